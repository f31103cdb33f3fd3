//! The events a handler wrote, as the kit reads them back from the outbox.

use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

use std::sync::LazyLock;

use crate::envelope::{Incoming, InvalidMessage, Metadata};
use crate::format::{Bare, CloudEvents, Formats, VersionFrom, WarrenEnvelope};
use crate::headers::HEADER_SCHEMA_VERSION;
use crate::outbox_row::OutboxRow;
use crate::outgoing::WireFormat;

/// An event a handler wrote to the outbox, as the relay would publish it.
#[derive(Debug, Clone)]
pub struct OutboxMessage {
    /// The exchange it goes to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// What a warren consumer reads from it, in whatever format it was
    /// written: message id, event type, correlation and causation ids, and
    /// the format (`meta.format`). A CloudEvent's `meta.message_id` is then
    /// its inbox key (`~ce:` and a hash); `meta.identity` holds its `source`
    /// and `id`.
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
        // Each format as warren writes it: the version where it puts it.
        static WARREN: LazyLock<Formats> = LazyLock::new(|| Formats::new().then(WarrenEnvelope));
        static BARE: LazyLock<Formats> = LazyLock::new(|| {
            Formats::new()
                .then(Bare::new().version_from(VersionFrom::Header(HEADER_SCHEMA_VERSION.into())))
        });
        static CLOUDEVENTS: LazyLock<Formats> = LazyLock::new(|| {
            Formats::new()
                .then(CloudEvents::new().version_from(VersionFrom::Header("schemaversion".into())))
        });
        let formats = match row.properties.format {
            WireFormat::Warren => &WARREN,
            WireFormat::Bare => &BARE,
            WireFormat::CloudEventsBinary | WireFormat::CloudEventsStructured => &CLOUDEVENTS,
        };
        let properties = row.properties.to_amqp(&row.message_id).map_err(|e| {
            InvalidMessage::new(
                crate::failure::DeadLetterReason::InvalidEnvelope,
                e.to_string(),
            )
        })?;
        let read = formats.read(
            &Incoming::new(&properties, &row.routing_key, &row.body),
            usize::MAX,
        )?;
        let identity = read
            .identity
            .clone()
            .expect("warren writes every message with an id");
        Ok(Self {
            exchange: row.exchange.clone(),
            routing_key: row.routing_key.clone(),
            meta: read.meta(identity),
            payload: read.payload,
        })
    }
}
