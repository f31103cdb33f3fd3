//! Running a parsed command: connecting to what it needs, then handing it to
//! its module.

use std::sync::Arc;
use std::time::Duration;

use warren::admin::DatabaseUrl;
use warren::topology::Topology;
use warren::{PgStore, SqliteStore};

use crate::cli::{Cli, Command, TopologyCommand};
use crate::dead_letters::run_dlq;
use crate::inbox::run_inbox;
use crate::outbox::run_outbox;
use crate::topology::print_topology;

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

pub(crate) async fn run(cli: Cli) -> Result<(), String> {
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
