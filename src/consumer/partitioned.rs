//! A partitioned consumer: the hash ring declared and checked once, then one
//! queue consumer per partition this instance holds a lease on, started and
//! stopped as the leases move.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Consumer;
use super::session::{SharedConnections, is_fatal};
use crate::backoff::Backoff;
use crate::broker;
use crate::error::Error;
use crate::partition::Seat;
use crate::partition::lease::Leaser;
use crate::pipeline::Pipeline;
use crate::store::ConsumerStore;

/// One partition being consumed.
struct Running {
    /// A child of the consumer's token: cancelled with it, or alone when the
    /// partition's lease moves.
    stop: CancellationToken,
    task: JoinHandle<Result<(), Error>>,
}

impl Running {
    /// Asks it to drain and stop; the task ends when in-flight work settled.
    fn stop(self) -> JoinHandle<Result<(), Error>> {
        self.stop.cancel();
        self.task
    }
}

impl<S: ConsumerStore> Consumer<S> {
    /// Declares the partitioned topology, then takes, consumes and hands over
    /// partitions by lease until `shutdown`; then drains every partition and
    /// gives its leases back.
    pub(crate) async fn consume_partitions(
        &self,
        amqp_url: &str,
        stop: &CancellationToken,
        permits: Arc<Semaphore>,
    ) -> Result<(), Error> {
        let config = &self.inner.config;
        let partitions = config
            .partitions
            .clone()
            .expect("called for partitioned consumers only");
        let Some(hash_verified) = self.declare_partitions(amqp_url, stop).await? else {
            return Ok(());
        };
        if !hash_verified {
            tracing::warn!(
                "this broker's consistent-hash exchange does not route as warren predicts (warren \
                 mirrors RabbitMQ 3.10's plugin); deliveries are not checked against their \
                 partition, only the partition queues at start"
            );
        }
        let member = uuid::Uuid::now_v7().to_string();
        let leaser = Leaser::new(
            self.inner.store.clone(),
            &config.name,
            &member,
            partitions.count,
            partitions.lease_ttl,
        );
        let tick = partitions.lease_ttl / 3;
        let connections = SharedConnections::default();
        let mut running: BTreeMap<u32, Running> = BTreeMap::new();
        let mut handing_over: Vec<(u32, JoinHandle<Result<(), Error>>)> = Vec::new();
        let mut last_round = Instant::now();
        let mut set_up = false;
        let mut idle = false;
        let result = loop {
            // A partition that stopped by itself hit what no retry mends.
            let failed = running
                .iter()
                .find(|(_, r)| r.task.is_finished())
                .map(|(p, _)| *p);
            if let Some(partition) = failed {
                let r = running.remove(&partition).expect("found above");
                match r.task.await {
                    Ok(Err(e)) => {
                        // Said now: the caller may only look at the result
                        // once its other consumers end too.
                        tracing::error!(partition, error = %e, "a partition stopped with an error; stopping every partition");
                        break Err(e);
                    }
                    Ok(Ok(())) => {
                        let _ = leaser.release(partition).await;
                    }
                    Err(e) => break Err(Error::Task(format!("partition {partition}: {e}"))),
                }
            }
            // Handovers: the lease is freed only once the partition drained.
            let mut still = Vec::new();
            for (partition, task) in handing_over.drain(..) {
                if task.is_finished() {
                    let _ = task.await;
                    if running.contains_key(&partition) {
                        // Taken again while it drained (its lease had expired
                        // in an outage of the store): the lease is the new
                        // consumer's, and giving it back would stop that one.
                        continue;
                    }
                    if let Err(e) = leaser.release(partition).await {
                        tracing::warn!(partition, error = %e, "cannot give the lease back; it will expire");
                    } else {
                        tracing::info!(
                            partition,
                            member = leaser.member(),
                            "partition handed over"
                        );
                    }
                } else {
                    still.push((partition, task));
                }
            }
            handing_over = still;

            let round = async {
                if !set_up {
                    leaser.setup().await?;
                }
                let held = running.keys().copied().collect();
                leaser.round(&held).await
            };
            match round.await {
                Ok(plan) => {
                    set_up = true;
                    last_round = Instant::now();
                    for partition in plan.lost {
                        tracing::warn!(
                            partition,
                            "partition lease lost to another instance; stopping it"
                        );
                        if let Some(r) = running.remove(&partition) {
                            // Not given back: it is someone else's now.
                            drop(r.stop());
                        }
                    }
                    for partition in plan.release {
                        if let Some(r) = running.remove(&partition) {
                            tracing::info!(partition, "handing a partition over: draining it");
                            handing_over.push((partition, r.stop()));
                        }
                    }
                    for partition in plan.acquired {
                        tracing::info!(partition, member = leaser.member(), "partition taken");
                        running.insert(
                            partition,
                            self.spawn_partition(
                                stop,
                                partition,
                                amqp_url,
                                &permits,
                                hash_verified,
                                &connections,
                            ),
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "partition leases cannot be renewed");
                    if last_round.elapsed() >= partitions.lease_ttl && !running.is_empty() {
                        // The leases may have expired and moved: stop consuming
                        // until they can be renewed or taken again.
                        tracing::warn!(
                            "leases unrenewed for a whole TTL; stopping every partition"
                        );
                        for (partition, r) in std::mem::take(&mut running) {
                            handing_over.push((partition, r.stop()));
                        }
                    }
                }
            }
            // An instance with no partition to consume (more instances than
            // partitions) is healthy, not stuck.
            let now_idle = running.is_empty() && last_round.elapsed() < partitions.lease_ttl;
            if now_idle != idle {
                self.inner.telemetry.set_consuming(now_idle);
                idle = now_idle;
            }
            tokio::select! {
                () = stop.cancelled() => break Ok(()),
                () = tokio::time::sleep(tick) => {}
            }
        };
        if idle {
            self.inner.telemetry.set_consuming(false);
        }
        // Drain every partition, then give the leases back.
        for (partition, r) in std::mem::take(&mut running) {
            handing_over.push((partition, r.stop()));
        }
        for (partition, task) in handing_over {
            let _ = task.await;
            let _ = leaser.release(partition).await;
        }
        let _ = leaser.leave().await;
        connections.close().await;
        tracing::info!(consumer_name = %config.name, "stopped");
        result
    }

    /// Declares the topology with its hash ring, waiting out a broker that is
    /// not up yet, and probes whether the broker hashes as warren predicts.
    /// `None` if shutdown came first.
    async fn declare_partitions(
        &self,
        amqp_url: &str,
        stop: &CancellationToken,
    ) -> Result<Option<bool>, Error> {
        let config = &self.inner.config;
        let partitions_header = config
            .partitions
            .as_ref()
            .map(|p| p.header.clone())
            .unwrap_or_default();
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            let declared = async {
                let connection = broker::connect_with_tls(
                    amqp_url,
                    &format!("warren setup {}", config.name),
                    &config.tls,
                )
                .await?;
                let declared = match broker::declare_on(&connection, &self.topology()).await {
                    Ok(()) => broker::ring::hash_matches(&connection, &partitions_header).await,
                    Err(e) => Err(e),
                };
                broker::close_connection(&connection, "declared").await;
                declared
            };
            match declared.await.map_err(Error::Broker) {
                Ok(verified) => return Ok(Some(verified)),
                Err(e) if is_fatal(&e) => return Err(e),
                Err(e) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "cannot declare the partitions; retrying");
                    tokio::select! {
                        () = stop.cancelled() => return Ok(None),
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// Starts consuming partition `index` with the shared `permits`, until
    /// `stop` (the consumer's) or its own child of it is cancelled.
    fn spawn_partition(
        &self,
        stop: &CancellationToken,
        index: u32,
        amqp_url: &str,
        permits: &Arc<Semaphore>,
        hash_verified: bool,
        connections: &SharedConnections,
    ) -> Running {
        let signer = OnceLock::new();
        if let Some(s) = self.inner.signer.get() {
            let _ = signer.set(s.clone());
        }
        let mut pipeline = Pipeline::new(
            self.inner.config.for_partition(index),
            self.inner.store.clone(),
            self.inner.registry.clone(),
            self.inner.barrier.clone(),
        );
        // The partitions count and size their batches as the one consumer they are.
        pipeline.telemetry = self.inner.telemetry.clone();
        pipeline.batch_size = self.inner.batch_size.clone();
        pipeline.gate = Arc::clone(&self.inner.gate);
        pipeline.signer = signer;
        pipeline.journal = Arc::clone(&self.inner.journal);
        pipeline.seat = Some(Seat {
            index,
            base_queue: self.inner.config.queue.clone(),
            hash_verified,
        });
        let partition = Consumer {
            inner: Arc::new(pipeline),
            shared: Some(connections.clone()),
        };
        let stop = stop.child_token();
        let url = amqp_url.to_owned();
        let permits = Arc::clone(permits);
        let stopped = stop.clone();
        let task =
            tokio::spawn(async move { partition.consume_queue(&url, &stopped, permits).await });
        Running { stop, task }
    }
}
