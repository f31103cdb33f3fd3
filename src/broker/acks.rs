//! Acks the broker can afford: the deliveries of a channel whose outcomes
//! committed are held for a moment and settled together, with one ack carrying
//! `multiple` wherever no delivery still open lies below them.
//!
//! On a quorum queue every settlement frame is a Raft command, so an ack per
//! batch (or per delivery) costs the broker far more than one ack per dozens of
//! deliveries. Holding acks is safe (the outcome is committed; a copy that
//! comes back is recognized by the inbox) and has three costs, each bounded:
//!
//! - **The prefetch window.** A held delivery counts against the prefetch like
//!   an open one, so the ledger releases what it can as soon as half the
//!   window's worth is held ([`AckPolicy::limit`]).
//! - **A low tag that stays open** (a suspect's solo run, a lane, a copy
//!   waiting for its confirm) blocks `multiple` for everything above it; what
//!   waits above it is acked one by one once it has been held for
//!   [`AckPolicy::max_hold`], so nothing waits for a slow neighbour longer.
//! - **A lost channel throws held acks away**: its committed deliveries come
//!   back redelivered and settle as duplicates. `max_hold` bounds how much.
//!
//! Tags belong to one channel: a ledger lives and dies with its channel, and a
//! session closing flushes it first. Every frame of a channel (ack, nack) is
//! sent by one writer in the order planned, so a nack leaves before any
//! `multiple` that would cover its tag, and no tag is settled twice.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// When held acks are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AckPolicy {
    /// Held acks below every open delivery go out once this many are held.
    pub(crate) limit: usize,
    /// Nothing is held longer than this.
    pub(crate) max_hold: Duration,
}

/// The longest an ack is held.
pub(crate) const MAX_ACK_HOLD: Duration = Duration::from_millis(5);

impl AckPolicy {
    /// For a channel with `prefetch`: release at half the window, and at most
    /// 64 (the bare drain's rhythm), after [`MAX_ACK_HOLD`] at the latest.
    pub(crate) fn for_prefetch(prefetch: u16) -> Self {
        Self {
            limit: (usize::from(prefetch) / 2).clamp(1, 64),
            max_hold: MAX_ACK_HOLD,
        }
    }
}

/// The open and held deliveries of one channel, and the acks that settle
/// them. Pure: the clock is passed in.
#[derive(Debug, Default)]
pub(crate) struct AckLedger {
    /// Delivered, outcome not yet decided or not yet sent.
    open: BTreeSet<u64>,
    /// Committed, their ack not yet sent, with when each was held.
    held: BTreeMap<u64, Instant>,
}

impl AckLedger {
    /// A delivery with `tag` arrived. Tags grow along a channel.
    pub(crate) fn delivered(&mut self, tag: u64) {
        self.open.insert(tag);
    }

    /// The outcome of `tag` is being sent on its own (a nack of that tag
    /// alone). False if it was not open (settled already, or unknown).
    pub(crate) fn done(&mut self, tag: u64) -> bool {
        self.open.remove(&tag)
    }

    /// `tags` committed: their acks are held until [`plan`](Self::plan)
    /// releases them. Tags not open (unknown, or settled already) are
    /// ignored, so no tag is acked twice.
    pub(crate) fn hold(&mut self, tags: &[u64], now: Instant) {
        for &tag in tags {
            if self.open.remove(&tag) {
                self.held.insert(tag, now);
            }
        }
    }

    /// The acks to send now, in order, as `(tag, multiple)`, and forgets
    /// them. Held tags below every open delivery go in one ack (with
    /// `multiple` when there are several) once `limit` are held, once the
    /// oldest has waited `max_hold`, once nothing else is open, or when
    /// `force`d (the channel is about to close); held tags above an open one
    /// go one by one once the oldest held has waited `max_hold`, or when
    /// `force`d.
    pub(crate) fn plan(
        &mut self,
        now: Instant,
        policy: AckPolicy,
        force: bool,
    ) -> Vec<(u64, bool)> {
        let Some(oldest) = self.held.values().min().copied() else {
            return Vec::new();
        };
        let aged = force || now.saturating_duration_since(oldest) >= policy.max_hold;
        let lowest_open = self.open.first().copied().unwrap_or(u64::MAX);
        let below: Vec<u64> = self.held.range(..lowest_open).map(|(&t, _)| t).collect();
        let mut acks = Vec::new();
        if let Some(&top) = below.last()
            && (aged || self.held.len() >= policy.limit || self.open.is_empty())
        {
            for tag in &below {
                self.held.remove(tag);
            }
            acks.push((top, below.len() > 1));
        }
        if aged {
            acks.extend(
                std::mem::take(&mut self.held)
                    .into_keys()
                    .map(|t| (t, false)),
            );
        }
        acks
    }

