//! Message formats: how a delivery is read into warren's [`Metadata`] and a
//! JSON payload, whoever published it.
//!
//! The application lists the formats a consumer accepts, in the order they
//! are tried ([`Formats`], set with
//! [`ConsumerConfigBuilder::with_formats`](crate::config::ConsumerConfigBuilder::with_formats)).
//! A message only selects among them, by its content type, its headers and
//! (for warren's envelope) its fields; it can never pick a format, a handler
//! or a key rule the application did not register. Whatever the format, the
//! event type and schema version only select among the routes of the
//! [`Registry`](crate::Registry), and everything else holds as for warren's
//! envelope: the size limit, the id rules, the inbox.
//!
//! Shipped: [`WarrenEnvelope`] (the default), [`Bare`] payloads with AMQP
//! properties, [`CloudEvents`] 1.0 in structured and binary mode, and the
//! messages of the frameworks services migrate from: [`MassTransit`]'s
//! envelope, [`NServiceBus`]'s headers and [`SpringAmqp`]'s `__TypeId__`.
//! `docs/formats.md` maps each one's fields.
//!
//! ```
//! use warren::format::{Bare, CloudEvents, Formats, WarrenEnvelope};
//!
//! // CloudEvents first, then warren's envelope, then any other JSON body.
//! let formats = Formats::new()
//!     .then(CloudEvents::new())
//!     .then(WarrenEnvelope)
//!     .then(Bare::new());
//! assert_eq!(formats.names(), ["cloudevents", "warren", "bare"]);
//! ```

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::amqp::{MAX_SHORT_STRING_LEN, truncate};
use crate::failure::DeadLetterReason;

mod bare;
mod cloudevents;
mod masstransit;
mod nservicebus;
mod spring;
mod warren;

pub use bare::{Bare, TypeFrom, VersionFrom};
pub use cloudevents::{CONTENT_TYPE_STRUCTURED, CloudEvents};
pub use masstransit::{CONTENT_TYPE_MASSTRANSIT, MassTransit};
pub use nservicebus::NServiceBus;
pub use spring::SpringAmqp;
pub use warren::WarrenEnvelope;

/// The content type warren's envelope is sent with.
pub const CONTENT_TYPE_JSON: &str = "application/json";

/// Default upper bound on a message body: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;

/// Longest message id accepted. Ids are stored in the inbox's primary key, so an
/// unbounded id is an unbounded index entry.
pub const MAX_MESSAGE_ID_LEN: usize = 200;

/// What a message says about itself, apart from its payload, whatever its
/// format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    /// The id warren deduplicates by: the inbox key, the journal's and the
    /// dead-letter store's message id ([`Identity::key`]). For warren's
    /// envelope and any producer's own id, that id.
    pub message_id: String,
    /// Who the message is, as it arrived: the producer's id, a CloudEvent's
    /// `source` and `id`, or the key its route derived.
    pub identity: Identity,
    /// The format it was read in (`warren`, `bare`, `cloudevents`, ...).
    pub format: &'static str,
    /// Event type, e.g. `billing.invoice-paid.v1`.
    pub event_type: String,
    /// Schema version of the payload.
    pub schema_version: u32,
    /// When the business event happened, as the producer saw it; `None` if
    /// the message does not say (a bare payload without a timestamp).
    pub occurred_at: Option<DateTime<Utc>>,
    /// Id shared by every message of one business flow; the message's own
    /// id when its producer sent none.
    pub correlation_id: String,
    /// Id of the message that caused this one; `None` for the first message of a flow.
    pub causation_id: Option<String>,
}

/// Why a message was refused before reaching a handler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct InvalidMessage {
    /// The dead-letter reason this refusal is filed under.
    pub reason: DeadLetterReason,
    /// A human-readable explanation; never contains the payload.
    pub detail: String,
}

