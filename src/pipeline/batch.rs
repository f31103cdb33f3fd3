//! Batches: the deliveries the broker had already sent, applied in one database
//! transaction, each message as isolated as in a transaction of its own.
//!
//! By default ([`BatchIsolation::Replay`]) the batch runs optimistically,
//! without savepoints: every claim first (in message id order, so two batches
//! claiming overlapping ids never deadlock), then each handler in broker order,
//! then one commit and one ack. When a handler fails (an error or a panic),
//! that is the message's outcome for this attempt, decided as without batching
//! (retry tier, dead letter); the whole transaction rolls back, claims
//! included, and the others are replayed without it: the messages before it
//! together, then the rest together. No savepoint means no PostgreSQL
//! subtransaction, whose cache overflows past 64 per transaction; the price is
//! that the messages before a failing one run their handlers twice, the first
//! run rolled back.
//!
//! With [`BatchIsolation::Savepoints`] each message's claim, handler and outbox
//! rows run inside a savepoint of their own, in message id order; a failing
//! message rolls back to it and the rest go on in the same transaction. Only a
//! panic rolls everything back and replays the batch without it. Measured by
//! `billing bench` (row 6), two statements more per message cost more than the
//! replays save, even with one message in fifty failing: replay is the default.
//!
//! A failure that names no message (a deadlock on a claim, an aborted
//! transaction found at commit) replays every message alone; a broken
//! connection returns them all to their queue, where the inbox recognizes
//! whatever did commit. A batch that reaches its time limit takes back the
//! claims of the messages it has not run and commits the rest.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use futures_util::FutureExt;
use futures_util::future::join_all;

use super::{Admitted, Pipeline, Prepared, inbox_entry};
use crate::broker::{Delivery, Port};
use crate::config::BatchIsolation;
use crate::disposition::{Applied, Disposition, Failure, is_outage};
use crate::envelope::Metadata;
use crate::failpoint;
use crate::handler::BoundCall;
use crate::store::{Store, StoreError};
use crate::telemetry::Outcome;

/// A delivery of a batch, validated and routed.
struct Item<DB: sqlx::Database> {
    admitted: Admitted,
    meta: Metadata,
    /// Bound once; bound again from the delivery for each replay.
    call: Option<Box<dyn BoundCall<DB>>>,
}

/// A delivery whose disposition is decided, waiting to be settled.
struct Finished {
    admitted: Admitted,
    meta: Option<Metadata>,
    disposition: Disposition,
    gated: Option<(String, i64)>,
}

/// What is left to run of a batch.
enum Part<DB: sqlx::Database> {
    /// In one transaction.
    Together(Vec<Item<DB>>),
    /// In a transaction of its own.
    Alone(Box<Item<DB>>),
}

/// One message's result in a batch's transaction, with what its gate saw.
type MessageResult = (Result<Applied, Failure>, Option<(String, i64)>);

/// How one transaction over several messages ended.
enum Run {
    /// Committed: the outcome of each message taken, in order, from the front
    /// (fewer than were given when the time limit cut the batch). With
    /// savepoints, a message that failed has its failure here, rolled back to
    /// its savepoint alone.
    Committed(Vec<MessageResult>),
    /// Rolled back because the message at this index failed, with what its
    /// gate saw; those before it ran well.
    FailedAt(usize, Failure, Option<(String, i64)>),
    /// Rolled back for a reason that names no message.
    Unattributed,
    /// The database could not be reached, or the connection broke (during the
    /// commit, the outcome is unknown): every message goes back to its queue.
    Outage(String),
}

