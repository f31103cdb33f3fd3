//! The outbox relay: publishes committed outbox rows with publisher confirms and
//! `mandatory`, and marks each row only after the broker confirmed it.
//!
//! A relay killed between the confirm and the mark publishes the row again with
//! the same message id: at-least-once, which downstream inboxes turn into
//! effectively-once. A row the broker cannot route is marked failed and counted,
//! never dropped.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::barrier::SoloBarrier;
use crate::broker::{self, BatchItem, Publisher};
use crate::error::Error;
use crate::failpoint;
use crate::outbox_row::{OutboxRow, RowOutcome};
use crate::relay_config::RelayConfig;
use crate::shutdown::cancel_on;
use crate::store::{OutboxStore, StoreError};

/// Upper bound of the reconnect backoff.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How often the backlog gauges are refreshed.
const BACKLOG_REPORT_INTERVAL: Duration = Duration::from_secs(5);
/// The shortest wait between polls, right after a pass that found rows, on a
/// database without notifications.
const MIN_POLL: Duration = Duration::from_millis(50);
/// How long closing the relay's connection may take.
const CLOSE_WAIT: Duration = Duration::from_secs(5);
/// How long a stopping relay keeps publishing what is already committed.
const FINAL_PASS: Duration = Duration::from_secs(5);

/// A snapshot of a relay's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Rows published and marked.
    pub published: u64,
    /// Rows marked failed (unroutable or unreadable).
    pub failed: u64,
    /// Publish attempts left pending for the next pass (broker trouble).
    pub retried: u64,
}

/// A live view of a relay's counters; cheap to clone.
#[derive(Debug, Clone)]
pub struct RelayStatsHandle(Arc<Counters>);

impl RelayStatsHandle {
    /// The counters now.
    pub fn snapshot(&self) -> RelayStats {
        let c = &self.0;
        RelayStats {
            published: c.published.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    failed: AtomicU64,
    retried: AtomicU64,
}

/// Publishes committed outbox rows of a store.
pub struct Relay<S: OutboxStore> {
    store: S,
    config: RelayConfig,
    counters: Arc<Counters>,
    /// The solo barrier its batches hold shared: the process's, or the one of
    /// the consumer it runs beside.
    barrier: SoloBarrier,
}

impl<S: OutboxStore> Relay<S> {
    /// A relay for `store`.
    pub fn new(store: S, config: RelayConfig) -> Self {
        Self {
            store,
            config,
            counters: Arc::default(),
            barrier: SoloBarrier::process(),
        }
    }

    /// This relay, its batches waiting behind `barrier`'s suspects.
    pub(crate) fn waiting_on(mut self, barrier: &SoloBarrier) -> Self {
        self.barrier = barrier.clone();
        self
    }

    /// This relay, counting into `handle`'s counters: a restarted relay carries
    /// on the counts of the one it replaces.
    pub(crate) fn sharing(mut self, handle: &RelayStatsHandle) -> Self {
        self.counters = Arc::clone(&handle.0);
        self
    }

    /// The counters now.
    pub fn stats(&self) -> RelayStats {
        self.stats_handle().snapshot()
    }

    /// A live view of the counters that outlives [`run`](Self::run).
    pub fn stats_handle(&self) -> RelayStatsHandle {
        RelayStatsHandle(Arc::clone(&self.counters))
    }

    /// Publishes one batch with `publisher` and records each row's outcome.
    /// Returns the rows taken and whether the broker had trouble (some rows stay
    /// pending for the next pass).
    ///
    /// The future is boxed so it is plainly `Send`: spawning an unboxed one trips
    /// the compiler's higher-ranked `Send` inference on the batch closure.
    pub fn run_once<'a>(
        &'a self,
        publisher: &'a Publisher,
    ) -> futures_util::future::BoxFuture<'a, Result<(usize, bool), StoreError>> {
        Box::pin(self.run_once_inner(publisher))
    }

