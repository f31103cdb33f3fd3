//! Bad input: every kind ends in the dead-letter queue with its reason, applies
//! nothing, and does not stop the consumer.

use std::collections::BTreeMap;
use std::time::Duration;

use warren::amqp::header_str;
use warren::lapin::BasicProperties;
use warren::lapin::types::{AMQPValue, FieldTable};
use warren::{Consumer, Outgoing};
use warren_admin::DeadLetterInfo;
use warren_admin::DeadLetterReason;

use crate::util::{Backend, EVENT, Job, JobV2, Mode, Running, TestBroker, routes};

on_all_backends!(
    poison_is_dead_lettered_with_its_reason,
    dead_letter_queue_unreachable_loses_nothing
);

const LIMIT: usize = 4096;

fn tagged(props: BasicProperties, case: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("test-case".into(), AMQPValue::LongString(case.into()));
    props.with_headers(headers)
}

/// One poison message per case: its body, its properties, and the reason expected.
fn poison_cases() -> Vec<(&'static str, Vec<u8>, BasicProperties, DeadLetterReason)> {
    let valid = TestBroker::message(&Job::ok());
    let body = valid.body();
    let props = valid.properties();
    let id = valid.meta().message_id.clone();
    let json = || BasicProperties::default().with_content_type("application/json".into());
    let with_id = |id: &str| json().with_message_id(id.into());
    let other_type = Outgoing::new("test.unheard-of", 1, &Job::ok()).unwrap();
    let other_version = Outgoing::new(EVENT, 7, &Job::ok()).unwrap();
    let bad_payload = Outgoing::new(EVENT, 1, &serde_json::json!({"mode": 42})).unwrap();
    let oversize = Outgoing::new(
        EVENT,
        1,
        &JobV2 {
            job: Job::ok(),
            note: "x".repeat(LIMIT),
        },
    )
    .unwrap()
    .with_message_id(uuid::Uuid::now_v7().to_string());
    let permanent = TestBroker::message(&Job::with(Mode::Permanent));
    vec![
        (
            "invalid-json",
            b"{\"messageId\": ".to_vec(),
            with_id("poison-json"),
            DeadLetterReason::InvalidJson,
        ),
        (
            "missing-message-id",
            body.clone(),
            json(),
            DeadLetterReason::MissingMessageId,
        ),
        (
            "id-mismatch",
            body.clone(),
            props.clone().with_message_id(format!("{id}-other").into()),
            DeadLetterReason::MessageIdMismatch,
        ),
        (
            "wrong-content-type",
            body,
            props.with_content_type("text/plain".into()),
            DeadLetterReason::InvalidContentType,
        ),
        (
            "missing-field",
            br#"{"messageId":"poison-field","payload":{}}"#.to_vec(),
            with_id("poison-field"),
            DeadLetterReason::InvalidEnvelope,
        ),
        (
            "unknown-type",
            other_type.body(),
            other_type.properties(),
            DeadLetterReason::UnknownEventType,
        ),
        (
            "unknown-version",
            other_version.body(),
            other_version.properties(),
            DeadLetterReason::UnknownSchemaVersion,
        ),
        (
            "bad-payload",
            bad_payload.body(),
            bad_payload.properties(),
            DeadLetterReason::InvalidPayload,
        ),
        (
            "oversize",
            oversize.body(),
            oversize.properties(),
            DeadLetterReason::BodyTooLarge,
        ),
        (
            "permanent",
            permanent.body(),
            permanent.properties(),
            DeadLetterReason::Permanent,
        ),
    ]
}

