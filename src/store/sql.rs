//! One implementation of [`Store`] and [`OutboxStore`](super::OutboxStore) for
//! every SQL dialect, written against the statements and hooks of
//! [`SqlDialect`](super::dialect::SqlDialect); the outbox half is in
//! `sql/outbox.rs`.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Type};

use super::{
    Dialect, InboxEntry, Leases, Retention, SigningKey, SoloRuns, Store, StoreError, Wakeups,
};

/// A [`Store`] with every capability, and an
/// [`OutboxStore`](super::OutboxStore), on a SQL database: `PgStore`,
/// `SqliteStore` and `MySqlStore` are this type for their dialect.
pub struct SqlStore<D: Database> {
    pub(super) pool: Pool<D>,
    pub(super) wakeups: Wakeups,
    /// Where the database has one writer (SQLite): the turns of this process's
    /// writers, taken in the order asked for. Without it they would all poll
    /// the file lock, sleeping up to 100 ms between tries however soon it is
    /// free, and a lease renewal could lose to a stream of consumer
    /// transactions for longer than its lease lasts.
    pub(super) writer: Option<Arc<tokio::sync::Mutex<()>>>,
}

/// A writer's turn on a one-writer database, held until its transaction ends.
pub(crate) type WriteTurn = Option<tokio::sync::OwnedMutexGuard<()>>;

impl<D: Database> SqlStore<D> {
    #[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
    pub(super) fn with_pool(pool: Pool<D>) -> Self {
        Self {
            pool,
            wakeups: Wakeups::default(),
            writer: None,
        }
    }

    /// Writers of this store take turns, first come first served.
    #[cfg(feature = "sqlite")]
    pub(super) fn one_writer_at_a_time(mut self) -> Self {
        self.writer = Some(Arc::default());
        self
    }

    /// Waits for this process's turn to write, where writers take turns. As
    /// long as SQLite's own busy timeout at most: past it, the database counts
    /// as unreachable, as a lock SQLite itself could not get would.
    pub(super) async fn write_turn(&self) -> Result<WriteTurn, StoreError> {
        let Some(writer) = &self.writer else {
            return Ok(None);
        };
        match tokio::time::timeout(WRITE_TURN_TIMEOUT, Arc::clone(writer).lock_owned()).await {
            Ok(turn) => Ok(Some(turn)),
            Err(_) => Err(StoreError::Database(sqlx::Error::PoolTimedOut)),
        }
    }

    /// The pool, for the application's own queries outside a handler.
    pub fn pool(&self) -> &Pool<D> {
        &self.pool
    }
}

impl<D: Database> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            wakeups: self.wakeups.clone(),
            writer: self.writer.clone(),
        }
    }
}

impl<D: Database> std::fmt::Debug for SqlStore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("dialect", &D::NAME)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// How long a writer waits for its turn: SQLite's busy timeout.
const WRITE_TURN_TIMEOUT: Duration = Duration::from_secs(30);

/// The statement that claims `rows` messages at once, where the dialect
/// numbers its placeholders; the rows are inserted in the order bound.
fn multi_row_claim<D: super::dialect::SqlDialect>(rows: usize) -> Option<String> {
    let mut sql = String::from(
        "INSERT INTO warren_inbox (consumer_name, message_id, event_type, correlation_id, received_at) VALUES ",
    );
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        for column in 1..=5 {
            if column > 1 {
                sql.push_str(", ");
            }
            sql.push_str(&D::numbered_placeholder(row * 5 + column)?);
        }
        sql.push(')');
    }
    sql.push_str(" ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id");
    Some(sql)
}

/// The stored version of `entity` in `scope` (0 if none yet), its row created
/// if missing and locked until the transaction ends: the one shared read behind
/// each dialect's [`SqlDialect::read_version`](super::dialect::SqlDialect::read_version).
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(super) async fn read_version<D>(
    conn: &mut D::Connection,
    scope: &str,
    entity: &str,
) -> Result<i64, StoreError>
where
    D: super::dialect::SqlDialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    for<'s> &'s str: Encode<'s, D> + Type<D>,
    i64: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
    usize: ColumnIndex<D::Row>,
{
    // Creating the row first makes the lock below exist even for a new entity:
    // a second transaction for it waits here until the first one ends.
    sqlx::query(D::SQL.version_ensure)
        .bind(scope)
        .bind(entity)
        .execute(&mut *conn)
        .await?;
    let version: i64 = sqlx::query_scalar(D::SQL.version_lock)
        .bind(scope)
        .bind(entity)
        .fetch_one(&mut *conn)
        .await?;
    Ok(version)
}

