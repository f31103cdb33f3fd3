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
    tool_result(program, args, &out)
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
        undo("turn the hash exchange plugin back on", plugin("enable"));
    }
}

fn plugin(verb: &str) -> Result<(), String> {
    run_tool_blocking(
        "rabbitmq-plugins",
        &[verb, "rabbitmq_consistent_hash_exchange"],
    )
}

/// A policy on the local broker's queues whose names match a pattern, until
/// this is dropped: for faults a client cannot cause, such as a queue that
/// refuses every publish (`{"max-length": 0, "overflow": "reject-publish"}`).
///
/// It affects only the queues the pattern matches, so tests with queues of
/// their own can use it side by side. Setting and clearing block the calling
/// thread while `rabbitmqctl` runs.
#[derive(Debug)]
pub struct QueuePolicy {
    name: String,
    operator: bool,
}

impl QueuePolicy {
    /// `rabbitmqctl set_operator_policy --apply-to queues --priority 100 NAME
    /// PATTERN DEFINITION`: an operator policy, which users' policies cannot
    /// override (the lower limit of the two wins).
    pub fn set_operator(name: &str, pattern: &str, definition: &str) -> Result<Self, String> {
        Self::set_with(true, name, pattern, definition)
    }

    /// `rabbitmqctl set_policy --apply-to queues --priority 100 NAME PATTERN
    /// DEFINITION`; the high priority wins over the usual policies.
    pub fn set(name: &str, pattern: &str, definition: &str) -> Result<Self, String> {
        Self::set_with(false, name, pattern, definition)
    }

    fn set_with(
        operator: bool,
        name: &str,
        pattern: &str,
        definition: &str,
    ) -> Result<Self, String> {
        let verb = if operator {
            "set_operator_policy"
        } else {
            "set_policy"
        };
        run_tool_blocking(
            "rabbitmqctl",
            &[
                verb,
                "--apply-to",
                "queues",
                "--priority",
                "100",
                name,
                pattern,
                definition,
            ],
        )?;
        Ok(QueuePolicy {
            name: name.to_owned(),
            operator,
        })
    }
}

impl Drop for QueuePolicy {
    fn drop(&mut self) {
        let verb = if self.operator {
            "clear_operator_policy"
        } else {
            "clear_policy"
        };
        undo(
            &format!("{verb} {}", self.name),
            run_tool_blocking("rabbitmqctl", &[verb, &self.name]),
        );
    }
}

/// Reports a guard that could not put the broker back: a panic, but not while
/// a failed test unwinds, where a second panic would abort the run and hide the
/// test's own failure.
fn undo(what: &str, result: Result<(), String>) {
    if let Err(e) = result {
        if std::thread::panicking() {
            #[allow(clippy::print_stderr, reason = "drop cannot return the error")]
            {
                eprintln!("could not {what}: {e}");
            }
        } else {
            panic!("could not {what}: {e}");
        }
    }
}

/// [`run_tool`] for drop, which cannot await: blocks the thread.
fn run_tool_blocking(program: &str, args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    tool_result(program, args, &out)
}

fn tool_result(program: &str, args: &[&str], out: &std::process::Output) -> Result<(), String> {
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
