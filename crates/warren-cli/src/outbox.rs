//! `warren outbox`: the outbox's state, and failed rows put back.

use warren::store::OutboxStore;
use warren_admin::printable;

use crate::cli::OutboxCommand;
use crate::print::{id, one_line};

pub(crate) async fn run_outbox<S: OutboxStore>(
    store: &S,
    cmd: OutboxCommand,
) -> Result<(), String> {
    run_outbox_on(store, cmd).await.map_err(|e| e.to_string())
}

async fn run_outbox_on<S: OutboxStore>(
    store: &S,
    cmd: OutboxCommand,
) -> Result<(), warren::store::StoreError> {
    match cmd {
        OutboxCommand::Status { limit } => {
            let status = store.outbox_counts().await?;
            let failed = store.failed_outbox_rows(limit).await?;
            println!("pending:   {}", status.pending);
            println!(
                "oldest:    {}",
                match status.oldest_pending {
                    Some(t) => format!(
                        "{} ({:.1} s ago)",
                        t.format("%Y-%m-%d %H:%M:%S"),
                        status.oldest_pending_age_seconds(chrono::Utc::now())
                    ),
                    None => "-".into(),
                }
            );
            println!("published: {} (kept until retention)", status.published);
            println!("failed:    {}", status.failed);
            for f in &failed {
                println!(
                    "  row {} message {} to {} with {} after {} attempt(s): {}",
                    f.id,
                    id(&f.message_id),
                    printable(&format!("{:?}", f.exchange)),
                    printable(&format!("{:?}", f.routing_key)),
                    f.attempts,
                    one_line(&f.last_error, 200)
                );
            }
            if (failed.len() as i64) < status.failed {
                println!(
                    "  ... {} more (--limit)",
                    status.failed - failed.len() as i64
                );
            }
        }
        OutboxCommand::RetryFailed { ids } => {
            let n = store.retry_failed(&ids).await?;
            println!("requeued {n} failed row(s)");
        }
    }
    Ok(())
}
