//! SQLite store: the embedded default.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::sqlite::SqliteConnection;
use sqlx::{AssertSqlSafe, Connection, Sqlite};

use crate::outbox::{FailedRow, NewOutboxRow, OutboxRow, RowOutcome};

use super::{
    Dialect, InboxEntry, Migration, Migrations, OutboxCounts, OutboxStore, RawOutboxRow, Store,
    StoreError, Tx, Wakeups, failed_rows, outbox_rows,
};

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
        Migration {
            version: 3,
            name: "outbox",
            statements: &[
                "CREATE TABLE warren_outbox (
                    id           INTEGER PRIMARY KEY AUTOINCREMENT,
                    message_id   TEXT    NOT NULL UNIQUE,
                    exchange     TEXT    NOT NULL,
                    routing_key  TEXT    NOT NULL,
                    properties   TEXT    NOT NULL,
                    body         BLOB    NOT NULL,
                    created_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
                    attempts     INTEGER NOT NULL DEFAULT 0,
                    last_error   TEXT    NULL,
                    published_at TEXT    NULL,
                    failed_at    TEXT    NULL
                )",
                "CREATE INDEX warren_outbox_pending ON warren_outbox (id)
                    WHERE published_at IS NULL AND failed_at IS NULL",
                "CREATE INDEX warren_outbox_published ON warren_outbox (published_at)
                    WHERE published_at IS NOT NULL",
            ],
        },
        Migration {
            version: 4,
            name: "outbox leases",
            statements: &["ALTER TABLE warren_outbox ADD COLUMN lease_until TEXT NULL"],
        },
        Migration {
            version: 5,
            name: "outbox failed index, redelivery age index",
            statements: &[
                "CREATE INDEX warren_outbox_failed ON warren_outbox (id) WHERE failed_at IS NOT NULL",
                "CREATE INDEX warren_redeliveries_age ON warren_redeliveries (consumer_name, last_delivered_at)",
            ],
        },
        Migration {
            version: 6,
            name: "settings",
            statements: &["CREATE TABLE warren_settings (
                name  TEXT PRIMARY KEY,
                value TEXT NOT NULL
            )"],
        },
    ],
};

/// How long a relay's claim on a batch lasts: far longer than publishing a batch
/// takes, short enough that the rows of a relay that died holding it are
/// delayed by no more than this before another relay takes them. (A batch still
/// unconfirmed when its lease runs out may be published twice: at-least-once.)
const LEASE: Duration = Duration::from_secs(20);

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
    wakeups: Wakeups,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url`: `sqlite://PATH` or a
    /// plain path.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = if url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(url).map_err(|e| {
                StoreError::Config(format!(
                    "invalid SQLite URL {}: {e}",
                    crate::redact_url(url)
                ))
            })?
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
        // Writers queue for SQLite's one write lock anyway; the pool only has to be
        // large enough that no task times out waiting for a connection at the
        // largest allowed concurrency (the prefetch, at most 65535 but 32 by
        // default), which would look like a database outage.
        let pool = SqlitePoolOptions::new()
            .max_connections(64)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(options)
            .await?;
        Ok(Self {
            pool,
            wakeups: Wakeups::default(),
        })
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

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn signing_key(&self) -> Result<Vec<u8>, StoreError> {
        super::load_signing_key(
            &self.pool,
            "INSERT INTO warren_settings (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
            "SELECT value FROM warren_settings WHERE name = ?",
        )
        .await
    }

    fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }

    async fn check_before_commit<'a>(&'a self, _tx: &'a mut Tx<Sqlite>) -> Result<(), StoreError> {
        // A failed statement in SQLite undoes only itself; the transaction stays
        // usable.
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
        .bind(sqlite_time(entry.received_at))
        .execute(tx.conn())
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_inbox<'a>(
        &'a self,
        consumer: &'a str,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let mut deleted = [0; 2];
        for (n, sql) in [
            "DELETE FROM warren_inbox WHERE rowid IN (
                SELECT rowid FROM warren_inbox
                WHERE consumer_name = ? AND processed_at < ? LIMIT ?)",
            // Redelivery counts older than the window belong to messages long settled.
            "DELETE FROM warren_redeliveries WHERE rowid IN (
                SELECT rowid FROM warren_redeliveries
                WHERE consumer_name = ? AND last_delivered_at < ? LIMIT ?)",
        ]
        .into_iter()
        .enumerate()
        {
            deleted[n] = sqlx::query(sql)
                .bind(consumer)
                .bind(sqlite_time(cutoff))
                .bind(i64::from(batch))
                .execute(&self.pool)
                .await?
                .rows_affected();
        }
        Ok(deleted[0])
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

/// The text form of times in warren's SQLite tables, which compares correctly as
/// a string.
fn sqlite_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

fn parse_sqlite_time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

