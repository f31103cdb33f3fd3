//! [`ConsumerConfig`](crate::ConsumerConfig): every setting of one consumer,
//! and what follows from them.

use std::time::Duration;

use super::*;
use crate::envelope::DEFAULT_MAX_BODY_BYTES;
use crate::partition::{Partitioning, partition_queue_name};
use crate::retry::RetryPolicy;
use crate::tls::TlsOptions;
use crate::topology::{BindingSpec, QueueType, dead_letter_queue_name, retry_queue_name};

/// Everything that defines one consumer, checked: build it with
/// [`ConsumerConfig::builder`], whose [`build`](ConsumerConfigBuilder::build) says
/// which setting is wrong and why.
///
/// ```
/// use warren::ConsumerConfig;
/// use warren::retry::RetryPolicy;
///
/// let config = ConsumerConfig::builder("billing", "billing.invoice-paid")
///     .bind("billing.events", ["billing.invoice-paid.*"])
///     .with_prefetch(64)
///     .with_concurrency(16)
///     .with_retry(RetryPolicy::default().with_max_attempts(4))
///     .build()?;
/// assert_eq!(config.prefetch(), 64);
///
/// let wrong = ConsumerConfig::builder("billing", "billing.invoice-paid")
///     .with_prefetch(4)
///     .with_concurrency(8)
///     .build()
///     .unwrap_err();
/// assert_eq!(wrong.field(), "concurrency");
/// # Ok::<(), warren::config::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// The consumer's name: its deduplication boundary in the inbox. Two consumers
    /// with different names each apply a message once.
    pub(crate) name: String,
    /// The queue consumed from.
    pub(crate) queue: String,
    /// The topic exchange the queue is bound to, if any.
    pub(crate) exchange: Option<String>,
    /// Binding keys from the exchange to the queue.
    pub(crate) binding_keys: Vec<String>,
    /// Exchanges the handlers publish to through the outbox, declared at start.
    pub(crate) outgoing: Vec<String>,
    /// Stand-in queues for downstream consumers, declared at start.
    pub(crate) stand_ins: Vec<BindingSpec>,
    /// Queue type of the main and dead-letter queues.
    pub(crate) queue_type: QueueType,
    /// Broker prefetch (unacknowledged deliveries in flight to this consumer).
    pub(crate) prefetch: u16,
    /// Batches (database transactions) processed at once.
    pub(crate) concurrency: usize,
    /// Largest number of already-buffered deliveries applied in one transaction.
    pub(crate) batch_size: usize,
    /// Wall time after which a batch commits what it applied so far; `None`:
    /// the store's default (a limit on SQLite only).
    pub(crate) batch_time_limit: Option<Duration>,
    /// How one message's failure is kept from the others of its batch.
    pub(crate) batch_isolation: BatchIsolation,
    /// Longest wait for a row lock in a transaction over several messages.
    pub(crate) batch_lock_timeout: Duration,
    /// Immediate reruns of a message alone after a lock conflict.
    pub(crate) conflict_retries: u32,
    /// Largest accepted body, in bytes.
    pub(crate) max_body_bytes: usize,
    /// The formats deliveries are read in, in the order they are tried.
    pub(crate) formats: crate::format::Formats,
    /// What the delivery journal records besides the outcomes of replayed
    /// copies (always journaled: careful replay depends on them).
    pub(crate) journal: JournalMode,
    /// How long journal rows are kept: the consumer deletes older ones.
    pub(crate) journal_retention: Option<Duration>,
    /// How long in-flight messages may take to finish after shutdown is requested.
    pub(crate) shutdown_timeout: Duration,
    /// Delay tiers, attempt limit and poison limit.
    pub(crate) retry: RetryPolicy,
    /// Wait before a delivery is returned when its outcome could not be recorded.
    pub(crate) failure_backoff: Duration,
    /// How often queue depth and consumer counts are read for the metrics.
    pub(crate) queue_metrics_interval: Duration,
    /// How often the consumer logs, at INFO, how many deliveries ended in
    /// each outcome since the last such line; zero for never.
    pub(crate) summary_interval: Duration,
    /// The broker's `consumer_timeout` (RabbitMQ's default is 30 minutes): a
    /// delivery unacked for that long makes the broker close the channel.
    pub(crate) consumer_timeout: Duration,
    /// Share of `consumer_timeout` after which a still-running handler is logged
    /// as a warning (default 0.5).
    pub(crate) timeout_warning_share: f64,
    /// How long a suspect may run alone before the run counts like a crash.
    pub(crate) solo_timeout: Duration,
    /// How `amqps://` connections verify the broker and authenticate (a private
    /// CA, a client certificate). Ignored by `amqp://` URLs, unless set: then the
    /// connect fails rather than run unencrypted.
    pub(crate) tls: TlsOptions,
    /// Partition queues behind a consistent-hash exchange, if partitioned.
    pub(crate) partitions: Option<Partitioning>,
    /// The queue has one active consumer at a time (a partition queue).
    pub(crate) single_active_consumer: bool,
    /// What puts deliveries in the same ordered lane, if anything.
    pub(crate) lanes: Option<LaneKey>,
    /// How long a strict-sequence gap may wait for the versions before it.
    pub(crate) gap_patience: Option<Duration>,
}

