//! `warren trace MESSAGE_ID`: what happened to one message, from the
//! databases alone. Each database is asked for the message's inbox rows (the
//! consumers that applied it), its journal (the outcomes that wrote no inbox
//! row: retries, duplicates, stale versions, dead letters), its dead letters in
//! the store, and the outbox rows that published it or that its handlers
//! wrote. With `--follow`, each event it caused is traced the same way, in
//! every database given, so that a causation chain reads across services.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use warren::store::{
    DeadLetterStore, InboxRecord, JournalEntry, LetterFilter, LetterState, OutboxRecord,
    StoredDeadLetter, Trail,
};
use warren::{MySqlStore, PgStore, SqliteStore};
use warren_admin::DatabaseUrl;

use crate::CliError;
use crate::print::{id, one_line};

/// Journal entries read per message and database: a message retried more
/// often than this has its first ones shown.
const JOURNAL_LIMIT: u32 = 200;
/// Dead letters read per message, database and state.
const LETTER_LIMIT: u32 = 50;
/// How deep `--follow` goes: a chain longer than this is cut, and says so.
pub(crate) const MAX_DEPTH: usize = 16;

/// One opened database.
enum Db {
    Pg(PgStore),
    Sqlite(SqliteStore),
    MySql(MySqlStore),
}

/// What one database remembers of one message.
#[derive(Default)]
struct Found {
    inbox: Vec<InboxRecord>,
    journal: Vec<JournalEntry>,
    letters: Vec<StoredDeadLetter>,
    outbox: Vec<OutboxRecord>,
}

async fn found_in<S: Trail + DeadLetterStore>(
    store: &S,
    message_id: &str,
) -> Result<Found, warren::store::StoreError> {
    let mut letters = Vec::new();
    for state in [
        LetterState::Unresolved,
        LetterState::Replayed,
        LetterState::Resolved,
    ] {
        let filter = LetterFilter {
            state,
            message_id: Some(message_id.to_owned()),
            ..LetterFilter::default()
        };
        letters.extend(store.dead_letters(&filter, None, LETTER_LIMIT).await?);
    }
    Ok(Found {
        inbox: store.inbox_records(message_id).await?,
        journal: store.journal_records(message_id, JOURNAL_LIMIT).await?,
        letters,
        outbox: store.outbox_records(message_id).await?,
    })
}

impl Db {
    async fn open(url: &DatabaseUrl) -> Result<Self, CliError> {
        let fail =
            |e: warren::store::StoreError| CliError::Failed(format!("{}: {e}", url.redacted()));
        Ok(match url {
            DatabaseUrl::Postgres(u) => Db::Pg(PgStore::connect(u, 2).await.map_err(fail)?),
            DatabaseUrl::Sqlite(u) => {
                crate::dispatch::existing_sqlite(u)?;
                Db::Sqlite(SqliteStore::connect(u).await.map_err(fail)?)
            }
            DatabaseUrl::MySql(u) => Db::MySql(MySqlStore::connect(u, 2).await.map_err(fail)?),
        })
    }

    async fn found(&self, message_id: &str) -> Result<Found, warren::store::StoreError> {
        match self {
            Db::Pg(s) => found_in(s, message_id).await,
            Db::Sqlite(s) => found_in(s, message_id).await,
            Db::MySql(s) => found_in(s, message_id).await,
        }
    }
}

/// Traces a message in every database of `urls` and prints the tree, or
/// JSON: under the first of `keys` that any database remembers, or under the
/// first if none does. Fails if a database cannot be read; a message found
/// nowhere is not a failure, and is said so.
pub(crate) async fn run_trace(
    urls: &[DatabaseUrl],
    keys: &[String],
    follow: bool,
    json_out: bool,
) -> Result<(), CliError> {
    let mut dbs = Vec::with_capacity(urls.len());
    for url in urls {
        dbs.push((url.redacted(), Db::open(url).await?));
    }
    let mut tree = Value::Null;
    for key in keys {
        let mut seen = HashSet::new();
        let found = trace(&dbs, key, follow, 0, &mut seen).await?;
        let remembered = remembered(&found);
        if tree.is_null() || remembered {
            tree = found;
        }
        if remembered {
            break;
        }
    }
    if json_out {
        println!("{}", warren_admin::printable_json_pretty(&tree));
    } else {
        let mut out = String::new();
        render(&tree, 0, &mut out);
        print!("{out}");
    }
    Ok(())
}

