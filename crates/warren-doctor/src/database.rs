//! The checks on a consumer's database: warren's tables and their version,
//! the inbox against its retention window, the outbox backlog, unresolved
//! dead letters, and the database's clock against the host's.

use std::time::Duration;

use chrono::Utc;

use super::report::{Check, Status};
use warren::store::{Checkup, DeadLetterStore, OutboxStore};

const DATABASE: &str = "database";

/// What the database checks measure against.
#[derive(Debug, Clone)]
pub struct DatabaseExpectations {
    /// The consumer whose inbox is checked.
    pub consumer: String,
    /// Its inbox retention window; `None` if nothing purges the inbox.
    pub inbox_retention: Option<Duration>,
    /// The oldest pending outbox row's age past which the relay counts as
    /// behind (default 60 s).
    pub outbox_age_limit: Duration,
    /// Clock skew past which the check warns (default 1 s); ten times it fails.
    pub skew_limit: Duration,
}

impl DatabaseExpectations {
    /// The defaults for `consumer`, without a retention window.
    pub fn new(consumer: impl Into<String>) -> Self {
        DatabaseExpectations {
            consumer: consumer.into(),
            inbox_retention: None,
            outbox_age_limit: Duration::from_secs(60),
            skew_limit: Duration::from_secs(1),
        }
    }
}

/// Every database check; a query that fails is reported, never raised.
pub async fn check_database<S>(store: &S, expect: &DatabaseExpectations) -> Vec<Check>
where
    S: Checkup + OutboxStore + DeadLetterStore,
{
    let mut checks = Vec::new();
    match store.migration_version().await {
        Ok((applied, known)) if applied == known => checks.push(Check::new(
            "migrations",
            DATABASE,
            Status::Pass,
            format!("warren's tables at version {applied}, as this build"),
        )),
        Ok((applied, known)) if applied < known => checks.push(
            Check::new(
                "migrations",
                DATABASE,
                Status::Warn,
                format!(
                    "warren's tables at version {applied}; this build brings {known}: the \
                     consumer applies the rest when it starts"
                ),
            )
            .fix("start the consumer (it migrates), then run the doctor again"),
        ),
        Ok((applied, known)) => checks.push(
            Check::new(
                "migrations",
                DATABASE,
                Status::Fail,
                format!(
                    "warren's tables at version {applied}, newer than this build's {known}: a \
                     newer warren migrated them"
                ),
            )
            .fix("run the warren version that migrated the database, or a newer one"),
        ),
        Err(e) if is_missing_table(&e.to_string()) => {
            checks.push(
                Check::new(
                    "migrations",
                    DATABASE,
                    Status::Warn,
                    format!(
                        "no warren tables in this database ({e}); the other database checks skipped"
                    ),
                )
                .fix(
                    "a consumer creates its tables when it first starts; if one has run on it, \
                     this is not its database",
                ),
            );
            return checks;
        }
        Err(e) => {
            checks.push(
                Check::new(
                    "migrations",
                    DATABASE,
                    Status::Fail,
                    format!("warren's tables cannot be read: {e}"),
                )
                .fix("check the database URL; a consumer creates the tables when it first starts"),
            );
            return checks;
        }
    }
    checks.push(inbox(store, expect).await);
    checks.push(match store.outbox_counts().await {
        Ok(counts) => {
            let age = counts.oldest_pending_age_seconds(Utc::now());
            if counts.failed > 0 {
                Check::new(
                    "outbox",
                    DATABASE,
                    Status::Warn,
                    format!(
                        "{} rows the relay gave up on; {} pending, the oldest {age:.0} s old",
                        counts.failed, counts.pending
                    ),
                )
                .fix("read them with `warren outbox status`, then `warren outbox retry-failed`")
            } else if age > expect.outbox_age_limit.as_secs_f64() {
                Check::new(
                    "outbox",
                    DATABASE,
                    Status::Warn,
                    format!(
                        "{} rows pending, the oldest {age:.0} s old (more than {} s): the relay \
                         is not running or the broker refuses it",
                        counts.pending,
                        expect.outbox_age_limit.as_secs()
                    ),
                )
                .fix("check that a consumer or relay runs on this database, and its logs")
            } else {
                Check::new(
                    "outbox",
                    DATABASE,
                    Status::Pass,
                    format!("{} rows pending, the oldest {age:.0} s old", counts.pending),
                )
            }
        }
        Err(e) => Check::new(
            "outbox",
            DATABASE,
            Status::Fail,
            format!("cannot read: {e}"),
        ),
    });
    checks.push(match store.dead_letter_stats().await {
        Ok(stats) => {
            let unresolved: u64 = stats.unresolved_by_group.iter().map(|(_, n)| n).sum();
            if unresolved == 0 {
                Check::new(
                    "dead-letters",
                    DATABASE,
                    Status::Pass,
                    "no unresolved dead letters",
                )
            } else {
                Check::new(
                    "dead-letters",
                    DATABASE,
                    Status::Warn,
                    format!(
                        "{unresolved} unresolved dead letters in {} groups, the oldest last failed {}",
                        stats.unresolved_by_group.len(),
                        stats
                            .oldest_unresolved
                            .map_or_else(|| "at an unknown time".to_owned(), |t| t.to_rfc3339())
                    ),
                )
                .fix("`warren dead-letters groups`, then replay or resolve them")
            }
        }
        Err(e) => Check::new(
            "dead-letters",
            DATABASE,
            Status::Fail,
            format!("cannot read: {e}"),
        ),
    });
    checks.push(clock(store, expect).await);
    checks
}

