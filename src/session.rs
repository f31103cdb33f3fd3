//! One connected period with the broker, and what ends or watches it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::Error;
use crate::broker::{self, Port, Subscription};
use crate::telemetry::Telemetry;

/// One connected period: two connections, the subscription, its monitor.
pub(crate) struct Session {
    pub(crate) consume: Arc<lapin::Connection>,
    pub(crate) publish: Arc<lapin::Connection>,
    pub(crate) subscription: Subscription,
    pub(crate) port: Arc<dyn Port>,
    pub(crate) lost: Arc<tokio::sync::Notify>,
    pub(crate) monitor: tokio::task::JoinHandle<()>,
}

impl Session {
    /// Closes politely, but never waits long: a broker that is shutting down may
    /// never answer the close, and a reconnect or a shutdown must not hang on it.
    pub(crate) async fn close(self) {
        self.monitor.abort();
        let close = async {
            self.subscription.close().await;
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

/// A session that lasted this long resets the reconnect backoff.
pub(crate) const STABLE_SESSION: Duration = Duration::from_secs(10);

/// How long closing a channel and its connections may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) enum SessionEnd {
    Shutdown,
    Lost(String),
}

/// Errors a reconnect cannot fix.
pub(crate) fn is_fatal(e: &Error) -> bool {
    match e {
        Error::Config(_) => true,
        // Neither a drifted queue nor a refused certificate mends by retrying.
        Error::Broker(b) => b.is_topology_drift() || b.is_tls(),
        _ => false,
    }
}

/// Waits for in-flight messages up to `deadline`, then abandons the rest to
/// redelivery: aborting drops each task's transaction uncommitted, and its
/// delivery was never acked.
pub(crate) async fn drain(in_flight: &mut JoinSet<()>, deadline: Duration) {
    let drained = tokio::time::timeout(deadline, async {
        while let Some(done) = in_flight.join_next().await {
            log_task_end(done);
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            unfinished = in_flight.len(),
            ?deadline,
            "shutdown deadline passed; abandoning unfinished messages to redelivery"
        );
        in_flight.shutdown().await;
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

pub(crate) fn log_task_end(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && !e.is_cancelled()
    {
        // `process` catches handler panics; reaching this means warren itself
        // panicked. The delivery was not acked, so it is redelivered.
        tracing::error!(error = %e, "message task failed");
    }
}
