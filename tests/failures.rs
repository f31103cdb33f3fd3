//! Transient failures and panics: retried until they succeed, applied once.

use crate::util::{Backend, Job, Mode, TestBroker, consume_until};

on_both_backends!(
    transient_failure_is_retried_then_applied_once,
    handler_panic_is_survived,
    a_swallowed_database_error_is_not_acked_as_applied,
);

/// Regression (found in review): on PostgreSQL a failed statement aborts the
/// transaction and COMMIT then quietly rolls back. A handler that ignores the
/// error and returns success must not have its message acked as applied with
/// nothing recorded; it is a failure, retried and finally dead-lettered. On
/// SQLite the failed statement undoes only itself and the message applies.
async fn a_swallowed_database_error_is_not_acked_as_applied<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let sloppy = TestBroker::message(&Job::with(Mode::SwallowError));
    broker.publish(&sloppy).await;
    let s = consume_until(&db, &broker, 1).await;
    if <B as Backend>::NAME == "postgres" {
        assert_eq!((s.applied, s.dead_lettered), (0, 1), "{s:?}");
        assert_eq!(db.inbox(&broker.name).await, 0);
        let dead = broker.drain(&broker.dead_letter_queue()).await;
        let info = warren::DeadLetterInfo::from_properties(&dead[0].properties).unwrap();
        assert_eq!(info.reason, "retries-exhausted");
        assert!(info.error.contains("aborted"), "{}", info.error);
    } else {
        assert_eq!((s.applied, s.dead_lettered), (1, 0), "{s:?}");
        assert_eq!(db.inbox(&broker.name).await, 1);
    }
    broker.cleanup().await;
    db.drop_db().await;
}

async fn transient_failure_is_retried_then_applied_once<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let flaky = TestBroker::message(&Job::with(Mode::Transient { n: 3 }));
    broker.publish(&flaky).await;

    let s = consume_until(&db, &broker, 1).await;
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

    let s = consume_until(&db, &broker, 2).await;
    assert_eq!(s.panics, 1, "{s:?}");
    assert_eq!(s.retried, 1, "a panic is a transient failure: {s:?}");
    assert_eq!(s.applied, 2, "{s:?}");
    assert_eq!(db.effects_for(&panicky.meta().message_id).await, 1);
    assert_eq!(db.effects_for(&after.meta().message_id).await, 1);

    broker.cleanup().await;
    db.drop_db().await;
}
