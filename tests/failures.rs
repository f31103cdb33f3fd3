//! Transient failures and panics: retried until they succeed, applied once.

use std::time::Duration;

use warren::Consumer;

use crate::util::{Backend, Job, Mode, Running, TestBroker, routes};

on_both_backends!(
    transient_failure_is_retried_then_applied_once,
    handler_panic_is_survived
);

async fn transient_failure_is_retried_then_applied_once<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let flaky = TestBroker::message(&Job::with(Mode::Transient { n: 3 }));
    broker.publish(&flaky).await;

    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        running.settled(1, Duration::from_secs(30)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(s.retried, 3, "three transient failures: {s:?}");
    assert_eq!(s.applied, 1, "{s:?}");
    assert_eq!(s.dead_lettered, 0, "{s:?}");
    // Each failed attempt wrote its effect too; only the committed one remains.
    assert_eq!(db.effects_for(&flaky.meta().message_id).await, 1);
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

async fn handler_panic_is_survived<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let panicky = TestBroker::message(&Job::with(Mode::PanicOnce));
    let after = TestBroker::message(&Job::ok());
    broker.publish(&panicky).await;
    broker.publish(&after).await;

    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        running.settled(2, Duration::from_secs(30)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    // The consumer is still running and stops cleanly.
    running.stop().await.unwrap();
    assert_eq!(s.panics, 1, "{s:?}");
    assert_eq!(s.retried, 1, "a panic is a transient failure: {s:?}");
    assert_eq!(s.applied, 2, "{s:?}");
    assert_eq!(db.effects_for(&panicky.meta().message_id).await, 1);
    assert_eq!(db.effects_for(&after.meta().message_id).await, 1);

    broker.cleanup().await;
    db.drop_db().await;
}
