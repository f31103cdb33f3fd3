//! The unit of work: the one place a transaction runs, for every path (one
//! message, a batch, a suspect's solo run, a lane's next delivery).
//!
//! A unit claims its messages in message id order (so two units claiming
//! overlapping ids never wait on each other in a cycle), runs each handler in
//! broker order under `catch_unwind`, and commits once: outbox rows, gated
//! versions, the pre-commit check and the crash points all happen here.
//!
//! What a unit of several does when something goes wrong:
//!
//! - **A handler fails** (an error or a panic): that is the message's outcome
//!   for this attempt, decided as it would be alone. By default
//!   ([`BatchIsolation::Replay`]) the whole transaction rolls back and the
//!   others run again without it: those before it together, then the rest.
//!   No savepoint means no PostgreSQL subtransaction, whose cache overflows
//!   past 64 per transaction; the price is that the messages before a failing
//!   one run their handlers twice, the first run rolled back. With
//!   [`BatchIsolation::Savepoints`] each handler runs inside a savepoint of its
//!   own, and a failing one rolls back to it and gives back its claim while
//!   the others go on in the same transaction; only a panic, which may leave a
//!   statement half-sent, rolls everything back. Measured by `billing bench`
//!   (row 6), two statements more per message cost more than the replays save,
//!   even with one message in fifty failing: replay is the default.
//! - **A lock conflict** (a deadlock, a serialization failure, a lock wait
//!   past the unit's lock timeout), from a claim, a handler or the commit: the
//!   whole transaction rolls back (MySQL's lock wait timeout undoes only the
//!   statement, and locks taken before a savepoint outlive a rollback to it)
//!   and the unit runs again at once, after a short jittered pause, costing no
//!   attempt. Which message the database chose as the victim is not knowable,
//!   so a unit of several is split in halves; a unit of one runs again up to
//!   the consumer's conflict retries, then the conflict is an ordinary
//!   transient failure. A unit of several waits for a lock no longer than the
//!   consumer's batch lock timeout, so a conflict between batches costs
//!   milliseconds, not PostgreSQL's one-second deadlock detection; a unit of
//!   one keeps the server's own timeouts. A conflict between batches halves
//!   how many run at once (the dispatcher's `BatchGate`, which every unit of
//!   several passes before it begins); one while they already run one at a
//!   time halves the consumer's batch size, which every batch that runs clean
//!   grows by one.
//! - **A failure that names no message** (an aborted transaction found at
//!   commit or by a later handler's statement, a failed claim): each message
//!   runs again in a unit of its own, where the failure is its own.
//! - **A broken connection**: every message goes back to its queue, where the
//!   inbox recognizes whatever did commit.
//! - **The time limit**: a unit that reaches it takes back the claims of the
//!   messages it has not run, commits the rest, and leaves those to the next
//!   unit.

use tracing::Instrument;

use crate::spans;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures_util::FutureExt;

use super::{Decided, Pipeline, Ready};
use crate::config::BatchIsolation;
use crate::disposition::{
    Applied, Disposition, Failure, decide, is_after_abort_of, is_conflict, is_outage,
};
use crate::failpoint;
use crate::failure::HandlerError;
use crate::handler::BoundCall;
use crate::store::{InboxEntry, Journal, JournalEntry, SoloRuns, Store, StoreError, Tx};
use crate::version::GatedVersion;

/// A ready delivery in a unit of work.
struct Member<DB: sqlx::Database> {
    /// Its place among the ready deliveries.
    index: usize,
    /// Bound at intake; bound again from the delivery when it runs again.
    call: Option<Box<dyn BoundCall<DB>>>,
}

/// Members that run in one transaction.
struct Part<DB: sqlx::Database> {
    members: Vec<Member<DB>>,
    /// Lock conflicts this part ran into as a unit of one.
    conflicts: u32,
}

impl<DB: sqlx::Database> Part<DB> {
    fn of(members: Vec<Member<DB>>) -> Self {
        Self {
            members,
            conflicts: 0,
        }
    }
}

/// One message's result in a unit's transaction, with what its gate saw.
type MessageResult = (Result<Applied, Failure>, Option<GatedVersion>);

