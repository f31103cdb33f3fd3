//! Per-entity order: partitioned queues shared by two instances through leases,
//! ordered lanes inside each, and version gates in the business transaction.
//! Counted: every version applied at most once, in version order per entity.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use warren::broker::BatchItem;
use warren::lapin::options::ExchangeDeleteOptions;
use warren::retry::RetryPolicy;
use warren::store::Leases;
use warren::version::{Verdict, VersionMode};
use warren::{Consumer, ConsumerConfig, HandlerError, Message, Outgoing, Registry, Tx};

use crate::util::{APPLIED_TABLE, Backend, Running, TEST_TIERS, TestBroker, TestDb, wait_for};

on_all_backends!(
    in_order_stream_on_two_instances_applies_each_version_once_in_order,
    shuffled_stream_with_duplicates_ends_at_the_highest_version,
    strict_sequence_waits_for_a_version_held_in_a_long_tier,
    a_gap_that_never_fills_is_dead_lettered_as_version_gap,
    strict_dead_letters_are_replayed_in_version_order,
);

const UPDATE: &str = "test.update";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Update {
    customer: String,
    version: i64,
    /// Fail transiently on the first attempt, asking for this long a wait.
    #[serde(default)]
    hold_ms: u64,
}

async fn record<B: Backend>(
    tx: &mut Tx<B>,
    update: &Update,
    message_id: &str,
) -> Result<(), HandlerError> {
    // The gate locked the entity's version row: no other transaction of this
    // customer runs between reading the next sequence number and the insert.
    B::record_version(tx, &update.customer, update.version, message_id).await?;
    Ok(())
}

async fn gated<B: Backend>(
    msg: &Message<Update>,
    tx: &mut Tx<B>,
    mode: VersionMode,
) -> Result<(), HandlerError> {
    let u = &msg.payload;
    // A flaky customer's first version fails twice: later versions overtake it
    // while it waits in the retry tiers.
    if u.customer.starts_with("cus_flaky") && u.version == 1 && msg.attempt <= 3 {
        return Err(
            HandlerError::transient("flaky customer").retry_after(Duration::from_millis(400))
        );
    }
    if u.hold_ms > 0 && msg.attempt == 1 {
        return Err(HandlerError::transient("held").retry_after(Duration::from_millis(u.hold_ms)));
    }
    match tx
        .check_version("test", &u.customer, u.version, mode)
        .await?
    {
        Verdict::Stale { .. } => Ok(()),
        Verdict::Apply { .. } => record(tx, u, &msg.meta.message_id).await,
    }
}

async fn latest<B: Backend>(msg: Message<Update>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    gated(&msg, tx, VersionMode::LatestWins).await
}

async fn strict<B: Backend>(msg: Message<Update>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    gated(&msg, tx, VersionMode::Strict).await
}

fn update(customer: &str, version: i64) -> Outgoing {
    let u = Update {
        customer: customer.to_owned(),
        version,
        hold_ms: 0,
    };
    Outgoing::new(UPDATE, 1, &u)
        .unwrap()
        .with_partition_key(customer)
}

/// A partitioned test consumer: 4 partitions, 3 s leases.
fn partitioned(broker: &TestBroker) -> ConsumerConfig {
    broker
        .builder()
        .partitioned(format!("{}.hash", broker.queue), 4)
        .with_lease_ttl(Duration::from_secs(3))
        .with_prefetch(32)
        .with_concurrency(8)
        .build()
        .unwrap()
}

/// Publishes `messages` in order, a batch of confirms at a time, so that a
/// customer's versions follow each other closely.
async fn publish_all(broker: &TestBroker, messages: &[Outgoing]) {
    for chunk in messages.chunks(200) {
        let bodies: Vec<Vec<u8>> = chunk.iter().map(Outgoing::body).collect();
        let items: Vec<BatchItem<'_>> = chunk
            .iter()
            .zip(&bodies)
            .map(|(m, body)| BatchItem {
                exchange: &broker.exchange,
                routing_key: "test.update",
                body,
                properties: m.properties(),
            })
            .collect();
        for r in broker.publisher.publish_batch(&items).await {
            r.unwrap();
        }
    }
}

/// Rows of `test_applied`: customer -> versions in application order.
async fn applied<B: Backend>(db: &TestDb<B>) -> BTreeMap<String, Vec<i64>> {
    let rows = B::applied_rows(&db.store).await;
    let mut by_customer: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for (c, v, s) in rows {
        by_customer.entry(c).or_default().push((s, v));
    }
    by_customer
        .into_iter()
        .map(|(c, rows)| {
            let seqs: Vec<i64> = rows.iter().map(|r| r.0).collect();
            assert_eq!(
                seqs,
                (1..=rows.len() as i64).collect::<Vec<_>>(),
                "seq of {c}"
            );
            (c, rows.into_iter().map(|r| r.1).collect())
        })
        .collect()
}

