//! Partitioned consumption: one entity's messages always reach the same queue,
//! and one instance at a time consumes each queue.
//!
//! A partitioned consumer declares a consistent-hash exchange (the
//! `rabbitmq_consistent_hash_exchange` plugin) that hashes on a header carrying
//! the partition key, and `count` partition queues `queue.0 .. queue.N-1`, each
//! with single active consumer, its own retry tiers and dead-letter queue. The
//! source exchange is bound to the hash exchange.
//!
//! - **Stable map.** The hash ring numbers its buckets in the order bindings
//!   were added, so the bindings are declared once, in partition order, when the
//!   hash exchange is created, and never again. At start warren checks that
//!   every partition queue exists (a deleted queue took its binding with it and
//!   renumbered the ring) and that no queue beyond the count does, and stops
//!   with an error instead of running out of order. A node restart can still
//!   rebuild the ring in another order (the plugin keeps it in memory), which
//!   no start check sees: so every delivery is checked against the partition
//!   its key hashes to, and one in the wrong queue is forwarded to its own, in
//!   order (see `pipeline::settle`).
//! - **Spreading.** Single active consumer never rebalances on RabbitMQ 3.x, so
//!   instances share the partitions through leases in the database (table
//!   `warren_partition_leases`): each takes its fair share, renews it, and
//!   hands a partition over by draining it first. Single active consumer stays as the safety net.
//! - **The key.** Sent as an AMQP long string (the hash covers the field type).
//!   A message without it is dead-lettered as `invalid-partition-key`.

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};

pub(crate) mod lease;
mod ring;

pub use ring::partition_of;

/// The header the partition key travels in, unless configured otherwise.
pub const DEFAULT_PARTITION_HEADER: &str = crate::headers::HEADER_PARTITION_KEY;

/// How long a partition lease lasts unrenewed, unless configured otherwise:
/// an instance that dies silently gives its partitions up after this long.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(15);

/// Partitions allowed on one consumer.
pub const MAX_PARTITIONS: u32 = 1024;

/// How a consumer is partitioned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitioning {
    /// The consistent-hash exchange.
    pub exchange: String,
    /// Number of partition queues.
    pub count: u32,
    /// The header the hash exchange hashes on.
    pub header: String,
    /// How long a lease lasts unrenewed.
    pub lease_ttl: Duration,
}

/// One partition queue's place among the others, known once its consumer
/// runs: its number, the queue every partition queue is named after (so that
/// a delivery that belongs in another partition can be sent there), and
/// whether the broker's hash ring was found to route as warren predicts (only
/// then is each delivery checked against its partition).
#[derive(Debug, Clone)]
pub(crate) struct Seat {
    pub(crate) index: u32,
    pub(crate) base_queue: String,
    pub(crate) hash_verified: bool,
}

impl Seat {
    /// The queue of partition `index` among this one's.
    pub(crate) fn queue_of(&self, index: u32) -> String {
        partition_queue_name(&self.base_queue, index)
    }
}

/// The name of partition `index` of `queue`: `queue.index`.
pub fn partition_queue_name(queue: &str, index: u32) -> String {
    format!("{queue}.{index}")
}

/// Why a delivery's partition key cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// No header, an empty one, or one of another AMQP type.
    Invalid(String),
}

/// The partition key of a delivery: the `header` as a non-empty AMQP long
/// string. Another type would hash differently from what producers are told to
/// send, so it is refused, not converted.
pub(crate) fn key_of(headers: Option<&FieldTable>, header: &str) -> Result<String, KeyError> {
    let value = headers.and_then(|h| h.inner().get(header));
    match value {
        None => Err(KeyError::Invalid(format!(
            "the {header:?} header is missing; a partitioned consumer needs it to keep one \
             entity's messages in one partition"
        ))),
        Some(AMQPValue::LongString(s)) => {
            let key = String::from_utf8_lossy(s.as_bytes()).into_owned();
            if key.is_empty() {
                Err(KeyError::Invalid(format!("the {header:?} header is empty")))
            } else {
                Ok(key)
            }
        }
        Some(other) => Err(KeyError::Invalid(format!(
            "the {header:?} header must be an AMQP long string, got {}; the hash exchange \
             hashes the field type too",
            amqp_type_name(other)
        ))),
    }
}

fn amqp_type_name(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::ShortString(_) => "a short string",
        AMQPValue::LongString(_) => "a long string",
        AMQPValue::Boolean(_) => "a boolean",
        AMQPValue::FieldTable(_) => "a table",
        AMQPValue::FieldArray(_) => "an array",
        AMQPValue::Void => "void",
        _ => "a number or timestamp",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: AMQPValue) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("partition-key".into(), value);
        t
    }

    #[test]
    fn the_key_is_a_non_empty_long_string() {
        let ok = headers(AMQPValue::LongString("cus_1".into()));
        assert_eq!(key_of(Some(&ok), "partition-key"), Ok("cus_1".into()));
        assert!(key_of(None, "partition-key").is_err());
        let empty = headers(AMQPValue::LongString("".into()));
        assert!(key_of(Some(&empty), "partition-key").is_err());
        let short = headers(AMQPValue::ShortString("cus_1".into()));
        let KeyError::Invalid(why) = key_of(Some(&short), "partition-key").unwrap_err();
        assert!(why.contains("long string"), "{why}");
    }
}