impl Dialect for Sqlite {
    async fn insert_outbox<'c>(
        conn: &'c mut SqliteConnection,
        row: &'c NewOutboxRow<'c>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO warren_outbox (message_id, exchange, routing_key, properties, body)
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(row.message_id)
        .bind(row.exchange)
        .bind(row.routing_key)
        .bind(&row.properties)
        .bind(&row.body)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

impl OutboxStore for SqliteStore {
    /// SQLite has no row locks, so a relay leases its batch instead: one short
    /// write transaction takes rows whose lease is free and stamps them, the batch
    /// is published without holding the write lock (consumers are not blocked
    /// meanwhile), and a second short transaction records the outcomes and frees
    /// the leases. Several relays on one file therefore take different rows.
    async fn relay_batch<'a, F, Fut>(
        &'a self,
        limit: usize,
        publish: F,
    ) -> Result<usize, StoreError>
    where
        F: FnOnce(Vec<OutboxRow>) -> Fut + Send + 'a,
        Fut: Future<Output = Vec<(i64, RowOutcome)>> + Send + 'a,
    {
        let now = Utc::now();
        let lease_until = now + chrono::Duration::from_std(LEASE).unwrap_or(chrono::Duration::MAX);
        let mut conn = self.pool.acquire().await?;
        let mut claim = conn.begin_with("BEGIN IMMEDIATE").await?;
        let raw: Vec<RawOutboxRow> = sqlx::query_as(
            "UPDATE warren_outbox SET lease_until = ?
             WHERE id IN (
                SELECT id FROM warren_outbox
                WHERE published_at IS NULL AND failed_at IS NULL
                  AND (lease_until IS NULL OR lease_until < ?)
                ORDER BY id
                LIMIT ?)
             RETURNING id, message_id, exchange, routing_key, properties, body, attempts",
        )
        .bind(sqlite_time(lease_until))
        .bind(sqlite_time(now))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&mut *claim)
        .await?;
        claim.commit().await?;
        drop(conn);
        let mut raw = raw;
        // RETURNING gives no order; the batch goes out in id order.
        raw.sort_by_key(|r| r.0);
        let taken = raw.len();
        if taken == 0 {
            return Ok(0);
        }
        let (rows, unreadable) = outbox_rows(raw);
        let mut outcomes = publish(rows).await;
        outcomes.extend(unreadable);
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        for (id, outcome) in outcomes {
            let q = match &outcome {
                RowOutcome::Published => sqlx::query(AssertSqlSafe(format!(
                    "UPDATE warren_outbox SET published_at = {NOW}, attempts = attempts + 1,
                     lease_until = NULL WHERE id = ?"
                )))
                .bind(id),
                RowOutcome::Failed(e) => sqlx::query(AssertSqlSafe(format!(
                    "UPDATE warren_outbox SET failed_at = {NOW}, attempts = attempts + 1,
                     last_error = ?, lease_until = NULL WHERE id = ?"
                )))
                .bind(e)
                .bind(id),
                RowOutcome::Retry(e) => sqlx::query(
                    "UPDATE warren_outbox SET attempts = attempts + 1, last_error = ?, lease_until = NULL
                     WHERE id = ?",
                )
                .bind(e)
                .bind(id),
            };
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(taken)
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        let (pending, oldest, published, failed): (i64, Option<String>, i64, i64) = sqlx::query_as(
            "SELECT
                coalesce(sum(published_at IS NULL AND failed_at IS NULL), 0),
                min(CASE WHEN published_at IS NULL AND failed_at IS NULL THEN created_at END),
                coalesce(sum(published_at IS NOT NULL), 0),
                coalesce(sum(failed_at IS NOT NULL), 0)
             FROM warren_outbox",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(OutboxCounts {
            pending,
            oldest_pending: oldest.as_deref().and_then(parse_sqlite_time),
            published,
            failed,
        })
    }

    async fn failed_outbox_rows(&self, limit: u32) -> Result<Vec<FailedRow>, StoreError> {
        let failed: Vec<(i64, String, String, String, Option<String>, i64)> = sqlx::query_as(
            "SELECT id, message_id, exchange, routing_key, last_error, attempts
             FROM warren_outbox WHERE failed_at IS NOT NULL ORDER BY id LIMIT ?",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(failed_rows(failed))
    }

    async fn retry_failed<'a>(&'a self, ids: &'a [i64]) -> Result<u64, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let mut n = 0;
        if ids.is_empty() {
            n = sqlx::query(
                "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL",
            )
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        for id in ids {
            n += sqlx::query(
                "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL AND id = ?",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        tx.commit().await?;
        Ok(n)
    }

    async fn delete_published_before(
        &self,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM warren_outbox WHERE id IN (
                SELECT id FROM warren_outbox WHERE published_at < ? LIMIT ?)",
        )
        .bind(sqlite_time(cutoff))
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
