//! `warren doctor` against the local broker and databases: a topology as
//! warren declares it passes; policies that lower the dead-letter queue's
//! delivery limit or shorten a retry tier fail, an operator policy's cap
//! warns; node settings read with rabbitmqctl; what cannot be asked is
//! skipped; the database checks on every backend.

use std::process::Output;
use std::time::Duration;

use serde_json::Value;
use warren::Consumer;

use crate::cli::{dead_letter_some, ingest, text, warren};
use crate::util::{Backend, Job, Running, TestBroker, routes, unique};

on_all_backends!(doctor_checks_the_database);

/// The flags of the consumer the broker tests check.
fn consumer(queue: &str) -> Vec<String> {
    ["--queue", queue, "--retry-tiers", "1s,5s"]
        .map(str::to_owned)
        .to_vec()
}

async fn doctor(queue: &str, extra: &[&str]) -> Output {
    let mut args = vec!["doctor".to_owned()];
    args.extend(consumer(queue));
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    warren(&args).await
}

fn checks(out: &Output) -> Vec<Value> {
    let (stdout, stderr) = text(out);
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}\n{stderr}"));
    report["checks"].as_array().unwrap().clone()
}

fn status<'a>(checks: &'a [Value], check: &str, subject: &str) -> &'a Value {
    checks
        .iter()
        .find(|c| c["check"] == check && c["subject"] == subject)
        .unwrap_or_else(|| panic!("no {check} on {subject}: {checks:#?}"))
}

/// A check's `detail`, which every check has.
fn detail(check: &Value) -> &str {
    check["detail"]
        .as_str()
        .unwrap_or_else(|| panic!("no detail: {check}"))
}

fn failed(checks: &[Value]) -> Vec<&Value> {
    checks.iter().filter(|c| c["status"] == "fail").collect()
}

async fn declare(queue: &str) {
    let mut args = vec!["topology".to_owned(), "declare".to_owned()];
    args.extend(consumer(queue));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = warren(&args).await;
    assert!(out.status.success(), "{:?}", text(&out));
}

