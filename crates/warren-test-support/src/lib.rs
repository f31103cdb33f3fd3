//! The fixtures warren's integration tests share, one file per concern: a
//! private database per test (`db`: a PostgreSQL schema, an SQLite file or a
//! MySQL database), private broker names and a consumer running in the
//! background (`broker`), a handler with a deliberately non-idempotent effect
//! (`handlers`), a stock ledger for the concurrency tests (`stock`), and a TCP
//! proxy that faults one client (`proxy`). Tests import everything from the
//! crate's root, not from the files. Not published: the library's own test kit
//! for users is `warren::testing`.

use std::future::Future;
use std::time::Duration;

mod broker;
mod db;
mod handlers;
mod proxy;
mod stock;

pub use broker::*;
pub use db::*;
pub use handlers::*;
pub use proxy::*;
pub use stock::*;

/// The broker the tests use: `AMQP_URL`, or the local one as guest.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The throwaway certificates of `.ci/tls-setup` (`WARREN_TLS_DIR`), or
/// `None` and a note: the TLS tests pass without running where TLS is not
/// set up.
#[allow(clippy::print_stderr)] // the note says why the test did nothing
pub fn tls_dir() -> Option<std::path::PathBuf> {
    match std::env::var_os("WARREN_TLS_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => Some(dir.into()),
        None => {
            eprintln!("skipped: WARREN_TLS_DIR is not set (run .ci/tls-setup)");
            None
        }
    }
}

/// The PostgreSQL server the tests create their schemas on: `WARREN_TEST_PG_URL`, or
/// the local one as postgres.
pub fn pg_admin_url() -> String {
    std::env::var("WARREN_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The MySQL/MariaDB server the tests create their databases on (a URL ending
/// in `/`).
#[cfg(feature = "mysql")]
pub fn mysql_admin_url() -> String {
    std::env::var("WARREN_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/".into())
}

/// A short random name unique to one test.
pub fn unique(prefix: &str) -> String {
    // The tail of a UUIDv7 is random; its head is the clock.
    let id = uuid::Uuid::now_v7().simple().to_string();
    format!("{prefix}_{}", &id[id.len() - 12..])
}

/// Polls `check` until it is true or `timeout` passes; returns the last answer.
pub async fn wait_for<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs a test body once per backend.
#[macro_export]
macro_rules! on_all_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name::<sqlx::Postgres>().await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$name::<sqlx::Sqlite>().await
                }
                #[cfg(feature = "mysql")]
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn mysql() {
                    super::$name::<sqlx::MySql>().await
                }
            }
        )*
    };
}
