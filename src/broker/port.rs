//! The pipeline's port to the broker: the few calls settling a delivery needs
//! (ack, put back, publish a copy and wait for its confirm), behind one small
//! trait. [`Amqp`] implements it on a lapin channel; the in-memory double in
//! `memory` implements it for fast tests of every disposition.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};

use super::acks::{AckLedger, AckPolicy};
use super::guard::{Pruned, take_pruned};
use super::{BrokerError, Publisher, close_channel_within, deadline, short};

/// A delivery as the pipeline sees it: the broker's tag, where it came from, and
/// what it carries. Of the client's types only its model of AMQP properties
/// (`BasicProperties`, with its header tables) crosses the port: no channel,
/// consumer or connection does (see the crate docs on lapin's types).
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The channel's delivery tag: what an ack names. Never an identity.
    pub tag: u64,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Set by the broker on a delivery it handed out before.
    pub redelivered: bool,
    /// Its AMQP properties, with what the frame guard left of its headers.
    pub properties: BasicProperties,
    /// Its body.
    pub body: Vec<u8>,
    /// What the frame guard removed or replaced before the client read the
    /// properties: such a delivery is dead-lettered, never applied.
    pub pruned: Option<Pruned>,
}

impl Delivery {
    /// The AMQP `message_id`, or "" (for logs; the envelope is the identity).
    pub(crate) fn message_id(&self) -> &str {
        self.properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
            .unwrap_or_default()
    }
}

impl From<lapin::message::Delivery> for Delivery {
    fn from(mut d: lapin::message::Delivery) -> Self {
        let pruned = take_pruned(&mut d.properties);
        Self {
            tag: d.delivery_tag,
            exchange: d.exchange.to_string(),
            routing_key: d.routing_key.to_string(),
            redelivered: d.redelivered,
            properties: d.properties,
            body: d.data,
            pruned,
        }
    }
}

/// What the pipeline needs from the broker to settle a delivery.
pub trait Port: Send + Sync {
    /// Acks the delivery `tag` alone.
    fn ack(&self, tag: u64) -> BoxFuture<'_, Result<(), BrokerError>>;

    /// Acks the deliveries `tags`, whose outcomes committed together: with one
    /// ack carrying `multiple` where no other open delivery lies below them,
    /// one by one where one does.
    fn ack_all<'a>(&'a self, tags: &'a [u64]) -> BoxFuture<'a, Result<(), BrokerError>> {
        Box::pin(async move {
            for &tag in tags {
                self.ack(tag).await?;
            }
            Ok(())
        })
    }

    /// Hands the delivery `tag` back to the broker for redelivery.
    fn requeue(&self, tag: u64) -> BoxFuture<'_, Result<(), BrokerError>>;

    /// Publishes a copy to `queue` through the default exchange, `mandatory`,
    /// and returns once the broker confirmed it.
    fn publish<'a>(
        &'a self,
        queue: &'a str,
        body: &'a [u8],
        properties: BasicProperties,
    ) -> BoxFuture<'a, Result<(), BrokerError>>;

    /// The largest frame the connection negotiated: the bound for headers.
    fn frame_max(&self) -> usize;
}

/// The settlements of one channel: the ledger of its open and held
/// deliveries, and the one writer that sends its acks and nacks in the order
/// they were planned.
pub(crate) struct Acker {
    channel: Channel,
    policy: AckPolicy,
    /// Never held across an await: the stream takes it for every delivery.
    ledger: std::sync::Mutex<AckLedger>,
    /// Held while frames are planned and sent, so that they leave in order.
    writer: tokio::sync::Mutex<()>,
    /// Something was held: the timer task looks at when it is due.
    held: tokio::sync::Notify,
}

impl Acker {
    fn new(channel: Channel, prefetch: u16) -> Self {
        Self {
            channel,
            policy: AckPolicy::for_prefetch(prefetch),
            ledger: std::sync::Mutex::default(),
            writer: tokio::sync::Mutex::new(()),
            held: tokio::sync::Notify::new(),
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, AckLedger> {
        self.ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Holds the acks of `tags`, then sends what the ledger releases now.
    async fn hold(&self, tags: &[u64]) -> Result<(), BrokerError> {
        self.ledger().hold(tags, std::time::Instant::now());
        self.held.notify_one();
        self.flush(false).await
    }

    /// Sends the acks the ledger releases now; every held one if `force`.
    async fn flush(&self, force: bool) -> Result<(), BrokerError> {
        let _writer = self.writer.lock().await;
        let plan = self
            .ledger()
            .plan(std::time::Instant::now(), self.policy, force);
        for (tag, multiple) in plan {
            deadline(
                "basic.ack",
                self.channel.basic_ack(tag, BasicAckOptions { multiple }),
            )
            .await?;
        }
        Ok(())
    }

    /// Hands `tag` back for redelivery, after whatever acks were planned
    /// before it.
    async fn requeue(&self, tag: u64) -> Result<(), BrokerError> {
        let _writer = self.writer.lock().await;
        self.ledger().done(tag);
        deadline(
            "basic.nack",
            self.channel.basic_nack(
                tag,
                BasicNackOptions {
                    multiple: false,
                    requeue: true,
                },
            ),
        )
        .await
    }

    /// Sends held acks when they fall due, until the channel closes.
    async fn release_when_due(self: Arc<Self>) {
        loop {
            let due = self.ledger().due(self.policy);
            match due {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => self.held.notified().await,
            }
            if self.flush(false).await.is_err() && !self.channel.status().connected() {
                return;
            }
        }
    }
}

/// The port on a live session: acks on the consuming channel, copies through
/// the session's publisher (a connection of its own).
pub struct Amqp {
    acker: Arc<Acker>,
    publisher: Arc<Publisher>,
}

impl Port for Amqp {
    fn ack(&self, tag: u64) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move { self.acker.hold(&[tag]).await })
    }

    fn ack_all<'a>(&'a self, tags: &'a [u64]) -> BoxFuture<'a, Result<(), BrokerError>> {
        Box::pin(self.acker.hold(tags))
    }

    fn requeue(&self, tag: u64) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(self.acker.requeue(tag))
    }

