//! What a delivery's outcome means: a pure decision from what happened in the
//! transaction, the message's history, the retry policy and the time, to what
//! to tell the broker. Carrying it out is the pipeline's `settle`, a separate
//! step.

use std::time::Duration;

use crate::failure::{DeadLetterReason, HandlerError};
use crate::retry::{Delay, RetryDecision, RetryPolicy};
use crate::store::{
    StoreError, error_text, is_after_abort, is_connection_error, is_lock_conflict,
    is_permanent_data_error,
};

/// How a delivery's earlier life reads from its (verified) headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct History {
    /// Failed attempts before this one (`x-warren-attempt`, believed only under
    /// warren's signature).
    pub(crate) failed_attempts: u32,
    /// When a strict-sequence gap started waiting (milliseconds since the
    /// epoch), if this is a parked copy.
    pub(crate) gap_since_ms: Option<i64>,
}

impl History {
    /// The number of the attempt now starting.
    pub(crate) fn attempt(&self) -> u32 {
        self.failed_attempts.saturating_add(1)
    }
}

/// What the decision weighs besides the outcome and the history.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rules<'a> {
    /// Delay tiers and the attempt limit.
    pub(crate) retry: &'a RetryPolicy,
    /// How long a strict-sequence gap may wait for the versions before it.
    pub(crate) gap_patience: Duration,
}

/// What the transaction did when it committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Applied {
    /// The claim was new; the handler's work committed with it.
    Committed,
    /// The message id was already claimed: a duplicate, handler not run.
    Duplicate,
    /// The version gate found the version stale: the claim committed, the
    /// effect did not run.
    Stale,
}

/// Why the transaction did not commit.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The handler returned an error.
    Handler(HandlerError),
    /// The handler panicked; the text is the panic's.
    Panic(String),
    /// One of warren's own statements (begin, claim, commit) failed.
    Store(StoreError),
    /// The handler returned success, but an earlier statement had aborted the
    /// transaction (it ignored a database error).
    Aborted(StoreError),
}

/// What to tell the broker about a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Ack: the outcome is recorded in the database.
    Ack(Applied),
    /// Send a copy to the retry tier of `delay`, then ack.
    Retry {
        /// The tier.
        delay: Duration,
        /// The attempt that failed (1-based).
        attempt: u32,
        /// Why, for the copy's headers and the log.
        error: String,
    },
    /// Send a copy to the dead-letter queue, then ack.
    DeadLetter {
        /// The reason it is filed under.
        reason: DeadLetterReason,
        /// The error text.
        error: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The database is unreachable: put the message back without using an
    /// attempt, and pause intake until the database answers.
    Return {
        /// Why, for the log.
        error: String,
    },
    /// Strict sequence: the version before this one has not applied; send a
    /// copy to the retry tier of `delay` without using an attempt, then ack.
    Park {
        /// The tier (the shortest).
        delay: Duration,
        /// When the gap started waiting (milliseconds since the epoch).
        since_ms: i64,
        /// Why, for the log.
        error: String,
    },
    /// On a partition queue, the delivery's key belongs to partition `home`:
    /// send a copy to `queue`, that partition's, then ack.
    Forward {
        /// The partition the key hashes to.
        home: u32,
        /// Its queue.
        queue: String,
    },
    /// A suspect outran its solo deadline: put the delivery itself back
    /// (`nack` with requeue), so that it stays a suspect and its recorded solo
    /// run counts like a crash.
    Requeue {
        /// Why, for the log.
        error: String,
    },
}

impl Disposition {
    /// A dead letter for a reason found before any transaction (validation,
    /// routing, poison).
    pub(crate) fn dead_letter(reason: DeadLetterReason, error: String, attempts: u32) -> Self {
        Disposition::DeadLetter {
            reason,
            error,
            attempts,
        }
    }
}

/// Decides what `applied` means for a delivery with `history`, at `now_ms`
/// (milliseconds since the epoch). Pure: no I/O, and the time is given.
///
/// A version gap parks the message in the shortest tier without using an
/// attempt, until the gap patience runs out; then it is dead-lettered as
/// `version-gap`.
pub(crate) fn decide(
    applied: Result<Applied, Failure>,
    history: &History,
    rules: Rules<'_>,
    now_ms: i64,
) -> Disposition {
    let Err(Failure::Handler(HandlerError::VersionGap(gap))) = &applied else {
        return decide_attempt(applied, history.attempt(), rules.retry);
    };
    let since_ms = history.gap_since_ms.unwrap_or(now_ms);
    let waited = Duration::from_millis(u64::try_from(now_ms - since_ms).unwrap_or(0));
    match rules.retry.tiers().first() {
        Some(&delay) if waited < rules.gap_patience => Disposition::Park {
            delay,
            since_ms,
            error: gap.to_string(),
        },
        _ => Disposition::dead_letter(
            DeadLetterReason::VersionGap,
            format!(
                "{gap}; waited {} for the versions before it (gap patience {})",
                Delay(waited),
                Delay(rules.gap_patience)
            ),
            history.attempt(),
        ),
    }
}

