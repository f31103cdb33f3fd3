//! Shutdown signals for binaries.

/// Resolves on the first SIGTERM or SIGINT (Ctrl-C). Pass it to
/// [`Consumer::run`](crate::Consumer::run) so that an orchestrator's stop drains
/// the consumer instead of killing it mid-message.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received; draining"),
            _ = int.recv() => tracing::info!("SIGINT received; draining"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("Ctrl-C received; draining");
    }
}
