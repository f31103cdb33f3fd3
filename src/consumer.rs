//! The delivery loop: prefetch, bounded concurrency, and the rule every message
//! follows.
//!
//! ```text
//! deliver -> validate -> BEGIN; claim inbox; handler; COMMIT -> ack
//! ```
//!
//! Each delivery goes through three steps. `prepare` validates and routes it
//! without touching the database; `apply` runs the claim and the handler in one
//! transaction; `settle` tells the broker the outcome (ack, dead-letter, requeue).
//! Only `settle` speaks to the broker about the delivery, and it acks only what
//! `apply` committed or found already committed.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use chrono::Utc;
use futures_util::{FutureExt, StreamExt};
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::Error;
use crate::broker::{self, Backoff, Publisher};
use crate::dead_letter::{
    self, DeadLetterInfo, HEADER_ATTEMPT, HEADER_FIRST_FAILURE, HEADER_LAST_ERROR,
    HEADER_LAST_FAILURE, HEADER_ORIGINAL_EXCHANGE, HEADER_ORIGINAL_ROUTING_KEY, header_int,
    header_str,
};
use crate::envelope::{
    DEFAULT_MAX_BODY_BYTES, Envelope, Incoming, InvalidMessage, Metadata, PERSISTENT,
};
use crate::failpoint;
use crate::failure::{DeadLetterReason, HandlerError};
use crate::handler::BoundCall;
use crate::headers::{self, Signer};
use crate::registry::Registry;
use crate::relay::{Relay, RelayConfig};
use crate::retry::{RetryDecision, RetryPolicy};
use crate::store::{InboxEntry, OutboxStore, Store, StoreError};
use crate::telemetry::{MessageFields, Outcome, StatsHandle, Telemetry};
use crate::tls::TlsOptions;
use crate::topology::{QueueType, Topology, dead_letter_queue_name, retry_queue_name};

/// Default number of unacknowledged deliveries the broker may push to one consumer.
pub const DEFAULT_PREFETCH: u16 = 32;
/// Default number of messages processed at once.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default time in-flight messages get to finish after shutdown is requested.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default wait before returning a delivery whose outcome could not be recorded
/// (retry or dead-letter queue unreachable), so that nothing spins hot.
pub const DEFAULT_FAILURE_BACKOFF: Duration = Duration::from_secs(2);

/// Everything that defines one consumer. Build with [`ConsumerConfig::new`] and the
/// `with_`/`bind` methods; [`validate`](Self::validate) runs at start.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// The consumer's name: its deduplication boundary in the inbox. Two consumers
    /// with different names each apply a message once.
    pub name: String,
    /// The queue consumed from.
    pub queue: String,
    /// The topic exchange the queue is bound to, if any.
    pub exchange: Option<String>,
    /// Binding keys from the exchange to the queue.
    pub binding_keys: Vec<String>,
    /// Queue type of the main and dead-letter queues.
    pub queue_type: QueueType,
    /// Broker prefetch (unacknowledged deliveries in flight to this consumer).
    pub prefetch: u16,
    /// Messages processed at once.
    pub concurrency: usize,
    /// Largest accepted body, in bytes.
    pub max_body_bytes: usize,
    /// How long in-flight messages may take to finish after shutdown is requested.
    pub shutdown_timeout: Duration,
    /// Delay tiers, attempt limit and poison limit.
    pub retry: RetryPolicy,
    /// Wait before a delivery is returned when its outcome could not be recorded.
    pub failure_backoff: Duration,
    /// How often queue depth and consumer counts are read for the metrics.
    pub queue_metrics_interval: Duration,
    /// The broker's `consumer_timeout` (RabbitMQ's default is 30 minutes): a
    /// delivery unacked for that long makes the broker close the channel.
    pub consumer_timeout: Duration,
    /// Share of `consumer_timeout` after which a still-running handler is logged
    /// as a warning (default 0.5).
    pub timeout_warning_share: f64,
    /// How `amqps://` connections verify the broker and authenticate (a private
    /// CA, a client certificate). Ignored by `amqp://` URLs, unless set: then the
    /// connect fails rather than run unencrypted.
    pub tls: TlsOptions,
}

