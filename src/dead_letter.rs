//! Dead letters as the runtime writes them: the record a dead-lettered copy
//! carries (`record`) and the id of its failure (`identity`). The operators'
//! tools on dead letters (ingestion into the store, browsing and replaying a
//! queue, editing, fingerprints) are the `warren_admin` crate's.

mod identity;
pub(crate) mod record;

pub use identity::{letter_id, letter_id_of_content};
pub use record::DeadLetterInfo;
