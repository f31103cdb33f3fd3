//! Building a [`ConsumerConfig`]: every setting, checked when built.

use std::time::Duration;

use super::{ConsumerConfig, LaneInput, LaneKey};
use crate::config_error::ConfigError;
use crate::partition::{DEFAULT_LEASE_TTL, DEFAULT_PARTITION_HEADER, Partitioning};
use crate::retry::RetryPolicy;
use crate::tls::TlsOptions;
use crate::topology::{BindingSpec, QueueType};

/// Builds a [`ConsumerConfig`]; [`build`](Self::build) checks every setting.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ConsumerConfigBuilder {
    pub(super) config: ConsumerConfig,
}

impl ConsumerConfigBuilder {
    /// Binds the queue to the topic exchange `exchange` with each of `keys`.
    pub fn bind<I, K>(mut self, exchange: impl Into<String>, keys: I) -> Self
    where
        I: IntoIterator<Item = K>,
        K: Into<String>,
    {
        self.config.exchange = Some(exchange.into());
        self.config.binding_keys = keys.into_iter().map(Into::into).collect();
        self
    }

    /// Declares the topic exchange `exchange` at start, for the events the
    /// handlers publish there through the outbox. The relay publishes with
    /// `mandatory`: an event no queue is bound for becomes a failed outbox row,
    /// so the exchange, and a consumer's queue bound to it, must exist.
    pub fn publishes_to(mut self, exchange: impl Into<String>) -> Self {
        let exchange = exchange.into();
        if !self.config.outgoing.contains(&exchange) {
            self.config.outgoing.push(exchange);
        }
        self
    }

    /// Also declares `queue`, bound to `exchange` with `binding_key`, standing in
    /// for the downstream consumer of those events on a local or test run: the
    /// events then have a route and can be counted there. In production, the
    /// downstream service declares its own queue; leave this out.
    pub fn with_stand_in_queue(
        self,
        exchange: impl Into<String>,
        queue: impl Into<String>,
        binding_key: impl Into<String>,
    ) -> Self {
        let exchange = exchange.into();
        let mut config = self.publishes_to(exchange.clone());
        config.config.stand_ins.push(BindingSpec {
            exchange,
            queue: queue.into(),
            routing_key: binding_key.into(),
        });
        config
    }

