//! The test kit (`warren::testing`) on both databases, with the suite's own
//! handler: what a user's test sees on PostgreSQL is what it sees on SQLite.

use warren::admin::DeadLetterReason;
use warren::testing::{Settled, TestConsumer};

use crate::util::{Backend, Job, Mode, TestBroker, routes, test_config, unique};

on_all_backends!(the_kit_settles_every_way_on_a_real_database);

async fn the_kit_settles_every_way_on_a_real_database<B: Backend>() {
    let db = B::create().await;
    let queue = unique("kit");
    let kit = TestConsumer::new(
        test_config(&unique("kit"), &queue, "kit.events")
            .build()
            .unwrap(),
        db.store.clone(),
        routes::<B>(),
    )
    .await
    .unwrap();

    let applied = TestBroker::message(&Job::ok().emitting(2, "kit.out"));
    assert_eq!(kit.deliver(&applied).await, Settled::Applied);
    assert_eq!(kit.redeliver(&applied).await, Settled::Duplicate);
    let crashed = TestBroker::message(&Job::ok());
    assert_eq!(kit.crash_after_commit(&crashed).await, Settled::Duplicate);

    let flaky = TestBroker::message(&Job::with(Mode::Transient { n: 1 }));
    assert!(matches!(
        kit.deliver(&flaky).await,
        Settled::Retried { attempt: 1, .. }
    ));
    assert_eq!(kit.next_attempt().await, Settled::Applied);

    let refused = TestBroker::message(&Job::with(Mode::Permanent));
    assert!(matches!(
        kit.deliver(&refused).await,
        Settled::DeadLettered {
            reason: DeadLetterReason::Permanent,
            attempts: 1,
            ..
        }
    ));

    assert_eq!(
        db.effects().await,
        3,
        "applied, crashed and flaky, once each"
    );
    let outbox = kit.outbox().await.unwrap();
    assert_eq!(outbox.len(), 2);
    assert!(outbox.iter().all(|m| m.exchange == "kit.out"));
    assert_eq!(kit.dead_letters().len(), 1);
    drop(kit);
    db.drop_db().await;
}
