//! `warren`: the operator's tool. Declares and shows a consumer's topology; lists,
//! shows, replays and purges its dead letters; shows and mends its outbox.
#![allow(clippy::print_stdout, clippy::print_stderr)] // printing is this program's job

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use warren::admin::DeadLetterQueue;
use warren::admin::{DatabaseUrl, DeadLetter, Selection, printable};
use warren::lapin;
use warren::retry::DEFAULT_POISON_LIMIT;
use warren::retry::RetryPolicy;
use warren::store::OutboxStore;
use warren::topology::QueueType;
use warren::topology::Topology;
use warren::{ConsumerConfig, PgStore, SqliteStore};

const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Operate warren consumers: topology and dead letters.
#[derive(Parser)]
#[command(name = "warren", version, about)]
struct Cli {
    /// Broker URL. The password is never printed.
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL, global = true, hide_env_values = true)]
    amqp_url: String,
    /// PEM file of the CA that signed the broker's certificate (amqps://), trusted
    /// besides the bundled public roots.
    #[arg(long, env = "AMQP_CA_FILE", global = true)]
    amqp_ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate to present (amqps://); needs --amqp-client-key.
    #[arg(long, env = "AMQP_CLIENT_CERT", global = true)]
    amqp_client_cert: Option<std::path::PathBuf>,
    /// PEM private key of --amqp-client-cert.
    #[arg(long, env = "AMQP_CLIENT_KEY", global = true)]
    amqp_client_key: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// The TLS flags, checked; an error names the flag.
    fn tls(&self) -> Result<warren::tls::TlsOptions, String> {
        let tls = warren::tls::TlsOptions {
            ca_file: self.amqp_ca_file.clone(),
            client_cert: self.amqp_client_cert.clone(),
            client_key: self.amqp_client_key.clone(),
        };
        tls.validate().map_err(|e| {
            e.with_option_names("--amqp-ca-file", "--amqp-client-cert", "--amqp-client-key")
                .to_string()
        })?;
        Ok(tls)
    }
}

#[derive(Subcommand)]
enum Command {
    /// A consumer's exchanges, queues, retry tiers and dead-letter queue.
    #[command(subcommand)]
    Topology(TopologyCommand),
    /// A consumer's dead-letter queue (`QUEUE.dead-letter`).
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// The inbox in a database: retention.
    Inbox {
        /// postgres://..., mysql://... or sqlite://PATH. The password is never printed.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = DatabaseUrlParser)]
        database_url: DatabaseUrl,
        #[command(subcommand)]
        command: InboxCommand,
    },
    /// The transactional outbox in a database.
    Outbox {
        /// postgres://..., mysql://... or sqlite://PATH. The password is never printed.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = DatabaseUrlParser)]
        database_url: DatabaseUrl,
        #[command(subcommand)]
        command: OutboxCommand,
    },
}

