//! Shutdown signals for binaries.

use std::future::Future;

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
