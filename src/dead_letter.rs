//! Dead letters: the record a dead-lettered copy carries (`record`), and the
//! operators' tools on a dead-letter queue (`queue`).

mod edit;
mod fingerprint;
mod identity;
mod ingest;
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