#[derive(Subcommand)]
enum InboxCommand {
    /// Delete a consumer's inbox rows older than a window, in bounded batches.
    /// Refuses a window shorter than the consumer's retry horizon plus the replay
    /// margin: a copy arriving after its row is gone would be applied again.
    Purge {
        /// The consumer name.
        #[arg(long)]
        consumer: String,
        /// Keep rows younger than this, e.g. 30d.
        #[arg(long, value_parser = warren::retry::parse_delay)]
        older_than: Duration,
        /// The consumer's retry tiers, for its retry horizon.
        #[arg(long, value_delimiter = ',', default_value = "5s,30s,2m,10m,30m", value_parser = warren::retry::parse_delay)]
        retry_tiers: Vec<Duration>,
        /// The consumer's total attempts [default: one per tier, plus one].
        #[arg(long)]
        max_attempts: Option<u32>,
        /// Time to allow for replays and republishing on top of the horizon.
        #[arg(long, default_value = "7d", value_parser = warren::retry::parse_delay)]
        replay_margin: Duration,
        /// Purge even if the window is shorter than horizon plus margin.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// Pending rows, the oldest pending row's age, published rows, failed rows.
    Status {
        /// List at most this many failed rows (all are counted).
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Put failed rows back in line for the relay (all, or those given with --id).
    RetryFailed {
        /// Outbox row id (repeat for several); all failed rows when absent.
        #[arg(long = "id")]
        ids: Vec<i64>,
    },
}

/// Parses `--database-url` without echoing it: clap's usual error quotes the
/// value, and the value holds a password.
#[derive(Clone)]
struct DatabaseUrlParser;

impl clap::builder::TypedValueParser for DatabaseUrlParser {
    type Value = DatabaseUrl;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<DatabaseUrl, clap::Error> {
        let invalid = |why: String| {
            cmd.clone().error(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid --database-url: {why}"),
            )
        };
        value
            .to_str()
            .ok_or_else(|| invalid("not UTF-8".into()))?
            .parse::<DatabaseUrl>()
            .map_err(|e| invalid(e.reason().to_owned()))
    }
}

#[derive(Subcommand)]
enum TopologyCommand {
    /// Declare the topology on the broker (idempotent).
    Declare(ConsumerArgs),
    /// Print the topology without touching the broker.
    Show(ConsumerArgs),
}

/// The consumer definition the topology derives from; use the same values the
/// consumer runs with.
#[derive(Args)]
struct ConsumerArgs {
    /// The consumer's queue.
    #[arg(long)]
    queue: String,
    /// Topic exchange to bind the queue to.
    #[arg(long, requires = "binding_keys")]
    exchange: Option<String>,
    /// Binding key from the exchange (repeat for several).
    #[arg(long = "binding-key", requires = "exchange")]
    binding_keys: Vec<String>,
    /// Queue type: quorum or classic.
    #[arg(long, default_value = "quorum", value_parser = parse_queue_type)]
    queue_type: QueueType,
    /// Retry delay tiers, comma separated (ms, s, m, h).
    #[arg(long, value_delimiter = ',', default_value = "5s,30s,2m,10m,30m", value_parser = warren::retry::parse_delay)]
    retry_tiers: Vec<Duration>,
    /// Total attempts, the first included [default: one per tier, plus one].
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Deaths while a message ran alone before it is poison.
    #[arg(long, default_value_t = DEFAULT_POISON_LIMIT)]
    poison_limit: u32,
}

#[derive(Subcommand)]
enum DlqCommand {
    /// List dead letters: id, type, reason, attempts, failure times, error.
    List {
        /// The consumer's queue (not the dead-letter queue's name).
        queue: String,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print each payload too. Payloads may hold personal data.
        #[arg(long)]
        show_payload: bool,
    },
    /// Show one dead letter with all its headers.
    Show {
        /// The consumer's queue.
        queue: String,
        /// Message id.
        id: String,
        /// Print the payload too. Payloads may hold personal data.
        #[arg(long)]
        show_payload: bool,
    },
    /// Republish dead letters to the consumer's queue, each confirmed before it is
    /// removed. A replayed message that had already succeeded is acked by the
    /// consumer as a duplicate, so replaying twice is safe.
    Replay {
        /// The consumer's queue.
        queue: String,
        #[command(flatten)]
        which: Which,
        /// Only dead letters with this reason (e.g. retries-exhausted).
        #[arg(long)]
        reason: Option<String>,
        /// At most this many.
        #[arg(long)]
        limit: Option<usize>,
        /// At most this many per second, e.g. 50/s.
        #[arg(long, value_parser = parse_rate)]
        rate: Option<f64>,
        /// Say what would be replayed; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete dead letters for good.
    Purge {
        /// The consumer's queue.
        queue: String,
        #[command(flatten)]
        which: Which,
        /// Confirm: purged messages cannot be recovered.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
#[group(required = true, multiple = false)]
struct Which {
    /// This message id (repeat for several).
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Every dead letter (that matches the other filters).
    #[arg(long)]
    all: bool,
}

fn parse_queue_type(s: &str) -> Result<QueueType, String> {
    s.parse::<QueueType>().map_err(|e| e.reason().to_owned())
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let n = s.strip_suffix("/s").unwrap_or(s);
    match n.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!(
            "{s:?} is not a rate: use a positive number per second, e.g. 50/s"
        )),
    }
}

impl ConsumerArgs {
    fn config(&self) -> Result<ConsumerConfig, String> {
        let mut retry =
            RetryPolicy::new(self.retry_tiers.iter().copied()).with_poison_limit(self.poison_limit);
        if let Some(n) = self.max_attempts {
            retry = retry.with_max_attempts(n);
        }
        let mut config = ConsumerConfig::builder(&self.queue, &self.queue)
            .with_queue_type(self.queue_type)
            .with_retry(retry);
        if let Some(exchange) = &self.exchange {
            config = config.bind(exchange, self.binding_keys.iter().cloned());
        }
        config.build().map_err(|e| e.to_string())
    }
}

fn print_topology(t: &Topology) {
    for e in &t.exchanges {
        println!("exchange {} ({:?}, durable)", e.name, e.kind);
    }
    for q in &t.queues {
        let args: Vec<String> = q
            .arguments
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!("queue    {} (durable) {}", q.name, args.join(" "));
    }
    for b in &t.bindings {
        println!("binding  {} -> {} [{}]", b.exchange, b.queue, b.routing_key);
    }
}

fn time(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|| "-".into())
}

/// Message-derived text, escaped by [`warren::admin::printable`], cut to `max` characters.
fn one_line(s: &str, max: usize) -> String {
    let flat = printable(s);
    if flat.chars().count() <= max {
        flat.into_owned()
    } else {
        flat.chars()
            .take(max.saturating_sub(1))
            .chain(['…'])
            .collect()
    }
}

fn print_payload(letter: &DeadLetter) {
    println!(
        "  payload: {}",
        warren::admin::printable_bytes(&letter.body)
    );
}

/// A message id for display: escaped, `(none)` if empty.
fn id(message_id: &str) -> std::borrow::Cow<'_, str> {
    if message_id.is_empty() {
        "(none)".into()
    } else {
        printable(message_id)
    }
}

fn print_list(letters: &[DeadLetter], show_payload: bool) {
    println!(
        "{:<38} {:<32} {:<24} {:>8} {:<19} {:<19} ERROR",
        "ID", "TYPE", "REASON", "ATTEMPTS", "FIRST FAILURE", "LAST FAILURE"
    );
    for l in letters {
        let (attempts, first, last, error) = match &l.info {
            Some(i) => (
                i.attempts.to_string(),
                time(i.first_failure),
                time(i.last_failure),
                one_line(&i.error, 80),
            ),
            None => ("-".into(), "-".into(), "-".into(), String::new()),
        };
        println!(
            "{:<38} {:<32} {:<24} {:>8} {:<19} {:<19} {}",
            id(&l.message_id),
            one_line(&l.event_type, 32),
            one_line(l.reason(), 24),
            attempts,
            first,
            last,
            error
        );
        if let Some(p) = &l.pruned {
            println!("  headers pruned on reading: {}", one_line(&p.detail, 160));
        }
        if show_payload {
            print_payload(l);
        }
    }
    println!("{} dead letter(s)", letters.len());
}

fn print_one(l: &DeadLetter, show_payload: bool) {
    println!("message id: {}", id(&l.message_id));
    println!("type:       {}", printable(&l.event_type));
    println!("reason:     {}", printable(l.reason()));
    if let Some(i) = &l.info {
        println!("attempts:   {}", i.attempts);
        println!("consumer:   {}", printable(&i.consumer));
        println!("queue:      {}", printable(&i.queue));
        println!(
            "published:  exchange {}, routing key {}",
            printable(&format!("{:?}", i.original_exchange)),
            printable(&format!("{:?}", i.original_routing_key))
        );
        println!("first fail: {}", time(i.first_failure));
        println!("last fail:  {}", time(i.last_failure));
        println!("error:      {}", printable(&i.error));
    }
    if let Some(p) = &l.pruned {
        // Read through warren's frame guard: what it removed is not in the
        // headers below.
        println!(
            "pruned:     {} on reading: {}",
            p.cause,
            printable(&p.detail)
        );
        println!("removed:    {}", printable(&p.removed));
        println!("digest:     {}", printable(&p.digest));
    }
    if let Some(headers) = l.properties.headers() {
        println!("headers:");
        for (k, v) in headers.inner() {
            println!(
                "  {}: {}",
                printable(k.as_str()),
                printable(&format!("{v:?}"))
            );
        }
    }
    if show_payload {
        print_payload(l);
    }
}

/// Opens the store a URL names and runs `$body` with `$store` bound to it. A
/// missing SQLite file is an error here, not a new empty database.
macro_rules! with_store {
    ($url:expr, |$store:ident| $body:expr) => {{
        let url: &DatabaseUrl = $url;
        let fail = |e: warren::store::StoreError| format!("{}: {e}", url.redacted());
        match url {
            DatabaseUrl::Postgres(u) => {
                let $store = PgStore::connect(u, 2).await.map_err(fail)?;
                $body.await
            }
            DatabaseUrl::Sqlite(u) => {
                let path = u
                    .trim_start_matches("sqlite://")
                    .trim_start_matches("sqlite:");
                if !std::path::Path::new(path).exists() {
                    return Err(format!("no database at {path}"));
                }
                let $store = SqliteStore::connect(u).await.map_err(fail)?;
                $body.await
            }
            DatabaseUrl::MySql(u) => {
                let $store = warren::MySqlStore::connect(u, 2).await.map_err(fail)?;
                $body.await
            }
        }
    }};
}

async fn run(cli: Cli) -> Result<(), String> {
    let tls = cli.tls()?;
    let connect = || async {
        warren::broker::connect_with_tls(&cli.amqp_url, "warren cli", &tls)
            .await
            .map(Arc::new)
            .map_err(|e| format!("cannot connect to the broker: {e}"))
    };
    match cli.command {
        Command::Topology(TopologyCommand::Show(args)) => {
            print_topology(&Topology::for_consumer(&args.config()?));
        }
        Command::Topology(TopologyCommand::Declare(args)) => {
            let topology = Topology::for_consumer(&args.config()?);
            let connection = connect().await?;
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| e.to_string())?;
            warren::broker::declare(&channel, &topology)
                .await
                .map_err(|e| e.to_string())?;
            print_topology(&topology);
            println!("declared");
        }
        Command::Dlq(cmd) => {
            let connection = connect().await?;
            let done = run_dlq(cmd, &connection).await;
            // Bounded: a broker that never answers the close must not keep the
            // command from exiting once its work is done.
            let _ =
                tokio::time::timeout(Duration::from_secs(5), connection.close(200, "done".into()))
                    .await;
            done?;
        }
        Command::Outbox {
            database_url,
            command,
        } => with_store!(&database_url, |store| run_outbox(&store, command))?,
        Command::Inbox {
            database_url,
            command,
        } => with_store!(&database_url, |store| run_inbox(&store, command))?,
    }
    Ok(())
}