/// How one unit's transaction ended.
enum Run {
    /// Committed: the result of each member taken, in order, from the front
    /// (fewer than were given when the time limit cut the unit). With
    /// savepoints, a member that failed has its failure here, rolled back to
    /// its savepoint alone.
    Committed(Vec<MessageResult>),
    /// Rolled back because the member at this position failed, with what its
    /// gate saw; those before it ran well.
    FailedAt(usize, Failure, Option<GatedVersion>),
    /// Rolled back for a reason that names no member of several (the failure
    /// of the only member of a unit of one).
    Unattributed(Failure),
    /// Rolled back: a lock conflict with another transaction.
    Conflict(Failure),
    /// The database could not be reached, or the connection broke (during the
    /// commit, the outcome is unknown): every member goes back to its queue.
    Outage(String),
}

impl<S: Store + SoloRuns + Journal> Pipeline<S> {
    /// Applies `ready` (each bound to its call in `calls`) in as few units of
    /// work as isolation and conflicts allow, and decides each one's
    /// disposition. A `solo` run (a suspect) also forgets its solo runs in the
    /// transaction that records its outcome.
    pub(super) async fn apply(
        &self,
        ready: &[Ready],
        calls: Vec<Box<dyn BoundCall<S::Db>>>,
        solo: bool,
    ) -> Vec<Decided> {
        let mut decided: Vec<Option<Decided>> = ready.iter().map(|_| None).collect();
        let members = calls
            .into_iter()
            .enumerate()
            .map(|(index, call)| Member {
                index,
                call: Some(call),
            })
            .collect();
        let mut parts = VecDeque::from([Part::of(members)]);
        let mut conflicted = false;
        while let Some(mut part) = parts.pop_front() {
            let mut decide_one = |member: &Member<S::Db>, result, gated| {
                let disposition = self.decide(result, &ready[member.index]);
                decided[member.index] = Some((disposition, gated));
            };
            match self.run_unit(ready, &mut part.members, solo).await {
                Run::Committed(results) => {
                    let rest = part.members.split_off(results.len());
                    if !rest.is_empty() {
                        parts.push_front(Part::of(rest));
                    }
                    for (member, (result, gated)) in part.members.iter().zip(results) {
                        decide_one(member, result, gated);
                    }
                }
                Run::FailedAt(at, failure, gated) => {
                    let rest = part.members.split_off(at + 1);
                    let failed = part
                        .members
                        .pop()
                        .expect("the failing member is in the unit");
                    decide_one(&failed, Err(failure), gated);
                    if !rest.is_empty() {
                        parts.push_front(Part::of(rest));
                    }
                    if !part.members.is_empty() {
                        parts.push_front(Part::of(part.members));
                    }
                }
                Run::Unattributed(failure) => {
                    if let [only] = part.members.as_slice() {
                        decide_one(only, Err(failure), None);
                    } else {
                        for member in part.members.into_iter().rev() {
                            parts.push_front(Part::of(vec![member]));
                        }
                    }
                }
                Run::Conflict(failure) => {
                    conflicted = true;
                    // Batches side by side make way first; only batches
                    // that conflict one at a time grow smaller.
                    if self.gate.limit() > 1 {
                        self.gate.conflict();
                        self.telemetry.batch_concurrency_now(self.gate.limit());
                    } else {
                        self.batch_size.conflict();
                        self.telemetry.batch_size_now(self.batch_size.get());
                    }
                    let pause = if part.members.len() > 1 {
                        let second = part.members.split_off(part.members.len() / 2);
                        parts.push_front(Part::of(second));
                        parts.push_front(Part::of(part.members));
                        conflict_pause(0)
                    } else if part.conflicts < self.config.conflict_retries() {
                        part.conflicts += 1;
                        let pause = conflict_pause(part.conflicts);
                        parts.push_front(part);
                        pause
                    } else {
                        decide_one(&part.members[0], Err(failure), None);
                        continue;
                    };
                    self.telemetry.conflict_retry();
                    tokio::time::sleep(pause).await;
                }
                Run::Outage(error) => {
                    for member in &part.members {
                        let error = error.clone();
                        decided[member.index] = Some((Disposition::Return { error }, None));
                    }
                }
            }
        }
        if !conflicted && !solo {
            if ready.len() > 1 && self.gate.clean() {
                self.telemetry.batch_concurrency_now(self.gate.limit());
            }
            if self.batch_size.grow() {
                self.telemetry.batch_size_now(self.batch_size.get());
            }
        }
        decided
            .into_iter()
            .map(|d| d.expect("every member of a unit is decided"))
            .collect()
    }

