//! The transactional outbox and its relay: rows exist only if their transaction
//! committed, are published with confirms, and are never lost or silently dropped.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use warren::broker::{BrokerError, Publisher};
use warren::lapin::types::AMQPValue;
use warren::store::OutboxStore;
use warren::{Consumer, Outgoing, Relay, RelayConfig};

use crate::util::{
    Backend, Job, Mode, OUT_EVENT, Proxy, TestBroker, amqp_url, queue_policy, routes, wait_for,
};

on_all_backends!(
    row_is_invisible_until_its_transaction_commits,
    handler_outbox_rows_follow_the_transaction,
    broker_down_rows_wait_and_are_published_after,
    unroutable_row_is_marked_failed_not_published,
    housekeeping_deletes_published_rows_past_retention_only,
    two_relays_publish_each_row_once,
    a_row_to_a_missing_exchange_is_failed_and_the_rest_go_out,
    a_frozen_broker_holds_a_batch_no_longer_than_its_deadline,
    each_store_wakes_its_own_relays,
    a_partition_key_leaves_the_outbox_as_a_long_string,
);

/// A quorum queue that refused a publish (its length limit reached, with
/// `reject-publish`) goes on refusing the channel it refused after the limit is
/// lifted, on RabbitMQ 3.10 (rabbitmq-server #12206): every retry copy, dead
/// letter or relay row for it would fail until the process reconnects. The
/// publisher takes a new channel after a nack (at most one per 5 s), so once
/// the limit is lifted publishes go in again, also when the new channel was
/// refused too while the queue was still full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_refused_by_a_full_quorum_queue_publishes_again_once_the_limit_is_lifted() {
    let broker = TestBroker::new().await;
    let queue = format!("{}.limited", broker.queue);
    broker
        .declare_queue(
            &queue,
            &[
                ("x-queue-type", AMQPValue::LongString("quorum".into())),
                ("x-overflow", AMQPValue::LongString("reject-publish".into())),
            ],
        )
        .await;
    let limit = warren_chaos::QueuePolicy::set(
        &format!("{}-limit", broker.queue),
        &format!("^{}$", queue.replace('.', "\\.")),
        r#"{"max-length": 1}"#,
    )
    .unwrap();
    assert!(
        wait_for(Duration::from_secs(20), || async {
            queue_policy(&queue).await.is_some()
        })
        .await,
        "the policy never reached {queue}"
    );

    let publisher = Publisher::new(Arc::new(
        warren::broker::connect(&amqp_url(), "limited publisher")
            .await
            .unwrap(),
    ));
    let publish = |n: u32| {
        let publisher = &publisher;
        let queue = &queue;
        async move {
            publisher
                .publish_raw("", queue, n.to_string().as_bytes(), Default::default())
                .await
        }
    };
    // The queue takes a publish and then finds itself at its limit: the
    // refusal comes within a few publishes.
    let mut refused = false;
    for n in 0..20 {
        match publish(n).await {
            Ok(()) => {}
            Err(BrokerError::Nacked { .. }) => {
                refused = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused, "the full queue never refused a publish");
    // Still full: the new channel taken after the nack is refused as well
    // (after taking at most one more), too soon after the first nack to be
    // replaced at once.
    let mut refused_again = 0;
    for n in 20..23 {
        if let Err(BrokerError::Nacked { .. }) = publish(n).await {
            refused_again += 1;
        }
    }
    assert!(refused_again >= 2, "the queue is still full");

    drop(limit);
    assert!(
        wait_for(Duration::from_secs(20), || async {
            queue_policy(&queue).await.is_none()
        })
        .await,
        "the policy stayed on {queue}"
    );
    let mut next = 100;
    assert!(
        wait_for(Duration::from_secs(20), || {
            next += 1;
            let n = next;
            let publish = &publish;
            async move { publish(n).await.is_ok() }
        })
        .await,
        "no publish went in after the limit was lifted"
    );
    broker.cleanup().await;
}

/// Each publish learns its own fate. Many tasks publish at once through one
/// publisher, half to a queue that refuses every message (length 0,
/// `reject-publish`), half to one that takes them. The client numbers a
/// publish for its confirm and then queues its frames, and two tasks on two
/// threads could cross between those steps: the broker then numbers them the
/// other way round, and each gets the other's confirm. A refused copy taken
/// for confirmed is a message lost (its original is acked); a taken one taken
/// for refused is a copy too many. Seen as one forwarded update lost in a
/// partitioned consumer under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_each_get_their_own_confirm() {
    const TASKS: usize = 8;
    const EACH: usize = 300;
    let broker = TestBroker::new().await;
    let refusing = format!("{}.refusing", broker.queue);
    let taking = format!("{}.taking", broker.queue);
    broker
        .declare_queue(
            &refusing,
            &[
                ("x-max-length", AMQPValue::LongLongInt(0)),
                ("x-overflow", AMQPValue::LongString("reject-publish".into())),
            ],
        )
        .await;
    broker.declare_queue(&taking, &[]).await;

    let publisher = Arc::new(Publisher::new(Arc::clone(&broker.connection)));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let publisher = Arc::clone(&publisher);
            let queue = if t % 2 == 0 {
                refusing.clone()
            } else {
                taking.clone()
            };
            tokio::spawn(async move {
                let mut results = Vec::with_capacity(EACH);
                for i in 0..EACH {
                    let body = format!("{t}-{i}");
                    let result = publisher
                        .publish_raw("", &queue, body.as_bytes(), Default::default())
                        .await;
                    results.push(result);
                }
                (t % 2 == 0, results)
            })
        })
        .collect();
    let (mut refused_taken_as_confirmed, mut taken_taken_as_refused, mut other) = (0, 0, vec![]);
    for task in tasks {
        let (refuses, results) = task.await.unwrap();
        for result in results {
            match (refuses, result) {
                (true, Ok(())) => refused_taken_as_confirmed += 1,
                (false, Err(BrokerError::Nacked { .. })) => taken_taken_as_refused += 1,
                (true, Err(BrokerError::Nacked { .. })) | (false, Ok(())) => {}
                (_, Err(e)) => other.push(e.to_string()),
            }
        }
    }
    assert_eq!(
        (refused_taken_as_confirmed, taken_taken_as_refused),
        (0, 0),
        "confirms handed to the wrong publish (refused ones confirmed, taken ones refused)"
    );
    assert!(other.is_empty(), "publishes failed otherwise: {other:?}");
    let expected = (TASKS / 2 * EACH) as u32;
    assert_eq!(
        broker.ready(&taking).await,
        expected,
        "every confirmed copy is in its queue"
    );
    assert_eq!(broker.ready(&refusing).await, 0);
    broker.cleanup().await;
}