    async fn run_once_inner(&self, publisher: &Publisher) -> Result<(usize, bool), StoreError> {
        // A batch is work of this process like a handler's: while a suspect
        // runs alone, the relay waits, so that a death of the relay's cannot
        // count against the suspect.
        let _shared = self.barrier.shared().await;
        let mut tally = RelayStats::default();
        let tally_ref = &mut tally;
        let mut handed = 0;
        let handed_ref = &mut handed;
        let taken = self
            .store
            .relay_batch(self.config.batch_size, move |rows| async move {
                *handed_ref = rows.len();
                let outcomes = publish_rows(publisher, rows, self.config.batch_deadline).await;
                for (_, outcome) in &outcomes {
                    match outcome {
                        RowOutcome::Published => tally_ref.published += 1,
                        RowOutcome::Failed(_) => tally_ref.failed += 1,
                        RowOutcome::Retry(_) => tally_ref.retried += 1,
                    }
                }
                outcomes
            })
            .await?;
        // Rows taken but never handed over had stored properties this
        // warren cannot read (a format a later version wrote, say): the
        // store marked them failed, and they count as failed like any other.
        tally.failed += u64::try_from(taken.saturating_sub(handed)).unwrap_or(u64::MAX);
        // Counted only now that the outcomes are recorded.
        let c = &self.counters;
        c.published.fetch_add(tally.published, Ordering::Relaxed);
        c.failed.fetch_add(tally.failed, Ordering::Relaxed);
        c.retried.fetch_add(tally.retried, Ordering::Relaxed);
        let labels = [("consumer", self.config.name.clone())];
        metrics::counter!("outbox_published_total", &labels).increment(tally.published);
        metrics::counter!("outbox_failed_total", &labels).increment(tally.failed);
        Ok((taken, tally.retried > 0))
    }

    /// Publishes until `shutdown` resolves, then makes a last pass over what is
    /// already committed. Reconnects to the broker with capped backoff; rows stay
    /// pending while it is away.
    pub async fn run<F>(self, amqp_url: &str, shutdown: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        self.config.validate()?;
        failpoint::check_env()?;
        let stop = CancellationToken::new();
        cancel_on(shutdown, &stop, self.publish_until(amqp_url, &stop)).await
    }

    /// The relay's loop: publishes until `stop` is cancelled, then makes the
    /// last pass.
    async fn publish_until(self, amqp_url: &str, stop: &CancellationToken) -> Result<(), Error> {
        let mut wakeups = self.store.wakeups().subscribe();
        let mut listener = self.store.listen().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot listen for outbox notifications; polling only");
            None
        });
        let mut publisher: Option<(Arc<lapin::Connection>, Publisher)> = None;
        let mut backoff = Backoff::new(Duration::from_millis(100), MAX_BACKOFF);
        let mut last_housekeeping = Instant::now();
        let mut last_backlog_report: Option<Instant> = None;
        let mut stopping = None::<Instant>;
        // Without notifications from other processes, the relay polls: soon
        // after a pass that found rows (more are likely on the way), backing off
        // to `poll_interval` while the outbox stays empty.
        let mut poll_wait = self.config.poll_interval;
        loop {
            if publisher.is_none() {
                match broker::connect_with_tls(
                    amqp_url,
                    &format!("warren relay {}", self.config.name),
                    &self.config.tls,
                )
                .await
                {
                    Ok(c) => {
                        let c = Arc::new(c);
                        publisher = Some((Arc::clone(&c), Publisher::new(c)));
                    }
                    // Retrying cannot mend a certificate; rows stay pending.
                    Err(e) if e.is_tls() => return Err(e.into()),
                    Err(e) => {
                        let wait = backoff.next_delay();
                        tracing::warn!(error = %e, retry_in = ?wait, "relay cannot reach the broker");
                        if !pause(stop, &mut stopping, wait).await {
                            break;
                        }
                        continue;
                    }
                }
            }
            let (_, pub_) = publisher.as_ref().expect("connected above");
            let pass = self.run_once(pub_).await;
            let (taken, trouble) = match pass {
                Ok(r) => r,
                Err(e) => {
                    // The database, not the broker: keep the connection and wait.
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "relay cannot read the outbox");
                    if !pause(stop, &mut stopping, wait).await {
                        break;
                    }
                    continue;
                }
            };
            if trouble {
                // Rows stay pending; start over on a fresh connection after a pause.
                if let Some((c, _)) = publisher.take() {
                    broker::close_connection_within(&c, "reconnecting", CLOSE_WAIT).await;
                }
                if !pause(stop, &mut stopping, backoff.next_delay()).await {
                    break;
                }
                continue;
            }
            // Only a pass that went through proves the broker is back; resetting on
            // connect alone would reconnect hot when every pass fails.
            backoff.reset();
            if last_housekeeping.elapsed() >= self.config.housekeeping_interval {
                last_housekeeping = Instant::now();
                self.housekeeping().await;
            }
            if let Some(since) = stopping {
                if taken < self.config.batch_size || since.elapsed() > FINAL_PASS {
                    break;
                }
                continue;
            }
            if taken == self.config.batch_size {
                continue; // more may be waiting
            }
            // The backlog query counts the table; at most every few seconds.
            if last_backlog_report.is_none_or(|t| t.elapsed() >= BACKLOG_REPORT_INTERVAL) {
                last_backlog_report = Some(Instant::now());
                self.report_backlog().await;
            }
            poll_wait = if listener.is_some() {
                self.config.poll_interval
            } else if taken > 0 {
                MIN_POLL.min(self.config.poll_interval)
            } else {
                (poll_wait * 2).min(self.config.poll_interval)
            };
            tokio::select! {
                () = stop.cancelled() => stopping = Some(Instant::now()),
                _ = wakeups.changed() => {}
                () = wait_for_notification(&mut listener) => {}
                () = tokio::time::sleep(poll_wait) => {}
            }
        }
        if let Some((c, _)) = publisher {
            broker::close_connection_within(&c, "relay stopped", CLOSE_WAIT).await;
        }
        tracing::info!(relay = %self.config.name, "relay stopped");
        Ok(())
    }

    /// Deletes published rows older than the retention, in batches of
    /// [`PURGE_BATCH`](crate::admin::PURGE_BATCH) so no single statement holds
    /// locks for long. Returns how many were deleted.
    pub async fn delete_expired(&self) -> Result<u64, StoreError> {
        let cutoff = crate::retention::cutoff(self.config.retention).ok_or_else(|| {
            StoreError::Config(crate::retention::window_too_long(
                "relay retention",
                self.config.retention,
            ))
        })?;
        let mut deleted = 0;
        loop {
            let n = self
                .store
                .delete_published_before(cutoff, crate::retention::PURGE_BATCH)
                .await?;
            deleted += n;
            if n < u64::from(crate::retention::PURGE_BATCH) {
                return Ok(deleted);
            }
        }
    }

    async fn housekeeping(&self) {
        match self.delete_expired().await {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "deleted published outbox rows past retention"),
            Err(e) => tracing::warn!(error = %e, "outbox housekeeping failed"),
        }
    }

    /// Updates the backlog gauges.
    async fn report_backlog(&self) {
        let labels = [("consumer", self.config.name.clone())];
        // Through the index of pending rows: a count of the whole table, every
        // published row kept for the retention included, held the relay (and
        // every row committed meanwhile) for a tenth of a second at 300 000.
        match self.store.outbox_backlog().await {
            Ok((pending, oldest_pending)) => {
                let status = crate::store::OutboxCounts {
                    pending,
                    oldest_pending,
                    ..Default::default()
                };
                metrics::gauge!("outbox_pending_messages", &labels).set(pending as f64);
                metrics::gauge!("outbox_oldest_unpublished_age_seconds", &labels)
                    .set(status.oldest_pending_age_seconds(Utc::now()));
            }
            // Stale gauges would say all is well; say why they are stale instead.
            Err(e) => {
                tracing::warn!(relay = %self.config.name, error = %e, "cannot read the outbox backlog");
                metrics::counter!("outbox_backlog_errors_total", &labels).increment(1);
            }
        }
    }
}

