//! Messages from producers nobody here wrote, each through its own library
//! installed from its registry (`.ci/interop-setup`): pika's bare payloads,
//! the CloudEvents SDK's RabbitMQ binding in both modes, FastStream and Node's
//! amqplib, on a consumer that reads CloudEvents, warren's envelope and bare
//! payloads; and keys derived from the payload for messages sent without an id.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde::Deserialize;
use warren::format::{
    Bare, CloudEvents, Formats, MassTransit, NServiceBus, SpringAmqp, VersionFrom, WarrenEnvelope,
};
use warren::{Consumer, HandlerError, Message, Registry, Tx};

use crate::util::{Backend, Job, Running, TestBroker, amqp_url, routes, wait_for};

on_all_backends!(
    foreign_producers_are_each_applied_once,
    the_same_invoice_without_an_id_on_two_instances_applies_once,
    other_frameworks_messages_are_each_applied_once,
    hostile_foreign_messages_are_dead_lettered_and_their_followers_applied_once,
    foreign_dead_letters_are_stored_under_the_id_warren_read,
    cloudevents_are_retried_and_dead_lettered_as_they_came,
    an_edit_keeps_who_a_foreign_letter_is_and_a_format_warren_cannot_lay_out_is_not_edited,
);

/// Where `.ci/interop-setup` installed the producers.
fn interop_dir() -> PathBuf {
    let dir = PathBuf::from(
        std::env::var("WARREN_INTEROP_DIR").unwrap_or_else(|_| "/var/lib/warren-interop".into()),
    );
    assert!(
        dir.join("stamp").exists(),
        "the foreign producers are not installed in {}: run .ci/interop-setup (pika, cloudevents, FastStream, amqplib from their registries)",
        dir.display()
    );
    dir
}

