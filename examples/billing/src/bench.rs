//! `billing bench`: what warren's correctness costs, measured in one run on one
//! broker against baselines run in the same process, and printed as ratios.
//!
//! On each database (PostgreSQL and SQLite), with the same prefetch,
//! concurrency, pool size and durability for every row:
//! 1. the bare drain: a lapin consumer that touches no database;
//! 2. the seed pattern by hand: one transaction per message, inbox row with
//!    `ON CONFLICT DO NOTHING`, a one-row effect, ack after commit;
//! 3. warren's consumer with the same one-row handler;
//! 4. billing itself: invoice upsert, loyalty row, outbox event, relay running;
//!    then its latency at half of that rate;
//! 5. the relay draining a filled outbox, against confirmed publishing of the
//!    same batches by hand (5a);
//! 6. row 3 with a savepoint per message instead of replays, and both ways
//!    with one message in fifty failing.
//!
//! `--inbox-rows` repeats rows 3 and 4 with that many rows already in the inbox
//! and times `warren inbox purge` of a million expired ones while billing runs.
//! `--sweep` runs row 4 over a grid of prefetch, concurrency and batch size.

mod counts;
mod dbs;
mod probe;
mod scale;
mod wire;
mod workloads;

use std::future::Future;
use std::time::Duration;

use sqlx::{Postgres, Sqlite};
use warren::admin::DatabaseUrl;
use warren::broker::Publisher;
use warren::config::BatchIsolation;
use warren::store::Store;

pub use probe::{Probe, Settled};

use crate::config::Config;
use dbs::BenchDb;
use workloads::{Env, invoices};

/// What `billing bench` was asked to do.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// Messages per workload.
    pub messages: usize,
    /// PostgreSQL, SQLite, or both.
    pub postgres: Option<String>,
    pub sqlite: bool,
    /// How long the latency run publishes.
    pub latency_period: Duration,
    /// Exit with failure if row 3 falls below half its goal.
    pub check: bool,
    /// Exit with failure if row 3 is not at least this many times row 2.
    pub min_over_seed: Option<f64>,
    /// Rows to put in the inbox before repeating rows 3 and 4 (0: skip).
    pub inbox_rows: u64,
    /// Run row 4 over the grid.
    pub sweep: bool,
    /// The rows to run besides row 1.
    pub rows: Vec<u8>,
    /// Count row 3's statements and ack frames on the wire (PostgreSQL).
    pub counts: bool,
}

impl BenchSpec {
    fn runs(&self, row: u8) -> bool {
        row == 1 || self.rows.contains(&row)
    }
}

/// The goals of the throughput issue, as ratios: row 3 and row 4 of the bare
/// drain, row 3 of the seed pattern, the relay of bare publishing, and the
/// p99 latency of row 4 at half load.
struct Goals {
    one_insert: f64,
    billing: f64,
    over_seed: f64,
    relay: f64,
    p99: Duration,
}

const RSS_GOAL_MIB: f64 = 100.0;

fn goals<B: BenchDb>() -> Goals {
    if B::LABEL == "SQLite" {
        Goals {
            one_insert: 0.4,
            billing: 0.2,
            over_seed: 4.0,
            relay: 0.7,
            p99: Duration::from_millis(50),
        }
    } else {
        Goals {
            one_insert: 0.6,
            billing: 0.3,
            over_seed: 4.0,
            relay: 0.7,
            p99: Duration::from_millis(20),
        }
    }
}

