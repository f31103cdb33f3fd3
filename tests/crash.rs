//! Crash points: a consumer process aborted at the worst moments, then restarted.
//! The message comes back, and it is applied exactly once.
//!
//! The consumer runs in a subprocess: this test binary itself, re-run with only
//! the ignored `crash::child` test selected and its instructions in the
//! environment.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::{Postgres, Sqlite};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use warren::store::OutboxStore;
use warren::topology::QueueType;
use warren::{Consumer, Relay, RelayConfig};

use crate::util::{
    Backend, Job, Mode, Running, TEST_POISON_LIMIT, TestBroker, amqp_url, batch_routes, routes,
    test_config, test_retry, wait_for,
};

const CHILD_ENV: &str = "WARREN_TEST_CHILD";
const SIGABRT: i32 = 6;

#[derive(Serialize, Deserialize)]
pub(crate) struct ChildSpec {
    backend: String,
    db_url: String,
    name: String,
    queue: String,
    exchange: String,
    queue_type: String,
    /// `consumer` or `relay`.
    role: String,
    #[serde(default)]
    pub(crate) options: ChildOptions,
}

/// How a consumer child differs from the default test consumer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ChildOptions {
    pub(crate) prefetch: Option<u16>,
    pub(crate) concurrency: Option<usize>,
    /// Runs the outbox relay beside the consumer.
    pub(crate) relay: bool,
    /// Also runs a second consumer in the same process, on the test consumer's
    /// topology under this name (its queue is `<name>.jobs`).
    pub(crate) neighbour: Option<String>,
    /// Routes the jobs to the batch handler.
    pub(crate) batch_handler: bool,
    /// Deaths while a message runs alone before it is poison, if not the
    /// tests' usual `TEST_POISON_LIMIT`.
    pub(crate) poison_limit: Option<u32>,
}

/// The consumer process. Does nothing unless started by a crash test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started by the crash tests as a subprocess"]
async fn child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let spec: ChildSpec = serde_json::from_str(&spec).unwrap();
    tracing_subscriber::fmt()
        .with_env_filter("warren=info,warren::telemetry=debug")
        .with_ansi(false)
        .init();
    match spec.backend.as_str() {
        "postgres" => run_child::<Postgres>(spec).await,
        "sqlite" => run_child::<Sqlite>(spec).await,
        #[cfg(feature = "mysql")]
        "mysql" => run_child::<sqlx::MySql>(spec).await,
        other => panic!("unknown backend {other}"),
    }
}

async fn run_child<B: Backend>(spec: ChildSpec) {
    let store = B::open(&spec.db_url).await;
    if spec.role == "relay" {
        let relay = Relay::new(
            store,
            RelayConfig::new(&spec.name).with_poll_interval(Duration::from_millis(200)),
        );
        let stats = relay.stats_handle();
        relay
            .run(&amqp_url(), warren::shutdown_signal())
            .await
            .unwrap();
        #[allow(clippy::print_stdout)]
        {
            println!("CHILD_STATS published={}", stats.snapshot().published);
        }
        return;
    }
    let options = &spec.options;
    let configure = |name: &str, queue: &str| {
        let mut config = test_config(name, queue, &spec.exchange)
            .with_queue_type(spec.queue_type.parse().unwrap());
        if let Some(p) = options.prefetch {
            config = config.with_prefetch(p);
        }
        if let Some(c) = options.concurrency {
            config = config.with_concurrency(c);
        }
        if let Some(limit) = options.poison_limit {
            config = config.with_retry(test_retry(limit));
        }
        config.build().unwrap()
    };
    let neighbour = options.neighbour.as_ref().map(|name| {
        let config = configure(name, &format!("{name}.jobs"));
        let consumer = Consumer::new(config, store.clone(), routes::<B>());
        tokio::spawn(async move { consumer.run(&amqp_url(), warren::shutdown_signal()).await })
    });
    let main_routes = if options.batch_handler {
        batch_routes::<B>()
    } else {
        routes::<B>()
    };
    let consumer = Consumer::new(configure(&spec.name, &spec.queue), store, main_routes);
    let stats = consumer.stats();
    if options.relay {
        let relay = RelayConfig::new(&spec.name).with_poll_interval(Duration::from_millis(200));
        consumer
            .run_with_relay(&amqp_url(), relay, warren::shutdown_signal())
            .await
            .unwrap();
    } else {
        consumer
            .run(&amqp_url(), warren::shutdown_signal())
            .await
            .unwrap();
    }
    if let Some(neighbour) = neighbour {
        neighbour.await.unwrap().unwrap();
    }
    let s = stats.snapshot();
    // The parent reads this line from the child's stdout.
    #[allow(clippy::print_stdout)]
    {
        println!(
            "CHILD_STATS applied={} duplicates={}",
            s.applied, s.duplicates
        );
    }
}

