//! The outbox side of a store: what the relay and the operators' tools need.

use std::future::Future;

use chrono::{DateTime, Utc};

use super::{Store, StoreError};
use crate::outbox_row::{FailedRow, OutboxRow, OutboxStatus, RowOutcome};

store_trait! {
    /// The outbox side of a store: what the relay and the operators' tools need.
    pub trait OutboxStore: Store {
        /// Takes up to `limit` unpublished rows in order, passes them to `publish`,
        /// and records each row's outcome. On PostgreSQL the rows stay locked
        /// (`FOR UPDATE SKIP LOCKED`) until the outcomes are recorded, so another relay
        /// skips them. A row whose stored properties cannot be read is
        /// marked failed without being handed to `publish`. Returns the
        /// number of rows taken, those included.
        fn relay_batch<'a, F, Fut>(
            &'a self,
            limit: usize,
            publish: F,
        ) -> impl Future<Output = Result<usize, StoreError>> + Send + 'a
        where
            F: FnOnce(Vec<OutboxRow>) -> Fut + Send + 'a,
            Fut: Future<Output = Vec<(i64, RowOutcome)>> + Send + 'a;

        /// A listener that wakes the relay when rows are committed (PostgreSQL's
        /// `LISTEN`); `None` where the database has no such thing.
        fn listen(
            &self,
        ) -> impl Future<Output = Result<Option<OutboxListener>, StoreError>> + Send + '_ {
            async { Ok(None) }
        }

        /// Pending, published and failed counts and the oldest pending row, from one
        /// counting query: what the relay's gauges read every few seconds.
        fn outbox_counts(&self) -> impl Future<Output = Result<OutboxCounts, StoreError>> + Send + '_;

        /// The rows waiting to be published and the oldest of them, read
        /// through the index of pending rows, so that it costs the same
        /// whatever the table keeps of published rows: what the relay's gauges
        /// read.
        fn outbox_backlog(
            &self,
        ) -> impl Future<Output = Result<(i64, Option<DateTime<Utc>>), StoreError>> + Send + '_;

        /// Up to `limit` failed rows, oldest first.
        fn failed_outbox_rows(
            &self,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<FailedRow>, StoreError>> + Send + '_;

        /// The counts and every failed row. Loads all failed rows: use
        /// [`outbox_counts`](Self::outbox_counts) to monitor, and
        /// [`failed_outbox_rows`](Self::failed_outbox_rows) to list a bounded number.
        fn outbox_status(&self) -> impl Future<Output = Result<OutboxStatus, StoreError>> + Send + '_ {
            async {
                let counts = self.outbox_counts().await?;
                let failed = self
                    .failed_outbox_rows(u32::try_from(counts.failed).unwrap_or(u32::MAX))
                    .await?;
                Ok(OutboxStatus {
                    pending: counts.pending,
                    oldest_pending: counts.oldest_pending,
                    published: counts.published,
                    failed,
                })
            }
        }

        /// Puts failed rows (all, or those with the given ids) back in the queue.
        fn retry_failed<'a>(
            &'a self,
            ids: &'a [i64],
        ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

        /// Deletes up to `batch` rows published before `cutoff`; returns how many.
        fn delete_published_before(
            &self,
            cutoff: DateTime<Utc>,
            batch: u32,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send + '_;
    }
}

/// Notifications that outbox rows were committed.
pub struct OutboxListener {
    #[cfg(feature = "postgres")]
    inner: sqlx::postgres::PgListener,
}

impl OutboxListener {
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(inner: sqlx::postgres::PgListener) -> Self {
        Self { inner }
    }

    /// Waits for the next notification. If the listening connection breaks, the
    /// listener reconnects; until then it waits a little, leaving the relay to
    /// its poll.
    pub async fn recv(&mut self) {
        #[cfg(feature = "postgres")]
        if self.inner.recv().await.is_ok() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// The outbox's rows by state, counted in the database.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxCounts {
    /// Rows waiting to be published.
    pub pending: i64,
    /// When the oldest waiting row was written.
    pub oldest_pending: Option<DateTime<Utc>>,
    /// Rows published and not yet deleted by housekeeping.
    pub published: i64,
    /// Rows the relay gave up on.
    pub failed: i64,
}

impl OutboxCounts {
    /// Age of the oldest pending row, in seconds (0 when nothing is pending).
    pub fn oldest_pending_age_seconds(&self, now: DateTime<Utc>) -> f64 {
        self.oldest_pending
            .map(|t| (now - t).num_milliseconds().max(0) as f64 / 1000.0)
            .unwrap_or(0.0)
    }
}
