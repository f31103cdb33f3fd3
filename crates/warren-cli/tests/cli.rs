//! The `warren` CLI against the real broker: replay that survives being killed,
//! dry runs, listing, purging, inbox retention, and clear errors for bad arguments.

use std::process::{Output, Stdio};
use std::time::Duration;

use warren::Consumer;

use crate::util::{
    Backend, Job, Mode, Running, TestBroker, amqp_url, routes, set_broken, unique, wait_for,
};

pub(crate) fn warren_cmd() -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_warren"));
    cmd.env("AMQP_URL", amqp_url())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

pub(crate) async fn warren(args: &[&str]) -> Output {
    let child = warren_cmd()
        .args(args)
        .env("RUST_LOG", "warn,warren=debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    match tokio::time::timeout(Duration::from_secs(120), child.wait_with_output()).await {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // Say where it stood: the broker's view of its connections.
            let channels = std::process::Command::new("rabbitmqctl")
                .args([
                    "list_channels",
                    "name",
                    "messages_unacknowledged",
                    "messages_unconfirmed",
                ])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            panic!(
                "warren {args:?} (pid {pid:?}) did not finish within 120 s; channels:\n{channels}"
            )
        }
    }
}

pub(crate) fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Dead-letters `n` messages through a consumer whose handler is broken, then
/// mends the handler. Returns the message ids.
pub(crate) async fn dead_letter_some<B: Backend>(
    db: &crate::util::TestDb<B>,
    broker: &TestBroker,
    n: usize,
) -> Vec<String> {
    let switch = unique("switch");
    set_broken(&switch, true);
    let mut ids = Vec::new();
    for _ in 0..n {
        let m = TestBroker::message(&Job::with(Mode::PermanentWhileBroken {
            switch: switch.clone(),
        }));
        broker.publish(&m).await;
        ids.push(m.meta().message_id.clone());
    }
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(n as u64, Duration::from_secs(60)).await);
    assert_eq!(running.stats.snapshot().dead_lettered, n as u64);
    running.stop().await.unwrap();
    set_broken(&switch, false);
    ids
}

/// Runs the dead-letter store's ingester until `n` letters are stored.
pub(crate) async fn ingest<B: Backend>(db: &crate::util::TestDb<B>, broker: &TestBroker, n: usize) {
    use warren::store::{DeadLetterStore, LetterFilter};
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let ingester = warren_admin::Ingester::new(db.store.clone(), &broker.config());
    let task = tokio::spawn(async move {
        ingester
            .run(&amqp_url(), async {
                let _ = stopped.await;
            })
            .await
    });
    let store = db.store.clone();
    assert!(
        wait_for(Duration::from_secs(30), || {
            let store = store.clone();
            async move {
                store
                    .dead_letters(&LetterFilter::default(), None, 100)
                    .await
                    .unwrap()
                    .len()
                    == n
            }
        })
        .await,
        "{n} letters stored"
    );
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}

on_all_backends!(
    inbox_purge_refuses_a_short_window_and_deletes_old_rows,
    replay_killed_halfway_loses_nothing_and_applies_once,
    replay_ends_while_the_consumer_dead_letters_the_copies_again,
);

/// Regression (found in review): replay walked the dead-letter queue until it was
/// empty, so while the consumer kept failing the replayed copies and
/// dead-lettering them again, it replayed them in a loop. A pass now covers only
/// what was there when it started.
async fn replay_ends_while_the_consumer_dead_letters_the_copies_again<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let switch = unique("still-broken");
    set_broken(&switch, true);
    for _ in 0..3 {
        let m = TestBroker::message(&Job::with(Mode::PermanentWhileBroken {
            switch: switch.clone(),
        }));
        broker.publish(&m).await;
    }
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(3, Duration::from_secs(30)).await);

    let replay = warren(&["dlq", "replay", &broker.queue, "--all", "--rate", "10/s"]).await;
    let (out, err) = text(&replay);
    assert!(replay.status.success(), "{err}");
    assert!(out.contains("replayed 3 message(s)"), "{out}");
    // Regression (issue 24): the publishing channel was left open as the
    // connection closed, and lapin logged "invalid channel state: Closing".
    assert!(
        !err.contains("ERROR"),
        "nothing is logged as an error: {err}"
    );
    // The consumer fails them again: back in the dead-letter queue, nothing lost.
    assert!(running.settled(6, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&broker.dead_letter_queue()).await == 3
        })
        .await
    );
    set_broken(&switch, false);

    broker.cleanup().await;
    db.drop_db().await;
}

