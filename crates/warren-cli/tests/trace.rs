//! `warren trace`: one message's story from two services' databases: a retry,
//! a duplicate delivery, the event its handler wrote, and that event applied
//! by a downstream consumer with a database of its own.

use std::time::Duration;

use warren::{Consumer, RelayConfig};

use crate::cli::{text, warren};
use crate::util::{Backend, Job, Mode, Running, TestBroker, routes, wait_for};

on_all_backends!(
    trace_tells_a_retry_a_duplicate_and_the_event_downstream,
    trace_finds_a_cloudevent_by_its_source_and_id,
    trace_finds_a_message_without_an_id_by_its_derived_key,
    trace_finds_a_producers_id_that_starts_with_a_tilde,
);

fn outcomes(journal: &serde_json::Value, consumer: &str) -> Vec<String> {
    journal
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["consumer"] == consumer)
        .map(|j| j["outcome"].as_str().unwrap().to_owned())
        .collect()
}

/// `warren trace ARGS... --json`, which must succeed, as JSON.
async fn trace_json(args: &[&str]) -> serde_json::Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = warren(&args).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

async fn trace_tells_a_retry_a_duplicate_and_the_event_downstream<B: Backend>() {
    let upstream_db = B::create().await;
    let downstream_db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let upstream_name = broker.config().name().to_owned();
    let downstream_name = broker.downstream_config().name().to_owned();

    // Fails once (a retry through a tier), then applies and writes one event.
    let job = Job::with(Mode::Transient { n: 1 }).emitting(1, &broker.exchange);
    let message = TestBroker::message(&job);
    let message_id = message.meta().message_id.clone();
    broker.publish(&message).await;
    let relay = RelayConfig::new(format!("{}-relay", broker.name))
        .with_poll_interval(Duration::from_millis(200));
    let upstream = Running::start_with_relay(
        Consumer::new(broker.config(), upstream_db.store.clone(), routes::<B>()),
        relay,
    );
    let downstream = Running::start(Consumer::new(
        broker.downstream_config(),
        downstream_db.store.clone(),
        routes::<B>(),
    ));
    assert!(upstream.settled(1, Duration::from_secs(60)).await);
    // The same message again: a duplicate, which writes nothing but its
    // journal entry.
    broker.publish(&message).await;
    assert!(upstream.settled(2, Duration::from_secs(60)).await);
    assert!(downstream.settled(1, Duration::from_secs(60)).await);
    assert!(
        wait_for(Duration::from_secs(10), || async {
            broker.ready(&capture).await == 0
        })
        .await
    );
    // Stopping flushes the journal.
    upstream.stop().await.unwrap();
    downstream.stop().await.unwrap();

    let tree = trace_json(&[
        "trace",
        &message_id,
        "--database-url",
        &upstream_db.url,
        "--database-url",
        &downstream_db.url,
        "--follow",
    ])
    .await;
    assert_eq!(tree["message_id"], message_id.as_str());
    let received = tree["received"].as_array().unwrap();
    assert_eq!(received.len(), 1, "applied once: {tree:#}");
    assert_eq!(received[0]["consumer"], upstream_name.as_str());
    let mut seen = outcomes(&tree["journal"], &upstream_name);
    seen.sort();
    assert_eq!(seen, ["duplicate", "retried"], "{tree:#}");
    let caused = tree["caused"].as_array().unwrap();
    assert_eq!(caused.len(), 1, "one event: {tree:#}");
    let event = &caused[0];
    assert_eq!(event["event_type"], "test.out");
    assert!(event["published_at"].is_string(), "published: {event:#}");
    assert!(event["traceparent"].is_null(), "no context came in");
    // Followed into the downstream database.
    let trail = &event["trail"];
    assert_eq!(trail["message_id"], event["message_id"]);
    let applied = trail["received"].as_array().unwrap();
    assert_eq!(applied.len(), 1, "{trail:#}");
    assert_eq!(applied[0]["consumer"], downstream_name.as_str());
    assert!(
        trail["published_by"]["row_id"].is_i64(),
        "the event's own row is found upstream: {trail:#}"
    );

    // The same as a tree.
    let out = warren(&[
        "trace",
        &message_id,
        "--database-url",
        &upstream_db.url,
        "--database-url",
        &downstream_db.url,
        "--follow",
    ])
    .await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for expected in [
        format!("message {message_id}"),
        format!("consumer {upstream_name}"),
        format!("consumer {downstream_name}"),
        "retried: attempt 1 of a flaky job".to_owned(),
        " duplicate".to_owned(),
        " applied (received ".to_owned(),
        "caused event ".to_owned(),
        ": published ".to_owned(),
    ] {
        assert!(stdout.contains(&expected), "{expected:?} not in:\n{stdout}");
    }

    // A message nobody has seen says so, and is no error.
    let out = warren(&["trace", "no-such-id", "--database-url", &upstream_db.url]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("never received by a consumer"), "{stdout}");

    broker.cleanup().await;
    upstream_db.drop_db().await;
    downstream_db.drop_db().await;
}

