#![allow(unreachable_pub)]
//! What the logs say of each outcome, read back as JSON from a consumer on
//! PostgreSQL: one line per outcome and no second one elsewhere, one attempt
//! numbering, no empty ids, a producer's malformed message at WARN and a
//! failure of the work at ERROR, the fields of an envelope that was read but
//! refused, and database errors without PostgreSQL's source line.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use warren::Consumer;
use warren::lapin::BasicProperties;

use util::*;

// Its own test binary, so its own process: tracing caches per call site
// whether anyone listens, and in the shared binary another test's thread,
// with no subscriber, could hit a call site first and leave this test's
// subscriber unasked (twice in CI the INFO line of a message's success was
// missing while the WARN and ERROR lines were there).
// The fixtures shared by warren's tests, the CLI's and the benches
// (crates/warren-test-support), as `crate::util::...`.
use warren_test_support as util;

/// Log lines written by the test's own thread, as the JSON formatter wrote
/// them.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines(&self) -> Vec<Value> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }
}

/// The "message processed" lines of `id`, in order.
fn processed<'a>(lines: &'a [Value], id: &str) -> Vec<&'a Value> {
    lines
        .iter()
        .filter(|l| {
            l["fields"]["message"] == "message processed" && l["fields"]["message_id"] == id
        })
        .collect()
}

