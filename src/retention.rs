//! Inbox retention: how long a consumer must remember the messages it applied.
//!
//! Deleting an inbox row forgets that its message was applied; a copy arriving
//! after that is applied again. The window must outlast everything that can bring
//! a copy back: the retry tiers, and the time within which an operator may replay
//! dead letters or a producer may republish.

use std::time::Duration;

use chrono::Utc;

use crate::retry::{RetryPolicy, format_delay};
use crate::store::{Retention, StoreError};

/// Default margin for replays and republishing on top of the retry horizon.
pub const DEFAULT_REPLAY_MARGIN: Duration = Duration::from_secs(7 * 24 * 3600);

/// Rows deleted per statement.
pub const PURGE_BATCH: u32 = 1000;

/// Checks that a retention `window` is long enough for `policy` plus `margin`.
/// The error says how long it must be and why.
pub fn check_window(
    window: Duration,
    policy: &RetryPolicy,
    margin: Duration,
) -> Result<(), String> {
    let minimum = policy.horizon().saturating_add(margin);
    if window < minimum {
        return Err(format!(
            "a retention of {} is shorter than the consumer's retry horizon ({}) plus the replay margin ({}): \
             a copy arriving after its inbox row is deleted would be applied again. \
             Use at least {}, or --force if you know no copy can still arrive",
            human(window),
            human(policy.horizon()),
            human(margin),
            human(minimum)
        ));
    }
    Ok(())
}

/// `7d`, `42m35s`, `7d42m35s`: whole units, largest first.
fn human(d: Duration) -> String {
    let mut secs = d.as_secs();
    if secs == 0 {
        return format_delay(d);
    }
    let mut out = String::new();
    for (unit, size) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if secs >= size {
            out.push_str(&format!("{}{unit}", secs / size));
            secs %= size;
        }
    }
    out
}

/// The longest retention window warren accepts (1000 years): longer ones do not
/// fit in a date, and no deployment keeps rows that long.
pub const MAX_RETENTION: Duration = Duration::from_secs(1000 * 365 * 86_400);

/// The instant `window` before now, or `None` if the window is longer than
/// [`MAX_RETENTION`] (subtracting it unchecked overflows the date and panics).
pub fn cutoff(window: Duration) -> Option<chrono::DateTime<Utc>> {
    if window > MAX_RETENTION {
        return None;
    }
    Utc::now().checked_sub_signed(chrono::Duration::from_std(window).ok()?)
}

/// The error for a window over [`MAX_RETENTION`].
pub(crate) fn window_too_long(what: &str, window: Duration) -> String {
    format!(
        "{what} of {} is longer than the most warren accepts ({})",
        human(window),
        human(MAX_RETENTION)
    )
}

/// Deletes inbox rows of `consumer` older than `window`, in bounded batches.
/// Returns how many were deleted. Check the window with [`check_window`] first;
/// a window over [`MAX_RETENTION`] is an error.
pub async fn purge_inbox<S: Retention>(
    store: &S,
    consumer: &str,
    window: Duration,
) -> Result<u64, StoreError> {
    let cutoff = cutoff(window)
        .ok_or_else(|| StoreError::Config(window_too_long("an inbox retention", window)))?;
    let mut deleted = 0;
    loop {
        let n = store.purge_inbox(consumer, cutoff, PURGE_BATCH).await?;
        deleted += n;
        if n < u64::from(PURGE_BATCH) {
            return Ok(deleted);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_must_cover_horizon_and_margin() {
        let policy = RetryPolicy::default(); // 5s+30s+2m+10m+30m = 42m35s
        let day = Duration::from_secs(86_400);
        assert!(check_window(30 * day, &policy, DEFAULT_REPLAY_MARGIN).is_ok());
        let err = check_window(day, &policy, DEFAULT_REPLAY_MARGIN).unwrap_err();
        assert!(
            err.contains("1d") && err.contains("7d") && err.contains("--force"),
            "{err}"
        );
        assert!(err.contains("42m35s") && err.contains("7d42m35s"), "{err}");
        assert!(check_window(day, &policy, Duration::ZERO).is_ok());
    }

    /// Regression (issue 10): `inbox purge --older-than 100000000d` and
    /// `with_retention(Duration::MAX)` panicked subtracting the window from now.
    #[test]
    fn windows_past_any_date_are_refused_not_panicked_on() {
        let day = Duration::from_secs(86_400);
        assert!(cutoff(100_000_000 * day).is_none());
        assert!(cutoff(Duration::MAX).is_none());
        assert!(cutoff(MAX_RETENTION).is_some());
        assert!(cutoff(7 * day).is_some_and(|t| t < Utc::now()));
        let relay = crate::relay_config::RelayConfig::new("r").with_retention(Duration::MAX);
        assert!(relay.validate().is_err());
        assert!(relay.with_retention(7 * day).validate().is_ok());
    }
}
