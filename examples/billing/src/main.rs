//! `billing`: warren's reference service. It records paid invoices and credits
//! loyalty points from `billing.invoice-paid` events, once per event however
//! often it arrives, and announces each recorded payment through its outbox.
#![allow(clippy::print_stdout, clippy::print_stderr)] // a command-line program
// A binary: `pub` marks what a module offers the rest of the program.
#![allow(unreachable_pub)]

mod amount;
mod bench;
mod chaos;
mod config;
mod credit;
mod db;
mod demo;
mod handlers;
mod http;
mod service;
mod status;
mod stream;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use sqlx::{Postgres, Sqlite};
use warren::admin::DatabaseUrl;
use warren::{QueueType, RetryPolicy};

use crate::config::{Config, LogFormat};
use crate::db::{BillingDb, Database};
use crate::service::{Names, Settings};
use crate::stream::StreamSpec;

use std::time::Duration;

/// warren's reference service: paid invoices and loyalty points, effectively once.
///
/// Every setting can come from a flag, its environment variable, or the TOML file
/// given with --config (keys as the flags, with underscores); flags win over the
/// file, the file over the defaults.
#[derive(Parser)]
#[command(name = "billing", version, about)]
struct Cli {
    /// TOML configuration file.
    #[arg(long, env = "BILLING_CONFIG", global = true)]
    config: Option<std::path::PathBuf>,
    /// Broker URL; several, separated by commas, for a cluster [default:
    /// amqp://guest:guest@127.0.0.1:5672/%2f].
    #[arg(long, env = "AMQP_URL", global = true, hide_env_values = true)]
    amqp_url: Option<String>,
    /// PEM file of the CA that signed the broker's certificate, for amqps://
    /// (trusted besides the bundled public roots).
    #[arg(long, env = "AMQP_CA_FILE", global = true)]
    amqp_ca_file: Option<String>,
    /// PEM client certificate to present over amqps://; needs --amqp-client-key.
    #[arg(long, env = "AMQP_CLIENT_CERT", global = true)]
    amqp_client_cert: Option<String>,
    /// PEM private key of --amqp-client-cert.
    #[arg(long, env = "AMQP_CLIENT_KEY", global = true)]
    amqp_client_key: Option<String>,
    /// Database: postgres://..., sqlite://PATH, or a file path [default: SQLite
    /// file billing.db here; the demo uses a fresh temporary one].
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Prefix of the exchange and queues [default: billing; the demo makes a fresh one].
    #[arg(long, env = "BILLING_PREFIX", global = true)]
    prefix: Option<String>,
    /// Address of /metrics, /healthz and /readyz [default: 127.0.0.1:9464].
    #[arg(long, env = "BILLING_HTTP", global = true)]
    http: Option<String>,
    /// Unacknowledged deliveries the broker may push to this process [default: 32].
    #[arg(long, env = "BILLING_PREFETCH", global = true)]
    prefetch: Option<u16>,
    /// Batches (database transactions) processed at once [default: 8].
    #[arg(long, env = "BILLING_CONCURRENCY", global = true)]
    concurrency: Option<usize>,
    /// Deliveries already buffered that are applied in one transaction, at
    /// most; 1 turns batching off [default: 32].
    #[arg(long, env = "BILLING_BATCH_SIZE", global = true)]
    batch_size: Option<usize>,
    /// Retry delay tiers, comma separated [default: 5s,30s,2m,10m,30m; the demo
    /// uses 200ms,500ms,1s].
    #[arg(long, env = "BILLING_RETRY_TIERS", global = true)]
    retry_tiers: Option<String>,
    /// Log format, text or json [default: text on a terminal, JSON otherwise].
    #[arg(long, env = "BILLING_LOG_FORMAT", global = true)]
    log_format: Option<String>,
    /// Delete inbox rows older than this, every hour (e.g. 30d) [default: keep].
    #[arg(long, env = "BILLING_INBOX_RETENTION", global = true)]
    inbox_retention: Option<String>,
    /// The broker's consumer_timeout, for the long-handler warning [default: 30m].
    #[arg(long, env = "BILLING_CONSUMER_TIMEOUT", global = true)]
    consumer_timeout: Option<String>,
    /// Partition queues of the credit stream, P.customer-credit.0 .. N-1
    /// [default: 4]. Changing it needs the drain-and-redeclare procedure.
    #[arg(long, env = "BILLING_PARTITIONS", global = true)]
    partitions: Option<u32>,
    /// How long a credit partition lease lasts unrenewed: how long the
    /// partitions of a process that died wait for another [default: 15s].
    #[arg(long, env = "BILLING_PARTITION_LEASE", global = true)]
    partition_lease: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the consumer, the outbox relay and the HTTP endpoints until SIGTERM or SIGINT.
    Run,
    /// Run the whole story on fresh state and prove the outcome.
    Demo {
        /// Invoices to publish.
        #[arg(long, default_value_t = 500)]
        count: usize,
        /// Keep the demo's queues and database instead of removing them.
        #[arg(long)]
        keep: bool,
    },
    /// Publish invoice-paid events to the prefix's exchange.
    Publish {
        /// Unique valid invoices (flaky ones included).
        #[arg(long, default_value_t = 100)]
        count: usize,
        /// Share of valid messages sent twice, 0 to 1.
        #[arg(long, default_value_t = 0.1)]
        duplicates: f64,
        /// Share of messages in schema version 2, 0 to 1.
        #[arg(long, default_value_t = 0.3)]
        v2: f64,
        /// Poison messages (invalid JSON, unknown version, negative amount,
        /// unsupported currency, unknown type, in turn).
        #[arg(long, default_value_t = 0)]
        poison: usize,
        /// Messages from flaky customers, which fail twice before succeeding.
        #[arg(long, default_value_t = 0)]
        flaky: usize,
        /// Seed of the random choices [default: random].
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Counts from the database and the queues.
    Status,
    /// Several `billing run` processes, a stream, and faults at random from a
    /// seed; then the invariants. Needs a build with --features failpoints.
    Chaos {
        /// Unique invoices to publish.
        #[arg(long, default_value_t = 20_000)]
        count: usize,
        /// `billing run` processes sharing the database.
        #[arg(long, default_value_t = 3)]
        processes: usize,
        /// Seed of the stream and the fault schedule [default: random].
        #[arg(long)]
        seed: Option<u64>,
        /// Mean pause between faults.
        #[arg(long, default_value = "1500ms", value_parser = warren::retry::parse_delay)]
        fault_interval: Duration,
        /// Probability of each crash point; every process started during the
        /// fault phase has them armed, so that several crashes fall within one
        /// prefetch window.
        #[arg(long, default_value_t = 0.03)]
        crash_probability: f64,
        /// Never stop and start the broker application.
        #[arg(long)]
        no_broker_restarts: bool,
        /// Stop injecting faults after this long.
        #[arg(long, default_value = "5m", value_parser = warren::retry::parse_delay)]
        max_fault_time: Duration,
        /// Publish at most this many messages per second, e.g. 100/s, so the
        /// stream flows for a while under faults [default: as fast as possible].
        #[arg(long, value_parser = parse_rate)]
        publish_rate: Option<f64>,
        /// Keep the campaign's queues and database.
        #[arg(long)]
        keep: bool,
    },
    /// Measure warren against a bare consumer and the hand-written pattern, on
    /// PostgreSQL and SQLite, in one run; prints rates and their ratios.
    Bench {
        /// Messages per workload.
        #[arg(long, default_value_t = 20_000)]
        messages: usize,
        /// PostgreSQL server to make a schema of its own on. The default asks
        /// for no TLS: to a database on the same host it only costs CPU, the
        /// same in every row but the bare drain's (say `sslmode=require` to
        /// measure with it).
        #[arg(
            long,
            default_value = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
        )]
        postgres_url: String,
        /// Databases to run on: postgres, sqlite, or both.
        #[arg(long, value_delimiter = ',', default_value = "postgres,sqlite")]
        databases: Vec<String>,
        /// How long the latency run publishes at half of row 4's rate.
        #[arg(long, default_value = "10s", value_parser = warren::retry::parse_delay)]
        latency_period: Duration,
        /// Fail if warren's one-insert consumer falls below half its goal
        /// ratio of the bare drain (0.3 on PostgreSQL, 0.2 on SQLite).
        #[arg(long)]
        check: bool,
        /// Fail if warren's one-insert consumer is not at least this many
        /// times as fast as the seed pattern by hand (e.g. 1.3).
        #[arg(long)]
        min_over_seed: Option<f64>,
        /// Repeat rows 3 and 4 with this many rows in the inbox, and time the
        /// purge of a million expired ones (e.g. 10000000) [default: skip].
        #[arg(long, default_value_t = 0)]
        inbox_rows: u64,
        /// Run row 4 over a grid of prefetch, concurrency and batch size.
        #[arg(long)]
        sweep: bool,
        /// Rows to run besides the bare drain (row 1, every ratio's
        /// baseline, always runs): any of 2, 3, 4, 5, 6.
        #[arg(long, value_delimiter = ',', default_value = "2,3,4,5,6")]
        rows: Vec<u8>,
    },
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.strip_suffix("/s").unwrap_or(s).parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!(
            "{s:?} is not a rate: use a positive number per second, e.g. 100/s"
        )),
    }
}