/// Two instances of the partitioned consumer, started and waited for until
/// each holds two partitions.
async fn two_instances<B: Backend>(
    db: &TestDb<B>,
    broker: &TestBroker,
    config: &ConsumerConfig,
) -> [Running; 2] {
    let routes = || Registry::<B>::new().route(UPDATE, 1, latest::<B>);
    let a = Running::start(Consumer::new(config.clone(), db.store.clone(), routes()));
    let b = Running::start(Consumer::new(config.clone(), db.store.clone(), routes()));
    let store = db.store.clone();
    let name = config.name().to_owned();
    let split = wait_for(Duration::from_secs(30), || {
        let store = store.clone();
        let name = name.clone();
        async move {
            let leases = store.leases(&name).await.unwrap_or_default();
            let mut owners: HashMap<String, usize> = HashMap::new();
            for l in leases.iter().filter(|l| !l.owner.is_empty()) {
                *owners.entry(l.owner.clone()).or_default() += 1;
            }
            owners.len() == 2 && owners.values().all(|n| *n == 2)
        }
    })
    .await;
    assert!(split, "the two instances did not split the partitions 2/2");
    let mut subscribed = false;
    for _ in 0..100 {
        let mut counts = Vec::new();
        for q in config.partition_queues() {
            counts.push(broker.consumers(&q).await);
        }
        if counts.iter().all(|n| *n == 1) {
            subscribed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(subscribed, "one consumer on each partition queue");
    [a, b]
}

/// Waits until the instances together settled `n` deliveries for good.
async fn settled(instances: &[Running], n: u64) -> bool {
    let stats: Vec<_> = instances.iter().map(|r| r.stats.clone()).collect();
    wait_for(Duration::from_secs(120), move || {
        let total: u64 = stats
            .iter()
            .map(|s| {
                let s = s.snapshot();
                s.applied + s.stale + s.duplicates + s.dead_lettered
            })
            .sum();
        async move { total >= n }
    })
    .await
}

async fn cleanup<B: Backend>(db: TestDb<B>, broker: TestBroker, config: &ConsumerConfig) {
    for q in warren::topology::Topology::for_consumer(config).queue_names() {
        broker.track_queue(q);
    }
    let channel = broker.connection.create_channel().await.unwrap();
    if let Some(p) = config.partitions() {
        let _ = channel
            .exchange_delete(p.exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    broker.cleanup().await;
    db.drop_db().await;
}

async fn in_order_stream_on_two_instances_applies_each_version_once_in_order<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker);
    let instances = two_instances(&db, &broker, &config).await;

    let customers: Vec<String> = (0..200)
        .map(|i| {
            if i % 10 == 0 {
                format!("cus_flaky_{i}")
            } else {
                format!("cus_{i}")
            }
        })
        .collect();
    let stream: Vec<Outgoing> = (1..=10)
        .flat_map(|v| customers.iter().map(move |c| update(c, v)))
        .collect();
    publish_all(&broker, &stream).await;
    assert!(settled(&instances, 2000).await, "not all settled");
    let per_instance: Vec<u64> = instances
        .iter()
        .map(|r| r.stats.snapshot().applied)
        .collect();
    assert!(
        per_instance.iter().all(|n| *n > 0),
        "both instances applied: {per_instance:?}"
    );
    let stale: u64 = instances.iter().map(|r| r.stats.snapshot().stale).sum();
    let snapshots: Vec<_> = instances.iter().map(|r| r.stats.snapshot()).collect();
    let returned: u64 = snapshots.iter().map(|s| s.returned).sum();
    let dead: u64 = instances
        .iter()
        .map(|r| r.stats.snapshot().dead_lettered)
        .sum();
    for r in instances {
        r.stop().await.unwrap();
    }

    let applied = applied(&db).await;
    let (mut flaky_skipped, mut others_skipped) = (0, 0);
    for c in &customers {
        let versions = &applied[c];
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "{c}: applied out of order: {versions:?}"
        );
        assert_eq!(versions.last(), Some(&10), "{c} ends at its last version");
        let missing = 10 - versions.len() as u64;
        if c.starts_with("cus_flaky") {
            // Only version 1 fails; it can come back stale, nothing else.
            assert!(
                versions == &(1..=10).collect::<Vec<_>>()
                    || versions == &(2..=10).collect::<Vec<_>>(),
                "{c}: {versions:?}"
            );
            flaky_skipped += missing;
        } else {
            others_skipped += missing;
        }
    }
    assert_eq!(dead, 0);
    // A copy put back at the tail of its queue (SQLite's write lock timed out,
    // counted as `returned`) can be overtaken, and the gate then drops it as
    // stale: at most one version lost that way per copy returned.
    assert!(
        others_skipped <= returned,
        "{others_skipped} versions of healthy customers not applied, {returned} copies returned; {snapshots:?}"
    );
    assert_eq!(
        stale,
        flaky_skipped + others_skipped,
        "each version not applied was counted stale"
    );
    assert!(
        flaky_skipped > 0,
        "a flaky customer's retried version 1 came back stale"
    );
    cleanup(db, broker, &config).await;
}

async fn shuffled_stream_with_duplicates_ends_at_the_highest_version<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker);
    let instances = two_instances(&db, &broker, &config).await;

    let mut stream: Vec<Outgoing> = (0..200)
        .flat_map(|i| (1..=10).map(move |v| update(&format!("cus_{i}"), v)))
        .collect();
    let copies: Vec<Outgoing> = stream
        .iter()
        .filter(|_| fastrand::f64() < 0.15)
        .cloned()
        .collect();
    let distinct = stream.len() as u64;
    let total = distinct + copies.len() as u64;
    stream.extend(copies);
    fastrand::shuffle(&mut stream);
    publish_all(&broker, &stream).await;
    assert!(settled(&instances, total).await, "not all settled");
    let sum = |f: fn(&warren::telemetry::ConsumerStats) -> u64| -> u64 {
        instances.iter().map(|r| f(&r.stats.snapshot())).sum()
    };
    let (stale, duplicates, dead) = (
        sum(|s| s.stale),
        sum(|s| s.duplicates),
        sum(|s| s.dead_lettered),
    );
    for r in instances {
        r.stop().await.unwrap();
    }

    let applied = applied(&db).await;
    let mut applied_count = 0;
    for i in 0..200 {
        let versions = &applied[&format!("cus_{i}")];
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "cus_{i}: {versions:?}"
        );
        assert_eq!(versions.last(), Some(&10), "cus_{i} ends at version 10");
        applied_count += versions.len() as u64;
    }
    assert_eq!(dead, 0);
    assert_eq!(duplicates, total - distinct, "every copy recognised");
    assert_eq!(
        stale,
        distinct - applied_count,
        "every distinct version not applied was counted stale"
    );
    cleanup(db, broker, &config).await;
}

