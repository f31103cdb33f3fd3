//! warren's message envelope: parsing and validating what arrives in it.
//!
//! Every delivery is checked before any handler or database is touched. A check
//! that fails yields an [`InvalidMessage`] carrying the
//! [`DeadLetterReason`](crate::admin::DeadLetterReason) the consumer files it
//! under; nothing here is retried. Other formats: [`format`](crate::format).

use serde_json::value::RawValue;

pub use crate::format::{
    CONTENT_TYPE_JSON, DEFAULT_MAX_BODY_BYTES, Incoming, InvalidMessage, MAX_MESSAGE_ID_LEN,
    Metadata,
};

/// A validated incoming message in warren's envelope: metadata plus the
/// still-serialized payload.
#[derive(Debug)]
pub struct Envelope {
    /// The envelope fields.
    pub meta: Metadata,
    payload: Box<RawValue>,
}

impl Envelope {
    /// Validates a delivery in warren's envelope: size, content type, the
    /// `message_id` property, JSON, the envelope's fields, and that the
    /// body's id equals the property.
    pub fn parse(incoming: Incoming<'_>, max_body_bytes: usize) -> Result<Self, InvalidMessage> {
        // Built once: a list of one format, shared by every parse.
        static WARREN: std::sync::LazyLock<crate::format::Formats> =
            std::sync::LazyLock::new(crate::format::Formats::default);
        let read = WARREN.read(&incoming, max_body_bytes)?;
        let identity = read
            .identity
            .clone()
            .expect("warren's envelope always has an id");
        Ok(Envelope {
            meta: read.meta(identity),
            payload: read.payload,
        })
    }

    /// The payload as raw JSON, to be deserialized by the handler it is routed to.
    pub fn payload(&self) -> &RawValue {
        &self.payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failure::DeadLetterReason;
    use crate::outgoing::Outgoing;

    fn incoming<'a>(id: Option<&'a str>, body: &'a [u8]) -> Incoming<'a> {
        Incoming {
            message_id: id,
            content_type: Some("application/json"),
            ..Incoming::body_only(body)
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
            env.meta.occurred_at.unwrap().timestamp_millis(),
            out.meta().occurred_at.unwrap().timestamp_millis()
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
