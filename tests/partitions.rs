//! Partitioned consumption at its edges: a hash ring that no longer matches its
//! partition queues stops the start, a ring the broker rebuilt in another order
//! costs a hop but neither a message nor the order, a partition key that cannot be hashed as
//! producers are told is dead-lettered (and so is a message whose headers the
//! frame guard had to prune, wherever it arrived), partitions move between instances by
//! lease and are given back on a graceful stop, every partition queue has a
//! single active consumer under the leases, a broker without the hash exchange
//! plugin stops the start with the command that enables it; and ordered lanes
//! on a plain queue keep one key's deliveries in order without any version gate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::Postgres;
use warren::broker::{BatchItem, BrokerError};
use warren::lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions};
use warren::lapin::types::AMQPValue;
use warren::topology::QueueType;
use warren::version::{Verdict, VersionMode};
use warren::{Consumer, ConsumerConfig, HandlerError, Message, Outgoing, Registry, Tx};

use crate::util::{
    APPLIED_TABLE, Backend, Running, TestBroker, TestDb, amqp_url, consumer_tags, queue_policy,
    queue_report, unique, wait_for,
};

on_all_backends!(
    a_missing_or_ill_typed_partition_key_is_dead_lettered,
    a_ring_rebuilt_in_another_order_sends_each_delivery_to_its_partition,
    a_forward_its_home_queue_refuses_goes_back_and_is_sent_on_later,
    a_second_reorder_while_forwards_are_in_flight_keeps_the_gate,
    a_handover_under_load_never_runs_one_key_in_two_instances,
    ordered_lanes_keep_each_key_in_order_without_a_version_gate,
);

mod leases_move_between_instances_and_are_given_back_on_stop {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        super::leases_move_between_instances_and_are_given_back_on_stop::<sqlx::Postgres>().await;
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        super::leases_move_between_instances_and_are_given_back_on_stop::<sqlx::Sqlite>().await;
    }
}

const UPDATE: &str = "test.update";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Update {
    customer: String,
    version: i64,
}

fn update(customer: &str, version: i64) -> Outgoing {
    let u = Update {
        customer: customer.to_owned(),
        version,
    };
    Outgoing::new(UPDATE, 1, &u)
        .unwrap()
        .with_partition_key(customer)
}

/// Each customer's versions 1 to `versions`, version by version: every
/// customer's first, then every second, and so on.
fn versions_of(customers: &[String], versions: i64) -> Vec<Outgoing> {
    (1..=versions)
        .flat_map(|v| customers.iter().map(move |c| update(c, v)))
        .collect()
}

/// Records the version as it arrives: no gate, so the rows show the order in
/// which the handler ran.
async fn record<B: Backend>(msg: Message<Update>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    let u = &msg.payload;
    B::record_version(tx, &u.customer, u.version, &msg.meta.message_id).await?;
    Ok(())
}

/// Per test (the part of a customer's name before its last `-`): handlers
/// running now, and the most that ever ran at once.
static SIDE_BY_SIDE: std::sync::Mutex<BTreeMap<String, (usize, usize)>> =
    std::sync::Mutex::new(BTreeMap::new());

fn test_of(customer: &str) -> String {
    customer
        .rsplit_once('-')
        .map_or(customer, |(test, _)| test)
        .to_owned()
}

/// Sleeps 0 to 20 ms first, so that deliveries running side by side finish in
/// a random order, then records; counts how many run at once.
async fn jittery<B: Backend>(msg: Message<Update>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    let test = test_of(&msg.payload.customer);
    {
        let mut counts = SIDE_BY_SIDE.lock().unwrap();
        let (now, most) = counts.entry(test.clone()).or_default();
        *now += 1;
        *most = (*most).max(*now);
    }
    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=20))).await;
    let recorded = record(msg, tx).await;
    if let Some((now, _)) = SIDE_BY_SIDE.lock().unwrap().get_mut(&test) {
        *now -= 1;
    }
    recorded
}

/// Keys whose handler is running now, in any instance of this process.
static RUNNING: std::sync::Mutex<BTreeSet<String>> = std::sync::Mutex::new(BTreeSet::new());
/// Keys a handler found already running elsewhere.
static OVERLAPPED: std::sync::Mutex<BTreeSet<String>> = std::sync::Mutex::new(BTreeSet::new());

/// Takes 20 ms, noting any other handler running the same key meanwhile (a
/// lane runs one key at a time, so only a second instance could), then records.
async fn exclusive<B: Backend>(msg: Message<Update>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    let key = msg.payload.customer.clone();
    if !RUNNING.lock().unwrap().insert(key.clone()) {
        OVERLAPPED.lock().unwrap().insert(key.clone());
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    RUNNING.lock().unwrap().remove(&key);
    record(msg, tx).await
}

fn routes<B: Backend>() -> Registry<B> {
    Registry::<B>::new().route(UPDATE, 1, record::<B>)
}

/// A partitioned test consumer on the test's queue: `count` partitions, 3 s
/// leases.
fn partitioned(broker: &TestBroker, count: u32) -> ConsumerConfig {
    broker
        .builder()
        .partitioned(format!("{}.hash", broker.queue), count)
        .with_lease_ttl(Duration::from_secs(3))
        .build()
        .unwrap()
}

/// A consumer on `config` running [`jittery`], and its counters once `n`
/// deliveries have settled.
async fn jittery_until_settled<B: Backend>(
    db: &TestDb<B>,
    config: &ConsumerConfig,
    n: u64,
) -> (Running, warren::telemetry::ConsumerStats) {
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        Registry::<B>::new().route(UPDATE, 1, jittery::<B>),
    ));
    assert!(
        running.settled(n, Duration::from_secs(120)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    (running, stats)
}

/// Partition -> owner, as stored (empty owner: free).
async fn owners<S: warren::store::Leases>(store: &S, name: &str) -> BTreeMap<u32, String> {
    store
        .leases(name)
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|l| (l.partition, l.owner))
        .collect()
}

