//! PostgreSQL store: the production backend.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Postgres};

use crate::outbox::{FailedRow, NewOutboxRow, OutboxRow, RowOutcome};

use super::{
    Dialect, InboxEntry, Migration, Migrations, OutboxCounts, OutboxListener, OutboxStore,
    RawOutboxRow, Store, StoreError, Tx, Wakeups, failed_rows, outbox_rows,
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
            statements: &[
                "CREATE TABLE warren_inbox (
                consumer_name  TEXT        NOT NULL,
                message_id     TEXT        NOT NULL,
                event_type     TEXT        NOT NULL,
                correlation_id TEXT        NULL,
                received_at    TIMESTAMPTZ NOT NULL,
                processed_at   TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
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
                deliveries        BIGINT  NOT NULL,
                last_delivered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                PRIMARY KEY (consumer_name, message_id)
            )"],
        },
        Migration {
            version: 3,
            name: "outbox",
            statements: &[
                "CREATE TABLE warren_outbox (
                    id           BIGSERIAL   PRIMARY KEY,
                    message_id   TEXT        NOT NULL UNIQUE,
                    exchange     TEXT        NOT NULL,
                    routing_key  TEXT        NOT NULL,
                    properties   TEXT        NOT NULL,
                    body         BYTEA       NOT NULL,
                    created_at   TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
                    attempts     BIGINT      NOT NULL DEFAULT 0,
                    last_error   TEXT        NULL,
                    published_at TIMESTAMPTZ NULL,
                    failed_at    TIMESTAMPTZ NULL
                )",
                "CREATE INDEX warren_outbox_pending ON warren_outbox (id)
                    WHERE published_at IS NULL AND failed_at IS NULL",
                "CREATE INDEX warren_outbox_published ON warren_outbox (published_at)
                    WHERE published_at IS NOT NULL",
            ],
        },
        Migration {
            version: 4,
            name: "outbox failed index, redelivery age index",
            statements: &[
                "CREATE INDEX warren_outbox_failed ON warren_outbox (id) WHERE failed_at IS NOT NULL",
                "CREATE INDEX warren_redeliveries_age ON warren_redeliveries (consumer_name, last_delivered_at)",
            ],
        },
        Migration {
            version: 5,
            name: "settings",
            statements: &["CREATE TABLE warren_settings (
                name  TEXT PRIMARY KEY,
                value TEXT NOT NULL
            )"],
        },
    ],
};

/// A [`Store`] on PostgreSQL.
///
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

/// Tables live in the connection's current schema (the first entry of
/// `search_path`), so one database can host several isolated warren deployments.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    wakeups: Wakeups,
}

impl PgStore {
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
        Self {
            pool,
            wakeups: Wakeups::default(),
        }
    }

    /// The pool, for the application's own queries outside a handler.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

