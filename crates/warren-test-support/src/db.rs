//! A private database per test: a PostgreSQL schema, an SQLite file or a
//! MySQL/MariaDB database, with warren migrated and a table for the test
//! handler's effects.

use std::future::Future;

use sqlx::{AssertSqlSafe, Postgres, Sqlite};
use warren::store::Store;
use warren::{PgStore, SqliteStore, Tx};

#[cfg(feature = "mysql")]
use crate::mysql_admin_url;
use crate::pg_admin_url;

/// A database dialect under test.
pub trait Backend: warren::store::Dialect {
    /// The store on this dialect.
    type S: warren::store::OutboxStore
        + warren::store::ConsumerStore
        + warren::store::Retention
        + warren::store::DeadLetterStore
        + Store<Db = Self>;
    /// The backend's name in test names and messages.
    const NAME: &'static str;
    /// A fresh, private database with warren migrated and the effects table.
    fn create() -> impl Future<Output = TestDb<Self>> + Send;
    /// Opens a store on a URL produced by `create`.
    fn open(url: &str) -> impl Future<Output = Self::S> + Send;
    /// The non-idempotent effect: one new row per call.
    fn insert_effect<'a>(
        tx: &'a mut Tx<Self>,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
    /// The batch handler's effect: one new row per id, in one statement.
    fn insert_effects<'a>(
        tx: &'a mut Tx<Self>,
        message_ids: &'a [String],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
    /// The store's pool.
    fn pool(store: &Self::S) -> &sqlx::Pool<Self>;
    /// Runs a `SELECT count(...)` inside `tx`.
    fn count_in<'a>(
        tx: &'a mut Tx<Self>,
        sql: &'static str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;
    /// Runs a `SELECT count(...)` query.
    fn count(store: &Self::S, sql: String) -> impl Future<Output = i64> + Send;
    /// Runs a statement.
    fn exec(store: &Self::S, sql: String) -> impl Future<Output = ()> + Send;
    /// The ordering tests' effect: appends `version` of `customer` to
    /// `test_applied` with the next sequence number of that customer.
    fn record_version<'a>(
        tx: &'a mut Tx<Self>,
        customer: &'a str,
        version: i64,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
    /// Every row of `test_applied` as (customer, version, seq), by customer and seq.
    fn applied_rows(store: &Self::S) -> impl Future<Output = Vec<(String, i64, i64)>> + Send;
    /// The conflict tests' effect: takes `qty` off the stock of `sku` in
    /// `test_stock`, locking its row until the transaction ends.
    fn take_stock<'a>(
        tx: &'a mut Tx<Self>,
        sku: &'a str,
        qty: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// The ordering tests' table of applied versions.
pub const APPLIED_TABLE: &str = "CREATE TABLE test_applied (
    customer TEXT NOT NULL, version BIGINT NOT NULL, seq BIGINT NOT NULL, message_id TEXT NOT NULL)";
const APPLIED_ROWS: &str = "SELECT customer, version, seq FROM test_applied ORDER BY customer, seq";

/// A test's private database and its store, dropped by `drop_db`.
pub struct TestDb<B: Backend> {
    /// The store on the test's database, migrated.
    pub store: B::S,
    /// A URL another process can open the same database with.
    pub url: String,
    cleanup: Cleanup,
}

