//! Lock conflicts against the real databases: a handler that takes stock off
//! a few hot rows, in whatever order an order's lines come. Transactions that
//! lock the same rows in different orders deadlock; warren runs the loser
//! again at once, in a fresh transaction, at no cost of an attempt, and the
//! stock comes out exact.
//!
//! The certain deadlock runs on PostgreSQL and MySQL/MariaDB only: SQLite has
//! one writer and no deadlocks.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use warren::config::ConsumerConfigBuilder;
use warren::{Consumer, HandlerError, Message, Outgoing, Registry, Tx};

use crate::util::{Backend, Running, TestBroker, TestDb};

const ORDER: &str = "test.order";
const SKUS: [&str; 4] = ["sku-a", "sku-b", "sku-c", "sku-d"];
const STOCK: i64 = 100_000;

/// An order: stock to take, line by line, in this order.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    lines: Vec<(String, i64)>,
    /// After its first line, wait until the other order of this pair has
    /// taken its first line too (on the first run only): two such orders
    /// whose lines go in opposite orders then deadlock for certain.
    #[serde(default)]
    pair: Option<String>,
}

/// The pairs waiting for each other, and the messages that already met.
static PAIRS: LazyLock<Mutex<HashMap<String, Arc<tokio::sync::Barrier>>>> =
    LazyLock::new(Default::default);
static MET: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

async fn take_stock<B: Backend>(msg: Message<Order>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    for (n, (sku, qty)) in msg.payload.lines.iter().enumerate() {
        B::take_stock(tx, sku, *qty).await?;
        if n == 0
            && let Some(pair) = &msg.payload.pair
            && MET.lock().unwrap().insert(msg.meta.message_id.clone())
        {
            let barrier = Arc::clone(
                PAIRS
                    .lock()
                    .unwrap()
                    .entry(pair.clone())
                    .or_insert_with(|| Arc::new(tokio::sync::Barrier::new(2))),
            );
            // Bounded, so a pair that never runs side by side fails the test's
            // count instead of hanging it.
            let _ = tokio::time::timeout(Duration::from_secs(20), barrier.wait()).await;
        }
    }
    Ok(())
}

fn routes<B: Backend>() -> Registry<B> {
    Registry::new().route(ORDER, 1, take_stock::<B>)
}

async fn with_stock<B: Backend>() -> TestDb<B> {
    let db = B::create().await;
    B::exec(
        &db.store,
        "CREATE TABLE test_stock (sku VARCHAR(64) PRIMARY KEY, available BIGINT NOT NULL)".into(),
    )
    .await;
    for sku in SKUS {
        B::exec(
            &db.store,
            format!("INSERT INTO test_stock (sku, available) VALUES ('{sku}', {STOCK})"),
        )
        .await;
    }
    db
}

async fn stock_of<B: Backend>(db: &TestDb<B>, sku: &str) -> i64 {
    B::count(
        &db.store,
        format!("SELECT available FROM test_stock WHERE sku = '{sku}'"),
    )
    .await
}

fn order(lines: Vec<(String, i64)>, pair: Option<String>) -> Outgoing {
    Outgoing::new(ORDER, 1, &Order { lines, pair }).unwrap()
}

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
    hot_rows_in_random_order_reach_no_retry_tier_in_batches,
    hot_rows_in_random_order_reach_no_retry_tier_with_prefetch_256,
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
    let running = Running::start(Consumer::new(config, db.store.clone(), routes::<B>()));
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
async fn hot_rows_in_random_order_reach_no_retry_tier_in_batches<B: Backend>() {
    hot_rows::<B>(|c| c).await;
}

/// Prefetch 256: up to 8 batches of 32 at once.
async fn hot_rows_in_random_order_reach_no_retry_tier_with_prefetch_256<B: Backend>() {
    hot_rows::<B>(|c| c.with_prefetch(256)).await;
}

/// 200 orders of 1 to 3 lines over 4 hot rows, in the queue before the
/// consumer starts, so that it finds them buffered and batches them. Each
/// order takes its lines in one order (by SKU), so that orders alone never
/// deadlock; a batch takes the rows of many orders, in the order the orders
/// came, so batches lock the same rows in different orders. Nothing may reach
/// a retry tier or the dead-letter queue, and the stock must be exact.
async fn hot_rows<B: Backend>(
    configure: impl FnOnce(ConsumerConfigBuilder) -> ConsumerConfigBuilder,
) {
    let db = with_stock::<B>().await;
    let broker = TestBroker::new().await;
    let config = configure(broker.builder()).build().unwrap();
    broker.declare_config(&config).await;
    let orders = 200;
    let mut taken: HashMap<&str, i64> = HashMap::new();
    let mut rng = fastrand::Rng::with_seed(22);
    for _ in 0..orders {
        let mut skus = SKUS.to_vec();
        rng.shuffle(&mut skus);
        skus.truncate(rng.usize(1..=3));
        skus.sort_unstable();
        let lines: Vec<(String, i64)> = skus
            .iter()
            .map(|&sku| {
                let qty = rng.i64(1..=3);
                *taken.entry(sku).or_default() += qty;
                (sku.to_owned(), qty)
            })
            .collect();
        broker.publish(&order(lines, None)).await;
    }
    let running = Running::start(Consumer::new(config, db.store.clone(), routes::<B>()));
    let settled = crate::util::wait_for(Duration::from_secs(120), || {
        let s = running.stats.snapshot();
        async move { s.applied + s.retried + s.dead_lettered >= orders }
    })
    .await;
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert!(settled, "not settled: {s:?}");
    assert_eq!(
        (s.applied, s.retried, s.dead_lettered),
        (orders, 0, 0),
        "every order applied, none through a retry tier or to the dead-letter queue: {s:?}"
    );
    assert!(s.batches > 0, "the buffered orders ran in batches: {s:?}");
    for sku in SKUS {
        let expected = STOCK - taken.get(sku).copied().unwrap_or(0);
        assert_eq!(stock_of(&db, sku).await, expected, "{sku}: {s:?}");
    }
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 0);
    broker.cleanup().await;
    db.drop_db().await;
}
