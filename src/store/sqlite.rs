//! SQLite store: the embedded default.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::Sqlite;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};

use super::StoreError;
use super::dialect::{SqlDialect, Statements, TakenBatch};
use super::migrations::{Migration, Migrations};
use super::sql::SqlStore;

/// A [`Store`](super::Store) on an SQLite file.
///
/// WAL journal, `synchronous = FULL` (a commit is on disk before the ack goes out)
/// and a busy timeout. Every writing transaction starts with `BEGIN IMMEDIATE`, so
/// two writers queue for the lock up front instead of one failing half-way with
/// `SQLITE_BUSY` when it tries to upgrade a read lock. Within one process,
/// warren's writers take turns, first come first served, before they ask SQLite
/// for the lock; writers of other processes still meet them at the lock, through
/// the busy timeout. SQLite has no row locks, so relays lease their batches
/// instead.
pub type SqliteStore = SqlStore<Sqlite>;

/// How long a relay's claim on a batch lasts: far longer than publishing a batch
/// takes, short enough that the rows of a relay that died holding it are
/// delayed by no more than this before another relay takes them. (A batch still
/// unconfirmed when its lease runs out may be published twice: at-least-once.)
const LEASE: Duration = Duration::from_secs(20);

/// Default time a writer waits for SQLite's write lock before giving up.
pub(crate) const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(30);

impl SqlStore<Sqlite> {
    /// Opens (creating if missing) the database at `url`: `sqlite://PATH` or a
    /// plain path.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = if url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(url).map_err(|e| {
                StoreError::Config(format!(
                    "invalid SQLite URL {}: {e}",
                    crate::database_url::redact_url(url)
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
        Ok(Self::with_pool(pool).one_writer_at_a_time())
    }

    /// A fresh database in memory, for tests: one connection that is never
    /// closed, because an in-memory SQLite database lives as long as its one
    /// connection and each new connection would open an empty one.
    #[cfg(feature = "testing")]
    pub(crate) async fn in_memory() -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:")
            .map_err(|e| StoreError::Config(format!("in-memory SQLite: {e}")))?
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        Ok(Self::with_pool(pool))
    }
}

/// The text form of times in warren's SQLite tables, which compares correctly as
/// a string.
fn sqlite_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

/// Stamps a lease on up to `limit` free rows and returns them, in one short write
/// transaction: the batch is then published without holding SQLite's write lock,
/// so consumers are not blocked meanwhile, and several relays on one file take
/// different rows. Binds (lease until, now, limit).
const TAKE_BATCH: &str = "UPDATE warren_outbox SET lease_until = ?1
     WHERE id IN (
        SELECT id FROM warren_outbox
        WHERE published_at IS NULL AND failed_at IS NULL
          AND (lease_until IS NULL OR lease_until < ?2)
        ORDER BY id
        LIMIT ?3)
     RETURNING id, message_id, exchange, routing_key, properties, body, attempts,
        CAST(ROUND((julianday(created_at) - 2440587.5) * 86400000.0) AS INTEGER),
        traceparent, tracestate, baggage";

impl SqlDialect for Sqlite {
    super::sql::shared_hooks!(Sqlite, SqliteConnection);
    super::sql::shared_outbox_insert!(Sqlite, SqliteConnection);

    const BATCH_TIME_LIMIT: Option<Duration> = Some(super::dialect::ONE_WRITER_BATCH_TIME_LIMIT);

