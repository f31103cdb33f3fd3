//! SQLite store: the embedded default.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Sqlite};

use super::{InboxEntry, Migration, Migrations, Store, StoreError, Tx};

const MIGRATIONS: Migrations = Migrations {
    create_table: "CREATE TABLE IF NOT EXISTS warren_migrations (
            version    INTEGER PRIMARY KEY,
            name       TEXT NOT NULL,
            applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
        )",
    record: "INSERT INTO warren_migrations (version, name) VALUES (?, ?)",
    list: &[
        Migration {
            version: 1,
            name: "inbox",
            statements: &[
                "CREATE TABLE warren_inbox (
                consumer_name  TEXT NOT NULL,
                message_id     TEXT NOT NULL,
                event_type     TEXT NOT NULL,
                correlation_id TEXT NULL,
                received_at    TEXT NOT NULL,
                processed_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
                PRIMARY KEY (consumer_name, message_id)
            )",
                "CREATE INDEX warren_inbox_processed_at ON warren_inbox (consumer_name, processed_at)",
            ],
        },
        Migration {
            version: 2,
            name: "redeliveries",
            statements: &["CREATE TABLE warren_redeliveries (
                consumer_name     TEXT    NOT NULL,
                message_id        TEXT    NOT NULL,
                deliveries        INTEGER NOT NULL,
                last_delivered_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
                PRIMARY KEY (consumer_name, message_id)
            )"],
        },
    ],
};

/// Default time a writer waits for SQLite's write lock before giving up.
pub(crate) const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// A [`Store`] on an SQLite file.
///
/// WAL journal, `synchronous = FULL` (a commit is on disk before the ack goes out)
/// and a busy timeout. Every writing transaction starts with `BEGIN IMMEDIATE`, so
/// two writers queue for the lock up front instead of one failing half-way with
/// `SQLITE_BUSY` when it tries to upgrade a read lock.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url`: `sqlite://PATH` or a
    /// plain path.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = if url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(url)
                .map_err(|e| StoreError::Config(format!("invalid SQLite URL {url:?}: {e}")))?
        } else {
            SqliteConnectOptions::new().filename(url)
        };
        Self::connect_with(options).await
    }

    /// Opens with explicit options; warren's journal, durability and busy-timeout
    /// settings are applied on top.
    pub async fn connect_with(options: SqliteConnectOptions) -> Result<Self, StoreError> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(DEFAULT_BUSY_TIMEOUT)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await?;
        Ok(Self { pool })
    }

    /// The pool, for the application's own queries outside a handler.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

impl Store for SqliteStore {
    type Db = Sqlite;

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        // BEGIN IMMEDIATE takes the write lock first, so concurrent starters apply
        // migrations one after another.
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        MIGRATIONS.apply::<Sqlite>(&mut tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn begin(&self) -> Result<Tx<Sqlite>, StoreError> {
        Ok(Tx::new(self.pool.begin_with("BEGIN IMMEDIATE").await?))
    }

    async fn claim<'a>(
        &'a self,
        tx: &'a mut Tx<Sqlite>,
        entry: &'a InboxEntry<'a>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
             VALUES (?, ?, ?, ?, ?)
             ON CONFLICT (consumer_name, message_id) DO NOTHING",
        )
        .bind(entry.consumer_name)
        .bind(entry.message_id)
        .bind(entry.event_type)
        .bind(entry.correlation_id)
        // The same text form as the column defaults, so times compare as strings.
        .bind(entry.received_at.format("%Y-%m-%dT%H:%M:%.3fZ").to_string())
        .execute(tx.conn())
        .await?;
        Ok(done.rows_affected() == 1)
    }
    async fn record_redelivery<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> Result<u32, StoreError> {
        let count: i64 = sqlx::query_scalar(
            "INSERT INTO warren_redeliveries (consumer_name, message_id, deliveries)
             VALUES (?, ?, 1)
             ON CONFLICT (consumer_name, message_id)
             DO UPDATE SET deliveries = warren_redeliveries.deliveries + 1,
                           last_delivered_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
             RETURNING deliveries",
        )
        .bind(consumer)
        .bind(message_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(u32::try_from(count).unwrap_or(u32::MAX))
    }

    async fn clear_redeliveries<'a>(
        &'a self,
        tx: Option<&'a mut Tx<Sqlite>>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> Result<(), StoreError> {
        let query = sqlx::query(
            "DELETE FROM warren_redeliveries WHERE consumer_name = ? AND message_id = ?",
        )
        .bind(consumer)
        .bind(message_id);
        match tx {
            Some(tx) => query.execute(tx.conn()).await?,
            None => query.execute(&self.pool).await?,
        };
        Ok(())
    }
}
