//! One implementation of [`Store`] and [`OutboxStore`] for every SQL dialect,
//! written against the statements and hooks of
//! [`SqlDialect`](super::dialect::SqlDialect).

use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Type};

use super::{
    Dialect, InboxEntry, OutboxCounts, OutboxListener, OutboxStore, Store, StoreError, Wakeups,
};
use crate::outbox_row::{FailedRow, OutboxRow, RowOutcome};

/// A [`Store`] and [`OutboxStore`] on a SQL database: [`PgStore`](super::PgStore)
/// and [`SqliteStore`](super::SqliteStore) are this type for their dialect.
pub struct SqlStore<D: Database> {
    pub(super) pool: Pool<D>,
    pub(super) wakeups: Wakeups,
}

impl<D: Database> SqlStore<D> {
    #[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
    pub(super) fn with_pool(pool: Pool<D>) -> Self {
        Self {
            pool,
            wakeups: Wakeups::default(),
        }
    }

    /// The pool, for the application's own queries outside a handler.
    pub fn pool(&self) -> &Pool<D> {
        &self.pool
    }
}

impl<D: Database> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            wakeups: self.wakeups.clone(),
        }
    }
}

impl<D: Database> std::fmt::Debug for SqlStore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("dialect", &D::NAME)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// The one shared insert behind each dialect's
/// [`SqlDialect::insert_outbox`](super::dialect::SqlDialect::insert_outbox).
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(super) async fn insert_outbox<D>(
    conn: &mut D::Connection,
    row: &crate::outbox_row::NewOutboxRow<'_>,
) -> Result<(), StoreError>
where
    D: super::dialect::SqlDialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    for<'s> &'s str: Encode<'s, D> + Type<D>,
    for<'s> &'s [u8]: Encode<'s, D> + Type<D>,
{
    sqlx::query(D::SQL.insert_outbox)
        .bind(row.message_id)
        .bind(row.exchange)
        .bind(row.routing_key)
        .bind(row.properties.as_str())
        .bind(row.body.as_slice())
        .execute(&mut *conn)
        .await?;
    if let Some(notify) = D::SQL.notify_outbox {
        sqlx::query(notify).execute(&mut *conn).await?;
    }
    Ok(())
}

/// Writes `impl $trait for SqlStore<D>` under the bounds every dialect meets for
/// the shared code: its connection runs queries, and it binds and reads the Rust
/// types warren's tables use. A macro, because the bounds cannot live on
/// [`SqlDialect`](super::dialect::SqlDialect): Rust does not carry a trait's
/// `where` clauses to the places that use it (rust-lang/rust#20671), so they
/// would have to be repeated on each impl.
macro_rules! shared_impl {
    (impl $trait_:ident { $($body:tt)* }) => {
        impl<D> $trait_ for SqlStore<D>
        where
            D: Dialect,
            for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
            D::Arguments: IntoArguments<D>,
            i64: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
            String: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
            Vec<u8>: Type<D> + for<'r> Decode<'r, D>,
            for<'s> &'s str: Encode<'s, D> + Type<D>,
            for<'s> Option<&'s str>: Encode<'s, D> + Type<D>,
            usize: ColumnIndex<D::Row>,
        {
            $($body)*
        }
    };
}