impl ConsumerConfig {
    /// A consumer named `name` on `queue`, with the defaults: quorum queues,
    /// prefetch 32, concurrency 8, 1 MiB bodies, 30 s shutdown deadline.
    pub fn new(name: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            queue: queue.into(),
            exchange: None,
            binding_keys: Vec::new(),
            queue_type: QueueType::default(),
            prefetch: DEFAULT_PREFETCH,
            concurrency: DEFAULT_CONCURRENCY,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            retry: RetryPolicy::default(),
            failure_backoff: DEFAULT_FAILURE_BACKOFF,
            queue_metrics_interval: Duration::from_secs(15),
            consumer_timeout: Duration::from_secs(30 * 60),
            timeout_warning_share: 0.5,
            tls: TlsOptions::default(),
        }
    }

    /// Binds the queue to the topic exchange `exchange` with each of `keys`.
    pub fn bind<I, K>(mut self, exchange: impl Into<String>, keys: I) -> Self
    where
        I: IntoIterator<Item = K>,
        K: Into<String>,
    {
        self.exchange = Some(exchange.into());
        self.binding_keys = keys.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the queue type.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets the prefetch.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Sets the concurrency.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Sets the body size limit.
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// Sets the shutdown deadline.
    pub fn with_shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Sets the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sets the backoff used when an outcome cannot be recorded.
    pub fn with_failure_backoff(mut self, delay: Duration) -> Self {
        self.failure_backoff = delay;
        self
    }

    /// Sets the broker's consumer timeout, for the long-handler warning.
    pub fn with_consumer_timeout(mut self, timeout: Duration) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// Sets how often queue metrics are read.
    pub fn with_queue_metrics_interval(mut self, interval: Duration) -> Self {
        self.queue_metrics_interval = interval;
        self
    }

    /// Sets the TLS options for `amqps://` (e.g. [`TlsOptions::from_env`]).
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.tls = tls;
        self
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue(&self) -> String {
        dead_letter_queue_name(&self.queue)
    }

    /// The retry queue's name for a tier.
    pub fn retry_queue(&self, delay: Duration) -> String {
        retry_queue_name(&self.queue, delay)
    }

    /// Checks every setting; the error names the setting and what is allowed.
    pub fn validate(&self) -> Result<(), Error> {
        let fail = |msg: String| Err(Error::Config(msg));
        if self.name.trim().is_empty() || self.name.len() > 200 {
            return fail(format!(
                "consumer name must be 1 to 200 bytes, got {} bytes",
                self.name.len()
            ));
        }
        if self.name.chars().any(char::is_control) || self.queue.chars().any(char::is_control) {
            return fail("consumer and queue names must not contain control characters".into());
        }
        if self.queue.trim().is_empty() || self.queue.len() > 200 {
            return fail(format!(
                "queue name must be 1 to 200 characters, got {:?}",
                self.queue
            ));
        }
        if self.exchange.is_some() && self.binding_keys.is_empty() {
            return fail("an exchange needs at least one binding key".into());
        }
        if self.prefetch == 0 {
            return fail("prefetch must be at least 1 (0 would mean unlimited)".into());
        }
        if self.concurrency == 0 {
            return fail("concurrency must be at least 1".into());
        }
        if self.concurrency > usize::from(self.prefetch) {
            return fail(format!(
                "concurrency ({}) must not exceed prefetch ({}): workers beyond the prefetch never get a message",
                self.concurrency, self.prefetch
            ));
        }
        self.retry.validate().map_err(Error::Config)?;
        if !(self.timeout_warning_share > 0.0 && self.timeout_warning_share <= 1.0) {
            return fail(format!(
                "timeout warning share must be above 0 and at most 1, got {}",
                self.timeout_warning_share
            ));
        }
        if self.queue_metrics_interval.is_zero() {
            return fail("queue metrics interval must be above zero".into());
        }
        if self.max_body_bytes == 0 {
            return fail("max body size must be at least 1 byte".into());
        }
        Ok(())
    }
}

/// A consumer: configuration, a store, and a routing table, ready to
/// [`run`](Self::run).
pub struct Consumer<S: Store> {
    inner: Arc<Inner<S>>,
}

struct Inner<S: Store> {
    config: ConsumerConfig,
    store: S,
    registry: Registry<S::Db>,
    telemetry: Telemetry,
    /// Signs warren's headers on copies and verifies them on deliveries; the key
    /// comes from the store, loaded once at start.
    signer: OnceLock<Signer>,
}

/// A delivery that passed validation and routing, bound to its handler.
struct Prepared<DB: sqlx::Database> {
    meta: Metadata,
    call: Box<dyn BoundCall<DB>>,
}

/// Why `apply` did not commit.
enum Failure {
    Handler(HandlerError),
    Panic(String),
    Store(StoreError),
}

impl<S: Store> Consumer<S> {
    /// A consumer that will apply each message through `registry` inside a
    /// transaction of `store`.
    pub fn new(config: ConsumerConfig, store: S, registry: Registry<S::Db>) -> Self {
        let telemetry = Telemetry::new(&config.name, &config.queue);
        Self {
            inner: Arc::new(Inner {
                config,
                store,
                registry,
                telemetry,
                signer: OnceLock::new(),
            }),
        }
    }

