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
//!    with one message in fifty failing;
//! 7. the database floor: the claims and effects of row 3, inserted set-based
//!    by a plain script, 32 messages a transaction, no broker.
//!    Row 7b is the floor again at row 3b's average transaction.
//!
//! Row 3b is row 3 with a batch handler: one insert for all new messages of a
//! transaction. Every row prints the CPU each process spent per message, and
//! row 4 its latency at half load and from publish to the downstream event at
//! 100 and 500 messages a second. `--counts` runs row 3 again through
//! counting proxies (statements, round trips, ack frames).
//!
//! `--inbox-rows` repeats rows 3 and 4 with that many rows already in the inbox
//! and times `warren inbox purge` of a million expired ones while billing runs.
//! `--sweep` runs row 4 over a grid of prefetch, concurrency and batch size.

mod counts;
mod dbs;
mod formats;
mod probe;
mod profile;
mod scale;
mod wire;
mod workloads;

use std::future::Future;
use std::time::Duration;

use sqlx::{Postgres, Sqlite};
use warren::broker::Publisher;
use warren::config::BatchIsolation;
use warren::store::Store;
use warren_admin::DatabaseUrl;

pub use probe::{LogSwitches, Probe, Settled, count_broker_nodes, install_switches};

use billing_service::config::Config;
use dbs::BenchDb;
use workloads::{Env, invoices};

/// What `billing bench` was asked to do.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// Messages per workload.
    pub messages: usize,
    /// PostgreSQL, SQLite, or both.
    pub postgres: Option<String>,
    /// Whether to run on SQLite too.
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
    /// Where to write flamegraphs of rows 3, 3b, 4 and 8 (feature `profile`).
    pub profile: Option<std::path::PathBuf>,
    /// Counts of billing instances to run row 4 with, side by side, on
    /// PostgreSQL (empty: skip).
    pub instances: Vec<usize>,
}

impl BenchSpec {
    fn runs(&self, row: u8) -> bool {
        row == 1 || self.rows.contains(&row)
    }
}

/// The goals of the throughput issues, as ratios: rows 3, 3b and 4 of the
/// bare drain, row 3 of the seed pattern, the relay of bare publishing, and
/// the p99 latency from publish to the downstream event.
struct Goals {
    one_insert: f64,
    batch_insert: f64,
    billing: f64,
    over_seed: f64,
    relay: f64,
    /// p99 end to end at 500/s and at 100/s, where there is a goal.
    p99_at_500: Option<Duration>,
    p99_at_100: Option<Duration>,
}

impl Goals {
    /// The p99 goal at `rate` messages a second, if there is one.
    fn end_to_end_p99(&self, rate: f64) -> Option<Duration> {
        if rate >= 500.0 {
            self.p99_at_500
        } else if rate <= 100.0 {
            self.p99_at_100
        } else {
            None
        }
    }

    /// The p99 goal the sweep keeps its cells within.
    fn sweep_p99(&self) -> Duration {
        self.p99_at_500.unwrap_or(Duration::from_millis(50))
    }
}

const RSS_GOAL_MIB: f64 = 100.0;

/// Messages a drain of row 8 at most: it drains twenty times, and a tick of
/// the CPU clock (10 ms) is then half a microsecond a message.
const FORMAT_MESSAGES: usize = 20_000;

/// Messages a transaction of row 7, the database floor.
const FLOOR_BATCH: usize = 32;