impl Cli {
    /// Flags and variables over the file over the defaults, checked.
    fn resolve(&self) -> Result<Config, String> {
        let flags = config::Raw {
            amqp_url: self.amqp_url.clone(),
            amqp_ca_file: self.amqp_ca_file.clone(),
            amqp_client_cert: self.amqp_client_cert.clone(),
            amqp_client_key: self.amqp_client_key.clone(),
            database_url: self.database_url.clone(),
            prefix: self.prefix.clone(),
            http: self.http.clone(),
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            batch_size: self.batch_size,
            retry_tiers: self.retry_tiers.clone().map(|t| vec![t]),
            log_format: self.log_format.clone(),
            inbox_retention: self.inbox_retention.clone(),
            consumer_timeout: self.consumer_timeout.clone(),
            partitions: self.partitions,
            partition_lease: self.partition_lease.clone(),
        };
        let file = match &self.config {
            Some(path) => config::Raw::from_file(path)?,
            None => config::Raw::default(),
        };
        Config::resolve(flags.or(file))
    }
}

impl Config {
    fn settings(&self, default_tiers: RetryPolicy) -> Settings {
        let retry = match &self.retry_tiers {
            Some(tiers) => RetryPolicy::new(tiers.iter().copied()),
            None => default_tiers,
        };
        Settings {
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            batch_size: self.batch_size,
            retry,
            queue_type: QueueType::Quorum,
            consumer_timeout: self.consumer_timeout,
            tls: self.tls.clone(),
            partitions: self.partitions,
            partition_lease: self.partition_lease,
        }
    }

