//! The consumer: sessions with the broker (connect, declare, subscribe,
//! reconnect), intake with bounded concurrency through the dispatcher, and the
//! relay beside it. What happens to each delivery is the pipeline's.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::shutdown::cancel_on;

mod partitioned;
mod relay_supervisor;
pub(crate) mod session;
use crate::backoff::Backoff;
use crate::barrier::SoloBarrier;
use crate::broker::Delivery;
use crate::broker::{self, Port, Publisher, Subscription};
use crate::config::ConsumerConfig;
use crate::config_error::ConfigError;
use crate::dispatcher::lanes::Lanes;
use crate::dispatcher::{Batch, Dispatcher, Work};
use crate::failpoint;
use crate::headers::Signer;
use crate::pipeline::Pipeline;
use crate::registry::Registry;
use crate::shutdown::{drain, log_task_end};
use crate::store::ConsumerStore;
use crate::telemetry::StatsHandle;
use crate::topology::Topology;
use session::{
    ConnectionPair, STABLE_SESSION, Session, SessionEnd, SharedConnections, is_fatal, monitor,
};

/// A consumer: configuration, a store, and a routing table, ready to
/// [`run`](Self::run).
pub struct Consumer<S: ConsumerStore> {
    pub(crate) inner: Arc<Pipeline<S>>,
    /// Set on a partition's consumer: the connections of its partitioned
    /// consumer, shared with the other partitions.
    pub(crate) shared: Option<SharedConnections>,
}

