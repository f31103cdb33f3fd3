//! The batch gate: how many transactions of several messages one consumer runs
//! at once.
//!
//! A batch locks the rows of all its messages, in the order the messages
//! came, and holds them until its one commit. Batches whose messages touch
//! the same rows (hot rows: a few stock items every order takes from) lock
//! them in different orders and deadlock, where the same messages one to a
//! transaction would only have waited their turn; and they gain nothing from
//! running side by side, since such rows let one transaction at a time
//! through. So a lock conflict between batches halves how many may run at
//! once, down to one, where batches of hot rows no longer meet; and after a
//! quiet spell without conflicts one more is let through, up to the
//! consumer's concurrency. A transaction of one message never waits here.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// How long the gate stays as it is after a conflict, or after it let one
/// more batch through, before it lets one more through again. A conflict
/// between batches costs a lock timeout (100 ms by default) and the work
/// rolled back; growing no faster than this keeps that cost a small share of
/// the time even where every extra batch conflicts.
pub(crate) const QUIET: Duration = Duration::from_secs(1);

/// The batches of one consumer that may hold a transaction at once.
#[derive(Debug)]
pub(crate) struct BatchGate {
    state: Mutex<State>,
    freed: Notify,
    max: usize,
}

#[derive(Debug)]
struct State {
    limit: usize,
    running: usize,
    /// When the limit last changed.
    changed: Instant,
}

/// A batch's place through the gate, given back when dropped.
#[derive(Debug)]
pub(crate) struct Pass<'a>(&'a BatchGate);

impl BatchGate {
    /// Lets `max` (at least 1) batches through at once to begin with.
    pub(crate) fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            state: Mutex::new(State {
                limit: max,
                running: 0,
                changed: Instant::now(),
            }),
            freed: Notify::new(),
            max,
        }
    }

    /// How many batches may run at once now.
    pub(crate) fn limit(&self) -> usize {
        self.state.lock().expect("gate lock").limit
    }

    /// Waits until fewer batches run than the limit, then holds a place.
    pub(crate) async fn enter(&self) -> Pass<'_> {
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            // Registered before the check, so a place freed in between is
            // not missed.
            freed.as_mut().enable();
            {
                let mut state = self.state.lock().expect("gate lock");
                if state.running < state.limit {
                    state.running += 1;
                    return Pass(self);
                }
            }
            freed.await;
        }
    }

    /// A batch ran into a lock conflict: halves the limit, down to one.
    pub(crate) fn conflict(&self) {
        let mut state = self.state.lock().expect("gate lock");
        state.limit = (state.limit / 2).max(1);
        state.changed = Instant::now();
    }

    /// A batch committed without a conflict: after a quiet spell, lets one
    /// more through. True if the limit grew.
    pub(crate) fn clean(&self) -> bool {
        let grew = {
            let mut state = self.state.lock().expect("gate lock");
            if state.limit < self.max && state.changed.elapsed() >= QUIET {
                state.limit += 1;
                state.changed = Instant::now();
                true
            } else {
                false
            }
        };
        if grew {
            self.freed.notify_waiters();
        }
        grew
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        self.0.state.lock().expect("gate lock").running -= 1;
        self.0.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn conflicts_narrow_the_gate_and_quiet_widens_it_one_at_a_time() {
        let gate = BatchGate::new(8);
        assert!(!gate.clean(), "never past the consumer's concurrency");
        gate.conflict();
        gate.conflict();
        gate.conflict();
        gate.conflict();
        assert_eq!(gate.limit(), 1, "never below one");
        assert!(!gate.clean(), "not before a quiet spell");
        gate.state.lock().unwrap().changed = Instant::now() - QUIET;
        assert!(gate.clean());
        assert_eq!(gate.limit(), 2);
        assert!(!gate.clean(), "one step per quiet spell");
    }

    #[tokio::test]
    async fn a_batch_waits_for_a_place_and_gets_it_when_one_is_freed() {
        let gate = BatchGate::new(1);
        let first = gate.enter().await;
        let mut second = std::pin::pin!(gate.enter());
        assert!(
            futures_util::FutureExt::now_or_never(second.as_mut()).is_none(),
            "the only place is held"
        );
        drop(first);
        tokio::time::timeout(Duration::from_secs(1), second)
            .await
            .expect("the freed place is taken");
    }
}