/// Waits `wait`, or until shutdown is asked for (which starts the final pass).
/// `false` if the relay is already stopping and should not wait at all.
async fn pause(stop: &CancellationToken, stopping: &mut Option<Instant>, wait: Duration) -> bool {
    if stopping.is_some() {
        return false;
    }
    tokio::select! {
        () = stop.cancelled() => *stopping = Some(Instant::now()),
        () = tokio::time::sleep(wait) => {}
    }
    true
}

async fn wait_for_notification(listener: &mut Option<crate::store::OutboxListener>) {
    match listener {
        Some(l) => l.recv().await,
        None => std::future::pending().await,
    }
}

/// Publishes `rows` as one pipelined batch and maps each confirm to an outcome.
/// The whole batch, fallback included, has one deadline: rows still unconfirmed
/// when it passes stay pending, and the row locks are released.
async fn publish_rows(
    publisher: &Publisher,
    rows: Vec<OutboxRow>,
    deadline: Duration,
) -> Vec<(i64, RowOutcome)> {
    match tokio::time::timeout(deadline, publish_rows_inner(publisher, &rows)).await {
        Ok(outcomes) => outcomes,
        Err(_) => {
            tracing::warn!(
                rows = rows.len(),
                ?deadline,
                "the broker did not confirm the outbox batch in time; the rows stay pending"
            );
            let reason = format!("no confirm within the batch deadline of {deadline:?}");
            rows.iter()
                .map(|r| (r.id, RowOutcome::Retry(reason.clone())))
                .collect()
        }
    }
}

