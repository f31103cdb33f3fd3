//! `billing status`: counts from the database and the queues.

use std::collections::BTreeMap;
use std::sync::Arc;

use warren::admin::DeadLetterQueue;
use warren::outbox::OutboxStatus;
use warren::store::OutboxStore;

use crate::db::{BillingDb, Counts};
use crate::handlers::CONSUMER;
use crate::service::Names;

/// Everything `billing status` reports.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub counts: Counts,
    pub outbox: OutboxStatus,
    /// Ready messages in billing's queue.
    pub queued: u32,
    /// Dead letters by reason.
    pub dead_letters: BTreeMap<String, usize>,
    /// Recorded-payment events waiting in the downstream queue.
    pub recorded_queued: u32,
}

impl Report {
    pub fn dead_lettered(&self) -> usize {
        self.dead_letters.values().sum()
    }
}

pub async fn gather<B: BillingDb>(
    store: &B::S,
    connection: &Arc<warren::lapin::Connection>,
    names: &Names,
) -> Result<Report, String> {
    let counts = B::counts(store, CONSUMER).await.map_err(|e| {
        if is_missing_table(&e) {
            "billing has not run on this database yet (it has no billing tables): \
             start `billing run` first, or check --database-url"
                .to_owned()
        } else {
            e.to_string()
        }
    })?;
    let outbox = store.outbox_status().await.map_err(|e| e.to_string())?;
    let depth = |q: String| async move {
        warren::broker::inspect_queue(connection, &q)
            .await
            .map(|i| i.ready)
            .map_err(|e| format!("queue {q}: {e}"))
    };
    let queued = depth(names.queue()).await?;
    let recorded_queued = depth(names.recorded_queue()).await.unwrap_or(0);
    let mut dead_letters = BTreeMap::new();
    for letter in DeadLetterQueue::new(Arc::clone(connection), &names.queue())
        .list(usize::MAX)
        .await
        .map_err(|e| e.to_string())?
    {
        // Reasons come from headers a producer could set: escaped before printing.
        *dead_letters
            .entry(warren::admin::printable(letter.reason()).into_owned())
            .or_default() += 1;
    }
    Ok(Report {
        counts,
        outbox,
        queued,
        dead_letters,
        recorded_queued,
    })
}

#[allow(clippy::print_stdout)]
pub fn print(report: &Report) {
    let c = &report.counts;
    println!("invoices paid            {}", c.invoices_paid);
    println!("loyalty rows             {}", c.loyalty_rows);
    println!("loyalty points (sum)     {}", c.loyalty_sum);
    println!("inbox rows               {}", c.inbox_rows);
    for (currency, total) in &c.paid {
        match total {
            Some(total) => println!("amount paid {currency:<12} {total}"),
            None => println!(
                "amount paid {currency:<12} not exact: holds an amount stored before amounts were checked"
            ),
        }
    }
    println!("outbox pending           {}", report.outbox.pending);
    println!("outbox published         {}", report.outbox.published);
    println!("outbox failed            {}", report.outbox.failed.len());
    println!("queue ready              {}", report.queued);
    println!("dead letters             {}", report.dead_lettered());
    for (reason, n) in &report.dead_letters {
        println!("  {reason:<22} {n}");
    }
}

/// A query on a table that does not exist: PostgreSQL 42P01, MySQL 42S02 (error
/// 1146), SQLite "no such table".
fn is_missing_table(e: &warren::store::StoreError) -> bool {
    let warren::store::StoreError::Database(sqlx::Error::Database(db)) = e else {
        return false;
    };
    matches!(db.code().as_deref(), Some("42P01" | "42S02"))
        || db.message().starts_with("no such table")
}
