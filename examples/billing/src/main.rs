//! `billing`: warren's reference service. It records paid invoices and credits
//! loyalty points from `billing.invoice-paid` events, once per event however
//! often it arrives, and announces each recorded payment through its outbox.
#![allow(clippy::print_stdout, clippy::print_stderr)] // a command-line program
// A binary: `pub` marks what a module offers the rest of the program.
#![allow(unreachable_pub)]

mod demo;
mod downstream;
mod status;

use billing_rig::{bench, chaos};
use billing_service::{config, db, service, stream};

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use warren::retry::RetryPolicy;
use warren_admin::DatabaseUrl;

use billing_service::config::{Config, LogFormat};
use billing_service::stream::StreamSpec;

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
    // The defaults of these three are warren's, written into their help by
    // `command()`: a number copied here would go stale (it did once).
    /// Unacknowledged deliveries the broker may push to this process.
    #[arg(long, env = "BILLING_PREFETCH", global = true)]
    prefetch: Option<u16>,
    /// Batches (database transactions) processed at once.
    #[arg(long, env = "BILLING_CONCURRENCY", global = true)]
    concurrency: Option<usize>,
    /// Deliveries already buffered that are applied in one transaction, at
    /// most; 1 turns batching off.
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
    /// Move dead letters into the database as they come, for `warren
    /// dead-letters` to group, search and replay: on or off [default: on].
    #[arg(long, env = "BILLING_DEAD_LETTER_STORE", global = true)]
    dead_letter_store: Option<String>,
    /// Payload fields to redact before a dead letter is stored, comma
    /// separated (dotted paths into the payload) [default: none].
    #[arg(long, env = "BILLING_DEAD_LETTER_REDACT", global = true)]
    dead_letter_redact: Option<String>,
    /// Serve the web console on the dead-letter store at this address (e.g.
    /// 127.0.0.1:8088) while `run` runs [default: off]. See docs/console.md.
    #[arg(long, env = "BILLING_CONSOLE", global = true)]
    console: Option<String>,
    /// The console's file of operators' tokens, one `NAME TOKEN` per line.
    #[arg(long, env = "BILLING_CONSOLE_TOKENS", global = true)]
    console_tokens: Option<String>,
    /// On loopback without tokens: the operator the console's actions are
    /// audited under.
    #[arg(long, env = "BILLING_CONSOLE_OPERATOR", global = true)]
    console_operator: Option<String>,
    /// Payload fields the console masks until an operator asks, comma
    /// separated.
    #[arg(long, env = "BILLING_CONSOLE_MASK", global = true)]
    console_mask: Option<String>,
    /// A PEM certificate chain the console serves HTTPS with itself; needs
    /// --console-tls-key. Off loopback the console needs TLS: this, or
    /// --console-behind-proxy.
    #[arg(long, env = "BILLING_CONSOLE_TLS_CERT", global = true)]
    console_tls_cert: Option<String>,
    /// The PEM private key of --console-tls-cert.
    #[arg(long, env = "BILLING_CONSOLE_TLS_KEY", global = true)]
    console_tls_key: Option<String>,
    /// Names the reverse proxy that terminates TLS in front of the console.
    #[arg(long, env = "BILLING_CONSOLE_BEHIND_PROXY", global = true)]
    console_behind_proxy: Option<String>,
    /// The header that proxy sets to the operator's name (needs
    /// --console-behind-proxy).
    #[arg(long, env = "BILLING_CONSOLE_IDENTITY_HEADER", global = true)]
    console_identity_header: Option<String>,
    /// The broker's management HTTP API, for the checks at start
    /// (http://user:pass@host:15672; a user tagged monitoring will do)
    /// [default: port 15672 of the AMQP host, with the AMQP credentials].
    #[arg(
        long,
        env = "BILLING_MANAGEMENT_URL",
        global = true,
        hide_env_values = true
    )]
    management_url: Option<String>,
    /// The rabbitmqctl to read the node's consumer_timeout and
    /// max_message_size with at start, on the broker's host [default: not run].
    #[arg(long, env = "BILLING_RABBITMQCTL", global = true)]
    rabbitmqctl: Option<String>,
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
        /// Poison messages (cut-off JSON, unknown version, negative amount,
        /// unsupported currency, unknown type, in turn).
        #[arg(long, default_value_t = 0)]
        poison: usize,
        /// Share of valid messages published as producers that are not
        /// warren would (CloudEvents structured and binary, bare payloads
        /// with and without an id, in turn), 0 to 1.
        #[arg(long, default_value_t = 0.0)]
        foreign: f64,
        /// Messages from flaky customers, which fail twice before succeeding.
        #[arg(long, default_value_t = 0)]
        flaky: usize,
        /// Seed of the random choices [default: random].
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Counts from the database and the queues.
    Status,
    /// Stand in for the service downstream of billing: consume the
    /// invoice-payment-recorded events from `P.downstream` into the inbox of
    /// the database given, until SIGTERM or SIGINT.
    Downstream,
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
        /// Instead of the random faults, one fault of a RabbitMQ cluster once
        /// the stream flows: leader-stop, leader-kill, rolling-restart,
        /// leader-wipe or leader-partition, aimed at the node that leads
        /// --cluster-target's queue. Needs the cluster's control script
        /// (WARREN_CLUSTER_SCRIPT, as `.ci/cluster env` prints) and
        /// --amqp-url listing its nodes; each process gets the list turned
        /// so that they connect to different nodes first.
        #[arg(long)]
        cluster_fault: Option<warren_chaos::ClusterFault>,
        /// Whose queue's leader the cluster fault hits: invoices
        /// (P.invoice-paid), credit (P.customer-credit.0) or events (the
        /// queue billing's relay publishes to).
        #[arg(long, default_value = "invoices")]
        cluster_target: chaos::FaultTarget,
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
        /// baseline, always runs): any of 2, 3 (with 3b), 4, 5, 6, 7, 8.
        #[arg(long, value_delimiter = ',', default_value = "2,3,4,5,6,7,8")]
        rows: Vec<u8>,
        /// After the rows on PostgreSQL, run rows 3, 3b and 4 again with
        /// their broker and database connections through counting proxies,
        /// print the statements, round trips and ack frames they took, and
        /// fail if they exceed what the README says.
        #[arg(long)]
        counts: bool,
        /// Write flamegraphs of this process during rows 3, 3b and 4 into
        /// this folder (a build with `--features profile`).
        #[arg(long)]
        profile: Option<std::path::PathBuf>,
        /// After the rows on PostgreSQL, run row 4 with this many billing
        /// instances side by side, for each count given (e.g. 1,2,4), and
        /// print each count's rate against the first.
        #[arg(long, value_delimiter = ',')]
        instances: Vec<usize>,
        /// Count the CPU of these RabbitMQ nodes' VMs as the broker's (e.g.
        /// the cluster's rabbit@wrn1,rabbit@wrn2,rabbit@wrn3) [default: the
        /// node in this network namespace].
        #[arg(long, value_delimiter = ',')]
        broker_nodes: Vec<String>,
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
            dead_letter_store: self.dead_letter_store.clone(),
            dead_letter_redact: self.dead_letter_redact.clone().map(|r| vec![r]),
            console: self.console.clone(),
            console_tokens: self.console_tokens.clone(),
            console_operator: self.console_operator.clone(),
            console_mask: self.console_mask.clone().map(|m| vec![m]),
            console_tls_cert: self.console_tls_cert.clone(),
            console_tls_key: self.console_tls_key.clone(),
            console_behind_proxy: self.console_behind_proxy.clone(),
            console_identity_header: self.console_identity_header.clone(),
            management_url: self.management_url.clone(),
            rabbitmqctl: self.rabbitmqctl.clone(),
        };
        let file = match &self.config {
            Some(path) => config::Raw::from_file(path)?,
            None => config::Raw::default(),
        };
        Config::resolve(flags.or(file))
    }
}

