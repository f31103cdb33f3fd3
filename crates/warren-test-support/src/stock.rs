//! The hot-row workload of the conflict tests and the `hot_rows` benchmark: a
//! handler that takes stock off a few rows, line by line, and orders to feed
//! it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use warren::{HandlerError, Message, Outgoing, Registry, Tx};

use crate::db::{Backend, TestDb};

/// The event type of an order.
pub const ORDER: &str = "test.order";
/// The SKUs `with_stock` stocks.
pub const SKUS: [&str; 4] = ["sku-a", "sku-b", "sku-c", "sku-d"];
/// What `with_stock` puts on the shelf of each SKU.
pub const STOCK: i64 = 1_000_000;

/// An order: stock to take, line by line, in this order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    /// The SKU and quantity of each line.
    pub lines: Vec<(String, i64)>,
    /// After its first line, wait until the other order of this pair has
    /// taken its first line too (on the first run only): two such orders
    /// whose lines go in opposite orders then deadlock for certain.
    #[serde(default)]
    pub pair: Option<String>,
}

/// The pairs waiting for each other, and the messages that already met.
static PAIRS: LazyLock<Mutex<HashMap<String, Arc<tokio::sync::Barrier>>>> =
    LazyLock::new(Default::default);
static MET: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

/// The conflict tests' handler: takes each line's quantity off its SKU, in the order's
/// order, locking the rows.
pub async fn take_stock<B: Backend>(
    msg: Message<Order>,
    tx: &mut Tx<B>,
) -> Result<(), HandlerError> {
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

/// The routes of the stock consumer.
pub fn stock_routes<B: Backend>() -> Registry<B> {
    Registry::new().route(ORDER, 1, take_stock::<B>)
}

/// A private database with `test_stock` holding [`STOCK`] of each SKU.
pub async fn with_stock<B: Backend>() -> TestDb<B> {
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

/// What is left of `sku`.
pub async fn stock_of<B: Backend>(db: &TestDb<B>, sku: &str) -> i64 {
    B::count(
        &db.store,
        format!("SELECT available FROM test_stock WHERE sku = '{sku}'"),
    )
    .await
}

/// An order message of `lines`, paired with another when `pair` is set.
pub fn order(lines: Vec<(String, i64)>, pair: Option<String>) -> Outgoing {
    Outgoing::new(ORDER, 1, &Order { lines, pair }).unwrap()
}

/// `n` orders of 1 to 3 lines over the hot SKUs, each taking its lines in
/// one order (by SKU), so that orders alone never deadlock: only batches,
/// which take the rows of many orders in the order the orders came, lock the
/// same rows in different orders. With what they take of each SKU in all.
pub fn hot_orders(n: usize, seed: u64) -> (Vec<Outgoing>, HashMap<&'static str, i64>) {
    let mut taken: HashMap<&'static str, i64> = HashMap::new();
    let mut rng = fastrand::Rng::with_seed(seed);
    let orders = (0..n)
        .map(|_| {
            let mut skus = SKUS.to_vec();
            rng.shuffle(&mut skus);
            skus.truncate(rng.usize(1..=3));
            skus.sort_unstable();
            let lines = skus
                .iter()
                .map(|&sku| {
                    let qty = rng.i64(1..=3);
                    *taken.entry(sku).or_default() += qty;
                    (sku.to_owned(), qty)
                })
                .collect();
            order(lines, None)
        })
        .collect();
    (orders, taken)
}

/// Checks that the stock is what the orders `taken` leave.
pub async fn assert_stock<B: Backend>(db: &TestDb<B>, taken: &HashMap<&'static str, i64>) {
    for sku in SKUS {
        let expected = STOCK - taken.get(sku).copied().unwrap_or(0);
        assert_eq!(stock_of(db, sku).await, expected, "{sku}");
    }
}