enum Cleanup {
    /// A PostgreSQL schema or a MySQL database, dropped when the test is done
    /// (or by a later run, if the test process was killed).
    Database(warren::testing::TestDatabase),
    /// An SQLite file's directory, removed with it.
    Dir(#[expect(dead_code, reason = "held for its drop")] tempfile::TempDir),
}

impl<B: Backend> TestDb<B> {
    /// Every effect the handlers recorded.
    pub async fn effects(&self) -> i64 {
        B::count(&self.store, "SELECT count(*) FROM test_effects".into()).await
    }
    /// The messages with at least one effect recorded.
    pub async fn distinct_effects(&self) -> i64 {
        B::count(
            &self.store,
            "SELECT count(DISTINCT message_id) FROM test_effects".into(),
        )
        .await
    }
    /// The effects recorded for `message_id`.
    pub async fn effects_for(&self, message_id: &str) -> i64 {
        B::count(
            &self.store,
            format!("SELECT count(*) FROM test_effects WHERE message_id = '{message_id}'"),
        )
        .await
    }
    /// The inbox rows of `consumer`.
    pub async fn inbox(&self, consumer: &str) -> i64 {
        B::count(
            &self.store,
            format!("SELECT count(*) FROM warren_inbox WHERE consumer_name = '{consumer}'"),
        )
        .await
    }
    /// Drops the test's schema or database (an SQLite file goes with its directory).
    pub async fn drop_db(self) {
        if let Cleanup::Database(db) = self.cleanup {
            B::pool(&self.store).close().await;
            db.drop_now().await.unwrap();
        }
    }
}

/// The methods every backend writes alike but for its store type and its
/// placeholders (`$1` or `?`). A macro, because sqlx's bounds are written per
/// database: a generic default body would need them all spelled out.
macro_rules! same_for_every_backend {
    ($S:ty, [$p1:literal, $p2:literal, $p3:literal, $p4:literal]) => {
        async fn record_version(
            tx: &mut Tx<Self>,
            customer: &str,
            version: i64,
            message_id: &str,
        ) -> Result<(), sqlx::Error> {
            let seq: i64 = sqlx::query_scalar(concat!(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM test_applied WHERE customer = ",
                $p1
            ))
            .bind(customer)
            .fetch_one(tx.conn())
            .await?;
            sqlx::query(concat!(
                "INSERT INTO test_applied (customer, version, seq, message_id) VALUES (",
                $p1,
                ", ",
                $p2,
                ", ",
                $p3,
                ", ",
                $p4,
                ")"
            ))
            .bind(customer)
            .bind(version)
            .bind(seq)
            .bind(message_id)
            .execute(tx.conn())
            .await?;
            Ok(())
        }

        async fn take_stock(tx: &mut Tx<Self>, sku: &str, qty: i64) -> Result<(), sqlx::Error> {
            sqlx::query(concat!(
                "UPDATE test_stock SET available = available - ",
                $p1,
                " WHERE sku = ",
                $p2
            ))
            .bind(qty)
            .bind(sku)
            .execute(tx.conn())
            .await?;
            Ok(())
        }

        async fn applied_rows(store: &$S) -> Vec<(String, i64, i64)> {
            sqlx::query_as(APPLIED_ROWS)
                .fetch_all(store.pool())
                .await
                .unwrap()
        }

        async fn insert_effect(tx: &mut Tx<Self>, message_id: &str) -> Result<(), sqlx::Error> {
            sqlx::query(concat!(
                "INSERT INTO test_effects (message_id) VALUES (",
                $p1,
                ")"
            ))
            .bind(message_id)
            .execute(tx.conn())
            .await?;
            Ok(())
        }

        async fn insert_effects(
            tx: &mut Tx<Self>,
            message_ids: &[String],
        ) -> Result<(), sqlx::Error> {
            // `?` binds in order in every dialect; `$n` where PostgreSQL wants it.
            let values: Vec<String> = (1..=message_ids.len())
                .map(|n| match $p1 {
                    "$1" => format!("(${n})"),
                    _ => "(?)".to_owned(),
                })
                .collect();
            let sql = format!(
                "INSERT INTO test_effects (message_id) VALUES {}",
                values.join(", ")
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in message_ids {
                query = query.bind(id);
            }
            query.execute(tx.conn()).await?;
            Ok(())
        }

        fn pool(store: &$S) -> &sqlx::Pool<Self> {
            store.pool()
        }

        async fn count_in(tx: &mut Tx<Self>, sql: &'static str) -> Result<i64, sqlx::Error> {
            sqlx::query_scalar(sql).fetch_one(tx.conn()).await
        }

        async fn count(store: &$S, sql: String) -> i64 {
            sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(store.pool())
                .await
                .unwrap()
        }

        async fn exec(store: &$S, sql: String) {
            sqlx::query(AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
        }
    };
}

const EFFECTS_PG: &str =
    "CREATE TABLE test_effects (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL)";
const EFFECTS_SQLITE: &str =
    "CREATE TABLE test_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL)";

impl Backend for Postgres {
    same_for_every_backend!(PgStore, ["$1", "$2", "$3", "$4"]);

    type S = PgStore;
    const NAME: &'static str = "postgres";

    async fn create() -> TestDb<Self> {
        let db = warren::testing::TestDatabase::postgres(&pg_admin_url())
            .await
            .unwrap();
        let url = db.url().to_owned();
        let store = Self::open(&url).await;
        store.migrate().await.unwrap();
        sqlx::query(EFFECTS_PG).execute(store.pool()).await.unwrap();
        TestDb {
            store,
            url,
            cleanup: Cleanup::Database(db),
        }
    }

    async fn open(url: &str) -> PgStore {
        PgStore::connect(url, 12).await.unwrap()
    }
}

impl Backend for Sqlite {
    same_for_every_backend!(SqliteStore, ["?", "?", "?", "?"]);

    type S = SqliteStore;
    const NAME: &'static str = "sqlite";

    async fn create() -> TestDb<Self> {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("test.db").display());
        let store = Self::open(&url).await;
        store.migrate().await.unwrap();
        sqlx::query(EFFECTS_SQLITE)
            .execute(store.pool())
            .await
            .unwrap();
        TestDb {
            store,
            url,
            cleanup: Cleanup::Dir(dir),
        }
    }

    async fn open(url: &str) -> SqliteStore {
        SqliteStore::connect(url).await.unwrap()
    }
}

#[cfg(feature = "mysql")]
const EFFECTS_MYSQL: &str = "CREATE TABLE test_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
     message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB";

#[cfg(feature = "mysql")]
impl Backend for sqlx::MySql {
    same_for_every_backend!(warren::MySqlStore, ["?", "?", "?", "?"]);

    type S = warren::MySqlStore;
    const NAME: &'static str = "mysql";

    async fn create() -> TestDb<Self> {
        let db = warren::testing::TestDatabase::mysql(&mysql_admin_url())
            .await
            .unwrap();
        let url = db.url().to_owned();
        let store = Self::open(&url).await;
        store.migrate().await.unwrap();
        sqlx::query(EFFECTS_MYSQL)
            .execute(store.pool())
            .await
            .unwrap();
        TestDb {
            store,
            url,
            cleanup: Cleanup::Database(db),
        }
    }

    async fn open(url: &str) -> warren::MySqlStore {
        warren::MySqlStore::connect(url, 12).await.unwrap()
    }
}