/// 100 dead letters; a dry run changes nothing; a replay is killed halfway and run
/// again; then the consumer applies each message exactly once.
async fn replay_killed_halfway_loses_nothing_and_applies_once<B: Backend>() {
    const N: usize = 100;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    dead_letter_some(&db, &broker, N).await;
    let dlq = broker.dead_letter_queue();
    assert_eq!(broker.ready(&dlq).await, N as u32);

    let dry = warren(&["dlq", "replay", &broker.queue, "--all", "--dry-run"]).await;
    let (out, err) = text(&dry);
    assert!(dry.status.success(), "{err}");
    assert!(
        out.contains(&format!("would replay {N} message(s)")),
        "{out}"
    );
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&dlq).await == N as u32
        })
        .await,
        "a dry run leaves every dead letter in place"
    );
    assert_eq!(
        broker.ready(&broker.queue).await,
        0,
        "and publishes nothing"
    );

    // Replay slowly and kill the process part-way.
    let mut slow = warren_cmd()
        .args(["dlq", "replay", &broker.queue, "--all", "--rate", "50/s"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(30), || async {
            broker.ready(&broker.queue).await >= 30
        })
        .await,
        "the replay made progress"
    );
    slow.kill().await.unwrap();
    let _ = slow.wait().await;
    // Whatever the killed process held unacked goes back to the dead-letter queue.
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&dlq).await + broker.ready(&broker.queue).await >= N as u32
        })
        .await,
        "nothing lost: {} + {}",
        broker.ready(&dlq).await,
        broker.ready(&broker.queue).await
    );
    let replayed_first = broker.ready(&broker.queue).await;
    assert!((replayed_first as usize) < N, "killed before the end");

    let rest = warren(&["dlq", "replay", &broker.queue, "--all"]).await;
    assert!(rest.status.success(), "{}", text(&rest).1);
    assert_eq!(broker.ready(&dlq).await, 0);
    let queued = broker.ready(&broker.queue).await;
    assert!(queued as usize >= N, "{queued}");

    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        running
            .settled(u64::from(queued), Duration::from_secs(60))
            .await
    );
    let s = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(s.applied, N as u64, "{s:?}");
    assert_eq!(s.applied + s.duplicates, u64::from(queued), "{s:?}");
    assert_eq!(
        db.effects().await,
        N as i64,
        "each message applied exactly once"
    );
    assert_eq!(db.distinct_effects().await, N as i64);
    assert_eq!(broker.ready(&dlq).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_show_purge_and_argument_errors() {
    let db = sqlx::Sqlite::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let ids = dead_letter_some(&db, &broker, 3).await;
    let q = broker.queue.as_str();

    let list = warren(&["dlq", "list", q]).await;
    let (out, err) = text(&list);
    assert!(list.status.success(), "{err}");
    for id in &ids {
        assert!(out.contains(id.as_str()), "{out}");
    }
    assert!(out.contains("permanent-failure"), "{out}");
    assert!(out.contains("3 dead letter(s)"), "{out}");
    assert!(!out.contains("payload:"), "payloads only on request");
    let with_payload = warren(&["dlq", "list", q, "--show-payload", "--limit", "1"]).await;
    let (out, _) = text(&with_payload);
    assert!(
        out.contains("payload:") && out.contains("1 dead letter(s)"),
        "{out}"
    );

    let show = warren(&["dlq", "show", q, &ids[1]]).await;
    let (out, _) = text(&show);
    assert!(show.status.success());
    assert!(
        out.contains(&ids[1]) && out.contains("x-warren-reason: permanent-failure"),
        "{out}"
    );
    assert!(
        !out.contains("LongString"),
        "headers decoded as text: {out}"
    );
    let missing = warren(&["dlq", "show", q, "no-such-id"]).await;
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        text(&missing).1.contains("no message with id"),
        "{}",
        text(&missing).1
    );

    let unconfirmed = warren(&["dlq", "purge", q, "--all"]).await;
    assert_eq!(unconfirmed.status.code(), Some(2));
    assert!(text(&unconfirmed).1.contains("--yes"));
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 3);

    let bad_reason = warren(&["dlq", "replay", q, "--all", "--reason", "nope"]).await;
    assert_eq!(bad_reason.status.code(), Some(2));
    assert!(text(&bad_reason).1.contains("unknown reason"));
    let bad_rate = warren(&["dlq", "replay", q, "--all", "--rate", "fast"]).await;
    assert_eq!(bad_rate.status.code(), Some(2));
    assert!(
        text(&bad_rate).1.contains("--rate"),
        "{}",
        text(&bad_rate).1
    );
    let neither = warren(&["dlq", "replay", q]).await;
    assert_eq!(neither.status.code(), Some(2), "--id or --all is required");
    let both = warren(&["dlq", "replay", q, "--all", "--id", "x"]).await;
    assert_eq!(both.status.code(), Some(2));

    let purge_one = warren(&["dlq", "purge", q, "--id", &ids[0], "--yes"]).await;
    assert!(purge_one.status.success());
    assert!(text(&purge_one).0.contains("purged 1 message(s)"));
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&broker.dead_letter_queue()).await == 2
        })
        .await
    );
    let unknown = warren(&["dlq", "replay", q, "--id", "no-such-id"]).await;
    assert_eq!(unknown.status.code(), Some(1), "an unknown id is a failure");
    assert!(
        text(&unknown)
            .1
            .contains("no dead letter with id no-such-id"),
        "{}",
        text(&unknown).1
    );
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 2);
    let replay_reason =
        warren(&["dlq", "replay", q, "--all", "--reason", "retries-exhausted"]).await;
    assert!(
        text(&replay_reason).0.contains("replayed 0 message(s)"),
        "{}",
        text(&replay_reason).0
    );
    let purge_all = warren(&["dlq", "purge", q, "--all", "--yes"]).await;
    assert!(purge_all.status.success());
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_declare_creates_what_the_consumer_expects() {
    let broker = TestBroker::new().await;
    let q = broker.queue.clone();
    let declare = warren(&[
        "topology",
        "declare",
        "--queue",
        &q,
        "--exchange",
        &broker.exchange,
        "--binding-key",
        "test.#",
        "--retry-tiers",
        "100ms,200ms,400ms",
        "--poison-limit",
        "3",
    ])
    .await;
    assert!(declare.status.success(), "{}", text(&declare).1);
    // The consumer's own declaration matches, so it starts without drift.
    broker.declare().await;
    assert_eq!(broker.ready(&format!("{q}.retry.400ms")).await, 0);
    let bad = warren(&["topology", "show", "--queue", &q, "--max-attempts", "0"]).await;
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad).1.contains("max attempts"), "{}", text(&bad).1);

    // Deleting: confirmed, and refused while a queue holds messages.
    let consumer = [
        "--queue",
        q.as_str(),
        "--exchange",
        broker.exchange.as_str(),
        "--binding-key",
        "test.#",
        "--retry-tiers",
        "100ms,200ms,400ms",
    ];
    let with = |verb: &[&str]| {
        let mut args = vec!["topology"];
        args.extend_from_slice(verb);
        args.extend_from_slice(&consumer);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| async move {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        warren(&refs).await
    };
    broker.publish(&TestBroker::message(&Job::ok())).await;
    let unconfirmed = run(with(&["delete"])).await;
    assert_eq!(unconfirmed.status.code(), Some(2));
    let refused = run(with(&["delete", "--yes"])).await;
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        text(&refused).1.contains("still hold messages"),
        "{}",
        text(&refused).1
    );
    assert_eq!(broker.ready(&q).await, 1);
    let deleted = run(with(&["delete", "--yes", "--force"])).await;
    assert!(deleted.status.success(), "{}", text(&deleted).1);
    assert!(
        text(&deleted)
            .0
            .contains(&format!("deleted queue    {q}.dead-letter"))
    );
    let gone = warren::broker::inspect_queue(&broker.connection, &q).await;
    assert!(gone.is_err(), "the queue is gone");
    broker.cleanup().await;
}

