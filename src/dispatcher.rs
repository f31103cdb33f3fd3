//! Which buffered deliveries run next.
//!
//! The dispatcher is the one owner of scheduling. It takes deliveries in the
//! order the broker sent them and hands out work:
//! - a suspect (a redelivery) is a batch of its own that runs alone (see
//!   [`barrier`]);
//! - a delivery with a lane key goes to its lane (see [`lanes`]): one entity's
//!   messages run one at a time, in order;
//! - every other delivery joins a batch: the deliveries already buffered, up to
//!   the batch size, applied in one database transaction. A batch never waits
//!   for more, never holds a suspect and never holds a lane's delivery.
//!
//! Acks for a batch are planned by the broker port's ack watermark: one ack with
//! `multiple` only below every delivery still open.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::broker::Delivery;
use crate::config::LaneKey;

pub(crate) mod gate;
pub(crate) mod lanes;
pub(crate) use gate::BatchGate;

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

/// What runs next.
#[derive(Debug)]
pub(crate) enum Work {
    /// A batch, or a suspect alone.
    Batch(Batch),
    /// A delivery for the lane of this key.
    Lane(String, Box<Delivery>),
}

/// A redelivery may be what killed the last process that held it. The broker's
/// `redelivered` flag decides, not a delivery-count header: a producer can forge
/// a header, not the flag.
pub(crate) fn is_suspect(delivery: &Delivery) -> bool {
    delivery.redelivered
}

/// The size of the batches a consumer forms now, between 1 and its
/// configured batch size: halved by every lock conflict between units of work,
/// grown by one by every batch that ran clean. Conflicts come from batches
/// that lock the same rows in different orders; smaller batches hold fewer
/// locks for less time, so they collide less, and a run without conflicts
/// keeps the full size. Clones share the size (the partitions of one
/// consumer).
#[derive(Debug, Clone)]
pub(crate) struct BatchSize {
    now: Arc<AtomicUsize>,
    max: usize,
}

impl BatchSize {
    /// Starts at `max` (at least 1).
    pub(crate) fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            now: Arc::new(AtomicUsize::new(max)),
            max,
        }
    }

    /// The size now.
    pub(crate) fn get(&self) -> usize {
        self.now.load(Ordering::Relaxed)
    }

    /// A lock conflict: halves the size, down to 1.
    pub(crate) fn conflict(&self) {
        let _ = self
            .now
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some((n / 2).max(1))
            });
    }

    /// A batch ran clean: grows the size by one, up to the configured size.
    /// True if it grew.
    pub(crate) fn grow(&self) -> bool {
        self.now
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max).then_some(n + 1)
            })
            .is_ok()
    }
}

/// Buffers deliveries and forms the work that runs next.
#[derive(Debug)]
pub(crate) struct Dispatcher {
    batch_size: BatchSize,
    lanes: Option<LaneKey>,
    /// With each delivery, its lane key, if it has one.
    buffered: VecDeque<(Delivery, Option<String>)>,
}

impl Dispatcher {
    /// A dispatcher that forms batches of at most `batch_size` as it is at
    /// the time, and puts deliveries in lanes by `lanes`, if set.
    pub(crate) fn new(batch_size: BatchSize, lanes: Option<LaneKey>) -> Self {
        Self {
            batch_size,
            lanes,
            buffered: VecDeque::new(),
        }
    }

    /// Buffers a delivery, in the order the broker sent it.
    pub(crate) fn push(&mut self, delivery: Delivery) {
        let lane = self
            .lanes
            .as_ref()
            .and_then(|k| lanes::key_of(k, &delivery));
        self.buffered.push_back((delivery, lane));
    }

    /// Deliveries buffered and not yet handed out.
    pub(crate) fn buffered(&self) -> usize {
        self.buffered.len()
    }

    /// The largest batch this dispatcher forms now.
    pub(crate) fn batch_size(&self) -> usize {
        self.batch_size.get()
    }

    /// The next work from what is already buffered, oldest first, never waiting
    /// for more; `None` when nothing is buffered. A suspect is always a batch of
    /// its own; it and a lane's delivery end the batch before them.
    pub(crate) fn next(&mut self) -> Option<Work> {
        let (first, lane) = self.buffered.pop_front()?;
        if let Some(key) = lane {
            return Some(Work::Lane(key, Box::new(first)));
        }
        if is_suspect(&first) {
            return Some(Work::Batch(Batch::of(first)));
        }
        let size = self.batch_size.get();
        let mut deliveries = vec![first];
        while deliveries.len() < size
            && self
                .buffered
                .front()
                .is_some_and(|(d, lane)| lane.is_none() && !is_suspect(d))
        {
            deliveries.extend(self.buffered.pop_front().map(|(d, _)| d));
        }
        Some(Work::Batch(Batch {
            deliveries,
            alone: false,
        }))
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
            pruned: None,
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
            pruned: None,
        }
    }

    fn batch(work: Work) -> Batch {
        match work {
            Work::Batch(b) => b,
            Work::Lane(key, _) => panic!("a lane delivery for {key}"),
        }
    }

    impl Dispatcher {
        fn next_batch(&mut self) -> Option<Batch> {
            self.next().map(batch)
        }
    }

    #[test]
    fn batches_keep_broker_order_and_never_wait_for_more() {
        let mut d = Dispatcher::new(BatchSize::new(1), None);
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
        let mut d = Dispatcher::new(BatchSize::new(2), None);
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
        let mut d = Dispatcher::new(BatchSize::new(8), None);
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
    fn a_lane_delivery_goes_to_its_lane_and_ends_the_batch_before_it() {
        let mut d = Dispatcher::new(BatchSize::new(8), Some(LaneKey::Header("k".into())));
        let keyed = |tag: u64, key: &str| {
            let mut headers = lapin::types::FieldTable::default();
            headers.insert("k".into(), crate::amqp::text(key));
            let mut d = delivery(tag);
            d.properties = d.properties.with_headers(headers);
            d
        };
        d.push(delivery(1));
        d.push(delivery(2));
        d.push(keyed(3, "a"));
        d.push(delivery(4));
        d.push(keyed(5, "a"));
        let mut seen = Vec::new();
        while let Some(work) = d.next() {
            seen.push(match work {
                Work::Batch(b) => format!(
                    "{:?}",
                    b.deliveries.iter().map(|d| d.tag).collect::<Vec<_>>()
                ),
                Work::Lane(key, d) => format!("{key}:{}", d.tag),
            });
        }
        assert_eq!(seen, ["[1, 2]", "a:3", "[4]", "a:5"]);
    }

    #[test]
    fn the_batch_size_halves_on_conflicts_and_grows_back_one_by_one() {
        let size = BatchSize::new(32);
        assert!(!size.grow(), "a run without conflicts keeps the full size");
        assert_eq!(size.get(), 32);
        size.conflict();
        assert_eq!(size.get(), 16);
        for _ in 0..10 {
            size.conflict();
        }
        assert_eq!(size.get(), 1, "never below one");
        let shared = size.clone();
        for _ in 0..40 {
            shared.grow();
        }
        assert_eq!(
            size.get(),
            32,
            "grows back to the configured size, no further"
        );

        let mut d = Dispatcher::new(size.clone(), None);
        for tag in 1..=8 {
            d.push(delivery(tag));
        }
        size.conflict();
        size.conflict();
        size.conflict();
        size.conflict();
        assert_eq!(
            d.next_batch().unwrap().deliveries.len(),
            2,
            "batches are formed at the size of the moment"
        );
    }
}