shared_impl! {
    impl Store {
        type Db = D;

        async fn migrate(&self) -> Result<(), StoreError> {
            let mut conn = self.pool.acquire().await?;
            let applied = apply_migrations::<D>(&mut conn).await;
            // A lock that outlives the transaction is released whatever happened:
            // the connection goes back to the pool, still holding it otherwise.
            if let Some(unlock) = D::SQL.unlock_migrations {
                sqlx::query(unlock).execute(&mut *conn).await?;
            }
            applied
        }

        async fn ping(&self) -> Result<(), StoreError> {
            sqlx::query(D::SQL.ping).execute(&self.pool).await?;
            Ok(())
        }

        /// Every process on the database races to insert its candidate; the
        /// first insert wins, and all of them read the same key back.
        async fn signing_key(&self) -> Result<Vec<u8>, StoreError> {
            let mut conn = self.pool.acquire().await?;
            sqlx::query(D::SQL.insert_setting)
                .bind(super::SIGNING_KEY_SETTING)
                .bind(super::new_signing_key())
                .execute(&mut *conn)
                .await?;
            let key: String = sqlx::query_scalar(D::SQL.select_setting)
                .bind(super::SIGNING_KEY_SETTING)
                .fetch_one(&mut *conn)
                .await?;
            Ok(key.into_bytes())
        }

        fn wakeups(&self) -> &Wakeups {
            &self.wakeups
        }

        async fn begin(&self) -> Result<super::Tx<D>, StoreError> {
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            if let Some(mark) = D::SQL.after_begin {
                Executor::execute(&mut *tx, sqlx::raw_sql(mark)).await?;
            }
            Ok(super::Tx::new(tx))
        }

        async fn claim<'a>(
            &'a self,
            tx: &'a mut super::Tx<D>,
            entry: &'a InboxEntry<'a>,
        ) -> Result<bool, StoreError> {
            let done = sqlx::query(D::SQL.claim)
                .bind(entry.consumer_name)
                .bind(entry.message_id)
                .bind(entry.event_type)
                .bind(entry.correlation_id)
                .bind(D::time(entry.received_at))
                .execute(tx.conn())
                .await;
            match done {
                Ok(done) => Ok(D::rows_affected(&done) == 1),
                Err(e) if D::is_refused_claim(&e) => Ok(false),
                Err(e) => Err(e.into()),
            }
        }

        async fn purge_inbox<'a>(
            &'a self,
            consumer: &'a str,
            cutoff: DateTime<Utc>,
            batch: u32,
        ) -> Result<u64, StoreError> {
            let mut deleted = [0; 2];
            // Redelivery counts older than the window belong to messages long
            // settled.
            for (n, sql) in [D::SQL.purge_inbox, D::SQL.purge_redeliveries]
                .into_iter()
                .enumerate()
            {
                let done = sqlx::query(sql)
                    .bind(consumer)
                    .bind(D::time(cutoff))
                    .bind(i64::from(batch))
                    .execute(&self.pool)
                    .await?;
                deleted[n] = D::rows_affected(&done);
            }
            Ok(deleted[0])
        }

        async fn record_solo_run<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
        ) -> Result<u32, StoreError> {
            let count: i64 = match D::SQL.solo_run_count {
                None => {
                    sqlx::query_scalar(D::SQL.record_solo_run)
                        .bind(consumer)
                        .bind(message_id)
                        .fetch_one(&self.pool)
                        .await?
                }
                Some(read_back) => {
                    let mut tx = self.pool.begin_with(D::SQL.begin).await?;
                    sqlx::query(D::SQL.record_solo_run)
                        .bind(consumer)
                        .bind(message_id)
                        .execute(&mut *tx)
                        .await?;
                    let count = sqlx::query_scalar(read_back)
                        .bind(consumer)
                        .bind(message_id)
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    count
                }
            };
            Ok(u32::try_from(count).unwrap_or(u32::MAX))
        }

        async fn clear_solo_runs<'a>(
            &'a self,
            tx: Option<&'a mut super::Tx<D>>,
            consumer: &'a str,
            message_id: &'a str,
        ) -> Result<(), StoreError> {
            let query = sqlx::query(D::SQL.clear_solo_runs)
                .bind(consumer)
                .bind(message_id);
            match tx {
                Some(tx) => query.execute(tx.conn()).await?,
                None => query.execute(&self.pool).await?,
            };
            Ok(())
        }
    }
}

shared_impl! {
    impl OutboxStore {
        async fn listen(&self) -> Result<Option<OutboxListener>, StoreError> {
            D::listen(&self.pool).await
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
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let (held, mut raw) = D::take_batch(&self.pool, limit).await?;
            if raw.is_empty() {
                if let Some(tx) = held {
                    tx.rollback().await?;
                }
                return Ok(0);
            }
            // Not every dialect's statement returns the rows in order; the batch
            // goes out in id order.
            raw.sort_by_key(|r| r.0);
            let taken = raw.len();
            let (rows, unreadable) = crate::outbox_row::from_raw(raw);
            let mut outcomes = publish(rows).await;
            outcomes.extend(unreadable);
            let mut tx = match held {
                Some(tx) => tx,
                None => self.pool.begin_with(D::SQL.begin).await?,
            };
            for (id, outcome) in outcomes {
                let q = match &outcome {
                    RowOutcome::Published => sqlx::query(D::SQL.mark_published).bind(id),
                    RowOutcome::Failed(e) => {
                        sqlx::query(D::SQL.mark_failed).bind(e.as_str()).bind(id)
                    }
                    RowOutcome::Retry(e) => sqlx::query(D::SQL.mark_retry).bind(e.as_str()).bind(id),
                };
                q.execute(&mut *tx).await?;
            }
            tx.commit().await?;
            Ok(taken)
        }

        async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
            let (pending, oldest, published, failed): (i64, Option<D::Time>, i64, i64) =
                sqlx::query_as(D::SQL.outbox_counts)
                    .fetch_one(&self.pool)
                    .await?;
            Ok(OutboxCounts {
                pending,
                oldest_pending: oldest.and_then(D::parse_time),
                published,
                failed,
            })
        }

        async fn failed_outbox_rows(&self, limit: u32) -> Result<Vec<FailedRow>, StoreError> {
            let failed: Vec<crate::outbox_row::RawFailedRow> =
                sqlx::query_as(D::SQL.failed_outbox_rows)
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
            Ok(crate::outbox_row::failed_from_raw(failed))
        }

        async fn retry_failed<'a>(&'a self, ids: &'a [i64]) -> Result<u64, StoreError> {
            // One statement per id, in one transaction: every dialect can do that,
            // and an operator retries a handful of rows, not thousands.
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let mut n = 0;
            if ids.is_empty() {
                let done = sqlx::query(D::SQL.retry_all_failed)
                    .execute(&mut *tx)
                    .await?;
                n = D::rows_affected(&done);
            }
            for id in ids {
                let done = sqlx::query(D::SQL.retry_failed_id)
                    .bind(*id)
                    .execute(&mut *tx)
                    .await?;
                n += D::rows_affected(&done);
            }
            tx.commit().await?;
            Ok(n)
        }

        async fn delete_published_before(
            &self,
            cutoff: DateTime<Utc>,
            batch: u32,
        ) -> Result<u64, StoreError> {
            let done = sqlx::query(D::SQL.delete_published_before)
                .bind(D::time(cutoff))
                .bind(i64::from(batch))
                .execute(&self.pool)
                .await?;
            Ok(D::rows_affected(&done))
        }
    }
}

