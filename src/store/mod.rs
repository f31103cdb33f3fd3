//! Storage: the inbox claim and the handler's transaction, behind one narrow trait.
//!
//! Each backend lives in its own module behind a cargo feature and carries its own
//! migrations. The consumer only ever asks a store to begin a transaction, claim a
//! message in it, and commit; it never formats SQL.
//!
//! - `tx`: the handler's transaction ([`Tx`]); its commit runs the dialect's check.
//! - `error`: [`StoreError`] and the questions callers ask of database errors.
//! - `dialect`: what a SQL database supplies: statements and hooks (`SqlDialect`).
//! - `sql`: the one implementation of [`Store`] and [`OutboxStore`] over a dialect
//!   (`SqlStore`, which `PgStore`, `SqliteStore` and `MySqlStore` name for
//!   their dialect).
//! - `migrations`: warren's tables as `.sql` files per dialect.
//! - `postgres`, `sqlite`, `mysql`: connecting, and each dialect's statements and
//!   hooks.

use std::future::Future;

use chrono::{DateTime, Utc};

use crate::outbox_row::{FailedRow, OutboxRow, OutboxStatus, RowOutcome};

mod dialect;
mod error;
mod migrations;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
mod tx;

pub use error::{StoreError, is_connection_error, is_lock_conflict, is_permanent_data_error};
#[cfg(feature = "mysql")]
pub use mysql::MySqlStore;
#[cfg(feature = "postgres")]
pub use postgres::PgStore;
pub use sql::SqlStore;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
pub use tx::Tx;

pub(crate) use error::is_after_abort;

pub(crate) use tx::insert_outbox;

/// A database dialect warren's store runs on and writes its outbox in:
/// PostgreSQL (`sqlx::Postgres`), SQLite (`sqlx::Sqlite`) or MySQL/MariaDB
/// (`sqlx::MySql`).
///
/// Sealed: a dialect is a set of statements and hooks inside warren, so a new
/// database is added to warren rather than implemented outside it. Write outbox
/// rows in a dialect's transaction with [`Tx::publish`] or
/// [`enqueue`](crate::outbox::enqueue).
pub trait Dialect: dialect::SqlDialect {}

impl<D: dialect::SqlDialect> Dialect for D {}

/// The name of the signing key in `warren_settings`.
pub(crate) const SIGNING_KEY_SETTING: &str = "header-signing-key";

/// 256 random bits from the operating system, hex-encoded.
pub(crate) fn new_signing_key() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source is available");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Wake-ups for the relays of one store: each relay holds a receiver and sees
/// every wake-up sent after it last looked, so none is lost while a relay is
/// busy publishing, and every relay on the store wakes, not just one.
#[derive(Debug, Clone)]
pub struct Wakeups(std::sync::Arc<tokio::sync::watch::Sender<u64>>);

impl Default for Wakeups {
    fn default() -> Self {
        Self(std::sync::Arc::new(tokio::sync::watch::Sender::new(0)))
    }
}

impl Wakeups {
    /// Wakes every relay of the store. Call it after committing a transaction
    /// that wrote outbox rows with [`enqueue`](crate::outbox::enqueue); the
    /// consumer does so itself for handlers' [`Tx::publish`].
    pub fn wake(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// One row of the inbox: the claim a consumer makes on a message id.
#[derive(Debug, Clone)]
pub struct InboxEntry<'a> {
    /// The deduplication boundary: one consumer's view of the message stream.
    pub consumer_name: &'a str,
    /// The producer's message id.
    pub message_id: &'a str,
    /// The event type, kept for operators.
    pub event_type: &'a str,
    /// The correlation id, kept for operators.
    pub correlation_id: Option<&'a str>,
    /// When the delivery reached the consumer.
    pub received_at: DateTime<Utc>,
}

/// A transactional store for the inbox and the handler's writes.
///
/// Implemented by [`PgStore`] (feature `postgres`) and [`SqliteStore`] (feature
/// `sqlite`), both a [`SqlStore`] over their dialect. The trait is deliberately small: everything a consumer needs to apply
/// a message once, nothing more.
pub trait Store: Clone + Send + Sync + 'static {
    /// The sqlx database the handler's transaction belongs to.
    type Db: Dialect;

