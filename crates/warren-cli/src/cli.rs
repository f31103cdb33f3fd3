//! The command line: every flag and subcommand, parsed and checked, and
//! nothing run.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use warren::ConsumerConfig;
use warren::retry::{DEFAULT_POISON_LIMIT, RetryPolicy};
use warren::store::PageAfter;
use warren::topology::QueueType;
use warren_admin::DatabaseUrl;
use warren_admin::input;

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
    /// Dead letters kept in a database: groups, search, replay, edit, mute,
    /// resolve, purge, and the ingester that fills it.
    #[command(name = "dead-letters")]
    DeadLetters {
        /// postgres://..., mysql://... or sqlite://PATH, before or after the
        /// subcommand (required). The password is never printed.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true, value_parser = DatabaseUrlParser)]
        database_url: Option<DatabaseUrl>,
        /// Your name, for the audit table; every command that changes
        /// something needs it. The OS user is recorded beside it.
        #[arg(long, env = "WARREN_OPERATOR", global = true, value_parser = checked("--operator", input::text))]
        operator: Option<String>,
        #[command(subcommand)]
        command: DeadLettersCommand,
    },
    /// A web console on the dead letters kept in a database (see
    /// docs/console.md): open on 127.0.0.1 by default; elsewhere only behind
    /// a reverse proxy that terminates TLS, with every operator authenticated.
    Console(ConsoleArgs),
    /// The inbox in a database: retention.
    Inbox {
        /// postgres://..., mysql://... or sqlite://PATH, before or after the
        /// subcommand (required). The password is never printed.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true, value_parser = DatabaseUrlParser)]
        database_url: Option<DatabaseUrl>,
        #[command(subcommand)]
        command: InboxCommand,
    },
    /// What happened to one message: when each consumer received and applied
    /// it, its retries, duplicates and dead letters (from the delivery
    /// journal and the dead-letter store), and the outbox events it caused,
    /// with whether each was published. From the databases alone.
    Trace {
        /// The message id: the producer's, or the key warren lists it under
        /// (`~ce:...`, `~key:...`). A producer's id that starts with `~` is
        /// found too (warren keeps it as `~~...`).
        #[arg(value_parser = checked("MESSAGE_ID", input::message_id))]
        message_id: String,
        /// postgres://..., mysql://... or sqlite://PATH; repeat it to look in
        /// several services' databases (each is searched for every message
        /// of the chain). The password is never printed.
        #[arg(long = "database-url", env = "DATABASE_URL", hide_env_values = true, required = true, value_parser = DatabaseUrlParser)]
        database_urls: Vec<DatabaseUrl>,
        /// MESSAGE_ID is a CloudEvent's `id` from this `source`: the trace
        /// looks for the key warren keeps the pair under (`~ce:` and a hash).
        #[arg(long, value_parser = checked("--source", input::message_id), conflicts_with = "derived_key")]
        source: Option<String>,
        /// MESSAGE_ID is a key the consumer's route derived from the payload
        /// (`inv_1:paid`), not a producer's id: the trace looks for `~key:`
        /// and it.
        #[arg(long)]
        derived_key: bool,
        /// Trace each event the message caused too, and theirs, through
        /// every database given.
        #[arg(long)]
        follow: bool,
        /// Print JSON instead of the tree.
        #[arg(long)]
        json: bool,
    },
    /// Check a consumer's deployment: the broker's version traps, each
    /// queue's effective arguments and policies, consumer_timeout, message
    /// and frame sizes, and (with --database-url) its database. Exits 1 if
    /// a check fails.
    Doctor(Box<crate::doctor::DoctorArgs>),
    /// The transactional outbox in a database.
    Outbox {
        /// postgres://..., mysql://... or sqlite://PATH, before or after the
        /// subcommand (required). The password is never printed.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true, value_parser = DatabaseUrlParser)]
        database_url: Option<DatabaseUrl>,
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
        #[arg(long, value_parser = checked("--consumer", input::text))]
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
pub(crate) enum DeadLettersCommand {
    /// Letters grouped by cause: count, first and last seen, type, reason, a
    /// sample error; the largest group first, muted ones marked.
    Groups {
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many groups.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Letters, newest failure first, a page at a time.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Where the page starts: the `--after` value the previous page printed.
        #[arg(long, value_parser = checked("--after", input::cursor))]
        after: Option<PageAfter>,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One letter: every header decoded, its edit and replays, and the
    /// journaled outcome of each replay.
    Show {
        /// The letter id.
        #[arg(value_parser = checked("LETTER", input::hex_id))]
        letter: String,
        /// Print the payload too. Payloads may hold personal data.
        #[arg(long)]
        show_payload: bool,
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
    /// Send letters back to their queue, from the table, each confirmed.
    Replay {
        #[command(flatten)]
        which: ReplayWhich,
        /// Replay one letter first and go on only once the consumer journals
        /// it applied (a duplicate or stale copy counts as done); then stop
        /// at the first copy that fails again.
        #[arg(long)]
        careful: bool,
        /// How long to wait for a copy's journaled outcome.
        #[arg(long, default_value = "60s", value_parser = warren::retry::parse_delay)]
        outcome_timeout: Duration,
        /// At most this many per second, e.g. 50/s.
        #[arg(long, value_parser = parse_rate)]
        rate: Option<f64>,
        /// The consumer's inbox retention window: letters that first failed
        /// before it are refused (their inbox rows may be purged).
        #[arg(long, default_value = "7d", value_parser = warren::retry::parse_delay)]
        inbox_retention: Duration,
        /// Replay letters older than --inbox-retention anyway (audited).
        #[arg(long)]
        force: bool,
        /// Publish and return without waiting for a single letter's outcome.
        #[arg(long)]
        no_wait: bool,
    },
    /// Edit a letter's payload before replaying it: opens $EDITOR on the
    /// envelope, or sets fields. The original is kept; the edit is audited.
    Edit {
        /// The letter id.
        #[arg(value_parser = checked("LETTER", input::hex_id))]
        letter: String,
        /// Set a payload field (dotted path), e.g. --set amount=12.50 (repeat).
        #[arg(long = "set", value_parser = field("--set"))]
        sets: Vec<(String, String)>,
        /// Why: recorded with the edit.
        #[arg(long, value_parser = checked("--reason", input::note))]
        reason: String,
    },
    /// Mark letters dealt with.
    Resolve {
        #[command(flatten)]
        which: LetterWhich,
    },
    /// Move letters to another group (a group given as --group merges it).
    Reclassify {
        #[command(flatten)]
        which: LetterWhich,
        /// The group to move them into.
        #[arg(long, value_parser = checked("--to", input::group))]
        to: String,
    },
    /// Leave a group out of the alerting metrics for a while, or until it
    /// grows; still listed, marked muted.
    Mute {
        /// The group.
        #[arg(long, value_parser = checked("--group", input::group))]
        group: String,
        /// For this long, e.g. 4h.
        #[arg(long = "for", value_parser = warren::retry::parse_delay)]
        for_: Option<Duration>,
        /// Until it holds more than this many letters beyond what it holds now.
        #[arg(long)]
        grows_by: Option<u64>,
        /// Why.
        #[arg(long, default_value = "", value_parser = checked("--reason", input::note))]
        reason: String,
    },
    /// Lift a group's mute.
    Unmute {
        /// The group.
        #[arg(long, value_parser = checked("--group", input::group))]
        group: String,
    },
    /// Delete letters for good: resolved and replayed ones older than a
    /// window; unresolved ones only with --include-unresolved and --force.
    Purge {
        /// Letters whose state changed longer ago than this, e.g. 30d.
        #[arg(long, value_parser = warren::retry::parse_delay)]
        older_than: Duration,
        /// Unresolved letters too: nobody has looked at them.
        #[arg(long, requires = "force")]
        include_unresolved: bool,
        /// Confirm deleting unresolved letters.
        #[arg(long)]
        force: bool,
        /// Confirm: purged letters cannot be recovered.
        #[arg(long)]
        yes: bool,
    },
    /// Move the dead letters of a consumer's queue into the table, until
    /// stopped (Ctrl-C); `billing run` does this by itself.
    Ingest {
        /// The consumer's queue (its dead-letter queue is QUEUE.dead-letter).
        #[arg(long)]
        queue: String,
        /// The consumer's name [default: the queue].
        #[arg(long, value_parser = checked("--consumer", input::text))]
        consumer: Option<String>,
        /// Queue type of the side queue for letters too large to store.
        #[arg(long, default_value = "quorum", value_parser = parse_queue_type)]
        queue_type: QueueType,
        /// Payload fields to redact before storing (dotted paths, comma separated).
        #[arg(long, value_delimiter = ',', value_parser = checked("--redact", input::field_path))]
        redact: Vec<String>,
        /// Keep resolved and replayed letters this long.
        #[arg(long, default_value = "30d", value_parser = warren::retry::parse_delay)]
        retention: Duration,
    },
    /// Who changed what: the audit table, newest first.
    Audit {
        /// At most this many lines.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Switch editing on or off for everyone using this database.
    Policy {
        /// on or off.
        // Set, not clap's default for a bool (a flag that takes no value):
        // `--edit off` must read the value.
        #[arg(long, value_parser = parse_on_off, action = clap::ArgAction::Set)]
        edit: bool,
    },
}

/// Which letters: filters, each narrowing.
#[derive(Args, Clone, Default)]
pub(crate) struct FilterArgs {
    /// unresolved, replayed or resolved.
    #[arg(long, default_value = "unresolved", value_parser = parse_state)]
    pub(crate) state: Option<warren::store::LetterState>,
    /// Of this consumer.
    #[arg(long, value_parser = checked("--consumer", input::text))]
    pub(crate) consumer: Option<String>,
    /// Of this event type.
    #[arg(long = "type", value_parser = checked("--type", input::text))]
    pub(crate) event_type: Option<String>,
    /// Dead-lettered for this reason.
    #[arg(long, value_parser = checked("--reason", input::reason))]
    pub(crate) reason: Option<String>,
    /// In this group.
    #[arg(long, value_parser = checked("--group", input::group))]
    pub(crate) group: Option<String>,
    /// Failed at or after this: RFC 3339, a date (2026-12-01), or an age (2h).
    #[arg(long, value_parser = when("--since"))]
    pub(crate) since: Option<chrono::DateTime<chrono::Utc>>,
    /// Failed before this: as --since.
    #[arg(long, value_parser = when("--until"))]
    pub(crate) until: Option<chrono::DateTime<chrono::Utc>>,
    /// With this message id.
    #[arg(long, value_parser = checked("--message-id", input::message_id))]
    pub(crate) message_id: Option<String>,
    /// With this correlation id.
    #[arg(long, value_parser = checked("--correlation-id", input::text))]
    pub(crate) correlation_id: Option<String>,
    /// Whose payload has field=value (a dotted path), e.g. customerId=cus_123.
    #[arg(long, value_parser = field("--field"))]
    pub(crate) field: Option<(String, String)>,
}

impl FilterArgs {
    pub(crate) fn filter(&self) -> warren::store::LetterFilter {
        warren::store::LetterFilter {
            state: self.state.unwrap_or(warren::store::LetterState::Unresolved),
            consumer: self.consumer.clone(),
            event_type: self.event_type.clone(),
            reason: self.reason.clone(),
            group: self.group.clone(),
            since: self.since,
            until: self.until,
            message_id: self.message_id.clone(),
            correlation_id: self.correlation_id.clone(),
            payload_field: self.field.clone(),
            letter_id: None,
        }
    }
}

/// One letter or a group of them.
#[derive(Args)]
#[group(required = true, multiple = false)]
pub(crate) struct LetterWhich {
    /// This letter id.
    #[arg(long = "id", value_parser = checked("--id", input::hex_id))]
    pub(crate) id: Option<String>,
    /// Every unresolved letter of this group.
    #[arg(long, value_parser = checked("--group", input::group))]
    pub(crate) group: Option<String>,
}

impl LetterWhich {
    pub(crate) fn filter(&self) -> warren::store::LetterFilter {
        warren::store::LetterFilter {
            letter_id: self.id.clone(),
            group: self.group.clone(),
            ..warren::store::LetterFilter::default()
        }
    }
}

/// What a replay sends: one letter, a group, or a run to resume.
#[derive(Args)]
#[group(required = true, multiple = false)]
pub(crate) struct ReplayWhich {
    /// This letter id (unresolved or not).
    #[arg(long = "id", value_parser = checked("--id", input::hex_id))]
    pub(crate) id: Option<String>,
    /// The unresolved letters of this group, as they are when it starts.
    #[arg(long, value_parser = checked("--group", input::group))]
    pub(crate) group: Option<String>,
    /// Go on with an interrupted run, where it stopped.
    #[arg(long, value_parser = checked("--resume", input::hex_id))]
    pub(crate) resume: Option<String>,
}

fn parse_state(s: &str) -> Result<warren::store::LetterState, String> {
    warren::store::LetterState::from_name(s)
        .ok_or_else(|| format!("{s:?} is not a state: use unresolved, replayed or resolved"))
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: use on or off")),
    }
}

/// A value parser that checks a flag's value by its input rule, the
/// refusal naming the flag (clap exits 2 with it).
pub(crate) fn checked<T: Clone + Send + Sync + 'static>(
    flag: &'static str,
    check: fn(&str, &str) -> Result<T, input::InputError>,
) -> impl Fn(&str) -> Result<T, String> + Clone {
    move |s| check(flag, s).map_err(|e| e.to_string())
}

/// `field=value`: the field a dotted path, each by its rule.
fn field(flag: &'static str) -> impl Fn(&str) -> Result<(String, String), String> + Clone {
    move |s| {
        let (field, value) = s
            .split_once('=')
            .ok_or_else(|| format!("{flag}: use field=value, e.g. customerId=cus_123"))?;
        Ok((
            input::field_path(flag, field).map_err(|e| e.to_string())?,
            input::field_value(flag, value).map_err(|e| e.to_string())?,
        ))
    }
}

/// A point in time: RFC 3339, a date (midnight UTC), or an age before now
/// (2h, 7d); within the time rule.
fn when(
    flag: &'static str,
) -> impl Fn(&str) -> Result<chrono::DateTime<chrono::Utc>, String> + Clone {
    move |s| {
        if let Ok(age) = warren::retry::parse_delay(s) {
            let t = chrono::Duration::from_std(age)
                .ok()
                .and_then(|age| chrono::Utc::now().checked_sub_signed(age))
                .ok_or_else(|| format!("{flag}: {s:?} is further back than any date"))?;
            return input::instant(flag, t).map_err(|e| e.to_string());
        }
        input::time(flag, s).map_err(|e| {
            if e.problem.contains("is not a time") {
                format!(
                    "{flag}: use RFC 3339 (2026-12-01T08:00:00Z), a date (2026-12-01) or an age \
                     (2h, 7d)"
                )
            } else {
                e.to_string()
            }
        })
    }
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
    /// Delete the consumer's queues (its queue, retry tiers, dead-letter
    /// queue, partitions and their hash exchange). Refuses while any of them
    /// holds messages, unless --force.
    Delete {
        #[command(flatten)]
        consumer: ConsumerArgs,
        /// Delete queues that still hold messages: those messages are lost.
        #[arg(long)]
        force: bool,
        /// Also delete the exchanges it binds to and publishes to. Other
        /// consumers and producers may share them: only for a topology of
        /// its own (a demo, a test).
        #[arg(long)]
        with_exchanges: bool,
        /// Confirm.
        #[arg(long)]
        yes: bool,
    },
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
    /// A topic exchange the handlers publish to through the outbox (repeat).
    #[arg(long = "publishes-to")]
    pub(crate) publishes_to: Vec<String>,
    /// A stand-in queue for a downstream consumer, as the consumer declares
    /// it with `with_stand_in_queue`: EXCHANGE:QUEUE:BINDING_KEY (repeat).
    /// Declared, shown and deleted with the rest.
    #[arg(long = "stand-in", value_parser = parse_stand_in)]
    pub(crate) stand_ins: Vec<(String, String, String)>,
    /// Partition the consumer into this many queues (QUEUE.0 ..), fed by a
    /// consistent-hash exchange; needs --partition-exchange.
    #[arg(long, requires = "partition_exchange")]
    pub(crate) partitions: Option<u32>,
    /// The consistent-hash exchange of a partitioned consumer.
    #[arg(long, requires = "partitions")]
    pub(crate) partition_exchange: Option<String>,
    /// The header partitions hash on.
    #[arg(long, requires = "partitions")]
    pub(crate) partition_header: Option<String>,
    /// The consumer's prefetch: a quorum queue's delivery limit grows with it.
    #[arg(long, default_value_t = warren::config::DEFAULT_PREFETCH)]
    pub(crate) prefetch: u16,
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

/// `EXCHANGE:QUEUE:BINDING_KEY` (the key may hold `:`).
fn parse_stand_in(s: &str) -> Result<(String, String, String), String> {
    let mut parts = s.splitn(3, ':');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(e), Some(q), Some(k)) if !e.is_empty() && !q.is_empty() && !k.is_empty() => {
            Ok((e.to_owned(), q.to_owned(), k.to_owned()))
        }
        _ => Err(format!(
            "{s:?}: use EXCHANGE:QUEUE:BINDING_KEY, e.g. billing.events:billing.recorded:billing.recorded.*"
        )),
    }
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
        self.builder().build().map_err(|e| e.to_string())
    }

    /// The consumer these flags define, to be built.
    pub(crate) fn builder(&self) -> warren::config::ConsumerConfigBuilder {
        let mut retry =
            RetryPolicy::new(self.retry_tiers.iter().copied()).with_poison_limit(self.poison_limit);
        if let Some(n) = self.max_attempts {
            retry = retry.with_max_attempts(n);
        }
        let mut config = ConsumerConfig::builder(&self.queue, &self.queue)
            .with_queue_type(self.queue_type)
            .with_prefetch(self.prefetch)
            .with_concurrency(warren::config::DEFAULT_CONCURRENCY.min(usize::from(self.prefetch)))
            .with_retry(retry);
        if let Some(exchange) = &self.exchange {
            config = config.bind(exchange, self.binding_keys.iter().cloned());
        }
        for exchange in &self.publishes_to {
            config = config.publishes_to(exchange);
        }
        for (exchange, queue, key) in &self.stand_ins {
            config = config.with_stand_in_queue(exchange, queue, key);
        }
        if let (Some(n), Some(exchange)) = (self.partitions, &self.partition_exchange) {
            config = config.partitioned(exchange, n);
            if let Some(header) = &self.partition_header {
                config = config.with_partition_header(header);
            }
        }
        config
    }
}