/// The hash exchange hashes the header's AMQP type with its value: an event
/// written with a partition key must leave the relay with that header as a
/// long string, exactly as `Publisher::publish` would send it.
async fn a_partition_key_leaves_the_outbox_as_a_long_string<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let relay = Relay::new(db.store.clone(), relay_config(&broker));
    let publisher = Publisher::new(Arc::clone(&broker.connection));
    let msg = event(1)
        .with_partition_key("cus_7")
        .with_header("tenant", "t-1");
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &msg)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(relay.run_once(&publisher).await.unwrap(), (1, false));
    let got = broker.drain(&capture).await;
    assert_eq!(got.len(), 1);
    let headers = got[0].properties.headers().clone().unwrap_or_default();
    for (name, value) in [("partition-key", "cus_7"), ("tenant", "t-1")] {
        match headers.inner().get(name) {
            Some(AMQPValue::LongString(s)) => {
                assert_eq!(s.to_string(), value, "{name}");
            }
            other => panic!("{name} is not a long string: {other:?}"),
        }
    }
    broker.cleanup().await;
    db.drop_db().await;
}

/// Regression (issue 10): against a broker that stopped answering, a batch
/// waited up to 30 s per confirm, then again per row in the fallback, holding the
/// rows' locks and a pooled connection all along. Now the whole batch has one
/// deadline, and its rows stay pending for the next pass.
async fn a_frozen_broker_holds_a_batch_no_longer_than_its_deadline<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let proxy = Proxy::start().await;
    let connection = Arc::new(
        warren::broker::connect(&proxy.url(), "frozen")
            .await
            .unwrap(),
    );
    let publisher = Publisher::new(Arc::clone(&connection));
    let relay = Relay::new(
        db.store.clone(),
        relay_config(&broker).with_batch_deadline(Duration::from_secs(2)),
    );
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    for n in 0..3 {
        warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event(n))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    proxy.freeze();
    let pass = tokio::time::timeout(Duration::from_secs(10), relay.run_once(&publisher))
        .await
        .expect("the batch ends at its deadline, not after the broker's");
    assert_eq!(pass.unwrap(), (3, true), "taken, and trouble reported");
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!(status.pending, 3, "the rows wait for the next pass");
    assert!(status.failed.is_empty());
    proxy.down();
    broker.cleanup().await;
    db.drop_db().await;
}

