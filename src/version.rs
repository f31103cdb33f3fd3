//! Version gates: per-entity versions checked inside the business transaction,
//! so that a stale or early update never applies out of order.
//!
//! [`Tx::check_version`](crate::Tx::check_version) reads the last applied version
//! of an entity from `warren_versions` (locking its row until the transaction
//! ends), decides, and stores the new version when the update applies, all in
//! the transaction that carries the effect.

pub use crate::failure::VersionGap;

/// How versions of one entity follow each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionMode {
    /// For "set" events (the new state in full): any newer version applies, a
    /// version not newer than the stored one is stale.
    LatestWins,
    /// For deltas: only the version right after the stored one applies. An older
    /// one is stale; a newer one is a gap and waits, parked in the shortest
    /// retry tier, for the versions before it.
    Strict,
}

/// What the gate decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Apply the effect; the new version is recorded in the transaction.
    Apply {
        /// The version stored before (0 for a new entity).
        previous: i64,
    },
    /// Do not apply: a version at least as new already did. The message is
    /// acked, counted and logged as `stale`.
    Stale {
        /// The version stored.
        stored: i64,
    },
}

impl Verdict {
    /// True if the effect should run.
    pub fn applies(self) -> bool {
        matches!(self, Verdict::Apply { .. })
    }
}

/// The decision, pure: `Ok` with the verdict, or `Err(stored)` for a gap.
pub(crate) fn decide(mode: VersionMode, stored: i64, version: i64) -> Result<Verdict, i64> {
    if version <= stored {
        return Ok(Verdict::Stale { stored });
    }
    match mode {
        VersionMode::Strict if version != stored.saturating_add(1) => Err(stored),
        _ => Ok(Verdict::Apply { previous: stored }),
    }
}

/// What a transaction's gate saw, for the pipeline: counted as stale, and
/// written on dead-lettered copies so that replays can go in version order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Gated {
    /// The entity and the version checked, from the last call.
    pub(crate) entity: Option<GatedVersion>,
    /// The last call found the version stale.
    pub(crate) stale: bool,
}

/// An entity and the version of it the gate checked. Its order (entity, then
/// version) is the order replays of dead letters go in. Reached by warren's
/// own crates through `__kit`, not part of the API.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct GatedVersion {
    /// The entity, as the handler named it.
    pub entity: String,
    /// The version checked.
    pub version: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_wins_applies_any_newer_version() {
        assert_eq!(
            decide(VersionMode::LatestWins, 0, 1),
            Ok(Verdict::Apply { previous: 0 })
        );
        assert_eq!(
            decide(VersionMode::LatestWins, 2, 7),
            Ok(Verdict::Apply { previous: 2 })
        );
        assert_eq!(
            decide(VersionMode::LatestWins, 7, 7),
            Ok(Verdict::Stale { stored: 7 })
        );
        assert_eq!(
            decide(VersionMode::LatestWins, 7, 3),
            Ok(Verdict::Stale { stored: 7 })
        );
    }

    #[test]
    fn strict_applies_only_the_next_version() {
        assert_eq!(
            decide(VersionMode::Strict, 4, 5),
            Ok(Verdict::Apply { previous: 4 })
        );
        assert_eq!(decide(VersionMode::Strict, 4, 6), Err(4), "a gap");
        assert_eq!(
            decide(VersionMode::Strict, 4, 4),
            Ok(Verdict::Stale { stored: 4 })
        );
        assert_eq!(decide(VersionMode::Strict, 0, 2), Err(0));
    }
}