/// A stand-in queue the consumer declares (`with_stand_in_queue`) is
/// declared, shown and deleted by the CLI when given with `--stand-in`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_delete_removes_the_stand_in_queue_it_is_given() {
    let broker = TestBroker::new().await;
    let q = broker.queue.clone();
    let stand_in = format!("{q}.downstream");
    broker.track_queue(&stand_in);
    let config = broker
        .builder()
        .with_stand_in_queue(&broker.exchange, &stand_in, "out.#")
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    assert!(
        warren::broker::inspect_queue(&broker.connection, &stand_in)
            .await
            .is_ok()
    );
    let spec = format!("{}:{stand_in}:out.#", broker.exchange);
    let consumer = [
        "--queue",
        q.as_str(),
        "--exchange",
        broker.exchange.as_str(),
        "--binding-key",
        "test.#",
        "--retry-tiers",
        "100ms,200ms,400ms",
        "--stand-in",
        spec.as_str(),
    ];
    let mut show = vec!["topology", "show"];
    show.extend_from_slice(&consumer);
    let shown = warren(&show).await;
    assert!(shown.status.success(), "{}", text(&shown).1);
    assert!(text(&shown).0.contains(&stand_in), "{}", text(&shown).0);
    let mut delete = vec!["topology", "delete", "--yes"];
    delete.extend_from_slice(&consumer);
    let deleted = warren(&delete).await;
    assert!(deleted.status.success(), "{}", text(&deleted).1);
    assert!(
        text(&deleted)
            .0
            .contains(&format!("deleted queue    {stand_in}")),
        "{}",
        text(&deleted).0
    );
    let gone = warren::broker::inspect_queue(&broker.connection, &stand_in).await;
    assert!(gone.is_err(), "the stand-in queue is gone");
    let bad = warren(&["topology", "show", "--queue", &q, "--stand-in", "no-colons"]).await;
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad).1.contains("EXCHANGE:QUEUE:BINDING_KEY"),
        "{}",
        text(&bad).1
    );
    broker.cleanup().await;
}