/// A database's "no such table" in its own words.
fn is_missing_table(error: &str) -> bool {
    ["does not exist", "no such table", "doesn't exist"]
        .iter()
        .any(|m| error.contains(m))
}

async fn inbox<S: Checkup>(store: &S, expect: &DatabaseExpectations) -> Check {
    let window = expect.inbox_retention;
    let cutoff = window
        .and_then(warren::admin::cutoff)
        // Without a window only the count matters; any date every database
        // stores will do.
        .unwrap_or(chrono::DateTime::<Utc>::UNIX_EPOCH);
    match store.inbox_size(&expect.consumer, cutoff).await {
        Err(e) => Check::new("inbox", DATABASE, Status::Fail, format!("cannot read: {e}")),
        Ok(size) => match window {
            None => Check::new(
                "inbox",
                DATABASE,
                Status::Warn,
                format!(
                    "{} rows of consumer {:?}, and no retention window: nothing purges them",
                    size.rows, expect.consumer
                ),
            )
            .fix("set an inbox retention window, or purge with `warren inbox purge`"),
            Some(window) if size.older > 0 => Check::new(
                "inbox",
                DATABASE,
                Status::Warn,
                format!(
                    "{} of {} rows of consumer {:?} are older than the {} s retention window: \
                     the purge is not keeping up, or not running",
                    size.older,
                    size.rows,
                    expect.consumer,
                    window.as_secs()
                ),
            )
            .fix("check the consumer's retention task, or run `warren inbox purge`"),
            Some(window) => Check::new(
                "inbox",
                DATABASE,
                Status::Pass,
                format!(
                    "{} rows of consumer {:?}, none older than the {} s retention window",
                    size.rows,
                    expect.consumer,
                    window.as_secs()
                ),
            ),
        },
    }
}

async fn clock<S: Checkup>(store: &S, expect: &DatabaseExpectations) -> Check {
    let before = Utc::now();
    let read = store.database_now().await;
    let after = Utc::now();
    match read {
        Err(e) => Check::new(
            "clock-skew",
            DATABASE,
            Status::Fail,
            format!("cannot read: {e}"),
        ),
        Ok(None) => Check::new(
            "clock-skew",
            DATABASE,
            Status::Pass,
            "an embedded database: it reads this host's clock",
        ),
        Ok(Some(theirs)) => skew(theirs, before, after, expect.skew_limit),
    }
}

/// The database's clock read at `theirs`, between `before` and `after` on
/// this host's.
fn skew(
    theirs: chrono::DateTime<Utc>,
    before: chrono::DateTime<Utc>,
    after: chrono::DateTime<Utc>,
    limit: Duration,
) -> Check {
    // Against the middle of the round trip, so its length is no skew.
    let ours = before + (after - before) / 2;
    let skew = (theirs - ours).abs().to_std().unwrap_or_default();
    let round_trip = (after - before).to_std().unwrap_or_default();
    let detail = format!(
        "the database's clock is {} ms {} this host's (round trip {} ms)",
        skew.as_millis(),
        if theirs >= ours { "ahead of" } else { "behind" },
        round_trip.as_millis()
    );
    let fix = "synchronize both clocks (NTP): message ages, retention and leases compare them";
    if skew > limit * 10 {
        Check::new("clock-skew", DATABASE, Status::Fail, detail).fix(fix)
    } else if skew > limit {
        Check::new("clock-skew", DATABASE, Status::Warn, detail).fix(fix)
    } else {
        Check::new("clock-skew", DATABASE, Status::Pass, detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_is_measured_from_the_middle_of_the_round_trip() {
        let before = Utc::now();
        let after = before + chrono::Duration::milliseconds(400);
        let limit = Duration::from_secs(1);
        let at = |ms| before + chrono::Duration::milliseconds(ms);
        // Read half-way through a 400 ms round trip: no skew at all.
        let same = skew(at(200), before, after, limit);
        assert_eq!(same.status, Status::Pass);
        assert!(
            same.detail.starts_with("the database's clock is 0 ms"),
            "{same:?}"
        );
        let ahead = skew(at(200 + 3_000), before, after, limit);
        assert_eq!(ahead.status, Status::Warn);
        assert!(ahead.detail.contains("3000 ms ahead of"), "{ahead:?}");
        let behind = skew(at(200 - 15_000), before, after, limit);
        assert_eq!(behind.status, Status::Fail);
        assert!(behind.detail.contains("15000 ms behind"), "{behind:?}");
    }
}
