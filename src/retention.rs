//! Inbox retention: how long a consumer must remember the messages it applied.
//!
//! Deleting an inbox row forgets that its message was applied; a copy arriving
//! after that is applied again. The window must outlast everything that can bring
//! a copy back: the retry tiers, and the time within which an operator may replay
//! dead letters or a producer may republish.

use std::time::Duration;

use chrono::Utc;

use crate::retry::{RetryPolicy, format_delay};
use crate::store::{Store, StoreError};

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
    let minimum = policy.horizon() + margin;
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

/// Deletes inbox rows of `consumer` older than `window`, in bounded batches.
/// Returns how many were deleted. Check the window with [`check_window`] first.
pub async fn purge_inbox<S: Store>(
    store: &S,
    consumer: &str,
    window: Duration,
) -> Result<u64, StoreError> {
    let cutoff = Utc::now() - chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
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
}
