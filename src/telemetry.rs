//! What a consumer tells its operators: one log event and a set of metrics per
//! processed message, and counters a caller can read directly.
//!
//! Metrics go through the `metrics` facade under the names of the design
//! (`consumer_messages_processed_total` and friends), labelled by consumer and
//! queue; install any `metrics` recorder to export them.

/// The target of warren's spans: `warren::trace=off` in a log filter keeps
/// them out of the log lines (see `docs/tracing.md`).
pub use crate::spans::TARGET as SPAN_TARGET;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram};

use crate::failure::DeadLetterReason;

/// How one delivery ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The handler ran and its transaction committed.
    Applied,
    /// The message id was already claimed by this consumer; acked without running
    /// the handler.
    Duplicate,
    /// Moved to the dead-letter queue.
    DeadLettered(DeadLetterReason),
    /// A transient failure; a copy waits in a retry tier for the next attempt.
    Retried,
    /// The retry or dead-letter queue could not take the message; it was returned
    /// to its queue instead, so nothing is lost.
    Returned,
    /// The version gate found a newer version already applied: acked, the
    /// effect not run (its claim committed, so a copy is a duplicate).
    Stale,
    /// Strict sequence: the version it follows has not applied yet; a copy
    /// waits in the shortest retry tier without using an attempt.
    Parked,
    /// On a partition queue, its key belongs to another partition: a copy went
    /// to that partition's queue, confirmed, and this delivery was acked.
    Forwarded,
}

impl Outcome {
    /// The `result` label and `processing_result` log field.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Duplicate => "duplicate",
            Outcome::DeadLettered(_) => "dead-lettered",
            Outcome::Retried => "retried",
            Outcome::Returned => "returned",
            Outcome::Stale => "stale",
            Outcome::Parked => "parked",
            Outcome::Forwarded => "forwarded",
        }
    }
}

/// A snapshot of a consumer's counters since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Deliveries whose handler committed.
    pub applied: u64,
    /// Deliveries acked as duplicates.
    pub duplicates: u64,
    /// Deliveries moved to the dead-letter queue.
    pub dead_lettered: u64,
    /// Transient failures sent to a retry tier.
    pub retried: u64,
    /// Deliveries returned to their queue because the retry or dead-letter queue
    /// could not take them.
    pub returned: u64,
    /// Handler panics caught (each also counted as retried or dead-lettered).
    pub panics: u64,
    /// Acks that could not be sent because the channel was gone; the broker
    /// redelivers those and the inbox recognizes them.
    pub acks_lost: u64,
    /// Suspects (redeliveries) that ran alone in the process.
    pub solo_runs: u64,
    /// Suspects waiting now for their turn to run alone.
    pub suspects_waiting: u64,
    /// Versions found stale by the version gate: acked, not applied.
    pub stale: u64,
    /// Strict-sequence gaps parked to wait for the versions before them.
    pub gap_waits: u64,
    /// Deliveries waiting now behind an earlier one of the same lane.
    pub lane_waiting: u64,
    /// Transactions committed that applied several messages at once.
    pub batches: u64,
    /// Messages settled by those transactions (applied, duplicate or stale).
    pub batched: u64,
    /// Deliveries sent on to the partition their key belongs to (the broker's
    /// hash ring is not in the order warren declared).
    pub forwarded: u64,
    /// Units of work that ran into a lock conflict and ran again at once
    /// (split in halves, or alone once more), at no cost of an attempt.
    pub conflict_retries: u64,
    /// The size the consumer forms batches at now: its configured batch size,
    /// less after lock conflicts (0 before it first consumes).
    pub batch_size: u64,
    /// How many transactions of several messages the consumer runs at once
    /// now: its concurrency, less after lock conflicts between batches (0
    /// before it first consumes).
    pub batch_concurrency: u64,
}

