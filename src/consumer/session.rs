//! One connected period with the broker, and what ends or watches it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::broker::{self, Port, Subscription};
use crate::error::Error;
use crate::telemetry::Telemetry;

/// One connected period: two connections, the subscription, its monitor.
pub(crate) struct Session {
    pub(crate) consume: Arc<lapin::Connection>,
    pub(crate) publish: Arc<lapin::Connection>,
    /// The connections are this session's own, closed with it; shared ones
    /// (the partitions of one consumer) outlive it.
    pub(crate) owns_connections: bool,
    pub(crate) subscription: Subscription,
    pub(crate) port: Arc<dyn Port>,
    pub(crate) lost: Arc<tokio::sync::Notify>,
    pub(crate) monitor: tokio::task::JoinHandle<()>,
}

impl Session {
    /// Closes politely, but never waits long: a broker that is shutting down may
    /// never answer the close, and a reconnect or a shutdown must not hang on it.
    ///
    /// A channel whose close the broker did not confirm may still be open,
    /// holding its unacked deliveries and, on a partition queue, the single
    /// active consumer's place: on a connection of its own that ends with the
    /// connection; on the connections the partitions share, those are closed
    /// too, or the deliveries would wait there while the process lives. The
    /// other partitions then reconnect, and what they held comes back as
    /// redeliveries the inbox recognizes.
    pub(crate) async fn close(self) {
        self.monitor.abort();
        let channel_closed = self.subscription.close(CLOSE_TIMEOUT).await;
        if !channel_closed && !self.owns_connections {
            tracing::warn!(
                "the broker did not confirm a partition channel's close within \
                 {CLOSE_TIMEOUT:?}; closing the shared connections so that it hands back \
                 what the channel held"
            );
        }
        if self.owns_connections || !channel_closed {
            let close = async {
                broker::close_connection(&self.consume, "shutdown").await;
                broker::close_connection(&self.publish, "shutdown").await;
            };
            if tokio::time::timeout(CLOSE_TIMEOUT, close).await.is_err() {
                tracing::warn!(
                    "the broker did not answer the close within {CLOSE_TIMEOUT:?}; dropping the connections"
                );
            }
        }
    }
}

/// A consuming and a publishing connection.
pub(crate) type ConnectionPair = (Arc<lapin::Connection>, Arc<lapin::Connection>);

/// The connections the partitions of one consumer share, each partition on a
/// channel of its own: a connection costs the broker a process and this
/// process two buffers of 32 frames (8 MiB at RabbitMQ's frame size), so one
/// pair per partition would multiply both by the partitions held. Whichever
/// partition finds them gone first connects anew; the others then use that.
#[derive(Clone, Default)]
pub(crate) struct SharedConnections(Arc<tokio::sync::Mutex<Option<ConnectionPair>>>);

impl SharedConnections {
    /// The live pair, or a new one made by `connect`.
    pub(crate) async fn get(
        &self,
        connect: impl AsyncFnOnce() -> Result<ConnectionPair, Error>,
    ) -> Result<ConnectionPair, Error> {
        let mut slot = self.0.lock().await;
        if let Some((consume, publish)) = slot.as_ref()
            && consume.status().connected()
            && publish.status().connected()
        {
            return Ok((Arc::clone(consume), Arc::clone(publish)));
        }
        if let Some((consume, publish)) = slot.take() {
            broker::close_connection(&consume, "reconnecting").await;
            broker::close_connection(&publish, "reconnecting").await;
        }
        let pair = connect().await?;
        *slot = Some((Arc::clone(&pair.0), Arc::clone(&pair.1)));
        Ok(pair)
    }

    /// Closes the pair, once every partition has stopped.
    pub(crate) async fn close(&self) {
        if let Some((consume, publish)) = self.0.lock().await.take() {
            let close = async {
                broker::close_connection(&consume, "shutdown").await;
                broker::close_connection(&publish, "shutdown").await;
            };
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, close).await;
        }
    }
}

/// A session that lasted this long resets the reconnect backoff.
pub(crate) const STABLE_SESSION: Duration = Duration::from_secs(10);

/// How long closing a channel and its connections may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) enum SessionEnd {
    Shutdown,
    Lost(String),
    /// The broker cancelled the subscription (`basic.cancel`: the queue was
    /// deleted or failed over, or a 4.3 consumer timeout fired) while the
    /// connection stayed open.
    Cancelled,
}

/// Errors a reconnect cannot fix.
pub(crate) fn is_fatal(e: &Error) -> bool {
    match e {
        Error::Config(_) => true,
        // Neither a drifted queue nor a refused certificate mends by retrying.
        Error::Broker(b) => b.is_fatal_topology() || b.is_tls(),
        _ => false,
    }
}

/// Watches a session: notices dead connections (the consuming stream may not end
/// by itself when only the publishing connection dies), reports the blocked state
/// and the queues' depth.
pub(crate) async fn monitor(
    consume: Arc<lapin::Connection>,
    publish: Arc<lapin::Connection>,
    telemetry: Telemetry,
    queues: Vec<String>,
    queue_interval: Duration,
    lost: Arc<tokio::sync::Notify>,
) {
    let mut last_queue_check: Option<Instant> = None;
    loop {
        if !consume.status().connected() || !publish.status().connected() {
            lost.notify_one();
            return;
        }
        telemetry.set_blocked(publish.status().blocked());
        if last_queue_check.is_none_or(|t| t.elapsed() >= queue_interval) {
            last_queue_check = Some(Instant::now());
            for q in &queues {
                if let Ok(info) = broker::inspect_queue(&publish, q).await {
                    telemetry.queue_depth(q, info.ready, info.consumers);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