impl ConsumerConfig {
    /// A consumer named `name` on `queue`, with the defaults: quorum queues,
    /// prefetch 256, concurrency 8, batches of up to 32, 1 MiB bodies, 30 s
    /// shutdown deadline.
    pub fn builder(name: impl Into<String>, queue: impl Into<String>) -> ConsumerConfigBuilder {
        ConsumerConfigBuilder {
            config: Self {
                name: name.into(),
                queue: queue.into(),
                exchange: None,
                binding_keys: Vec::new(),
                outgoing: Vec::new(),
                stand_ins: Vec::new(),
                queue_type: QueueType::default(),
                prefetch: DEFAULT_PREFETCH,
                concurrency: DEFAULT_CONCURRENCY,
                batch_size: DEFAULT_BATCH_SIZE,
                batch_time_limit: None,
                batch_isolation: BatchIsolation::Replay,
                batch_lock_timeout: DEFAULT_BATCH_LOCK_TIMEOUT,
                conflict_retries: DEFAULT_CONFLICT_RETRIES,
                max_body_bytes: DEFAULT_MAX_BODY_BYTES,
                formats: crate::format::Formats::default(),
                journal: JournalMode::Outcomes,
                journal_retention: Some(DEFAULT_JOURNAL_RETENTION),
                shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
                retry: RetryPolicy::default(),
                failure_backoff: DEFAULT_FAILURE_BACKOFF,
                queue_metrics_interval: Duration::from_secs(15),
                summary_interval: DEFAULT_SUMMARY_INTERVAL,
                consumer_timeout: Duration::from_secs(30 * 60),
                timeout_warning_share: 0.5,
                solo_timeout: DEFAULT_SOLO_TIMEOUT,
                tls: TlsOptions::default(),
                partitions: None,
                single_active_consumer: false,
                lanes: None,
                gap_patience: None,
            },
        }
    }

    /// A builder that starts from this configuration, to derive a variant.
    pub fn to_builder(&self) -> ConsumerConfigBuilder {
        ConsumerConfigBuilder {
            config: self.clone(),
        }
    }

    /// The consumer's name: its deduplication boundary in the inbox. Two consumers
    /// with different names each apply a message once.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The queue consumed from.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The exchange the queue is bound to, if any.
    pub fn exchange(&self) -> Option<&str> {
        self.exchange.as_deref()
    }

    /// The binding keys from the exchange to the queue.
    pub fn binding_keys(&self) -> &[String] {
        &self.binding_keys
    }

    /// The exchanges the handlers publish to through the outbox.
    pub fn outgoing(&self) -> &[String] {
        &self.outgoing
    }

    /// The stand-in queues declared at start for downstream consumers.
    pub fn stand_ins(&self) -> &[BindingSpec] {
        &self.stand_ins
    }

    /// Whether the queue has one active consumer at a time (a partition
    /// queue's consumer).
    pub fn single_active_consumer(&self) -> bool {
        self.single_active_consumer
    }

