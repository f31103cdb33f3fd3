//! Batches against the real broker and databases: a queue filled before the
//! consumer starts, so that the consumer finds deliveries buffered and applies
//! them several to a transaction. Failures inside a batch stay with their own
//! message; every other message applies exactly once.

use std::time::Duration;

use warren::config::BatchIsolation;
use warren::{Consumer, Outgoing};

use crate::util::{Backend, Job, Mode, Running, TestBroker};

on_all_backends!(
    failures_inside_batches_stay_with_their_message,
    failures_inside_savepoint_batches_stay_with_their_message,
    a_batch_of_one_keeps_latency_at_low_load,
    a_run_without_conflicts_keeps_the_full_batch_size,
);

async fn failures_inside_batches_stay_with_their_message<B: Backend>() {
    failures_stay_with_their_message::<B>(BatchIsolation::Replay).await;
}

async fn failures_inside_savepoint_batches_stay_with_their_message<B: Backend>() {
    failures_stay_with_their_message::<B>(BatchIsolation::Savepoints {
        handler_savepoints: 0,
    })
    .await;
}

/// 120 messages, among them transient failures, panics, permanent failures, a
/// handler that swallows a database error, and copies of earlier messages, all
/// in the queue before the consumer starts. Each failing message takes its own
/// path; every other one applies once, and the copies are recognized.
async fn failures_stay_with_their_message<B: Backend>(isolation: BatchIsolation) {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let mut healthy = Vec::new();
    let mut permanent = Vec::new();
    let mut swallowing = Vec::new();
    let mut copies = 0;
    let mut published: Vec<Outgoing> = Vec::new();
    for i in 0..120 {
        let job = match i % 20 {
            5 => Job::with(Mode::Transient { n: 1 }),
            9 => Job::with(Mode::PanicOnce),
            13 => Job::with(Mode::Permanent),
            17 => Job::with(Mode::SwallowError),
            _ => Job::ok(),
        };
        let msg = TestBroker::message(&job);
        let id = msg.meta().message_id.clone();
        match job.mode {
            Mode::Permanent => permanent.push(id),
            Mode::SwallowError => swallowing.push(id),
            _ => healthy.push(id),
        }
        broker.publish(&msg).await;
        if i % 10 == 3 {
            // A copy of an earlier healthy message, close behind it: often in
            // the same batch, sometimes in the next.
            broker.publish(&published[published.len() - 2]).await;
            copies += 1;
        }
        published.push(msg);
    }
    let deliveries = 120 + copies;

    let config = broker
        .builder()
        .with_batch_isolation(isolation)
        .build()
        .unwrap();
    let running = Running::start(Consumer::new(
        config,
        db.store.clone(),
        crate::util::routes::<B>(),
    ));
    assert!(
        running.settled(deliveries, Duration::from_secs(60)).await,
        "not settled: {:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    running.stop().await.unwrap();

    assert!(
        s.batches > 0 && s.batched >= 2 * s.batches,
        "the prefilled queue ran in batches: {s:?}"
    );
    for id in &healthy {
        assert_eq!(
            db.effects_for(id).await,
            1,
            "{id} applied exactly once: {s:?}"
        );
    }
    for id in &permanent {
        assert_eq!(db.effects_for(id).await, 0, "{id} rolled back");
    }
    let postgres = <B as Backend>::NAME == "postgres";
    for id in &swallowing {
        // PostgreSQL aborts the transaction at the failed statement: the
        // message cannot commit and ends dead-lettered, and nothing of the
        // batch around it is lost. Elsewhere the statement fails alone.
        assert_eq!(db.effects_for(id).await, i64::from(!postgres), "{id}");
    }
    let dead = permanent.len() + if postgres { swallowing.len() } else { 0 };
    assert_eq!(s.duplicates, copies, "{s:?}");
    assert_eq!(s.dead_lettered, dead as u64, "{s:?}");
    assert_eq!(s.panics, 6, "each panic counted once: {s:?}");
    assert_eq!(
        s.applied,
        (healthy.len() + if postgres { 0 } else { swallowing.len() }) as u64,
        "{s:?}"
    );
    assert_eq!(
        broker.drain(&broker.dead_letter_queue()).await.len(),
        dead,
        "every dead letter has its copy"
    );
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

/// Published one at a time, each waiting for the last to apply, messages
/// never wait for a batch to fill: each runs as a batch of one.
async fn a_batch_of_one_keeps_latency_at_low_load<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        crate::util::routes::<B>(),
    ));
    for n in 1..=5 {
        broker.publish(&TestBroker::message(&Job::ok())).await;
        assert!(
            running.settled(n, Duration::from_secs(30)).await,
            "message {n} applied on its own"
        );
    }
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!((s.applied, s.batches), (5, 0), "no batch formed: {s:?}");

    broker.cleanup().await;
    db.drop_db().await;
}

/// 200 independent messages in the queue before the consumer starts: they run
/// in batches, none of which meets a lock conflict, so the batch size the
/// consumer forms and how many batches it runs at once stay as configured.
async fn a_run_without_conflicts_keeps_the_full_batch_size<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    for _ in 0..200 {
        broker.publish(&TestBroker::message(&Job::ok())).await;
    }
    let config = broker.config();
    let configured = config.batch_size() as u64;
    let running = Running::start(Consumer::new(
        config,
        db.store.clone(),
        crate::util::routes::<B>(),
    ));
    assert!(
        running.settled(200, Duration::from_secs(60)).await,
        "not settled: {:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(s.applied, 200, "{s:?}");
    assert!(s.batches > 0, "they ran in batches: {s:?}");
    assert_eq!(
        (s.conflict_retries, s.batch_size, s.batch_concurrency),
        (0, configured, 8),
        "no conflict, full size, full concurrency: {s:?}"
    );
    assert_eq!(db.effects().await, 200);

    broker.cleanup().await;
    db.drop_db().await;
}
