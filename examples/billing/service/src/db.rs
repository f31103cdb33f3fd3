//! billing's own tables, in each dialect: `invoices` (naturally idempotent upsert)
//! and `loyalty_points` (one row per credit: only the inbox keeps it from
//! doubling).

use std::collections::BTreeMap;
use std::future::Future;

use chrono::{DateTime, Utc};
use futures_util::TryStreamExt;
use sqlx::{Pool, Postgres, Sqlite};
use warren::store::OutboxStore;
use warren::store::Store;
use warren::store::StoreError;
use warren::{PgStore, SqliteStore, Tx};
use warren_admin::DatabaseUrl;

use crate::amount::Amount;
use crate::credit::{CreditLimit, CreditState};

pub mod mysql;

/// Runs `$body` with `$B` bound to the database type of `$db` and `$store` to
/// its store. The caller names `sqlx`, as every user of the service does.
#[macro_export]
macro_rules! with_store {
    ($db:expr, |$store:ident: $B:ident| $body:expr) => {
        match $db {
            $crate::db::Database::Postgres($store) => {
                type $B = sqlx::Postgres;
                $body
            }
            $crate::db::Database::Sqlite($store) => {
                type $B = sqlx::Sqlite;
                $body
            }
            $crate::db::Database::MySql($store) => {
                type $B = sqlx::MySql;
                $body
            }
        }
    };
}
pub use crate::with_store;

/// Opens the database at `url`; the error names it, password hidden.
pub async fn open(url: &DatabaseUrl, schema: Option<&str>, pool: u32) -> Result<Database, String> {
    Database::open(url, schema, pool)
        .await
        .map_err(|e| format!("cannot open the database {}: {e}", url.redacted()))
}

/// The database pool: one connection per concurrent transaction, and a few for
/// the relay, the leases and the probes.
pub fn pool_size(concurrency: usize) -> u32 {
    u32::try_from(concurrency)
        .unwrap_or(u32::MAX)
        .saturating_add(4)
}

/// Of several payments of one invoice, the first: paying an invoice again
/// changes nothing but its status (the upsert keeps the first payment's
/// values), and one statement may not upsert a row twice.
pub(crate) fn first_per_invoice<'p>(payments: &'p [(Payment, &str)]) -> Vec<&'p Payment> {
    let mut seen = std::collections::HashSet::new();
    payments
        .iter()
        .map(|(p, _)| p)
        .filter(|p| seen.insert(p.invoice_id.as_str()))
        .collect()
}

/// `rows` copies of `row` (`(?, ?)`), comma separated: the VALUES list of a
/// multi-row insert whose placeholders bind in order.
pub fn values(rows: usize, row: &str) -> String {
    vec![row; rows].join(", ")
}

/// A payment to record, validated.
#[derive(Debug, Clone)]
pub struct Payment {
    /// The invoice paid.
    pub invoice_id: String,
    /// The customer who paid it.
    pub customer_id: String,
    /// The amount, exact, as canonical decimal text: the digits the producer
    /// wrote, without an exponent or leading zeros.
    pub amount: String,
    /// `floor(amount)`: up to 28 digits, so not an `i64`.
    pub points: i128,
    /// ISO 4217 code.
    pub currency: String,
    /// When it was paid: v2's `paidAtUtc`; for v1 the event's time, or the
    /// time it was handled if the event gives none.
    pub paid_at: DateTime<Utc>,
    /// How it was paid (v2 only).
    pub payment_method: Option<String>,
    /// The key a payment provider would have been given for this payment.
    pub payment_reference: String,
}

/// What `billing status` and the demo count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Rows in `invoices`.
    pub invoices_paid: i64,
    /// Rows in `loyalty_points`.
    pub loyalty_rows: i64,
    /// Exact: a single invoice may credit more than `i64::MAX` points.
    pub loyalty_sum: i128,
    /// Rows in the inbox.
    pub inbox_rows: i64,
    /// The exact sum of paid invoices' amounts, per currency; `None` where no
    /// exact sum exists (see `sum_by_currency`).
    pub paid: BTreeMap<String, Option<Amount>>,
}

