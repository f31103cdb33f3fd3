//! The health check's questions on every SQL dialect.

use chrono::{DateTime, Utc};

use super::super::checkup::{Checkup, InboxSize};
use super::*;

shared_impl! {
    impl Checkup {
        async fn migration_version(&self) -> Result<(i64, i64), StoreError> {
            let applied: Option<i64> =
                sqlx::query_scalar("SELECT MAX(version) FROM warren_migrations")
                    .fetch_one(&self.pool)
                    .await?;
            let known = D::MIGRATIONS.list.last().map_or(0, |m| m.version);
            Ok((applied.unwrap_or(0), known))
        }

        async fn inbox_size<'a>(
            &'a self,
            consumer: &'a str,
            cutoff: DateTime<Utc>,
        ) -> Result<InboxSize, StoreError> {
            let (rows, older): (i64, i64) = sqlx::query_as(D::INBOX_SIZE)
                .bind(D::time(cutoff))
                .bind(consumer)
                .fetch_one(&self.pool)
                .await?;
            Ok(InboxSize {
                rows: rows.max(0) as u64,
                older: older.max(0) as u64,
            })
        }

        async fn database_now(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
            let Some(sql) = D::DATABASE_NOW else {
                return Ok(None);
            };
            let now: D::Time = sqlx::query_scalar(sql).fetch_one(&self.pool).await?;
            D::parse_time(now)
                .map(Some)
                .ok_or_else(|| StoreError::Config("the database's clock does not read as a time".into()))
        }
    }
}