    /// The consumer's configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.inner.config
    }

    /// A live view of this consumer's counters.
    pub fn stats(&self) -> StatsHandle {
        self.inner.telemetry.stats().clone()
    }

    /// The topology this consumer declares at start.
    pub fn topology(&self) -> Topology {
        Topology::for_consumer(&self.inner.config)
    }

    /// Migrates the store, declares the topology, and consumes from the queue until
    /// `shutdown` resolves.
    ///
    /// `amqp_url` may list several brokers of a cluster, separated by commas. When
    /// the connection or channel drops (broker restart, network cut, missed
    /// heartbeats, the queue deleted under the consumer), the consumer reconnects
    /// with capped, jittered backoff, declares the topology again and resumes.
    /// Deliveries of the lost channel are never acked on the new one; the broker
    /// redelivers them and the inbox recognizes what already committed. While the
    /// database is unreachable, intake pauses and resumes when it answers again.
    ///
    /// On shutdown it cancels the subscription, takes no new deliveries, gives
    /// in-flight messages the shutdown deadline to finish (acking what committed),
    /// then closes. Deliveries that did not finish are left unacked and the broker
    /// redelivers them.
    ///
    /// Returns an error only for what retrying cannot fix: an invalid
    /// configuration, or a queue that exists with other arguments.
    pub async fn run<F>(self, amqp_url: &str, shutdown: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        let config = &self.inner.config;
        config.validate()?;
        failpoint::check_env().map_err(Error::Config)?;
        broker::parse_urls(amqp_url).map_err(|e| Error::Config(e.to_string()))?;
        let mut shutdown = std::pin::pin!(shutdown);

        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            let prepared = async {
                self.inner.store.migrate().await?;
                self.inner.store.signing_key().await
            };
            match prepared.await {
                Ok(key) => {
                    let _ = self.inner.signer.set(Signer::new(&key));
                    break;
                }
                Err(e) if e.is_connection_error() => {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "database unreachable at start");
                    tokio::select! {
                        () = &mut shutdown => return Ok(()),
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }

        let permits = Arc::new(Semaphore::new(config.concurrency));
        let mut in_flight = JoinSet::new();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
        loop {
            let opened = tokio::select! {
                () = &mut shutdown => break,
                opened = self.open_session(amqp_url) => opened,
            };
            let session = match opened {
                Ok(session) => session,
                Err(e) if is_fatal(&e) => {
                    drain(&mut in_flight, config.shutdown_timeout).await;
                    return Err(e);
                }
                Err(e) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "cannot consume; retrying");
                    tokio::select! {
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            let session_start = Instant::now();
            self.inner.telemetry.set_consuming(true);
            let end = self
                .consume(&session, &permits, &mut in_flight, &mut shutdown)
                .await;
            // A session that lasted proves the broker was back; one that died at
            // once keeps the backoff growing, so a flapping broker is not hammered.
            if session_start.elapsed() >= STABLE_SESSION {
                backoff.reset();
            }
            self.inner.telemetry.set_consuming(false);
            match end {
                SessionEnd::Shutdown => {
                    // Draining: stop the flow first, so nothing new arrives while
                    // in-flight work finishes. Deliveries buffered but not started
                    // stay unacked and return to the queue when the channel closes.
                    tracing::info!(in_flight = in_flight.len(), "draining");
                    if session.channel.status().connected() {
                        let cancel = session.channel.basic_cancel(
                            session.tag.as_str().into(),
                            BasicCancelOptions::default(),
                        );
                        let _ = tokio::time::timeout(CLOSE_TIMEOUT, cancel).await;
                    }
                    drain(&mut in_flight, config.shutdown_timeout).await;
                    session.close().await;
                    break;
                }
                SessionEnd::Lost(reason) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(
                        consumer_name = %config.name,
                        reason = %reason,
                        retry_in = ?wait,
                        "lost the broker; reconnecting"
                    );
                    session.close().await;
                    tokio::select! {
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
        // Work of sessions that were lost before the shutdown.
        drain(&mut in_flight, config.shutdown_timeout).await;
        tracing::info!(consumer_name = %config.name, "stopped");
        Ok(())
    }

    /// Connects (consuming and publishing on separate connections, so that a
    /// resource alarm that blocks publishing does not stop consumption), declares
    /// the topology, and subscribes.
    async fn open_session(&self, amqp_url: &str) -> Result<Session, Error> {
        let config = &self.inner.config;
        let consume = Arc::new(
            broker::connect_with_tls(
                amqp_url,
                &format!("warren consumer {}", config.name),
                &config.tls,
            )
            .await?,
        );
        let publish = match broker::connect_with_tls(
            amqp_url,
            &format!("warren publisher {}", config.name),
            &config.tls,
        )
        .await
        {
            Ok(c) => Arc::new(c),
            Err(e) => {
                let _ = consume.close(200, "publisher failed".into()).await;
                return Err(e.into());
            }
        };
        let opened = async {
            let setup = broker::deadline("opening a channel", consume.create_channel()).await?;
            broker::declare(&setup, &self.topology()).await?;
            broker::close_channel(&setup, "topology declared").await;
            let channel = broker::deadline("opening a channel", consume.create_channel()).await?;
            broker::deadline(
                "basic.qos",
                channel.basic_qos(config.prefetch, BasicQosOptions::default()),
            )
            .await?;
            let tag = format!("warren.{}.{}", config.name, uuid::Uuid::now_v7());
            let deliveries = broker::deadline(
                "basic.consume",
                channel.basic_consume(
                    broker::short("queue name", &config.queue)?,
                    broker::short("consumer tag", &tag)?,
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                ),
            )
            .await?;
            Ok::<_, Error>((channel, tag, deliveries))
        }
        .await;
        let (channel, tag, deliveries) = match opened {
            Ok(parts) => parts,
            Err(e) => {
                let _ = consume.close(200, "setup failed".into()).await;
                let _ = publish.close(200, "setup failed".into()).await;
                return Err(e);
            }
        };
        let lost = Arc::new(tokio::sync::Notify::new());
        let monitor = tokio::spawn(monitor(
            Arc::clone(&consume),
            Arc::clone(&publish),
            self.inner.telemetry.clone(),
            vec![config.queue.clone(), config.dead_letter_queue()],
            config.queue_metrics_interval,
            Arc::clone(&lost),
        ));
        tracing::info!(
            consumer_name = %config.name,
            queue_name = %config.queue,
            prefetch = config.prefetch,
            concurrency = config.concurrency,
            "consuming"
        );
        Ok(Session {
            publisher: Arc::new(Publisher::new(Arc::clone(&publish))),
            consume,
            publish,
            channel,
            tag,
            deliveries,
            lost,
            monitor,
        })
    }

    /// Takes deliveries until shutdown or until the session is lost.
    async fn consume<F>(
        &self,
        session: &Session,
        permits: &Arc<Semaphore>,
        in_flight: &mut JoinSet<()>,
        shutdown: &mut std::pin::Pin<&mut F>,
    ) -> SessionEnd
    where
        F: Future<Output = ()> + Send,
    {
        let mut deliveries = session.deliveries.clone();
        loop {
            if !self.inner.telemetry.stats().health().database {
                // Pause intake: a delivery taken now could only be returned.
                if let Some(end) = self.wait_for_database(session, shutdown).await {
                    return end;
                }
            }
            // A permit first: a delivery is taken from the buffer only when a worker
            // is free, so at most `concurrency` messages are being processed.
            let permit = tokio::select! {
                biased;
                () = shutdown.as_mut() => return SessionEnd::Shutdown,
                () = session.lost.notified() => return SessionEnd::Lost("a connection closed".into()),
                permit = Arc::clone(permits).acquire_owned() => permit.expect("semaphore is never closed"),
            };
            let next = tokio::select! {
                biased;
                () = shutdown.as_mut() => return SessionEnd::Shutdown,
                () = session.lost.notified() => return SessionEnd::Lost("a connection closed".into()),
                next = deliveries.next() => next,
            };
            match next {
                Some(Ok(delivery)) => {
                    let inner = Arc::clone(&self.inner);
                    let publisher = Arc::clone(&session.publisher);
                    in_flight.spawn(async move {
                        inner.process(&publisher, delivery).await;
                        drop(permit);
                    });
                }
                Some(Err(e)) => return SessionEnd::Lost(e.to_string()),
                None => {
                    return SessionEnd::Lost(
                        "the broker ended the subscription (queue deleted or connection closed)"
                            .into(),
                    );
                }
            }
            while let Some(done) = in_flight.try_join_next() {
                log_task_end(done);
            }
        }
    }

    /// Probes the database with backoff until it answers. `Some` if the session
    /// ended meanwhile.
    async fn wait_for_database<F>(
        &self,
        session: &Session,
        shutdown: &mut std::pin::Pin<&mut F>,
    ) -> Option<SessionEnd>
    where
        F: Future<Output = ()> + Send,
    {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        loop {
            if self.inner.store.ping().await.is_ok() {
                self.inner.telemetry.set_database_ok(true);
                return None;
            }
            tokio::select! {
                () = shutdown.as_mut() => return Some(SessionEnd::Shutdown),
                () = session.lost.notified() => return Some(SessionEnd::Lost("a connection closed".into())),
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}

/// One connected period: two connections, the consuming channel, its monitor.
struct Session {
    consume: Arc<lapin::Connection>,
    publish: Arc<lapin::Connection>,
    channel: lapin::Channel,
    tag: String,
    deliveries: lapin::Consumer,
    publisher: Arc<Publisher>,
    lost: Arc<tokio::sync::Notify>,
    monitor: tokio::task::JoinHandle<()>,
}

impl Session {
    /// Closes politely, but never waits long: a broker that is shutting down may
    /// never answer the close, and a reconnect or a shutdown must not hang on it.
    async fn close(self) {
        self.monitor.abort();
        let close = async {
            if self.channel.status().connected() {
                let _ = self.channel.close(200, "shutdown".into()).await;
            }
            for c in [&self.consume, &self.publish] {
                if c.status().connected() {
                    let _ = c.close(200, "shutdown".into()).await;
                }
            }
        };
        if tokio::time::timeout(CLOSE_TIMEOUT, close).await.is_err() {
            tracing::warn!(
                "the broker did not answer the close within {CLOSE_TIMEOUT:?}; dropping the connections"
            );
        }
    }
}

/// A session that lasted this long resets the reconnect backoff.
const STABLE_SESSION: Duration = Duration::from_secs(10);

/// How long closing a channel and its connections may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

enum SessionEnd {
    Shutdown,
    Lost(String),
}

/// Errors a reconnect cannot fix.
fn is_fatal(e: &Error) -> bool {
    match e {
        Error::Config(_) => true,
        // Neither a drifted queue nor a refused certificate mends by retrying.
        Error::Broker(b) => b.is_topology_drift() || b.is_tls(),
        _ => false,
    }
}

/// Waits for in-flight messages up to `deadline`, then abandons the rest to
/// redelivery: aborting drops each task's transaction uncommitted, and its
/// delivery was never acked.
async fn drain(in_flight: &mut JoinSet<()>, deadline: Duration) {
    let drained = tokio::time::timeout(deadline, async {
        while let Some(done) = in_flight.join_next().await {
            log_task_end(done);
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            unfinished = in_flight.len(),
            ?deadline,
            "shutdown deadline passed; abandoning unfinished messages to redelivery"
        );
        in_flight.shutdown().await;
    }
}

/// Watches a session: notices dead connections (the consuming stream may not end
/// by itself when only the publishing connection dies), reports the blocked state
/// and the queues' depth.
async fn monitor(
    consume: Arc<lapin::Connection>,
    publish: Arc<lapin::Connection>,
    telemetry: Telemetry,
    queues: Vec<String>,
    queue_interval: Duration,
    lost: Arc<tokio::sync::Notify>,
) {
    let mut last_queue_check: Option<Instant> = None;
    loop {
        if !consume.status().connected() || !publish.status().connected() {
            lost.notify_one();
            return;
        }
        telemetry.set_blocked(publish.status().blocked());
        if last_queue_check.is_none_or(|t| t.elapsed() >= queue_interval) {
            last_queue_check = Some(Instant::now());
            for q in &queues {
                if let Ok(info) = broker::inspect_queue(&publish, q).await {
                    telemetry.queue_depth(q, info.ready, info.consumers);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

impl<S: OutboxStore> Consumer<S> {
    /// Runs the consumer and an outbox relay on the same store together, the
    /// common case: what handlers write to the outbox is published as soon as it
    /// commits. On shutdown the consumer drains first, then the relay publishes
    /// what is committed and stops. A relay configured without TLS options uses
    /// the consumer's, since both talk to the same broker.
    ///
    /// The relay is supervised: if it ends while the consumer runs (a panic, an
    /// error), [`Health::relay`](crate::Health) turns false (so `/readyz` goes
    /// red), `outbox_relay_up` drops to 0, and it is restarted with capped
    /// backoff, each restart counted in `outbox_relay_restarts_total`. The
    /// consumer never keeps consuming with no relay in silence.
    pub async fn run_with_relay<F>(
        self,
        amqp_url: &str,
        relay: RelayConfig,
        shutdown: F,
    ) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        relay.validate()?;
        let mut relay = relay;
        if relay.tls.is_default() {
            relay.tls = self.inner.config.tls.clone();
        }
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let store = self.inner.store.clone();
        let url = amqp_url.to_owned();
        let counters = Relay::new(store.clone(), relay.clone()).stats_handle();
        let supervisor = tokio::spawn(supervise(
            self.inner.telemetry.clone(),
            stopping.clone(),
            move || {
                let relay = Relay::new(store.clone(), relay.clone()).sharing(&counters);
                let url = url.clone();
                let mut stopping = stopping.clone();
                async move {
                    relay
                        .run(&url, async move {
                            let _ = stopping.wait_for(|stop| *stop).await;
                        })
                        .await
                }
            },
        ));
        let consumed = self.run(amqp_url, shutdown).await;
        let _ = stop.send(true);
        let relayed = match supervisor.await {
            Ok(r) => r,
            Err(e) => Err(Error::Task(format!("outbox relay supervisor: {e}"))),
        };
        consumed.and(relayed)
    }
}

/// Runs the task `start` makes until `stopping` turns true, starting it again
/// (after a capped, growing pause) whenever it ends before that, with the health
/// and metrics saying so meanwhile. Returns the last run's result.
async fn supervise<F, Fut>(
    telemetry: Telemetry,
    mut stopping: tokio::sync::watch::Receiver<bool>,
    start: F,
) -> Result<(), Error>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), Error>> + Send + 'static,
{
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    telemetry.set_relay_running(true);
    loop {
        let ended = tokio::spawn(start()).await;
        if *stopping.borrow() {
            return ended.unwrap_or_else(|e| Err(Error::Task(format!("outbox relay: {e}"))));
        }
        let why = match &ended {
            Ok(Ok(())) => "it returned".to_owned(),
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        telemetry.set_relay_running(false);
        let wait = backoff.next_delay();
        tracing::error!(
            reason = %why,
            restart_in = ?wait,
            "the outbox relay ended while the consumer runs; restarting it"
        );
        tokio::select! {
            _ = stopping.wait_for(|stop| *stop) => return Ok(()),
            () = tokio::time::sleep(wait) => {}
        }
        telemetry.relay_restarted();
        telemetry.set_relay_running(true);
    }
}

fn log_task_end(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && !e.is_cancelled()
    {
        // `process` catches handler panics; reaching this means warren itself
        // panicked. The delivery was not acked, so it is redelivered.
        tracing::error!(error = %e, "message task failed");
    }
}

/// Asks `test` of the first database error in `error`'s chain (a handler may
/// wrap it); false if there is none.
fn database_error_in(
    error: &(dyn std::error::Error + 'static),
    test: fn(&sqlx::Error) -> bool,
) -> bool {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = current {
        if let Some(sqlx_error) = e.downcast_ref::<sqlx::Error>() {
            return test(sqlx_error);
        }
        if let Some(StoreError::Database(sqlx_error)) = e.downcast_ref::<StoreError>() {
            return test(sqlx_error);
        }
        current = e.source();
    }
    false
}

/// True if `error` is (or wraps) a lost or unobtainable database connection.
fn is_database_outage(error: &(dyn std::error::Error + 'static)) -> bool {
    database_error_in(error, crate::store::is_connection_error)
}

/// True if `error` is (or wraps) a database error no retry can fix.
fn is_data_refused(error: &(dyn std::error::Error + 'static)) -> bool {
    database_error_in(error, crate::store::is_permanent_data_error)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "handler panicked".to_owned()
    }
}

/// How a delivery's earlier life reads from its (verified) headers.
struct History {
    /// Failed attempts before this one (`x-warren-attempt`, believed only under
    /// warren's signature).
    failed_attempts: u32,
}

impl History {
    fn of(delivery: &Delivery) -> Self {
        let attempts = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| header_int(h, HEADER_ATTEMPT))
            .unwrap_or(0);
        Self {
            failed_attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
        }
    }

    /// The number of the attempt now starting.
    fn attempt(&self) -> u32 {
        self.failed_attempts.saturating_add(1)
    }
}

fn message_id_of(delivery: &Delivery) -> &str {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str())
        .unwrap_or_default()
}

impl<S: Store> Inner<S> {
    /// One delivery, start to finish.
    async fn process(&self, publisher: &Publisher, mut delivery: Delivery) {
        let started = Instant::now();
        let received_at = Utc::now();
        // From here on, only headers warren signed count as warren's; forged
        // ones travel on, set apart, and decide nothing.
        delivery.properties = self.signer().trusted(&delivery.properties);
        let history = History::of(&delivery);
        self.telemetry.in_flight(1.0);
        if let Some(sent) = *delivery.properties.timestamp() {
            // Freshness: how long the message waited before reaching a handler.
            let age = received_at.timestamp() - i64::try_from(sent).unwrap_or(i64::MAX);
            self.telemetry.message_age(age.max(0) as f64);
        }
        let (outcome, meta) = match self.prepare(&delivery, &history) {
            Err(invalid) => {
                let outcome = self
                    .dead_letter(publisher, &delivery, invalid.reason, &invalid.detail, 1)
                    .await;
                (outcome, None)
            }
            Ok(Prepared { meta, call }) => {
                let outcome = match self.poison_check(&delivery, &meta).await {
                    Some(deliveries) => {
                        let detail = format!(
                            "delivered {deliveries} times without an outcome being recorded; \
                             the process probably died handling it"
                        );
                        let outcome = self
                            .dead_letter(
                                publisher,
                                &delivery,
                                DeadLetterReason::Poison,
                                &detail,
                                history.attempt(),
                            )
                            .await;
                        if matches!(outcome, Outcome::DeadLettered(_)) {
                            self.forget_redeliveries(&meta.message_id).await;
                        }
                        outcome
                    }
                    None => {
                        let entry = InboxEntry {
                            consumer_name: &self.config.name,
                            message_id: &meta.message_id,
                            event_type: &meta.event_type,
                            correlation_id: Some(&meta.correlation_id),
                            received_at,
                        };
                        let forget_redeliveries = delivery.redelivered;
                        let applied = self
                            .watch_duration(
                                &meta.message_id,
                                self.apply(call, &meta, &entry, forget_redeliveries),
                            )
                            .await;
                        let outcome = self.settle(publisher, &delivery, &history, applied).await;
                        // A count written before the handler ran belongs to this
                        // copy's crash history; once the message moved on (retry
                        // tier, dead letter) that history is over. The applied path
                        // cleared it in its own transaction.
                        if forget_redeliveries
                            && matches!(outcome, Outcome::Retried | Outcome::DeadLettered(_))
                        {
                            self.forget_redeliveries(&meta.message_id).await;
                        }
                        outcome
                    }
                };
                (outcome, Some(meta))
            }
        };
        let fields = match &meta {
            Some(m) => MessageFields {
                message_id: &m.message_id,
                event_type: &m.event_type,
                correlation_id: &m.correlation_id,
                causation_id: m.causation_id.as_deref().unwrap_or_default(),
                redelivered: delivery.redelivered,
                retry_attempt: history.failed_attempts,
            },
            None => MessageFields {
                message_id: message_id_of(&delivery),
                redelivered: delivery.redelivered,
                retry_attempt: history.failed_attempts,
                ..MessageFields::default()
            },
        };
        self.telemetry.record(outcome, &fields, started.elapsed());
        self.telemetry.in_flight(-1.0);
    }

    /// Runs `work`, warning once if it takes longer than the configured share of
    /// the broker's consumer timeout: past the timeout itself the broker closes
    /// the channel and the message is redelivered, however well the handler ends.
    async fn watch_duration<T>(&self, message_id: &str, work: impl Future<Output = T>) -> T {
        let warn_after = self
            .config
            .consumer_timeout
            .mul_f64(self.config.timeout_warning_share);
        let mut work = std::pin::pin!(work);
        tokio::select! {
            out = &mut work => out,
            () = tokio::time::sleep(warn_after) => {
                self.telemetry.slow_handler();
                tracing::warn!(
                    message_id,
                    running_for = ?warn_after,
                    consumer_timeout = ?self.config.consumer_timeout,
                    "handler is still running; if it outlasts the broker's consumer_timeout the channel is closed and the message redelivered"
                );
                work.await
            }
        }
    }

    /// Drops the redelivery count of a message that moved on. A count left
    /// behind is harmless for the message (it is not delivered again), but is
    /// logged and counted: a store that keeps failing here needs looking at.
    async fn forget_redeliveries(&self, message_id: &str) {
        if let Err(e) = self
            .store
            .clear_redeliveries(None, &self.config.name, message_id)
            .await
        {
            self.telemetry
                .bookkeeping_error("clear_redeliveries", message_id, &e);
        }
    }

    /// `Some(deliveries)` if the message has been handed out so often without any
    /// outcome that it must be killing the process: poison.
    ///
    /// The count is warren's own, kept in the database, on every queue type: a
    /// broker's delivery-count header can be set by a producer on a first
    /// delivery (RabbitMQ 3.x passes it through), so no header decides this.
    async fn poison_check(&self, delivery: &Delivery, meta: &Metadata) -> Option<u32> {
        // Only a redelivery can be part of a crash loop; warren's own returns to
        // the queue are fresh copies, so they are not counted.
        if !delivery.redelivered {
            return None;
        }
        let deliveries = match self
            .store
            .record_redelivery(&self.config.name, &meta.message_id)
            .await
        {
            Ok(n) => n,
            Err(e) => {
                // Without the count this delivery proceeds; the next one is
                // counted again.
                self.telemetry
                    .bookkeeping_error("record_redelivery", &meta.message_id, &e);
                0
            }
        };
        (deliveries >= self.config.retry.poison_limit()).then_some(deliveries)
    }

    /// Validates the delivery and binds it to its handler. No database, no broker.
    fn prepare(
        &self,
        delivery: &Delivery,
        history: &History,
    ) -> Result<Prepared<S::Db>, InvalidMessage> {
        let props = &delivery.properties;
        let envelope = Envelope::parse(
            Incoming {
                message_id: props.message_id().as_ref().map(|s| s.as_str()),
                content_type: props.content_type().as_ref().map(|s| s.as_str()),
                content_encoding: props.content_encoding().as_ref().map(|s| s.as_str()),
                body: &delivery.data,
            },
            self.config.max_body_bytes,
        )?;
        let handler = self
            .registry
            .lookup(&envelope.meta.event_type, envelope.meta.schema_version)
            .map_err(|(reason, detail)| InvalidMessage::new(reason, detail))?;
        let call = handler
            .bind(
                envelope.payload(),
                envelope.meta.clone(),
                delivery.redelivered,
                history.attempt(),
            )
            .map_err(|e| {
                InvalidMessage::new(
                    DeadLetterReason::InvalidPayload,
                    format!(
                        "payload does not match {} v{}: {e}",
                        envelope.meta.event_type, envelope.meta.schema_version
                    ),
                )
            })?;
        Ok(Prepared {
            meta: envelope.meta,
            call,
        })
    }

    /// The transaction: claim, handle, commit. `Ok(true)` if the handler's work
    /// committed, `Ok(false)` if the message was already claimed (a duplicate).
    async fn apply(
        &self,
        call: Box<dyn BoundCall<S::Db>>,
        meta: &Metadata,
        entry: &InboxEntry<'_>,
        forget_redeliveries: bool,
    ) -> Result<bool, Failure> {
        let mut tx = self.store.begin().await.map_err(Failure::Store)?;
        tx.set_cause(meta.clone());
        // The insert is the claim: a copy in flight elsewhere blocks here until the
        // first commits, then finds the row and backs off.
        let claimed = self
            .store
            .claim(&mut tx, entry)
            .await
            .map_err(Failure::Store)?;
        if forget_redeliveries {
            self.store
                .clear_redeliveries(Some(&mut tx), entry.consumer_name, entry.message_id)
                .await
                .map_err(Failure::Store)?;
        }
        if !claimed {
            // Commit rather than roll back only when there is a redelivery count
            // to forget; otherwise nothing was written.
            if forget_redeliveries {
                tx.commit().await.map_err(Failure::Store)?;
            } else {
                let _ = tx.rollback().await;
            }
            return Ok(false);
        }
        let handled = AssertUnwindSafe(call.call(&mut tx)).catch_unwind().await;
        match handled {
            Ok(Ok(())) => {
                let enqueued = tx.enqueued();
                failpoint::hit("before-commit");
                match tx.commit().await {
                    Ok(()) => {}
                    Err(e) if e.is_aborted() => {
                        return Err(Failure::Handler(HandlerError::transient(format!(
                            "the handler returned success, but an earlier statement had aborted its transaction \
                             (did it ignore a database error?): {e}"
                        ))));
                    }
                    Err(e) => return Err(Failure::Store(e)),
                }
                if enqueued > 0 {
                    self.store.wakeups().wake();
                }
                failpoint::hit("after-commit-before-ack");
                Ok(true)
            }
            Ok(Err(e)) => {
                let _ = tx.rollback().await;
                Err(Failure::Handler(e))
            }
            Err(panic) => {
                // The transaction may be mid-statement; dropping it rolls it back.
                drop(tx);
                self.telemetry.panic();
                Err(Failure::Panic(panic_message(&*panic)))
            }
        }
    }

    /// Tells the broker how `apply` went.
    async fn settle(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        history: &History,
        applied: Result<bool, Failure>,
    ) -> Outcome {
        let attempt = history.attempt();
        let (error, retry_after) = match applied {
            Ok(committed) => {
                self.ack(delivery).await;
                return if committed {
                    Outcome::Applied
                } else {
                    Outcome::Duplicate
                };
            }
            Err(Failure::Handler(HandlerError::Permanent { error })) => {
                return self
                    .dead_letter(
                        publisher,
                        delivery,
                        DeadLetterReason::Permanent,
                        &error.to_string(),
                        attempt,
                    )
                    .await;
            }
            // The database refused the data itself (see `store::is_permanent_data_error`):
            // every retry would fail the same way, so spend no retry tiers on it.
            Err(Failure::Handler(e)) if e.is_transient() && is_data_refused(e.error()) => {
                return self
                    .data_refused(publisher, delivery, e.error(), attempt)
                    .await;
            }
            Err(Failure::Store(e)) if e.is_permanent_data_error() => {
                return self.data_refused(publisher, delivery, &e, attempt).await;
            }
            Err(Failure::Handler(e)) if e.is_transient() && is_database_outage(e.error()) => {
                return self
                    .database_outage(publisher, delivery, &e.to_string())
                    .await;
            }
            Err(Failure::Handler(e @ HandlerError::Transient { .. })) => {
                (e.error().to_string(), e.retry_after_hint())
            }
            Err(Failure::Panic(text)) => (format!("handler panicked: {text}"), None),
            // warren's own statements could not reach the database: it is down or
            // restarting. That is no fault of the message, so it costs no attempt.
            Err(Failure::Store(e)) if e.is_connection_error() => {
                return self
                    .database_outage(publisher, delivery, &e.to_string())
                    .await;
            }
            // Any other store error (a constraint checked at commit, a
            // serialization failure) is a transient failure like any other, with
            // bounded attempts.
            Err(Failure::Store(e)) => (e.to_string(), None),
        };
        match self.config.retry.decide(attempt, retry_after) {
            RetryDecision::Retry { delay, attempt } => {
                self.retry(publisher, delivery, delay, attempt, &error)
                    .await
            }
            RetryDecision::Exhausted { attempts } => {
                self.dead_letter(
                    publisher,
                    delivery,
                    DeadLetterReason::RetriesExhausted,
                    &error,
                    attempts,
                )
                .await
            }
        }
    }

    /// Dead-letters a message whose data the database refused.
    async fn data_refused(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        error: &(dyn std::fmt::Display + Sync),
        attempt: u32,
    ) -> Outcome {
        let detail = format!("the database refused the data: {error}");
        self.dead_letter(
            publisher,
            delivery,
            DeadLetterReason::Permanent,
            &detail,
            attempt,
        )
        .await
    }

    /// The database is unreachable: pause intake (the consume loop probes until it
    /// answers) and put this delivery back without using up an attempt.
    async fn database_outage(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        error: &str,
    ) -> Outcome {
        tracing::warn!(
            message_id = message_id_of(delivery),
            error,
            "database unavailable; the message goes back to its queue"
        );
        self.telemetry.set_database_ok(false);
        self.return_to_queue(publisher, delivery).await;
        Outcome::Returned
    }

    async fn ack(&self, delivery: &Delivery) {
        let acked = broker::deadline("basic.ack", delivery.acker.ack(BasicAckOptions::default()));
        match acked.await {
            Ok(true) => {}
            Ok(false) | Err(_) => self.telemetry.ack_lost(message_id_of(delivery)),
        }
    }

    /// Finishes a copy: headers cut to fit a frame, warren's own signed.
    fn seal(&self, publisher: &Publisher, properties: BasicProperties) -> BasicProperties {
        headers::seal(properties, self.signer(), publisher.frame_max())
    }

    fn signer(&self) -> &Signer {
        self.signer
            .get()
            .expect("the signing key is loaded before any delivery is taken")
    }

    /// Sends a copy to the retry tier of `delay`, waits for the confirm, then acks
    /// the original.
    async fn retry(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        delay: Duration,
        attempt: u32,
        error: &str,
    ) -> Outcome {
        let target = self.config.retry_queue(delay);
        let properties = self.seal(publisher, retry_properties(delivery, attempt, error));
        match publisher
            .publish_raw("", &target, &delivery.data, properties)
            .await
        {
            Ok(()) => {
                tracing::warn!(
                    message_id = message_id_of(delivery),
                    attempt,
                    retry_in = %crate::retry::Delay(delay),
                    error,
                    "transient failure; retrying later"
                );
                self.ack(delivery).await;
                Outcome::Retried
            }
            Err(e) => {
                tracing::error!(
                    message_id = message_id_of(delivery),
                    error = %e,
                    "cannot reach the retry queue {target:?}; returning the message to its queue"
                );
                self.return_to_queue(publisher, delivery).await;
                Outcome::Returned
            }
        }
    }

    /// Moves the delivery to the dead-letter queue: republish with confirm, then
    /// ack. If the dead-letter queue cannot take it, the delivery goes back to its
    /// queue; it is never dropped.
    async fn dead_letter(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        reason: DeadLetterReason,
        detail: &str,
        attempts: u32,
    ) -> Outcome {
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let original = |name, fallback: &str| {
            header_str(&headers, name)
                .map(|c| c.into_owned())
                .unwrap_or_else(|| fallback.to_owned())
        };
        let info = DeadLetterInfo {
            reason: reason.as_str().to_owned(),
            error: detail.to_owned(),
            attempts,
            original_exchange: original(HEADER_ORIGINAL_EXCHANGE, delivery.exchange.as_str()),
            original_routing_key: original(
                HEADER_ORIGINAL_ROUTING_KEY,
                delivery.routing_key.as_str(),
            ),
            consumer: self.config.name.clone(),
            queue: self.config.queue.clone(),
            first_failure: None,
            last_failure: Some(Utc::now()),
        };
        let properties = self.seal(
            publisher,
            info.apply_to(&headers::copy_base(&delivery.properties, false)),
        );
        let target = self.config.dead_letter_queue();
        match publisher
            .publish_raw("", &target, &delivery.data, properties)
            .await
        {
            Ok(()) => {
                tracing::error!(
                    message_id = message_id_of(delivery),
                    reason = %reason,
                    error = detail,
                    "dead-lettered"
                );
                self.ack(delivery).await;
                Outcome::DeadLettered(reason)
            }
            Err(e) => {
                tracing::error!(
                    message_id = message_id_of(delivery),
                    reason = %reason,
                    error = %e,
                    "cannot reach the dead-letter queue {target:?}; returning the message to its queue"
                );
                self.return_to_queue(publisher, delivery).await;
                Outcome::Returned
            }
        }
    }

    /// Puts a delivery whose outcome could not be recorded back in its queue after
    /// a backoff, so nothing is lost and nothing spins hot.
    ///
    /// The copy is republished (with confirm) and the original acked, rather than
    /// nacked: a nack would count as a delivery without outcome and, repeated
    /// through an outage, would make a healthy message look like poison. Only if
    /// the main queue cannot take the copy either is the original nacked.
    async fn return_to_queue(&self, publisher: &Publisher, delivery: &Delivery) {
        tokio::time::sleep(self.config.failure_backoff).await;
        let properties = self.seal(
            publisher,
            with_original_route(&headers::copy_base(&delivery.properties, true), delivery),
        );
        match publisher
            .publish_raw("", &self.config.queue, &delivery.data, properties)
            .await
        {
            Ok(()) => self.ack(delivery).await,
            Err(e) => {
                tracing::warn!(
                    message_id = message_id_of(delivery),
                    error = %e,
                    "cannot republish to the main queue either; nacking for redelivery"
                );
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                if !matches!(
                    broker::deadline("basic.nack", delivery.acker.nack(requeue)).await,
                    Ok(true)
                ) {
                    // The channel is gone; the broker requeues the delivery itself.
                    tracing::warn!(
                        message_id = message_id_of(delivery),
                        "nack not delivered; the broker will redeliver"
                    );
                }
            }
        }
    }
}

/// `properties` with the delivery's exchange and routing key recorded, unless an
/// earlier copy already recorded the first ones: a copy travels through the
/// default exchange, and its dead-letter record should still name the original
/// route.
fn with_original_route(properties: &BasicProperties, delivery: &Delivery) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    for (name, value) in [
        (HEADER_ORIGINAL_EXCHANGE, delivery.exchange.as_str()),
        (HEADER_ORIGINAL_ROUTING_KEY, delivery.routing_key.as_str()),
    ] {
        if !headers.contains_key(name) {
            headers.insert(name.into(), dead_letter::text(value));
        }
    }
    properties.clone().with_headers(headers)
}

/// The properties of a copy bound for a retry tier: the original's, with the
/// attempt count, failure times, last error and original route recorded.
fn retry_properties(delivery: &Delivery, attempt: u32, error: &str) -> BasicProperties {
    let base = with_original_route(&headers::copy_base(&delivery.properties, false), delivery);
    let mut headers = base.headers().clone().unwrap_or_default();
    let now = dead_letter::time(Utc::now());
    if !headers.contains_key(HEADER_FIRST_FAILURE) {
        headers.insert(HEADER_FIRST_FAILURE.into(), now.clone());
    }
    headers.insert(
        HEADER_ATTEMPT.into(),
        AMQPValue::LongLongInt(attempt.into()),
    );
    headers.insert(HEADER_LAST_FAILURE.into(), now);
    headers.insert(
        HEADER_LAST_ERROR.into(),
        dead_letter::text(dead_letter::truncate(error, dead_letter::MAX_ERROR_LEN)),
    );
    base.with_headers(headers).with_delivery_mode(PERSISTENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_relay_that_ends_is_reported_and_restarted_until_shutdown() {
        let telemetry = Telemetry::new("c", "q");
        let stats = telemetry.stats().clone();
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let runs = Arc::new(AtomicU32::new(0));
        let started = Arc::clone(&runs);
        let running = stopping.clone();
        let supervisor = tokio::spawn(supervise(telemetry, stopping, move || {
            let run = started.fetch_add(1, Ordering::SeqCst);
            let mut stopping = running.clone();
            async move {
                match run {
                    0 => panic!("relay bug"),
                    1 => Err(Error::Task("relay gave up".into())),
                    _ => {
                        let _ = stopping.wait_for(|s| *s).await;
                        Ok(())
                    }
                }
            }
        }));
        // The first run panics: the health says so until the restart.
        let mut saw_down = false;
        for _ in 0..1000 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            saw_down |= !stats.health().relay;
            if runs.load(Ordering::SeqCst) >= 3 {
                break;
            }
        }
        assert!(saw_down, "an ended relay turns readiness red");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            3,
            "restarted after a panic and an error"
        );
        assert!(
            stats.health().relay,
            "green again while the third run is up"
        );
        stop.send(true).unwrap();
        supervisor.await.unwrap().unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3, "no restart after shutdown");
    }
}
