//! `warren`: the operator's tool. Declares and shows a consumer's topology; lists,
//! shows, replays and purges its dead letters; shows and mends its outbox;
//! purges its inbox.
//!
//! The flags are in `cli`, what each command does in a module of its own
//! (`topology`, `dead_letters`, `outbox`, `inbox`), and `dispatch` connects to what
//! a command needs and hands it over.
#![allow(clippy::print_stdout, clippy::print_stderr)] // printing is this program's job

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod dead_letters;
mod dispatch;
mod inbox;
mod outbox;
mod print;
mod topology;

use cli::Cli;

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
    match runtime.block_on(dispatch::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("warren: {message}");
            ExitCode::FAILURE
        }
    }
}
