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
//! [`Cluster`] injects the faults of a RabbitMQ cluster instead: the node
//! that leads a queue stopped, killed, wiped or cut off from the network, or
//! every node restarted in turn ([`ClusterFault`]), each reported as a
//! [`Failover`].
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

mod broker_tools;
mod cluster;
mod faults;
mod fleet;
pub mod hostile;
mod report;
mod tally;

pub use broker_tools::{HashExchangePluginOff, QueuePolicy, close_all_connections, restart_broker};
pub use cluster::{Cluster, ClusterFault, Failover};
pub use faults::{Campaign, FaultKind, FaultMix, Step};
pub use fleet::{Fleet, START_TIMEOUT};
pub use report::{Check, Report};
pub use tally::LogTally;

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::broker_tools::run_tool;
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
