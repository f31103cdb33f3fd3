//! Chaos campaigns: inject faults into a fleet of consumer processes and the
//! broker, then check invariants. `billing chaos` is built on this crate; point
//! it at your own service to run the same campaign against it.
//!
//! A campaign runs your service as several processes ([`Fleet`]), each started by
//! a command you supply. While your stream flows, [`Campaign::inject`] picks faults
//! from a seeded random generator, so a failing schedule can be replayed with the
//! same seed: SIGKILL, SIGTERM (graceful restart), crash points armed on restart,
//! every broker connection closed, the broker application stopped and started.
//! The fleet reads each process's JSON log lines and tallies the per-message
//! outcomes warren logs, so the report counts redeliveries, duplicates, retries and
//! dead letters even of processes that were killed. Afterwards, [`Check`]s state
//! the invariants and [`Report`] prints PASS or FAIL for each.
//!
//! [`hostile`] is the producer no client library would be: it writes frames
//! byte by byte (header tables thousands of levels deep, names and ids that
//! are not UTF-8), to check that no message the broker accepts takes a
//! service down.
//!
//! ```no_run
//! # async fn demo() -> Result<(), String> {
//! use std::time::Duration;
//! use warren_chaos::{Campaign, Check, Fleet, FaultMix, Report};
//!
//! let mut fleet = Fleet::new(3, |_index| {
//!     let mut cmd = tokio::process::Command::new("my-service");
//!     cmd.arg("run");
//!     cmd
//! });
//! fleet.start_all(None).await?;
//! let mut campaign = Campaign::new(42, FaultMix::default());
//! let until = tokio::time::Instant::now() + Duration::from_secs(60);
//! while tokio::time::Instant::now() < until {
//!     campaign.inject(&mut fleet).await?;
//! }
//! fleet.restart_all(None).await?; // a quiet phase: no more faults
//! // ... wait for the queues to drain, then state what must hold:
//! let checks = vec![Check::new("nothing lost", true, "10000 of 10000 applied")];
//! fleet.stop_all().await?;
//! let report = Report::new(&campaign, &fleet, checks, Duration::from_secs(90));
//! println!("{report}");
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

mod broker_tools;
pub mod hostile;
#[cfg(test)]
use broker_tools::run_tool;
pub use broker_tools::{HashExchangePluginOff, QueuePolicy, close_all_connections, restart_broker};

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL a process, then start it again.
    Kill,
    /// SIGTERM a process (it drains), then start it again.
    Terminate,
    /// Restart a process with every crash point armed.
    ArmCrashPoints,
    /// A process aborted at an armed crash point (observed, then restarted).
    CrashPointFired,
    /// `rabbitmqctl close_all_connections`.
    CloseConnections,
    /// `rabbitmqctl stop_app`, a pause, `start_app`.
    RestartBroker,
}

impl FaultKind {
    /// A short name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Kill => "SIGKILL + restart",
            FaultKind::Terminate => "SIGTERM + restart",
            FaultKind::ArmCrashPoints => "crash points armed",
            FaultKind::CrashPointFired => "crash point fired",
            FaultKind::CloseConnections => "broker connections closed",
            FaultKind::RestartBroker => "broker stopped and started",
        }
    }
}

/// How often each fault is picked, and how the pauses between them are spread.
#[derive(Debug, Clone)]
pub struct FaultMix {
    /// Relative weights of kill, terminate, arm crash points, close connections,
    /// restart broker.
    pub weights: [u32; 5],
    /// Mean pause between faults (drawn uniformly from half to one and a half).
    pub mean_interval: Duration,
    /// The probability each crash point gets when armed (`WARREN_FAILPOINTS`).
    pub crash_probability: f64,
    /// How long the broker stays stopped.
    pub broker_down_for: Duration,
    /// Every process started during the fault phase has its crash points
    /// armed (else only after an arm-crash-points fault, and half the revived
    /// ones), so that crashes land at any moment, several within one prefetch
    /// window.
    pub armed_throughout: bool,
}

impl Default for FaultMix {
    fn default() -> Self {
        Self {
            weights: [4, 3, 3, 2, 1],
            mean_interval: Duration::from_millis(1500),
            crash_probability: 0.01,
            broker_down_for: Duration::from_secs(2),
            armed_throughout: true,
        }
    }
}