/// Held partitions per owner.
fn shares(owners: &BTreeMap<u32, String>) -> HashMap<String, usize> {
    let mut shares = HashMap::new();
    for owner in owners.values().filter(|o| !o.is_empty()) {
        *shares.entry(owner.clone()).or_default() += 1;
    }
    shares
}

/// Why partitions may go untaken when nothing in warren failed: a broker
/// without the consistent-hash exchange (its plugin off), where the
/// consumers stop at start. "" if the broker has the exchange type.
async fn without_the_plugin() -> &'static str {
    let Ok(connection) = lapin::Connection::connect(&amqp_url(), Default::default()).await else {
        return "; the broker cannot be reached";
    };
    let name = unique("plugin-probe");
    let declared = match connection.create_channel().await {
        Ok(channel) => {
            let declared = channel
                .exchange_declare(
                    name.as_str().into(),
                    lapin::ExchangeKind::Custom("x-consistent-hash".into()),
                    Default::default(),
                    Default::default(),
                )
                .await
                .is_ok();
            if declared {
                let _ = channel
                    .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
            declared
        }
        Err(_) => false,
    };
    let _ = connection.close(200, "probed".into()).await;
    if declared {
        ""
    } else {
        "; the broker has no x-consistent-hash exchange type: \
         rabbitmq-plugins enable rabbitmq_consistent_hash_exchange (.ci/run does)"
    }
}

/// Waits until one member holds all `count` partitions and each partition
/// queue has its consumer; returns that member.
async fn one_owner_of_all<S: warren::store::Leases>(
    store: &S,
    broker: &TestBroker,
    config: &ConsumerConfig,
) -> String {
    let count = config.partitions().unwrap().count as usize;
    let name = config.name().to_owned();
    let took = wait_for(Duration::from_secs(30), || async {
        let owners = owners(store, &name).await;
        let shares = shares(&owners);
        owners.len() == count && shares.len() == 1 && shares.values().all(|n| *n == count)
    })
    .await;
    if !took {
        panic!(
            "one instance did not take every partition: {:?}{}",
            owners(store, &name).await,
            without_the_plugin().await
        );
    }
    subscribed(broker, config).await;
    owners(store, &name).await.remove(&0).unwrap()
}

/// Waits until every partition queue has exactly one consumer.
async fn subscribed(broker: &TestBroker, config: &ConsumerConfig) {
    let queues = config.partition_queues();
    let ok = wait_for(Duration::from_secs(20), || {
        let queues = queues.clone();
        async {
            let mut all = true;
            for q in queues {
                let n = broker.consumers(&q).await;
                all &= n == 1;
            }
            all
        }
    })
    .await;
    assert!(ok, "not one consumer on each partition queue");
}

/// Publishes `messages` to the test exchange in order, a batch of confirms at
/// a time.
async fn publish_all(broker: &TestBroker, messages: &[Outgoing]) {
    for chunk in messages.chunks(200) {
        let bodies: Vec<Vec<u8>> = chunk.iter().map(Outgoing::body).collect();
        let items: Vec<BatchItem<'_>> = chunk
            .iter()
            .zip(&bodies)
            .map(|(m, body)| BatchItem {
                exchange: &broker.exchange,
                routing_key: UPDATE,
                body,
                properties: m.properties(),
            })
            .collect();
        for r in broker.publisher.publish_batch(&items).await {
            r.unwrap();
        }
    }
}

