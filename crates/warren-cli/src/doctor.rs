//! `warren doctor`: one consumer's deployment checked against the traps of
//! broker versions and misconfiguration, and its database's health.

use std::path::Path;
use std::time::Duration;

use clap::Args;
use warren::{MySqlStore, PgStore, SqliteStore};
use warren_admin::DatabaseUrl;
use warren_doctor::{
    BrokerAccess, Check, DatabaseExpectations, Report, Status, check_consumers, check_database,
};

use crate::CliError;
use crate::cli::{ConsumerArgs, DatabaseUrlParser};

/// `warren doctor`'s flags: the consumer as it runs, and where to ask.
#[derive(Args)]
pub(crate) struct DoctorArgs {
    #[command(flatten)]
    pub(crate) consumer: ConsumerArgs,
    /// The consumer's name, for its inbox [default: the queue].
    #[arg(long, value_parser = crate::cli::checked("--consumer-name", warren_admin::input::text))]
    pub(crate) consumer_name: Option<String>,
    /// How long a suspect may run alone (the consumer's solo_timeout)
    /// [default: 60s].
    #[arg(long, value_parser = warren::retry::parse_delay)]
    pub(crate) solo_timeout: Option<Duration>,
    /// When a batch commits what it applied so far (batch_time_limit)
    /// [default: 100ms on SQLite, none on PostgreSQL and MySQL].
    #[arg(long, value_parser = warren::retry::parse_delay)]
    pub(crate) batch_time_limit: Option<Duration>,
    /// The broker consumer_timeout the consumer is configured to assume
    /// [default: 30m].
    #[arg(long, value_parser = warren::retry::parse_delay)]
    pub(crate) consumer_timeout: Option<Duration>,
    /// The largest body the consumer accepts, in bytes (max_body_bytes)
    /// [default: 1048576].
    #[arg(long)]
    pub(crate) max_body_bytes: Option<usize>,
    /// The management HTTP API, e.g. http://user:pass@rabbit:15672 (a user
    /// tagged monitoring with access to the virtual host does) [default:
    /// port 15672 of the AMQP host, with the AMQP URL's credentials]. The
    /// password is never printed.
    #[arg(long, env = "WARREN_MANAGEMENT_URL", hide_env_values = true)]
    pub(crate) management_url: Option<String>,
    /// The rabbitmqctl to read consumer_timeout and max_message_size with
    /// (they are node settings the HTTP API does not show) [default:
    /// rabbitmqctl, if this host has it].
    #[arg(long, conflicts_with = "no_rabbitmqctl")]
    pub(crate) rabbitmqctl: Option<String>,
    /// Do not run rabbitmqctl.
    #[arg(long)]
    pub(crate) no_rabbitmqctl: bool,
    /// The consumer's database: postgres://..., mysql://... or sqlite://PATH.
    /// The password is never printed.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = DatabaseUrlParser)]
    pub(crate) database_url: Option<DatabaseUrl>,
    /// The consumer's inbox retention window, e.g. 7d.
    #[arg(long, value_parser = warren::retry::parse_delay)]
    pub(crate) inbox_retention: Option<Duration>,
    /// Print JSON instead of the report.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `program` if it is a file on `PATH` (or a path to one).
fn on_path(program: &str) -> Option<String> {
    if program.contains('/') {
        return Path::new(program).is_file().then(|| program.to_owned());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .any(|dir| dir.join(program).is_file())
        .then(|| program.to_owned())
}

pub(crate) async fn run_doctor(
    args: DoctorArgs,
    amqp_url: &str,
    tls: warren::tls::TlsOptions,
) -> Result<(), CliError> {
    let mut builder = args.consumer.builder();
    if let Some(t) = args.solo_timeout {
        builder = builder.with_solo_timeout(t);
    }
    if let Some(t) = args.batch_time_limit {
        builder = builder.with_batch_time_limit(t);
    }
    if let Some(t) = args.consumer_timeout {
        builder = builder.with_consumer_timeout(t);
    }
    if let Some(n) = args.max_body_bytes {
        builder = builder.with_max_body_bytes(n);
    }
    let config = builder
        .build()
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let rabbitmqctl = if args.no_rabbitmqctl {
        None
    } else {
        match &args.rabbitmqctl {
            Some(program) => Some(program.clone()),
            None => on_path("rabbitmqctl"),
        }
    };
    let access = BrokerAccess {
        amqp_url: amqp_url.to_owned(),
        tls,
        management_url: args.management_url.clone(),
        rabbitmqctl,
    };
    let mut report = check_consumers(std::slice::from_ref(&config), &access).await;
    if let Some(url) = &args.database_url {
        let mut expect =
            DatabaseExpectations::new(args.consumer_name.as_deref().unwrap_or(config.name()));
        expect.inbox_retention = args.inbox_retention;
        report.extend(database(url, &expect).await);
    }
    if args.json {
        // A report quotes the broker's and the database's answers.
        println!("{}", warren_admin::printable_json_pretty(&report));
    } else {
        print!("{}", report.text());
    }
    verdict(&report)
}

fn verdict(report: &Report) -> Result<(), CliError> {
    let failed = report.with_status(Status::Fail).count();
    if failed == 0 {
        Ok(())
    } else {
        Err(CliError::Failed(format!(
            "{failed} check{} failed",
            if failed == 1 { "" } else { "s" }
        )))
    }
}

/// The database checks; a database that cannot be opened is one failed check.
async fn database(url: &DatabaseUrl, expect: &DatabaseExpectations) -> Vec<Check> {
    let unreachable = |e: String| {
        vec![
            Check::new(
                "database",
                "database",
                Status::Fail,
                format!("cannot open {}: {e}", url.redacted()),
            )
            .fix("check --database-url and that the database runs"),
        ]
    };
    match url {
        DatabaseUrl::Postgres(u) => match PgStore::connect(u, 1).await {
            Ok(store) => check_database(&store, expect).await,
            Err(e) => unreachable(e.to_string()),
        },
        DatabaseUrl::Sqlite(u) => {
            if let Err(CliError::Failed(e) | CliError::Usage(e)) =
                crate::dispatch::existing_sqlite(u)
            {
                return unreachable(e);
            }
            match SqliteStore::connect(u).await {
                Ok(store) => check_database(&store, expect).await,
                Err(e) => unreachable(e.to_string()),
            }
        }
        DatabaseUrl::MySql(u) => match MySqlStore::connect(u, 1).await {
            Ok(store) => check_database(&store, expect).await,
            Err(e) => unreachable(e.to_string()),
        },
    }
}
