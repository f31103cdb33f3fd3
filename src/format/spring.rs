//! Spring AMQP's JSON messages (`Jackson2JsonMessageConverter`): a bare
//! JSON body whose Java class is named in the `__TypeId__` header.

use super::{
    Format, Identity, Incoming, InvalidMessage, Read, Refusal, TypeMap, check_id, check_short,
    json_body, json_content_type,
};
use crate::failure::DeadLetterReason as R;

/// The header Spring's converter names the payload's class in.
const TYPE_ID: &str = "__TypeId__";

/// Spring AMQP's JSON messages, recognized by the `__TypeId__` header. The
/// event type and schema version are those the class it names is mapped
/// to with [`type_id`](Self::type_id); the identity is the AMQP
/// `message_id` (Spring sets one only with `setCreateMessageIds(true)`;
/// without it, only a route that derives a key takes the message);
/// occurred-at the AMQP `timestamp`; the correlation id the AMQP
/// `correlation_id`; the body, JSON, the payload.
///
/// ```
/// use warren::format::SpringAmqp;
/// let format = SpringAmqp::new()
///     .type_id("com.example.billing.InvoicePaid", "billing.invoice-paid", 1);
/// # let _ = format;
/// ```
#[derive(Debug, Clone, Default)]
pub struct SpringAmqp {
    types: TypeMap,
}

impl SpringAmqp {
    /// No class mapped yet: every message would be refused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads messages whose `__TypeId__` is `class` (the Java class's
    /// fully qualified name) as `event_type` in schema `version`.
    pub fn type_id(mut self, class: impl Into<String>, event_type: &str, version: u32) -> Self {
        self.types = self.types.with(class.into(), event_type, version);
        self
    }
}

fn invalid(detail: String) -> InvalidMessage {
    InvalidMessage::new(R::InvalidSpringMessage, detail)
}

impl Format for SpringAmqp {
    fn name(&self) -> &'static str {
        "spring"
    }

    fn read(&self, incoming: &Incoming<'_>) -> Result<Read, Refusal> {
        if incoming.header(TYPE_ID).is_none() {
            return Err(Refusal::NotMine(invalid(format!("no {TYPE_ID} header"))));
        }
        self.message(incoming).map_err(Refusal::Invalid)
    }
}

impl SpringAmqp {
    fn message(&self, incoming: &Incoming<'_>) -> Result<Read, InvalidMessage> {
        let class = incoming
            .header_str(TYPE_ID)
            .ok_or_else(|| invalid(format!("header {TYPE_ID} is not text")))?;
        let (event_type, version) = self.types.get(&class).ok_or_else(|| {
            invalid(format!(
                "{TYPE_ID} {:?} names no class this consumer maps (SpringAmqp::type_id)",
                crate::amqp::truncate(&class, 100)
            ))
        })?;
        if let Some(ct) = incoming.content_type.filter(|ct| !ct.is_empty()) {
            json_content_type(ct).map_err(invalid)?;
        }
        let payload =
            json_body(incoming.body).map_err(|e| invalid(format!("the body is not JSON: {e}")))?;
        let mut read = Read::new(self.name(), event_type.to_owned(), version, payload);
        if let Some(id) = incoming.message_id.filter(|id| !id.is_empty()) {
            check_id("the AMQP message_id", id, R::InvalidSpringMessage)?;
            read.identity = Some(Identity::Given(id.to_owned()));
        }
        if let Some(id) = incoming.correlation_id.filter(|id| !id.is_empty()) {
            check_short("the AMQP correlation_id", id, R::InvalidSpringMessage)?;
            read.correlation_id = Some(id.to_owned());
        }
        read.occurred_at = incoming.sent_at();
        Ok(read)
    }
}