on_all_backends!(outbox_status_and_retry_failed);

async fn outbox_status_and_retry_failed<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let event =
        warren::Outgoing::new(crate::util::OUT_EVENT, 1, &serde_json::json!({"n": 1})).unwrap();
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "nobody.listens", &event)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let pending = warren(&["outbox", "--database-url", &db.url, "status"]).await;
    let (out, err) = text(&pending);
    assert!(pending.status.success(), "{err}");
    assert!(out.contains("pending:   1"), "{out}");

    let relay = warren::Relay::new(db.store.clone(), warren::RelayConfig::new("cli-test"));
    let publisher = warren::broker::Publisher::new(std::sync::Arc::clone(&broker.connection));
    relay.run_once(&publisher).await.unwrap();

    let failed = warren(&["outbox", "--database-url", &db.url, "status"]).await;
    let (out, _) = text(&failed);
    assert!(
        out.contains("pending:   0") && out.contains("failed:    1"),
        "{out}"
    );
    assert!(
        out.contains(&event.meta().message_id) && out.contains("unroutable"),
        "{out}"
    );

    // Counted in SQL for the relay's gauges; listed only up to --limit.
    use warren::store::OutboxStore;
    let counts = db.store.outbox_counts().await.unwrap();
    assert_eq!((counts.pending, counts.failed), (0, 1));
    let bounded = warren(&[
        "outbox",
        "--database-url",
        &db.url,
        "status",
        "--limit",
        "0",
    ])
    .await;
    let (out, _) = text(&bounded);
    assert!(
        out.contains("failed:    1")
            && out.contains("1 more (--limit)")
            && !out.contains(&event.meta().message_id),
        "{out}"
    );

    let retried = warren(&["outbox", "--database-url", &db.url, "retry-failed"]).await;
    assert!(
        text(&retried).0.contains("requeued 1 failed row(s)"),
        "{}",
        text(&retried).0
    );
    let again = warren(&["outbox", "--database-url", &db.url, "status"]).await;
    assert!(
        text(&again).0.contains("pending:   1"),
        "{}",
        text(&again).0
    );

    broker.cleanup().await;
    db.drop_db().await;
}

/// Regression (issue 10): `warren outbox` printed a `?password=` parameter and a
/// password holding `/` whole, a bad scheme was echoed by the argument parser, and
/// a malformed broker URL appeared in full in a log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_form_of_credential_is_printed() {
    for (database, bad_argument) in [
        (
            "postgres://u:SECRET/x@127.0.0.1/nodb?password=SECRET2",
            false,
        ),
        ("postgres://u@127.0.0.1/nodb?password=SECRET", false),
        (
            "postgres://u:SE%2FCRET@127.0.0.1/db?sslpassword=SECRET",
            false,
        ),
        ("pg://u:SECRET@127.0.0.1/db", true),
    ] {
        let out = warren(&["outbox", "--database-url", database, "status"]).await;
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(if bad_argument { 2 } else { 1 }),
            "{stderr}"
        );
        assert!(
            !stdout.contains("SECRET") && !stderr.contains("SECRET"),
            "{database}:\n{stdout}\n{stderr}"
        );
    }
    let out = warren_cmd()
        .env("AMQP_URL", "amqp://u:SECRET/x@127.0.0.1:1/%2f")
        .args(["dlq", "list", "q"])
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        !stdout.contains("SECRET") && !stderr.contains("SECRET"),
        "{stdout}\n{stderr}"
    );
}