    /// The queue type of the main and dead-letter queues.
    pub fn queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// The broker prefetch.
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }

    /// How many batches (each one database transaction) are processed at once.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The largest number of deliveries applied in one transaction: the
    /// configured batch size, never more than the prefetch, and with
    /// savepoints never more than the subtransactions allow.
    pub fn batch_size(&self) -> usize {
        let size = self.batch_size.min(usize::from(self.prefetch)).max(1);
        match self.batch_isolation {
            BatchIsolation::Replay => size,
            BatchIsolation::Savepoints { handler_savepoints } => {
                let per_message = handler_savepoints.saturating_add(1);
                size.min((MAX_SUBTRANSACTIONS / per_message).max(1) as usize)
            }
        }
    }

    /// How one message's failure is kept from the others of its batch.
    pub fn batch_isolation(&self) -> BatchIsolation {
        self.batch_isolation
    }

    /// The wall time after which a batch commits what it applied so far, if
    /// it was set; `None` leaves it to the store: SQLite, whose one writer
    /// waits behind a batch, limits it to
    /// [`DEFAULT_BATCH_TIME_LIMIT`](crate::config::DEFAULT_BATCH_TIME_LIMIT);
    /// PostgreSQL and MySQL do not.
    pub fn batch_time_limit(&self) -> Option<Duration> {
        self.batch_time_limit
    }

    /// The longest a transaction over several messages waits for a row lock
    /// before the wait fails as a lock conflict.
    pub fn batch_lock_timeout(&self) -> Duration {
        self.batch_lock_timeout
    }

    /// How many times a message that ran into a lock conflict alone runs again
    /// at once before the conflict counts as a transient failure.
    pub fn conflict_retries(&self) -> u32 {
        self.conflict_retries
    }

    /// What the delivery journal records.
    pub fn journal(&self) -> JournalMode {
        self.journal
    }

    /// The largest accepted body, in bytes.
    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    /// The formats deliveries are read in, in the order they are tried.
    pub fn formats(&self) -> &crate::format::Formats {
        &self.formats
    }

    /// How long in-flight messages may take to finish after shutdown is requested.
    pub fn shutdown_timeout(&self) -> Duration {
        self.shutdown_timeout
    }

    /// Delay tiers, attempt limit and poison limit.
    pub fn retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The TLS options for `amqps://`.
    pub fn tls(&self) -> &TlsOptions {
        &self.tls
    }

    /// How long a suspect may run alone before the run counts like a crash.
    pub fn solo_timeout(&self) -> Duration {
        self.solo_timeout
    }

    /// The broker's `consumer_timeout` this consumer assumes.
    pub fn consumer_timeout(&self) -> Duration {
        self.consumer_timeout
    }

    /// The partitioning, if the consumer is partitioned.
    pub fn partitions(&self) -> Option<&Partitioning> {
        self.partitions.as_ref()
    }

    /// The partition queues' names, in partition order (empty if not
    /// partitioned).
    pub fn partition_queues(&self) -> Vec<String> {
        match &self.partitions {
            Some(p) => (0..p.count)
                .map(|i| partition_queue_name(&self.queue, i))
                .collect(),
            None => Vec::new(),
        }
    }

    /// What puts deliveries in ordered lanes: the configured key, or for a
    /// partitioned consumer its partition header.
    pub fn lanes(&self) -> Option<LaneKey> {
        self.lanes.clone().or_else(|| {
            self.partitions
                .as_ref()
                .map(|p| LaneKey::Header(p.header.clone()))
        })
    }

    /// How long a strict-sequence gap waits for the versions before it before
    /// the message is dead-lettered as `version-gap`: the configured value, or
    /// twice the retry horizon, at least a minute, so that a predecessor can go
    /// through its whole retry ladder first.
    pub fn gap_patience(&self) -> Duration {
        self.gap_patience.unwrap_or_else(|| {
            self.retry
                .horizon()
                .saturating_mul(2)
                .max(Duration::from_secs(60))
        })
    }

    /// The configuration of partition `index`: its own queue, retry tiers and
    /// dead-letter queue, bound to nothing (the hash exchange's bindings are
    /// declared once, by the partitioned consumer).
    pub(crate) fn for_partition(&self, index: u32) -> Self {
        let mut config = self.clone();
        config.queue = partition_queue_name(&self.queue, index);
        config.exchange = None;
        config.binding_keys = Vec::new();
        config.stand_ins = Vec::new();
        config.single_active_consumer = true;
        config
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue(&self) -> String {
        dead_letter_queue_name(&self.queue)
    }

    /// The retry queue's name for a tier.
    pub fn retry_queue(&self, delay: Duration) -> String {
        retry_queue_name(&self.queue, delay)
    }
}

/// How long delivery-journal rows are kept by default: 30 days.
pub const DEFAULT_JOURNAL_RETENTION: Duration = Duration::from_secs(30 * 86_400);

/// What the delivery journal (`warren_journal`) records. The outcome of a
/// replayed copy (one that carries `x-warren-replay-id`) is journaled in
/// every mode: careful replay continues on it. An applied outcome is its
/// inbox row, and costs the journal nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JournalMode {
    /// Every outcome that is not an applied one: duplicate, stale, retried,
    /// parked, dead-lettered, returned, forwarded. Written in batches off the
    /// delivery path. The default.
    Outcomes,
    /// Also a row for each applied outcome, written in its transaction.
    Everything,
    /// Only the outcomes of replayed copies.
    ReplaysOnly,
}