/// Rows of `test_applied`: customer -> versions in application order (the
/// per-customer sequence numbers checked to run 1, 2, 3 ...).
async fn applied<B: Backend>(db: &TestDb<B>) -> BTreeMap<String, Vec<i64>> {
    let mut by_customer: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for (c, v, s) in B::applied_rows(&db.store).await {
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

/// Deletes everything the configurations declared (every partition queue with
/// its tiers and dead-letter queue, the hash exchange, the source exchange) and
/// drops the database.
async fn cleanup<B: Backend>(db: TestDb<B>, broker: TestBroker, configs: &[&ConsumerConfig]) {
    let channel = broker.connection.create_channel().await.unwrap();
    for config in configs {
        for q in warren::topology::Topology::for_consumer(config).queue_names() {
            broker.track_queue(q);
        }
        if let Some(p) = config.partitions() {
            let _ = channel
                .exchange_delete(p.exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
    }
    let _ = channel.close(200, "ok".into()).await;
    broker.cleanup().await;
    db.drop_db().await;
}

/// Runs a consumer that is expected to refuse to start, and returns its error.
async fn refused<B: Backend>(db: &TestDb<B>, config: &ConsumerConfig) -> warren::Error {
    let consumer = Consumer::new(config.clone(), db.store.clone(), routes::<B>());
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(&amqp_url(), std::future::pending::<()>()),
    )
    .await
    .expect("the consumer kept running instead of refusing to start");
    ran.expect_err("the consumer started on a ring that no longer matches its queues")
}

/// A first run declares the ring and takes every partition, then stops.
async fn first_run<B: Backend>(db: &TestDb<B>, broker: &TestBroker, config: &ConsumerConfig) {
    let first = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    one_owner_of_all(&db.store, broker, config).await;
    first.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_partition_queue_stops_the_start() {
    let db = Postgres::create().await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 4);
    first_run(&db, &broker, &config).await;

    let gone = format!("{}.2", broker.queue);
    broker.delete_queue(&gone).await;
    let error = refused(&db, &config).await;
    assert!(
        matches!(error, warren::Error::Broker(BrokerError::RingBroken(_))),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(
        text.contains(&format!("{gone:?}")),
        "names the queue: {text}"
    );
    assert!(
        text.contains("Changing the partition count"),
        "says what to do: {text}"
    );
    // Nothing was declared again: the queue stays gone.
    let channel = broker.connection.create_channel().await.unwrap();
    let passive = channel
        .queue_declare(
            gone.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await;
    assert!(
        passive.is_err(),
        "the deleted partition queue was declared again"
    );
    cleanup(db, broker, &[&config]).await;
}

/// A partition queue deleted under a running consumer: the broker cancels
/// its subscription, and the consumer does not declare it again (its hash
/// binding went with it, and a queue declared anew would sit unbound while
/// the ring renumbered) but stops with the ring's error naming the queue,
/// instead of sitting idle on an open connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_queue_deleted_under_a_running_consumer_stops_it() {
    let db = Postgres::create().await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 4);
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<Postgres>(),
    ));
    one_owner_of_all(&db.store, &broker, &config).await;

    let gone = format!("{}.2", broker.queue);
    broker.delete_queue(&gone).await;
    // It waits out the grace a recovering queue gets (30 s), then stops.
    assert!(
        wait_for(Duration::from_secs(120), || {
            let done = running.finished();
            async move { done }
        })
        .await,
        "the consumer kept running on a ring without {gone}"
    );
    let error = running
        .stop()
        .await
        .expect_err("the consumer stopped with an error");
    assert!(
        matches!(error, warren::Error::Broker(BrokerError::RingBroken(_))),
        "{error:?}"
    );
    assert!(
        error.to_string().contains(&format!("{gone:?}")),
        "names the queue: {error}"
    );
    cleanup(db, broker, &[&config]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_partition_count_stops_the_start() {
    let db = Postgres::create().await;
    let broker = TestBroker::new().await;
    let four = partitioned(&broker, 4);
    first_run(&db, &broker, &four).await;

    let three = partitioned(&broker, 3);
    let error = refused(&db, &three).await;
    assert!(
        matches!(error, warren::Error::Broker(BrokerError::RingBroken(_))),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(text.contains("partition count"), "{text}");
    assert!(
        text.contains(&format!("{:?}", format!("{}.3", broker.queue))),
        "names the queue beyond the count: {text}"
    );
    cleanup(db, broker, &[&four, &three]).await;
}

async fn a_missing_or_ill_typed_partition_key_is_dead_lettered<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 4);
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    one_owner_of_all(&db.store, &broker, &config).await;

    // No header at all.
    let missing = Outgoing::new(
        UPDATE,
        1,
        &Update {
            customer: "cus_missing".into(),
            version: 1,
        },
    )
    .unwrap();
    broker
        .publisher
        .publish(&broker.exchange, UPDATE, &missing)
        .await
        .unwrap();
    // The header as a number. (A short string would do too, but RabbitMQ closes
    // the publishing connection on one.)
    let numeric = update("cus_numeric", 1);
    let properties = numeric.properties();
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert("partition-key".into(), AMQPValue::LongLongInt(42));
    broker
        .publisher
        .publish_raw(
            &broker.exchange,
            UPDATE,
            &numeric.body(),
            properties.with_headers(headers),
        )
        .await
        .unwrap();
    // A good key beside a header nested far too deep for the client to read:
    // one through the ring, one put straight on a partition it does not hash
    // to. Neither is applied nor sent on (the key could have been among what
    // the frame guard removed); both are dead-lettered where they arrived.
    let mut hostile = warren_chaos::hostile::RawPublisher::connect(&amqp_url())
        .await
        .unwrap();
    let deep = update("cus_deep", 1);
    let astray = update("cus_astray", 1);
    let home = warren::partition::partition_of(b"cus_astray", 4);
    for (message, key, exchange, routing_key) in [
        (
            &deep,
            "cus_deep",
            broker.exchange.clone(),
            UPDATE.to_owned(),
        ),
        (
            &astray,
            "cus_astray",
            String::new(),
            format!("{}.{}", broker.queue, (home + 1) % 4),
        ),
    ] {
        let p = warren_chaos::hostile::Properties::default()
            .message_id(&message.meta().message_id)
            .content_type("application/json")
            .header(
                "partition-key",
                warren_chaos::hostile::Value::long_string(key),
            )
            .header(
                "h",
                warren_chaos::hostile::Value::nested_tables(
                    2_000,
                    warren_chaos::hostile::Value::void(),
                ),
            );
        hostile
            .publish(exchange, routing_key, &p, &message.body())
            .await
            .unwrap();
    }
    hostile.close().await;
    let valid = update("cus_valid", 1);
    broker
        .publisher
        .publish(&broker.exchange, UPDATE, &valid)
        .await
        .unwrap();

    assert!(
        running.settled(5, Duration::from_secs(30)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(
        (s.applied, s.dead_lettered, s.forwarded),
        (1, 4, 0),
        "{s:?}"
    );

    let mut dead = BTreeMap::new();
    for i in 0..4 {
        let queue = warren::topology::dead_letter_queue_name(&format!("{}.{i}", broker.queue));
        for d in broker.drain(&queue).await {
            let headers = d.properties.headers().clone().unwrap_or_default();
            let text = |name: &str| {
                warren::amqp::header_str(&headers, name)
                    .map(|c| c.into_owned())
                    .unwrap_or_default()
            };
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default();
            dead.insert(
                id,
                (
                    text(warren::headers::HEADER_REASON),
                    text(warren::headers::HEADER_ERROR),
                ),
            );
        }
    }
    assert_eq!(
        dead.keys().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from([
            missing.meta().message_id.clone(),
            numeric.meta().message_id.clone(),
            deep.meta().message_id.clone(),
            astray.meta().message_id.clone(),
        ]),
        "{dead:?}"
    );
    for message in [&missing, &numeric] {
        let (reason, error) = &dead[&message.meta().message_id];
        assert_eq!(reason, "invalid-partition-key", "{error}");
    }
    for message in [&deep, &astray] {
        let (reason, error) = &dead[&message.meta().message_id];
        assert_eq!(reason, "headers-too-deep", "{error}");
    }
    let (_, error) = &dead[&numeric.meta().message_id];
    assert!(error.contains("long string"), "{error}");
    let (_, error) = &dead[&missing.meta().message_id];
    assert!(error.contains("missing"), "{error}");

    let applied = applied(&db).await;
    assert_eq!(
        applied,
        BTreeMap::from([("cus_valid".to_owned(), vec![1])]),
        "only the valid message applied"
    );
    cleanup(db, broker, &[&config]).await;
}

/// What a broker restart can do to the ring (rabbitmq-server #3386), done by
/// hand: partition 0's binding removed and added again moves it to the end of
/// the ring. Bucket b then feeds the queue of partition (b + 1) % count: no key
/// reaches its own queue.
async fn reorder_ring(broker: &TestBroker, config: &ConsumerConfig) {
    move_to_the_end_of_the_ring(broker, config, 0).await;
}

/// Removes partition `index`'s binding and adds it again, which moves its
/// queue to the end of the ring.
async fn move_to_the_end_of_the_ring(broker: &TestBroker, config: &ConsumerConfig, index: usize) {
    let hash = config.partitions().unwrap().exchange.clone();
    let queue = config.partition_queues()[index].clone();
    let channel = broker.connection.create_channel().await.unwrap();
    channel
        .queue_unbind(
            queue.as_str().into(),
            hash.as_str().into(),
            "1".into(),
            Default::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.as_str().into(),
            hash.as_str().into(),
            "1".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let _ = channel.close(200, "ring reordered".into()).await;
}

/// What a broker restart can do to the ring (rabbitmq-server #3386), done by
/// hand: partition 0's binding removed and added again moves it to the end of
/// the ring, so most keys now hash to a queue that is not theirs. Every update
/// must still apply once, each customer's in order, with no version gate: the
/// deliveries that arrive in the wrong queue are sent on to their own.
async fn a_ring_rebuilt_in_another_order_sends_each_delivery_to_its_partition<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 4);
    first_run(&db, &broker, &config).await;
    reorder_ring(&broker, &config).await;

    let customers: Vec<String> = (0..40).map(|i| format!("cus_{i}")).collect();
    // Bucket b now holds queue (b + 1) % 4: no key is in its own queue.
    let stream = versions_of(&customers, 10);
    publish_all(&broker, &stream).await;

    let (running, s) = jittery_until_settled(&db, &config, 400).await;
    assert!(
        running.is_running(),
        "a reordered ring stopped the consumer"
    );
    running.stop().await.unwrap();
    assert_eq!(
        (s.applied, s.duplicates, s.dead_lettered, s.forwarded),
        (400, 0, 0, 400),
        "every update applied once, each after one forward: {s:?}"
    );
    let applied = applied(&db).await;
    assert_eq!(applied.len(), customers.len());
    for c in &customers {
        assert_eq!(
            applied[c],
            (1..=10).collect::<Vec<_>>(),
            "{c}: applied out of order ({s:?})"
        );
    }
    cleanup(db, broker, &[&config]).await;
}

/// Latest wins: a version not newer than the stored one is dropped as stale.
async fn latest<B: Backend>(msg: Message<Update>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    let u = &msg.payload;
    match tx
        .check_version("test", &u.customer, u.version, VersionMode::LatestWins)
        .await?
    {
        Verdict::Stale { .. } => Ok(()),
        Verdict::Apply { .. } => record(msg, tx).await,
    }
}

/// On a reordered ring, the home queue of partition 1 refuses every publish
/// for a while (a policy: length 0, overflow `reject-publish`), so each
/// forward to it fails. Such a delivery goes back to the tail of the queue it
/// came from and is sent on later: none is lost or dead-lettered, and once the
/// home takes copies again every customer ends at its highest version, with
/// what the trip to the tail let overtake dropped as stale by the gate.
async fn a_forward_its_home_queue_refuses_goes_back_and_is_sent_on_later<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    // Classic queues: one refuses every publish past its limit. A quorum home
    // queue that its consumer drains at once refused no forward in a trial
    // run (it takes a publish and then finds itself over the limit).
    let config = broker
        .builder()
        .with_queue_type(QueueType::Classic)
        .partitioned(format!("{}.hash", broker.queue), 4)
        .with_lease_ttl(Duration::from_secs(3))
        .build()
        .unwrap();
    first_run(&db, &broker, &config).await;
    reorder_ring(&broker, &config).await;

    // No key of partition 0: bucket 0 now feeds partition 1's queue, which is
    // about to refuse every publish, the producer's too; the stream has to
    // reach the consumer whole.
    let customers: Vec<String> = (0..)
        .map(|i| format!("cus_{i}"))
        .filter(|c| warren::partition::partition_of(c.as_bytes(), 4) != 0)
        .take(40)
        .collect();
    let stream = versions_of(&customers, 5);
    publish_all(&broker, &stream).await;
    let home = config.partition_queues()[1].clone();
    let refusing = warren_chaos::QueuePolicy::set(
        &format!("{}-refuse", broker.queue),
        &format!("^{}$", home.replace('.', "\\.")),
        r#"{"max-length": 0, "overflow": "reject-publish"}"#,
    )
    .unwrap();
    assert!(
        wait_for(Duration::from_secs(20), || async {
            queue_policy(&home).await.is_some()
        })
        .await,
        "the policy never reached {home}"
    );

    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        Registry::<B>::new().route(UPDATE, 1, latest::<B>),
    ));
    let stats = running.stats.clone();
    assert!(
        wait_for(Duration::from_secs(60), || {
            let s = stats.snapshot();
            async move { s.returned >= 3 }
        })
        .await,
        "no forward to the refusing queue came back: {:?}",
        running.stats.snapshot()
    );
    drop(refusing);

    let total = stream.len() as u64;
    let settled = wait_for(Duration::from_secs(120), || {
        let s = stats.snapshot();
        async move { s.applied + s.stale >= total }
    })
    .await;
    if !settled {
        // Seen once in a loaded CI run: one update never reached a handler.
        // Where it waits (ready in a queue, unacked on a channel) says why.
        panic!(
            "{total} updates not all applied or stale: {:?}\ninbox rows: {}\n{}\n{}",
            running.stats.snapshot(),
            db.inbox(config.name()).await,
            queue_report(&broker.queue).await,
            histories(&db, config.name(), &stream).await
        );
    }
    let s = running.stats.snapshot();
    assert!(
        running.is_running(),
        "refused forwards stopped the consumer"
    );
    running.stop().await.unwrap();
    // A forward the broker took and still nacked while its policy changed, or a
    // trip to the tail whose ack was lost, leaves a second copy (seen once in
    // a loaded CI run): at-least-once allows it, and the inbox must absorb it.
    // The counts below prove it was not applied twice.
    assert_eq!(
        (s.applied + s.stale, s.dead_lettered),
        (total, 0),
        "each update applied or dropped as stale once, none dead-lettered: {s:?}"
    );
    let applied = applied(&db).await;
    assert_eq!(applied.len(), customers.len(), "every customer applied");
    for c in &customers {
        let versions = &applied[c];
        assert_eq!(versions.last(), Some(&5), "{c} ends at its highest version");
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "{c}: applied out of order: {versions:?}"
        );
    }
    assert_eq!(
        applied.values().map(|v| v.len() as u64).sum::<u64>(),
        s.applied,
        "one row per version applied"
    );
    cleanup(db, broker, &[&config]).await;
}