    const SQL: Statements = Statements {
        begin: "BEGIN IMMEDIATE",
        after_begin: None,
        // BEGIN IMMEDIATE takes the write lock first, so concurrent starters
        // apply migrations one after another.
        lock_migrations: None,
        unlock_migrations: None,
        ping: "SELECT 1",
        claim: "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (consumer_name, message_id) DO NOTHING",
        unclaim: "DELETE FROM warren_inbox WHERE consumer_name = ?1 AND message_id = ?2",
        claimed: "SELECT 1 FROM warren_inbox WHERE consumer_name = ?1 AND message_id = ?2",
        purge_inbox: "DELETE FROM warren_inbox WHERE rowid IN (
                SELECT rowid FROM warren_inbox
                WHERE consumer_name = ?1 AND processed_at < ?2 LIMIT ?3)",
        purge_solo_runs: "DELETE FROM warren_solo_runs WHERE rowid IN (
                SELECT rowid FROM warren_solo_runs
                WHERE consumer_name = ?1 AND last_run_at < ?2 LIMIT ?3)",
        record_solo_run: "INSERT INTO warren_solo_runs (consumer_name, message_id, runs)
             VALUES (?1, ?2, 1)
             ON CONFLICT (consumer_name, message_id)
             DO UPDATE SET runs = warren_solo_runs.runs + 1,
                           last_run_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
             RETURNING runs",
        solo_run_count: None,
        clear_solo_runs: "DELETE FROM warren_solo_runs WHERE consumer_name = ?1 AND message_id = ?2",
        insert_outbox: "INSERT INTO warren_outbox (message_id, exchange, routing_key, properties, body,
                 causation_id, traceparent, tracestate, baggage)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        notify_outbox: None,
        mark_published: "UPDATE warren_outbox SET published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
             attempts = attempts + 1, lease_until = NULL
             WHERE id IN (SELECT value FROM json_each(?1))",
        mark_failed: "UPDATE warren_outbox SET failed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
             attempts = attempts + 1, last_error = ?1, lease_until = NULL WHERE id = ?2",
        mark_retry: "UPDATE warren_outbox SET attempts = attempts + 1, last_error = ?1, lease_until = NULL
             WHERE id = ?2",
        outbox_counts: "SELECT
                coalesce(sum(published_at IS NULL AND failed_at IS NULL), 0),
                min(CASE WHEN published_at IS NULL AND failed_at IS NULL THEN created_at END),
                coalesce(sum(published_at IS NOT NULL), 0),
                coalesce(sum(failed_at IS NOT NULL), 0)
             FROM warren_outbox",
        outbox_backlog: "SELECT count(*), min(created_at) FROM warren_outbox
             WHERE published_at IS NULL AND failed_at IS NULL",
        failed_outbox_rows: "SELECT id, message_id, exchange, routing_key, last_error, attempts
             FROM warren_outbox WHERE failed_at IS NOT NULL ORDER BY id LIMIT ?1",
        retry_all_failed: "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL",
        retry_failed_id: "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL AND id = ?1",
        delete_published_before: "DELETE FROM warren_outbox WHERE id IN (
                SELECT id FROM warren_outbox WHERE published_at < ?1 LIMIT ?2)",
        // Consumers are found by skipping through the primary key's (or the
        // journal index's) leading column, one lookup each, so that a message
        // is looked up by key in each consumer's rows, not by a scan.
        trail_inbox: "WITH RECURSIVE consumers(name) AS (
                SELECT MIN(consumer_name) FROM warren_inbox
                UNION ALL
                SELECT (SELECT MIN(consumer_name) FROM warren_inbox WHERE consumer_name > c.name)
                FROM consumers c WHERE c.name IS NOT NULL)
             SELECT i.consumer_name, i.event_type, i.received_at, i.processed_at
             FROM consumers c JOIN warren_inbox i ON i.consumer_name = c.name AND i.message_id = ?1
             ORDER BY i.processed_at",
        trail_journal: "WITH RECURSIVE consumers(name) AS (
                SELECT MIN(consumer_name) FROM warren_journal
                UNION ALL
                SELECT (SELECT MIN(consumer_name) FROM warren_journal WHERE consumer_name > c.name)
                FROM consumers c WHERE c.name IS NOT NULL)
             SELECT j.consumer_name, j.replay_id, j.outcome, j.detail, j.at
             FROM consumers c JOIN warren_journal j ON j.consumer_name = c.name AND j.message_id = ?1
             ORDER BY j.id LIMIT ?2",
        trail_outbox: "SELECT id, message_id, causation_id, exchange, routing_key, properties,
                    created_at, published_at, failed_at, attempts, last_error, traceparent
             FROM warren_outbox WHERE message_id = ?1 OR causation_id = ?2 ORDER BY id",
        insert_setting: "INSERT INTO warren_settings (name, value) VALUES (?1, ?2)
             ON CONFLICT (name) DO NOTHING",
        select_setting: "SELECT value FROM warren_settings WHERE name = ?1",
        lease_ensure: "INSERT INTO warren_partition_leases (consumer_name, partition_no)
             VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        lease_acquire: "UPDATE warren_partition_leases SET owner = ?1, expires_ms = ?2
             WHERE consumer_name = ?3 AND partition_no = ?4 AND (owner = '' OR expires_ms < ?5)",
        lease_renew: "UPDATE warren_partition_leases SET expires_ms = ?1
             WHERE consumer_name = ?2 AND partition_no = ?3 AND owner = ?4",
        lease_release: "UPDATE warren_partition_leases SET owner = '', expires_ms = 0
             WHERE consumer_name = ?1 AND partition_no = ?2 AND owner = ?3",
        leases: "SELECT partition_no, owner, expires_ms FROM warren_partition_leases
             WHERE consumer_name = ?1 ORDER BY partition_no",
        member_beat: "INSERT INTO warren_partition_members (consumer_name, member, expires_ms)
             VALUES (?1, ?2, ?3) ON CONFLICT (consumer_name, member) DO UPDATE SET expires_ms = excluded.expires_ms",
        members: "SELECT member FROM warren_partition_members
             WHERE consumer_name = ?1 AND expires_ms > ?2 ORDER BY member",
        member_leave: "DELETE FROM warren_partition_members
             WHERE consumer_name = ?1 AND (member = ?2 OR expires_ms < ?3)",
        version_ensure: "INSERT INTO warren_versions (scope, entity, version)
             VALUES (?1, ?2, 0) ON CONFLICT DO NOTHING",
        version_lock: "SELECT version FROM warren_versions WHERE scope = ?1 AND entity = ?2",
        version_set: "UPDATE warren_versions SET version = ?1 WHERE scope = ?2 AND entity = ?3",
    };

    const MIGRATIONS: Migrations = Migrations {
        create_table: "CREATE TABLE IF NOT EXISTS warren_migrations (
            version    INTEGER PRIMARY KEY,
            name       TEXT NOT NULL,
            applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
        )",
        record: "INSERT INTO warren_migrations (version, name) VALUES (?1, ?2)",
        list: &[
            Migration {
                version: 1,
                name: "inbox",
                sql: include_str!("migrations/sqlite/0001_inbox.sql"),
            },
            Migration {
                version: 2,
                name: "redeliveries",
                sql: include_str!("migrations/sqlite/0002_redeliveries.sql"),
            },
            Migration {
                version: 3,
                name: "outbox",
                sql: include_str!("migrations/sqlite/0003_outbox.sql"),
            },
            Migration {
                version: 4,
                name: "outbox leases",
                sql: include_str!("migrations/sqlite/0004_outbox_leases.sql"),
            },
            Migration {
                version: 5,
                name: "outbox failed index, redelivery age index",
                sql: include_str!(
                    "migrations/sqlite/0005_outbox_failed_index_redelivery_age_index.sql"
                ),
            },
            Migration {
                version: 6,
                name: "settings",
                sql: include_str!("migrations/sqlite/0006_settings.sql"),
            },
            Migration {
                version: 7,
                name: "partition leases, versions",
                sql: include_str!("migrations/sqlite/0007_partitions_versions.sql"),
            },
            Migration {
                version: 8,
                name: "solo runs",
                sql: include_str!("migrations/sqlite/0008_solo_runs.sql"),
            },
            Migration {
                version: 9,
                name: "dead letters",
                sql: include_str!("migrations/sqlite/0009_dead_letters.sql"),
            },
            Migration {
                version: 10,
                name: "outbox trace context",
                sql: include_str!("migrations/sqlite/0010_outbox_trace.sql"),
            },
        ],
    };

    /// The same text form as the column defaults, so times compare as strings.
    type Time = String;

    fn time(t: DateTime<Utc>) -> String {
        sqlite_time(t)
    }

    fn parse_time(t: String) -> Option<DateTime<Utc>> {
        DateTime::parse_from_rfc3339(&t)
            .ok()
            .map(|t| t.with_timezone(&Utc))
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    /// SQLite keeps no per-table size without the optional `dbstat` table.
    const INBOX_SIZE: &'static str = "SELECT count(*), coalesce(sum(processed_at < ?1), 0)
             FROM warren_inbox WHERE consumer_name = ?2";

    const DATABASE_NOW: Option<&'static str> = None;

    const DEAD_LETTER_BYTES: Option<&'static str> = None;

    const INSERT_DEAD_LETTER: &'static str = "INSERT INTO warren_dead_letters (letter_id, consumer_name, queue_name, message_id, event_type, correlation_id, replay_id, reason, error, attempts, original_exchange, original_routing_key, first_failure, last_failure, fingerprint, group_key, headers, properties, body, body_truncated, payload, redacted_fields, entity, entity_version, state)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18,
                 ?19, ?20, ?21, ?22, ?23, ?24, ?25)
         ON CONFLICT (letter_id) DO NOTHING";

    /// No index: a scan of the letters the other filters leave. `->` gives
    /// a number's text as stored, so a number compares as the texts
    /// `serde_json` writes for values equal to it.
    fn payload_condition(
        next: &mut dyn FnMut() -> String,
        field: &str,
        value: &str,
    ) -> (String, Vec<String>) {
        let path = super::dialect::json_path(field);
        let (p1, p2, v) = (next(), next(), next());
        let mut sql =
            format!("(json_type(payload, {p1}) = 'text' AND json_extract(payload, {p2}) = {v})");
        let mut binds = vec![path.clone(), path.clone(), value.to_owned()];
        if let Some(texts) = crate::store::compare::number_texts(value) {
            let (p1, p2) = (next(), next());
            let list: Vec<String> = texts.iter().map(|_| next()).collect();
            sql = format!(
                "({sql} OR (json_type(payload, {p1}) IN ('integer', 'real') AND (payload -> {p2}) IN ({})))",
                list.join(", ")
            );
            binds.extend([path.clone(), path]);
            binds.extend(texts);
        }
        (sql, binds)
    }

    /// A failed statement in SQLite undoes only itself; the transaction stays
    /// usable, so there is nothing to check.
    fn numbered_placeholder(n: usize) -> Option<String> {
        Some(format!("?{n}"))
    }

    async fn check_before_commit(
        _conn: &mut SqliteConnection,
        _notify: bool,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// The lease is committed before publishing; the outcomes are recorded in a
    /// second short transaction, which also frees the leases.
    async fn take_batch(pool: &SqlitePool, limit: i64) -> Result<TakenBatch<Sqlite>, StoreError> {
        let now = Utc::now();
        let lease_until = now + chrono::Duration::from_std(LEASE).unwrap_or(chrono::Duration::MAX);
        let mut tx = pool.begin_with(Self::SQL.begin).await?;
        let raw = sqlx::query_as(TAKE_BATCH)
            .bind(sqlite_time(lease_until))
            .bind(sqlite_time(now))
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok((None, raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer still waiting for its turn when SQLite's busy timeout has
    /// passed gives up as a lock SQLite could not get would: as a database
    /// that cannot be reached, which the consumer answers by pausing and
    /// handing the message back, never by waiting on.
    #[tokio::test]
    async fn a_writer_waiting_past_the_busy_timeout_for_its_turn_fails_as_unreachable() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("turns.db").display());
        let store = SqliteStore::connect(&url).await.unwrap();
        let held = std::sync::Arc::clone(store.writer.as_ref().unwrap())
            .lock_owned()
            .await;
        // Time stands still from here and jumps to the next timer whenever
        // every task waits, so the 30 s pass at once.
        tokio::time::pause();
        let asked = tokio::time::Instant::now();
        let error = tokio::time::timeout(2 * DEFAULT_BUSY_TIMEOUT, store.write_turn())
            .await
            .expect("gives up by itself")
            .unwrap_err();
        assert!(
            asked.elapsed() >= DEFAULT_BUSY_TIMEOUT,
            "{:?}",
            asked.elapsed()
        );
        assert!(error.is_connection_error(), "{error:?}");
        drop(held);
        tokio::time::resume();
        assert!(
            store.write_turn().await.unwrap().is_some(),
            "the turn is free again"
        );
    }

    #[test]
    fn taking_a_batch_binds_what_take_batch_binds() {
        assert_eq!(super::super::dialect::arity_in_order(TAKE_BATCH), 3);
    }

    #[test]
    fn times_are_written_in_the_form_the_column_defaults_use() {
        let t = DateTime::parse_from_rfc3339("2026-01-02T03:04:05.678Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(sqlite_time(t), "2026-01-02T03:04:05.678Z");
        assert_eq!(Sqlite::parse_time(sqlite_time(t)), Some(t));
    }
}
