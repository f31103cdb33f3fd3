//! A consumer's configuration: its queue and the topology around it, prefetch and
//! concurrency, retries, deadlines; checked in one place.

use std::time::Duration;

mod builder;
mod isolation;
mod layout;
pub(crate) mod settings;
mod validate;
pub use builder::ConsumerConfigBuilder;
pub use isolation::{BatchIsolation, MAX_SUBTRANSACTIONS};
pub(crate) use settings::ConsumerConfig;
pub use settings::{DEFAULT_JOURNAL_RETENTION, JournalMode};

pub use crate::config_error::ConfigError;

/// Default number of unacknowledged deliveries the broker may push to one
/// consumer. Chosen from `billing bench --sweep` (docs/performance.md): 256
/// lets batches fill (32 shared by 8 transactions made batches of 4 to 8) and
/// held acks leave room; billing drained 2.5 times as fast as at 32 with the
/// end-to-end p99 at 500/s unchanged. A crash returns up to this many
/// deliveries; those whose claim committed settle as duplicates without a
/// solo run.
pub const DEFAULT_PREFETCH: u16 = 256;
/// Default number of batches (database transactions) processed at once.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default largest number of deliveries applied in one database transaction.
pub const DEFAULT_BATCH_SIZE: usize = 32;
/// Default wall time, on SQLite, after which a batch stops taking its next
/// message and commits what it applied: bounds how long one batch holds the
/// write lock. PostgreSQL and MySQL have no limit unless one is set.
pub const DEFAULT_BATCH_TIME_LIMIT: Duration = crate::store::dialect::ONE_WRITER_BATCH_TIME_LIMIT;
/// Default longest wait for a row lock inside a transaction over several
/// messages: past it the wait fails as a lock conflict and the batch is split.
/// Measured with `cargo bench --bench hot_rows` (docs/performance.md, "Lock conflicts"):
/// 100 ms made batches at prefetch 32 on PostgreSQL 1.6 times slower than
/// batching turned off, 25 ms as fast.
pub const DEFAULT_BATCH_LOCK_TIMEOUT: Duration = Duration::from_millis(25);
/// The longest batch lock timeout accepted.
pub const MAX_BATCH_LOCK_TIMEOUT: Duration = Duration::from_secs(60);
/// Default number of times a message that ran into a lock conflict alone runs
/// again at once, before the conflict counts as a transient failure.
pub const DEFAULT_CONFLICT_RETRIES: u32 = 5;
/// The most conflict retries accepted.
pub const MAX_CONFLICT_RETRIES: u32 = 100;
/// The largest batch size accepted.
pub const MAX_BATCH_SIZE: usize = 1000;
/// Default time in-flight messages get to finish after shutdown is requested.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default interval of the consumer's INFO line counting each outcome.
pub const DEFAULT_SUMMARY_INTERVAL: Duration = Duration::from_secs(60);
/// Default deadline of a suspect's solo run: past it, the run counts like a crash.
pub const DEFAULT_SOLO_TIMEOUT: Duration = Duration::from_secs(60);
/// Default wait before returning a delivery whose outcome could not be recorded
/// (retry or dead-letter queue unreachable), so that nothing spins hot.
pub const DEFAULT_FAILURE_BACKOFF: Duration = Duration::from_secs(2);

/// What decides that two deliveries belong to the same entity and must run one
/// after the other, in the order they arrived.
#[derive(Clone)]
pub enum LaneKey {
    /// The value of this AMQP header (a string).
    Header(String),
    /// A function of the delivery; `None` puts it in no lane.
    Function(LaneFn),
}

impl std::fmt::Debug for LaneKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LaneKey::Header(h) => f.debug_tuple("Header").field(h).finish(),
            LaneKey::Function(_) => f.write_str("Function(..)"),
        }
    }
}

/// A function that puts a delivery in a lane (`Some(key)`) or in none.
pub type LaneFn = std::sync::Arc<dyn Fn(&LaneInput<'_>) -> Option<String> + Send + Sync>;

/// What a lane function sees of a delivery, before it is parsed.
#[derive(Debug)]
pub struct LaneInput<'a> {
    pub(crate) headers: Option<&'a lapin::types::FieldTable>,
    pub(crate) routing_key: &'a str,
    pub(crate) body: &'a [u8],
}

