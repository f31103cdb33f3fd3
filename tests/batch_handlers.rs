//! Batch handlers (`Registry::route_batch`) against the real broker and
//! databases: one call for every new message of a transaction, each message
//! still claimed on its own, failures kept with their message, and every other
//! message applied exactly once, counted in the database.

use std::collections::HashSet;
use std::time::Duration;

use warren::testing::{Settled, TestConsumer};
use warren::version::{Verdict, VersionMode};
use warren::{Batch, BatchResult, Consumer, Outgoing, Registry, Tx};
use warren_admin::DeadLetterReason;

use crate::util::{
    Backend, Job, Mode, Running, TestBroker, batch_calls_of, batch_routes, test_config, unique,
};

on_all_backends!(
    a_batch_handler_sees_each_new_message_once,
    failures_in_a_batch_handler_stay_with_their_message,
    version_gates_in_a_batch_behave_as_one_message_after_the_other,
    a_batch_handlers_events_are_caused_by_their_own_messages,
    a_batch_committed_then_lost_comes_back_as_duplicates,
);

/// 150 messages and 15 copies of them, in the queue before the consumer
/// starts: the handler is called with several at a time and never with a
/// duplicate, each message applies once, and each copy is counted.
async fn a_batch_handler_sees_each_new_message_once<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let mut ids = Vec::new();
    let mut published: Vec<Outgoing> = Vec::new();
    let mut copies = 0;
    for i in 0..150 {
        let msg = TestBroker::message(&Job::ok());
        ids.push(msg.meta().message_id.clone());
        broker.publish(&msg).await;
        if i % 10 == 4 {
            broker.publish(&published[published.len() - 3]).await;
            copies += 1;
        }
        published.push(msg);
    }
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        batch_routes::<B>(),
    ));
    assert!(
        running.settled(150 + copies, Duration::from_secs(60)).await,
        "not settled: {:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    running.stop().await.unwrap();

    for id in &ids {
        assert_eq!(db.effects_for(id).await, 1, "{id} applied once: {s:?}");
    }
    assert_eq!(db.effects().await, 150);
    assert_eq!(s.applied, 150, "{s:?}");
    assert_eq!(s.duplicates, copies, "{s:?}");
    let ours: HashSet<String> = ids.iter().cloned().collect();
    let calls = batch_calls_of(&ours);
    let seen: usize = calls.iter().sum();
    assert_eq!(seen, 150, "each new message handed over once: {calls:?}");
    assert!(
        calls.len() < 150 && calls.iter().any(|&n| n > 1),
        "several messages to a call: {calls:?}"
    );
    broker.cleanup().await;
    db.drop_db().await;
}

/// 120 messages whose jobs fail in every way a batch handler can: named
/// transient and permanent failures, a panic of the whole call, and a job
/// that fails every batch it is in. The handler wrote every message's effect
/// in one statement before it failed, so a failure that did not roll back
/// would show as an extra row.
async fn failures_in_a_batch_handler_stay_with_their_message<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    let mut healthy = Vec::new();
    let mut failing = Vec::new();
    let mut panicking = Vec::new();
    for i in 0..120 {
        let job = match i % 20 {
            5 => Job::with(Mode::Transient { n: 1 }),
            9 => Job::with(Mode::PanicOnce),
            13 => Job::with(Mode::Permanent),
            17 => Job::with(Mode::FailBatch),
            _ => Job::ok(),
        };
        let msg = TestBroker::message(&job);
        let id = msg.meta().message_id.clone();
        match job.mode {
            Mode::Permanent | Mode::FailBatch => failing.push((id, job.mode)),
            Mode::PanicOnce => {
                panicking.push(id.clone());
                healthy.push(id);
            }
            _ => healthy.push(id),
        }
        broker.publish(&msg).await;
    }
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        batch_routes::<B>(),
    ));
    assert!(
        running.settled(120, Duration::from_secs(90)).await,
        "not settled: {:?}",
        running.stats.snapshot()
    );
    let s = running.stats.snapshot();
    running.stop().await.unwrap();

    for id in &healthy {
        assert_eq!(db.effects_for(id).await, 1, "{id} applied once: {s:?}");
    }
    for (id, _) in &failing {
        assert_eq!(db.effects_for(id).await, 0, "{id} rolled back: {s:?}");
    }
    assert_eq!(db.effects().await, healthy.len() as i64);
    assert_eq!(s.applied, healthy.len() as u64, "{s:?}");
    assert_eq!(s.dead_lettered, failing.len() as u64, "{s:?}");
    // Two panicking jobs in one batch share its one panic.
    assert!(
        (1..=6).contains(&s.panics),
        "each panicking job's batch panicked once: {s:?}"
    );
    for id in &panicking {
        assert!(
            crate::util::attempt_times(id).len() >= 2,
            "{id} ran again after its batch panicked"
        );
    }
    let letters = broker.dead_letters().await;
    assert_eq!(letters.len(), failing.len());
    for (id, mode) in &failing {
        let reason = letters
            .get(id)
            .and_then(|p| warren::amqp::header_str(p.headers().as_ref()?, "x-warren-reason"))
            .unwrap_or_else(|| panic!("{id} was dead-lettered"));
        let expected = match mode {
            Mode::Permanent => "permanent-failure",
            _ => "retries-exhausted",
        };
        assert_eq!(reason, expected, "{id} ({mode:?})");
    }
    broker.cleanup().await;
    db.drop_db().await;
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Versioned {
    customer: String,
    version: i64,
}

