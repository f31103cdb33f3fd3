//! The delivery journal's writer: outcomes with no business transaction to
//! ride on (duplicate, retried, dead-lettered...) are queued here as they are
//! finished and written in batches by a task of their own, off the delivery
//! path. Its writes never hold a delivery up: a full queue or a failed write
//! drops entries and counts them (`consumer_journal_dropped_total`).

use std::borrow::Cow;
use std::sync::OnceLock;
use std::time::Duration;

use chrono::Utc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::amqp::header_str;
use crate::broker::Delivery;
use crate::config::JournalMode;
use crate::format::Identity;
use crate::headers::HEADER_REPLAY_ID;
use crate::store::{Journal, JournalEntry};

/// Entries waiting to be written, at most.
const QUEUE: usize = 8192;

/// Entries written per transaction, at most.
const BATCH: usize = 500;

/// Rows deleted per statement by retention.
const PURGE_BATCH: u32 = 1000;

/// Where a consumer's journal entries go.
pub(crate) struct JournalSink {
    mode: JournalMode,
    retention: Option<Duration>,
    consumer: String,
    queue: OnceLock<mpsc::Sender<JournalEntry>>,
}

impl JournalSink {
    pub(crate) fn new(mode: JournalMode, retention: Option<Duration>, consumer: &str) -> Self {
        Self {
            mode,
            retention,
            consumer: consumer.to_owned(),
            queue: OnceLock::new(),
        }
    }

    /// Whether an applied outcome without a replay id gets a row (in its
    /// transaction).
    pub(crate) fn journals_applied(&self) -> bool {
        self.mode == JournalMode::Everything
    }

    /// The entry for `outcome` of `delivery`, if the mode journals it. A
    /// message whose id is not its producer's own (a CloudEvent, keyed by a
    /// hash of its `source` and `id`; a derived key) has who it is, verbatim,
    /// at the head of the detail: the journal's message id alone would not
    /// say.
    pub(crate) fn entry(
        &self,
        delivery: &Delivery,
        message_id: &str,
        identity: Option<&Identity>,
        outcome: &str,
        detail: &str,
    ) -> Option<JournalEntry> {
        let replay_id = replay_id_of(delivery);
        if replay_id.is_empty() && self.mode == JournalMode::ReplaysOnly {
            return None;
        }
        let detail = match identity {
            None | Some(Identity::Given(_)) => Cow::Borrowed(detail),
            Some(who) if detail.is_empty() => Cow::Owned(who.to_string()),
            Some(who) => Cow::Owned(format!("{who}; {detail}")),
        };
        Some(JournalEntry {
            consumer: self.consumer.clone(),
            message_id: message_id.to_owned(),
            replay_id,
            outcome: outcome.to_owned(),
            detail: crate::amqp::truncate(&detail, 2048).to_owned(),
            at: Utc::now(),
        })
    }

    /// Queues `entry` for the writer; counted as dropped if the writer is
    /// behind, or not running (a pipeline driven by the test kit).
    pub(crate) fn send(&self, entry: JournalEntry) {
        let sent = self.queue.get().is_some_and(|q| q.try_send(entry).is_ok());
        if !sent && self.queue.get().is_some() {
            metrics::counter!("consumer_journal_dropped_total", "consumer" => self.consumer.clone())
                .increment(1);
        }
    }

    /// Starts the writer on `store`, if it is not running; it writes until
    /// `stop`, then writes what is queued and ends.
    pub(crate) fn start<S: Journal>(
        &self,
        store: S,
        stop: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (tx, rx) = mpsc::channel(QUEUE);
        self.queue.set(tx).ok()?;
        let consumer = self.consumer.clone();
        if let Some(age) = self.retention {
            tokio::spawn(purge_every_hour(store.clone(), age, stop.clone()));
        }
        Some(tokio::spawn(write(store, rx, stop, consumer)))
    }
}

/// The replay id a delivery carries, signed ("" if none).
pub(crate) fn replay_id_of(delivery: &Delivery) -> String {
    delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| header_str(h, HEADER_REPLAY_ID))
        .map(|s| s.into_owned())
        .unwrap_or_default()
}

async fn write<S: Journal>(
    store: S,
    mut rx: mpsc::Receiver<JournalEntry>,
    stop: CancellationToken,
    consumer: String,
) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        let first = tokio::select! {
            () = stop.cancelled() => None,
            e = rx.recv() => e,
        };
        let Some(first) = first else { break };
        batch.push(first);
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        flush(&store, &mut batch, &consumer).await;
    }
    // Stopping: what is queued still goes, in batches.
    rx.close();
    while let Some(e) = rx.recv().await {
        batch.push(e);
        if batch.len() == BATCH {
            flush(&store, &mut batch, &consumer).await;
        }
    }
    flush(&store, &mut batch, &consumer).await;
}

/// Deletes journal rows older than `age`, in bounded batches, at start and
/// every hour until `stop`. Every consumer on the database does; the deletes
/// are idempotent.
async fn purge_every_hour<S: Journal>(store: S, age: Duration, stop: CancellationToken) {
    loop {
        if let Some(cutoff) = crate::retention::cutoff(age) {
            loop {
                match store.purge_journal(cutoff, PURGE_BATCH).await {
                    Ok(n) if n == u64::from(PURGE_BATCH) => continue,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "delivery journal retention failed; trying again in an hour");
                        break;
                    }
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(3600)) => {}
        }
    }
}

async fn flush<S: Journal>(store: &S, batch: &mut Vec<JournalEntry>, consumer: &str) {
    if batch.is_empty() {
        return;
    }
    let written = tokio::time::timeout(Duration::from_secs(10), store.write_journal(batch)).await;
    if !matches!(written, Ok(Ok(()))) {
        let why = match written {
            Ok(Err(e)) => e.to_string(),
            _ => "timed out".to_owned(),
        };
        tracing::warn!(entries = batch.len(), error = %why, "delivery journal write failed; entries dropped");
        metrics::counter!("consumer_journal_dropped_total", "consumer" => consumer.to_owned())
            .increment(batch.len() as u64);
    }
    batch.clear();
}
