//! Running a parsed command: connecting to what it needs, then handing it to
//! its module.

use std::sync::Arc;

use warren::topology::Topology;
use warren::{PgStore, SqliteStore};
use warren_admin::DatabaseUrl;

use crate::CliError;
use crate::cli::{Cli, Command, TopologyCommand};
use crate::dead_letters::{Broker, run_dead_letters};
use crate::dlq::run_dlq;
use crate::inbox::run_inbox;
use crate::outbox::run_outbox;
use crate::topology::print_topology;
use crate::trace::run_trace;

/// Opens the store a URL names and runs `$body` with `$store` bound to it. A
/// missing SQLite file is an error here, not a new empty database.
macro_rules! with_store {
    ($url:expr, |$store:ident| $body:expr) => {{
        let url: &DatabaseUrl = $url;
        let fail =
            |e: warren::store::StoreError| CliError::Failed(format!("{}: {e}", url.redacted()));
        match url {
            DatabaseUrl::Postgres(u) => {
                let $store = PgStore::connect(u, 2).await.map_err(fail)?;
                $body.await
            }
            DatabaseUrl::Sqlite(u) => {
                $crate::dispatch::existing_sqlite(u)?;
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

/// A SQLite URL's file must exist: opening one that does not would make a
/// new, empty database and report nothing in it.
pub(crate) fn existing_sqlite(url: &str) -> Result<(), CliError> {
    let path = url
        .trim_start_matches("sqlite://")
        .trim_start_matches("sqlite:");
    if std::path::Path::new(path).exists() {
        Ok(())
    } else {
        Err(CliError::Failed(format!("no database at {path}")))
    }
}

pub(crate) async fn run(cli: Cli) -> Result<(), CliError> {
    let tls = cli.tls().map_err(CliError::Usage)?;
    let connect = || async {
        warren::broker::connect_with_tls(&cli.amqp_url, "warren cli", &tls)
            .await
            .map(Arc::new)
            .map_err(|e| format!("cannot connect to the broker: {e}"))
    };
    match cli.command {
        Command::Topology(TopologyCommand::Show(args)) => {
            print_topology(&Topology::for_consumer(
                &args.config().map_err(CliError::Usage)?,
            ));
        }
        Command::Topology(TopologyCommand::Declare(args)) => {
            let topology = Topology::for_consumer(&args.config().map_err(CliError::Usage)?);
            let connection = connect().await?;
            let declared = warren::broker::declare_on(&connection, &topology).await;
            warren::broker::close_connection(&connection, "done").await;
            declared.map_err(|e| e.to_string())?;
            print_topology(&topology);
            println!("declared");
        }
        Command::Topology(TopologyCommand::Delete {
            consumer,
            force,
            with_exchanges,
            yes,
        }) => {
            let config = consumer.config().map_err(CliError::Usage)?;
            if !yes {
                return Err(CliError::Usage(
                    "deleting a topology deletes its queues; add --yes to confirm".into(),
                ));
            }
            let connection = connect().await?;
            let deleted = delete_topology(&connection, &config, force, with_exchanges).await;
            warren::broker::close_connection(&connection, "done").await;
            deleted?;
        }
        Command::Dlq(cmd) => {
            let connection = connect().await?;
            let done = run_dlq(cmd, &connection).await;
            warren::broker::close_connection(&connection, "done").await;
            done?;
        }
        Command::Doctor(args) => crate::doctor::run_doctor(*args, &cli.amqp_url, tls).await?,
        Command::Outbox {
            database_url,
            command,
        } => with_store!(&required(database_url)?, |store| run_outbox(
            &store, command
        ))?,
        Command::Trace {
            message_id,
            database_urls,
            source,
            derived_key,
            follow,
            json,
        } => {
            use warren::format::Identity;
            // The keys warren may journal and dedup the message by, in the
            // order they are tried.
            let keys = match (source, derived_key) {
                (Some(source), _) => vec![
                    Identity::CloudEvent {
                        source,
                        id: message_id,
                    }
                    .key(),
                ],
                (None, true) => vec![Identity::Derived(message_id).key()],
                // An id that starts with `~` is either a key as warren shows
                // it (`~key:...`, `~ce:...`) or a producer's own id, which
                // warren keeps with one more `~` in front.
                (None, false) if message_id.starts_with('~') => {
                    let escaped = Identity::Given(message_id.clone()).key();
                    vec![message_id, escaped]
                }
                (None, false) => vec![message_id],
            };
            run_trace(&database_urls, &keys, follow, json).await?;
        }
        Command::Inbox {
            database_url,
            command,
        } => with_store!(&required(database_url)?, |store| run_inbox(&store, command))?,
        Command::Console(args) => {
            let config = console_config(&args, &cli.amqp_url, tls)?;
            config
                .check_named(&warren_console::SettingNames::WARREN_CONSOLE)
                .map_err(CliError::Usage)?;
            let console = warren_console::Console::bind(config)
                .await
                .map_err(CliError::Usage)?;
            let url = console.url().map_err(CliError::Failed)?;
            eprintln!("warren: console on {url}");
            with_store!(&args.database_url, |store| async {
                console
                    .serve(store, async {
                        warren::shutdown_signal().await;
                    })
                    .await
                    .map_err(CliError::Failed)
            })?;
        }
        Command::DeadLetters {
            database_url,
            operator,
            command,
        } => {
            let broker = Broker {
                amqp_url: cli.amqp_url.clone(),
                tls,
            };
            with_store!(&required(database_url)?, |store| run_dead_letters(
                &store, operator, command, &broker
            ))?;
        }
    }
    Ok(())
}

/// `--database-url` of a command group: a global flag, so that it may come
/// after the subcommand, and so optional to clap (a global flag cannot be
/// required); required here.
fn required(url: Option<DatabaseUrl>) -> Result<DatabaseUrl, CliError> {
    url.ok_or_else(|| {
        CliError::Usage(
            "this command needs --database-url postgres://..., mysql://... or sqlite://PATH \
             (or DATABASE_URL)"
                .into(),
        )
    })
}

/// The console's configuration from its flags; a bad value names the flag.
fn console_config(
    args: &crate::cli::ConsoleArgs,
    amqp_url: &str,
    tls: warren::tls::TlsOptions,
) -> Result<warren_console::ConsoleConfig, CliError> {
    let mut config = warren_console::ConsoleConfig::new(args.bind);
    config.tokens = args
        .tokens
        .as_deref()
        .map(warren_console::read_tokens)
        .transpose()
        .map_err(|e| CliError::Usage(format!("--tokens: {e}")))?;
    config.identity_header = args.identity_header.clone();
    config.behind_proxy = args.behind_proxy.clone();
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        config.tls = Some(warren_console::ServerTls {
            cert: cert.clone(),
            key: key.clone(),
        });
    }
    config.local_operator = args
        .operator
        .as_deref()
        .map(str::trim)
        .filter(|o| !o.is_empty())
        .map(str::to_owned);
    config.masked_fields = args
        .mask
        .iter()
        .map(|f| f.trim().to_owned())
        .filter(|f| !f.is_empty())
        .collect();
    config.inbox_retention = args.inbox_retention;
    config.broker = Some(warren_console::BrokerTarget {
        amqp_url: amqp_url.to_owned(),
        tls,
    });
    Ok(config)
}

/// Deletes the consumer's queues, the dead-letter store's side queue, and
/// (`with_exchanges`) the exchanges it names; refuses, unless `force`, while
/// a queue holds messages.
async fn delete_topology(
    connection: &warren::lapin::Connection,
    config: &warren::ConsumerConfig,
    force: bool,
    with_exchanges: bool,
) -> Result<(), CliError> {
    let mut topology = Topology::for_consumer(config);
    if !with_exchanges {
        topology.exchanges.clear();
    }
    let side = warren_admin::unstored_queue_name(config.queue());
    topology
        .queues
        .push(warren::topology::QueueSpec::new(side, config.queue_type()));
    // Ready messages would be lost, and a queue with consumers may hold
    // unacked ones the count leaves out: both refuse without --force.
    let mut holding = Vec::new();
    for q in &topology.queues {
        match warren::broker::inspect_queue(connection, &q.name).await {
            Ok(info) if info.ready > 0 || info.consumers > 0 => holding.push(format!(
                "{} ({} ready, {} consumers)",
                q.name, info.ready, info.consumers
            )),
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                return Err(CliError::Failed(format!(
                    "cannot tell whether {} is empty: {e}",
                    q.name
                )));
            }
        }
    }
    if !holding.is_empty() && !force {
        return Err(CliError::Failed(format!(
            "not deleted: {} still hold messages or have consumers, and deleting would lose \
             them; stop the consumers and drain or replay the queues first, or add --force",
            holding.join(", ")
        )));
    }
    warren::broker::delete(connection, &topology)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    for q in &topology.queues {
        println!("deleted queue    {}", q.name);
    }
    for e in &topology.exchanges {
        println!("deleted exchange {}", e.name);
    }
    Ok(())
}
