//! The outbox half of the shared SQL store: the insert a handler's events
//! go through, and what the relay and the operator tools run.

use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Type};

use super::SqlStore;
use crate::outbox_row::{FailedRow, OutboxRow, RowOutcome};
use crate::store::{Dialect, OutboxCounts, OutboxListener, OutboxStore, StoreError};

/// Rows one outbox insert writes at most: 9 values a row stays far below
/// every dialect's limit on bound values.
const ROWS_PER_INSERT: usize = 500;

/// The one shared insert behind each dialect's
/// [`SqlDialect::insert_outbox`](crate::store::dialect::SqlDialect::insert_outbox):
/// the dialect's statement for one row, one statement of several rows for
/// more.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(in crate::store) async fn insert_outbox<D>(
    conn: &mut D::Connection,
    rows: &[crate::outbox_row::NewOutboxRow<'_>],
) -> Result<(), StoreError>
where
    D: crate::store::dialect::SqlDialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    for<'s> &'s str: Encode<'s, D> + Type<D>,
    for<'s> &'s [u8]: Encode<'s, D> + Type<D>,
    for<'s> Option<&'s str>: Encode<'s, D> + Type<D>,
{
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let built = (chunk.len() > 1).then(|| multi_row_insert::<D>(chunk.len()));
        let mut query = match &built {
            Some(sql) => sqlx::query(sqlx::AssertSqlSafe(sql.as_str())),
            None => sqlx::query(D::SQL.insert_outbox),
        };
        for row in chunk {
            query = query
                .bind(row.message_id)
                .bind(row.exchange)
                .bind(row.routing_key)
                .bind(row.properties.as_str())
                .bind(row.body.as_slice())
                .bind(row.causation_id)
                .bind(row.trace.traceparent())
                .bind(row.trace.tracestate())
                .bind(row.trace.baggage());
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}

/// The dialect's outbox insert with `rows` rows of values, bound in order.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
fn multi_row_insert<D: crate::store::dialect::SqlDialect>(rows: usize) -> String {
    const COLUMNS: usize = 9;
    let statement = D::SQL.insert_outbox;
    let head = &statement[..statement
        .find("VALUES")
        .expect("the outbox insert has a VALUES list")];
    let mut sql = String::from(head);
    sql.push_str("VALUES ");
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        for column in 1..=COLUMNS {
            if column > 1 {
                sql.push_str(", ");
            }
            let n = row * COLUMNS + column;
            sql.push_str(&D::numbered_placeholder(n).unwrap_or_else(|| "?".to_owned()));
        }
        sql.push(')');
    }
    sql
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
            // Where writers take turns, the batch is taken in a short write
            // of its own (the dialect holds no transaction while it is
            // published), and its outcomes are marked in another.
            let mut turn = self.write_turn().await?;
            let (held, mut raw) = D::take_batch(&self.pool, limit).await?;
            if held.is_none() {
                drop(turn.take());
            }
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
                None => {
                    turn = self.write_turn().await?;
                    self.pool.begin_with(D::SQL.begin).await?
                }
            };
            // The published rows, the common case, in one statement; failed
            // and retried ones each carry their own error.
            let mut published = Vec::with_capacity(outcomes.len());
            for (id, outcome) in outcomes {
                let q = match &outcome {
                    RowOutcome::Published => {
                        published.push(id);
                        continue;
                    }
                    RowOutcome::Failed(e) => {
                        sqlx::query(D::SQL.mark_failed).bind(e.as_str()).bind(id)
                    }
                    RowOutcome::Retry(e) => sqlx::query(D::SQL.mark_retry).bind(e.as_str()).bind(id),
                };
                q.execute(&mut *tx).await?;
            }
            if !published.is_empty() {
                let ids = serde_json::to_string(&published).expect("integers serialize");
                sqlx::query(D::SQL.mark_published)
                    .bind(ids)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            drop(turn);
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

        async fn outbox_backlog(&self) -> Result<(i64, Option<DateTime<Utc>>), StoreError> {
            let (pending, oldest): (i64, Option<D::Time>) = sqlx::query_as(D::SQL.outbox_backlog)
                .fetch_one(&self.pool)
                .await?;
            Ok((pending, oldest.and_then(D::parse_time)))
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
            let _turn = self.write_turn().await?;
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
            let _turn = self.write_turn().await?;
            let done = sqlx::query(D::SQL.delete_published_before)
                .bind(D::time(cutoff))
                .bind(i64::from(batch))
                .execute(&self.pool)
                .await?;
            Ok(D::rows_affected(&done))
        }
    }
}
