//! Storage: the inbox claim and the handler's transaction, behind one narrow trait.
//!
//! Each backend lives in its own module behind a cargo feature and carries its own
//! migrations. The consumer only ever asks a store to begin a transaction, claim a
//! message in it, and commit; it never formats SQL.

use std::future::Future;
use std::ops::{Deref, DerefMut};

use chrono::{DateTime, Utc};
use sqlx::Database;

use crate::outbox::{OutboxRow, RowOutcome};

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "postgres")]
pub use postgres::PgStore;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;

/// The open database transaction a handler writes in.
///
/// It dereferences to the driver's connection, so any sqlx query runs on it:
/// `sqlx::query("...").execute(tx.conn())`. warren owns the boundary: it begins the
/// transaction, claims the message, runs the handler, and commits or rolls back.
pub struct Tx<DB: Database> {
    inner: sqlx::Transaction<'static, DB>,
    /// The message being handled, whose ids outgoing messages carry on.
    cause: Option<crate::envelope::Metadata>,
    /// Outbox rows written, so the relay can be woken after the commit.
    enqueued: usize,
}

impl<DB: Database> Tx<DB> {
    pub(crate) fn new(inner: sqlx::Transaction<'static, DB>) -> Self {
        Self {
            inner,
            cause: None,
            enqueued: 0,
        }
    }

    pub(crate) fn set_cause(&mut self, cause: crate::envelope::Metadata) {
        self.cause = Some(cause);
    }

    pub(crate) fn enqueued(&self) -> usize {
        self.enqueued
    }

    /// The connection inside the transaction, for sqlx queries.
    pub fn conn(&mut self) -> &mut DB::Connection {
        &mut self.inner
    }

    pub(crate) async fn commit(self) -> Result<(), StoreError> {
        self.inner.commit().await.map_err(StoreError::Database)
    }

    pub(crate) async fn rollback(self) -> Result<(), StoreError> {
        self.inner.rollback().await.map_err(StoreError::Database)
    }
}

impl<DB: Database> Deref for Tx<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

impl<DB: Dialect> Tx<DB> {
    /// Writes `message` to the outbox in this transaction, for the relay to publish
    /// to `exchange` with `routing_key` after the commit. Inside a handler the
    /// message is marked as caused by the message being handled (its correlation
    /// id carried over, its causation id set to the incoming message id). Returns
    /// the outgoing message id, fixed now and never regenerated.
    pub async fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: crate::envelope::Outgoing,
    ) -> Result<String, StoreError> {
        let message = match &self.cause {
            Some(cause) => message.caused_by(cause),
            None => message,
        };
        crate::outbox::enqueue::<DB>(&mut self.inner, exchange, routing_key, &message).await?;
        self.enqueued += 1;
        Ok(message.meta().message_id.clone())
    }
}

/// A database dialect warren can write its outbox in: PostgreSQL or SQLite.
pub trait Dialect: Database {
    /// Inserts one outbox row on `conn`, inside whatever transaction it is in.
    fn insert_outbox<'c>(
        conn: &'c mut Self::Connection,
        row: &'c crate::outbox::NewOutboxRow<'c>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'c;
}

/// The name of the signing key in `warren_settings`.
pub(crate) const SIGNING_KEY_SETTING: &str = "header-signing-key";