#[derive(Debug)]
struct Counters {
    /// Sessions consuming now (a partitioned consumer runs one per partition).
    consuming: AtomicU64,
    /// Cleared when warren's own statements fail, set again by a successful probe.
    database_ok: AtomicBool,
    relay_down: AtomicBool,
    /// The publishing connection is blocked by a broker memory or disk alarm.
    blocked: AtomicBool,
    applied: AtomicU64,
    duplicates: AtomicU64,
    dead_lettered: AtomicU64,
    retried: AtomicU64,
    returned: AtomicU64,
    panics: AtomicU64,
    acks_lost: AtomicU64,
    solo_runs: AtomicU64,
    suspects_waiting: AtomicU64,
    stale: AtomicU64,
    gap_waits: AtomicU64,
    lane_waiting: AtomicU64,
    batches: AtomicU64,
    batched: AtomicU64,
    forwarded: AtomicU64,
    conflict_retries: AtomicU64,
    batch_size: AtomicU64,
    batch_concurrency: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            consuming: AtomicU64::new(0),
            database_ok: AtomicBool::new(true),
            relay_down: AtomicBool::new(false),
            blocked: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            acks_lost: AtomicU64::new(0),
            solo_runs: AtomicU64::new(0),
            suspects_waiting: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            gap_waits: AtomicU64::new(0),
            lane_waiting: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batched: AtomicU64::new(0),
            forwarded: AtomicU64::new(0),
            conflict_retries: AtomicU64::new(0),
            batch_size: AtomicU64::new(0),
            batch_concurrency: AtomicU64::new(0),
        }
    }
}

/// `tracing` filter directives that keep message payloads out of the logs. The
/// AMQP client logs a returned message, body included, at WARN
/// (`lapin::returned_messages`) and every frame at TRACE (`lapin::frames`,
/// `lapin::channels`); warren handles returns itself and says what matters.
/// Add each to your `EnvFilter` after reading `RUST_LOG`, so that no setting
/// turns them back on:
///
/// ```
/// let mut filter = tracing_subscriber::EnvFilter::new("info");
/// for directive in warren::telemetry::PAYLOAD_SAFE_LOG_DIRECTIVES {
///     filter = filter.add_directive(directive.parse().expect("a valid directive"));
/// }
/// ```
pub const PAYLOAD_SAFE_LOG_DIRECTIVES: &[&str] = &[
    "lapin::returned_messages=off",
    "lapin::frames=off",
    // Every frame at TRACE, and at ERROR each lost connection, which warren
    // logs itself (at WARN: "lost the broker; reconnecting", with the reason).
    "lapin::channels=off",
];

/// Histogram buckets for warren's histograms, by metric name: give them to
/// the exporter so that it renders histograms, not summaries. Quantiles of a
/// summary cannot be added up across instances; a histogram's buckets can
/// (`histogram_quantile(0.99, sum by (le) (rate(..._bucket[5m])))`). With
/// `metrics-exporter-prometheus`:
///
/// ```
/// use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
///
/// let mut builder = PrometheusBuilder::new();
/// for (name, buckets) in warren::telemetry::HISTOGRAM_BUCKETS {
///     builder = builder
///         .set_buckets_for_metric(Matcher::Full((*name).to_owned()), buckets)
///         .expect("warren's buckets are valid");
/// }
/// let _recorder = builder.build_recorder();
/// ```
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    // Handler and commit time, in seconds: a millisecond to a minute.
    (
        "consumer_processing_duration_seconds",
        &[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0,
        ],
    ),
    // Time since the producer's AMQP timestamp, which has one-second
    // resolution and the producer's clock: a second to a day.
    (
        "consumer_message_age_seconds",
        &[
            1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 21600.0, 86400.0,
        ],
    ),
    // Messages per transaction.
    (
        "consumer_batch_size",
        &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0],
    ),
];

/// The filter we recommend for a service on warren, and the one warren's
/// programs start from when `RUST_LOG` is not set: INFO for warren and the
/// application (a line for each message that failed, was retried or
/// dead-lettered; `warren::telemetry=debug` adds one for each that applied),
/// WARN for sqlx, and nothing
/// from lapin, the AMQP client. lapin logs at ERROR every channel the broker
/// closes (a passive declare that finds nothing, as warren's check of a
/// partition ring at every start expects; a publish the broker refuses) and
/// every connection it loses (`lapin::io_loop`, "error doing IO", on each
/// broker restart). Warren reports what matters of those itself, once per
/// component, at WARN, with what it does about it ("lost the broker;
/// reconnecting", "cannot consume; retrying"). Add
/// [`PAYLOAD_SAFE_LOG_DIRECTIVES`] after it.
pub const DEFAULT_LOG_FILTER: &str = "info,sqlx=warn,lapin=off";

