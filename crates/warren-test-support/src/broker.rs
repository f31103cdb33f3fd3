//! Private broker names per test, with helpers to publish and inspect queues,
//! and a consumer running in the background of a test.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use warren::broker::Publisher;
use warren::config::ConsumerConfigBuilder;
use warren::lapin::options::{
    BasicAckOptions, BasicGetOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use warren::lapin::types::{AMQPValue, FieldTable};
use warren::lapin::{self, BasicProperties, Connection, message::Delivery};
use warren::telemetry::StatsHandle;
use warren::{Consumer, ConsumerConfig, Error, Outgoing};

use crate::db::{Backend, TestDb};
use crate::handlers::{EVENT, Job, routes, test_config};
use crate::{amqp_url, unique, wait_for};

/// A test's broker names and a connection to inspect and publish with.
pub struct TestBroker {
    /// The test's topic exchange, where `publish` sends.
    pub exchange: String,
    /// The test consumer's work queue.
    pub queue: String,
    /// The test consumer's name (its inbox key and its queues' stem).
    pub name: String,
    /// The connection the test inspects and publishes with.
    pub connection: Arc<Connection>,
    /// A publisher with confirms on `connection`.
    pub publisher: Publisher,
    /// Queues the test declared besides the consumer's, deleted by `cleanup`.
    pub extra_queues: Mutex<Vec<String>>,
}

impl TestBroker {
    /// Names unique to this test, and a connection to the broker `AMQP_URL` names.
    pub async fn new() -> Self {
        let base = unique("wt");
        let connection = Arc::new(
            warren::broker::connect(&amqp_url(), "warren tests")
                .await
                .unwrap(),
        );
        TestBroker {
            exchange: format!("{base}.events"),
            queue: format!("{base}.jobs"),
            name: format!("{base}-consumer"),
            publisher: Publisher::new(Arc::clone(&connection)),
            connection,
            extra_queues: Mutex::new(Vec::new()),
        }
    }

    /// The default test consumer configuration.
    pub fn config(&self) -> ConsumerConfig {
        self.builder().build().unwrap()
    }

    /// The default test consumer configuration, to change before building.
    pub fn builder(&self) -> ConsumerConfigBuilder {
        test_config(&self.name, &self.queue, &self.exchange)
    }

    /// Declares a queue bound to the test exchange with `out.#`, where outbox events
    /// land, and returns its name.
    pub async fn capture(&self) -> String {
        let config = self.downstream_config();
        for q in warren::topology::Topology::for_consumer(&config).queue_names() {
            self.track_queue(q);
        }
        self.declare_config(&config).await;
        config.queue().to_owned()
    }

    /// The configuration of a downstream consumer of the capture queue.
    pub fn downstream_config(&self) -> ConsumerConfig {
        test_config(
            &format!("{}-downstream", self.name),
            &format!("{}.capture", self.queue),
            &self.exchange,
        )
        .bind(&self.exchange, ["out.#"])
        .build()
        .unwrap()
    }

    /// Remembers another queue to delete at cleanup.
    pub fn track_queue(&self, name: &str) {
        self.extra_queues.lock().unwrap().push(name.to_owned());
    }

    /// Declares a durable queue `name` with `arguments` (`x-queue-type`,
    /// `x-overflow`, ...), removed at cleanup.
    pub async fn declare_queue(&self, name: &str, arguments: &[(&str, AMQPValue)]) {
        self.track_queue(name);
        let mut table = FieldTable::default();
        for (key, value) in arguments {
            table.insert((*key).into(), value.clone());
        }
        let channel = self.connection.create_channel().await.unwrap();
        channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                table,
            )
            .await
            .unwrap();
        let _ = channel.close(200, "declared".into()).await;
    }

    /// The test consumer's dead-letter queue.
    pub fn dead_letter_queue(&self) -> String {
        warren::topology::dead_letter_queue_name(&self.queue)
    }

    /// Declares the default test consumer's topology, so publishes before the
    /// consumer starts are routed.
    pub async fn declare(&self) {
        self.declare_config(&self.config()).await;
    }

    /// Declares the topology of the consumer `config` describes.
    pub async fn declare_config(&self, config: &ConsumerConfig) {
        let channel = self.connection.create_channel().await.unwrap();
        warren::broker::declare(&channel, &warren::topology::Topology::for_consumer(config))
            .await
            .unwrap();
        let _ = channel.close(200, "ok".into()).await;
    }

    /// Builds a valid message of version 1.
    pub fn message(job: &Job) -> Outgoing {
        Outgoing::new(EVENT, 1, job).unwrap()
    }

    /// Publishes `message` to the test exchange with the test consumer's routing key,
    /// confirmed.
    pub async fn publish(&self, message: &Outgoing) {
        self.publisher
            .publish(&self.exchange, "test.job", message)
            .await
            .unwrap();
    }

    /// Publishes straight to `queue`, through the default exchange.
    pub async fn publish_to(&self, queue: &str, message: &Outgoing) {
        self.publisher.publish("", queue, message).await.unwrap();
    }

    /// Publishes bytes as they are, with `properties`, where `publish` would.
    pub async fn publish_raw(&self, body: &[u8], properties: BasicProperties) {
        self.publisher
            .publish_raw(&self.exchange, "test.job", body, properties)
            .await
            .unwrap();
    }

    /// Ready messages in `queue` (not counting unacked ones).
    pub async fn ready(&self, queue: &str) -> u32 {
        self.passive(queue).await.message_count()
    }

    /// Consumers subscribed to `queue`.
    pub async fn consumers(&self, queue: &str) -> u32 {
        self.passive(queue).await.consumer_count()
    }

    async fn passive(&self, queue: &str) -> lapin::Queue {
        // A fresh channel: a passive declare of a missing queue closes its channel.
        let channel = self.connection.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = channel.close(200, "ok".into()).await;
        q
    }

    /// Takes every message from `queue` (acking each).
    pub async fn drain(&self, queue: &str) -> Vec<Delivery> {
        let channel = self.connection.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Some(msg) = channel
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            msg.delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .unwrap();
            out.push(msg.delivery);
        }
        let _ = channel.close(200, "ok".into()).await;
        out
    }

    /// Takes every dead letter of the test's queue, by message id.
    pub async fn dead_letters(&self) -> HashMap<String, BasicProperties> {
        self.drain(&self.dead_letter_queue())
            .await
            .into_iter()
            .map(|d| {
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                (id, d.properties)
            })
            .collect()
    }

    /// Deletes `queue`, if it exists.
    pub async fn delete_queue(&self, queue: &str) {
        let channel = self.connection.create_channel().await.unwrap();
        let _ = channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
        let _ = channel.close(200, "ok".into()).await;
    }

    /// Deletes the test's queues and exchange and closes the connection.
    pub async fn cleanup(self) {
        let mut queues: Vec<String> = warren::topology::Topology::for_consumer(&self.config())
            .queue_names()
            .map(String::from)
            .collect();
        queues.extend(self.extra_queues.lock().unwrap().drain(..));
        for q in &queues {
            self.delete_queue(q).await;
        }
        let channel = self.connection.create_channel().await.unwrap();
        let _ = channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.connection.close(200, "ok".into()).await;
    }
}

