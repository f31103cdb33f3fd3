//! A message's trail on every SQL dialect.

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::super::journal::JournalEntry;
use super::super::trail::{InboxRecord, OutboxRecord, Trail};
use super::*;

fn time<D: Dialect>(t: D::Time, what: &str) -> Result<DateTime<Utc>, StoreError> {
    D::parse_time(t).ok_or_else(|| StoreError::Config(format!("{what} does not read as a time")))
}

shared_impl! {
    impl Trail {
        async fn inbox_records<'a>(
            &'a self,
            message_id: &'a str,
        ) -> Result<Vec<InboxRecord>, StoreError> {
            let rows = sqlx::query(D::SQL.trail_inbox)
                .bind(message_id)
                .fetch_all(&self.pool)
                .await?;
            rows.iter()
                .map(|row| {
                    Ok(InboxRecord {
                        consumer: row.try_get(0)?,
                        event_type: row.try_get(1)?,
                        received_at: time::<D>(row.try_get(2)?, "an inbox received_at")?,
                        processed_at: time::<D>(row.try_get(3)?, "an inbox processed_at")?,
                    })
                })
                .collect()
        }

        async fn journal_records<'a>(
            &'a self,
            message_id: &'a str,
            limit: u32,
        ) -> Result<Vec<JournalEntry>, StoreError> {
            let rows = sqlx::query(D::SQL.trail_journal)
                .bind(message_id)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
            rows.iter()
                .map(|row| {
                    Ok(JournalEntry {
                        consumer: row.try_get(0)?,
                        message_id: message_id.to_owned(),
                        replay_id: row.try_get(1)?,
                        outcome: row.try_get(2)?,
                        detail: row.try_get(3)?,
                        at: time::<D>(row.try_get(4)?, "a journal time")?,
                    })
                })
                .collect()
        }

        async fn outbox_records<'a>(
            &'a self,
            message_id: &'a str,
        ) -> Result<Vec<OutboxRecord>, StoreError> {
            let rows = sqlx::query(D::SQL.trail_outbox)
                .bind(message_id)
                .bind(message_id)
                .fetch_all(&self.pool)
                .await?;
            rows.iter()
                .map(|row| {
                    let properties: String = row.try_get(5)?;
                    let optional_time = |i: usize| -> Result<Option<DateTime<Utc>>, StoreError> {
                        let t: Option<D::Time> = row.try_get(i)?;
                        Ok(t.and_then(D::parse_time))
                    };
                    Ok(OutboxRecord {
                        id: row.try_get(0)?,
                        message_id: row.try_get(1)?,
                        causation_id: row.try_get(2)?,
                        exchange: row.try_get(3)?,
                        routing_key: row.try_get(4)?,
                        event_type: crate::outbox_row::parse_properties(&properties)
                            .map(|p| p.event_type)
                            .unwrap_or_default(),
                        written_at: optional_time(6)?,
                        published_at: optional_time(7)?,
                        failed_at: optional_time(8)?,
                        attempts: row.try_get(9)?,
                        last_error: row.try_get(10)?,
                        traceparent: row.try_get(11)?,
                    })
                })
                .collect()
        }
    }
}
