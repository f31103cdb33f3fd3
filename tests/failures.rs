//! Transient failures and panics: retried until they succeed, applied once. Data
//! the database refuses: dead-lettered at once.

use std::future::Future;
use std::time::Duration;

use sqlx::{Postgres, Sqlite};
use warren::{Consumer, HandlerError, Message, Registry, Tx};

use crate::util::{Backend, EVENT, Job, Mode, Running, TestBroker, consume_until};

on_all_backends!(
    transient_failure_is_retried_then_applied_once,
    handler_panic_is_survived,
    a_swallowed_database_error_is_not_acked_as_applied,
    data_the_database_refuses_is_dead_lettered_at_once,
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
        let info = warren_admin::DeadLetterInfo::from_properties(&dead[0].properties).unwrap();
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

/// A statement each dialect refuses for its data, whatever the database's state.
trait RefusesData: Backend {
    fn refused_statement(tx: &mut Tx<Self>)
    -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl RefusesData for Postgres {
    /// A NUL character in text: SQLSTATE 22021, class 22.
    async fn refused_statement(tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT length($1::text)")
            .bind("cus_\0nul")
            .execute(tx.conn())
            .await
            .map(drop)
    }
}

impl RefusesData for Sqlite {
    /// SQLite stores a NUL happily; a blob over its length limit is SQLITE_TOOBIG
    /// (zeroblob checks the limit before allocating anything).
    async fn refused_statement(tx: &mut Tx<Sqlite>) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT length(zeroblob(?))")
            .bind(2_000_000_000_i64)
            .execute(tx.conn())
            .await
            .map(drop)
    }
}

#[cfg(feature = "mysql")]
impl RefusesData for sqlx::MySql {
    /// A value too long for its column in strict mode: error 1406.
    async fn refused_statement(tx: &mut Tx<sqlx::MySql>) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO test_effects (message_id) VALUES (?)")
            .bind("x".repeat(300))
            .execute(tx.conn())
            .await
            .map(drop)
    }
}

/// Writes its effect, then runs the refused statement and `?`s its error, which
/// makes it a transient `HandlerError` like any other database error.
async fn refusing<B: RefusesData>(
    msg: Message<serde_json::Value>,
    tx: &mut Tx<B>,
) -> Result<(), HandlerError> {
    B::insert_effect(tx, &msg.meta.message_id).await?;
    B::refused_statement(tx).await?;
    Ok(())
}

/// Issue 10: a value the database refuses (PostgreSQL class 22 and 54, SQLite's
/// equivalents) was retried through every tier, and with the default tiers that
/// is over 40 minutes before `retries-exhausted`. It is dead-lettered as permanent
/// on its first attempt, on both dialects alike.
async fn data_the_database_refuses_is_dead_lettered_at_once<B: RefusesData>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let bad = TestBroker::message(&Job::ok());
    broker.publish(&bad).await;

    let routes = Registry::new().route(EVENT, 1, refusing::<B>);
    let running = Running::start(Consumer::new(broker.config(), db.store.clone(), routes));
    assert!(running.settled(1, Duration::from_secs(30)).await);
    let s = running.stats.snapshot();
    running.stop().await.unwrap();

    assert_eq!((s.dead_lettered, s.retried, s.applied), (1, 0, 0), "{s:?}");
    assert_eq!(db.inbox(&broker.name).await, 0);
    assert_eq!(db.effects_for(&bad.meta().message_id).await, 0);
    let dead = broker.drain(&broker.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1);
    let info = warren_admin::DeadLetterInfo::from_properties(&dead[0].properties).unwrap();
    assert_eq!(info.reason, "permanent-failure");
    assert_eq!(info.attempts, 1);
    assert!(info.error.contains("refused the data"), "{}", info.error);

    broker.cleanup().await;
    db.drop_db().await;
}