pub(crate) struct ChildProcess {
    pub(crate) child: Child,
    pub(crate) lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

fn spawn<B: Backend>(db_url: &str, broker: &TestBroker, failpoints: Option<&str>) -> ChildProcess {
    spawn_on::<B>(db_url, broker, failpoints, QueueType::Quorum)
}

fn spawn_on<B: Backend>(
    db_url: &str,
    broker: &TestBroker,
    failpoints: Option<&str>,
    queue_type: QueueType,
) -> ChildProcess {
    spawn_spec::<B>(db_url, broker, failpoints, queue_type, "consumer")
}

fn spawn_relay<B: Backend>(
    db_url: &str,
    broker: &TestBroker,
    failpoints: Option<&str>,
) -> ChildProcess {
    spawn_spec::<B>(db_url, broker, failpoints, QueueType::Quorum, "relay")
}

fn spawn_spec<B: Backend>(
    db_url: &str,
    broker: &TestBroker,
    failpoints: Option<&str>,
    queue_type: QueueType,
    role: &str,
) -> ChildProcess {
    spawn_with::<B>(
        db_url,
        broker,
        failpoints,
        queue_type,
        role,
        ChildOptions::default(),
    )
}

/// Starts this test binary as a consumer (or relay) process.
pub(crate) fn spawn_with<B: Backend>(
    db_url: &str,
    broker: &TestBroker,
    failpoints: Option<&str>,
    queue_type: QueueType,
    role: &str,
    options: ChildOptions,
) -> ChildProcess {
    let spec = ChildSpec {
        options,
        queue_type: queue_type.as_str().into(),
        role: role.into(),
        backend: <B as Backend>::NAME.into(),
        db_url: db_url.into(),
        name: broker.name.clone(),
        queue: broker.queue.clone(),
        exchange: broker.exchange.clone(),
    };
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "crash::child",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env(CHILD_ENV, serde_json::to_string(&spec).unwrap())
    .env_remove(warren::failpoint::ENV)
    .stdout(Stdio::piped())
    .kill_on_drop(true);
    if let Some(spec) = failpoints {
        cmd.env(warren::failpoint::ENV, spec);
    }
    let mut child = cmd.spawn().unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    ChildProcess { child, lines }
}

impl ChildProcess {
    /// Reads output until a line contains all of `needles`.
    async fn expect_line(&mut self, needles: &[&str]) -> String {
        let read = async {
            while let Some(line) = self.lines.next_line().await.unwrap() {
                if needles.iter().all(|n| line.contains(n)) {
                    return line;
                }
            }
            panic!("child exited without printing a line with {needles:?}");
        };
        tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .unwrap_or_else(|_| panic!("no line with {needles:?} within 60 s"))
    }

    /// Reads output until the child dead-letters `id` as poison (`true`) or dies
    /// (`false`, after checking it aborted).
    async fn poisoned_or_aborted(&mut self, id: &str) -> bool {
        let read = async {
            while let Some(line) = self.lines.next_line().await.unwrap() {
                if line.contains("message processed")
                    && line.contains(id)
                    && line.contains("poison")
                {
                    return true;
                }
            }
            false
        };
        let poisoned = tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .expect("the child should crash or dead-letter within 60 s");
        if !poisoned {
            let status = self.child.wait().await.unwrap();
            assert_eq!(status.signal(), Some(SIGABRT), "{status:?}");
        }
        poisoned
    }

    async fn wait_for_abort(mut self) {
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("the crash point should have fired")
            .unwrap();
        assert_eq!(
            status.signal(),
            Some(SIGABRT),
            "aborted at the crash point: {status:?}"
        );
    }

