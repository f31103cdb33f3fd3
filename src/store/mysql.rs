//! MySQL and MariaDB store (MySQL 8.0+, MariaDB 10.6+: both have
//! `FOR UPDATE SKIP LOCKED`).

use std::str::FromStr;

use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::{Executor, MySql};

use super::StoreError;
use super::dialect::{SqlDialect, Statements, TakenBatch};
use super::migrations::{Migration, Migrations};
use super::sql::SqlStore;

/// A [`Store`](super::Store) on MySQL or MariaDB (InnoDB).
///
/// Tables live in the URL's database. Keys are bytes (`VARBINARY`), so ids
/// that differ only by case or trailing spaces stay distinct. The claim
/// is a plain `INSERT`: a concurrent copy waits on the row lock, and a
/// duplicate key (error 1062) means the message was claimed before. Sessions
/// run in strict SQL mode at `READ COMMITTED`, with times in UTC to the
/// microsecond. Relays share the outbox with `FOR UPDATE SKIP LOCKED`; there is
/// no `LISTEN`, so a relay polls, and wakes at once when a consumer in its own
/// process commits outbox rows.
pub type MySqlStore = SqlStore<MySql>;

/// Set on every connection: refuse bad data instead of truncating it, take no
/// gap locks a second claim could deadlock on, and keep times in UTC.
const SESSION_SETUP: &str = "SET SESSION sql_mode = CONCAT_WS(',', @@sql_mode, 'STRICT_ALL_TABLES'), time_zone = '+00:00'; \
     SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// The savepoint that marks the transaction warren opened. Statements that end
/// a transaction implicitly (DDL, `LOCK TABLES`, `START TRANSACTION`) or a
/// deadlock, which rolls the whole transaction back, take it with them; the
/// check before commit then finds it gone.
const MARK: &str = "SAVEPOINT warren_tx";
const CHECK_MARK: &str = "RELEASE SAVEPOINT warren_tx";

/// Locked rows belong to another relay's batch.
const TAKE_BATCH: &str = "SELECT id, CAST(message_id AS CHAR) AS message_id, exchange, routing_key,
            properties, body, attempts,
            CAST(ROUND(UNIX_TIMESTAMP(created_at) * 1000) AS SIGNED),
            traceparent, tracestate, baggage
     FROM warren_outbox
     WHERE published_at IS NULL AND failed_at IS NULL
     ORDER BY id
     LIMIT ?
     FOR UPDATE SKIP LOCKED";

impl SqlStore<MySql> {
    /// Connects with a pool of `max_connections` (size it to the consumer's
    /// concurrency plus a few for the relay and operators).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::connect_with(Self::options(url)?, max_connections).await
    }

    /// The connect options a `mysql://` URL names.
    pub fn options(url: &str) -> Result<MySqlConnectOptions, StoreError> {
        MySqlConnectOptions::from_str(url)
            .map_err(|e| StoreError::Config(format!("database URL is not a MySQL URL: {e}")))
    }

    /// Connects with explicit options.
    pub async fn connect_with(
        options: MySqlConnectOptions,
        max_connections: u32,
    ) -> Result<Self, StoreError> {
        let pool = MySqlPoolOptions::new()
            .max_connections(max_connections.max(1))
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute(sqlx::raw_sql(SESSION_SETUP)).await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await?;
        Ok(Self::from_pool(pool))
    }

    /// Wraps an existing pool, for applications that already have one. Its
    /// connections should run in strict SQL mode (MariaDB's and MySQL's
    /// default), or an over-long value is truncated instead of refused.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self::with_pool(pool)
    }
}

/// Puts the session's own lock wait timeout back, as saved in
/// `@warren_lock_wait` by the first transaction that set one of its own (a
/// no-op before that). A user variable has no declared type: MariaDB refuses
/// it unconverted.
const RESTORE_LOCK_WAIT: &str = "SET SESSION innodb_lock_wait_timeout = \
     CAST(COALESCE(@warren_lock_wait, @@SESSION.innodb_lock_wait_timeout) AS UNSIGNED)";

/// A session variable outlives the transaction on a pooled connection, so a
/// transaction with a lock timeout of its own saves the session's value once,
/// and puts it back before it ends (every other transaction warren begins
/// puts it back too, in case one ended without).
fn lock_wait_sql(lock_timeout: Option<std::time::Duration>) -> String {
    match lock_timeout {
        // Whole seconds, at least one: MySQL takes nothing finer.
        Some(t) => format!(
            "SET @warren_lock_wait = COALESCE(@warren_lock_wait, @@SESSION.innodb_lock_wait_timeout), \
             SESSION innodb_lock_wait_timeout = {}",
            t.as_millis().div_ceil(1000).max(1)
        ),
        None => RESTORE_LOCK_WAIT.to_owned(),
    }
}

