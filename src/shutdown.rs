//! Shutdown: the signals binaries stop on, and the token a consumer passes
//! down to everything it starts.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Runs `work` to its end, cancelling `stop` if `shutdown` resolves first:
/// the one place a caller's shutdown future becomes the token that every task
/// below watches. `work` goes on after the cancel, to drain.
pub async fn cancel_on<T>(
    shutdown: impl Future<Output = ()>,
    stop: &CancellationToken,
    work: impl Future<Output = T>,
) -> T {
    let mut work = std::pin::pin!(work);
    tokio::select! {
        out = &mut work => return out,
        () = shutdown => stop.cancel(),
    }
    work.await
}

/// A future that resolves on the first SIGTERM or SIGINT (Ctrl-C). Pass it to
/// [`Consumer::run`](crate::Consumer::run) so that an orchestrator's stop drains
/// the consumer instead of killing it mid-message.
///
/// The signal handlers are installed when this function is called, not when the
/// future is first polled: a SIGTERM that arrives while the consumer is still
/// starting is kept, instead of killing the process by the default action.
///
/// # Panics
///
/// Outside a Tokio runtime, or if the handlers cannot be installed.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
        async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received; draining"),
                _ = int.recv() => tracing::info!("SIGINT received; draining"),
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("Ctrl-C received; draining");
        }
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

pub(crate) fn log_task_end(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && !e.is_cancelled()
    {
        // The engine catches handler panics; reaching this means warren itself
        // panicked. The delivery was not acked, so it is redelivered.
        tracing::error!(error = %e, "message task failed");
    }
}
