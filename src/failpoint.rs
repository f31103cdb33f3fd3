//! Crash points for crash tests.
//!
//! In a build with the cargo feature `failpoints`, the environment variable
//! `WARREN_FAILPOINTS` (e.g. `after-commit-before-ack=0.02;before-commit=0.01`)
//! makes the process abort with the given probability when it reaches the named
//! point. Without the feature every point compiles to nothing.
//!
//! `batch-commit-outcome-unknown` does not abort: the first time it fires, a
//! batch that committed reports its connection lost during `COMMIT`, the case
//! where the consumer cannot know whether the commit happened.

use crate::config_error::ConfigError;

/// The crash points warren knows.
pub const NAMES: &[&str] = &[
    "before-commit",
    "after-commit-before-ack",
    "after-batch-commit-before-ack",
    "batch-commit-outcome-unknown",
    "relay-after-publish-before-mark",
];

/// The environment variable read.
pub const ENV: &str = "WARREN_FAILPOINTS";

/// Parses a `name=probability;...` specification.
pub fn parse(spec: &str) -> Result<Vec<(&'static str, f64)>, ConfigError> {
    parse_text(spec).map_err(|reason| ConfigError::new(ENV, reason))
}

fn parse_text(spec: &str) -> Result<Vec<(&'static str, f64)>, String> {
    let mut points = Vec::new();
    for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, p) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?} is not NAME=PROBABILITY"))?;
        let name = NAMES
            .iter()
            .find(|n| **n == name.trim())
            .ok_or_else(|| format!("unknown crash point {name:?}; known: {NAMES:?}"))?;
        let p: f64 = p
            .trim()
            .parse()
            .ok()
            .filter(|p: &f64| (0.0..=1.0).contains(p))
            .ok_or_else(|| {
                format!("probability for {name} must be a number from 0 to 1, got {p:?}")
            })?;
        points.push((*name, p));
    }
    Ok(points)
}

/// Validates `WARREN_FAILPOINTS` so that a typo stops the program at start rather
/// than silently disabling a crash test.
pub fn check_env() -> Result<(), ConfigError> {
    match std::env::var(ENV) {
        Ok(spec) => {
            parse(&spec)?;
            if !cfg!(feature = "failpoints") && !spec.trim().is_empty() {
                tracing::warn!("{ENV} is set but this build has no `failpoints` feature; ignored");
            }
            Ok(())
        }
        Err(_) => Ok(()),
    }
}

/// Aborts the process with the configured probability for `name`.
#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &'static str) {
    if draw(name) {
        tracing::error!(failpoint = name, "crash point reached; aborting");
        std::process::abort();
    }
}

/// True the first time the point named `name` draws its probability in this
/// process, false ever after: a fault simulated once, not a crash.
#[cfg(feature = "failpoints")]
pub(crate) fn fires_once(name: &'static str) -> bool {
    use std::sync::Mutex;
    static FIRED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut fired = FIRED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if fired.contains(&name) || !draw(name) {
        return false;
    }
    fired.push(name);
    tracing::error!(failpoint = name, "fault point reached");
    true
}

/// Draws the configured probability of `name`.
#[cfg(feature = "failpoints")]
fn draw(name: &'static str) -> bool {
    use std::sync::OnceLock;
    static POINTS: OnceLock<Vec<(&'static str, f64)>> = OnceLock::new();
    let points = POINTS.get_or_init(|| {
        std::env::var(ENV)
            .ok()
            .and_then(|spec| parse(&spec).ok())
            .unwrap_or_default()
    });
    points
        .iter()
        .find(|(n, _)| *n == name)
        .is_some_and(|(_, p)| fastrand::f64() < *p)
}

/// Without the `failpoints` feature a crash point is nothing.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn hit(_name: &'static str) {}

/// Without the `failpoints` feature a fault point never fires.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn fires_once(_name: &'static str) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        assert_eq!(
            parse("before-commit=0.5; after-commit-before-ack=1").unwrap(),
            [("before-commit", 0.5), ("after-commit-before-ack", 1.0)]
        );
        assert!(parse("").unwrap().is_empty());
        assert!(
            parse("nope=1")
                .unwrap_err()
                .reason()
                .contains("unknown crash point")
        );
        assert!(
            parse("before-commit=2")
                .unwrap_err()
                .reason()
                .contains("from 0 to 1")
        );
        assert!(
            parse("before-commit")
                .unwrap_err()
                .reason()
                .contains("NAME=PROBABILITY")
        );
    }
}