/// Reads the signing key, storing a new random one first if there is none.
/// Every process on the database races to insert its candidate; the first
/// insert wins, and all of them read the same key back. The dialects differ
/// only in their SQL: `insert` takes (name, value), `select` takes (name).
pub(crate) async fn load_signing_key<DB>(
    pool: &sqlx::Pool<DB>,
    insert: &'static str,
    select: &'static str,
) -> Result<Vec<u8>, StoreError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'static str: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    (String,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let mut conn = pool.acquire().await?;
    sqlx::query(insert)
        .bind(SIGNING_KEY_SETTING)
        .bind(new_signing_key())
        .execute(&mut *conn)
        .await?;
    let key: String = sqlx::query_scalar(select)
        .bind(SIGNING_KEY_SETTING)
        .fetch_one(&mut *conn)
        .await?;
    Ok(key.into_bytes())
}

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
/// `sqlite`). The trait is deliberately small: everything a consumer needs to apply
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

    /// Checks, just before the commit, that the transaction can still commit. On
    /// PostgreSQL a statement that failed aborts the whole transaction, and a
    /// `COMMIT` then quietly rolls back: a handler that ignored such an error
    /// would otherwise have its message acked with nothing applied.
    fn check_before_commit<'a>(
        &'a self,
        tx: &'a mut Tx<Self::Db>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Begins a transaction that is allowed to write.
    fn begin(&self) -> impl Future<Output = Result<Tx<Self::Db>, StoreError>> + Send;

    /// Claims `entry` inside `tx` with `INSERT ... ON CONFLICT DO NOTHING`. Returns
    /// `false` if the consumer already claimed this message id: a duplicate. A copy in
    /// flight elsewhere makes this call wait until that transaction ends.
    fn claim<'a>(
        &'a self,
        tx: &'a mut Tx<Self::Db>,
        entry: &'a InboxEntry<'a>,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

    /// Deletes up to `batch` inbox rows of `consumer` processed before `cutoff`,
    /// and as many redelivery counts last touched before it; returns how many
    /// inbox rows went. Callers loop until fewer than `batch` come back, so no
    /// single statement holds locks for long.
    fn purge_inbox<'a>(
        &'a self,
        consumer: &'a str,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Counts one more redelivery of `message_id` to `consumer`, in its own
    /// committed statement (it must survive the process dying right after), and
    /// returns the count. Used to find poison messages on queues that keep no
    /// delivery count of their own.
    fn record_redelivery<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> impl Future<Output = Result<u32, StoreError>> + Send + 'a;

    /// Forgets the redelivery count of `message_id`: inside `tx` when the message
    /// reached an outcome, or on its own (`tx` = `None`) when it was dead-lettered.
    fn clear_redeliveries<'a>(
        &'a self,
        tx: Option<&'a mut Tx<Self::Db>>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;
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
    ) -> impl Future<Output = Result<Vec<crate::outbox::FailedRow>, StoreError>> + Send + '_;

    /// The counts and every failed row. Loads all failed rows: use
    /// [`outbox_counts`](Self::outbox_counts) to monitor, and
    /// [`failed_outbox_rows`](Self::failed_outbox_rows) to list a bounded number.
    fn outbox_status(
        &self,
    ) -> impl Future<Output = Result<crate::outbox::OutboxStatus, StoreError>> + Send + '_ {
        async {
            let counts = self.outbox_counts().await?;
            let failed = self
                .failed_outbox_rows(u32::try_from(counts.failed).unwrap_or(u32::MAX))
                .await?;
            Ok(crate::outbox::OutboxStatus {
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

/// An error from a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database refused or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed to apply.
    #[error("migration {version} ({name}) failed: {source}")]
    Migration {
        /// Migration number.
        version: i64,
        /// Migration name.
        name: &'static str,
        /// The database's error.
        source: sqlx::Error,
    },
    /// The database URL or options are not usable.
    #[error("invalid database configuration: {0}")]
    Config(String),
    /// A message handed to the outbox could never be published (a field too long
    /// for its AMQP property, say). Nothing was written.
    #[error("message refused by the outbox: {0}")]
    InvalidMessage(String),
}

impl StoreError {
    /// True if the database could not be reached or the connection broke; retrying
    /// later is the right response.
    pub fn is_connection_error(&self) -> bool {
        match self {
            StoreError::Database(e) => is_connection_error(e),
            _ => false,
        }
    }

    /// True if the database refused a value that no retry can make acceptable; see
    /// [`is_permanent_data_error`].
    pub fn is_permanent_data_error(&self) -> bool {
        match self {
            StoreError::Database(e) => is_permanent_data_error(e),
            _ => false,
        }
    }
}

/// True if `e` is the database refusing the data itself, so that running the same
/// message again would fail the same way:
///
/// - PostgreSQL: SQLSTATE class `22` (data exception: a NUL byte in text, a value
///   too long for `varchar(n)`, a number out of range, text that is not a number),
///   class `54` (program limit exceeded: an index row or a statement too large) and
///   `23514` (a `CHECK` constraint);
/// - SQLite: `SQLITE_TOOBIG` (18, a string or blob over the length limit),
///   `SQLITE_MISMATCH` (20, a datatype mismatch), `SQLITE_CONSTRAINT_DATATYPE`
///   (3091, a value of the wrong type in a `STRICT` table) and
///   `SQLITE_CONSTRAINT_CHECK` (275).
///
/// Unique, foreign-key, not-null and exclusion violations are left out on purpose:
/// they depend on other rows (a concurrent insert, a parent or reference row that
/// has not arrived yet), so a later attempt can succeed.
pub fn is_permanent_data_error(e: &sqlx::Error) -> bool {
    let Some(db) = e.as_database_error() else {
        return false;
    };
    #[cfg(feature = "postgres")]
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        let code = pg.code();
        return code.starts_with("22") || code.starts_with("54") || code == "23514";
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // sqlx reports SQLite's extended result code; its low byte is the primary.
        let Some(code) = db.code().and_then(|c| c.parse::<i32>().ok()) else {
            return false;
        };
        return matches!(code & 0xff, 18 | 20) || matches!(code, 275 | 3091);
    }
    false
}

/// True if `e` means the database cannot be reached or is going away: a broken
/// or unobtainable connection, or PostgreSQL's admin shutdown, crash shutdown and
/// "cannot connect now" (starting up).
pub fn is_connection_error(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
    ) || e
        .as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| matches!(c.as_ref(), "57P01" | "57P02" | "57P03"))
}