    /// Applies warren's migrations for this dialect. Safe to call from several
    /// processes at once.
    fn migrate(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Checks that the database answers.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The key warren signs its own headers with (see the README, "What a
    /// producer cannot forge"). Created at random the first time any process
    /// asks, and kept in `warren_settings`, so every process on this database
    /// verifies what the others signed, across restarts.
    fn signing_key(&self) -> impl Future<Output = Result<Vec<u8>, StoreError>> + Send;

    /// Wakes the outbox relays running on this store (and its clones) now
    /// instead of at their next poll.
    fn wakeups(&self) -> &Wakeups;

    /// Begins a transaction that is allowed to write. Its commit first checks
    /// that it can still commit (see [`StoreError::Aborted`]).
    fn begin(&self) -> impl Future<Output = Result<Tx<Self::Db>, StoreError>> + Send;

    /// Begins a transaction like [`begin`](Self::begin) in which a wait for a
    /// row lock fails after `lock_timeout` as a lock conflict
    /// ([`StoreError::is_lock_conflict`]) instead of after the server's own
    /// timeout (`None` keeps that): PostgreSQL's `lock_timeout`, MySQL's and
    /// MariaDB's `innodb_lock_wait_timeout` (whole seconds). The consumer sets
    /// it on a transaction over several messages, so that a conflict between
    /// batches costs milliseconds and the batch is split, rather than waiting
    /// a second for PostgreSQL's deadlock detector. SQLite has no such wait.
    fn begin_with_lock_timeout(
        &self,
        lock_timeout: Option<std::time::Duration>,
    ) -> impl Future<Output = Result<Tx<Self::Db>, StoreError>> + Send {
        let _ = lock_timeout;
        self.begin()
    }

    /// Claims `entry` inside `tx` by inserting its inbox row (`INSERT ... ON
    /// CONFLICT DO NOTHING`). Returns `false` if the consumer already claimed this
    /// message id: a duplicate. A copy in flight elsewhere makes this call wait
    /// until that transaction ends.
    fn claim<'a>(
        &'a self,
        tx: &'a mut Tx<Self::Db>,
        entry: &'a InboxEntry<'a>,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

    /// Claims every one of `entries` (distinct message ids) inside `tx`, in
    /// the order given, and says which were new: one statement where the
    /// dialect allows it, one per entry where it does not. A batch claims its
    /// messages sorted by id, so that two batches never wait on each other in
    /// a cycle.
    fn claim_all<'a>(
        &'a self,
        tx: &'a mut Tx<Self::Db>,
        entries: &'a [InboxEntry<'a>],
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send + 'a {
        async move {
            let mut claimed = Vec::with_capacity(entries.len());
            for entry in entries {
                claimed.push(self.claim(tx, entry).await?);
            }
            Ok(claimed)
        }
    }

    /// Takes back, inside `tx`, a claim made in `tx` for a message the
    /// transaction will not apply: a batch that reached its time limit leaves
    /// the rest of its messages to the next transaction, claims included.
    fn unclaim<'a>(
        &'a self,
        tx: &'a mut Tx<Self::Db>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Deletes up to `batch` inbox rows of `consumer` processed before `cutoff`,
    /// and as many solo-run counts last touched before it; returns how many
    /// inbox rows went. Callers loop until fewer than `batch` come back, so no
    /// single statement holds locks for long.
    fn purge_inbox<'a>(
        &'a self,
        consumer: &'a str,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Records that `message_id`, a suspect (a redelivery), is about to run alone
    /// in `consumer`'s process, in its own committed statement (it must survive
    /// the process dying right after), and returns how many solo runs it has
    /// started without reaching an outcome, this one included. Only these count
    /// toward the poison limit: a crash during a solo run is evidence against the
    /// message that ran; a crash while it waited in line is not.
    fn record_solo_run<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> impl Future<Output = Result<u32, StoreError>> + Send + 'a;

    /// Forgets the solo runs of `message_id`: inside `tx` when the message
    /// reached an outcome, or on its own (`tx` = `None`) when it moved on (a retry
    /// tier, the dead-letter queue, back to its queue as a fresh copy).
    fn clear_solo_runs<'a>(
        &'a self,
        tx: Option<&'a mut Tx<Self::Db>>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// The partition leases of a partitioned consumer (see
    /// [`crate::partition`]): who holds which partition, until when.
    fn leases<'a>(
        &'a self,
        consumer: &'a str,
    ) -> impl Future<Output = Result<Vec<Lease>, StoreError>> + Send + 'a;

    /// One step of the lease protocol for `member` of `consumer`, each in its own
    /// committed statement. Times are milliseconds since the epoch.
    fn lease_step<'a>(
        &'a self,
        consumer: &'a str,
        member: &'a str,
        step: LeaseStep,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

    /// The live members of `consumer` at `now_ms`, sorted.
    fn lease_members<'a>(
        &'a self,
        consumer: &'a str,
        now_ms: i64,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send + 'a;
}

/// A partition lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The partition number, from 0.
    pub partition: u32,
    /// The member holding it; empty when free.
    pub owner: String,
    /// Until when (milliseconds since the epoch) the holder may keep it unrenewed.
    pub expires_ms: i64,
}

