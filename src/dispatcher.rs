//! Which buffered deliveries run next, and which of them an ack may cover.
//!
//! The dispatcher is the one owner of scheduling. It takes deliveries in the
//! order the broker sent them and hands out batches; the policies that later
//! work fills in live here: the solo barrier for suspects (a redelivery runs
//! alone, see [`barrier`]), lanes by key (one entity's messages in order), and
//! the batch former (several messages in one transaction). Today: a suspect is
//! a batch of its own that runs alone; other batches hold one delivery.
//!
//! The [`AckWatermark`] says how far an ack with `multiple` may reach: never past
//! a delivery that is still held, retrying or waiting.

use std::collections::{BTreeSet, VecDeque};

use crate::broker::Delivery;

pub(crate) mod barrier;
pub(crate) use barrier::SoloBarrier;

/// Deliveries that run together.
#[derive(Debug)]
pub(crate) struct Batch {
    /// In broker order.
    pub(crate) deliveries: Vec<Delivery>,
    /// A suspect: one redelivered delivery, to run with nothing else running in
    /// the process.
    pub(crate) alone: bool,
}

impl Batch {
    /// One delivery as a batch of its own, alone if it is a suspect.
    pub(crate) fn of(delivery: Delivery) -> Self {
        Self {
            alone: is_suspect(&delivery),
            deliveries: vec![delivery],
        }
    }
}

/// A redelivery may be what killed the last process that held it. The broker's
/// `redelivered` flag decides, not a delivery-count header: a producer can forge
/// a header, not the flag.
pub(crate) fn is_suspect(delivery: &Delivery) -> bool {
    delivery.redelivered
}

/// Buffers deliveries and forms the batches that run next.
#[derive(Debug)]
pub(crate) struct Dispatcher {
    batch_size: usize,
    buffered: VecDeque<Delivery>,
}

impl Dispatcher {
    /// A dispatcher that forms batches of at most `batch_size` (at least 1).
    pub(crate) fn new(batch_size: usize) -> Self {
        Self {
            batch_size: batch_size.max(1),
            buffered: VecDeque::new(),
        }
    }

    /// Buffers a delivery, in the order the broker sent it.
    pub(crate) fn push(&mut self, delivery: Delivery) {
        self.buffered.push_back(delivery);
    }

    /// The next batch from what is already buffered, oldest first, never waiting
    /// for more; `None` when nothing is buffered. A suspect is always a batch of
    /// its own, and ends the batch of ordinary deliveries before it.
    pub(crate) fn next_batch(&mut self) -> Option<Batch> {
        let first = self.buffered.pop_front()?;
        if is_suspect(&first) {
            return Some(Batch::of(first));
        }
        let mut deliveries = vec![first];
        while deliveries.len() < self.batch_size
            && self.buffered.front().is_some_and(|d| !is_suspect(d))
        {
            deliveries.extend(self.buffered.pop_front());
        }
        Some(Batch {
            deliveries,
            alone: false,
        })
    }

    /// Deliveries buffered and not yet handed out.
    #[cfg(test)]
    fn buffered(&self) -> usize {
        self.buffered.len()
    }
}

/// Tracks, per channel, the delivery tags handed out and the ones whose outcome
/// is recorded, and answers how far an ack with `multiple` may reach.
///
/// With batches of one, every delivery is acked on its own as it settles; the
/// batch former acks through this instead.
#[derive(Debug, Default)]
pub(crate) struct AckWatermark {
    /// Delivered, outcome not yet recorded.
    open: BTreeSet<u64>,
    /// Outcome recorded, not yet acked.
    settled: BTreeSet<u64>,
    /// Every tag up to here is acked.
    acked_through: u64,
}

#[cfg_attr(
    not(test),
    expect(dead_code, reason = "acks with `multiple` come with the batch former")
)]
impl AckWatermark {
    /// A delivery with `tag` arrived. Tags grow along a channel.
    pub(crate) fn delivered(&mut self, tag: u64) {
        debug_assert!(tag > self.acked_through, "tags only grow");
        self.open.insert(tag);
    }

    /// The outcome of `tag` is recorded (committed, or its copy confirmed): it
    /// may be acked.
    pub(crate) fn settled(&mut self, tag: u64) {
        if self.open.remove(&tag) {
            self.settled.insert(tag);
        }
    }

