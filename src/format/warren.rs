//! warren's own envelope: a JSON object with `messageId`, `eventType`,
//! `schemaVersion`, `occurredAtUtc`, `correlationId`, `causationId` and
//! `payload`, its `messageId` also in the AMQP `message_id` property.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use super::{CONTENT_TYPE_JSON, InvalidMessage};
use super::{Format, Identity, Incoming, Read, Refusal, check_id, check_short};
use crate::failure::DeadLetterReason as R;

/// warren's envelope, the format warren's outbox publishes. A body is
/// warren's when it is a JSON object with `messageId`, `eventType`,
/// `schemaVersion` and `payload`; it is then held to every rule: content type
/// `application/json`, the AMQP `message_id` present and equal to
/// `messageId`, `occurredAtUtc` and `correlationId` present.
#[derive(Debug, Clone, Copy, Default)]
pub struct WarrenEnvelope;

/// The fields the envelope is told apart by.
const CLAIMING_FIELDS: [&str; 4] = ["messageId", "eventType", "schemaVersion", "payload"];

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireIn {
    message_id: Option<String>,
    event_type: Option<String>,
    schema_version: Option<u32>,
    occurred_at_utc: Option<DateTime<Utc>>,
    correlation_id: Option<String>,
    #[serde(default)]
    causation_id: Option<String>,
    payload: Option<Box<RawValue>>,
}

impl Format for WarrenEnvelope {
    fn name(&self) -> &'static str {
        "warren"
    }

    fn read(&self, incoming: &Incoming<'_>) -> Result<Read, Refusal> {
        check_content_type(incoming.content_type).map_err(Refusal::NotMine)?;
        let property_id = incoming.message_id.filter(|id| !id.is_empty());
        // Checked before the body, as warren always has: a consumer of this
        // format alone files a message without it as `missing-message-id`.
        let no_id = || {
            InvalidMessage::new(
                R::MissingMessageId,
                "the AMQP message_id property is missing or empty",
            )
        };
        let wire = match parse(incoming.body) {
            Ok(wire) => wire,
            Err((claimed, _)) if claimed && property_id.is_none() => {
                return Err(Refusal::Invalid(no_id()));
            }
            Err((claimed, why)) => {
                return Err(match (claimed, property_id) {
                    (true, _) => Refusal::Invalid(why),
                    (false, None) => Refusal::NotMine(no_id()),
                    (false, Some(_)) => Refusal::NotMine(why),
                });
            }
        };
        let (Some(message_id), Some(event_type), Some(schema_version), Some(payload)) = (
            wire.message_id,
            wire.event_type,
            wire.schema_version,
            wire.payload,
        ) else {
            unreachable!("parse returns only envelopes with their claiming fields")
        };
        let Some(property_id) = property_id else {
            return Err(Refusal::Invalid(no_id()));
        };
        let invalid =
            |detail: String| Refusal::Invalid(InvalidMessage::new(R::InvalidEnvelope, detail));
        let missing = |field: &str| invalid(format!("missing field `{field}`"));
        let occurred_at = wire
            .occurred_at_utc
            .ok_or_else(|| missing("occurredAtUtc"))?;
        let correlation_id = wire
            .correlation_id
            .ok_or_else(|| missing("correlationId"))?;
        check_id("messageId", &message_id, R::InvalidEnvelope).map_err(Refusal::Invalid)?;
        super::check_same_id("body messageId", &message_id, Some(property_id))
            .map_err(Refusal::Invalid)?;
        for (field, value) in [
            ("eventType", event_type.as_str()),
            ("correlationId", correlation_id.as_str()),
            (
                "causationId",
                wire.causation_id.as_deref().unwrap_or_default(),
            ),
        ] {
            // Each travels on in an AMQP short-string property (the outbox
            // copies the correlation id onto every event it causes).
            check_short(field, value, R::InvalidEnvelope).map_err(Refusal::Invalid)?;
        }
        if event_type.is_empty() {
            return Err(invalid("eventType is empty".into()));
        }
        let mut read = Read::new(self.name(), event_type, schema_version, payload);
        read.identity = Some(Identity::Given(message_id));
        read.occurred_at = Some(occurred_at);
        read.correlation_id = Some(correlation_id);
        read.causation_id = wire.causation_id;
        Ok(read)
    }
}

/// The body read as an envelope with its claiming fields; else whether it
/// still claims to be one (it has them all, one of them ill-typed), and why
/// it is refused.
fn parse(body: &[u8]) -> Result<WireIn, (bool, InvalidMessage)> {
    // serde lets a struct deserialize from a JSON array too (fields by
    // position); an envelope is an object, nothing else.
    let first = body.iter().find(|b| !b.is_ascii_whitespace()).copied();
    if first != Some(b'{') {
        let reason = if serde_json::from_slice::<IgnoredAny>(body).is_ok() {
            R::InvalidEnvelope
        } else {
            R::InvalidJson
        };
        return Err((
            false,
            InvalidMessage::new(reason, "the body must be a JSON object (an envelope)"),
        ));
    }
    let wire: WireIn = serde_json::from_slice(body).map_err(|e| {
        if !e.is_data() {
            return (false, InvalidMessage::new(R::InvalidJson, e.to_string()));
        }
        // An ill-typed field: the envelope's if it has every claiming field.
        let claimed = serde_json::from_slice::<HashMap<String, IgnoredAny>>(body)
            .is_ok_and(|fields| CLAIMING_FIELDS.iter().all(|f| fields.contains_key(*f)));
        (
            claimed,
            InvalidMessage::new(R::InvalidEnvelope, e.to_string()),
        )
    })?;
    let present = [
        wire.message_id.is_some(),
        wire.event_type.is_some(),
        wire.schema_version.is_some(),
        wire.payload.is_some(),
    ];
    if let Some(i) = present.iter().position(|p| !p) {
        return Err((
            false,
            InvalidMessage::new(
                R::InvalidEnvelope,
                format!("missing field `{}`", CLAIMING_FIELDS[i]),
            ),
        ));
    }
    Ok(wire)
}

/// The content type must be JSON, and any charset it names UTF-8: JSON in
/// another charset would be misread as UTF-8 and its text silently changed.
fn check_content_type(content_type: Option<&str>) -> Result<(), InvalidMessage> {
    let refuse = |detail: String| InvalidMessage::new(R::InvalidContentType, detail);
    let Some(ct) = content_type else {
        return Err(refuse(format!(
            "content type is missing, expected {CONTENT_TYPE_JSON:?}"
        )));
    };
    let shown = crate::amqp::truncate(ct, 100);
    let mut parts = ct.split(';');
    if !parts
        .next()
        .unwrap_or_default()
        .trim()
        .eq_ignore_ascii_case(CONTENT_TYPE_JSON)
    {
        return Err(refuse(format!(
            "content type is {shown:?}, expected {CONTENT_TYPE_JSON:?}"
        )));
    }
    super::charset_utf8(parts, shown).map_err(refuse)
}