async fn publish_rows_inner(publisher: &Publisher, rows: &[OutboxRow]) -> Vec<(i64, RowOutcome)> {
    // A row whose stored properties cannot be expressed in AMQP is failed here,
    // alone; the others go out.
    let mut outcomes: Vec<Option<RowOutcome>> = Vec::with_capacity(rows.len());
    let mut items: Vec<BatchItem<'_>> = Vec::with_capacity(rows.len());
    let mut item_rows = Vec::with_capacity(rows.len());
    // Each published row's spans (with the `otel` feature), ended with its
    // outcome: what the next consumer continues is the publish span's context.
    let mut row_spans = Vec::with_capacity(rows.len());
    // A row to an exchange that does not exist is failed before anything is
    // published: sent along, it would close the channel the others ride on.
    let mut missing = std::collections::HashSet::new();
    let mut exchanges: Vec<&str> = rows.iter().map(|r| r.exchange.as_str()).collect();
    exchanges.sort_unstable();
    exchanges.dedup();
    for exchange in exchanges {
        if !publisher.exchange_exists(exchange).await {
            missing.insert(exchange);
        }
    }
    for (i, r) in rows.iter().enumerate() {
        if missing.contains(r.exchange.as_str()) {
            tracing::error!(
                row_id = r.id,
                message_id = %r.message_id,
                exchange = %r.exchange,
                "outbox message cannot be published; marked failed"
            );
            outcomes.push(Some(RowOutcome::Failed(format!(
                "NOT_FOUND: no exchange {:?}",
                r.exchange
            ))));
            continue;
        }
        let (spans, send) = RowSpans::start(&r.trace, r.written_at, &r.exchange, &r.message_id);
        match r.to_amqp(&send, Utc::now()) {
            Ok(properties) => {
                outcomes.push(None);
                item_rows.push(i);
                row_spans.push(spans);
                items.push(BatchItem {
                    exchange: &r.exchange,
                    routing_key: &r.routing_key,
                    body: &r.body,
                    properties,
                });
            }
            Err(e) => {
                spans.end(Some("cannot be published"));
                tracing::error!(
                    row_id = r.id,
                    error = %e,
                    "outbox row cannot be published; marked failed"
                );
                outcomes.push(Some(RowOutcome::Failed(format!(
                    "cannot be published: {e}"
                ))));
            }
        }
    }
    let mut results = publisher.publish_batch(&items).await;
    let channel_failed = results
        .iter()
        .any(|r| matches!(r, Err(e) if !e.is_unroutable() && !e.is_invalid()));
    if channel_failed && items.len() > 1 {
        // One bad row (an exchange that does not exist makes the broker close the
        // channel) fails every row pipelined with it. Publishing the batch again
        // one row at a time finds the culprit, so it alone is set aside and the
        // rest go out instead of stalling behind it.
        results = Vec::with_capacity(items.len());
        // The batch's channel was closed by the bad row: start on a fresh one.
        publisher.discard_channel().await;
        for item in &items {
            let publish = || {
                publisher.publish_raw(
                    item.exchange,
                    item.routing_key,
                    item.body,
                    item.properties.clone(),
                )
            };
            let mut result = publish().await;
            if result.is_err() {
                // A refused publish closes the channel; the next row gets a
                // fresh one rather than racing the close.
                publisher.discard_channel().await;
            }
            if matches!(&result, Err(e) if !e.is_unroutable() && !e.is_not_found() && !e.is_invalid())
            {
                // This row may have failed only because the channel was still
                // closing from the row before; once more, on a fresh channel,
                // gives it its own answer.
                result = publish().await;
                if result.is_err() {
                    publisher.discard_channel().await;
                }
            }
            results.push(result);
        }
    }
    failpoint::hit("relay-after-publish-before-mark");
    for ((i, result), spans) in item_rows.into_iter().zip(results).zip(row_spans) {
        let row = &rows[i];
        spans.end(result.as_ref().err().map(|e| e.to_string()).as_deref());
        outcomes[i] = Some(match result {
            Ok(()) => RowOutcome::Published,
            Err(e) if e.is_unroutable() || e.is_not_found() || e.is_invalid() => {
                tracing::error!(
                    row_id = row.id,
                    message_id = %row.message_id,
                    error = %e,
                    "outbox message cannot be published; marked failed"
                );
                RowOutcome::Failed(e.to_string())
            }
            Err(e) => RowOutcome::Retry(e.to_string()),
        });
    }
    rows.iter()
        .zip(outcomes)
        .map(|(row, outcome)| {
            (
                row.id,
                outcome.unwrap_or_else(|| RowOutcome::Retry("not published".into())),
            )
        })
        .collect()
}

#[cfg(feature = "otel")]
use crate::otel::RowSpans;

/// Without the `otel` feature a row has no spans, and goes out with the
/// context stored with it.
#[cfg(not(feature = "otel"))]
struct RowSpans;

#[cfg(not(feature = "otel"))]
impl RowSpans {
    fn start(
        stored: &crate::trace_context::TraceContext,
        _written_at: Option<chrono::DateTime<Utc>>,
        _exchange: &str,
        _message_id: &str,
    ) -> (Self, crate::trace_context::TraceContext) {
        (Self, stored.clone())
    }

    fn end(self, _error: Option<&str>) {}
}
