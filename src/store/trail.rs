//! What the database remembers of one message, for `warren trace`: the
//! inbox rows of each consumer that applied it, the journal of each outcome
//! that wrote no inbox row (a retry rolls its claim back, a duplicate writes
//! nothing), and the outbox rows it caused or that published it.

use std::future::Future;

use chrono::{DateTime, Utc};

use super::{JournalEntry, Store, StoreError};

/// One consumer's inbox row for a message: it was claimed and applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxRecord {
    /// The consumer that applied it.
    pub consumer: String,
    /// Its event type, as the envelope said.
    pub event_type: String,
    /// When the delivery that applied it arrived.
    pub received_at: DateTime<Utc>,
    /// When its transaction wrote the row (the commit follows at once).
    pub processed_at: DateTime<Utc>,
}

/// An outbox row, as `warren trace` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The row id: the publish order.
    pub id: i64,
    /// The outgoing message id.
    pub message_id: String,
    /// The message whose handler wrote it, if any (none before warren
    /// stored it).
    pub causation_id: Option<String>,
    /// Its event type ("" if the stored properties do not read).
    pub event_type: String,
    /// The exchange it goes to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// When it was written.
    pub written_at: Option<DateTime<Utc>>,
    /// When the broker confirmed it; `None` while pending or failed.
    pub published_at: Option<DateTime<Utc>>,
    /// When the relay gave up on it.
    pub failed_at: Option<DateTime<Utc>>,
    /// Publish attempts.
    pub attempts: i64,
    /// The last publish error.
    pub last_error: Option<String>,
    /// The W3C `traceparent` it carries.
    pub traceparent: Option<String>,
}

store_trait! {
    /// One message's trail through this database.
    pub trait Trail: Store {
        /// Every consumer's inbox row for `message_id`, oldest first.
        fn inbox_records<'a>(
            &'a self,
            message_id: &'a str,
        ) -> impl Future<Output = Result<Vec<InboxRecord>, StoreError>> + Send + 'a;

        /// Every consumer's journaled outcomes for `message_id`, oldest
        /// first, at most `limit`.
        fn journal_records<'a>(
            &'a self,
            message_id: &'a str,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<JournalEntry>, StoreError>> + Send + 'a;

        /// The outbox row that published `message_id`, if this outbox did,
        /// and the rows whose handler handled it, in id order.
        fn outbox_records<'a>(
            &'a self,
            message_id: &'a str,
        ) -> impl Future<Output = Result<Vec<OutboxRecord>, StoreError>> + Send + 'a;
    }
}
