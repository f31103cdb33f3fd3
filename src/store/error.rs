//! The store's error, the questions callers ask of it, and what it means inside a
//! handler.

use crate::failure::HandlerError;

/// A database error as text. sqlx's own text of a PostgreSQL error ends in
/// " at line N": the line of PostgreSQL's C source that raised it, which
/// tells a reader nothing (and differs between PostgreSQL builds, so it
/// would split one cause into several dead-letter groups). This is sqlx's
/// text without it; any other error (MySQL's, with its error number;
/// SQLite's) is sqlx's text as it is.
pub fn database_text(e: &sqlx::Error) -> String {
    #[cfg(feature = "postgres")]
    if let sqlx::Error::Database(db) = e
        && let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
    {
        return format!("error returned from database: {}", pg.message());
    }
    e.to_string()
}

/// An error from a handler as text: a database error as
/// [`database_text`] gives it, any other as it displays itself.
pub fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    if let Some(db) = e.downcast_ref::<sqlx::Error>() {
        return database_text(db);
    }
    e.to_string()
}

/// An error from a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database refused or could not be reached.
    #[error("database error: {}", database_text(.0))]
    Database(#[from] sqlx::Error),
    /// The transaction could not commit because an earlier statement had aborted
    /// it (PostgreSQL then turns `COMMIT` into a silent rollback). Nothing was
    /// applied and the transaction is rolled back. Inside a handler this means it
    /// ignored a failed statement; see [`is_aborted`](Self::is_aborted).
    #[error("the transaction had been aborted by an earlier statement: {}", database_text(.0))]
    Aborted(#[source] sqlx::Error),
    /// A migration failed to apply.
    #[error("migration {version} ({name}) failed: {}", database_text(source))]
    Migration {
        /// Migration number.
        version: i64,
        /// Migration name.
        name: &'static str,
        /// The database's error.
        source: sqlx::Error,
    },
    /// The database URL or options are not usable.
    #[error("invalid database configuration: {0}")]
    Config(String),
    /// A message handed to the outbox could never be published (a field too long
    /// for its AMQP property, say). Nothing was written.
    #[error("message refused by the outbox: {0}")]
    InvalidMessage(String),
}

impl StoreError {
    /// True if the database could not be reached or the connection broke; retrying
    /// later is the right response.
    pub fn is_connection_error(&self) -> bool {
        match self {
            StoreError::Database(e) => is_connection_error(e),
            _ => false,
        }
    }

    /// True if the database refused a value that no retry can make acceptable; see
    /// [`is_permanent_data_error`].
    pub fn is_permanent_data_error(&self) -> bool {
        match self {
            StoreError::Database(e) => is_permanent_data_error(e),
            _ => false,
        }
    }

    /// True if a commit found its transaction already aborted by an earlier
    /// statement, so nothing was applied ([`StoreError::Aborted`]).
    pub fn is_aborted(&self) -> bool {
        matches!(self, StoreError::Aborted(_))
    }

    /// True if the transaction lost a race for a lock; see [`is_lock_conflict`].
    pub fn is_lock_conflict(&self) -> bool {
        match self {
            StoreError::Database(e) => is_lock_conflict(e),
            _ => false,
        }
    }
}

/// A store error inside a handler (writing to the outbox, say) is transient, for
/// the same reasons as [`sqlx::Error`], except a message the outbox refused as
/// unpublishable: the same message would be refused on every attempt.
impl From<StoreError> for HandlerError {
    fn from(e: StoreError) -> Self {
        if matches!(e, StoreError::InvalidMessage(_)) {
            HandlerError::permanent(e)
        } else {
            HandlerError::transient(e)
        }
    }
}

/// True if `e` is the database refusing the data itself, so that running the same
/// message again would fail the same way:
///
/// - PostgreSQL: SQLSTATE class `22` (data exception: a NUL byte in text, a value
///   too long for `varchar(n)`, a number out of range, text that is not a number),
///   class `54` (program limit exceeded: an index row or a statement too large) and
///   `23514` (a `CHECK` constraint);
/// - SQLite: `SQLITE_TOOBIG` (18, a string or blob over the length limit),
///   `SQLITE_MISMATCH` (20, a datatype mismatch), `SQLITE_CONSTRAINT_DATATYPE`
///   (3091, a value of the wrong type in a `STRICT` table) and
///   `SQLITE_CONSTRAINT_CHECK` (275);
/// - MySQL and MariaDB, in strict SQL mode: 1264 (out of range), 1265 (data
///   truncated), 1292 (incorrect date or number), 1300 (invalid character
///   string), 1365 (division by zero), 1366 (incorrect value for a column), 1367
///   (illegal value), 1406 (data too long), 1690 (value out of range in an
///   expression), 3140 (invalid JSON), 3819 and 4025 (a failed `CHECK`).
///
/// Unique, foreign-key, not-null and exclusion violations are left out on purpose:
/// they depend on other rows (a concurrent insert, a parent or reference row that
/// has not arrived yet), so a later attempt can succeed.
// Without a backend there is no error code to read.
#[cfg_attr(
    not(any(feature = "postgres", feature = "sqlite")),
    allow(unused_variables)
)]
pub fn is_permanent_data_error(e: &sqlx::Error) -> bool {
    let Some(db) = e.as_database_error() else {
        return false;
    };
    #[cfg(feature = "postgres")]
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        let code = pg.code();
        return code.starts_with("22") || code.starts_with("54") || code == "23514";
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // sqlx reports SQLite's extended result code; its low byte is the primary.
        let Some(code) = db.code().and_then(|c| c.parse::<i32>().ok()) else {
            return false;
        };
        return matches!(code & 0xff, 18 | 20) || matches!(code, 275 | 3091);
    }
    #[cfg(feature = "mysql")]
    if let Some(n) = mysql_error_number(e) {
        return MYSQL_DATA_ERRORS.contains(&n);
    }
    false
}