/// Stores `version` for `entity` in `scope`, in the open transaction.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(super) async fn write_version<D>(
    conn: &mut D::Connection,
    scope: &str,
    entity: &str,
    version: i64,
) -> Result<(), StoreError>
where
    D: super::dialect::SqlDialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    for<'s> &'s str: Encode<'s, D> + Type<D>,
    i64: for<'q> Encode<'q, D> + Type<D>,
{
    sqlx::query(D::SQL.version_set)
        .bind(version)
        .bind(scope)
        .bind(entity)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Writes, inside a dialect's `impl SqlDialect`, the hooks every dialect
/// implements alike: running a statement that binds nothing, and forwarding
/// the outbox insert and the version gate's read and write to the code in
/// `sql` written once for all. They cannot be default methods of
/// [`SqlDialect`](super::dialect::SqlDialect): the shared code needs bounds on the dialect's connection
/// that a trait's `where` clause would not carry to the generic code that
/// calls the hooks (rust-lang/rust#20671, as for `shared_impl!` below), so
/// each dialect instantiates them under its concrete type.
macro_rules! shared_hooks {
    ($db:ty, $conn:ty) => {
        async fn execute_raw(conn: &mut $conn, sql: &'static str) -> Result<(), sqlx::Error> {
            sqlx::Executor::execute(conn, sqlx::raw_sql(sql)).await?;
            Ok(())
        }

        async fn read_version<'c>(
            conn: &'c mut $conn,
            scope: &'c str,
            entity: &'c str,
        ) -> Result<i64, StoreError> {
            super::sql::read_version::<$db>(conn, scope, entity).await
        }

        async fn write_version<'c>(
            conn: &'c mut $conn,
            scope: &'c str,
            entity: &'c str,
            version: i64,
        ) -> Result<(), StoreError> {
            super::sql::write_version::<$db>(conn, scope, entity, version).await
        }
    };
}
pub(super) use shared_hooks;

