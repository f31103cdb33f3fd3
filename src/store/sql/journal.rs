//! The delivery journal on every SQL dialect.

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::super::journal::{Journal, JournalEntry};
use super::dead_letters::{Bind, Conditions};
use super::*;

/// Entries written per `INSERT`: 6 values each.
const ROWS_PER_INSERT: usize = 500;

/// The columns read back, in the order [`entry`] reads them.
const COLUMNS: &str = "j.consumer_name, j.message_id, j.replay_id, j.outcome, j.detail, j.at";

/// The multi-row inserts that write `entries`, with their values.
fn inserts<D: Dialect>(entries: &[JournalEntry]) -> Vec<(String, Conditions<D>)> {
    entries
        .chunks(ROWS_PER_INSERT)
        .map(|chunk| {
            let mut c = Conditions::<D>::new();
            let rows: Vec<String> = chunk
                .iter()
                .map(|e| {
                    let row = [
                        c.value(Bind::Text(e.consumer.clone())),
                        c.value(Bind::Text(e.message_id.clone())),
                        c.value(Bind::Text(e.replay_id.clone())),
                        c.value(Bind::Text(e.outcome.clone())),
                        c.value(Bind::Text(e.detail.clone())),
                        c.value(Bind::Time(D::time(e.at))),
                    ];
                    format!("({})", row.join(", "))
                })
                .collect();
            let sql = format!(
                "INSERT INTO warren_journal (consumer_name, message_id, replay_id, outcome, detail, at)
                 VALUES {}",
                rows.join(", ")
            );
            (sql, c)
        })
        .collect()
}

shared_impl! {
    impl Journal {
        async fn journal_in<'a>(
            &'a self,
            tx: &'a mut crate::store::Tx<D>,
            entries: &'a [JournalEntry],
        ) -> Result<(), StoreError> {
            for (sql, c) in inserts::<D>(entries) {
                run_built!(tx.conn(), sql, c, execute);
            }
            Ok(())
        }

        async fn write_journal<'a>(&'a self, entries: &'a [JournalEntry]) -> Result<(), StoreError> {
            if entries.is_empty() {
                return Ok(());
            }
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            for (sql, c) in inserts::<D>(entries) {
                run_built!(&mut *tx, sql, c, execute);
            }
            tx.commit().await?;
            Ok(())
        }

        async fn journal_of_run<'a>(
            &'a self,
            run_id: &'a str,
            failures_only: bool,
            limit: u32,
        ) -> Result<Vec<JournalEntry>, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("r.run_id =", Bind::Text(run_id.to_owned()));
            if failures_only {
                c.sql
                    .push("j.outcome IN ('retried', 'dead-lettered')".to_owned());
            }
            let limit = c.value(Bind::Int(i64::from(limit)));
            let sql = format!(
                "SELECT {COLUMNS} FROM warren_journal j
                 JOIN warren_replays r ON r.replay_id = j.replay_id
                 {} ORDER BY j.id LIMIT {limit}",
                c.where_clause()
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter().map(entry::<D>).collect()
        }

        async fn journal_of_replay<'a>(&'a self, replay_id: &'a str) -> Result<Vec<JournalEntry>, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("j.replay_id =", Bind::Text(replay_id.to_owned()));
            let sql = format!(
                "SELECT {COLUMNS} FROM warren_journal j {} ORDER BY j.id",
                c.where_clause()
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter().map(entry::<D>).collect()
        }

        async fn journal_of_message<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
            limit: u32,
        ) -> Result<Vec<JournalEntry>, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("j.consumer_name =", Bind::Text(consumer.to_owned()));
            c.push("j.message_id =", Bind::Text(message_id.to_owned()));
            let limit = c.value(Bind::Int(i64::from(limit)));
            let sql = format!(
                "SELECT {COLUMNS} FROM warren_journal j {} ORDER BY j.id LIMIT {limit}",
                c.where_clause()
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter().map(entry::<D>).collect()
        }

        async fn purge_journal(&self, before: DateTime<Utc>, limit: u32) -> Result<u64, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("at <", Bind::Time(D::time(before)));
            let limit = c.value(Bind::Int(i64::from(limit)));
            // Through a derived table, as the dead-letter purge: MySQL takes no
            // LIMIT in an IN subquery.
            let sql = format!(
                "DELETE FROM warren_journal WHERE id IN (
                     SELECT id FROM (SELECT id FROM warren_journal {} LIMIT {limit}) doomed)",
                c.where_clause()
            );
            let _turn = self.write_turn().await?;
            let done = run_built!(&self.pool, sql, c, execute);
            Ok(D::rows_affected(&done))
        }
    }
}

/// An entry, from [`COLUMNS`].
fn entry<D>(row: &D::Row) -> Result<JournalEntry, StoreError>
where
    D: Dialect,
    String: for<'r> Decode<'r, D> + Type<D>,
    usize: ColumnIndex<D::Row>,
{
    Ok(JournalEntry {
        consumer: row.try_get(0)?,
        message_id: row.try_get(1)?,
        replay_id: row.try_get(2)?,
        outcome: row.try_get(3)?,
        detail: row.try_get(4)?,
        at: D::parse_time(row.try_get(5)?)
            .ok_or_else(|| StoreError::Config("a journal time does not read as one".into()))?,
    })
}
