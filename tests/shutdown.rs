//! Graceful shutdown: what committed is acked, the rest is redelivered; nothing
//! lost, nothing applied twice.

use std::time::Duration;

use warren::Consumer;

use crate::util::{Backend, Job, Mode, Running, TestBroker, routes};

on_all_backends!(
    shutdown_under_load_loses_nothing,
    shutdown_deadline_leaves_unfinished_work_to_redelivery
);

async fn shutdown_under_load_loses_nothing<B: Backend>() {
    const N: u64 = 300;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_concurrency(4)
        .with_prefetch(16)
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    for _ in 0..N {
        broker.publish(&TestBroker::message(&Job::slow(20))).await;
    }

    let first = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(first.settled(40, Duration::from_secs(60)).await);
    first
        .stop()
        .await
        .expect("a requested shutdown is a clean stop");

    // Everything is either applied (and acked) or back in the queue.
    let applied = db.effects().await;
    assert!(
        applied >= 40 && (applied as u64) < N,
        "stopped mid-stream: {applied}"
    );
    assert_eq!(db.inbox(&broker.name).await, applied);
    // The broker returns unacked deliveries to the queue as the channel closes.
    let all_accounted = crate::util::wait_for(Duration::from_secs(10), || async {
        applied + broker.ready(&broker.queue).await as i64 == N as i64
    })
    .await;
    let ready = broker.ready(&broker.queue).await as i64;
    assert!(
        all_accounted,
        "every message is applied or waiting: {applied} + {ready} != {N}"
    );

    let second = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(second.settled(ready as u64, Duration::from_secs(60)).await);
    let s = second.stats.snapshot();
    second.stop().await.unwrap();
    assert_eq!(
        s.duplicates, 0,
        "a graceful stop acks what it committed, so nothing comes back as a duplicate"
    );
    assert_eq!(db.effects().await, N as i64);
    assert_eq!(db.distinct_effects().await, N as i64);
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

/// A handler still running when the deadline passes is abandoned: its transaction
/// rolls back, its delivery is not acked, and the broker redelivers it.
async fn shutdown_deadline_leaves_unfinished_work_to_redelivery<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_shutdown_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let slow = TestBroker::message(&Job::with(Mode::SlowOnce { ms: 10_000 }));
    broker.publish(&slow).await;

    let first = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let stats = first.stats.clone();
    // Wait until the handler is running: the message has left the ready list.
    assert!(
        crate::util::wait_for(Duration::from_secs(20), || async {
            broker.ready(&broker.queue).await == 0
        })
        .await
    );
    first
        .stop()
        .await
        .expect("the first consumer stops cleanly");
    let s = stats.snapshot();
    assert_eq!(
        s.applied, 0,
        "nothing was applied before the deadline: {s:?}"
    );
    assert_eq!(
        db.effects().await,
        0,
        "the abandoned transaction rolled back"
    );
    assert!(
        crate::util::wait_for(Duration::from_secs(10), || async {
            broker.ready(&broker.queue).await == 1
        })
        .await,
        "the unfinished delivery is back in the queue (ready: {})",
        broker.ready(&broker.queue).await
    );

    let second = Running::start(Consumer::new(config, db.store.clone(), routes::<B>()));
    assert!(
        second.settled(1, Duration::from_secs(30)).await,
        "the second consumer applies the redelivered message: {:?}",
        second.stats.snapshot()
    );
    second.stop().await.unwrap();
    assert_eq!(db.effects_for(&slow.meta().message_id).await, 1);

    broker.cleanup().await;
    db.drop_db().await;
}
