//! `billing status`: counts from the database and the queues.

use std::collections::BTreeMap;
use std::sync::Arc;

use warren::outbox::OutboxStatus;
use warren::store::{DeadLetterStore, OutboxStore};
use warren_admin::DeadLetterQueue;

use billing_service::db::{BillingDb, Counts};
use billing_service::handlers::CONSUMER;
use billing_service::service::Names;

/// Everything `billing status` reports.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub counts: Counts,
    pub outbox: OutboxStatus,
    /// Ready messages in billing's queue.
    pub queued: u32,
    /// Dead letters by reason: unresolved ones in the dead-letter store, or
    /// (`DeadLetterSource::QueueBodies`) those in the dead-letter queue.
    pub dead_letters: BTreeMap<String, usize>,
    /// Dead letters in the dead-letter queue not counted by reason: not
    /// stored yet, or all of them when the store is off.
    pub dead_letters_queued: u32,
    /// Where the dead letters were counted.
    pub source: DeadLetterSource,
    /// Recorded-payment events waiting in the downstream queue.
    pub recorded_queued: u32,
}

impl Report {
    pub fn dead_lettered(&self) -> usize {
        self.dead_letters.values().sum::<usize>() + self.dead_letters_queued as usize
    }
}

/// Where `gather` counts dead letters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeadLetterSource {
    /// The dead-letter store (unresolved letters, by reason), plus the
    /// dead-letter queue's depth for those not stored yet. No body is read.
    #[default]
    Table,
    /// The dead-letter queue's depth alone, from queue metadata: no body
    /// is read, and no reason is known.
    QueueDepth,
    /// Every letter in the dead-letter queue, read to count by reason: the
    /// demo's check when the store is off.
    QueueBodies,
}

pub async fn gather<B: BillingDb>(
    store: &B::S,
    connection: &Arc<warren::lapin::Connection>,
    names: &Names,
    source: DeadLetterSource,
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
    let dead_letter_queue = warren::topology::dead_letter_queue_name(&names.queue());
    let mut dead_letters = BTreeMap::new();
    let mut dead_letters_queued = 0;
    match source {
        DeadLetterSource::Table => {
            let filter = warren::store::LetterFilter {
                consumer: Some(CONSUMER.to_owned()),
                ..warren::store::LetterFilter::default()
            };
            for group in store
                .dead_letter_groups(&filter, 100_000)
                .await
                .map_err(|e| e.to_string())?
            {
                // Reasons come from headers a producer could set: escaped
                // before printing.
                *dead_letters
                    .entry(warren_admin::printable(&group.reason).into_owned())
                    .or_default() += group.count as usize;
            }
            dead_letters_queued = depth(dead_letter_queue).await.unwrap_or(0);
        }
        DeadLetterSource::QueueDepth => {
            dead_letters_queued = depth(dead_letter_queue).await?;
        }
        DeadLetterSource::QueueBodies => {
            for letter in DeadLetterQueue::new(Arc::clone(connection), &names.queue())
                .list(usize::MAX)
                .await
                .map_err(|e| e.to_string())?
            {
                *dead_letters
                    .entry(warren_admin::printable(letter.reason()).into_owned())
                    .or_default() += 1;
            }
        }
    }
    Ok(Report {
        counts,
        outbox,
        queued,
        dead_letters,
        dead_letters_queued,
        source,
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
    match report.source {
        DeadLetterSource::Table => {
            println!(
                "dead letters unresolved  {}",
                report.dead_letters.values().sum::<usize>()
            );
            for (reason, n) in &report.dead_letters {
                println!("  {reason:<22} {n}");
            }
            println!("dead letters not stored  {}", report.dead_letters_queued);
        }
        DeadLetterSource::QueueDepth => {
            println!("dead letters (queue)     {}", report.dead_letters_queued);
            println!("  the dead-letter store is off: `warren dlq list` reads the queue");
        }
        DeadLetterSource::QueueBodies => {
            println!("dead letters             {}", report.dead_lettered());
            for (reason, n) in &report.dead_letters {
                println!("  {reason:<22} {n}");
            }
        }
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