impl<'a> LaneInput<'a> {
    /// A header's value, if it is a string.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .and_then(|h| crate::amqp::header_str(h, name))
            .map(|c| c.into_owned())
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        self.routing_key
    }

    /// The raw body (the envelope's JSON).
    pub fn body(&self) -> &[u8] {
        self.body
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ConsumerConfig;
    use crate::topology::{
        ArgValue, BindingSpec, QueueSpec, QueueType, Topology, UNBOUNDED_DELIVERY_LIMIT,
    };

    fn arg(q: &QueueSpec, name: &str) -> ArgValue {
        q.arguments[name].clone()
    }

    fn s(v: &str) -> ArgValue {
        ArgValue::Str(v.into())
    }

    #[test]
    fn consumer_topology_has_exchange_queue_binding_tiers_and_dead_letter_queue() {
        let config = ConsumerConfig::builder("billing", "p.invoice-paid")
            .bind("p.events", ["billing.invoice-paid.*"])
            .build()
            .unwrap();
        let t = Topology::for_consumer(&config);
        assert_eq!(t.exchanges.len(), 1);
        assert_eq!(t.exchanges[0].name, "p.events");
        assert_eq!(
            t.queue_names().collect::<Vec<_>>(),
            [
                "p.invoice-paid",
                "p.invoice-paid.retry.5s",
                "p.invoice-paid.retry.30s",
                "p.invoice-paid.retry.2m",
                "p.invoice-paid.retry.10m",
                "p.invoice-paid.retry.30m",
                "p.invoice-paid.dead-letter"
            ]
        );
        let main = &t.queues[0];
        // Prefetch 256 times (poison limit 5 + 1).
        assert_eq!(arg(main, "x-delivery-limit"), ArgValue::Int(1536));
        assert_eq!(
            arg(main, "x-dead-letter-routing-key"),
            s("p.invoice-paid.dead-letter")
        );
        assert_eq!(arg(main, "x-overflow"), s("reject-publish"));
        let tier = &t.queues[1];
        assert_eq!(arg(tier, "x-message-ttl"), ArgValue::Int(5000));
        assert_eq!(arg(tier, "x-dead-letter-exchange"), s(""));
        assert_eq!(arg(tier, "x-dead-letter-routing-key"), s("p.invoice-paid"));
        assert_eq!(arg(tier, "x-dead-letter-strategy"), s("at-least-once"));
        assert_eq!(
            t.bindings,
            [BindingSpec {
                exchange: "p.events".into(),
                queue: "p.invoice-paid".into(),
                routing_key: "billing.invoice-paid.*".into()
            }]
        );
        assert_eq!(arg(main, "x-queue-type"), s("quorum"));
        for q in &t.queues[1..] {
            assert_eq!(
                arg(q, "x-delivery-limit"),
                ArgValue::Int(UNBOUNDED_DELIVERY_LIMIT),
                "{} has an explicit limit",
                q.name
            );
        }
    }

    #[test]
    fn outgoing_exchanges_and_stand_in_queues_are_declared_with_the_consumer() {
        let config = ConsumerConfig::builder("billing", "p.invoice-paid")
            .bind("p.events", ["billing.invoice-paid.*"])
            .publishes_to("p.audit")
            .with_stand_in_queue("p.events", "p.recorded", "billing.recorded.*")
            .build()
            .unwrap();
        let t = Topology::for_consumer(&config);
        let exchanges: Vec<_> = t.exchanges.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(exchanges, ["p.events", "p.audit"], "each declared once");
        assert!(t.queue_names().any(|q| q == "p.recorded"));
        assert!(t.bindings.contains(&BindingSpec {
            exchange: "p.events".into(),
            queue: "p.recorded".into(),
            routing_key: "billing.recorded.*".into(),
        }));
    }

    #[test]
    fn classic_queues_have_no_quorum_only_arguments() {
        let config = ConsumerConfig::builder("c", "q")
            .with_queue_type(QueueType::Classic)
            .build()
            .unwrap();
        let t = Topology::for_consumer(&config);
        for q in &t.queues {
            assert_eq!(arg(q, "x-queue-type"), s("classic"));
            for quorum_only in ["x-delivery-limit", "x-dead-letter-strategy", "x-overflow"] {
                assert!(
                    !q.arguments.contains_key(quorum_only),
                    "{} has {quorum_only}",
                    q.name
                );
            }
        }
        assert_eq!(arg(&t.queues[1], "x-dead-letter-routing-key"), s("q"));
    }
}