/// What a readiness probe needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    /// Subscribed and taking deliveries: connected to the broker, not starting,
    /// not draining.
    pub consuming: bool,
    /// The database answered warren's last statement or probe.
    pub database: bool,
    /// The publishing connection is blocked by a broker resource alarm.
    pub blocked: bool,
    /// The outbox relay run beside the consumer is running (true where there
    /// is no relay). False between a relay's unexpected end and its restart.
    pub relay: bool,
}

impl Health {
    /// Ready to do work: consuming, database reachable, not blocked, relay running.
    pub fn is_ready(&self) -> bool {
        self.consuming && self.database && !self.blocked && self.relay
    }
}

/// A live view of one consumer's counters; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct StatsHandle(Arc<Counters>);

impl StatsHandle {
    /// True while the consumer is subscribed and taking deliveries (not starting,
    /// not draining, not stopped).
    pub fn is_consuming(&self) -> bool {
        self.0.consuming.load(Ordering::Relaxed) > 0
    }

    /// The consumer's health now.
    pub fn health(&self) -> Health {
        Health {
            consuming: self.0.consuming.load(Ordering::Relaxed) > 0,
            database: self.0.database_ok.load(Ordering::Relaxed),
            blocked: self.0.blocked.load(Ordering::Relaxed),
            relay: !self.0.relay_down.load(Ordering::Relaxed),
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> ConsumerStats {
        let c = &self.0;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            applied: get(&c.applied),
            duplicates: get(&c.duplicates),
            dead_lettered: get(&c.dead_lettered),
            retried: get(&c.retried),
            returned: get(&c.returned),
            panics: get(&c.panics),
            acks_lost: get(&c.acks_lost),
            solo_runs: get(&c.solo_runs),
            suspects_waiting: get(&c.suspects_waiting),
            stale: get(&c.stale),
            gap_waits: get(&c.gap_waits),
            lane_waiting: get(&c.lane_waiting),
            batches: get(&c.batches),
            batched: get(&c.batched),
            forwarded: get(&c.forwarded),
            conflict_retries: get(&c.conflict_retries),
            batch_size: get(&c.batch_size),
            batch_concurrency: get(&c.batch_concurrency),
        }
    }
}

/// The log fields of one processed message. What warren could not read (an
/// envelope that did not parse) or the message did not carry (a causation
/// id) is absent, not an empty string.
#[derive(Debug, Default)]
pub(crate) struct MessageFields<'a> {
    pub(crate) message_id: &'a str,
    pub(crate) event_type: Option<&'a str>,
    pub(crate) correlation_id: Option<&'a str>,
    pub(crate) causation_id: Option<&'a str>,
    pub(crate) redelivered: bool,
    /// Failed attempts before this delivery: 0 on the first.
    pub(crate) retry_attempt: u32,
    /// Why it was retried, dead-lettered, parked or returned.
    pub(crate) error: Option<&'a str>,
    /// When a retried or parked message comes back.
    pub(crate) retry_in: Option<Duration>,
    /// It ran as a suspect past its solo deadline: returned to its queue,
    /// and counted as a crash of the work.
    pub(crate) crashed: bool,
}

/// Records outcomes for one consumer.
#[derive(Debug, Clone)]
pub(crate) struct Telemetry {
    consumer: Arc<str>,
    queue: Arc<str>,
    stats: StatsHandle,
    /// The per-message metrics, registered once, on the first message: by then
    /// the application has installed its recorder (a handle taken earlier would
    /// stay bound to the no-op one), and no message pays for label strings.
    hot: Arc<OnceLock<HotMetrics>>,
    /// Held while a session's start or end changes the consuming count and
    /// `consumer_broker_up` with it: the partitions of one consumer share
    /// this telemetry, and two of them ending at once must not leave the
    /// gauge at the value of the first.
    consuming_gauge: Arc<std::sync::Mutex<()>>,
}