impl FaultMix {
    /// The `WARREN_FAILPOINTS` value that arms every crash point.
    pub fn failpoints(&self) -> String {
        warren::failpoint::NAMES
            .iter()
            .map(|n| format!("{n}={}", self.crash_probability))
            .collect::<Vec<_>>()
            .join(";")
    }

    /// The crash points a process started during the fault phase gets, unless
    /// the fault is to arm them.
    pub fn start_armed(&self) -> Option<String> {
        self.armed_throughout.then(|| self.failpoints())
    }
}

/// Per-message outcomes read from the fleet's logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogTally {
    /// `processing_result` values and how often each was logged.
    pub results: BTreeMap<String, u64>,
    /// Deliveries the broker marked redelivered.
    pub redelivered: u64,
    /// Suspects that started a solo run.
    pub solo_runs: u64,
    /// Solo runs of a message whose previous solo run ended without an outcome
    /// (the process died, or the run outlasted its deadline): evidence a
    /// healthy message can collect against itself when unrelated deaths fall
    /// inside its solo runs.
    pub solo_runs_after_a_death: u64,
}

impl LogTally {
    fn read(&mut self, line: &str) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            return;
        };
        let fields = &v["fields"];
        if fields["message"] == "suspect runs alone" {
            self.solo_runs += 1;
            if fields["solo_run"].as_u64().is_some_and(|n| n >= 2) {
                self.solo_runs_after_a_death += 1;
            }
            return;
        }
        if fields["message"] != "message processed" {
            return;
        }
        if let Some(result) = fields["processing_result"].as_str() {
            *self.results.entry(result.to_owned()).or_default() += 1;
        }
        if fields["rabbitmq_redelivered"] == true {
            self.redelivered += 1;
        }
    }

    /// How often `result` was logged.
    pub fn count(&self, result: &str) -> u64 {
        self.results.get(result).copied().unwrap_or(0)
    }
}

struct Member {
    child: Child,
}

type Spawner = Box<dyn Fn(usize) -> Command + Send + Sync>;

/// How long a starting member has to log its ready line.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Several processes of one service, started by a command of yours.
pub struct Fleet {
    spawn: Spawner,
    members: Vec<Option<Member>>,
    tally: Arc<Mutex<LogTally>>,
    crashes: u64,
    ready_line: Option<String>,
}

impl Fleet {
    /// A fleet of `size` processes; `spawn(index)` builds the command for one.
    /// The fleet adds `WARREN_FAILPOINTS` when crash points are armed, reads the
    /// process's standard error (warren's JSON logs), and discards its output.
    pub fn new(size: usize, spawn: impl Fn(usize) -> Command + Send + Sync + 'static) -> Self {
        Self {
            spawn: Box::new(spawn),
            members: (0..size).map(|_| None).collect(),
            tally: Arc::default(),
            crashes: 0,
            ready_line: None,
        }
    }

    /// Makes [`start`](Self::start) wait until the new process logs a line that
    /// contains `text` (for warren consumers, `"consuming"`). A process is only
    /// signalled once it is up: a SIGTERM that lands before the program has
    /// installed its handler kills it the default way, which no program can
    /// prevent and which is not the fault under test.
    pub fn with_ready_line(mut self, text: impl Into<String>) -> Self {
        self.ready_line = Some(text.into());
        self
    }

    /// Number of processes.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// True for a fleet of none.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Outcomes tallied so far.
    pub fn tally(&self) -> LogTally {
        self.tally.lock().expect("tally lock").clone()
    }

