//! Dead letters: the record a dead-lettered copy carries (`record`), and the
//! operators' tools on a dead-letter queue (`queue`).

mod edit;
mod fingerprint;
mod identity;
mod ingest;
mod layout;
mod queue;
mod record;
mod replay;

pub use edit::{EditError, edit_letter, set_payload_fields};
pub use fingerprint::{error_shape, fingerprint};
pub use identity::{letter_id, letter_id_of_content};
pub use ingest::{
    DEFAULT_MAX_STORED_BODY, DEFAULT_RESOLVED_RETENTION, Ingester, REDACTED, unstored_queue_name,
};
pub use queue::{DeadLetter, DeadLetterQueue, ReplayReport, Replayed, Selection};
pub use record::DeadLetterInfo;
pub use replay::{CopyOutcome, DEFAULT_OUTCOME_TIMEOUT, MAX_REPLAY_RUN, ReplayError, Replayer};

/// Deletes every letter in `state` whose state last changed before `before`,
/// a batch of [`PURGE_BATCH`](crate::retention::PURGE_BATCH) per statement so
/// that no statement holds its locks for long; how many went. Auditing is the
/// caller's: who purged, and why, is theirs to say.
pub async fn purge_letters<S: crate::store::DeadLetterStore>(
    store: &S,
    state: crate::store::LetterState,
    before: chrono::DateTime<chrono::Utc>,
) -> Result<u64, crate::store::StoreError> {
    let batch = crate::retention::PURGE_BATCH;
    let mut total = 0;
    loop {
        let gone = store.purge_dead_letters(state, before, batch).await?;
        total += gone;
        if gone < u64::from(batch) {
            return Ok(total);
        }
    }
}

/// A letter's replays, oldest first, each with the outcomes the journal kept
/// for its copy: what `warren dead-letters show` and the console's letter
/// page both show.
pub async fn replays_with_outcomes<S>(
    store: &S,
    letter_id: &str,
) -> Result<
    Vec<(crate::store::LetterReplay, Vec<crate::store::JournalEntry>)>,
    crate::store::StoreError,
>
where
    S: crate::store::DeadLetterStore + crate::store::Journal,
{
    let replays = store.letter_replays(letter_id).await?;
    let mut with = Vec::with_capacity(replays.len());
    for replay in replays {
        let outcomes = store.journal_of_replay(&replay.replay_id).await?;
        with.push((replay, outcomes));
    }
    Ok(with)
}