impl<S: ConsumerStore> Consumer<S> {
    /// A consumer that will apply each message through `registry` inside a
    /// transaction of `store`.
    pub fn new<St>(config: ConsumerConfig, store: S, registry: Registry<S::Db, St>) -> Self
    where
        St: Clone + Send + Sync + 'static,
    {
        Self {
            inner: Arc::new(Pipeline::new(
                config,
                store,
                registry.erase(),
                SoloBarrier::process(),
            )),
            shared: None,
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
    ///
    /// `shutdown` can be any future: [`shutdown_signal`](crate::shutdown_signal)
    /// for SIGTERM and SIGINT, or a `tokio_util` `CancellationToken`'s
    /// `cancelled_owned()` to stop it with the rest of an application.
    pub async fn run<F>(self, amqp_url: &str, shutdown: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        let stop = CancellationToken::new();
        cancel_on(shutdown, &stop, async {
            if !self.start(amqp_url, &stop).await? {
                return Ok(());
            }
            self.consume_until(amqp_url, &stop).await
        })
        .await
    }

    /// Checks the configuration, then migrates the store and loads the signing
    /// key, waiting out a database that is not up yet. `false` if shutdown came
    /// first.
    pub(crate) async fn start(
        &self,
        amqp_url: &str,
        stop: &CancellationToken,
    ) -> Result<bool, Error> {
        self.inner.config.validate()?;
        failpoint::check_env().map_err(Error::Config)?;
        broker::parse_urls(amqp_url).map_err(|e| ConfigError::new("broker URL", e.to_string()))?;
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            let prepared = async {
                self.inner.store.migrate().await?;
                self.inner.store.signing_key().await
            };
            match prepared.await {
                Ok(key) => {
                    let _ = self.inner.signer.set(Signer::new(&key));
                    return Ok(true);
                }
                Err(e) if e.is_connection_error() => {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "database unreachable at start");
                    tokio::select! {
                        () = stop.cancelled() => return Ok(false),
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Consumes, reconnecting as needed, until `shutdown`; then drains. A
    /// partitioned consumer consumes the partitions it holds a lease on.
    pub(crate) async fn consume_until(
        &self,
        amqp_url: &str,
        stop: &CancellationToken,
    ) -> Result<(), Error> {
        let permits = Arc::new(Semaphore::new(self.inner.config.concurrency));
        let journal_stop = CancellationToken::new();
        let writer = self
            .inner
            .journal
            .start(self.inner.store.clone(), journal_stop.clone());
        let summary = self
            .inner
            .telemetry
            .summarize(self.inner.config.summary_interval, journal_stop.clone());
        let consumed = if self.inner.config.partitions.is_some() {
            self.consume_partitions(amqp_url, stop, permits).await
        } else {
            self.consume_queue(amqp_url, stop, permits).await
        };
        // Drained: the journal writes what the last deliveries queued, and
        // the summary counts them.
        journal_stop.cancel();
        if let Some(summary) = summary {
            let _ = summary.await;
        }
        if let Some(writer) = writer {
            let _ = tokio::time::timeout(Duration::from_secs(15), writer).await;
        }
        consumed
    }

    /// Consumes the one queue of this pipeline, reconnecting as needed, until
    /// `shutdown`; then drains. `permits` bound the messages processed at once.
    pub(crate) async fn consume_queue(
        &self,
        amqp_url: &str,
        stop: &CancellationToken,
        permits: Arc<Semaphore>,
    ) -> Result<(), Error> {
        let config = &self.inner.config;
        let mut in_flight = JoinSet::new();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
        loop {
            let opened = tokio::select! {
                () = stop.cancelled() => break,
                opened = self.open_session(amqp_url) => opened,
            };
            let mut session = match opened {
                Ok(session) => session,
                Err(e) if is_fatal(&e) => {
                    drain(&mut in_flight, config.shutdown_timeout).await;
                    return Err(e);
                }
                Err(e) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(
                        consumer_name = %config.name,
                        queue_name = %config.queue,
                        error = %e,
                        retry_in = ?wait,
                        "cannot consume; retrying"
                    );
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            let session_start = Instant::now();
            self.inner.telemetry.set_consuming(true);
            let end = self
                .consume(&mut session, &permits, &mut in_flight, stop)
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
                    //
                    // Not on a partition queue: there the next owner may be
                    // subscribed already (it took a lease this instance lost
                    // while stalled), kept waiting by single active consumer
                    // only while this subscription stands. Cancelled first, it
                    // would start on the deliveries after those still running
                    // or buffered here, out of order; closed after the drain,
                    // it starts with what comes back.
                    // Tasks that finished but were not collected yet are not in
                    // flight: collected first, the count is the work still running.
                    while let Some(done) = in_flight.try_join_next() {
                        log_task_end(done);
                    }
                    tracing::info!(
                        consumer_name = %config.name,
                        queue_name = %config.queue,
                        in_flight = in_flight.len(),
                        "draining"
                    );
                    if self.inner.seat.is_none() {
                        session.subscription.cancel().await;
                    }
                    drain(&mut in_flight, config.shutdown_timeout).await;
                    session.close().await;
                    break;
                }
                SessionEnd::Cancelled => {
                    // The channel is still open: what runs finishes and is
                    // acked on it, rather than come back as redeliveries to
                    // skip. Then the topology is declared again (a deleted
                    // queue comes back; a deleted partition queue stops the
                    // consumer with the ring's error) and the subscription
                    // made anew. Never idle on an open connection.
                    tracing::warn!(
                        consumer_name = %config.name,
                        queue_name = %config.queue,
                        in_flight = in_flight.len(),
                        "the broker cancelled the subscription (queue deleted or failed over, or \
                         consumer_timeout); finishing what runs, then subscribing again"
                    );
                    self.inner.telemetry.subscription_cancelled();
                    drain(&mut in_flight, config.shutdown_timeout).await;
                    session.close().await;
                    let wait = backoff.next_delay();
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(wait) => {}
                    }
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
                        () = stop.cancelled() => break,
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
        let connect = async || -> Result<ConnectionPair, Error> {
            let tls = &config.tls;
            let consume = Arc::new(
                broker::connect_with_tls(
                    amqp_url,
                    &format!("warren consumer {}", config.name),
                    tls,
                )
                .await?,
            );
            match broker::connect_with_tls(
                amqp_url,
                &format!("warren publisher {}", config.name),
                tls,
            )
            .await
            {
                Ok(publish) => Ok((consume, Arc::new(publish))),
                Err(e) => {
                    broker::close_connection(&consume, "publisher failed").await;
                    Err(e.into())
                }
            }
        };
        let (consume, publish) = match &self.shared {
            Some(shared) => shared.get(connect).await?,
            None => connect().await?,
        };
        let owns_connections = self.shared.is_none();
        let opened = async {
            if self.inner.seat.is_some() {
                // A partition queue is never declared here: one that is gone
                // took its hash binding with it, and declaring it again
                // would leave it unbound while the ring renumbered.
                if !broker::ring::queue_recovered(&consume, &config.queue).await? {
                    return Err(broker::BrokerError::RingBroken(format!(
                        "partition queue {:?} is gone; its hash binding went with it. Stop every \
                         instance, drain the partition queues, delete the hash exchange, and start \
                         again (docs/ordering.md, \"Changing the partition count\")",
                        config.queue
                    )));
                }
            } else {
                broker::declare_on(&consume, &self.topology()).await?;
            }
            let tag = format!("warren.{}.{}", config.name, uuid::Uuid::now_v7());
            Subscription::open(&consume, &config.queue, config.prefetch, &tag).await
        }
        .await;
        let subscription = match opened {
            Ok(s) => s,
            Err(e) => {
                if owns_connections {
                    broker::close_connection(&consume, "setup failed").await;
                    broker::close_connection(&publish, "setup failed").await;
                }
                return Err(e.into());
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
        let port: Arc<dyn Port> = subscription.port(Arc::new(Publisher::new(Arc::clone(&publish))));
        Ok(Session {
            consume,
            publish,
            owns_connections,
            subscription,
            port,
            lost,
            monitor,
        })
    }

    /// Takes deliveries until shutdown or until the session is lost. Deliveries
    /// are taken from the broker's buffer only when a worker is free, so at most
    /// `concurrency` batches are processed at once; the dispatcher decides what
    /// runs next, from what the broker has already sent.
    async fn consume(
        &self,
        session: &mut Session,
        permits: &Arc<Semaphore>,
        in_flight: &mut JoinSet<()>,
        stop: &CancellationToken,
    ) -> SessionEnd {
        let mut dispatcher =
            Dispatcher::new(self.inner.batch_size.clone(), self.inner.config.lanes());
        self.inner
            .telemetry
            .batch_size_now(self.inner.batch_size.get());
        self.inner
            .telemetry
            .batch_concurrency_now(self.inner.gate.limit());
        let lanes = Arc::new(Lanes::default());
        // Whatever ends the session, lanes take nothing more from it.
        let _close_lanes = CloseOnDrop(Arc::clone(&lanes));
        loop {
            if !self.inner.telemetry.stats().health().database {
                // Pause intake: a delivery taken now could only be returned.
                if let Some(end) = self.wait_for_database(session, stop).await {
                    return end;
                }
            }
            let mut permit = Some(tokio::select! {
                biased;
                () = stop.cancelled() => return SessionEnd::Shutdown,
                () = session.lost.notified() => return SessionEnd::Lost("a connection closed".into()),
                permit = Arc::clone(permits).acquire_owned() => permit.expect("semaphore is never closed"),
            });
            if dispatcher.buffered() == 0 {
                let next = tokio::select! {
                    biased;
                    () = stop.cancelled() => return SessionEnd::Shutdown,
                    () = session.lost.notified() => return SessionEnd::Lost("a connection closed".into()),
                    next = session.subscription.next() => next,
                };
                match next {
                    Some(Ok(delivery)) => dispatcher.push(delivery),
                    Some(Err(e)) => return SessionEnd::Lost(e.to_string()),
                    None if session.consume.status().connected() => {
                        return SessionEnd::Cancelled;
                    }
                    None => {
                        return SessionEnd::Lost(
                            "the subscription ended with its connection".into(),
                        );
                    }
                }
            }
            // What else the broker already sent joins, never waiting for more.
            while dispatcher.buffered() < dispatcher.batch_size() {
                match session.subscription.next_buffered() {
                    Some(Ok(delivery)) => dispatcher.push(delivery),
                    Some(Err(e)) => return SessionEnd::Lost(e.to_string()),
                    None => break,
                }
            }
            // A delivery queued behind its lane's running one needs no worker:
            // the permit goes to the next work.
            while let Some(work) = permit.is_some().then(|| dispatcher.next()).flatten() {
                let pipeline = Arc::clone(&self.inner);
                let port = Arc::clone(&session.port);
                match work {
                    Work::Lane(key, delivery) => match lanes.enter(&key, *delivery) {
                        Some(first) => {
                            let lanes = Arc::clone(&lanes);
                            let permit = permit.take();
                            in_flight.spawn(async move {
                                run_lane(&pipeline, port.as_ref(), &lanes, &key, first).await;
                                drop(permit);
                            });
                        }
                        None => self.inner.telemetry.lane_waiting(1),
                    },
                    Work::Batch(batch) => {
                        let permit = permit.take();
                        in_flight.spawn(async move {
                            pipeline.run(port.as_ref(), batch).await;
                            drop(permit);
                        });
                    }
                }
            }
            while let Some(done) = in_flight.try_join_next() {
                log_task_end(done);
            }
        }
    }

    /// Probes the database with backoff until it answers. `Some` if the session
    /// ended meanwhile.
    async fn wait_for_database(
        &self,
        session: &Session,
        stop: &CancellationToken,
    ) -> Option<SessionEnd> {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        loop {
            if self.inner.store.ping().await.is_ok() {
                self.inner.telemetry.set_database_ok(true);
                return None;
            }
            tokio::select! {
                () = stop.cancelled() => return Some(SessionEnd::Shutdown),
                () = session.lost.notified() => return Some(SessionEnd::Lost("a connection closed".into())),
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}

/// Runs `key`'s lane from `first` until it is empty or its session ended.
async fn run_lane<S: ConsumerStore>(
    pipeline: &Pipeline<S>,
    port: &dyn Port,
    lanes: &Lanes,
    key: &str,
    first: Delivery,
) {
    let mut current = first;
    loop {
        pipeline.run(port, Batch::of(current)).await;
        let (next, dropped) = lanes.next(key);
        if dropped > 0 {
            pipeline.telemetry.lane_waiting(-(dropped as i64));
        }
        match next {
            Some(delivery) => {
                pipeline.telemetry.lane_waiting(-1);
                current = delivery;
            }
            None => return,
        }
    }
}

/// Closes the lanes of a session when it ends, however it ends.
struct CloseOnDrop(Arc<Lanes>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}
