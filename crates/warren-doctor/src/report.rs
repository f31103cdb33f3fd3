//! The doctor's findings: each check passed, warned, failed or was skipped,
//! with what was found and the fix; printed for people or as JSON.

use std::fmt::Write as _;

use serde::Serialize;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Could not be checked; the detail says why. Never a failure.
    Skip,
    /// As warren expects.
    Pass,
    /// Works, with a risk or a cost the detail names.
    Warn,
    /// Loses messages, applies them twice, or stops the consumer.
    Fail,
}

impl Status {
    /// `pass`, `warn`, `fail` or `skip`.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Skip => "skip",
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked, a stable kebab-case name: `broker-version`,
    /// `delivery-limit`, `retry-ttl`, `consumer-timeout`...
    pub check: &'static str,
    /// What it was checked on: `broker`, a queue's name, `database`.
    pub subject: String,
    /// The outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it; empty when nothing is to be done.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub fix: String,
}

impl Check {
    /// A finding without a fix.
    pub fn new(
        check: &'static str,
        subject: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
    ) -> Self {
        Check {
            check,
            subject: subject.into(),
            status,
            detail: detail.into(),
            fix: String::new(),
        }
    }

    /// The same, with what to do.
    pub fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = fix.into();
        self
    }
}

/// Every finding of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The findings, in the order they were made.
    pub checks: Vec<Check>,
}

impl Report {
    /// A report of `checks`.
    pub fn new(checks: Vec<Check>) -> Self {
        Report { checks }
    }

    /// Adds findings.
    pub fn extend(&mut self, checks: impl IntoIterator<Item = Check>) {
        self.checks.extend(checks);
    }

    /// The findings of `status`.
    pub fn with_status(&self, status: Status) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(move |c| c.status == status)
    }

    /// Whether any check failed.
    pub fn failed(&self) -> bool {
        self.with_status(Status::Fail).next().is_some()
    }

    /// How many checks came out each way: (pass, warn, fail, skip).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let n = |s| self.with_status(s).count();
        (
            n(Status::Pass),
            n(Status::Warn),
            n(Status::Fail),
            n(Status::Skip),
        )
    }

    /// For people: one line per check, its detail and fix indented under it,
    /// then the counts.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let _ = writeln!(
                out,
                "{:<4}  {:<24} {}",
                c.status.as_str(),
                c.check,
                c.subject
            );
            for line in c.detail.lines() {
                let _ = writeln!(out, "      {line}");
            }
            if !c.fix.is_empty() {
                let _ = writeln!(out, "      fix: {}", c.fix);
            }
        }
        let (pass, warn, fail, skip) = self.counts();
        let _ = writeln!(
            out,
            "{pass} passed, {warn} warnings, {fail} failed, {skip} skipped"
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_fails_the_report_and_a_skip_does_not() {
        let mut report = Report::new(vec![
            Check::new("broker-version", "broker", Status::Pass, "RabbitMQ 3.10.8"),
            Check::new(
                "feature-flags",
                "broker",
                Status::Skip,
                "needs administrator",
            ),
        ]);
        assert!(!report.failed());
        report.extend([
            Check::new("retry-ttl", "q.retry.5s", Status::Fail, "3000 ms").fix("remove the policy"),
        ]);
        assert!(report.failed());
        assert_eq!(report.counts(), (1, 0, 1, 1));
        let text = report.text();
        assert!(text.contains("fail  retry-ttl"), "{text}");
        assert!(text.contains("      fix: remove the policy"), "{text}");
        assert!(
            text.ends_with("1 passed, 0 warnings, 1 failed, 1 skipped\n"),
            "{text}"
        );
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["checks"][2]["status"], "fail");
        assert_eq!(json["checks"][0].get("fix"), None);
    }
}
