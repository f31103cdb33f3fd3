//! The inbox core of a store: what a consumer needs to apply a message once.

use std::future::Future;

use chrono::{DateTime, Utc};

use super::{Dialect, StoreError, Tx, Wakeups};

/// One row of the inbox: the claim a consumer makes on a message id.
#[derive(Debug, Clone)]
pub struct InboxEntry<'a> {
    /// The deduplication boundary: one consumer's view of the message stream.
    pub consumer_name: &'a str,
    /// The producer's message id.
    pub message_id: &'a str,
    /// The event type, kept for operators.
    pub event_type: &'a str,
    /// The correlation id, kept for operators.
    pub correlation_id: Option<&'a str>,
    /// When the delivery reached the consumer.
    pub received_at: DateTime<Utc>,
}

store_trait! {
    /// A transactional store: the inbox and the handler's transaction, the core
    /// every backend implements. What a backend adds beyond it are capabilities of
    /// their own ([`SigningKey`](super::SigningKey), [`SoloRuns`](super::SoloRuns),
    /// [`Leases`](super::Leases), [`Retention`](super::Retention),
    /// [`OutboxStore`](super::OutboxStore)); a consumer needs the first three
    /// ([`ConsumerStore`](super::ConsumerStore)).
    ///
    /// Implemented by `PgStore` (feature `postgres`), `SqliteStore` (`sqlite`) and
    /// `MySqlStore` (`mysql`), each a [`SqlStore`](super::SqlStore) over its
    /// dialect, with every capability.
    pub trait Store: Clone + Send + Sync + 'static {
        /// The sqlx database the handler's transaction belongs to.
        type Db: Dialect;

        /// Applies warren's migrations for this dialect. Safe to call from several
        /// processes at once.
        fn migrate(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

        /// Checks that the database answers.
        fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
        /// Wakes the outbox relays running on this store (and its clones) now
        /// instead of at their next poll.
        fn wakeups(&self) -> &Wakeups;

        /// Begins a transaction that is allowed to write. Its commit first checks
        /// that it can still commit (see [`StoreError::Aborted`]).
        fn begin(&self) -> impl Future<Output = Result<Tx<Self::Db>, StoreError>> + Send;

        /// Begins a transaction like [`begin`](Self::begin) in which a wait for a
        /// row lock fails after `lock_timeout` as a lock conflict
        /// ([`StoreError::is_lock_conflict`]) instead of after the server's own
        /// timeout (`None` keeps that): PostgreSQL's `lock_timeout`, MySQL's and
        /// MariaDB's `innodb_lock_wait_timeout` (whole seconds). The consumer sets
        /// it on a transaction over several messages, so that a conflict between
        /// batches costs milliseconds and the batch is split, rather than waiting
        /// a second for PostgreSQL's deadlock detector. SQLite has no such wait.
        fn begin_with_lock_timeout(
            &self,
            lock_timeout: Option<std::time::Duration>,
        ) -> impl Future<Output = Result<Tx<Self::Db>, StoreError>> + Send {
            let _ = lock_timeout;
            self.begin()
        }

        /// Claims `entry` inside `tx` by inserting its inbox row (`INSERT ... ON
        /// CONFLICT DO NOTHING`). Returns `false` if the consumer already claimed this
        /// message id: a duplicate. A copy in flight elsewhere makes this call wait
        /// until that transaction ends.
        fn claim<'a>(
            &'a self,
            tx: &'a mut Tx<Self::Db>,
            entry: &'a InboxEntry<'a>,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

        /// Claims every one of `entries` (distinct message ids) inside `tx`, in
        /// the order given, and says which were new: one statement where the
        /// dialect allows it, one per entry where it does not. A batch claims its
        /// messages sorted by id, so that two batches never wait on each other in
        /// a cycle.
        fn claim_all<'a>(
            &'a self,
            tx: &'a mut Tx<Self::Db>,
            entries: &'a [InboxEntry<'a>],
        ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send + 'a {
            async move {
                let mut claimed = Vec::with_capacity(entries.len());
                for entry in entries {
                    claimed.push(self.claim(tx, entry).await?);
                }
                Ok(claimed)
            }
        }

        /// True if `consumer`'s claim of `message_id` committed: the message
        /// was applied (or found a duplicate of one that was). Read outside
        /// any transaction; a claim still in flight elsewhere is not seen.
        fn claimed<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

        /// Takes back, inside `tx`, a claim made in `tx` for a message the
        /// transaction will not apply: a batch that reached its time limit leaves
        /// the rest of its messages to the next transaction, claims included.
        fn unclaim<'a>(
            &'a self,
            tx: &'a mut Tx<Self::Db>,
            consumer: &'a str,
            message_id: &'a str,
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;
    }
}