    /// Process ids of the running members, by index.
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.members
            .iter()
            .map(|m| m.as_ref().and_then(|m| m.child.id()))
            .collect()
    }

    /// Starts member `index` (stopping nothing); `failpoints` arms crash points.
    pub async fn start(&mut self, index: usize, failpoints: Option<&str>) -> Result<(), String> {
        let mut cmd = (self.spawn)(index);
        cmd.env_remove(warren::failpoint::ENV);
        if let Some(spec) = failpoints {
            cmd.env(warren::failpoint::ENV, spec);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start member {index}: {e}"))?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let tally = Arc::clone(&self.tally);
        // With WARREN_CHAOS_LOG_DIR set, every member's log is kept there too.
        let mut keep = std::env::var_os("WARREN_CHAOS_LOG_DIR").and_then(|dir| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(std::path::Path::new(&dir).join(format!("member-{index}.log")))
                .ok()
        });
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        let mut ready = self.ready_line.clone().map(|text| (text, ready_tx));
        tokio::spawn(async move {
            use std::io::Write;
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(f) = keep.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
                if ready
                    .as_ref()
                    .is_some_and(|(text, _)| line.contains(text.as_str()))
                    && let Some((_, tx)) = ready.take()
                {
                    let _ = tx.send(());
                }
                tally.lock().expect("tally lock").read(&line);
            }
        });
        if self.ready_line.is_some() {
            match tokio::time::timeout(START_TIMEOUT, ready_rx).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    // The process ended before it was ready (a crash point can
                    // fire at once); `revive` sees it dead and counts it.
                }
                Err(_) => {
                    return Err(format!(
                        "member {index} did not become ready within {START_TIMEOUT:?}"
                    ));
                }
            }
        }
        self.members[index] = Some(Member { child });
        Ok(())
    }

    /// Starts every member.
    pub async fn start_all(&mut self, failpoints: Option<&str>) -> Result<(), String> {
        for i in 0..self.len() {
            self.start(i, failpoints).await?;
        }
        Ok(())
    }

    /// SIGKILLs member `index`.
    pub async fn kill(&mut self, index: usize) -> Result<(), String> {
        if let Some(mut m) = self.members[index].take() {
            m.child
                .kill()
                .await
                .map_err(|e| format!("cannot kill member {index}: {e}"))?;
        }
        Ok(())
    }

    /// SIGTERMs member `index` and waits for it to drain and exit. An exit other
    /// than 0 is an error: a graceful stop must be clean.
    pub async fn terminate(&mut self, index: usize) -> Result<(), String> {
        let Some(mut m) = self.members[index].take() else {
            return Ok(());
        };
        if let Some(pid) = m.child.id() {
            signal(pid, "-TERM").await?;
        }
        let status = tokio::time::timeout(Duration::from_secs(90), m.child.wait())
            .await
            .map_err(|_| format!("member {index} did not exit within 90 s of SIGTERM"))?
            .map_err(|e| e.to_string())?;
        if status.success() {
            Ok(())
        } else {
            // A crash point can fire while it drains; that is an abort, not a
            // failed graceful stop.
            if is_abort(&status) {
                self.crashes += 1;
                Ok(())
            } else {
                Err(format!("member {index} exited with {status} after SIGTERM"))
            }
        }
    }

    /// Restarts members that died (a crash point fired); returns how many.
    pub async fn revive(&mut self, failpoints: Option<&str>) -> Result<usize, String> {
        let mut revived = 0;
        for i in 0..self.len() {
            let dead = match self.members[i].as_mut() {
                Some(m) => match m.child.try_wait() {
                    Ok(Some(status)) => {
                        if !is_abort(&status) {
                            return Err(format!("member {i} exited unexpectedly with {status}"));
                        }
                        true
                    }
                    Ok(None) => false,
                    Err(e) => return Err(e.to_string()),
                },
                None => true,
            };
            if dead {
                self.crashes += 1;
                self.start(i, failpoints).await?;
                revived += 1;
            }
        }
        Ok(revived)
    }

    /// Gracefully restarts every member, e.g. without crash points for a quiet
    /// phase.
    pub async fn restart_all(&mut self, failpoints: Option<&str>) -> Result<(), String> {
        for i in 0..self.len() {
            self.terminate(i).await?;
            self.start(i, failpoints).await?;
        }
        Ok(())
    }

    /// Stops every member with SIGTERM; each must exit 0.
    pub async fn stop_all(&mut self) -> Result<(), String> {
        for i in 0..self.len() {
            self.terminate(i).await?;
        }
        Ok(())
    }

    /// Crash points that fired (members found aborted).
    pub fn crashes(&self) -> u64 {
        self.crashes
    }
}

fn is_abort(status: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(6)
}

// signal and the broker tools run their command with tokio::process: they are
// called from async code on the runtime's few worker threads, and rabbitmqctl can
// take seconds (await_startup much longer), which would stall every task on the
// thread.

