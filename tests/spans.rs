#![allow(unreachable_pub)]
//! warren's spans as OpenTelemetry records them, for messages that a consumer
//! on PostgreSQL applies in batches: each message keeps a trace of its own,
//! its `process` span the child of the producer's span its `traceparent`
//! named, and each batch's `commit` span is linked to every message it
//! applied, and each of them back to it, never their parent.

use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::trace::{SpanId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt;
use warren::Consumer;

use util::*;

// Its own test binary: the subscriber is the test thread's, and tracing
// caches per call site whether anyone listens (see tests/logs.rs).
// The fixtures shared by warren's tests, the CLI's and the benches
// (crates/warren-test-support), as `crate::util::...`.
use warren_test_support as util;

const MESSAGES: usize = 40;

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

// A current-thread runtime: the consumer's tasks run on the thread whose
// default subscriber records them.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_commit_is_linked_to_each_message_and_parents_none() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("warren")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = <sqlx::Postgres as Backend>::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    // Every message from a producer span of its own, in a trace of its own;
    // all in the queue before the consumer starts, so they run in batches.
    let mut producers = HashMap::new();
    for _ in 0..MESSAGES {
        let trace_id = format!("{:032x}", fastrand::u128(1..));
        let span_id = format!("{:016x}", fastrand::u64(1..));
        let message = TestBroker::message(&Job::ok())
            .with_header("traceparent", format!("00-{trace_id}-{span_id}-01"));
        broker.publish(&message).await;
        producers.insert(message.meta().message_id.clone(), (trace_id, span_id));
    }
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<sqlx::Postgres>(),
    ));
    assert!(
        running
            .settled(MESSAGES as u64, Duration::from_secs(60))
            .await
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    assert!(stats.batches > 0, "they ran in batches: {stats:?}");
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();

    let queue = broker.config().queue().to_owned();
    let process: HashMap<SpanId, &SpanData> = spans
        .iter()
        .filter(|s| s.name == format!("process {queue}"))
        .map(|s| (s.span_context.span_id(), s))
        .collect();
    assert_eq!(process.len(), MESSAGES, "one process span per delivery");
    for span in process.values() {
        let id = attribute(span, "messaging.message.id").expect("the message id");
        let (trace_id, parent) = &producers[&id];
        assert_eq!(&format!("{:032x}", span.span_context.trace_id()), trace_id);
        assert_eq!(&format!("{:016x}", span.parent_span_id), parent);
        assert!(span.parent_span_is_remote);
        assert_eq!(
            attribute(span, "messaging.system").as_deref(),
            Some("rabbitmq")
        );
        assert_eq!(
            attribute(span, "messaging.destination.name").as_deref(),
            Some(queue.as_str())
        );
    }

    let by_id: HashMap<SpanId, &SpanData> = spans
        .iter()
        .map(|s| (s.span_context.span_id(), s))
        .collect();
    let batch_commits: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == "commit" && s.links.len() > 1)
        .collect();
    assert!(!batch_commits.is_empty(), "no batch commit among the spans");
    let mut linked = 0;
    for commit in &batch_commits {
        let unit = by_id[&commit.parent_span_id];
        assert_eq!(unit.name, "transaction");
        assert_eq!(
            attribute(unit, "warren.messages"),
            Some(commit.links.len().to_string()),
            "the transaction counts the messages its commit is linked to"
        );
        assert!(
            !process.contains_key(&unit.parent_span_id),
            "a batch's transaction is no message's child"
        );
        for link in commit.links.iter() {
            let member = process
                .get(&link.span_context.span_id())
                .expect("a commit links to process spans");
            assert!(
                member
                    .links
                    .iter()
                    .any(|l| l.span_context.span_id() == commit.span_context.span_id()),
                "each message links back to its commit"
            );
            linked += 1;
        }
    }
    assert!(linked > 1);
    broker.cleanup().await;
    db.drop_db().await;
}
