//! Throwaway databases for tests: a PostgreSQL schema or a MySQL/MariaDB
//! database of a test's own, dropped when the test is done.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::store::StoreError;

/// Every throwaway database's name starts with this, then the second it was
/// made and a random tail: what a later run reads to find the stale ones.
const PREFIX: &str = "warren_test_";

/// How old a throwaway database must be before a later test takes it for
/// one whose test was killed, and drops it. Longer than any test run.
pub const STALE_AFTER: Duration = Duration::from_secs(6 * 60 * 60);

/// A PostgreSQL schema or a MySQL/MariaDB database of one test's own, like
/// `#[sqlx::test]` makes: [`url`](Self::url) connects to it (on PostgreSQL
/// through `search_path`), so a store opened on it migrates warren's tables
/// there and nowhere else.
///
/// It is dropped by [`drop_now`](Self::drop_now), or when the value is
/// dropped (a test that panics included, from a thread of its own). A test
/// process that is killed cannot drop it: the next throwaway database made
/// on the same server drops every one older than [`STALE_AFTER`].
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use warren::PgStore;
/// use warren::testing::TestDatabase;
///
/// let db = TestDatabase::postgres("postgres://postgres@127.0.0.1:5432/postgres").await?;
/// let store = PgStore::connect(db.url(), 4).await?;
/// // ... a TestConsumer on `store`, or a Consumer and the real broker ...
/// store.pool().close().await;
/// db.drop_now().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TestDatabase {
    kind: Kind,
    /// The server, as given, to drop it from.
    server: String,
    name: String,
    url: String,
    dropped: bool,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "mysql")]
    MySql,
}

impl TestDatabase {
    /// A schema of its own on the PostgreSQL server `url` names (any
    /// database on it; the schema is made there). Drops the stale ones first.
    #[cfg(feature = "postgres")]
    pub async fn postgres(url: &str) -> Result<Self, StoreError> {
        let admin = sqlx::PgPool::connect(url).await?;
        let stale: Vec<String> =
            sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE $1")
                .bind(format!("{}%", PREFIX.replace('_', "\\_")))
                .fetch_all(&admin)
                .await?;
        for name in stale.iter().filter(|n| is_stale(n)) {
            drop_quietly(&admin, &format!("DROP SCHEMA IF EXISTS {name} CASCADE")).await;
        }
        let name = fresh_name();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let sep = if url.contains('?') { '&' } else { '?' };
        Ok(Self {
            kind: Kind::Postgres,
            server: url.to_owned(),
            url: format!("{url}{sep}options=-c%20search_path%3D{name}"),
            name,
            dropped: false,
        })
    }

    /// A database of its own on the MySQL or MariaDB server `url` names (a
    /// URL ending in `/`, or naming any database on it). Drops the stale ones
    /// first.
    #[cfg(feature = "mysql")]
    pub async fn mysql(url: &str) -> Result<Self, StoreError> {
        let admin = sqlx::MySqlPool::connect(url).await?;
        let stale: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(schema_name AS CHAR) FROM information_schema.schemata \
             WHERE schema_name LIKE ?",
        )
        .bind(format!("{}%", PREFIX.replace('_', "\\_")))
        .fetch_all(&admin)
        .await?;
        for name in stale.iter().filter(|n| is_stale(n)) {
            drop_quietly(&admin, &format!("DROP DATABASE IF EXISTS {name}")).await;
        }
        let name = fresh_name();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let base = url.split('?').next().unwrap_or(url);
        let server = &base[..base.rfind('/').map_or(base.len(), |i| i + 1)];
        Ok(Self {
            kind: Kind::MySql,
            server: url.to_owned(),
            url: format!("{server}{name}"),
            name,
            dropped: false,
        })
    }

    /// The URL of the throwaway database: what a store connects with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its name: the schema on PostgreSQL, the database on MySQL.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Drops it now, and says if that failed. Close the stores on it first:
    /// MySQL waits for their connections.
    pub async fn drop_now(mut self) -> Result<(), StoreError> {
        self.dropped = true;
        drop_database(self.kind, &self.server, &self.name).await
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        // Drop runs outside async code's reach (a test that panicked, say):
        // a thread of its own, with a runtime of its own, does the dropping.
        let (kind, server, name) = (self.kind, self.server.clone(), self.name.clone());
        let done = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(runtime) = runtime {
                let _ = runtime.block_on(drop_database(kind, &server, &name));
            }
        });
        // Left behind if it fails: the next run drops it as stale.
        let _ = done.join();
    }
}

async fn drop_database(kind: Kind, server: &str, name: &str) -> Result<(), StoreError> {
    match kind {
        #[cfg(feature = "postgres")]
        Kind::Postgres => {
            let admin = sqlx::PgPool::connect(server).await?;
            let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {name} CASCADE"
            )))
            .execute(&admin)
            .await;
            admin.close().await;
            dropped?;
        }
        #[cfg(feature = "mysql")]
        Kind::MySql => {
            let admin = sqlx::MySqlPool::connect(server).await?;
            let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name}"
            )))
            .execute(&admin)
            .await;
            admin.close().await;
            dropped?;
        }
    }
    Ok(())
}

/// Runs a `DROP` of a stale database; one that another run drops at the same
/// moment is no error of this one's.
async fn drop_quietly<'e, E>(admin: E, sql: &str)
where
    E: sqlx::Executor<'e>,
{
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(admin)
        .await;
}

/// `warren_test_<seconds since the epoch>_<random>`: lower case, so that it
/// needs no quoting on either server.
fn fresh_name() -> String {
    format!("{PREFIX}{}_{:08x}", now_secs(), fastrand::u32(..),)
}

/// True if `name` is a throwaway database made more than [`STALE_AFTER`] ago.
fn is_stale(name: &str) -> bool {
    name.strip_prefix(PREFIX)
        .and_then(|rest| rest.split('_').next())
        .and_then(|secs| secs.parse::<u64>().ok())
        .is_some_and(|made| now_secs().saturating_sub(made) > STALE_AFTER.as_secs())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_when_they_were_made_and_only_old_ones_are_stale() {
        let name = fresh_name();
        assert!(name.starts_with(PREFIX));
        assert!(!is_stale(&name), "a name made now");
        let old = format!(
            "{PREFIX}{}_abcd0123",
            now_secs() - STALE_AFTER.as_secs() - 1
        );
        assert!(is_stale(&old));
        assert!(!is_stale("warren_test_notanumber_1"));
        assert!(!is_stale("someone_elses_schema"));
    }
}