async fn delete(queue: &str) {
    let mut args = vec!["topology".to_owned(), "delete".to_owned()];
    args.extend(consumer(queue));
    args.extend(["--force".to_owned(), "--yes".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = warren(&args).await;
    assert!(out.status.success(), "{:?}", text(&out));
}

#[tokio::test]
async fn policies_that_break_the_topology_fail_and_an_operator_cap_warns() {
    let queue = unique("doctor");
    declare(&queue).await;
    let dlq = format!("{queue}.dead-letter");
    let tier = format!("{queue}.retry.1s");

    // As warren declares it: nothing fails.
    let out = doctor(&queue, &["--json", "--no-rabbitmqctl"]).await;
    let clean = checks(&out);
    assert!(failed(&clean).is_empty(), "{:#?}", failed(&clean));
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(status(&clean, "delivery-limit", &dlq)["status"], "pass");
    assert_eq!(
        status(&clean, "retry-ttl", &tier)["detail"],
        "1000 ms (queue argument)"
    );
    assert_eq!(
        status(&clean, "dead-letter-target", &tier)["status"],
        "pass"
    );

    let escape = |name: &str| name.replace('.', "\\.");
    let limit = warren_chaos::QueuePolicy::set(
        &format!("{queue}-dlq-limit"),
        &format!("^{}$", escape(&dlq)),
        r#"{"delivery-limit": 20}"#,
    )
    .unwrap();
    let ttl = warren_chaos::QueuePolicy::set(
        &format!("{queue}-tier-ttl"),
        &format!("^{}$", escape(&tier)),
        r#"{"message-ttl": 300}"#,
    )
    .unwrap();
    let cap = warren_chaos::QueuePolicy::set_operator(
        &format!("{queue}-cap"),
        &format!("^{}$", escape(&queue)),
        r#"{"max-length": 1000}"#,
    )
    .unwrap();
    // The management API shows a queue's policy once its statistics are
    // next emitted (every 5 s by default).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let broken = loop {
        let found = checks(&doctor(&queue, &["--json", "--no-rabbitmqctl"]).await);
        if failed(&found).len() >= 2 && found.iter().any(|c| c["check"] == "max-length") {
            break found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the policies never showed: {found:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let dlq_limit = status(&broken, "delivery-limit", &dlq);
    assert_eq!(dlq_limit["status"], "fail", "{dlq_limit}");
    let dlq_detail = detail(dlq_limit);
    assert!(
        dlq_detail.contains(&format!("20 (policy \"{queue}-dlq-limit\")")),
        "{dlq_detail}"
    );
    let tier_ttl = status(&broken, "retry-ttl", &tier);
    assert_eq!(tier_ttl["status"], "fail", "{tier_ttl}");
    assert!(detail(tier_ttl).contains("300 ms"), "{tier_ttl}");
    assert!(
        tier_ttl["fix"].as_str().unwrap().contains("message-ttl"),
        "{tier_ttl}"
    );
    let main_cap = status(&broken, "max-length", &queue);
    assert_eq!(main_cap["status"], "warn", "{main_cap}");
    assert!(
        detail(main_cap).contains(&format!("operator policy \"{queue}-cap\"")),
        "{main_cap}"
    );
    assert_eq!(failed(&broken).len(), 2, "{:#?}", failed(&broken));

    // For people: each check on a line, the fix under it; exit code 1.
    let out = doctor(&queue, &["--no-rabbitmqctl"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("fail  delivery-limit           {dlq}")),
        "{stdout}"
    );
    assert!(
        stdout.contains("      fix: remove delivery-limit from the policy"),
        "{stdout}"
    );
    assert!(stderr.contains("2 checks failed"), "{stderr}");

    drop((limit, ttl, cap));
    delete(&queue).await;
}

#[tokio::test]
async fn node_settings_are_read_with_rabbitmqctl() {
    let queue = unique("doctor-node");
    declare(&queue).await;
    let out = doctor(&queue, &["--json"]).await;
    let found = checks(&out);
    let timeout = status(&found, "consumer-timeout", "broker");
    assert_eq!(timeout["status"], "pass", "{timeout}");
    assert!(
        detail(timeout).contains("(the node's consumer_timeout)"),
        "{timeout}"
    );
    let size = status(&found, "max-message-size", "broker");
    assert!(
        detail(size).contains("(the node's max_message_size)"),
        "{size}"
    );
    assert_eq!(status(&found, "frame-size", "broker")["status"], "pass");
    // This broker keeps the dead-letter worker's default resend time.
    let handoff = status(&found, "retry-handoff", "broker");
    assert_eq!(handoff["status"], "warn", "{handoff}");
    assert!(
        detail(handoff).contains("after 180000 ms (the node's)"),
        "{handoff}"
    );
    // A solo run longer than the broker's consumer_timeout (30 min here):
    // the broker would close the channel first.
    let out = doctor(&queue, &["--json", "--solo-timeout", "45m"]).await;
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    let found = checks(&out);
    let timeout = status(&found, "consumer-timeout", "broker");
    assert_eq!(timeout["status"], "fail", "{timeout}");
    assert!(detail(timeout).contains("closes the channel"), "{timeout}");
    delete(&queue).await;
}

#[tokio::test]
async fn what_cannot_be_asked_is_skipped_and_no_password_is_printed() {
    let queue = unique("doctor-skip");
    let out = doctor(
        &queue,
        &[
            "--json",
            "--management-url",
            "http://nobody:s3cret-pw@127.0.0.1:9/",
            "--rabbitmqctl",
            "/nonexistent/rabbitmqctl",
        ],
    )
    .await;
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "a skip never fails: {stdout}\n{stderr}"
    );
    assert!(
        !stdout.contains("s3cret-pw") && !stderr.contains("s3cret-pw"),
        "{stdout}{stderr}"
    );
    let found = checks(&out);
    let api = status(&found, "management-api", "broker");
    assert_eq!(api["status"], "skip");
    assert!(detail(api).contains("http://127.0.0.1:9/"), "{api}");
    let timeout = status(&found, "consumer-timeout", "broker");
    assert_eq!(timeout["status"], "skip");
    assert!(
        detail(timeout).contains("/nonexistent/rabbitmqctl"),
        "{timeout}"
    );
    // The AMQP connection still answers.
    assert_eq!(status(&found, "frame-size", "broker")["status"], "pass");

    // A wrong flag value stops with what to fix.
    let out = doctor(&queue, &["--management-url", "ftp://x"]).await;
    let (stdout, _) = text(&out);
    assert!(stdout.contains("must be http:// or https://"), "{stdout}");
}

/// A broker user for one test, deleted when dropped.
struct BrokerUser(String);

impl BrokerUser {
    fn monitoring(name: &str, password: &str) -> Self {
        let ctl = |args: &[&str]| {
            let out = std::process::Command::new("rabbitmqctl")
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "rabbitmqctl {args:?}: {out:?}");
        };
        ctl(&["add_user", name, password]);
        let user = BrokerUser(name.to_owned());
        ctl(&["set_user_tags", name, "monitoring"]);
        // Access to the virtual host, and no right to do anything in it.
        ctl(&["set_permissions", "-p", "/", name, "^$", "^$", "^$"]);
        user
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.0])
            .output();
    }
}

