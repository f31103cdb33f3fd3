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

use std::any::Any;
use std::sync::Arc;

use super::{Decided, Pipeline, Ready};
use crate::config::BatchIsolation;
use crate::disposition::{
    Applied, Disposition, Failure, decide, is_after_abort_of, is_conflict, is_outage,
};
use crate::failpoint;
use crate::failure::HandlerError;
use crate::handler::{BatchError, BatchFailure, BoundCall, Call, ErasedBatch};
use crate::store::{InboxEntry, Journal, JournalEntry, SoloRuns, Store, StoreError, Tx};
use crate::version::GatedVersion;

/// A ready delivery in a unit of work.
struct Member<DB: sqlx::Database> {
    /// Its place among the ready deliveries.
    index: usize,
    /// Bound at intake; bound again from the delivery when it runs again.
    call: Option<Call<DB>>,
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

/// A message of a batch route in a unit: its position, and the message
/// bound to the route.
type Grouped = (usize, Box<dyn Any + Send>);

/// One message's result in a unit's transaction, with what its gate saw.
type MessageResult = (Result<Applied, Failure>, Option<GatedVersion>);

/// How one unit's transaction ended. Positions are the members' places in
/// the unit.
enum Run {
    /// Committed: the result of each member, or `None` for those the time
    /// limit left to the next unit. With savepoints, a member that failed has
    /// its failure here, rolled back to its savepoint alone.
    Committed(Vec<Option<MessageResult>>),
    /// Rolled back because the member at this position failed, with what its
    /// gate saw; those before it ran well.
    FailedAt(usize, Failure, Option<GatedVersion>),
    /// Rolled back because these members failed (a batch handler named
    /// them); the others run again without them.
    Failed(Vec<(usize, Failure, Option<GatedVersion>)>),
    /// Rolled back for a reason that names no member of several (the failure
    /// of the only member of a unit of one).
    Unattributed(Failure),
    /// Rolled back for a reason that names none of the members at these
    /// positions (a batch handler's failure of its whole batch): each runs
    /// again alone, the others together.
    Isolate(Vec<usize>, Failure),
    /// Rolled back: a lock conflict with another transaction.
    Conflict(Failure),
    /// The database could not be reached, or the connection broke (during the
    /// commit, the outcome is unknown): every member goes back to its queue.
    Outage(String),
}

/// How one handler call in a unit ended, for the unit.
enum Step {
    /// The results of the members it ran, by position.
    Ran(Vec<(usize, MessageResult)>),
    /// The unit ends so, its transaction rolled back.
    RollBack(Run),
    /// The unit ends so, its transaction dropped: a panic may leave a
    /// statement half-sent, and a broken connection takes none.
    Drop(Run),
}

impl<S: Store + SoloRuns + Journal> Pipeline<S> {
    /// Applies `ready` (each bound to its call in `calls`) in as few units of
    /// work as isolation and conflicts allow, and decides each one's
    /// disposition. A `solo` run (a suspect) also forgets its solo runs in the
    /// transaction that records its outcome.
    pub(super) async fn apply(
        &self,
        ready: &[Ready],
        calls: Vec<Call<S::Db>>,
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
                    let mut rest = Vec::new();
                    for (member, result) in part.members.into_iter().zip(results) {
                        match result {
                            Some((result, gated)) => decide_one(&member, result, gated),
                            None => rest.push(member),
                        }
                    }
                    if !rest.is_empty() {
                        parts.push_front(Part::of(rest));
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
                Run::Failed(failures) => {
                    let mut failures: Vec<Option<(Failure, Option<GatedVersion>)>> = {
                        let mut by_pos: Vec<_> = part.members.iter().map(|_| None).collect();
                        for (pos, failure, gated) in failures {
                            by_pos[pos] = Some((failure, gated));
                        }
                        by_pos
                    };
                    let mut rest = Vec::new();
                    for (member, failed) in part.members.into_iter().zip(failures.iter_mut()) {
                        match failed.take() {
                            Some((failure, gated)) => decide_one(&member, Err(failure), gated),
                            None => rest.push(member),
                        }
                    }
                    if !rest.is_empty() {
                        parts.push_front(Part::of(rest));
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
                Run::Isolate(positions, failure) => {
                    if let [only] = part.members.as_slice() {
                        decide_one(only, Err(failure), None);
                        continue;
                    }
                    let (alone, together): (Vec<_>, Vec<_>) = part
                        .members
                        .into_iter()
                        .enumerate()
                        .partition(|(pos, _)| positions.contains(pos));
                    let together: Vec<_> = together.into_iter().map(|(_, m)| m).collect();
                    for (_, member) in alone.into_iter().rev() {
                        parts.push_front(Part::of(vec![member]));
                    }
                    if !together.is_empty() {
                        parts.push_front(Part::of(together));
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
        let time_limit = self
            .config
            .batch_time_limit
            .or(<S::Db as crate::store::dialect::SqlDialect>::BATCH_TIME_LIMIT);
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
        let mut results: Vec<Option<MessageResult>> = members.iter().map(|_| None).collect();
        for pos in 0..members.len() {
            if results[pos].is_some() {
                // It ran with the batch of its route.
                continue;
            }
            if !claimed[pos] {
                results[pos] = Some((Ok(Applied::Duplicate), None));
            } else {
                wrote = true;
                let this = &ready[members[pos].index];
                let step = match self.bound(this, &mut members[pos]) {
                    Ok(Call::One(call)) => {
                        self.call_one(&mut tx, ready, &indices, pos, call, savepoints)
                            .await
                    }
                    Ok(Call::Batch { route, message }) => {
                        match self.batch_of(ready, members, &claimed, pos, &route, message) {
                            Ok(group) => {
                                self.call_batch(&mut tx, ready, &indices, &route, group)
                                    .await
                            }
                            Err(step) => step,
                        }
                    }
                    // Binding is pure and succeeded at intake.
                    Err(detail) => {
                        let failure = Failure::Handler(HandlerError::permanent(detail));
                        Step::RollBack(Run::FailedAt(pos, failure, None))
                    }
                };
                match step {
                    Step::Ran(ran) => {
                        for (at, result) in ran {
                            results[at] = Some(result);
                        }
                    }
                    Step::RollBack(run) => return rolled_back(tx, run).await,
                    Step::Drop(run) => {
                        drop(tx);
                        return run;
                    }
                }
            }
            let unrun = results.iter().any(Option::is_none);
            if unrun && time_limit.is_some_and(|limit| started.elapsed() >= limit) {
                // The rest go to the next unit, their claims with them.
                for later in 0..members.len() {
                    if !claimed[later] || results[later].is_some() {
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

    /// Runs the handler of the member at `pos`, a handler of one message,
    /// in `tx` (inside a savepoint of its own with `savepoints`).
    async fn call_one(
        &self,
        tx: &mut Tx<S::Db>,
        ready: &[Ready],
        indices: &[usize],
        pos: usize,
        call: Box<dyn BoundCall<S::Db>>,
        savepoints: bool,
    ) -> Step {
        let several = indices.len() > 1;
        let this = &ready[indices[pos]];
        let handler_span = spans::handler(&this.admitted.span, &this.meta.event_type);
        let trace = spans::context_of(&handler_span, &this.admitted.trace);
        tx.set_cause(this.meta.clone(), trace);
        if savepoints && let Err(e) = tx.savepoint().await {
            return Step::RollBack(store_failed(e));
        }
        let called = AssertUnwindSafe(call.call(tx))
            .catch_unwind()
            .instrument(handler_span)
            .await;
        let gated = tx.take_gated();
        let failure = match called {
            Ok(Ok(())) if savepoints => match tx.release_savepoint().await {
                Ok(()) => None,
                Err(e) if e.is_connection_error() => {
                    return Step::Drop(Run::Outage(e.to_string()));
                }
                // The handler went on after a statement of its own failed:
                // what it wrote is not all there.
                Err(e) => Some(Failure::Aborted(e)),
            },
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(Failure::Handler(e)),
            Err(panic) => {
                // The transaction may be mid-statement; dropping it rolls it
                // back.
                self.telemetry.panic();
                let failure = Failure::Panic(panic_message(&*panic));
                return Step::Drop(Run::FailedAt(pos, failure, gated.entity));
            }
        };
        let Some(failure) = failure else {
            let result = (Ok(applied_or_stale(gated.stale)), gated.entity);
            return Step::Ran(vec![(pos, result)]);
        };
        let failure = match unit_wide(failure, several) {
            Ok(run) => return Step::RollBack(run),
            Err(failure) => failure,
        };
        let alone = savepoints
            && !copy_follows(ready, indices, pos)
            && self.undo_one(tx, &this.meta.message_id).await;
        if alone {
            Step::Ran(vec![(pos, (Err(failure), gated.entity))])
        } else {
            Step::RollBack(Run::FailedAt(pos, failure, gated.entity))
        }
    }

    /// The messages of the batch route `route` in the unit, from the one at
    /// `pos` (already bound: `first`) on: every later member with a new
    /// claim that binds to the same route, taken out of its member. Members
    /// bound to another route keep their call.
    fn batch_of(
        &self,
        ready: &[Ready],
        members: &mut [Member<S::Db>],
        claimed: &[bool],
        pos: usize,
        route: &Arc<dyn ErasedBatch<S::Db>>,
        first: Box<dyn Any + Send>,
    ) -> Result<Vec<Grouped>, Step> {
        let mut group = vec![(pos, first)];
        for later in pos + 1..members.len() {
            if !claimed[later] {
                continue;
            }
            let this = &ready[members[later].index];
            match self.bound(this, &mut members[later]) {
                Ok(Call::Batch { route: r, message })
                    if std::ptr::addr_eq(Arc::as_ptr(&r), Arc::as_ptr(route)) =>
                {
                    group.push((later, message));
                }
                Ok(other) => members[later].call = Some(other),
                Err(detail) => {
                    let failure = Failure::Handler(HandlerError::permanent(detail));
                    return Err(Step::RollBack(Run::FailedAt(later, failure, None)));
                }
            }
        }
        Ok(group)
    }

    /// Calls the batch route `route` once with `group`, its members in the
    /// unit (position and bound message), in `tx`.
    async fn call_batch(
        &self,
        tx: &mut Tx<S::Db>,
        ready: &[Ready],
        indices: &[usize],
        route: &Arc<dyn ErasedBatch<S::Db>>,
        group: Vec<Grouped>,
    ) -> Step {
        let several = indices.len() > 1;
        let positions: Vec<usize> = group.iter().map(|(pos, _)| *pos).collect();
        let member = |pos: usize| &ready[indices[pos]];
        // Each message's trace has its handler span, as with a handler of
        // one message, all covering the one call; its outbox rows continue
        // from it. The handler's own spans go under the first.
        let handler_spans: Vec<tracing::Span> = positions
            .iter()
            .map(|&pos| spans::handler(&member(pos).admitted.span, &member(pos).meta.event_type))
            .collect();
        let traces = positions
            .iter()
            .zip(&handler_spans)
            .map(|(&pos, span)| {
                let this = member(pos);
                let trace = spans::context_of(span, &this.admitted.trace);
                (this.meta.message_id.clone(), trace)
            })
            .collect();
        tx.set_batch_causes(traces);
        let messages = group.into_iter().map(|(_, message)| message).collect();
        let called = AssertUnwindSafe(route.call(messages, tx))
            .catch_unwind()
            .instrument(handler_spans[0].clone())
            .await;
        drop(handler_spans);
        let mut gated = tx.take_batch_gated();
        let mut gated_of = |pos: usize| {
            gated
                .remove(&member(pos).meta.message_id)
                .unwrap_or_default()
        };
        // A failure of the whole batch names none of its messages, unless it
        // has only one.
        let whole = |failure: Failure| match positions.as_slice() {
            [only] => Run::FailedAt(*only, failure, None),
            _ => Run::Isolate(positions.clone(), failure),
        };
        let failed = match called {
            Ok(Ok(())) => {
                let ran = positions
                    .iter()
                    .map(|&pos| {
                        let gated = gated_of(pos);
                        (pos, (Ok(applied_or_stale(gated.stale)), gated.entity))
                    })
                    .collect();
                return Step::Ran(ran);
            }
            Err(panic) => {
                self.telemetry.panic();
                return Step::Drop(whole(Failure::Panic(panic_message(&*panic))));
            }
            Ok(Err(BatchError {
                failure: BatchFailure::All(e),
            })) => {
                let run = unit_wide(Failure::Handler(e), several).unwrap_or_else(whole);
                return Step::RollBack(run);
            }
            Ok(Err(BatchError {
                failure: BatchFailure::Messages(failed),
            })) => failed,
        };
        let mut named: Vec<(usize, Failure, Option<GatedVersion>)> = Vec::new();
        for (message_id, error) in failed {
            let found = positions
                .iter()
                .copied()
                .find(|&p| member(p).meta.message_id == message_id);
            let Some(pos) = found.filter(|p| !named.iter().any(|(n, _, _)| n == p)) else {
                continue;
            };
            match unit_wide(Failure::Handler(error), several) {
                Ok(run) => return Step::RollBack(run),
                Err(failure) => named.push((pos, failure, gated_of(pos).entity)),
            }
        }
        if named.is_empty() {
            let failure = Failure::Handler(HandlerError::transient(
                "the batch handler failed only messages that are not in its batch",
            ));
            return Step::RollBack(whole(failure));
        }
        Step::RollBack(Run::Failed(named))
    }

    /// The journal rows of the unit's applied (and stale) outcomes that ride
    /// in its transaction: those of replayed copies, which careful replay
    /// waits for, and every one if the journal records everything.
    fn applied_entries(
        &self,
        ready: &[Ready],
        members: &[Member<S::Db>],
        results: &[Option<MessageResult>],
    ) -> Vec<JournalEntry> {
        results
            .iter()
            .zip(members)
            .filter_map(|(result, member)| {
                let outcome = match result.as_ref()?.0 {
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
                self.journal.entry(
                    delivery,
                    &this.meta.message_id,
                    Some(&this.meta.identity),
                    outcome,
                    "",
                )
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
    async fn commit(
        &self,
        tx: Tx<S::Db>,
        results: Vec<Option<MessageResult>>,
        several: bool,
    ) -> Run {
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
                    let applied = results
                        .iter()
                        .filter(|r| r.as_ref().is_some_and(|(r, _)| r.is_ok()))
                        .count();
                    self.telemetry.batch_committed(applied);
                }
                Run::Committed(results)
            }
            Err(e) => store_failed(e),
        }
    }

    /// The member's handler call: bound at intake the first time, bound again
    /// from the delivery when the member runs again. Binding is pure, so it
    /// succeeds again; `Err` says why if it did not.
    fn bound(&self, ready: &Ready, member: &mut Member<S::Db>) -> Result<Call<S::Db>, String> {
        if let Some(call) = member.call.take() {
            return Ok(call);
        }
        self.prepare(&ready.admitted)
            .map(|(_, call)| call)
            .map_err(|(invalid, _)| invalid.detail)
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

/// How a handler's failure ends the whole unit, if it does: an outage, a
/// lock conflict, or (in a unit of several) a statement refused because an
/// earlier one aborted the transaction, which another member may have
/// ignored.
/// `Err` gives the failure back, the member's own.
fn unit_wide(failure: Failure, several: bool) -> Result<Run, Failure> {
    if is_outage(&failure) {
        Ok(Run::Outage(failure_text(&failure)))
    } else if is_conflict(&failure) {
        Ok(Run::Conflict(failure))
    } else if several && is_after_abort_of(&failure) {
        Ok(Run::Unattributed(failure))
    } else {
        Err(failure)
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

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "handler panicked".to_owned()
    }
}