/// Regression (issue 10): `dlq list`, `show` and `replay` printed message ids,
/// types, reasons, errors, headers and payloads raw, so a producer could send
/// ESC sequences to the operator's terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_output_escapes_control_characters() {
    use warren::lapin::BasicProperties;
    use warren::lapin::types::{AMQPValue, FieldTable, LongString};
    let broker = TestBroker::new().await;
    broker.declare().await;
    let evil = "\u{1b}]0;pwned\u{7}\u{1b}[2J\r\u{9b}31m\u{202e}";
    let id = format!("id-{evil}");
    let text_value = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
    let mut headers = FieldTable::default();
    headers.insert(
        warren::headers::HEADER_REASON.into(),
        text_value(&format!("r{evil}")),
    );
    headers.insert(
        warren::headers::HEADER_ERROR.into(),
        text_value(&format!("e{evil}")),
    );
    headers.insert(
        format!("x-h{}", &evil[..5]).as_str().into(),
        text_value(evil),
    );
    let properties = BasicProperties::default()
        .with_message_id(id.as_str().into())
        .with_type(format!("t{evil}").as_str().into())
        .with_headers(headers);
    broker
        .publisher
        .publish_raw(
            "",
            &broker.dead_letter_queue(),
            format!("{{\"p\":\"{evil}\"}}").as_bytes(),
            properties,
        )
        .await
        .unwrap();
    let q = broker.queue.as_str();
    for args in [
        vec!["dlq", "list", q, "--show-payload"],
        vec!["dlq", "show", q, &id, "--show-payload"],
        vec!["dlq", "replay", q, "--all", "--dry-run"],
    ] {
        let out = warren(&args).await;
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(stdout.contains(r"id-\u{1b}]0;pwned"), "{args:?}: {stdout}");
        for c in ['\u{1b}', '\u{7}', '\r', '\u{9b}', '\u{202e}'] {
            assert!(
                !stdout.contains(c) && !stderr.contains(c),
                "{args:?} printed {c:?} raw:\n{stdout}"
            );
        }
    }
    broker.cleanup().await;
}

/// A dead-letter queue holding letters the AMQP client cannot read as sent
/// (put there by the broker or a producer, never by warren's consumer):
/// headers nested thousands of levels deep, text that is not UTF-8. Listing,
/// showing and replaying them works, shows what was removed on reading, and
/// loses no letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_tools_survive_letters_the_client_cannot_read() {
    use warren_chaos::hostile::{NESTED_TABLE_LEVEL, Properties, RawPublisher, Value};
    let broker = TestBroker::new().await;
    broker.declare().await;
    let mut producer = RawPublisher::connect(&amqp_url()).await.unwrap();
    let id = |case: &str| format!("{}-{case}", broker.name);
    let letter = |case: &str| {
        Properties::default()
            .message_id(id(case))
            .content_type("application/json")
            .header("tenant", Value::long_string("acme"))
    };
    let room = producer.frame_max() - letter("deepest").frame_len() - 2 - 1;
    let letters = [
        ("valid", letter("valid")),
        (
            "deep",
            letter("deep").header("h", Value::nested_tables(2_000, Value::void())),
        ),
        (
            "deepest",
            letter("deepest").header(
                "h",
                Value::nested_tables(room / NESTED_TABLE_LEVEL, Value::void()),
            ),
        ),
        (
            "arrays",
            letter("arrays").header("h", Value::nested_arrays(20_000, Value::void())),
        ),
        ("name", letter("name").header([0xff], Value::long(1))),
    ];
    for (case, p) in &letters {
        producer
            .publish("", broker.dead_letter_queue(), p, b"{}")
            .await
            .unwrap_or_else(|e| panic!("{case}: {e}"));
    }
    // And one whose id is not UTF-8: it is listed as `...?`.
    let mut bent = id("bent-id").into_bytes();
    bent.push(0xfe);
    producer
        .publish(
            "",
            broker.dead_letter_queue(),
            &Properties::default().message_id(bent),
            b"{}",
        )
        .await
        .unwrap();
    producer.close().await;
    let q = broker.queue.as_str();

    let out = warren(&["dlq", "list", q]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("6 dead letter(s)"), "{stdout}");
    assert_eq!(
        stdout.matches("headers pruned on reading").count(),
        5,
        "{stdout}"
    );
    assert!(stdout.contains(&format!("{}?", id("bent-id"))), "{stdout}");
    assert_eq!(
        broker.ready(&broker.dead_letter_queue()).await,
        6,
        "nothing lost"
    );

    let out = warren(&["dlq", "show", q, &id("deepest")]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("pruned:     headers-too-deep"), "{stdout}");
    assert!(stdout.contains("removed:    \"h\""), "{stdout}");
    assert!(stdout.contains("digest:     sha256:"), "{stdout}");
    assert!(stdout.contains("tenant"), "{stdout}");

    let out = warren(&["dlq", "replay", q, "--all"]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 0);
    let replayed = broker.drain(q).await;
    assert_eq!(replayed.len(), 6, "every letter replayed");
    let dropped = |id: &str| {
        let d = replayed
            .iter()
            .find(|d| d.properties.message_id().as_ref().map(|s| s.as_str()) == Some(id))
            .unwrap_or_else(|| panic!("{id} replayed"));
        let headers = d.properties.headers().clone().unwrap_or_default();
        assert_eq!(
            warren::amqp::header_str(&headers, "tenant").as_deref(),
            (!id.ends_with('?')).then_some("acme"),
            "{id}: the other headers travel on"
        );
        let digest = warren::amqp::header_str(&headers, warren::headers::HEADER_PRUNED_DIGEST);
        assert_eq!(
            digest.is_some_and(|d| d.starts_with("sha256:")),
            !id.ends_with("-valid"),
            "{id}: the digest of what was removed or replaced"
        );
        warren::amqp::header_str(&headers, warren::headers::HEADER_DROPPED).map(|s| s.into_owned())
    };
    for case in ["deep", "deepest", "arrays"] {
        assert_eq!(dropped(&id(case)).as_deref(), Some("\"h\""), "{case}");
    }
    assert_eq!(dropped(&id("name")).as_deref(), Some("\"\\xff\""));
    assert_eq!(
        dropped(&id("valid")),
        None,
        "a letter read as sent is replayed as sent"
    );
    assert_eq!(
        dropped(&format!("{}?", id("bent-id"))),
        None,
        "nothing removed, bytes replaced"
    );
    broker.cleanup().await;
}