    /// One unit of work: claim, handle, commit, in one transaction.
    async fn run_unit(&self, ready: &[Ready], members: &mut [Member<S::Db>], solo: bool) -> Run {
        let started = Instant::now();
        let several = members.len() > 1;
        let savepoints = several
            && matches!(
                self.config.batch_isolation(),
                BatchIsolation::Savepoints { .. }
            );
        let lock_timeout = several.then(|| self.config.batch_lock_timeout());
        let _pass = match several {
            true => Some(self.gate.enter().await),
            false => None,
        };
        let mut tx = match self.store.begin_with_lock_timeout(lock_timeout).await {
            Ok(tx) => tx,
            Err(e) => return store_failed(e),
        };
        let indices: Vec<usize> = members.iter().map(|m| m.index).collect();
        let member_spans: Vec<&tracing::Span> =
            indices.iter().map(|&i| &ready[i].admitted.span).collect();
        let unit_span = spans::unit(&member_spans, solo);
        let claimed = match self
            .claim(&mut tx, ready, &indices)
            .instrument(spans::step(&unit_span, "inbox claim"))
            .await
        {
            Ok(claimed) => claimed,
            Err(e) => return rolled_back(tx, store_failed(e)).await,
        };
        if solo {
            let meta = &ready[indices[0]].meta;
            let cleared = self
                .store
                .clear_solo_runs(Some(&mut tx), &self.config.name, &meta.message_id)
                .await;
            if let Err(e) = cleared {
                return rolled_back(tx, store_failed(e)).await;
            }
        }
        let mut wrote = solo;
        let mut results = Vec::with_capacity(members.len());
        for pos in 0..members.len() {
            if claimed[pos] {
                wrote = true;
                let this = &ready[members[pos].index];
                let call = match self.bound(this, &mut members[pos]) {
                    Ok(call) => call,
                    // Binding is pure and succeeded at intake.
                    Err(detail) => {
                        let failure = Failure::Handler(HandlerError::permanent(detail));
                        return rolled_back(tx, Run::FailedAt(pos, failure, None)).await;
                    }
                };
                let handler_span = spans::handler(&this.admitted.span, &this.meta.event_type);
                let trace = spans::context_of(&handler_span, &this.admitted.trace);
                tx.set_cause(this.meta.clone(), trace);
                if savepoints && let Err(e) = tx.savepoint().await {
                    return rolled_back(tx, store_failed(e)).await;
                }
                let called = AssertUnwindSafe(call.call(&mut tx))
                    .catch_unwind()
                    .instrument(handler_span)
                    .await;
                let gated = tx.take_gated();
                let failure = match called {
                    Ok(Ok(())) if savepoints => match tx.release_savepoint().await {
                        Ok(()) => None,
                        Err(e) if e.is_connection_error() => return Run::Outage(e.to_string()),
                        // The handler went on after a statement of its own
                        // failed: what it wrote is not all there.
                        Err(e) => Some(Failure::Aborted(e)),
                    },
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(Failure::Handler(e)),
                    Err(panic) => {
                        // The transaction may be mid-statement; dropping it
                        // rolls it back.
                        drop(tx);
                        self.telemetry.panic();
                        let failure = Failure::Panic(panic_message(&*panic));
                        return Run::FailedAt(pos, failure, gated.entity);
                    }
                };
                match failure {
                    None => results.push((Ok(applied_or_stale(gated.stale)), gated.entity)),
                    Some(failure) if is_outage(&failure) => {
                        return rolled_back(tx, Run::Outage(failure_text(&failure))).await;
                    }
                    Some(failure) if is_conflict(&failure) => {
                        return rolled_back(tx, Run::Conflict(failure)).await;
                    }
                    // Another member may have ignored the statement that
                    // aborted the transaction: each runs alone to find out.
                    Some(failure) if several && is_after_abort_of(&failure) => {
                        return rolled_back(tx, Run::Unattributed(failure)).await;
                    }
                    Some(failure) => {
                        let alone = savepoints
                            && !copy_follows(ready, &indices, pos)
                            && self.undo_one(&mut tx, &this.meta.message_id).await;
                        if !alone {
                            return rolled_back(tx, Run::FailedAt(pos, failure, gated.entity))
                                .await;
                        }
                        results.push((Err(failure), gated.entity));
                    }
                }
            } else {
                results.push((Ok(Applied::Duplicate), None));
            }
            if pos + 1 < members.len() && started.elapsed() >= self.config.batch_time_limit {
                // The rest go to the next unit, their claims with them.
                for later in pos + 1..members.len() {
                    if !claimed[later] {
                        continue;
                    }
                    let message_id = &ready[indices[later]].meta.message_id;
                    if let Err(e) = self
                        .store
                        .unclaim(&mut tx, &self.config.name, message_id)
                        .await
                    {
                        return rolled_back(tx, store_failed(e)).await;
                    }
                }
                break;
            }
        }
        if !wrote {
            // Only duplicates: nothing to commit.
            let _ = tx.rollback().await;
            return Run::Committed(results);
        }
        let journaled = self.applied_entries(ready, members, &results);
        if !journaled.is_empty()
            && let Err(e) = self.store.journal_in(&mut tx, &journaled).await
        {
            return rolled_back(tx, store_failed(e)).await;
        }
        self.commit(tx, results, several)
            .instrument(spans::commit(&unit_span, &member_spans))
            .await
    }

