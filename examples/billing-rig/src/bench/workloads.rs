//! The workloads, each draining a queue filled before it starts (or an outbox),
//! timed from the first moment it can take a message to the last one settled.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::{Semaphore, watch};
use warren::broker::BatchItem;
use warren::broker::Publisher;
use warren::config::ConsumerConfigBuilder;
use warren::lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use warren::lapin::types::FieldTable;
use warren::store::OutboxStore;
use warren::topology::QueueType;
use warren::topology::Topology;
use warren::{Consumer, ConsumerConfig, Outgoing, Registry, Relay, RelayConfig, lapin};

use super::Latency;
use super::dbs::{BenchDb, one_insert, one_insert_batch, one_insert_failing};
use super::probe::{CpuTimes, Settled, percentile};
use billing_service::handlers::{CONSUMER, PAID_V1, RECORDED};
use billing_service::service::{self, Names, Settings};
use billing_service::stream::{Form, Planned, StreamSpec, plan_in};

/// What every workload of one run shares.
pub(crate) struct Env {
    pub amqp_url: String,
    pub connection: Arc<lapin::Connection>,
    pub publisher: Publisher,
    /// Unique to the run: queue names and prefixes start with it.
    pub tag: String,
    pub settings: Settings,
}

/// A failure of the benchmark's own setup.
fn fail<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// `n` unique, valid invoice-paid events (v1), as the publisher sends them.
pub(crate) fn invoices(n: usize) -> Vec<Planned> {
    invoices_in(Form::Warren, n)
}

/// `n` unique, valid invoice-paid events (v1), each in `form`.
pub(crate) fn invoices_in(form: Form, n: usize) -> Vec<Planned> {
    plan_in(
        form,
        &StreamSpec {
            count: n,
            duplicates: 0.0,
            v2: 0.0,
            poison: 0,
            flaky: 0,
            foreign: 0.0,
            seed: fastrand::u64(..),
        },
    )
    .messages
}

/// Publishes `messages` to `exchange` (or straight to the queue `routing` names,
/// through the default exchange), each batch confirmed.
pub(crate) async fn publish(
    env: &Env,
    exchange: &str,
    routing: Option<&str>,
    messages: &[Planned],
) -> Result<(), String> {
    for chunk in messages.chunks(500) {
        let items: Vec<BatchItem<'_>> = chunk
            .iter()
            .map(|m| BatchItem {
                exchange,
                routing_key: routing.unwrap_or(&m.routing_key),
                body: &m.body,
                properties: m.properties.clone(),
            })
            .collect();
        for r in env.publisher.publish_batch(&items).await {
            r.map_err(|e| format!("cannot fill the queue: {e}"))?;
        }
    }
    Ok(())
}

/// The configuration of the warren consumer of row 3, on `queue`.
pub(crate) fn consumer_config(env: &Env, queue: &str) -> Result<ConsumerConfig, String> {
    consumer_builder(env, queue)
        .build()
        .map_err(|e| e.to_string())
}

fn consumer_builder(env: &Env, queue: &str) -> ConsumerConfigBuilder {
    ConsumerConfig::builder(format!("bench-{}", env.tag), queue)
        .with_prefetch(env.settings.prefetch)
        .with_concurrency(env.settings.concurrency)
        .with_batch_size(env.settings.batch_size)
        .with_queue_type(QueueType::Quorum)
}

/// Declares `queue` (quorum, with its retry tiers and dead-letter queue) and
/// fills it with `messages`.
pub(crate) async fn filled_queue(
    env: &Env,
    queue: &str,
    messages: &[Planned],
) -> Result<Topology, String> {
    let topology = Topology::for_consumer(&consumer_config(env, queue)?);
    warren::broker::declare_on(&env.connection, &topology)
        .await
        .map_err(|e| format!("cannot declare {queue}: {e}"))?;
    publish(env, "", Some(queue), messages).await?;
    Ok(topology)
}