    /// The ack to send now: the highest settled tag below every open one, as
    /// `(tag, multiple)`, or `None` when there is nothing to ack yet. `multiple`
    /// is set only when the ack covers more than one settled delivery and no
    /// open one. Settled tags above an open one wait for it.
    pub(crate) fn next_ack(&mut self) -> Option<(u64, bool)> {
        let lowest_open = self.open.first().copied().unwrap_or(u64::MAX);
        let covered: Vec<u64> = self.settled.range(..lowest_open).copied().collect();
        let &top = covered.last()?;
        for tag in &covered {
            self.settled.remove(tag);
        }
        self.acked_through = top;
        Some((top, covered.len() > 1))
    }

    /// Settled tags waiting behind an open one.
    pub(crate) fn waiting(&self) -> usize {
        self.settled.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(tag: u64) -> Delivery {
        Delivery {
            tag,
            exchange: String::new(),
            routing_key: String::new(),
            redelivered: false,
            properties: Default::default(),
            body: Vec::new(),
        }
    }

    fn redelivery(tag: u64) -> Delivery {
        Delivery {
            tag,
            exchange: String::new(),
            routing_key: String::new(),
            redelivered: true,
            properties: Default::default(),
            body: Vec::new(),
        }
    }

    #[test]
    fn batches_keep_broker_order_and_never_wait_for_more() {
        let mut d = Dispatcher::new(1);
        assert!(d.next_batch().is_none());
        for tag in 1..=3 {
            d.push(delivery(tag));
        }
        let tags: Vec<u64> = std::iter::from_fn(|| d.next_batch())
            .map(|b| {
                assert_eq!(b.deliveries.len(), 1, "batch size 1");
                b.deliveries[0].tag
            })
            .collect();
        assert_eq!(tags, [1, 2, 3]);
        let mut d = Dispatcher::new(2);
        for tag in 1..=3 {
            d.push(delivery(tag));
        }
        assert_eq!(d.next_batch().unwrap().deliveries.len(), 2);
        assert_eq!(
            d.next_batch().unwrap().deliveries.len(),
            1,
            "what is there, no waiting"
        );
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn a_suspect_runs_alone_and_never_joins_a_batch() {
        let mut d = Dispatcher::new(8);
        d.push(delivery(1));
        d.push(delivery(2));
        d.push(redelivery(3));
        d.push(redelivery(4));
        d.push(delivery(5));
        let batches: Vec<(Vec<u64>, bool)> = std::iter::from_fn(|| d.next_batch())
            .map(|b| (b.deliveries.iter().map(|d| d.tag).collect(), b.alone))
            .collect();
        assert_eq!(
            batches,
            [
                (vec![1, 2], false),
                (vec![3], true),
                (vec![4], true),
                (vec![5], false)
            ]
        );
        assert!(!Batch::of(delivery(6)).alone);
        assert!(Batch::of(redelivery(7)).alone);
    }

    #[test]
    fn an_ack_never_covers_a_delivery_still_open() {
        let mut w = AckWatermark::default();
        for tag in 1..=5 {
            w.delivered(tag);
        }
        assert_eq!(w.next_ack(), None, "nothing settled");
        // 2 and 3 settle while 1 is still held: they wait.
        w.settled(2);
        w.settled(3);
        assert_eq!(w.next_ack(), None);
        assert_eq!(w.waiting(), 2);
        // 1 settles: one ack with `multiple` covers 1..=3, not 4 or 5.
        w.settled(1);
        assert_eq!(w.next_ack(), Some((3, true)));
        assert_eq!(w.next_ack(), None);
        // A lone settled tag is acked alone.
        w.settled(4);
        assert_eq!(w.next_ack(), Some((4, false)));
        w.settled(5);
        assert_eq!(w.next_ack(), Some((5, false)));
        assert_eq!(w.waiting(), 0);
    }

    #[test]
    fn settling_an_unknown_or_repeated_tag_changes_nothing() {
        let mut w = AckWatermark::default();
        w.delivered(7);
        w.settled(9);
        assert_eq!(w.next_ack(), None);
        w.settled(7);
        w.settled(7);
        assert_eq!(w.next_ack(), Some((7, false)));
        assert_eq!(w.next_ack(), None, "acked once");
    }
}