/// What the journal holds of each update without an inbox row, and of each
/// with more than one outcome: where a missing update went.
async fn histories<B: Backend>(db: &TestDb<B>, consumer: &str, stream: &[Outgoing]) -> String {
    use warren::store::Journal;
    let mut out = String::from("updates without an inbox row, or settled more than once:");
    for m in stream {
        let id = &m.meta().message_id;
        let rows = B::count(
            &db.store,
            format!(
                "SELECT count(*) FROM warren_inbox WHERE consumer_name = '{consumer}' \
                 AND message_id = '{id}'"
            ),
        )
        .await;
        let journal = db
            .store
            .journal_of_message(consumer, id, 50)
            .await
            .unwrap_or_default();
        if rows == 0 || journal.len() > 1 {
            let outcomes: Vec<String> = journal
                .iter()
                .map(|e| format!("{} {}", e.at.format("%H:%M:%S%.3f"), e.described()))
                .collect();
            out.push_str(&format!(
                "\n  {id}: {rows} inbox rows; journal: {}",
                outcomes.join(", ")
            ));
        }
    }
    out
}

/// A second reorder while the first one's forwards are on their way: keys move
/// again, so a key's forwarded copies and its newer messages can reach its home
/// queue by different paths and in another order. Latest wins holds each
/// customer to increasing versions and its highest at the end; nothing is lost,
/// applied twice or dead-lettered.
async fn a_second_reorder_while_forwards_are_in_flight_keeps_the_gate<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 4);
    first_run(&db, &broker, &config).await;
    reorder_ring(&broker, &config).await;

    let customers: Vec<String> = (0..40).map(|i| format!("cus_{i}")).collect();
    let stream = versions_of(&customers, 10);
    let (early, late) = stream.split_at(stream.len() / 2);
    publish_all(&broker, early).await;
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        Registry::<B>::new().route(UPDATE, 1, latest::<B>),
    ));
    let stats = running.stats.clone();
    assert!(
        wait_for(Duration::from_secs(60), || {
            let s = stats.snapshot();
            async move { s.forwarded >= 1 }
        })
        .await,
        "no forwards under way: {:?}",
        running.stats.snapshot()
    );
    // The ring is now partitions 2, 3, 0, 1: bucket b feeds (b + 2) % 4.
    move_to_the_end_of_the_ring(&broker, &config, 1).await;
    let forwarded_before = running.stats.snapshot().forwarded;
    assert!(
        forwarded_before < early.len() as u64,
        "every early message was forwarded before the second reorder"
    );
    publish_all(&broker, late).await;

    let total = stream.len() as u64;
    assert!(
        wait_for(Duration::from_secs(120), || {
            let s = stats.snapshot();
            async move { s.applied + s.stale >= total }
        })
        .await,
        "{:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    assert!(
        running.is_running(),
        "a second reorder stopped the consumer"
    );
    running.stop().await.unwrap();
    assert_eq!(
        (s.applied + s.stale, s.duplicates, s.dead_lettered),
        (total, 0, 0),
        "each update applied or dropped as stale once, none dead-lettered: {s:?}"
    );
    let applied = applied(&db).await;
    for c in &customers {
        let versions = &applied[c];
        assert_eq!(
            versions.last(),
            Some(&10),
            "{c} ends at its highest version"
        );
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "{c}: applied out of order: {versions:?}"
        );
    }
    cleanup(db, broker, &[&config]).await;
}

