//! The operator's side of warren: dead letters moved from a consumer's
//! dead-letter queue into its store ([`Ingester`]), browsed, replayed and
//! purged on the broker ([`DeadLetterQueue`]), replayed from the store
//! ([`Replayer`]), edited ([`edit_letter`]) and grouped by fingerprint
//! ([`fingerprint`]); every value an operator types checked before a store
//! sees it ([`input`]). The `warren` CLI and the console are built on it; a
//! service runs the [`Ingester`] beside its consumer.
//!
//! What the runtime shares with these tools (the record a dead-lettered copy
//! carries, the dead-letter reasons, inbox retention, database URLs, printable
//! text) is `warren::admin`, re-exported here whole: one path,
//! `warren_admin::...`, for every operator's item.
//!
//! ```no_run
//! # async fn demo(store: warren::PgStore, config: warren::ConsumerConfig) -> Result<(), warren::Error> {
//! use warren_admin::Ingester;
//!
//! Ingester::new(store, &config)
//!     .redacting(["cardNumber", "iban"])
//!     .run("amqp://guest:guest@127.0.0.1:5672/%2f", warren::shutdown_signal())
//!     .await
//! # }
//! ```

mod browse;
mod edit;
mod fingerprint;
mod ingest;
pub mod input;
mod layout;
mod queue;
mod replay;

pub use edit::{EditError, edit_letter, set_payload_fields};
pub use fingerprint::{error_shape, fingerprint};
pub use ingest::{
    DEFAULT_MAX_STORED_BODY, DEFAULT_RESOLVED_RETENTION, Ingester, REDACTED, unstored_queue_name,
};
pub use queue::{DeadLetter, DeadLetterQueue, ReplayReport, Replayed, Selection};
pub use replay::{CopyOutcome, DEFAULT_OUTCOME_TIMEOUT, MAX_REPLAY_RUN, ReplayError, Replayer};
pub use warren::admin::*;

use warren::store::{
    DeadLetterStore, Journal, JournalEntry, LetterReplay, LetterState, StoreError,
};

/// Deletes every letter in `state` whose state last changed before `before`,
/// a batch of [`PURGE_BATCH`] per statement so
/// that no statement holds its locks for long; how many went. Auditing is the
/// caller's: who purged, and why, is theirs to say.
pub async fn purge_letters<S: DeadLetterStore>(
    store: &S,
    state: LetterState,
    before: chrono::DateTime<chrono::Utc>,
) -> Result<u64, StoreError> {
    let batch = PURGE_BATCH;
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
) -> Result<Vec<(LetterReplay, Vec<JournalEntry>)>, StoreError>
where
    S: DeadLetterStore + Journal,
{
    let replays = store.letter_replays(letter_id).await?;
    let mut with = Vec::with_capacity(replays.len());
    for replay in replays {
        let outcomes = store.journal_of_replay(&replay.replay_id).await?;
        with.push((replay, outcomes));
    }
    Ok(with)
}
