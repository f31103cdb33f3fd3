//! Bare payloads: the body is the business JSON, the rest is in AMQP
//! properties and headers, as most producers that are not a framework send.

use chrono::{DateTime, TimeZone, Utc};
use lapin::types::AMQPValue;

use super::InvalidMessage;
use super::{
    Format, Identity, Incoming, Read, Refusal, check_id, check_short, json_body, json_content_type,
    version_suffix,
};
use crate::failure::DeadLetterReason as R;

/// Where a bare payload's event type comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TypeFrom {
    /// The AMQP `type` property (the default).
    Property,
    /// A header, an AMQP string.
    Header(String),
    /// The routing key it was published with.
    RoutingKey,
    /// Always this type: for a queue that carries one kind of message.
    Fixed(String),
}

/// Where a schema version comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VersionFrom {
    /// The event type's `.vN` suffix (the default): `billing.invoice-paid.v2`
    /// is version 2.
    TypeSuffix,
    /// A header (for a CloudEvent, an extension attribute): an integer, or
    /// text of digits.
    Header(String),
    /// Always this version.
    Fixed(u32),
}

/// A bare payload: the body is the business JSON (content type
/// `application/json`, a `+json` type, or none); the id is the AMQP
/// `message_id` (absent: only a route that derives a key takes it); the
/// event type and version come from where [`TypeFrom`] and [`VersionFrom`]
/// say; occurred-at from the AMQP `timestamp` or a header; the correlation id
/// from the AMQP `correlation_id`.
///
/// Listed after the formats that recognize themselves (CloudEvents,
/// warren's envelope): it takes any JSON body.
///
/// ```
/// use warren::format::{Bare, TypeFrom, VersionFrom};
/// let orders = Bare::new()
///     .event_type_from(TypeFrom::Fixed("shop.order-placed".into()))
///     .version_from(VersionFrom::Fixed(1))
///     .occurred_at_header("occurred-at");
/// # let _ = orders;
/// ```
#[derive(Debug, Clone)]
pub struct Bare {
    event_type: TypeFrom,
    version: VersionFrom,
    occurred_at_header: Option<String>,
}

impl Bare {
    /// Event type from the AMQP `type` property, version from its `.vN`
    /// suffix, occurred-at from the AMQP `timestamp`.
    pub fn new() -> Self {
        Self {
            event_type: TypeFrom::Property,
            version: VersionFrom::TypeSuffix,
            occurred_at_header: None,
        }
    }

    /// Where the event type comes from.
    pub fn event_type_from(mut self, from: TypeFrom) -> Self {
        self.event_type = from;
        self
    }

    /// Where the schema version comes from.
    pub fn version_from(mut self, from: VersionFrom) -> Self {
        self.version = from;
        self
    }

    /// Reads occurred-at from this header (RFC 3339 text or an AMQP
    /// timestamp), before the AMQP `timestamp` property.
    pub fn occurred_at_header(mut self, header: impl Into<String>) -> Self {
        self.occurred_at_header = Some(header.into());
        self
    }
}

impl Default for Bare {
    fn default() -> Self {
        Self::new()
    }
}

impl Format for Bare {
    fn name(&self) -> &'static str {
        "bare"
    }

    fn read(&self, incoming: &Incoming<'_>) -> Result<Read, Refusal> {
        if let Some(ct) = incoming.content_type.filter(|ct| !ct.is_empty()) {
            json_content_type(ct)
                .map_err(|why| Refusal::NotMine(InvalidMessage::new(R::InvalidContentType, why)))?;
        }
        let payload = json_body(incoming.body)
            .map_err(|e| Refusal::NotMine(InvalidMessage::new(R::InvalidJson, e.to_string())))?;
        let invalid =
            |detail: String| Refusal::Invalid(InvalidMessage::new(R::InvalidBarePayload, detail));
        let event_type = match &self.event_type {
            TypeFrom::Property => incoming
                .kind
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| {
                    invalid("no event type: the AMQP type property is missing".into())
                })?,
            TypeFrom::Header(name) => incoming
                .header_str(name)
                .filter(|t| !t.is_empty())
                .map(|t| t.into_owned())
                .ok_or_else(|| invalid(format!("no event type: no text header {name:?}")))?,
            TypeFrom::RoutingKey if incoming.routing_key.is_empty() => {
                return Err(invalid("no event type: the routing key is empty".into()));
            }
            TypeFrom::RoutingKey => incoming.routing_key.to_owned(),
            TypeFrom::Fixed(t) => t.clone(),
        };
        check_short("the event type", &event_type, R::InvalidBarePayload)
            .map_err(Refusal::Invalid)?;
        let schema_version =
            version(&self.version, &event_type, |name| incoming.header(name)).map_err(invalid)?;
        let mut read = Read::new(self.name(), event_type, schema_version, payload);
        if let Some(id) = incoming.message_id.filter(|id| !id.is_empty()) {
            check_id("the AMQP message_id", id, R::InvalidBarePayload).map_err(Refusal::Invalid)?;
            read.identity = Some(Identity::Given(id.to_owned()));
        }
        if let Some(id) = incoming.correlation_id.filter(|id| !id.is_empty()) {
            check_short("the AMQP correlation_id", id, R::InvalidBarePayload)
                .map_err(Refusal::Invalid)?;
            read.correlation_id = Some(id.to_owned());
        }
        read.occurred_at = match &self.occurred_at_header {
            Some(name) if incoming.header(name).is_some() => Some(
                time_value(incoming.header(name).expect("checked"))
                    .ok_or_else(|| invalid(format!("header {name:?} is not an RFC 3339 time")))?,
            ),
            _ => incoming.sent_at(),
        };
        Ok(read)
    }
}

/// The schema version `from` names, for `event_type`; `header` looks a
/// header (or attribute) up. `Err` explains, for the format's refusal.
pub(super) fn version<'a>(
    from: &VersionFrom,
    event_type: &str,
    header: impl Fn(&str) -> Option<&'a AMQPValue>,
) -> Result<u32, String> {
    match from {
        VersionFrom::TypeSuffix => version_suffix(event_type).ok_or_else(|| {
            format!(
                "no schema version: the event type {:?} has no .vN suffix (name another source: VersionFrom)",
                crate::amqp::truncate(event_type, 100)
            )
        }),
        VersionFrom::Fixed(v) => Ok(*v),
        VersionFrom::Header(name) => {
            let value = header(name).ok_or_else(|| format!("no schema version: no header {name:?}"))?;
            let number = match value {
                AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
                    .ok()
                    .and_then(|t| t.trim().parse::<i64>().ok()),
                AMQPValue::ShortString(s) => s.as_str().trim().parse::<i64>().ok(),
                other => crate::amqp::int_value(other),
            };
            number
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| format!("header {name:?} is not a schema version (a whole number)"))
        }
    }
}

/// A time header's value: RFC 3339 text, or an AMQP timestamp (seconds).
pub(super) fn time_value(value: &AMQPValue) -> Option<DateTime<Utc>> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .ok()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&Utc)),
        AMQPValue::ShortString(s) => DateTime::parse_from_rfc3339(s.as_str())
            .ok()
            .map(|t| t.with_timezone(&Utc)),
        AMQPValue::Timestamp(s) => i64::try_from(*s)
            .ok()
            .and_then(|s| Utc.timestamp_opt(s, 0).single()),
        _ => None,
    }
}