async fn signal(pid: u32, sig: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .await
        .map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill {sig} {pid} failed"))
    }
}

/// A seeded fault schedule and the count of what it injected.
pub struct Campaign {
    rng: fastrand::Rng,
    mix: FaultMix,
    counts: BTreeMap<FaultKind, u64>,
}

impl Campaign {
    /// A campaign whose schedule is determined by `seed`.
    pub fn new(seed: u64, mix: FaultMix) -> Self {
        Self {
            rng: fastrand::Rng::with_seed(seed),
            mix,
            counts: BTreeMap::new(),
        }
    }

    /// The mix in use.
    pub fn mix(&self) -> &FaultMix {
        &self.mix
    }

    /// Faults injected so far, by kind.
    pub fn counts(&self) -> &BTreeMap<FaultKind, u64> {
        &self.counts
    }

    /// The next step of the schedule: a function of the seed and the fleet size
    /// alone, so the same seed gives the same schedule.
    pub fn plan_next(&mut self, members: usize) -> Step {
        let mean = self.mix.mean_interval.as_secs_f64();
        let pause = Duration::from_secs_f64(mean * (0.5 + self.rng.f64()));
        let arm_revived = self.rng.bool();
        let kinds = [
            FaultKind::Kill,
            FaultKind::Terminate,
            FaultKind::ArmCrashPoints,
            FaultKind::CloseConnections,
            FaultKind::RestartBroker,
        ];
        let total: u32 = self.mix.weights.iter().sum();
        let mut pick = self.rng.u32(0..total.max(1));
        let mut kind = kinds[0];
        for (k, w) in kinds.iter().zip(self.mix.weights) {
            if pick < w {
                kind = *k;
                break;
            }
            pick -= w;
        }
        let member = self.rng.usize(0..members.max(1));
        Step {
            pause,
            arm_revived,
            kind,
            member,
        }
    }

    /// Waits the next pause, revives members that crashed (re-arming their crash
    /// points half the time), then injects one fault. Returns the kind.
    pub async fn inject(&mut self, fleet: &mut Fleet) -> Result<FaultKind, String> {
        let step = self.plan_next(fleet.len());
        tokio::time::sleep(step.pause).await;
        let armed = self.mix.failpoints();
        let crashed_before = fleet.crashes();
        let on_start = self.mix.start_armed();
        let revived = if step.arm_revived {
            Some(armed.clone())
        } else {
            on_start.clone()
        };
        fleet.revive(revived.as_deref()).await?;
        let fired = fleet.crashes() - crashed_before;
        if fired > 0 {
            *self.counts.entry(FaultKind::CrashPointFired).or_default() += fired;
        }
        let member = step.member;
        match step.kind {
            FaultKind::Kill => {
                fleet.kill(member).await?;
                fleet.start(member, on_start.as_deref()).await?;
            }
            FaultKind::Terminate => {
                fleet.terminate(member).await?;
                fleet.start(member, on_start.as_deref()).await?;
            }
            FaultKind::ArmCrashPoints => {
                fleet.terminate(member).await?;
                fleet.start(member, Some(&armed)).await?;
            }
            FaultKind::CloseConnections => close_all_connections().await?,
            FaultKind::RestartBroker => restart_broker(self.mix.broker_down_for).await?,
            FaultKind::CrashPointFired => {}
        }
        *self.counts.entry(step.kind).or_default() += 1;
        Ok(step.kind)
    }
}

/// One step of a fault schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// Pause before the fault.
    pub pause: Duration,
    /// Whether members found crashed are restarted with crash points armed.
    pub arm_revived: bool,
    /// The fault.
    pub kind: FaultKind,
    /// The member it hits (for process faults).
    pub member: usize,
}

/// One invariant and whether it held.
#[derive(Debug, Clone)]
pub struct Check {
    /// What must hold.
    pub name: String,
    /// Whether it held.
    pub ok: bool,
    /// The numbers behind the verdict.
    pub detail: String,
}

impl Check {
    /// A verdict.
    pub fn new(name: impl Into<String>, ok: bool, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ok,
            detail: detail.into(),
        }
    }
}