    fn database_url_or_default(&self) -> DatabaseUrl {
        self.database_url
            .clone()
            .unwrap_or_else(|| DatabaseUrl::Sqlite("sqlite://billing.db".into()))
    }

    fn names(&self) -> Names {
        Names::new(self.prefix.as_deref().unwrap_or("billing"))
    }
}

fn init_logging(format: Option<LogFormat>, default_level: &str) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // After RUST_LOG, so that no setting lets payloads into the logs.
    for directive in warren::telemetry::PAYLOAD_SAFE_LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse().expect("warren's directives parse"));
    }
    let json = match format {
        Some(LogFormat::Json) => true,
        Some(LogFormat::Text) => false,
        None => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// `billing bench`: warnings to stderr, and warren's per-message events to the
/// latency probe only.
fn init_bench_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, filter};
    let probe = bench::Probe(SETTLED.clone())
        .with_filter(filter::Targets::new().with_target("warren::telemetry", tracing::Level::INFO));
    // lapin reports the channels the clean-up closes on purpose; only warren's
    // and billing's own warnings are news.
    let warnings = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            filter::Targets::new()
                .with_target("warren", tracing::Level::WARN)
                // Row 6 dead-letters one message in fifty on purpose; the
                // per-message events go to the probe.
                .with_target(
                    "warren::pipeline::settle",
                    tracing::level_filters::LevelFilter::OFF,
                )
                .with_target(
                    "warren::telemetry",
                    tracing::level_filters::LevelFilter::OFF,
                )
                .with_target("billing", tracing::Level::WARN),
        );
    tracing_subscriber::registry()
        .with(probe)
        .with(warnings)
        .init();
}