/// A consumer running in the background of a test.
pub struct Running {
    /// The consumer's counters.
    pub stats: StatsHandle,
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<(), Error>>,
}

impl Running {
    /// Runs `consumer` against the broker `AMQP_URL` names until stopped.
    pub fn start<S: warren::store::ConsumerStore>(consumer: Consumer<S>) -> Self {
        Self::spawn(consumer.stats(), |stopped| async move {
            consumer.run(&amqp_url(), stopped).await
        })
    }

    /// Starts `consumer` with an outbox relay beside it (`run_with_relay`).
    pub fn start_with_relay<S: warren::store::OutboxStore + warren::store::ConsumerStore>(
        consumer: Consumer<S>,
        relay: warren::RelayConfig,
    ) -> Self {
        Self::spawn(consumer.stats(), |stopped| async move {
            consumer.run_with_relay(&amqp_url(), relay, stopped).await
        })
    }

    /// Spawns what `run` makes of the shutdown future.
    fn spawn<F, Fut>(stats: StatsHandle, run: F) -> Self
    where
        F: FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
        Fut: Future<Output = Result<(), Error>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(run(Box::pin(async {
            let _ = stopped.await;
        })));
        Running {
            stats,
            stop: Some(stop),
            handle,
        }
    }

    /// True while `run` has not returned (nothing stopped the consumer).
    pub fn is_running(&self) -> bool {
        !self.handle.is_finished()
    }

    /// Requests a graceful shutdown and waits for `run` to return.
    pub async fn stop(mut self) -> Result<(), Error> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(60), self.handle)
            .await
            .expect("consumer did not stop within 60 s")
            .expect("consumer task panicked")
    }

    /// Whether the consumer has ended (by an error, or stopped).
    pub fn finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits until `applied + duplicates + dead_lettered` reaches `n`.
    pub async fn settled(&self, n: u64, timeout: Duration) -> bool {
        let stats = self.stats.clone();
        wait_for(timeout, move || {
            let s = stats.snapshot();
            async move { s.applied + s.duplicates + s.dead_lettered >= n }
        })
        .await
    }
}

