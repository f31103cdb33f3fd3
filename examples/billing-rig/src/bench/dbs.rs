//! What the benchmark needs of each database beyond billing's own tables: the
//! one-insert effect, the hand-written seed pattern, and a large inbox.

use std::future::Future;

use sqlx::{Pool, Postgres, Sqlite};
use warren::store::StoreError;
use warren::{HandlerError, Message, Tx};

use billing_service::db::BillingDb;

/// A database the benchmark runs on.
pub(crate) trait BenchDb: BillingDb {
    /// The name in the table.
    const LABEL: &'static str;
    /// Its durability setting, printed with the results.
    const DURABILITY: &'static str;

    /// Creates the effect table of rows 2 and 3 and the seed pattern's inbox.
    fn create_bench_tables(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Row 3's effect: one row.
    fn insert_effect<'a>(
        tx: &'a mut Tx<Self>,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Row 3b's effect: one row per message, in one statement.
    fn insert_effects<'a>(
        tx: &'a mut Tx<Self>,
        message_ids: &'a [String],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Row 7, the database floor: in one transaction of a plain pool, the
    /// inbox rows of `message_ids` (the claim warren makes, `ON CONFLICT DO
    /// NOTHING`) and their effects, each set-based in one statement.
    fn floor_apply<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        message_ids: &'a [String],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Row 2, the seed pattern written by hand: one transaction with the inbox
    /// row (`ON CONFLICT DO NOTHING`) and, if it was new, the same one-row effect.
    fn seed_apply<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Fills `warren_inbox` with `rows` rows of `consumer`, of which the first
    /// `expired` were processed long ago (for the purge).
    fn fill_inbox<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        rows: u64,
        expired: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;
}

/// Row 3's handler: the message's id in one row. For row 3s, the message
/// [`SLOW`] names first waits until every other message of the run reached
/// the handler, holding its delivery (the lowest tag) open while the rest
/// flow past it.
pub(crate) async fn one_insert<B: BenchDb>(
    msg: Message<serde_json::Value>,
    tx: &mut Tx<B>,
) -> Result<(), HandlerError> {
    let held = SLOW
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .filter(|(id, _)| *id == msg.meta.message_id)
        .map(|(_, others)| *others);
    if let Some(others) = held {
        let start = std::time::Instant::now();
        while CALLS.load(std::sync::atomic::Ordering::Relaxed) < others
            && start.elapsed() < std::time::Duration::from_secs(60)
        {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    } else {
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    B::insert_effect(tx, &msg.meta.message_id).await?;
    Ok(())
}

/// Row 3s: the message held open, and how many others must reach the
/// handler before it goes on.
pub(crate) static SLOW: std::sync::RwLock<Option<(String, usize)>> = std::sync::RwLock::new(None);

/// Calls of [`one_insert`] for messages other than the held one.
pub(crate) static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Row 3b's handler: every message of the batch in one insert.
pub(crate) async fn one_insert_batch<B: BenchDb>(
    batch: warren::Batch<serde_json::Value>,
    tx: &mut Tx<B>,
) -> warren::BatchResult {
    let ids: Vec<String> = batch.iter().map(|m| m.meta.message_id.clone()).collect();
    B::insert_effects(tx, &ids).await?;
    Ok(())
}

/// Whether row 6's failing handler refuses this message: about one in
/// fifty, chosen by the id (FNV-1a), so both isolations meet the same ones.
pub(crate) fn fails(message_id: &str) -> bool {
    let hash = message_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    hash % 50 == 0
}

/// Row 6's handler: row 3's, failing for good after its insert for the
/// messages [`fails`] picks.
pub(crate) async fn one_insert_failing<B: BenchDb>(
    msg: Message<serde_json::Value>,
    tx: &mut Tx<B>,
) -> Result<(), HandlerError> {
    B::insert_effect(tx, &msg.meta.message_id).await?;
    if fails(&msg.meta.message_id) {
        return Err(HandlerError::permanent("refused by the benchmark"));
    }
    Ok(())
}

impl BenchDb for Postgres {
    const LABEL: &'static str = "PostgreSQL";
    const DURABILITY: &'static str = "synchronous_commit=on";

    async fn create_bench_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        for sql in [
            "CREATE TABLE bench_effects (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL)",
            "CREATE TABLE seed_inbox (consumer TEXT NOT NULL, message_id TEXT NOT NULL, \
             PRIMARY KEY (consumer, message_id))",
        ] {
            sqlx::query(sql).execute(pool).await?;
        }
        Ok(())
    }

    async fn insert_effect<'a>(
        tx: &'a mut Tx<Self>,
        message_id: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO bench_effects (message_id) VALUES ($1)")
            .bind(message_id)
            .execute(tx.conn())
            .await
            .map(drop)
    }

    async fn insert_effects<'a>(
        tx: &'a mut Tx<Self>,
        message_ids: &'a [String],
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO bench_effects (message_id) SELECT unnest($1::text[])")
            .bind(message_ids)
            .execute(tx.conn())
            .await
            .map(drop)
    }

