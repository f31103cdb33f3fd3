//! What one SQL database needs to say for warren's store to run on it.
//!
//! The operations whose SQL differs only in dialect (placeholders, time
//! functions, how a batch is limited) are written once, in [`super::sql`],
//! against the statements a dialect supplies in [`Statements`]. What really
//! differs between databases is a hook on [`SqlDialect`]:
//!
//! - how a writing transaction begins ([`Statements::begin`]) and how concurrent
//!   migrators are serialized ([`Statements::lock_migrations`] and
//!   [`Statements::unlock_migrations`]);
//! - the check that a transaction can still commit
//!   ([`SqlDialect::check_before_commit`]);
//! - how a relay takes a batch so that no other relay takes it too
//!   ([`SqlDialect::take_batch`]: row locks with `SKIP LOCKED`, or leases);
//! - wake-ups from other processes ([`Statements::notify_outbox`] and
//!   [`SqlDialect::listen`]);
//! - how a dialect tells a refused claim ([`SqlDialect::is_refused_claim`]).
//!
//! MySQL/MariaDB (`mysql`) fits the same shape: `BEGIN` and, as
//! [`Statements::after_begin`], a savepoint that the pre-commit check releases
//! (it is gone if DDL or a deadlock ended the transaction); `GET_LOCK` /
//! `RELEASE_LOCK` around migrations; a claim that is a plain `INSERT` whose
//! duplicate-key error 1062 is a refused claim; `FOR UPDATE SKIP LOCKED` to take
//! a batch; no `LISTEN`, so no notify statement and no listener; having no
//! `RETURNING`, a [`Statements::solo_run_count`] query after the upsert; and
//! plain `?` placeholders, which work because every statement binds its values
//! in the order they appear.

use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::{Database, Decode, Encode, Pool, Type};

use super::migrations::Migrations;
use super::{OutboxListener, StoreError};
use crate::outbox_row::{NewOutboxRow, RawOutboxRow};

