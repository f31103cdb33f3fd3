//! Throughput of warren's consumer against a bare consumer, in one run.
//!
//! ```text
//! cargo run --release --features mysql --example bench -- [MESSAGES] [postgres://...] [mysql://.../]
//! ```
//!
//! Publishes MESSAGES (default 20 000) to a fresh queue four times and drains
//! it with: a bare lapin consumer that touches no database and acks in batches
//! of 100 (the ceiling), warren on SQLite, on PostgreSQL and on MySQL/MariaDB
//! (a server URL ending in `/`; the bench creates a database of its own). warren's
//! handler inserts one row; each message is one transaction with its inbox
//! claim. Prints messages per second and each as a ratio of the bare consumer's,
//! measured in this run on this machine. Needs RabbitMQ, PostgreSQL and
//! MariaDB or MySQL on localhost (or AMQP_URL and the URL arguments).
#![allow(clippy::print_stdout, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use sqlx::{Postgres, Sqlite};
use warren::broker::BatchItem;
use warren::lapin;
use warren::lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use warren::lapin::types::FieldTable;
use warren::{
    Consumer, ConsumerConfig, HandlerError, Message, Outgoing, PgStore, Publisher, QueueType,
    Registry, SqliteStore, Store, Topology, Tx,
};

async fn record_sqlite(
    msg: Message<serde_json::Value>,
    tx: &mut Tx<Sqlite>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO bench_effects (message_id) VALUES (?)")
        .bind(&msg.meta.message_id)
        .execute(tx.conn())
        .await?;
    Ok(())
}

async fn record_mysql(
    msg: Message<serde_json::Value>,
    tx: &mut Tx<sqlx::MySql>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO bench_effects (message_id) VALUES (?)")
        .bind(&msg.meta.message_id)
        .execute(tx.conn())
        .await?;
    Ok(())
}

async fn record_postgres(
    msg: Message<serde_json::Value>,
    tx: &mut Tx<Postgres>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO bench_effects (message_id) VALUES ($1)")
        .bind(&msg.meta.message_id)
        .execute(tx.conn())
        .await?;
    Ok(())
}

fn tag() -> String {
    let id = uuid::Uuid::now_v7().simple().to_string();
    id[id.len() - 8..].to_owned()
}

/// Publishes `n` envelopes to `queue` through the default exchange.
async fn fill(publisher: &Publisher, queue: &str, n: usize) {
    let messages: Vec<Outgoing> = (0..n)
        .map(|i| Outgoing::new("bench.event.v1", 1, &serde_json::json!({ "n": i })).unwrap())
        .collect();
    for chunk in messages.chunks(500) {
        let bodies: Vec<Vec<u8>> = chunk.iter().map(Outgoing::body).collect();
        let items: Vec<BatchItem<'_>> = chunk
            .iter()
            .zip(&bodies)
            .map(|(m, body)| BatchItem {
                exchange: "",
                routing_key: queue,
                body,
                properties: m.properties(),
            })
            .collect();
        for r in publisher.publish_batch(&items).await {
            r.expect("publish");
        }
    }
}

fn config(queue: &str) -> ConsumerConfig {
    ConsumerConfig::builder(format!("bench-{queue}"), queue)
        .with_queue_type(QueueType::Classic)
        .build()
        .expect("a valid bench configuration")
}

async fn declare(connection: &lapin::Connection, queue: &str) -> Topology {
    let topology = Topology::for_consumer(&config(queue));
    let channel = connection.create_channel().await.unwrap();
    warren::broker::declare(&channel, &topology).await.unwrap();
    topology
}

/// The ceiling: no validation, no database, acks every 100 deliveries.
async fn bare(connection: &lapin::Connection, queue: &str, n: usize) -> Duration {
    let channel = connection.create_channel().await.unwrap();
    channel
        .basic_qos(1000, BasicQosOptions::default())
        .await
        .unwrap();
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "bench-bare".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let start = Instant::now();
    let mut seen = 0;
    while let Some(Ok(d)) = deliveries.next().await {
        seen += 1;
        if seen % 100 == 0 || seen == n {
            d.acker
                .ack(BasicAckOptions { multiple: true })
                .await
                .unwrap();
        }
        if seen == n {
            break;
        }
    }
    let elapsed = start.elapsed();
    let _ = channel.close(200, "done".into()).await;
    elapsed
}