/// Decides what `applied` means for attempt number `attempt` (1-based) under
/// `policy`, a version gap aside.
fn decide_attempt(
    applied: Result<Applied, Failure>,
    attempt: u32,
    policy: &RetryPolicy,
) -> Disposition {
    let (error, retry_after) = match applied {
        Ok(applied) => return Disposition::Ack(applied),
        Err(Failure::Handler(HandlerError::Permanent { error })) => {
            return Disposition::dead_letter(
                DeadLetterReason::Permanent,
                error_text(error.as_ref()),
                attempt,
            );
        }
        // The database refused the data itself: every retry would fail alike.
        Err(Failure::Handler(e)) if database_error_in(e.error(), is_permanent_data_error) => {
            return refused(&error_text(e.error()), attempt);
        }
        Err(Failure::Store(e)) if e.is_permanent_data_error() => return refused(&e, attempt),
        // The database is down or restarting: no fault of the message, so it
        // costs no attempt.
        Err(Failure::Handler(e)) if database_error_in(e.error(), is_connection_error) => {
            return Disposition::Return {
                error: error_text(e.error()),
            };
        }
        Err(Failure::Store(e)) if e.is_connection_error() => {
            return Disposition::Return {
                error: e.to_string(),
            };
        }
        Err(Failure::Handler(e)) => (error_text(e.error()), e.retry_after_hint()),
        Err(Failure::Panic(text)) => (format!("handler panicked: {text}"), None),
        Err(Failure::Aborted(e)) => (
            format!(
                "the handler returned success, but an earlier statement had aborted its transaction \
                 (did it ignore a database error?): {e}"
            ),
            None,
        ),
        // Any other store error (a constraint checked at commit, a serialization
        // failure) is transient, with bounded attempts.
        Err(Failure::Store(e)) => (e.to_string(), None),
    };
    match policy.decide(attempt, retry_after) {
        RetryDecision::Retry { delay, attempt } => Disposition::Retry {
            delay,
            attempt,
            error,
        },
        RetryDecision::Exhausted { attempts } => Disposition::DeadLetter {
            reason: DeadLetterReason::RetriesExhausted,
            error,
            attempts,
        },
    }
}

fn refused(error: &dyn std::fmt::Display, attempts: u32) -> Disposition {
    Disposition::dead_letter(
        DeadLetterReason::Permanent,
        format!("the database refused the data: {error}"),
        attempts,
    )
}

/// True if `failure` is the database's being unreachable (the connection broke),
/// not the message's fault: what [`decide`] returns to the queue at no cost
/// of an attempt.
pub(crate) fn is_outage(failure: &Failure) -> bool {
    match failure {
        Failure::Handler(e) => database_error_in(e.error(), is_connection_error),
        Failure::Store(e) => e.is_connection_error(),
        Failure::Panic(_) | Failure::Aborted(_) => false,
    }
}

/// True if `failure` is a lock conflict with another transaction (a
/// deadlock, a serialization failure, a lock wait past its timeout), from
/// warren's own statements or the handler's: rerun at once in a fresh
/// transaction, at no cost of an attempt, before it counts as transient.
pub(crate) fn is_conflict(failure: &Failure) -> bool {
    match failure {
        Failure::Handler(e) => database_error_in(e.error(), is_lock_conflict),
        Failure::Store(e) => e.is_lock_conflict(),
        Failure::Panic(_) | Failure::Aborted(_) => false,
    }
}

/// True if `failure` is a handler's statement refused because an earlier
/// statement had aborted the transaction (PostgreSQL): in a unit of several,
/// the handler that ignored that earlier failure may be another message's,
/// so the failure names no message.
pub(crate) fn is_after_abort_of(failure: &Failure) -> bool {
    match failure {
        Failure::Handler(e) => database_error_in(e.error(), is_after_abort),
        _ => false,
    }
}