impl SqlDialect for MySql {
    super::sql::shared_hooks!(MySql, MySqlConnection);
    super::sql::shared_outbox_insert!(MySql, MySqlConnection);

    const SQL: Statements = Statements {
        begin: "BEGIN",
        after_begin: Some(MARK),
        // A session lock: DDL commits as it goes, so no transaction could hold it.
        lock_migrations: Some("DO GET_LOCK(CONCAT(DATABASE(), '.warren_migrations'), 120)"),
        unlock_migrations: Some("DO RELEASE_LOCK(CONCAT(DATABASE(), '.warren_migrations'))"),
        ping: "SELECT 1",
        // Not `INSERT IGNORE`, which also turns a too-long or bad value into a
        // warning; not a no-op `ON DUPLICATE KEY UPDATE`, which reports one row
        // under the driver's CLIENT_FOUND_ROWS. A duplicate is error 1062.
        claim: "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
             VALUES (?, ?, ?, ?, ?)",
        // Batched deletes along an index: only the rows they remove are locked.
        unclaim: "DELETE FROM warren_inbox WHERE consumer_name = ? AND message_id = ?",
        claimed: "SELECT 1 FROM warren_inbox WHERE consumer_name = ? AND message_id = ?",
        purge_inbox: "DELETE FROM warren_inbox
             WHERE consumer_name = ? AND processed_at < ? ORDER BY processed_at LIMIT ?",
        purge_solo_runs: "DELETE FROM warren_solo_runs
             WHERE consumer_name = ? AND last_run_at < ? ORDER BY last_run_at LIMIT ?",
        record_solo_run: "INSERT INTO warren_solo_runs (consumer_name, message_id, runs)
             VALUES (?, ?, 1)
             ON DUPLICATE KEY UPDATE runs = runs + 1,
                                     last_run_at = UTC_TIMESTAMP(6)",
        solo_run_count: Some(
            "SELECT runs FROM warren_solo_runs WHERE consumer_name = ? AND message_id = ?",
        ),
        clear_solo_runs: "DELETE FROM warren_solo_runs WHERE consumer_name = ? AND message_id = ?",
        insert_outbox: "INSERT INTO warren_outbox (message_id, exchange, routing_key, properties, body,
                 causation_id, traceparent, tracestate, baggage)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        notify_outbox: None,
        mark_published: "UPDATE warren_outbox SET published_at = UTC_TIMESTAMP(6), attempts = attempts + 1
             WHERE id IN (SELECT j.id FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j)",
        mark_failed: "UPDATE warren_outbox SET failed_at = UTC_TIMESTAMP(6), attempts = attempts + 1,
             last_error = ? WHERE id = ?",
        mark_retry: "UPDATE warren_outbox SET attempts = attempts + 1, last_error = ? WHERE id = ?",
        outbox_counts: "SELECT
                COUNT(CASE WHEN published_at IS NULL AND failed_at IS NULL THEN 1 END),
                MIN(CASE WHEN published_at IS NULL AND failed_at IS NULL THEN created_at END),
                COUNT(published_at),
                COUNT(failed_at)
             FROM warren_outbox",
        outbox_backlog: "SELECT count(*), min(created_at) FROM warren_outbox
             WHERE published_at IS NULL AND failed_at IS NULL",
        failed_outbox_rows: "SELECT id, CAST(message_id AS CHAR) AS message_id, exchange, routing_key,
                last_error, attempts
             FROM warren_outbox WHERE failed_at IS NOT NULL ORDER BY id LIMIT ?",
        retry_all_failed: "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL",
        retry_failed_id: "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL AND id = ?",
        delete_published_before: "DELETE FROM warren_outbox
             WHERE published_at < ? ORDER BY published_at LIMIT ?",
        // Consumers are found by skipping through the primary key's (or the
        // journal index's) leading column, one lookup each, so that a message
        // is looked up by key in each consumer's rows, not by a scan.
        trail_inbox: "WITH RECURSIVE consumers(name) AS (
                SELECT MIN(consumer_name) FROM warren_inbox
                UNION ALL
                SELECT (SELECT MIN(consumer_name) FROM warren_inbox WHERE consumer_name > c.name)
                FROM consumers c WHERE c.name IS NOT NULL)
             SELECT CAST(i.consumer_name AS CHAR), i.event_type, i.received_at, i.processed_at
             FROM consumers c JOIN warren_inbox i ON i.consumer_name = c.name AND i.message_id = ?
             ORDER BY i.processed_at",
        trail_journal: "WITH RECURSIVE consumers(name) AS (
                SELECT MIN(consumer_name) FROM warren_journal
                UNION ALL
                SELECT (SELECT MIN(consumer_name) FROM warren_journal WHERE consumer_name > c.name)
                FROM consumers c WHERE c.name IS NOT NULL)
             SELECT j.consumer_name, j.replay_id, j.outcome, j.detail, j.at
             FROM consumers c JOIN warren_journal j ON j.consumer_name = c.name AND j.message_id = ?
             ORDER BY j.id LIMIT ?",
        trail_outbox: "SELECT id, CAST(message_id AS CHAR), CAST(causation_id AS CHAR), exchange, routing_key, properties,
                    created_at, published_at, failed_at, attempts, last_error, traceparent
             FROM warren_outbox WHERE message_id = ? OR causation_id = ? ORDER BY id",
        insert_setting: "INSERT INTO warren_settings (name, value) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE name = name",
        select_setting: "SELECT value FROM warren_settings WHERE name = ?",
        lease_ensure: "INSERT IGNORE INTO warren_partition_leases (consumer_name, partition_no)
             VALUES (?, ?)",
        lease_acquire: "UPDATE warren_partition_leases SET owner = ?, expires_ms = ?
             WHERE consumer_name = ? AND partition_no = ? AND (owner = '' OR expires_ms < ?)",
        lease_renew: "UPDATE warren_partition_leases SET expires_ms = ?
             WHERE consumer_name = ? AND partition_no = ? AND owner = ?",
        lease_release: "UPDATE warren_partition_leases SET owner = '', expires_ms = 0
             WHERE consumer_name = ? AND partition_no = ? AND owner = ?",
        leases: "SELECT partition_no, owner, expires_ms FROM warren_partition_leases
             WHERE consumer_name = ? ORDER BY partition_no",
        member_beat: "INSERT INTO warren_partition_members (consumer_name, member, expires_ms)
             VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE expires_ms = VALUES(expires_ms)",
        members: "SELECT member FROM warren_partition_members
             WHERE consumer_name = ? AND expires_ms > ? ORDER BY member",
        member_leave: "DELETE FROM warren_partition_members
             WHERE consumer_name = ? AND (member = ? OR expires_ms < ?)",
        version_ensure: "INSERT IGNORE INTO warren_versions (scope, entity, version)
             VALUES (?, ?, 0)",
        version_lock: "SELECT version FROM warren_versions WHERE scope = ? AND entity = ? FOR UPDATE",
        version_set: "UPDATE warren_versions SET version = ? WHERE scope = ? AND entity = ?",
    };

    const MIGRATIONS: Migrations = Migrations {
        create_table: "CREATE TABLE IF NOT EXISTS warren_migrations (
            version    BIGINT       NOT NULL PRIMARY KEY,
            name       VARCHAR(255) NOT NULL,
            applied_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6))
        ) ENGINE = InnoDB",
        record: "INSERT INTO warren_migrations (version, name) VALUES (?, ?)",
        list: &[
            Migration {
                version: 1,
                name: "inbox",
                sql: include_str!("migrations/mysql/0001_inbox.sql"),
            },
            Migration {
                version: 2,
                name: "redeliveries",
                sql: include_str!("migrations/mysql/0002_redeliveries.sql"),
            },
            Migration {
                version: 3,
                name: "outbox",
                sql: include_str!("migrations/mysql/0003_outbox.sql"),
            },
            Migration {
                version: 4,
                name: "settings",
                sql: include_str!("migrations/mysql/0004_settings.sql"),
            },
            Migration {
                version: 5,
                name: "partition leases, versions",
                sql: include_str!("migrations/mysql/0005_partitions_versions.sql"),
            },
            Migration {
                version: 6,
                name: "solo runs",
                sql: include_str!("migrations/mysql/0006_solo_runs.sql"),
            },
            Migration {
                version: 7,
                name: "dead letters",
                sql: include_str!("migrations/mysql/0007_dead_letters.sql"),
            },
            Migration {
                version: 8,
                name: "outbox trace context",
                sql: include_str!("migrations/mysql/0008_outbox_trace.sql"),
            },
        ],
    };

    type Time = NaiveDateTime;

    fn time(t: DateTime<Utc>) -> NaiveDateTime {
        t.naive_utc()
    }

    fn parse_time(t: NaiveDateTime) -> Option<DateTime<Utc>> {
        Some(t.and_utc())
    }

    fn rows_affected(done: &sqlx::mysql::MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    /// Fails with error 1305 (no such savepoint) if the transaction warren
    /// opened ended under the handler: committed by DDL, `LOCK TABLES` or
    /// `START TRANSACTION`, or rolled back by a deadlock.
    async fn check_before_commit(
        conn: &mut MySqlConnection,
        _notify: bool,
    ) -> Result<(), sqlx::Error> {
        conn.execute(sqlx::raw_sql(CHECK_MARK)).await?;
        Ok(())
    }

    const INBOX_SIZE: &'static str = "SELECT COUNT(*), COUNT(CASE WHEN processed_at < ? THEN 1 END)
             FROM warren_inbox WHERE consumer_name = ?";

    const DATABASE_NOW: Option<&'static str> = Some("SELECT UTC_TIMESTAMP(6)");

    const DEAD_LETTER_BYTES: Option<&'static str> = Some(
        "SELECT CAST(data_length + index_length AS SIGNED) FROM information_schema.tables
         WHERE table_schema = DATABASE() AND table_name = 'warren_dead_letters'",
    );

    const INSERT_DEAD_LETTER: &'static str = "INSERT INTO warren_dead_letters (letter_id, consumer_name, queue_name, message_id, event_type, correlation_id, replay_id, reason, error, attempts, original_exchange, original_routing_key, first_failure, last_failure, fingerprint, group_key, headers, properties, body, body_truncated, payload, redacted_fields, entity, entity_version, state)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

    /// `utf8mb4_bin` pads: `'a' = 'a '` holds. The lengths must agree too.
    fn text_equals(next: &mut dyn FnMut() -> String, column: &str) -> (String, usize) {
        (
            format!(
                "({column} = {} AND OCTET_LENGTH({column}) = OCTET_LENGTH({}))",
                next(),
                next()
            ),
            2,
        )
    }

    /// The payload is kept as text, so `JSON_EXTRACT` gives a number's text
    /// as stored: a number compares as the texts `serde_json` writes for
    /// values equal to it. Compared as bytes: the connection's collation
    /// folds case and pads.
    fn payload_condition(
        next: &mut dyn FnMut() -> String,
        field: &str,
        value: &str,
    ) -> (String, Vec<String>) {
        let path = super::dialect::json_path(field);
        let (p1, p2, v) = (next(), next(), next());
        let mut sql = format!(
            "(JSON_TYPE(JSON_EXTRACT(payload, {p1})) = 'STRING' \
             AND CAST(JSON_UNQUOTE(JSON_EXTRACT(payload, {p2})) AS BINARY) = CAST({v} AS BINARY))"
        );
        let mut binds = vec![path.clone(), path.clone(), value.to_owned()];
        if let Some(texts) = crate::store::compare::number_texts(value) {
            let (p1, p2) = (next(), next());
            let list: Vec<String> = texts
                .iter()
                .map(|_| format!("CAST({} AS BINARY)", next()))
                .collect();
            sql = format!(
                "({sql} OR (JSON_TYPE(JSON_EXTRACT(payload, {p1})) IN ('INTEGER', 'DOUBLE') \
                 AND CAST(JSON_EXTRACT(payload, {p2}) AS BINARY) IN ({})))",
                list.join(", ")
            );
            binds.extend([path.clone(), path]);
            binds.extend(texts);
        }
        (sql, binds)
    }

    fn lock_timeout_sql(lock_timeout: Option<std::time::Duration>) -> Option<String> {
        Some(lock_wait_sql(lock_timeout))
    }

    const RESTORE_LOCK_TIMEOUT: Option<&'static str> = Some(RESTORE_LOCK_WAIT);

    /// The rows stay locked in the open transaction until their outcomes are
    /// recorded in it.
    async fn take_batch(pool: &MySqlPool, limit: i64) -> Result<TakenBatch<MySql>, StoreError> {
        let mut tx = pool.begin().await?;
        let raw = sqlx::query_as(TAKE_BATCH)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        Ok((Some(tx), raw))
    }

    fn is_refused_claim(e: &sqlx::Error) -> bool {
        super::error::mysql_error_number(e) == Some(1062)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taking_a_batch_binds_what_take_batch_binds() {
        assert_eq!(super::super::dialect::arity_in_order(TAKE_BATCH), 1);
    }

    #[test]
    fn the_check_releases_the_savepoint_the_transaction_begins_with() {
        assert_eq!(MySql::SQL.after_begin, Some(MARK));
        assert!(CHECK_MARK.ends_with(MARK.trim_start_matches("SAVEPOINT ")));
    }
}