/// The SQL of one dialect, for the operations written once in this module.
///
/// Values are bound in the order each field's doc gives, which is also the order
/// their placeholders first appear in the SQL: `$1`, `$2`... on PostgreSQL,
/// `?1`, `?2`... on SQLite, and plain `?` works for a dialect that only has
/// positional placeholders (MySQL). Times are bound and read as
/// [`SqlDialect::Time`].
#[derive(Debug)]
pub struct Statements {
    /// Begins a transaction that will write: the write lock is taken up front
    /// where the database would otherwise upgrade a read lock half-way.
    pub begin: &'static str,
    /// Run right after [`begin`](Self::begin) in a handler's transaction, as
    /// plain text (no binds): a marker the pre-commit check looks for.
    pub after_begin: Option<&'static str>,
    /// Run just after [`begin`](Self::begin) in `migrate`, so that processes
    /// starting at once apply migrations one after another; `None` where the
    /// begin statement already serializes them.
    pub lock_migrations: Option<&'static str>,
    /// Releases a migration lock that the commit does not release, on the same
    /// connection, whether the migrations applied or not.
    pub unlock_migrations: Option<&'static str>,
    /// Checks that the database answers.
    pub ping: &'static str,
    /// (consumer, message id, event type, correlation id, received at): inserts
    /// the inbox row, affecting one row if the claim is new and none (or a
    /// refused-claim error) if the message id was claimed before.
    pub claim: &'static str,
    /// (consumer, message id): deletes the inbox row a batch claimed for a
    /// message it leaves to the next transaction.
    pub unclaim: &'static str,
    /// (consumer, message id): a row if the consumer's claim of the message
    /// id committed.
    pub claimed: &'static str,
    /// (consumer, cutoff, batch): deletes up to `batch` inbox rows processed
    /// before the cutoff.
    pub purge_inbox: &'static str,
    /// (consumer, cutoff, batch): deletes up to `batch` solo-run counts last
    /// touched before the cutoff.
    pub purge_solo_runs: &'static str,
    /// (consumer, message id): adds one to the solo-run count, creating it at
    /// 1, and returns it unless [`solo_run_count`](Self::solo_run_count) is
    /// set.
    pub record_solo_run: &'static str,
    /// (consumer, message id): reads the count back, for a dialect whose upsert
    /// cannot return it; run on the same transaction.
    pub solo_run_count: Option<&'static str>,
    /// (consumer, message id): forgets the solo-run count.
    pub clear_solo_runs: &'static str,
    /// (message id, exchange, routing key, properties, body, causation id,
    /// traceparent, tracestate, baggage): one outbox row.
    pub insert_outbox: &'static str,
    /// Wakes relays in other processes when the transaction that runs it
    /// commits; `None` where the database cannot. Run once per transaction
    /// that wrote outbox rows, as its pre-commit check (a statement in an
    /// aborted transaction fails), and only where no relay in this process
    /// serves the store: that one is woken in process. After each
    /// [`enqueue`](crate::outbox::enqueue), which cannot know when its
    /// caller's transaction ends.
    pub notify_outbox: Option<&'static str>,
    /// (ids, a JSON array of integers): the rows were published; frees their
    /// leases. One statement for a whole batch.
    pub mark_published: &'static str,
    /// (error, id): the row failed for good; frees any lease.
    pub mark_failed: &'static str,
    /// (error, id): the row stays pending for the next pass; frees any lease.
    pub mark_retry: &'static str,
    /// (): pending count, oldest pending creation time, published count, failed
    /// count.
    pub outbox_counts: &'static str,
    /// (): pending count and oldest pending creation time, read through the
    /// index of pending rows alone: what the relay's gauges read, however many
    /// published rows the table keeps.
    pub outbox_backlog: &'static str,
    /// (limit): id, message id, exchange, routing key, last error, attempts of
    /// failed rows, oldest first.
    pub failed_outbox_rows: &'static str,
    /// (): puts every failed row back in the queue.
    pub retry_all_failed: &'static str,
    /// (id): puts one failed row back in the queue.
    pub retry_failed_id: &'static str,
    /// (cutoff, batch): deletes up to `batch` rows published before the cutoff.
    pub delete_published_before: &'static str,
    /// (message id): consumer, event type, received at, processed at of each
    /// consumer's inbox row of the message.
    pub trail_inbox: &'static str,
    /// (message id, limit): consumer, replay id, outcome, detail, time of
    /// each journaled outcome of the message, in the order written.
    pub trail_journal: &'static str,
    /// (message id, message id): the outbox rows of the message or caused by
    /// it: id, message id, causation id, exchange, routing key, properties,
    /// written, published, failed, attempts, last error, traceparent.
    pub trail_outbox: &'static str,
    /// (name, value): stores a setting unless one of that name exists.
    pub insert_setting: &'static str,
    /// (name): reads a setting.
    pub select_setting: &'static str,
    /// Creates the lease row of one partition if missing: consumer, partition.
    pub lease_ensure: &'static str,
    /// Takes a free or expired lease: owner, expires, consumer, partition, now.
    pub lease_acquire: &'static str,
    /// Extends a lease still held: expires, consumer, partition, owner.
    pub lease_renew: &'static str,
    /// Gives a lease back: consumer, partition, owner.
    pub lease_release: &'static str,
    /// Every lease of a consumer: consumer. Columns partition, owner, expires.
    pub leases: &'static str,
    /// Announces a live instance: consumer, member, expires.
    pub member_beat: &'static str,
    /// Live instances, sorted: consumer, now.
    pub members: &'static str,
    /// Removes an instance, and any that expired long ago: consumer, member, cutoff.
    pub member_leave: &'static str,
    /// Creates an entity's version row at 0 if missing: scope, entity.
    pub version_ensure: &'static str,
    /// Reads an entity's version and locks the row: scope, entity.
    pub version_lock: &'static str,
    /// Stores an entity's version: version, scope, entity.
    pub version_set: &'static str,
}

/// A SQL database warren's store runs on: its statements and its hooks.
///
/// Implemented on the sqlx database types (`Postgres`, `Sqlite`) and reachable
/// only inside warren: [`Dialect`](super::Dialect) is sealed by it.
pub trait SqlDialect: Database {
    /// The dialect's statements.
    const SQL: Statements;
    /// The dialect's migrations.
    const MIGRATIONS: Migrations;

    /// How the dialect binds and reads a point in time.
    type Time: for<'q> Encode<'q, Self>
        + Type<Self>
        + for<'r> Decode<'r, Self>
        + Send
        + Sync
        + Unpin
        + 'static;

