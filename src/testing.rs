//! A test kit for handlers: runs them through warren's real pipeline (the
//! envelope checks, the inbox claim, the transaction, the retry and dead-letter
//! decisions) against a real database, with an in-memory broker in place of
//! RabbitMQ. Feature `testing`; meant for `[dev-dependencies]`.
//!
//! A [`TestConsumer`] is built like a [`Consumer`](crate::Consumer), from a
//! configuration, a store and a routing table. Each `deliver` call runs one
//! delivery to the end and returns how it [`Settled`]. Then the test looks at
//! what the handler left behind: its own tables through
//! [`store`](TestConsumer::store), the events it wrote with
//! [`outbox`](TestConsumer::outbox), the copies sent to the dead-letter queue with
//! [`dead_letters`](TestConsumer::dead_letters).
//!
//! What at-least-once delivery does to a handler can be replayed on demand:
//! - [`redeliver`](TestConsumer::redeliver): the same message again;
//! - [`crash_after_commit`](TestConsumer::crash_after_commit): the handler's
//!   transaction commits, the process dies before the ack, and the broker hands
//!   the message out again;
//! - [`next_attempt`](TestConsumer::next_attempt): the copy waiting in a retry
//!   tier comes back, as it does once the tier's delay has passed (the kit does
//!   not wait the delay);
//! - [`deliver_attempt`](TestConsumer::deliver_attempt): a message arriving as
//!   attempt N.
//!
//! The kit takes a store, not a database: `TestConsumer<PgStore>`, never
//! `TestConsumer<sqlx::Postgres>` (the database, which a handler's `Tx` names).
//! The compiler says what to write instead:
//!
//! ```compile_fail
//! fn kit(_: warren::testing::TestConsumer<warren::sqlx::Postgres>) {}
//! ```
//!
//! Any [`OutboxStore`] works: [`sqlite_in_memory`] for a fresh database per
//! test, [`SqliteStore::connect`](crate::store::sqlite::SqliteStore::connect) on a file in a
//! temporary directory, or [`PgStore::connect`](crate::PgStore::connect) with
//! the URL of a test database. Give each test a database (or, on PostgreSQL, a
//! schema through `search_path`) of its own: [`outbox`](TestConsumer::outbox)
//! takes every pending row it finds, as a relay would.
//!
//! # Example
//!
//! ```
//! use warren::sqlx::{self, Sqlite};
//! use warren::testing::{Settled, TestConsumer, sqlite_in_memory};
//! use warren::{ConsumerConfig, HandlerError, Message, Outgoing, Registry, Tx};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Paid {
//!     invoice: String,
//!     amount: i64,
//! }
//!
//! async fn paid(msg: Message<Paid>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> {
//!     if msg.payload.amount < 0 {
//!         return Err(HandlerError::permanent("negative amount"));
//!     }
//!     sqlx::query("INSERT INTO points (invoice, points) VALUES (?, ?)")
//!         .bind(&msg.payload.invoice)
//!         .bind(msg.payload.amount)
//!         .execute(tx.conn())
//!         .await?;
//!     let recorded = Outgoing::new("shop.points-added.v1", 1, &msg.payload)
//!         .map_err(HandlerError::permanent)?
//!         .caused_by(&msg.meta);
//!     tx.publish("shop.events", "shop.points-added.v1", recorded).await?;
//!     Ok(())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = sqlite_in_memory().await?;
//! sqlx::query("CREATE TABLE points (invoice TEXT NOT NULL, points INTEGER NOT NULL)")
//!     .execute(store.pool())
//!     .await?;
//! let kit = TestConsumer::new(
//!     ConsumerConfig::builder("shop", "shop.invoice-paid").build()?,
//!     store,
//!     Registry::new().route("shop.invoice-paid.v1", 1, paid),
//! )
//! .await?;
//!
//! let paid = |invoice: &str, amount| {
//!     let payload = Paid { invoice: invoice.into(), amount };
//!     Outgoing::new("shop.invoice-paid.v1", 1, &payload)
//! };
//! let first = paid("in_1", 12)?;
//! assert_eq!(kit.deliver(&first).await, Settled::Applied);
//! assert_eq!(kit.redeliver(&first).await, Settled::Duplicate);
//! // Committed, then the process died before the ack: the message comes back.
//! let second = paid("in_2", 5)?;
//! assert_eq!(kit.crash_after_commit(&second).await, Settled::Duplicate);
//!
//! let points: i64 = sqlx::query_scalar("SELECT count(*) FROM points")
//!     .fetch_one(kit.store().pool())
//!     .await?;
//! assert_eq!(points, 2, "each applied once, however often it came");
//!
//! let outbox = kit.outbox().await?;
//! assert_eq!(outbox.len(), 2);
//! assert_eq!(outbox[0].meta.event_type, "shop.points-added.v1");
//! let cause = outbox[0].meta.causation_id.as_deref();
//! assert_eq!(cause, Some(first.meta().message_id.as_str()));
//!
//! let negative = serde_json::json!({ "invoice": "in_3", "amount": -3 });
//! let settled = kit.deliver_json("shop.invoice-paid.v1", 1, &negative).await;
//! assert!(matches!(
//!     settled,
//!     Settled::DeadLettered { reason: warren::admin::DeadLetterReason::Permanent, .. }
//! ));
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::amqp::{header_int, header_str};
use crate::barrier::SoloBarrier;
use crate::broker::Delivery;
use crate::broker::memory::{MemoryBroker, Published};
use crate::config::ConsumerConfig;
use crate::dead_letter::DeadLetterInfo;
use crate::dispatcher::Batch;
use crate::error::Error;
use crate::failure::DeadLetterReason;
use crate::headers::{self, HEADER_ATTEMPT, HEADER_LAST_ERROR, Signer};
use crate::outbox_row::RowOutcome;
use crate::outgoing::Outgoing;
use crate::pipeline::Pipeline;
use crate::registry::Registry;
use crate::store::{ConsumerStore, OutboxStore, StoreError};
use crate::telemetry::{ConsumerStats, Outcome};