// A current-thread runtime: the consumer's tasks run on the thread whose
// default subscriber captures them, and no other test's lines get in.
#[tokio::test(flavor = "current_thread")]
async fn each_outcome_is_logged_once_and_truthfully() {
    let captured = Captured::default();
    let writer = captured.clone();
    // Applied outcomes are logged at DEBUG.
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_env_filter("info,warren::telemetry=debug")
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = <sqlx::Postgres as Backend>::create().await;
    // Migrating a database that is up to date, as every start does: no
    // "already exists, skipping" notice reaches the log.
    warren::store::Store::migrate(&db.store).await.unwrap();
    let broker = TestBroker::new().await;
    broker.declare().await;
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<sqlx::Postgres>(),
    ));

    let retried = TestBroker::message(&Job::with(Mode::Transient { n: 1 }));
    let permanent = TestBroker::message(&Job::with(Mode::Permanent));
    let swallowed = TestBroker::message(&Job::with(Mode::SwallowError));
    let unknown_version = warren::Outgoing::new(EVENT, 9, &Job::ok()).unwrap();
    for m in [&retried, &permanent, &swallowed, &unknown_version] {
        broker.publish(m).await;
    }
    broker
        .publish_raw(
            b"{not json",
            BasicProperties::default()
                .with_message_id("not-json-1".into())
                .with_content_type("application/json".into()),
        )
        .await;
    let id = |m: &warren::Outgoing| m.meta().message_id.clone();
    // Each message reaches its end; the retried one is also counted by its
    // effect in the database.
    let ended = |lines: &[Value], id: &str| {
        processed(lines, id).iter().any(|l| {
            matches!(
                l["fields"]["processing_result"].as_str(),
                Some("applied" | "dead-lettered")
            )
        })
    };
    let others = [
        id(&permanent),
        id(&swallowed),
        id(&unknown_version),
        "not-json-1".to_owned(),
    ];
    let all_ended = wait_for(Duration::from_secs(60), || {
        let lines = captured.lines();
        let done = others.iter().all(|i| ended(&lines, i)) && ended(&lines, &id(&retried));
        let db = &db;
        let retried = id(&retried);
        async move { done && db.effects_for(&retried).await == 1 }
    })
    .await;
    running.stop().await.unwrap();
    let lines = captured.lines();
    assert!(
        all_ended,
        "not every message ended: {:#?}",
        lines
            .iter()
            .filter(|l| l["fields"]["message"] == "message processed")
            .collect::<Vec<_>>()
    );
    assert_eq!(db.effects_for(&id(&retried)).await, 1, "applied once");

    // A retry and the success after it: one line each, numbered by the
    // attempts that failed before.
    let seen = processed(&lines, &id(&retried));
    assert_eq!(seen.len(), 2, "one line per outcome: {seen:#?}");
    let first = &seen[0];
    assert_eq!(first["level"], "WARN");
    assert_eq!(first["fields"]["processing_result"], "retried");
    assert_eq!(first["fields"]["retry_attempt"], 0);
    assert!(first["fields"]["error"].is_string(), "{first}");
    assert!(first["fields"]["retry_in"].is_string(), "{first}");
    let second = &seen[1];
    assert_eq!(second["level"], "DEBUG");
    assert_eq!(second["fields"]["processing_result"], "applied");
    assert_eq!(second["fields"]["retry_attempt"], 1);
    assert!(second["fields"].get("error").is_none(), "{second}");

    // The handler's permanent failure: a failure of the work, at ERROR, once.
    let seen = processed(&lines, &id(&permanent));
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert_eq!(seen[0]["level"], "ERROR");
    assert_eq!(seen[0]["fields"]["dead_letter_reason"], "permanent-failure");
    assert_eq!(seen[0]["fields"]["event_type"], EVENT);

    // A producer's malformed messages: WARN, with what could be read. An
    // envelope that parsed names its event type and correlation id; one that
    // did not names neither, and says so by leaving them out.
    let seen = processed(&lines, &id(&unknown_version));
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert_eq!(seen[0]["level"], "WARN");
    assert_eq!(
        seen[0]["fields"]["dead_letter_reason"],
        "unknown-schema-version"
    );
    assert_eq!(seen[0]["fields"]["event_type"], EVENT);
    assert_eq!(
        seen[0]["fields"]["correlation_id"],
        unknown_version.meta().correlation_id.as_str()
    );
    let seen = processed(&lines, "not-json-1");
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert_eq!(seen[0]["level"], "WARN");
    assert_eq!(seen[0]["fields"]["dead_letter_reason"], "invalid-json");
    assert!(seen[0]["fields"].get("event_type").is_none(), "{}", seen[0]);
    assert!(
        seen[0]["fields"].get("correlation_id").is_none(),
        "{}",
        seen[0]
    );

    // A database error, in words a reader can use: no " at line N" of
    // PostgreSQL's C source.
    let seen = processed(&lines, &id(&swallowed));
    let error = seen
        .iter()
        .filter_map(|l| l["fields"]["error"].as_str())
        .next()
        .unwrap_or_else(|| panic!("the swallowed error is logged: {seen:#?}"));
    assert!(error.contains("error returned from database"), "{error}");
    assert!(!error.contains(" at line "), "{error}");

    // Nothing is logged with an empty id, and no outcome twice elsewhere.
    for line in &lines {
        assert!(
            !line["target"]
                .as_str()
                .is_some_and(|t| t.starts_with("sqlx::postgres::notice")),
            "a database notice in the log: {line}"
        );
        for field in ["event_type", "correlation_id", "causation_id"] {
            assert_ne!(line["fields"][field], "", "{field} empty in {line}");
        }
        let message = line["fields"]["message"].as_str().unwrap_or_default();
        assert!(
            !["transient failure; retrying later", "dead-lettered"].contains(&message),
            "a second line for an outcome: {line}"
        );
    }
    // An idle consumer drains nothing.
    let draining: Vec<_> = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "draining")
        .collect();
    assert!(!draining.is_empty(), "the shutdown is logged");
    for line in draining {
        assert_eq!(line["fields"]["in_flight"], 0, "{line}");
    }

    broker.cleanup().await;
    db.drop_db().await;
}