impl InvalidMessage {
    /// A refusal for `reason`, explained by `detail` (never the payload).
    pub fn new(reason: DeadLetterReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

/// The parts of an AMQP delivery a format reads.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// The AMQP `message_id` property.
    pub message_id: Option<&'a str>,
    /// The AMQP `content_type` property.
    pub content_type: Option<&'a str>,
    /// The AMQP `content_encoding` property.
    pub content_encoding: Option<&'a str>,
    /// The AMQP `type` property.
    pub kind: Option<&'a str>,
    /// The AMQP `correlation_id` property.
    pub correlation_id: Option<&'a str>,
    /// The AMQP `timestamp` property: whole seconds since the Unix epoch.
    pub timestamp: Option<u64>,
    /// The headers, as the frame guard let them through.
    pub headers: Option<&'a FieldTable>,
    /// The routing key the message was published with.
    pub routing_key: &'a str,
    /// The raw body.
    pub body: &'a [u8],
}

impl<'a> Incoming<'a> {
    /// A delivery's properties, routing key and body.
    pub fn new(properties: &'a BasicProperties, routing_key: &'a str, body: &'a [u8]) -> Self {
        Self {
            message_id: properties.message_id().as_ref().map(|s| s.as_str()),
            content_type: properties.content_type().as_ref().map(|s| s.as_str()),
            content_encoding: properties.content_encoding().as_ref().map(|s| s.as_str()),
            kind: properties.kind().as_ref().map(|s| s.as_str()),
            correlation_id: properties.correlation_id().as_ref().map(|s| s.as_str()),
            timestamp: *properties.timestamp(),
            headers: properties.headers().as_ref(),
            routing_key,
            body,
        }
    }

    /// A body with no properties at all.
    pub fn body_only(body: &'a [u8]) -> Self {
        Self {
            message_id: None,
            content_type: None,
            content_encoding: None,
            kind: None,
            correlation_id: None,
            timestamp: None,
            headers: None,
            routing_key: "",
            body,
        }
    }

    /// The header `name`'s value, if there is one.
    pub fn header(&self, name: &str) -> Option<&'a AMQPValue> {
        self.headers?.inner().get(name)
    }

    /// The header `name` as text, if it is an AMQP string.
    pub fn header_str(&self, name: &str) -> Option<Cow<'a, str>> {
        crate::amqp::header_str(self.headers?, name)
    }

    /// The AMQP `timestamp` property as a time, if it is set and in range.
    pub fn sent_at(&self) -> Option<DateTime<Utc>> {
        use chrono::TimeZone;
        let seconds = i64::try_from(self.timestamp?).ok()?;
        Utc.timestamp_opt(seconds, 0).single()
    }
}

/// Who a message is, as the inbox knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// The id its producer gave it (warren's `messageId`, the AMQP
    /// `message_id`, another framework's id).
    Given(String),
    /// A CloudEvent: unique by `source` and `id` together, as the
    /// CloudEvents specification defines it.
    CloudEvent {
        /// The event's `source` attribute.
        source: String,
        /// The event's `id` attribute.
        id: String,
    },
    /// No id was sent: the key its route derived from the payload.
    Derived(String),
}

/// What the inbox, the journal and the dead-letter store key a derived key
/// by: `~key:` and the key.
pub(crate) const DERIVED_PREFIX: &str = "~key:";
/// What they key a CloudEvent by: `~ce:` and the SHA-256 of its source and
/// id, each prefixed with its length.
const CLOUDEVENT_PREFIX: &str = "~ce:";

impl Identity {
    /// The message id warren deduplicates, journals and files the message
    /// under. Each kind has a namespace of its own, so no producer's id can
    /// meet a derived key or a CloudEvent's:
    /// - a given id as it is, unless it starts with `~`: then with one more
    ///   `~` in front (`~x` is kept as `~~x`);
    /// - a derived key as `~key:` and the key;
    /// - a CloudEvent as `~ce:` and the SHA-256, in hex, of its `source` and
    ///   `id`, each prefixed with its length in 8 bytes (so that no two
    ///   pairs meet, and any pair fits the 200-byte limit).
    ///
    /// ```
    /// use warren::format::Identity;
    /// assert_eq!(Identity::Given("m-1".into()).key(), "m-1");
    /// assert_eq!(Identity::Given("~key:inv_1".into()).key(), "~~key:inv_1");
    /// assert_eq!(Identity::Derived("inv_1:paid".into()).key(), "~key:inv_1:paid");
    /// let event = Identity::CloudEvent { source: "/shop".into(), id: "1".into() };
    /// assert!(event.key().starts_with("~ce:"));
    /// assert_eq!(event.key().len(), 4 + 64);
    /// ```
    pub fn key(&self) -> String {
        match self {
            Identity::Given(id) if id.starts_with('~') => format!("~{id}"),
            Identity::Given(id) => id.clone(),
            Identity::Derived(key) => format!("{DERIVED_PREFIX}{key}"),
            Identity::CloudEvent { source, id } => {
                let mut hash = Sha256::new();
                for part in [source, id] {
                    hash.update((part.len() as u64).to_be_bytes());
                    hash.update(part.as_bytes());
                }
                format!("{CLOUDEVENT_PREFIX}{}", hex::encode(hash.finalize()))
            }
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Given(id) => f.write_str(id),
            Identity::Derived(key) => write!(f, "derived key {key:?}"),
            Identity::CloudEvent { source, id } => write!(f, "CloudEvent {id:?} from {source:?}"),
        }
    }
}

