//! What leaves: an envelope built for publishing, with its AMQP properties.

use chrono::{DateTime, SecondsFormat, Utc};
use lapin::BasicProperties;
use lapin::types::ShortString;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::amqp::{MAX_SHORT_STRING_LEN, PERSISTENT};
use crate::envelope::{CONTENT_TYPE_JSON, MAX_MESSAGE_ID_LEN, Metadata};
use crate::failure::DeadLetterReason as R;
use crate::format::{CONTENT_TYPE_STRUCTURED, Identity};
use crate::headers::{
    HEADER_BAGGAGE, HEADER_SCHEMA_VERSION, HEADER_TRACEPARENT, HEADER_TRACESTATE,
};
use crate::trace_context::TraceContext;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct WireOut<'a> {
    message_id: &'a str,
    event_type: &'a str,
    schema_version: u32,
    occurred_at_utc: String,
    correlation_id: &'a str,
    causation_id: Option<&'a str>,
    payload: &'a RawValue,
}

/// A structured CloudEvent as it is sent: the attributes and the data.
#[derive(Serialize)]
struct CloudEventOut<'a> {
    specversion: &'static str,
    id: &'a str,
    source: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    time: String,
    datacontenttype: &'static str,
    correlationid: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    causationid: Option<&'a str>,
    schemaversion: u32,
    data: &'a RawValue,
}

/// The attributes a binary-mode CloudEvent's `ce-` headers carry from the
/// message: a header of the same name set by hand would contradict them.
const CLOUDEVENT_ATTRIBUTES: [&str; 9] = [
    "specversion",
    "id",
    "source",
    "type",
    "time",
    "datacontenttype",
    "correlationid",
    "causationid",
    "schemaversion",
];

/// How a message goes on the wire: what its body holds and which
/// properties and headers carry the rest. Chosen per message, so per target:
/// a downstream service reads warren's events with its own library. Every
/// format carries the AMQP `message_id` (the message id), `type` (the event
/// type), `correlation_id`, `timestamp` (occurred-at, whole seconds) and
/// persistent delivery; what differs:
///
/// | format | body | content type | the rest |
/// |---|---|---|---|
/// | [`Warren`](Self::Warren) | warren's JSON envelope | `application/json` | in the envelope |
/// | [`Bare`](Self::Bare) | the payload | `application/json` | header `schema-version` |
/// | [`CloudEventsBinary`](Self::CloudEventsBinary) | the payload (`data`) | `application/json` (`datacontenttype`) | `ce-` string headers |
/// | [`CloudEventsStructured`](Self::CloudEventsStructured) | the event: attributes and `data` | `application/cloudevents+json` | in the body |
///
/// A CloudEvent's `id` is the message id, `type` the event type, `time`
/// occurred-at (RFC 3339, milliseconds), and its extension attributes
/// `correlationid`, `causationid` (if any) and `schemaversion` carry the
/// rest: warren's [`CloudEvents`](crate::format::CloudEvents) reader takes
/// the first two as they are and the version with
/// `version_from(VersionFrom::Header("schemaversion".into()))`, or from the
/// type's `.vN` suffix by default.
///
/// ```
/// use warren::{Outgoing, OutgoingFormat};
/// let event = Outgoing::new("billing.invoice-paid.v1", 1, &serde_json::json!({"invoiceId": "inv_1"}))?
///     .with_format(OutgoingFormat::cloud_events_binary("urn:acme:billing"));
/// let props = event.properties();
/// let headers = props.headers().as_ref().unwrap();
/// assert!(headers.contains_key("ce-source"));
/// assert_eq!(event.body(), br#"{"invoiceId":"inv_1"}"#);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutgoingFormat {
    /// warren's JSON envelope (the default).
    #[default]
    Warren,
    /// The payload alone, as most producers that are not a framework send:
    /// the schema version in the `schema-version` header.
    Bare,
    /// CloudEvents 1.0 in binary mode over AMQP 0-9-1: the payload as the
    /// body, the attributes as `ce-` string headers (Knative's RabbitMQ
    /// binding, as the CloudEvents SDKs read it).
    CloudEventsBinary {
        /// The event's `source` attribute: who sends it, e.g. `urn:acme:billing`.
        source: String,
    },
    /// CloudEvents 1.0 in structured mode: the event's JSON form as the body.
    CloudEventsStructured {
        /// The event's `source` attribute.
        source: String,
    },
}