/// Applies the missing migrations in one transaction on `conn`, holding the
/// dialect's migration lock.
async fn apply_migrations<D>(conn: &mut D::Connection) -> Result<(), StoreError>
where
    D: super::dialect::SqlDialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    i64: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
    for<'s> &'s str: Encode<'s, D> + Type<D>,
    usize: ColumnIndex<D::Row>,
{
    // `Transaction::begin` with a ready `SqlStr`: the generic `begin_with` trips
    // the compiler's higher-ranked `Send` check on `&'static str`.
    let begin = sqlx::SqlSafeStr::into_sql_str(D::SQL.begin);
    let mut tx: sqlx::Transaction<'_, D> =
        sqlx::Transaction::begin(&mut *conn, Some(begin)).await?;
    if let Some(lock) = D::SQL.lock_migrations {
        sqlx::query(lock).execute(&mut *tx).await?;
    }
    D::MIGRATIONS.apply::<D>(&mut tx).await?;
    tx.commit().await?;
    Ok(())
}

/// The shared implementation on a throwaway SQLite file: no server needed.
#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::outgoing::Outgoing;
    use crate::store::SqliteStore;

    async fn store(dir: &tempfile::TempDir) -> SqliteStore {
        let path = dir.path().join("warren.db");
        let store = SqliteStore::connect(path.to_str().unwrap()).await.unwrap();
        store.migrate().await.unwrap();
        store
    }

    #[tokio::test]
    async fn migrating_again_runs_nothing_twice_and_records_every_version() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        store.migrate().await.unwrap();
        let versions: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM warren_migrations ORDER BY version")
                .fetch_all(store.pool())
                .await
                .unwrap();
        assert_eq!(versions, vec![1, 2, 3, 4, 5, 6]);
    }

    #[tokio::test]
    async fn a_message_id_is_claimed_once_and_redeliveries_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let entry = InboxEntry {
            consumer_name: "c",
            message_id: "m-1",
            event_type: "t",
            correlation_id: None,
            received_at: Utc::now(),
        };
        for expected in [true, false] {
            let mut tx = store.begin().await.unwrap();
            assert_eq!(store.claim(&mut tx, &entry).await.unwrap(), expected);
            tx.commit().await.unwrap();
        }
        assert_eq!(store.record_solo_run("c", "m-1").await.unwrap(), 1);
        assert_eq!(store.record_solo_run("c", "m-1").await.unwrap(), 2);
        store.clear_solo_runs(None, "c", "m-1").await.unwrap();
        assert_eq!(store.record_solo_run("c", "m-1").await.unwrap(), 1);
        let later = Utc::now() + chrono::Duration::seconds(1);
        assert_eq!(store.purge_inbox("c", later, 10).await.unwrap(), 1);
        assert_eq!(
            store.signing_key().await.unwrap(),
            store.signing_key().await.unwrap()
        );
    }

    #[tokio::test]
    async fn outbox_rows_go_out_in_order_and_their_outcomes_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let mut tx = store.begin().await.unwrap();
        for n in 0..3 {
            let message = Outgoing::new("t", 1, &serde_json::json!({ "n": n })).unwrap();
            tx.publish("ex", "key", message).await.unwrap();
        }
        tx.commit().await.unwrap();
        let taken = store
            .relay_batch(10, |rows| async move {
                let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
                assert!(ids.is_sorted(), "{ids:?}");
                vec![
                    (ids[0], RowOutcome::Published),
                    (ids[1], RowOutcome::Failed("no route".into())),
                    (ids[2], RowOutcome::Retry("nacked".into())),
                ]
            })
            .await
            .unwrap();
        assert_eq!(taken, 3);
        let counts = store.outbox_counts().await.unwrap();
        assert_eq!((counts.pending, counts.published, counts.failed), (1, 1, 1));
        assert!(counts.oldest_pending.is_some());
        let failed = store.failed_outbox_rows(10).await.unwrap();
        assert_eq!(failed[0].last_error, "no route");
        assert_eq!(store.retry_failed(&[failed[0].id]).await.unwrap(), 1);
        let later = Utc::now() + chrono::Duration::seconds(1);
        assert_eq!(store.delete_published_before(later, 10).await.unwrap(), 1);
    }
}
