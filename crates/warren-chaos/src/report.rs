//! The verdict of a campaign: each invariant, and what the campaign did.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::faults::{Campaign, FaultKind};
use crate::fleet::Fleet;
use crate::tally::LogTally;

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