impl OutgoingFormat {
    /// CloudEvents binary mode, sent from `source`.
    pub fn cloud_events_binary(source: impl Into<String>) -> Self {
        Self::CloudEventsBinary {
            source: source.into(),
        }
    }

    /// CloudEvents structured mode, sent from `source`.
    pub fn cloud_events_structured(source: impl Into<String>) -> Self {
        Self::CloudEventsStructured {
            source: source.into(),
        }
    }

    /// How an outbox row stores the choice.
    pub(crate) fn wire(&self) -> WireFormat {
        match self {
            Self::Warren => WireFormat::Warren,
            Self::Bare => WireFormat::Bare,
            Self::CloudEventsBinary { .. } => WireFormat::CloudEventsBinary,
            Self::CloudEventsStructured { .. } => WireFormat::CloudEventsStructured,
        }
    }
}

/// The format an outbox row was rendered in, as its stored properties name
/// it: what the relay needs to publish the row (its content type) and the
/// kit to read it back. A row written before formats existed has none and is
/// warren's envelope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WireFormat {
    /// warren's envelope.
    #[default]
    Warren,
    /// A bare payload.
    Bare,
    /// A binary-mode CloudEvent.
    #[serde(rename = "cloudevents-binary")]
    CloudEventsBinary,
    /// A structured-mode CloudEvent.
    #[serde(rename = "cloudevents-structured")]
    CloudEventsStructured,
}

impl WireFormat {
    /// The AMQP content type it is sent with.
    pub fn content_type(self) -> &'static str {
        match self {
            WireFormat::CloudEventsStructured => CONTENT_TYPE_STRUCTURED,
            _ => CONTENT_TYPE_JSON,
        }
    }

    /// Whether this is warren's envelope (the stored default, left out).
    pub(crate) fn is_warren(&self) -> bool {
        *self == WireFormat::Warren
    }
}

/// A message ready to publish: envelope body plus the AMQP properties that go with it.
///
/// The message id is a UUIDv7 fixed at construction, so every publish attempt of
/// this value carries the same id and downstream inboxes can deduplicate it.
///
/// ```
/// use warren::Outgoing;
/// #[derive(serde::Serialize)]
/// struct InvoicePaid { invoice_id: String }
///
/// let msg = Outgoing::new("billing.invoice-paid.v1", 1, &InvoicePaid { invoice_id: "inv_1".into() })?;
/// let props = msg.properties();
/// assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some(msg.meta().message_id.as_str()));
/// assert_eq!(msg.meta().correlation_id, msg.meta().message_id); // a new flow starts here
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Outgoing {
    meta: Metadata,
    payload: Box<RawValue>,
    /// Headers sent as AMQP long strings (the partition key among them).
    headers: std::collections::BTreeMap<String, String>,
    /// The W3C trace context it continues, checked; sent as the
    /// `traceparent`, `tracestate` and `baggage` headers.
    trace: TraceContext,
    /// The correlation id was given (or carried from a cause), not the
    /// message's own id by default.
    correlation_given: bool,
    /// How it goes on the wire.
    format: OutgoingFormat,
}

impl Outgoing {
    /// A new message that starts a flow: fresh UUIDv7 id, occurred now, correlation
    /// id equal to its own id, no causation id.
    pub fn new<T: Serialize + ?Sized>(
        event_type: impl Into<String>,
        schema_version: u32,
        payload: &T,
    ) -> Result<Self, serde_json::Error> {
        let id = uuid::Uuid::now_v7().to_string();
        Ok(Self {
            meta: Metadata {
                message_id: id.clone(),
                identity: Identity::Given(id.clone()),
                format: "warren",
                event_type: event_type.into(),
                schema_version,
                occurred_at: Some(Utc::now()),
                correlation_id: id,
                causation_id: None,
            },
            payload: serde_json::value::to_raw_value(payload)?,
            headers: std::collections::BTreeMap::new(),
            trace: TraceContext::default(),
            correlation_given: false,
            format: OutgoingFormat::Warren,
        })
    }

