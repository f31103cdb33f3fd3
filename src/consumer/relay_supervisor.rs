//! The outbox relay beside a consumer, supervised: restarted with backoff if it
//! ends while the consumer runs, with readiness and metrics saying so.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::consumer::Consumer;
use crate::error::Error;
use crate::relay::Relay;
use crate::relay_config::RelayConfig;
use crate::shutdown::cancel_on;
use crate::store::{ConsumerStore, OutboxStore};
use crate::telemetry::Telemetry;

impl<S: ConsumerStore + OutboxStore> Consumer<S> {
    /// Runs the consumer and an outbox relay on the same store together, the
    /// common case: what handlers write to the outbox is published as soon as it
    /// commits. On shutdown the consumer drains first, then the relay publishes
    /// what is committed and stops. A relay configured without TLS options uses
    /// the consumer's, since both talk to the same broker.
    ///
    /// The relay is supervised: if it ends while the consumer runs (a panic, an
    /// error), [`Health::relay`](crate::telemetry::Health) turns false (so `/readyz` goes
    /// red), `outbox_relay_up` drops to 0, and it is restarted with capped
    /// backoff, each restart counted in `outbox_relay_restarts_total`. The
    /// consumer never keeps consuming with no relay in silence.
    pub async fn run_with_relay<F>(
        self,
        amqp_url: &str,
        relay: RelayConfig,
        shutdown: F,
    ) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        relay.validate()?;
        let stop = CancellationToken::new();
        cancel_on(shutdown, &stop, async {
            // Migrations first: a relay started on a fresh database would only
            // find no outbox table.
            if !self.start(amqp_url, &stop).await? {
                return Ok(());
            }
            let mut relay = relay;
            if relay.tls.is_default() {
                relay.tls = self.inner.config.tls.clone();
            }
            // Not a child of the consumer's: the relay stops only once the
            // consumer drained, to publish what its last transactions wrote.
            let relay_stop = CancellationToken::new();
            let store = self.inner.store.clone();
            let url = amqp_url.to_owned();
            let counters = Relay::new(store.clone(), relay.clone()).stats_handle();
            let barrier = self.inner.barrier.clone();
            let supervisor = tokio::spawn(supervise(
                self.inner.telemetry.clone(),
                relay_stop.clone(),
                move |stop: CancellationToken| {
                    let relay = Relay::new(store.clone(), relay.clone())
                        .sharing(&counters)
                        .waiting_on(&barrier);
                    let url = url.clone();
                    async move { relay.run(&url, stop.cancelled_owned()).await }
                },
            ));
            let consumed = self.consume_until(amqp_url, &stop).await;
            relay_stop.cancel();
            let relayed = match supervisor.await {
                Ok(r) => r,
                Err(e) => Err(Error::Task(format!("outbox relay supervisor: {e}"))),
            };
            consumed.and(relayed)
        })
        .await
    }
}

/// Runs the task `start` makes (given `stop`) until `stop` is cancelled,
/// starting it again (after a capped, growing pause) whenever it ends before
/// that, with the health and metrics saying so meanwhile. Returns the last
/// run's result.
async fn supervise<F, Fut>(
    telemetry: Telemetry,
    stop: CancellationToken,
    start: F,
) -> Result<(), Error>
where
    F: Fn(CancellationToken) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), Error>> + Send + 'static,
{
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    telemetry.set_relay_running(true);
    loop {
        let ended = tokio::spawn(start(stop.clone())).await;
        if stop.is_cancelled() {
            return ended.unwrap_or_else(|e| Err(Error::Task(format!("outbox relay: {e}"))));
        }
        let why = match &ended {
            Ok(Ok(())) => "it returned".to_owned(),
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        telemetry.set_relay_running(false);
        let wait = backoff.next_delay();
        tracing::error!(
            reason = %why,
            restart_in = ?wait,
            "the outbox relay ended while the consumer runs; restarting it"
        );
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            () = tokio::time::sleep(wait) => {}
        }
        telemetry.relay_restarted();
        telemetry.set_relay_running(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_relay_that_ends_is_reported_and_restarted_until_shutdown() {
        let telemetry = Telemetry::new("c", "q");
        let stats = telemetry.stats().clone();
        let stop = CancellationToken::new();
        let runs = Arc::new(AtomicU32::new(0));
        let started = Arc::clone(&runs);
        let supervisor = tokio::spawn(supervise(telemetry, stop.clone(), move |stop| {
            let run = started.fetch_add(1, Ordering::SeqCst);
            async move {
                match run {
                    0 => panic!("relay bug"),
                    1 => Err(Error::Task("relay gave up".into())),
                    _ => {
                        stop.cancelled().await;
                        Ok(())
                    }
                }
            }
        }));
        // The first run panics: the health says so until the restart.
        let mut saw_down = false;
        for _ in 0..1000 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            saw_down |= !stats.health().relay;
            if runs.load(Ordering::SeqCst) >= 3 {
                break;
            }
        }
        assert!(saw_down, "an ended relay turns readiness red");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            3,
            "restarted after a panic and an error"
        );
        assert!(
            stats.health().relay,
            "green again while the third run is up"
        );
        stop.cancel();
        supervisor.await.unwrap().unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3, "no restart after shutdown");
    }
}