/// Regression (issue 10): the wake-up after a commit was one process-wide
/// `notify_one`, which woke one relay of the process, not necessarily one of the
/// store that was written. Each store now wakes its own relays.
async fn each_store_wakes_its_own_relays<B: Backend>() {
    let (first, second) = (B::create().await, B::create().await);
    let broker = TestBroker::new().await;
    let capture = broker.capture().await;
    // Polling so rarely that only a wake-up can explain a prompt publish.
    let config = relay_config(&broker).with_poll_interval(Duration::from_secs(120));
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut relays = Vec::new();
    for db in [&first, &second] {
        let relay = Relay::new(db.store.clone(), config.clone());
        let mut stopping = stopping.clone();
        relays.push(tokio::spawn(async move {
            relay
                .run(&amqp_url(), async move {
                    let _ = stopping.wait_for(|s| *s).await;
                })
                .await
        }));
    }
    // Both relays have made their first pass and sleep until woken.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for round in 0..4u32 {
        // The same store twice in a row: a process-wide `notify_one` wakes the
        // relays in turn, so the second round would wake the wrong one.
        let db = if round < 2 { &first } else { &second };
        let mut tx = B::pool(&db.store).begin().await.unwrap();
        warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event(round))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        warren::store::Store::wakeups(&db.store).wake();
        assert!(
            wait_for(Duration::from_secs(10), || async {
                broker.ready(&capture).await == round + 1
            })
            .await,
            "round {round}: the written store's relay woke"
        );
    }
    stop.send(true).unwrap();
    for r in relays {
        r.await.unwrap().unwrap();
    }
    broker.cleanup().await;
    first.drop_db().await;
    second.drop_db().await;
}

/// Regression (found in review): publishing to an exchange that does not exist
/// makes the broker close the channel, failing every row pipelined with it; the
/// oldest such row then headed every batch and the outbox stalled. Now the bad
/// row alone is marked failed and the others are published in the same pass.
async fn a_row_to_a_missing_exchange_is_failed_and_the_rest_go_out<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let relay = Relay::new(db.store.clone(), relay_config(&broker));
    let publisher = Publisher::new(Arc::clone(&broker.connection));
    let missing = format!("{}.nowhere", broker.exchange);
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    let lost = event(0);
    warren::outbox::enqueue::<B>(&mut tx, &missing, "out.event", &lost)
        .await
        .unwrap();
    for n in 1..4 {
        warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event(n))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    assert_eq!(relay.run_once(&publisher).await.unwrap(), (4, false));
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!((status.pending, status.published), (0, 3), "{status:?}");
    assert_eq!(status.failed.len(), 1);
    assert_eq!(status.failed[0].message_id, lost.meta().message_id);
    assert!(
        status.failed[0].last_error.contains("NOT_FOUND"),
        "{:?}",
        status.failed[0]
    );
    assert_eq!(broker.drain(&capture).await.len(), 3);

    broker.cleanup().await;
    db.drop_db().await;
}

async fn housekeeping_deletes_published_rows_past_retention_only<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    broker.capture().await;
    let publisher = Publisher::new(Arc::clone(&broker.connection));
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    for n in 0..3 {
        warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event(n))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let keep = Relay::new(db.store.clone(), relay_config(&broker));
    keep.run_once(&publisher).await.unwrap();
    // One more row, left pending: housekeeping must never touch it.
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event(9))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    assert_eq!(
        keep.delete_expired().await.unwrap(),
        0,
        "7 days have not passed"
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let short = Relay::new(
        db.store.clone(),
        relay_config(&broker).with_retention(Duration::from_millis(10)),
    );
    assert_eq!(short.delete_expired().await.unwrap(), 3);
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!((status.pending, status.published), (1, 0));

    broker.cleanup().await;
    db.drop_db().await;
}

