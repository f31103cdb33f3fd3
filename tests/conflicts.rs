//! Lock conflicts against the real databases: a handler that takes stock off
//! a few hot rows (`util::stock`). Transactions that lock the same rows in
//! different orders deadlock; warren runs the loser again at once, in a fresh
//! transaction, at no cost of an attempt, and the stock comes out exact.
//!
//! The certain deadlock runs on PostgreSQL and MySQL/MariaDB only: SQLite has
//! one writer and no deadlocks.

use std::time::Duration;

use warren::Consumer;
use warren::config::ConsumerConfigBuilder;

use crate::util::{
    Backend, Running, SKUS, STOCK, TestBroker, TestDb, assert_stock, hot_orders, order, stock_of,
    stock_routes, with_stock,
};

macro_rules! on_databases_with_locks {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name::<sqlx::Postgres>().await
                }
                #[cfg(feature = "mysql")]
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn mysql() {
                    super::$name::<sqlx::MySql>().await
                }
            }
        )*
    };
}

on_databases_with_locks!(
    a_deadlock_is_run_again_in_place_at_no_cost_of_an_attempt,
    past_its_conflict_retries_a_deadlock_is_a_transient_failure,
);

// SQLite too: one writer at a time has nothing to conflict over, and batching
// must still leave the stock exact.
on_all_backends!(
    hot_rows_reach_no_retry_tier_in_batches,
    hot_rows_reach_no_retry_tier_with_prefetch_256,
);

/// Two orders, each alone in its transaction, take two rows in opposite
/// orders and wait for each other in between: a deadlock for certain. The
/// database picks one to fail; warren runs it again at once, and both apply.
async fn a_deadlock_is_run_again_in_place_at_no_cost_of_an_attempt<B: Backend>() {
    let (retried, conflicts) = deadlocked_pair::<B>(|c| c).await;
    assert_eq!(retried, 0, "no retry tier");
    assert!(
        conflicts >= 1,
        "the loser ran again: {conflicts} conflict retries"
    );
}

/// With no conflict retries, the loser of the same deadlock goes through a
/// retry tier as an ordinary transient failure, and still applies once.
async fn past_its_conflict_retries_a_deadlock_is_a_transient_failure<B: Backend>() {
    let (retried, conflicts) = deadlocked_pair::<B>(|c| c.with_conflict_retries(0)).await;
    assert_eq!(retried, 1, "the loser went through a retry tier");
    assert_eq!(conflicts, 0);
}

/// Runs the deadlocked pair under `configure`d batch size 1 and returns the
/// consumer's retries and conflict retries, once both orders applied and the
/// stock checks out.
async fn deadlocked_pair<B: Backend>(
    configure: impl FnOnce(ConsumerConfigBuilder) -> ConsumerConfigBuilder,
) -> (u64, u64) {
    let db = with_stock::<B>().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let pair = crate::util::unique("pair");
    let (a, b) = (SKUS[0].to_owned(), SKUS[1].to_owned());
    broker
        .publish(&order(
            vec![(a.clone(), 1), (b.clone(), 1)],
            Some(pair.clone()),
        ))
        .await;
    broker
        .publish(&order(vec![(b, 1), (a, 1)], Some(pair)))
        .await;
    let config = configure(broker.builder().with_batch_size(1).with_concurrency(2))
        .build()
        .unwrap();
    let running = Running::start(Consumer::new(config, db.store.clone(), stock_routes::<B>()));
    let applied = crate::util::wait_for(Duration::from_secs(60), || {
        let s = running.stats.snapshot();
        async move { s.applied >= 2 }
    })
    .await;
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert!(applied, "both orders applied: {s:?}");
    assert_eq!(s.dead_lettered, 0, "{s:?}");
    assert_eq!(stock_of(&db, SKUS[0]).await, STOCK - 2);
    assert_eq!(stock_of(&db, SKUS[1]).await, STOCK - 2);
    broker.cleanup().await;
    db.drop_db().await;
    (s.retried, s.conflict_retries)
}

/// The default settings: prefetch 32, 8 batches at once.
async fn hot_rows_reach_no_retry_tier_in_batches<B: Backend>() {
    hot_rows::<B>(|c| c).await.drop_db().await;
}

/// Prefetch 256: up to 8 batches of 32 at once.
async fn hot_rows_reach_no_retry_tier_with_prefetch_256<B: Backend>() {
    hot_rows::<B>(|c| c.with_prefetch(256))
        .await
        .drop_db()
        .await;
}

