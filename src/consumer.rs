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
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::Error;
use crate::broker::{self, Publisher};
use crate::dead_letter::DeadLetterInfo;
use crate::envelope::{DEFAULT_MAX_BODY_BYTES, Envelope, Incoming, InvalidMessage, Metadata};
use crate::failpoint;
use crate::failure::{DeadLetterReason, HandlerError};
use crate::handler::BoundCall;
use crate::registry::Registry;
use crate::store::{InboxEntry, Store, StoreError};
use crate::telemetry::{MessageFields, Outcome, StatsHandle, Telemetry};
use crate::topology::{QueueType, Topology, dead_letter_queue_name};

/// Default number of unacknowledged deliveries the broker may push to one consumer.
pub const DEFAULT_PREFETCH: u16 = 32;
/// Default number of messages processed at once.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default time in-flight messages get to finish after shutdown is requested.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default wait before a transiently failed delivery is returned to the queue.
pub const DEFAULT_REQUEUE_DELAY: Duration = Duration::from_secs(1);
/// Default wait before returning a delivery whose outcome could not be recorded
/// (database or dead-letter queue unreachable), so that nothing spins hot.
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
    /// Wait before a transiently failed delivery is returned to the queue.
    pub requeue_delay: Duration,
    /// Wait before a delivery is returned when its outcome could not be recorded.
    pub failure_backoff: Duration,
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
            requeue_delay: DEFAULT_REQUEUE_DELAY,
            failure_backoff: DEFAULT_FAILURE_BACKOFF,
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

    /// Sets the delay before a transiently failed delivery is requeued.
    pub fn with_requeue_delay(mut self, delay: Duration) -> Self {
        self.requeue_delay = delay;
        self
    }

    /// Sets the backoff used when an outcome cannot be recorded.
    pub fn with_failure_backoff(mut self, delay: Duration) -> Self {
        self.failure_backoff = delay;
        self
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue(&self) -> String {
        dead_letter_queue_name(&self.queue)
    }

    /// Checks every setting; the error names the setting and what is allowed.
    pub fn validate(&self) -> Result<(), Error> {
        let fail = |msg: String| Err(Error::Config(msg));
        if self.name.trim().is_empty() {
            return fail("consumer name must not be empty".into());
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
    /// `shutdown` resolves or the subscription is lost.
    ///
    /// On shutdown it cancels the subscription, takes no new deliveries, gives
    /// in-flight messages the shutdown deadline to finish (acking what committed),
    /// then closes. Deliveries that did not finish are left unacked and the broker
    /// redelivers them.
    pub async fn run<F>(self, amqp_url: &str, shutdown: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        let config = &self.inner.config;
        config.validate()?;
        failpoint::check_env().map_err(Error::Config)?;
        self.inner.store.migrate().await?;

        let connection =
            Arc::new(broker::connect(amqp_url, &format!("warren consumer {}", config.name)).await?);
        let setup = connection.create_channel().await?;
        broker::declare(&setup, &self.topology()).await?;
        let _ = setup.close(200, "topology declared".into()).await;

        let publisher = Arc::new(Publisher::new(Arc::clone(&connection)));
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await?;
        let tag = format!("warren.{}.{}", config.name, uuid::Uuid::now_v7());
        let mut deliveries = channel
            .basic_consume(
                config.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::info!(
            consumer_name = %config.name,
            queue_name = %config.queue,
            prefetch = config.prefetch,
            concurrency = config.concurrency,
            "consuming"
        );

        let permits = Arc::new(Semaphore::new(config.concurrency));
        let mut in_flight = JoinSet::new();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut ended: Result<(), Error> = Ok(());
        loop {
            // A permit first: a delivery is taken from the buffer only when a worker
            // is free, so at most `concurrency` messages are being processed.
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break,
                permit = Arc::clone(&permits).acquire_owned() => permit.expect("semaphore is never closed"),
            };
            let next = tokio::select! {
                biased;
                () = &mut shutdown => break,
                next = deliveries.next() => next,
            };
            match next {
                Some(Ok(delivery)) => {
                    let inner = Arc::clone(&self.inner);
                    let publisher = Arc::clone(&publisher);
                    in_flight.spawn(async move {
                        inner.process(&publisher, delivery).await;
                        drop(permit);
                    });
                }
                Some(Err(e)) => {
                    ended = Err(Error::SubscriptionLost {
                        queue: config.queue.clone(),
                        detail: e.to_string(),
                    });
                    break;
                }
                None => {
                    ended = Err(Error::SubscriptionLost {
                        queue: config.queue.clone(),
                        detail: "the consumer was cancelled".into(),
                    });
                    break;
                }
            }
            while let Some(done) = in_flight.try_join_next() {
                log_task_end(done);
            }
        }

        // Draining: stop the flow first, so nothing new arrives while in-flight work
        // finishes. Deliveries already buffered but not started stay unacked and
        // return to the queue when the channel closes.
        tracing::info!(in_flight = in_flight.len(), "draining");
        if channel.status().connected() {
            let _ = channel
                .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
                .await;
        }
        let drained = tokio::time::timeout(config.shutdown_timeout, async {
            while let Some(done) = in_flight.join_next().await {
                log_task_end(done);
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                unfinished = in_flight.len(),
                deadline = ?config.shutdown_timeout,
                "shutdown deadline passed; abandoning unfinished messages to redelivery"
            );
            // Aborting drops each task's transaction uncommitted; its delivery was
            // never acked, so the broker redelivers it.
            in_flight.shutdown().await;
        }
        let _ = channel.close(200, "shutdown".into()).await;
        let _ = connection.close(200, "shutdown".into()).await;
        tracing::info!(consumer_name = %config.name, "stopped");
        ended
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

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "handler panicked".to_owned()
    }
}

impl<S: Store> Inner<S> {
    /// One delivery, start to finish.
    async fn process(&self, publisher: &Publisher, delivery: Delivery) {
        let started = Instant::now();
        let received_at = Utc::now();
        self.telemetry.in_flight(1.0);
        let (outcome, meta) = match self.prepare(&delivery) {
            Err(invalid) => {
                let outcome = self
                    .dead_letter(publisher, &delivery, invalid.reason, &invalid.detail)
                    .await;
                (outcome, None)
            }
            Ok(Prepared { meta, call }) => {
                let entry = InboxEntry {
                    consumer_name: &self.config.name,
                    message_id: &meta.message_id,
                    event_type: &meta.event_type,
                    correlation_id: Some(&meta.correlation_id),
                    received_at,
                };
                let applied = self.apply(call, &entry).await;
                let outcome = self.settle(publisher, &delivery, applied).await;
                (outcome, Some(meta))
            }
        };
        let property_id = delivery.properties.message_id().as_ref();
        let fields = match &meta {
            Some(m) => MessageFields {
                message_id: &m.message_id,
                event_type: &m.event_type,
                correlation_id: &m.correlation_id,
                causation_id: m.causation_id.as_deref().unwrap_or_default(),
                redelivered: delivery.redelivered,
                retry_attempt: 0,
            },
            None => MessageFields {
                message_id: property_id.map(|s| s.as_str()).unwrap_or_default(),
                redelivered: delivery.redelivered,
                ..MessageFields::default()
            },
        };
        self.telemetry.record(outcome, &fields, started.elapsed());
        self.telemetry.in_flight(-1.0);
    }

    /// Validates the delivery and binds it to its handler. No database, no broker.
    fn prepare(&self, delivery: &Delivery) -> Result<Prepared<S::Db>, InvalidMessage> {
        let props = &delivery.properties;
        let envelope = Envelope::parse(
            Incoming {
                message_id: props.message_id().as_ref().map(|s| s.as_str()),
                content_type: props.content_type().as_ref().map(|s| s.as_str()),
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
        entry: &InboxEntry<'_>,
    ) -> Result<bool, Failure> {
        let mut tx = self.store.begin().await.map_err(Failure::Store)?;
        // The insert is the claim: a copy in flight elsewhere blocks here until the
        // first commits, then finds the row and backs off.
        let claimed = self
            .store
            .claim(&mut tx, entry)
            .await
            .map_err(Failure::Store)?;
        if !claimed {
            let _ = tx.rollback().await;
            return Ok(false);
        }
        let handled = AssertUnwindSafe(call.call(&mut tx)).catch_unwind().await;
        match handled {
            Ok(Ok(())) => {
                failpoint::hit("before-commit");
                tx.commit().await.map_err(Failure::Store)?;
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
        applied: Result<bool, Failure>,
    ) -> Outcome {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
            .unwrap_or_default();
        match applied {
            Ok(committed) => {
                self.ack(delivery, message_id).await;
                if committed {
                    Outcome::Applied
                } else {
                    Outcome::Duplicate
                }
            }
            Err(Failure::Handler(HandlerError::Permanent { error })) => {
                self.dead_letter(
                    publisher,
                    delivery,
                    DeadLetterReason::Permanent,
                    &error.to_string(),
                )
                .await
            }
            Err(Failure::Handler(e @ HandlerError::Transient { .. })) => {
                tracing::warn!(message_id, error = %e, "transient failure; requeueing");
                self.requeue(delivery, message_id, self.config.requeue_delay)
                    .await;
                Outcome::Requeued
            }
            Err(Failure::Panic(text)) => {
                tracing::error!(message_id, panic = %text, "handler panicked; treated as transient");
                self.requeue(delivery, message_id, self.config.requeue_delay)
                    .await;
                Outcome::Requeued
            }
            Err(Failure::Store(e)) => {
                tracing::warn!(message_id, error = %e, "database unavailable; requeueing after backoff");
                self.requeue(delivery, message_id, self.config.failure_backoff)
                    .await;
                Outcome::Requeued
            }
        }
    }

    async fn ack(&self, delivery: &Delivery, message_id: &str) {
        match delivery.acker.ack(BasicAckOptions::default()).await {
            Ok(true) => {}
            Ok(false) | Err(_) => self.telemetry.ack_lost(message_id),
        }
    }

    /// Returns the delivery to the queue after `delay`, so a failing message does
    /// not spin hot.
    async fn requeue(&self, delivery: &Delivery, message_id: &str, delay: Duration) {
        tokio::time::sleep(delay).await;
        let requeue = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        if !matches!(delivery.acker.nack(requeue).await, Ok(true)) {
            // The channel is gone; the broker requeues the delivery by itself.
            tracing::warn!(message_id, "nack not delivered; the broker will redeliver");
        }
    }

    /// Moves the delivery to the dead-letter queue: republish with confirm, then
    /// ack. If the dead-letter queue cannot take it, the delivery goes back to the
    /// queue after a backoff; it is never dropped.
    async fn dead_letter(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        reason: DeadLetterReason,
        detail: &str,
    ) -> Outcome {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
            .unwrap_or_default();
        let info = DeadLetterInfo {
            reason: reason.as_str().to_owned(),
            error: detail.to_owned(),
            attempts: 1,
            original_exchange: delivery.exchange.to_string(),
            original_routing_key: delivery.routing_key.to_string(),
            consumer: self.config.name.clone(),
            queue: self.config.queue.clone(),
            first_failure: None,
            last_failure: Some(Utc::now()),
        };
        let properties = info.apply_to(&delivery.properties);
        let target = self.config.dead_letter_queue();
        match publisher
            .publish_raw("", &target, &delivery.data, properties)
            .await
        {
            Ok(()) => {
                tracing::error!(message_id, reason = %reason, error = detail, "dead-lettered");
                self.ack(delivery, message_id).await;
                Outcome::DeadLettered(reason)
            }
            Err(e) => {
                tracing::error!(
                    message_id,
                    reason = %reason,
                    error = %e,
                    "cannot reach the dead-letter queue {target:?}; returning the message to its queue"
                );
                self.requeue(delivery, message_id, self.config.failure_backoff)
                    .await;
                Outcome::DeadLetterFailed
            }
        }
    }
}
