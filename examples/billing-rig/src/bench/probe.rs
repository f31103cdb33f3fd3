//! Instruments of the benchmark: when each message settled (from warren's own
//! "message processed" event, logged after the commit and the ack), and the
//! process's peak resident memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;

/// Switches for what the benchmark's subscriber listens to, installed by its
/// logging setup. Both are off unless a row needs them, so that no other row
/// pays for an event per message: the probe (while a latency run records),
/// and a log line per message written as text to `/dev/null` (the row that
/// measures what such a line costs).
pub struct LogSwitches {
    /// Turns the latency probe on or off.
    pub probe: Box<dyn Fn(bool) + Send + Sync>,
    /// Turns the per-message log line on or off.
    pub lines: Box<dyn Fn(bool) + Send + Sync>,
}

static SWITCHES: std::sync::OnceLock<LogSwitches> = std::sync::OnceLock::new();

/// Installs the switches (once, at start).
pub fn install_switches(switches: LogSwitches) {
    let _ = SWITCHES.set(switches);
}

/// Turns the per-message log lines on or off.
pub(crate) fn log_lines(on: bool) {
    if let Some(s) = SWITCHES.get() {
        (s.lines)(on);
    }
}

/// When each message id settled, while recording.
#[derive(Clone, Default)]
pub struct Settled(Arc<Mutex<Option<HashMap<String, Instant>>>>);

impl Settled {
    /// Starts recording (and forgets what was recorded before).
    pub fn start(&self) {
        *self.lock() = Some(HashMap::new());
        if let Some(s) = SWITCHES.get() {
            (s.probe)(true);
        }
    }

    /// Stops recording and returns what was recorded.
    pub fn take(&self) -> HashMap<String, Instant> {
        if let Some(s) = SWITCHES.get() {
            (s.probe)(false);
        }
        self.lock().take().unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<HashMap<String, Instant>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The layer that feeds [`Settled`].
pub struct Probe(pub Settled);

#[derive(Default)]
struct Fields {
    processed: bool,
    message_id: Option<String>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message_id" {
            self.message_id = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.processed = format!("{value:?}") == "message processed";
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Probe {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let now = Instant::now();
        let mut guard = self.0.lock();
        let Some(settled) = guard.as_mut() else {
            return;
        };
        let mut fields = Fields::default();
        event.record(&mut fields);
        if let (true, Some(id)) = (fields.processed, fields.message_id) {
            settled.entry(id).or_insert(now);
        }
    }
}

/// The p-th percentile (0 to 100) of `samples`, sorted in place.
pub(crate) fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let rank = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
    samples[rank.min(samples.len() - 1)]
}

/// Resets the process's peak resident set size, so that the next reading is
/// the peak of what runs from now on. False where the kernel does not allow it.
pub(crate) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The process's peak resident set size since the last reset, in MiB.
pub(crate) fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// The RabbitMQ nodes whose VMs count as the broker, when not the one in
/// this network namespace (`--broker-nodes`).
static BROKER_NODES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Counts the CPU of `nodes`' VMs (`rabbit@host` names, as on their command
/// lines or in their RABBITMQ_NODENAME) as the broker's, in place of the
/// local node's.
pub fn count_broker_nodes(nodes: Vec<String>) {
    let _ = BROKER_NODES.set(nodes);
}

/// What the broker is, for the bench's heading: one node, or the nodes of
/// `--broker-nodes`.
pub(crate) fn broker_described() -> String {
    match BROKER_NODES.get() {
        Some(nodes) => format!("a cluster of {} nodes ({})", nodes.len(), nodes.join(", ")),
        None => "one broker".into(),
    }
}

/// True if process `dir` is a VM the broker's CPU is read from: one of
/// `--broker-nodes`, or else the node in this network namespace.
fn is_broker(dir: &std::path::Path) -> bool {
    match BROKER_NODES.get() {
        // RabbitMQ 3.10 names its node from the environment
        // (RABBITMQ_NODENAME), not from the VM's command line: read both.
        Some(nodes) => ["cmdline", "environ"].iter().any(|file| {
            std::fs::read(dir.join(file)).is_ok_and(|args| {
                args.split(|&b| b == 0).any(|arg| {
                    let arg = arg.strip_prefix(b"RABBITMQ_NODENAME=").unwrap_or(arg);
                    nodes.iter().any(|n| arg == n.as_bytes())
                })
            })
        }),
        None => same_network(dir),
    }
}

/// True if process `dir` (`/proc/PID`) shares this process's network
/// namespace: the broker this process reaches on 127.0.0.1, not the nodes of
/// a test cluster, each in a namespace of its own.
fn same_network(dir: &std::path::Path) -> bool {
    let ours = std::fs::read_link("/proc/self/ns/net");
    ours.is_ok() && std::fs::read_link(dir.join("ns/net")).ok() == ours.ok()
}

/// CPU time spent so far by this process, the broker and the database server
/// on this host, read from `/proc` (Linux). The broker and the database are
/// found by process name (`beam.smp`, `postgres`) in this process's network
/// namespace; a server on another host, or none, reads as zero.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuTimes {
    pub this_process: Duration,
    pub broker: Duration,
    pub database: Duration,
}