async fn run_inbox<S: warren::store::Retention>(
    store: &S,
    cmd: InboxCommand,
) -> Result<(), String> {
    let InboxCommand::Purge {
        consumer,
        older_than,
        retry_tiers,
        max_attempts,
        replay_margin,
        force,
    } = cmd;
    let mut policy = RetryPolicy::new(retry_tiers);
    if let Some(n) = max_attempts {
        policy = policy.with_max_attempts(n);
    }
    policy.validate().map_err(|e| e.to_string())?;
    if older_than > warren::admin::MAX_RETENTION {
        return Err(format!(
            "--older-than {} is longer than the most warren accepts ({}d)",
            warren::retry::format_delay(older_than),
            warren::admin::MAX_RETENTION.as_secs() / 86_400
        ));
    }
    if let Err(why) = warren::admin::check_window(older_than, &policy, replay_margin) {
        if !force {
            return Err(why);
        }
        eprintln!("warren: --force: {why}");
    }
    let deleted = warren::admin::purge_inbox(store, &consumer, older_than)
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "deleted {deleted} inbox row(s) of {consumer:?} older than {}",
        warren::retry::format_delay(older_than)
    );
    Ok(())
}

async fn run_outbox<S: OutboxStore>(store: &S, cmd: OutboxCommand) -> Result<(), String> {
    run_outbox_on(store, cmd).await.map_err(|e| e.to_string())
}

