//! Retry policy as data: delay tiers, an attempt limit, and the crash-loop limit.
//!
//! A transient failure moves the message to the retry queue of the tier its
//! attempt number (and any retry-after) calls for; the queue's TTL sends it back
//! to the main queue. After the last attempt it is dead-lettered.

use std::fmt;
use std::time::Duration;

use crate::config_error::ConfigError;

/// The default delay tiers: 5 s, 30 s, 2 min, 10 min, 30 min.
pub const DEFAULT_TIERS: [Duration; 5] = [
    Duration::from_secs(5),
    Duration::from_secs(30),
    Duration::from_secs(120),
    Duration::from_secs(600),
    Duration::from_secs(1800),
];

/// Default number of solo runs without any recorded outcome (the process died
/// while the message ran alone) after which a message is treated as poison.
pub const DEFAULT_POISON_LIMIT: u32 = 5;

/// What to do with a message whose attempt failed transiently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Send it to the tier with this delay; `attempt` failed attempts so far.
    Retry {
        /// Delay of the chosen tier.
        delay: Duration,
        /// Failed attempts so far, written to `x-warren-attempt`.
        attempt: u32,
    },
    /// No attempts left: dead-letter it as `retries-exhausted`.
    Exhausted {
        /// Attempts made.
        attempts: u32,
    },
}

/// Delay tiers and limits for one consumer.
///
/// ```
/// use std::time::Duration;
/// use warren::retry::RetryPolicy;
/// use warren::retry::RetryDecision;
///
/// let policy = RetryPolicy::new([Duration::from_secs(5), Duration::from_secs(30)]).with_max_attempts(3);
/// // The first failure waits in the first tier...
/// assert_eq!(policy.decide(1, None), RetryDecision::Retry { delay: Duration::from_secs(5), attempt: 1 });
/// // ...unless the dependency asked for longer: the shortest tier at least that long.
/// assert_eq!(policy.decide(1, Some(Duration::from_secs(10))), RetryDecision::Retry { delay: Duration::from_secs(30), attempt: 1 });
/// assert_eq!(policy.decide(2, None), RetryDecision::Retry { delay: Duration::from_secs(30), attempt: 2 });
/// // The third failure was the last attempt.
/// assert_eq!(policy.decide(3, None), RetryDecision::Exhausted { attempts: 3 });
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    tiers: Vec<Duration>,
    max_attempts: u32,
    poison_limit: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new(DEFAULT_TIERS)
    }
}

impl RetryPolicy {
    /// Tiers in any order (they are sorted and deduplicated); the attempt limit
    /// defaults to one first attempt plus one per tier.
    pub fn new(tiers: impl IntoIterator<Item = Duration>) -> Self {
        let mut tiers: Vec<Duration> = tiers.into_iter().collect();
        tiers.sort_unstable();
        tiers.dedup();
        let max_attempts = u32::try_from(tiers.len())
            .unwrap_or(u32::MAX)
            .saturating_add(1);
        Self {
            tiers,
            max_attempts,
            poison_limit: DEFAULT_POISON_LIMIT,
        }
    }

    /// Sets the total number of attempts, the first included.
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Sets how many solo runs that ended without an outcome (the process died
    /// while the message ran alone) make a message poison.
    pub fn with_poison_limit(mut self, limit: u32) -> Self {
        self.poison_limit = limit;
        self
    }

    /// The tiers, shortest first.
    pub fn tiers(&self) -> &[Duration] {
        &self.tiers
    }

    /// Total attempts, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Solo runs without an outcome after which a message is poison.
    pub fn poison_limit(&self) -> u32 {
        self.poison_limit
    }

    /// The longest a message can spend in retry tiers: the delays of every retry
    /// it may get. Inbox retention must be longer than this.
    pub fn horizon(&self) -> Duration {
        // Saturating, and without a loop per attempt: tiers and attempts come
        // from operators' flags, and a plain sum overflows and panics.
        let Some(last) = self.tiers.last() else {
            return Duration::ZERO;
        };
        let retries = self.max_attempts.saturating_sub(1) as usize;
        let listed = retries.min(self.tiers.len());
        let beyond = u32::try_from(retries - listed).unwrap_or(u32::MAX);
        self.tiers[..listed]
            .iter()
            .fold(Duration::ZERO, |sum, t| sum.saturating_add(*t))
            .saturating_add(last.saturating_mul(beyond))
    }

    fn tier_for(&self, failed: u32, retry_after: Option<Duration>) -> Duration {
        let last = self.tiers.len().saturating_sub(1);
        let by_attempt = (failed.saturating_sub(1) as usize).min(last);
        let by_hint = retry_after
            .map(|hint| self.tiers.iter().position(|t| *t >= hint).unwrap_or(last))
            .unwrap_or(0);
        self.tiers[by_attempt.max(by_hint)]
    }

    /// Decides what happens after the `failed`-th attempt failed transiently.
    pub fn decide(&self, failed: u32, retry_after: Option<Duration>) -> RetryDecision {
        if failed >= self.max_attempts || self.tiers.is_empty() {
            return RetryDecision::Exhausted { attempts: failed };
        }
        RetryDecision::Retry {
            delay: self.tier_for(failed, retry_after),
            attempt: failed,
        }
    }

    /// Checks the policy; the error names the setting and says what to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |field: &str, reason: String| Err(ConfigError::new(field, reason));
        if self.tiers.is_empty() {
            return fail("retry tiers", "at least one delay is needed".into());
        }
        if let Some(t) = self.tiers.iter().find(|t| t.as_millis() == 0) {
            return fail(
                "retry tiers",
                format!("a delay must be at least 1 ms, got {t:?}"),
            );
        }
        if self.tiers.iter().any(|t| t.as_millis() > i64::MAX as u128) {
            return fail("retry tiers", "delay too long".into());
        }
        if self.max_attempts == 0 {
            return fail("max attempts", "must be at least 1".into());
        }
        if self.poison_limit == 0 {
            return fail("poison limit", "must be at least 1".into());
        }
        Ok(())
    }
}