/// A second instance joins while the first is busy with every partition: the
/// first hands two partitions over by finishing what it started before it
/// frees their leases. No key runs in both instances at once, and without a
/// version gate every key still applies each version once, in order.
async fn a_handover_under_load_never_runs_one_key_in_two_instances<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 4);
    let name = config.name().to_owned();
    let registry = || Registry::<B>::new().route(UPDATE, 1, exclusive::<B>);
    let first = Running::start(Consumer::new(config.clone(), db.store.clone(), registry()));
    one_owner_of_all(&db.store, &broker, &config).await;

    // Unique keys: other tests in this binary share the overlap records.
    let customers: Vec<String> = (0..40).map(|i| format!("{}-c{i}", broker.queue)).collect();
    let stream = versions_of(&customers, 20);
    // One version of every customer each 200 ms: the stream is still coming
    // when the second instance joins and the first hands partitions over.
    publish_all(&broker, &stream[..customers.len()]).await;
    let second = Running::start(Consumer::new(config.clone(), db.store.clone(), registry()));
    for round in stream[customers.len()..].chunks(customers.len()) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        publish_all(&broker, round).await;
    }
    let store = db.store.clone();
    let split = wait_for(Duration::from_secs(30), || async {
        let shares = shares(&owners(&store, &name).await);
        shares.len() == 2 && shares.values().all(|n| *n == 2)
    })
    .await;
    assert!(split, "not handed over: {:?}", owners(&store, &name).await);
    let total = stream.len() as u64;
    let stats = [first.stats.clone(), second.stats.clone()];
    let done = wait_for(Duration::from_secs(120), || {
        let n: u64 = stats
            .iter()
            .map(|s| {
                let s = s.snapshot();
                s.applied + s.duplicates + s.dead_lettered
            })
            .sum();
        async move { n >= total }
    })
    .await;
    let (a, b) = (first.stats.snapshot(), second.stats.snapshot());
    assert!(done, "not all applied: {a:?} {b:?}");
    first.stop().await.unwrap();
    second.stop().await.unwrap();
    assert!(
        a.applied > 0 && b.applied > 0,
        "the handover came after the stream: {a:?} {b:?}"
    );
    assert_eq!(a.applied + b.applied, total, "{a:?} {b:?}");
    let overlapped: Vec<String> = OVERLAPPED
        .lock()
        .unwrap()
        .iter()
        .filter(|k| customers.contains(k))
        .cloned()
        .collect();
    assert!(
        overlapped.is_empty(),
        "keys that ran in both instances at once: {overlapped:?}"
    );
    let applied = applied(&db).await;
    for c in &customers {
        assert_eq!(
            applied[c],
            (1..=20).collect::<Vec<_>>(),
            "{c}: applied out of order or twice; {a:?} {b:?}"
        );
    }
    cleanup(db, broker, &[&config]).await;
}