    /// Sends SIGTERM and returns the stats line the child prints on a clean exit.
    pub(crate) async fn terminate(mut self) -> String {
        let pid = self.child.id().unwrap();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let stats = self.expect_line(&["CHILD_STATS"]).await;
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("the child should drain and exit after SIGTERM")
            .unwrap();
        assert!(status.success(), "clean exit on SIGTERM: {status:?}");
        stats
    }
}

on_all_backends!(
    crash_after_a_batch_commit_before_its_ack,
    crash_after_a_batch_handlers_commit_before_its_ack,
    an_unknown_batch_commit_outcome_is_recognized_when_the_messages_return,
    crash_after_commit_before_ack,
    crash_before_commit,
    crash_loop_on_quorum_queue_ends_as_poison,
    crash_loop_on_classic_queue_ends_as_poison,
    relay_crash_after_publish_before_mark_publishes_again_and_downstream_applies_once,
    a_relay_crash_republishes_each_format_byte_for_byte_and_the_cloudevents_sdk_reads_one_id,
);

/// The relay publishes a row, the broker confirms, and the relay dies before
/// marking it. The restarted relay publishes it again with the same message id;
/// a downstream warren consumer applies it once.
async fn relay_crash_after_publish_before_mark_publishes_again_and_downstream_applies_once<
    B: Backend,
>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let event =
        warren::Outgoing::new(crate::util::OUT_EVENT, 1, &serde_json::json!({"n": 1})).unwrap();
    let id = event.meta().message_id.clone();
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    spawn_relay::<B>(&db.url, &broker, Some("relay-after-publish-before-mark=1"))
        .wait_for_abort()
        .await;
    let status = db.store.outbox_status().await.unwrap();
    assert_eq!(
        (status.pending, status.published),
        (1, 0),
        "published but not marked"
    );
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&capture).await == 1
        })
        .await
    );

    let restarted = spawn_relay::<B>(&db.url, &broker, None);
    let store = db.store.clone();
    // On SQLite the dead relay's lease on the row has to run out first (20 s).
    assert!(
        wait_for(Duration::from_secs(60), || {
            let store = store.clone();
            async move { store.outbox_status().await.unwrap().published == 1 }
        })
        .await
    );
    let stats = restarted.terminate().await;
    assert!(stats.contains("published=1"), "{stats}");
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&capture).await == 2
        })
        .await
    );

    let downstream = Running::start(Consumer::new(
        broker.downstream_config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(downstream.settled(2, Duration::from_secs(30)).await);
    let s = downstream.stats.snapshot();
    downstream.stop().await.unwrap();
    assert_eq!((s.applied, s.duplicates), (1, 1), "{s:?}");
    assert_eq!(db.effects_for(&id).await, 1, "applied once downstream");

    broker.cleanup().await;
    db.drop_db().await;
}

/// Outgoing formats across the same crash: a binary and a structured
/// CloudEvent and a bare payload, published, the relay dead before marking
/// them, published again by its successor. Each copy is its first byte for
/// byte (bar the publish time); the CloudEvents SDK reads both CloudEvents
/// with the same `source` and `id` in each copy; a downstream warren
/// consumer reading the three formats applies each message once.
async fn a_relay_crash_republishes_each_format_byte_for_byte_and_the_cloudevents_sdk_reads_one_id<
    B: Backend,
>() {
    use warren::OutgoingFormat;
    use warren::format::{Bare, CloudEvents, Formats, Identity, VersionFrom};
    const SOURCE: &str = "urn:warren:test:relay";

    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let cause = warren::Outgoing::new("test.cause", 1, &1).unwrap();
    let event = |n: u32, format: OutgoingFormat| {
        warren::Outgoing::new(crate::util::OUT_EVENT, 1, &serde_json::json!({ "n": n }))
            .unwrap()
            .caused_by(cause.meta())
            .with_format(format)
    };
    let events = [
        event(1, OutgoingFormat::cloud_events_binary(SOURCE)),
        event(2, OutgoingFormat::cloud_events_structured(SOURCE)),
        event(3, OutgoingFormat::Bare),
    ];
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    for e in &events {
        warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", e)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    spawn_relay::<B>(&db.url, &broker, Some("relay-after-publish-before-mark=1"))
        .wait_for_abort()
        .await;
    assert_eq!(db.store.outbox_status().await.unwrap().published, 0);
    let restarted = spawn_relay::<B>(&db.url, &broker, None);
    let store = db.store.clone();
    assert!(
        wait_for(Duration::from_secs(60), || {
            let store = store.clone();
            async move { store.outbox_status().await.unwrap().published == 3 }
        })
        .await
    );
    restarted.terminate().await;
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&capture).await == 6
        })
        .await,
        "each row published twice"
    );

    // The SDK reads the CloudEvents; every copy goes back to the queue.
    let read = crate::foreign::read_with_cloudevents_sdk(&capture, 6);
    assert_eq!(read.len(), 6);
    let bare: Vec<_> = read.iter().filter(|r| r["attributes"].is_null()).collect();
    assert_eq!(
        bare.len(),
        2,
        "the bare copies are no CloudEvents: {read:?}"
    );
    assert!(
        bare.iter()
            .all(|r| r["message_id"] == events[2].meta().message_id.as_str())
    );
    for (n, e) in events.iter().enumerate().take(2) {
        let id = &e.meta().message_id;
        let seen: Vec<_> = read
            .iter()
            .filter(|r| r["attributes"]["id"] == id.as_str())
            .collect();
        assert_eq!(
            seen.len(),
            2,
            "both copies of event {n} read, same id: {read:?}"
        );
        for r in seen {
            let a = &r["attributes"];
            assert_eq!(a["source"], SOURCE);
            assert_eq!(a["type"], crate::util::OUT_EVENT);
            assert_eq!(a["specversion"], "1.0");
            assert_eq!(a["datacontenttype"], "application/json");
            assert_eq!(a["correlationid"], cause.meta().correlation_id.as_str());
            assert_eq!(a["causationid"], cause.meta().message_id.as_str());
            assert_eq!(r["data"], serde_json::json!({ "n": n + 1 }));
            assert_eq!(r["message_id"], id.as_str());
            let time = chrono::DateTime::parse_from_rfc3339(a["time"].as_str().unwrap()).unwrap();
            assert_eq!(
                time.timestamp_millis(),
                e.meta().occurred_at.unwrap().timestamp_millis()
            );
        }
    }

    // Byte for byte: each copy's body and headers are its first's, except
    // when it was published.
    let taken = broker.drain(&capture).await;
    assert_eq!(taken.len(), 6);
    for e in &events {
        let id = e.meta().message_id.as_str();
        let same: Vec<_> = taken
            .iter()
            .filter(|d| d.properties.message_id().as_ref().map(|m| m.as_str()) == Some(id))
            .collect();
        assert_eq!(same.len(), 2, "{id}");
        assert_eq!(same[0].data, same[1].data);
        assert_eq!(same[0].data, e.body());
        let headers = |d: &lapin::message::Delivery| {
            let h = d.properties.headers().clone().unwrap_or_default();
            h.inner()
                .iter()
                .filter(|(name, _)| name.as_str() != warren::headers::HEADER_PUBLISHED_AT_MS)
                .map(|(name, value)| (name.to_string(), value.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(headers(same[0]), headers(same[1]));
        assert_eq!(
            same[0].properties.content_type(),
            same[1].properties.content_type()
        );
    }
    for d in &taken {
        broker
            .publisher
            .publish_raw("", &capture, &d.data, d.properties.clone())
            .await
            .unwrap();
    }

    let downstream = test_config(
        &format!("{}-downstream", broker.name),
        &capture,
        &broker.exchange,
    )
    .with_formats(
        Formats::new()
            .then(CloudEvents::new().version_from(VersionFrom::Header("schemaversion".into())))
            .then(Bare::new().version_from(VersionFrom::Header(
                warren::headers::HEADER_SCHEMA_VERSION.into(),
            ))),
    )
    .build()
    .unwrap();
    let downstream = Running::start(Consumer::new(downstream, db.store.clone(), routes::<B>()));
    assert!(downstream.settled(6, Duration::from_secs(30)).await);
    let s = downstream.stats.snapshot();
    downstream.stop().await.unwrap();
    assert_eq!(
        (s.applied, s.duplicates, s.dead_lettered),
        (3, 3, 0),
        "{s:?}"
    );
    for e in &events[..2] {
        let key = Identity::CloudEvent {
            source: SOURCE.into(),
            id: e.meta().message_id.clone(),
        }
        .key();
        assert_eq!(db.effects_for(&key).await, 1);
    }
    assert_eq!(db.effects_for(&events[2].meta().message_id).await, 1);

    broker.cleanup().await;
    db.drop_db().await;
}

async fn crash_loop_on_quorum_queue_ends_as_poison<B: Backend>() {
    crash_loop_ends_as_poison::<B>(QueueType::Quorum).await;
}

async fn crash_loop_on_classic_queue_ends_as_poison<B: Backend>() {
    crash_loop_ends_as_poison::<B>(QueueType::Classic).await;
}

/// A message that aborts every process handling it: its first death is shared
/// with whatever else ran, so it only makes it a suspect; after the poison limit
/// of deaths while it ran alone, the next consumer dead-letters it as `poison`
/// instead of running the handler again, and carries on.
async fn crash_loop_ends_as_poison<B: Backend>(queue_type: QueueType) {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker
        .declare_config(
            &broker
                .builder()
                .with_queue_type(queue_type)
                .build()
                .unwrap(),
        )
        .await;
    let killer = TestBroker::message(&Job::with(Mode::Abort));
    broker.publish(&killer).await;
    let id = killer.meta().message_id.clone();

    let mut crashes = 0;
    loop {
        let mut child = spawn_on::<B>(&db.url, &broker, None, queue_type);
        if child.poisoned_or_aborted(&id).await {
            child.terminate().await;
            break;
        }
        crashes += 1;
        assert!(
            crashes <= TEST_POISON_LIMIT + 1,
            "still crashing after {crashes} runs"
        );
    }
    assert_eq!(
        crashes,
        TEST_POISON_LIMIT + 1,
        "the handler ran once with others, then alone up to the limit"
    );

    let dead = broker.drain(&broker.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1);
    let info = warren_admin::DeadLetterInfo::from_properties(&dead[0].properties).unwrap();
    assert_eq!(info.reason, "poison");
    assert!(info.error.contains("without an outcome"), "{}", info.error);
    assert_eq!(db.effects().await, 0);
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

/// Committed, then killed before the ack: the broker redelivers, the restarted
/// consumer finds the inbox row and acks the copy as a duplicate. One effect.
async fn crash_after_commit_before_ack<B: Backend>() {
    crash_then_restart::<B>("after-commit-before-ack", true).await;
}

/// Killed after the handler ran but before the commit: nothing was applied, the
/// message comes back and is applied once.
async fn crash_before_commit<B: Backend>() {
    crash_then_restart::<B>("before-commit", false).await;
}

/// Publishes one message, runs a consumer that aborts at `point`, restarts it
/// without crash points and checks the message was applied exactly once.
async fn crash_then_restart<B: Backend>(point: &str, committed_before_crash: bool) {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let msg = TestBroker::message(&Job::ok());
    broker.publish(&msg).await;
    let id = msg.meta().message_id.clone();

    spawn::<B>(&db.url, &broker, Some(&format!("{point}=1")))
        .wait_for_abort()
        .await;
    let before = i64::from(committed_before_crash);
    assert_eq!(
        db.effects_for(&id).await,
        before,
        "effects after a crash at {point}"
    );
    assert_eq!(db.inbox(&broker.name).await, before);
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&broker.queue).await == 1
        })
        .await,
        "the unacked message is back in the queue"
    );

    let (result, expected) = if committed_before_crash {
        ("duplicate", "applied=0 duplicates=1")
    } else {
        ("applied", "applied=1 duplicates=0")
    };
    let mut restarted = spawn::<B>(&db.url, &broker, None);
    restarted
        .expect_line(&["message processed", &id, result])
        .await;
    let stats = restarted.terminate().await;
    assert!(stats.contains(expected), "{stats}");
    assert_eq!(db.effects_for(&id).await, 1, "applied exactly once");
    assert_eq!(db.inbox(&broker.name).await, 1);
    assert_eq!(
        broker.ready(&broker.queue).await,
        0,
        "the redelivery was acked"
    );

    broker.cleanup().await;
    db.drop_db().await;
}