/// How often the bare drain acks: every 64 deliveries, or every half prefetch
/// when that is less (the broker sends no more than the prefetch unacked).
pub(crate) fn bare_ack_every(prefetch: u16) -> usize {
    (usize::from(prefetch) / 2).clamp(1, 64)
}

/// A channel of its own with the run's prefetch, subscribed to `queue`: how
/// rows 1 and 2 consume without warren.
async fn subscribe(
    env: &Env,
    queue: &str,
    row: &str,
) -> Result<(lapin::Channel, lapin::Consumer), String> {
    let channel = env
        .connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    channel
        .basic_qos(env.settings.prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let deliveries = channel
        .basic_consume(
            queue.into(),
            format!("bench-{row}-{}", env.tag).as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((channel, deliveries))
}

/// Row 1: a lapin consumer with the same prefetch that touches no database and
/// acks with `multiple` every [`bare_ack_every`] deliveries.
pub(crate) async fn bare_drain(env: &Env, queue: &str, n: usize) -> Result<Duration, String> {
    let start = Instant::now();
    let (channel, mut deliveries) = subscribe(env, queue, "bare").await?;
    let mut seen = 0;
    let every = bare_ack_every(env.settings.prefetch);
    while let Some(Ok(d)) = deliveries.next().await {
        seen += 1;
        if seen % every == 0 || seen == n {
            d.acker
                .ack(BasicAckOptions { multiple: true })
                .await
                .map_err(|e| e.to_string())?;
        }
        if seen == n {
            break;
        }
    }
    let elapsed = start.elapsed();
    let _ = channel.close(200, "done".into()).await;
    Ok(elapsed)
}

/// Row 2: the pattern of the reference texts written by hand: for each
/// delivery, one transaction with the inbox row (`ON CONFLICT DO NOTHING`) and
/// the effect, then the ack; `concurrency` deliveries at once, on a pool as large
/// as warren's.
pub(crate) async fn seed_pattern<B: BenchDb>(
    env: &Env,
    pool: &sqlx::Pool<B>,
    queue: &str,
    n: usize,
) -> Result<Duration, String> {
    let workers = Arc::new(Semaphore::new(env.settings.concurrency));
    let done = Arc::new(AtomicUsize::new(0));
    let (finished_tx, mut finished) = watch::channel(false);
    let start = Instant::now();
    let (channel, mut deliveries) = subscribe(env, queue, "seed").await?;
    let consumer = format!("seed-{}", env.tag);
    let mut taken = 0;
    while taken < n {
        let permit = Arc::clone(&workers)
            .acquire_owned()
            .await
            .expect("never closed");
        let Some(Ok(d)) = deliveries.next().await else {
            return Err("the seed pattern's subscription ended".into());
        };
        taken += 1;
        let (pool, consumer, done, finished_tx) = (
            pool.clone(),
            consumer.clone(),
            Arc::clone(&done),
            finished_tx.clone(),
        );
        tokio::spawn(async move {
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            // A failure would be retried by redelivery; here none is expected.
            B::seed_apply(&pool, &consumer, &id)
                .await
                .expect("the seed transaction commits");
            d.acker.ack(BasicAckOptions::default()).await.expect("ack");
            drop(permit);
            if done.fetch_add(1, Ordering::SeqCst) + 1 == n {
                let _ = finished_tx.send(true);
            }
        });
    }
    let _ = finished.wait_for(|f| *f).await;
    let elapsed = start.elapsed();
    let _ = channel.close(200, "done".into()).await;
    Ok(elapsed)
}

/// Where an end-to-end latency went, each leg's p50 and p99: from the
/// publish to the delivery's settling (broker in, batch, commit, ack); from
/// there to the relay publishing its event (the relay's wake, its take of the
/// row); from there to the event's arrival downstream (the broker, the
/// publisher confirm). The relay's stamp is in milliseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Legs {
    pub consumer: (Duration, Duration),
    pub relay: (Duration, Duration),
    pub downstream: (Duration, Duration),
}

/// Publishes `messages` to `exchange` at `rate` a second, a tick's worth every
/// 10 ms, each batch confirmed; returns when each was published, by id.
async fn publish_paced(
    env: &Env,
    exchange: &str,
    messages: &[Planned],
    rate: f64,
) -> Result<HashMap<String, Instant>, String> {
    let tick = Duration::from_millis(10);
    let per_tick = rate * tick.as_secs_f64();
    let total = messages.len();
    let mut published: HashMap<String, Instant> = HashMap::with_capacity(total);
    let mut interval = tokio::time::interval(tick);
    let (mut sent, mut due) = (0usize, 0.0f64);
    while sent < total {
        interval.tick().await;
        due += per_tick;
        let upto = (due.floor() as usize).min(total);
        if upto > sent {
            let now = Instant::now();
            for m in &messages[sent..upto] {
                let id = m
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                published.insert(id, now);
            }
            publish(env, exchange, None, &messages[sent..upto]).await?;
            sent = upto;
        }
    }
    Ok(published)
}

/// Waits until `applied` reaches `n`, from the moment `consuming` turns true
/// (when `on_consuming` runs).
async fn drained(
    stats: &warren::telemetry::StatsHandle,
    n: usize,
    on_consuming: &(dyn Fn() + Sync),
) -> Duration {
    while !stats.health().consuming {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    on_consuming();
    let start = Instant::now();
    while {
        let s = stats.snapshot();
        s.applied + s.dead_lettered
    } < n as u64
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    start.elapsed()
}

/// Row 3: warren's consumer, the handler writing one row; for row 6 with
/// another batch isolation, or failing for one message in fifty.
/// `on_consuming` runs once the consumer has subscribed.
pub(crate) async fn warren_one_insert<B: BenchDb>(
    env: &Env,
    store: B::S,
    queue: &str,
    n: usize,
    failing: bool,
    configure: &(dyn Fn(ConsumerConfigBuilder) -> ConsumerConfigBuilder + Sync),
    on_consuming: &(dyn Fn() + Sync),
) -> Result<(Duration, warren::telemetry::ConsumerStats), String> {
    let routes: Registry<B> = if failing {
        Registry::new().route(PAID_V1, 1, one_insert_failing::<B>)
    } else {
        Registry::new().route(PAID_V1, 1, one_insert::<B>)
    };
    let config = configure(consumer_builder(env, queue))
        .build()
        .map_err(|e| e.to_string())?;
    let consumer = Consumer::new(config, store, routes);
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let url = env.amqp_url.clone();
    let task = tokio::spawn(async move {
        consumer
            .run(&url, async {
                let _ = stopped.await;
            })
            .await
    });
    let elapsed = drained(&stats, n, on_consuming).await;
    let _ = stop.send(());
    task.await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok((elapsed, stats.snapshot()))
}

/// Row 3b: warren's consumer with a batch handler writing one insert for all
/// new messages of a transaction.
pub(crate) async fn warren_batch_insert<B: BenchDb>(
    env: &Env,
    store: B::S,
    queue: &str,
    n: usize,
) -> Result<(Duration, warren::telemetry::ConsumerStats), String> {
    warren_batch_insert_with::<B>(env, store, queue, n, &|| {}).await
}

/// Row 3b, `on_consuming` run once the consumer has subscribed.
pub(crate) async fn warren_batch_insert_with<B: BenchDb>(
    env: &Env,
    store: B::S,
    queue: &str,
    n: usize,
    on_consuming: &(dyn Fn() + Sync),
) -> Result<(Duration, warren::telemetry::ConsumerStats), String> {
    let routes: Registry<B> = Registry::new().route_batch(PAID_V1, 1, one_insert_batch::<B>);
    let config = consumer_config(env, queue)?;
    let consumer = Consumer::new(config, store, routes);
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let url = env.amqp_url.clone();
    let task = tokio::spawn(async move {
        consumer
            .run(&url, async {
                let _ = stopped.await;
            })
            .await
    });
    let elapsed = drained(&stats, n, on_consuming).await;
    let _ = stop.send(());
    task.await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok((elapsed, stats.snapshot()))
}

/// Row 7: what the database itself costs for row 3's rows: the inbox claims
/// and effects of `messages`, `per_transaction` a transaction (32 for row 7,
/// row 3b's average for row 7b), each set-based in one statement,
/// `concurrency` transactions at once on a plain pool. No broker.
pub(crate) async fn database_floor<B: BenchDb>(
    env: &Env,
    pool: &sqlx::Pool<B>,
    messages: &[Planned],
    per_transaction: usize,
) -> Result<Duration, String> {
    let ids: Vec<String> = messages
        .iter()
        .map(|m| {
            m.properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default()
        })
        .collect();
    let consumer = format!("floor-{}", env.tag);
    let chunks: Vec<Vec<String>> = ids
        .chunks(per_transaction.max(1))
        .map(<[String]>::to_vec)
        .collect();
    let start = Instant::now();
    let results = futures_util::stream::iter(chunks)
        .map(|chunk| {
            let (pool, consumer) = (pool.clone(), consumer.clone());
            async move { B::floor_apply(&pool, &consumer, &chunk).await }
        })
        .buffer_unordered(env.settings.concurrency)
        .collect::<Vec<_>>()
        .await;
    let elapsed = start.elapsed();
    for r in results {
        r.map_err(|e| format!("the floor's transaction failed: {e}"))?;
    }
    Ok(elapsed)
}

/// billing itself, running: both consumers and the relay.
pub(crate) struct Billing {
    pub names: Names,
    running: service::Running,
    stop: watch::Sender<bool>,
}

/// Starts billing on `store` under a prefix of its own, its queue filled with
/// `messages` first.
pub(crate) async fn start_billing<B: BenchDb>(
    env: &Env,
    store: B::S,
    prefix: &str,
    messages: &[Planned],
) -> Result<Billing, String> {
    let names = Names::new(prefix);
    service::declare(&env.amqp_url, &names, &env.settings).await?;
    publish(env, &names.exchange(), None, messages).await?;
    let (stop, stopped) = watch::channel(false);
    let running = service::start::<B>(
        store,
        &env.amqp_url,
        &names,
        &env.settings,
        RelayConfig::new(CONSUMER),
        stopped,
    )
    .await?;
    Ok(Billing {
        names,
        running,
        stop,
    })
}

impl Billing {
    /// Waits until billing's invoice consumer has subscribed.
    pub(crate) async fn wait_consuming(&self) {
        while !self.running.stats.health().consuming {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Row 4: how long the filled queue takes to drain.
    pub(crate) async fn drain(&self, n: usize) -> Duration {
        drained(&self.running.stats, n, &|| {}).await
    }

    /// Publishes invoices at `rate` a second for `period` and returns the
    /// latency of each, from just before its publish to its settling (commit,
    /// then ack).
    pub(crate) async fn latencies(
        &self,
        env: &Env,
        settled: &Settled,
        rate: f64,
        period: Duration,
    ) -> Result<Latency, String> {
        let before = self.running.stats.snapshot().applied;
        let total = (rate * period.as_secs_f64()).round() as usize;
        let messages = invoices(total);
        settled.start();
        let published = publish_paced(env, &self.names.exchange(), &messages, rate).await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.running.stats.snapshot().applied < before + total as u64 {
            if Instant::now() > deadline {
                return Err("the latency run did not settle within 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The last "message processed" event follows the counter closely.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let settled = settled.take();
        let mut samples: Vec<Duration> = published
            .iter()
            .filter_map(|(id, at)| settled.get(id).map(|s| s.saturating_duration_since(*at)))
            .collect();
        Ok(Latency {
            rate,
            samples: samples.len(),
            p50: percentile(&mut samples, 50.0),
            p99: percentile(&mut samples, 99.0),
        })
    }

    /// Publishes invoices at `rate` a second for `period` and returns the
    /// latency of each from just before its publish to the arrival of the
    /// `invoice-payment-recorded` event it caused at a consumer downstream
    /// (a queue of the benchmark's bound to billing's exchange): through the
    /// inbox, the effect, the outbox and the relay; and where that time went.
    pub(crate) async fn end_to_end(
        &self,
        env: &Env,
        settled: &Settled,
        rate: f64,
        period: Duration,
    ) -> Result<(Latency, Legs), String> {
        let sink = format!("{}.e2e-sink", self.names.prefix);
        let channel = env
            .connection
            .create_channel()
            .await
            .map_err(fail("channel"))?;
        channel
            .queue_declare(
                sink.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(fail("downstream queue"))?;
        channel
            .queue_bind(
                sink.as_str().into(),
                self.names.exchange().as_str().into(),
                RECORDED.into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .map_err(fail("downstream binding"))?;
        let mut events = channel
            .basic_consume(
                sink.as_str().into(),
                format!("e2e-{}", env.tag).as_str().into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(fail("downstream consumer"))?;
        let total = (rate * period.as_secs_f64()).round() as usize;
        // Each event's arrival, and when the relay published it (its
        // published-at-ms header, by this host's clock).
        type Arrivals = HashMap<String, (Instant, Option<i64>)>;
        let arrived: Arc<std::sync::Mutex<Arrivals>> = Arc::default();
        let recorder = Arc::clone(&arrived);
        let receiving = tokio::spawn(async move {
            while let Some(Ok(event)) = events.next().await {
                let at = Instant::now();
                let cause = serde_json::from_slice::<serde_json::Value>(&event.data)
                    .ok()
                    .and_then(|v| v.get("causationId")?.as_str().map(str::to_owned));
                let relayed = event.properties.headers().as_ref().and_then(|h| {
                    warren::amqp::header_int(h, warren::headers::HEADER_PUBLISHED_AT_MS)
                });
                if let Some(cause) = cause {
                    recorder
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(cause, (at, relayed));
                }
            }
        });
        let messages = invoices(total);
        // An instant and the wall clock read together, to put the relay's
        // stamps on the axis of the instants measured here.
        let (origin, origin_ms) = (Instant::now(), chrono::Utc::now().timestamp_millis());
        settled.start();
        let published = publish_paced(env, &self.names.exchange(), &messages, rate).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        let count = || {
            arrived
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .len()
        };
        while published.is_ok() && count() < total && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        receiving.abort();
        let _ = channel.close(200, "done".into()).await;
        let settled = settled.take();
        let published = published?;
        let arrived = arrived
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if arrived.len() < total {
            return Err(format!(
                "end to end: {} of {total} events arrived downstream within 60 s",
                arrived.len()
            ));
        }
        let at_ms = |instant: Instant| {
            origin_ms as f64 + instant.saturating_duration_since(origin).as_secs_f64() * 1e3
        };
        let span = |ms: f64| Duration::from_secs_f64(ms.max(0.0) / 1e3);
        let (mut whole, mut consumer, mut relay, mut downstream) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (id, sent) in &published {
            let Some((arrival, relayed)) = arrived.get(id) else {
                continue;
            };
            whole.push(arrival.saturating_duration_since(*sent));
            if let (Some(done), Some(relayed)) = (settled.get(id), relayed) {
                consumer.push(done.saturating_duration_since(*sent));
                relay.push(span(*relayed as f64 - at_ms(*done)));
                downstream.push(span(at_ms(*arrival) - *relayed as f64));
            }
        }
        let leg =
            |samples: &mut Vec<Duration>| (percentile(samples, 50.0), percentile(samples, 99.0));
        Ok((
            Latency {
                rate,
                samples: whole.len(),
                p50: percentile(&mut whole, 50.0),
                p99: percentile(&mut whole, 99.0),
            },
            Legs {
                consumer: leg(&mut consumer),
                relay: leg(&mut relay),
                downstream: leg(&mut downstream),
            },
        ))
    }

    /// Outbox rows still waiting for the relay.
    pub(crate) async fn outbox_pending<S: OutboxStore>(store: &S) -> i64 {
        store
            .outbox_backlog()
            .await
            .map(|(pending, _)| pending)
            .unwrap_or(-1)
    }

    /// Stops billing and removes its queues.
    pub(crate) async fn stop(self, env: &Env) {
        let _ = self.stop.send(true);
        let _ = self.running.task.await;
        for topology in [
            service::topology(&self.names, &env.settings),
            service::credit_topology(&self.names, &env.settings),
        ]
        .into_iter()
        .flatten()
        {
            let _ = warren::broker::delete(&env.connection, &topology).await;
        }
        // The dead-letter ingester's side queue is its own, not the topology's.
        let mut side = Topology::default();
        side.queues.push(warren::topology::QueueSpec::new(
            warren_admin::unstored_queue_name(&self.names.queue()),
            env.settings.queue_type,
        ));
        let _ = warren::broker::delete(&env.connection, &side).await;
    }
}

/// Row 5: the relay draining `n` rows written to the outbox beforehand, against
/// the same messages published by hand in batches of the relay's size, each
/// batch's confirms awaited (row 5a). Returns (relay, bare), each with the
/// CPU the processes spent.
pub(crate) async fn relay_against_bare<B: BenchDb>(
    env: &Env,
    store: B::S,
    n: usize,
) -> Result<((Duration, CpuTimes), (Duration, CpuTimes)), String> {
    let exchange = format!("bench-{}.out", env.tag);
    let queue = format!("bench-{}.out-sink", env.tag);
    let channel = env
        .connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    channel
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(fail("exchange"))?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .map_err(fail("queue"))?;
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .map_err(fail("binding"))?;

    let events: Vec<Outgoing> = (0..n)
        .map(|i| {
            Outgoing::new("bench.recorded.v1", 1, &serde_json::json!({ "n": i })).expect("JSON")
        })
        .collect();
    let pool = B::pool(&store);
    for chunk in events.chunks(500) {
        let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
        for e in chunk {
            warren::outbox::enqueue::<B>(&mut tx, &exchange, "bench.recorded", e)
                .await
                .map_err(|e| e.to_string())?;
        }
        tx.commit().await.map_err(|e| e.to_string())?;
    }
    let config = RelayConfig::new(format!("bench-{}", env.tag));
    let batch = config.batch_size;
    let relay = Relay::new(store, config);
    let stats = relay.stats_handle();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let url = env.amqp_url.clone();
    let start = Instant::now();
    let relay_cpu = CpuTimes::now();
    let task = tokio::spawn(async move {
        relay
            .run(&url, async {
                let _ = stopped.await;
            })
            .await
    });
    while stats.snapshot().published < n as u64 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let relay_time = start.elapsed();
    let relay_cpu = CpuTimes::now().since(&relay_cpu);
    let _ = stop.send(());
    task.await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;

    let bodies: Vec<Vec<u8>> = events.iter().map(Outgoing::body).collect();
    let start = Instant::now();
    let bare_cpu = CpuTimes::now();
    for (chunk, bodies) in events.chunks(batch).zip(bodies.chunks(batch)) {
        let items: Vec<BatchItem<'_>> = chunk
            .iter()
            .zip(bodies)
            .map(|(m, body)| BatchItem {
                exchange: &exchange,
                routing_key: "bench.recorded",
                body,
                properties: m.properties(),
            })
            .collect();
        for r in env.publisher.publish_batch(&items).await {
            r.map_err(fail("bare publish"))?;
        }
    }
    let bare_time = start.elapsed();
    let bare_cpu = CpuTimes::now().since(&bare_cpu);
    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    let _ = channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
    Ok(((relay_time, relay_cpu), (bare_time, bare_cpu)))
}
