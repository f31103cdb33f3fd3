//! Ordered lanes: deliveries with the same key run one at a time, in the order
//! the broker sent them; deliveries with different keys run side by side.
//!
//! The first delivery of a key opens its lane and runs; later ones queue in the
//! lane without holding a worker. The task that runs a lane takes the next one
//! when it finishes, and closes the lane when it is empty. Queued deliveries are
//! unacked broker deliveries, so the prefetch bounds them; when the session ends
//! the queue is dropped and the broker redelivers them.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::broker::Delivery;
use crate::config::{LaneInput, LaneKey};

/// The lanes of one session.
#[derive(Debug, Default)]
pub(crate) struct Lanes {
    open: Mutex<HashMap<String, VecDeque<Delivery>>>,
    /// Set when the session ends: lanes stop taking their next delivery.
    closed: AtomicBool,
}

impl Lanes {
    /// Puts `delivery` in the lane of `key`: `Some` if the lane was idle and the
    /// delivery should run now (its runner owns the lane until [`next`]
    /// returns `None`); `None` if it queued behind an earlier one.
    pub(crate) fn enter(&self, key: &str, delivery: Delivery) -> Option<Delivery> {
        let mut open = self.open.lock().expect("lanes lock");
        match open.get_mut(key) {
            Some(queue) => {
                queue.push_back(delivery);
                None
            }
            None => {
                open.insert(key.to_owned(), VecDeque::new());
                Some(delivery)
            }
        }
    }

    /// The next delivery of `key`'s lane for its runner, or `None` (the lane is
    /// closed) when it is empty or the session ended. The second value is how
    /// many queued deliveries were dropped because the session ended.
    pub(crate) fn next(&self, key: &str) -> (Option<Delivery>, usize) {
        let mut open = self.open.lock().expect("lanes lock");
        if self.closed.load(Ordering::Acquire) {
            let dropped = open.remove(key).map_or(0, |q| q.len());
            return (None, dropped);
        }
        match open.get_mut(key).and_then(VecDeque::pop_front) {
            Some(delivery) => (Some(delivery), 0),
            None => {
                open.remove(key);
                (None, 0)
            }
        }
    }

    /// The session ended: runners finish what they run and take nothing more.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// The lane key of `delivery` under `lanes`, if it has one.
pub(crate) fn key_of(lanes: &LaneKey, delivery: &Delivery) -> Option<String> {
    let input = LaneInput {
        headers: delivery.properties.headers().as_ref(),
        routing_key: &delivery.routing_key,
        body: &delivery.body,
    };
    match lanes {
        LaneKey::Header(name) => input.header(name),
        LaneKey::Function(f) => f(&input),
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

    #[test]
    fn one_key_runs_in_order_and_others_run_beside_it() {
        let lanes = Lanes::default();
        assert_eq!(lanes.enter("a", delivery(1)).map(|d| d.tag), Some(1));
        assert!(lanes.enter("a", delivery(2)).is_none(), "queued behind 1");
        assert_eq!(lanes.enter("b", delivery(3)).map(|d| d.tag), Some(3));
        assert!(lanes.enter("a", delivery(4)).is_none());
        assert_eq!(lanes.next("a").0.map(|d| d.tag), Some(2));
        assert_eq!(lanes.next("a").0.map(|d| d.tag), Some(4));
        assert!(lanes.next("a").0.is_none(), "lane closed");
        assert_eq!(
            lanes.enter("a", delivery(5)).map(|d| d.tag),
            Some(5),
            "a closed lane opens again"
        );
        assert!(lanes.next("b").0.is_none());
    }

    #[test]
    fn a_closed_session_drops_what_waits() {
        let lanes = Lanes::default();
        lanes.enter("a", delivery(1));
        lanes.enter("a", delivery(2));
        lanes.enter("a", delivery(3));
        lanes.close();
        assert_eq!(lanes.next("a").1, 2);
        assert!(lanes.next("a").0.is_none());
    }
}