/// Logs to stderr, and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and
/// billing is built with its default `otel` feature), warren's spans over
/// OTLP/HTTP. The spans stay out of the log lines, which carry the same ids.
fn init_logging(format: Option<LogFormat>, default_level: &str) -> Result<Option<Otel>, String> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // After RUST_LOG, so that no setting lets payloads into the logs.
    for directive in warren::telemetry::PAYLOAD_SAFE_LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse().expect("warren's directives parse"));
    }
    let spans_off = format!("{}=off", warren::telemetry::SPAN_TARGET);
    filter = filter.add_directive(spans_off.parse().expect("a valid directive"));
    let json = match format {
        Some(LogFormat::Json) => true,
        Some(LogFormat::Text) => false,
        None => !std::io::stderr().is_terminal(),
    };
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let otel = otel_from_env()?;
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel.as_ref().map(otel_layer))
        .init();
    Ok(otel)
}

#[cfg(feature = "otel")]
type Otel = warren::otel::Otel;

#[cfg(feature = "otel")]
fn otel_from_env() -> Result<Option<Otel>, String> {
    Otel::from_env("billing")
}

#[cfg(feature = "otel")]
fn otel_layer<S>(otel: &Otel) -> impl tracing_subscriber::Layer<S> + use<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    otel.layer()
}

/// Built without the `otel` feature: the variable is refused rather than
/// ignored, so that nobody waits for traces that never come.
#[cfg(not(feature = "otel"))]
enum Otel {}