async fn leases_move_between_instances_and_are_given_back_on_stop<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 4);
    let name = config.name().to_owned();

    let first = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let a = one_owner_of_all(&db.store, &broker, &config).await;

    let second = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let store = db.store.clone();
    let split = wait_for(Duration::from_secs(30), || async {
        let shares = shares(&owners(&store, &name).await);
        shares.len() == 2 && shares.values().all(|n| *n == 2) && shares.get(&a) == Some(&2)
    })
    .await;
    assert!(
        split,
        "not handed over 2/2: {:?}",
        owners(&store, &name).await
    );
    let owners_split = owners(&store, &name).await;
    let b = owners_split
        .values()
        .find(|o| **o != a)
        .cloned()
        .expect("a second owner");
    // Single active consumer on each partition queue: still one consumer each.
    subscribed(&broker, &config).await;
    assert!(first.is_running() && second.is_running());

    first.stop().await.unwrap();
    // A graceful stop drains, then gives the leases back: none is left to expire.
    let after_stop = owners(&store, &name).await;
    assert!(
        after_stop.values().all(|o| o != &a),
        "the stopped instance still holds leases: {after_stop:?}"
    );

    let taken = wait_for(Duration::from_secs(20), || async {
        let owners = owners(&store, &name).await;
        owners.len() == 4 && owners.values().all(|o| o == &b)
    })
    .await;
    if !taken {
        panic!(
            "the second instance did not take every partition: {:?}{}",
            owners(&store, &name).await,
            without_the_plugin().await
        );
    }
    subscribed(&broker, &config).await;
    assert!(second.is_running());
    second.stop().await.unwrap();
    let after = owners(&store, &name).await;
    assert!(
        after.values().all(String::is_empty),
        "every lease given back: {after:?}"
    );
    cleanup(db, broker, &[&config]).await;
}

