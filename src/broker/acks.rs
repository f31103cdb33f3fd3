//! Which acks to send for deliveries that settled, so that an ack with
//! `multiple` never covers a delivery still held, retrying or waiting.
//!
//! Every delivery of a channel is `delivered` when it arrives and `done` when
//! its outcome reached the broker. A batch that committed asks for a
//! [`plan`](AckWatermark::plan): its tags below every delivery still open go in
//! one ack with `multiple`; tags above an open one are acked one by one, so
//! nothing waits for a slow neighbour.

use std::collections::BTreeSet;

/// The open deliveries of one channel.
#[derive(Debug, Default)]
pub(crate) struct AckWatermark {
    /// Delivered, outcome not yet sent to the broker.
    open: BTreeSet<u64>,
}

impl AckWatermark {
    /// A delivery with `tag` arrived. Tags grow along a channel.
    pub(crate) fn delivered(&mut self, tag: u64) {
        self.open.insert(tag);
    }

    /// The outcome of `tag` is being sent on its own (an ack or a nack of that
    /// tag alone).
    pub(crate) fn done(&mut self, tag: u64) {
        self.open.remove(&tag);
    }

    /// The acks that settle `tags` (distinct, each still open), in the order to
    /// send them, as `(tag, multiple)`: the tags below every other open
    /// delivery in one ack with `multiple` (when there are several), each tag
    /// above an open one alone. Marks them done.
    pub(crate) fn plan(&mut self, tags: &[u64]) -> Vec<(u64, bool)> {
        let mut tags: Vec<u64> = tags
            .iter()
            .copied()
            .filter(|t| self.open.remove(t))
            .collect();
        tags.sort_unstable();
        let lowest_open = self.open.first().copied().unwrap_or(u64::MAX);
        let below = tags.partition_point(|&t| t < lowest_open);
        let mut acks = Vec::with_capacity(tags.len() - below + 1);
        if below > 0 {
            acks.push((tags[below - 1], below > 1));
        }
        acks.extend(tags[below..].iter().map(|&t| (t, false)));
        acks
    }

    /// Deliveries still open.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_never_covers_a_delivery_still_open() {
        let mut w = AckWatermark::default();
        for tag in 1..=6 {
            w.delivered(tag);
        }
        // 2, 3 and 5 settle while 1 is still held: each goes alone.
        assert_eq!(w.plan(&[3, 2, 5]), [(2, false), (3, false), (5, false)]);
        // 1 settles alone; then 4 and 6 together, below nothing open: one ack.
        w.done(1);
        assert_eq!(w.plan(&[6, 4]), [(6, true)]);
        assert_eq!(w.open(), 0);
    }

    #[test]
    fn tags_below_the_lowest_open_one_share_one_ack() {
        let mut w = AckWatermark::default();
        for tag in 1..=5 {
            w.delivered(tag);
        }
        // 4 is still open: 1..=3 in one ack with `multiple`, 5 alone.
        assert_eq!(w.plan(&[1, 2, 3, 5]), [(3, true), (5, false)]);
        // A single tag below everything open is acked without `multiple`.
        assert_eq!(w.plan(&[4]), [(4, false)]);
    }

    #[test]
    fn settling_an_unknown_or_repeated_tag_sends_nothing() {
        let mut w = AckWatermark::default();
        w.delivered(7);
        assert!(w.plan(&[9]).is_empty());
        assert_eq!(w.plan(&[7, 7]), [(7, false)]);
        assert!(w.plan(&[7]).is_empty(), "acked once");
    }
}
