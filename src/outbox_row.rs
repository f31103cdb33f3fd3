//! The rows of `warren_outbox` as warren writes and reads them.
//!
//! Kept apart from [`crate::outbox`] so that the store can read and write rows
//! without depending on the module that depends on it.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use serde::{Deserialize, Serialize};

use crate::amqp::{MAX_SHORT_STRING_LEN, PERSISTENT};
use crate::headers::HEADER_PUBLISHED_AT_MS;
use crate::outgoing::{InvalidOutgoing, Outgoing, WireFormat};
use crate::trace_context::TraceContext;

/// The AMQP properties of an outbox row, as stored (JSON) in `warren_outbox.properties`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredProperties {
    /// AMQP `type`: the event type.
    pub event_type: String,
    /// AMQP `correlation_id`.
    pub correlation_id: String,
    /// AMQP `timestamp`, seconds since the epoch.
    pub timestamp: u64,
    /// String headers: those the message was given and its format's (a
    /// CloudEvent's `ce-` attributes).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The format the row's body and headers were rendered in; a row
    /// written before warren had formats has none: warren's envelope.
    #[serde(default, skip_serializing_if = "WireFormat::is_warren")]
    pub format: WireFormat,
}

impl StoredProperties {
    /// The properties of `message`.
    pub fn of(message: &Outgoing) -> Self {
        let meta = message.meta();
        Self {
            event_type: meta.event_type.clone(),
            correlation_id: meta.correlation_id.clone(),
            timestamp: message.occurred_at().timestamp().max(0) as u64,
            headers: message.wire_headers(),
            format: message.format().wire(),
        }
    }

    /// The AMQP properties to publish with, message id included. A value that
    /// does not fit its AMQP field (a short string over 255 bytes) is an error
    /// naming the field: the relay marks such a row failed instead of panicking
    /// on it.
    pub fn to_amqp(&self, message_id: &str) -> Result<BasicProperties, InvalidOutgoing> {
        let short = |field: &str, value: &str| {
            ShortString::try_new(value).map_err(|e| InvalidOutgoing(format!("{field}: {e}")))
        };
        let mut headers = FieldTable::default();
        for (k, v) in &self.headers {
            headers.insert(
                short("header name", k)?,
                AMQPValue::LongString(v.as_str().into()),
            );
        }
        Ok(BasicProperties::default()
            .with_message_id(short("message id", message_id)?)
            .with_type(short("event type", &self.event_type)?)
            .with_content_type(self.format.content_type().into())
            .with_correlation_id(short("correlation id", &self.correlation_id)?)
            .with_timestamp(self.timestamp)
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers))
    }
}

/// A row about to be inserted.
#[derive(Debug)]
pub struct NewOutboxRow<'a> {
    /// The outgoing message id (UUIDv7), fixed at insert.
    pub message_id: &'a str,
    /// Exchange to publish to.
    pub exchange: &'a str,
    /// Routing key.
    pub routing_key: &'a str,
    /// Properties as JSON.
    pub properties: String,
    /// The envelope body.
    pub body: Vec<u8>,
    /// The id of the message whose handler wrote it, if any.
    pub causation_id: Option<&'a str>,
    /// The trace context it continues, checked, captured as it is written.
    pub trace: &'a TraceContext,
}

/// An unpublished row, as the relay reads it.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    /// Row id; the publish order.
    pub id: i64,
    /// The outgoing message id.
    pub message_id: String,
    /// Exchange to publish to.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Properties as stored.
    pub properties: StoredProperties,
    /// The envelope body.
    pub body: Vec<u8>,
    /// Publish attempts so far.
    pub attempts: i64,
    /// When it was written, by the database's clock.
    pub written_at: Option<DateTime<Utc>>,
    /// The trace context stored with it (empty for a row written before
    /// warren stored one); checked again as it is read.
    pub trace: TraceContext,
}

impl OutboxRow {
    /// The AMQP properties to publish with: the stored ones, the trace
    /// context `trace` (the stored one, or a relay span's that continues
    /// it), and [`HEADER_PUBLISHED_AT_MS`] set to `published_at`.
    pub fn to_amqp(
        &self,
        trace: &TraceContext,
        published_at: DateTime<Utc>,
    ) -> Result<BasicProperties, InvalidOutgoing> {
        let properties = self.properties.to_amqp(&self.message_id)?;
        let mut headers = properties.headers().clone().unwrap_or_default();
        trace.write_headers(&mut headers);
        headers.insert(
            HEADER_PUBLISHED_AT_MS.into(),
            AMQPValue::LongLongInt(published_at.timestamp_millis()),
        );
        Ok(properties.with_headers(headers))
    }
}

/// What became of one row the relay tried to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowOutcome {
    /// Confirmed by the broker.
    Published,
    /// Refused for good (unroutable); kept aside until an operator retries it.
    Failed(String),
    /// Not confirmed (broker nack, lost connection); stays pending for the next pass.
    Retry(String),
}

/// A row the relay gave up on.
#[derive(Debug, Clone)]
pub struct FailedRow {
    /// Row id.
    pub id: i64,
    /// The outgoing message id.
    pub message_id: String,
    /// Exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Why it failed.
    pub last_error: String,
    /// Publish attempts.
    pub attempts: i64,
}

/// What `warren outbox status` shows.
#[derive(Debug, Clone, Default)]
pub struct OutboxStatus {
    /// Rows waiting to be published.
    pub pending: i64,
    /// When the oldest waiting row was written.
    pub oldest_pending: Option<DateTime<Utc>>,
    /// Rows published and not yet deleted by housekeeping.
    pub published: i64,
    /// Rows the relay gave up on.
    pub failed: Vec<FailedRow>,
}