/// Publishes `n` messages that apply, before any consumer runs, so that the
/// consumer finds them buffered and forms batches. Returns their ids.
async fn prefill(broker: &TestBroker, n: usize) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let msg = TestBroker::message(&Job::ok());
        broker.publish(&msg).await;
        ids.push(msg.meta().message_id.clone());
    }
    ids
}

/// Checks that each of `ids` was applied exactly once.
async fn each_applied_once<B: Backend>(db: &crate::util::TestDb<B>, ids: &[String]) {
    for id in ids {
        assert_eq!(db.effects_for(id).await, 1, "{id} applied exactly once");
    }
    assert_eq!(db.effects().await, ids.len() as i64);
}

/// Reads `CHILD_STATS applied=A duplicates=D`.
fn applied_and_duplicates(stats: &str) -> (i64, i64) {
    let field = |name: &str| -> i64 {
        stats
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {stats:?}"))
    };
    (field("applied="), field("duplicates="))
}

/// Killed after a batch of several messages committed, before the ack: the
/// messages of that batch come back, and the inbox recognizes each one; every
/// message that had not committed applies after the restart, once.
async fn crash_after_a_batch_commit_before_its_ack<B: Backend>() {
    crash_after_batch_commit::<B>(false).await;
}

/// The same with a batch handler, which wrote the whole batch's effects in
/// one statement.
async fn crash_after_a_batch_handlers_commit_before_its_ack<B: Backend>() {
    crash_after_batch_commit::<B>(true).await;
}