/// Formats a delay the way tier queue names carry it: `500ms`, `5s`, `2m`, `1h`.
pub fn format_delay(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// Parses `500ms`, `5s`, `2m`, `1h`, `30d` (days, for retention windows).
pub fn parse_delay(s: &str) -> Result<Duration, ConfigError> {
    parse_delay_text(s).map_err(|reason| ConfigError::new("delay", reason))
}

fn parse_delay_text(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{s:?} has no unit: use ms, s, m, h or d (e.g. 5s)"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|e: std::num::ParseIntError| {
        if *e.kind() == std::num::IntErrorKind::PosOverflow {
            format!("{s:?} is too long")
        } else {
            format!("{s:?} does not start with a whole number")
        }
    })?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        other => {
            return Err(format!(
                "{s:?} has unknown unit {other:?}: use ms, s, m, h or d"
            ));
        }
    }
    .ok_or_else(|| format!("{s:?} is too long"))?;
    Ok(Duration::from_millis(ms))
}

/// A delay shown as in queue names.
pub(crate) struct Delay(pub(crate) Duration);

impl fmt::Display for Delay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_delay(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn default_policy_retries_once_per_tier() {
        let p = RetryPolicy::default();
        assert_eq!(p.max_attempts(), 6);
        let delays: Vec<_> = (1..6)
            .map(|n| match p.decide(n, None) {
                RetryDecision::Retry { delay, .. } => delay,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(delays, DEFAULT_TIERS);
        assert_eq!(p.decide(6, None), RetryDecision::Exhausted { attempts: 6 });
        assert_eq!(p.horizon(), DEFAULT_TIERS.iter().sum::<Duration>());
    }

    #[test]
    fn more_attempts_than_tiers_repeat_the_longest() {
        let p = RetryPolicy::new([ms(100), ms(200)]).with_max_attempts(5);
        assert_eq!(
            p.decide(4, None),
            RetryDecision::Retry {
                delay: ms(200),
                attempt: 4
            }
        );
        assert_eq!(p.horizon(), ms(100 + 200 + 200 + 200));
    }

    #[test]
    fn retry_after_longer_than_every_tier_takes_the_longest() {
        let p = RetryPolicy::new([ms(100), ms(200)]);
        assert_eq!(
            p.decide(1, Some(Duration::from_secs(60))),
            RetryDecision::Retry {
                delay: ms(200),
                attempt: 1
            }
        );
    }

    #[test]
    fn delays_format_and_parse() {
        for (d, s) in [
            (ms(500), "500ms"),
            (ms(5000), "5s"),
            (ms(120_000), "2m"),
            (ms(3_600_000), "1h"),
            (ms(1500), "1500ms"),
        ] {
            assert_eq!(format_delay(d), s);
            assert_eq!(parse_delay(s).unwrap(), d);
        }
        assert_eq!(
            parse_delay("30d").unwrap(),
            Duration::from_secs(30 * 86_400)
        );
        assert!(parse_delay("5").unwrap_err().reason().contains("no unit"));
        assert!(
            parse_delay("5x")
                .unwrap_err()
                .reason()
                .contains("unknown unit")
        );
        assert!(parse_delay("s").is_err());
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(
            RetryPolicy::new([])
                .validate()
                .unwrap_err()
                .reason()
                .contains("at least one")
        );
        assert!(
            RetryPolicy::default()
                .with_max_attempts(0)
                .validate()
                .is_err()
        );
        assert!(RetryPolicy::default().validate().is_ok());
    }

    /// Regression (issue 10): operators' flags could overflow the horizon's sum
    /// (a panic), and a number too big for any unit was called "not a number".
    #[test]
    fn huge_delays_do_not_panic() {
        let huge = parse_delay("9223372036854775807ms").unwrap();
        let p = RetryPolicy::new([huge]).with_max_attempts(u32::MAX);
        assert_eq!(p.horizon(), Duration::MAX);
        assert!(crate::retention::check_window(Duration::MAX, &p, Duration::MAX).is_ok());
        assert!(
            parse_delay("99999999999999999999999d")
                .unwrap_err()
                .reason()
                .contains("too long")
        );
        assert!(
            parse_delay("300000000000000000d")
                .unwrap_err()
                .reason()
                .contains("too long")
        );
    }
}