/// A CloudEvent is journaled under its `~ce:` key; `warren trace ID
/// --source SOURCE` finds it by the pair its producer knows, and the
/// journal's rows name the pair verbatim.
async fn trace_finds_a_cloudevent_by_its_source_and_id<B: Backend>() {
    use warren::format::{CloudEvents, Formats, VersionFrom};
    use warren::{Outgoing, OutgoingFormat};

    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_formats(
            Formats::new()
                .then(CloudEvents::new().version_from(VersionFrom::Header("schemaversion".into()))),
        )
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let source = format!("urn:shop:{}", broker.name);
    let event = Outgoing::new(crate::util::EVENT, 1, &Job::with(Mode::Transient { n: 1 }))
        .unwrap()
        .with_format(OutgoingFormat::cloud_events_binary(&source));
    let id = event.meta().message_id.clone();
    broker.publish(&event).await;
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(1, Duration::from_secs(60)).await);
    broker.publish(&event).await;
    assert!(running.settled(2, Duration::from_secs(60)).await);
    running.stop().await.unwrap();

    let tree = trace_json(&["trace", &id, "--source", &source, "--database-url", &db.url]).await;
    assert!(
        tree["message_id"].as_str().unwrap().starts_with("~ce:"),
        "{tree:#}"
    );
    assert_eq!(tree["received"].as_array().unwrap().len(), 1, "{tree:#}");
    let mut seen = outcomes(&tree["journal"], config.name());
    seen.sort();
    assert_eq!(seen, ["duplicate", "retried"], "{tree:#}");
    let who = format!("CloudEvent {id:?} from {source:?}");
    for row in tree["journal"].as_array().unwrap() {
        assert!(row["detail"].as_str().unwrap().starts_with(&who), "{row:#}");
    }
    // Without --source the id alone is another message: never received.
    let out = warren(&["trace", &id, "--database-url", &db.url]).await;
    let (stdout, _) = text(&out);
    assert!(stdout.contains("never received by a consumer"), "{stdout}");
    // The key as warren lists it finds the event too.
    let key = tree["message_id"].as_str().unwrap();
    let by_key = trace_json(&["trace", key, "--database-url", &db.url]).await;
    assert_eq!(by_key["message_id"], key, "{by_key:#}");
    assert_eq!(
        by_key["received"].as_array().unwrap().len(),
        1,
        "{by_key:#}"
    );

    broker.cleanup().await;
    db.drop_db().await;
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Paid {
    invoice_id: String,
}

async fn paid<B: Backend>(
    msg: warren::Message<Paid>,
    tx: &mut warren::Tx<B>,
) -> Result<(), warren::HandlerError> {
    assert!(!msg.payload.invoice_id.is_empty());
    B::insert_effect(tx, &msg.meta.message_id).await?;
    Ok(())
}

/// A bare payload sent twice without an id is keyed by what its route
/// derives (`{invoiceId}:paid`); `warren trace KEY --derived-key` finds it by
/// that key, and the journal's rows name it.
async fn trace_finds_a_message_without_an_id_by_its_derived_key<B: Backend>() {
    use warren::format::{Bare, Formats, VersionFrom};
    use warren::lapin::BasicProperties;

    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_formats(Formats::new().then(Bare::new().version_from(VersionFrom::Fixed(1))))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let invoice = format!("inv_{}", broker.name);
    let body = serde_json::to_vec(&serde_json::json!({ "invoiceId": invoice })).unwrap();
    let properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_type("test.paid".into());
    for _ in 0..2 {
        broker.publish_raw(&body, properties.clone()).await;
    }
    let registry = routes::<B>().route_keyed(
        "test.paid",
        1,
        |p: &Paid| format!("{}:paid", p.invoice_id),
        paid::<B>,
    );
    let running = Running::start(Consumer::new(config.clone(), db.store.clone(), registry));
    assert!(running.settled(2, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    let key = format!("{invoice}:paid");
    assert_eq!(db.effects_for(&format!("~key:{key}")).await, 1);

    let tree = trace_json(&["trace", &key, "--derived-key", "--database-url", &db.url]).await;
    assert_eq!(tree["message_id"], format!("~key:{key}"), "{tree:#}");
    assert_eq!(tree["received"].as_array().unwrap().len(), 1, "{tree:#}");
    assert_eq!(
        outcomes(&tree["journal"], config.name()),
        ["duplicate"],
        "{tree:#}"
    );
    let who = format!("derived key {key:?}");
    for row in tree["journal"].as_array().unwrap() {
        assert!(row["detail"].as_str().unwrap().starts_with(&who), "{row:#}");
    }
    // The key alone, without --derived-key, names no message received.
    let out = warren(&["trace", &key, "--database-url", &db.url]).await;
    let (stdout, _) = text(&out);
    assert!(stdout.contains("never received by a consumer"), "{stdout}");

    broker.cleanup().await;
    db.drop_db().await;
}

/// A producer's id that starts with `~` is kept as `~~` and the id (no
/// producer's id can meet a key warren derives); `warren trace` finds the
/// message by the producer's id and by the key warren keeps.
async fn trace_finds_a_producers_id_that_starts_with_a_tilde<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let producer_id = format!("~{}", broker.name);
    let message = TestBroker::message(&Job::ok()).with_message_id(&producer_id);
    broker.publish(&message).await;
    broker.publish(&message).await;
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(2, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    let kept = format!("~{producer_id}");
    assert_eq!(db.effects_for(&kept).await, 1);

    for asked in [&producer_id, &kept] {
        let tree = trace_json(&["trace", asked, "--database-url", &db.url]).await;
        assert_eq!(tree["message_id"], kept.as_str(), "{asked}: {tree:#}");
        assert_eq!(tree["received"].as_array().unwrap().len(), 1, "{tree:#}");
        assert_eq!(
            outcomes(&tree["journal"], broker.config().name()),
            ["duplicate"],
            "{tree:#}"
        );
    }
    // Another id that starts with `~`, never sent: said so, under the id asked.
    let never = format!("~never-{}", broker.name);
    let out = warren(&["trace", &never, "--database-url", &db.url]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("never received by a consumer"), "{stdout}");
    assert!(
        stdout.contains(&never) && !stdout.contains(&format!("~{never}")),
        "{stdout}"
    );

    broker.cleanup().await;
    db.drop_db().await;
}