/// Runs the benchmark; `false` if a check it was asked for failed.
pub async fn run(cfg: &Config, spec: &BenchSpec, settled: &Settled) -> Result<bool, String> {
    let connection = std::sync::Arc::new(
        warren::broker::connect_with_tls(&cfg.amqp_url, "billing bench", &cfg.tls)
            .await
            .map_err(|e| format!("cannot reach the broker: {e}"))?,
    );
    let tag = uuid::Uuid::now_v7().simple().to_string()[20..].to_owned();
    let env = Env {
        amqp_url: cfg.amqp_url.clone(),
        publisher: Publisher::new(std::sync::Arc::clone(&connection)),
        connection,
        tag,
        settings: cfg.settings(warren::retry::RetryPolicy::default()),
    };
    let pool = crate::db::pool_size(cfg.concurrency);
    println!(
        "billing bench: {} messages per workload; prefetch {}, concurrency {}, batch size {}, \
         pool {pool}; quorum queues; one broker; this machine ({} cores)",
        spec.messages,
        env.settings.prefetch,
        env.settings.concurrency,
        env.settings.batch_size,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let mut passed = true;
    if let Some(url) = &spec.postgres {
        println!(
            "PostgreSQL at {} (TLS: {})",
            warren::admin::redact_url(url),
            if url.contains("sslmode=disable") {
                "off"
            } else {
                "as the server and sslmode allow"
            }
        );
        let schema = format!("bench_{}", env.tag);
        let db_url: DatabaseUrl = url.parse().map_err(|e| format!("--postgres-url: {e}"))?;
        crate::scratch::create_schema(&db_url, &schema).await?;
        let opened = crate::db::open(&db_url, Some(&schema), pool).await;
        let result = match opened {
            Ok(crate::db::Database::Postgres(store)) => {
                let mut r = on_database::<Postgres>(&env, spec, store.clone(), settled).await;
                if spec.counts && r.is_ok() {
                    r = counted(&env, url, &schema, spec.messages.min(4000)).await;
                }
                store.pool().close().await;
                r
            }
            Ok(_) => Err("--postgres-url is not a PostgreSQL URL".into()),
            Err(e) => Err(e),
        };
        crate::scratch::drop_schema(&db_url, &schema).await;
        passed &= result?;
    }
    if spec.sqlite {
        let dir = crate::scratch::tempdir()?;
        let url = format!("sqlite://{}", dir.join("bench.db").display());
        let result = match crate::db::open(&DatabaseUrl::Sqlite(url), None, pool).await? {
            crate::db::Database::Sqlite(store) => {
                let r = on_database::<Sqlite>(&env, spec, store.clone(), settled).await;
                store.pool().close().await;
                r
            }
            _ => unreachable!("an SQLite URL opens SQLite"),
        };
        let _ = std::fs::remove_dir_all(&dir);
        passed &= result?;
    }
    Ok(passed)
}

/// One row of the table.
struct Row {
    name: String,
    rate: f64,
    ratio: Option<(f64, &'static str)>,
    goal: Option<f64>,
    rss: Option<f64>,
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

/// Runs `work` and returns its result with the peak RSS it reached.
async fn with_peak<T>(work: impl Future<Output = T>) -> (T, Option<f64>) {
    let reset = probe::reset_peak_rss();
    let out = work.await;
    (out, if reset { probe::peak_rss_mib() } else { None })
}

/// Every row on one database. `Ok(false)` if a check failed.
async fn on_database<B: BenchDb>(
    env: &Env,
    spec: &BenchSpec,
    store: B::S,
    settled: &Settled,
) -> Result<bool, String> {
    let n = spec.messages;
    store.migrate().await.map_err(|e| e.to_string())?;
    B::create_tables(&store).await.map_err(|e| e.to_string())?;
    B::create_bench_tables(B::pool(&store))
        .await
        .map_err(|e| e.to_string())?;
    let goals = goals::<B>();
    let messages = invoices(n);
    let queue = |row: &str| format!("bench-{}-{}-{row}", env.tag, B::LABEL.to_lowercase());

    println!("{}: row 1, the bare drain", B::LABEL);
    let q = queue("bare");
    let t = workloads::filled_queue(env, &q, &messages).await?;
    let cpu = probe::CpuTimes::now();
    let bare = rate(n, workloads::bare_drain(env, &q, n).await?);
    println!(
        "   {}",
        cpu_per_message(&probe::CpuTimes::now().since(&cpu), n)
    );
    let _ = warren::broker::delete(&env.connection, &t).await;

    let mut seed = None;
    if spec.runs(2) {
        println!("{}: row 2, the seed pattern by hand", B::LABEL);
        let q = queue("seed");
        let t = workloads::filled_queue(env, &q, &messages).await?;
        seed = Some(rate(
            n,
            workloads::seed_pattern::<B>(env, B::pool(&store), &q, n).await?,
        ));
        let _ = warren::broker::delete(&env.connection, &t).await;
    }

    let mut one_insert = None;
    if spec.runs(3) {
        println!("{}: row 3, warren with a one-insert handler", B::LABEL);
        one_insert = Some(row3::<B>(env, &store, &queue("warren"), &messages).await?);
    }

    let prefix = format!("bench-{}-{}", env.tag, B::LABEL.to_lowercase());
    let mut billing = None;
    if spec.runs(4) {
        println!(
            "{}: row 4, billing, then its latency at half load",
            B::LABEL
        );
        billing = Some(row4::<B>(env, &store, &prefix, &messages, settled, spec).await?);
    }

    // Row 6: the two ways of isolating a message in a batch, when nothing
    // fails and when one message in fifty does.
    let mut isolation = None;
    if spec.runs(6) {
        println!("{}: row 6, savepoints against replays", B::LABEL);
        let savepoints = BatchIsolation::Savepoints {
            handler_savepoints: 0,
        };
        let mut rates = Vec::new();
        for (name, mode, failing) in [
            ("savepoints", savepoints, false),
            ("replay-failing", BatchIsolation::Replay, true),
            ("savepoints-failing", savepoints, true),
        ] {
            // Fresh ids: those of row 3 are in the inbox of the same consumer.
            let fresh = invoices(n);
            let (r, _) =
                one_insert_run::<B>(env, &store, &queue(name), &fresh, mode, failing).await?;
            rates.push(r);
        }
        isolation = Some((rates[0], rates[1], rates[2]));
    }

    let mut relayed = None;
    if spec.runs(5) {
        let (relay, bare_publish) =
            workloads::relay_against_bare::<B>(env, store.clone(), n).await?;
        relayed = Some((rate(n, relay), rate(n, bare_publish)));
    }

    let mut rows = vec![Row {
        name: format!(
            "1  bare drain: lapin, no database, acks every {}",
            workloads::bare_ack_every(env.settings.prefetch)
        ),
        rate: bare,
        ratio: Some((1.0, "row 1")),
        goal: None,
        rss: None,
    }];
    if let Some(seed) = seed {
        rows.push(Row {
            name: "2  seed pattern by hand: a transaction per message".into(),
            rate: seed,
            ratio: Some((seed / bare, "row 1")),
            goal: None,
            rss: None,
        });
    }
    if let Some((one_insert, rss)) = one_insert {
        rows.push(Row {
            name: "3  warren, one-insert handler".into(),
            rate: one_insert,
            ratio: Some((one_insert / bare, "row 1")),
            goal: Some(goals.one_insert),
            rss,
        });
        if let Some(seed) = seed {
            rows.push(Row {
                name: "3  warren, one-insert handler".into(),
                rate: one_insert,
                ratio: Some((one_insert / seed, "row 2")),
                goal: Some(goals.over_seed),
                rss: None,
            });
        }
    }
    if let Some((row4, _)) = &billing {
        rows.push(Row {
            name: "4  billing: invoice, points, outbox, relay".into(),
            rate: row4.rate,
            ratio: Some((row4.rate / bare, "row 1")),
            goal: Some(goals.billing),
            rss: row4.rss,
        });
    }
    if let (Some((savepoints, replay_failing, savepoints_failing)), Some((row3, _))) =
        (isolation, one_insert)
    {
        rows.push(Row {
            name: "6a row 3, a savepoint per message".into(),
            rate: savepoints,
            ratio: Some((savepoints / row3, "row 3")),
            goal: None,
            rss: None,
        });
        rows.push(Row {
            name: "6b row 3, 1 in 50 failing, replayed (default)".into(),
            rate: replay_failing,
            ratio: Some((replay_failing / row3, "row 3")),
            goal: None,
            rss: None,
        });
        rows.push(Row {
            name: "6c row 3, 1 in 50 failing, savepoints".into(),
            rate: savepoints_failing,
            ratio: Some((savepoints_failing / replay_failing, "row 6b")),
            goal: None,
            rss: None,
        });
    }
    if let Some((relay, bare_publish)) = relayed {
        rows.push(Row {
            name: "5a bare confirmed publishing, relay's batches".into(),
            rate: bare_publish,
            ratio: Some((1.0, "row 5a")),
            goal: None,
            rss: None,
        });
        rows.push(Row {
            name: "5  relay draining a filled outbox".into(),
            rate: relay,
            ratio: Some((relay / bare_publish, "row 5a")),
            goal: Some(goals.relay),
            rss: None,
        });
    }
    println!("\n{} ({})", B::LABEL, B::DURABILITY);
    print_table(&rows);
    if let Some((row4, latency)) = &billing {
        println!(
            "   outbox rows pending when row 4's queue was drained: {}",
            row4.pending_outbox
        );
        let (p50, p99, samples, at) = *latency;
        println!(
            "   row 4 latency at half load ({at:.0} msg/s, {samples} messages), publish to ack after \
             commit: p50 {:.1} ms, p99 {:.1} ms (goal p99 < {} ms: {})",
            ms(p50),
            ms(p99),
            goals.p99.as_millis(),
            met(p99 < goals.p99),
        );
    }
    let rss_of = [
        ("row 3", one_insert.and_then(|(_, rss)| rss)),
        ("row 4", billing.as_ref().and_then(|(r, _)| r.rss)),
    ];
    for (what, rss) in rss_of {
        if let Some(rss) = rss {
            println!(
                "   peak RSS of the process during {what}: {rss:.0} MiB (goal < {RSS_GOAL_MIB:.0} MiB: {})",
                met(rss < RSS_GOAL_MIB)
            );
        }
    }

    if let (Some((one_insert, _)), Some((row4, _))) = (one_insert, &billing) {
        if spec.inbox_rows > 0 {
            scale::big_inbox::<B>(env, spec, &store, &messages, one_insert, row4.rate, settled)
                .await?;
        }
        if spec.sweep {
            scale::sweep::<B>(env, spec, &store, bare, settled).await?;
        }
    }
    let mut passed = true;
    let floor = goals.one_insert / 2.0;
    if let (true, Some((one_insert, _))) = (spec.check, one_insert) {
        let ratio = one_insert / bare;
        let ok = ratio >= floor;
        println!(
            "check {}: row 3 on {} is {ratio:.3} of the bare drain (half its goal: {floor:.2})",
            if ok { "passed" } else { "FAILED" },
            B::LABEL
        );
        passed &= ok;
    }
    if let (Some(min), Some((one_insert, _)), Some(seed)) = (spec.min_over_seed, one_insert, seed) {
        let over = one_insert / seed;
        let ok = over >= min;
        println!(
            "check {}: row 3 on {} is {over:.2} times the seed pattern (at least {min} required)",
            if ok { "passed" } else { "FAILED" },
            B::LABEL
        );
        passed &= ok;
    }
    Ok(passed)
}

/// The counting pass on PostgreSQL (see `counts`); `Ok(false)` if a gate on
/// the counts failed.
async fn counted(env: &Env, url: &str, schema: &str, n: usize) -> Result<bool, String> {
    println!("PostgreSQL: row 3 again, {n} messages, counted on the wire");
    let Some(counts) = counts::row3(env, url, schema, n).await? else {
        return Ok(true);
    };
    counts.print();
    Ok(true)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "missed" }
}

fn print_table(rows: &[Row]) {
    println!(
        "   {:<52} {:>9} {:>7} {:<7} {:>12} {:>9}",
        "workload", "msg/s", "ratio", "of", "goal", "peak RSS"
    );
    for r in rows {
        let (ratio, of) = r
            .ratio
            .map_or((String::new(), ""), |(x, of)| (format!("{x:.3}"), of));
        let goal = r.goal.map_or(String::new(), |g| {
            let x = r.ratio.map_or(0.0, |(x, _)| x);
            format!("≥ {g} {}", met(x >= g))
        });
        let rss = r.rss.map_or(String::new(), |m| format!("{m:.0} MiB"));
        println!(
            "   {:<52} {:>9.0} {:>7} {:<7} {:>12} {:>9}",
            r.name, r.rate, ratio, of, goal, rss
        );
    }
}

/// Row 3 on a fresh queue: messages a second and peak RSS.
async fn row3<B: BenchDb>(
    env: &Env,
    store: &B::S,
    queue: &str,
    messages: &[crate::stream::Planned],
) -> Result<(f64, Option<f64>), String> {
    one_insert_run::<B>(env, store, queue, messages, BatchIsolation::Replay, false).await
}

/// Row 3's consumer draining a filled queue, with `isolation`, its handler
/// failing for one message in fifty if `failing`.
async fn one_insert_run<B: BenchDb>(
    env: &Env,
    store: &B::S,
    queue: &str,
    messages: &[crate::stream::Planned],
    isolation: BatchIsolation,
    failing: bool,
) -> Result<(f64, Option<f64>), String> {
    let n = messages.len();
    let t = workloads::filled_queue(env, queue, messages).await?;
    let cpu = probe::CpuTimes::now();
    let (elapsed, rss) = with_peak(workloads::warren_one_insert::<B>(
        env,
        store.clone(),
        queue,
        n,
        isolation,
        failing,
        &|| {},
    ))
    .await;
    let _ = warren::broker::delete(&env.connection, &t).await;
    let spent = probe::CpuTimes::now().since(&cpu);
    let (elapsed, stats) = elapsed?;
    println!("   {}", batching(&stats));
    println!("   {}", cpu_per_message(&spent, n));
    let hash = partition_hash_cost(n);
    let per_message = spent.this_process.as_secs_f64() / n.max(1) as f64;
    println!(
        "   a partitioned consumer also hashes each delivery's key to check its partition: \
         {:.2} µs, {:.1}% of this process's CPU per message above",
        hash.as_secs_f64() * 1e6,
        100.0 * hash.as_secs_f64() / per_message.max(f64::MIN_POSITIVE),
    );
    Ok((rate(n, elapsed), rss))
}

/// The hash a partition queue's consumer runs on every delivery's key (the
/// ring's own, to find the key's home), timed here over `n` keys shaped like
/// billing's customer ids.
fn partition_hash_cost(n: usize) -> Duration {
    let keys: Vec<String> = (0..n.max(1)).map(|i| format!("cus_{i:08}")).collect();
    let started = std::time::Instant::now();
    let mut homes = 0u64;
    for key in &keys {
        homes += u64::from(warren::partition::partition_of(key.as_bytes(), 4));
    }
    std::hint::black_box(homes);
    started.elapsed() / u32::try_from(keys.len()).unwrap_or(u32::MAX)
}

/// CPU per message of each process, against what the machine has.
fn cpu_per_message(spent: &probe::CpuTimes, n: usize) -> String {
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n.max(1) as f64;
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    format!(
        "CPU per message: this process {:.0} µs, RabbitMQ {:.0} µs, a PostgreSQL server \
         {:.0} µs (SQLite runs inside this process); {cores} cores have {} µs a second",
        per(spent.this_process),
        per(spent.broker),
        per(spent.database),
        cores * 1_000_000,
    )
}

/// How the consumer's messages were grouped into transactions.
fn batching(stats: &warren::telemetry::ConsumerStats) -> String {
    let settled = stats.applied + stats.duplicates + stats.stale;
    let alone = settled.saturating_sub(stats.batched);
    format!(
        "{} transactions of several messages ({:.1} on average), {alone} messages in one of their own",
        stats.batches,
        stats.batched as f64 / stats.batches.max(1) as f64,
    )
}

/// What row 4 measured.
struct Row4 {
    rate: f64,
    rss: Option<f64>,
    pending_outbox: i64,
}

/// Row 4 (billing draining a filled queue), then its latency at half that rate.
async fn row4<B: BenchDb>(
    env: &Env,
    store: &B::S,
    prefix: &str,
    messages: &[crate::stream::Planned],
    settled: &Settled,
    spec: &BenchSpec,
) -> Result<(Row4, (Duration, Duration, usize, f64)), String> {
    let n = messages.len();
    let billing = workloads::start_billing::<B>(env, store.clone(), prefix, messages).await?;
    let (elapsed, rss) = with_peak(billing.drain(n)).await;
    let pending_outbox = workloads::Billing::outbox_pending(store).await;
    let r = rate(n, elapsed);
    let half = r / 2.0;
    let latency = billing
        .latencies(env, settled, half, spec.latency_period)
        .await;
    billing.stop(env).await;
    let (p50, p99, samples) = latency?;
    Ok((
        Row4 {
            rate: r,
            rss,
            pending_outbox,
        },
        (p50, p99, samples, half),
    ))
}
