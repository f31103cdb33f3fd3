//! What operators see and what survives their actions: metrics with the right
//! values, a queue deleted under a running consumer. Inbox retention is the CLI's
//! (`crates/warren-cli/tests`).

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use warren::{Consumer, RelayConfig};

use crate::util::{Backend, Job, Mode, Running, TestBroker, amqp_url, routes, wait_for};

on_all_backends!(
    metrics_show_what_happened,
    deleted_queue_is_declared_again_and_consumption_resumes,
    shutdown_completes_when_the_broker_stops_answering,
    a_handler_nearing_the_consumer_timeout_is_reported,
);

/// A handler that runs past the warning share of the broker's consumer timeout
/// is logged and counted (`consumer_slow_handlers_total`); one that does not, is
/// not.
async fn a_handler_nearing_the_consumer_timeout_is_reported<B: Backend>() {
    let handle = recorder();
    let db = B::create().await;
    let broker = TestBroker::new().await;
    // Warn after half of 600 ms.
    let config = broker
        .builder()
        .with_consumer_timeout(Duration::from_millis(600))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    broker.publish(&TestBroker::message(&Job::slow(500))).await;
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(1, Duration::from_secs(30)).await);
    // A quick one afterwards (on SQLite, one sent alongside would wait for the
    // slow one's write lock, and rightly count as slow too).
    broker.publish(&TestBroker::message(&Job::ok())).await;
    assert!(running.settled(2, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    let c = format!("consumer=\"{}\"", config.name());
    assert_eq!(
        value(&handle.render(), "consumer_slow_handlers_total", &[&c]),
        Some(1.0),
        "{}",
        handle.render()
    );
    broker.cleanup().await;
    db.drop_db().await;
}

pub(crate) fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .install_recorder()
            .expect("one recorder for the test process")
    })
}

