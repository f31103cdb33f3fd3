//! The counting pass: row 3 again, on PostgreSQL, with the consumer's broker
//! and database connections through counting proxies ([`super::wire`]), so
//! that what warren asks of each is counted on the wire: statements and round
//! trips per transaction, ack frames per delivery. These counts do not depend
//! on the machine's speed, so CI gates on them.

use sqlx::Postgres;
use warren::admin::DatabaseUrl;
use warren::broker::Publisher;
use warren::config::BatchIsolation;

use super::wire::{Counts, Protocol, Proxy};
use super::workloads::{self, Env};

/// What row 3 asked of the database and the broker, counted on the wire.
pub struct RowCounts {
    pub messages: usize,
    /// Transactions committed (`COMMIT` statements).
    pub commits: u64,
    /// Transactions rolled back (`ROLLBACK` statements).
    pub rollbacks: u64,
    /// The handler's own statements (its one insert).
    pub handler: u64,
    pub pg: Counts,
    pub amqp: Counts,
}

impl RowCounts {
    /// Round trips per transaction beyond the handler's statements (each
    /// of which is a round trip of its own), pings included.
    pub fn overhead_per_transaction(&self) -> f64 {
        (self.pg.round_trips.saturating_sub(self.handler)) as f64
            / (self.commits + self.rollbacks).max(1) as f64
    }

    /// Ack frames the consumer sent per delivery it received.
    pub fn acks_per_delivery(&self) -> f64 {
        self.amqp.method("basic.ack") as f64 / self.amqp.deliveries.max(1) as f64
    }

    /// Prints what was counted.
    pub fn print(&self) {
        let pg = &self.pg;
        let t = (self.commits + self.rollbacks).max(1) as f64;
        println!(
            "   counted on the wire, {} messages: {} transactions committed, {} rolled back \
             ({:.1} messages a transaction)",
            self.messages,
            self.commits,
            self.rollbacks,
            self.messages as f64 / self.commits.max(1) as f64,
        );
        println!(
            "   PostgreSQL: {} round trips ({} of them pings), {} statements, of which the \
             handler's {}: {:.2} round trips per transaction beside the handler's",
            pg.round_trips,
            pg.pings,
            pg.all_statements(),
            self.handler,
            self.overhead_per_transaction(),
        );
        // Statements that differ only past their first words (the claim of
        // N messages has N rows of placeholders) are shown as one.
        let mut shown: std::collections::BTreeMap<String, u64> = Default::default();
        for (sql, n) in &pg.statements {
            let head: String = sql.chars().take(72).collect();
            *shown.entry(head).or_default() += n;
        }
        for (sql, n) in &shown {
            println!("     {:>8} {:>6.2}/tx  {sql}", n, *n as f64 / t);
        }
        println!(
            "   RabbitMQ: {} deliveries, {} basic.ack frames ({:.3} per delivery), {} nack, \
             {} reject, {} publish",
            self.amqp.deliveries,
            self.amqp.method("basic.ack"),
            self.acks_per_delivery(),
            self.amqp.method("basic.nack"),
            self.amqp.method("basic.reject"),
            self.amqp.method("basic.publish"),
        );
    }
}

/// The host and port a URL names, with `default_port` if it names none.
fn address(url: &str, default_port: u16) -> Result<std::net::SocketAddr, String> {
    let parsed = url::Url::parse(url).map_err(|e| format!("{url}: {e}"))?;
    let host = parsed.host_str().ok_or("the URL names no host")?;
    let port = parsed.port().unwrap_or(default_port);
    std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .map_err(|e| e.to_string())?
        .next()
        .ok_or_else(|| format!("{host}:{port} does not resolve"))
}

/// `url` pointed at `proxy` instead.
fn through(url: &str, proxy: &Proxy) -> Result<String, String> {
    let mut parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    parsed
        .set_host(Some(&proxy.addr.ip().to_string()))
        .map_err(|e| e.to_string())?;
    parsed
        .set_port(Some(proxy.addr.port()))
        .map_err(|()| "cannot set the port".to_owned())?;
    Ok(parsed.into())
}

/// Row 3 on `n` fresh messages, the consumer's connections through
/// counting proxies. `None` where the connections cannot be read (TLS).
pub async fn row3(
    env: &Env,
    postgres_url: &str,
    schema: &str,
    n: usize,
) -> Result<Option<RowCounts>, String> {
    if env.amqp_url.starts_with("amqps:") || !postgres_url.contains("sslmode=disable") {
        println!("   (not counted: the counting proxies cannot read TLS)");
        return Ok(None);
    }
    let broker = Proxy::start(Protocol::Amqp, address(&env.amqp_url, 5672)?).await?;
    let database = Proxy::start(Protocol::Postgres, address(postgres_url, 5432)?).await?;
    let db_url: DatabaseUrl = through(postgres_url, &database)?
        .parse()
        .map_err(|e| format!("{e}"))?;
    let pool = crate::db::pool_size(env.settings.concurrency);
    let crate::db::Database::Postgres(store) = crate::db::open(&db_url, Some(schema), pool).await?
    else {
        return Err("the counting pass runs on PostgreSQL".into());
    };
    let counting = Env {
        amqp_url: through(&env.amqp_url, &broker)?,
        connection: std::sync::Arc::clone(&env.connection),
        publisher: Publisher::new(std::sync::Arc::clone(&env.connection)),
        tag: env.tag.clone(),
        settings: env.settings.clone(),
    };
    let queue = format!("bench-{}-postgresql-counted", env.tag);
    let messages = workloads::invoices(n);
    let topology = workloads::filled_queue(env, &queue, &messages).await?;
    // What connecting and migrating cost is not the rule's: counted from
    // the subscription on (a delivery or two may be in flight by then, on
    // both sides of the count alike).
    let reset = || {
        database.reset();
        broker.reset();
    };
    let ran = workloads::warren_one_insert::<Postgres>(
        &counting,
        store.clone(),
        &queue,
        n,
        BatchIsolation::Replay,
        false,
        &reset,
    )
    .await;
    let _ = warren::broker::delete(&env.connection, &topology).await;
    store.pool().close().await;
    ran?;
    let pg = database.counts();
    Ok(Some(RowCounts {
        messages: pg.statements_starting("INSERT INTO bench_effects") as usize,
        commits: pg.statements_starting("COMMIT"),
        rollbacks: pg.statements_starting("ROLLBACK"),
        handler: pg.statements_starting("INSERT INTO bench_effects"),
        amqp: broker.counts(),
        pg,
    }))
}