/// One statement of the lease protocol. `true` from [`Store::lease_step`] means
/// the step took effect (a lease taken, renewed or given back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStep {
    /// Creates the rows of partitions `0..count` where missing.
    Setup {
        /// Partitions.
        count: u32,
    },
    /// Announces the member alive until `expires_ms`.
    Beat {
        /// Alive until.
        expires_ms: i64,
    },
    /// Removes the member (and members expired before `cutoff_ms`).
    Leave {
        /// Members expired before this are removed too.
        cutoff_ms: i64,
    },
    /// Takes `partition` if it is free or its lease expired before `now_ms`.
    Acquire {
        /// Partition.
        partition: u32,
        /// Held until.
        expires_ms: i64,
        /// Now.
        now_ms: i64,
    },
    /// Extends a lease the member still holds.
    Renew {
        /// Partition.
        partition: u32,
        /// Held until.
        expires_ms: i64,
    },
    /// Gives a lease back.
    Release {
        /// Partition.
        partition: u32,
    },
}

/// The outbox side of a store: what the relay and the operators' tools need.
pub trait OutboxStore: Store {
    /// Takes up to `limit` unpublished rows in order, passes them to `publish`,
    /// and records each row's outcome. On PostgreSQL the rows stay locked
    /// (`FOR UPDATE SKIP LOCKED`) until the outcomes are recorded, so another relay
    /// skips them. Returns the number of rows handed to `publish`.
    fn relay_batch<'a, F, Fut>(
        &'a self,
        limit: usize,
        publish: F,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send + 'a
    where
        F: FnOnce(Vec<OutboxRow>) -> Fut + Send + 'a,
        Fut: Future<Output = Vec<(i64, RowOutcome)>> + Send + 'a;

    /// A listener that wakes the relay when rows are committed (PostgreSQL's
    /// `LISTEN`); `None` where the database has no such thing.
    fn listen(
        &self,
    ) -> impl Future<Output = Result<Option<OutboxListener>, StoreError>> + Send + '_ {
        async { Ok(None) }
    }

    /// Pending, published and failed counts and the oldest pending row, from one
    /// counting query: what the relay's gauges read every few seconds.
    fn outbox_counts(&self) -> impl Future<Output = Result<OutboxCounts, StoreError>> + Send + '_;

    /// Up to `limit` failed rows, oldest first.
    fn failed_outbox_rows(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<FailedRow>, StoreError>> + Send + '_;

    /// The counts and every failed row. Loads all failed rows: use
    /// [`outbox_counts`](Self::outbox_counts) to monitor, and
    /// [`failed_outbox_rows`](Self::failed_outbox_rows) to list a bounded number.
    fn outbox_status(&self) -> impl Future<Output = Result<OutboxStatus, StoreError>> + Send + '_ {
        async {
            let counts = self.outbox_counts().await?;
            let failed = self
                .failed_outbox_rows(u32::try_from(counts.failed).unwrap_or(u32::MAX))
                .await?;
            Ok(OutboxStatus {
                pending: counts.pending,
                oldest_pending: counts.oldest_pending,
                published: counts.published,
                failed,
            })
        }
    }

    /// Puts failed rows (all, or those with the given ids) back in the queue.
    fn retry_failed<'a>(
        &'a self,
        ids: &'a [i64],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Deletes up to `batch` rows published before `cutoff`; returns how many.
    fn delete_published_before(
        &self,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + '_;
}

/// Notifications that outbox rows were committed.
pub struct OutboxListener {
    #[cfg(feature = "postgres")]
    inner: sqlx::postgres::PgListener,
}

impl OutboxListener {
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(inner: sqlx::postgres::PgListener) -> Self {
        Self { inner }
    }

    /// Waits for the next notification. If the listening connection breaks, the
    /// listener reconnects; until then it waits a little, leaving the relay to
    /// its poll.
    pub async fn recv(&mut self) {
        #[cfg(feature = "postgres")]
        if self.inner.recv().await.is_ok() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// The outbox's rows by state, counted in the database.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxCounts {
    /// Rows waiting to be published.
    pub pending: i64,
    /// When the oldest waiting row was written.
    pub oldest_pending: Option<DateTime<Utc>>,
    /// Rows published and not yet deleted by housekeeping.
    pub published: i64,
    /// Rows the relay gave up on.
    pub failed: i64,
}

impl OutboxCounts {
    /// Age of the oldest pending row, in seconds (0 when nothing is pending).
    pub fn oldest_pending_age_seconds(&self, now: DateTime<Utc>) -> f64 {
        self.oldest_pending
            .map(|t| (now - t).num_milliseconds().max(0) as f64 / 1000.0)
            .unwrap_or(0.0)
    }
}