    /// Marks this message as caused by `cause`: the correlation id is carried over
    /// and the causation id is the cause's message id.
    pub fn caused_by(mut self, cause: &Metadata) -> Self {
        self.meta.correlation_id = cause.correlation_id.clone();
        self.correlation_given = true;
        self.meta.causation_id = Some(cause.message_id.clone());
        self
    }

    /// Sets the correlation id explicitly.
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.meta.correlation_id = id.into();
        self.correlation_given = true;
        self
    }

    /// Overrides the message id. Use only to carry an id that already exists (for
    /// example one stored in an outbox row, or one derived from a business
    /// fact); new messages get a UUIDv7. A message that starts a flow is its
    /// own correlation id, so the correlation id follows, unless one was set
    /// with [`with_correlation_id`](Self::with_correlation_id) or
    /// [`caused_by`](Self::caused_by), before or after.
    ///
    /// ```
    /// # use warren::Outgoing;
    /// let msg = Outgoing::new("billing.invoice-paid.v1", 1, &serde_json::json!({}))?
    ///     .with_message_id("inv_1:paid");
    /// assert_eq!(msg.meta().correlation_id, "inv_1:paid");
    /// let msg = Outgoing::new("billing.invoice-paid.v1", 1, &serde_json::json!({}))?
    ///     .with_correlation_id("order-7")
    ///     .with_message_id("inv_1:paid");
    /// assert_eq!(msg.meta().correlation_id, "order-7");
    /// # Ok::<(), serde_json::Error>(())
    /// ```
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.meta.message_id = id.into();
        self.meta.identity = Identity::Given(self.meta.message_id.clone());
        if !self.correlation_given {
            self.meta.correlation_id = self.meta.message_id.clone();
        }
        self
    }

    /// Sets the partition key: the `partition-key` header, as an AMQP long
    /// string (the type a consistent-hash exchange must see to put one entity's
    /// messages in one partition). For a consumer partitioned on another header,
    /// use [`with_header`](Self::with_header).
    pub fn with_partition_key(self, key: impl Into<String>) -> Self {
        self.with_header(crate::headers::HEADER_PARTITION_KEY, key)
    }

    /// Sets a header, sent as an AMQP long string. The trace headers
    /// (`traceparent`, `tracestate`, `baggage`) go through
    /// [`TraceContext`]'s checks instead, as if set by
    /// [`with_trace_context`](Self::with_trace_context).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let (name, value) = (name.into(), value.into());
        let t = &self.trace;
        let (mut parent, mut state, mut baggage) = (t.traceparent(), t.tracestate(), t.baggage());
        match name.as_str() {
            HEADER_TRACEPARENT => parent = Some(&value),
            HEADER_TRACESTATE => state = Some(&value),
            HEADER_BAGGAGE => baggage = Some(&value),
            _ => {
                self.headers.insert(name, value);
                return self;
            }
        }
        self.trace = TraceContext::from_parts(parent, state, baggage);
        self
    }

    /// Sets the trace context this message continues. Inside a handler,
    /// [`Tx::publish`](crate::Tx::publish) sets the handler's own unless one is
    /// set here.
    pub fn with_trace_context(mut self, trace: TraceContext) -> Self {
        self.trace = trace;
        self
    }

    /// The trace context this message continues (empty if none).
    pub fn trace_context(&self) -> &TraceContext {
        &self.trace
    }

    /// The headers set with [`with_header`](Self::with_header).
    pub fn headers(&self) -> &std::collections::BTreeMap<String, String> {
        &self.headers
    }

    /// Sets the format it is published in (warren's envelope by default):
    /// the outbox renders it so at enqueue, and the row publishes so on every
    /// attempt, with the same id.
    pub fn with_format(mut self, format: OutgoingFormat) -> Self {
        self.format = format;
        self
    }

    /// The format it is published in.
    pub fn format(&self) -> &OutgoingFormat {
        &self.format
    }

    /// The headers it is sent with: those set with
    /// [`with_header`](Self::with_header), and its format's (a CloudEvent's
    /// `ce-` attributes, a bare payload's `schema-version`).
    pub fn wire_headers(&self) -> std::collections::BTreeMap<String, String> {
        let mut headers = self.headers.clone();
        let m = &self.meta;
        match &self.format {
            OutgoingFormat::Warren | OutgoingFormat::CloudEventsStructured { .. } => {}
            OutgoingFormat::Bare => {
                headers.insert(HEADER_SCHEMA_VERSION.into(), m.schema_version.to_string());
            }
            OutgoingFormat::CloudEventsBinary { source } => {
                let mut attribute = |name: &str, value: String| {
                    headers.insert(format!("ce-{name}"), value);
                };
                attribute("specversion", "1.0".into());
                attribute("id", m.message_id.clone());
                attribute("source", source.clone());
                attribute("type", m.event_type.clone());
                attribute("time", self.time());
                attribute("correlationid", m.correlation_id.clone());
                if let Some(causation) = &m.causation_id {
                    attribute("causationid", causation.clone());
                }
                attribute("schemaversion", m.schema_version.to_string());
            }
        }
        headers
    }

    /// Occurred-at as the envelope and a CloudEvent's `time` carry it.
    fn time(&self) -> String {
        self.occurred_at()
            .to_rfc3339_opts(SecondsFormat::Millis, true)
    }

    /// Sets when the business event happened.
    pub fn with_occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.meta.occurred_at = Some(at);
        self
    }

    /// When the business event happened: always set on a message built here.
    pub(crate) fn occurred_at(&self) -> DateTime<Utc> {
        self.meta.occurred_at.unwrap_or_default()
    }

    /// The envelope fields.
    pub fn meta(&self) -> &Metadata {
        &self.meta
    }

    /// The body in its format: warren's envelope with the payload, the
    /// payload alone, or a structured CloudEvent.
    pub fn body(&self) -> Vec<u8> {
        let m = &self.meta;
        let written = match &self.format {
            OutgoingFormat::Warren => serde_json::to_vec(&WireOut {
                message_id: &m.message_id,
                event_type: &m.event_type,
                schema_version: m.schema_version,
                occurred_at_utc: self.time(),
                correlation_id: &m.correlation_id,
                causation_id: m.causation_id.as_deref(),
                payload: &self.payload,
            }),
            OutgoingFormat::Bare | OutgoingFormat::CloudEventsBinary { .. } => {
                return self.payload.get().as_bytes().to_vec();
            }
            OutgoingFormat::CloudEventsStructured { source } => {
                serde_json::to_vec(&CloudEventOut {
                    specversion: "1.0",
                    id: &m.message_id,
                    source,
                    kind: &m.event_type,
                    time: self.time(),
                    datacontenttype: CONTENT_TYPE_JSON,
                    correlationid: &m.correlation_id,
                    causationid: m.causation_id.as_deref(),
                    schemaversion: m.schema_version,
                    data: &self.payload,
                })
            }
        };
        written.expect("strings, numbers and raw JSON always serialize")
    }

    /// Checks that every envelope field fits where it travels: ids and event type
    /// non-empty, at most [`MAX_SHORT_STRING_LEN`] bytes (the AMQP limit of the
    /// properties they are copied into; the message id at most
    /// [`MAX_MESSAGE_ID_LEN`], what inboxes accept) and free of control
    /// characters. [`Publisher::publish`](crate::broker::Publisher::publish) and the
    /// outbox refuse a message that fails this.
    pub fn validate(&self) -> Result<(), InvalidOutgoing> {
        self.check().map_err(InvalidOutgoing)
    }

    fn check(&self) -> Result<(), String> {
        let m = &self.meta;
        let id_len = m.message_id.len();
        if id_len == 0 || id_len > MAX_MESSAGE_ID_LEN {
            return Err(format!(
                "message id is {id_len} bytes; it must be 1 to {MAX_MESSAGE_ID_LEN}"
            ));
        }
        if m.event_type.is_empty() {
            return Err("event type is empty".into());
        }
        for name in self.headers.keys() {
            if name.is_empty() || name.len() > MAX_SHORT_STRING_LEN {
                return Err(format!(
                    "header name {name:?} must be 1 to {MAX_SHORT_STRING_LEN} bytes"
                ));
            }
        }
        match &self.format {
            OutgoingFormat::Warren => {}
            OutgoingFormat::Bare => {
                if self.headers.contains_key(HEADER_SCHEMA_VERSION) {
                    return Err(format!(
                        "header {HEADER_SCHEMA_VERSION:?} is the bare format's own; the schema version sets it"
                    ));
                }
            }
            OutgoingFormat::CloudEventsBinary { source }
            | OutgoingFormat::CloudEventsStructured { source } => {
                crate::format::check_id("CloudEvent source", source, R::InvalidCloudEvent)
                    .map_err(|e| e.detail)?;
                let binary = matches!(self.format, OutgoingFormat::CloudEventsBinary { .. });
                if let Some(name) = self.headers.keys().find(|name| {
                    binary
                        && name.strip_prefix("ce-").is_some_and(|a| {
                            CLOUDEVENT_ATTRIBUTES.contains(&a.to_ascii_lowercase().as_str())
                        })
                }) {
                    return Err(format!(
                        "header {name:?} is a CloudEvents attribute the format sets"
                    ));
                }
            }
        }
        for (field, value) in [
            ("message id", m.message_id.as_str()),
            ("event type", m.event_type.as_str()),
            ("correlation id", m.correlation_id.as_str()),
            (
                "causation id",
                m.causation_id.as_deref().unwrap_or_default(),
            ),
        ] {
            if value.len() > MAX_SHORT_STRING_LEN {
                return Err(format!(
                    "{field} is {} bytes, the limit is {MAX_SHORT_STRING_LEN}",
                    value.len()
                ));
            }
            if value.chars().any(char::is_control) {
                return Err(format!("{field} contains a control character"));
            }
        }
        Ok(())
    }

    /// AMQP properties: message id, type, JSON content type, correlation id,
    /// timestamp, persistent delivery. A field over the AMQP limit is left out
    /// rather than panicking; [`validate`](Self::validate) reports it, and
    /// warren's publishers refuse such a message before it gets here.
    pub fn properties(&self) -> BasicProperties {
        let mut props = BasicProperties::default()
            .with_content_type(self.format.wire().content_type().into())
            .with_timestamp(self.occurred_at().timestamp().max(0) as u64)
            .with_delivery_mode(PERSISTENT);
        if let Ok(id) = ShortString::try_new(self.meta.message_id.as_str()) {
            props = props.with_message_id(id);
        }
        if let Ok(kind) = ShortString::try_new(self.meta.event_type.as_str()) {
            props = props.with_type(kind);
        }
        if let Ok(correlation) = ShortString::try_new(self.meta.correlation_id.as_str()) {
            props = props.with_correlation_id(correlation);
        }
        let wire_headers = self.wire_headers();
        if !wire_headers.is_empty() {
            let mut headers = lapin::types::FieldTable::default();
            for (name, value) in &wire_headers {
                if let Ok(name) = ShortString::try_new(name.as_str()) {
                    headers.insert(
                        name,
                        lapin::types::AMQPValue::LongString(value.as_str().into()),
                    );
                }
            }
            props = props.with_headers(headers);
        }
        if !self.trace.is_empty() {
            let mut headers = props.headers().clone().unwrap_or_default();
            self.trace.write_headers(&mut headers);
            props = props.with_headers(headers);
        }
        props
    }
}

