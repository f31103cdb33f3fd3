//! PostgreSQL store: the production backend.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, Postgres};

use super::{InboxEntry, Migration, Migrations, Store, StoreError, Tx};

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
    ],
};

/// A [`Store`] on PostgreSQL.
///
/// Tables live in the connection's current schema (the first entry of
/// `search_path`), so one database can host several isolated warren deployments.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
}

impl PgStore {
    /// Connects with a pool of `max_connections` (size it to the consumer's
    /// concurrency plus a few for the relay and operators).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url).map_err(|e| {
            StoreError::Config(format!("database URL is not a PostgreSQL URL: {e}"))
        })?;
        Self::connect_with(options, max_connections).await
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
        Ok(Self { pool })
    }

    /// Wraps an existing pool, for applications that already have one.
    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
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
