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
//!   an open one. What can go in one frame goes once 64 are held (or half the
//!   window, if less), or after 5 ms ([`AckPolicy`]).
//! - **A low tag that stays open** (a batch still running, a suspect's solo
//!   run, a lane, a copy waiting for its confirm) blocks `multiple` for
//!   everything above it. Batches commit out of order all the time, by a few
//!   milliseconds, so what waits above a delivery waits for it, up to
//!   100 ms; only when that delivery has been open so long that it is stuck
//!   (50 ms) and half the window is held do the acks above it go one by one,
//!   so that the window keeps moving. Both bounds grow with how long the
//!   channel's deliveries take to commit (four and eight times as long, up to
//!   a second and two), so that a slow database or a busy machine, where every
//!   batch takes longer, does not make every batch look stuck.
//! - **A lost channel throws held acks away**: its committed deliveries come
//!   back redelivered and settle as duplicates without a solo run. The bounds
//!   above are how many.
//!
//! Tags belong to one channel: a ledger lives and dies with its channel, and a
//! session closing flushes it first. Every frame of a channel (ack, nack) is
//! sent by one writer in the order planned, so a nack leaves before any
//! `multiple` that would cover its tag, and no tag is settled twice.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// When held acks are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AckPolicy {
    /// Held acks below every open delivery go out in one frame once this
    /// many are held.
    pub(crate) limit: usize,
    /// Held acks above a stuck delivery go out one by one once this many are
    /// held: half the prefetch window, which held acks count against.
    pub(crate) limit_above: usize,
    /// Held acks below every open delivery go out once the oldest has
    /// waited this long.
    pub(crate) max_hold: Duration,
    /// Held acks above an open delivery go out one by one once the oldest
    /// has waited this long.
    pub(crate) max_hold_above: Duration,
    /// An open delivery is stuck once it has been open this long: longer
    /// than a batch runs.
    pub(crate) stuck_after: Duration,
}

impl AckPolicy {
    /// For a channel with `prefetch`.
    pub(crate) fn for_prefetch(prefetch: u16) -> Self {
        Self {
            limit: (usize::from(prefetch) / 2).clamp(1, 64),
            limit_above: (usize::from(prefetch) / 2).max(1),
            max_hold: Duration::from_millis(5),
            max_hold_above: Duration::from_millis(100),
            stuck_after: Duration::from_millis(50),
        }
    }
}

/// The open and held deliveries of one channel, and the acks that settle
/// them. Pure: the clock is passed in.
#[derive(Debug, Default)]
pub(crate) struct AckLedger {
    /// Delivered, outcome not yet decided or not yet sent, with when each
    /// was taken in.
    open: BTreeMap<u64, Instant>,
    /// Committed, their ack not yet sent, with when each was held.
    held: BTreeMap<u64, Instant>,
    /// How long a delivery typically stays open before it commits: a moving
    /// average over the channel's commits, each capped at [`TYPICAL_CAP`].
    typical: Option<Duration>,
}

/// The most one commit adds to the typical open time: a suspect's solo run
/// (up to a minute) is what "stuck" is for, and must not become the norm.
const TYPICAL_CAP: Duration = Duration::from_millis(250);

impl AckLedger {
    /// A delivery with `tag` was taken in at `now`. Tags grow along a
    /// channel.
    pub(crate) fn delivered(&mut self, tag: u64, now: Instant) {
        self.open.insert(tag, now);
    }

    /// The outcome of `tag` is being sent on its own (a nack of that tag
    /// alone). False if it was not open (settled already, or unknown).
    pub(crate) fn done(&mut self, tag: u64) -> bool {
        self.open.remove(&tag).is_some()
    }

    /// `tags` committed: their acks are held until [`plan`](Self::plan)
    /// releases them. Tags not open (unknown, or settled already) are
    /// ignored, so no tag is acked twice.
    pub(crate) fn hold(&mut self, tags: &[u64], now: Instant) {
        let mut taken_in = None;
        for &tag in tags {
            if let Some(at) = self.open.remove(&tag) {
                self.held.insert(tag, now);
                taken_in = Some(taken_in.map_or(at, |t: Instant| t.min(at)));
            }
        }
        if let Some(at) = taken_in {
            // The oldest of them: how long this commit kept its deliveries open.
            let open = now.saturating_duration_since(at).min(TYPICAL_CAP);
            self.typical = Some(self.typical.map_or(open, |t| (t * 7 + open) / 8));
        }
    }

