//! The message envelope: parsing and validating what arrives, building what leaves.
//!
//! Every delivery is checked here before any handler or database is touched. A check
//! that fails yields an [`InvalidMessage`] carrying the [`DeadLetterReason`] the
//! consumer files it under; nothing in this module is retried.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::amqp::{MAX_SHORT_STRING_LEN, truncate};
use crate::failure::DeadLetterReason;

/// The only content type warren accepts and produces.
pub const CONTENT_TYPE_JSON: &str = "application/json";

/// Default upper bound on a message body: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;

/// Longest message id accepted. Ids are stored in the inbox's primary key, so an
/// unbounded id is an unbounded index entry.
pub const MAX_MESSAGE_ID_LEN: usize = 200;

/// What the envelope says about a message, apart from its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    /// The producer's identity for this message; the deduplication key.
    pub message_id: String,
    /// Event type, e.g. `billing.invoice-paid.v1`.
    pub event_type: String,
    /// Schema version of the payload.
    pub schema_version: u32,
    /// When the business event happened, as the producer saw it.
    pub occurred_at: DateTime<Utc>,
    /// Id shared by every message of one business flow.
    pub correlation_id: String,
    /// Id of the message that caused this one; `None` for the first message of a flow.
    pub causation_id: Option<String>,
}

/// A validated incoming message: metadata plus the still-serialized payload.
#[derive(Debug)]
pub struct Envelope {
    /// The envelope fields.
    pub meta: Metadata,
    payload: Box<RawValue>,
}

