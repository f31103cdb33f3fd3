//! The local broker's command-line tools, for faults and for tests that need
//! the broker in a state a client cannot put it in.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

async fn rabbitmqctl(args: &[&str]) -> Result<(), String> {
    run_tool("rabbitmqctl", args).await
}

/// Runs `program` to completion without blocking the thread; its stderr is the
/// error if it fails.
pub(crate) async fn run_tool(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Closes every client connection of the local broker.
pub async fn close_all_connections() -> Result<(), String> {
    rabbitmqctl(&["close_all_connections", "chaos"]).await
}

/// Stops the local broker's application for `down_for`, then starts it and waits
/// until it is up.
pub async fn restart_broker(down_for: Duration) -> Result<(), String> {
    rabbitmqctl(&["stop_app"]).await?;
    tokio::time::sleep(down_for).await;
    rabbitmqctl(&["start_app"]).await?;
    rabbitmqctl(&["await_startup"]).await
}

/// The consistent-hash exchange plugin turned off on the local broker until
/// this is dropped (also when a test's assertion fails), for testing what a
/// partitioned consumer does without it.
///
/// It changes the shared broker for every client: run such a test alone.
/// Both ends block the calling thread while `rabbitmq-plugins` runs (drop
/// cannot await), a few seconds each.
#[derive(Debug)]
pub struct HashExchangePluginOff(());

impl HashExchangePluginOff {
    /// `rabbitmq-plugins disable rabbitmq_consistent_hash_exchange`.
    pub fn new() -> Result<Self, String> {
        plugin("disable")?;
        Ok(HashExchangePluginOff(()))
    }
}

impl Drop for HashExchangePluginOff {
    fn drop(&mut self) {
        if let Err(e) = plugin("enable") {
            if std::thread::panicking() {
                // A second panic while a failed test unwinds would abort the
                // run and hide the test's own failure.
                #[allow(clippy::print_stderr, reason = "drop cannot return the error")]
                {
                    eprintln!("could not turn the hash exchange plugin back on: {e}");
                }
            } else {
                panic!("could not turn the hash exchange plugin back on: {e}");
            }
        }
    }
}

fn plugin(verb: &str) -> Result<(), String> {
    let out = std::process::Command::new("rabbitmq-plugins")
        .args([verb, "rabbitmq_consistent_hash_exchange"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run rabbitmq-plugins: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "rabbitmq-plugins {verb}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
