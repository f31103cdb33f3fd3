//! Faults of a RabbitMQ cluster: the node that leads a queue stopped, killed,
//! wiped or cut off from the network, and a rolling restart of every node.
//!
//! The nodes are driven through a control script with the interface of the
//! repository's `.ci/cluster` (three nodes, each in a network namespace of its
//! own): `stop N`, `kill N`, `start N`, `wipe N`, `grow N`, `cut N [IP..]`,
//! `heal`, `leader QUEUE`, `replicas QUEUE` and `quorum-safe N`. Every fault
//! finds the queue's leader first: each quorum queue has a leader of its own,
//! and stopping an arbitrary node would often test nothing.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::Command;

/// A fault of the cluster, aimed at the node leading one queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterFault {
    /// `rabbitmqctl stop` on the leader's node, a pause, then start it.
    LeaderStop,
    /// `kill -9` of the leader's Erlang VM, a pause, then start it.
    LeaderKill,
    /// Every node stopped and started in turn, each only once the cluster
    /// can lose it without a quorum queue losing its majority.
    RollingRestart,
    /// The leader's node stopped, removed from the cluster, its data deleted,
    /// started empty, joined again and given back its replicas.
    LeaderWipe,
    /// The leader's node cut off from the other nodes (and from the extra
    /// addresses given), held apart, then healed.
    LeaderPartition,
}

impl ClusterFault {
    /// Every fault, in the order of their names.
    pub const ALL: [ClusterFault; 5] = [
        ClusterFault::LeaderStop,
        ClusterFault::LeaderKill,
        ClusterFault::RollingRestart,
        ClusterFault::LeaderWipe,
        ClusterFault::LeaderPartition,
    ];

    /// The name used on command lines.
    pub fn as_str(self) -> &'static str {
        match self {
            ClusterFault::LeaderStop => "leader-stop",
            ClusterFault::LeaderKill => "leader-kill",
            ClusterFault::RollingRestart => "rolling-restart",
            ClusterFault::LeaderWipe => "leader-wipe",
            ClusterFault::LeaderPartition => "leader-partition",
        }
    }
}

impl std::str::FromStr for ClusterFault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|f| f.as_str()).collect();
                format!("{s:?} is not a cluster fault; one of {}", names.join(", "))
            })
    }
}

/// What one fault did to the queue's leadership, and how long it took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failover {
    /// The node that led the queue before the fault (`rabbit@...`).
    pub leader_before: String,
    /// Leaders seen while a node was down or cut off, in order.
    pub leaders_during: Vec<String>,
    /// The node that leads it once the fault is over.
    pub leader_after: String,
    /// From the first node going down until another led the queue.
    pub election: Duration,
    /// The whole fault, from the first stop to every node back.
    pub duration: Duration,
}

impl Failover {
    /// True if another node led the queue while its leader was down.
    pub fn moved(&self) -> bool {
        self.leaders_during.iter().any(|l| *l != self.leader_before)
    }
}

/// The cluster, driven through its control script.
#[derive(Debug, Clone)]
pub struct Cluster {
    script: PathBuf,
    /// How long a stopped or killed node stays down, and a cut one apart.
    pub down_for: Duration,
}

impl Cluster {
    /// The cluster whose control script is `script`.
    pub fn new(script: impl Into<PathBuf>) -> Self {
        Self {
            script: script.into(),
            down_for: Duration::from_secs(5),
        }
    }

    /// The cluster named by `WARREN_CLUSTER_SCRIPT` (which `.ci/cluster env`
    /// prints), if set.
    pub fn from_env() -> Option<Self> {
        std::env::var_os("WARREN_CLUSTER_SCRIPT").map(Self::new)
    }

