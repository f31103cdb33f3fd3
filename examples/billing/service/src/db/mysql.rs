//! billing's tables on MySQL and MariaDB.

use futures_util::TryStreamExt;
use sqlx::MySql;
use sqlx::mysql::MySqlConnectOptions;
use sqlx::{Executor, Pool};
use warren::store::StoreError;
use warren::{MySqlStore, Tx};

use super::{
    Audit, BillingDb, Counts, Payment, audit_with, corrupt, credit_state_with, first_per_invoice,
    integer, sum_by_currency, values,
};
use crate::credit::{CreditLimit, CreditState};

// Amounts and points are kept as the canonical decimal text, as on SQLite, and
// summed here exactly: a DECIMAL column would hand sums back at the column's
// scale (`149.000000000`), not in the digits the producer wrote. Keys compare
// as bytes, like warren's.
const TABLES: [&str; 4] = [
    "CREATE TABLE IF NOT EXISTS invoices (
        invoice_id        VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY,
        customer_id       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
        amount            VARCHAR(64)  NOT NULL,
        currency          VARCHAR(16)  NOT NULL,
        status            VARCHAR(16)  NOT NULL,
        paid_at           DATETIME(6)  NOT NULL,
        payment_method    VARCHAR(255) NULL,
        payment_reference VARCHAR(255) NOT NULL
    ) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS loyalty_points (
        id          BIGINT       AUTO_INCREMENT PRIMARY KEY,
        customer_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
        points      VARCHAR(64)  NOT NULL,
        message_id  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL
    ) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS customer_credit (
        customer_id  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY,
        credit_limit VARCHAR(64)  NOT NULL,
        version      BIGINT       NOT NULL
    ) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS credit_limit_changes (
        customer_id  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
        version      BIGINT       NOT NULL,
        credit_limit VARCHAR(64)  NOT NULL,
        message_id   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
        applied_seq  BIGINT       NOT NULL,
        PRIMARY KEY (customer_id, version)
    ) ENGINE = InnoDB",
];

/// Connects to the database a `mysql://` URL names, creating it first if the
/// server does not have it.
pub async fn open(url: &str, pool: u32) -> Result<MySqlStore, StoreError> {
    let options = MySqlStore::options(url)?;
    if let Some(name) = options.get_database().map(str::to_owned) {
        create_database(&options, &name).await?;
    }
    MySqlStore::connect_with(options, pool).await
}

/// Creates database `name` on the server `options` name, if missing.
pub async fn create_database(options: &MySqlConnectOptions, name: &str) -> Result<(), StoreError> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(StoreError::Config(format!(
            "database name {name:?}: use letters, digits and underscores"
        )));
    }
    // information_schema is on every server, so the connection needs no
    // database of its own.
    let admin =
        sqlx::MySqlPool::connect_with(options.clone().database("information_schema")).await?;
    let created = admin
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE IF NOT EXISTS `{name}`"
        )))
        .await;
    admin.close().await;
    created?;
    Ok(())
}

/// `url` naming database `name` instead of its own.
pub fn with_database(url: &str, name: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("mysql", url));
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let authority = before_query.split('/').next().unwrap_or(before_query);
    match query {
        Some(q) => format!("{scheme}://{authority}/{name}?{q}"),
        None => format!("{scheme}://{authority}/{name}"),
    }
}

/// Drops database `name` on the server `url` names.
pub async fn drop_database(url: &str, name: &str) -> Result<(), StoreError> {
    let options = MySqlStore::options(url)?.database("information_schema");
    let admin = sqlx::MySqlPool::connect_with(options).await?;
    let dropped = admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS `{name}`"
        )))
        .await;
    admin.close().await;
    dropped?;
    Ok(())
}

impl BillingDb for MySql {
    type S = MySqlStore;

    async fn create_tables(store: &MySqlStore) -> Result<(), StoreError> {
        // CREATE TABLE IF NOT EXISTS is safe for instances starting together.
        for sql in TABLES {
            sqlx::query(sql).execute(store.pool()).await?;
        }
        Ok(())
    }