    fn publish<'a>(
        &'a self,
        queue: &'a str,
        body: &'a [u8],
        properties: BasicProperties,
    ) -> BoxFuture<'a, Result<(), BrokerError>> {
        Box::pin(self.publisher.publish_raw("", queue, body, properties))
    }

    fn frame_max(&self) -> usize {
        self.publisher.frame_max()
    }
}

/// A consumer subscription: the channel with its prefetch, the stream of
/// deliveries, and their settlements.
pub struct Subscription {
    channel: Channel,
    tag: String,
    deliveries: lapin::Consumer,
    acker: Arc<Acker>,
    /// Sends held acks as they fall due; ends with the subscription.
    releaser: tokio::task::JoinHandle<()>,
}

impl Subscription {
    /// Opens a channel on `connection` with `prefetch` and subscribes to `queue`
    /// as `tag`.
    pub async fn open(
        connection: &Connection,
        queue: &str,
        prefetch: u16,
        tag: &str,
    ) -> Result<Self, BrokerError> {
        let channel = deadline("opening a channel", connection.create_channel()).await?;
        deadline(
            "basic.qos",
            channel.basic_qos(prefetch, BasicQosOptions::default()),
        )
        .await?;
        let deliveries = deadline(
            "basic.consume",
            channel.basic_consume(
                short("queue name", queue)?,
                short("consumer tag", tag)?,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        let acker = Arc::new(Acker::new(channel.clone(), prefetch));
        let releaser = tokio::spawn(Arc::clone(&acker).release_when_due());
        Ok(Self {
            channel,
            tag: tag.to_owned(),
            deliveries,
            acker,
            releaser,
        })
    }

    /// The next delivery; `None` when the broker ended the subscription (the
    /// queue was deleted, the channel or connection closed).
    pub async fn next(&mut self) -> Option<Result<Delivery, BrokerError>> {
        let next = self.deliveries.next().await?;
        Some(self.received(next))
    }

    /// The next delivery if the broker already sent it, without waiting.
    pub(crate) fn next_buffered(&mut self) -> Option<Result<Delivery, BrokerError>> {
        let next = self.deliveries.next().now_or_never()??;
        Some(self.received(next))
    }

    fn received(
        &self,
        next: Result<lapin::message::Delivery, lapin::Error>,
    ) -> Result<Delivery, BrokerError> {
        let delivery = next.map(Delivery::from).map_err(BrokerError::from)?;
        self.acker
            .ledger()
            .delivered(delivery.tag, std::time::Instant::now());
        Ok(delivery)
    }

    /// The port that settles this subscription's deliveries.
    pub fn port(&self, publisher: Arc<Publisher>) -> Arc<Amqp> {
        Arc::new(Amqp {
            acker: Arc::clone(&self.acker),
            publisher,
        })
    }

    /// Stops the flow: nothing new is delivered; what is in flight can still be
    /// acked. Bounded, since a broker going away may never answer.
    pub(crate) async fn cancel(&self) {
        if self.channel.status().connected() {
            let cancel = self
                .channel
                .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default());
            let _ = deadline("basic.cancel", cancel).await;
        }
    }

    /// Sends every held ack, then closes the channel; unacked deliveries
    /// return to the queue. Each step waits at most `limit`: held acks that
    /// cannot be sent in time are given up (their deliveries come back and
    /// settle as duplicates) rather than keep the channel, and everything it
    /// holds, open. False if the broker did not confirm the close in time.
    pub async fn close(&self, limit: Duration) -> bool {
        if self.channel.status().connected() {
            let _ = tokio::time::timeout(limit, self.acker.flush(true)).await;
        }
        self.releaser.abort();
        close_channel_within(&self.channel, "shutdown", limit).await
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.releaser.abort();
    }
}