/// Why a message cannot be published as it is: which field, and what is wrong
/// with it (too long for its AMQP property, a control character, empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidOutgoing(pub(crate) String);

impl std::fmt::Display for InvalidOutgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidOutgoing {}

#[cfg(test)]
mod tests {
    use super::*;

    fn new() -> Outgoing {
        Outgoing::new("t.v1", 1, &serde_json::json!({})).unwrap()
    }

    #[test]
    fn a_given_message_id_is_the_correlation_id_unless_one_was_set_in_either_order() {
        let m = new().with_message_id("m1");
        assert_eq!(
            (
                m.meta().message_id.as_str(),
                m.meta().correlation_id.as_str()
            ),
            ("m1", "m1")
        );
        let m = new().with_correlation_id("c1").with_message_id("m1");
        assert_eq!(m.meta().correlation_id, "c1");
        let m = new().with_message_id("m1").with_correlation_id("c1");
        assert_eq!(m.meta().correlation_id, "c1");
        let cause = new().with_correlation_id("flow").meta().clone();
        let m = new().caused_by(&cause).with_message_id("m1");
        assert_eq!(m.meta().correlation_id, "flow");
        let m = new().with_message_id("m1").caused_by(&cause);
        assert_eq!(m.meta().correlation_id, "flow");
        assert_eq!(
            m.properties().correlation_id().as_ref().map(|s| s.as_str()),
            Some("flow")
        );
        let m = new().with_message_id("m1").with_message_id("m2");
        assert_eq!(m.meta().correlation_id, "m2");
    }

