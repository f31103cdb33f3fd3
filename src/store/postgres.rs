//! PostgreSQL store: the production backend.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use sqlx::Postgres;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

use super::dialect::{SqlDialect, Statements, TakenBatch};
use super::migrations::{Migration, Migrations};
use super::sql::SqlStore;
use super::{OutboxListener, StoreError};

/// A [`Store`](super::Store) on PostgreSQL.
///
/// Tables live in the connection's current schema (the first entry of
/// `search_path`), so one database can host several isolated warren deployments.
/// Several relays share one outbox: each takes its batch with
/// `FOR UPDATE SKIP LOCKED`, and a commit that wrote outbox rows wakes the relays
/// of every process with `NOTIFY`.
pub type PgStore = SqlStore<Postgres>;

/// The query parameters sqlx 0.9 reads from a PostgreSQL URL.
const KNOWN_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

fn without_unknown_params(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return url.to_owned();
    };
    let (known, unknown): (Vec<_>, Vec<_>) = parsed
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .partition(|(k, _)| KNOWN_PARAMS.contains(&k.as_str()));
    if unknown.is_empty() {
        return url.to_owned();
    }
    let names: Vec<&str> = unknown.iter().map(|(k, _)| k.as_str()).collect();
    tracing::warn!(parameters = ?names, "ignoring unrecognized PostgreSQL URL parameters");
    if known.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(known);
    }
    parsed.into()
}

impl SqlStore<Postgres> {
    /// Connects with a pool of `max_connections` (size it to the consumer's
    /// concurrency plus a few for the relay and operators).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::connect_with(Self::options(url)?, max_connections).await
    }

    /// The connect options a PostgreSQL URL names. Query parameters the driver
    /// does not know are dropped first (it would ignore them anyway): the driver
    /// logs each one it ignores with its value, and `sslpassword=...` is one.
    pub fn options(url: &str) -> Result<PgConnectOptions, StoreError> {
        PgConnectOptions::from_str(&without_unknown_params(url))
            .map_err(|e| StoreError::Config(format!("database URL is not a PostgreSQL URL: {e}")))
    }

    /// Connects with explicit options.
    pub async fn connect_with(
        options: PgConnectOptions,
        max_connections: u32,
    ) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .connect_with(options)
            .await?;
        Ok(Self::from_pool(pool))
    }

    /// Wraps an existing pool, for applications that already have one.
    pub fn from_pool(pool: PgPool) -> Self {
        Self::with_pool(pool)
    }
}

/// The channel the outbox writer notifies (delivered at commit) and the relay
/// listens on, so a relay wakes as soon as rows are committed.
const NOTIFY_CHANNEL: &str = "warren_outbox";

/// The claims of a batch, in the order of the arrays (message id order), one
/// statement for any number: (consumer, message ids, event types,
/// correlation ids, received at).
const CLAIM_ROWS: &str =
    "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
     SELECT $1, t.m, t.e, t.c, t.r
     FROM unnest($2::text[], $3::text[], $4::text[], $5::timestamptz[]) AS t(m, e, c, r)
     ON CONFLICT (consumer_name, message_id) DO NOTHING
     RETURNING message_id";

/// Outbox rows through arrays, one statement for any number, the columns of
/// `insert_outbox` in its order.
const INSERT_OUTBOX_ROWS: &str =
    "INSERT INTO warren_outbox (message_id, exchange, routing_key, properties, body,
         causation_id, traceparent, tracestate, baggage)
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                          $6::text[], $7::text[], $8::text[], $9::text[])";

/// Locked rows belong to another relay's batch; skipping them is what lets
/// several relays share one outbox without publishing a row twice.
const TAKE_BATCH: &str = "SELECT id, message_id, exchange, routing_key, properties, body, attempts,
            (EXTRACT(EPOCH FROM created_at) * 1000)::BIGINT, traceparent, tracestate, baggage
     FROM warren_outbox
     WHERE published_at IS NULL AND failed_at IS NULL
     ORDER BY id
     LIMIT $1
     FOR UPDATE SKIP LOCKED";

impl SqlDialect for Postgres {
    super::sql::shared_hooks!(Postgres, PgConnection);