    async fn record_payments<'a>(
        tx: &'a mut Tx<MySql>,
        payments: &'a [(Payment, &'a str)],
    ) -> Result<(), sqlx::Error> {
        let invoices = first_per_invoice(payments);
        let sql = format!(
            "INSERT INTO invoices (invoice_id, customer_id, amount, currency, status, paid_at,
                                   payment_method, payment_reference)
             VALUES {}
             ON DUPLICATE KEY UPDATE status = 'paid'",
            values(invoices.len(), "(?, ?, ?, ?, 'paid', ?, ?, ?)")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for p in &invoices {
            query = query
                .bind(&p.invoice_id)
                .bind(&p.customer_id)
                .bind(&p.amount)
                .bind(&p.currency)
                .bind(p.paid_at.naive_utc())
                .bind(&p.payment_method)
                .bind(&p.payment_reference);
        }
        query.execute(tx.conn()).await?;
        let sql = format!(
            "INSERT INTO loyalty_points (customer_id, points, message_id) VALUES {}",
            values(payments.len(), "(?, ?, ?)")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (p, id) in payments {
            query = query
                .bind(&p.customer_id)
                .bind(p.points.to_string())
                .bind(*id);
        }
        query.execute(tx.conn()).await?;
        Ok(())
    }

    async fn apply_credit_limit<'a>(
        tx: &'a mut Tx<MySql>,
        c: &'a CreditLimit,
        message_id: &'a str,
    ) -> Result<(), sqlx::Error> {
        // The limit is assigned first, while `version` still holds the old one.
        sqlx::query(
            "INSERT INTO customer_credit (customer_id, credit_limit, version) VALUES (?, ?, ?)
             ON DUPLICATE KEY UPDATE
                credit_limit = IF(version < VALUES(version), VALUES(credit_limit), credit_limit),
                version = GREATEST(version, VALUES(version))",
        )
        .bind(&c.customer_id)
        .bind(&c.credit_limit)
        .bind(c.version)
        .execute(tx.conn())
        .await?;
        let seq: i64 = sqlx::query_scalar(
            "SELECT COALESCE(MAX(applied_seq), 0) + 1 FROM credit_limit_changes WHERE customer_id = ?",
        )
        .bind(&c.customer_id)
        .fetch_one(tx.conn())
        .await?;
        sqlx::query(
            "INSERT INTO credit_limit_changes
                (customer_id, version, credit_limit, message_id, applied_seq)
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&c.customer_id)
        .bind(c.version)
        .bind(&c.credit_limit)
        .bind(message_id)
        .bind(seq)
        .execute(tx.conn())
        .await?;
        Ok(())
    }

    async fn credit_state(store: &MySqlStore) -> Result<CreditState, StoreError> {
        credit_state_with(
            store.pool(),
            "SELECT customer_id, credit_limit, version FROM customer_credit",
        )
        .await
    }

    async fn counts<'a>(store: &'a MySqlStore, consumer: &'a str) -> Result<Counts, StoreError> {
        let (invoices_paid, loyalty_rows, inbox_rows): (i64, i64, i64) = sqlx::query_as(
            "SELECT
                (SELECT count(*) FROM invoices WHERE status = 'paid'),
                (SELECT count(*) FROM loyalty_points),
                (SELECT count(*) FROM warren_inbox WHERE consumer_name = ?)",
        )
        .bind(consumer)
        .fetch_one(store.pool())
        .await?;
        let mut loyalty_sum: i128 = 0;
        let mut points = sqlx::query_scalar::<_, String>("SELECT points FROM loyalty_points")
            .fetch(store.pool());
        while let Some(p) = points.try_next().await? {
            loyalty_sum = loyalty_sum
                .checked_add(integer(&p)?)
                .ok_or_else(|| corrupt("the loyalty points overflow 128 bits"))?;
        }
        drop(points);
        let paid: Vec<(String, String)> =
            sqlx::query_as("SELECT currency, amount FROM invoices WHERE status = 'paid'")
                .fetch_all(store.pool())
                .await?;
        Ok(Counts {
            invoices_paid,
            loyalty_rows,
            loyalty_sum,
            inbox_rows,
            paid: sum_by_currency(paid),
        })
    }

    fn pool(store: &MySqlStore) -> &Pool<MySql> {
        store.pool()
    }

    async fn audit(store: &MySqlStore) -> Result<Audit, StoreError> {
        // warren keeps message ids as bytes on MySQL.
        audit_with(
            store.pool(),
            "SELECT CAST(message_id AS CHAR) FROM warren_outbox
             WHERE routing_key = 'billing.invoice-payment-recorded.v1'",
        )
        .await
    }
}