/// Regression (issue 10): `inbox purge --older-than 100000000d` panicked on date
/// overflow; a huge number of days overflowed a sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_windows_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
    warren::SqliteStore::connect(&url).await.unwrap();
    for (older_than, code) in [
        ("100000000d", 2),
        ("18446744073709551615ms", 2),
        ("99999999999999999999999d", 2),
    ] {
        let out = warren(&[
            "inbox",
            "--database-url",
            &url,
            "purge",
            "--consumer",
            "c",
            "--older-than",
            older_than,
            "--replay-margin",
            "18446744073709551615ms",
            "--force",
        ])
        .await;
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{older_than}: {stdout}{stderr}"
        );
        assert!(
            !stderr.contains("panicked")
                && (stderr.contains("too long") || stderr.contains("longer than")),
            "{older_than}: {stderr}"
        );
    }
}

async fn inbox_purge_refuses_a_short_window_and_deletes_old_rows<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    for _ in 0..3 {
        broker.publish(&TestBroker::message(&Job::ok())).await;
    }
    assert!(running.settled(3, Duration::from_secs(30)).await);
    // The first three rows age past a 1 s window; two more stay young.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for _ in 0..2 {
        broker.publish(&TestBroker::message(&Job::ok())).await;
    }
    assert!(running.settled(5, Duration::from_secs(30)).await);
    running.stop().await.unwrap();

    let purge = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_warren"));
        cmd.args([
            "inbox",
            "--database-url",
            &db.url,
            "purge",
            "--consumer",
            &broker.name,
        ]);
        cmd.args(extra);
        cmd.output().unwrap()
    };
    let refused = purge(&["--older-than", "1s"]);
    assert_eq!(refused.status.code(), Some(1));
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(
        why.contains("retry horizon") && why.contains("--force"),
        "{why}"
    );
    assert_eq!(
        db.inbox(&broker.name).await,
        5,
        "nothing deleted when refused"
    );

    let forced = purge(&["--older-than", "1s", "--force"]);
    let out = String::from_utf8_lossy(&forced.stdout);
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
    assert!(out.contains("deleted 3 inbox row(s)"), "{out}");
    assert_eq!(db.inbox(&broker.name).await, 2);

    broker.cleanup().await;
    db.drop_db().await;
}