/// The name of the policy the broker applies to `queue` (None without one, or
/// without the queue), read off `rabbitmqctl` on the broker's host.
pub async fn queue_policy(queue: &str) -> Option<String> {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "--no-table-headers", "name", "policy"])
        .output()
        .await
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl list_queues: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| {
            let (name, policy) = line.split_once('\t')?;
            (name == queue && !policy.trim().is_empty()).then(|| policy.trim().to_owned())
        })
}

/// The consumer tags subscribed to `queue`, waiting ones of a single-active-
/// consumer queue included, from `rabbitmqctl`: a consumer stopped and
/// replaced shows as a new tag.
pub async fn consumer_tags(queue: &str) -> BTreeSet<String> {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args([
            "list_consumers",
            "-q",
            "--no-table-headers",
            "queue_name",
            "consumer_tag",
        ])
        .output()
        .await
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl list_consumers: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let (name, tag) = line.split_once('\t')?;
            (name == queue).then(|| tag.trim().to_owned())
        })
        .collect()
}

/// Where the messages of the queues named `prefix...` are, for a failed wait
/// to print: each queue's ready and unacked messages and its consumers, from
/// `rabbitmqctl` (a message held unacked on a channel nobody reads shows here
/// and nowhere else).
pub async fn queue_report(prefix: &str) -> String {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages_ready",
            "messages_unacknowledged",
            "consumers",
        ])
        .output()
        .await
        .expect("rabbitmqctl runs");
    let rows: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| line.starts_with(prefix))
        .map(|line| line.replace('\t', " "))
        .collect();
    format!(
        "queues (name ready unacked consumers):\n  {}",
        rows.join("\n  ")
    )
}

/// Runs the test's default consumer until `n` deliveries have settled (applied,
/// duplicate or dead-lettered), stops it, and returns its counters.
pub async fn consume_until<B: Backend>(
    db: &TestDb<B>,
    broker: &TestBroker,
    n: u64,
) -> warren::telemetry::ConsumerStats {
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        running.settled(n, Duration::from_secs(30)).await,
        "not settled: {:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    stats
}

/// An ingester running in the background of a test.
pub struct Ingesting {
    stop: oneshot::Sender<()>,
    handle: JoinHandle<Result<(), Error>>,
}

impl Ingesting {
    /// Runs `ingester` against the broker `AMQP_URL` names until stopped.
    pub fn start<S>(ingester: warren_admin::Ingester<S>) -> Self
    where
        S: warren::store::DeadLetterStore
            + warren::store::SigningKey
            + warren::store::Journal
            + Send
            + Sync
            + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            ingester
                .run(&amqp_url(), async {
                    let _ = stopped.await;
                })
                .await
        });
        Self { stop, handle }
    }

    /// Stops the ingester and waits for it, failing the test if it does not end cleanly
    /// within 30 s.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("the ingester stops within 30 s")
            .expect("the ingester task does not panic")
            .expect("the ingester ends without an error");
    }
}