fn relay_config(broker: &TestBroker) -> RelayConfig {
    RelayConfig::new(format!("{}-relay", broker.name))
        .with_poll_interval(Duration::from_millis(200))
}

fn event(n: u32) -> Outgoing {
    Outgoing::new(OUT_EVENT, 1, &serde_json::json!({ "n": n })).unwrap()
}

async fn row_is_invisible_until_its_transaction_commits<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let relay = Relay::new(db.store.clone(), relay_config(&broker));
    let publisher = Publisher::new(Arc::clone(&broker.connection));

    let msg = event(1);
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &msg)
        .await
        .unwrap();
    // A relay pass while the row's transaction is open: on PostgreSQL it finds
    // nothing; on SQLite it waits for the write lock. Either way nothing goes out.
    let relay = Arc::new(relay);
    let publisher = Arc::new(publisher);
    let pass = {
        let (relay, publisher) = (Arc::clone(&relay), Arc::clone(&publisher));
        tokio::spawn(async move { relay.run_once(&publisher).await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        broker.ready(&capture).await,
        0,
        "nothing published before the commit"
    );
    tx.commit().await.unwrap();
    let (first, _) = pass.await.unwrap();
    if first == 0 {
        assert_eq!(relay.run_once(&publisher).await.unwrap(), (1, false));
    }

    let got = broker.drain(&capture).await;
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].properties.message_id().as_ref().unwrap().as_str(),
        msg.meta().message_id,
        "the id fixed at insert is the id published"
    );
    assert_eq!(got[0].data, msg.body());
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!((status.pending, status.published), (0, 1));

    // A rolled-back row never existed.
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event(2))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(relay.run_once(&publisher).await.unwrap(), (0, false));
    assert_eq!(relay.stats().published, 1);

    broker.cleanup().await;
    db.drop_db().await;
}

/// A handler writes two outbox events and then fails transiently once: the failed
/// attempt's events roll back with it, the retry's two are published. A
/// dead-lettered message publishes nothing.
async fn handler_outbox_rows_follow_the_transaction<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let flaky =
        TestBroker::message(&Job::with(Mode::Transient { n: 1 }).emitting(2, &broker.exchange));
    let doomed = TestBroker::message(&Job::with(Mode::Permanent).emitting(2, &broker.exchange));
    broker.publish(&flaky).await;
    broker.publish(&doomed).await;

    let consumer = Consumer::new(broker.config(), db.store.clone(), routes::<B>());
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_config = relay_config(&broker);
    let task = tokio::spawn(async move {
        consumer
            .run_with_relay(&amqp_url(), relay_config, async {
                let _ = stopped.await;
            })
            .await
    });
    assert!(
        wait_for(Duration::from_secs(30), || {
            let s = stats.snapshot();
            async move { s.applied + s.dead_lettered == 2 }
        })
        .await
    );
    assert!(
        wait_for(Duration::from_secs(30), || async {
            broker.ready(&capture).await >= 2
        })
        .await,
        "the relay beside the consumer publishes the committed events"
    );
    let _ = stop.send(());
    task.await.unwrap().unwrap();

    let status = db.store.outbox_status().await.unwrap();
    assert_eq!(
        (status.pending, status.published),
        (0, 2),
        "only the committed attempt's rows ever existed"
    );
    let got = broker.drain(&capture).await;
    assert_eq!(got.len(), 2);
    let ids: HashSet<_> = got
        .iter()
        .map(|d| d.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 2, "two distinct events");
    for d in &got {
        let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(body["causationId"], flaky.meta().message_id.as_str());
        assert_eq!(body["correlationId"], flaky.meta().correlation_id.as_str());
        assert_eq!(body["eventType"], OUT_EVENT);
    }

    broker.cleanup().await;
    db.drop_db().await;
}