/// What a format read from a delivery: everything warren needs before the
/// registry picks a handler.
#[derive(Debug)]
#[non_exhaustive]
pub struct Read {
    /// The format's name ([`Format::name`]).
    pub format: &'static str,
    /// Who the message is; `None` when the producer sent no id, and only a
    /// route that derives a key can then take it.
    pub identity: Option<Identity>,
    /// The event type the registry routes by.
    pub event_type: String,
    /// The schema version the registry routes by.
    pub schema_version: u32,
    /// When the business event happened, if the message says.
    pub occurred_at: Option<DateTime<Utc>>,
    /// The flow it belongs to, if the message says; else its own id.
    pub correlation_id: Option<String>,
    /// The message that caused it, if the message says.
    pub causation_id: Option<String>,
    /// The business payload, as JSON.
    pub payload: Box<RawValue>,
}

impl Read {
    /// A read with only what every message has: its format, event type,
    /// schema version and payload. The rest is set field by field.
    pub fn new(
        format: &'static str,
        event_type: String,
        schema_version: u32,
        payload: Box<RawValue>,
    ) -> Self {
        Self {
            format,
            identity: None,
            event_type,
            schema_version,
            occurred_at: None,
            correlation_id: None,
            causation_id: None,
            payload,
        }
    }

    /// The message's metadata, once its identity is known.
    pub(crate) fn meta(&self, identity: Identity) -> Metadata {
        let message_id = identity.key();
        Metadata {
            correlation_id: self
                .correlation_id
                .clone()
                .unwrap_or_else(|| message_id.clone()),
            message_id,
            identity,
            format: self.format,
            event_type: self.event_type.clone(),
            schema_version: self.schema_version,
            occurred_at: self.occurred_at,
            causation_id: self.causation_id.clone(),
        }
    }
}

/// Why a format did not read a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The delivery is not in this format: the next format is tried. If it
    /// is the consumer's only format, this is the reason it is dead-lettered.
    NotMine(InvalidMessage),
    /// The delivery is in this format and breaks its rules: dead-lettered
    /// with this reason, no other format tried.
    Invalid(InvalidMessage),
}

/// A way to read deliveries. Implement it for a format warren does not ship;
/// list it with the others in [`Formats`].
///
/// `read` is pure (no I/O) and must not panic on any input: every value in
/// `incoming` came from a producer.
pub trait Format: Send + Sync + fmt::Debug + 'static {
    /// A short name (`warren`, `bare`, `cloudevents`): logged, journaled and
    /// shown with every dead letter of this format.
    fn name(&self) -> &'static str;

    /// Reads `incoming`, or says why not. The body is within the consumer's
    /// size limit and has no content encoding, already checked.
    fn read(&self, incoming: &Incoming<'_>) -> Result<Read, Refusal>;
}

/// The formats a consumer accepts, in the order they are tried: the first
/// that says a delivery is its own reads it. The default is warren's
/// envelope alone.
#[derive(Clone)]
pub struct Formats {
    formats: Arc<[Arc<dyn Format>]>,
}

impl Formats {
    /// No format yet: add them with [`then`](Self::then). (A consumer needs
    /// at least one; its configuration is refused otherwise.)
    pub fn new() -> Self {
        Self {
            formats: Arc::from(Vec::new()),
        }
    }