impl CpuTimes {
    /// Reads them now.
    pub(crate) fn now() -> Self {
        let mut times = Self {
            this_process: stat_cpu("/proc/self/stat", false).unwrap_or_default(),
            ..Self::default()
        };
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return times;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
                continue;
            };
            let stat = path.join("stat");
            let stat = stat.to_string_lossy();
            match comm.trim() {
                "beam.smp" if is_broker(&path) => {
                    times.broker += stat_cpu(&stat, false).unwrap_or_default();
                }
                // Backends that ended were reaped by the postmaster: their
                // time is in its children's fields.
                "postgres" => times.database += stat_cpu(&stat, true).unwrap_or_default(),
                _ => {}
            }
        }
        times
    }

    /// What was spent between `earlier` and this reading.
    pub(crate) fn since(&self, earlier: &Self) -> Self {
        Self {
            this_process: self.this_process.saturating_sub(earlier.this_process),
            broker: self.broker.saturating_sub(earlier.broker),
            database: self.database.saturating_sub(earlier.database),
        }
    }
}

/// How the local RabbitMQ node's schedulers wait for work, from its command
/// line (`-sbwt`, `-sbwtdcpu`, `-sbwtdio`; RabbitMQ 3.10 passes `none` by
/// default, Erlang's own default is `medium`): spinning schedulers spend CPU
/// between messages, which a CPU-per-message figure then includes.
pub(crate) fn broker_busy_wait() -> String {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return "unknown".into();
    };
    for entry in entries.flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_node = args.first().is_some_and(|a| a.ends_with("beam.smp"))
            && args.windows(3).any(|w| w == ["-s", "rabbit", "boot"])
            && same_network(&entry.path());
        if !is_node {
            continue;
        }
        let flags: Vec<String> = ["-sbwt", "-sbwtdcpu", "-sbwtdio"]
            .iter()
            .filter_map(|flag| {
                // The last one counts: RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS
                // come after the defaults.
                let at = args.iter().rposition(|a| a == flag)?;
                Some(format!("{flag} {}", args.get(at + 1)?))
            })
            .collect();
        return if flags.is_empty() {
            "Erlang's default (medium)".into()
        } else {
            flags.join(" ")
        };
    }
    "unknown (no local RabbitMQ node)".into()
}

/// User and system time from a `/proc/<pid>/stat` file, with the reaped
/// children's if `children`.
fn stat_cpu(path: &str, children: bool) -> Option<Duration> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    let mut ticks = field(14)? + field(15)?;
    if children {
        ticks += field(16)? + field(17)?;
    }
    // The kernel's USER_HZ: 100 on every Linux this runs on.
    Some(Duration::from_millis(ticks * 10))
}
