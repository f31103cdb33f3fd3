//! Dead letters: the record a dead-lettered copy carries (`record`), and the
//! operators' tools on a dead-letter queue (`queue`).

mod identity;
mod queue;
mod record;

pub use identity::{letter_id, letter_id_of_content};
pub use queue::{DeadLetter, DeadLetterQueue, ReplayReport, Replayed, Selection};
pub use record::DeadLetterInfo;
