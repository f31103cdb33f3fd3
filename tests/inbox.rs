//! The inbox: each message id applied once per consumer, whatever arrives twice.

use std::time::Duration;

use warren::Consumer;

use crate::util::{Backend, Job, Running, TestBroker, routes, test_config, unique};

on_all_backends!(
    duplicates_are_applied_once,
    concurrent_copies_on_two_instances_apply_once,
    two_consumer_names_each_apply_once,
);

/// 1000 messages, 200 of them published twice: exactly 1000 effects, 200
/// duplicates counted, nothing left in the queues.
async fn duplicates_are_applied_once<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;

    let messages: Vec<_> = (0..1000).map(|_| TestBroker::message(&Job::ok())).collect();
    for (i, m) in messages.iter().enumerate() {
        broker.publish(m).await;
        // Half of the copies follow right behind the original...
        if i % 10 == 0 {
            broker.publish(m).await;
        }
    }
    // ...and half arrive long after the original was applied.
    for m in messages.iter().skip(5).step_by(10) {
        broker.publish(m).await;
    }

    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        running.settled(1200, Duration::from_secs(120)).await,
        "not all deliveries settled: {:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();

    assert_eq!(stats.applied, 1000, "{stats:?}");
    assert_eq!(stats.duplicates, 200, "{stats:?}");
    assert_eq!(stats.dead_lettered + stats.retried, 0, "{stats:?}");
    assert_eq!(db.effects().await, 1000, "one effect per unique message");
    assert_eq!(db.distinct_effects().await, 1000);
    assert_eq!(db.inbox(&broker.name).await, 1000);
    assert_eq!(broker.ready(&broker.queue).await, 0);
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

/// Two instances of one consumer on one queue, each holding one delivery at a time;
/// both copies of each message are published together, so each instance gets one
/// copy and both handle it at the same moment (the handler is slowed down). The
/// second claim waits for the first transaction and then sees the conflict.
async fn concurrent_copies_on_two_instances_apply_once<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_prefetch(1)
        .with_concurrency(1)
        .build()
        .unwrap();
    broker.declare_config(&config).await;

    // Both instances subscribed before anything is published, so the broker
    // alternates between them.
    let a = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let b = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let both_subscribed = crate::util::wait_for(Duration::from_secs(20), || async {
        broker.consumers(&broker.queue).await == 2
    })
    .await;
    assert!(both_subscribed, "two consumers should be subscribed");

    const IDS: u64 = 10;
    let messages: Vec<_> = (0..IDS)
        .map(|_| TestBroker::message(&Job::slow(300)))
        .collect();
    for m in &messages {
        broker.publish(m).await;
        broker.publish(m).await;
    }

    let settled = crate::util::wait_for(Duration::from_secs(60), || async {
        let (sa, sb) = (a.stats.snapshot(), b.stats.snapshot());
        sa.applied + sa.duplicates + sb.applied + sb.duplicates >= 2 * IDS
    })
    .await;
    let (sa, sb) = (a.stats.snapshot(), b.stats.snapshot());
    assert!(settled, "a={sa:?} b={sb:?}");
    a.stop().await.unwrap();
    b.stop().await.unwrap();

    assert_eq!(sa.applied + sb.applied, IDS, "a={sa:?} b={sb:?}");
    assert_eq!(sa.duplicates + sb.duplicates, IDS, "a={sa:?} b={sb:?}");
    assert!(
        sa.applied + sa.duplicates > 0 && sb.applied + sb.duplicates > 0,
        "both instances should have received copies: a={sa:?} b={sb:?}"
    );
    assert_eq!(sa.retried + sb.retried, 0, "a duplicate is not an error");
    assert_eq!(db.effects().await, IDS as i64);
    assert_eq!(db.distinct_effects().await, IDS as i64);
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

/// The same message to two consumers with different names (and queues): each
/// applies it once. Uses classic queues, to cover both queue types.
async fn two_consumer_names_each_apply_once<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let first = broker
        .builder()
        .with_queue_type(warren::topology::QueueType::Classic)
        .build()
        .unwrap();
    let other_queue = unique("wt_other");
    let second = test_config(
        &format!("{}-other", broker.name),
        &other_queue,
        &broker.exchange,
    )
    .with_queue_type(warren::topology::QueueType::Classic)
    .build()
    .unwrap();
    for q in warren::topology::Topology::for_consumer(&second).queue_names() {
        broker.track_queue(q);
    }
    broker.declare_config(&first).await;
    broker.declare_config(&second).await;

    let messages: Vec<_> = (0..5).map(|_| TestBroker::message(&Job::ok())).collect();
    for m in &messages {
        broker.publish(m).await;
    }
    let a = Running::start(Consumer::new(
        first.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let b = Running::start(Consumer::new(
        second.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(a.settled(5, Duration::from_secs(30)).await);
    assert!(b.settled(5, Duration::from_secs(30)).await);
    a.stop().await.unwrap();
    b.stop().await.unwrap();

    assert_eq!(db.effects().await, 10, "each consumer applies each message");
    assert_eq!(db.distinct_effects().await, 5);
    for m in &messages {
        assert_eq!(db.effects_for(&m.meta().message_id).await, 2);
    }
    assert_eq!(db.inbox(first.name()).await, 5);
    assert_eq!(db.inbox(second.name()).await, 5);

    broker.cleanup().await;
    db.drop_db().await;
}