/// Gated per message: each version checked in the order of the batch, as if
/// the messages came one after the other.
async fn record_versions<B: Backend>(batch: Batch<Versioned>, tx: &mut Tx<B>) -> BatchResult {
    for msg in &batch {
        let p = &msg.payload;
        let verdict = tx
            .check_version_of(msg, "test", &p.customer, p.version, VersionMode::LatestWins)
            .await?;
        if let Verdict::Apply { .. } = verdict {
            B::record_version(tx, &p.customer, p.version, &msg.meta.message_id).await?;
        }
    }
    Ok(())
}

fn versioned(customer: &str, version: i64) -> Outgoing {
    let payload = Versioned {
        customer: customer.into(),
        version,
    };
    Outgoing::new("test.versioned.v1", 1, &payload).unwrap()
}

/// Two versions of one entity in one batch: version 2 then 1 leaves 1 stale;
/// 1 then 2 applies both, in that order.
async fn version_gates_in_a_batch_behave_as_one_message_after_the_other<B: Backend>() {
    let db = B::create().await;
    B::exec(&db.store, crate::util::APPLIED_TABLE.into()).await;
    let kit = TestConsumer::new(
        test_config(&unique("gates"), &unique("gates"), "gates.events")
            .build()
            .unwrap(),
        db.store.clone(),
        Registry::new().route_batch("test.versioned.v1", 1, record_versions::<B>),
    )
    .await
    .unwrap();
    let newer_first = kit
        .deliver_batch(&[versioned("a", 2), versioned("a", 1), versioned("c", 1)])
        .await;
    assert_eq!(
        newer_first,
        [Settled::Applied, Settled::Stale, Settled::Applied]
    );
    let older_first = kit
        .deliver_batch(&[versioned("b", 1), versioned("b", 2)])
        .await;
    assert_eq!(older_first, [Settled::Applied, Settled::Applied]);
    let rows = B::applied_rows(&db.store).await;
    let of = |c: &str| -> Vec<(i64, i64)> {
        rows.iter()
            .filter(|(customer, _, _)| customer == c)
            .map(|(_, v, seq)| (*v, *seq))
            .collect()
    };
    assert_eq!(of("a"), [(2, 1)], "the stale version never applied");
    assert_eq!(of("b"), [(1, 1), (2, 2)], "both, in order");
    let stats = kit.stats();
    assert_eq!((stats.applied, stats.stale), (4, 1), "{stats:?}");
    drop(kit);
    db.drop_db().await;
}

/// `publish_all` writes one event per message in one statement, each caused
/// by its own message; a message that fails takes its events with it.
async fn a_batch_handlers_events_are_caused_by_their_own_messages<B: Backend>() {
    let db = B::create().await;
    let kit = TestConsumer::new(
        test_config(&unique("events"), &unique("events"), "events.in")
            .build()
            .unwrap(),
        db.store.clone(),
        batch_routes::<B>(),
    )
    .await
    .unwrap();
    let jobs = [
        Job::ok().emitting(2, "events.out"),
        Job::with(Mode::Permanent).emitting(1, "events.out"),
        Job::ok().emitting(1, "events.out"),
    ];
    let messages: Vec<Outgoing> = jobs.iter().map(TestBroker::message).collect();
    let settled = kit.deliver_batch(&messages).await;
    assert_eq!(settled[0], Settled::Applied);
    assert!(matches!(
        settled[1],
        Settled::DeadLettered {
            reason: DeadLetterReason::Permanent,
            ..
        }
    ));
    assert_eq!(settled[2], Settled::Applied);
    let outbox = kit.outbox().await.unwrap();
    let caused_by = |m: &Outgoing| {
        outbox
            .iter()
            .filter(|e| e.meta.causation_id.as_deref() == Some(m.meta().message_id.as_str()))
            .count()
    };
    assert_eq!(
        (
            caused_by(&messages[0]),
            caused_by(&messages[1]),
            caused_by(&messages[2])
        ),
        (2, 0, 1),
        "{outbox:?}"
    );
    assert!(outbox.iter().all(
        |e| e.meta.correlation_id == messages[0].meta().correlation_id
            || e.meta.correlation_id == messages[2].meta().correlation_id
    ));
    drop(kit);
    db.drop_db().await;
}

/// A batch commits and its acks are lost with the process: every message
/// comes back redelivered and is recognized, with no solo run (its claim
/// committed, so it cannot be what killed the process).
async fn a_batch_committed_then_lost_comes_back_as_duplicates<B: Backend>() {
    let db = B::create().await;
    let kit = TestConsumer::new(
        test_config(&unique("lost"), &unique("lost"), "lost.events")
            .build()
            .unwrap(),
        db.store.clone(),
        batch_routes::<B>(),
    )
    .await
    .unwrap();
    let messages: Vec<Outgoing> = (0..5).map(|_| TestBroker::message(&Job::ok())).collect();
    let settled = kit.crash_after_batch_commit(&messages).await;
    assert_eq!(settled, vec![Settled::Duplicate; 5]);
    assert_eq!(db.effects().await, 5);
    assert_eq!(kit.stats().solo_runs, 0, "{:?}", kit.stats());
    drop(kit);
    db.drop_db().await;
}