/// Whether any database remembers anything of the traced message.
fn remembered(tree: &Value) -> bool {
    !tree["published_by"].is_null()
        || ["received", "journal", "dead_letters", "caused"]
            .iter()
            .any(|part| tree[part].as_array().is_some_and(|a| !a.is_empty()))
}

fn at(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn opt_at(t: Option<DateTime<Utc>>) -> Value {
    t.map_or(Value::Null, |t| Value::String(at(t)))
}

/// The trail of `message_id` as JSON: the same shape at every level.
fn trace<'a>(
    dbs: &'a [(String, Db)],
    message_id: &'a str,
    follow: bool,
    depth: usize,
    seen: &'a mut HashSet<String>,
) -> Pin<Box<dyn Future<Output = Result<Value, CliError>> + Send + 'a>> {
    Box::pin(async move {
        seen.insert(message_id.to_owned());
        let (mut received, mut journal, mut letters, mut published_by, mut caused) =
            (vec![], vec![], vec![], Value::Null, vec![]);
        for (name, db) in dbs {
            let found = db
                .found(message_id)
                .await
                .map_err(|e| CliError::Failed(format!("{name}: {e}")))?;
            for r in found.inbox {
                received.push(json!({
                    "database": name, "consumer": r.consumer, "event_type": r.event_type,
                    "received_at": at(r.received_at), "applied_at": at(r.processed_at),
                }));
            }
            for j in found.journal {
                journal.push(json!({
                    "database": name, "consumer": j.consumer, "outcome": j.outcome,
                    "detail": j.detail, "replay_id": j.replay_id, "at": at(j.at),
                }));
            }
            for l in found.letters {
                letters.push(json!({
                    "database": name, "letter_id": l.letter_id, "consumer": l.consumer,
                    "reason": l.reason, "error": l.error, "attempts": l.attempts,
                    "state": l.state.as_str(), "last_failure": at(l.last_failure),
                }));
            }
            for row in found.outbox {
                let value = json!({
                    "database": name, "row_id": row.id, "message_id": row.message_id,
                    "event_type": row.event_type, "exchange": row.exchange,
                    "routing_key": row.routing_key, "written_at": opt_at(row.written_at),
                    "published_at": opt_at(row.published_at),
                    "failed_at": opt_at(row.failed_at), "attempts": row.attempts,
                    "last_error": row.last_error, "traceparent": row.traceparent,
                });
                if row.message_id == message_id {
                    published_by = value;
                } else {
                    caused.push((row.message_id, value));
                }
            }
        }
        let mut events = Vec::with_capacity(caused.len());
        for (event_id, mut value) in caused {
            if follow {
                value["trail"] = if seen.contains(&event_id) {
                    json!({"message_id": event_id, "cut": "already shown"})
                } else if depth + 1 >= MAX_DEPTH {
                    json!({"message_id": event_id, "cut": format!("deeper than {MAX_DEPTH}")})
                } else {
                    trace(dbs, &event_id, follow, depth + 1, seen).await?
                };
            }
            events.push(value);
        }
        Ok(json!({
            "message_id": message_id,
            "published_by": published_by,
            "received": received,
            "journal": journal,
            "dead_letters": letters,
            "caused": events,
        }))
    })
}

fn text<'v>(v: &'v Value, key: &str) -> &'v str {
    v[key].as_str().unwrap_or("")
}

fn push_line(out: &mut String, indent: usize, line: &str) {
    out.push_str(&"  ".repeat(indent));
    out.push_str(line);
    out.push('\n');
}