async fn run_outbox_on<S: OutboxStore>(
    store: &S,
    cmd: OutboxCommand,
) -> Result<(), warren::store::StoreError> {
    match cmd {
        OutboxCommand::Status { limit } => {
            let status = store.outbox_counts().await?;
            let failed = store.failed_outbox_rows(limit).await?;
            println!("pending:   {}", status.pending);
            println!(
                "oldest:    {}",
                match status.oldest_pending {
                    Some(t) => format!(
                        "{} ({:.1} s ago)",
                        t.format("%Y-%m-%d %H:%M:%S"),
                        status.oldest_pending_age_seconds(chrono::Utc::now())
                    ),
                    None => "-".into(),
                }
            );
            println!("published: {} (kept until retention)", status.published);
            println!("failed:    {}", status.failed);
            for f in &failed {
                println!(
                    "  row {} message {} to {} with {} after {} attempt(s): {}",
                    f.id,
                    id(&f.message_id),
                    printable(&format!("{:?}", f.exchange)),
                    printable(&format!("{:?}", f.routing_key)),
                    f.attempts,
                    one_line(&f.last_error, 200)
                );
            }
            if (failed.len() as i64) < status.failed {
                println!(
                    "  ... {} more (--limit)",
                    status.failed - failed.len() as i64
                );
            }
        }
        OutboxCommand::RetryFailed { ids } => {
            let n = store.retry_failed(&ids).await?;
            println!("requeued {n} failed row(s)");
        }
    }
    Ok(())
}

