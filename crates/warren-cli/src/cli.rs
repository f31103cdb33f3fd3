//! The command line: every flag and subcommand, parsed and checked, and
//! nothing run.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use warren::ConsumerConfig;
use warren::admin::DatabaseUrl;
use warren::retry::{DEFAULT_POISON_LIMIT, RetryPolicy};
use warren::topology::QueueType;

const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Operate warren consumers: topology and dead letters.
#[derive(Parser)]
#[command(name = "warren", version, about)]
pub(crate) struct Cli {
    /// Broker URL. The password is never printed.
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL, global = true, hide_env_values = true)]
    pub(crate) amqp_url: String,
    /// PEM file of the CA that signed the broker's certificate (amqps://), trusted
    /// besides the bundled public roots.
    #[arg(long, env = "AMQP_CA_FILE", global = true)]
    pub(crate) amqp_ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate to present (amqps://); needs --amqp-client-key.
    #[arg(long, env = "AMQP_CLIENT_CERT", global = true)]
    pub(crate) amqp_client_cert: Option<std::path::PathBuf>,
    /// PEM private key of --amqp-client-cert.
    #[arg(long, env = "AMQP_CLIENT_KEY", global = true)]
    pub(crate) amqp_client_key: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

impl Cli {
    /// The TLS flags, checked; an error names the flag.
    pub(crate) fn tls(&self) -> Result<warren::tls::TlsOptions, String> {
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
pub(crate) enum Command {
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
pub(crate) enum InboxCommand {
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
pub(crate) enum OutboxCommand {
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
pub(crate) struct DatabaseUrlParser;

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
pub(crate) enum TopologyCommand {
    /// Declare the topology on the broker (idempotent).
    Declare(ConsumerArgs),
    /// Print the topology without touching the broker.
    Show(ConsumerArgs),
}

/// The consumer definition the topology derives from; use the same values the
/// consumer runs with.
#[derive(Args)]
pub(crate) struct ConsumerArgs {
    /// The consumer's queue.
    #[arg(long)]
    pub(crate) queue: String,
    /// Topic exchange to bind the queue to.
    #[arg(long, requires = "binding_keys")]
    pub(crate) exchange: Option<String>,
    /// Binding key from the exchange (repeat for several).
    #[arg(long = "binding-key", requires = "exchange")]
    pub(crate) binding_keys: Vec<String>,
    /// Queue type: quorum or classic.
    #[arg(long, default_value = "quorum", value_parser = parse_queue_type)]
    pub(crate) queue_type: QueueType,
    /// Retry delay tiers, comma separated (ms, s, m, h).
    #[arg(long, value_delimiter = ',', default_value = "5s,30s,2m,10m,30m", value_parser = warren::retry::parse_delay)]
    pub(crate) retry_tiers: Vec<Duration>,
    /// Total attempts, the first included [default: one per tier, plus one].
    #[arg(long)]
    pub(crate) max_attempts: Option<u32>,
    /// Deaths while a message ran alone before it is poison.
    #[arg(long, default_value_t = DEFAULT_POISON_LIMIT)]
    pub(crate) poison_limit: u32,
}

#[derive(Subcommand)]
pub(crate) enum DlqCommand {
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
pub(crate) struct Which {
    /// This message id (repeat for several).
    #[arg(long = "id")]
    pub(crate) ids: Vec<String>,
    /// Every dead letter (that matches the other filters).
    #[arg(long)]
    pub(crate) all: bool,
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
    pub(crate) fn config(&self) -> Result<ConsumerConfig, String> {
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
