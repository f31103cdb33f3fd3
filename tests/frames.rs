//! Frames the broker accepts and the AMQP client cannot read safely: headers
//! nested thousands of levels deep, past the value limit, text that is not
//! UTF-8. The consumer lives, dead-letters each message as its reason says,
//! and applies every message behind it once. The frames are written byte by
//! byte (`warren_chaos::hostile`): lapin itself cannot encode them. The test
//! process runs with default stack sizes, as a user's service does.

use std::collections::HashMap;
use std::time::Duration;

use sha2::{Digest, Sha256};
use warren::Consumer;
use warren::broker::guard::{MAX_HEADER_DEPTH, MAX_HEADER_ENTRIES};
use warren::headers::{HEADER_DROPPED, HEADER_PRUNED_DIGEST};
use warren::lapin::BasicProperties;
use warren::lapin::protocol::basic::parse_properties;
use warren::retry::RetryPolicy;
use warren::topology::QueueType;
use warren_admin::DeadLetterInfo;
use warren_chaos::hostile::{
    NESTED_ARRAY_LEVEL, NESTED_TABLE_LEVEL, Properties, RawPublisher, Value,
};

use crate::supervision::{recorder, value};
use crate::util::{
    Backend, EVENT, Job, Mode, Running, TestBroker, amqp_url, reported_attempts, routes, unique,
    wait_for,
};

on_all_backends!(
    deep_headers_on_a_quorum_queue,
    deep_headers_on_a_classic_queue,
    text_that_is_not_utf8_is_dead_lettered_and_the_messages_behind_it_apply,
    headers_just_under_the_limits_pass_and_are_retried_intact,
    generated_frames_never_stop_the_consumer,
);

async fn deep_headers_on_a_quorum_queue<B: Backend>() {
    deep_headers_are_dead_lettered_and_the_messages_behind_them_apply::<B>(QueueType::Quorum).await;
}

async fn deep_headers_on_a_classic_queue<B: Backend>() {
    deep_headers_are_dead_lettered_and_the_messages_behind_them_apply::<B>(QueueType::Classic)
        .await;
}

/// A valid envelope for `job`, as the body of message `id`.
fn body(id: &str, job: &Job) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "messageId": id,
        "eventType": EVENT,
        "schemaVersion": 1,
        "occurredAtUtc": "2026-12-02T12:00:00Z",
        "correlationId": id,
        "causationId": null,
        "payload": job,
    }))
    .unwrap()
}

/// Properties of a valid message `id` (raw bytes: the id may be bent), with
/// one ordinary header, `tenant`.
fn properties(id: impl AsRef<[u8]>) -> Properties {
    Properties::default()
        .content_type("application/json")
        .delivery_mode(2)
        .message_id(id)
        .header("tenant", Value::long_string("acme"))
}