    async fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.script)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| format!("cannot run {}: {e}", self.script.display()))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(format!(
                "{} {}: {}",
                self.script.display(),
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// The node leading quorum queue `queue` (`rabbit@...`).
    pub async fn leader(&self, queue: &str) -> Result<String, String> {
        self.run(&["leader", queue]).await
    }

    /// How many of `queue`'s replicas are running.
    pub async fn replicas(&self, queue: &str) -> Result<usize, String> {
        let out = self.run(&["replicas", queue]).await?;
        out.parse()
            .map_err(|e| format!("replicas of {queue}: {out:?}: {e}"))
    }

    /// Stops node `n` cleanly.
    pub async fn stop(&self, n: usize) -> Result<(), String> {
        self.run(&["stop", &n.to_string()]).await.map(drop)
    }

    /// Kills node `n`'s Erlang VM with SIGKILL.
    pub async fn kill(&self, n: usize) -> Result<(), String> {
        self.run(&["kill", &n.to_string()]).await.map(drop)
    }

    /// Starts node `n` again and waits until it runs.
    pub async fn start(&self, n: usize) -> Result<(), String> {
        self.run(&["start", &n.to_string()]).await.map(drop)
    }

    /// Cuts node `n` off from the other nodes and from `also` (addresses).
    pub async fn cut(&self, n: usize, also: &[String]) -> Result<(), String> {
        let mut args = vec!["cut".to_owned(), n.to_string()];
        args.extend(also.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(&args).await.map(drop)
    }

    /// A network namespace for client `k` on the cluster's network, for a
    /// partition to cut off from a node: its name and address.
    pub async fn client(&self, k: usize) -> Result<(String, String), String> {
        let out = self.run(&["client", &k.to_string()]).await?;
        out.split_once(' ')
            .map(|(ns, addr)| (ns.to_owned(), addr.to_owned()))
            .ok_or_else(|| format!("client {k}: unexpected answer {out:?}"))
    }

    /// Removes every cut.
    pub async fn heal(&self) -> Result<(), String> {
        self.run(&["heal"]).await.map(drop)
    }

    /// Queues named from `prefix` on that hold messages not ready, as
    /// `(queue, unacknowledged, held back)`: held back are those in the
    /// total but neither ready nor unacknowledged (on a quorum queue, messages
    /// it dead-lettered at-least-once and has not yet handed on).
    pub async fn not_ready(&self, prefix: &str) -> Result<Vec<(String, u64, u64)>, String> {
        Ok(not_ready_of(&self.run(&["not-ready", prefix]).await?))
    }

    /// Waits until stopping node `n` leaves every quorum queue a majority.
    pub async fn wait_quorum_safe(&self, n: usize, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            match self.run(&["quorum-safe", &n.to_string()]).await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("node {n} stayed quorum critical: {e}"));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Waits until `queue` has `count` replicas running.
    pub async fn wait_replicas(
        &self,
        queue: &str,
        count: usize,
        within: Duration,
    ) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let running = self.replicas(queue).await.unwrap_or(0);
            if running >= count {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{queue}: {running} replicas running after {within:?}, expected {count}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until a node other than `former` leads `queue`, asking the
    /// other nodes only (the former leader's may be going down); returns it.
    async fn new_leader(&self, queue: &str, former: &str) -> Result<String, String> {
        let deadline = Instant::now() + Duration::from_secs(90);
        let skip = node_index(former)?.to_string();
        loop {
            if let Ok(l) = self.run(&["leader", queue, &skip]).await
                && l != former
            {
                return Ok(l);
            }
            if Instant::now() >= deadline {
                return Err(format!("no node but {former} led {queue} within 90 s"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Injects `fault` aimed at the node that leads `queue`, and returns what
    /// became of its leadership. `cut_also` are the addresses a partition
    /// also cuts the node off from (a client's, say).
    pub async fn inject(
        &self,
        fault: ClusterFault,
        queue: &str,
        cut_also: &[String],
    ) -> Result<Failover, String> {
        let started = Instant::now();
        let before = self.leader(queue).await?;
        let n = node_index(&before)?;
        let mut during = Vec::new();
        let mut election = Duration::ZERO;
        match fault {
            ClusterFault::LeaderStop | ClusterFault::LeaderKill => {
                // A clean stop takes seconds, and the queue may change
                // leader while it runs: both are watched at once.
                let down = async {
                    if fault == ClusterFault::LeaderStop {
                        self.stop(n).await
                    } else {
                        self.kill(n).await
                    }
                };
                let (down, elected) = tokio::join!(down, async {
                    let l = self.new_leader(queue, &before).await;
                    (l, started.elapsed())
                });
                down?;
                during.push(elected.0?);
                election = elected.1;
                tokio::time::sleep(self.down_for).await;
                self.start(n).await?;
            }
            ClusterFault::RollingRestart => {
                for node in 1..=3 {
                    self.wait_quorum_safe(node, Duration::from_secs(120))
                        .await?;
                    let leading = self.leader(queue).await?;
                    let down_at = Instant::now();
                    if node_index(&leading)? == node {
                        let (down, elected) = tokio::join!(self.stop(node), async {
                            let l = self.new_leader(queue, &leading).await;
                            (l, down_at.elapsed())
                        });
                        down?;
                        during.push(elected.0?);
                        election = election.max(elected.1);
                    } else {
                        self.stop(node).await?;
                        during.push(self.leader(queue).await?);
                    }
                    tokio::time::sleep(self.down_for).await;
                    self.start(node).await?;
                }
            }
            ClusterFault::LeaderWipe => {
                let (down, elected) = tokio::join!(self.stop(n), async {
                    let l = self.new_leader(queue, &before).await;
                    (l, started.elapsed())
                });
                down?;
                during.push(elected.0?);
                election = elected.1;
                // `wipe` forgets the stopped node, deletes its data, starts
                // it empty and joins it; its replicas come back with `grow`.
                self.run(&["wipe", &n.to_string()]).await?;
                self.run(&["grow", &n.to_string()]).await?;
            }
            ClusterFault::LeaderPartition => {
                self.cut(n, cut_also).await?;
                during.push(self.new_leader(queue, &before).await?);
                election = started.elapsed();
                tokio::time::sleep(self.down_for).await;
                self.heal().await?;
            }
        }
        self.wait_replicas(queue, 3, Duration::from_secs(180))
            .await?;
        let after = self.leader(queue).await?;
        Ok(Failover {
            leader_before: before,
            leaders_during: during,
            leader_after: after,
            election,
            duration: started.elapsed(),
        })
    }
}

/// `rabbit@wrn2` is node 2.
fn node_index(node: &str) -> Result<usize, String> {
    node.rsplit_once("wrn")
        .and_then(|(_, n)| n.parse().ok())
        .ok_or_else(|| format!("{node:?} is not a node of the cluster (rabbit@wrnN)"))
}

/// The lines `NAME UNACKED HELD` of the control script's `not-ready`.
fn not_ready_of(listing: &str) -> Vec<(String, u64, u64)> {
    listing
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let name = fields.next()?.to_owned();
            let unacked = fields.next()?.parse().ok()?;
            let held = fields.next()?.parse().ok()?;
            Some((name, unacked, held))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_not_ready_are_read_a_line_each() {
        let listing = "p.q.retry.5s 0 3\np.customer-credit.2 1 0\n";
        assert_eq!(
            not_ready_of(listing),
            [
                ("p.q.retry.5s".to_owned(), 0, 3),
                ("p.customer-credit.2".to_owned(), 1, 0)
            ]
        );
        assert!(not_ready_of("").is_empty());
        assert!(not_ready_of("p.q three 0").is_empty());
    }

    #[test]
    fn faults_are_named_on_the_command_line() {
        for f in ClusterFault::ALL {
            assert_eq!(f.as_str().parse::<ClusterFault>(), Ok(f));
        }
        let err = "leader-nap".parse::<ClusterFault>().unwrap_err();
        assert!(err.contains("leader-stop, leader-kill"), "{err}");
    }

    #[test]
    fn nodes_are_numbered_by_their_host() {
        assert_eq!(node_index("rabbit@wrn3"), Ok(3));
        assert!(node_index("rabbit@localhost").is_err());
    }

    #[test]
    fn leadership_moved_if_another_node_led_meanwhile() {
        let f = |during: &[&str]| Failover {
            leader_before: "rabbit@wrn1".into(),
            leaders_during: during.iter().map(|s| (*s).to_owned()).collect(),
            leader_after: "rabbit@wrn1".into(),
            election: Duration::ZERO,
            duration: Duration::ZERO,
        };
        assert!(f(&["rabbit@wrn2"]).moved());
        assert!(!f(&["rabbit@wrn1"]).moved());
        assert!(!f(&[]).moved());
    }
}