    async fn floor_apply<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        message_ids: &'a [String],
    ) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query(
            "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
             SELECT $1, id, 'billing.invoice-paid.v1', NULL, now() FROM unnest($2::text[]) AS t(id)
             ON CONFLICT (consumer_name, message_id) DO NOTHING",
        )
        .bind(consumer)
        .bind(message_ids)
        .execute(&mut *tx)
        .await?;
        sqlx::query("INSERT INTO bench_effects (message_id) SELECT unnest($1::text[])")
            .bind(message_ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    async fn seed_apply<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        let claimed = sqlx::query(
            "INSERT INTO seed_inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(consumer)
        .bind(message_id)
        .execute(&mut *tx)
        .await?;
        if claimed.rows_affected() == 1 {
            sqlx::query("INSERT INTO bench_effects (message_id) VALUES ($1)")
                .bind(message_id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    async fn fill_inbox<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        rows: u64,
        expired: u64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO warren_inbox (consumer_name, message_id, event_type, received_at, processed_at)
             SELECT $1, 'filler-' || g, 'bench.filler.v1', now(),
                    CASE WHEN g <= $3 THEN now() - interval '400 days' ELSE now() END
             FROM generate_series(1, $2::bigint) AS g",
        )
        .bind(consumer)
        .bind(i64::try_from(rows).unwrap_or(i64::MAX))
        .bind(i64::try_from(expired).unwrap_or(i64::MAX))
        .execute(pool)
        .await?;
        sqlx::query("ANALYZE warren_inbox").execute(pool).await?;
        Ok(())
    }
}

impl BenchDb for Sqlite {
    const LABEL: &'static str = "SQLite";
    const DURABILITY: &'static str = "WAL, synchronous=FULL";

    async fn create_bench_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        for sql in [
            "CREATE TABLE bench_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL)",
            "CREATE TABLE seed_inbox (consumer TEXT NOT NULL, message_id TEXT NOT NULL, \
             PRIMARY KEY (consumer, message_id))",
        ] {
            sqlx::query(sql).execute(pool).await?;
        }
        Ok(())
    }

    async fn insert_effect<'a>(
        tx: &'a mut Tx<Self>,
        message_id: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO bench_effects (message_id) VALUES (?1)")
            .bind(message_id)
            .execute(tx.conn())
            .await
            .map(drop)
    }

    async fn insert_effects<'a>(
        tx: &'a mut Tx<Self>,
        message_ids: &'a [String],
    ) -> Result<(), sqlx::Error> {
        let sql = format!(
            "INSERT INTO bench_effects (message_id) VALUES {}",
            billing_service::db::values(message_ids.len(), "(?)")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for id in message_ids {
            query = query.bind(id);
        }
        query.execute(tx.conn()).await.map(drop)
    }

    async fn floor_apply<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        message_ids: &'a [String],
    ) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let sql = format!(
            "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at)
             VALUES {} ON CONFLICT (consumer_name, message_id) DO NOTHING",
            billing_service::db::values(message_ids.len(), "(?, ?, 'billing.invoice-paid.v1', NULL, ?)")
        );
        let now = chrono::Utc::now()
            .format("%Y-%m-%dT%H:%M:%S%.6fZ")
            .to_string();
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for id in message_ids {
            query = query.bind(consumer).bind(id).bind(&now);
        }
        query.execute(&mut *tx).await?;
        let sql = format!(
            "INSERT INTO bench_effects (message_id) VALUES {}",
            billing_service::db::values(message_ids.len(), "(?)")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for id in message_ids {
            query = query.bind(id);
        }
        query.execute(&mut *tx).await?;
        tx.commit().await
    }

    async fn seed_apply<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        message_id: &'a str,
    ) -> Result<(), sqlx::Error> {
        // BEGIN IMMEDIATE, as anyone writing SQLite from several tasks must:
        // a deferred transaction that upgrades to a write lock fails as busy.
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let claimed = sqlx::query(
            "INSERT INTO seed_inbox (consumer, message_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        )
        .bind(consumer)
        .bind(message_id)
        .execute(&mut *tx)
        .await?;
        if claimed.rows_affected() == 1 {
            sqlx::query("INSERT INTO bench_effects (message_id) VALUES (?1)")
                .bind(message_id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    async fn fill_inbox<'a>(
        pool: &'a Pool<Self>,
        consumer: &'a str,
        rows: u64,
        expired: u64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?2)
             INSERT INTO warren_inbox (consumer_name, message_id, event_type, received_at, processed_at)
             SELECT ?1, 'filler-' || n, 'bench.filler.v1', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
                    CASE WHEN n <= ?3 THEN strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-400 days')
                         ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now') END
             FROM g",
        )
        .bind(consumer)
        .bind(i64::try_from(rows).unwrap_or(i64::MAX))
        .bind(i64::try_from(expired).unwrap_or(i64::MAX))
        .execute(pool)
        .await?;
        sqlx::query("ANALYZE").execute(pool).await?;
        Ok(())
    }
}