    /// These formats, then `format`.
    ///
    /// # Panics
    ///
    /// If a format of the same name is already listed: the second would
    /// never read anything.
    pub fn then(self, format: impl Format) -> Self {
        assert!(
            !self.names().contains(&format.name()),
            "the format {:?} is listed twice",
            format.name()
        );
        let mut formats: Vec<_> = self.formats.iter().cloned().collect();
        formats.push(Arc::new(format));
        Self {
            formats: formats.into(),
        }
    }

    /// The formats' names, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.formats.iter().map(|f| f.name()).collect()
    }

    /// True if no format is listed.
    pub fn is_empty(&self) -> bool {
        self.formats.is_empty()
    }

    /// Reads a delivery: the size limit and the content encoding first, then
    /// each format in order. When none takes it, a consumer of one format
    /// refuses it with that format's reason; one of several with
    /// `unrecognized-format` and what each said.
    pub fn read(
        &self,
        incoming: &Incoming<'_>,
        max_body_bytes: usize,
    ) -> Result<Read, InvalidMessage> {
        use DeadLetterReason as R;
        if incoming.body.len() > max_body_bytes {
            return Err(InvalidMessage::new(
                R::BodyTooLarge,
                format!(
                    "body is {} bytes, the limit is {max_body_bytes}",
                    incoming.body.len()
                ),
            ));
        }
        // Spring AMQP's converter puts the charset, `UTF-8`, in the content
        // encoding: not an encoding of the bytes, and what JSON is anyway.
        if let Some(encoding) = incoming.content_encoding
            && !["", "identity", "utf-8", "utf8"]
                .iter()
                .any(|e| encoding.eq_ignore_ascii_case(e))
        {
            return Err(InvalidMessage::new(
                R::UnsupportedContentEncoding,
                format!(
                    "content encoding is {:?}; warren reads only unencoded JSON",
                    truncate(encoding, 64)
                ),
            ));
        }
        let mut declined = Vec::new();
        for format in self.formats.iter() {
            match format.read(incoming) {
                Ok(read) => return Ok(read),
                Err(Refusal::Invalid(why)) => return Err(why),
                Err(Refusal::NotMine(why)) => declined.push((format.name(), why)),
            }
        }
        if declined.len() == 1 {
            return Err(declined.remove(0).1);
        }
        let detail = declined
            .iter()
            .map(|(name, why)| format!("not {name}: {why}"))
            .collect::<Vec<_>>()
            .join("; ");
        Err(InvalidMessage::new(R::UnrecognizedFormat, detail))
    }
}

impl Default for Formats {
    /// Warren's envelope alone.
    fn default() -> Self {
        Self::new().then(WarrenEnvelope)
    }
}

impl fmt::Debug for Formats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

/// Another framework's message type names, each mapped to an event type
/// and a schema version: such a framework sends no version, and a name no
/// mapping lists is refused.
#[derive(Debug, Clone, Default)]
pub(crate) struct TypeMap {
    types: Vec<(String, String, u32)>,
}

impl TypeMap {
    /// This map, and `name` read as `event_type` in `version`.
    ///
    /// # Panics
    ///
    /// If `name` is mapped already: a message of it could not be told
    /// apart.
    pub(crate) fn with(mut self, name: String, event_type: &str, version: u32) -> Self {
        assert!(
            self.get(&name).is_none(),
            "the message type {name:?} is mapped twice"
        );
        self.types.push((name, event_type.to_owned(), version));
        self
    }

    /// What `name` is mapped to.
    pub(crate) fn get(&self, name: &str) -> Option<(&str, u32)> {
        self.types
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, t, v)| (t.as_str(), *v))
    }

    /// What the first of `names` that is mapped is mapped to.
    pub(crate) fn first_of<'n>(
        &self,
        mut names: impl Iterator<Item = &'n str>,
    ) -> Option<(&str, u32)> {
        names.find_map(|n| self.get(n))
    }
}

/// Names a producer sent, for a refusal: the first few, each cut short.
pub(crate) fn shown_list<S: AsRef<str>>(names: &[S]) -> String {
    let mut shown: Vec<String> = names
        .iter()
        .take(3)
        .map(|n| format!("{:?}", truncate(n.as_ref(), 100)))
        .collect();
    if names.len() > 3 {
        shown.push(format!("and {} more", names.len() - 3));
    }
    format!("[{}]", shown.join(", "))
}