    /// `t` as the dialect stores it.
    fn time(t: DateTime<Utc>) -> Self::Time;

    /// A stored time as a `DateTime`, if it reads as one.
    fn parse_time(t: Self::Time) -> Option<DateTime<Utc>>;

    /// The `n`-th bind placeholder (from 1) of a statement built at run time,
    /// where the dialect claims several messages in one statement
    /// (`INSERT ... VALUES (...), (...) ON CONFLICT DO NOTHING RETURNING`);
    /// `None` where it claims one at a time.
    fn numbered_placeholder(_n: usize) -> Option<String> {
        None
    }

    /// Claims `entries` (distinct message ids, all of one consumer) on `conn`
    /// in one statement whose text is the same however many there are, and
    /// returns the message ids that were new; `None` where the dialect has no
    /// such statement (it then claims with numbered placeholders, or one at
    /// a time). A statement whose text changes with the number of rows is
    /// prepared anew for every size on every connection: a round trip more.
    fn claim_rows<'c>(
        _conn: &'c mut Self::Connection,
        _entries: &'c [super::InboxEntry<'c>],
    ) -> impl Future<Output = Result<Option<Vec<String>>, sqlx::Error>> + Send + 'c {
        async { Ok(None) }
    }

    /// How many rows a statement changed (sqlx has no trait for it).
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// Fails if the transaction on `conn` can no longer commit. Called by
    /// [`Tx::commit`](super::Tx::commit) just before `COMMIT`; with `notify`,
    /// the check is [`Statements::notify_outbox`] where the dialect has it, so
    /// that waking other processes' relays costs no round trip of its own.
    fn check_before_commit(
        conn: &mut Self::Connection,
        notify: bool,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Runs `sql`, which binds nothing (a savepoint statement), on `conn`.
    fn execute_raw<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Inserts outbox rows on `conn`, inside whatever transaction it is in:
    /// several in one statement.
    fn insert_outbox<'c>(
        conn: &'c mut Self::Connection,
        rows: &'c [NewOutboxRow<'c>],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'c;

    /// The stored version of `entity` in `scope` (0 if none), its row locked
    /// until the transaction ends. Behind the version gate.
    fn read_version<'c>(
        conn: &'c mut Self::Connection,
        scope: &'c str,
        entity: &'c str,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send + 'c;

    /// Stores `version` for `entity` in `scope` in the open transaction.
    fn write_version<'c>(
        conn: &'c mut Self::Connection,
        scope: &'c str,
        entity: &'c str,
        version: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'c;

    /// Takes up to `limit` unpublished rows, in any order, so that no other
    /// relay takes them until the outcomes are recorded. Returns the rows and,
    /// if the dialect holds the batch by keeping a transaction open, that
    /// transaction: the outcomes are then recorded and committed in it.
    fn take_batch(
        pool: &Pool<Self>,
        limit: i64,
    ) -> impl Future<Output = Result<TakenBatch<Self>, StoreError>> + Send + '_;

    /// A listener for outbox commits in other processes; `None` where the
    /// database has no such thing.
    fn listen(
        _pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Option<OutboxListener>, StoreError>> + Send + '_ {
        async { Ok(None) }
    }

    /// What to run right after `begin` so that, in this transaction, a wait
    /// for a row lock fails after `lock_timeout` (`Some`) or after the
    /// server's own timeout (`None`), as a lock conflict
    /// ([`is_lock_conflict`](super::is_lock_conflict)); `None` where there is
    /// nothing to run.
    fn lock_timeout_sql(_lock_timeout: Option<std::time::Duration>) -> Option<String> {
        None
    }

    /// How long a batch may run before it commits what it applied, unless the
    /// consumer sets a limit: where a transaction holds the one write lock
    /// (SQLite), everything else that writes waits behind it.
    const BATCH_TIME_LIMIT: Option<std::time::Duration> = None;

    /// True if the begin statement is sent as text that may hold more
    /// statements after it (PostgreSQL's simple query), so that what follows
    /// the begin costs no round trip of its own.
    const BEGIN_TAKES_MORE: bool = false;

    /// Stores a dead letter, binding in order: letter id, consumer, queue,
    /// message id, event type, correlation id, replay id, reason, error,
    /// attempts, original exchange, original routing key, first failure,
    /// last failure, fingerprint, group key, headers, properties, body, body
    /// truncated, payload (JSON text or NULL), redacted fields, entity,
    /// entity version (NULL if none), state. One stored before with
    /// the same id is left alone: nothing inserted, or (a dialect without
    /// `ON CONFLICT`) a refused-claim error ([`is_refused_claim`](Self::is_refused_claim)).
    const INSERT_DEAD_LETTER: &'static str;

    /// (cutoff, consumer): the consumer's inbox rows, and those processed
    /// before the cutoff, as two integers.
    const INBOX_SIZE: &'static str;

    /// The server's current time, one value; `None` for an embedded database.
    const DATABASE_NOW: Option<&'static str>;

    /// The size of `warren_dead_letters` with its indexes, in bytes, one
    /// value (NULL if unknown); `None` where the database cannot say.
    const DEAD_LETTER_BYTES: Option<&'static str>;

    /// The condition that text `column` equals one bound value byte for
    /// byte (no case folding, no padding), its placeholders taken from
    /// `next`; with how many times the value is bound.
    fn text_equals(next: &mut dyn FnMut() -> String, column: &str) -> (String, usize) {
        (format!("{column} = {}", next()), 1)
    }

    /// `column` as it sorts and compares by its bytes, whatever the
    /// database's default collation.
    fn binary(column: &str) -> String {
        column.to_owned()
    }

    /// The condition that a letter's payload has `field` (a dotted path of
    /// object keys) holding `value`: a JSON string equal to it byte for
    /// byte, or, where `value` is written as a JSON number within the input
    /// rules, a JSON number equal to it ([`number_texts`](crate::store::compare::number_texts)).
    /// Its placeholders are taken from `next`; with the values to bind, in
    /// order.
    fn payload_condition(
        next: &mut dyn FnMut() -> String,
        field: &str,
        value: &str,
    ) -> (String, Vec<String>);

    /// Where a lock timeout set by [`lock_timeout_sql`](Self::lock_timeout_sql)
    /// outlives the transaction (a session variable), what puts the session's
    /// own back; run before the transaction ends, so that the pooled
    /// connection goes back to the application as it came.
    const RESTORE_LOCK_TIMEOUT: Option<&'static str> = None;

    /// True if `e`, from the claim statement, means the message id was already
    /// claimed, for a dialect that refuses a duplicate with an error instead of
    /// ignoring it.
    fn is_refused_claim(_e: &sqlx::Error) -> bool {
        false
    }
}