mod outbox_message;

pub use outbox_message::OutboxMessage;

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod database;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use database::{STALE_AFTER, TestDatabase};

/// A fresh, empty SQLite database in memory, for one test. It has a single
/// connection, which a delivery's transaction takes: a test that holds the
/// connection itself (an open transaction of its own) while delivering waits
/// for it.
#[cfg(feature = "sqlite")]
pub async fn sqlite_in_memory() -> Result<crate::store::sqlite::SqliteStore, StoreError> {
    crate::store::sqlite::SqliteStore::in_memory().await
}

/// How one delivery ended: what the broker was told.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// The handler ran and its transaction committed; the delivery was acked.
    Applied,
    /// The message id was claimed before: acked without running the handler.
    Duplicate,
    /// A transient failure: a copy went to the retry tier of `delay` and the
    /// delivery was acked. [`TestConsumer::next_attempt`] brings the copy back.
    Retried {
        /// The attempt that failed (1-based).
        attempt: u32,
        /// The tier the copy waits in.
        delay: Duration,
        /// The error, as the copy records it.
        error: String,
    },
    /// A copy went to the dead-letter queue and the delivery was acked.
    /// [`TestConsumer::dead_letters`] has the whole record.
    DeadLettered {
        /// Why.
        reason: DeadLetterReason,
        /// The error text.
        error: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The database was unreachable, so no outcome could be recorded: the
    /// message went back to its queue without using an attempt. (A real
    /// broker's retry or dead-letter queue refusing the copy ends the same way;
    /// the kit's broker takes every copy.)
    Returned,
    /// The version gate found the version stale: acked, the effect not run.
    Stale,
    /// A strict-sequence gap: a copy waits in the shortest retry tier, no
    /// attempt used. [`TestConsumer::next_attempt`] brings the copy back.
    Parked,
}

/// A consumer without a broker: feeds deliveries to the handlers through
/// warren's pipeline, one at a time, and reports how each settled. See the
/// [module docs](self) for an example.
pub struct TestConsumer<S: ConsumerStore> {
    pipeline: Pipeline<S>,
    broker: MemoryBroker,
    next_tag: AtomicU64,
    state: Mutex<Seen>,
}

/// What the kit has taken from the in-memory broker and the outbox so far.
#[derive(Default)]
struct Seen {
    /// Copies in `broker.published()` already classified.
    published: usize,
    /// Retry copies not yet fed back, oldest first.
    waiting: VecDeque<Published>,
    dead_letters: Vec<DeadLetterInfo>,
    outbox: Vec<OutboxMessage>,
    /// How the copies seen settled their deliveries, by message id, until the
    /// call that made each takes it.
    settled_copies: Vec<(String, Settled)>,
}