/// A database billing runs on.
pub trait BillingDb: warren::store::Dialect {
    /// The store warren runs on for this database.
    type S: OutboxStore
        + warren::store::ConsumerStore
        + warren::store::Retention
        + warren::store::DeadLetterStore
        + warren::store::Checkup
        + warren::store::Journal
        + Store<Db = Self>;

    /// Creates billing's tables if missing (warren's are migrated by warren).
    fn create_tables(store: &Self::S) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Upserts each payment's invoice as paid and credits its loyalty points,
    /// for all of them at once: one statement on PostgreSQL, one per table
    /// elsewhere. Each payment comes with the id of the message that carried
    /// it (its loyalty row's). Never empty.
    fn record_payments<'a>(
        tx: &'a mut Tx<Self>,
        payments: &'a [(Payment, &'a str)],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Counts for reports.
    fn counts<'a>(
        store: &'a Self::S,
        consumer: &'a str,
    ) -> impl Future<Output = Result<Counts, StoreError>> + Send + 'a;

    /// The store's pool.
    fn pool(store: &Self::S) -> &Pool<Self>;

    /// Applies a credit limit the version gate let through: the limit, updated
    /// only by a newer version, and one change row with the next `applied_seq`
    /// of the customer.
    fn apply_credit_limit<'a>(
        tx: &'a mut Tx<Self>,
        change: &'a CreditLimit,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The credit tables, for the checks.
    fn credit_state(
        store: &Self::S,
    ) -> impl Future<Output = Result<CreditState, StoreError>> + Send + '_;

    /// Facts the chaos campaign checks: distinct message ids among loyalty rows,
    /// poison invoices recorded, and the outbox's message ids.
    fn audit(store: &Self::S) -> impl Future<Output = Result<Audit, StoreError>> + Send + '_;
}

/// What the chaos campaign reads back to check its invariants.
#[derive(Debug, Clone, Default)]
pub struct Audit {
    /// Distinct incoming message ids among the loyalty rows.
    pub loyalty_messages: i64,
    /// Invoices recorded for poison messages (must be 0).
    pub poison_invoices: i64,
    /// Message ids of every payment event in the outbox.
    pub outbox_ids: Vec<String>,
    /// Outbox rows not yet published.
    pub outbox_unpublished: i64,
}

/// Opens the database a URL names: PostgreSQL (optionally in `schema`), SQLite,
/// or MySQL/MariaDB.
pub enum Database {
    /// PostgreSQL.
    Postgres(PgStore),
    /// SQLite.
    Sqlite(SqliteStore),
    /// MySQL or MariaDB.
    MySql(warren::MySqlStore),
}

impl Database {
    /// Opens `url` with a pool of `pool` connections; on PostgreSQL in
    /// `schema` if one is given.
    pub async fn open(
        url: &DatabaseUrl,
        schema: Option<&str>,
        pool: u32,
    ) -> Result<Self, StoreError> {
        match url {
            DatabaseUrl::Postgres(u) => {
                let mut options = PgStore::options(u)
                    .map_err(|e| StoreError::Config(format!("{}: {e}", url.redacted())))?;
                if let Some(schema) = schema {
                    options = options.options([("search_path", schema)]);
                }
                Ok(Database::Postgres(
                    PgStore::connect_with(options, pool).await?,
                ))
            }
            DatabaseUrl::Sqlite(u) => Ok(Database::Sqlite(SqliteStore::connect(u).await?)),
            DatabaseUrl::MySql(u) => Ok(Database::MySql(mysql::open(u, pool).await?)),
        }
    }
}