/// The digest the guard reports for removing these header entries.
fn digest(entries: &[(&[u8], &Value)]) -> String {
    let mut d = Sha256::new();
    for (name, value) in entries {
        d.update([name.len() as u8]);
        d.update(name);
        d.update(value.as_bytes());
    }
    let hex: String = d.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn text_header(p: &BasicProperties, name: &str) -> Option<String> {
    warren::amqp::header_str(p.headers().as_ref()?, name).map(|s| s.into_owned())
}

fn pruned_count(consumer: &str, cause: &str) -> Option<f64> {
    value(
        &recorder().render(),
        "consumer_pruned_messages_total",
        &[
            &format!("consumer=\"{consumer}\""),
            &format!("cause=\"{cause}\""),
        ],
    )
}

/// Header tables and arrays nested from 500 levels to the deepest one frame
/// holds, each followed by a valid message: every deep one is dead-lettered
/// as `headers-too-deep` with what was removed recorded, every follower
/// applied once, and the consumer never stops.
async fn deep_headers_are_dead_lettered_and_the_messages_behind_them_apply<B: Backend>(
    queue_type: QueueType,
) {
    assert!(
        std::env::var_os("RUST_MIN_STACK").is_none(),
        "the consumer under test runs on default stacks"
    );
    let _ = recorder();
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_queue_type(queue_type)
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let mut producer = RawPublisher::connect(&amqp_url()).await.unwrap();
    let frame_max = producer.frame_max();

    // From 500 levels to the deepest of each kind the negotiated frame holds.
    let leaf = Value::long_string("leaf");
    let id = |case: &str| format!("{}-deep-{case}", broker.name);
    let room = |case: &str| frame_max - properties(id(case)).frame_len() - 2 - leaf.len();
    let mut cases: Vec<(String, Value)> = Vec::new();
    for depth in [500, 1_000, 1_200, 2_000, 5_000] {
        cases.push((
            format!("tables-{depth}"),
            Value::nested_tables(depth, leaf.clone()),
        ));
    }
    for depth in [500, 2_000] {
        cases.push((
            format!("arrays-{depth}"),
            Value::nested_arrays(depth, leaf.clone()),
        ));
    }
    // With the flag bit that announces a second flag word: RabbitMQ passes it
    // on, and neither it nor lapin reads it.
    cases.push((
        "tables-2000-flagged".into(),
        Value::nested_tables(2_000, leaf.clone()),
    ));
    let max_tables = room("tables-max") / NESTED_TABLE_LEVEL;
    let max_arrays = room("arrays-max") / NESTED_ARRAY_LEVEL;
    cases.push((
        "tables-max".into(),
        Value::nested_tables(max_tables, leaf.clone()),
    ));
    cases.push((
        "arrays-max".into(),
        Value::nested_arrays(max_arrays, leaf.clone()),
    ));
    assert!(
        max_tables > 18_000 && max_arrays > 26_000,
        "{max_tables} {max_arrays}"
    );
    let mut sent = Vec::new();
    for (case, deep) in &cases {
        let id = id(case);
        let mut p = properties(&id).header("h", deep.clone());
        if case.ends_with("flagged") {
            p = p.reserved_flags(1);
        }
        assert!(p.frame_len() <= frame_max, "{case} fits the frame");
        if case.ends_with("max") {
            let level = if case.starts_with("tables") {
                NESTED_TABLE_LEVEL
            } else {
                NESTED_ARRAY_LEVEL
            };
            assert!(
                p.frame_len() + level > frame_max,
                "{case}: one level more would not fit"
            );
        }
        producer
            .publish(&broker.exchange, "test.job", &p, &body(&id, &Job::ok()))
            .await
            .unwrap_or_else(|e| panic!("the broker takes {case}: {e}"));
        let follower = format!("{}-after-{case}", broker.name);
        producer
            .publish(
                &broker.exchange,
                "test.job",
                &properties(&follower),
                &body(&follower, &Job::ok()),
            )
            .await
            .unwrap();
        sent.push((id, follower, deep.clone()));
    }
    producer.close().await;

    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let total = 2 * sent.len() as u64;
    assert!(
        running.settled(total, Duration::from_secs(60)).await,
        "every message settled: {:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    assert_eq!(stats.dead_lettered, sent.len() as u64, "{stats:?}");
    assert_eq!(stats.applied, sent.len() as u64, "{stats:?}");
    assert!(running.is_running() && running.stats.health().is_ready());
    for (deep, follower, _) in &sent {
        assert_eq!(db.effects_for(follower).await, 1, "{follower} applied once");
        assert_eq!(db.effects_for(deep).await, 0, "{deep} never applied");
    }
    assert_eq!(
        pruned_count(config.name(), "headers-too-deep"),
        Some(sent.len() as f64)
    );
    running.stop().await.unwrap();

    let letters = broker.dead_letters().await;
    assert_eq!(letters.len(), sent.len());
    for (id, _, deep) in &sent {
        let p = &letters[id];
        let info = DeadLetterInfo::from_properties(p).unwrap();
        assert_eq!(info.reason, "headers-too-deep", "{id}");
        assert!(info.error.contains("more than 32"), "{id}: {}", info.error);
        assert_eq!(
            text_header(p, HEADER_DROPPED).as_deref(),
            Some("\"h\""),
            "{id}"
        );
        assert_eq!(
            text_header(p, HEADER_PRUNED_DIGEST),
            Some(digest(&[(b"h", deep)])),
            "{id}: the digest of what was removed"
        );
        assert_eq!(text_header(p, "tenant").as_deref(), Some("acme"), "{id}");
        assert!(!p.headers().as_ref().unwrap().contains_key("h"), "{id}");
    }
    broker.cleanup().await;
    db.drop_db().await;
}

/// Text lapin reads as UTF-8 that is not: the broker takes it, and lapin
/// would close the connection on every delivery of it, forever. Each is
/// dead-lettered as `unreadable-frame`, with its bad bytes replaced by `?`.
async fn text_that_is_not_utf8_is_dead_lettered_and_the_messages_behind_it_apply<B: Backend>() {
    let _ = recorder();
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let mut producer = RawPublisher::connect(&amqp_url()).await.unwrap();
    let id = |case: &str| format!("{}-{case}", broker.name);
    let bent = |case: &str| {
        let mut bytes = id(case).into_bytes();
        bytes.push(0xff);
        bytes
    };
    // (case, the id the dead letter carries, properties, routing key)
    let cases: Vec<(&str, String, Properties, Vec<u8>)> = vec![
        (
            "message-id",
            format!("{}?", id("message-id")),
            properties(bent("message-id")),
            b"test.job".to_vec(),
        ),
        (
            "header-name",
            id("header-name"),
            properties(id("header-name")).header([b'h', 0xfe], Value::long(1)),
            b"test.job".to_vec(),
        ),
        (
            "nested-name",
            id("nested-name"),
            properties(id("nested-name"))
                .header("t", Value::table([(&[0xc3u8][..], Value::long(1))])),
            b"test.job".to_vec(),
        ),
        (
            "correlation-id",
            id("correlation-id"),
            properties(id("correlation-id")).correlation_id([0x80]),
            b"test.job".to_vec(),
        ),
        (
            "routing-key",
            id("routing-key"),
            properties(id("routing-key")),
            b"test.\xff".to_vec(),
        ),
    ];
    let mut followers = Vec::new();
    for (case, _, p, routing_key) in &cases {
        producer
            .publish(
                &broker.exchange,
                routing_key,
                p,
                &body(&id(case), &Job::ok()),
            )
            .await
            .unwrap_or_else(|e| panic!("the broker takes {case}: {e}"));
        let follower = id(&format!("after-{case}"));
        producer
            .publish(
                &broker.exchange,
                "test.job",
                &properties(&follower),
                &body(&follower, &Job::ok()),
            )
            .await
            .unwrap();
        followers.push(follower);
    }
    producer.close().await;

    let config = broker.config();
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let total = (cases.len() + followers.len()) as u64;
    assert!(
        running.settled(total, Duration::from_secs(60)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    assert_eq!(
        (stats.applied, stats.dead_lettered),
        (followers.len() as u64, cases.len() as u64)
    );
    for f in &followers {
        assert_eq!(db.effects_for(f).await, 1, "{f}");
    }
    assert!(running.is_running());
    assert_eq!(
        pruned_count(config.name(), "unreadable-frame"),
        Some(cases.len() as f64)
    );
    running.stop().await.unwrap();

    let letters = broker.dead_letters().await;
    for (case, letter_id, _, _) in &cases {
        let p = letters
            .get(letter_id)
            .unwrap_or_else(|| panic!("{case}: dead-lettered as {letter_id}"));
        let info = DeadLetterInfo::from_properties(p).unwrap();
        assert_eq!(info.reason, "unreadable-frame", "{case}");
        assert!(
            text_header(p, HEADER_PRUNED_DIGEST).is_some_and(|d| d.starts_with("sha256:")),
            "{case}"
        );
        assert_eq!(db.effects_for(&id(case)).await, 0, "{case}");
    }
    let routed = DeadLetterInfo::from_properties(&letters[&id("routing-key")]).unwrap();
    assert_eq!(routed.original_routing_key, "test.?");
    assert!(routed.error.contains("routing key"), "{}", routed.error);
    broker.cleanup().await;
    db.drop_db().await;
}

/// Headers at the depth limit, with as many values as the limit allows, are
/// read as sent; a message carrying them that fails every attempt goes through
/// each retry tier and reaches the dead-letter queue with them intact.
async fn headers_just_under_the_limits_pass_and_are_retried_intact<B: Backend>() {
    let _ = recorder();
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_retry(RetryPolicy::new([
            Duration::from_millis(100),
            Duration::from_millis(200),
        ]))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let tables = Value::nested_tables(MAX_HEADER_DEPTH, Value::long_string("leaf"));
    let arrays = Value::nested_arrays(MAX_HEADER_DEPTH, Value::long(7));
    // tenant, the two deep ones (their leaves counted), the array itself.
    let room = MAX_HEADER_ENTRIES - 1 - 2 * (MAX_HEADER_DEPTH + 1) - 1;
    let wide = Value::array((0..room).map(|n| Value::int(n as i32)));
    let with_limits = |id: &str| {
        properties(id)
            .header("deep-tables", tables.clone())
            .header("deep-arrays", arrays.clone())
            .header("wide", wide.clone())
    };
    let failing = format!("{}-failing", broker.name);
    let passing = format!("{}-passing", broker.name);
    let mut producer = RawPublisher::connect(&amqp_url()).await.unwrap();
    for (id, job) in [
        (&failing, Job::with(Mode::Transient { n: 100 })),
        (&passing, Job::ok()),
    ] {
        producer
            .publish(
                &broker.exchange,
                "test.job",
                &with_limits(id),
                &body(id, &job),
            )
            .await
            .unwrap();
    }
    producer.close().await;

    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        running.settled(2, Duration::from_secs(60)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    assert_eq!(
        (stats.applied, stats.dead_lettered, stats.retried),
        (1, 1, 2),
        "{stats:?}: {:?}",
        broker
            .dead_letters()
            .await
            .values()
            .map(DeadLetterInfo::from_properties)
            .collect::<Vec<_>>()
    );
    assert_eq!(db.effects_for(&passing).await, 1);
    assert_eq!(
        reported_attempts(&failing),
        [1, 2, 3],
        "warren's signed attempt count travelled beside the headers"
    );
    assert_eq!(pruned_count(config.name(), "headers-too-deep"), None);
    assert_eq!(pruned_count(config.name(), "too-many-headers"), None);
    running.stop().await.unwrap();

    // What lapin reads from the headers as they were sent.
    let sent = parse_properties(&with_limits(&failing).encode()[..])
        .expect("lapin reads headers within the limits")
        .1;
    let letters = broker.dead_letters().await;
    let letter = &letters[&failing];
    assert_eq!(
        DeadLetterInfo::from_properties(letter).unwrap().reason,
        "retries-exhausted"
    );
    let got = letter.headers().as_ref().unwrap();
    for name in ["deep-tables", "deep-arrays", "wide", "tenant"] {
        assert_eq!(
            got.inner().get(name),
            sent.headers().as_ref().unwrap().inner().get(name),
            "{name} intact after two retries and the dead letter"
        );
    }
    assert!(!got.contains_key(HEADER_DROPPED));
    broker.cleanup().await;
    db.drop_db().await;
}

/// A header the generator made, with what it knows of it.
struct Made {
    name: Vec<u8>,
    value: Value,
    depth: usize,
    values: usize,
    readable: bool,
}

fn random_name(rng: &mut fastrand::Rng, n: usize) -> (Vec<u8>, bool) {
    let mut name: Vec<u8> = format!("g{n}-").into_bytes();
    name.extend((0..rng.usize(0..20)).map(|_| rng.alphanumeric() as u8));
    if rng.u8(0..25) == 0 {
        name.push([0xff, 0xc3, 0x80][rng.usize(0..3)]);
        return (name, false);
    }
    (name, true)
}

/// A random value within `budget` bytes: (value, depth, values, names readable).
fn random_value(
    rng: &mut fastrand::Rng,
    depth: usize,
    budget: usize,
) -> (Value, usize, usize, bool) {
    let scalar = |rng: &mut fastrand::Rng| match rng.u8(0..9) {
        0 => Value::long_string(
            (0..rng.usize(0..40))
                .map(|_| rng.u8(..))
                .collect::<Vec<_>>(),
        ),
        1 => Value::bytes(
            (0..rng.usize(0..40))
                .map(|_| rng.u8(..))
                .collect::<Vec<_>>(),
        ),
        2 => Value::bool(rng.bool()),
        3 => Value::int(rng.i32(..)),
        4 => Value::decimal(rng.u8(0..10), rng.u32(..)),
        5 => Value::timestamp(rng.u64(..)),
        6 => Value::void(),
        7 => Value::double(rng.i32(..) as f64 / 7.0),
        _ => Value::long(rng.i64(..)),
    };
    if depth == 0 || budget < 64 || rng.u8(0..3) == 0 {
        let v = scalar(rng);
        return (v, 0, 1, true);
    }
    let n = rng.usize(0..5);
    let (mut deepest, mut values, mut readable) = (0, 1, true);
    let mut children = Vec::new();
    for i in 0..n {
        let (v, d, c, r) = random_value(rng, depth - 1, budget / (n + 1));
        deepest = deepest.max(d);
        values += c;
        readable &= r;
        children.push((i, v));
    }
    let value = if rng.bool() {
        Value::array(children.into_iter().map(|(_, v)| v))
    } else {
        let named: Vec<(Vec<u8>, Value)> = children
            .into_iter()
            .map(|(i, v)| {
                let (name, ok) = random_name(rng, i);
                readable &= ok;
                (name, v)
            })
            .collect();
        Value::table(named)
    };
    (value, deepest + 1, values, readable)
}

/// One header: mostly a small random tree, sometimes a chain as deep as the
/// frame allows, a wide array, or a long string.
fn random_header(rng: &mut fastrand::Rng, n: usize, room: usize) -> Made {
    let (name, name_ok) = random_name(rng, n);
    let (value, depth, values, readable) = match rng.u8(0..12) {
        0 => {
            let d =
                rng.usize(MAX_HEADER_DEPTH - 2..(room / NESTED_TABLE_LEVEL).max(MAX_HEADER_DEPTH));
            (Value::nested_tables(d, Value::void()), d, d + 1, true)
        }
        1 => {
            let d =
                rng.usize(MAX_HEADER_DEPTH - 2..(room / NESTED_ARRAY_LEVEL).max(MAX_HEADER_DEPTH));
            (Value::nested_arrays(d, Value::void()), d, d + 1, true)
        }
        2 => {
            let k = rng.usize(5_000..room.clamp(5_001, 13_000));
            (Value::array((0..k).map(|_| Value::void())), 1, k + 1, true)
        }
        3 => {
            let len = rng.usize(0..room.saturating_sub(16).max(1));
            (Value::long_string(vec![b'x'; len]), 0, 1, true)
        }
        _ => {
            let depth = rng.usize(0..MAX_HEADER_DEPTH + 8);
            random_value(rng, depth, room.min(4_000))
        }
    };
    Made {
        name,
        value,
        depth,
        values,
        readable: readable && name_ok,
    }
}

/// What the consumer must do with a generated message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Apply,
    DeadLetter(&'static str),
    /// Dead-lettered for one of two reasons, as the frame's room decides.
    DeadLetterEither(&'static str, &'static str),
}

/// More than the guard's marker header takes at its longest (1024 bytes).
const MARKER_ROOM: usize = 1100;

/// Closes the class: a seeded stream of messages with random header trees
/// (random nesting, types, sizes and names, up to what a frame holds), ids
/// and routing keys that are sometimes not UTF-8. The consumer lives, and each
/// message applies once or is dead-lettered with the reason its headers call
/// for, as the generator itself worked out.
async fn generated_frames_never_stop_the_consumer<B: Backend>() {
    let seed = std::env::var("WARREN_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    let mut rng = fastrand::Rng::with_seed(seed);
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let mut producer = RawPublisher::connect(&amqp_url()).await.unwrap();
    let frame_max = producer.frame_max();
    let base = unique("gf");
    let mut expected: HashMap<String, Expect> = HashMap::new();
    for n in 0..100 {
        let id = format!("{base}-{n}");
        let bad_id = rng.u8(0..20) == 0;
        let bad_key = rng.u8(0..20) == 0;
        let mut p = properties(if bad_id {
            let mut b = id.clone().into_bytes();
            b.push(0xfe);
            b
        } else {
            id.clone().into_bytes()
        });
        let mut made = Vec::new();
        for h in 0..rng.usize(0..5) {
            let room = frame_max.saturating_sub(p.frame_len() + 300);
            let m = random_header(&mut rng, h, room);
            let with = p.clone().header(&m.name, m.value.clone());
            if with.frame_len() <= frame_max {
                p = with;
                made.push(m);
            }
        }
        // The guard's verdict, worked out from what was made: a deep header
        // first, then the value count of what stays readable, then text.
        let deep = made.iter().any(|m| m.depth > MAX_HEADER_DEPTH);
        let counted: usize = 1 + made
            .iter()
            .filter(|m| m.readable && m.depth <= MAX_HEADER_DEPTH && m.values <= MAX_HEADER_ENTRIES)
            .map(|m| m.values)
            .sum::<usize>();
        let many = made
            .iter()
            .any(|m| m.values > MAX_HEADER_ENTRIES && m.depth <= MAX_HEADER_DEPTH)
            || counted > MAX_HEADER_ENTRIES;
        let unreadable = bad_id || bad_key || made.iter().any(|m| !m.readable);
        let expect = if deep {
            Expect::DeadLetter("headers-too-deep")
        } else if many {
            Expect::DeadLetter("too-many-headers")
        } else if unreadable && p.frame_len() + MARKER_ROOM > frame_max {
            // The repair adds the guard's marker (up to 1 KiB); where the frame
            // has no room left for it, the largest header goes, as past the
            // frame, and the letter says so.
            Expect::DeadLetterEither("unreadable-frame", "too-many-headers")
        } else if unreadable {
            Expect::DeadLetter("unreadable-frame")
        } else {
            Expect::Apply
        };
        if rng.u8(0..10) == 0 {
            p = p.reserved_flags(rng.u16(1..4));
        }
        let routing_key: &[u8] = if bad_key { b"test.\xfe" } else { b"test.job" };
        producer
            .publish(&broker.exchange, routing_key, &p, &body(&id, &Job::ok()))
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: the broker takes message {n}: {e}"));
        expected.insert(id, expect);
    }
    producer.close().await;

    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    let total = expected.len() as u64;
    let stats = running.stats.clone();
    assert!(
        wait_for(Duration::from_secs(90), || {
            let s = stats.snapshot();
            async move { s.applied + s.dead_lettered == total }
        })
        .await,
        "seed {seed}: every message settled: {:?}",
        running.stats.snapshot()
    );
    assert!(
        running.is_running() && running.stats.health().is_ready(),
        "seed {seed}"
    );
    running.stop().await.unwrap();
    let letters = broker.dead_letters().await;
    for (id, expect) in &expected {
        let applied = db.effects_for(id).await;
        let letter = letters
            .get(id)
            .or_else(|| letters.get(&format!("{id}?")))
            .and_then(DeadLetterInfo::from_properties);
        match expect {
            Expect::Apply => {
                assert_eq!(applied, 1, "seed {seed}: {id} applied once");
                assert!(letter.is_none(), "seed {seed}: {id} not dead-lettered");
            }
            Expect::DeadLetter(reason) => {
                assert_eq!(applied, 0, "seed {seed}: {id} not applied");
                assert_eq!(
                    letter.map(|l| l.reason).as_deref(),
                    Some(*reason),
                    "seed {seed}: {id}"
                );
            }
            Expect::DeadLetterEither(one, other) => {
                assert_eq!(applied, 0, "seed {seed}: {id} not applied");
                let reason = letter.map(|l| l.reason);
                assert!(
                    reason.as_deref() == Some(*one) || reason.as_deref() == Some(*other),
                    "seed {seed}: {id}: {reason:?}, expected {one} or {other}"
                );
            }
        }
    }
    assert_eq!(
        letters.len(),
        expected.values().filter(|e| **e != Expect::Apply).count(),
        "seed {seed}"
    );
    broker.cleanup().await;
    db.drop_db().await;
}