    /// When the oldest held ack is due, if any is held.
    pub(crate) fn due(&self, policy: AckPolicy) -> Option<Instant> {
        self.held.values().min().map(|&t| t + policy.max_hold)
    }

    /// Deliveries open or held.
    #[cfg(test)]
    fn unsettled(&self) -> usize {
        self.open.len() + self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: AckPolicy = AckPolicy {
        limit: 4,
        max_hold: Duration::from_millis(5),
    };

    fn ledger(tags: std::ops::RangeInclusive<u64>) -> AckLedger {
        let mut l = AckLedger::default();
        for tag in tags {
            l.delivered(tag);
        }
        l
    }

    #[test]
    fn held_acks_below_every_open_delivery_leave_together_at_the_limit() {
        let t0 = Instant::now();
        let mut l = ledger(1..=10);
        l.hold(&[1, 2], t0);
        assert!(l.plan(t0, POLICY, false).is_empty(), "two held, limit four");
        l.hold(&[3, 4], t0);
        assert_eq!(l.plan(t0, POLICY, false), [(4, true)]);
        assert_eq!(l.unsettled(), 6);
    }

    #[test]
    fn an_ack_never_covers_a_delivery_still_open() {
        let t0 = Instant::now();
        let mut l = ledger(1..=8);
        // 2..=7 commit while 1 is still open: nothing can go with `multiple`.
        l.hold(&[2, 3, 4, 5, 6, 7], t0);
        assert!(l.plan(t0, POLICY, false).is_empty());
        // 1 commits: 1..=7 lie below 8, the one still open.
        l.hold(&[1], t0);
        assert_eq!(l.plan(t0, POLICY, false), [(7, true)]);
    }

    #[test]
    fn what_waits_above_a_slow_delivery_goes_one_by_one_after_the_longest_hold() {
        let t0 = Instant::now();
        let mut l = ledger(1..=4);
        l.hold(&[3, 4], t0);
        let later = t0 + Duration::from_millis(4);
        assert!(l.plan(later, POLICY, false).is_empty());
        assert_eq!(l.due(POLICY), Some(t0 + POLICY.max_hold));
        let due = t0 + POLICY.max_hold;
        assert_eq!(l.plan(due, POLICY, false), [(3, false), (4, false)]);
        assert_eq!(l.due(POLICY), None);
    }

    #[test]
    fn nothing_else_open_or_closing_releases_at_once() {
        let t0 = Instant::now();
        let mut l = ledger(1..=2);
        l.hold(&[1, 2], t0);
        assert_eq!(l.plan(t0, POLICY, false), [(2, true)], "nothing else open");
        let mut l = ledger(1..=3);
        l.hold(&[1, 3], t0);
        assert_eq!(l.plan(t0, POLICY, true), [(1, false), (3, false)]);
    }

    #[test]
    fn a_tag_is_settled_once() {
        let t0 = Instant::now();
        let mut l = ledger(7..=7);
        l.hold(&[9], t0);
        assert!(l.plan(t0, POLICY, true).is_empty(), "unknown tag");
        l.hold(&[7, 7], t0);
        assert_eq!(l.plan(t0, POLICY, false), [(7, false)]);
        l.hold(&[7], t0);
        assert!(l.plan(t0, POLICY, true).is_empty(), "acked once");
        let mut l = ledger(1..=2);
        assert!(l.done(2));
        l.hold(&[2], t0);
        assert!(l.plan(t0, POLICY, true).is_empty(), "nacked, never acked");
    }
}