/// Runs `$body` with `$B` bound to the database type of `$db` and `$store` to its store.
macro_rules! with_store {
    ($db:expr, |$store:ident: $B:ident| $body:expr) => {
        match $db {
            Database::Postgres($store) => {
                type $B = Postgres;
                $body
            }
            Database::Sqlite($store) => {
                type $B = Sqlite;
                $body
            }
            Database::MySql($store) => {
                type $B = sqlx::MySql;
                $body
            }
        }
    };
}

async fn open(url: &DatabaseUrl, schema: Option<&str>, pool: u32) -> Result<Database, String> {
    Database::open(url, schema, pool)
        .await
        .map_err(|e| format!("cannot open the database {}: {e}", url.redacted()))
}

/// The database pool: one connection per concurrent transaction, and a few for
/// the relay, the leases and the probes.
fn pool_size(concurrency: usize) -> u32 {
    u32::try_from(concurrency)
        .unwrap_or(u32::MAX)
        .saturating_add(4)
}

/// When each message settled, recorded during `billing bench`'s latency runs.
static SETTLED: std::sync::LazyLock<bench::Settled> = std::sync::LazyLock::new(Default::default);

async fn run(command: Command, cfg: Config) -> Result<bool, String> {
    let cli = &cfg;
    let pool = pool_size(cli.concurrency);
    match &command {
        Command::Run => {
            // Installed before anything else, so a SIGTERM during start-up drains.
            let signal = warren::shutdown_signal();
            let settings = cli.settings(RetryPolicy::default());
            let names = cli.names();
            let db = open(&cli.database_url_or_default(), None, pool).await?;
            with_store!(db, |store: B| {
                service::run::<B>(
                    store,
                    &cli.amqp_url,
                    &names,
                    &settings,
                    cli.http,
                    cli.inbox_retention,
                    signal,
                )
                .await?;
            });
            Ok(true)
        }
        Command::Publish {
            count,
            duplicates,
            v2,
            poison,
            flaky,
            seed,
        } => {
            let settings = cli.settings(RetryPolicy::default());
            let names = cli.names();
            let spec = StreamSpec {
                count: *count,
                duplicates: *duplicates,
                v2: *v2,
                poison: *poison,
                flaky: *flaky,
                seed: seed.unwrap_or_else(|| fastrand::u64(..)),
            };
            spec.validate()?;
            service::declare(&cli.amqp_url, &names, &settings).await?;
            let plan = stream::plan(&spec);
            let connection = Arc::new(
                warren::broker::connect_with_tls(&cli.amqp_url, "billing publish", &cli.tls)
                    .await
                    .map_err(|e| e.to_string())?,
            );
            stream::publish(Arc::clone(&connection), &names.exchange(), &plan).await?;
            let _ = connection.close(200, "published".into()).await;
            let e = &plan.expected;
            println!(
                "published {} deliveries to {}",
                e.published,
                names.exchange()
            );
            println!("  unique      {}", e.unique);
            println!(
                "  valid       {} ({} v1, {} v2, {} flaky)",
                e.valid,
                e.valid - e.v2,
                e.v2,
                e.flaky
            );
            println!("  duplicates  {}", e.duplicates);
            println!("  poison      {}", e.poison.values().sum::<usize>());
            for (reason, n) in &e.poison {
                println!("    {reason:<24} {n}");
            }
            println!("  loyalty points expected  {}", e.loyalty_sum);
            println!("  seed        {}", spec.seed);
            Ok(true)
        }
        Command::Status => {
            let names = cli.names();
            let url = cli.database_url_or_default();
            if let DatabaseUrl::Sqlite(u) = &url {
                let path = u
                    .trim_start_matches("sqlite://")
                    .trim_start_matches("sqlite:");
                if !std::path::Path::new(path).exists() {
                    return Err(format!("no database at {path} (--database-url)"));
                }
            }
            let db = open(&url, None, 2).await?;
            let connection = Arc::new(
                warren::broker::connect_with_tls(&cli.amqp_url, "billing status", &cli.tls)
                    .await
                    .map_err(|e| e.to_string())?,
            );
            let report = with_store!(db, |store: B| {
                status::gather::<B>(&store, &connection, &names).await?
            });
            status::print(&report);
            Ok(true)
        }
        Command::Demo { count, keep } => demo_command(cli, *count, *keep, pool).await,
        Command::Bench {
            messages,
            postgres_url,
            databases,
            latency_period,
            check,
            min_over_seed,
            inbox_rows,
            sweep,
            rows,
        } => {
            if let Some(bad) = rows.iter().find(|r| !(1..=6).contains(*r)) {
                return Err(format!("--rows: {bad} is not a row; the rows are 1 to 6"));
            }
            let has = |r: u8| rows.contains(&r);
            if has(6) && !has(3) {
                return Err("row 6 is measured against row 3: add 3 to --rows".into());
            }
            if *check && !has(3) {
                return Err("--check judges row 3: add 3 to --rows".into());
            }
            if min_over_seed.is_some() && !(has(2) && has(3)) {
                return Err("--min-over-seed compares rows 3 and 2: add both to --rows".into());
            }
            if (*inbox_rows > 0 || *sweep) && !(has(3) && has(4)) {
                return Err(
                    "--inbox-rows and --sweep build on rows 3 and 4: add both to --rows".into(),
                );
            }
            if *messages < 100 {
                return Err(format!("--messages must be at least 100, got {messages}"));
            }
            for d in databases {
                if d != "postgres" && d != "sqlite" {
                    return Err(format!("--databases: {d:?} is not postgres or sqlite"));
                }
            }
            let spec = bench::BenchSpec {
                messages: *messages,
                postgres: databases
                    .iter()
                    .any(|d| d == "postgres")
                    .then(|| postgres_url.clone()),
                sqlite: databases.iter().any(|d| d == "sqlite"),
                latency_period: *latency_period,
                check: *check,
                min_over_seed: *min_over_seed,
                inbox_rows: *inbox_rows,
                sweep: *sweep,
                rows: rows.clone(),
            };
            bench::run(cli, &spec, &SETTLED).await
        }
        Command::Chaos {
            count,
            processes,
            seed,
            fault_interval,
            crash_probability,
            no_broker_restarts,
            max_fault_time,
            publish_rate,
            keep,
        } => {
            if *processes == 0 || *count == 0 {
                return Err("--processes and --count must be at least 1".into());
            }
            if !(0.0..=1.0).contains(crash_probability) {
                return Err(format!(
                    "--crash-probability is from 0 to 1, got {crash_probability}"
                ));
            }
            let mut mix = warren_chaos::FaultMix {
                mean_interval: *fault_interval,
                crash_probability: *crash_probability,
                ..warren_chaos::FaultMix::default()
            };
            if *no_broker_restarts {
                mix.weights[4] = 0;
            }
            let spec = chaos::ChaosSpec {
                count: *count,
                processes: *processes,
                seed: seed.unwrap_or_else(|| fastrand::u64(..)),
                mix,
                max_fault_time: *max_fault_time,
                drain_deadline: Duration::from_secs(300),
                publish_rate: *publish_rate,
            };
            chaos_command(cli, &spec, *keep, pool).await
        }
    }
}