/// With the broker unreachable the rows wait; when it is back they are published.
async fn broker_down_rows_wait_and_are_published_after<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let proxy = Proxy::start().await;
    proxy.down();

    let relay = Relay::new(db.store.clone(), relay_config(&broker));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let url = proxy.url();
    let running = tokio::spawn(async move {
        relay
            .run(&url, async {
                let _ = stopped.await;
            })
            .await
    });

    let mut tx = B::pool(&db.store).begin().await.unwrap();
    for n in 0..5 {
        warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event(n))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    warren::store::Store::wakeups(&db.store).wake();
    // The relay keeps trying for a while; nothing can go out.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!(status.pending, 5, "rows wait while the broker is away");
    assert!(status.oldest_pending.is_some());
    assert_eq!(broker.ready(&capture).await, 0);

    proxy.up();
    assert!(
        wait_for(Duration::from_secs(40), || async {
            broker.ready(&capture).await == 5
        })
        .await,
        "published once the broker is back"
    );
    let _ = stop.send(());
    running.await.unwrap().unwrap();
    assert_eq!(db.store.outbox_status().await.unwrap().pending, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

async fn unroutable_row_is_marked_failed_not_published<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let relay = Relay::new(db.store.clone(), relay_config(&broker));
    let publisher = Publisher::new(Arc::clone(&broker.connection));

    let lost = event(1);
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &lost)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // No queue is bound for out.event yet.
    assert_eq!(relay.run_once(&publisher).await.unwrap(), (1, false));
    let stats = relay.stats();
    assert_eq!((stats.published, stats.failed), (0, 1));
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!((status.pending, status.published), (0, 0));
    assert_eq!(status.failed.len(), 1);
    assert_eq!(status.failed[0].message_id, lost.meta().message_id);
    assert!(
        status.failed[0].last_error.contains("unroutable"),
        "{:?}",
        status.failed[0]
    );
    assert_eq!(
        relay.run_once(&publisher).await.unwrap(),
        (0, false),
        "a failed row is not retried by itself"
    );

    // Once something listens, an operator re-queues it and it goes out.
    let capture = broker.capture().await;
    assert_eq!(db.store.retry_failed(&[]).await.unwrap(), 1);
    assert_eq!(relay.run_once(&publisher).await.unwrap(), (1, false));
    assert_eq!(broker.drain(&capture).await.len(), 1);
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!(
        (status.pending, status.published, status.failed.len()),
        (0, 1, 0)
    );

    broker.cleanup().await;
    db.drop_db().await;
}

/// Two relays on one outbox of 5000 rows: every row published, none twice
/// (PostgreSQL: `FOR UPDATE SKIP LOCKED`; SQLite: leases).
async fn two_relays_publish_each_row_once<B: Backend>() {
    const N: u32 = 5000;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let pool = B::pool(&db.store).clone();
    for chunk in 0..(N / 500) {
        let mut tx = pool.begin().await.unwrap();
        for n in 0..500 {
            warren::outbox::enqueue::<B>(
                &mut tx,
                &broker.exchange,
                "out.event",
                &event(chunk * 500 + n),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }

    let mut stops = Vec::new();
    let mut tasks = Vec::new();
    let mut relays = Vec::new();
    for i in 0..2 {
        let relay = Arc::new(Relay::new(
            db.store.clone(),
            RelayConfig::new(format!("{}-relay-{i}", broker.name)).with_batch_size(50),
        ));
        relays.push(Arc::clone(&relay));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop);
        tasks.push(tokio::spawn(async move {
            let connection = Arc::new(
                warren::broker::connect(&amqp_url(), "relay test")
                    .await
                    .unwrap(),
            );
            let publisher = Publisher::new(connection);
            let mut stopped = stopped;
            loop {
                let (taken, trouble) = relay.run_once(&publisher).await.unwrap();
                assert!(!trouble);
                if taken == 0 && stopped.try_recv().is_ok() {
                    break;
                }
                if taken == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    let store = db.store.clone();
    assert!(
        wait_for(Duration::from_secs(120), || {
            let store = store.clone();
            async move { store.outbox_status().await.unwrap().pending == 0 }
        })
        .await
    );
    for s in stops {
        let _ = s.send(());
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (a, b) = (relays[0].stats(), relays[1].stats());
    assert_eq!(a.published + b.published, u64::from(N), "a={a:?} b={b:?}");
    assert!(
        a.published > 0 && b.published > 0,
        "both relays worked: a={a:?} b={b:?}"
    );

    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&capture).await == N
        })
        .await
    );
    let got = broker.drain(&capture).await;
    let ids: HashSet<_> = got
        .iter()
        .map(|d| d.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    assert_eq!(got.len(), N as usize, "no row published twice");
    assert_eq!(ids.len(), N as usize);

    broker.cleanup().await;
    db.drop_db().await;
}
