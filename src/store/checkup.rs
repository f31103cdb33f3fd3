//! What `warren doctor` asks a database: its migration version, the inbox
//! against its retention window, and the database's clock.

use chrono::{DateTime, Utc};

use super::StoreError;

/// A consumer's inbox rows: all of them, and those older than a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboxSize {
    /// Rows of the consumer.
    pub rows: u64,
    /// Rows processed before the cutoff asked about.
    pub older: u64,
}

store_trait! {
    /// The questions of a health check, each one query.
    pub trait Checkup: super::Store {
        /// The highest migration recorded in `warren_migrations`, and the
        /// highest this build of warren knows.
        fn migration_version(
            &self,
        ) -> impl Future<Output = Result<(i64, i64), StoreError>> + Send + '_;

        /// `consumer`'s inbox rows, and how many were processed before `cutoff`.
        fn inbox_size<'a>(
            &'a self,
            consumer: &'a str,
            cutoff: DateTime<Utc>,
        ) -> impl Future<Output = Result<InboxSize, StoreError>> + Send + 'a;

        /// The database server's clock; `None` for an embedded database,
        /// which reads the host's.
        fn database_now(
            &self,
        ) -> impl Future<Output = Result<Option<DateTime<Utc>>, StoreError>> + Send + '_;
    }
}