    /// The journal rows of the unit's applied (and stale) outcomes that ride
    /// in its transaction: those of replayed copies, which careful replay
    /// waits for, and every one if the journal records everything.
    fn applied_entries(
        &self,
        ready: &[Ready],
        members: &[Member<S::Db>],
        results: &[MessageResult],
    ) -> Vec<JournalEntry> {
        results
            .iter()
            .zip(members)
            .filter_map(|((result, _), member)| {
                let outcome = match result {
                    Ok(Applied::Committed) => "applied",
                    Ok(Applied::Stale) => "stale",
                    _ => return None,
                };
                let this = &ready[member.index];
                let delivery = &this.admitted.delivery;
                if !self.journal.journals_applied()
                    && super::journal::replay_id_of(delivery).is_empty()
                {
                    return None;
                }
                self.journal
                    .entry(delivery, &this.meta.message_id, outcome, "")
            })
            .collect()
    }

    /// Claims the members' message ids in `tx`, in message id order, and says
    /// which member holds a new claim. Of two copies of one id in the unit,
    /// the first in broker order holds the claim and the other is its
    /// duplicate. The insert is the claim: a copy in flight elsewhere blocks
    /// here until that transaction ends, then finds the row.
    async fn claim(
        &self,
        tx: &mut Tx<S::Db>,
        ready: &[Ready],
        members: &[usize],
    ) -> Result<Vec<bool>, StoreError> {
        let meta = |pos: usize| &ready[members[pos]].meta;
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_by(|&a, &b| meta(a).message_id.cmp(&meta(b).message_id));
        order.dedup_by(|b, a| meta(*a).message_id == meta(*b).message_id);
        let entries: Vec<InboxEntry<'_>> = order
            .iter()
            .map(|&pos| {
                let ready = &ready[members[pos]];
                InboxEntry {
                    consumer_name: &self.config.name,
                    message_id: &ready.meta.message_id,
                    event_type: &ready.meta.event_type,
                    correlation_id: Some(&ready.meta.correlation_id),
                    received_at: ready.admitted.received_at,
                }
            })
            .collect();
        let claimed_now = self.store.claim_all(tx, &entries).await?;
        let mut claimed = vec![false; members.len()];
        for (&pos, new) in order.iter().zip(claimed_now) {
            claimed[pos] = new;
        }
        Ok(claimed)
    }

    /// Undoes, with savepoints, what the failed message wrote and its claim,
    /// leaving the rest of the unit's transaction as it was. False if that
    /// could not be done (MySQL ends the transaction, savepoint and all, on a
    /// deadlock or DDL): the whole unit then rolls back.
    async fn undo_one(&self, tx: &mut Tx<S::Db>, message_id: &str) -> bool {
        tx.rollback_to_savepoint().await.is_ok()
            && self
                .store
                .unclaim(tx, &self.config.name, message_id)
                .await
                .is_ok()
    }