async fn ordered_lanes_keep_each_key_in_order_without_a_version_gate<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .ordered_by(|input| input.header("partition-key"))
        .with_concurrency(8)
        .build()
        .unwrap();
    broker.declare_config(&config).await;

    let customers: Vec<String> = (0..20).map(|i| format!("{}-c{i}", broker.queue)).collect();
    let stream = versions_of(&customers, 20);
    publish_all(&broker, &stream).await;

    let (running, s) = jittery_until_settled(&db, &config, 400).await;
    running.stop().await.unwrap();
    assert_eq!(
        (
            s.applied,
            s.duplicates,
            s.dead_lettered,
            s.stale,
            s.gap_waits
        ),
        (400, 0, 0, 0, 0),
        "{s:?}"
    );

    let applied = applied(&db).await;
    assert_eq!(applied.len(), 20);
    for c in &customers {
        assert_eq!(
            applied[c],
            (1..=20).collect::<Vec<_>>(),
            "{c}: applied out of order ({s:?})"
        );
    }
    // Nothing of the version gate was involved.
    let versions = B::count(&db.store, "SELECT count(*) FROM warren_versions".into()).await;
    assert_eq!(versions, 0);
    // SQLite has one writer: a transaction, and the handler in it, runs alone
    // whatever the lanes allow.
    if <B as Backend>::NAME != "sqlite" {
        let most = SIDE_BY_SIDE.lock().unwrap()[&broker.queue].1;
        assert!(
            most > 1,
            "different keys never ran side by side (at most {most})"
        );
    }
    cleanup(db, broker, &[&config]).await;
}

/// The documented way down from 4 partitions to 3: stop, drain, delete the hash
/// exchange and every partition queue, start with the new count. A second
/// instance must then share partitions 0..3 only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_count_went_down_no_instance_takes_a_partition_beyond_it() {
    let db = Postgres::create().await;
    let broker = TestBroker::new().await;
    let four = partitioned(&broker, 4);
    first_run(&db, &broker, &four).await;
    let channel = broker.connection.create_channel().await.unwrap();
    channel
        .exchange_delete(
            four.partitions().unwrap().exchange.as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await
        .unwrap();
    let _ = channel.close(200, "ok".into()).await;
    for q in warren::topology::Topology::for_consumer(&four).queue_names() {
        broker.delete_queue(q).await;
    }

    let three = partitioned(&broker, 3);
    let name = three.name().to_owned();
    let store = db.store.clone();
    let first = Running::start(Consumer::new(
        three.clone(),
        db.store.clone(),
        routes::<Postgres>(),
    ));
    let alone = wait_for(Duration::from_secs(30), || async {
        let owners = owners(&store, &name).await;
        let a = owners.get(&0).cloned().unwrap_or_default();
        !a.is_empty() && (0..3).all(|p| owners.get(&p) == Some(&a))
    })
    .await;
    assert!(alone, "{:?}", owners(&store, &name).await);
    subscribed(&broker, &three).await;

    let second = Running::start(Consumer::new(
        three.clone(),
        db.store.clone(),
        routes::<Postgres>(),
    ));
    let shared = wait_for(Duration::from_secs(30), || async {
        let owners = owners(&store, &name).await;
        let within: BTreeMap<u32, String> = owners
            .iter()
            .filter(|(p, _)| **p < 3)
            .map(|(p, o)| (*p, o.clone()))
            .collect();
        let mut counts: Vec<usize> = shares(&within).into_values().collect();
        counts.sort_unstable();
        counts == [1, 2] && second.is_running()
    })
    .await;
    let owners_now = owners(&store, &name).await;
    let running = second.is_running();
    // Stopped and cleaned up before asserting, so that a failure leaves nothing
    // behind.
    let second_end = second.stop().await;
    let first_end = first.stop().await;
    cleanup(db, broker, &[&four, &three]).await;
    assert!(
        shared && running,
        "the second instance did not share partitions 0..3: leases {owners_now:?}, \
         it ended with {second_end:?}"
    );
    assert!(
        owners_now.get(&3).is_none_or(String::is_empty),
        "partition 3 taken after the count went down to 3: {owners_now:?}"
    );
    second_end.unwrap();
    first_end.unwrap();
}

/// With the consistent-hash plugin off, a partitioned consumer stops at once
/// with an error that names the plugin and the command enabling it, instead
/// of reconnecting forever. It turns a plugin of the shared broker off, so it
/// runs alone, after the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disables a plugin of the shared broker; run alone with --ignored --test-threads=1"]
async fn a_missing_hash_exchange_plugin_stops_the_start_with_the_command_that_enables_it() {
    let db = Postgres::create().await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 2);
    let error = {
        let _off = warren_chaos::HashExchangePluginOff::new().unwrap();
        refused(&db, &config).await
    };
    assert!(
        matches!(
            error,
            warren::Error::Broker(BrokerError::PluginMissing { .. })
        ),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(
        text.contains("rabbitmq-plugins enable rabbitmq_consistent_hash_exchange"),
        "says how to enable it: {text}"
    );
    // With the plugin back, the same configuration starts and takes its
    // partitions.
    first_run(&db, &broker, &config).await;
    cleanup(db, broker, &[&config]).await;
}

/// Every partition queue carries `x-single-active-consumer`, the safety net
/// under the leases: a second subscriber to a partition (an instance whose
/// lease just expired) waits instead of running the same keys. Read off the
/// broker's own description of the queues.
/// Set once the slow update's handler has started; its handler then runs
/// for [`SLOW_HANDLER`].
static SLOW_STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Set once it has ended.
static SLOW_DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
const SLOW_HANDLER: Duration = Duration::from_secs(15);
const SLOW_CUSTOMER: &str = "cus_slow";