/// The tree as text: the message, then per consumer what became of it, its
/// dead letters, and the events it caused (each followed, if asked).
fn render(node: &Value, indent: usize, out: &mut String) {
    let message_id = text(node, "message_id");
    if let Some(cut) = node["cut"].as_str() {
        push_line(out, indent, &format!("message {} ({cut})", id(message_id)));
        return;
    }
    push_line(out, indent, &format!("message {}", id(message_id)));
    let inner = indent + 1;
    if let Some(p) = node["published_by"].as_object() {
        let p = Value::Object(p.clone());
        push_line(
            out,
            inner,
            &format!(
                "published by the outbox of {} (row {}): {}",
                text(&p, "database"),
                p["row_id"],
                publish_state(&p)
            ),
        );
    }
    let received = node["received"].as_array().cloned().unwrap_or_default();
    let journal = node["journal"].as_array().cloned().unwrap_or_default();
    if received.is_empty() && journal.is_empty() {
        push_line(
            out,
            inner,
            "never received by a consumer of these databases",
        );
    }
    let mut consumers: Vec<(String, String)> = received
        .iter()
        .chain(&journal)
        .map(|v| {
            (
                text(v, "database").to_owned(),
                text(v, "consumer").to_owned(),
            )
        })
        .collect();
    consumers.dedup();
    let mut shown = HashSet::new();
    for (database, consumer) in consumers {
        if !shown.insert((database.clone(), consumer.clone())) {
            continue;
        }
        push_line(
            out,
            inner,
            &format!("consumer {} ({database})", one_line(&consumer, 80)),
        );
        let mine = |v: &&Value| text(v, "database") == database && text(v, "consumer") == consumer;
        // Its outcomes in the order they happened: the journal and the inbox
        // row interleave (a duplicate comes after the applied copy).
        let mut lines: Vec<(String, String)> = Vec::new();
        for j in journal.iter().filter(mine) {
            let detail = match text(j, "detail") {
                "" => String::new(),
                d => format!(": {}", one_line(d, 160)),
            };
            let replay = match text(j, "replay_id") {
                "" => String::new(),
                r => format!(" [replay {}]", one_line(r, 40)),
            };
            let when = text(j, "at").to_owned();
            let line = format!("{when} {}{replay}{detail}", text(j, "outcome"));
            lines.push((when, line));
        }
        for r in received.iter().filter(mine) {
            let when = text(r, "applied_at").to_owned();
            let line = format!(
                "{when} applied (received {}, claimed in the inbox)",
                text(r, "received_at")
            );
            lines.push((when, line));
        }
        lines.sort();
        for (_, line) in lines {
            push_line(out, inner + 1, &line);
        }
    }
    for l in node["dead_letters"].as_array().into_iter().flatten() {
        push_line(
            out,
            inner,
            &format!(
                "dead letter {} ({}) at {}: {}: {} [{}]",
                one_line(text(l, "letter_id"), 40),
                text(l, "database"),
                text(l, "last_failure"),
                text(l, "reason"),
                one_line(text(l, "error"), 160),
                text(l, "state"),
            ),
        );
    }
    for e in node["caused"].as_array().into_iter().flatten() {
        push_line(
            out,
            inner,
            &format!(
                "caused event {} {} to {:?} with {:?}: {}",
                id(text(e, "message_id")),
                one_line(text(e, "event_type"), 80),
                one_line(text(e, "exchange"), 80),
                one_line(text(e, "routing_key"), 80),
                publish_state(e)
            ),
        );
        if e["trail"].is_object() {
            render(&e["trail"], inner + 1, out);
        }
    }
}

fn publish_state(row: &Value) -> String {
    let attempts = row["attempts"].as_i64().unwrap_or(0);
    if let Some(t) = row["published_at"].as_str() {
        format!("published {t}")
    } else if let Some(t) = row["failed_at"].as_str() {
        format!(
            "failed {t} after {attempts} attempts: {}",
            one_line(row["last_error"].as_str().unwrap_or(""), 160)
        )
    } else {
        format!(
            "pending since {} ({attempts} attempts)",
            row["written_at"].as_str().unwrap_or("-")
        )
    }
}