// Amounts and points are exact decimals: NUMERIC on PostgreSQL, and on SQLite,
// which has no decimal type (its NUMERIC affinity turns 20 digits into a float),
// canonical decimal text that billing sums itself.
const SQLITE_TABLES: [&str; 4] = [
    "CREATE TABLE IF NOT EXISTS invoices (
        invoice_id        TEXT PRIMARY KEY,
        customer_id       TEXT NOT NULL,
        amount            TEXT NOT NULL,
        currency          TEXT NOT NULL,
        status            TEXT NOT NULL,
        paid_at           TEXT NOT NULL,
        payment_method    TEXT NULL,
        payment_reference TEXT NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS loyalty_points (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        customer_id TEXT    NOT NULL,
        points      TEXT    NOT NULL,
        message_id  TEXT    NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS customer_credit (
        customer_id  TEXT    PRIMARY KEY,
        credit_limit TEXT    NOT NULL,
        version      INTEGER NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS credit_limit_changes (
        customer_id  TEXT    NOT NULL,
        version      INTEGER NOT NULL,
        credit_limit TEXT    NOT NULL,
        message_id   TEXT    NOT NULL,
        applied_seq  INTEGER NOT NULL,
        PRIMARY KEY (customer_id, version)
    )",
];

const PG_TABLES: [&str; 4] = [
    "CREATE TABLE IF NOT EXISTS invoices (
        invoice_id        TEXT        PRIMARY KEY,
        customer_id       TEXT        NOT NULL,
        amount            NUMERIC     NOT NULL,
        currency          TEXT        NOT NULL,
        status            TEXT        NOT NULL,
        paid_at           TIMESTAMPTZ NOT NULL,
        payment_method    TEXT        NULL,
        payment_reference TEXT        NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS loyalty_points (
        id          BIGSERIAL PRIMARY KEY,
        customer_id TEXT      NOT NULL,
        points      NUMERIC   NOT NULL,
        message_id  TEXT      NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS customer_credit (
        customer_id  TEXT    PRIMARY KEY,
        credit_limit NUMERIC NOT NULL,
        version      BIGINT  NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS credit_limit_changes (
        customer_id  TEXT    NOT NULL,
        version      BIGINT  NOT NULL,
        credit_limit NUMERIC NOT NULL,
        message_id   TEXT    NOT NULL,
        applied_seq  BIGINT  NOT NULL,
        PRIMARY KEY (customer_id, version)
    )",
];

impl BillingDb for Postgres {
    type S = PgStore;

    async fn create_tables(store: &PgStore) -> Result<(), StoreError> {
        let mut tx = store.pool().begin().await?;
        // Two instances starting together must not race on CREATE TABLE.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.billing'))")
            .execute(&mut *tx)
            .await?;
        for sql in PG_TABLES {
            sqlx::query(sql).execute(&mut *tx).await?;
        }
        // Databases created before points were exact hold them as BIGINT, which
        // overflows at 19 digits.
        let points_type: Option<String> = sqlx::query_scalar(
            "SELECT data_type::text FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = 'loyalty_points'
               AND column_name = 'points'",
        )
        .fetch_optional(&mut *tx)
        .await?;
        if points_type.as_deref() == Some("bigint") {
            sqlx::query("ALTER TABLE loyalty_points ALTER COLUMN points TYPE NUMERIC")
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn record_payments<'a>(
        tx: &'a mut Tx<Postgres>,
        payments: &'a [(Payment, &'a str)],
    ) -> Result<(), sqlx::Error> {
        let invoices = first_per_invoice(payments);
        let column = |f: fn(&Payment) -> String| invoices.iter().map(|p| f(p)).collect::<Vec<_>>();
        // One statement for both tables: the upsert is a data-modifying CTE,
        // run whether or not the insert after it reads it.
        sqlx::query(
            "WITH paid AS (
                INSERT INTO invoices (invoice_id, customer_id, amount, currency, status, paid_at,
                                      payment_method, payment_reference)
                SELECT i, c, a::numeric, cur, 'paid', at, m, r
                FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[],
                            $6::text[], $7::text[]) AS t(i, c, a, cur, at, m, r)
                ON CONFLICT (invoice_id) DO UPDATE SET status = 'paid')
             INSERT INTO loyalty_points (customer_id, points, message_id)
             SELECT c, pts::numeric, id FROM unnest($8::text[], $9::text[], $10::text[]) AS l(c, pts, id)",
        )
        .bind(column(|p| p.invoice_id.clone()))
        .bind(column(|p| p.customer_id.clone()))
        .bind(column(|p| p.amount.clone()))
        .bind(column(|p| p.currency.clone()))
        .bind(invoices.iter().map(|p| p.paid_at).collect::<Vec<_>>())
        .bind(invoices.iter().map(|p| p.payment_method.clone()).collect::<Vec<_>>())
        .bind(column(|p| p.payment_reference.clone()))
        .bind(payments.iter().map(|(p, _)| p.customer_id.clone()).collect::<Vec<_>>())
        .bind(payments.iter().map(|(p, _)| p.points.to_string()).collect::<Vec<_>>())
        .bind(payments.iter().map(|(_, id)| (*id).to_owned()).collect::<Vec<_>>())
        .execute(tx.conn())
        .await?;
        Ok(())
    }

    async fn counts<'a>(store: &'a PgStore, consumer: &'a str) -> Result<Counts, StoreError> {
        // Sums as text: NUMERIC sums are exact, and text carries every digit.
        let (invoices_paid, loyalty_rows, loyalty_sum, inbox_rows): (i64, i64, String, i64) =
            sqlx::query_as(
                "SELECT
                    (SELECT count(*) FROM invoices WHERE status = 'paid'),
                    (SELECT count(*) FROM loyalty_points),
                    (SELECT coalesce(sum(points), 0)::text FROM loyalty_points),
                    (SELECT count(*) FROM warren_inbox WHERE consumer_name = $1)",
            )
            .bind(consumer)
            .fetch_one(store.pool())
            .await?;
        let paid: Vec<(String, String)> = sqlx::query_as(
            "SELECT currency, sum(amount)::text FROM invoices WHERE status = 'paid'
             GROUP BY currency",
        )
        .fetch_all(store.pool())
        .await?;
        Ok(Counts {
            invoices_paid,
            loyalty_rows,
            loyalty_sum: integer(&loyalty_sum)?,
            inbox_rows,
            paid: sum_by_currency(paid),
        })
    }

    async fn apply_credit_limit<'a>(
        tx: &'a mut Tx<Postgres>,
        c: &'a CreditLimit,
        message_id: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO customer_credit (customer_id, credit_limit, version)
             VALUES ($1, $2::numeric, $3)
             ON CONFLICT (customer_id) DO UPDATE
                SET credit_limit = EXCLUDED.credit_limit, version = EXCLUDED.version
                WHERE customer_credit.version < EXCLUDED.version",
        )
        .bind(&c.customer_id)
        .bind(&c.credit_limit)
        .bind(c.version)
        .execute(tx.conn())
        .await?;
        sqlx::query(
            "INSERT INTO credit_limit_changes
                (customer_id, version, credit_limit, message_id, applied_seq)
             SELECT $1, $2, $3::numeric, $4, COALESCE(MAX(applied_seq), 0) + 1
             FROM credit_limit_changes WHERE customer_id = $1",
        )
        .bind(&c.customer_id)
        .bind(c.version)
        .bind(&c.credit_limit)
        .bind(message_id)
        .execute(tx.conn())
        .await?;
        Ok(())
    }

    async fn credit_state(store: &PgStore) -> Result<CreditState, StoreError> {
        credit_state_with(
            store.pool(),
            "SELECT customer_id, credit_limit::text, version FROM customer_credit",
        )
        .await
    }

    fn pool(store: &PgStore) -> &Pool<Postgres> {
        store.pool()
    }

    async fn audit(store: &PgStore) -> Result<Audit, StoreError> {
        audit_with(store.pool(), OUTBOX_IDS).await
    }
}

