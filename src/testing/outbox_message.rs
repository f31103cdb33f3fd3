//! The events a handler wrote, as the kit reads them back from the outbox.

use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

use crate::envelope::{CONTENT_TYPE_JSON, Envelope, Incoming, InvalidMessage, Metadata};
use crate::outbox_row::OutboxRow;

/// An event a handler wrote to the outbox, as the relay would publish it.
#[derive(Debug, Clone)]
pub struct OutboxMessage {
    /// The exchange it goes to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Its envelope: message id, event type, correlation and causation ids.
    pub meta: Metadata,
    payload: Box<RawValue>,
}

impl OutboxMessage {
    /// The payload, deserialized.
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.payload.get())
    }

    /// The payload as JSON text, exactly as written.
    pub fn payload_json(&self) -> &str {
        self.payload.get()
    }

    pub(super) fn of(row: &OutboxRow) -> Result<Self, InvalidMessage> {
        let envelope = Envelope::parse(
            Incoming {
                message_id: Some(&row.message_id),
                content_type: Some(CONTENT_TYPE_JSON),
                ..Incoming::body_only(&row.body)
            },
            usize::MAX,
        )?;
        Ok(Self {
            exchange: row.exchange.clone(),
            routing_key: row.routing_key.clone(),
            payload: envelope.payload().to_owned(),
            meta: envelope.meta,
        })
    }
}
