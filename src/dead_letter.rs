//! Dead letters: the record a dead-lettered copy carries (`record`), and the
//! operators' tools on a dead-letter queue (`queue`).

mod queue;
mod record;

pub use queue::{DeadLetter, DeadLetterQueue, ReplayReport, Replayed, Selection};
pub use record::DeadLetterInfo;