impl Store for PgStore {
    type Db = Postgres;

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        // Several processes may start at once; the lock (scoped to this schema and
        // released at commit) makes them apply migrations one after another.
        sqlx::query(
            "SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.warren_migrations'))",
        )
        .execute(&mut *tx)
        .await?;
        MIGRATIONS.apply::<Postgres>(&mut tx).await?;
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
            "INSERT INTO warren_settings (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            "SELECT value FROM warren_settings WHERE name = $1",
        )
        .await
    }

    fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }

    async fn check_before_commit<'a>(&'a self, tx: &'a mut Tx<Postgres>) -> Result<(), StoreError> {
        // Fails with 25P02 (in failed SQL transaction) if an earlier statement
        // aborted the transaction.
        sqlx::query("SELECT 1").execute(tx.conn()).await?;
        Ok(())
    }

    async fn begin(&self) -> Result<Tx<Postgres>, StoreError> {
        Ok(Tx::new(self.pool.begin().await?))
    }

    async fn claim<'a>(
        &'a self,
        tx: &'a mut Tx<Postgres>,
        entry: &'a InboxEntry<'a>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (consumer_name, message_id) DO NOTHING",
        )
        .bind(entry.consumer_name)
        .bind(entry.message_id)
        .bind(entry.event_type)
        .bind(entry.correlation_id)
        .bind(entry.received_at)
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
            "DELETE FROM warren_inbox WHERE (consumer_name, message_id) IN (
                SELECT consumer_name, message_id FROM warren_inbox
                WHERE consumer_name = $1 AND processed_at < $2 LIMIT $3)",
            // Redelivery counts older than the window belong to messages long settled.
            "DELETE FROM warren_redeliveries WHERE (consumer_name, message_id) IN (
                SELECT consumer_name, message_id FROM warren_redeliveries
                WHERE consumer_name = $1 AND last_delivered_at < $2 LIMIT $3)",
        ]
        .into_iter()
        .enumerate()
        {
            deleted[n] = sqlx::query(sql)
                .bind(consumer)
                .bind(cutoff)
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
             VALUES ($1, $2, 1)
             ON CONFLICT (consumer_name, message_id)
             DO UPDATE SET deliveries = warren_redeliveries.deliveries + 1,
                           last_delivered_at = now()
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
        tx: Option<&'a mut Tx<Postgres>>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> Result<(), StoreError> {
        let query = sqlx::query(
            "DELETE FROM warren_redeliveries WHERE consumer_name = $1 AND message_id = $2",
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

/// The channel the outbox writer notifies (delivered at commit) and the relay
/// listens on, so a relay wakes as soon as rows are committed.
pub(crate) const NOTIFY_CHANNEL: &str = "warren_outbox";

impl Dialect for Postgres {
    async fn insert_outbox<'c>(
        conn: &'c mut PgConnection,
        row: &'c NewOutboxRow<'c>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO warren_outbox (message_id, exchange, routing_key, properties, body)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(row.message_id)
        .bind(row.exchange)
        .bind(row.routing_key)
        .bind(&row.properties)
        .bind(&row.body)
        .execute(&mut *conn)
        .await?;
        // Delivered only if and when the transaction commits.
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(NOTIFY_CHANNEL)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

impl OutboxStore for PgStore {
    async fn listen(&self) -> Result<Option<OutboxListener>, StoreError> {
        let mut listener = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        Ok(Some(OutboxListener::postgres(listener)))
    }

    async fn relay_batch<'a, F, Fut>(
        &'a self,
        limit: usize,
        publish: F,
    ) -> Result<usize, StoreError>
    where
        F: FnOnce(Vec<OutboxRow>) -> Fut + Send + 'a,
        Fut: Future<Output = Vec<(i64, RowOutcome)>> + Send + 'a,
    {
        let mut tx = self.pool.begin().await?;
        // Locked rows belong to another relay's batch; skipping them is what lets
        // several relays share one outbox without publishing a row twice.
        let raw: Vec<RawOutboxRow> = sqlx::query_as(
            "SELECT id, message_id, exchange, routing_key, properties, body, attempts
             FROM warren_outbox
             WHERE published_at IS NULL AND failed_at IS NULL
             ORDER BY id
             LIMIT $1
             FOR UPDATE SKIP LOCKED",
        )
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&mut *tx)
        .await?;
        let taken = raw.len();
        if taken == 0 {
            tx.rollback().await?;
            return Ok(0);
        }
        let (rows, unreadable) = outbox_rows(raw);
        let mut outcomes = publish(rows).await;
        outcomes.extend(unreadable);
        for (id, outcome) in outcomes {
            let q = match &outcome {
                RowOutcome::Published => sqlx::query(
                    "UPDATE warren_outbox SET published_at = clock_timestamp(), attempts = attempts + 1
                     WHERE id = $1",
                )
                .bind(id),
                RowOutcome::Failed(e) => sqlx::query(
                    "UPDATE warren_outbox SET failed_at = clock_timestamp(), attempts = attempts + 1,
                     last_error = $2 WHERE id = $1",
                )
                .bind(id)
                .bind(e),
                RowOutcome::Retry(e) => sqlx::query(
                    "UPDATE warren_outbox SET attempts = attempts + 1, last_error = $2 WHERE id = $1",
                )
                .bind(id)
                .bind(e),
            };
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(taken)
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        let (pending, oldest, published, failed): (i64, Option<DateTime<Utc>>, i64, i64) =
            sqlx::query_as(
                "SELECT
                count(*) FILTER (WHERE published_at IS NULL AND failed_at IS NULL),
                min(created_at) FILTER (WHERE published_at IS NULL AND failed_at IS NULL),
                count(*) FILTER (WHERE published_at IS NOT NULL),
                count(*) FILTER (WHERE failed_at IS NOT NULL)
             FROM warren_outbox",
            )
            .fetch_one(&self.pool)
            .await?;
        Ok(OutboxCounts {
            pending,
            oldest_pending: oldest,
            published,
            failed,
        })
    }

    async fn failed_outbox_rows(&self, limit: u32) -> Result<Vec<FailedRow>, StoreError> {
        let failed: Vec<(i64, String, String, String, Option<String>, i64)> = sqlx::query_as(
            "SELECT id, message_id, exchange, routing_key, last_error, attempts
             FROM warren_outbox WHERE failed_at IS NOT NULL ORDER BY id LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(failed_rows(failed))
    }

    async fn retry_failed<'a>(&'a self, ids: &'a [i64]) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE warren_outbox SET failed_at = NULL
             WHERE failed_at IS NOT NULL AND (cardinality($1::BIGINT[]) = 0 OR id = ANY($1))",
        )
        .bind(ids)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn delete_published_before(
        &self,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM warren_outbox WHERE id IN (
                SELECT id FROM warren_outbox WHERE published_at < $1 LIMIT $2)",
        )
        .bind(cutoff)
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
