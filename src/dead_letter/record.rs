//! The dead-letter record: headers a dead-lettered copy carries, written by the
//! consumer and read back by operators' tools.

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::amqp::{PERSISTENT, header_int, header_str, text, time, truncate};
use crate::headers::{
    HEADER_ATTEMPT, HEADER_ATTEMPTS, HEADER_CONSUMER, HEADER_ERROR, HEADER_EVENT_TYPE,
    HEADER_FIRST_FAILURE, HEADER_FORMAT, HEADER_LAST_FAILURE, HEADER_MESSAGE_KEY,
    HEADER_ORIGINAL_EXCHANGE, HEADER_ORIGINAL_ROUTING_KEY, HEADER_QUEUE, HEADER_REASON,
    MAX_ERROR_LEN,
};

/// What a dead-lettered copy records about its failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterInfo {
    /// Reason name, e.g. `invalid-json`.
    pub reason: String,
    /// Error text.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
    /// Exchange of the original publish.
    pub original_exchange: String,
    /// Routing key of the original publish.
    pub original_routing_key: String,
    /// Consumer name.
    pub consumer: String,
    /// Queue consumed from.
    pub queue: String,
    /// First failure time.
    pub first_failure: Option<DateTime<Utc>>,
    /// Last failure time.
    pub last_failure: Option<DateTime<Utc>>,
    /// The id warren knew the message by, if it was read
    /// ([`Identity::key`](crate::format::Identity::key)); empty if it was
    /// refused before (then the AMQP `message_id` is all there is).
    pub message_key: String,
    /// The format it was read in; empty if it was refused before.
    pub format: String,
    /// Its event type as read; empty if it was refused before.
    pub event_type: String,
}

impl DeadLetterInfo {
    /// The properties of the dead-letter copy: the original's, persistent, with
    /// this record added to its headers. The first-failure time already on the
    /// message (from earlier attempts) is kept.
    pub fn apply_to(&self, original: &BasicProperties) -> BasicProperties {
        let mut headers = original.headers().clone().unwrap_or_default();
        let now = self.last_failure.unwrap_or_else(Utc::now);
        let first = header_str(&headers, HEADER_FIRST_FAILURE)
            .and_then(|s| DateTime::parse_from_rfc3339(&s).ok())
            .map(|t| t.with_timezone(&Utc))
            .or(self.first_failure)
            .unwrap_or(now);
        let entries: [(&str, AMQPValue); 9] = [
            (HEADER_REASON, text(&self.reason)),
            (HEADER_ERROR, text(truncate(&self.error, MAX_ERROR_LEN))),
            (
                HEADER_ATTEMPTS,
                AMQPValue::LongLongInt(self.attempts.into()),
            ),
            (HEADER_ORIGINAL_EXCHANGE, text(&self.original_exchange)),
            (
                HEADER_ORIGINAL_ROUTING_KEY,
                text(&self.original_routing_key),
            ),
            (HEADER_CONSUMER, text(&self.consumer)),
            (HEADER_QUEUE, text(&self.queue)),
            (HEADER_FIRST_FAILURE, time(first)),
            (HEADER_LAST_FAILURE, time(now)),
        ];
        for (k, v) in entries {
            headers.insert(ShortString::from(k), v);
        }
        for (k, v) in [
            (HEADER_MESSAGE_KEY, &self.message_key),
            (HEADER_FORMAT, &self.format),
            (HEADER_EVENT_TYPE, &self.event_type),
        ] {
            if !v.is_empty() {
                headers.insert(ShortString::from(k), text(v));
            }
        }
        // A per-message TTL from the producer would make the copy expire from
        // the dead-letter queue, which has nowhere to send it: dropped. So is the
        // user id, which the broker checks against the publishing connection.
        crate::headers::rebuild(original, false)
            .with_headers(headers)
            .with_delivery_mode(PERSISTENT)
    }

    /// Reads the record back from a dead-lettered message's properties. A copy the
    /// broker dead-lettered itself at the queue's delivery limit (the poison
    /// backstop) reads as reason `poison`. `None` if the message carries neither.
    pub fn from_properties(properties: &BasicProperties) -> Option<Self> {
        let headers = properties.headers().as_ref()?;
        if header_str(headers, HEADER_REASON).is_none() {
            return broker_dead_lettered(headers);
        }
        let s = |name| {
            header_str(headers, name)
                .map(|c| c.into_owned())
                .unwrap_or_default()
        };
        let t = |name| {
            header_str(headers, name)
                .and_then(|v| DateTime::parse_from_rfc3339(&v).ok())
                .map(|v| v.with_timezone(&Utc))
        };
        Some(Self {
            reason: header_str(headers, HEADER_REASON)?.into_owned(),
            error: s(HEADER_ERROR),
            attempts: header_int(headers, HEADER_ATTEMPTS)
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0),
            original_exchange: s(HEADER_ORIGINAL_EXCHANGE),
            original_routing_key: s(HEADER_ORIGINAL_ROUTING_KEY),
            consumer: s(HEADER_CONSUMER),
            queue: s(HEADER_QUEUE),
            first_failure: t(HEADER_FIRST_FAILURE),
            last_failure: t(HEADER_LAST_FAILURE),
            message_key: s(HEADER_MESSAGE_KEY),
            format: s(HEADER_FORMAT),
            event_type: s(HEADER_EVENT_TYPE),
        })
    }
}