/// warren on `store`: from start until every message is applied.
async fn with_warren<S: Store>(
    store: S,
    routes: Registry<S::Db>,
    url: &str,
    queue: &str,
    n: usize,
) -> Duration {
    let consumer = Consumer::new(config(queue), store, routes);
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let url = url.to_owned();
    let start = Instant::now();
    let task = tokio::spawn(async move {
        consumer
            .run(&url, async {
                let _ = stopped.await;
            })
            .await
    });
    while stats.snapshot().applied < n as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    elapsed
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let pg_url = args
        .get(2)
        .cloned()
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let mysql_server = args
        .get(3)
        .cloned()
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/".into());
    let amqp = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = Arc::new(warren::broker::connect(&amqp, "bench").await.unwrap());
    let publisher = Publisher::new(Arc::clone(&connection));
    let run = tag();
    println!("{n} messages per run, one broker, this machine");

    let q = format!("bench-{run}-bare");
    let t = declare(&connection, &q).await;
    fill(&publisher, &q, n).await;
    let bare_time = bare(&connection, &q, n).await;
    warren::broker::delete(&connection, &t).await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("bench.db").display()
    ))
    .await
    .unwrap();
    sqlite.migrate().await.unwrap();
    sqlx::query("CREATE TABLE bench_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL)")
        .execute(sqlite.pool())
        .await
        .unwrap();
    let q = format!("bench-{run}-sqlite");
    let t = declare(&connection, &q).await;
    fill(&publisher, &q, n).await;
    let sqlite_time = with_warren(
        sqlite,
        Registry::new().route("bench.event.v1", 1, record_sqlite),
        &amqp,
        &q,
        n,
    )
    .await;
    warren::broker::delete(&connection, &t).await.unwrap();

    let schema = format!("bench_{run}");
    let admin = sqlx::PgPool::connect(&pg_url).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let sep = if pg_url.contains('?') { '&' } else { '?' };
    let pg = PgStore::connect(
        &format!("{pg_url}{sep}options=-c%20search_path%3D{schema}"),
        12,
    )
    .await
    .unwrap();
    pg.migrate().await.unwrap();
    sqlx::query("CREATE TABLE bench_effects (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL)")
        .execute(pg.pool())
        .await
        .unwrap();
    let q = format!("bench-{run}-pg");
    let t = declare(&connection, &q).await;
    fill(&publisher, &q, n).await;
    let pg_time = with_warren(
        pg,
        Registry::new().route("bench.event.v1", 1, record_postgres),
        &amqp,
        &q,
        n,
    )
    .await;
    warren::broker::delete(&connection, &t).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();

    let database = format!("bench_{run}");
    let admin = sqlx::MySqlPool::connect(&format!("{mysql_server}information_schema"))
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
    let my = warren::MySqlStore::connect(&format!("{mysql_server}{database}"), 12)
        .await
        .unwrap();
    my.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE bench_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    )
    .execute(my.pool())
    .await
    .unwrap();
    let q = format!("bench-{run}-mysql");
    let t = declare(&connection, &q).await;
    fill(&publisher, &q, n).await;
    let mysql_time = with_warren(
        my,
        Registry::new().route("bench.event.v1", 1, record_mysql),
        &amqp,
        &q,
        n,
    )
    .await;
    warren::broker::delete(&connection, &t).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();

    let rate = |d: Duration| n as f64 / d.as_secs_f64();
    println!("{:<44} {:>10} {:>8}", "consumer", "msg/s", "ratio");
    for (name, d) in [
        ("bare lapin, no database, acks every 100", bare_time),
        ("warren on SQLite, one transaction per msg", sqlite_time),
        ("warren on PostgreSQL, one transaction per msg", pg_time),
        ("warren on MySQL, one transaction per msg", mysql_time),
    ] {
        println!(
            "{name:<44} {:>10.0} {:>8.3}",
            rate(d),
            rate(d) / rate(bare_time)
        );
    }
}
