//! The counting pass: rows 3, 3b and 4 again, on PostgreSQL, with their
//! broker and database connections through counting proxies
//! ([`super::wire`]), so that what warren asks of each is counted on the wire:
//! statements and round trips per transaction, ack frames per delivery, the
//! relay's passes. These counts do not depend on the machine's speed, so CI
//! gates on them.

use std::time::Duration;

use sqlx::Postgres;
use warren::PgStore;
use warren::broker::Publisher;
use warren::config::BatchIsolation;
use warren_admin::DatabaseUrl;

use super::wire::{Counts, Protocol, Proxy};
use super::workloads::{self, Env};

/// Ack frames per delivery that row 3 sent before acks were held, counted on
/// the wire with prefetch 32 (0.371 at batches of 4.2 messages): the gate is
/// a quarter of it.
pub(crate) const ACKS_PER_DELIVERY_BEFORE: f64 = 0.371;

/// Round trips warren spends on a transaction on PostgreSQL beside its
/// handlers' statements, the pool's pings and the first preparation of each
/// statement on a connection: `BEGIN` (with a batch's lock timeout in the
/// same trip), the claim of all its messages, the pre-commit check,
/// `COMMIT`. The README says so; CI holds the code to it.
pub(crate) const PG_ROUND_TRIPS_PER_TRANSACTION: f64 = 4.0;

/// What a counted row asked of the database and the broker.
pub(crate) struct RowCounts {
    /// Messages the handler saw (its effects, counted; billing's, the
    /// invoices published).
    pub messages: u64,
    /// Transactions committed (`COMMIT` statements).
    pub commits: u64,
    /// Transactions rolled back (`ROLLBACK` statements).
    pub rollbacks: u64,
    /// The handlers' own statements.
    pub handler: u64,
    pub pg: Counts,
    pub amqp: Counts,
}

impl RowCounts {
    /// Round trips per transaction beside the handlers' statements (each of
    /// which is a round trip of its own), the pool's pings, and the
    /// preparation of each statement once per connection.
    pub(crate) fn overhead_per_transaction(&self) -> f64 {
        let apart = self.handler + self.pg.pings + self.pg.prepares;
        (self.pg.round_trips.saturating_sub(apart)) as f64
            / (self.commits + self.rollbacks).max(1) as f64
    }

    /// Ack frames the consumer sent per delivery it received.
    pub(crate) fn acks_per_delivery(&self) -> f64 {
        self.amqp.method("basic.ack") as f64 / self.amqp.deliveries.max(1) as f64
    }

    /// Prints what was counted.
    pub(crate) fn print(&self) {
        let pg = &self.pg;
        let t = (self.commits + self.rollbacks).max(1) as f64;
        println!(
            "   {} messages: {} transactions committed, {} rolled back ({:.1} messages a \
             committed transaction)",
            self.messages,
            self.commits,
            self.rollbacks,
            self.messages as f64 / self.commits.max(1) as f64,
        );
        println!(
            "   PostgreSQL: {} round trips ({} of them the pool's pings, {} preparing a statement \
             on a connection for the first time), {} statements, of which the handlers' {}: {:.2} \
             round trips a transaction beside the handlers', the pings and the preparations",
            pg.round_trips,
            pg.pings,
            pg.prepares,
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

/// Which row a counting pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    /// Row 3: a handler of one message, one insert each.
    OneInsert,
    /// Row 3b: a batch handler, one insert a batch.
    BatchInsert,
    /// Row 4: billing with its relay.
    Billing,
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

/// `row` on `n` fresh messages, its connections through counting proxies.
/// `None` where the connections cannot be read (TLS).
pub(crate) async fn run(
    env: &Env,
    postgres_url: &str,
    schema: &str,
    n: usize,
    row: Counted,
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
    let pool = billing_service::db::pool_size(env.settings.concurrency);
    let billing_service::db::Database::Postgres(store) =
        billing_service::db::open(&db_url, Some(schema), pool).await?
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
    // What connecting and migrating cost is not the rule's: counted from
    // the subscription on (a delivery or two may be in flight by then, on
    // both sides of the count alike).
    let reset = || {
        database.reset();
        broker.reset();
    };
    let ran = match row {
        Counted::OneInsert | Counted::BatchInsert => {
            consume(&counting, env, &store, n, row, &reset).await
        }
        Counted::Billing => billing(&counting, env, &store, n, &reset).await,
    };
    store.pool().close().await;
    ran?;
    let pg = database.counts();
    let handler = match row {
        Counted::Billing => {
            pg.statements_starting("WITH paid AS")
                + pg.statements_starting("INSERT INTO warren_outbox")
        }
        _ => pg.statements_starting("INSERT INTO bench_effects"),
    };
    Ok(Some(RowCounts {
        // A batch handler writes a batch's effects in one statement: its
        // messages are the ones published, not its statements.
        messages: match row {
            Counted::OneInsert => handler,
            Counted::BatchInsert | Counted::Billing => n as u64,
        },
        commits: pg.statements_starting("COMMIT"),
        rollbacks: pg.statements_starting("ROLLBACK"),
        handler,
        amqp: broker.counts(),
        pg,
    }))
}

/// Rows 3 and 3b through `counting`'s proxies, on a queue filled through
/// `env`'s own connection.
async fn consume(
    counting: &Env,
    env: &Env,
    store: &PgStore,
    n: usize,
    row: Counted,
    reset: &(dyn Fn() + Sync),
) -> Result<(), String> {
    let queue = format!("bench-{}-postgresql-counted-{row:?}", env.tag);
    let messages = workloads::invoices(n);
    let topology = workloads::filled_queue(env, &queue, &messages).await?;
    let ran = match row {
        Counted::BatchInsert => {
            workloads::warren_batch_insert_with::<Postgres>(
                counting,
                store.clone(),
                &queue,
                n,
                reset,
            )
            .await
        }
        _ => {
            workloads::warren_one_insert::<Postgres>(
                counting,
                store.clone(),
                &queue,
                n,
                false,
                &|b| b.with_batch_isolation(BatchIsolation::Replay),
                reset,
            )
            .await
        }
    };
    let _ = warren::broker::delete(&env.connection, &topology).await;
    ran.map(drop)
}

/// Row 4 through `counting`'s proxies: billing drains `n` invoices and its
/// relay publishes their events.
async fn billing(
    counting: &Env,
    env: &Env,
    store: &PgStore,
    n: usize,
    reset: &(dyn Fn() + Sync),
) -> Result<(), String> {
    let prefix = format!("bench-{}-postgresql-counted", env.tag);
    let billing =
        workloads::start_billing::<Postgres>(counting, store.clone(), &prefix, &[]).await?;
    billing.wait_consuming().await;
    reset();
    workloads::publish(
        env,
        &billing.names.exchange(),
        None,
        &workloads::invoices(n),
    )
    .await?;
    billing.drain(n).await;
    let start = std::time::Instant::now();
    while workloads::Billing::outbox_pending(store).await > 0 {
        if start.elapsed() > Duration::from_secs(60) {
            return Err("the relay did not publish the counted events within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    billing.stop(env).await;
    Ok(())
}