impl BillingDb for Sqlite {
    type S = SqliteStore;

    async fn create_tables(store: &SqliteStore) -> Result<(), StoreError> {
        // IMMEDIATE: take the write lock first, so that instances starting together
        // queue up instead of failing to upgrade a read.
        let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await?;
        for sql in SQLITE_TABLES {
            sqlx::query(sql).execute(&mut *tx).await?;
        }
        // Files created before points were exact declare them INTEGER, whose
        // affinity turns 20 digits into a float. SQLite cannot change a column's
        // type, so the table is rebuilt (ids kept, values converted exactly).
        let points_type: Option<String> = sqlx::query_scalar(
            "SELECT type FROM pragma_table_info('loyalty_points') WHERE name = 'points'",
        )
        .fetch_optional(&mut *tx)
        .await?;
        if points_type.is_some_and(|t| t.eq_ignore_ascii_case("INTEGER")) {
            for sql in [
                "ALTER TABLE loyalty_points RENAME TO loyalty_points_integer",
                SQLITE_TABLES[1], // loyalty_points
                "INSERT INTO loyalty_points (id, customer_id, points, message_id)
                 SELECT id, customer_id, CAST(points AS TEXT), message_id
                 FROM loyalty_points_integer",
                "DROP TABLE loyalty_points_integer",
            ] {
                sqlx::query(sql).execute(&mut *tx).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn record_payments<'a>(
        tx: &'a mut Tx<Sqlite>,
        payments: &'a [(Payment, &'a str)],
    ) -> Result<(), sqlx::Error> {
        let invoices = first_per_invoice(payments);
        let sql = format!(
            "INSERT INTO invoices (invoice_id, customer_id, amount, currency, status, paid_at,
                                   payment_method, payment_reference)
             VALUES {}
             ON CONFLICT (invoice_id) DO UPDATE SET status = 'paid'",
            values(invoices.len(), "(?, ?, ?, ?, 'paid', ?, ?, ?)")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for p in &invoices {
            query = query
                .bind(&p.invoice_id)
                .bind(&p.customer_id)
                .bind(&p.amount)
                .bind(&p.currency)
                .bind(p.paid_at.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
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

    async fn counts<'a>(store: &'a SqliteStore, consumer: &'a str) -> Result<Counts, StoreError> {
        let (invoices_paid, loyalty_rows, inbox_rows): (i64, i64, i64) = sqlx::query_as(
            "SELECT
                (SELECT count(*) FROM invoices WHERE status = 'paid'),
                (SELECT count(*) FROM loyalty_points),
                (SELECT count(*) FROM warren_inbox WHERE consumer_name = ?)",
        )
        .bind(consumer)
        .fetch_one(store.pool())
        .await?;
        // SQLite's sum() goes through a float (or stops at i64) for decimal text,
        // so the sums are taken here, exactly.
        let mut loyalty_sum: i128 = 0;
        let mut points =
            sqlx::query_scalar::<_, String>("SELECT CAST(points AS TEXT) FROM loyalty_points")
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

    async fn apply_credit_limit<'a>(
        tx: &'a mut Tx<Sqlite>,
        c: &'a CreditLimit,
        message_id: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO customer_credit (customer_id, credit_limit, version)
             VALUES (?1, ?2, ?3)
             ON CONFLICT (customer_id) DO UPDATE
                SET credit_limit = excluded.credit_limit, version = excluded.version
                WHERE customer_credit.version < excluded.version",
        )
        .bind(&c.customer_id)
        .bind(&c.credit_limit)
        .bind(c.version)
        .execute(tx.conn())
        .await?;
        sqlx::query(
            "INSERT INTO credit_limit_changes
                (customer_id, version, credit_limit, message_id, applied_seq)
             SELECT ?1, ?2, ?3, ?4, COALESCE(MAX(applied_seq), 0) + 1
             FROM credit_limit_changes WHERE customer_id = ?1",
        )
        .bind(&c.customer_id)
        .bind(c.version)
        .bind(&c.credit_limit)
        .bind(message_id)
        .execute(tx.conn())
        .await?;
        Ok(())
    }

    async fn credit_state(store: &SqliteStore) -> Result<CreditState, StoreError> {
        credit_state_with(
            store.pool(),
            "SELECT customer_id, credit_limit, version FROM customer_credit",
        )
        .await
    }

    fn pool(store: &SqliteStore) -> &Pool<Sqlite> {
        store.pool()
    }

    async fn audit(store: &SqliteStore) -> Result<Audit, StoreError> {
        audit_with(store.pool(), OUTBOX_IDS).await
    }
}

pub(crate) fn corrupt(what: &str) -> StoreError {
    StoreError::Database(sqlx::Error::Protocol(what.to_owned()))
}

/// A whole number of points as stored (decimal text).
pub(crate) fn integer(text: &str) -> Result<i128, StoreError> {
    text.parse()
        .map_err(|_| corrupt(&format!("loyalty points {text:?} are not an integer")))
}

/// Adds up `(currency, amount)` rows exactly. A currency whose total cannot be
/// exact (an amount stored before amounts were checked, such as `1e308`, or a
/// total beyond 128 bits) maps to `None` rather than failing the report.
pub(crate) fn sum_by_currency(
    rows: impl IntoIterator<Item = (String, String)>,
) -> BTreeMap<String, Option<Amount>> {
    let mut paid = BTreeMap::new();
    for (currency, amount) in rows {
        let total = paid.entry(currency).or_insert(Some(Amount::ZERO));
        *total = total.and_then(|t| t.checked_add(amount.parse().ok()?));
    }
    paid
}

/// The outbox's message ids, where they are text.
/// The payment events' outbox ids (the credit stream's events are checked by
/// their own invariants).
const OUTBOX_IDS: &str = "SELECT message_id FROM warren_outbox
    WHERE routing_key = 'billing.invoice-payment-recorded.v1'";

/// The audit queries, the same text in each dialect but the outbox ids.
pub(crate) async fn audit_with<DB>(
    pool: &Pool<DB>,
    outbox_ids_sql: &'static str,
) -> Result<Audit, StoreError>
where
    DB: sqlx::Database,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    (String,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let one = |sql: &'static str| async move {
        sqlx::query_as::<DB, (i64,)>(sql)
            .fetch_one(pool)
            .await
            .map(|(n,)| n)
    };
    let loyalty_messages = one("SELECT count(DISTINCT message_id) FROM loyalty_points").await?;
    let poison_invoices =
        one("SELECT count(*) FROM invoices WHERE invoice_id LIKE 'inv_poison_%'").await?;
    let outbox_unpublished =
        one("SELECT count(*) FROM warren_outbox WHERE published_at IS NULL").await?;
    let outbox_ids = sqlx::query_as::<DB, (String,)>(outbox_ids_sql)
        .fetch_all(pool)
        .await?
        .into_iter()
        .map(|(id,)| id)
        .collect();
    Ok(Audit {
        loyalty_messages,
        poison_invoices,
        outbox_ids,
        outbox_unpublished,
    })
}

/// The credit tables read back: limits, and each customer's versions in the
/// order they were applied.
pub(crate) async fn credit_state_with<DB>(
    pool: &Pool<DB>,
    limits_sql: &'static str,
) -> Result<CreditState, StoreError>
where
    DB: sqlx::Database,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    (String, String, i64): for<'r> sqlx::FromRow<'r, DB::Row>,
    (String, i64): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let mut state = CreditState::default();
    for (customer, limit, version) in sqlx::query_as::<DB, (String, String, i64)>(limits_sql)
        .fetch_all(pool)
        .await?
    {
        state.limits.insert(customer, (limit, version));
    }
    for (customer, version) in sqlx::query_as::<DB, (String, i64)>(
        "SELECT customer_id, version FROM credit_limit_changes ORDER BY customer_id, applied_seq",
    )
    .fetch_all(pool)
    .await?
    {
        state.applied.entry(customer).or_default().push(version);
    }
    Ok(state)
}