/// A letter's message id and event type as its consumer read them (a
/// derived key or a CloudEvent's has no AMQP `message_id` or `type` to
/// show), else the AMQP `message_id` and `type` of `properties`.
pub fn id_and_type(
    info: Option<&DeadLetterInfo>,
    properties: &BasicProperties,
) -> (String, String) {
    let read_as = |field: fn(&DeadLetterInfo) -> &String, property: &Option<ShortString>| {
        info.map(field)
            .filter(|v| !v.is_empty())
            .cloned()
            .unwrap_or_else(|| property.as_ref().map(|s| s.to_string()).unwrap_or_default())
    };
    (
        read_as(|i| &i.message_key, properties.message_id()),
        read_as(|i| &i.event_type, properties.kind()),
    )
}

/// The record of a message the broker dead-lettered at the delivery limit.
fn broker_dead_lettered(headers: &FieldTable) -> Option<DeadLetterInfo> {
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
        return None;
    };
    let death = deaths.as_slice().iter().find_map(|d| match d {
        AMQPValue::FieldTable(t)
            if header_str(t, "reason").as_deref() == Some("delivery_limit") =>
        {
            Some(t)
        }
        _ => None,
    })?;
    let queue = header_str(death, "queue")
        .map(|c| c.into_owned())
        .unwrap_or_default();
    let when = match death.inner().get("time") {
        Some(AMQPValue::Timestamp(t)) => DateTime::from_timestamp(i64::try_from(*t).ok()?, 0),
        _ => None,
    };
    Some(DeadLetterInfo {
        reason: crate::failure::DeadLetterReason::Poison.as_str().to_owned(),
        error: "the broker's delivery limit was reached".to_owned(),
        attempts: header_int(headers, HEADER_ATTEMPT)
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(0),
        original_exchange: header_str(headers, HEADER_ORIGINAL_EXCHANGE)
            .map(|c| c.into_owned())
            .unwrap_or_default(),
        original_routing_key: header_str(headers, HEADER_ORIGINAL_ROUTING_KEY)
            .map(|c| c.into_owned())
            .unwrap_or_default(),
        consumer: String::new(),
        queue,
        first_failure: when,
        last_failure: when,
        message_key: String::new(),
        format: String::new(),
        event_type: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_through_properties_and_keeps_original_headers() {
        let mut original_headers = FieldTable::default();
        original_headers.insert("tenant".into(), text("acme"));
        let original = BasicProperties::default()
            .with_message_id("m1".into())
            .with_expiration("60000".into())
            .with_user_id("A".into())
            .with_priority(3)
            .with_headers(original_headers);
        let info = DeadLetterInfo {
            reason: "invalid-json".into(),
            error: "é".repeat(MAX_ERROR_LEN),
            attempts: 1,
            original_exchange: "ex".into(),
            original_routing_key: "rk".into(),
            consumer: "c".into(),
            queue: "q".into(),
            first_failure: None,
            last_failure: Some(Utc::now()),
            message_key: "~ce:ab".into(),
            format: "cloudevents".into(),
            event_type: "shop.order-placed.v1".into(),
        };
        let props = info.apply_to(&original);
        assert_eq!(props.message_id().as_ref().unwrap().as_str(), "m1");
        assert_eq!(*props.delivery_mode(), Some(PERSISTENT));
        assert_eq!(*props.expiration(), None, "a dead letter must not expire");
        assert_eq!(
            *props.user_id(),
            None,
            "the broker would refuse another user's id"
        );
        assert_eq!(*props.priority(), Some(3), "everything else is kept");
        let headers = props.headers().as_ref().unwrap();
        assert_eq!(header_str(headers, "tenant").unwrap(), "acme");
        let back = DeadLetterInfo::from_properties(&props).unwrap();
        assert_eq!(back.reason, "invalid-json");
        assert!(back.error.len() <= MAX_ERROR_LEN);
        assert_eq!(back.attempts, 1);
        assert_eq!(back.queue, "q");
        assert_eq!(back.first_failure, back.last_failure);
        assert_eq!(
            (
                back.message_key.as_str(),
                back.format.as_str(),
                back.event_type.as_str()
            ),
            ("~ce:ab", "cloudevents", "shop.order-placed.v1")
        );
    }
}