impl OutboxStatus {
    /// Age of the oldest pending row, in seconds (0 when nothing is pending).
    pub fn oldest_pending_age_seconds(&self, now: DateTime<Utc>) -> f64 {
        self.oldest_pending
            .map(|t| (now - t).num_milliseconds().max(0) as f64 / 1000.0)
            .unwrap_or(0.0)
    }
}

impl<'a> NewOutboxRow<'a> {
    /// The row for `message`, or why it could never be published: an id, event
    /// type or correlation id the AMQP properties cannot carry, an exchange or
    /// routing key over 255 bytes.
    pub(crate) fn of(
        exchange: &'a str,
        routing_key: &'a str,
        message: &'a Outgoing,
    ) -> Result<Self, String> {
        check_route(exchange, routing_key)?;
        message.validate().map_err(|e| e.to_string())?;
        let properties = serde_json::to_string(&StoredProperties::of(message))
            .expect("properties of strings and numbers always serialize");
        Ok(NewOutboxRow {
            message_id: &message.meta().message_id,
            exchange,
            routing_key,
            properties,
            body: message.body(),
            causation_id: message.meta().causation_id.as_deref(),
            trace: message.trace_context(),
        })
    }
}

/// Exchange names and routing keys are AMQP short strings.
pub(crate) fn check_route(exchange: &str, routing_key: &str) -> Result<(), String> {
    for (field, value) in [("exchange", exchange), ("routing key", routing_key)] {
        if value.len() > MAX_SHORT_STRING_LEN {
            return Err(format!(
                "{field} is {} bytes, the limit is {}",
                value.len(),
                MAX_SHORT_STRING_LEN
            ));
        }
    }
    Ok(())
}

/// Parses a stored properties column; a row that cannot be read is failed, not
/// published with made-up properties.
pub(crate) fn parse_properties(json: &str) -> Result<StoredProperties, String> {
    serde_json::from_str(json).map_err(|e| format!("stored properties are not readable: {e}"))
}

/// An outbox row as selected for publishing: id, message id, exchange, routing
/// key, properties (JSON), body, attempts, when it was written (milliseconds
/// since the epoch), traceparent, tracestate, baggage.
pub(crate) type RawOutboxRow = (
    i64,
    String,
    String,
    String,
    String,
    Vec<u8>,
    i64,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// A failed row as selected: id, message id, exchange, routing key, last error,
/// attempts.
pub(crate) type RawFailedRow = (i64, String, String, String, Option<String>, i64);

/// Turns raw outbox rows into [`OutboxRow`]s; rows whose stored properties cannot
/// be read come back as failed outcomes instead.
pub(crate) fn from_raw(raw: Vec<RawOutboxRow>) -> (Vec<OutboxRow>, Vec<(i64, RowOutcome)>) {
    let mut rows = Vec::with_capacity(raw.len());
    let mut unreadable = Vec::new();
    for (id, message_id, exchange, routing_key, properties, body, attempts, written, tp, ts, bg) in
        raw
    {
        match parse_properties(&properties) {
            Ok(properties) => rows.push(OutboxRow {
                id,
                message_id,
                exchange,
                routing_key,
                properties,
                body,
                attempts,
                written_at: written.and_then(DateTime::from_timestamp_millis),
                trace: TraceContext::from_parts(tp.as_deref(), ts.as_deref(), bg.as_deref()),
            }),
            Err(e) => unreadable.push((id, RowOutcome::Failed(e))),
        }
    }
    (rows, unreadable)
}

/// Turns failed rows as selected into [`FailedRow`]s.
pub(crate) fn failed_from_raw(raw: Vec<RawFailedRow>) -> Vec<FailedRow> {
    raw.into_iter()
        .map(
            |(id, message_id, exchange, routing_key, last_error, attempts)| FailedRow {
                id,
                message_id,
                exchange,
                routing_key,
                last_error: last_error.unwrap_or_default(),
                attempts,
            },
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outgoing::OutgoingFormat;

    /// A row written before formats existed has no `format` and is warren's
    /// envelope; a row in warren's envelope is still written without one, so
    /// a relay of the version before reads it too.
    #[test]
    fn rows_without_a_format_are_warrens_envelope_and_new_ones_say_theirs() {
        let old = r#"{"eventType":"t.v1","correlationId":"c","timestamp":1,"headers":{}}"#;
        let read = parse_properties(old).unwrap();
        assert_eq!(read.format, WireFormat::Warren);
        let props = read.to_amqp("m-1").unwrap();
        assert_eq!(
            props.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );

        let warren = Outgoing::new("t.v1", 1, &1).unwrap();
        let stored = serde_json::to_string(&StoredProperties::of(&warren)).unwrap();
        assert!(!stored.contains("format"), "{stored}");

        let event = warren.with_format(OutgoingFormat::cloud_events_structured("urn:t"));
        let stored = serde_json::to_string(&StoredProperties::of(&event)).unwrap();
        assert!(
            stored.contains(r#""format":"cloudevents-structured""#),
            "{stored}"
        );
        let props = parse_properties(&stored).unwrap().to_amqp("m-1").unwrap();
        assert_eq!(
            props.content_type().as_ref().unwrap().as_str(),
            "application/cloudevents+json"
        );
        // A format a later version wrote and this one does not know is not
        // published as something else: the row fails, readably.
        let unknown = old.replace("\"headers\"", "\"format\":\"avro\",\"headers\"");
        assert!(parse_properties(&unknown).is_err());
    }
}