/// Asks `test` of the first database error in `error`'s chain (a handler may
/// wrap it); false if there is none.
fn database_error_in(
    error: &(dyn std::error::Error + 'static),
    test: fn(&sqlx::Error) -> bool,
) -> bool {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = current {
        if let Some(sqlx_error) = e.downcast_ref::<sqlx::Error>() {
            return test(sqlx_error);
        }
        if let Some(StoreError::Database(sqlx_error)) = e.downcast_ref::<StoreError>() {
            return test(sqlx_error);
        }
        current = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn policy() -> RetryPolicy {
        RetryPolicy::new([100 * MS, 200 * MS]).with_max_attempts(3)
    }

    fn outage() -> StoreError {
        StoreError::Database(sqlx::Error::PoolTimedOut)
    }

    #[test]
    fn committed_and_duplicates_are_acked() {
        for applied in [Applied::Committed, Applied::Duplicate] {
            assert_eq!(
                decide_attempt(Ok(applied), 1, &policy()),
                Disposition::Ack(applied)
            );
        }
    }

    #[test]
    fn permanent_failures_are_dead_lettered_at_once() {
        let d = decide_attempt(
            Err(Failure::Handler(HandlerError::permanent("never"))),
            1,
            &policy(),
        );
        assert_eq!(
            d,
            Disposition::dead_letter(DeadLetterReason::Permanent, "never".into(), 1)
        );
    }

    #[test]
    fn transient_failures_climb_the_tiers_then_are_exhausted() {
        let failed = || Err(Failure::Handler(HandlerError::transient("later")));
        assert!(matches!(
            decide_attempt(failed(), 1, &policy()),
            Disposition::Retry { delay, attempt: 1, .. } if delay == 100 * MS
        ));
        assert!(matches!(
            decide_attempt(failed(), 2, &policy()),
            Disposition::Retry { delay, attempt: 2, .. } if delay == 200 * MS
        ));
        assert_eq!(
            decide_attempt(failed(), 3, &policy()),
            Disposition::DeadLetter {
                reason: DeadLetterReason::RetriesExhausted,
                error: "later".into(),
                attempts: 3
            }
        );
        assert!(
            matches!(
                decide_attempt(failed(), u32::MAX, &policy()),
                Disposition::DeadLetter {
                    reason: DeadLetterReason::RetriesExhausted,
                    ..
                }
            ),
            "a count at the top of the range is exhausted, never wrapped"
        );
    }

    #[test]
    fn retry_after_picks_a_long_enough_tier() {
        let failed = Err(Failure::Handler(
            HandlerError::transient("rate limited").retry_after(150 * MS),
        ));
        assert!(matches!(
            decide_attempt(failed, 1, &policy()),
            Disposition::Retry { delay, .. } if delay == 200 * MS
        ));
    }

    #[test]
    fn panics_and_aborted_transactions_are_transient() {
        assert!(matches!(
            decide_attempt(Err(Failure::Panic("boom".into())), 1, &policy()),
            Disposition::Retry { error, .. } if error.contains("boom")
        ));
        assert!(matches!(
            decide_attempt(Err(Failure::Aborted(StoreError::Config("x".into()))), 1, &policy()),
            Disposition::Retry { error, .. } if error.contains("ignore a database error")
        ));
    }

    #[test]
    fn database_outages_return_the_message_without_an_attempt() {
        assert!(matches!(
            decide_attempt(Err(Failure::Store(outage())), 1, &policy()),
            Disposition::Return { .. }
        ));
        // A handler that `?`-ed a lost connection: the error is in its chain.
        let handler = HandlerError::transient(outage());
        assert!(matches!(
            decide_attempt(Err(Failure::Handler(handler)), 3, &policy()),
            Disposition::Return { .. }
        ));
    }

    #[test]
    fn other_store_errors_use_up_attempts() {
        let other = StoreError::Config("constraint at commit".into());
        assert!(matches!(
            decide_attempt(Err(Failure::Store(other)), 1, &policy()),
            Disposition::Retry { attempt: 1, .. }
        ));
    }

    #[test]
    fn a_version_gap_parks_without_an_attempt_until_its_patience_runs_out() {
        let gap = || {
            Err(Failure::Handler(HandlerError::VersionGap(
                crate::failure::VersionGap {
                    entity: "cus_1".into(),
                    stored: 3,
                    got: 5,
                },
            )))
        };
        let rules = Rules {
            retry: &policy(),
            gap_patience: Duration::from_secs(10),
        };
        let first = History::default();
        assert_eq!(
            decide(gap(), &first, rules, 1_000),
            Disposition::Park {
                delay: 100 * MS,
                since_ms: 1_000,
                error: "version gap for \"cus_1\": expected version 4, got version 5".into()
            },
            "the first wait starts now"
        );
        let parked = History {
            failed_attempts: 0,
            gap_since_ms: Some(1_000),
        };
        assert!(matches!(
            decide(gap(), &parked, rules, 10_999),
            Disposition::Park {
                since_ms: 1_000,
                ..
            }
        ));
        assert!(matches!(
            decide(gap(), &parked, rules, 11_000),
            Disposition::DeadLetter {
                reason: DeadLetterReason::VersionGap,
                attempts: 1,
                ..
            }
        ));
        // A clock that went back counts as no wait at all.
        assert!(matches!(
            decide(gap(), &parked, rules, 0),
            Disposition::Park {
                since_ms: 1_000,
                ..
            }
        ));
    }

    #[test]
    fn lock_conflicts_are_told_apart_from_other_failures() {
        assert!(!is_conflict(&Failure::Panic("x".into())));
        assert!(!is_conflict(&Failure::Store(outage())));
        assert!(!is_conflict(&Failure::Handler(HandlerError::transient(
            "x"
        ))));
    }
}
