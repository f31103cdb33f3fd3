//! What billing's test binaries share: running the binary, its HTTP endpoints,
//! waiting with a deadline.
#![allow(dead_code, reason = "each test binary uses a part")]

use std::future::Future;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

pub(crate) const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub(crate) fn pg_url() -> String {
    std::env::var("WARREN_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A PostgreSQL schema of one test's own, and a database URL whose
/// `search_path` points at it.
pub(crate) struct PgSchema {
    admin: sqlx::PgPool,
    pub(crate) name: String,
    pub(crate) url: String,
}

impl PgSchema {
    /// Creates a schema named after `prefix` and a unique suffix.
    pub(crate) async fn create(prefix: &str) -> Self {
        let name = unique(prefix).replace('-', "_");
        let admin = sqlx::PgPool::connect(&pg_url()).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&admin)
            .await
            .unwrap();
        let url = format!("{}?options=-c%20search_path%3D{name}", pg_url());
        PgSchema { admin, name, url }
    }

    /// Drops the schema and everything in it.
    pub(crate) async fn remove(self) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.name
        )))
        .execute(&self.admin)
        .await
        .unwrap();
        self.admin.close().await;
    }
}

pub(crate) fn billing() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_billing"));
    cmd.env("AMQP_URL", AMQP_URL)
        .env_remove("AMQP_CA_FILE")
        .env_remove("AMQP_CLIENT_CERT")
        .env_remove("AMQP_CLIENT_KEY")
        .env_remove("DATABASE_URL")
        .env_remove("BILLING_PREFIX")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

pub(crate) fn unique(prefix: &str) -> String {
    let id = uuid::Uuid::now_v7().simple().to_string();
    format!("{prefix}-{}", &id[id.len() - 10..])
}

/// Runs `cmd` to its end and returns its success, stdout and stderr. A run
/// past 300 s is killed, and the panic carries what it had printed by then,
/// so that a hang shows where it stood.
pub(crate) async fn output(cmd: &mut Command) -> (bool, String, String) {
    output_within(cmd, Duration::from_secs(300)).await
}

/// [`output`] with its own deadline.
pub(crate) async fn output_within(cmd: &mut Command, deadline: Duration) -> (bool, String, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let run = async {
        let (o, e) = tokio::join!(stdout.read_to_end(&mut out), stderr.read_to_end(&mut err));
        o.unwrap();
        e.unwrap();
        child.wait().await.unwrap()
    };
    let status = tokio::time::timeout(deadline, run).await;
    let (out, err) = (
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    );
    match status {
        Ok(status) => (status.success(), out, err),
        Err(_) => {
            let mut from = err.len().saturating_sub(8000);
            while !err.is_char_boundary(from) {
                from += 1;
            }
            panic!(
                "billing did not finish within {} s; it printed:\n{out}\n--- stderr, its end ---\n{}",
                deadline.as_secs(),
                &err[from..]
            )
        }
    }
}

/// The MySQL/MariaDB server the tests use, as `mysql://.../` (no database).
pub(crate) fn mysql_server() -> String {
    std::env::var("WARREN_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/".into())
}

pub(crate) async fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    Some(response)
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `billing run` from `cmd` (flags already set) serving HTTP on `port`,
/// and waits until `/readyz` answers 200. Its log goes to a file that is read
/// back only if it never becomes ready.
pub(crate) async fn start_run(cmd: &mut Command, port: u16) -> tokio::process::Child {
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut run = cmd
        .args(["--http", &format!("127.0.0.1:{port}"), "run"])
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    wait_ready(&mut run, port, log.path()).await;
    run
}

/// Waits up to 60 s for `billing run` (`run`, logging to `log`) to answer
/// `/readyz` with 200. If it exits first or never gets there, fails with what
/// it printed last, its exit status and its last `/readyz` answer: a test that
/// only says "not ready" leaves nothing to go on.
pub(crate) async fn wait_ready(run: &mut tokio::process::Child, port: u16, log: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last_answer = None;
    let exited = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break Some(status);
        }
        if let Some(answer) = http_get(port, "/readyz").await {
            if answer.starts_with("HTTP/1.1 200") {
                return;
            }
            last_answer = Some(answer);
        }
        if tokio::time::Instant::now() >= deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let printed = std::fs::read_to_string(log).unwrap_or_default();
    let tail: Vec<&str> = printed.lines().rev().take(40).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    panic!(
        "billing run did not become ready: {}; last /readyz answer: {}\nits log ends:\n{}",
        exited.map_or("still running after 60 s".to_owned(), |s| format!(
            "it exited with {s}"
        )),
        last_answer.as_deref().unwrap_or("none (nothing listening)"),
        tail.join("\n")
    );
}

pub(crate) fn line_value(out: &str, label: &str) -> Option<i64> {
    out.lines()
        .find(|l| l.trim_start().starts_with(label))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
}

pub(crate) async fn wait_for<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

pub(crate) async fn warren_connect() -> warren::lapin::Connection {
    warren::broker::connect(AMQP_URL, "billing tests")
        .await
        .unwrap()
}

/// Deletes every queue and exchange whose name starts with `{prefix}.`, as the
/// broker lists them: all that billing declared under the prefix, whatever
/// retry tiers and partitions it ran with. Needs `rabbitmqctl` on the broker's
/// host, as the test command does anyway.
pub(crate) async fn delete_prefix(connection: &warren::lapin::Connection, prefix: &str) {
    let owned = |kind: &str| {
        let out = std::process::Command::new("rabbitmqctl")
            .args([kind, "-q", "--no-table-headers", "name"])
            .output()
            .expect("rabbitmqctl runs");
        assert!(out.status.success(), "rabbitmqctl {kind}");
        let start = format!("{prefix}.");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|name| name.starts_with(&start))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let channel = connection.create_channel().await.unwrap();
    for queue in owned("list_queues") {
        channel
            .queue_delete(queue.as_str().into(), Default::default())
            .await
            .unwrap();
    }
    for exchange in owned("list_exchanges") {
        channel
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await
            .unwrap();
    }
    let _ = channel.close(200, "deleted".into()).await;
}