impl<S: Store> Pipeline<S> {
    /// Applies `deliveries` in as few transactions as isolation allows, then
    /// settles them: one ack for all that committed, where the delivery tags
    /// allow it.
    pub(super) async fn run_batch(
        &self,
        port: &dyn Port,
        deliveries: Vec<Delivery>,
    ) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(deliveries.len());
        let mut items = Vec::with_capacity(deliveries.len());
        let mut finished = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            let admitted = match self.admit(port, delivery).await {
                Ok(admitted) => admitted,
                Err(outcome) => {
                    outcomes.push(outcome);
                    continue;
                }
            };
            match self.prepare(&admitted.delivery, admitted.history.attempt()) {
                Ok(Prepared { meta, call }) => items.push(Item {
                    admitted,
                    meta,
                    call: Some(call),
                }),
                Err(invalid) => finished.push(Finished {
                    admitted,
                    meta: None,
                    disposition: Disposition::dead_letter(invalid.reason, invalid.detail, 1),
                    gated: None,
                }),
            }
        }
        if let Some(first) = items.first() {
            let first = first.meta.message_id.clone();
            let _shared = self.barrier.shared().await;
            self.watch_duration(&first, self.apply_parts(items, &mut finished))
                .await;
        }
        outcomes.extend(self.settle_finished(port, finished).await);
        outcomes
    }

    /// Runs the parts of a batch until every message has its disposition.
    async fn apply_parts(&self, items: Vec<Item<S::Db>>, finished: &mut Vec<Finished>) {
        let mut parts = VecDeque::from([Part::Together(items)]);
        while let Some(part) = parts.pop_front() {
            let mut items = match part {
                Part::Alone(item) => {
                    finished.push(self.apply_alone(*item).await);
                    continue;
                }
                Part::Together(mut items) if items.len() == 1 => {
                    parts.push_front(Part::Alone(Box::new(items.remove(0))));
                    continue;
                }
                Part::Together(items) => items,
            };
            let run = match self.config.batch_isolation() {
                BatchIsolation::Replay => self.apply_together(&mut items).await,
                BatchIsolation::Savepoints { .. } => self.apply_savepoints(&mut items).await,
            };
            match run {
                Run::Committed(results) => {
                    let rest = items.split_off(results.len());
                    if !rest.is_empty() {
                        parts.push_front(Part::Together(rest));
                    }
                    for (item, (result, gated)) in items.into_iter().zip(results) {
                        let disposition = match result {
                            Ok(applied) => Disposition::Ack(applied),
                            Err(failure) => {
                                if let Failure::Panic(_) = failure {
                                    self.telemetry.panic();
                                }
                                self.decide(Err(failure), &item.admitted.history)
                            }
                        };
                        finished.push(Finished {
                            admitted: item.admitted,
                            meta: Some(item.meta),
                            disposition,
                            gated,
                        });
                    }
                }
                Run::FailedAt(at, failure, gated) => {
                    let rest = items.split_off(at + 1);
                    let failed = items.pop().expect("the failing message is in the batch");
                    if let Failure::Panic(_) = failure {
                        self.telemetry.panic();
                    }
                    // Its outcome is decided now; the others go on without it,
                    // in broker order.
                    finished.push(Finished {
                        disposition: self.decide(Err(failure), &failed.admitted.history),
                        admitted: failed.admitted,
                        meta: Some(failed.meta),
                        gated,
                    });
                    if !rest.is_empty() {
                        parts.push_front(Part::Together(rest));
                    }
                    if !items.is_empty() {
                        parts.push_front(Part::Together(items));
                    }
                }
                Run::Unattributed => {
                    for item in items.into_iter().rev() {
                        parts.push_front(Part::Alone(Box::new(item)));
                    }
                }
                Run::Outage(error) => {
                    finished.extend(items.into_iter().map(|item| Finished {
                        admitted: item.admitted,
                        meta: Some(item.meta),
                        disposition: Disposition::Return {
                            error: error.clone(),
                        },
                        gated: None,
                    }));
                }
            }
        }
    }

    /// One message in a transaction of its own: its outcome decided exactly as
    /// without batching.
    async fn apply_alone(&self, mut item: Item<S::Db>) -> Finished {
        let mut gated = None;
        let disposition = match self.bound(&mut item) {
            Ok(call) => {
                let entry = inbox_entry(&self.config.name, &item.meta, item.admitted.received_at);
                let applied = self
                    .apply(call, &item.meta, &entry, false, &mut gated)
                    .await;
                self.decide(applied, &item.admitted.history)
            }
            Err(disposition) => disposition,
        };
        Finished {
            admitted: item.admitted,
            meta: Some(item.meta),
            disposition,
            gated,
        }
    }

    /// The transaction over several messages: claims in message id order,
    /// handlers in broker order, one commit.
    async fn apply_together(&self, items: &mut [Item<S::Db>]) -> Run {
        let started = Instant::now();
        let mut tx = match self.store.begin().await {
            Ok(tx) => tx,
            Err(e) => return store_failed(&e),
        };
        // Each message id once, in id order; of two copies, the first in
        // broker order holds the claim and the other is its duplicate.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by(|&a, &b| items[a].meta.message_id.cmp(&items[b].meta.message_id));
        order.dedup_by(|b, a| items[*a].meta.message_id == items[*b].meta.message_id);
        let entries: Vec<_> = order
            .iter()
            .map(|&i| {
                inbox_entry(
                    &self.config.name,
                    &items[i].meta,
                    items[i].admitted.received_at,
                )
            })
            .collect();
        let claimed_now = match self.store.claim_all(&mut tx, &entries).await {
            Ok(claimed) => claimed,
            Err(e) => {
                drop(entries);
                let _ = tx.rollback().await;
                return store_failed(&e);
            }
        };
        drop(entries);
        let mut claimed = vec![false; items.len()];
        for (&i, new) in order.iter().zip(claimed_now) {
            claimed[i] = new;
        }
        let mut applied = Vec::with_capacity(items.len());
        for i in 0..items.len() {
            if claimed[i] {
                let item = &mut items[i];
                let Ok(call) = self.bound(item) else {
                    // Binding is pure and succeeded at intake.
                    let _ = tx.rollback().await;
                    return Run::Unattributed;
                };
                tx.set_cause(item.meta.clone());
                let called = AssertUnwindSafe(call.call(&mut tx)).catch_unwind().await;
                let gated = tx.take_gated();
                match called {
                    Ok(Ok(())) => applied.push((Ok(applied_or_stale(gated.stale)), gated.entity)),
                    Ok(Err(e)) => {
                        let _ = tx.rollback().await;
                        let failure = Failure::Handler(e);
                        if is_outage(&failure) {
                            return Run::Outage(failure_text(&failure));
                        }
                        return Run::FailedAt(i, failure, gated.entity);
                    }
                    // The transaction may be mid-statement; dropping it rolls it
                    // back.
                    Err(panic) => {
                        drop(tx);
                        return Run::FailedAt(
                            i,
                            Failure::Panic(super::panic_message(&*panic)),
                            gated.entity,
                        );
                    }
                }
            } else {
                applied.push((Ok(Applied::Duplicate), None));
            }
            if i + 1 < items.len() && started.elapsed() >= self.config.batch_time_limit {
                // The rest go to the next transaction, their claims with them.
                let left: Vec<String> = (i + 1..items.len())
                    .filter(|&j| claimed[j])
                    .map(|j| items[j].meta.message_id.clone())
                    .collect();
                for message_id in &left {
                    if let Err(e) = self
                        .store
                        .unclaim(&mut tx, &self.config.name, message_id)
                        .await
                    {
                        let _ = tx.rollback().await;
                        return store_failed(&e);
                    }
                }
                break;
            }
        }
        self.commit_batch(tx, applied).await
    }

    /// The transaction over several messages, each inside a savepoint of its
    /// own, in message id order (so that two batches claiming overlapping ids
    /// never wait on each other in a cycle; copies of one id keep broker
    /// order): its claim, its handler and its outbox rows. A failing message
    /// rolls back to its savepoint and the others go on; only a panic, which
    /// may leave a statement half-sent, rolls the whole transaction back and
    /// replays the batch without it.
    async fn apply_savepoints(&self, items: &mut [Item<S::Db>]) -> Run {
        let started = Instant::now();
        items.sort_by(|a, b| a.meta.message_id.cmp(&b.meta.message_id));
        let mut tx = match self.store.begin().await {
            Ok(tx) => tx,
            Err(e) => return store_failed(&e),
        };
        let mut results = Vec::with_capacity(items.len());
        for i in 0..items.len() {
            let item = &mut items[i];
            let Ok(call) = self.bound(item) else {
                // Binding is pure and succeeded at intake.
                let _ = tx.rollback().await;
                return Run::Unattributed;
            };
            let entry = inbox_entry(&self.config.name, &item.meta, item.admitted.received_at);
            let claimed = match tx.savepoint().await {
                Ok(()) => self.store.claim(&mut tx, &entry).await,
                Err(e) => Err(e),
            };
            let claimed = match claimed {
                Ok(claimed) => claimed,
                Err(e) => {
                    let _ = tx.rollback().await;
                    return store_failed(&e);
                }
            };
            if !claimed {
                if let Err(e) = tx.release_savepoint().await {
                    let _ = tx.rollback().await;
                    return store_failed(&e);
                }
                results.push((Ok(Applied::Duplicate), None));
            } else {
                tx.set_cause(item.meta.clone());
                let called = AssertUnwindSafe(call.call(&mut tx)).catch_unwind().await;
                let gated = tx.take_gated();
                let failure = match called {
                    Ok(Ok(())) => match tx.release_savepoint().await {
                        Ok(()) => None,
                        Err(e) if e.is_connection_error() => {
                            return Run::Outage(e.to_string());
                        }
                        // The handler went on after a statement of its own
                        // failed: what it wrote is not all there.
                        Err(e) => Some(Failure::Aborted(e)),
                    },
                    Ok(Err(e)) => Some(Failure::Handler(e)),
                    Err(panic) => {
                        drop(tx);
                        return Run::FailedAt(
                            i,
                            Failure::Panic(super::panic_message(&*panic)),
                            gated.entity,
                        );
                    }
                };
                if let Some(failure) = failure {
                    if is_outage(&failure) {
                        let _ = tx.rollback().await;
                        return Run::Outage(failure_text(&failure));
                    }
                    if tx.rollback_to_savepoint().await.is_err() {
                        // The savepoint is gone with the transaction (MySQL
                        // ends it on a deadlock or DDL): start again without
                        // this message.
                        let _ = tx.rollback().await;
                        return Run::FailedAt(i, failure, gated.entity);
                    }
                    results.push((Err(failure), gated.entity));
                } else {
                    results.push((Ok(applied_or_stale(gated.stale)), gated.entity));
                }
            }
            if i + 1 < items.len() && started.elapsed() >= self.config.batch_time_limit {
                break;
            }
        }
        self.commit_batch(tx, results).await
    }

    /// Commits a batch's transaction; the crash points and the fault point of
    /// an unknown outcome fire here for both ways of isolating messages.
    async fn commit_batch(&self, tx: crate::store::Tx<S::Db>, results: Vec<MessageResult>) -> Run {
        let enqueued = tx.enqueued();
        failpoint::hit("before-commit");
        match tx.commit().await {
            Ok(()) if failpoint::fires_once("batch-commit-outcome-unknown") => Run::Outage(
                "the connection dropped during COMMIT; whether it committed is unknown".into(),
            ),
            Ok(()) => {
                if enqueued > 0 {
                    self.store.wakeups().wake();
                }
                failpoint::hit("after-commit-before-ack");
                failpoint::hit("after-batch-commit-before-ack");
                self.telemetry
                    .batch_committed(results.iter().filter(|(r, _)| r.is_ok()).count());
                Run::Committed(results)
            }
            Err(e) => store_failed(&e),
        }
    }

    /// The item's handler call: bound at intake the first time, bound again
    /// from the delivery for a replay. Binding is pure, so it succeeds again;
    /// `Err` carries the dead letter if it did not.
    fn bound(&self, item: &mut Item<S::Db>) -> Result<Box<dyn BoundCall<S::Db>>, Disposition> {
        if let Some(call) = item.call.take() {
            return Ok(call);
        }
        self.prepare(&item.admitted.delivery, item.admitted.history.attempt())
            .map(|p| p.call)
            .map_err(|invalid| Disposition::dead_letter(invalid.reason, invalid.detail, 1))
    }

    /// Settles what a batch decided: one ack (or as few as the tags allow) for
    /// every message whose outcome committed, then the rest side by side, so
    /// that a backoff before returning messages is waited once, not once each.
    async fn settle_finished(&self, port: &dyn Port, finished: Vec<Finished>) -> Vec<Outcome> {
        let (acked, others): (Vec<Finished>, Vec<Finished>) = finished
            .into_iter()
            .partition(|f| matches!(f.disposition, Disposition::Ack(_)));
        let tags: Vec<u64> = acked.iter().map(|f| f.admitted.delivery.tag).collect();
        if !tags.is_empty() && port.ack_all(&tags).await.is_err() {
            for f in &acked {
                self.telemetry.ack_lost(f.admitted.delivery.message_id());
            }
        }
        let mut outcomes = Vec::with_capacity(acked.len() + others.len());
        for f in &acked {
            let Disposition::Ack(applied) = f.disposition else {
                unreachable!("partitioned on Ack");
            };
            let outcome = super::settle::acked(applied);
            self.record_finished(f, outcome);
            outcomes.push(outcome);
        }
        let settled = join_all(others.iter().map(|f| {
            self.settle(
                port,
                &f.admitted.delivery,
                f.disposition.clone(),
                f.gated.as_ref(),
            )
        }))
        .await;
        for (f, outcome) in others.iter().zip(settled) {
            self.record_finished(f, outcome);
            outcomes.push(outcome);
        }
        outcomes
    }

    fn record_finished(&self, f: &Finished, outcome: Outcome) {
        self.record(
            outcome,
            &f.admitted.delivery,
            &f.admitted.history,
            f.meta.as_ref(),
            f.admitted.started,
        );
    }
}

/// What a handler that returned `Ok` applied.
fn applied_or_stale(stale: bool) -> Applied {
    if stale {
        Applied::Stale
    } else {
        Applied::Committed
    }
}

/// A failure of warren's own statements in a batch: a broken connection is an
/// outage; anything else (a deadlock, an aborted transaction) names no message.
fn store_failed(e: &StoreError) -> Run {
    if e.is_connection_error() {
        Run::Outage(e.to_string())
    } else {
        Run::Unattributed
    }
}

fn failure_text(failure: &Failure) -> String {
    match failure {
        Failure::Handler(e) => e.to_string(),
        Failure::Store(e) | Failure::Aborted(e) => e.to_string(),
        Failure::Panic(text) => text.clone(),
    }
}
