//! Retry tiers: transient failures wait in TTL queues and come back; attempts are
//! bounded; what cannot be retried is not lost.

use std::time::Duration;

use warren::Consumer;
use warren::retry::RetryPolicy;
use warren_admin::DeadLetterInfo;

use crate::util::{
    Backend, Job, Mode, Running, TEST_TIERS, TestBroker, attempt_times, consume_until,
    reported_attempts, routes, wait_for,
};

on_all_backends!(
    transient_below_the_limit_is_retried_through_the_tiers,
    transient_above_the_limit_is_dead_lettered_with_its_history,
    retry_after_picks_the_shortest_tier_long_enough,
    unreachable_retry_queue_loses_nothing_and_does_not_spin,
    topology_drift_names_the_queue_and_argument,
);

/// Asserts that attempt `i + 1` began at least `tiers[i]` after attempt `i`.
fn assert_gaps_at_least(id: &str, tiers: &[Duration]) {
    let times = attempt_times(id);
    assert!(times.len() > tiers.len(), "{} attempts", times.len());
    for (i, tier) in tiers.iter().enumerate() {
        let gap = times[i + 1] - times[i];
        assert!(
            gap >= *tier,
            "attempt {} came {gap:?} after the previous one, before its tier of {tier:?}",
            i + 2
        );
    }
}

async fn transient_below_the_limit_is_retried_through_the_tiers<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let flaky = TestBroker::message(&Job::with(Mode::Transient { n: 2 }));
    broker.publish(&flaky).await;

    let s = consume_until(&db, &broker, 1).await;

    let id = &flaky.meta().message_id;
    assert_eq!(attempt_times(id).len(), 3, "two failures, then success");
    assert_eq!(
        reported_attempts(id),
        [1, 2, 3],
        "the handler is told its attempt"
    );
    assert_eq!((s.retried, s.applied, s.dead_lettered), (2, 1, 0), "{s:?}");
    assert_gaps_at_least(id, &TEST_TIERS[..2]);
    assert_eq!(db.effects_for(id).await, 1);
    for q in broker.config().retry().tiers() {
        assert_eq!(broker.ready(&broker.config().retry_queue(*q)).await, 0);
    }

    broker.cleanup().await;
    db.drop_db().await;
}

async fn transient_above_the_limit_is_dead_lettered_with_its_history<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let doomed = TestBroker::message(&Job::with(Mode::Transient { n: 10 }));
    broker.publish(&doomed).await;

    let s = consume_until(&db, &broker, 1).await;

    let id = &doomed.meta().message_id;
    let max = broker.config().retry().max_attempts();
    assert_eq!(max, 4);
    assert_eq!(
        attempt_times(id).len(),
        max as usize,
        "exactly the allowed attempts"
    );
    assert_eq!((s.retried, s.dead_lettered, s.applied), (3, 1, 0), "{s:?}");
    assert_gaps_at_least(id, &TEST_TIERS);

    let dead = broker.drain(&broker.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1);
    let info = DeadLetterInfo::from_properties(&dead[0].properties).unwrap();
    assert_eq!(info.reason, "retries-exhausted");
    assert_eq!(info.attempts, max);
    assert!(info.error.contains("attempt 4"), "{}", info.error);
    assert_eq!(
        info.original_exchange, broker.exchange,
        "the route survives the tiers"
    );
    assert_eq!(info.original_routing_key, "test.job");
    let (first, last) = (info.first_failure.unwrap(), info.last_failure.unwrap());
    assert!(
        last - first >= chrono::Duration::milliseconds(700),
        "first failure {first}, last {last}: the tiers add up to 700 ms"
    );
    assert_eq!(db.effects_for(id).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

async fn retry_after_picks_the_shortest_tier_long_enough<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    // 150 ms is longer than the first tier (100 ms): the 200 ms tier is the one.
    let polite = TestBroker::message(&Job::with(Mode::TransientAfter { ms: 150 }));
    broker.publish(&polite).await;

    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(1, Duration::from_secs(30)).await);
    running.stop().await.unwrap();

    let times = attempt_times(&polite.meta().message_id);
    assert_eq!(times.len(), 2);
    assert!(
        times[1] - times[0] >= Duration::from_millis(200),
        "retried after {:?}, before the 200 ms tier",
        times[1] - times[0]
    );
    assert_eq!(db.effects_for(&polite.meta().message_id).await, 1);

    broker.cleanup().await;
    db.drop_db().await;
}

/// With its retry tier gone, a transiently failing message is neither acked away
/// nor lost: it returns to its queue after a backoff, again and again but not in a
/// hot loop, and moves on once the tier exists again.
async fn unreachable_retry_queue_loses_nothing_and_does_not_spin<B: Backend>() {
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
        wait_for(Duration::from_secs(20), || async {
            broker.consumers(&broker.queue).await == 1
        })
        .await
    );

    let first_tier = config.retry_queue(TEST_TIERS[0]);
    broker.delete_queue(&first_tier).await;
    let flaky = TestBroker::message(&Job::with(Mode::Transient { n: 1_000 }));
    broker.publish(&flaky).await;
    let id = flaky.meta().message_id.clone();

    let stats = running.stats.clone();
    assert!(
        wait_for(Duration::from_secs(20), || {
            let s = stats.snapshot();
            async move { s.returned >= 3 }
        })
        .await,
        "{:?}",
        stats.snapshot()
    );
    let seen = attempt_times(&id);
    let span = *seen.last().unwrap() - seen[0];
    // Each return waits the 200 ms failure backoff first; a hot loop would show
    // hundreds of attempts in this span.
    let bound = (span.as_millis() / 200) as usize + 2;
    assert!(seen.len() <= bound, "{} attempts in {span:?}", seen.len());
    assert_eq!(stats.snapshot().retried, 0);
    assert_eq!(db.effects_for(&id).await, 0);

    // The tier is back: the message goes through the tiers and, failing every
    // time, ends in the dead-letter queue. Nothing was lost on the way.
    broker.declare_config(&config).await;
    assert!(
        running.settled(1, Duration::from_secs(30)).await,
        "{:?}",
        stats.snapshot()
    );
    running.stop().await.unwrap();
    let dead = broker.drain(&broker.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].properties.message_id().as_ref().unwrap().as_str(),
        id
    );
    assert_eq!(broker.ready(&broker.queue).await, 0);

    broker.cleanup().await;
    db.drop_db().await;
}

/// A retry queue that already exists with another TTL stops the consumer with an
/// error naming the queue and the argument, not a bare channel close.
async fn topology_drift_names_the_queue_and_argument<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let other = broker
        .builder()
        .with_retry(RetryPolicy::new([Duration::from_millis(100)]))
        .build()
        .unwrap();
    // Same tier name (100ms) with a different TTL: declare it by hand.
    let mut drifted = warren::topology::Topology::for_consumer(&other);
    drifted.queues.retain(|q| q.name.ends_with(".retry.100ms"));
    drifted.bindings.clear();
    drifted.queues[0]
        .arguments
        .insert("x-message-ttl".into(), warren::topology::ArgValue::Int(999));
    let channel = broker.connection.create_channel().await.unwrap();
    warren::broker::declare(&channel, &drifted).await.unwrap();

    let err = Consumer::new(broker.config(), db.store.clone(), routes::<B>())
        .run(&crate::util::amqp_url(), std::future::pending())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, warren::Error::Broker(b) if b.is_topology_drift()),
        "{err:?}"
    );
    assert!(text.contains(".retry.100ms"), "{text}");
    assert!(text.contains("x-message-ttl"), "{text}");

    broker.cleanup().await;
    db.drop_db().await;
}
