//! `billing run` checks its deployment before it consumes (`warren doctor`'s
//! checks): a policy that lowers the dead-letter queue's delivery limit
//! refuses the start with the check and its fix; database findings, even a
//! failed one, only warn; a management API it cannot reach skips its checks.

use std::process::Stdio;
use std::time::Duration;

use warren_doctor::{BrokerAccess, Management};

mod common;
use common::*;

/// Until the management API has `policy` and shows `queue`.
async fn policy_shown(queue: &str, policy: &str) -> bool {
    let api = Management::new(&BrokerAccess {
        amqp_url: AMQP_URL.to_owned(),
        ..BrokerAccess::default()
    })
    .unwrap();
    wait_for(Duration::from_secs(60), || async {
        api.ask(&[queue.to_owned()]).await.is_ok_and(|facts| {
            facts.queues[queue]
                .as_ref()
                .and_then(|q| q.policy.as_ref())
                .is_some_and(|p| p.name == policy)
        })
    })
    .await
}

#[tokio::test]
async fn a_policy_lowering_the_dead_letter_queues_limit_refuses_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("billing.db");
    let prefix = unique("billing-doctor");
    let db = database.to_str().unwrap();
    // The topology as billing declares it.
    let (ok, _, err) = output(billing().args([
        "--prefix",
        &prefix,
        "--database-url",
        db,
        "publish",
        "--count",
        "0",
    ]))
    .await;
    assert!(ok, "{err}");
    let dlq = format!("{prefix}.invoice-paid.dead-letter");
    let name = format!("{prefix}-dlq-limit");
    let policy = warren_chaos::QueuePolicy::set(
        &name,
        &format!("^{}$", dlq.replace('.', "\\.")),
        r#"{"delivery-limit": 20}"#,
    )
    .unwrap();
    assert!(
        policy_shown(&dlq, &name).await,
        "the management API never showed {name} on {dlq}"
    );

    let port = free_port();
    let (ok, _, err) = output(billing().args([
        "--prefix",
        &prefix,
        "--database-url",
        db,
        "--http",
        &format!("127.0.0.1:{port}"),
        "run",
    ]))
    .await;
    assert!(!ok, "billing refused to start: {err}");
    assert!(err.contains("refusing to start, 1 check failed"), "{err}");
    assert!(
        err.contains(&format!("delivery-limit on {dlq}: 20 (policy \"{name}\")")),
        "{err}"
    );
    assert!(
        err.contains("fix: remove delivery-limit from the policy"),
        "{err}"
    );

    // Without the policy it starts.
    drop(policy);
    let mut run = start_run(
        billing().args(["--prefix", &prefix, "--database-url", db]),
        free_port(),
    )
    .await;
    stop(&mut run).await;
    delete_prefix(&warren_connect().await, &prefix).await;
}

#[tokio::test]
async fn database_findings_only_warn_and_an_unreachable_api_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("billing.db");
    let prefix = unique("billing-doctor-db");
    let db = database.to_str().unwrap();
    // A first run makes the database.
    let mut first = start_run(
        billing().args(["--prefix", &prefix, "--database-url", db]),
        free_port(),
    )
    .await;
    stop(&mut first).await;
    // Migrated by a newer warren: `warren doctor` fails on it, a start warns.
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{db}"))
        .await
        .unwrap();
    sqlx::query("INSERT INTO warren_migrations (version, name) VALUES (9999, 'from the future')")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;

    let log = tempfile::NamedTempFile::new().unwrap();
    let port = free_port();
    let mut run = billing()
        .args([
            "--prefix",
            &prefix,
            "--database-url",
            db,
            "--management-url",
            "http://127.0.0.1:9/",
            "--http",
            &format!("127.0.0.1:{port}"),
            "run",
        ])
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    wait_ready(&mut run, port, log.path()).await;
    stop(&mut run).await;
    let printed = std::fs::read_to_string(log.path()).unwrap();
    let line = |check: &str| {
        printed
            .lines()
            .find(|l| l.contains("doctor:") && l.contains(&format!("\"check\":\"{check}\"")))
            .unwrap_or_else(|| panic!("no doctor line on {check}:\n{printed}"))
            .to_owned()
    };
    let migrations = line("migrations");
    assert!(
        migrations.contains("WARN") && migrations.contains("version 9999"),
        "{migrations}"
    );
    let api = line("management-api");
    assert!(
        api.contains("doctor: skipped") && api.contains("127.0.0.1:9"),
        "{api}"
    );
    delete_prefix(&warren_connect().await, &prefix).await;
}

async fn stop(run: &mut tokio::process::Child) {
    let pid = run.id().unwrap().to_string();
    let _ = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await;
    let exit = tokio::time::timeout(Duration::from_secs(60), run.wait())
        .await
        .expect("billing run drains and exits after SIGTERM")
        .unwrap();
    assert!(exit.success(), "exit 0 on SIGTERM: {exit:?}");
}

/// A first start finds nothing declared yet, and declares it next: one INFO
/// line says so, not a warning per queue.
#[tokio::test]
async fn a_first_start_does_not_warn_of_queues_it_is_about_to_declare() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("billing.db");
    let prefix = unique("billing-first");
    let log = tempfile::NamedTempFile::new().unwrap();
    let port = free_port();
    let mut run = billing()
        .args([
            "--prefix",
            &prefix,
            "--database-url",
            database.to_str().unwrap(),
            "--http",
            &format!("127.0.0.1:{port}"),
            "run",
        ])
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    wait_ready(&mut run, port, log.path()).await;
    stop(&mut run).await;
    let printed = std::fs::read_to_string(log.path()).unwrap();
    delete_prefix(&warren_connect().await, &prefix).await;
    assert!(
        !printed.contains("\"check\":\"queue-exists\""),
        "a check line per queue:\n{printed}"
    );
    let said = printed
        .lines()
        .find(|l| l.contains("queues not declared yet"))
        .unwrap_or_else(|| panic!("no line on the undeclared queues:\n{printed}"));
    assert!(said.contains("\"level\":\"INFO\""), "{said}");
}
