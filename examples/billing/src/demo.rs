//! `billing demo`: a fresh run of the whole story, ending in a table that proves
//! the outcome.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use warren::RelayConfig;
use warren::retry::RetryPolicy;
use warren::store::OutboxStore;
use warren::topology::QueueType;

use crate::status::{self, Report};
use billing_service::config::Config;
use billing_service::credit::{self, CreditSpec};
use billing_service::db::{self, BillingDb};
use billing_service::scratch;
use billing_service::service::{self, Names, Settings};
use billing_service::stream::{self, Expected, StreamSpec};

/// How long the demo waits for everything to settle.
const DEADLINE: Duration = Duration::from_secs(90);

/// The demo's retry tiers: short, so flaky messages finish in about a second.
pub fn demo_settings(prefetch: u16, concurrency: usize) -> Settings {
    Settings {
        prefetch,
        concurrency,
        retry: RetryPolicy::new([
            Duration::from_millis(200),
            Duration::from_millis(500),
            Duration::from_secs(1),
        ]),
        queue_type: QueueType::Quorum,
        ..Settings::default()
    }
}

/// One line of the closing table.
struct Check {
    ok: bool,
    text: String,
}

fn check(ok: bool, text: String) -> Check {
    Check { ok, text }
}

/// Runs the demo on `store`; returns whether every check passed.
#[allow(clippy::print_stdout)]
pub async fn run<B: BillingDb>(
    store: B::S,
    amqp_url: &str,
    names: &Names,
    settings: &Settings,
    spec: &StreamSpec,
) -> Result<bool, String> {
    let started = Instant::now();
    println!("warren demo: billing on prefix {:?}", names.prefix);
    let (stop_tx, stop_rx) = watch::channel(false);
    let relay = RelayConfig::new("billing").with_poll_interval(Duration::from_millis(200));
    let running =
        service::start::<B>(store.clone(), amqp_url, names, settings, relay, stop_rx).await?;
    let connection = Arc::new(
        warren::broker::connect_with_tls(amqp_url, "billing demo", &settings.tls)
            .await
            .map_err(|e| e.to_string())?,
    );

    let plan = stream::plan(spec);
    let e = plan.expected.clone();
    println!(
        "publishing {} deliveries: {} invoices ({} v1, {} v2, {} from flaky customers), {} duplicate copies, {} poison",
        e.published,
        e.valid,
        e.valid - e.v2,
        e.v2,
        e.flaky,
        e.duplicates,
        e.poison.values().sum::<usize>()
    );
    stream::publish(Arc::clone(&connection), &names.exchange(), &plan).await?;
    let credit_plan = credit::plan(&CreditSpec {
        customers: (spec.count / 10).max(4),
        versions: 8,
        duplicates: 0.15,
        flaky: 2,
        seed: spec.seed,
    });
    println!(
        "publishing {} credit-limit updates: {} customers x 8 versions, half in order, half shuffled, {} duplicate copies, {} partitions",
        credit_plan.messages.len(),
        credit_plan.last.len(),
        credit_plan.messages.len() - credit_plan.unique,
        settings.partitions
    );
    credit::publish(&connection, &names.exchange(), &credit_plan).await?;

    let bar = if std::io::stdout().is_terminal() {
        let bar = indicatif::ProgressBar::new(e.published as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{bar:40}] {pos}/{len} settled  {msg}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        Some(bar)
    } else {
        None
    };
    let mut last_line = Instant::now();
    let settled = loop {
        let s = running.stats.snapshot();
        let c = running.credit_stats.snapshot();
        let credit_done = c.applied + c.stale + c.duplicates + c.dead_lettered;
        let done = s.applied + s.duplicates + s.dead_lettered;
        let pending = store.outbox_status().await.map(|o| o.pending).unwrap_or(-1);
        let msg = format!(
            "applied {} · duplicates {} · retried {} · dead-lettered {} · outbox pending {}",
            s.applied, s.duplicates, s.retried, s.dead_lettered, pending
        );
        match &bar {
            Some(bar) => {
                bar.set_position(done);
                bar.set_message(msg.clone());
            }
            None if last_line.elapsed() >= Duration::from_secs(1) => {
                println!("{done}/{} settled: {msg}", e.published);
                last_line = Instant::now();
            }
            None => {}
        }
        // With the dead-letter store on, every dead letter is in it before the
        // count.
        let unstored = if settings.dead_letter_store {
            warren::broker::inspect_queue(
                &connection,
                &warren::topology::dead_letter_queue_name(&names.queue()),
            )
            .await
            .map_or(1, |q| q.ready)
        } else {
            0
        };
        if done >= e.published as u64
            && credit_done >= credit_plan.messages.len() as u64
            && pending == 0
            && unstored == 0
        {
            break true;
        }
        if started.elapsed() > DEADLINE {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let stats = running.stats.snapshot();
    let credit_stats = running.credit_stats.snapshot();
    let _ = stop_tx.send(true);
    match running.task.await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => return Err(format!("the consumer stopped with an error: {err}")),
        Err(err) => return Err(format!("the consumer task failed: {err}")),
    }
    let source = if settings.dead_letter_store {
        status::DeadLetterSource::Table
    } else {
        status::DeadLetterSource::QueueBodies
    };
    let report = status::gather::<B>(&store, &connection, names, source).await?;
    let credit_state = B::credit_state(&store)
        .await
        .map_err(|e| format!("cannot read the credit tables: {e}"))?;
    let credit_applied: usize = credit_state.applied.values().map(Vec::len).sum();
    let mut checks = checks(&e, &report, &stats, settled, credit_applied);
    checks.extend(
        credit::checks(&credit_plan, &credit_state, credit_stats.stale)
            .into_iter()
            .map(|(ok, text)| check(ok, text)),
    );
    checks.push(check(
        credit_stats.duplicates as usize == credit_plan.messages.len() - credit_plan.unique
            && credit_stats.dead_lettered == 0,
        format!(
            "credit duplicates skipped: {} of {} copies, {} dead-lettered",
            credit_stats.duplicates,
            credit_plan.messages.len() - credit_plan.unique,
            credit_stats.dead_lettered
        ),
    ));
    print_table(&e, &report, &stats);
    println!("  {:<28} {}", "credit versions applied", credit_applied);
    println!("  {:<28} {}", "credit stale drops", credit_stats.stale);
    println!("  {:<28} {}", "credit duplicates", credit_stats.duplicates);
    println!();
    for c in &checks {
        println!("  [{}] {}", if c.ok { "PASS" } else { "FAIL" }, c.text);
    }
    let passed = checks.iter().all(|c| c.ok);
    println!(
        "\n{} in {:.1} s",
        if passed {
            "all checks passed"
        } else {
            "SOME CHECKS FAILED"
        },
        started.elapsed().as_secs_f64()
    );
    let _ = connection.close(200, "demo done".into()).await;
    Ok(passed)
}

#[allow(clippy::print_stdout)]
fn print_table(e: &Expected, r: &Report, s: &warren::telemetry::ConsumerStats) {
    let rows: Vec<(&str, String)> = vec![
        ("published (deliveries)", e.published.to_string()),
        ("unique messages", e.unique.to_string()),
        ("valid, published as", e.valid.to_string()),
        ("applied", r.counts.inbox_rows.to_string()),
        ("duplicates skipped", s.duplicates.to_string()),
        (
            "retried",
            format!("{} (flaky customers: {} messages)", s.retried, e.flaky),
        ),
        ("dead-lettered", r.dead_lettered().to_string()),
    ];
    println!();
    println!("  {:<28} count", "what");
    println!("  {:<28} {}", "-".repeat(28), "-".repeat(12));
    for (k, v) in rows {
        println!("  {k:<28} {v}");
        if k == "valid, published as" {
            for (form, n) in &e.forms {
                println!("    {:<26} {n}", form.name());
            }
        }
        if k == "dead-lettered" {
            for (reason, n) in &r.dead_letters {
                println!("    {reason:<26} {n}");
            }
        }
    }
    println!("  {:<28} {}", "outbox events published", r.outbox.published);
    println!("  {:<28} {}", "loyalty rows", r.counts.loyalty_rows);
    println!("  {:<28} {}", "loyalty points", r.counts.loyalty_sum);
}

fn checks(
    e: &Expected,
    r: &Report,
    s: &warren::telemetry::ConsumerStats,
    settled: bool,
    credit_applied: usize,
) -> Vec<Check> {
    let c = &r.counts;
    let applied = c.inbox_rows as usize;
    vec![
        check(
            settled,
            format!("every delivery settled within {} s", DEADLINE.as_secs()),
        ),
        check(
            applied == e.valid && c.invoices_paid as usize == e.valid,
            format!(
                "applied: {applied} of {} valid messages, once each",
                e.valid
            ),
        ),
        check(
            c.loyalty_rows as usize == e.valid && c.loyalty_sum == e.loyalty_sum,
            format!(
                "loyalty points = exactly one credit per unique valid message: {} rows, {} points (expected {} rows, {} points)",
                c.loyalty_rows, c.loyalty_sum, e.valid, e.loyalty_sum
            ),
        ),
        check(
            s.duplicates as usize == e.duplicates && e.duplicates > 0,
            format!(
                "duplicates skipped: {} of {} copies",
                s.duplicates, e.duplicates
            ),
        ),
        check(
            s.retried as usize == 2 * e.flaky && e.flaky > 0,
            format!(
                "flaky messages retried until they succeeded: {} retries for {} messages",
                s.retried, e.flaky
            ),
        ),
        check(
            r.dead_letters == e.poison,
            format!("poison dead-lettered with reasons: {:?}", r.dead_letters),
        ),
        check(
            applied + r.dead_lettered() == e.unique,
            format!(
                "every message accounted for: applied + dead-lettered = unique ({applied} + {} = {})",
                r.dead_lettered(),
                e.unique
            ),
        ),
        check(
            r.outbox.published as usize == applied + credit_applied
                && r.outbox.pending == 0
                && r.outbox.failed.is_empty()
                && r.recorded_queued as usize == applied,
            format!(
                "one outbox event per applied message, all published: {} published ({applied} payments + {credit_applied} credit changes), {} payments delivered downstream",
                r.outbox.published, r.recorded_queued
            ),
        ),
        check(
            r.queued == 0,
            format!("nothing left in the queue ({} ready)", r.queued),
        ),
    ]
}

/// `billing demo`: the stream against a fresh database and prefix, its checks,
/// and everything removed afterwards unless `keep`.
pub async fn command(cli: &Config, count: usize, keep: bool, pool: u32) -> Result<bool, String> {
    let settings = cli.settings(demo_settings(cli.prefetch, cli.concurrency).retry);
    let tag = &uuid::Uuid::now_v7().simple().to_string()[26..];
    let names = Names::new(
        &cli.prefix
            .clone()
            .unwrap_or_else(|| format!("billing-demo-{tag}")),
    );
    let spec = StreamSpec {
        count,
        duplicates: 0.1,
        v2: 0.3,
        poison: 5,
        flaky: 3.min(count),
        foreign: 0.4,
        seed: fastrand::u64(..),
    };
    spec.validate()?;

    let fresh = scratch::fresh_database(cli, tag, pool).await?;
    let (db, schema, temp) = (fresh.db, fresh.schema, fresh.temp);
    let passed = db::with_store!(db, |store: B| {
        let passed = run::<B>(store.clone(), &cli.amqp_url, &names, &settings, &spec).await;
        if !keep {
            B::pool(&store).close().await;
        }
        passed
    });
    if keep {
        println!("kept: prefix {:?}, database as above", names.prefix);
    } else {
        scratch::teardown(cli, &names, &settings, schema.as_deref()).await;
        let _ = std::fs::remove_dir_all(&temp);
    }
    passed
}