/// MySQL keeps a lock timeout in the session, which outlives a transaction on
/// a pooled connection: after batches that set their own, every connection of
/// the pool still has the server's, for the application's own queries.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_batches_leave_the_session_lock_timeout_as_they_found_it() {
    let db = hot_rows::<sqlx::MySql>(|c| c.with_prefetch(256)).await;
    let pool = db.store.pool();
    let mut connections = Vec::new();
    for _ in 0..pool.size() {
        connections.push(pool.acquire().await.unwrap());
    }
    assert!(!connections.is_empty());
    for conn in &mut connections {
        let (session, global): (u64, u64) = sqlx::query_as(
            "SELECT @@SESSION.innodb_lock_wait_timeout, @@GLOBAL.innodb_lock_wait_timeout",
        )
        .fetch_one(&mut **conn)
        .await
        .unwrap();
        assert_eq!(session, global);
    }
    drop(connections);
    db.drop_db().await;
}

/// 200 hot orders (`util::hot_orders`) in the queue before the consumer
/// starts, so that it finds them buffered and batches them. Nothing may reach
/// a retry tier or the dead-letter queue, and the stock must be exact. Hands
/// the database back for more checks.
async fn hot_rows<B: Backend>(
    configure: impl FnOnce(ConsumerConfigBuilder) -> ConsumerConfigBuilder,
) -> TestDb<B> {
    let db = with_stock::<B>().await;
    let broker = TestBroker::new().await;
    let config = configure(broker.builder()).build().unwrap();
    broker.declare_config(&config).await;
    let (orders, taken) = hot_orders(200, 22);
    for order in &orders {
        broker.publish(order).await;
    }
    let n = orders.len() as u64;
    let running = Running::start(Consumer::new(config, db.store.clone(), stock_routes::<B>()));
    let settled = crate::util::wait_for(Duration::from_secs(120), || {
        let s = running.stats.snapshot();
        async move { s.applied + s.retried + s.dead_lettered >= n }
    })
    .await;
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert!(settled, "not settled: {s:?}");
    assert_eq!(
        (s.applied, s.retried, s.dead_lettered),
        (n, 0, 0),
        "every order applied, none through a retry tier or to the dead-letter queue: {s:?}"
    );
    assert!(s.batches > 0, "the buffered orders ran in batches: {s:?}");
    assert_stock(&db, &taken).await;
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 0);
    broker.cleanup().await;
    db
}

/// What a PostgreSQL transaction's lock timeout was, per message.
#[derive(serde::Serialize, serde::Deserialize)]
struct Probe {}

async fn probe_lock_timeout(
    msg: warren::Message<Probe>,
    tx: &mut warren::Tx<sqlx::Postgres>,
) -> Result<(), warren::HandlerError> {
    sqlx::query(
        "INSERT INTO test_lock_timeouts (message_id, lock_timeout) \
         VALUES ($1, current_setting('lock_timeout'))",
    )
    .bind(&msg.meta.message_id)
    .execute(tx.conn())
    .await?;
    Ok(())
}

/// A transaction of several messages waits for a row lock no longer than the
/// batch lock timeout; one of a single message keeps the server's setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_only_batches_set_their_own_lock_timeout() {
    let db = <sqlx::Postgres as Backend>::create().await;
    <sqlx::Postgres as Backend>::exec(
        &db.store,
        "CREATE TABLE test_lock_timeouts (message_id TEXT PRIMARY KEY, lock_timeout TEXT NOT NULL)"
            .into(),
    )
    .await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let probe = || warren::Outgoing::new("test.probe", 1, &Probe {}).unwrap();
    for _ in 0..40 {
        broker.publish(&probe()).await;
    }
    let config = broker.builder().build().unwrap();
    let running = Running::start(Consumer::new(
        config,
        db.store.clone(),
        warren::Registry::new().route("test.probe", 1, probe_lock_timeout),
    ));
    assert!(running.settled(40, Duration::from_secs(60)).await);
    // Alone now: the queue is empty, so it runs in a transaction of its own.
    let alone = probe();
    broker.publish(&alone).await;
    assert!(running.settled(41, Duration::from_secs(60)).await);
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert!(s.batches > 0, "the first 40 ran in batches: {s:?}");
    let batched = <sqlx::Postgres as Backend>::count(
        &db.store,
        "SELECT count(*) FROM test_lock_timeouts WHERE lock_timeout = '25ms'".into(),
    )
    .await;
    assert_eq!(
        batched as u64, s.batched,
        "every message of a batch ran under the batch lock timeout: {s:?}"
    );
    let single = <sqlx::Postgres as Backend>::count(
        &db.store,
        format!(
            "SELECT count(*) FROM test_lock_timeouts WHERE message_id = '{}' \
             AND lock_timeout = current_setting('lock_timeout')",
            alone.meta().message_id
        ),
    )
    .await;
    assert_eq!(
        single, 1,
        "the message alone kept the server's lock timeout"
    );
    broker.cleanup().await;
    db.drop_db().await;
}
