//! What `billing bench` measures beyond rows 1 to 6: rows 3 and 4 with a large
//! inbox and the purge beside them (`--inbox-rows`), and row 4 over a grid of
//! settings (`--sweep`).

use std::time::Duration;

use super::dbs::BenchDb;
use super::workloads::{self, Env, invoices};
use super::{BenchSpec, Settled, goals, met, ms, rate, row3, row4, row4_with};
use billing_service::service::Settings;
use warren::broker::Publisher;

/// Rows 3 and 4 again with `--inbox-rows` rows in the inbox, then the purge of
/// a million expired rows timed while billing drains a queue.
pub(super) async fn big_inbox<B: BenchDb>(
    env: &Env,
    spec: &BenchSpec,
    store: &B::S,
    messages: &[billing_service::stream::Planned],
    empty_row3: f64,
    empty_row4: f64,
    settled: &Settled,
) -> Result<(), String> {
    let half = spec.inbox_rows / 2;
    let expired = half.min(1_000_000);
    let fill_start = std::time::Instant::now();
    B::fill_inbox(
        B::pool(store),
        &format!("bench-{}", env.tag),
        spec.inbox_rows - half,
        0,
    )
    .await
    .map_err(|e| format!("cannot fill the inbox: {e}"))?;
    B::fill_inbox(
        B::pool(store),
        billing_service::handlers::CONSUMER,
        half,
        expired,
    )
    .await
    .map_err(|e| format!("cannot fill the inbox: {e}"))?;
    println!(
        "   with {} rows in warren_inbox (filled in {:.0} s):",
        spec.inbox_rows,
        fill_start.elapsed().as_secs_f64()
    );
    // Fresh ids each time: the earlier rows' are in the same consumers' inbox.
    let n = messages.len();
    let queue = format!("bench-{}-{}-warren-big", env.tag, B::LABEL.to_lowercase());
    let row3 = row3::<B>(env, store, &queue, &invoices(n)).await?.rate;
    let prefix = format!("bench-{}-{}-big", env.tag, B::LABEL.to_lowercase());
    let (row4, _) = row4::<B>(env, store, &prefix, &invoices(n), settled, spec).await?;
    for (what, full, empty) in [("3", row3, empty_row3), ("4", row4.rate, empty_row4)] {
        let ratio = full / empty;
        println!(
            "   row {what}: {full:.0} msg/s, {ratio:.3} of the same row with an empty inbox \
             (goal ≥ 0.8: {})",
            met(ratio >= 0.8)
        );
    }
    // The purge, while billing drains a fresh queue.
    let prefix = format!("bench-{}-{}-purge", env.tag, B::LABEL.to_lowercase());
    let billing = workloads::start_billing::<B>(env, store.clone(), &prefix, &invoices(n)).await?;
    let purge_store = store.clone();
    let purge = tokio::spawn(async move {
        let start = std::time::Instant::now();
        let deleted = warren_admin::purge_inbox(
            &purge_store,
            billing_service::handlers::CONSUMER,
            Duration::from_secs(365 * 86_400),
        )
        .await;
        (deleted, start.elapsed())
    });
    let drained = billing.drain(n).await;
    let (deleted, purge_time) = purge.await.map_err(|e| e.to_string())?;
    let deleted = deleted.map_err(|e| format!("purge failed: {e}"))?;
    billing.stop(env).await;
    println!(
        "   warren inbox purge removed {deleted} expired rows in {:.1} s while billing drained {n} \
         messages at {:.0} msg/s, {:.3} of row 4 with an empty inbox",
        purge_time.as_secs_f64(),
        rate(n, drained),
        rate(n, drained) / empty_row4
    );
    Ok(())
}

/// The rate the sweep measures each cell's end-to-end latency at: the goal's.
const SWEEP_RATE: f64 = 500.0;

/// Row 4 over a grid of prefetch, concurrency and batch size, each with its
/// p99 from publish to the downstream event at 500 messages a second; names
/// the fastest setting whose p99 is within the goal.
pub(super) async fn sweep<B: BenchDb>(
    env: &Env,
    spec: &BenchSpec,
    store: &B::S,
    bare: f64,
    settled: &Settled,
) -> Result<(), String> {
    let goals = goals::<B>();
    println!(
        "\n   sweep of row 4 on {} ({} messages each; ratio of row 1; p99 from publish to the \
         downstream event at {SWEEP_RATE}/s, and of its legs (to settled / to the relay's \
         publish / to downstream); CPU µs per message here / RabbitMQ / database):",
        B::LABEL,
        spec.messages
    );
    println!(
        "   {:>8} {:>11} {:>10} {:>9} {:>7} {:>9} {:>24} {:>20}",
        "prefetch", "concurrency", "batch", "msg/s", "ratio", "p99 ms", "CPU µs/msg", "p99 legs ms"
    );
    let mut best: Option<(f64, u16, usize, usize)> = None;
    for prefetch in [32u16, 128, 256] {
        for concurrency in [4usize, 8] {
            for batch in [16usize, 32, 64] {
                let cell = Env {
                    amqp_url: env.amqp_url.clone(),
                    connection: std::sync::Arc::clone(&env.connection),
                    publisher: Publisher::new(std::sync::Arc::clone(&env.connection)),
                    tag: env.tag.clone(),
                    settings: Settings {
                        prefetch,
                        concurrency,
                        batch_size: batch,
                        ..env.settings.clone()
                    },
                };
                let messages = invoices(spec.messages);
                let prefix = format!(
                    "bench-{}-{}-p{prefetch}c{concurrency}b{batch}",
                    env.tag,
                    B::LABEL.to_lowercase()
                );
                let (row, latencies) = row4_with::<B>(
                    &cell,
                    store,
                    &prefix,
                    &messages,
                    settled,
                    spec,
                    &[SWEEP_RATE],
                    false,
                )
                .await?;
                let Some((latency, legs)) = latencies.end_to_end.last() else {
                    continue;
                };
                let p99 = latency.p99;
                println!(
                    "   {prefetch:>8} {concurrency:>11} {batch:>10} {:>9.0} {:>7.3} {:>9.1} {:>24} {:>20}",
                    row.rate,
                    row.rate / bare,
                    ms(p99),
                    format!(
                        "{:.1} / {:.1} / {:.1}",
                        row.cpu.this, row.cpu.broker, row.cpu.database
                    ),
                    format!(
                        "{:.1} / {:.1} / {:.1}",
                        ms(legs.consumer.1),
                        ms(legs.relay.1),
                        ms(legs.downstream.1)
                    ),
                );
                if p99 < goals.sweep_p99() && best.is_none_or(|(r, ..)| row.rate > r) {
                    best = Some((row.rate, prefetch, concurrency, batch));
                }
            }
        }
    }
    match best {
        Some((r, p, c, b)) => println!(
            "   recommended on {}: --prefetch {p} --concurrency {c} --batch-size {b} \
             ({r:.0} msg/s, {:.3} of row 1, p99 within {} ms)",
            B::LABEL,
            r / bare,
            goals.sweep_p99().as_millis()
        ),
        None => println!(
            "   no setting kept p99 within {} ms on {}",
            goals.sweep_p99().as_millis(),
            B::LABEL
        ),
    }
    Ok(())
}

