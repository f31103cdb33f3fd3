//! MassTransit's JSON envelope (`application/vnd.masstransit+json`, its
//! default serializer since version 8): the message under `message`, its
//! types under `messageType` as URNs, ids and times beside them.

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use super::{
    Format, Identity, InvalidMessage, Read, Refusal, TypeMap, check_id, check_short, essence,
};
use super::{Incoming, charset_utf8};
use crate::failure::DeadLetterReason as R;

/// The content type MassTransit's envelope is sent with.
pub const CONTENT_TYPE_MASSTRANSIT: &str = "application/vnd.masstransit+json";

/// MassTransit's JSON envelope, recognized by its content type. The
/// identity is `messageId` (and the AMQP `message_id`, when set, must be
/// the same); the event type and schema version are those the first URN in
/// `messageType` is mapped to with [`message_type`](Self::message_type)
/// (MassTransit sends no version, and a URN no mapping names is a dead
/// letter); `sentTime` is occurred-at; `conversationId` (else
/// `correlationId`) the correlation id; `initiatorId` the causation id;
/// `message` the payload.
///
/// ```
/// use warren::format::MassTransit;
/// let format = MassTransit::new()
///     .message_type("urn:message:Billing.Contracts:InvoicePaid", "billing.invoice-paid", 1);
/// # let _ = format;
/// ```
#[derive(Debug, Clone, Default)]
pub struct MassTransit {
    types: TypeMap,
}

impl MassTransit {
    /// No message type mapped yet: every envelope would be refused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads envelopes whose `messageType` lists `urn` (for example
    /// `urn:message:Billing.Contracts:InvoicePaid`) as `event_type` in
    /// schema `version`.
    pub fn message_type(mut self, urn: impl Into<String>, event_type: &str, version: u32) -> Self {
        self.types = self.types.with(urn.into(), event_type, version);
        self
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    message_id: Option<String>,
    correlation_id: Option<String>,
    conversation_id: Option<String>,
    initiator_id: Option<String>,
    #[serde(default)]
    message_type: Vec<String>,
    message: Option<Box<RawValue>>,
    sent_time: Option<String>,
    // Named so that their presence is allowed and their values ignored.
    #[serde(default, rename = "headers")]
    _headers: Option<IgnoredAny>,
}

fn invalid(detail: String) -> InvalidMessage {
    InvalidMessage::new(R::InvalidMassTransit, detail)
}

impl Format for MassTransit {
    fn name(&self) -> &'static str {
        "masstransit"
    }

    fn read(&self, incoming: &Incoming<'_>) -> Result<Read, Refusal> {
        let Some(ct) = incoming
            .content_type
            .filter(|ct| essence(ct) == CONTENT_TYPE_MASSTRANSIT)
        else {
            return Err(Refusal::NotMine(InvalidMessage::new(
                R::InvalidContentType,
                format!("content type is not {CONTENT_TYPE_MASSTRANSIT:?}"),
            )));
        };
        self.envelope(incoming, ct).map_err(Refusal::Invalid)
    }
}

impl MassTransit {
    fn envelope(&self, incoming: &Incoming<'_>, ct: &str) -> Result<Read, InvalidMessage> {
        charset_utf8(ct.split(';').skip(1), ct).map_err(invalid)?;
        let wire: Wire = serde_json::from_slice(incoming.body)
            .map_err(|e| invalid(format!("the body is not a MassTransit envelope: {e}")))?;
        let message_id = wire
            .message_id
            .filter(|id| !id.is_empty())
            .ok_or_else(|| invalid("messageId is missing or empty".into()))?;
        check_id("messageId", &message_id, R::InvalidMassTransit)?;
        super::check_same_id("messageId", &message_id, incoming.message_id)?;
        let (event_type, version) = self
            .types
            .first_of(wire.message_type.iter().map(String::as_str))
            .ok_or_else(|| {
                invalid(format!(
                    "messageType {} names no type this consumer maps (MassTransit::message_type)",
                    super::shown_list(&wire.message_type)
                ))
            })?;
        let payload = wire
            .message
            .ok_or_else(|| invalid("the envelope has no message".into()))?;
        let mut read = Read::new(self.name(), event_type.to_owned(), version, payload);
        read.identity = Some(Identity::Given(message_id));
        read.occurred_at = match wire.sent_time {
            None => None,
            Some(t) => Some(sent_time(&t).ok_or_else(|| {
                invalid(format!(
                    "sentTime {:?} is not an ISO 8601 time",
                    crate::amqp::truncate(&t, 64)
                ))
            })?),
        };
        for (field, value, slot) in [
            (
                "conversationId",
                wire.conversation_id.or(wire.correlation_id),
                &mut read.correlation_id,
            ),
            ("initiatorId", wire.initiator_id, &mut read.causation_id),
        ] {
            if let Some(value) = value.filter(|v| !v.is_empty()) {
                check_short(field, &value, R::InvalidMassTransit)?;
                *slot = Some(value);
            }
        }
        Ok(read)
    }
}

/// .NET writes a UTC `DateTime` with a `Z` and up to seven fraction digits;
/// one without a zone is taken as UTC, which is what MassTransit stamps.
fn sent_time(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .ok()
        .or_else(|| {
            NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S%.f")
                .ok()
                .map(|t| t.and_utc())
        })
}