impl<S: ConsumerStore + OutboxStore> TestConsumer<S> {
    /// A test consumer applying messages through `registry` in transactions of
    /// `store`. Migrates warren's tables and loads the signing
    /// key, as [`Consumer::run`](crate::Consumer::run) does at start.
    ///
    /// The configuration's failure backoff (the wait before a message is
    /// returned to its queue) is set to zero: a test has nothing to wait for.
    pub async fn new<St>(
        config: ConsumerConfig,
        store: S,
        registry: Registry<S::Db, St>,
    ) -> Result<Self, Error>
    where
        St: Clone + Send + Sync + 'static,
    {
        let mut config = config;
        config.failure_backoff = Duration::ZERO;
        store.migrate().await?;
        let key = store.signing_key().await?;
        Ok(Self {
            pipeline: {
                let pipeline =
                    // A barrier of its own: kits in tests running side by side
                    // never wait on each other's suspects.
                    Pipeline::new(config, store, registry.erase(), SoloBarrier::default());
                let _ = pipeline.signer.set(Signer::new(&key));
                pipeline
            },
            broker: MemoryBroker::default(),
            next_tag: AtomicU64::new(1),
            state: Mutex::new(Seen::default()),
        })
    }

    /// The store, for the handler's own tables: `kit.store().pool()` on a
    /// [`SqlStore`](crate::store::SqlStore).
    pub fn store(&self) -> &S {
        &self.pipeline.store
    }

    /// The configuration in use.
    pub fn config(&self) -> &ConsumerConfig {
        &self.pipeline.config
    }

    /// The consumer's counters since the kit was built.
    pub fn stats(&self) -> ConsumerStats {
        self.pipeline.telemetry.stats().snapshot()
    }

    /// Delivers `message` as its producer would publish it.
    pub async fn deliver(&self, message: &Outgoing) -> Settled {
        self.run(self.delivery_of(message, false, message.properties()))
            .await
    }

    /// Delivers `messages` as the broker hands out what it had buffered: in
    /// batches of up to the consumer's batch size, each applied in one
    /// transaction, as the consumer does under load. A failing message is
    /// decided alone and the others of its batch run again without it; a lock
    /// conflict splits the batch. Returns how each settled, in order.
    ///
    /// ```
    /// use warren::sqlx::{self, Sqlite};
    /// use warren::testing::{Settled, TestConsumer, sqlite_in_memory};
    /// use warren::{ConsumerConfig, HandlerError, Message, Outgoing, Registry, Tx};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Line { sku: String, qty: i64 }
    ///
    /// async fn take(msg: Message<Line>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> {
    ///     if msg.payload.qty <= 0 {
    ///         return Err(HandlerError::permanent("a line takes at least one"));
    ///     }
    ///     sqlx::query("UPDATE stock SET available = available - ? WHERE sku = ?")
    ///         .bind(msg.payload.qty)
    ///         .bind(&msg.payload.sku)
    ///         .execute(tx.conn())
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = sqlite_in_memory().await?;
    /// sqlx::query("CREATE TABLE stock (sku TEXT PRIMARY KEY, available INTEGER NOT NULL)")
    ///     .execute(store.pool())
    ///     .await?;
    /// sqlx::query("INSERT INTO stock VALUES ('a', 10)").execute(store.pool()).await?;
    /// let kit = TestConsumer::new(
    ///     ConsumerConfig::builder("shop", "shop.lines").build()?,
    ///     store,
    ///     Registry::new().route("shop.line.v1", 1, take),
    /// )
    /// .await?;
    /// let line = |qty| Outgoing::new("shop.line.v1", 1, &Line { sku: "a".into(), qty });
    /// let settled = kit.deliver_batch(&[line(2)?, line(3)?, line(0)?]).await;
    /// assert_eq!(settled[..2], [Settled::Applied, Settled::Applied]);
    /// assert!(matches!(settled[2], Settled::DeadLettered { .. }));
    /// // The batch rolled back for the failing line, and the two before it ran
    /// // again together, without it.
    /// assert_eq!(kit.stats().batches, 1);
    /// let left: i64 = sqlx::query_scalar("SELECT available FROM stock")
    ///     .fetch_one(kit.store().pool())
    ///     .await?;
    /// assert_eq!(left, 5, "the failing line rolled back alone");
    /// # Ok(())
    /// # }
    /// ```
    pub async fn deliver_batch(&self, messages: &[Outgoing]) -> Vec<Settled> {
        let mut settled = Vec::with_capacity(messages.len());
        for chunk in messages.chunks(self.pipeline.batch_size.get()) {
            let deliveries = chunk
                .iter()
                .map(|m| self.delivery_of(m, false, m.properties()))
                .collect();
            let batch = Batch {
                deliveries,
                alone: false,
            };
            settled.extend(self.run_batch(batch).await);
        }
        settled
    }

