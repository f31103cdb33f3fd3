//! The delivery journal: one small record per delivery outcome, for the
//! careful replay (which continues only on the outcome its own replay id
//! earned) and for following one message's history.

use std::future::Future;

use chrono::{DateTime, Utc};

use super::{Store, StoreError, Tx};

/// One delivery's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    /// The consumer.
    pub consumer: String,
    /// The message id ("" if it had none).
    pub message_id: String,
    /// The replay that sent this copy ("" if none).
    pub replay_id: String,
    /// `applied`, `duplicate`, `stale`, `retried`, `parked`,
    /// `dead-lettered`, `returned` or `forwarded`; `replayed` when a replay
    /// published the copy.
    pub outcome: String,
    /// The error, for a failure; else "".
    pub detail: String,
    /// When it was settled.
    pub at: DateTime<Utc>,
}

impl JournalEntry {
    /// The outcome, with its detail in brackets if it has one.
    pub fn described(&self) -> String {
        match self.detail.as_str() {
            "" => self.outcome.clone(),
            d => format!("{} ({d})", self.outcome),
        }
    }
}

store_trait! {
    /// The delivery journal.
    pub trait Journal: Store {
        /// Writes `entries` in `tx`: an applied outcome rides in the
        /// transaction that applied it, and costs no round trip of its own.
        fn journal_in<'a>(
            &'a self,
            tx: &'a mut Tx<Self::Db>,
            entries: &'a [JournalEntry],
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

        /// Writes `entries` in a transaction of their own.
        fn write_journal<'a>(
            &'a self,
            entries: &'a [JournalEntry],
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

        /// The outcomes journaled for the copies of a replay run, oldest first,
        /// at most `limit`; only failures (`retried`, `dead-lettered`) if
        /// `failures_only`.
        fn journal_of_run<'a>(
            &'a self,
            run_id: &'a str,
            failures_only: bool,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<JournalEntry>, StoreError>> + Send + 'a;

        /// The outcomes journaled for one replay id, oldest first.
        fn journal_of_replay<'a>(
            &'a self,
            replay_id: &'a str,
        ) -> impl Future<Output = Result<Vec<JournalEntry>, StoreError>> + Send + 'a;

        /// One message's outcomes at one consumer, oldest first, at most `limit`.
        fn journal_of_message<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<JournalEntry>, StoreError>> + Send + 'a;

        /// Deletes up to `limit` entries written before `before`; how many went.
        fn purge_journal(
            &self,
            before: DateTime<Utc>,
            limit: u32,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send + '_;
    }
}