/// Checks a producer's id or a derived key: 1 to 200 bytes, no control
/// character (a NUL, for one, no PostgreSQL text column takes). `what` names
/// it in the refusal.
pub(crate) fn check_id(
    what: &str,
    id: &str,
    reason: DeadLetterReason,
) -> Result<(), InvalidMessage> {
    if id.is_empty() || id.len() > MAX_MESSAGE_ID_LEN {
        return Err(InvalidMessage::new(
            reason,
            format!(
                "{what} must be 1 to {MAX_MESSAGE_ID_LEN} bytes, is {}",
                id.len()
            ),
        ));
    }
    if id.chars().any(char::is_control) {
        return Err(InvalidMessage::new(
            reason,
            format!("{what} contains a control character"),
        ));
    }
    Ok(())
}

/// Refuses a message whose own id (`field` of the format: warren's
/// `messageId`, MassTransit's, `NServiceBus.MessageId`) differs from the
/// AMQP `message_id` it also carries, if it carries one: two ids for one
/// message, and no telling which a producer's retry would repeat.
pub(crate) fn check_same_id(
    field: &str,
    id: &str,
    property: Option<&str>,
) -> Result<(), InvalidMessage> {
    match property.filter(|p| !p.is_empty()) {
        Some(property) if property != id => Err(InvalidMessage::new(
            DeadLetterReason::MessageIdMismatch,
            format!("{field} {id:?} differs from the message_id property {property:?}"),
        )),
        _ => Ok(()),
    }
}

/// Checks a text that travels on in an AMQP short string (an event type, a
/// correlation or causation id): at most 255 bytes, no control character.
pub(crate) fn check_short(
    what: &str,
    value: &str,
    reason: DeadLetterReason,
) -> Result<(), InvalidMessage> {
    if value.len() > MAX_SHORT_STRING_LEN {
        return Err(InvalidMessage::new(
            reason,
            format!(
                "{what} is {} bytes, the limit is {MAX_SHORT_STRING_LEN}",
                value.len()
            ),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(InvalidMessage::new(
            reason,
            format!("{what} contains a control character"),
        ));
    }
    Ok(())
}

/// The schema version an event type's `.vN` suffix names, if it has one.
///
/// ```
/// use warren::format::version_suffix;
/// assert_eq!(version_suffix("billing.invoice-paid.v2"), Some(2));
/// assert_eq!(version_suffix("billing.invoice-paid"), None);
/// assert_eq!(version_suffix("billing.v"), None);
/// ```
pub fn version_suffix(event_type: &str) -> Option<u32> {
    let (_, last) = event_type.rsplit_once('.')?;
    let digits = last.strip_prefix('v')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Whether a content type (its essence, parameters aside) is JSON:
/// `application/json` or any `+json` type; and any charset it names UTF-8.
/// `Err` says what is wrong with it.
pub(crate) fn json_content_type(content_type: &str) -> Result<(), String> {
    let shown = truncate(content_type, 100);
    let mut parts = content_type.split(';');
    let essence = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
    let json = essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"));
    if !json {
        return Err(format!("content type {shown:?} is not JSON"));
    }
    charset_utf8(parts, shown)
}

/// Any charset among a content type's parameters must be UTF-8: JSON in
/// another charset would be misread and its text silently changed.
pub(crate) fn charset_utf8<'a>(
    params: impl Iterator<Item = &'a str>,
    shown: &str,
) -> Result<(), String> {
    for param in params {
        let Some((name, value)) = param.split_once('=') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("charset") {
            let charset = value.trim().trim_matches('"');
            if !(charset.eq_ignore_ascii_case("utf-8") || charset.eq_ignore_ascii_case("utf8")) {
                return Err(format!(
                    "content type {shown:?} names a charset other than UTF-8"
                ));
            }
        }
    }
    Ok(())
}

/// The essence of a content type (`application/cloudevents+json` of
/// `application/cloudevents+json; charset=utf-8`), lowercased.
pub(crate) fn essence(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// The body as JSON, or why not.
pub(crate) fn json_body(body: &[u8]) -> Result<Box<RawValue>, serde_json::Error> {
    serde_json::from_slice(body)
}

#[cfg(test)]
mod tests;