/// The MySQL and MariaDB errors [`is_permanent_data_error`] lists.
#[cfg(feature = "mysql")]
pub(crate) const MYSQL_DATA_ERRORS: &[u16] = &[
    1264, 1265, 1292, 1300, 1365, 1366, 1367, 1406, 1690, 3140, 3819, 4025,
];

/// MySQL and MariaDB errors that mean the server is going away or dropped the
/// connection: 1053 (shutdown in progress), 1152 and 1184 (connection aborted),
/// 1927 (MariaDB: connection killed), 2002, 2003, 2006 and 2013 (cannot connect,
/// server gone, connection lost), 4031 (MySQL: disconnected by the server).
const MYSQL_CONNECTION_ERRORS: &[u16] = &[1053, 1152, 1184, 1927, 2002, 2003, 2006, 2013, 4031];

/// The MySQL or MariaDB error number of `e`, if it is a MySQL server error.
#[cfg_attr(not(feature = "mysql"), allow(unused_variables))]
pub(crate) fn mysql_error_number(e: &sqlx::Error) -> Option<u16> {
    #[cfg(feature = "mysql")]
    if let Some(my) = e
        .as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
    {
        return Some(my.number());
    }
    None
}

/// True if `e` means the transaction lost a race for a lock with another one,
/// so that running it again at once in a fresh transaction can succeed:
///
/// - PostgreSQL: a deadlock (`40P01`), a serialization failure (`40001`), a
///   lock wait past `lock_timeout` (`55P03`);
/// - MySQL and MariaDB: a deadlock (1213), a lock wait past
///   `innodb_lock_wait_timeout` (1205).
///
/// SQLite has one writer and no deadlocks: a lock it waited for past its busy
/// timeout counts as an unreachable database instead.
pub fn is_lock_conflict(e: &sqlx::Error) -> bool {
    if let Some(n) = mysql_error_number(e) {
        return matches!(n, 1205 | 1213);
    }
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| matches!(c.as_ref(), "40P01" | "40001" | "55P03"))
}

/// True if `e` is PostgreSQL refusing a statement because an earlier one had
/// already aborted the transaction (`25P02`): the fault lies with whoever ran
/// and ignored that earlier statement, not with the statement refused.
pub(crate) fn is_after_abort(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "25P02")
}

/// True if `e` means the database cannot be reached or is going away: a broken
/// or unobtainable connection, PostgreSQL's admin shutdown, crash shutdown and
/// "cannot connect now" (starting up), or MySQL's and MariaDB's shutdown and
/// lost-connection errors.
pub fn is_connection_error(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
    ) || mysql_error_number(e).is_some_and(|n| MYSQL_CONNECTION_ERRORS.contains(&n))
        || e.as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|c| matches!(c.as_ref(), "57P01" | "57P02" | "57P03"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aborted_commit_is_told_apart_from_other_failures() {
        let aborted = StoreError::Aborted(sqlx::Error::Protocol("25P02".into()));
        assert!(aborted.is_aborted());
        assert!(!aborted.is_connection_error());
        let lost = StoreError::Database(sqlx::Error::PoolClosed);
        assert!(!lost.is_aborted());
        assert!(lost.is_connection_error());
    }

    #[test]
    fn only_a_refused_message_is_permanent_in_a_handler() {
        let refused: HandlerError = StoreError::InvalidMessage("too long".into()).into();
        assert!(refused.is_permanent());
        let lost: HandlerError = StoreError::Database(sqlx::Error::PoolClosed).into();
        assert!(lost.is_transient());
    }
}