/// The value of the series `name` whose labels contain all of `labels`.
pub(crate) fn value(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn metrics_show_what_happened<B: Backend>() {
    let handle = recorder();
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_queue_metrics_interval(Duration::from_millis(200))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    broker.capture().await;
    let mut sent = 0;
    for _ in 0..8 {
        let m = TestBroker::message(&Job::ok().emitting(1, &broker.exchange));
        broker.publish(&m).await;
        sent += 1;
        if sent <= 2 {
            broker.publish(&m).await;
        }
    }
    broker
        .publish(&TestBroker::message(&Job::with(Mode::Transient { n: 1 })))
        .await;
    broker
        .publish(&TestBroker::message(&Job::with(Mode::Permanent)))
        .await;

    let consumer = Consumer::new(config.clone(), db.store.clone(), routes::<B>());
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = RelayConfig::new(config.name()).with_poll_interval(Duration::from_millis(100));
    let task = tokio::spawn(async move {
        consumer
            .run_with_relay(&amqp_url(), relay, async {
                let _ = stopped.await;
            })
            .await
    });
    assert!(
        wait_for(Duration::from_secs(30), || {
            let s = stats.snapshot();
            async move { s.applied == 9 && s.duplicates == 2 && s.dead_lettered == 1 }
        })
        .await,
        "{:?}",
        stats.snapshot()
    );
    let c = format!("consumer=\"{}\"", config.name());
    let q = format!("queue=\"{}\"", config.queue());
    // Queue depth and outbox gauges are refreshed on their own schedules.
    assert!(
        wait_for(Duration::from_secs(10), || async {
            let text = handle.render();
            value(&text, "rabbitmq_queue_messages_ready", &[&c, &q]) == Some(0.0)
                && value(&text, "outbox_pending_messages", &[&c]) == Some(0.0)
        })
        .await,
        "{}",
        handle.render()
    );
    let _ = stop.send(());
    task.await.unwrap().unwrap();

    let text = handle.render();
    let v = |name: &str, extra: &[&str]| {
        let mut labels = vec![c.as_str(), q.as_str()];
        labels.extend_from_slice(extra);
        value(&text, name, &labels)
    };
    assert_eq!(
        v("consumer_messages_processed_total", &["result=\"applied\""]),
        Some(9.0),
        "{text}"
    );
    assert_eq!(
        v(
            "consumer_messages_processed_total",
            &["result=\"duplicate\""]
        ),
        Some(2.0)
    );
    assert_eq!(
        v("consumer_messages_processed_total", &["result=\"retried\""]),
        Some(1.0)
    );
    assert_eq!(
        v(
            "consumer_messages_processed_total",
            &["result=\"dead-lettered\""]
        ),
        Some(1.0)
    );
    assert_eq!(v("consumer_duplicates_total", &[]), Some(2.0));
    assert_eq!(v("consumer_retry_total", &[]), Some(1.0));
    assert_eq!(
        v(
            "consumer_dead_letter_total",
            &["reason=\"permanent-failure\""]
        ),
        Some(1.0)
    );
    assert_eq!(v("consumer_in_flight", &[]), Some(0.0));
    assert_eq!(
        v("consumer_processing_duration_seconds_count", &[]),
        Some(13.0),
        "{text}"
    );
    assert_eq!(v("consumer_message_age_seconds_count", &[]), Some(13.0));
    assert!(v("rabbitmq_queue_consumers", &[]).is_some());
    assert_eq!(v("rabbitmq_connection_blocked", &[]), Some(0.0));
    assert_eq!(
        value(&text, "outbox_published_total", &[&c]),
        Some(8.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "outbox_oldest_unpublished_age_seconds", &[&c]),
        Some(0.0)
    );

    broker.cleanup().await;
    db.drop_db().await;
}

/// The broker cancels the subscription when its queue is deleted
/// (`basic.cancel`, as on a failover or a 4.3 consumer timeout) while the
/// connection stays open. The consumer finishes the message it was running
/// and settles it on the open channel, then declares the topology again,
/// subscribes again, and carries on: never idle on an open connection.
async fn deleted_queue_is_declared_again_and_consumption_resumes<B: Backend>() {
    let handle = recorder();
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let config = broker.config();
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        wait_for(Duration::from_secs(20), || async {
            broker.consumers(&broker.queue).await == 1
        })
        .await
    );
    assert!(running.stats.health().is_ready());

    // A message in the handler when the queue goes.
    let running_when_deleted = TestBroker::message(&Job::slow(1500));
    broker.publish(&running_when_deleted).await;
    assert!(
        wait_for(Duration::from_secs(20), || async {
            warren::broker::inspect_queue(&broker.connection, &broker.queue)
                .await
                .is_ok_and(|i| i.ready == 0)
        })
        .await,
        "the consumer took the message"
    );
    broker.delete_queue(&broker.queue).await;
    // Finished and settled on the channel that was still open.
    assert!(running.settled(1, Duration::from_secs(30)).await);
    // Back: declared again (with its binding) and subscribed.
    assert!(
        wait_for(Duration::from_secs(30), || async {
            warren::broker::inspect_queue(&broker.connection, &broker.queue)
                .await
                .is_ok_and(|i| i.consumers == 1)
        })
        .await,
        "the consumer re-declared its queue and subscribed again"
    );
    let after = TestBroker::message(&Job::ok());
    broker.publish(&after).await;
    assert!(running.settled(2, Duration::from_secs(30)).await);
    assert!(running.stats.health().is_ready());
    running.stop().await.unwrap();
    assert_eq!(
        db.effects_for(&running_when_deleted.meta().message_id)
            .await,
        1
    );
    assert_eq!(db.effects_for(&after.meta().message_id).await, 1);
    let c = format!("consumer=\"{}\"", config.name());
    assert_eq!(
        value(
            &handle.render(),
            "consumer_subscription_cancelled_total",
            &[&c]
        ),
        Some(1.0),
        "{}",
        handle.render()
    );

    broker.cleanup().await;
    db.drop_db().await;
}

/// Regression (found by the chaos campaign): a broker that accepts the TCP
/// connection but never answers the handshake, as one that is starting up, made
/// `connect` wait forever.
#[tokio::test]
async fn connect_gives_up_on_a_broker_that_never_answers() {
    let proxy = crate::util::Proxy::start().await;
    proxy.freeze();
    let attempt = tokio::time::timeout(
        warren::broker::CONNECT_TIMEOUT + Duration::from_secs(20),
        warren::broker::connect(&proxy.url(), "frozen"),
    )
    .await
    .expect("connect returns instead of hanging");
    let err = attempt.expect_err("nothing answered");
    assert!(err.to_string().contains("handshake"), "{err}");
}

/// Regression (found by the chaos campaign): with the broker no longer answering,
/// closing the channel and connections waited forever for the broker's reply, so
/// a graceful stop hung. It now gives up on the close and returns.
async fn shutdown_completes_when_the_broker_stops_answering<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let proxy = crate::util::Proxy::start().await;
    let consumer = Consumer::new(broker.config(), db.store.clone(), routes::<B>());
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let url = proxy.url();
    let task = tokio::spawn(async move {
        consumer
            .run(&url, async {
                let _ = stopped.await;
            })
            .await
    });
    assert!(
        wait_for(Duration::from_secs(20), || {
            let s = stats.clone();
            async move { s.is_consuming() }
        })
        .await
    );
    proxy.freeze();
    let _ = stop.send(());
    let ended = tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .expect("run returns although the broker does not answer the close");
    ended.unwrap().unwrap();

    drop(proxy);
    broker.cleanup().await;
    db.drop_db().await;
}
