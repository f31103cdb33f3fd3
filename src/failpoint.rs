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

/// The crash points warren knows, and the environment variable read: from
/// the `warren_failpoints` crate, which a chaos kit uses without the runtime.
pub use warren_failpoints::{ENV, NAMES};

/// Parses a `name=probability;...` specification.
pub fn parse(spec: &str) -> Result<Vec<(&'static str, f64)>, ConfigError> {
    warren_failpoints::parse(spec).map_err(|reason| ConfigError::new(ENV, reason))
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
    fn a_bad_spec_is_a_config_error_naming_the_variable() {
        assert_eq!(
            parse("before-commit=0.5").unwrap(),
            [("before-commit", 0.5)]
        );
        let error = parse("nope=1").unwrap_err();
        assert!(error.to_string().contains(ENV), "{error}");
        assert!(error.reason().contains("unknown crash point"));
    }
}