/// Writes, inside a dialect's `impl SqlDialect`, the outbox insert written
/// once for all (one statement of numbered or positional placeholders for
/// several rows): every dialect's but PostgreSQL's, which binds arrays.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
macro_rules! shared_outbox_insert {
    ($db:ty, $conn:ty) => {
        async fn insert_outbox<'c>(
            conn: &'c mut $conn,
            rows: &'c [crate::outbox_row::NewOutboxRow<'c>],
        ) -> Result<(), StoreError> {
            super::sql::insert_outbox::<$db>(conn, rows).await
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(super) use shared_outbox_insert;

/// Writes `impl $trait for SqlStore<D>` under the bounds every dialect meets for
/// the shared code: its connection runs queries, and it binds and reads the Rust
/// types warren's tables use. A macro, because the bounds cannot live on
/// [`SqlDialect`](super::dialect::SqlDialect): Rust does not carry a trait's
/// `where` clauses to the places that use it (rust-lang/rust#20671), so they
/// would have to be repeated on each impl.
macro_rules! shared_impl {
    (impl $trait_:ident { $($body:tt)* }) => {
        impl<D> $trait_ for SqlStore<D>
        where
            D: Dialect + sqlx::database::HasStatementCache,
            for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
            D::Arguments: IntoArguments<D>,
            i64: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
            String: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
            Vec<u8>: Type<D> + for<'q> Encode<'q, D> + for<'r> Decode<'r, D>,
            for<'s> &'s str: Encode<'s, D> + Type<D>,
            for<'s> Option<&'s str>: Encode<'s, D> + Type<D>,
            Option<i64>: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
            Option<D::Time>: for<'q> Encode<'q, D> + Type<D>,
            for<'s> &'s [u8]: Encode<'s, D> + Type<D>,
            bool: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
            usize: ColumnIndex<D::Row>,
        {
            $($body)*
        }
    };
}

/// Binds each of a built statement's values (`dead_letters::Bind`) to
/// `query`, in order.
macro_rules! bind_all {
    ($query:expr, $binds:expr) => {{
        let mut query = $query;
        for bind in $binds {
            query = match bind {
                Bind::Text(v) => query.bind(v),
                Bind::Time(v) => query.bind(v),
                Bind::Int(v) => query.bind(v),
                Bind::Bool(v) => query.bind(v),
                Bind::OptTime(v) => query.bind(v),
                Bind::OptInt(v) => query.bind(v),
                Bind::Bytes(v) => query.bind(v),
            };
        }
        query
    }};
}

/// Runs a statement built at run time with the values of `Conditions` `$c`
/// on `$on` (a pool or a connection): `fetch_all` (the rows) or `execute`.
macro_rules! run_built {
    ($on:expr, $sql:expr, $c:expr, $how:ident) => {
        bind_all!(sqlx::query(sqlx::AssertSqlSafe($sql)), $c.binds)
            .$how($on)
            .await?
    };
}

// After the macros: the outbox half, the dead letters and the journal use them too.
mod checkup;
mod dead_letters;
mod journal;
mod outbox;
mod trail;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(super) use outbox::insert_outbox;

shared_impl! {
    impl Store {
        type Db = D;

        async fn migrate(&self) -> Result<(), StoreError> {
            let _turn = self.write_turn().await?;
            let mut conn = self.pool.acquire().await?;
            let applied = apply_migrations::<D>(&mut conn).await;
            // A lock that outlives the transaction is released whatever happened:
            // the connection goes back to the pool, still holding it otherwise.
            if let Some(unlock) = D::SQL.unlock_migrations {
                sqlx::query(unlock).execute(&mut *conn).await?;
            }
            applied
        }

        async fn ping(&self) -> Result<(), StoreError> {
            sqlx::query(D::SQL.ping).execute(&self.pool).await?;
            Ok(())
        }

        fn wakeups(&self) -> &Wakeups {
            &self.wakeups
        }

        async fn begin(&self) -> Result<super::Tx<D>, StoreError> {
            self.begin_with_lock_timeout(None).await
        }

        async fn begin_with_lock_timeout(
            &self,
            lock_timeout: Option<Duration>,
        ) -> Result<super::Tx<D>, StoreError> {
            let turn = self.write_turn().await?;
            // What follows the begin goes in one round trip, however many
            // parts; in the begin's own where the dialect allows.
            let after = [D::SQL.after_begin.map(str::to_owned), D::lock_timeout_sql(lock_timeout)]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("; ");
            let tx = if after.is_empty() {
                self.pool.begin_with(D::SQL.begin).await?
            } else if D::BEGIN_TAKES_MORE {
                let begin = format!("{}; {after}", D::SQL.begin);
                self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await?
            } else {
                let mut tx = self.pool.begin_with(D::SQL.begin).await?;
                Executor::execute(&mut *tx, sqlx::raw_sql(sqlx::AssertSqlSafe(after))).await?;
                tx
            };
            // A relay of this process is woken in process after the commit;
            // only without one do relays elsewhere need the database's.
            let notify = D::SQL.notify_outbox.is_some() && !self.wakeups.listened();
            let mut tx = super::Tx::new(tx, turn, notify);
            if lock_timeout.is_some()
                && let Some(restore) = D::RESTORE_LOCK_TIMEOUT
            {
                tx.restore_before_end(restore);
            }
            Ok(tx)
        }

        async fn claim<'a>(
            &'a self,
            tx: &'a mut super::Tx<D>,
            entry: &'a InboxEntry<'a>,
        ) -> Result<bool, StoreError> {
            let done = sqlx::query(D::SQL.claim)
                .bind(entry.consumer_name)
                .bind(entry.message_id)
                .bind(entry.event_type)
                .bind(entry.correlation_id)
                .bind(D::time(entry.received_at))
                .execute(tx.conn())
                .await;
            match done {
                Ok(done) => Ok(D::rows_affected(&done) == 1),
                Err(e) if D::is_refused_claim(&e) => Ok(false),
                Err(e) => Err(e.into()),
            }
        }

        async fn claim_all<'a>(
            &'a self,
            tx: &'a mut super::Tx<D>,
            entries: &'a [InboxEntry<'a>],
        ) -> Result<Vec<bool>, StoreError> {
            if entries.len() > 1
                && let Some(new) = D::claim_rows(tx.conn(), entries).await?
            {
                let new: std::collections::HashSet<String> = new.into_iter().collect();
                return Ok(entries.iter().map(|e| new.contains(e.message_id)).collect());
            }
            let Some(sql) = multi_row_claim::<D>(entries.len()) else {
                let mut claimed = Vec::with_capacity(entries.len());
                for entry in entries {
                    claimed.push(self.claim(tx, entry).await?);
                }
                return Ok(claimed);
            };
            let mut query = sqlx::query_scalar::<D, String>(sqlx::AssertSqlSafe(sql));
            for entry in entries {
                query = query
                    .bind(entry.consumer_name)
                    .bind(entry.message_id)
                    .bind(entry.event_type)
                    .bind(entry.correlation_id)
                    .bind(D::time(entry.received_at));
            }
            let new: std::collections::HashSet<String> =
                query.fetch_all(tx.conn()).await?.into_iter().collect();
            Ok(entries.iter().map(|e| new.contains(e.message_id)).collect())
        }

        async fn claimed<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
        ) -> Result<bool, StoreError> {
            // Planned at each call, for the inbox as it is now: a plan cached
            // on the connection while the inbox was small would scan it whole
            // for every suspect of a crash, on a server whose statistics are
            // not kept up (autovacuum off).
            let found: Option<i64> = sqlx::query_scalar(D::SQL.claimed)
                .persistent(false)
                .bind(consumer)
                .bind(message_id)
                .fetch_optional(&self.pool)
                .await?;
            Ok(found.is_some())
        }

        async fn unclaim<'a>(
            &'a self,
            tx: &'a mut super::Tx<D>,
            consumer: &'a str,
            message_id: &'a str,
        ) -> Result<(), StoreError> {
            sqlx::query(D::SQL.unclaim)
                .bind(consumer)
                .bind(message_id)
                .execute(tx.conn())
                .await?;
            Ok(())
        }
    }
}

