//! W3C trace context through the inbox and the outbox: a handler's events
//! continue the trace of the message it handled, through a retry tier and a
//! relay pass; what a producer sends is checked before it reaches a row; a
//! row written before the trace columns existed still publishes.

use std::time::Duration;

use warren::lapin::BasicProperties;
use warren::lapin::message::Delivery;
use warren::lapin::types::{AMQPValue, FieldTable};
use warren::store::OutboxStore;
use warren::{Consumer, Outgoing, Relay, RelayConfig};

use crate::util::{Backend, Job, Mode, TestBroker, amqp_url, routes, wait_for};

on_all_backends!(
    a_handler_event_continues_the_trace_of_the_message_it_handled,
    hostile_trace_headers_never_reach_an_outbox_row,
    a_row_without_a_stored_context_still_publishes,
);

/// Not sampled on purpose: the context travels all the same.
const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

fn text(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name) {
        Some(AMQPValue::LongString(s)) => Some(s.to_string()),
        None => None,
        Some(other) => panic!("{name} is not a long string: {other:?}"),
    }
}

fn relay_config(broker: &TestBroker) -> RelayConfig {
    RelayConfig::new(format!("{}-relay", broker.name))
        .with_poll_interval(Duration::from_millis(200))
}

/// Runs a consumer with its relay until `events` events reached `capture`,
/// and returns them.
async fn run_until_events<B: Backend>(
    db: &crate::util::TestDb<B>,
    broker: &TestBroker,
    capture: &str,
    events: u32,
) -> Vec<Delivery> {
    let consumer = Consumer::new(broker.config(), db.store.clone(), routes::<B>());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_config = relay_config(broker);
    let task = tokio::spawn(async move {
        consumer
            .run_with_relay(&amqp_url(), relay_config, async {
                let _ = stopped.await;
            })
            .await
    });
    assert!(
        wait_for(Duration::from_secs(40), || async {
            broker.ready(capture).await >= events
        })
        .await,
        "the handler's events were not published"
    );
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    broker.drain(capture).await
}

/// The message fails once, goes through a retry tier and is applied; its
/// event leaves the relay with the message's trace id, tracestate and
/// baggage (the parent passes through unchanged where no OpenTelemetry layer
/// is installed), unsampled as it came, with the relay's publish time in
/// milliseconds.
async fn a_handler_event_continues_the_trace_of_the_message_it_handled<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let job = Job::with(Mode::Transient { n: 1 }).emitting(1, &broker.exchange);
    let message = TestBroker::message(&job)
        .with_header("traceparent", PARENT)
        .with_header("tracestate", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        .with_header("baggage", "tenant=acme,region=eu-west-1");
    broker.publish(&message).await;
    let before = chrono::Utc::now().timestamp_millis();
    let got = run_until_events(&db, &broker, &capture, 1).await;
    let after = chrono::Utc::now().timestamp_millis();
    assert_eq!(got.len(), 1, "one event, from the attempt that committed");
    let headers = got[0].properties.headers().clone().unwrap_or_default();
    assert_eq!(text(&headers, "traceparent").as_deref(), Some(PARENT));
    assert_eq!(
        text(&headers, "tracestate").as_deref(),
        Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    );
    assert_eq!(
        text(&headers, "baggage").as_deref(),
        Some("tenant=acme,region=eu-west-1")
    );
    match headers.inner().get("published-at-ms") {
        Some(AMQPValue::LongLongInt(ms)) => assert!(
            (before..=after).contains(ms),
            "published at {ms}, not within the run ({before}..{after})"
        ),
        other => panic!("no publish time in milliseconds: {other:?}"),
    }
    let body: serde_json::Value = serde_json::from_slice(&got[0].data).unwrap();
    assert_eq!(body["causationId"], message.meta().message_id.as_str());
    assert!(
        !String::from_utf8_lossy(&got[0].data).contains("traceparent"),
        "the context travels in headers, not in the payload"
    );
    broker.cleanup().await;
    db.drop_db().await;
}

/// A producer's malformed traceparent, a tracestate of 33 members, baggage
/// over 8,192 bytes and a traceparent of the wrong AMQP type are all
/// dropped: the messages are still applied, and their events carry none of
/// it.
async fn hostile_trace_headers_never_reach_an_outbox_row<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let over: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
    let cases: Vec<Vec<(&str, AMQPValue)>> = vec![
        vec![
            (
                "traceparent",
                AMQPValue::LongString("00-xyz-b7ad6b7169203331-01".into()),
            ),
            ("tracestate", AMQPValue::LongString("a=b".into())),
        ],
        vec![
            ("traceparent", AMQPValue::LongString(PARENT.into())),
            (
                "tracestate",
                AMQPValue::LongString(over.join(",").as_str().into()),
            ),
            (
                "baggage",
                AMQPValue::LongString(format!("k={}", "v".repeat(9000)).as_str().into()),
            ),
        ],
        vec![("traceparent", AMQPValue::LongLongInt(7))],
    ];
    let mut ids = Vec::new();
    for headers in cases {
        let job = Job::with(Mode::Ok).emitting(1, &broker.exchange);
        let message = TestBroker::message(&job);
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(name.into(), value);
        }
        let properties: BasicProperties = message.properties().with_headers(table);
        broker.publish_raw(&message.body(), properties).await;
        ids.push(message.meta().message_id.clone());
    }
    let got = run_until_events(&db, &broker, &capture, 3).await;
    assert_eq!(got.len(), 3, "every message was applied");
    for event in &got {
        let headers = event.properties.headers().clone().unwrap_or_default();
        let body: serde_json::Value = serde_json::from_slice(&event.data).unwrap();
        let cause = body["causationId"].as_str().unwrap().to_owned();
        assert!(ids.contains(&cause));
        let second = cause == ids[1];
        // The second message's traceparent is valid and travels on; its
        // oversized tracestate and baggage do not.
        assert_eq!(
            text(&headers, "traceparent").as_deref(),
            second.then_some(PARENT),
            "{cause}"
        );
        assert_eq!(text(&headers, "tracestate"), None, "{cause}");
        assert_eq!(text(&headers, "baggage"), None, "{cause}");
    }
    broker.cleanup().await;
    db.drop_db().await;
}

/// A row written before the trace columns existed has them empty: it is
/// published as before, with no trace headers.
async fn a_row_without_a_stored_context_still_publishes<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let capture = broker.capture().await;
    let event = Outgoing::new("test.out.v1", 1, &serde_json::json!({"n": 1}))
        .unwrap()
        .with_header("traceparent", PARENT);
    let mut tx = B::pool(&db.store).begin().await.unwrap();
    warren::outbox::enqueue::<B>(&mut tx, &broker.exchange, "out.event", &event)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // What the migration leaves in a row that existed before it.
    B::exec(
        &db.store,
        "UPDATE warren_outbox SET causation_id = NULL, traceparent = NULL, \
         tracestate = NULL, baggage = NULL"
            .into(),
    )
    .await;
    let relay = Relay::new(db.store.clone(), relay_config(&broker));
    let publisher = warren::broker::Publisher::new(std::sync::Arc::clone(&broker.connection));
    assert_eq!(relay.run_once(&publisher).await.unwrap(), (1, false));
    let got = broker.drain(&capture).await;
    assert_eq!(got.len(), 1);
    let headers = got[0].properties.headers().clone().unwrap_or_default();
    assert_eq!(text(&headers, "traceparent"), None);
    assert_eq!(db.store.outbox_status().await.unwrap().published, 1);
    broker.cleanup().await;
    db.drop_db().await;
}
