//! A fleet: several processes of one service, started, stopped, killed and
//! restarted, with their logs read as they go.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::tally::LogTally;

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
    /// The same, for each member alone (across its restarts).
    member_tallies: Vec<Arc<Mutex<LogTally>>>,
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
            member_tallies: (0..size).map(|_| Arc::default()).collect(),
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

    /// What member `index`'s logs said, across its restarts.
    pub fn member_tally(&self, index: usize) -> LogTally {
        self.member_tallies[index]
            .lock()
            .expect("tally lock")
            .clone()
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
        cmd.env_remove(warren_failpoints::ENV);
        if let Some(spec) = failpoints {
            cmd.env(warren_failpoints::ENV, spec);
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
        let own_tally = Arc::clone(&self.member_tallies[index]);
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
                own_tally.lock().expect("tally lock").read(&line);
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