/// Handles of the metrics every delivery touches.
#[derive(Debug)]
struct HotMetrics {
    in_flight: Gauge,
    age: Histogram,
    duration: Histogram,
    duplicates: Counter,
    retries: Counter,
    /// `consumer_messages_processed_total` by result, in [`Outcome::index`] order.
    processed: [Counter; 8],
    /// `consumer_dead_letter_total` by reason, in [`DeadLetterReason::ALL`] order.
    dead_letters: Vec<Counter>,
}

impl HotMetrics {
    fn register(consumer: &str, queue: &str) -> Self {
        let labels = [
            ("consumer", consumer.to_owned()),
            ("queue", queue.to_owned()),
        ];
        let with = |name: &'static str, value: &'static str| {
            let mut l: Vec<(&'static str, String)> = labels.to_vec();
            l.push((name, value.to_owned()));
            l
        };
        let results = [
            "applied",
            "duplicate",
            "dead-lettered",
            "retried",
            "returned",
            "stale",
            "parked",
            "forwarded",
        ];
        Self {
            in_flight: metrics::gauge!("consumer_in_flight", &labels),
            age: metrics::histogram!("consumer_message_age_seconds", &labels),
            duration: metrics::histogram!("consumer_processing_duration_seconds", &labels),
            duplicates: metrics::counter!("consumer_duplicates_total", &labels),
            retries: metrics::counter!("consumer_retry_total", &labels),
            processed: results.map(|r| {
                metrics::counter!("consumer_messages_processed_total", &with("result", r))
            }),
            dead_letters: DeadLetterReason::ALL
                .iter()
                .map(|r| {
                    metrics::counter!("consumer_dead_letter_total", &with("reason", r.as_str()))
                })
                .collect(),
        }
    }
}

impl Outcome {
    /// Position in [`HotMetrics::processed`].
    fn index(self) -> usize {
        match self {
            Outcome::Applied => 0,
            Outcome::Duplicate => 1,
            Outcome::DeadLettered(_) => 2,
            Outcome::Retried => 3,
            Outcome::Returned => 4,
            Outcome::Stale => 5,
            Outcome::Parked => 6,
            Outcome::Forwarded => 7,
        }
    }
}

impl Telemetry {
    pub(crate) fn new(consumer: &str, queue: &str) -> Self {
        Self {
            consumer: consumer.into(),
            queue: queue.into(),
            stats: StatsHandle::default(),
            hot: Arc::default(),
            consuming_gauge: Arc::default(),
        }
    }

    fn hot(&self) -> &HotMetrics {
        self.hot
            .get_or_init(|| HotMetrics::register(&self.consumer, &self.queue))
    }

    pub(crate) fn stats(&self) -> &StatsHandle {
        &self.stats
    }

