//! Capped exponential backoff with jitter: how long to wait before trying a
//! broker or a database again.

use std::time::Duration;

/// Capped exponential backoff with jitter, for reconnecting to the broker and
/// waiting out a database.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Steps from `first`, doubling up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            first,
            max,
            next: first,
        }
    }

    /// The next wait: between half and all of the current step, so that many
    /// clients do not reconnect in lockstep after a broker restart.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.max);
        step.mul_f64(0.5 + fastrand::f64() * 0.5)
    }

    /// Back to the first step, after a success.
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}