/// What a campaign did and whether the invariants held.
#[derive(Debug, Clone)]
pub struct Report {
    /// Faults by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Outcomes read from the logs.
    pub tally: LogTally,
    /// The invariants.
    pub checks: Vec<Check>,
    /// How long it took.
    pub duration: Duration,
}

impl Report {
    /// Collects the report.
    pub fn new(campaign: &Campaign, fleet: &Fleet, checks: Vec<Check>, duration: Duration) -> Self {
        Self {
            faults: campaign.counts().clone(),
            tally: fleet.tally(),
            checks,
            duration,
        }
    }

    /// True if every invariant held.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "faults injected")?;
        for (kind, n) in &self.faults {
            writeln!(f, "  {:<28} {n}", kind.as_str())?;
        }
        writeln!(f, "outcomes logged by the fleet")?;
        writeln!(
            f,
            "  {:<28} {}",
            "redelivered deliveries", self.tally.redelivered
        )?;
        for (result, n) in &self.tally.results {
            writeln!(f, "  {result:<28} {n}")?;
        }
        writeln!(f, "  {:<28} {}", "solo runs", self.tally.solo_runs)?;
        writeln!(
            f,
            "  {:<28} {} ({:.2}% of solo runs)",
            "solo runs after a death",
            self.tally.solo_runs_after_a_death,
            100.0 * self.tally.solo_runs_after_a_death as f64 / self.tally.solo_runs.max(1) as f64
        )?;
        writeln!(f, "duration {:.1} s", self.duration.as_secs_f64())?;
        writeln!(f, "invariants")?;
        for c in &self.checks {
            writeln!(
                f,
                "  [{}] {}: {}",
                if c.ok { "PASS" } else { "FAIL" },
                c.name,
                c.detail
            )?;
        }
        write!(f, "{}", if self.passed() { "PASS" } else { "FAIL" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 10): rabbitmqctl ran with std::process inside async
    /// functions, blocking the runtime's thread until it finished. On a
    /// single-threaded runtime another task must keep running meanwhile.
    #[tokio::test(flavor = "current_thread")]
    async fn tools_run_without_blocking_the_runtime() {
        let ticks = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counter = Arc::clone(&ticks);
        let ticker = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        run_tool("sleep", &["0.5"]).await.unwrap();
        ticker.abort();
        assert!(ticks.load(std::sync::atomic::Ordering::Relaxed) >= 5);
        let err = run_tool("sh", &["-c", "echo broken >&2; exit 3"])
            .await
            .unwrap_err();
        assert!(err.contains("broken"), "{err}");
    }

    #[test]
    fn tally_reads_warren_json_lines_only() {
        let mut t = LogTally::default();
        t.read(r#"{"fields":{"message":"message processed","processing_result":"applied","rabbitmq_redelivered":true}}"#);
        t.read(r#"{"fields":{"message":"message processed","processing_result":"duplicate","rabbitmq_redelivered":false}}"#);
        t.read(r#"{"fields":{"message":"consuming"}}"#);
        t.read("not json");
        assert_eq!(t.count("applied"), 1);
        assert_eq!(t.count("duplicate"), 1);
        assert_eq!(t.redelivered, 1);
    }

    fn schedule(seed: u64) -> Vec<Step> {
        let mut c = Campaign::new(seed, FaultMix::default());
        (0..50).map(|_| c.plan_next(3)).collect()
    }

    #[test]
    fn same_seed_same_schedule_and_every_kind_appears() {
        assert_eq!(schedule(7), schedule(7));
        assert_ne!(schedule(7), schedule(8));
        let steps = schedule(7);
        for kind in [
            FaultKind::Kill,
            FaultKind::Terminate,
            FaultKind::ArmCrashPoints,
            FaultKind::CloseConnections,
            FaultKind::RestartBroker,
        ] {
            assert!(
                steps.iter().any(|s| s.kind == kind),
                "{kind:?} never picked"
            );
        }
        assert!(steps.iter().all(|s| s.member < 3));
        let mean = FaultMix::default().mean_interval;
        assert!(
            steps
                .iter()
                .all(|s| s.pause >= mean / 2 && s.pause <= mean * 3 / 2)
        );
        assert!(
            FaultMix::default()
                .failpoints()
                .contains("after-commit-before-ack=0.01")
        );
    }
}