    /// What each format sends, warren's readers take back: the same message
    /// id (a CloudEvent's with its source), event type, version,
    /// occurred-at, correlation and causation ids and payload.
    #[test]
    fn every_format_reads_back_as_it_was_written() {
        use crate::format::{Bare, CloudEvents, Formats, Incoming, VersionFrom, WarrenEnvelope};
        let formats = Formats::new()
            .then(CloudEvents::new().version_from(VersionFrom::Header("schemaversion".into())))
            .then(WarrenEnvelope)
            .then(Bare::new().version_from(VersionFrom::Header(HEADER_SCHEMA_VERSION.into())));
        let cause = new().with_correlation_id("flow-1");
        for (format, read_as) in [
            (OutgoingFormat::Warren, "warren"),
            (OutgoingFormat::Bare, "bare"),
            (OutgoingFormat::cloud_events_binary("urn:t"), "cloudevents"),
            (
                OutgoingFormat::cloud_events_structured("urn:t"),
                "cloudevents",
            ),
        ] {
            let m = Outgoing::new(
                "shop.order-placed",
                3,
                &serde_json::json!({"sku": "é\u{1}"}),
            )
            .unwrap()
            .caused_by(cause.meta())
            .with_format(format.clone());
            m.validate().unwrap();
            let (props, body) = (m.properties(), m.body());
            let read = formats
                .read(&Incoming::new(&props, "rk", &body), 1 << 20)
                .unwrap_or_else(|e| panic!("{format:?}: {e}"));
            let identity = read.identity.clone().expect("an id");
            let meta = read.meta(identity.clone());
            let want = match &format {
                OutgoingFormat::CloudEventsBinary { source }
                | OutgoingFormat::CloudEventsStructured { source } => Identity::CloudEvent {
                    source: source.clone(),
                    id: m.meta().message_id.clone(),
                },
                _ => Identity::Given(m.meta().message_id.clone()),
            };
            assert_eq!(identity, want, "{format:?}");
            assert_eq!(meta.format, read_as);
            assert_eq!(
                (meta.event_type.as_str(), meta.schema_version),
                ("shop.order-placed", 3)
            );
            assert_eq!(meta.correlation_id, "flow-1");
            // A bare payload has nowhere to carry one.
            let causation = (read_as != "bare").then(|| cause.meta().message_id.clone());
            assert_eq!(meta.causation_id, causation, "{format:?}");
            assert_eq!(
                meta.occurred_at.map(|t| t.timestamp()),
                m.meta().occurred_at.map(|t| t.timestamp())
            );
            assert_eq!(read.payload.get(), r#"{"sku":"é\u0001"}"#, "{format:?}");
        }
    }

    #[test]
    fn a_format_refuses_what_would_contradict_it() {
        let m = new().with_header("ce-id", "x");
        assert!(
            m.validate().is_ok(),
            "warren's envelope sends ce- headers as any other"
        );
        let refused = m
            .with_format(OutgoingFormat::cloud_events_binary("urn:t"))
            .validate()
            .unwrap_err();
        assert!(refused.0.contains("ce-id"), "{refused}");
        let extension = new()
            .with_header("ce-tenant", "t-1")
            .with_format(OutgoingFormat::cloud_events_binary("urn:t"));
        assert_eq!(extension.wire_headers()["ce-tenant"], "t-1");
        assert!(extension.validate().is_ok());
        let refused = new()
            .with_format(OutgoingFormat::cloud_events_structured(""))
            .validate()
            .unwrap_err();
        assert!(refused.0.contains("source"), "{refused}");
        let refused = new()
            .with_header(HEADER_SCHEMA_VERSION, "9")
            .with_format(OutgoingFormat::Bare)
            .validate()
            .unwrap_err();
        assert!(refused.0.contains(HEADER_SCHEMA_VERSION), "{refused}");
    }
}