async fn crash_after_batch_commit<B: Backend>(batch_handler: bool) {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let ids = prefill(&broker, 24).await;
    let options = ChildOptions {
        batch_handler,
        ..ChildOptions::default()
    };
    let spawn = |failpoints| {
        spawn_with::<B>(
            &db.url,
            &broker,
            failpoints,
            QueueType::Quorum,
            "consumer",
            options.clone(),
        )
    };

    spawn(Some("after-batch-commit-before-ack=1"))
        .wait_for_abort()
        .await;
    // The crashing batch, and whatever other workers committed before it.
    let committed = db.effects().await;
    assert!(committed >= 2, "a batch of several committed: {committed}");
    assert_eq!(db.inbox(&broker.name).await, committed);

    let mut restarted = spawn(None);
    let mut duplicates_seen = 0;
    let settled = async {
        loop {
            let line = restarted
                .lines
                .next_line()
                .await
                .unwrap()
                .expect("the child runs");
            if line.contains("message processed") && line.contains("duplicate") {
                duplicates_seen += 1;
            }
            if duplicates_seen > 0 && db.effects().await == 24 {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), settled)
        .await
        .expect("after the restart, every message applied and the crashed batch recognized");
    let stats = restarted.terminate().await;
    let (applied, duplicates) = applied_and_duplicates(&stats);
    assert_eq!(
        applied,
        24 - committed,
        "only what had not committed applies: {stats}"
    );
    assert!(
        (1..=committed).contains(&duplicates),
        "the unacked batch came back as duplicates: {stats}"
    );
    each_applied_once(&db, &ids).await;

    broker.cleanup().await;
    db.drop_db().await;
}

/// The connection drops during a batch's COMMIT (simulated once, after the
/// commit did happen): the consumer cannot know, so it returns every message of
/// the batch to its queue. They come back and the inbox recognizes each one;
/// nothing is applied twice and nothing is lost.
async fn an_unknown_batch_commit_outcome_is_recognized_when_the_messages_return<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let ids = prefill(&broker, 24).await;

    let mut child = spawn::<B>(&db.url, &broker, Some("batch-commit-outcome-unknown=1"));
    // Settled once every message has been applied or recognized as a duplicate.
    // The "returned" line of a delivery is logged after its nack, so its
    // redelivery's outcome can be printed first: counting resolutions, not the
    // last line per message, is what the log can tell. Under load a message can
    // also be returned for a real reason (the pool timing out); it comes back
    // and applies then.
    let mut resolved: std::collections::HashSet<String> = std::collections::HashSet::new();
    let (mut applied, mut duplicates, mut returned) = (0, 0, 0);
    let read = async {
        while resolved.len() < ids.len() {
            let line = child
                .lines
                .next_line()
                .await
                .unwrap()
                .expect("the child runs until told to stop");
            if !line.contains("message processed") {
                continue;
            }
            let Some(id) = ids.iter().find(|id| line.contains(id.as_str())) else {
                continue;
            };
            if line.contains("returned") {
                returned += 1;
            } else if line.contains("duplicate") {
                duplicates += 1;
                resolved.insert(id.clone());
            } else if line.contains("applied") {
                applied += 1;
                resolved.insert(id.clone());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .unwrap_or_else(|_| {
            panic!("not settled: applied {applied}, duplicates {duplicates}, returned {returned}")
        });
    assert!(
        returned >= 1,
        "the batch whose commit was unknown was returned"
    );
    assert!(
        duplicates >= 1,
        "what had committed came back and was recognized: applied {applied}, duplicates \
         {duplicates}, returned {returned}"
    );
    let stats = child.terminate().await;
    assert_eq!(
        applied_and_duplicates(&stats),
        (applied, duplicates),
        "{stats}"
    );
    each_applied_once(&db, &ids).await;
    assert_eq!(db.inbox(&broker.name).await, 24);

    broker.cleanup().await;
    db.drop_db().await;
}