    /// Delivers `messages` side by side, each in a transaction of its own, as
    /// the consumer's workers run them when deliveries arrive one at a time:
    /// handlers that take the same rows then wait for each other or
    /// deadlock, and a deadlock's loser runs again in place. Returns how each
    /// settled, in order.
    ///
    /// ```
    /// # use warren::sqlx::{self, Sqlite};
    /// # use warren::testing::{Settled, TestConsumer, sqlite_in_memory};
    /// # use warren::{ConsumerConfig, HandlerError, Message, Outgoing, Registry, Tx};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct Paid { invoice: String }
    /// # async fn paid(msg: Message<Paid>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> {
    /// #     sqlx::query("INSERT INTO paid (invoice) VALUES (?)")
    /// #         .bind(&msg.payload.invoice)
    /// #         .execute(tx.conn())
    /// #         .await?;
    /// #     Ok(())
    /// # }
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let store = sqlite_in_memory().await?;
    /// # sqlx::query("CREATE TABLE paid (invoice TEXT NOT NULL)").execute(store.pool()).await?;
    /// # let kit = TestConsumer::new(
    /// #     ConsumerConfig::builder("shop", "shop.paid").build()?,
    /// #     store,
    /// #     Registry::new().route("shop.paid.v1", 1, paid),
    /// # )
    /// # .await?;
    /// // Eight copies of one message at once, as eight workers would take them:
    /// // the inbox lets one apply.
    /// let m = Outgoing::new("shop.paid.v1", 1, &Paid { invoice: "in_1".into() })?;
    /// let copies = vec![m; 8];
    /// let settled = kit.deliver_concurrently(&copies).await;
    /// let applied = settled.iter().filter(|s| **s == Settled::Applied).count();
    /// assert_eq!(applied, 1);
    /// assert!(settled.iter().all(|s| matches!(s, Settled::Applied | Settled::Duplicate)));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn deliver_concurrently(&self, messages: &[Outgoing]) -> Vec<Settled> {
        futures_util::future::join_all(messages.iter().map(|m| self.deliver(m))).await
    }

    /// Delivers a message of `event_type` in schema `version` with `payload`,
    /// under a fresh message id.
    ///
    /// # Panics
    ///
    /// If the message cannot be built (an empty event type, say).
    pub async fn deliver_json(
        &self,
        event_type: &str,
        version: u32,
        payload: &serde_json::Value,
    ) -> Settled {
        let message = Outgoing::new(event_type, version, payload)
            .unwrap_or_else(|e| panic!("cannot build a {event_type} v{version} message: {e}"));
        self.deliver(&message).await
    }

    /// Delivers a body and properties as they are: a message in any format
    /// the consumer reads (a bare payload, a CloudEvent; see
    /// [`format`](crate::format)), or input no [`Outgoing`] would produce (no
    /// message id, not JSON, a wrong content type). The routing key is the
    /// AMQP `type` property, if set.
    pub async fn deliver_raw(
        &self,
        body: impl Into<Vec<u8>>,
        properties: BasicProperties,
    ) -> Settled {
        let routing_key = properties
            .kind()
            .as_ref()
            .map(|k| k.to_string())
            .unwrap_or_default();
        self.run(Delivery {
            tag: 0,
            exchange: self.pipeline.config.exchange.clone().unwrap_or_default(),
            routing_key,
            redelivered: false,
            properties,
            body: body.into(),
            pruned: None,
        })
        .await
    }

    /// Delivers `message` again, marked redelivered, as the broker does after a
    /// channel or connection was lost before the ack.
    pub async fn redeliver(&self, message: &Outgoing) -> Settled {
        self.run(self.delivery_of(message, true, message.properties()))
            .await
    }

    /// Delivers `message`, lets its transaction commit, then loses the ack as a
    /// process dying at that moment would: the broker hands the message out
    /// again, redelivered. Returns how that second delivery settled; the inbox
    /// should make it [`Settled::Duplicate`].
    ///
    /// # Panics
    ///
    /// If the first delivery did not commit: there is no commit to crash after.
    pub async fn crash_after_commit(&self, message: &Outgoing) -> Settled {
        let first = self.deliver(message).await;
        assert_eq!(
            first,
            Settled::Applied,
            "crash_after_commit: the first delivery of {} did not commit",
            message.meta().message_id
        );
        // The ack the pipeline sent is the one the crash lost: the in-memory
        // broker recorded it, but nothing here reads it as a settlement.
        self.redeliver(message).await
    }

    /// Delivers `messages` as one batch ([`deliver_batch`](Self::deliver_batch)),
    /// lets its transaction commit, then loses the acks as a process dying at
    /// that moment would: the broker hands each message out again,
    /// redelivered. Returns how each second delivery settled; the inbox should
    /// make each [`Settled::Duplicate`], without a solo run.
    ///
    /// # Panics
    ///
    /// If a message of the batch did not commit.
    pub async fn crash_after_batch_commit(&self, messages: &[Outgoing]) -> Vec<Settled> {
        let first = self.deliver_batch(messages).await;
        assert!(
            first.iter().all(|s| *s == Settled::Applied),
            "crash_after_batch_commit: the batch did not commit whole: {first:?}"
        );
        let mut again = Vec::with_capacity(messages.len());
        for message in messages {
            again.push(self.redeliver(message).await);
        }
        again
    }

    /// Delivers `message` as attempt `attempt` (1-based): as the copy a retry
    /// tier returns after `attempt - 1` failed attempts. The attempt count
    /// travels in warren's signed header, so the handler sees
    /// [`Message::attempt`](crate::Message::attempt) = `attempt`, and the retry
    /// policy counts from there.
    pub async fn deliver_attempt(&self, message: &Outgoing, attempt: u32) -> Settled {
        let mut properties = message.properties();
        if attempt > 1 {
            let mut headers = properties.headers().clone().unwrap_or_default();
            headers.insert(
                HEADER_ATTEMPT.into(),
                AMQPValue::LongLongInt(i64::from(attempt - 1)),
            );
            properties = headers::seal(
                properties.with_headers(headers),
                self.pipeline.signer.get().expect("loaded in new"),
                headers::DEFAULT_FRAME_MAX,
            );
        }
        self.run(self.delivery_of(message, false, properties)).await
    }

    /// Delivers the oldest copy waiting in a retry tier, as the broker does when
    /// its delay has passed (the kit does not wait it).
    ///
    /// # Panics
    ///
    /// If no copy is waiting: no delivery settled as [`Settled::Retried`] since
    /// the last call.
    pub async fn next_attempt(&self) -> Settled {
        let copy = self
            .state
            .lock()
            .unwrap()
            .waiting
            .pop_front()
            .expect("next_attempt: no copy waits in a retry tier");
        self.run(Delivery {
            tag: 0,
            // A tier's TTL dead-letters the copy back through the default exchange.
            exchange: String::new(),
            routing_key: self.pipeline.config.queue.clone(),
            redelivered: false,
            properties: copy.properties,
            body: copy.body,
            pruned: None,
        })
        .await
    }

    /// The records of every copy sent to the dead-letter queue so far.
    pub fn dead_letters(&self) -> Vec<DeadLetterInfo> {
        self.state.lock().unwrap().dead_letters.clone()
    }

    /// Every event the handlers wrote to the outbox so far, in order.
    ///
    /// The kit plays the relay: it takes the pending rows as a relay does and
    /// marks them published, so they are listed here however often this is
    /// called, and `warren_outbox` shows them as published afterwards.
    pub async fn outbox(&self) -> Result<Vec<OutboxMessage>, StoreError> {
        loop {
            // As production's relay does, behind the suspects of its consumer.
            let _shared = self.pipeline.barrier.shared().await;
            let mut taken = Vec::new();
            let n = self
                .pipeline
                .store
                .relay_batch(100, |rows| {
                    let outcomes = rows.iter().map(|r| (r.id, RowOutcome::Published)).collect();
                    taken = rows;
                    async move { outcomes }
                })
                .await?;
            let mut state = self.state.lock().unwrap();
            for row in &taken {
                let message = OutboxMessage::of(row).map_err(|e| {
                    StoreError::Config(format!(
                        "outbox row {} cannot be read in its format: {}",
                        row.id, e.detail
                    ))
                })?;
                state.outbox.push(message);
            }
            if n == 0 {
                return Ok(state.outbox.clone());
            }
        }
    }

    /// `message` as the broker delivers it from the producer's publish to the
    /// consumer's exchange, with the event type as routing key.
    fn delivery_of(
        &self,
        message: &Outgoing,
        redelivered: bool,
        properties: BasicProperties,
    ) -> Delivery {
        Delivery {
            tag: 0,
            exchange: self.pipeline.config.exchange.clone().unwrap_or_default(),
            routing_key: message.meta().event_type.clone(),
            redelivered,
            properties,
            body: message.body(),
            pruned: None,
        }
    }

    /// Runs one delivery and reads its settlement from what the broker was told.
    async fn run(&self, delivery: Delivery) -> Settled {
        self.run_batch(Batch::of(delivery))
            .await
            .pop()
            .expect("one delivery, one outcome")
    }

    /// Runs the deliveries of `batch` as the dispatcher hands them out, and
    /// reads how each settled, in order, from what the broker was told.
    async fn run_batch(&self, mut batch: Batch) -> Vec<Settled> {
        for delivery in &mut batch.deliveries {
            delivery.tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        }
        let ids: Vec<String> = batch
            .deliveries
            .iter()
            .map(|d| d.message_id().to_owned())
            .collect();
        let outcomes = self.pipeline.run(&self.broker, batch).await;
        let published = self.broker.published();
        let mut state = self.state.lock().unwrap();
        let copies = published[state.published..].to_vec();
        state.published = published.len();
        let config = &self.pipeline.config;
        // Copies are classified as they appear, whichever call (deliveries may
        // run side by side) made them; each delivery then takes its own by id.
        for copy in copies {
            let copy_id = copy
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            if copy.queue == config.dead_letter_queue() {
                let info = DeadLetterInfo::from_properties(&copy.properties)
                    .expect("warren's dead-letter copies carry their record");
                let settled = Settled::DeadLettered {
                    reason: DeadLetterReason::from_name(&info.reason)
                        .expect("warren writes only its own reason names"),
                    error: info.error.clone(),
                    attempts: info.attempts,
                };
                state.settled_copies.push((copy_id, settled));
                state.dead_letters.push(info);
            } else if let Some(delay) = config
                .retry
                .tiers()
                .iter()
                .copied()
                .find(|d| config.retry_queue(*d) == copy.queue)
            {
                let headers = copy.properties.headers().clone().unwrap_or_default();
                let settled = Settled::Retried {
                    attempt: header_int(&headers, HEADER_ATTEMPT)
                        .and_then(|a| u32::try_from(a).ok())
                        .unwrap_or_default(),
                    delay,
                    error: header_str(&headers, HEADER_LAST_ERROR)
                        .map(|e| e.into_owned())
                        .unwrap_or_default(),
                };
                state.settled_copies.push((copy_id, settled));
                state.waiting.push_back(copy);
            }
        }
        let mut take_copy = |id: &str| {
            state
                .settled_copies
                .iter()
                .rposition(|(copy_id, _)| copy_id == id)
                .map(|at| state.settled_copies.remove(at).1)
        };
        ids.iter()
            .zip(outcomes)
            .map(|(id, outcome)| match outcome {
                Outcome::Applied => Settled::Applied,
                Outcome::Duplicate => Settled::Duplicate,
                Outcome::Returned => Settled::Returned,
                Outcome::Stale => Settled::Stale,
                Outcome::Forwarded => {
                    unreachable!("the kit consumes no partition queue, and only those forward")
                }
                Outcome::Parked => {
                    take_copy(id);
                    Settled::Parked
                }
                Outcome::Retried | Outcome::DeadLettered(_) => {
                    take_copy(id).expect("a retried or dead-lettered delivery left a copy")
                }
            })
            .collect()
    }
}

impl<S: ConsumerStore> std::fmt::Debug for TestConsumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestConsumer")
            .field("consumer", &self.pipeline.config.name)
            .field("queue", &self.pipeline.config.queue)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests;