    /// Commits a unit's transaction: the crash points, the relay's wake-up and
    /// the fault point of an unknown outcome are here, for every path.
    /// `several` is whether the unit began as a batch (its transaction took the
    /// batch's settings): one cut short by the batch time limit after its first
    /// message still counts as a batch, of the messages it committed.
    async fn commit(&self, tx: Tx<S::Db>, results: Vec<MessageResult>, several: bool) -> Run {
        let enqueued = tx.enqueued();
        failpoint::hit("before-commit");
        match tx.commit().await {
            Ok(()) if several && failpoint::fires_once("batch-commit-outcome-unknown") => {
                Run::Outage(
                    "the connection dropped during COMMIT; whether it committed is unknown".into(),
                )
            }
            Ok(()) => {
                if enqueued > 0 {
                    self.store.wakeups().wake();
                }
                failpoint::hit("after-commit-before-ack");
                if several {
                    failpoint::hit("after-batch-commit-before-ack");
                    self.telemetry
                        .batch_committed(results.iter().filter(|(r, _)| r.is_ok()).count());
                }
                Run::Committed(results)
            }
            Err(e) => store_failed(e),
        }
    }

    /// The member's handler call: bound at intake the first time, bound again
    /// from the delivery when the member runs again. Binding is pure, so it
    /// succeeds again; `Err` says why if it did not.
    fn bound(
        &self,
        ready: &Ready,
        member: &mut Member<S::Db>,
    ) -> Result<Box<dyn BoundCall<S::Db>>, String> {
        if let Some(call) = member.call.take() {
            return Ok(call);
        }
        self.prepare(&ready.admitted)
            .map(|(_, call)| call)
            .map_err(|invalid| invalid.detail)
    }

    /// What `result` means for `ready`, now.
    fn decide(&self, result: Result<Applied, Failure>, ready: &Ready) -> Disposition {
        decide(
            result,
            &ready.admitted.history,
            self.rules(),
            Utc::now().timestamp_millis(),
        )
    }
}

/// True if a member after `pos` is a copy of the member at `pos` (same message
/// id), which the claim counted as its duplicate: undoing `pos` alone would
/// leave that copy acked as a duplicate of nothing.
fn copy_follows(ready: &[Ready], members: &[usize], pos: usize) -> bool {
    let id = &ready[members[pos]].meta.message_id;
    members[pos + 1..]
        .iter()
        .any(|&i| &ready[i].meta.message_id == id)
}

/// Rolls `tx` back, then returns `run`.
async fn rolled_back<DB: crate::store::Dialect>(tx: Tx<DB>, run: Run) -> Run {
    let _ = tx.rollback().await;
    run
}

/// How a failure of warren's own statements ends a unit: a broken
/// connection is an outage, a lock conflict a conflict; anything else (an
/// aborted transaction found at commit, say) names no member of several.
fn store_failed(e: StoreError) -> Run {
    if e.is_connection_error() {
        Run::Outage(e.to_string())
    } else if e.is_lock_conflict() {
        Run::Conflict(Failure::Store(e))
    } else if e.is_aborted() {
        Run::Unattributed(Failure::Aborted(e))
    } else {
        Run::Unattributed(Failure::Store(e))
    }
}

/// The pause before a unit that ran into a lock conflict runs again: random,
/// so that two units that collided do not collide again in step, and longer
/// with each conflict of a unit of one (`conflicts`, 0 for a split batch):
/// up to 5 ms, 10 ms, 20 ms... capped at 200 ms.
fn conflict_pause(conflicts: u32) -> Duration {
    let ceiling_ms = (5u64 << conflicts.min(6)).min(200);
    Duration::from_micros(fastrand::u64(0..=ceiling_ms * 1000))
}

/// What a handler that returned `Ok` applied.
fn applied_or_stale(stale: bool) -> Applied {
    if stale {
        Applied::Stale
    } else {
        Applied::Committed
    }
}

fn failure_text(failure: &Failure) -> String {
    match failure {
        Failure::Handler(e) => crate::store::error_text(e.error()),
        Failure::Store(e) | Failure::Aborted(e) => e.to_string(),
        Failure::Panic(text) => text.clone(),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "handler panicked".to_owned()
    }
}