    /// Sets the queue type.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.config.queue_type = queue_type;
        self
    }

    /// Sets the prefetch.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.config.prefetch = prefetch;
        self
    }

    /// Sets the concurrency.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.config.concurrency = concurrency;
        self
    }

    /// Sets the largest number of deliveries applied in one database
    /// transaction (default [`DEFAULT_BATCH_SIZE`](crate::config::DEFAULT_BATCH_SIZE);
    /// 1 turns batching off). A batch takes only deliveries the broker already
    /// sent, never waiting for more, so at low load batches hold one message.
    /// Never more than the prefetch.
    pub fn with_batch_size(mut self, size: usize) -> Self {
        self.config.batch_size = size;
        self
    }

    /// Sets how a batch keeps one failing message from undoing the others
    /// (default [`BatchIsolation::Replay`](crate::config::BatchIsolation::Replay):
    /// no savepoints).
    pub fn with_batch_isolation(mut self, isolation: crate::config::BatchIsolation) -> Self {
        self.config.batch_isolation = isolation;
        self
    }

    /// Sets the wall time after which a batch commits what it applied and leaves
    /// the rest to the next transaction, on every store. By default only
    /// SQLite has one
    /// ([`DEFAULT_BATCH_TIME_LIMIT`](crate::config::DEFAULT_BATCH_TIME_LIMIT)):
    /// a batch holds its one write lock until it commits, and this bounds how
    /// long the relay and other writers wait for it. On PostgreSQL and MySQL a
    /// batch locks only the rows it writes, and a limit would only take back
    /// claims (work thrown away) when the machine is busy.
    pub fn with_batch_time_limit(mut self, limit: Duration) -> Self {
        self.config.batch_time_limit = Some(limit);
        self
    }

    /// Sets the longest a transaction over several messages waits for a row
    /// lock (default
    /// [`DEFAULT_BATCH_LOCK_TIMEOUT`](crate::config::DEFAULT_BATCH_LOCK_TIMEOUT)).
    /// Past it the wait fails as a lock conflict, the batch is rolled back and
    /// split in halves that run again at once, at no cost of an attempt.
    /// PostgreSQL takes it to the millisecond (`lock_timeout`); MySQL and
    /// MariaDB in whole seconds, rounded up (`innodb_lock_wait_timeout`);
    /// SQLite has no such wait. A transaction of one message keeps the
    /// server's own timeouts.
    pub fn with_batch_lock_timeout(mut self, timeout: Duration) -> Self {
        self.config.batch_lock_timeout = timeout;
        self
    }

    /// Sets how many times a message that ran into a lock conflict (a
    /// deadlock, a serialization failure, a lock wait timeout) in a
    /// transaction of its own runs again at once, after a short random pause,
    /// before the conflict counts as a transient failure that uses an attempt
    /// (default [`DEFAULT_CONFLICT_RETRIES`](crate::config::DEFAULT_CONFLICT_RETRIES);
    /// 0 makes every conflict transient at once).
    pub fn with_conflict_retries(mut self, retries: u32) -> Self {
        self.config.conflict_retries = retries;
        self
    }

    /// Sets the body size limit.
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.config.max_body_bytes = bytes;
        self
    }

    /// Sets the formats this consumer reads, in the order they are tried
    /// (default: warren's envelope alone). A message selects only among
    /// these; see [`format`](crate::format).
    ///
    /// ```
    /// use warren::ConsumerConfig;
    /// use warren::format::{Bare, CloudEvents, Formats, WarrenEnvelope};
    /// let config = ConsumerConfig::builder("billing", "billing.invoice-paid")
    ///     .with_formats(Formats::new().then(CloudEvents::new()).then(WarrenEnvelope).then(Bare::new()))
    ///     .build()?;
    /// assert_eq!(config.formats().names(), ["cloudevents", "warren", "bare"]);
    /// # Ok::<(), warren::config::ConfigError>(())
    /// ```
    pub fn with_formats(mut self, formats: crate::format::Formats) -> Self {
        self.config.formats = formats;
        self
    }

    /// Sets what the delivery journal records (default
    /// [`JournalMode::Outcomes`](crate::config::JournalMode::Outcomes)).
    pub fn with_journal(mut self, mode: super::JournalMode) -> Self {
        self.config.journal = mode;
        self
    }

    /// Sets how long delivery-journal rows are kept (default
    /// [`DEFAULT_JOURNAL_RETENTION`](crate::config::DEFAULT_JOURNAL_RETENTION),
    /// 30 days); the consumer deletes older ones every hour. `None` keeps
    /// them.
    pub fn with_journal_retention(mut self, age: Option<Duration>) -> Self {
        self.config.journal_retention = age;
        self
    }

    /// Sets the shutdown deadline.
    pub fn with_shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.config.shutdown_timeout = timeout;
        self
    }

    /// Sets the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.config.retry = retry;
        self
    }

    /// Sets the backoff used when an outcome cannot be recorded.
    pub fn with_failure_backoff(mut self, delay: Duration) -> Self {
        self.config.failure_backoff = delay;
        self
    }

    /// Sets the broker's consumer timeout, for the long-handler warning.
    pub fn with_consumer_timeout(mut self, timeout: Duration) -> Self {
        self.config.consumer_timeout = timeout;
        self
    }

    /// Sets how often queue metrics are read.
    pub fn with_queue_metrics_interval(mut self, interval: Duration) -> Self {
        self.config.queue_metrics_interval = interval;
        self
    }

    /// Sets how often the consumer logs one INFO line with the count of each
    /// outcome since the last (default 60 s; zero for never). Each message's
    /// own line is at DEBUG when it went well: this line is what shows the
    /// service working at INFO.
    pub fn with_summary_interval(mut self, interval: Duration) -> Self {
        self.config.summary_interval = interval;
        self
    }

    /// Sets the share of the consumer timeout after which a still-running handler
    /// is logged as a warning (above 0, at most 1; default 0.5).
    pub fn with_timeout_warning_share(mut self, share: f64) -> Self {
        self.config.timeout_warning_share = share;
        self
    }

    /// Sets the deadline of a suspect's solo run (default 60 s). A suspect (a
    /// redelivery, which may be what killed the last process) runs with no other
    /// handler running in the process, so a hung one would stop the process;
    /// past this deadline its transaction is rolled back, it goes back to its
    /// queue, and the run counts like a crash toward the poison limit. Set it
    /// above your slowest handler.
    pub fn with_solo_timeout(mut self, timeout: Duration) -> Self {
        self.config.solo_timeout = timeout;
        self
    }

    /// Sets the TLS options for `amqps://` (e.g. [`TlsOptions::from_env`]).
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.config.tls = tls;
        self
    }

    /// Partitions the consumer: a consistent-hash exchange `exchange` hashing on
    /// the `partition-key` header feeds `count` queues `queue.0 .. queue.N-1`,
    /// each with single active consumer, its own retry tiers and dead-letter
    /// queue; the exchange given to [`bind`](Self::bind) is bound to the hash
    /// exchange. Instances share the partitions through leases in the database.
    /// Deliveries with the same key run one at a time, in order. Needs the
    /// `rabbitmq_consistent_hash_exchange` plugin.
    pub fn partitioned(mut self, exchange: impl Into<String>, count: u32) -> Self {
        let previous = self.config.partitions.take();
        self.config.partitions = Some(Partitioning {
            exchange: exchange.into(),
            count,
            header: previous
                .as_ref()
                .map(|p| p.header.clone())
                .unwrap_or_else(|| DEFAULT_PARTITION_HEADER.to_owned()),
            lease_ttl: previous.map_or(DEFAULT_LEASE_TTL, |p| p.lease_ttl),
        });
        self
    }

    /// The header a partitioned consumer hashes on (default `partition-key`).
    /// Call after [`partitioned`](Self::partitioned).
    pub fn with_partition_header(mut self, header: impl Into<String>) -> Self {
        if let Some(p) = &mut self.config.partitions {
            p.header = header.into();
        }
        self
    }

    /// How long a partition lease lasts unrenewed (default 15 s): how long the
    /// partitions of an instance that died silently wait before another takes
    /// them. Call after [`partitioned`](Self::partitioned).
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        if let Some(p) = &mut self.config.partitions {
            p.lease_ttl = ttl;
        }
        self
    }

    /// Deliveries with the same value of `header` run one at a time, in the
    /// order they arrived; others still run side by side.
    pub fn ordered_by_header(mut self, header: impl Into<String>) -> Self {
        self.config.lanes = Some(LaneKey::Header(header.into()));
        self
    }

    /// Deliveries for which `key` returns the same value run one at a time, in
    /// the order they arrived; `None` puts a delivery in no lane.
    pub fn ordered_by<F>(mut self, key: F) -> Self
    where
        F: Fn(&LaneInput<'_>) -> Option<String> + Send + Sync + 'static,
    {
        self.config.lanes = Some(LaneKey::Function(std::sync::Arc::new(key)));
        self
    }

    /// How long a strict-sequence gap waits for the versions before it before
    /// it is dead-lettered as `version-gap`. Must outlast the retry horizon.
    pub fn with_gap_patience(mut self, patience: Duration) -> Self {
        self.config.gap_patience = Some(patience);
        self
    }

    /// Checks every setting and returns the configuration; the error names the
    /// setting and what is allowed.
    pub fn build(self) -> Result<ConsumerConfig, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}