/// `warren console`'s flags.
#[derive(Args)]
pub(crate) struct ConsoleArgs {
    /// postgres://..., mysql://... or sqlite://PATH. The password is never printed.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = DatabaseUrlParser)]
    pub(crate) database_url: DatabaseUrl,
    /// Address to listen on. Anything but loopback needs TLS: --tls-cert and
    /// --tls-key, or --behind-proxy.
    #[arg(long, env = "WARREN_CONSOLE_BIND", default_value = warren_console::DEFAULT_BIND)]
    pub(crate) bind: std::net::SocketAddr,
    /// A file of operators' tokens, one `NAME TOKEN` per line: each operator
    /// logs in with their own, and the audit table names them.
    #[arg(long, env = "WARREN_CONSOLE_TOKENS")]
    pub(crate) tokens: Option<std::path::PathBuf>,
    /// The header a trusted reverse proxy sets to the operator's name
    /// (needs --behind-proxy).
    #[arg(long)]
    pub(crate) identity_header: Option<String>,
    /// Names the reverse proxy that terminates TLS in front of the console;
    /// one way to listen on anything but loopback.
    #[arg(long)]
    pub(crate) behind_proxy: Option<String>,
    /// A PEM certificate chain (leaf first) to serve HTTPS with, the console
    /// itself; needs --tls-key.
    #[arg(long, env = "WARREN_CONSOLE_TLS_CERT", requires = "tls_key")]
    pub(crate) tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "WARREN_CONSOLE_TLS_KEY", requires = "tls_cert")]
    pub(crate) tls_key: Option<std::path::PathBuf>,
    /// On loopback without tokens: the operator actions are audited under.
    #[arg(long, env = "WARREN_OPERATOR")]
    pub(crate) operator: Option<String>,
    /// JSON fields of payloads to mask until an operator asks to see them
    /// (comma-separated, at any depth).
    #[arg(long, value_delimiter = ',')]
    pub(crate) mask: Vec<String>,
    /// The consumers' inbox retention window: replays refuse letters that
    /// first failed before it.
    #[arg(long, default_value = "7d", value_parser = warren::retry::parse_delay)]
    pub(crate) inbox_retention: Duration,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;
    use clap::error::ErrorKind;

    use super::*;

    /// A value each group-level flag takes, for the walk.
    fn sample(arg: &clap::Arg) -> Option<&'static str> {
        if !arg.get_num_args().is_some_and(|n| n.takes_values()) {
            return None;
        }
        Some(match arg.get_id().as_str() {
            "database_url" => "sqlite://walk.db",
            "amqp_url" => "amqp://guest:guest@127.0.0.1:5672/%2f",
            _ => "x",
        })
    }

    /// Every flag a command group takes parses before its subcommand and
    /// after it, down the whole tree: `warren dead-letters list
    /// --database-url URL` as well as `warren dead-letters --database-url
    /// URL list`.
    #[test]
    fn every_group_flag_parses_before_and_after_each_subcommand() {
        let mut root = Cli::command();
        root.build();
        let mut checked = 0;
        let mut groups = vec![(vec!["warren".to_owned()], root.clone())];
        while let Some((path, group)) = groups.pop() {
            let flags: Vec<&clap::Arg> = group
                .get_arguments()
                .filter(|a| {
                    a.get_long().is_some() && !matches!(a.get_id().as_str(), "help" | "version")
                })
                .collect();
            for sub in group.get_subcommands() {
                let mut sub_path = path.clone();
                sub_path.push(sub.get_name().to_owned());
                if sub.has_subcommands() {
                    groups.push((sub_path.clone(), sub.clone()));
                }
                for flag in &flags {
                    let mut given = vec![format!("--{}", flag.get_long().unwrap())];
                    given.extend(sample(flag).map(str::to_owned));
                    let before: Vec<String> = path
                        .iter()
                        .cloned()
                        .chain(given.iter().cloned())
                        .chain([sub.get_name().to_owned()])
                        .collect();
                    let after: Vec<String> = sub_path
                        .iter()
                        .cloned()
                        .chain(given.iter().cloned())
                        .collect();
                    for args in [before, after] {
                        // Missing required arguments of the subcommand are
                        // fine here; refusing the flag itself is not.
                        if let Err(e) = Cli::try_parse_from(&args) {
                            assert!(
                                !matches!(
                                    e.kind(),
                                    ErrorKind::UnknownArgument | ErrorKind::ArgumentConflict
                                ),
                                "{}: {e}",
                                args.join(" ")
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 50, "the walk reached the tree: {checked}");
        let parsed = Cli::try_parse_from([
            "warren",
            "dead-letters",
            "list",
            "--database-url",
            "sqlite://walk.db",
            "--operator",
            "alice",
        ])
        .unwrap();
        let Command::DeadLetters {
            database_url,
            operator,
            ..
        } = parsed.command
        else {
            panic!("dead-letters parses as dead-letters")
        };
        assert!(database_url.is_some());
        assert_eq!(operator.as_deref(), Some("alice"));
    }

    #[test]
    fn refused_values_exit_2_naming_the_flag() {
        for args in [
            &["warren", "dead-letters", "list", "--since", "+10000-01-01"][..],
            &["warren", "dead-letters", "list", "--group", "é"],
            &["warren", "dead-letters", "list", "--type", "a\u{0}b"],
            &[
                "warren",
                "dead-letters",
                "list",
                "--field",
                "amount=1e-20000",
            ],
            &["warren", "dead-letters", "show", "not-a-letter"],
            &[
                "warren",
                "dead-letters",
                "reclassify",
                "--group",
                "g1",
                "--to",
                "a b",
            ],
        ] {
            let Err(e) = Cli::try_parse_from(args) else {
                panic!("{args:?} parsed")
            };
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{args:?}: {e}");
            assert_eq!(e.exit_code(), 2);
            let text = e.to_string();
            assert!(text.contains("the rule: "), "{text}");
            assert!(!text.contains('\u{0}'), "{text:?}");
        }
    }
}