async fn run_dlq(cmd: DlqCommand, connection: &Arc<lapin::Connection>) -> Result<(), String> {
    let dlq = |queue: &str| DeadLetterQueue::new(Arc::clone(connection), queue);
    let err = |e: warren::broker::BrokerError| e.to_string();
    match cmd {
        DlqCommand::List {
            queue,
            limit,
            show_payload,
        } => {
            print_list(&dlq(&queue).list(limit).await.map_err(err)?, show_payload);
        }
        DlqCommand::Show {
            queue,
            id,
            show_payload,
        } => {
            let q = dlq(&queue);
            match q.find(&id).await.map_err(err)? {
                Some(letter) => print_one(&letter, show_payload),
                None => return Err(format!("no message with id {id:?} in {}", q.name())),
            }
        }
        DlqCommand::Replay {
            queue,
            which,
            reason,
            limit,
            rate,
            dry_run,
        } => {
            if let Some(r) = &reason
                && warren::admin::DeadLetterReason::from_name(r).is_none()
            {
                return Err(format!(
                    "unknown reason {r:?}; known: {}",
                    warren::admin::DeadLetterReason::ALL
                        .map(|r| r.as_str())
                        .join(", ")
                ));
            }
            let selection = Selection {
                ids: which.ids,
                reason,
                limit,
            };
            let report = dlq(&queue)
                .replay(&selection, rate, dry_run)
                .await
                .map_err(err)?;
            let verb = if dry_run { "would replay" } else { "replayed" };
            for l in &report.replayed {
                println!("{verb} {} ({})", id(&l.message_id), printable(&l.reason));
            }
            println!(
                "{verb} {} message(s) to {queue}; {} left in place",
                report.replayed.len(),
                report.skipped
            );
        }
        DlqCommand::Purge { queue, which, yes } => {
            if !yes {
                return Err("purging deletes dead letters for good; add --yes to confirm".into());
            }
            let q = dlq(&queue);
            if which.all {
                let n = q.purge_all().await.map_err(err)?;
                println!("purged {n} message(s) from {}", q.name());
            } else {
                let removed = q.purge_ids(&which.ids).await.map_err(err)?;
                for l in &removed {
                    println!("purged {}", id(&l.message_id));
                }
                println!("purged {} message(s) from {}", removed.len(), q.name());
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // After RUST_LOG, so that no setting lets payloads into the logs.
    for directive in warren::telemetry::PAYLOAD_SAFE_LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse().expect("warren's directives parse"));
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("warren: {message}");
            ExitCode::FAILURE
        }
    }
}
