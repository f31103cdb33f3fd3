//! Which faults a campaign injects: their kinds, the mix, and the seeded
//! schedule that picks them.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::broker_tools::{close_all_connections, restart_broker};
use crate::fleet::Fleet;

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
        warren_failpoints::NAMES
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