async fn demo_command(cli: &Config, count: usize, keep: bool, pool: u32) -> Result<bool, String> {
    let settings = cli.settings(demo::demo_settings(cli.prefetch, cli.concurrency).retry);
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
        seed: fastrand::u64(..),
    };
    spec.validate()?;

    let fresh = fresh_database(cli, tag, pool).await?;
    let (db, schema, temp) = (fresh.db, fresh.schema, fresh.temp);
    let passed = with_store!(db, |store: B| {
        let passed = demo::run::<B>(store.clone(), &cli.amqp_url, &names, &settings, &spec).await;
        if !keep {
            B::pool(&store).close().await;
        }
        passed
    });
    if keep {
        println!("kept: prefix {:?}, database as above", names.prefix);
    } else {
        teardown(cli, &names, &settings, schema.as_deref()).await;
        let _ = std::fs::remove_dir_all(&temp);
    }
    passed
}

/// A database with nothing in it: a temporary SQLite file, a schema of its own
/// on PostgreSQL, or a database of its own on MySQL.
struct Fresh {
    db: Database,
    /// A URL other processes can open the same database with.
    url: String,
    schema: Option<String>,
    temp: std::path::PathBuf,
}

async fn fresh_database(cli: &Config, tag: &str, pool: u32) -> Result<Fresh, String> {
    let temp = tempdir()?;
    match &cli.database_url {
        None => {
            let path = temp.join("billing.db");
            let url = format!("sqlite://{}", path.display());
            println!("database: SQLite {}", path.display());
            let db = open(&DatabaseUrl::Sqlite(url.clone()), None, pool).await?;
            Ok(Fresh {
                db,
                url,
                schema: None,
                temp,
            })
        }
        Some(url @ DatabaseUrl::Postgres(u)) => {
            let schema = format!("billing_{tag}");
            create_schema(url, &schema).await?;
            println!("database: PostgreSQL {} (schema {schema})", url.redacted());
            let db = open(url, Some(&schema), pool).await?;
            let sep = if u.contains('?') { '&' } else { '?' };
            let child = format!("{u}{sep}options=-c%20search_path%3D{schema}");
            Ok(Fresh {
                db,
                url: child,
                schema: Some(schema),
                temp,
            })
        }
        Some(url @ DatabaseUrl::MySql(u)) => {
            let name = format!("billing_{tag}");
            let child = db::mysql::with_database(u, &name);
            let options = warren::MySqlStore::options(&child).map_err(|e| e.to_string())?;
            db::mysql::create_database(&options, &name)
                .await
                .map_err(|e| format!("cannot create database {name}: {e}"))?;
            println!("database: MySQL {} (database {name})", url.redacted());
            let db = open(&DatabaseUrl::MySql(child.clone()), None, pool).await?;
            Ok(Fresh {
                db,
                url: child,
                schema: Some(name),
                temp,
            })
        }
        Some(url) => {
            println!("database: {}", url.redacted());
            let db = open(url, None, pool).await?;
            Ok(Fresh {
                db,
                url: url.as_str().to_owned(),
                schema: None,
                temp,
            })
        }
    }
}