/// Runs one producer to the end; it has published `count` messages twice,
/// each confirmed.
fn produce(library: &str, broker: &TestBroker, routing_key: &str, count: u32) {
    let dir = interop_dir();
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop");
    let url = amqp_url();
    let count = count.to_string();
    let output = if library == "amqplib" {
        Command::new("node")
            .arg(here.join("produce.cjs"))
            .args([&url, &broker.exchange, routing_key, &count])
            .env("NODE_PATH", dir.join("node/node_modules"))
            .output()
    } else {
        Command::new(dir.join("venv/bin/python"))
            .arg(here.join("produce.py"))
            .args([library, &url, &broker.exchange, routing_key, &count])
            .output()
    }
    .unwrap_or_else(|e| panic!("{library}: cannot run: {e}"));
    assert!(
        output.status.success(),
        "{library} failed: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Reads `count` messages of `queue` with the CloudEvents SDK (pika, then
/// the SDK's RabbitMQ binding), leaving them in the queue: per event, its
/// `attributes`, its `data` and the AMQP `message_id` it came with.
pub(crate) fn read_with_cloudevents_sdk(queue: &str, count: usize) -> Vec<serde_json::Value> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop");
    let output = Command::new(interop_dir().join("venv/bin/python"))
        .arg(here.join("consume.py"))
        .args([&amqp_url(), queue, &count.to_string()])
        .output()
        .unwrap_or_else(|e| panic!("consume.py: cannot run: {e}"));
    assert!(
        output.status.success(),
        "the CloudEvents SDK refused warren's events: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("consume.py prints JSON lines"))
        .collect()
}

/// CloudEvents first, then warren's envelope, then any other JSON body; the
/// test routes' event type (`test.job`) has no `.vN` suffix, so the
/// version is fixed.
fn formats() -> Formats {
    Formats::new()
        .then(CloudEvents::new().version_from(VersionFrom::Fixed(1)))
        .then(WarrenEnvelope)
        .then(Bare::new().version_from(VersionFrom::Fixed(1)))
}

/// Five producers in four formats, 40 messages each, each message twice:
/// 200 effects, 200 duplicates, nothing dead-lettered. Warren's own
/// envelope on the same queue, beside them, is applied as ever.
async fn foreign_producers_are_each_applied_once<B: Backend>() {
    const EACH: u32 = 40;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker.builder().with_formats(formats()).build().unwrap();
    broker.declare_config(&config).await;

    let libraries = [
        "pika-bare",
        "cloudevents-binary",
        "cloudevents-structured",
        "faststream",
        "amqplib",
    ];
    for library in libraries {
        produce(library, &broker, "test.job", EACH);
    }
    let own = TestBroker::message(&Job::ok());
    broker.publish(&own).await;
    broker.publish(&own).await;

    let unique = EACH as u64 * libraries.len() as u64 + 1;
    consume_each_twice_apply_once(&db, &broker, config, unique).await;
    assert_eq!(db.effects_for(&own.meta().message_id).await, 1);

    broker.cleanup().await;
    db.drop_db().await;
}

/// Consumes a queue holding `unique` messages, each twice: each applied
/// once, the other copy a duplicate, nothing retried or dead-lettered.
async fn consume_each_twice_apply_once<B: Backend>(
    db: &crate::util::TestDb<B>,
    broker: &TestBroker,
    config: warren::ConsumerConfig,
    unique: u64,
) {
    let running = Running::start(Consumer::new(config, db.store.clone(), routes::<B>()));
    assert!(
        running.settled(2 * unique, Duration::from_secs(120)).await,
        "not all deliveries settled: {:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(stats.applied, unique, "{stats:?}");
    assert_eq!(stats.duplicates, unique, "{stats:?}");
    assert_eq!(stats.dead_lettered + stats.retried, 0, "{stats:?}");
    assert_eq!(
        db.effects().await,
        unique as i64,
        "one effect per unique message"
    );
    assert_eq!(db.distinct_effects().await, unique as i64);
    assert_eq!(db.inbox(&broker.name).await, unique as i64);
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 0);
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Paid {
    invoice_id: String,
}

/// Records one effect under the message's id, slowly enough that both
/// copies of an invoice are in flight at once.
async fn paid<B: Backend>(msg: Message<Paid>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    assert!(!msg.payload.invoice_id.is_empty());
    tokio::time::sleep(Duration::from_millis(100)).await;
    B::insert_effect(tx, &msg.meta.message_id).await?;
    Ok(())
}

/// pika publishes ten invoices with no id at all, each copy right behind its
/// original, to two instances of one consumer holding one delivery each:
/// the copies run at the same moment, and the key the route derives
/// (`{invoiceId}:paid`) claims each invoice once. Ten distinct invoices,
/// ten effects: no two keys meet.
async fn the_same_invoice_without_an_id_on_two_instances_applies_once<B: Backend>() {
    const INVOICES: u64 = 10;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_formats(formats())
        .with_prefetch(1)
        .with_concurrency(1)
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let registry = || -> Registry<B> {
        routes::<B>().route_keyed(
            "test.paid",
            1,
            |p: &Paid| format!("{}:paid", p.invoice_id),
            paid::<B>,
        )
    };
    let a = Running::start(Consumer::new(config.clone(), db.store.clone(), registry()));
    let b = Running::start(Consumer::new(config, db.store.clone(), registry()));
    let both = wait_for(Duration::from_secs(20), || async {
        broker.consumers(&broker.queue).await == 2
    })
    .await;
    assert!(both, "two consumers should be subscribed");

    produce("pika-no-id", &broker, "test.paid", INVOICES as u32);

    let settled = wait_for(Duration::from_secs(60), || async {
        let (sa, sb) = (a.stats.snapshot(), b.stats.snapshot());
        sa.applied + sa.duplicates + sb.applied + sb.duplicates >= 2 * INVOICES
    })
    .await;
    let (sa, sb) = (a.stats.snapshot(), b.stats.snapshot());
    assert!(settled, "a={sa:?} b={sb:?}");
    a.stop().await.unwrap();
    b.stop().await.unwrap();

    assert_eq!(sa.applied + sb.applied, INVOICES, "a={sa:?} b={sb:?}");
    assert_eq!(sa.duplicates + sb.duplicates, INVOICES, "a={sa:?} b={sb:?}");
    assert_eq!(sa.dead_lettered + sb.dead_lettered, 0, "a={sa:?} b={sb:?}");
    assert_eq!(db.effects().await, INVOICES as i64);
    assert_eq!(db.distinct_effects().await, INVOICES as i64);
    assert_eq!(db.inbox(&broker.name).await, INVOICES as i64);

    broker.cleanup().await;
    db.drop_db().await;
}

/// The three frameworks' formats, each mapping the test's job type, then
/// warren's envelope.
fn framework_formats() -> Formats {
    Formats::new()
        .then(MassTransit::new().message_type("urn:message:Warren.Tests:Job", "test.job", 1))
        .then(NServiceBus::new().message_type("Warren.Tests.Job", "test.job", 1))
        .then(SpringAmqp::new().type_id("com.example.warren.Job", "test.job", 1))
        .then(WarrenEnvelope)
}

/// pika publishes MassTransit envelopes, NServiceBus messages and Spring
/// AMQP's JSON messages as those frameworks' RabbitMQ transports document
/// them, 30 of each, each twice: 90 effects, 90 duplicates.
async fn other_frameworks_messages_are_each_applied_once<B: Backend>() {
    const EACH: u32 = 30;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_formats(framework_formats())
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let kinds = ["pika-masstransit", "pika-nservicebus", "pika-spring"];
    for kind in kinds {
        produce(kind, &broker, "test.job", EACH);
    }
    let unique = EACH as u64 * kinds.len() as u64;
    consume_each_twice_apply_once(&db, &broker, config, unique).await;
    broker.cleanup().await;
    db.drop_db().await;
}

/// Hostile messages from pika, each followed by a valid bare payload sent
/// twice: every hostile one is dead-lettered at once with a reason naming
/// its format, nothing of it applied, and every follower applied once. A
/// structured CloudEvent with contradicting `ce-` headers beside it is read
/// from its body.
async fn hostile_foreign_messages_are_dead_lettered_and_their_followers_applied_once<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let formats = Formats::new()
        .then(CloudEvents::new().version_from(VersionFrom::Fixed(1)))
        .then(MassTransit::new().message_type("urn:message:Warren.Tests:Job", "test.job", 1))
        .then(NServiceBus::new().message_type("Warren.Tests.Job", "test.job", 1))
        .then(SpringAmqp::new().type_id("com.example.warren.Job", "test.job", 1))
        .then(WarrenEnvelope)
        .then(Bare::new().version_from(VersionFrom::Fixed(1)));
    let config = broker.builder().with_formats(formats).build().unwrap();
    broker.declare_config(&config).await;
    produce("pika-hostile", &broker, "test.job", 0);
    // A payment sent without an id is keyed by its invoice.
    let registry = routes::<B>().route_keyed(
        "test.paid",
        1,
        |p: &Paid| format!("{}:paid", p.invoice_id),
        paid::<B>,
    );

    let expected: BTreeMap<&str, &str> = [
        ("ce-id-too-long", "invalid-cloudevent"),
        ("ce-source-control", "invalid-cloudevent"),
        ("ce-data-not-json", "invalid-cloudevent"),
        ("ce-broken-body", "invalid-cloudevent"),
        ("ce-data-base64", "invalid-cloudevent"),
        ("ce-binary-text", "invalid-cloudevent"),
        ("ce-specversion", "invalid-cloudevent"),
        ("ce-two-prefixes", "invalid-cloudevent"),
        ("ce-id-boolean", "invalid-cloudevent"),
        ("masstransit-unknown-type", "invalid-masstransit"),
        ("bare-unknown-type", "unknown-event-type"),
        ("bare-id-too-long", "invalid-bare-payload"),
        ("bare-no-type", "invalid-bare-payload"),
        ("derived-key-too-long", "invalid-derived-key"),
        ("masstransit-id-mismatch", "message-id-mismatch"),
        ("nservicebus-unknown-type", "invalid-nservicebus"),
        ("nservicebus-id-mismatch", "message-id-mismatch"),
        ("spring-unknown-type", "invalid-spring-message"),
    ]
    .into();
    let hostile = expected.len() as u64;
    // Each case's follower twice, and the structured event twice.
    let valid = hostile + 1;
    let running = Running::start(Consumer::new(config, db.store.clone(), registry));
    assert!(
        running
            .settled(hostile + 2 * valid, Duration::from_secs(60))
            .await,
        "not all deliveries settled: {:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(stats.dead_lettered, hostile, "{stats:?}");
    assert_eq!(stats.retried, 0, "never retried: {stats:?}");
    assert_eq!(stats.applied, valid, "{stats:?}");
    assert_eq!(stats.duplicates, valid, "{stats:?}");
    assert_eq!(db.effects().await, valid as i64, "nothing hostile applied");
    assert_eq!(db.distinct_effects().await, valid as i64);

    let mut seen = BTreeMap::new();
    for letter in broker.drain(&broker.dead_letter_queue()).await {
        let headers = letter.properties.headers().clone().unwrap_or_default();
        let text = |name: &str| match headers.inner().get(name) {
            Some(lapin::types::AMQPValue::LongString(s)) => {
                String::from_utf8_lossy(s.as_bytes()).into_owned()
            }
            other => panic!("{name}: {other:?}"),
        };
        let case = text("test-case");
        let reason = text("x-warren-reason");
        let error = text("x-warren-error");
        if case == "bare-unknown-type" {
            assert!(error.contains("read as bare"), "{case}: {error}");
        }
        assert!(
            !error.is_empty(),
            "{case}: an error that says what is wrong"
        );
        seen.insert(case, reason);
    }
    let seen: BTreeMap<&str, &str> = seen.iter().map(|(c, r)| (c.as_str(), r.as_str())).collect();
    assert_eq!(seen, expected);

    broker.cleanup().await;
    db.drop_db().await;
}

/// A handler that refuses every invoice for good.
async fn refuse_paid<B: Backend>(_: Message<Paid>, _: &mut Tx<B>) -> Result<(), HandlerError> {
    Err(HandlerError::permanent("this invoice cannot be paid"))
}

/// Two messages without an AMQP `message_id` dead-lettered after they were
/// read: a binary CloudEvent of a type no route takes, and a bare payment
/// its handler refuses, keyed by the route. Each letter carries the key,
/// the format and the event type warren read (signed), and the dead-letter
/// store files it under that key, found by it; replayed, it is the message
/// its producer sent.
/// The stored letters of the message warren knew by `key`.
async fn letters_keyed<B: Backend>(
    db: &crate::util::TestDb<B>,
    key: &str,
) -> Vec<warren::store::StoredDeadLetter> {
    use warren::store::{DeadLetterStore, LetterFilter};
    let by_key = LetterFilter {
        message_id: Some(key.to_owned()),
        ..LetterFilter::default()
    };
    db.store.dead_letters(&by_key, None, 10).await.unwrap()
}

async fn foreign_dead_letters_are_stored_under_the_id_warren_read<B: Backend>() {
    use warren::format::Identity;
    use warren::lapin::BasicProperties;
    use warren::lapin::types::{AMQPValue, FieldTable, LongString};
    use warren::store::{DeadLetterStore, Journal, LetterFilter};
    use warren_admin::Ingester;

    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker.builder().with_formats(formats()).build().unwrap();
    broker.declare_config(&config).await;
    let registry = routes::<B>().route_keyed(
        "test.paid",
        1,
        |p: &Paid| format!("{}:paid", p.invoice_id),
        refuse_paid::<B>,
    );

    let source = format!("/shop/{}", broker.name);
    let mut ce = FieldTable::default();
    for (k, v) in [
        ("ce-specversion", "1.0"),
        ("ce-id", "order-1"),
        ("ce-source", source.as_str()),
        ("ce-type", "shop.order-placed"),
    ] {
        ce.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    }
    let json = || BasicProperties::default().with_content_type("application/json".into());
    broker
        .publish_raw(
            br#"{"orderId":"o-1","card":{"number":"4111"}}"#,
            json().with_headers(ce),
        )
        .await;
    broker
        .publish_raw(
            br#"{"invoiceId":"inv_9"}"#,
            json().with_type("test.paid".into()),
        )
        .await;

    let running = Running::start(Consumer::new(config.clone(), db.store.clone(), registry));
    assert!(running.settled(2, Duration::from_secs(60)).await);
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(stats.dead_lettered, 2, "{stats:?}");

    let event_key = Identity::CloudEvent {
        source: source.clone(),
        id: "order-1".into(),
    }
    .key();
    let paid_key = Identity::Derived("inv_9:paid".into()).key();
    let ingesting = crate::util::Ingesting::start(
        Ingester::new(db.store.clone(), &config).redacting(["card.number"]),
    );
    let all = LetterFilter::default();
    let stored = wait_for(Duration::from_secs(60), || async {
        db.store.dead_letters(&all, None, 10).await.unwrap().len() >= 2
    })
    .await;
    ingesting.stop().await;
    assert!(stored, "both letters stored");

    for (key, event_type, reason, format) in [
        (
            &event_key,
            "shop.order-placed",
            "unknown-event-type",
            "cloudevents",
        ),
        (&paid_key, "test.paid", "permanent-failure", "bare"),
    ] {
        let found = letters_keyed(&db, key).await;
        assert_eq!(found.len(), 1, "{key}: {found:?}");
        let letter = &found[0];
        assert_eq!(letter.event_type, event_type);
        assert_eq!(letter.reason, reason);
        let record = db
            .store
            .dead_letter(&letter.letter_id)
            .await
            .unwrap()
            .expect("the letter is stored");
        assert!(
            record
                .headers
                .contains(&format!(r#""x-warren-format":"{format}""#)),
            "{key}: {}",
            record.headers
        );
        let properties: serde_json::Value = serde_json::from_str(&record.properties).unwrap();
        assert!(
            properties["message_id"].is_null(),
            "the copy gained no message_id its original lacked: {properties}"
        );
        // The journal keeps who the message is, verbatim, beside its key.
        let journal = db
            .store
            .journal_of_message(config.name(), key, 10)
            .await
            .unwrap();
        let dead = journal
            .iter()
            .find(|e| e.outcome == "dead-lettered")
            .unwrap_or_else(|| panic!("{key}: {journal:?}"));
        let who = if format == "cloudevents" {
            format!("CloudEvent \"order-1\" from {source:?}; ")
        } else {
            "derived key \"inv_9:paid\"; ".to_owned()
        };
        assert!(dead.detail.starts_with(&who), "{:?}", dead.detail);
    }

    // Redaction finds a binary CloudEvent's payload in its body.
    let event_letter = letters_keyed(&db, &event_key).await.remove(0);
    let record = db
        .store
        .dead_letter(&event_letter.letter_id)
        .await
        .unwrap()
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&record.body).unwrap();
    assert_eq!(body["card"]["number"], warren_admin::REDACTED);
    assert_eq!(body["orderId"], "o-1");

    // An operator's edit of it sets the field where the format keeps the
    // payload, and is the same CloudEvent; a letter whose key its route
    // derives from the payload is not edited.
    let ana = warren::store::Actor::new("ana");
    let fixed =
        warren_admin::set_payload_fields(&record, &[("orderId".into(), "o-2".into())]).unwrap();
    warren_admin::edit_letter(&db.store, &event_letter.letter_id, &fixed, "typo", &ana)
        .await
        .unwrap();
    let edited = db
        .store
        .dead_letter(&event_letter.letter_id)
        .await
        .unwrap()
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(edited.body_to_send()).unwrap();
    assert_eq!(body["orderId"], "o-2");
    let refused =
        warren_admin::edit_letter(&db.store, &event_letter.letter_id, b"[1,", "bad", &ana)
            .await
            .unwrap_err()
            .to_string();
    assert!(
        refused.starts_with("the edit is not a valid cloudevents message: not JSON"),
        "{refused}"
    );
    let paid_letter = letters_keyed(&db, &paid_key).await.remove(0);
    let refused = warren_admin::edit_letter(
        &db.store,
        &paid_letter.letter_id,
        br#"{"invoiceId":"inv_10"}"#,
        "why",
        &ana,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(refused, warren_admin::EditError::DerivedKey(_)),
        "{refused}"
    );

    broker.cleanup().await;
    db.drop_db().await;
}

/// `Publisher` sends warren's events as CloudEvents in both modes, and the
/// CloudEvents SDK, reading them as its documentation shows, takes each
/// attribute and the data as warren meant them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloudevents_sdk_reads_what_warren_publishes_in_both_modes() {
    use warren::{Outgoing, OutgoingFormat};
    const SOURCE: &str = "urn:warren:test:publisher";
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let sent: Vec<_> = [
        OutgoingFormat::cloud_events_binary(SOURCE),
        OutgoingFormat::cloud_events_structured(SOURCE),
    ]
    .into_iter()
    .enumerate()
    .map(|(n, format)| {
        Outgoing::new("billing.invoice-paid.v1", 1, &serde_json::json!({ "n": n }))
            .unwrap()
            .with_correlation_id("order-7")
            .with_format(format)
    })
    .collect();
    for message in &sent {
        broker
            .publisher
            .publish(&broker.exchange, "out.event", message)
            .await
            .unwrap();
    }
    let read = read_with_cloudevents_sdk(&capture, sent.len());
    for (n, message) in sent.iter().enumerate() {
        let r = &read[n];
        let a = &r["attributes"];
        assert_eq!(a["id"], message.meta().message_id.as_str(), "{r}");
        assert_eq!(a["source"], SOURCE);
        assert_eq!(a["type"], "billing.invoice-paid.v1");
        assert_eq!(a["correlationid"], "order-7");
        assert_eq!(
            a["schemaversion"],
            if n == 0 {
                "1".into()
            } else {
                serde_json::json!(1)
            }
        );
        assert!(a.get("causationid").is_none(), "{r}");
        assert_eq!(r["data"], serde_json::json!({ "n": n }));
    }
    broker.cleanup().await;
}

/// A CloudEvent whose handler fails for a while is retried through the delay
/// tiers and applied once, keyed by its source and id on every attempt; one
/// that fails for good is dead-lettered, its copy still the CloudEvent it
/// was (its content type, its body), and a bare payload sent without an id
/// is refused with its copy still lacking one.
async fn cloudevents_are_retried_and_dead_lettered_as_they_came<B: Backend>() {
    use crate::util::Mode;
    use warren::format::Identity;
    use warren::lapin::BasicProperties;
    use warren::lapin::types::{AMQPValue, FieldTable, LongString};
    use warren::{Outgoing, OutgoingFormat};

    let db = B::create().await;
    let broker = TestBroker::new().await;
    let formats = Formats::new()
        .then(CloudEvents::new().version_from(VersionFrom::Header("schemaversion".into())))
        .then(Bare::new().version_from(VersionFrom::Fixed(1)));
    let config = broker.builder().with_formats(formats).build().unwrap();
    broker.declare_config(&config).await;
    let source = format!("urn:test:{}", broker.name);
    let flaky = Outgoing::new(crate::util::EVENT, 1, &Job::with(Mode::Transient { n: 2 }))
        .unwrap()
        .with_format(OutgoingFormat::cloud_events_binary(&source));
    let doomed = Outgoing::new(crate::util::EVENT, 1, &Job::with(Mode::Permanent))
        .unwrap()
        .with_format(OutgoingFormat::cloud_events_structured(&source));
    broker.publish(&flaky).await;
    broker.publish(&doomed).await;
    // A bare payload without a message_id whose handler refuses it.
    let mut headers = FieldTable::default();
    headers.insert(
        "test-case".into(),
        AMQPValue::LongString(LongString::from("bare-doomed")),
    );
    let bare_body = serde_json::to_vec(&Job::with(Mode::Permanent)).unwrap();
    broker
        .publish_raw(
            &bare_body,
            BasicProperties::default()
                .with_content_type("application/json".into())
                .with_type(crate::util::EVENT.into())
                .with_headers(headers),
        )
        .await;

    let running = Running::start(Consumer::new(config, db.store.clone(), routes::<B>()));
    assert!(
        running.settled(3, Duration::from_secs(60)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(
        (stats.applied, stats.retried, stats.dead_lettered),
        (1, 2, 2),
        "{stats:?}"
    );
    let key = |m: &Outgoing| {
        Identity::CloudEvent {
            source: source.clone(),
            id: m.meta().message_id.clone(),
        }
        .key()
    };
    assert_eq!(db.effects_for(&key(&flaky)).await, 1, "applied once");
    assert_eq!(db.effects_for(&key(&doomed)).await, 0, "rolled back");

    let letters = broker.drain(&broker.dead_letter_queue()).await;
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        let p = &letter.properties;
        let headers = p.headers().clone().unwrap_or_default();
        let header = |name: &str| match headers.inner().get(name) {
            Some(AMQPValue::LongString(s)) => {
                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            _ => None,
        };
        let reason = header("x-warren-reason");
        if header("test-case").is_some() {
            // No id and no route that derives one: refused before any handler.
            assert_eq!(reason.as_deref(), Some("missing-message-id"));
            assert_eq!(letter.data, bare_body, "the bare body as sent");
            assert!(p.message_id().is_none(), "no message_id it lacked");
        } else {
            assert_eq!(reason.as_deref(), Some("permanent-failure"));
            assert_eq!(letter.data, doomed.body(), "the structured event as sent");
            assert_eq!(
                p.content_type().as_ref().map(|c| c.as_str()),
                Some(warren::format::CONTENT_TYPE_STRUCTURED)
            );
            assert_eq!(header("x-warren-message-key"), Some(key(&doomed)));
            assert_eq!(header("x-warren-format").as_deref(), Some("cloudevents"));
        }
    }

    broker.cleanup().await;
    db.drop_db().await;
}

/// An application's own format, which warren cannot lay out: a JSON body
/// under the content type `application/x-tagged`, its id the AMQP
/// `message_id`.
#[derive(Debug)]
struct Tagged;

impl warren::format::Format for Tagged {
    fn name(&self) -> &'static str {
        "tagged"
    }

    fn read(
        &self,
        incoming: &warren::format::Incoming<'_>,
    ) -> Result<warren::format::Read, warren::format::Refusal> {
        use warren::format::{Identity, InvalidMessage, Read, Refusal};
        use warren_admin::DeadLetterReason;
        if incoming.content_type != Some("application/x-tagged") {
            return Err(Refusal::NotMine(InvalidMessage::new(
                DeadLetterReason::InvalidContentType,
                "not application/x-tagged",
            )));
        }
        let invalid = |detail: &str| {
            Refusal::Invalid(InvalidMessage::new(DeadLetterReason::InvalidJson, detail))
        };
        let payload = serde_json::from_slice(incoming.body).map_err(|_| invalid("not JSON"))?;
        let id = incoming
            .message_id
            .ok_or_else(|| invalid("no message_id"))?;
        let mut read = Read::new("tagged", "test.job".into(), 1, payload);
        read.identity = Some(Identity::Given(id.to_owned()));
        Ok(read)
    }
}

/// The stored dead letters, each under the format warren read it in (its
/// `x-warren-format` header).
async fn letters_by_format<B: Backend>(
    db: &crate::util::TestDb<B>,
) -> BTreeMap<String, warren::store::DeadLetterRecord> {
    use warren::store::{DeadLetterStore, LetterFilter};
    let mut records = BTreeMap::new();
    let letters = db
        .store
        .dead_letters(&LetterFilter::default(), None, 20)
        .await
        .unwrap();
    for letter in letters {
        let record = db
            .store
            .dead_letter(&letter.letter_id)
            .await
            .unwrap()
            .unwrap();
        let format = record
            .header_texts()
            .into_iter()
            .find(|(name, _)| name == "x-warren-format")
            .map(|(_, v)| v)
            .unwrap_or_default();
        records.insert(format, record);
    }
    records
}

/// Refuses every job for good, whatever its payload.
async fn refuse_any<B: Backend>(
    _: Message<serde_json::Value>,
    _: &mut Tx<B>,
) -> Result<(), HandlerError> {
    Err(HandlerError::permanent("refused for the test"))
}

/// A structured CloudEvent (the CloudEvents SDK), a MassTransit envelope
/// (pika) and a message in an application's own format, each refused by its
/// handler and stored as a dead letter. An operator's edit of the first two
/// may change their payload, never who they are: the event's `id` or
/// `source`, MassTransit's `messageId` (the inbox would take the replay for
/// another message). The third is not edited at all: warren does not know
/// where its payload is or what names it.
async fn an_edit_keeps_who_a_foreign_letter_is_and_a_format_warren_cannot_lay_out_is_not_edited<
    B: Backend,
>() {
    use warren::lapin::BasicProperties;
    use warren::store::{Actor, DeadLetterStore};
    use warren_admin::{EditError, Ingester, edit_letter, set_payload_fields};

    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_formats(
            Formats::new()
                .then(Tagged)
                .then(CloudEvents::new().version_from(VersionFrom::Fixed(1)))
                .then(MassTransit::new().message_type(
                    "urn:message:Warren.Tests:Job",
                    "test.job",
                    1,
                )),
        )
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    produce("cloudevents-structured", &broker, "test.job", 1);
    produce("pika-masstransit", &broker, "test.job", 1);
    let tagged_id = format!("tag-{}", broker.name);
    broker
        .publish_raw(
            br#"{"n":1}"#,
            BasicProperties::default()
                .with_content_type("application/x-tagged".into())
                .with_message_id(tagged_id.as_str().into()),
        )
        .await;

    let registry = Registry::<B>::new().route("test.job", 1, refuse_any::<B>);
    let running = Running::start(Consumer::new(config.clone(), db.store.clone(), registry));
    // Each producer sent its message twice; the tagged one came once.
    assert!(running.settled(5, Duration::from_secs(60)).await);
    running.stop().await.unwrap();

    let ingesting = crate::util::Ingesting::start(Ingester::new(db.store.clone(), &config));
    let formats = ["cloudevents", "masstransit", "tagged"];
    let stored = wait_for(Duration::from_secs(60), || async {
        let records = letters_by_format(&db).await;
        formats.iter().all(|f| records.contains_key(*f))
    })
    .await;
    ingesting.stop().await;
    let records = letters_by_format(&db).await;
    assert!(stored, "a letter of each format: {:?}", records.keys());

    let ana = Actor::new("ana");
    let edit = |body: &serde_json::Value| serde_json::to_vec(body).unwrap();
    for (format, members) in [
        ("cloudevents", &["id", "source"][..]),
        ("masstransit", &["messageId"][..]),
    ] {
        let record = &records[format];
        let id = &record.letter.letter_id;
        let body: serde_json::Value = serde_json::from_slice(record.body_to_send()).unwrap();
        for member in members {
            let mut other = body.clone();
            other[*member] = serde_json::json!("someone-else");
            let refused = edit_letter(&db.store, id, &edit(&other), "why", &ana)
                .await
                .unwrap_err();
            assert!(
                matches!(refused, EditError::MessageIdChanged(_)),
                "{format}, {member}: {refused}"
            );
        }
        // The payload may change; who it is stays.
        let fixed = set_payload_fields(record, &[("note".into(), "fixed".into())]).unwrap();
        edit_letter(&db.store, id, &fixed, "fix", &ana)
            .await
            .unwrap();
        let edited = db.store.dead_letter(id).await.unwrap().unwrap();
        let after: serde_json::Value = serde_json::from_slice(edited.body_to_send()).unwrap();
        for member in members {
            assert_eq!(after[*member], body[*member], "{format}: {member}");
        }
        let payload = if format == "cloudevents" {
            "data"
        } else {
            "message"
        };
        assert_eq!(after[payload]["note"], "fixed", "{format}: {after}");
    }

    let tagged = &records["tagged"];
    assert_eq!(tagged.letter.message_id, tagged_id);
    let refused = edit_letter(
        &db.store,
        &tagged.letter.letter_id,
        br#"{"n":2}"#,
        "why",
        &ana,
    )
    .await
    .unwrap_err();
    assert!(matches!(refused, EditError::UnknownFormat(_)), "{refused}");
    assert!(refused.to_string().contains("\"tagged\""), "{refused}");
    let why = set_payload_fields(tagged, &[("n".into(), "2".into())]).unwrap_err();
    assert!(why.contains("\"tagged\""), "{why}");
    let unchanged = db
        .store
        .dead_letter(&tagged.letter.letter_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(unchanged.body_to_send(), br#"{"n":1}"#);

    broker.cleanup().await;
    db.drop_db().await;
}
