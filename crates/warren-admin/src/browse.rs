//! Walking a queue with `basic.get`, for operator tooling: what is taken is held
//! unacked until the walk closes, and then returned to the queue; only what the
//! caller acks is removed.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueuePurgeOptions};
use lapin::{Channel, Connection};

use warren::__kit::broker::{close_channel, deadline, short};
use warren::broker::guard::{Pruned, take_pruned};
use warren::broker::{BrokerError, inspect_queue};

/// How long closing a walk waits for the broker to put back what it held.
const RETURN_WAIT: Duration = Duration::from_secs(5);

/// A pass over a queue, holding what it takes until closed.
pub(crate) struct Browse<'c> {
    connection: &'c Connection,
    channel: Channel,
    queue: String,
    /// Messages ready when the walk began: it never takes more, so it cannot
    /// loop over what it returns itself.
    present: u32,
    remaining: AtomicU32,
    acked: AtomicU32,
}

impl<'c> Browse<'c> {
    /// Starts a walk over the messages ready in `queue` now.
    pub(crate) async fn open(connection: &'c Connection, queue: &str) -> Result<Self, BrokerError> {
        let present = inspect_queue(connection, queue).await?.ready;
        Ok(Self {
            connection,
            channel: deadline("opening a channel", connection.create_channel()).await?,
            queue: queue.to_owned(),
            present,
            remaining: AtomicU32::new(present),
            acked: AtomicU32::new(0),
        })
    }

    /// The next message, held until the walk closes unless acked, with what
    /// the frame guard removed from it (taken off its properties).
    pub(crate) async fn next(&self) -> Result<Option<(Delivery, Option<Pruned>)>, BrokerError> {
        if self
            .remaining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_err()
        {
            return Ok(None);
        }
        Ok(deadline(
            "basic.get",
            self.channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions::default()),
        )
        .await?
        .map(|got| {
            let mut delivery = got.delivery;
            let pruned = take_pruned(&mut delivery.properties);
            (delivery, pruned)
        }))
    }

    /// Removes `delivery` from the queue.
    pub(crate) async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        deadline("basic.ack", delivery.acker.ack(BasicAckOptions::default())).await?;
        self.acked.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Closes the walk, and waits (a few seconds at most) until the broker has
    /// put back what it held: a quorum queue returns them after the close is
    /// answered, and a listing right after would otherwise miss them.
    pub(crate) async fn close(self) {
        close_channel(&self.channel, "done").await;
        let expected = self
            .present
            .saturating_sub(self.acked.load(Ordering::Relaxed));
        let until = Instant::now() + RETURN_WAIT;
        while Instant::now() < until {
            match inspect_queue(self.connection, &self.queue).await {
                // Someone else may take messages meanwhile; the wait is bounded.
                Ok(info) if info.ready < expected => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => return,
            }
        }
    }
}

/// Removes every ready message from `queue`; returns how many there were.
pub(crate) async fn purge(connection: &Connection, queue: &str) -> Result<u32, BrokerError> {
    let channel = deadline("opening a channel", connection.create_channel()).await?;
    let n = deadline(
        "queue.purge",
        channel.queue_purge(short("queue name", queue)?, QueuePurgeOptions::default()),
    )
    .await;
    close_channel(&channel, "done").await;
    n
}