/// What `--instances` measured for one count of instances.
struct Scaled {
    instances: usize,
    rate: f64,
    cpu: super::CpuPer,
}

/// Row 4 with `counts` billing instances side by side, each with its own
/// connections and its own pool on the same PostgreSQL schema (as separate
/// processes would have), draining `n` invoices published beforehand:
/// consumers, relays and the credit partitions' leases shared among them.
/// Prints each count's rate, its ratio to one instance, and the CPU each
/// process spent per message.
pub(super) async fn instances(
    env: &Env,
    db_url: &warren_admin::DatabaseUrl,
    schema: &str,
    pool: u32,
    counts: &[usize],
    n: usize,
) -> Result<(), String> {
    let mut results: Vec<Scaled> = Vec::new();
    for &count in counts {
        println!("PostgreSQL: row 4 with {count} billing instances");
        let names =
            billing_service::service::Names::new(&format!("bench-{}-scale{count}", env.tag));
        billing_service::service::declare(&env.amqp_url, &names, &env.settings).await?;
        let messages = invoices(n);
        workloads::publish(env, &names.exchange(), None, &messages).await?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut running = Vec::new();
        let mut stores = Vec::new();
        for _ in 0..count {
            let billing_service::db::Database::Postgres(store) =
                billing_service::db::open(db_url, Some(schema), pool).await?
            else {
                return Err("--instances runs on PostgreSQL".into());
            };
            running.push(
                billing_service::service::start::<sqlx::Postgres>(
                    store.clone(),
                    &env.amqp_url,
                    &names,
                    &env.settings,
                    warren::RelayConfig::new(billing_service::handlers::CONSUMER),
                    stopped.clone(),
                )
                .await?,
            );
            stores.push(store);
        }
        let settled = || {
            running
                .iter()
                .map(|r| {
                    let s = r.stats.snapshot();
                    s.applied + s.duplicates + s.dead_lettered
                })
                .sum::<u64>()
        };
        let run = super::measured(n, async {
            let started = std::time::Instant::now();
            let deadline = started + Duration::from_secs(600);
            while settled() < n as u64 {
                if std::time::Instant::now() > deadline {
                    return Err(format!(
                        "{count} instances settled {} of {n} in 600 s",
                        settled()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok(started.elapsed())
        })
        .await;
        let _ = stop.send(true);
        for r in running {
            let _ = r.task.await;
        }
        for store in stores {
            store.pool().close().await;
        }
        for topology in [
            billing_service::service::topology(&names, &env.settings),
            billing_service::service::credit_topology(&names, &env.settings),
        ]
        .into_iter()
        .flatten()
        {
            let _ = warren::broker::delete(&env.connection, &topology).await;
        }
        let elapsed = run.out?;
        results.push(Scaled {
            instances: count,
            rate: rate(n, elapsed),
            cpu: run.cpu,
        });
    }
    let one = results.first().map_or(1.0, |r| r.rate);
    println!(
        "\nPostgreSQL, billing instances side by side ({n} invoices each; {})",
        env.amqp_url
            .split(',')
            .map(warren_admin::redact_url)
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Cores busy = messages a second × CPU seconds a message, for each
    // process: where the sum nears the machine's cores, more instances only
    // share the same CPU.
    println!(
        "   {:<10} {:>9} {:>20} {:>26} {:>26}",
        "instances",
        "msg/s",
        "ratio to the first",
        "CPU µs/msg: here/MQ/DB",
        "cores busy: here/MQ/DB"
    );
    for r in &results {
        let busy = |us: f64| r.rate * us / 1e6;
        println!(
            "   {:<10} {:>9.0} {:>20.3} {:>26} {:>26}",
            r.instances,
            r.rate,
            r.rate / one,
            format!(
                "{:.1} / {:.1} / {:.1}",
                r.cpu.this, r.cpu.broker, r.cpu.database
            ),
            format!(
                "{:.2} / {:.2} / {:.2} = {:.2}",
                busy(r.cpu.this),
                busy(r.cpu.broker),
                busy(r.cpu.database),
                busy(r.cpu.this + r.cpu.broker + r.cpu.database)
            )
        );
    }
    Ok(())
}
