//! NServiceBus over RabbitMQ: the body is the message (JSON with its
//! System.Text.Json or Newtonsoft serializer), everything else in
//! `NServiceBus.*` headers.

use chrono::{DateTime, NaiveDateTime, Utc};

use super::{
    Format, Identity, Incoming, InvalidMessage, Read, Refusal, TypeMap, check_id, check_short,
    json_body, json_content_type,
};
use crate::failure::DeadLetterReason as R;

/// The header NServiceBus names a message's types in; its presence makes a
/// message NServiceBus's.
const ENCLOSED_TYPES: &str = "NServiceBus.EnclosedMessageTypes";

/// NServiceBus's headers, recognized by `NServiceBus.EnclosedMessageTypes`.
/// The identity is `NServiceBus.MessageId` (and the AMQP `message_id`, when
/// set, must be the same); the event type and schema version are those the
/// first of the enclosed types is mapped to with
/// [`message_type`](Self::message_type), by its full name (the
/// assembly-qualified name up to its first comma); `NServiceBus.TimeSent`
/// is occurred-at; `NServiceBus.ConversationId` the correlation id;
/// `NServiceBus.RelatedTo` the causation id; the body, which must be JSON
/// (`NServiceBus.ContentType`), the payload.
///
/// ```
/// use warren::format::NServiceBus;
/// let format = NServiceBus::new()
///     .message_type("Billing.Contracts.InvoicePaid", "billing.invoice-paid", 1);
/// # let _ = format;
/// ```
#[derive(Debug, Clone, Default)]
pub struct NServiceBus {
    types: TypeMap,
}

impl NServiceBus {
    /// No message type mapped yet: every message would be refused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads messages enclosing the .NET type `full_name` (namespace and
    /// name, `Billing.Contracts.InvoicePaid`) as `event_type` in schema
    /// `version`.
    pub fn message_type(
        mut self,
        full_name: impl Into<String>,
        event_type: &str,
        version: u32,
    ) -> Self {
        self.types = self.types.with(full_name.into(), event_type, version);
        self
    }
}

fn invalid(detail: String) -> InvalidMessage {
    InvalidMessage::new(R::InvalidNServiceBus, detail)
}

impl Format for NServiceBus {
    fn name(&self) -> &'static str {
        "nservicebus"
    }

    fn read(&self, incoming: &Incoming<'_>) -> Result<Read, Refusal> {
        if incoming.header(ENCLOSED_TYPES).is_none() {
            return Err(Refusal::NotMine(invalid(format!(
                "no {ENCLOSED_TYPES} header"
            ))));
        }
        self.message(incoming).map_err(Refusal::Invalid)
    }
}

impl NServiceBus {
    fn message(&self, incoming: &Incoming<'_>) -> Result<Read, InvalidMessage> {
        let text = |name: &str| -> Result<Option<String>, InvalidMessage> {
            match incoming.header(name) {
                None => Ok(None),
                Some(_) => incoming
                    .header_str(name)
                    .map(|v| Some(v.into_owned()))
                    .ok_or_else(|| invalid(format!("header {name:?} is not text"))),
            }
        };
        let enclosed = text(ENCLOSED_TYPES)?.unwrap_or_default();
        let names: Vec<&str> = enclosed
            .split(';')
            .map(|t| t.split(',').next().unwrap_or_default().trim())
            .filter(|t| !t.is_empty())
            .collect();
        let (event_type, version) = self.types.first_of(names.iter().copied()).ok_or_else(|| {
            invalid(format!(
                "{ENCLOSED_TYPES} {} names no type this consumer maps (NServiceBus::message_type)",
                super::shown_list(&names)
            ))
        })?;
        let content_type = text("NServiceBus.ContentType")?
            .or_else(|| incoming.content_type.map(str::to_owned))
            .filter(|ct| !ct.is_empty());
        if let Some(ct) = content_type {
            json_content_type(&ct).map_err(invalid)?;
        }
        let message_id = text("NServiceBus.MessageId")?
            .or_else(|| incoming.message_id.map(str::to_owned))
            .filter(|id| !id.is_empty())
            .ok_or_else(|| invalid("NServiceBus.MessageId is missing or empty".into()))?;
        check_id("NServiceBus.MessageId", &message_id, R::InvalidNServiceBus)?;
        super::check_same_id("NServiceBus.MessageId", &message_id, incoming.message_id)?;
        let payload =
            json_body(incoming.body).map_err(|e| invalid(format!("the body is not JSON: {e}")))?;
        let mut read = Read::new(self.name(), event_type.to_owned(), version, payload);
        read.identity = Some(Identity::Given(message_id));
        read.occurred_at = match text("NServiceBus.TimeSent")? {
            None => None,
            Some(t) => Some(time_sent(&t).ok_or_else(|| {
                invalid(format!(
                    "NServiceBus.TimeSent {:?} is not in NServiceBus's form, yyyy-MM-dd HH:mm:ss:ffffff Z",
                    crate::amqp::truncate(&t, 64)
                ))
            })?),
        };
        for (header, slot) in [
            ("NServiceBus.ConversationId", &mut read.correlation_id),
            ("NServiceBus.RelatedTo", &mut read.causation_id),
        ] {
            if let Some(value) = text(header)?.filter(|v| !v.is_empty()) {
                check_short(header, &value, R::InvalidNServiceBus)?;
                *slot = Some(value);
            }
        }
        Ok(read)
    }
}

/// NServiceBus's wire time: `2026-12-07 09:23:14:318456 Z`, always UTC.
fn time_sent(text: &str) -> Option<DateTime<Utc>> {
    let naive = text.strip_suffix(" Z")?;
    NaiveDateTime::parse_from_str(naive, "%Y-%m-%d %H:%M:%S:%6f")
        .ok()
        .map(|t| t.and_utc())
}