fn goals<B: BenchDb>() -> Goals {
    let postgres = B::LABEL == "PostgreSQL";
    Goals {
        one_insert: 0.4,
        batch_insert: 0.6,
        billing: 0.3,
        over_seed: 4.0,
        relay: 0.7,
        // The latency goals are PostgreSQL's; SQLite's figures are shown.
        p99_at_500: postgres.then(|| Duration::from_millis(20)),
        p99_at_100: postgres.then(|| Duration::from_millis(10)),
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
    let pool = billing_service::db::pool_size(cfg.concurrency);
    println!(
        "billing bench: {} messages per workload; prefetch {}, concurrency {}, batch size {}, \
         pool {pool}; quorum queues; {}; this machine ({} cores)",
        spec.messages,
        env.settings.prefetch,
        env.settings.concurrency,
        env.settings.batch_size,
        probe::broker_described(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "RabbitMQ's schedulers busy-wait: {}",
        probe::broker_busy_wait()
    );
    let mut passed = true;
    if let Some(url) = &spec.postgres {
        println!(
            "PostgreSQL at {} (TLS: {})",
            warren_admin::redact_url(url),
            if url.contains("sslmode=disable") {
                "off"
            } else {
                "as the server and sslmode allow"
            }
        );
        let schema = format!("bench_{}", env.tag);
        let db_url: DatabaseUrl = url.parse().map_err(|e| format!("--postgres-url: {e}"))?;
        billing_service::scratch::create_schema(&db_url, &schema).await?;
        let opened = billing_service::db::open(&db_url, Some(&schema), pool).await;
        let result = match opened {
            Ok(billing_service::db::Database::Postgres(store)) => {
                let mut r = on_database::<Postgres>(&env, spec, store.clone(), settled).await;
                if spec.counts
                    && let Ok(passed) = r
                {
                    r = counted(&env, url, &schema, spec.messages.min(4000))
                        .await
                        .map(|counts_passed| passed && counts_passed);
                }
                if !spec.instances.is_empty() && r.is_ok() {
                    r = scale::instances(
                        &env,
                        &db_url,
                        &schema,
                        pool,
                        &spec.instances,
                        spec.messages,
                    )
                    .await
                    .and(r);
                }
                store.pool().close().await;
                r
            }
            Ok(_) => Err("--postgres-url is not a PostgreSQL URL".into()),
            Err(e) => Err(e),
        };
        billing_service::scratch::drop_schema(&db_url, &schema).await;
        passed &= result?;
    }
    if spec.sqlite {
        let dir = billing_service::scratch::tempdir()?;
        let url = format!("sqlite://{}", dir.join("bench.db").display());
        let result = match billing_service::db::open(&DatabaseUrl::Sqlite(url), None, pool).await? {
            billing_service::db::Database::Sqlite(store) => {
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
    /// CPU per message of each process, where the row measured it.
    cpu: Option<CpuPer>,
}

impl Row {
    fn new(name: impl Into<String>, rate: f64, ratio: (f64, &'static str)) -> Self {
        Self {
            name: name.into(),
            rate,
            ratio: Some(ratio),
            goal: None,
            rss: None,
            cpu: None,
        }
    }

    fn goal(mut self, goal: f64) -> Self {
        self.goal = Some(goal);
        self
    }

    fn cpu(mut self, cpu: CpuPer) -> Self {
        self.cpu = Some(cpu);
        self
    }

    fn rss(mut self, rss: Option<f64>) -> Self {
        self.rss = rss;
        self
    }
}

/// CPU each process spent per message of a workload, in microseconds: this
/// one (the consumer: warren's process), RabbitMQ's `beam.smp`, and the
/// PostgreSQL server's backends (SQLite runs in this process).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuPer {
    /// This process: the consumer.
    pub this: f64,
    /// RabbitMQ's `beam.smp`.
    pub broker: f64,
    /// PostgreSQL's backends.
    pub database: f64,
}

impl CpuPer {
    fn of(spent: &probe::CpuTimes, n: usize) -> Self {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / n.max(1) as f64;
        Self {
            this: per(spent.this_process),
            broker: per(spent.broker),
            database: per(spent.database),
        }
    }
}

/// A workload's result, with its time and the CPU each process spent on it.
struct Measured<T> {
    out: T,
    cpu: CpuPer,
    rss: Option<f64>,
}

/// Runs `work` over `n` messages and reads the CPU each process spent and the
/// peak RSS of this one meanwhile.
async fn measured<T>(n: usize, work: impl Future<Output = T>) -> Measured<T> {
    let before = probe::CpuTimes::now();
    let (out, rss) = with_peak(work).await;
    let spent = probe::CpuTimes::now().since(&before);
    Measured {
        out,
        cpu: CpuPer::of(&spent, n),
        rss,
    }
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

/// What rows 3 and 3b measured: rate, CPU per message, peak RSS.
#[derive(Clone, Copy)]
struct Drain {
    rate: f64,
    cpu: CpuPer,
    rss: Option<f64>,
    /// Messages a transaction, on average (alone ones included).
    per_transaction: f64,
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
    let bare_run = measured(n, workloads::bare_drain(env, &q, n)).await;
    let bare = rate(n, bare_run.out?);
    let bare_cpu = bare_run.cpu;
    let _ = warren::broker::delete(&env.connection, &t).await;

    let mut seed = None;
    if spec.runs(2) {
        println!("{}: row 2, the seed pattern by hand", B::LABEL);
        let q = queue("seed");
        let t = workloads::filled_queue(env, &q, &messages).await?;
        let run = measured(n, workloads::seed_pattern::<B>(env, B::pool(&store), &q, n)).await;
        seed = Some((rate(n, run.out?), run.cpu));
        let _ = warren::broker::delete(&env.connection, &t).await;
    }

    let mut one_insert = None;
    let mut batch_insert = None;
    let mut logging = None;
    let mut slow = None;
    if spec.runs(3) {
        let db = B::LABEL.to_lowercase();
        let profile = spec.profile.as_deref();
        println!("{}: row 3, warren with a one-insert handler", B::LABEL);
        let q = queue("warren");
        let run = row3::<B>(env, &store, &q, &messages);
        one_insert = Some(profile::profiled(profile, &format!("row3-{db}"), run).await??);
        println!("{}: row 3b, warren with a batch handler", B::LABEL);
        let fresh = invoices(n);
        let q = queue("warren-batch");
        let run = row3_batch::<B>(env, &store, &q, &fresh);
        batch_insert = Some(profile::profiled(profile, &format!("row3b-{db}"), run).await??);
        // Not on SQLite: there the held handler holds the one writer, and
        // every other transaction waits for it.
        if B::LABEL != "SQLite" {
            println!(
                "{}: row 3s, row 3 with its first delivery held open until the rest were handled",
                B::LABEL,
            );
            let slowed = invoices(n);
            let first = slowed[0]
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            let set_slow = |held: Option<(String, usize)>| {
                *dbs::SLOW
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = held;
            };
            dbs::CALLS.store(0, std::sync::atomic::Ordering::Relaxed);
            // Released once all but the held one's own batch were handled: those
            // run after it in its transaction.
            let others = n.saturating_sub(1 + env.settings.batch_size);
            set_slow(Some((first, others)));
            let slowed = row3::<B>(env, &store, &queue("warren-slow"), &slowed).await;
            set_slow(None);
            slow = Some(slowed?);
        }
        println!("{}: row 3i, row 3 with a log line per message", B::LABEL);
        probe::log_lines(true);
        let logged = row3::<B>(env, &store, &queue("warren-logged"), &invoices(n)).await;
        probe::log_lines(false);
        logging = Some(logged?);
    }

    let mut floor = None;
    // The floor again at the size of the batch handler's transactions: how
    // much of the distance to the floor is batch size alone.
    let mut floor_at_3b = None;
    if spec.runs(7) {
        println!("{}: row 7, the database floor", B::LABEL);
        let run = measured(
            n,
            workloads::database_floor::<B>(env, B::pool(&store), &invoices(n), FLOOR_BATCH),
        )
        .await;
        floor = Some((rate(n, run.out?), run.cpu));
        if let Some(d) = batch_insert {
            let size = (d.per_transaction.round() as usize).clamp(1, FLOOR_BATCH);
            println!(
                "{}: row 7b, the database floor at {size} messages a transaction",
                B::LABEL
            );
            let run = measured(
                n,
                workloads::database_floor::<B>(env, B::pool(&store), &invoices(n), size),
            )
            .await;
            floor_at_3b = Some((size, rate(n, run.out?), run.cpu));
        }
    }

    let prefix = format!("bench-{}-{}", env.tag, B::LABEL.to_lowercase());
    let mut billing = None;
    if spec.runs(4) {
        println!(
            "{}: row 4, billing, then its latency at half load and end to end",
            B::LABEL
        );
        let run = row4::<B>(env, &store, &prefix, &messages, settled, spec);
        let name = format!("row4-{}", B::LABEL.to_lowercase());
        billing = Some(profile::profiled(spec.profile.as_deref(), &name, run).await??);
    }

    // Row 6: the two ways of isolating a message in a batch, when nothing
    // fails and when one message in fifty does.
    let mut isolation = Vec::new();
    if spec.runs(6) {
        println!("{}: row 6, savepoints against replays", B::LABEL);
        let savepoints = BatchIsolation::Savepoints {
            handler_savepoints: 0,
        };
        for (name, mode, failing) in [
            ("savepoints", savepoints, false),
            ("replay-failing", BatchIsolation::Replay, true),
            ("savepoints-failing", savepoints, true),
        ] {
            // Fresh ids: those of row 3 are in the inbox of the same consumer.
            let fresh = invoices(n);
            let run = one_insert_run::<B>(env, &store, &queue(name), &fresh, mode, failing).await?;
            isolation.push(run);
        }
    }

    let mut by_format = None;
    if spec.runs(8) {
        let n8 = n.min(FORMAT_MESSAGES);
        println!(
            "{}: row 8, each format billing reads against warren's envelope, {n8} messages a drain",
            B::LABEL
        );
        by_format =
            Some(formats::row8::<B>(env, &store, &queue, n8, spec.profile.as_deref()).await?);
    }

    let mut relayed = None;
    if spec.runs(5) {
        let ((relay, relay_cpu), (bare_publish, bare_cpu)) =
            workloads::relay_against_bare::<B>(env, store.clone(), n).await?;
        relayed = Some((
            (rate(n, relay), CpuPer::of(&relay_cpu, n)),
            (rate(n, bare_publish), CpuPer::of(&bare_cpu, n)),
        ));
    }

    let mut rows = vec![
        Row::new(
            format!(
                "1  bare drain: lapin, no database, acks every {}",
                workloads::bare_ack_every(env.settings.prefetch)
            ),
            bare,
            (1.0, "row 1"),
        )
        .cpu(bare_cpu),
    ];
    if let Some((seed, cpu)) = seed {
        rows.push(
            Row::new(
                "2  seed pattern by hand: a transaction per message",
                seed,
                (seed / bare, "row 1"),
            )
            .cpu(cpu),
        );
    }
    for (row, name, goal) in [
        (
            one_insert,
            "3  warren, one-insert handler",
            goals.one_insert,
        ),
        (
            batch_insert,
            "3b warren, batch handler, one insert a batch",
            goals.batch_insert,
        ),
    ] {
        let Some(d) = row else { continue };
        rows.push(
            Row::new(name, d.rate, (d.rate / bare, "row 1"))
                .goal(goal)
                .cpu(d.cpu)
                .rss(d.rss),
        );
        if let Some((seed, _)) = seed {
            rows.push(Row::new(name, d.rate, (d.rate / seed, "row 2")).goal(goals.over_seed));
        }
    }
    if let (Some(d), Some(slowed)) = (one_insert, slow) {
        rows.push(
            Row::new(
                "3s row 3, its first delivery open all along",
                slowed.rate,
                (slowed.rate / d.rate, "row 3"),
            )
            .cpu(slowed.cpu),
        );
    }
    if let (Some(d), Some(logged)) = (one_insert, logging) {
        rows.push(
            Row::new(
                "3i row 3, a log line per message (text, /dev/null)",
                logged.rate,
                (logged.rate / d.rate, "row 3"),
            )
            .cpu(logged.cpu),
        );
    }
    if let Some((row4, _)) = &billing {
        rows.push(
            Row::new(
                "4  billing: invoice, points, outbox, relay",
                row4.rate,
                (row4.rate / bare, "row 1"),
            )
            .goal(goals.billing)
            .cpu(row4.cpu)
            .rss(row4.rss),
        );
    }
    if let (Some(d), [savepoints, replay_failing, savepoints_failing]) =
        (one_insert, isolation.as_slice())
    {
        rows.push(
            Row::new(
                "6a row 3, a savepoint per message",
                savepoints.rate,
                (savepoints.rate / d.rate, "row 3"),
            )
            .cpu(savepoints.cpu),
        );
        rows.push(
            Row::new(
                "6b row 3, 1 in 50 failing, replayed (default)",
                replay_failing.rate,
                (replay_failing.rate / d.rate, "row 3"),
            )
            .cpu(replay_failing.cpu),
        );
        rows.push(
            Row::new(
                "6c row 3, 1 in 50 failing, savepoints",
                savepoints_failing.rate,
                (savepoints_failing.rate / replay_failing.rate, "row 6b"),
            )
            .cpu(savepoints_failing.cpu),
        );
    }
    if let Some((relay, bare_publish)) = relayed {
        rows.push(
            Row::new(
                "5a bare confirmed publishing, relay's batches",
                bare_publish.0,
                (1.0, "row 5a"),
            )
            .cpu(bare_publish.1),
        );
        rows.push(
            Row::new(
                "5  relay draining a filled outbox",
                relay.0,
                (relay.0 / bare_publish.0, "row 5a"),
            )
            .goal(goals.relay)
            .cpu(relay.1),
        );
    }
    if let Some((floor, cpu)) = floor {
        rows.push(
            Row::new(
                format!("7  database floor: claims and effects, {FLOOR_BATCH} a transaction"),
                floor,
                (floor / bare, "row 1"),
            )
            .cpu(cpu),
        );
    }
    if let Some((size, floor, cpu)) = floor_at_3b {
        rows.push(
            Row::new(
                format!("7b database floor, {size} a transaction (row 3b's average)"),
                floor,
                (floor / bare, "row 1"),
            )
            .cpu(cpu),
        );
    }
    println!("\n{} ({})", B::LABEL, B::DURABILITY);
    print_table(&rows);
    if let Some((row4, latency)) = &billing {
        println!(
            "   outbox rows pending when row 4's queue was drained: {}",
            row4.pending_outbox
        );
        let half = &latency.half_load;
        println!(
            "   row 4 latency at half load ({:.0} msg/s, {} messages), publish to ack after \
             commit: p50 {:.1} ms, p99 {:.1} ms",
            half.rate,
            half.samples,
            ms(half.p50),
            ms(half.p99),
        );
        for (e2e, legs) in &latency.end_to_end {
            let goal = goals.end_to_end_p99(e2e.rate);
            println!(
                "   row 4 end to end at {:.0} msg/s ({} messages), publish to the \
                 invoice-payment-recorded event downstream: p50 {:.1} ms, p99 {:.1} ms{}",
                e2e.rate,
                e2e.samples,
                ms(e2e.p50),
                ms(e2e.p99),
                goal.map_or(String::new(), |g| format!(
                    " (goal p99 < {} ms: {})",
                    g.as_millis(),
                    met(e2e.p99 < g)
                )),
            );
            let leg = |(p50, p99): (Duration, Duration)| {
                format!("p50 {:.1} ms, p99 {:.1} ms", ms(p50), ms(p99))
            };
            println!(
                "     where it went: publish to settled (broker, batch, commit, ack) {}; settled \
                 to the relay's publish {}; the relay's publish to the event downstream {}",
                leg(legs.consumer),
                leg(legs.relay),
                leg(legs.downstream),
            );
        }
    }
    for (what, rss) in [
        ("row 3", one_insert.and_then(|d| d.rss)),
        ("row 4", billing.as_ref().and_then(|(r, _)| r.rss)),
    ] {
        if let Some(rss) = rss {
            println!(
                "   peak RSS of the process during {what}: {rss:.0} MiB (goal < {RSS_GOAL_MIB:.0} MiB: {})",
                met(rss < RSS_GOAL_MIB)
            );
        }
    }
    if let Some(costs) = &by_format {
        formats::print(B::LABEL, costs);
    }
    print_budgets::<B>(
        bare_cpu,
        one_insert,
        batch_insert,
        floor.map(|(_, cpu)| cpu),
        floor_at_3b.map(|(size, _, cpu)| (size, cpu)),
    );

    if let (Some(d), Some((row4, _))) = (one_insert, &billing) {
        if spec.inbox_rows > 0 {
            scale::big_inbox::<B>(env, spec, &store, &messages, d.rate, row4.rate, settled).await?;
        }
        if spec.sweep {
            scale::sweep::<B>(env, spec, &store, bare, settled).await?;
        }
    }
    let mut passed = true;
    let floor = goals.one_insert / 2.0;
    if let (true, Some(d)) = (spec.check, one_insert) {
        let ratio = d.rate / bare;
        let ok = ratio >= floor;
        println!(
            "check {}: row 3 on {} is {ratio:.3} of the bare drain (half its goal: {floor:.2})",
            if ok { "passed" } else { "FAILED" },
            B::LABEL
        );
        passed &= ok;
    }
    if let (Some(min), Some(d), Some((seed, _))) = (spec.min_over_seed, one_insert, seed) {
        let over = d.rate / seed;
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

/// The budgets of CPU per message, each against a floor measured in the same
/// run (PostgreSQL's: SQLite runs inside this process).
fn print_budgets<B: BenchDb>(
    bare: CpuPer,
    one_insert: Option<Drain>,
    batch: Option<Drain>,
    floor: Option<CpuPer>,
    floor_at_batch: Option<(usize, CpuPer)>,
) {
    // Rows 3 and 3b are what the budgets are for: without them (e.g.
    // `--rows 4`) there is nothing to hold against a budget.
    if B::LABEL != "PostgreSQL" || (one_insert.is_none() && batch.is_none()) {
        return;
    }
    println!("   CPU per message against budgets measured in this run:");
    let line = |what: &str, spent: f64, budget: f64, how: String| {
        println!(
            "     {what:<44} {spent:>6.1} µs, budget {budget:>6.1} µs ({how}): {}",
            met(spent <= budget)
        );
    };
    if let Some(d) = one_insert {
        line(
            "warren's process, one-insert handler",
            d.cpu.this,
            bare.this + 25.0,
            format!("the bare drain's {:.1} + 25", bare.this),
        );
    }
    if let Some(d) = batch {
        line(
            "warren's process, batch handler",
            d.cpu.this,
            bare.this + 12.0,
            format!("the bare drain's {:.1} + 12", bare.this),
        );
    }
    for (what, d) in [("one-insert", one_insert), ("batch", batch)] {
        if let Some(d) = d {
            line(
                &format!("RabbitMQ, {what} handler"),
                d.cpu.broker,
                1.3 * bare.broker,
                format!("1.3 × the bare drain's {:.1}", bare.broker),
            );
        }
    }
    if let Some(floor) = floor {
        for (what, d, factor) in [("one-insert", one_insert, 2.0), ("batch", batch, 1.3)] {
            if let Some(d) = d {
                line(
                    &format!("PostgreSQL, {what} handler"),
                    d.cpu.database,
                    factor * floor.database,
                    format!("{factor} × the floor's {:.1} per row", floor.database),
                );
            }
        }
    }
    // Not a budget: how far the batch handler is from the floor at the size
    // its own transactions had.
    if let (Some((size, floor)), Some(d)) = (floor_at_batch, batch) {
        println!(
            "     PostgreSQL, batch handler, against the floor at {size} a transaction: {:.1} µs \
             against {:.1} ({:.2} ×)",
            d.cpu.database,
            floor.database,
            d.cpu.database / floor.database.max(f64::MIN_POSITIVE),
        );
    }
}

/// The counting passes on PostgreSQL (see `counts`): rows 3, 3b and 4 with
/// their connections through counting proxies. `Ok(false)` if a gate on the
/// counts failed.
async fn counted(env: &Env, url: &str, schema: &str, n: usize) -> Result<bool, String> {
    let mut passed = true;
    let mut gate = |ok: bool, what: String| {
        println!("check {}: {what}", if ok { "passed" } else { "FAILED" });
        passed &= ok;
    };
    for (row, name) in [
        (
            counts::Counted::OneInsert,
            "row 3 (a handler of one message)",
        ),
        (counts::Counted::BatchInsert, "row 3b (a batch handler)"),
        (
            counts::Counted::Billing,
            "row 4 (billing, its relay beside it)",
        ),
    ] {
        println!("PostgreSQL: {name} again, {n} messages, counted on the wire");
        let Some(c) = counts::run(env, url, schema, n, row).await? else {
            return Ok(true);
        };
        c.print();
        match row {
            counts::Counted::OneInsert | counts::Counted::BatchInsert => {
                let trips = c.overhead_per_transaction();
                // A transaction under way when the count starts is counted in
                // part: a few hundredths over.
                gate(
                    trips <= counts::PG_ROUND_TRIPS_PER_TRANSACTION + 0.05,
                    format!(
                        "{name}: {trips:.2} round trips a transaction beside the handlers' (the README's \
                         count: {})",
                        counts::PG_ROUND_TRIPS_PER_TRANSACTION
                    ),
                );
                let acks = c.acks_per_delivery();
                let most = counts::ACKS_PER_DELIVERY_BEFORE / 4.0;
                gate(
                    acks <= most,
                    format!(
                        "{name}: {acks:.3} ack frames per delivery (at most {most:.3}, a quarter of the {} \
                         before acks were held)",
                        counts::ACKS_PER_DELIVERY_BEFORE
                    ),
                );
            }
            counts::Counted::Billing => {
                let notify = c.pg.statements_starting("SELECT pg_notify");
                gate(
                    notify == 0,
                    format!("{name}: {notify} notifications (the relay is woken in process)"),
                );
                let unclaims = c.pg.statements_starting("DELETE FROM warren_inbox");
                gate(
                    unclaims == 0,
                    format!("{name}: {unclaims} claims taken back (no batch time limit)"),
                );
                let passes = c.pg.statements_starting("SET LOCAL synchronous_commit");
                let marks =
                    c.pg.statements_starting("UPDATE warren_outbox SET published_at");
                println!(
                    "   the relay: {passes} passes, {marks} of them published rows ({} empty)",
                    passes.saturating_sub(marks)
                );
            }
        }
    }
    Ok(passed)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "missed" }
}

fn print_table(rows: &[Row]) {
    println!(
        "   {:<52} {:>9} {:>7} {:<7} {:>12} {:>26} {:>9}",
        "workload", "msg/s", "ratio", "of", "goal", "CPU µs/msg: here/MQ/DB", "peak RSS"
    );
    for r in rows {
        let (ratio, of) = r
            .ratio
            .map_or((String::new(), ""), |(x, of)| (format!("{x:.3}"), of));
        let goal = r.goal.map_or(String::new(), |g| {
            let x = r.ratio.map_or(0.0, |(x, _)| x);
            format!("≥ {g} {}", met(x >= g))
        });
        let cpu = r.cpu.map_or(String::new(), |c| {
            format!("{:.1} / {:.1} / {:.1}", c.this, c.broker, c.database)
        });
        let rss = r.rss.map_or(String::new(), |m| format!("{m:.0} MiB"));
        println!(
            "   {:<52} {:>9.0} {:>7} {:<7} {:>12} {:>26} {:>9}",
            r.name, r.rate, ratio, of, goal, cpu, rss
        );
    }
}

/// Row 3 on a fresh queue.
async fn row3<B: BenchDb>(
    env: &Env,
    store: &B::S,
    queue: &str,
    messages: &[billing_service::stream::Planned],
) -> Result<Drain, String> {
    one_insert_run::<B>(env, store, queue, messages, BatchIsolation::Replay, false).await
}

/// Row 3b: row 3's effect written by a batch handler, one insert a batch.
async fn row3_batch<B: BenchDb>(
    env: &Env,
    store: &B::S,
    queue: &str,
    messages: &[billing_service::stream::Planned],
) -> Result<Drain, String> {
    let n = messages.len();
    let t = workloads::filled_queue(env, queue, messages).await?;
    let run = measured(
        n,
        workloads::warren_batch_insert::<B>(env, store.clone(), queue, n),
    )
    .await;
    let _ = warren::broker::delete(&env.connection, &t).await;
    let (elapsed, stats) = run.out?;
    println!("   {}", batching(&stats));
    Ok(Drain {
        rate: rate(n, elapsed),
        cpu: run.cpu,
        rss: run.rss,
        per_transaction: per_transaction(&stats),
    })
}

/// Row 3's consumer draining a filled queue, with `isolation`, its handler
/// failing for one message in fifty if `failing`.
async fn one_insert_run<B: BenchDb>(
    env: &Env,
    store: &B::S,
    queue: &str,
    messages: &[billing_service::stream::Planned],
    isolation: BatchIsolation,
    failing: bool,
) -> Result<Drain, String> {
    let n = messages.len();
    let t = workloads::filled_queue(env, queue, messages).await?;
    let run = measured(
        n,
        workloads::warren_one_insert::<B>(
            env,
            store.clone(),
            queue,
            n,
            failing,
            &|b| b.with_batch_isolation(isolation),
            &|| {},
        ),
    )
    .await;
    let _ = warren::broker::delete(&env.connection, &t).await;
    let (elapsed, stats) = run.out?;
    println!("   {}", batching(&stats));
    let hash = partition_hash_cost(n);
    println!(
        "   a partitioned consumer also hashes each delivery's key to check its partition: \
         {:.2} µs, {:.1}% of this process's CPU per message above",
        hash.as_secs_f64() * 1e6,
        100.0 * hash.as_secs_f64() * 1e6 / run.cpu.this.max(f64::MIN_POSITIVE),
    );
    Ok(Drain {
        rate: rate(n, elapsed),
        cpu: run.cpu,
        rss: run.rss,
        per_transaction: per_transaction(&stats),
    })
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

/// Messages a transaction: those of batches, and those alone at one each.
fn per_transaction(stats: &warren::telemetry::ConsumerStats) -> f64 {
    let settled = stats.applied + stats.duplicates + stats.stale;
    let alone = settled.saturating_sub(stats.batched);
    settled as f64 / (stats.batches + alone).max(1) as f64
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
    cpu: CpuPer,
    rss: Option<f64>,
    pending_outbox: i64,
}

/// A latency run's figures.
#[derive(Debug, Clone, Copy)]
pub struct Latency {
    /// The rate messages were published at.
    pub rate: f64,
    /// The median latency.
    pub p50: Duration,
    /// The 99th percentile.
    pub p99: Duration,
    /// Messages whose latency was measured.
    pub samples: usize,
}

/// Row 4's latency runs: publish to ack at half its own rate, and publish to
/// the downstream event at the fixed rates of the goals.
struct Latencies {
    half_load: Latency,
    end_to_end: Vec<(Latency, workloads::Legs)>,
}

/// The rates the end-to-end latency is measured at: the goals'.
const END_TO_END_RATES: [f64; 2] = [100.0, 500.0];

/// Row 4 (billing draining a filled queue), then its latency at half that
/// rate, and end to end at each of [`END_TO_END_RATES`].
async fn row4<B: BenchDb>(
    env: &Env,
    store: &B::S,
    prefix: &str,
    messages: &[billing_service::stream::Planned],
    settled: &Settled,
    spec: &BenchSpec,
) -> Result<(Row4, Latencies), String> {
    row4_with::<B>(
        env,
        store,
        prefix,
        messages,
        settled,
        spec,
        &END_TO_END_RATES,
        true,
    )
    .await
}

/// Waits until the relay has published every row of the outbox; how long.
async fn relay_caught_up<B: BenchDb>(store: &B::S) -> Result<Duration, String> {
    let start = std::time::Instant::now();
    while workloads::Billing::outbox_pending(store).await > 0 {
        if start.elapsed() > Duration::from_secs(120) {
            return Err("the relay did not publish its backlog within 120 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(start.elapsed())
}

/// Row 4, its latency at half load if `half_load` (else reported as zero),
/// and end to end at each of `rates`.
#[allow(clippy::too_many_arguments)]
async fn row4_with<B: BenchDb>(
    env: &Env,
    store: &B::S,
    prefix: &str,
    messages: &[billing_service::stream::Planned],
    settled: &Settled,
    spec: &BenchSpec,
    rates: &[f64],
    half_load: bool,
) -> Result<(Row4, Latencies), String> {
    let n = messages.len();
    let billing = workloads::start_billing::<B>(env, store.clone(), prefix, messages).await?;
    let run = measured(n, billing.drain(n)).await;
    let pending_outbox = workloads::Billing::outbox_pending(store).await;
    let r = rate(n, run.out);
    // The latency runs measure a relay that keeps up, not the backlog the
    // drain left it.
    let waited = relay_caught_up::<B>(store).await?;
    if half_load {
        println!(
            "   the relay published row 4's backlog of {pending_outbox} events {:.1} s after \
             the queue was drained",
            waited.as_secs_f64()
        );
    }
    let latencies = async {
        let half_load = match half_load {
            true => {
                billing
                    .latencies(env, settled, r / 2.0, spec.latency_period)
                    .await?
            }
            false => Latency {
                rate: 0.0,
                p50: Duration::ZERO,
                p99: Duration::ZERO,
                samples: 0,
            },
        };
        let mut end_to_end = Vec::new();
        for &rate in rates {
            relay_caught_up::<B>(store).await?;
            end_to_end.push(
                billing
                    .end_to_end(env, settled, rate, spec.latency_period)
                    .await?,
            );
        }
        Ok::<_, String>(Latencies {
            half_load,
            end_to_end,
        })
    }
    .await;
    billing.stop(env).await;
    Ok((
        Row4 {
            rate: r,
            cpu: run.cpu,
            rss: run.rss,
            pending_outbox,
        },
        latencies?,
    ))
}