async fn chaos_command(
    cli: &Config,
    spec: &chaos::ChaosSpec,
    keep: bool,
    pool: u32,
) -> Result<bool, String> {
    let tag = &uuid::Uuid::now_v7().simple().to_string()[26..];
    let names = Names::new(
        &cli.prefix
            .clone()
            .unwrap_or_else(|| format!("billing-chaos-{tag}")),
    );
    let mut tiers = RetryPolicy::new(
        chaos::TIERS
            .split(',')
            .map(|t| warren::retry::parse_delay(t).expect("valid tiers")),
    );
    // The retry policy must match the processes' (the topology is derived from it).
    tiers = tiers.with_poison_limit(warren::retry::DEFAULT_POISON_LIMIT);
    let settings = Settings {
        retry: tiers.clone(),
        ..cli.settings(tiers)
    };
    let fresh = fresh_database(cli, &format!("chaos_{tag}"), pool).await?;
    let url = fresh.url.clone();
    let passed = with_store!(fresh.db, |store: B| {
        let passed =
            chaos::run::<B>(store.clone(), url, &cli.amqp_url, &names, &settings, spec).await;
        if !keep {
            B::pool(&store).close().await;
        }
        passed
    });
    if keep {
        println!(
            "kept: prefix {:?}, database {}",
            names.prefix,
            warren::admin::redact_url(&fresh.url)
        );
    } else {
        teardown(cli, &names, &settings, fresh.schema.as_deref()).await;
        let _ = std::fs::remove_dir_all(&fresh.temp);
    }
    passed
}