/// The least the checks need: a user tagged `monitoring` with access to the
/// virtual host and no permission in it reads every queue and policy; the
/// feature flags (administrator only before 3.13) are skipped.
#[tokio::test]
async fn a_monitoring_user_is_enough() {
    let queue = unique("doctor-monitor");
    declare(&queue).await;
    let name = unique("doctor-mon");
    let _user = BrokerUser::monitoring(&name, "mon-pw-4711");
    let url = format!("http://{name}:mon-pw-4711@127.0.0.1:15672");
    let out = doctor(
        &queue,
        &["--json", "--no-rabbitmqctl", "--management-url", &url],
    )
    .await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains("mon-pw-4711"), "{stdout}");
    let found = checks(&out);
    assert_eq!(status(&found, "broker-version", "broker")["status"], "pass");
    assert_eq!(
        status(&found, "delivery-limit", &format!("{queue}.dead-letter"))["status"],
        "pass"
    );
    assert_eq!(
        status(&found, "retry-ttl", &format!("{queue}.retry.5s"))["status"],
        "pass"
    );
    let flags = status(&found, "feature-flags", "broker");
    assert_eq!(flags["status"], "skip", "{flags}");
    delete(&queue).await;
}

/// Two days ago, in the dialect of `B`.
fn two_days_ago<B: Backend>() -> &'static str {
    match <B as Backend>::NAME {
        "postgres" => "now() - interval '2 days'",
        "sqlite" => "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-2 days')",
        _ => "UTC_TIMESTAMP(6) - INTERVAL 2 DAY",
    }
}

async fn doctor_checks_the_database<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let queue = broker.queue.clone();
    let tiers = crate::util::TEST_TIERS
        .iter()
        .map(|d| format!("{}ms", d.as_millis()))
        .collect::<Vec<_>>()
        .join(",");
    let run = |extra: Vec<String>| {
        let mut args: Vec<String> = [
            "doctor",
            "--queue",
            &queue,
            "--retry-tiers",
            &tiers,
            "--consumer-name",
            &broker.name,
            "--database-url",
            &db.url,
            "--no-rabbitmqctl",
            "--json",
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend(extra);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            warren(&args).await
        }
    };
    let week = || vec!["--inbox-retention".to_owned(), "1d".to_owned()];

    // A fresh database: tables at this build's version, nothing waiting.
    let fresh = checks(&run(week()).await);
    for check in [
        "migrations",
        "inbox",
        "outbox",
        "dead-letters",
        "clock-skew",
    ] {
        assert_eq!(
            status(&fresh, check, "database")["status"],
            "pass",
            "{fresh:#?}"
        );
    }

    // One dead letter, unresolved; two messages applied, each writing an
    // outbox event no relay publishes; then their rows made two days old.
    dead_letter_some(&db, &broker, 1).await;
    ingest(&db, &broker, 1).await;
    for _ in 0..2 {
        broker
            .publish(&TestBroker::message(
                &Job::ok().emitting(1, &broker.exchange),
            ))
            .await;
    }
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(2, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    B::exec(
        &db.store,
        format!(
            "UPDATE warren_inbox SET processed_at = {}",
            two_days_ago::<B>()
        ),
    )
    .await;
    B::exec(
        &db.store,
        format!(
            "UPDATE warren_outbox SET created_at = {}",
            two_days_ago::<B>()
        ),
    )
    .await;

    let out = run(week()).await;
    assert!(out.status.success(), "warnings only: {:?}", text(&out));
    let found = checks(&out);
    let inbox = status(&found, "inbox", "database");
    assert_eq!(inbox["status"], "warn", "{inbox}");
    assert!(detail(inbox).starts_with("2 of 2 rows"), "{inbox}");
    let outbox = status(&found, "outbox", "database");
    assert_eq!(outbox["status"], "warn", "{outbox}");
    assert!(detail(outbox).starts_with("2 rows pending"), "{outbox}");
    let letters = status(&found, "dead-letters", "database");
    assert_eq!(letters["status"], "warn", "{letters}");
    assert!(detail(letters).starts_with("1 unresolved"), "{letters}");
    assert_eq!(status(&found, "clock-skew", "database")["status"], "pass");
    // Without a retention window, nothing purges the inbox.
    let unbounded = checks(&run(Vec::new()).await);
    assert!(
        status(&unbounded, "inbox", "database")["detail"]
            .as_str()
            .unwrap()
            .contains("no retention window")
    );

    // Migrated by a newer warren than this one: a failure.
    B::exec(
        &db.store,
        "INSERT INTO warren_migrations (version, name) VALUES (9999, 'from the future')".into(),
    )
    .await;
    let out = run(week()).await;
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    let found = checks(&out);
    let migrations = status(&found, "migrations", "database");
    assert_eq!(migrations["status"], "fail", "{migrations}");
    assert!(detail(migrations).contains("version 9999"), "{migrations}");

    broker.cleanup().await;
    db.drop_db().await;
}
