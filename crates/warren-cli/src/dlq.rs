//! `warren dlq`: list, show, replay and purge a dead-letter queue.

use std::sync::Arc;

use warren::lapin;
use warren_admin::{DeadLetter, DeadLetterQueue, Selection, printable};

use crate::CliError;
use crate::cli::DlqCommand;
use crate::print::{id, one_line, time};

fn print_payload(letter: &DeadLetter) {
    println!("  payload: {}", warren_admin::printable_bytes(&letter.body));
}

fn print_list(letters: &[DeadLetter], show_payload: bool) {
    println!(
        "{:<38} {:<32} {:<24} {:>8} {:<19} {:<19} ERROR",
        "ID", "TYPE", "REASON", "ATTEMPTS", "FIRST FAILURE", "LAST FAILURE"
    );
    for l in letters {
        let (attempts, first, last, error) = match &l.info {
            Some(i) => (
                i.attempts.to_string(),
                time(i.first_failure),
                time(i.last_failure),
                one_line(&i.error, 80),
            ),
            None => ("-".into(), "-".into(), "-".into(), String::new()),
        };
        println!(
            "{:<38} {:<32} {:<24} {:>8} {:<19} {:<19} {}",
            id(&l.message_id),
            one_line(&l.event_type, 32),
            one_line(l.reason(), 24),
            attempts,
            first,
            last,
            error
        );
        if let Some(p) = &l.pruned {
            println!("  headers pruned on reading: {}", one_line(&p.detail, 160));
        }
        if show_payload {
            print_payload(l);
        }
    }
    println!("{} dead letter(s)", letters.len());
}

fn print_one(l: &DeadLetter, show_payload: bool) {
    println!("message id: {}", id(&l.message_id));
    println!("type:       {}", printable(&l.event_type));
    println!("reason:     {}", printable(l.reason()));
    if let Some(i) = &l.info {
        if !i.format.is_empty() {
            println!("format:     {}", printable(&i.format));
        }
        println!("attempts:   {}", i.attempts);
        println!("consumer:   {}", printable(&i.consumer));
        println!("queue:      {}", printable(&i.queue));
        println!(
            "published:  exchange {}, routing key {}",
            printable(&format!("{:?}", i.original_exchange)),
            printable(&format!("{:?}", i.original_routing_key))
        );
        println!("first fail: {}", time(i.first_failure));
        println!("last fail:  {}", time(i.last_failure));
        println!("error:      {}", printable(&i.error));
    }
    if let Some(p) = &l.pruned {
        // Read through warren's frame guard: what it removed is not in the
        // headers below.
        println!(
            "pruned:     {} on reading: {}",
            p.cause,
            printable(&p.detail)
        );
        println!("removed:    {}", printable(&p.removed));
        println!("digest:     {}", printable(&p.digest));
    }
    if let Some(headers) = l.properties.headers() {
        println!("headers:");
        for (k, v) in headers.inner() {
            println!(
                "  {}: {}",
                printable(k.as_str()),
                printable(&header_text(v))
            );
        }
    }
    if show_payload {
        print_payload(l);
    }
}

/// A header value as text: a string as itself (warren's own headers are
/// long strings, which the client holds as bytes), anything else as JSON.
fn header_text(value: &lapin::types::AMQPValue) -> String {
    match warren::amqp::value_to_json(value) {
        serde_json::Value::String(s) => s,
        other => other.to_string(),
    }
}

pub(crate) async fn run_dlq(
    cmd: DlqCommand,
    connection: &Arc<lapin::Connection>,
) -> Result<(), CliError> {
    let dlq = |queue: &str| DeadLetterQueue::new(Arc::clone(connection), queue);
    let err = |e: warren::broker::BrokerError| CliError::Failed(e.to_string());
    match cmd {
        DlqCommand::List {
            queue,
            limit,
            show_payload,
        } => {
            print_list(&dlq(&queue).list(limit).await.map_err(err)?, show_payload);
        }
        DlqCommand::Show {
            queue,
            id,
            show_payload,
        } => {
            let q = dlq(&queue);
            match q.find(&id).await.map_err(err)? {
                Some(letter) => print_one(&letter, show_payload),
                None => {
                    return Err(CliError::Failed(format!(
                        "no message with id {id:?} in {}",
                        q.name()
                    )));
                }
            }
        }
        DlqCommand::Replay {
            queue,
            which,
            reason,
            limit,
            rate,
            dry_run,
        } => {
            if let Some(r) = &reason
                && warren_admin::DeadLetterReason::from_name(r).is_none()
            {
                return Err(CliError::Usage(format!(
                    "unknown reason {r:?}; known: {}",
                    warren_admin::DeadLetterReason::ALL
                        .map(|r| r.as_str())
                        .join(", ")
                )));
            }
            let wanted = which.ids.clone();
            let selection = Selection {
                ids: which.ids,
                reason,
                limit,
            };
            let report = dlq(&queue)
                .replay(&selection, rate, dry_run)
                .await
                .map_err(err)?;
            let verb = if dry_run { "would replay" } else { "replayed" };
            for l in &report.replayed {
                println!("{verb} {} ({})", id(&l.message_id), printable(&l.reason));
            }
            println!(
                "{verb} {} message(s) to {queue}; {} left in place",
                report.replayed.len(),
                report.skipped
            );
            let missing: Vec<&String> = wanted
                .iter()
                .filter(|w| !report.replayed.iter().any(|r| &r.message_id == *w))
                .collect();
            if !missing.is_empty() {
                let names: Vec<String> = missing.iter().map(|m| id(m).into_owned()).collect();
                return Err(CliError::Failed(format!(
                    "no dead letter with id {} (matching the filters) in {queue}.dead-letter",
                    names.join(", ")
                )));
            }
        }
        DlqCommand::Purge { queue, which, yes } => {
            if !yes {
                return Err(CliError::Usage(
                    "purging deletes dead letters for good; add --yes to confirm".into(),
                ));
            }
            let q = dlq(&queue);
            if which.all {
                let n = q.purge_all().await.map_err(err)?;
                println!("purged {n} message(s) from {}", q.name());
            } else {
                let removed = q.purge_ids(&which.ids).await.map_err(err)?;
                for l in &removed {
                    println!("purged {}", id(&l.message_id));
                }
                println!("purged {} message(s) from {}", removed.len(), q.name());
            }
        }
    }
    Ok(())
}