#[cfg(not(feature = "otel"))]
fn otel_from_env() -> Result<Option<Otel>, String> {
    match std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT") {
        Ok(v) if !v.trim().is_empty() => Err(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set, but this billing is built without the otel feature"
                .into(),
        ),
        _ => Ok(None),
    }
}

#[cfg(not(feature = "otel"))]
fn otel_layer(otel: &Otel) -> tracing_subscriber::layer::Identity {
    match *otel {}
}

/// `billing bench`: warnings to stderr, warren's per-message events to the
/// latency probe only, and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set,
/// warren's spans exported (the benchmark's "tracing on";
/// `benches/otel_overhead.sh` compares it with tracing off and with a build
/// without the `otel` feature).
fn init_bench_logging() -> Result<Option<Otel>, String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, filter, reload};
    // Off until a row turns them on (bench::probe::LogSwitches).
    let per_message = |on: bool| match on {
        true => filter::Targets::new().with_target("warren::telemetry", tracing::Level::TRACE),
        false => filter::Targets::new(),
    };
    let (probe_filter, probe_switch) = reload::Layer::new(per_message(false));
    let probe = bench::Probe(SETTLED.clone()).with_filter(probe_filter);
    let (lines_filter, lines_switch) = reload::Layer::new(per_message(false));
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .map_err(|e| format!("cannot open /dev/null: {e}"))?;
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::sync::Mutex::new(null))
        .with_ansi(false)
        .with_filter(lines_filter);
    bench::install_switches(bench::LogSwitches {
        probe: Box::new(move |on| {
            let _ = probe_switch.reload(per_message(on));
        }),
        lines: Box::new(move |on| {
            let _ = lines_switch.reload(per_message(on));
        }),
    });
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
    let otel = otel_from_env()?;
    tracing_subscriber::registry()
        .with(probe)
        .with(lines)
        .with(warnings)
        .with(otel.as_ref().map(otel_layer))
        .init();
    Ok(otel)
}

/// Binds the console (failing at once, saying what to fix) and serves it
/// beside the service until the task is aborted.
async fn start_console<S: warren_console::ConsoleStore>(
    config: warren_console::ConsoleConfig,
    store: S,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let console = warren_console::Console::bind(config)
        .await
        .map_err(|e| format!("console: {e}"))?;
    let url = console.url()?;
    tracing::info!(url = %url, "console listening");
    Ok(tokio::spawn(async move {
        if let Err(e) = console.serve(store, std::future::pending()).await {
            tracing::error!(error = %e, "the console stopped");
        }
    }))
}

/// When each message settled, recorded during `billing bench`'s latency runs.
static SETTLED: std::sync::LazyLock<bench::Settled> = std::sync::LazyLock::new(Default::default);