    fn labels(&self) -> [(&'static str, String); 2] {
        [
            ("consumer", self.consumer.to_string()),
            ("queue", self.queue.to_string()),
        ]
    }

    /// A session starts (`true`) or stops (`false`) consuming; calls pair up.
    pub(crate) fn set_consuming(&self, consuming: bool) {
        let _one_at_a_time = self
            .consuming_gauge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = &self.stats.0.consuming;
        if consuming {
            count.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
        let up = count.load(Ordering::Relaxed) > 0;
        metrics::gauge!("consumer_broker_up", &self.labels()).set(if up { 1.0 } else { 0.0 });
    }

    pub(crate) fn set_database_ok(&self, ok: bool) {
        let was = self.stats.0.database_ok.swap(ok, Ordering::Relaxed);
        if was != ok {
            if ok {
                tracing::info!(
                    consumer_name = &*self.consumer,
                    "database reachable again; resuming"
                );
            } else {
                tracing::error!(
                    consumer_name = &*self.consumer,
                    "database unreachable; pausing intake"
                );
            }
        }
        metrics::gauge!("consumer_database_up", &self.labels()).set(if ok { 1.0 } else { 0.0 });
    }

    /// Records whether the relay run beside the consumer is running.
    pub(crate) fn set_relay_running(&self, running: bool) {
        self.stats.0.relay_down.store(!running, Ordering::Relaxed);
        let labels = [("consumer", self.consumer.to_string())];
        metrics::gauge!("outbox_relay_up", &labels).set(if running { 1.0 } else { 0.0 });
    }

    /// Counts a restart of a relay that ended while the consumer ran.
    pub(crate) fn relay_restarted(&self) {
        let labels = [("consumer", self.consumer.to_string())];
        metrics::counter!("outbox_relay_restarts_total", &labels).increment(1);
    }

    pub(crate) fn set_blocked(&self, blocked: bool) {
        let was = self.stats.0.blocked.swap(blocked, Ordering::Relaxed);
        if was != blocked {
            if blocked {
                tracing::warn!(
                    consumer_name = &*self.consumer,
                    "broker blocked publishing (resource alarm)"
                );
            } else {
                tracing::info!(
                    consumer_name = &*self.consumer,
                    "broker unblocked publishing"
                );
            }
        }
        metrics::gauge!("rabbitmq_connection_blocked", &self.labels()).set(if blocked {
            1.0
        } else {
            0.0
        });
    }

    pub(crate) fn queue_depth(&self, queue: &str, ready: u32, consumers: u32) {
        let labels = [
            ("consumer", self.consumer.to_string()),
            ("queue", queue.to_owned()),
        ];
        metrics::gauge!("rabbitmq_queue_messages_ready", &labels).set(f64::from(ready));
        metrics::gauge!("rabbitmq_queue_consumers", &labels).set(f64::from(consumers));
    }

    /// A bookkeeping statement of warren's own failed (a solo-run count not
    /// recorded or not cleared): logged and counted, never silently dropped.
    pub(crate) fn bookkeeping_error(
        &self,
        operation: &'static str,
        message_id: &str,
        error: &dyn std::fmt::Display,
    ) {
        tracing::warn!(
            consumer_name = %self.consumer,
            message_id,
            operation,
            error = %error,
            "bookkeeping statement failed"
        );
        let [consumer, queue] = self.labels();
        metrics::counter!(
            "consumer_bookkeeping_errors_total",
            &[consumer, queue, ("operation", operation.to_owned())]
        )
        .increment(1);
    }

    /// A delivery arrived with properties the frame guard rewrote.
    pub(crate) fn pruned(&self, cause: crate::broker::guard::Cause) {
        let [consumer, queue] = self.labels();
        metrics::counter!(
            "consumer_pruned_messages_total",
            &[consumer, queue, ("cause", cause.as_str().to_owned())]
        )
        .increment(1);
    }

    /// The broker cancelled the subscription while the connection stayed open.
    pub(crate) fn subscription_cancelled(&self) {
        metrics::counter!("consumer_subscription_cancelled_total", &self.labels()).increment(1);
    }

    pub(crate) fn slow_handler(&self) {
        metrics::counter!("consumer_slow_handlers_total", &self.labels()).increment(1);
    }

    pub(crate) fn message_age(&self, seconds: f64) {
        self.hot().age.record(seconds);
    }

    pub(crate) fn in_flight(&self, delta: f64) {
        self.hot().in_flight.increment(delta);
    }

    pub(crate) fn panic(&self) {
        self.stats.0.panics.fetch_add(1, Ordering::Relaxed);
    }

    /// A suspect starts (`1.0`) or stops (`-1.0`) waiting to run alone.
    pub(crate) fn suspect_waiting(&self, delta: f64) {
        let waiting = &self.stats.0.suspects_waiting;
        if delta > 0.0 {
            waiting.fetch_add(1, Ordering::Relaxed);
        } else {
            waiting.fetch_sub(1, Ordering::Relaxed);
        }
        metrics::gauge!("consumer_suspects_waiting", &self.labels()).increment(delta);
    }

    /// Deliveries start (`n > 0`) or stop (`n < 0`) waiting in a lane behind
    /// an earlier delivery of the same key.
    pub(crate) fn lane_waiting(&self, n: i64) {
        let waiting = &self.stats.0.lane_waiting;
        if n > 0 {
            waiting.fetch_add(n.unsigned_abs(), Ordering::Relaxed);
        } else {
            waiting.fetch_sub(n.unsigned_abs(), Ordering::Relaxed);
        }
        metrics::gauge!("consumer_lane_waiting", &self.labels()).increment(n as f64);
    }

    /// A transaction over several messages committed `size` of them.
    pub(crate) fn batch_committed(&self, size: usize) {
        let c = &self.stats.0;
        c.batches.fetch_add(1, Ordering::Relaxed);
        c.batched.fetch_add(size as u64, Ordering::Relaxed);
        metrics::histogram!("consumer_batch_size", &self.labels()).record(size as f64);
    }

    /// A unit of work ran into a lock conflict and runs again (split, or
    /// alone once more).
    pub(crate) fn conflict_retry(&self) {
        self.stats
            .0
            .conflict_retries
            .fetch_add(1, Ordering::Relaxed);
        metrics::counter!("consumer_conflict_retries_total", &self.labels()).increment(1);
    }

    /// How many transactions of several messages may run at once now.
    pub(crate) fn batch_concurrency_now(&self, limit: usize) {
        self.stats
            .0
            .batch_concurrency
            .store(limit as u64, Ordering::Relaxed);
        metrics::gauge!("consumer_batch_concurrency_limit", &self.labels()).set(limit as f64);
    }

    /// The size the dispatcher forms batches at now.
    pub(crate) fn batch_size_now(&self, size: usize) {
        self.stats
            .0
            .batch_size
            .store(size as u64, Ordering::Relaxed);
        metrics::gauge!("consumer_batch_size_limit", &self.labels()).set(size as f64);
    }

    /// A suspect starts its solo run.
    pub(crate) fn solo_run(&self) {
        self.stats.0.solo_runs.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("consumer_solo_runs_total", &self.labels()).increment(1);
    }

    pub(crate) fn ack_lost(&self, message_id: &str) {
        self.stats.0.acks_lost.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            message_id,
            consumer_name = &*self.consumer,
            queue_name = &*self.queue,
            "ack not delivered: the channel is gone; the broker will redeliver and the inbox will recognize it"
        );
    }

    /// Logs, every `interval` until `stop`, one INFO line with how many
    /// deliveries ended in each outcome since the line before; nothing for
    /// an interval in which none ended. Each applied or duplicate delivery
    /// logs at DEBUG only (a line a message costs CPU at thousands a
    /// second), so this is what shows an operator at INFO that the consumer
    /// works.
    pub(crate) fn summarize(
        &self,
        interval: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if interval.is_zero() {
            return None;
        }
        let telemetry = self.clone();
        Some(tokio::spawn(async move {
            let mut last = telemetry.stats.snapshot();
            let mut ticks =
                tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let last_interval = tokio::select! {
                    () = stop.cancelled() => false,
                    _ = ticks.tick() => true,
                };
                let now = telemetry.stats.snapshot();
                telemetry.log_summary(&last, &now);
                last = now;
                if !last_interval {
                    return;
                }
            }
        }))
    }