/// With each success at DEBUG, an operator reading INFO sees the consumer
/// work through one line an interval that counts each outcome; the last
/// interval's counts are logged when the consumer stops.
#[tokio::test(flavor = "current_thread")]
async fn an_info_summary_counts_each_outcome_per_interval() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_env_filter("info")
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = <sqlx::Sqlite as Backend>::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let config = broker
        .builder()
        .with_summary_interval(Duration::from_millis(200))
        .build()
        .unwrap();
    let running = Running::start(Consumer::new(
        config,
        db.store.clone(),
        routes::<sqlx::Sqlite>(),
    ));
    let messages: Vec<_> = (0..5).map(|_| TestBroker::message(&Job::ok())).collect();
    for m in &messages {
        broker.publish(m).await;
    }
    // Two copies of messages already sent: duplicates.
    broker.publish(&messages[0]).await;
    broker.publish(&messages[1]).await;
    let summaries = |lines: &[Value]| -> (u64, u64, usize) {
        let mine: Vec<&Value> = lines
            .iter()
            .filter(|l| l["fields"]["message"] == "messages processed since the last summary")
            .collect();
        let sum = |k: &str| mine.iter().map(|l| l["fields"][k].as_u64().unwrap()).sum();
        (sum("applied"), sum("duplicate"), mine.len())
    };
    let seen = wait_for(Duration::from_secs(60), || {
        let (applied, duplicates, _) = summaries(&captured.lines());
        async move { applied == 5 && duplicates == 2 }
    })
    .await;
    running.stop().await.unwrap();
    let lines = captured.lines();
    let (applied, duplicates, count) = summaries(&lines);
    assert!(
        seen,
        "summaries counted {applied} applied, {duplicates} duplicates"
    );
    assert_eq!((applied, duplicates), (5, 2), "nothing counted twice");
    for line in lines
        .iter()
        .filter(|l| l["fields"]["message"] == "messages processed since the last summary")
    {
        assert_eq!(line["level"], "INFO");
        assert_eq!(
            line["fields"]["consumer_name"],
            broker.name.as_str(),
            "{line}"
        );
        assert_eq!(line["fields"]["dead_lettered"], 0, "{line}");
    }
    assert!(count >= 1);
    // The successes themselves stay at DEBUG.
    assert!(
        !lines
            .iter()
            .any(|l| l["fields"]["message"] == "message processed"),
        "no line per success at INFO"
    );
    broker.cleanup().await;
    db.drop_db().await;
}

/// An ingester started before its consumer declared the dead-letter queue
/// waits for it and says so at INFO: no warning that sends an operator after
/// a broker outage that is not there. Then it ingests.
#[tokio::test(flavor = "current_thread")]
async fn an_ingester_waits_quietly_for_its_dead_letter_queue() {
    use warren::store::{DeadLetterStore, LetterFilter};
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_env_filter("info,lapin=off")
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = <sqlx::Sqlite as Backend>::create().await;
    let broker = TestBroker::new().await;
    broker.track_queue(&warren_admin::unstored_queue_name(&broker.queue));
    let ingester = warren_admin::Ingester::new(db.store.clone(), &broker.config());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let ingesting = tokio::spawn(async move {
        ingester
            .run(&amqp_url(), async {
                let _ = stopped.await;
            })
            .await
    });
    let said = |text: &'static str| {
        let captured = captured.clone();
        move || {
            let found = captured.lines().iter().any(|l| {
                l["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with(text))
            });
            async move { found }
        }
    };
    assert!(
        wait_for(
            Duration::from_secs(30),
            said("dead-letter queue not declared yet")
        )
        .await,
        "the ingester says it waits"
    );
    broker.declare().await;
    broker
        .publisher
        .publish_raw(
            "",
            &broker.dead_letter_queue(),
            b"{}",
            BasicProperties::default().with_message_id("waited-for-1".into()),
        )
        .await
        .unwrap();
    let store = db.store.clone();
    let stored = wait_for(Duration::from_secs(30), || {
        let store = store.clone();
        async move {
            store
                .dead_letters(&LetterFilter::default(), None, 10)
                .await
                .unwrap()
                .iter()
                .any(|l| l.message_id == "waited-for-1")
        }
    })
    .await;
    let _ = stop.send(());
    ingesting.await.unwrap().unwrap();
    assert!(stored, "the letter is ingested once the queue exists");
    assert!(
        wait_for(
            Duration::from_secs(1),
            said("dead-letter queue declared; ingesting")
        )
        .await
    );
    let warnings: Vec<Value> = captured
        .lines()
        .into_iter()
        .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
        .collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
    broker.cleanup().await;
    db.drop_db().await;
}
