//! What only MySQL and MariaDB can get wrong: collations that fold case and
//! trailing spaces, a claim that must wait on a concurrent copy, deadlocks that
//! roll the whole transaction back, and statements that commit it implicitly.
//! Each ends with every distinct id applied once and nothing acked that did not
//! commit. Run through the test kit on a real MariaDB (or MySQL) database.

use std::time::Duration;

use sqlx::MySql;
use warren::retry::RetryPolicy;
use warren::testing::{Settled, TestConsumer};
use warren::{ConsumerConfig, HandlerError, Message, Outgoing, Registry, Tx};

use crate::util::{Backend, TestDb, unique};

const EVENT: &str = "test.mysql";

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Step {
    /// Rows of `test_locks` to update, in this order, pausing between them.
    #[serde(default)]
    lock: Vec<i64>,
    /// Run DDL inside the handler.
    #[serde(default)]
    ddl: bool,
}

async fn step(msg: Message<Step>, tx: &mut Tx<MySql>) -> Result<(), HandlerError> {
    MySql::insert_effect(tx, &msg.meta.message_id).await?;
    for (n, row) in msg.payload.lock.iter().enumerate() {
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        sqlx::query("UPDATE test_locks SET n = n + 1 WHERE id = ?")
            .bind(row)
            .execute(tx.conn())
            .await?;
    }
    if msg.payload.ddl {
        // Commits the transaction implicitly, claim and effect included.
        let table = unique("t");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (id INT)"
        )))
        .execute(tx.conn())
        .await?;
    }
    Ok(())
}

async fn kit(db: &TestDb<MySql>) -> TestConsumer<warren::MySqlStore> {
    sqlx::query(
        "CREATE TABLE test_locks (id BIGINT PRIMARY KEY, n BIGINT NOT NULL) ENGINE = InnoDB",
    )
    .execute(db.store.pool())
    .await
    .unwrap();
    sqlx::query("INSERT INTO test_locks (id, n) VALUES (1, 0), (2, 0)")
        .execute(db.store.pool())
        .await
        .unwrap();
    let config = ConsumerConfig::builder(unique("my"), unique("my"))
        .with_retry(RetryPolicy::new([Duration::from_millis(100)]).with_max_attempts(5))
        .build()
        .unwrap();
    TestConsumer::new(
        config,
        db.store.clone(),
        Registry::new().route(EVENT, 1, step),
    )
    .await
    .unwrap()
}

fn message(id: &str, step: &Step) -> Outgoing {
    Outgoing::new(EVENT, 1, step).unwrap().with_message_id(id)
}

fn plain() -> Step {
    Step {
        lock: Vec::new(),
        ddl: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_differ_only_by_case_or_trailing_spaces_are_distinct() {
    let db = MySql::create().await;
    let kit = kit(&db).await;
    let ids = ["inv-A", "inv-a", "inv-a ", "inv-a  "];
    for id in ids {
        assert_eq!(
            kit.deliver(&message(id, &plain())).await,
            Settled::Applied,
            "{id:?}"
        );
    }
    for id in ids {
        assert_eq!(
            kit.redeliver(&message(id, &plain())).await,
            Settled::Duplicate,
            "{id:?}"
        );
        assert_eq!(db.effects_for(id).await, 1, "{id:?} applied once");
    }
    assert_eq!(db.effects().await, 4);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicate_claims_apply_once() {
    let db = MySql::create().await;
    let kit = kit(&db).await;
    let m = message(&unique("dup"), &plain());
    let settled = futures_util::future::join_all((0..8).map(|_| kit.deliver(&m))).await;
    let applied = settled.iter().filter(|s| **s == Settled::Applied).count();
    let duplicates = settled.iter().filter(|s| **s == Settled::Duplicate).count();
    assert_eq!((applied, duplicates), (1, 7), "{settled:?}");
    assert_eq!(db.effects().await, 1);
    db.drop_db().await;
}

/// Two messages lock two rows in opposite orders: MySQL rolls one back with
/// a deadlock (1213). It runs again at once, in a fresh transaction, at no
/// cost of an attempt, and both apply once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_victim_runs_again_in_place_and_both_apply_once() {
    let db = MySql::create().await;
    let kit = kit(&db).await;
    let a = message(
        &unique("a"),
        &Step {
            lock: vec![1, 2],
            ddl: false,
        },
    );
    let b = message(
        &unique("b"),
        &Step {
            lock: vec![2, 1],
            ddl: false,
        },
    );
    let (sa, sb) = tokio::join!(kit.deliver(&a), kit.deliver(&b));
    assert_eq!(
        (sa, sb),
        (Settled::Applied, Settled::Applied),
        "neither went through a retry tier"
    );
    assert!(
        kit.stats().conflict_retries >= 1,
        "the victim ran again: {:?}",
        kit.stats()
    );
    for m in [&a, &b] {
        assert_eq!(db.effects_for(&m.meta().message_id).await, 1);
    }
    let locked: i64 = sqlx::query_scalar("SELECT CAST(SUM(n) AS SIGNED) FROM test_locks")
        .fetch_one(db.store.pool())
        .await
        .unwrap();
    assert_eq!(locked, 4, "each message's updates applied once");
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_runs_ddl_is_not_acked_as_applied() {
    let db = MySql::create().await;
    let kit = kit(&db).await;
    let m = message(
        &unique("ddl"),
        &Step {
            lock: Vec::new(),
            ddl: true,
        },
    );
    let first = kit.deliver(&m).await;
    assert!(
        matches!(&first, Settled::Retried { error, .. } if error.contains("aborted")),
        "the implicit commit is caught before the ack: {first:?}"
    );
    // The DDL committed the claim and the effect on its own; the retry finds
    // the claim and applies nothing more.
    assert_eq!(kit.next_attempt().await, Settled::Duplicate);
    assert_eq!(db.effects().await, 1);
    db.drop_db().await;
}