/// How long a batch may hold the one write lock of a database that has one
/// (SQLite) before it commits what it applied: the consumer's default batch
/// time limit.
pub(crate) const ONE_WRITER_BATCH_TIME_LIMIT: std::time::Duration =
    std::time::Duration::from_millis(100);

/// What [`SqlDialect::take_batch`] took: the transaction holding the rows, if the
/// dialect keeps one open, and the rows.
pub(crate) type TakenBatch<D> = (Option<sqlx::Transaction<'static, D>>, Vec<RawOutboxRow>);

impl Statements {
    /// Every statement with its name and the number of values it binds, as
    /// documented on each field.
    #[cfg(test)]
    pub(crate) fn with_arity(&self) -> Vec<(&'static str, &'static str, usize)> {
        let mut all = vec![
            ("begin", self.begin, 0),
            ("ping", self.ping, 0),
            ("claim", self.claim, 5),
            ("unclaim", self.unclaim, 2),
            ("claimed", self.claimed, 2),
            ("purge_inbox", self.purge_inbox, 3),
            ("purge_solo_runs", self.purge_solo_runs, 3),
            ("record_solo_run", self.record_solo_run, 2),
            ("clear_solo_runs", self.clear_solo_runs, 2),
            ("insert_outbox", self.insert_outbox, 9),
            ("mark_published", self.mark_published, 1),
            ("mark_failed", self.mark_failed, 2),
            ("mark_retry", self.mark_retry, 2),
            ("outbox_counts", self.outbox_counts, 0),
            ("outbox_backlog", self.outbox_backlog, 0),
            ("failed_outbox_rows", self.failed_outbox_rows, 1),
            ("retry_all_failed", self.retry_all_failed, 0),
            ("retry_failed_id", self.retry_failed_id, 1),
            ("delete_published_before", self.delete_published_before, 2),
            ("trail_inbox", self.trail_inbox, 1),
            ("trail_journal", self.trail_journal, 2),
            ("trail_outbox", self.trail_outbox, 2),
            ("insert_setting", self.insert_setting, 2),
            ("select_setting", self.select_setting, 1),
            ("lease_ensure", self.lease_ensure, 2),
            ("lease_acquire", self.lease_acquire, 5),
            ("lease_renew", self.lease_renew, 4),
            ("lease_release", self.lease_release, 3),
            ("leases", self.leases, 1),
            ("member_beat", self.member_beat, 3),
            ("members", self.members, 2),
            ("member_leave", self.member_leave, 3),
            ("version_ensure", self.version_ensure, 2),
            ("version_lock", self.version_lock, 2),
            ("version_set", self.version_set, 3),
        ];
        let optional = [
            ("after_begin", self.after_begin, 0),
            ("lock_migrations", self.lock_migrations, 0),
            ("unlock_migrations", self.unlock_migrations, 0),
            ("solo_run_count", self.solo_run_count, 2),
            ("notify_outbox", self.notify_outbox, 0),
        ];
        for (name, sql, arity) in optional {
            if let Some(sql) = sql {
                all.push((name, sql, arity));
            }
        }
        all
    }
}

/// The placeholders of `sql` (`$N`, `?N` or a plain `?`, which counts as the
/// next number), in the order they appear.
#[cfg(test)]
pub(crate) fn placeholders(sql: &str) -> Vec<usize> {
    let mut found = Vec::new();
    let mut rest = sql;
    while let Some(at) = rest.find(['$', '?']) {
        let digits: String = rest[at + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        found.push(match digits.parse() {
            Ok(n) => n,
            Err(_) => found.len() + 1,
        });
        rest = &rest[at + 1 + digits.len()..];
    }
    found
}

/// How many values `sql` binds, checking that its placeholders first appear in
/// bind order (1, 2, 3...), so that a dialect with only positional `?` could
/// write the same statement.
#[cfg(test)]
pub(crate) fn arity_in_order(sql: &str) -> usize {
    let mut first_seen = Vec::new();
    for n in placeholders(sql) {
        if !first_seen.contains(&n) {
            first_seen.push(n);
        }
    }
    let in_order: Vec<usize> = (1..=first_seen.len()).collect();
    assert_eq!(
        first_seen, in_order,
        "placeholders out of bind order in {sql}"
    );
    first_seen.len()
}

/// The SQL/JSON path of a payload field: `customerId`, or a dotted path into
/// nested objects (`card.number`), each step quoted so that no name is read
/// as path syntax.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn json_path(field: &str) -> String {
    let mut path = String::from("$");
    for step in field.split('.') {
        path.push_str(&format!(
            ".\"{}\"",
            step.replace('\\', "\\\\").replace('"', "\\\"")
        ));
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each dialect's statements bind what the shared code binds, in number.
    fn check_statements<D: SqlDialect>() {
        for (name, sql, arity) in D::SQL.with_arity() {
            assert!(!sql.trim().is_empty(), "{} {name} is empty", D::NAME);
            assert_eq!(arity_in_order(sql), arity, "{} {name}: {sql}", D::NAME);
        }
    }

    #[test]
    fn placeholders_are_counted_and_must_appear_in_bind_order() {
        assert_eq!(arity_in_order("SELECT 1"), 0);
        assert_eq!(
            arity_in_order("UPDATE t SET a = $1, b = $1 WHERE id = $2"),
            2
        );
        assert_eq!(arity_in_order("UPDATE t SET a = ? WHERE id = ?"), 2);
        let out_of_order =
            std::panic::catch_unwind(|| arity_in_order("UPDATE t SET a = ?2 WHERE id = ?1"));
        assert!(out_of_order.is_err());
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_statements_bind_what_the_shared_code_binds() {
        check_statements::<sqlx::Postgres>();
        super::super::migrations::check_list(
            &sqlx::Postgres::MIGRATIONS,
            &[2, 1, 3, 2, 1, 3, 4, 18, 5],
        );
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn sqlite_statements_bind_what_the_shared_code_binds() {
        check_statements::<sqlx::Sqlite>();
        super::super::migrations::check_list(
            &sqlx::Sqlite::MIGRATIONS,
            &[2, 1, 3, 1, 2, 1, 3, 5, 17, 5],
        );
    }
}
