//! `warren`: the operator's tool. Declares, shows and deletes a consumer's
//! topology; groups, searches, replays, edits and resolves its dead letters
//! kept in the database, and lists, replays and purges its dead-letter
//! queue; shows and mends its outbox; purges its inbox.
//!
//! The flags are in `cli`, what each command does in a module of its own
//! (`topology`, `dead_letters`, `dlq`, `outbox`, `inbox`), and `dispatch`
//! connects to what a command needs and hands it over.
#![allow(clippy::print_stdout, clippy::print_stderr)] // printing is this program's job

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod dead_letters;
mod dispatch;
mod dlq;
mod doctor;
mod inbox;
mod outbox;
mod print;
mod topology;
mod trace;

use cli::Cli;

/// Why a command did not succeed: a wrong argument (exit code 2, as clap's
/// own errors), or an operation that failed (exit code 1).
#[derive(Debug)]
pub(crate) enum CliError {
    /// The arguments cannot work: fix the command line.
    Usage(String),
    /// The command ran and failed.
    Failed(String),
}

impl From<String> for CliError {
    fn from(message: String) -> Self {
        CliError::Failed(message)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // Warnings only: the CLI's output is what it prints. lapin's own
        // ERROR lines for the channels a passive check closes are not news.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,lapin=off"));
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
        Err(CliError::Usage(message)) => {
            eprintln!("warren: {message}");
            ExitCode::from(2)
        }
        Err(CliError::Failed(message)) => {
            eprintln!("warren: {message}");
            ExitCode::FAILURE
        }
    }
}