/// A numbered migration: plain SQL statements applied in order, once.
pub(crate) struct Migration {
    pub(crate) version: i64,
    pub(crate) name: &'static str,
    pub(crate) statements: &'static [&'static str],
}

/// One dialect's migrations and its SQL for the bookkeeping table.
pub(crate) struct Migrations {
    pub(crate) create_table: &'static str,
    pub(crate) record: &'static str,
    pub(crate) list: &'static [Migration],
}

impl Migrations {
    /// Applies the migrations not yet recorded, on a connection that is already in
    /// a transaction holding the dialect's migration lock.
    pub(crate) async fn apply<DB>(&self, conn: &mut DB::Connection) -> Result<(), StoreError>
    where
        DB: Database,
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
        DB::Arguments: sqlx::IntoArguments<DB>,
        i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        &'static str: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        sqlx::query(self.create_table).execute(&mut *conn).await?;
        let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM warren_migrations")
            .fetch_all(&mut *conn)
            .await?;
        for m in self.list.iter().filter(|m| !applied.contains(&m.version)) {
            for statement in m.statements {
                sqlx::query(*statement)
                    .execute(&mut *conn)
                    .await
                    .map_err(|source| StoreError::Migration {
                        version: m.version,
                        name: m.name,
                        source,
                    })?;
            }
            sqlx::query(self.record)
                .bind(m.version)
                .bind(m.name)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
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

/// An outbox row as selected: id, message id, exchange, routing key, properties
/// (JSON), body, attempts.
pub(crate) type RawOutboxRow = (i64, String, String, String, String, Vec<u8>, i64);

/// Turns raw outbox rows into [`OutboxRow`](OutboxRow)s; rows whose
/// stored properties cannot be read come back as failed outcomes instead.
pub(crate) fn outbox_rows(raw: Vec<RawOutboxRow>) -> (Vec<OutboxRow>, Vec<(i64, RowOutcome)>) {
    let mut rows = Vec::with_capacity(raw.len());
    let mut unreadable = Vec::new();
    for (id, message_id, exchange, routing_key, properties, body, attempts) in raw {
        match crate::outbox::parse_properties(&properties) {
            Ok(properties) => rows.push(OutboxRow {
                id,
                message_id,
                exchange,
                routing_key,
                properties,
                body,
                attempts,
            }),
            Err(e) => unreadable.push((id, RowOutcome::Failed(e))),
        }
    }
    (rows, unreadable)
}

pub(crate) fn failed_rows(
    raw: Vec<(i64, String, String, String, Option<String>, i64)>,
) -> Vec<crate::outbox::FailedRow> {
    raw.into_iter()
        .map(
            |(id, message_id, exchange, routing_key, last_error, attempts)| {
                crate::outbox::FailedRow {
                    id,
                    message_id,
                    exchange,
                    routing_key,
                    last_error: last_error.unwrap_or_default(),
                    attempts,
                }
            },
        )
        .collect()
}