shared_impl! {
    impl SigningKey {
        /// Every process on the database races to insert its candidate; the
        /// first insert wins, and all of them read the same key back.
        async fn signing_key(&self) -> Result<Vec<u8>, StoreError> {
            let _turn = self.write_turn().await?;
            let mut conn = self.pool.acquire().await?;
            sqlx::query(D::SQL.insert_setting)
                .bind(super::SIGNING_KEY_SETTING)
                .bind(super::new_signing_key())
                .execute(&mut *conn)
                .await?;
            let key: String = sqlx::query_scalar(D::SQL.select_setting)
                .bind(super::SIGNING_KEY_SETTING)
                .fetch_one(&mut *conn)
                .await?;
            Ok(key.into_bytes())
        }
    }
}

shared_impl! {
    impl SoloRuns {
        async fn record_solo_run<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
        ) -> Result<u32, StoreError> {
            let _turn = self.write_turn().await?;
            let count: i64 = match D::SQL.solo_run_count {
                None => {
                    sqlx::query_scalar(D::SQL.record_solo_run)
                        .bind(consumer)
                        .bind(message_id)
                        .fetch_one(&self.pool)
                        .await?
                }
                Some(read_back) => {
                    let mut tx = self.pool.begin_with(D::SQL.begin).await?;
                    sqlx::query(D::SQL.record_solo_run)
                        .bind(consumer)
                        .bind(message_id)
                        .execute(&mut *tx)
                        .await?;
                    let count = sqlx::query_scalar(read_back)
                        .bind(consumer)
                        .bind(message_id)
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    count
                }
            };
            Ok(u32::try_from(count).unwrap_or(u32::MAX))
        }

        async fn clear_solo_runs<'a>(
            &'a self,
            tx: Option<&'a mut super::Tx<D>>,
            consumer: &'a str,
            message_id: &'a str,
        ) -> Result<(), StoreError> {
            let query = sqlx::query(D::SQL.clear_solo_runs)
                .bind(consumer)
                .bind(message_id);
            match tx {
                Some(tx) => query.execute(tx.conn()).await?,
                None => {
                    let _turn = self.write_turn().await?;
                    query.execute(&self.pool).await?
                }
            };
            Ok(())
        }
    }
}