    fn log_summary(&self, before: &ConsumerStats, now: &ConsumerStats) {
        let d = |f: fn(&ConsumerStats) -> u64| f(now).saturating_sub(f(before));
        let counts = [
            d(|s| s.applied),
            d(|s| s.duplicates),
            d(|s| s.stale),
            d(|s| s.retried),
            d(|s| s.dead_lettered),
            d(|s| s.returned),
            d(|s| s.gap_waits),
            d(|s| s.forwarded),
        ];
        if counts.iter().all(|&n| n == 0) {
            return;
        }
        let [
            applied,
            duplicate,
            stale,
            retried,
            dead_lettered,
            returned,
            parked,
            forwarded,
        ] = counts;
        tracing::info!(
            consumer_name = &*self.consumer,
            queue_name = &*self.queue,
            applied,
            duplicate,
            stale,
            retried,
            dead_lettered,
            returned,
            parked,
            forwarded,
            "messages processed since the last summary"
        );
    }

    /// Counts, measures and logs one finished delivery.
    pub(crate) fn record<'a>(
        &self,
        outcome: Outcome,
        fields: &MessageFields<'a>,
        elapsed: Duration,
    ) {
        let c = &self.stats.0;
        let counter = match outcome {
            Outcome::Applied => &c.applied,
            Outcome::Duplicate => &c.duplicates,
            Outcome::DeadLettered(_) => &c.dead_lettered,
            Outcome::Retried => &c.retried,
            Outcome::Returned => &c.returned,
            Outcome::Stale => &c.stale,
            Outcome::Parked => &c.gap_waits,
            Outcome::Forwarded => &c.forwarded,
        };
        counter.fetch_add(1, Ordering::Relaxed);

        let hot = self.hot();
        hot.processed[outcome.index()].increment(1);
        hot.duration.record(elapsed.as_secs_f64());
        match outcome {
            Outcome::Duplicate => hot.duplicates.increment(1),
            Outcome::Retried => hot.retries.increment(1),
            Outcome::DeadLettered(reason) => {
                if let Some(i) = DeadLetterReason::ALL.iter().position(|r| *r == reason) {
                    hot.dead_letters[i].increment(1);
                }
            }
            Outcome::Stale => {
                metrics::counter!("consumer_stale_total", &self.labels()).increment(1);
            }
            Outcome::Parked => {
                metrics::counter!("consumer_gap_waits_total", &self.labels()).increment(1);
            }
            Outcome::Forwarded => {
                metrics::counter!("consumer_partition_forwarded_total", &self.labels())
                    .increment(1);
            }
            Outcome::Applied | Outcome::Returned => {}
        }

        let processing_duration_ms = elapsed.as_millis() as u64;
        let nonempty = |v: Option<&'a str>| v.filter(|v| !v.is_empty());
        // One line per outcome, and the only one: the fields the design names,
        // and for a failure why and when it comes back.
        macro_rules! event {
            ($level:expr) => {
                tracing::event!(
                    $level,
                    message_id = fields.message_id,
                    event_type = nonempty(fields.event_type),
                    consumer_name = &*self.consumer,
                    correlation_id = nonempty(fields.correlation_id),
                    causation_id = nonempty(fields.causation_id),
                    rabbitmq_redelivered = fields.redelivered,
                    retry_attempt = fields.retry_attempt,
                    queue_name = &*self.queue,
                    processing_duration_ms,
                    processing_result = outcome.as_str(),
                    dead_letter_reason = match outcome {
                        Outcome::DeadLettered(r) => Some(r.as_str()),
                        _ => None,
                    },
                    retry_in = fields
                        .retry_in
                        .map(|d| tracing::field::display(crate::retry::Delay(d))),
                    error = fields.error,
                    "message processed"
                )
            };
        }
        match outcome {
            // What goes right is counted, and logged at DEBUG: at thousands
            // of messages a second a line each (about 6 µs of CPU per
            // message, measured by `billing bench` row 3i) buries the lines
            // that need a reader.
            Outcome::Applied | Outcome::Duplicate | Outcome::Stale | Outcome::Forwarded => {
                event!(tracing::Level::DEBUG);
            }
            Outcome::Parked => event!(tracing::Level::INFO),
            // A suspect that outran its solo deadline counts as a crash of
            // the work.
            Outcome::Returned if fields.crashed => event!(tracing::Level::ERROR),
            // A producer's malformed message is not this service's error; a
            // message that goes back to its queue is tried again.
            Outcome::Retried | Outcome::Returned => event!(tracing::Level::WARN),
            Outcome::DeadLettered(reason) if reason.is_invalid_input() => {
                event!(tracing::Level::WARN);
            }
            Outcome::DeadLettered(_) => event!(tracing::Level::ERROR),
        }
    }
}