fn tempdir() -> Result<std::path::PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("billing-demo-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

async fn create_schema(url: &DatabaseUrl, schema: &str) -> Result<(), String> {
    let options = warren::PgStore::options(url.as_str()).map_err(|e| e.to_string())?;
    let pool = sqlx::PgPool::connect_with(options)
        .await
        .map_err(|e| format!("cannot open {}: {e}", url.redacted()))?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&pool)
        .await
        .map_err(|e| format!("cannot create schema {schema}: {e}"))?;
    pool.close().await;
    Ok(())
}

/// Removes what the demo created: its queues and exchange, and its schema.
async fn drop_schema(url: &DatabaseUrl, schema: &str) {
    if let Ok(options) = warren::PgStore::options(url.as_str())
        && let Ok(pool) = sqlx::PgPool::connect_with(options).await
    {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&pool)
            .await;
        pool.close().await;
    }
}

async fn teardown(cli: &Config, names: &Names, settings: &Settings, schema: Option<&str>) {
    if let Ok(connection) =
        warren::broker::connect_with_tls(&cli.amqp_url, "billing demo teardown", &cli.tls).await
    {
        if let Ok(topology) = service::topology(names, settings) {
            let _ = warren::broker::delete(&connection, &topology).await;
        }
        if let Ok(topology) = service::credit_topology(names, settings) {
            let _ = warren::broker::delete(&connection, &topology).await;
        }
        let _ = connection.close(200, "done".into()).await;
    }
    if let (Some(name), Some(DatabaseUrl::MySql(url))) = (schema, &cli.database_url) {
        let _ = db::mysql::drop_database(url, name).await;
        return;
    }
    if let (Some(schema), Some(url)) = (schema, &cli.database_url) {
        drop_schema(url, schema).await;
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Every setting is checked before any command touches anything.
    let cfg = match cli.resolve() {
        Ok(c) => c,
        Err(message) => {
            eprintln!("billing: {message}");
            return ExitCode::from(2);
        }
    };
    let level = match cli.command {
        Command::Run => "info",
        // The demo's output is its progress and its table; warren's per-message
        // logs (RUST_LOG=warren=info) would drown them.
        Command::Demo { .. } | Command::Chaos { .. } => "off",
        _ => "warn",
    };
    if let Command::Bench { .. } = cli.command {
        init_bench_logging();
    } else {
        init_logging(cfg.log_format, level);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("billing: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command, cfg)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("billing: {message}");
            ExitCode::FAILURE
        }
    }
}