shared_impl! {
    impl Leases {
        async fn leases<'a>(&'a self, consumer: &'a str) -> Result<Vec<super::Lease>, StoreError> {
            let rows: Vec<(i64, String, i64)> = sqlx::query_as(D::SQL.leases)
                .bind(consumer)
                .fetch_all(&self.pool)
                .await?;
            Ok(rows
                .into_iter()
                .map(|(partition, owner, expires_ms)| super::Lease {
                    partition: u32::try_from(partition).unwrap_or(u32::MAX),
                    owner,
                    expires_ms,
                })
                .collect())
        }

        async fn lease_step<'a>(
            &'a self,
            consumer: &'a str,
            member: &'a str,
            step: super::LeaseStep,
        ) -> Result<bool, StoreError> {
            use super::LeaseStep;
            let _turn = self.write_turn().await?;
            let done = match step {
                LeaseStep::Setup { count } => {
                    for partition in 0..count {
                        sqlx::query(D::SQL.lease_ensure)
                            .bind(consumer)
                            .bind(i64::from(partition))
                            .execute(&self.pool)
                            .await?;
                    }
                    return Ok(true);
                }
                LeaseStep::Beat { expires_ms } => {
                    sqlx::query(D::SQL.member_beat)
                        .bind(consumer)
                        .bind(member)
                        .bind(expires_ms)
                        .execute(&self.pool)
                        .await?
                }
                LeaseStep::Leave { cutoff_ms } => {
                    sqlx::query(D::SQL.member_leave)
                        .bind(consumer)
                        .bind(member)
                        .bind(cutoff_ms)
                        .execute(&self.pool)
                        .await?
                }
                LeaseStep::Acquire {
                    partition,
                    expires_ms,
                    now_ms,
                } => {
                    sqlx::query(D::SQL.lease_acquire)
                        .bind(member)
                        .bind(expires_ms)
                        .bind(consumer)
                        .bind(i64::from(partition))
                        .bind(now_ms)
                        .execute(&self.pool)
                        .await?
                }
                LeaseStep::Renew {
                    partition,
                    expires_ms,
                } => {
                    sqlx::query(D::SQL.lease_renew)
                        .bind(expires_ms)
                        .bind(consumer)
                        .bind(i64::from(partition))
                        .bind(member)
                        .execute(&self.pool)
                        .await?
                }
                LeaseStep::Release { partition } => {
                    sqlx::query(D::SQL.lease_release)
                        .bind(consumer)
                        .bind(i64::from(partition))
                        .bind(member)
                        .execute(&self.pool)
                        .await?
                }
            };
            Ok(D::rows_affected(&done) > 0)
        }

        async fn lease_members<'a>(
            &'a self,
            consumer: &'a str,
            now_ms: i64,
        ) -> Result<Vec<String>, StoreError> {
            Ok(sqlx::query_scalar(D::SQL.members)
                .bind(consumer)
                .bind(now_ms)
                .fetch_all(&self.pool)
                .await?)
        }
    }
}

shared_impl! {
    impl Retention {
        async fn purge_inbox<'a>(
            &'a self,
            consumer: &'a str,
            cutoff: DateTime<Utc>,
            batch: u32,
        ) -> Result<u64, StoreError> {
            let _turn = self.write_turn().await?;
            let mut deleted = [0; 2];
            // Solo-run counts older than the window belong to messages long
            // settled.
            for (n, sql) in [D::SQL.purge_inbox, D::SQL.purge_solo_runs]
                .into_iter()
                .enumerate()
            {
                let done = sqlx::query(sql)
                    .bind(consumer)
                    .bind(D::time(cutoff))
                    .bind(i64::from(batch))
                    .execute(&self.pool)
                    .await?;
                deleted[n] = D::rows_affected(&done);
            }
            Ok(deleted[0])
        }
    }
}

/// Applies the missing migrations in one transaction on `conn`, holding the
/// dialect's migration lock.
async fn apply_migrations<D>(conn: &mut D::Connection) -> Result<(), StoreError>
where
    D: super::dialect::SqlDialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    i64: for<'q> Encode<'q, D> + Type<D> + for<'r> Decode<'r, D>,
    for<'s> &'s str: Encode<'s, D> + Type<D>,
    usize: ColumnIndex<D::Row>,
{
    // `Transaction::begin` with a ready `SqlStr`: the generic `begin_with` trips
    // the compiler's higher-ranked `Send` check on `&'static str`.
    let begin = sqlx::SqlSafeStr::into_sql_str(D::SQL.begin);
    let mut tx: sqlx::Transaction<'_, D> =
        sqlx::Transaction::begin(&mut *conn, Some(begin)).await?;
    if let Some(lock) = D::SQL.lock_migrations {
        sqlx::query(lock).execute(&mut *tx).await?;
    }
    D::MIGRATIONS.apply::<D>(&mut tx).await?;
    tx.commit().await?;
    Ok(())
}

/// The shared implementation on a throwaway SQLite file: no server needed.
#[cfg(all(test, feature = "sqlite"))]
mod tests;
