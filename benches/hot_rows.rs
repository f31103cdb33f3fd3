//! What lock conflicts cost a batching consumer, against batching turned off,
//! in one process: the hot-row workload of `tests/conflicts.rs` (orders of 1
//! to 3 lines taking stock off 4 rows, each order in SKU order, so that only
//! batches lock the rows in different orders), drained from a queue filled
//! before the consumer starts, on PostgreSQL and MySQL/MariaDB (with the
//! `mysql` feature). Each setting runs in turns with the others, `ROUNDS`
//! times; the table gives the median wall time of each and its ratio to batch
//! size 1 at the same prefetch, with the conflict reruns of the median run.
//! Every run checks that every order applied, none went to the dead-letter
//! queue and the stock is exact; the table says how many went through a
//! retry tier.
//!
//! Needs the test broker and databases (the same variables as the tests):
//! `cargo bench --bench hot_rows --all-features`; `HOT_ROWS_ORDERS` sets the
//! number of orders (default 1000), `HOT_ROWS_LOCK_TIMEOUT_MS` the batches'
//! lock timeout (default warren's).

#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use warren::Consumer;

// The fixtures shared by warren's tests, the CLI's and the benches
// (crates/warren-test-support), as `crate::util::...`.
use warren_test_support as util;

use util::{Backend, Running, TestBroker, assert_stock, hot_orders, stock_routes, with_stock};

const ROUNDS: usize = 3;

/// (prefetch, batch size) of each setting, the batch-size-1 baseline of each
/// prefetch first.
const SETTINGS: [(u16, usize); 4] = [(32, 1), (32, 32), (256, 1), (256, 32)];

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let orders: usize = std::env::var("HOT_ROWS_ORDERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    println!(
        "{orders} orders on 4 hot rows, concurrency 8, {ROUNDS} rounds of each setting in turns"
    );
    measure::<sqlx::Postgres>(orders).await;
    #[cfg(feature = "mysql")]
    measure::<sqlx::MySql>(orders).await;
}

/// The batches' lock timeout: `HOT_ROWS_LOCK_TIMEOUT_MS`, else warren's
/// default.
fn lock_timeout() -> Duration {
    std::env::var("HOT_ROWS_LOCK_TIMEOUT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(
            warren::config::DEFAULT_BATCH_LOCK_TIMEOUT,
            Duration::from_millis,
        )
}

/// One run's wall time, conflict reruns, and trips through a retry tier.
type Sample = (Duration, u64, u64);

async fn measure<B: Backend>(orders: usize) {
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); SETTINGS.len()];
    for round in 0..ROUNDS {
        for (i, &(prefetch, batch)) in SETTINGS.iter().enumerate() {
            let seed = round as u64;
            samples[i].push(run::<B>(orders, prefetch, batch, seed).await);
        }
    }
    println!("\n{}", <B as Backend>::NAME);
    println!(
        "{:>8} {:>10} {:>12} {:>11} {:>16} {:>8}",
        "prefetch", "batch size", "median wall", "ratio to 1", "conflict reruns", "retried"
    );
    let mut baseline = Duration::ZERO;
    for (i, &(prefetch, batch)) in SETTINGS.iter().enumerate() {
        let mut runs = samples[i].clone();
        runs.sort();
        let (wall, reruns, retried) = runs[runs.len() / 2];
        if batch == 1 {
            baseline = wall;
        }
        let all: Vec<String> = samples[i]
            .iter()
            .map(|(w, _, _)| format!("{:.2}", w.as_secs_f64()))
            .collect();
        println!(
            "{prefetch:>8} {batch:>10} {:>11.2}s {:>11.3} {reruns:>16} {retried:>8}   (runs: {} s)",
            wall.as_secs_f64(),
            wall.as_secs_f64() / baseline.as_secs_f64(),
            all.join(", ")
        );
    }
}

async fn run<B: Backend>(orders: usize, prefetch: u16, batch: usize, seed: u64) -> Sample {
    let db = with_stock::<B>().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_prefetch(prefetch)
        .with_concurrency(8)
        .with_batch_size(batch)
        .with_batch_lock_timeout(lock_timeout())
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let (messages, taken) = hot_orders(orders, seed);
    for message in &messages {
        broker.publish(message).await;
    }
    let n = orders as u64;
    let started = Instant::now();
    let running = Running::start(Consumer::new(config, db.store.clone(), stock_routes::<B>()));
    // Polled every 2 ms: the tests' 50 ms would be a tenth of a short run.
    let deadline = started + Duration::from_secs(600);
    let settled =
        |s: &warren::telemetry::ConsumerStats| s.applied + s.retried + s.dead_lettered >= n;
    while !settled(&running.stats.snapshot()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let done = settled(&running.stats.snapshot());
    let wall = started.elapsed();
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert!(done, "not drained within 600 s: {s:?}");
    // A retried order still applies once: the table reports it.
    assert_eq!((s.applied, s.dead_lettered), (n, 0), "{s:?}");
    assert_stock(&db, &taken).await;
    broker.cleanup().await;
    db.drop_db().await;
    (wall, s.conflict_retries, s.retried)
}