    /// One row as the shared insert writes it; several through arrays, in
    /// one statement whose text is the same for any number of rows (prepared
    /// once per connection, not once per size).
    async fn insert_outbox<'c>(
        conn: &'c mut PgConnection,
        rows: &'c [crate::outbox_row::NewOutboxRow<'c>],
    ) -> Result<(), StoreError> {
        if rows.len() < 2 {
            return super::sql::insert_outbox::<Postgres>(conn, rows).await;
        }
        let column = |f: fn(&crate::outbox_row::NewOutboxRow<'c>) -> Option<&'c str>| {
            rows.iter().map(f).collect::<Vec<Option<&str>>>()
        };
        sqlx::query(INSERT_OUTBOX_ROWS)
            .bind(rows.iter().map(|r| r.message_id).collect::<Vec<&str>>())
            .bind(rows.iter().map(|r| r.exchange).collect::<Vec<&str>>())
            .bind(rows.iter().map(|r| r.routing_key).collect::<Vec<&str>>())
            .bind(
                rows.iter()
                    .map(|r| r.properties.as_str())
                    .collect::<Vec<&str>>(),
            )
            .bind(
                rows.iter()
                    .map(|r| r.body.as_slice())
                    .collect::<Vec<&[u8]>>(),
            )
            .bind(column(|r| r.causation_id))
            .bind(column(|r| r.trace.traceparent()))
            .bind(column(|r| r.trace.tracestate()))
            .bind(column(|r| r.trace.baggage()))
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn claim_rows<'c>(
        conn: &'c mut PgConnection,
        entries: &'c [super::InboxEntry<'c>],
    ) -> Result<Option<Vec<String>>, sqlx::Error> {
        let Some(first) = entries.first() else {
            return Ok(Some(Vec::new()));
        };
        let new = sqlx::query_scalar(CLAIM_ROWS)
            .bind(first.consumer_name)
            .bind(entries.iter().map(|e| e.message_id).collect::<Vec<&str>>())
            .bind(entries.iter().map(|e| e.event_type).collect::<Vec<&str>>())
            .bind(
                entries
                    .iter()
                    .map(|e| e.correlation_id)
                    .collect::<Vec<Option<&str>>>(),
            )
            .bind(
                entries
                    .iter()
                    .map(|e| e.received_at)
                    .collect::<Vec<DateTime<Utc>>>(),
            )
            .fetch_all(conn)
            .await?;
        Ok(Some(new))
    }

    const SQL: Statements = Statements {
        begin: "BEGIN",
        after_begin: None,
        // Scoped to this schema and released at commit. For the same
        // transaction, notices are not sent: `CREATE TABLE IF NOT EXISTS`
        // raises one on every start ("already exists, skipping"), which sqlx
        // would log at INFO.
        lock_migrations: Some(
            "SELECT set_config('client_min_messages', 'warning', true), \
             pg_advisory_xact_lock(hashtext(current_schema() || '.warren_migrations'))",
        ),
        unlock_migrations: None,
        ping: "SELECT 1",
        claim: "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (consumer_name, message_id) DO NOTHING",
        unclaim: "DELETE FROM warren_inbox WHERE consumer_name = $1 AND message_id = $2",
        claimed: "SELECT 1::BIGINT FROM warren_inbox WHERE consumer_name = $1 AND message_id = $2",
        purge_inbox: "DELETE FROM warren_inbox WHERE (consumer_name, message_id) IN (
                SELECT consumer_name, message_id FROM warren_inbox
                WHERE consumer_name = $1 AND processed_at < $2 LIMIT $3)",
        purge_solo_runs: "DELETE FROM warren_solo_runs WHERE (consumer_name, message_id) IN (
                SELECT consumer_name, message_id FROM warren_solo_runs
                WHERE consumer_name = $1 AND last_run_at < $2 LIMIT $3)",
        record_solo_run: "INSERT INTO warren_solo_runs (consumer_name, message_id, runs)
             VALUES ($1, $2, 1)
             ON CONFLICT (consumer_name, message_id)
             DO UPDATE SET runs = warren_solo_runs.runs + 1,
                           last_run_at = now()
             RETURNING runs",
        solo_run_count: None,
        clear_solo_runs: "DELETE FROM warren_solo_runs WHERE consumer_name = $1 AND message_id = $2",
        insert_outbox: "INSERT INTO warren_outbox (message_id, exchange, routing_key, properties, body,
                 causation_id, traceparent, tracestate, baggage)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        // Delivered only if and when the transaction commits.
        notify_outbox: Some("SELECT pg_notify('warren_outbox', '')"),
        mark_published: "UPDATE warren_outbox SET published_at = clock_timestamp(), attempts = attempts + 1
             WHERE id IN (SELECT jsonb_array_elements_text($1::text::jsonb)::bigint)",
        mark_failed: "UPDATE warren_outbox SET failed_at = clock_timestamp(), attempts = attempts + 1,
             last_error = $1 WHERE id = $2",
        mark_retry: "UPDATE warren_outbox SET attempts = attempts + 1, last_error = $1 WHERE id = $2",
        outbox_counts: "SELECT
                count(*) FILTER (WHERE published_at IS NULL AND failed_at IS NULL),
                min(created_at) FILTER (WHERE published_at IS NULL AND failed_at IS NULL),
                count(*) FILTER (WHERE published_at IS NOT NULL),
                count(*) FILTER (WHERE failed_at IS NOT NULL)
             FROM warren_outbox",
        outbox_backlog: "SELECT count(*), min(created_at) FROM warren_outbox
             WHERE published_at IS NULL AND failed_at IS NULL",
        failed_outbox_rows: "SELECT id, message_id, exchange, routing_key, last_error, attempts
             FROM warren_outbox WHERE failed_at IS NOT NULL ORDER BY id LIMIT $1",
        retry_all_failed: "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL",
        retry_failed_id: "UPDATE warren_outbox SET failed_at = NULL WHERE failed_at IS NOT NULL AND id = $1",
        delete_published_before: "DELETE FROM warren_outbox WHERE id IN (
                SELECT id FROM warren_outbox WHERE published_at < $1 LIMIT $2)",
        // Consumers are found by skipping through the primary key's (or the
        // journal index's) leading column, one lookup each, so that a message
        // is looked up by key in each consumer's rows, not by a scan.
        trail_inbox: "WITH RECURSIVE consumers(name) AS (
                SELECT MIN(consumer_name) FROM warren_inbox
                UNION ALL
                SELECT (SELECT MIN(consumer_name) FROM warren_inbox WHERE consumer_name > c.name)
                FROM consumers c WHERE c.name IS NOT NULL)
             SELECT i.consumer_name, i.event_type, i.received_at, i.processed_at
             FROM consumers c JOIN warren_inbox i ON i.consumer_name = c.name AND i.message_id = $1
             ORDER BY i.processed_at",
        trail_journal: "WITH RECURSIVE consumers(name) AS (
                SELECT MIN(consumer_name) FROM warren_journal
                UNION ALL
                SELECT (SELECT MIN(consumer_name) FROM warren_journal WHERE consumer_name > c.name)
                FROM consumers c WHERE c.name IS NOT NULL)
             SELECT j.consumer_name, j.replay_id, j.outcome, j.detail, j.at
             FROM consumers c JOIN warren_journal j ON j.consumer_name = c.name AND j.message_id = $1
             ORDER BY j.id LIMIT $2",
        trail_outbox: "SELECT id, message_id, causation_id, exchange, routing_key, properties,
                    created_at, published_at, failed_at, attempts, last_error, traceparent
             FROM warren_outbox WHERE message_id = $1 OR causation_id = $2 ORDER BY id",
        insert_setting: "INSERT INTO warren_settings (name, value) VALUES ($1, $2)
             ON CONFLICT (name) DO NOTHING",
        select_setting: "SELECT value FROM warren_settings WHERE name = $1",
        lease_ensure: "INSERT INTO warren_partition_leases (consumer_name, partition_no)
             VALUES ($1, $2) ON CONFLICT DO NOTHING",
        lease_acquire: "UPDATE warren_partition_leases SET owner = $1, expires_ms = $2
             WHERE consumer_name = $3 AND partition_no = $4 AND (owner = '' OR expires_ms < $5)",
        lease_renew: "UPDATE warren_partition_leases SET expires_ms = $1
             WHERE consumer_name = $2 AND partition_no = $3 AND owner = $4",
        lease_release: "UPDATE warren_partition_leases SET owner = '', expires_ms = 0
             WHERE consumer_name = $1 AND partition_no = $2 AND owner = $3",
        leases: "SELECT partition_no, owner, expires_ms FROM warren_partition_leases
             WHERE consumer_name = $1 ORDER BY partition_no",
        member_beat: "INSERT INTO warren_partition_members (consumer_name, member, expires_ms)
             VALUES ($1, $2, $3) ON CONFLICT (consumer_name, member) DO UPDATE SET expires_ms = excluded.expires_ms",
        members: "SELECT member FROM warren_partition_members
             WHERE consumer_name = $1 AND expires_ms > $2 ORDER BY member",
        member_leave: "DELETE FROM warren_partition_members
             WHERE consumer_name = $1 AND (member = $2 OR expires_ms < $3)",
        version_ensure: "INSERT INTO warren_versions (scope, entity, version)
             VALUES ($1, $2, 0) ON CONFLICT DO NOTHING",
        version_lock: "SELECT version FROM warren_versions WHERE scope = $1 AND entity = $2 FOR UPDATE",
        version_set: "UPDATE warren_versions SET version = $1 WHERE scope = $2 AND entity = $3",
    };

    const MIGRATIONS: Migrations = Migrations {
        create_table: "CREATE TABLE IF NOT EXISTS warren_migrations (
            version    BIGINT      PRIMARY KEY,
            name       TEXT        NOT NULL,
            applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
        )",
        record: "INSERT INTO warren_migrations (version, name) VALUES ($1, $2)",
        list: &[
            Migration {
                version: 1,
                name: "inbox",
                sql: include_str!("migrations/postgres/0001_inbox.sql"),
            },
            Migration {
                version: 2,
                name: "redeliveries",
                sql: include_str!("migrations/postgres/0002_redeliveries.sql"),
            },
            Migration {
                version: 3,
                name: "outbox",
                sql: include_str!("migrations/postgres/0003_outbox.sql"),
            },
            Migration {
                version: 4,
                name: "outbox failed index, redelivery age index",
                sql: include_str!(
                    "migrations/postgres/0004_outbox_failed_index_redelivery_age_index.sql"
                ),
            },
            Migration {
                version: 5,
                name: "settings",
                sql: include_str!("migrations/postgres/0005_settings.sql"),
            },
            Migration {
                version: 6,
                name: "partition leases, versions",
                sql: include_str!("migrations/postgres/0006_partitions_versions.sql"),
            },
            Migration {
                version: 7,
                name: "solo runs",
                sql: include_str!("migrations/postgres/0007_solo_runs.sql"),
            },
            Migration {
                version: 8,
                name: "dead letters",
                sql: include_str!("migrations/postgres/0008_dead_letters.sql"),
            },
            Migration {
                version: 9,
                name: "outbox trace context",
                sql: include_str!("migrations/postgres/0009_outbox_trace.sql"),
            },
        ],
    };

    type Time = DateTime<Utc>;

    fn time(t: DateTime<Utc>) -> DateTime<Utc> {
        t
    }

    fn parse_time(t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        Some(t)
    }

    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn numbered_placeholder(n: usize) -> Option<String> {
        Some(format!("${n}"))
    }

    async fn check_before_commit(conn: &mut PgConnection, notify: bool) -> Result<(), sqlx::Error> {
        // Either fails with 25P02 (in failed SQL transaction) if an earlier
        // statement aborted the transaction. The notification is delivered
        // only if and when the transaction commits.
        let check = match Self::SQL.notify_outbox {
            Some(notify_outbox) if notify => notify_outbox,
            _ => "SELECT 1",
        };
        sqlx::query(check).execute(conn).await?;
        Ok(())
    }

    /// `SET LOCAL` ends with the transaction: a unit of one message keeps
    /// the server's setting. A lock timeout shorter than `deadlock_timeout`
    /// (1 s by default, settable by a superuser only) also ends a deadlock
    /// before PostgreSQL would look for one.
    /// sqlx begins a PostgreSQL transaction with a simple query.
    const BEGIN_TAKES_MORE: bool = true;

    const INBOX_SIZE: &'static str = "SELECT count(*), count(*) FILTER (WHERE processed_at < $1)
             FROM warren_inbox WHERE consumer_name = $2";

    const DATABASE_NOW: Option<&'static str> = Some("SELECT now()");

    const DEAD_LETTER_BYTES: Option<&'static str> =
        Some("SELECT pg_total_relation_size('warren_dead_letters')::BIGINT");

    const INSERT_DEAD_LETTER: &'static str = "INSERT INTO warren_dead_letters (letter_id, consumer_name, queue_name, message_id, event_type, correlation_id, replay_id, reason, error, attempts, original_exchange, original_routing_key, first_failure, last_failure, fingerprint, group_key, headers, properties, body, body_truncated, payload, redacted_fields, entity, entity_version, state)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
                 $19, $20, $21::jsonb, $22, $23, $24, $25)
         ON CONFLICT (letter_id) DO NOTHING";

    /// `COLLATE "C"`: a database created with a language's collation
    /// would otherwise sort `B` before `a`, unlike the other stores.
    fn binary(column: &str) -> String {
        format!("{column} COLLATE \"C\"")
    }

    /// Containment (`@>`), which the payload's GIN index serves; a dotted
    /// field nests one object per step. A string matches only a string, a
    /// `numeric` only a number, and numbers compare exactly.
    fn payload_condition(
        next: &mut dyn FnMut() -> String,
        field: &str,
        value: &str,
    ) -> (String, Vec<String>) {
        let steps: Vec<&str> = field.split('.').collect();
        let mut contains = |leaf: &str| {
            let keys: Vec<String> = steps.iter().map(|_| next()).collect();
            let mut object = leaf.replace("{}", &next());
            for key in keys.iter().rev() {
                object = format!("jsonb_build_object({key}::text, {object})");
            }
            format!("payload @> {object}")
        };
        let mut binds: Vec<String> = steps.iter().map(|s| (*s).to_owned()).collect();
        binds.push(value.to_owned());
        let text = contains("{}::text");
        // Only a number within the input rules is cast: `1e-20000` would
        // overflow `numeric`, and a number of more digits than a float
        // holds would match differently here than on the other stores.
        if crate::store::compare::number_texts(value).is_some() {
            let number = contains("({})::numeric");
            binds.extend(steps.iter().map(|s| (*s).to_owned()));
            binds.push(value.to_owned());
            (format!("({text} OR {number})"), binds)
        } else {
            (text, binds)
        }
    }

    fn lock_timeout_sql(lock_timeout: Option<std::time::Duration>) -> Option<String> {
        lock_timeout.map(|t| format!("SET LOCAL lock_timeout = {}", t.as_millis().max(1)))
    }

    /// The rows stay locked in the open transaction until their outcomes are
    /// recorded in it. That transaction does not wait for its commit to reach
    /// the disk: a mark lost in a crash only publishes its row again, with
    /// its message id, which downstream inboxes recognize; waiting would hold
    /// every row committed meanwhile for a disk flush per batch.
    ///
    /// Its statements are planned for the table as it is at each pass: the
    /// outbox grows from empty, and a plan cached on the connection while it
    /// was small scans it whole (seen: a mark of four rows taking 93 ms at
    /// 240 000 rows, with no `ANALYZE` since the table was created to
    /// invalidate it). And the batch is taken by walking the index of pending
    /// rows in order, never through a bitmap: a bitmap reads every entry of
    /// that index, those of rows published since the last vacuum included,
    /// and sorts them, on every pass (seen: 3.3 ms a pass with 10 000 such
    /// entries, against 0.06 ms for the walk, which marks them dead as it
    /// passes so the next pass skips them).
    async fn take_batch(pool: &PgPool, limit: i64) -> Result<TakenBatch<Postgres>, StoreError> {
        let mut tx = pool
            .begin_with(
                "BEGIN; SET LOCAL synchronous_commit = off; \
                 SET LOCAL plan_cache_mode = force_custom_plan; \
                 SET LOCAL enable_bitmapscan = off",
            )
            .await?;
        let raw = sqlx::query_as(TAKE_BATCH)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        Ok((Some(tx), raw))
    }

    async fn listen(pool: &PgPool) -> Result<Option<OutboxListener>, StoreError> {
        let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        Ok(Some(OutboxListener::postgres(listener)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taking_a_batch_binds_what_take_batch_binds() {
        assert_eq!(super::super::dialect::arity_in_order(TAKE_BATCH), 1);
        assert_eq!(super::super::dialect::arity_in_order(CLAIM_ROWS), 5);
        assert_eq!(super::super::dialect::arity_in_order(INSERT_OUTBOX_ROWS), 9);
    }

    #[test]
    fn the_notify_statement_names_the_channel_the_listener_listens_on() {
        assert!(
            Postgres::SQL
                .notify_outbox
                .unwrap()
                .contains(NOTIFY_CHANNEL)
        );
    }
}