    /// When the lowest open delivery counts as stuck, and how long acks wait
    /// above it: the policy's bounds, or four and eight times the typical
    /// open time where that is longer.
    fn above_bounds(&self, policy: AckPolicy) -> (Duration, Duration) {
        let typical = self.typical.unwrap_or_default();
        (
            policy.stuck_after.max(typical * 4),
            policy.max_hold_above.max(typical * 8),
        )
    }

    /// The acks to send now, in order, as `(tag, multiple)`, and forgets
    /// them. Held tags below every open delivery go in one ack (with
    /// `multiple` when there are several) once `limit` are held, once the
    /// oldest has waited `max_hold`, once nothing else is open, or when
    /// `force`d (the channel is about to close). Held tags above an open one
    /// go one by one once the oldest of them has waited `max_hold_above`,
    /// once `limit_above` are held while the lowest open delivery is stuck,
    /// or when `force`d.
    pub(crate) fn plan(
        &mut self,
        now: Instant,
        policy: AckPolicy,
        force: bool,
    ) -> Vec<(u64, bool)> {
        if self.held.is_empty() {
            return Vec::new();
        }
        let since = |at: Instant| now.saturating_duration_since(at);
        let lowest_open = self.open.first_key_value().map(|(&t, &at)| (t, at));
        let boundary = lowest_open.map_or(u64::MAX, |(t, _)| t);
        let oldest = |range: std::collections::btree_map::Range<'_, u64, Instant>| {
            range.map(|(_, &at)| at).min()
        };
        let below: Vec<u64> = self.held.range(..boundary).map(|(&t, _)| t).collect();
        let below_due = force
            || self.held.len() >= policy.limit
            || self.open.is_empty()
            || oldest(self.held.range(..boundary)).is_some_and(|at| since(at) >= policy.max_hold);
        let mut acks = Vec::new();
        if let Some(&top) = below.last()
            && below_due
        {
            for tag in &below {
                self.held.remove(tag);
            }
            acks.push((top, below.len() > 1));
        }
        let (stuck_after, max_hold_above) = self.above_bounds(policy);
        let stuck = lowest_open.is_some_and(|(_, at)| since(at) >= stuck_after);
        let above_due = force
            || stuck && self.held.len() >= policy.limit_above
            || oldest(self.held.range(boundary..)).is_some_and(|at| since(at) >= max_hold_above);
        if above_due {
            acks.extend(
                std::mem::take(&mut self.held)
                    .into_keys()
                    .map(|t| (t, false)),
            );
        }
        acks
    }

    /// When the next held ack is due, if any is held: by its age, or, with
    /// half the window held, when the lowest open delivery becomes stuck.
    pub(crate) fn due(&self, policy: AckPolicy) -> Option<Instant> {
        let (stuck_after, max_hold_above) = self.above_bounds(policy);
        let lowest_open = self.open.first_key_value();
        let boundary = lowest_open.map_or(u64::MAX, |(&t, _)| t);
        let below = self
            .held
            .range(..boundary)
            .map(|(_, &t)| t + policy.max_hold);
        let above = self
            .held
            .range(boundary..)
            .map(|(_, &t)| t + max_hold_above);
        let stuck = lowest_open
            .filter(|_| self.held.len() >= policy.limit_above)
            .map(|(_, &at)| at + stuck_after);
        below.chain(above).chain(stuck).min()
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
        limit_above: 6,
        max_hold: Duration::from_millis(5),
        max_hold_above: Duration::from_millis(100),
        stuck_after: Duration::from_millis(50),
    };

    /// A ledger whose `tags` were all taken in at `t0`.
    fn ledger_at(tags: std::ops::RangeInclusive<u64>, t0: Instant) -> AckLedger {
        let mut l = AckLedger::default();
        for tag in tags {
            l.delivered(tag, t0);
        }
        l
    }

    fn ledger(tags: std::ops::RangeInclusive<u64>) -> AckLedger {
        ledger_at(tags, Instant::now())
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
        // 2 and 3 commit while 1 is still open: nothing can go with `multiple`.
        l.hold(&[2, 3], t0);
        assert!(l.plan(t0 + POLICY.max_hold, POLICY, false).is_empty());
        // 1 commits: 1..=3 lie below 4, the lowest still open.
        l.hold(&[1], t0);
        assert_eq!(l.plan(t0 + POLICY.max_hold, POLICY, false), [(3, true)]);
    }

    #[test]
    fn what_waits_above_a_slow_delivery_goes_one_by_one_after_the_longer_hold() {
        let t0 = Instant::now();
        let mut l = ledger(1..=4);
        l.hold(&[3], t0);
        assert_eq!(l.due(POLICY), Some(t0 + POLICY.max_hold_above));
        let later = t0 + POLICY.max_hold_above - Duration::from_millis(1);
        assert!(l.plan(later, POLICY, false).is_empty(), "1 may commit yet");
        let due = t0 + POLICY.max_hold_above;
        assert_eq!(l.plan(due, POLICY, false), [(3, false)]);
        assert_eq!(l.due(POLICY), None);
    }

    #[test]
    fn half_the_window_held_above_a_stuck_delivery_goes_at_once() {
        let t0 = Instant::now();
        let now = t0 + POLICY.stuck_after;
        // 1 was taken in long ago; the rest came and committed at once.
        let mut l = ledger_at(1..=1, t0);
        for tag in 2..=8 {
            l.delivered(tag, now);
        }
        l.hold(&[2, 3, 4, 5, 6], now);
        assert!(
            l.plan(now, POLICY, false).is_empty(),
            "under half the window"
        );
        l.hold(&[7], now);
        assert_eq!(l.due(POLICY), Some(t0 + POLICY.stuck_after));
        assert_eq!(
            l.plan(now, POLICY, false),
            [
                (2, false),
                (3, false),
                (4, false),
                (5, false),
                (6, false),
                (7, false)
            ],
            "held acks count against the window: past half of it, above a stuck \
             delivery, they go"
        );
    }

    #[test]
    fn above_a_batch_still_running_acks_wait_for_it() {
        let t0 = Instant::now();
        let mut l = ledger_at(1..=10, t0);
        // 1 is a batch that started a moment ago: not stuck.
        let now = t0 + POLICY.stuck_after - Duration::from_millis(1);
        l.hold(&[2, 3, 4, 5, 6, 7, 8], now);
        assert!(l.plan(now, POLICY, false).is_empty(), "1 commits soon");
        l.hold(&[1], now);
        assert_eq!(l.plan(now, POLICY, false), [(8, true)], "one frame for all");
    }

    #[test]
    fn below_every_open_delivery_an_ack_waits_the_short_hold() {
        let t0 = Instant::now();
        let mut l = ledger(1..=4);
        l.hold(&[1, 2], t0);
        assert_eq!(l.due(POLICY), Some(t0 + POLICY.max_hold));
        assert!(
            l.plan(t0 + Duration::from_millis(4), POLICY, false)
                .is_empty()
        );
        assert_eq!(l.plan(t0 + POLICY.max_hold, POLICY, false), [(2, true)]);
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
    fn where_every_commit_is_slow_a_delivery_is_stuck_later() {
        let t0 = Instant::now();
        let mut l = AckLedger::default();
        // Batches of a slow database: each open 60 ms before it commits.
        let mut tag = 0;
        for batch in 0..32u32 {
            let start = t0 + Duration::from_millis(60) * batch;
            for _ in 0..4 {
                tag += 1;
                l.delivered(tag, start);
            }
            l.hold(
                &[tag - 3, tag - 2, tag - 1, tag],
                start + Duration::from_millis(60),
            );
            l.plan(start + Duration::from_millis(60), POLICY, true);
        }
        let (stuck_after, max_hold_above) = l.above_bounds(POLICY);
        assert!(
            stuck_after > Duration::from_millis(200) && stuck_after <= Duration::from_millis(240),
            "four times a typical commit's 60 ms: {stuck_after:?}"
        );
        assert_eq!(max_hold_above, stuck_after * 2);
        // A batch open 100 ms there is not stuck, and what waits above it
        // waits for it.
        let now = t0 + Duration::from_secs(10);
        for t in tag + 1..=tag + 8 {
            l.delivered(t, now);
        }
        l.hold(&((tag + 2)..=(tag + 8)).collect::<Vec<_>>(), now);
        let later = now + Duration::from_millis(100);
        assert!(l.plan(later, POLICY, false).is_empty(), "not stuck yet");
        l.hold(&[tag + 1], later);
        assert_eq!(l.plan(later, POLICY, false), [(tag + 8, true)]);
    }

    #[test]
    fn a_solo_run_of_a_minute_does_not_become_the_norm() {
        let t0 = Instant::now();
        let mut l = ledger_at(1..=1, t0);
        l.hold(&[1], t0 + Duration::from_secs(60));
        let (stuck_after, max_hold_above) = l.above_bounds(POLICY);
        assert_eq!(stuck_after, TYPICAL_CAP * 4);
        assert_eq!(max_hold_above, TYPICAL_CAP * 8);
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