async fn poison_is_dead_lettered_with_its_reason<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker.builder().with_max_body_bytes(LIMIT).build().unwrap();
    broker.declare_config(&config).await;

    let cases = poison_cases();
    for (case, body, props, _) in &cases {
        broker.publish_raw(body, tagged(props.clone(), case)).await;
    }
    // Valid messages of both versions, after the poison: the consumer must still be
    // running to apply them.
    let v1 = TestBroker::message(&Job::ok());
    let v2 = Outgoing::new(
        EVENT,
        2,
        &JobV2 {
            job: Job::ok(),
            note: "v2".into(),
        },
    )
    .unwrap();
    broker.publish(&v1).await;
    broker.publish(&v2).await;

    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let total = cases.len() as u64 + 2;
    assert!(
        running.settled(total, Duration::from_secs(60)).await,
        "{:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    assert_eq!(stats.dead_lettered, cases.len() as u64, "{stats:?}");
    assert_eq!(stats.applied, 2, "{stats:?}");
    assert_eq!(stats.retried, 0, "poison is never retried: {stats:?}");

    let dead = broker.drain(&broker.dead_letter_queue()).await;
    let mut found = BTreeMap::new();
    for d in &dead {
        let headers = d.properties.headers().as_ref().expect("headers");
        let case = header_str(headers, "test-case").expect("original headers are kept");
        let info = DeadLetterInfo::from_properties(&d.properties).expect("dead-letter record");
        assert_eq!(info.consumer, config.name());
        assert_eq!(info.queue, config.queue());
        assert_eq!(info.original_exchange, broker.exchange);
        assert_eq!(info.original_routing_key, "test.job");
        assert_eq!(info.attempts, 1);
        assert!(!info.error.is_empty());
        assert!(info.last_failure.is_some() && info.first_failure.is_some());
        found.insert(case.into_owned(), (info.reason, d.data.clone()));
    }
    assert_eq!(
        found.len(),
        cases.len(),
        "each case dead-lettered once: {found:?}"
    );
    for (case, body, _, reason) in &cases {
        let (got, data) = &found[*case];
        assert_eq!(got, reason.as_str(), "reason for {case}");
        assert_eq!(data, body, "the body of {case} is kept as it came");
    }

    assert_eq!(
        db.effects().await,
        2,
        "only the valid messages have an effect"
    );
    assert_eq!(db.effects_for(&v1.meta().message_id).await, 1);
    assert_eq!(db.effects_for(&v2.meta().message_id).await, 1);
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

/// With the dead-letter queue gone, a poison message is neither acked nor lost:
/// it goes back to its queue after a backoff, and reaches the dead-letter queue
/// once that exists again.
async fn dead_letter_queue_unreachable_loses_nothing<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker.config();
    broker.declare_config(&config).await;

    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        crate::util::wait_for(Duration::from_secs(20), || async {
            broker.consumers(&broker.queue).await == 1
        })
        .await
    );
    broker.delete_queue(&broker.dead_letter_queue()).await;
    let poison = TestBroker::message(&Job::with(Mode::Permanent));
    broker.publish(&poison).await;

    let stats = running.stats.clone();
    assert!(
        crate::util::wait_for(Duration::from_secs(20), || {
            let s = stats.snapshot();
            async move { s.returned >= 2 }
        })
        .await,
        "the message should come back and fail again: {:?}",
        stats.snapshot()
    );
    let s = stats.snapshot();
    assert_eq!(s.dead_lettered, 0, "{s:?}");

    // Restore the dead-letter queue; the next attempt gets through.
    broker.declare_config(&config).await;
    assert!(
        running.settled(1, Duration::from_secs(20)).await,
        "{:?}",
        stats.snapshot()
    );
    let s = stats.snapshot();
    running.stop().await.unwrap();
    // A backoff of 200 ms between attempts bounds how often it could have failed
    // in the time it took; a hot loop would have failed thousands of times.
    assert!(s.returned < 200, "{s:?}");

    let dead = broker.drain(&broker.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].properties.message_id().as_ref().unwrap().as_str(),
        poison.meta().message_id
    );
    // Returned through the default exchange, it still names its original route.
    let info = DeadLetterInfo::from_properties(&dead[0].properties).unwrap();
    assert_eq!(info.original_exchange, broker.exchange);
    assert_eq!(info.original_routing_key, "test.job");
    assert_eq!(db.effects().await, 0);
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}
