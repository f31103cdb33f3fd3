//! billing's credit-limit stream through its contract: two `billing run`
//! processes share the partitions of `P.customer-credit`, one of them is killed
//! with SIGKILL every few seconds while the stream flows, and the final state
//! and the order of applied versions must hold.

use std::collections::BTreeMap;
use std::time::Duration;

use warren::Outgoing;
use warren::broker::BatchItem;
use warren::broker::Publisher;

mod common;
use common::*;

const LIMIT_SET: &str = "billing.customer-credit-limit-set.v1";
const CUSTOMERS: usize = 200;
const VERSIONS: i64 = 10;

fn limit(customer: usize, version: i64) -> String {
    format!("{}.{}", 1000 + customer * 10, 11 * (1 + version % 8))
}

/// 200 customers x 10 versions, each customer's versions in order.
fn stream() -> Vec<Outgoing> {
    let mut out = Vec::new();
    for v in 1..=VERSIONS {
        for c in 0..CUSTOMERS {
            let customer = format!("cus_kill_{c}");
            let json = format!(
                "{{\"customerId\":\"{customer}\",\"creditLimit\":{},\"version\":{v}}}",
                limit(c, v)
            );
            let payload = serde_json::value::RawValue::from_string(json).unwrap();
            out.push(
                Outgoing::new(LIMIT_SET, 1, &*payload)
                    .unwrap()
                    .with_partition_key(&customer),
            );
        }
    }
    out
}

/// What the database holds: limits by customer, and applied versions in
/// `applied_seq` order.
type CreditRows = (BTreeMap<String, (String, i64)>, BTreeMap<String, Vec<i64>>);

async fn read_credit(url: &str) -> CreditRows {
    let limits_sql = if url.starts_with("postgres") {
        "SELECT customer_id, credit_limit::text, version FROM customer_credit"
    } else {
        "SELECT customer_id, credit_limit, version FROM customer_credit"
    };
    let changes_sql =
        "SELECT customer_id, version FROM credit_limit_changes ORDER BY customer_id, applied_seq";
    type Rows = (Vec<(String, String, i64)>, Vec<(String, i64)>);
    let (limits, changes): Rows = if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let l = sqlx::query_as(limits_sql)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
        let c = sqlx::query_as(changes_sql)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
        pool.close().await;
        (l, c)
    } else {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        let l = sqlx::query_as(limits_sql)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
        let c = sqlx::query_as(changes_sql)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
        pool.close().await;
        (l, c)
    };
    let mut applied: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (c, v) in changes {
        applied.entry(c).or_default().push(v);
    }
    (
        limits.into_iter().map(|(c, l, v)| (c, (l, v))).collect(),
        applied,
    )
}

/// How many credit partitions each live owner holds, fewest first.
async fn holders(url: &str) -> Vec<i64> {
    let sql = "SELECT count(*) FROM warren_partition_leases
               WHERE consumer_name = 'billing-credit' AND owner <> ''
               GROUP BY owner ORDER BY count(*)";
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let n: Vec<i64> = sqlx::query_scalar(sql)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
        pool.close().await;
        n
    } else {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        let n: Vec<i64> = sqlx::query_scalar(sql)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
        pool.close().await;
        n
    }
}

async fn start(common: &[String], port: u16) -> tokio::process::Child {
    start_run(billing().args(common), port).await
}

async fn two_processes_share_the_credit_partitions_through_kill_9(url: &str) {
    let prefix = unique("billing-credit");
    let common: Vec<String> = [
        "--prefix",
        &prefix,
        "--database-url",
        url,
        "--retry-tiers",
        "200ms,500ms",
        "--partition-lease",
        "3s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut ports = [free_port(), free_port()];
    let mut procs = [
        start(&common, ports[0]).await,
        start(&common, ports[1]).await,
    ];
    assert!(
        wait_for(Duration::from_secs(30), || async {
            holders(url).await == [2, 2]
        })
        .await,
        "both processes hold partitions at the same time"
    );

    let connection = std::sync::Arc::new(warren_connect().await);
    let messages = stream();
    let publisher = Publisher::new(std::sync::Arc::clone(&connection));
    let exchange = format!("{prefix}.events");
    let publishing = tokio::spawn(async move {
        // About 150 messages a second: the stream flows through the kills.
        for chunk in messages.chunks(50) {
            let bodies: Vec<Vec<u8>> = chunk.iter().map(Outgoing::body).collect();
            let items: Vec<BatchItem<'_>> = chunk
                .iter()
                .zip(&bodies)
                .map(|(m, body)| BatchItem {
                    exchange: &exchange,
                    routing_key: LIMIT_SET,
                    body,
                    properties: m.properties(),
                })
                .collect();
            for r in publisher.publish_batch(&items).await {
                r.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(330)).await;
        }
    });

    // Kill one of the two every few seconds, alternating, and start it again.
    for round in 0..4 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let victim = round % 2;
        procs[victim].start_kill().unwrap();
        let _ = procs[victim].wait().await;
        // Its leases expire unrenewed and the survivor takes them: one owner
        // of all four, since the dead one can no longer renew.
        assert!(
            wait_for(Duration::from_secs(20), || async {
                holders(url).await == [4]
            })
            .await,
            "round {round}: the survivor did not take the killed process's partitions: {:?}",
            holders(url).await
        );
        ports[victim] = free_port();
        procs[victim] = start(&common, ports[victim]).await;
    }
    publishing.await.unwrap();

    let settled = wait_for(Duration::from_secs(120), || async {
        let (limits, _) = read_credit(url).await;
        limits.len() == CUSTOMERS && limits.values().all(|(_, v)| *v == VERSIONS)
    })
    .await;
    let (limits, applied) = read_credit(url).await;
    assert!(
        settled,
        "every customer reached version {VERSIONS}: {} customers, {:?}",
        limits.len(),
        limits.iter().find(|(_, (_, v))| *v != VERSIONS)
    );
    for c in 0..CUSTOMERS {
        let customer = format!("cus_kill_{c}");
        assert_eq!(
            limits[&customer],
            (limit(c, VERSIONS), VERSIONS),
            "{customer}: the limit of the highest version"
        );
        let versions = &applied[&customer];
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "{customer}: applied versions only increase: {versions:?}"
        );
    }

    for p in &mut procs {
        let pid = p.id().unwrap();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let exit = tokio::time::timeout(Duration::from_secs(60), p.wait())
            .await
            .expect("billing run exits after SIGTERM")
            .unwrap();
        assert!(exit.success(), "{exit:?}");
    }
    for i in 0..4 {
        let q = format!("{prefix}.customer-credit.{i}");
        let info = warren::broker::inspect_queue(&connection, &q)
            .await
            .unwrap();
        assert_eq!(info.ready, 0, "{q} drained");
    }
    delete_prefix(&connection, &prefix).await;
}

#[tokio::test]
async fn credit_stream_on_sqlite_survives_kill_9_of_either_process() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("billing.db").display());
    two_processes_share_the_credit_partitions_through_kill_9(&url).await;
}

#[tokio::test]
async fn credit_stream_on_postgres_survives_kill_9_of_either_process() {
    let schema = PgSchema::create("billing_credit").await;
    two_processes_share_the_credit_partitions_through_kill_9(&schema.url).await;
    schema.remove().await;
}
