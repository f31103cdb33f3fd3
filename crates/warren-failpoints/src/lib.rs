//! The names of warren's crash points and the syntax that arms them.
//!
//! A service built with warren's cargo feature `failpoints` reads the
//! environment variable [`ENV`] (for example
//! `before-commit=0.01;after-commit-before-ack=0.02`) and, at each named
//! point, aborts the process with the given probability. This crate is what a
//! tool that starts such a service needs: the names, the variable and the
//! parser, with no dependency on the runtime.
//!
//! ```
//! use warren_failpoints::{ENV, parse};
//!
//! let armed = parse("after-commit-before-ack=0.02; before-commit=0.01").unwrap();
//! assert_eq!(armed, [("after-commit-before-ack", 0.02), ("before-commit", 0.01)]);
//! assert!(parse("after-comit=1").unwrap_err().contains("unknown crash point"));
//! assert_eq!(ENV, "WARREN_FAILPOINTS");
//! ```

/// The points warren knows, in the order a delivery or an outbox row meets them:
///
/// - `before-commit`: the handler ran, its transaction is not committed;
/// - `after-commit-before-ack`: a single delivery's transaction committed,
///   the broker has no ack;
/// - `after-batch-commit-before-ack`: the same for a batch of deliveries;
/// - `batch-commit-outcome-unknown`: does not abort; the first time it fires,
///   a batch that committed reports its connection lost during `COMMIT`, the
///   case where the consumer cannot know whether the commit happened;
/// - `relay-after-publish-before-mark`: the relay's publish was confirmed, the
///   outbox row is not yet marked sent.
pub const NAMES: &[&str] = &[
    "before-commit",
    "after-commit-before-ack",
    "after-batch-commit-before-ack",
    "batch-commit-outcome-unknown",
    "relay-after-publish-before-mark",
];

/// The environment variable a service reads its armed points from.
pub const ENV: &str = "WARREN_FAILPOINTS";

/// Parses a `name=probability;...` specification into its points, each name
/// one of [`NAMES`] and each probability from 0 to 1; blank items are
/// skipped. The error says which item is wrong and why.
pub fn parse(spec: &str) -> Result<Vec<(&'static str, f64)>, String> {
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
        assert!(parse(" ; ;").unwrap().is_empty());
        assert!(parse("nope=1").unwrap_err().contains("unknown crash point"));
        assert!(
            parse("before-commit=2")
                .unwrap_err()
                .contains("from 0 to 1")
        );
        assert!(
            parse("before-commit=-0.1")
                .unwrap_err()
                .contains("from 0 to 1")
        );
        assert!(
            parse("before-commit=NaN")
                .unwrap_err()
                .contains("from 0 to 1")
        );
        assert!(
            parse("before-commit")
                .unwrap_err()
                .contains("NAME=PROBABILITY")
        );
    }
}