async fn run(command: Command, cfg: Config) -> Result<bool, String> {
    let cli = &cfg;
    let pool = db::pool_size(cli.concurrency);
    match &command {
        Command::Run => {
            // Installed before anything else, so a SIGTERM during start-up drains.
            let signal = warren::shutdown_signal();
            let settings = cli.settings(RetryPolicy::default());
            let names = cli.names();
            let db = db::open(&cli.database_url_or_default(), None, pool).await?;
            db::with_store!(db, |store: B| {
                let console = match &cli.console {
                    Some(config) => Some(start_console(config.clone(), store.clone()).await?),
                    None => None,
                };
                let ran = service::run::<B>(
                    store,
                    &cli.amqp_url,
                    &names,
                    &settings,
                    cli.http,
                    cli.inbox_retention,
                    signal,
                )
                .await;
                if let Some(console) = console {
                    console.abort();
                }
                ran?;
            });
            Ok(true)
        }
        Command::Publish {
            count,
            duplicates,
            v2,
            poison,
            foreign,
            flaky,
            seed,
        } => {
            let settings = cli.settings(RetryPolicy::default());
            let names = cli.names();
            let spec = StreamSpec {
                count: *count,
                duplicates: *duplicates,
                v2: *v2,
                foreign: *foreign,
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
        Command::Downstream => {
            let signal = warren::shutdown_signal();
            let settings = cli.settings(RetryPolicy::default());
            let db = db::open(&cli.database_url_or_default(), None, pool).await?;
            db::with_store!(db, |store: B| {
                downstream::run::<<B as db::BillingDb>::S>(
                    store,
                    &cli.amqp_url,
                    &cli.names(),
                    &settings,
                    signal,
                )
                .await?;
            });
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
            let db = db::open(&url, None, 2).await?;
            let connection = Arc::new(
                warren::broker::connect_with_tls(&cli.amqp_url, "billing status", &cli.tls)
                    .await
                    .map_err(|e| e.to_string())?,
            );
            let source = if cli.dead_letter_store {
                status::DeadLetterSource::Table
            } else {
                status::DeadLetterSource::QueueDepth
            };
            let report = db::with_store!(db, |store: B| {
                status::gather::<B>(&store, &connection, &names, source).await?
            });
            status::print(&report);
            Ok(true)
        }
        Command::Demo { count, keep } => demo::command(cli, *count, *keep, pool).await,
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
            counts,
            profile,
            instances,
            broker_nodes,
        } => {
            if let Some(bad) = rows.iter().find(|r| !(1..=8).contains(*r)) {
                return Err(format!("--rows: {bad} is not a row; the rows are 1 to 8"));
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
            if let Some(dir) = profile {
                std::fs::create_dir_all(dir)
                    .map_err(|e| format!("--profile {}: {e}", dir.display()))?;
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
                counts: *counts,
                profile: profile.clone(),
                instances: instances.clone(),
            };
            if instances.contains(&0) {
                return Err("--instances counts instances: each at least 1".into());
            }
            if !broker_nodes.is_empty() {
                bench::count_broker_nodes(broker_nodes.clone());
            }
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
            cluster_fault,
            cluster_target,
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
            let cluster = match cluster_fault {
                None => None,
                Some(fault) => {
                    // The cluster's fault alone: no process is killed and
                    // no crash point armed, so what the report shows is
                    // the failover's doing.
                    mix.weights = [0; 5];
                    mix.armed_throughout = false;
                    let cluster = warren_chaos::Cluster::from_env().ok_or(
                        "--cluster-fault drives the cluster through its control script: set \
                         WARREN_CLUSTER_SCRIPT (eval \"$(.ci/cluster env)\" after .ci/cluster up)",
                    )?;
                    Some((cluster, *fault, *cluster_target))
                }
            };
            let spec = chaos::ChaosSpec {
                count: *count,
                processes: *processes,
                seed: seed.unwrap_or_else(|| fastrand::u64(..)),
                mix,
                max_fault_time: *max_fault_time,
                drain_deadline: Duration::from_secs(300),
                publish_rate: *publish_rate,
                cluster,
            };
            chaos::command(cli, &spec, *keep, pool).await
        }
    }
}

/// The command line, its defaults taken from warren's constants.
fn command() -> clap::Command {
    use warren::config::{DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY, DEFAULT_PREFETCH};
    let with_default = |arg: clap::Arg, default: String| {
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        arg.help(format!("{help} [default: {default}]"))
    };
    Cli::command()
        .mut_arg("prefetch", |a| {
            with_default(a, DEFAULT_PREFETCH.to_string())
        })
        .mut_arg("concurrency", |a| {
            with_default(a, DEFAULT_CONCURRENCY.to_string())
        })
        .mut_arg("batch_size", |a| {
            with_default(a, DEFAULT_BATCH_SIZE.to_string())
        })
}

fn main() -> ExitCode {
    let cli = match Cli::from_arg_matches(&command().get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // Every setting is checked before any command touches anything.
    let cfg = match cli.resolve() {
        Ok(c) => c,
        Err(message) => {
            eprintln!("billing: {message}");
            return ExitCode::from(2);
        }
    };
    let level = match cli.command {
        Command::Run | Command::Downstream => warren::telemetry::DEFAULT_LOG_FILTER,
        // The demo's output is its progress and its table; warren's per-message
        // logs (RUST_LOG=warren=info) would drown them.
        Command::Demo { .. } | Command::Chaos { .. } => "off",
        _ => "warn,lapin=off",
    };
    // Kept until the end of main: dropping it exports the spans still
    // buffered.
    let logging = if let Command::Bench { .. } = cli.command {
        init_bench_logging()
    } else {
        init_logging(cfg.log_format, level)
    };
    let _otel = match logging {
        Ok(otel) => otel,
        Err(message) => {
            eprintln!("billing: {message}");
            return ExitCode::from(2);
        }
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_states_the_library_defaults() {
        let mut cli = command();
        cli.build();
        for sub in ["run", "bench"] {
            let help = cli
                .find_subcommand_mut(sub)
                .unwrap()
                .render_long_help()
                .to_string();
            for (flag, default) in [
                ("--prefetch", warren::config::DEFAULT_PREFETCH.to_string()),
                (
                    "--concurrency",
                    warren::config::DEFAULT_CONCURRENCY.to_string(),
                ),
                (
                    "--batch-size",
                    warren::config::DEFAULT_BATCH_SIZE.to_string(),
                ),
            ] {
                let at = help.find(&format!("{flag} <")).unwrap();
                let entry = &help[at..];
                let entry = &entry[..entry.find("\n      --").unwrap_or(entry.len())];
                assert!(
                    entry.contains(&format!("[default: {default}]")),
                    "billing {sub} --help, {flag}: {entry}"
                );
            }
        }
    }
}