async fn slow_one(msg: Message<Update>, tx: &mut Tx<Postgres>) -> Result<(), HandlerError> {
    if msg.payload.customer == SLOW_CUSTOMER {
        SLOW_STARTED.store(true, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(SLOW_HANDLER).await;
        SLOW_DONE.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    record(msg, tx).await
}

/// The store refuses lease statements for longer than the TTL while one
/// partition runs a long handler: every partition stops, the idle one at once,
/// the busy one once its handler finishes. The store comes back before that,
/// and the instance takes both partitions again, the busy one while its old
/// consumer still drains (its successor waits beside it, single active
/// consumer). The old consumer finishing must not give back the lease its
/// successor now holds: the successor would fail its next renewal and be
/// stopped and replaced. It stays, and the partition consumes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_taken_again_while_it_drains_keeps_its_new_lease() {
    let db = Postgres::create().await;
    Postgres::exec(&db.store, APPLIED_TABLE.into()).await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 2);
    let name = config.name().to_owned();
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        Registry::<Postgres>::new().route(UPDATE, 1, slow_one),
    ));
    let member = one_owner_of_all(&db.store, &broker, &config).await;
    let busy = warren::partition::partition_of(SLOW_CUSTOMER.as_bytes(), 2);
    let busy_queue = config.partition_queues()[busy as usize].clone();
    let idle_queue = config.partition_queues()[1 - busy as usize].clone();
    let first = consumer_tags(&busy_queue).await;
    assert_eq!(first.len(), 1, "{first:?}");
    let busy_lease = || async {
        warren::store::Leases::leases(&db.store, &name)
            .await
            .unwrap_or_default()
            .into_iter()
            .find(|l| l.partition == busy)
    };

    publish_all(&broker, &[update(SLOW_CUSTOMER, 1)]).await;
    assert!(
        wait_for(Duration::from_secs(30), || async {
            SLOW_STARTED.load(std::sync::atomic::Ordering::SeqCst)
        })
        .await,
        "the slow handler never started: {:?}",
        running.stats.snapshot()
    );
    Postgres::exec(
        &db.store,
        "ALTER TABLE warren_partition_leases RENAME TO warren_partition_leases_away".into(),
    )
    .await;
    // A whole TTL unrenewed: every partition stops; the idle one has nothing to
    // drain and leaves its queue.
    assert!(
        wait_for(Duration::from_secs(15), || async {
            broker.consumers(&idle_queue).await == 0
        })
        .await,
        "the partitions did not stop with their leases unrenewed"
    );
    Postgres::exec(
        &db.store,
        "ALTER TABLE warren_partition_leases_away RENAME TO warren_partition_leases".into(),
    )
    .await;

    // Taken again while the old consumer drains: a successor subscribes.
    assert!(
        wait_for(Duration::from_secs(10), || async {
            consumer_tags(&busy_queue).await.len() == 2
        })
        .await,
        "the busy partition was not taken again while it drained: {:?}",
        consumer_tags(&busy_queue).await
    );
    let both = consumer_tags(&busy_queue).await;
    let successor = both
        .difference(&first)
        .next()
        .cloned()
        .unwrap_or_else(|| panic!("no successor beside the old consumer: {both:?}"));
    assert!(
        !SLOW_DONE.load(std::sync::atomic::Ordering::SeqCst),
        "the slow handler ended before its partition was taken again: the test proves nothing"
    );
    // The old consumer drains and leaves; two lease rounds after that (its
    // task is collected at the first), the successor is still the one.
    assert!(
        wait_for(Duration::from_secs(30), || async {
            consumer_tags(&busy_queue).await.len() == 1
        })
        .await,
        "the old consumer never left: {:?}",
        consumer_tags(&busy_queue).await
    );
    let renewed = busy_lease()
        .await
        .expect("the busy partition's lease")
        .expires_ms;
    assert!(
        wait_for(Duration::from_secs(10), || async {
            busy_lease()
                .await
                .is_some_and(|l| l.owner == member && l.expires_ms >= renewed + 1500)
        })
        .await,
        "the busy partition's lease was not renewed: {:?}",
        busy_lease().await
    );
    let tags = consumer_tags(&busy_queue).await;
    assert_eq!(
        tags,
        BTreeSet::from([successor.clone()]),
        "the successor was stopped and replaced after the old consumer drained"
    );

    // The partition consumes on: a second update of the slow customer is
    // applied, after the first.
    publish_all(&broker, &[update(SLOW_CUSTOMER, 2)]).await;
    let stats = running.stats.clone();
    assert!(
        wait_for(Duration::from_secs(60), || {
            let s = stats.snapshot();
            async move { s.applied >= 2 }
        })
        .await,
        "{:?}",
        running.stats.snapshot()
    );
    assert!(running.is_running());
    running.stop().await.unwrap();
    assert_eq!(applied(&db).await[SLOW_CUSTOMER], [1, 2]);
    cleanup(db, broker, &[&config]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_partition_queue_has_a_single_active_consumer() {
    let db = Postgres::create().await;
    let broker = TestBroker::new().await;
    let config = partitioned(&broker, 3);
    first_run(&db, &broker, &config).await;

    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "list_queues",
            "name",
            "arguments",
            "--formatter",
            "json",
        ])
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let queues: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    for p in 0..3 {
        let name = format!("{}.{p}", broker.queue);
        let queue = queues
            .iter()
            .find(|q| q["name"] == name.as_str())
            .unwrap_or_else(|| panic!("{name} declared"));
        let sac = queue["arguments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a[0] == "x-single-active-consumer");
        assert_eq!(
            sac.map(|a| a[2].clone()),
            Some(serde_json::Value::Bool(true)),
            "{name}: {queue}"
        );
    }
    cleanup(db, broker, &[&config]).await;
}
