//! Real faults of the shared services: every broker connection closed, the broker
//! application stopped and started, PostgreSQL restarted, each in the middle of a
//! run. Nothing is lost and nothing is applied twice, proven by counting.
//!
//! These tests disturb every other test's connections, so they are `#[ignore]`d
//! and run alone, after the others:
//! `cargo test --workspace --all-features -- --ignored --test-threads=1`.

use std::process::Command;
use std::time::Duration;

use warren::Consumer;

use crate::util::{Backend, Job, Running, TestBroker, amqp_url, routes, wait_for};

const N: u64 = 5000;

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Ready messages in `queue`, on a connection of its own (the fault closes the
/// test's other connections too).
async fn ready(queue: &str) -> Option<u32> {
    let connection = warren::broker::connect(&amqp_url(), "outage check")
        .await
        .ok()?;
    let info = warren::broker::inspect_queue(&connection, queue).await.ok();
    let _ = connection.close(200, "checked".into()).await;
    info.map(|i| i.ready)
}

async fn publish_batch(broker: &TestBroker) {
    for chunk in 0..(N / 500) {
        let items: Vec<_> = (0..500).map(|_| TestBroker::message(&Job::ok())).collect();
        let bodies: Vec<_> = items.iter().map(|m| m.body()).collect();
        let batch: Vec<_> = items
            .iter()
            .zip(&bodies)
            .map(|(m, body)| warren::broker::BatchItem {
                exchange: &broker.exchange,
                routing_key: "test.job",
                body,
                properties: m.properties(),
            })
            .collect();
        for r in broker.publisher.publish_batch(&batch).await {
            r.unwrap_or_else(|e| panic!("chunk {chunk}: {e}"));
        }
    }
}

/// Publishes N messages, starts a consumer, injects `fault` once a fifth is
/// applied, and checks that every message ends applied exactly once.
async fn survives<B: Backend>(fault: impl AsyncFnOnce()) {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    publish_batch(&broker).await;

    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(N / 5, Duration::from_secs(120)).await);
    let at_fault = db.inbox(&broker.name).await;
    fault().await;
    assert!(
        at_fault < N as i64 * 3 / 4,
        "the fault came mid-run ({at_fault} of {N} applied)"
    );
    let applied_all = wait_for(Duration::from_secs(300), || async {
        db.inbox(&broker.name).await == N as i64
    })
    .await;
    let s = running.stats.snapshot();
    assert!(
        applied_all,
        "inbox {} of {N}: {s:?}",
        db.inbox(&broker.name).await
    );
    assert!(
        wait_for(Duration::from_secs(60), || async {
            ready(&broker.queue).await == Some(0)
        })
        .await,
        "the queue drains"
    );
    running.stop().await.unwrap();
    assert_eq!(
        db.effects().await,
        N as i64,
        "each message applied exactly once: {s:?}"
    );
    assert_eq!(db.distinct_effects().await, N as i64);
    assert_eq!(
        ready(&broker.dead_letter_queue()).await,
        Some(0),
        "nothing dead-lettered"
    );

    // The fault closed the test's own connection too.
    let broker = TestBroker {
        connection: std::sync::Arc::new(
            warren::broker::connect(&amqp_url(), "cleanup")
                .await
                .unwrap(),
        ),
        ..broker
    };
    broker.cleanup().await;
    db.drop_db().await;
}

/// MariaDB restarted mid-run, as PostgreSQL above: the server is shut down, and
/// started again once its process is gone.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "restarts shared services; run alone with --ignored --test-threads=1"]
async fn mariadb_restart() {
    survives::<sqlx::MySql>(async || {
        run("mariadb-admin", &["-uroot", "-h127.0.0.1", "shutdown"]);
        let gone = wait_for(Duration::from_secs(60), || async {
            !Command::new("pgrep")
                .args(["-x", "mariadbd"])
                .output()
                .unwrap()
                .status
                .success()
        })
        .await;
        assert!(gone, "mariadbd did not stop");
        run(
            "start-stop-daemon",
            &[
                "--start",
                "--oknodo",
                "--background",
                "--exec",
                "/usr/sbin/mariadbd",
            ],
        );
        let up = wait_for(Duration::from_secs(60), || async {
            Command::new("mariadb-admin")
                .args(["-uroot", "-h127.0.0.1", "ping"])
                .output()
                .unwrap()
                .status
                .success()
        })
        .await;
        assert!(up, "MariaDB did not come back");
    })
    .await;
}

macro_rules! outage_tests {
    ($($name:ident => $fault:expr),* $(,)?) => {
        $(
            mod $name {
                use super::*;
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                #[ignore = "restarts shared services; run alone with --ignored --test-threads=1"]
                async fn postgres() {
                    survives::<sqlx::Postgres>($fault).await;
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                #[ignore = "restarts shared services; run alone with --ignored --test-threads=1"]
                async fn sqlite() {
                    survives::<sqlx::Sqlite>($fault).await;
                }
                #[cfg(feature = "mysql")]
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                #[ignore = "restarts shared services; run alone with --ignored --test-threads=1"]
                async fn mysql() {
                    survives::<sqlx::MySql>($fault).await;
                }
            }
        )*
    };
}

outage_tests!(
    close_all_connections => async || {
        warren_chaos::close_all_connections().await.unwrap();
    },
    stop_and_start_the_broker => async || {
        warren_chaos::restart_broker(Duration::from_secs(3)).await.unwrap();
    },
);

/// PostgreSQL restarted mid-run: in-flight transactions fail, intake pauses until
/// the database answers, nothing is acked without a commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "restarts shared services; run alone with --ignored --test-threads=1"]
async fn postgres_restart() {
    survives::<sqlx::Postgres>(async || {
        let version = std::fs::read_dir("/etc/postgresql")
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .file_name();
        run(
            "pg_ctlcluster",
            &[
                "--skip-systemctl-redirect",
                version.to_str().unwrap(),
                "main",
                "restart",
            ],
        );
    })
    .await;
}