/// The parts of an AMQP delivery that validation looks at.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// The AMQP `message_id` property.
    pub message_id: Option<&'a str>,
    /// The AMQP `content_type` property.
    pub content_type: Option<&'a str>,
    /// The AMQP `content_encoding` property.
    pub content_encoding: Option<&'a str>,
    /// The raw body.
    pub body: &'a [u8],
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
    pub(crate) fn new(reason: DeadLetterReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireIn {
    message_id: String,
    event_type: String,
    schema_version: u32,
    occurred_at_utc: DateTime<Utc>,
    correlation_id: String,
    #[serde(default)]
    causation_id: Option<String>,
    payload: Box<RawValue>,
}

impl Envelope {
    /// Validates a delivery: size, content type, the `message_id` property, JSON, the
    /// envelope's fields, and that the body's id equals the property.
    pub fn parse(incoming: Incoming<'_>, max_body_bytes: usize) -> Result<Self, InvalidMessage> {
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
        check_content_type(incoming.content_type)?;
        if let Some(encoding) = incoming.content_encoding
            && !(encoding.is_empty() || encoding.eq_ignore_ascii_case("identity"))
        {
            return Err(InvalidMessage::new(
                R::UnsupportedContentEncoding,
                format!(
                    "content encoding is {:?}; warren reads only unencoded JSON",
                    truncate(encoding, 64)
                ),
            ));
        }
        let property_id = match incoming.message_id {
            Some(id) if !id.is_empty() => id,
            _ => {
                return Err(InvalidMessage::new(
                    R::MissingMessageId,
                    "the AMQP message_id property is missing or empty",
                ));
            }
        };
        // serde lets a struct deserialize from a JSON array too (fields by
        // position); an envelope is an object, nothing else.
        let first = incoming
            .body
            .iter()
            .find(|b| !b.is_ascii_whitespace())
            .copied();
        if first != Some(b'{') {
            let reason = if serde_json::from_slice::<serde::de::IgnoredAny>(incoming.body).is_ok() {
                R::InvalidEnvelope
            } else {
                R::InvalidJson
            };
            return Err(InvalidMessage::new(
                reason,
                "the body must be a JSON object (an envelope)",
            ));
        }
        let wire: WireIn = serde_json::from_slice(incoming.body).map_err(|e| {
            let reason = if e.is_data() {
                R::InvalidEnvelope
            } else {
                R::InvalidJson
            };
            InvalidMessage::new(reason, e.to_string())
        })?;
        if wire.message_id.is_empty() || wire.message_id.len() > MAX_MESSAGE_ID_LEN {
            return Err(InvalidMessage::new(
                R::InvalidEnvelope,
                format!("messageId must be 1 to {MAX_MESSAGE_ID_LEN} characters"),
            ));
        }
        if wire.message_id != property_id {
            return Err(InvalidMessage::new(
                R::MessageIdMismatch,
                format!(
                    "body messageId {:?} differs from the message_id property {property_id:?}",
                    wire.message_id
                ),
            ));
        }
        for (field, value) in [
            ("messageId", wire.message_id.as_str()),
            ("eventType", wire.event_type.as_str()),
            ("correlationId", wire.correlation_id.as_str()),
            (
                "causationId",
                wire.causation_id.as_deref().unwrap_or_default(),
            ),
        ] {
            // Each of these travels on in an AMQP short-string property (the
            // outbox copies the correlation id onto every event it causes).
            if value.len() > MAX_SHORT_STRING_LEN {
                return Err(InvalidMessage::new(
                    R::InvalidEnvelope,
                    format!(
                        "{field} is {} bytes, the limit is {MAX_SHORT_STRING_LEN}",
                        value.len()
                    ),
                ));
            }
            // A NUL byte, for one, is a string no PostgreSQL text column accepts:
            // refused here, it cannot turn into a database error later.
            if value.chars().any(char::is_control) {
                return Err(InvalidMessage::new(
                    R::InvalidEnvelope,
                    format!("{field} contains a control character"),
                ));
            }
        }
        if wire.event_type.is_empty() {
            return Err(InvalidMessage::new(
                R::InvalidEnvelope,
                "eventType is empty",
            ));
        }
        Ok(Envelope {
            meta: Metadata {
                message_id: wire.message_id,
                event_type: wire.event_type,
                schema_version: wire.schema_version,
                occurred_at: wire.occurred_at_utc,
                correlation_id: wire.correlation_id,
                causation_id: wire.causation_id,
            },
            payload: wire.payload,
        })
    }

    /// The payload as raw JSON, to be deserialized by the handler it is routed to.
    pub fn payload(&self) -> &RawValue {
        &self.payload
    }
}

/// The content type must be JSON, and any charset it names UTF-8: JSON in another
/// charset would be misread as UTF-8 and its text fields silently changed.
fn check_content_type(content_type: Option<&str>) -> Result<(), InvalidMessage> {
    let refuse = |detail: String| {
        Err(InvalidMessage::new(
            DeadLetterReason::InvalidContentType,
            detail,
        ))
    };
    let Some(ct) = content_type else {
        return refuse(format!(
            "content type is missing, expected {CONTENT_TYPE_JSON:?}"
        ));
    };
    let shown = truncate(ct, 100);
    let mut parts = ct.split(';');
    let essence = parts.next().unwrap_or_default().trim();
    if !essence.eq_ignore_ascii_case(CONTENT_TYPE_JSON) {
        return refuse(format!(
            "content type is {shown:?}, expected {CONTENT_TYPE_JSON:?}"
        ));
    }
    for param in parts {
        let Some((name, value)) = param.split_once('=') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("charset") {
            let charset = value.trim().trim_matches('"');
            if !(charset.eq_ignore_ascii_case("utf-8") || charset.eq_ignore_ascii_case("utf8")) {
                return refuse(format!(
                    "content type {shown:?} names a charset other than UTF-8"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outgoing::Outgoing;

    fn incoming<'a>(id: Option<&'a str>, body: &'a [u8]) -> Incoming<'a> {
        Incoming {
            message_id: id,
            content_type: Some("application/json"),
            content_encoding: None,
            body,
        }
    }

    fn reason(r: Result<Envelope, InvalidMessage>) -> DeadLetterReason {
        r.expect_err("should be refused").reason
    }

    #[test]
    fn round_trips_what_outgoing_builds() {
        let out = Outgoing::new("t.v1", 1, &serde_json::json!({"a": 1})).unwrap();
        let body = out.body();
        let env = Envelope::parse(incoming(Some(&out.meta().message_id), &body), 1024).unwrap();
        assert_eq!(env.meta.message_id, out.meta().message_id);
        assert_eq!(env.meta.event_type, "t.v1");
        assert_eq!(env.meta.causation_id, None);
        assert_eq!(env.payload().get(), r#"{"a":1}"#);
        // Millisecond precision survives the round trip.
        assert_eq!(
            env.meta.occurred_at.timestamp_millis(),
            out.meta().occurred_at.timestamp_millis()
        );
    }

    #[test]
    fn caused_by_carries_correlation_and_sets_causation() {
        let first = Outgoing::new("a.v1", 1, &1).unwrap();
        let second = Outgoing::new("b.v1", 1, &2)
            .unwrap()
            .caused_by(first.meta());
        assert_eq!(second.meta().correlation_id, first.meta().correlation_id);
        assert_eq!(
            second.meta().causation_id.as_deref(),
            Some(first.meta().message_id.as_str())
        );
        assert_ne!(second.meta().message_id, first.meta().message_id);
    }

    #[test]
    fn refuses_each_kind_of_bad_input() {
        let good = Outgoing::new("t.v1", 1, &1).unwrap();
        let id = good.meta().message_id.clone();
        let body = good.body();
        assert_eq!(
            reason(Envelope::parse(incoming(Some(&id), &body), 10)),
            DeadLetterReason::BodyTooLarge
        );
        assert_eq!(
            reason(Envelope::parse(incoming(None, &body), 1024)),
            DeadLetterReason::MissingMessageId
        );
        assert_eq!(
            reason(Envelope::parse(incoming(Some("other"), &body), 1024)),
            DeadLetterReason::MessageIdMismatch
        );
        assert_eq!(
            reason(Envelope::parse(incoming(Some(&id), b"{not json"), 1024)),
            DeadLetterReason::InvalidJson
        );
        assert_eq!(
            reason(Envelope::parse(
                incoming(Some(&id), br#"{"messageId":"x"}"#),
                1024
            )),
            DeadLetterReason::InvalidEnvelope
        );
        let wrong_type = Incoming {
            content_type: Some("text/plain"),
            ..incoming(Some(&id), &body)
        };
        assert_eq!(
            reason(Envelope::parse(wrong_type, 1024)),
            DeadLetterReason::InvalidContentType
        );
        let nul_id = "a\u{0}b";
        let nul_body = r#"{"messageId":"a\u0000b","eventType":"t","schemaVersion":1,"occurredAtUtc":"2026-01-01T00:00:00Z","correlationId":"c","payload":{}}"#;
        assert_eq!(
            reason(Envelope::parse(
                incoming(Some(nul_id), nul_body.as_bytes()),
                1024
            )),
            DeadLetterReason::InvalidEnvelope
        );
        let with_charset = Incoming {
            content_type: Some("Application/JSON; charset=utf-8"),
            ..incoming(Some(&id), &body)
        };
        assert!(Envelope::parse(with_charset, 1024).is_ok());
        let latin1 = Incoming {
            content_type: Some("application/json; charset=ISO-8859-1"),
            ..incoming(Some(&id), &body)
        };
        assert_eq!(
            reason(Envelope::parse(latin1, 1024)),
            DeadLetterReason::InvalidContentType
        );
        let gzip = Incoming {
            content_encoding: Some("gzip"),
            ..incoming(Some(&id), &body)
        };
        assert_eq!(
            reason(Envelope::parse(gzip, 1024)),
            DeadLetterReason::UnsupportedContentEncoding
        );
    }

    #[test]
    fn only_objects_and_short_string_sized_fields_are_envelopes() {
        let array = br#"["m1","t",1,"2026-01-01T00:00:00Z","c",null,{}]"#;
        assert_eq!(
            reason(Envelope::parse(incoming(Some("m1"), array), 1024)),
            DeadLetterReason::InvalidEnvelope
        );
        for (field, len) in [
            ("correlationId", 256),
            ("eventType", 256),
            ("causationId", 300),
        ] {
            let mut value = serde_json::json!({
                "messageId": "m1", "eventType": "t", "schemaVersion": 1,
                "occurredAtUtc": "2026-01-01T00:00:00Z", "correlationId": "c", "payload": {}
            });
            value[field] = serde_json::Value::String("é".repeat(len / 2 + 1));
            let body = serde_json::to_vec(&value).unwrap();
            let refused = Envelope::parse(incoming(Some("m1"), &body), 1 << 20).unwrap_err();
            assert_eq!(refused.reason, DeadLetterReason::InvalidEnvelope, "{field}");
            assert!(refused.detail.contains(field), "{}", refused.detail);
        }
        let fits = serde_json::json!({
            "messageId": "m1", "eventType": "t", "schemaVersion": 1,
            "occurredAtUtc": "2026-01-01T00:00:00Z", "correlationId": "c".repeat(255), "payload": {}
        });
        let body = serde_json::to_vec(&fits).unwrap();
        assert!(Envelope::parse(incoming(Some("m1"), &body), 1 << 20).is_ok());
    }
}