/// A plain queue with lanes by the partition key and strict versions: tiers of
/// 200 ms and 5 s (a long one, 25 short waits).
fn strict_config(broker: &TestBroker, gap_patience: Option<Duration>) -> ConsumerConfig {
    let b = broker
        .builder()
        .with_retry(
            RetryPolicy::new([Duration::from_millis(200), Duration::from_secs(5)])
                .with_max_attempts(3),
        )
        .ordered_by_header("partition-key");
    match gap_patience {
        Some(p) => b.with_gap_patience(p),
        None => b,
    }
    .build()
    .unwrap()
}

async fn strict_sequence_waits_for_a_version_held_in_a_long_tier<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = strict_config(&broker, None);
    broker.declare_config(&config).await;
    for v in 1..=8 {
        let u = Update {
            customer: "cus_1".into(),
            version: v,
            hold_ms: if v == 5 { 5_000 } else { 0 },
        };
        let m = Outgoing::new(UPDATE, 1, &u)
            .unwrap()
            .with_partition_key("cus_1");
        broker
            .publisher
            .publish(&broker.exchange, "test.update", &m)
            .await
            .unwrap();
    }
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        Registry::<B>::new().route(UPDATE, 1, strict::<B>),
    ));
    // v1..v4 apply; v5 goes to the 5 s tier; v6..v8 wait in the short tier.
    let stats = running.stats.clone();
    stats_reach(&stats, Duration::from_secs(20), |s| {
        s.applied == 4 && s.gap_waits >= 3
    })
    .await;
    assert_eq!(
        applied(&db).await["cus_1"],
        [1, 2, 3, 4],
        "nothing after the held version applied first"
    );
    stats_reach(&stats, Duration::from_secs(60), |s| s.applied == 8).await;
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(applied(&db).await["cus_1"], (1..=8).collect::<Vec<_>>());
    assert_eq!((s.dead_lettered, s.stale), (0, 0), "{s:?}");
    assert!(s.gap_waits > 3, "the later versions kept waiting: {s:?}");
    cleanup(db, broker, &config).await;
}

async fn a_gap_that_never_fills_is_dead_lettered_as_version_gap<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_retry(RetryPolicy::new(TEST_TIERS))
        .with_gap_patience(Duration::from_secs(3))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    for v in [1, 3] {
        broker
            .publisher
            .publish(&broker.exchange, "test.update", &update("cus_gap", v))
            .await
            .unwrap();
    }
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        Registry::<B>::new().route(UPDATE, 1, strict::<B>),
    ));
    assert!(running.settled(2, Duration::from_secs(30)).await);
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!((s.applied, s.dead_lettered), (1, 1), "{s:?}");
    assert!(s.gap_waits >= 1, "{s:?}");
    let dead = broker.drain(&config.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1);
    let headers = dead[0].properties.headers().clone().unwrap_or_default();
    let text = |name: &str| {
        warren::amqp::header_str(&headers, name)
            .map(|c| c.into_owned())
            .unwrap_or_default()
    };
    assert_eq!(text(warren::headers::HEADER_REASON), "version-gap");
    let error = text(warren::headers::HEADER_ERROR);
    assert!(
        error.contains("expected version 2") && error.contains("got version 3"),
        "{error}"
    );
    assert_eq!(
        warren::amqp::header_int(&headers, warren::headers::HEADER_VERSION),
        Some(3)
    );
    assert_eq!(applied(&db).await["cus_gap"], [1]);
    cleanup(db, broker, &config).await;
}

/// Versions 4, 3 and 2 of one customer are dead-lettered as `version-gap` in
/// that order (version 1 never came). Once version 1 applies, a replay of the
/// whole dead-letter queue sends them back as 2, 3, 4: on a lane of their key
/// they apply without waiting for a gap again.
async fn strict_dead_letters_are_replayed_in_version_order<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_retry(RetryPolicy::new(TEST_TIERS))
        .with_gap_patience(Duration::from_secs(2))
        .ordered_by_header("partition-key")
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        Registry::<B>::new().route(UPDATE, 1, strict::<B>),
    ));
    let stats = running.stats.clone();
    let mut ids = BTreeMap::new();
    for (k, v) in [4, 3, 2].into_iter().enumerate() {
        let m = update("cus_replay", v);
        ids.insert(v, m.meta().message_id.clone());
        broker
            .publisher
            .publish(&broker.exchange, "test.update", &m)
            .await
            .unwrap();
        // One at a time, so the dead-letter queue holds them newest first.
        stats_reach(&stats, Duration::from_secs(30), |s| {
            s.dead_lettered == k as u64 + 1
        })
        .await;
    }
    broker
        .publisher
        .publish(&broker.exchange, "test.update", &update("cus_replay", 1))
        .await
        .unwrap();
    stats_reach(&stats, Duration::from_secs(30), |s| s.applied == 1).await;

    let dlq = warren_admin::DeadLetterQueue::new(broker.connection.clone(), &broker.queue);
    let listed: Vec<String> = dlq
        .list(10)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.message_id)
        .collect();
    assert_eq!(
        listed,
        [ids[&4].clone(), ids[&3].clone(), ids[&2].clone()],
        "newest first in the queue"
    );
    let gap_waits = stats.snapshot().gap_waits;
    let report = dlq
        .replay(&warren_admin::Selection::default(), None, false)
        .await
        .unwrap();
    let replayed: Vec<String> = report.replayed.into_iter().map(|r| r.message_id).collect();
    assert_eq!(
        replayed,
        [ids[&2].clone(), ids[&3].clone(), ids[&4].clone()],
        "replayed in version order"
    );
    stats_reach(&stats, Duration::from_secs(30), |s| s.applied == 4).await;
    let s = stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(applied(&db).await["cus_replay"], [1, 2, 3, 4]);
    assert_eq!(
        s.gap_waits, gap_waits,
        "no replayed version waited for a gap: {s:?}"
    );
    assert_eq!(s.dead_lettered, 3, "none dead-lettered again: {s:?}");
    cleanup(db, broker, &config).await;
}

/// Waits up to `within` until the consumer's counters satisfy `done`; fails the
/// test with the last snapshot if they never do.
async fn stats_reach(
    stats: &warren::telemetry::StatsHandle,
    within: Duration,
    done: impl Fn(&warren::telemetry::ConsumerStats) -> bool,
) {
    let reached = wait_for(within, || {
        let s = stats.snapshot();
        let ok = done(&s);
        async move { ok }
    })
    .await;
    assert!(
        reached,
        "not reached within {within:?}: {:?}",
        stats.snapshot()
    );
}
