//! The dead-letter store: letters moved off the dead-letter queue into the
//! database once each, grouped by cause, found by every filter, and changed
//! only with an audit line.

use std::time::Duration;

use chrono::Utc;
use warren::lapin::BasicProperties;
use warren::store::{
    Actor, DeadLetterStore, Journal, JournalEntry, LetterFilter, LetterState, PageAfter,
};
use warren::{Consumer, ConsumerConfig};
use warren_admin::{
    CopyOutcome, EditError, Ingester, ReplayError, Replayer, edit_letter, set_payload_fields,
    unstored_queue_name,
};

use crate::util::{
    Backend, Ingesting, Job, Mode, Running, TestBroker, routes, set_broken, unique, wait_for,
};

on_all_backends!(
    dead_letters_are_stored_once_grouped_and_found,
    a_letter_replayed_that_fails_again_is_a_second_letter,
    an_interrupted_replay_resumes_and_replays_each_letter_once,
    careful_replay_goes_on_only_on_the_outcome_of_its_own_replay_id,
    an_edit_is_checked_kept_beside_the_original_audited_and_replayed,
    the_consumer_keeps_its_journal_within_its_retention,
    a_letter_dealt_with_that_fails_again_is_opened_again,
    a_letter_the_database_refuses_whole_is_stored_cut_and_kept_aside
);

async fn stored<B: Backend>(store: &B::S, filter: &LetterFilter) -> usize {
    store.dead_letters(filter, None, 1000).await.unwrap().len()
}

async fn wait_stored<B: Backend>(store: &B::S, n: usize) -> bool {
    wait_for(Duration::from_secs(60), || async {
        stored::<B>(store, &LetterFilter::default()).await >= n
    })
    .await
}

async fn dead_letters_are_stored_once_grouped_and_found<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;
    broker.track_queue(&unstored_queue_name(config.queue()));

    let refused: Vec<_> = (0..3)
        .map(|_| TestBroker::message(&Job::with(Mode::Permanent)))
        .collect();
    for m in &refused {
        broker.publish(m).await;
    }
    let json = || BasicProperties::default().with_content_type("application/json".into());
    for n in 0..2 {
        let id = format!("bad-json-{n}-{}", uuid::Uuid::now_v7());
        broker
            .publish_raw(b"{\"messageId\": ", json().with_message_id(id.into()))
            .await;
    }
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(5, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    // A letter the broker made itself (no warren record, no message id).
    broker
        .publisher
        .publish_raw(
            "",
            &broker.dead_letter_queue(),
            b"expired, say",
            BasicProperties::default(),
        )
        .await
        .unwrap();

    let ingesting = Ingesting::start(Ingester::new(db.store.clone(), &config));
    assert!(wait_stored::<B>(&db.store, 6).await, "six letters stored");
    assert!(
        wait_for(Duration::from_secs(30), || async {
            broker.ready(&broker.dead_letter_queue()).await == 0
        })
        .await,
        "each letter is acked once stored"
    );

    // One group per cause, the largest first.
    let groups = db
        .store
        .dead_letter_groups(&LetterFilter::default(), 10)
        .await
        .unwrap();
    let shape: Vec<(u64, &str)> = groups
        .iter()
        .map(|g| (g.count, g.reason.as_str()))
        .collect();
    assert_eq!(
        shape,
        [
            (3, "permanent-failure"),
            (2, "invalid-json"),
            (1, "unknown")
        ],
        "{groups:?}"
    );
    assert_eq!(groups[0].event_type, crate::util::EVENT);
    assert_eq!(groups[0].sample_error, "the job says it can never succeed");

    // Every filter narrows.
    let by = |f: &dyn Fn(&mut LetterFilter)| {
        let mut filter = LetterFilter::default();
        f(&mut filter);
        filter
    };
    let permanent = refused[0].meta().message_id.clone();
    let one = LetterFilter {
        message_id: Some(permanent.clone()),
        ..LetterFilter::default()
    };
    assert_eq!(stored::<B>(&db.store, &one).await, 1);
    let correlated = LetterFilter {
        correlation_id: Some(refused[1].meta().correlation_id.clone()),
        ..LetterFilter::default()
    };
    assert_eq!(stored::<B>(&db.store, &correlated).await, 1);
    let cases = [
        (by(&|f| f.reason = Some("invalid-json".into())), 2),
        (by(&|f| f.event_type = Some(crate::util::EVENT.into())), 3),
        (by(&|f| f.group = Some(groups[1].group_key.clone())), 2),
        (
            by(&|f| f.payload_field = Some(("mode.kind".into(), "permanent".into()))),
            3,
        ),
        (
            by(&|f| f.payload_field = Some(("delay_ms".into(), "0".into()))),
            3,
        ),
        (
            by(&|f| f.payload_field = Some(("delay_ms".into(), "1".into()))),
            0,
        ),
        (
            by(&|f| f.since = Some(Utc::now() - chrono::Duration::hours(1))),
            6,
        ),
        (
            by(&|f| f.until = Some(Utc::now() - chrono::Duration::hours(1))),
            0,
        ),
        (by(&|f| f.state = LetterState::Resolved), 0),
    ];
    for (filter, n) in cases {
        assert_eq!(stored::<B>(&db.store, &filter).await, n, "{filter:?}");
    }

    // Pages follow each other without a gap or an overlap.
    let mut seen = Vec::new();
    let mut after: Option<PageAfter> = None;
    loop {
        let page = db
            .store
            .dead_letters(&LetterFilter::default(), after.as_ref(), 4)
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        after = Some(PageAfter {
            last_failure: last.last_failure,
            letter_id: last.letter_id.clone(),
        });
        seen.extend(page.into_iter().map(|l| l.letter_id));
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 6);

    // A letter whole: headers decoded as text, the body as it came.
    let letter = db
        .store
        .dead_letters(&one, None, 1)
        .await
        .unwrap()
        .remove(0);
    let record = db
        .store
        .dead_letter(&letter.letter_id)
        .await
        .unwrap()
        .unwrap();
    let headers: serde_json::Value = serde_json::from_str(&record.headers).unwrap();
    assert_eq!(headers["x-warren-reason"], "permanent-failure");
    assert_eq!(headers["x-warren-consumer"], config.name());
    assert_eq!(record.body, refused[0].body());
    assert_eq!(record.letter.attempts, 1);
    assert_eq!(record.letter.original_exchange, broker.exchange);

    // The same letter dead-lettered again (its ack lost) is recognized.
    let properties: BasicProperties = serde_json::from_str(&record.properties).unwrap();
    broker
        .publisher
        .publish_raw("", &broker.dead_letter_queue(), &record.body, properties)
        .await
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(30), || async {
            broker.ready(&broker.dead_letter_queue()).await == 0
        })
        .await
    );
    ingesting.stop().await;
    assert_eq!(stored::<B>(&db.store, &LetterFilter::default()).await, 6);

    // Changes, each audited.
    let actor = Actor::new("ana");
    let single = LetterFilter {
        letter_id: Some(letter.letter_id.clone()),
        ..LetterFilter::default()
    };
    assert_eq!(
        db.store
            .resolve_dead_letters(&single, &actor)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        db.store
            .resolve_dead_letters(&single, &actor)
            .await
            .unwrap(),
        0
    );
    let merged = db
        .store
        .reclassify_dead_letters(
            &by(&|f| f.reason = Some("invalid-json".into())),
            &groups[0].group_key,
            &actor,
        )
        .await
        .unwrap();
    assert_eq!(merged, 2);
    let after_merge = db
        .store
        .dead_letter_groups(&LetterFilter::default(), 10)
        .await
        .unwrap();
    assert_eq!(after_merge[0].count, 4, "2 left unresolved + 2 merged in");

    let mute = db
        .store
        .mute_group(&groups[0].group_key, None, Some(2), "known outage", &actor)
        .await
        .unwrap();
    assert_eq!(mute.count_at_mute, 4);
    assert!(mute.holds(6, Utc::now()) && !mute.holds(7, Utc::now()));
    assert_eq!(db.store.group_mutes().await.unwrap(), vec![mute]);
    assert!(
        db.store
            .unmute_group(&groups[0].group_key, &actor)
            .await
            .unwrap()
    );
    assert!(
        !db.store
            .unmute_group(&groups[0].group_key, &actor)
            .await
            .unwrap()
    );

    // The gauges leave a muted group out, and say how old the oldest is.
    let handle = crate::supervision::recorder();
    db.store
        .mute_group(&groups[0].group_key, None, None, "known", &actor)
        .await
        .unwrap();
    let house = Ingester::new(db.store.clone(), &config).with_retention(None);
    house.housekeeping_pass().await.unwrap();
    let text = handle.render();
    let consumer_label = format!("consumer=\"{}\"", config.name());
    let gauge = |name: &str| crate::supervision::value(&text, name, &[&consumer_label]);
    assert_eq!(gauge("dead_letters_unresolved"), Some(1.0), "{text}");
    assert_eq!(gauge("dead_letters_unresolved_muted"), Some(4.0), "{text}");
    assert_eq!(gauge("dead_letters_rows"), Some(6.0), "{text}");
    assert!(gauge("dead_letters_oldest_unresolved_age_seconds").is_some_and(|a| a >= 0.0));
    db.store
        .unmute_group(&groups[0].group_key, &actor)
        .await
        .unwrap();

    let stats = db.store.dead_letter_stats().await.unwrap();
    assert_eq!(stats.rows, 6);
    assert_eq!(
        stats.unresolved_by_group.iter().map(|g| g.1).sum::<u64>(),
        5
    );
    assert!(stats.oldest_unresolved.is_some());

    // Purge takes resolved letters only, and only those resolved long enough;
    // retention does the same on its own.
    let earlier = Utc::now() - chrono::Duration::hours(1);
    assert_eq!(
        db.store
            .purge_dead_letters(LetterState::Resolved, earlier, 100)
            .await
            .unwrap(),
        0
    );
    Ingester::new(db.store.clone(), &config)
        .with_retention(Some(Duration::ZERO))
        .housekeeping_pass()
        .await
        .unwrap();
    assert_eq!(stored::<B>(&db.store, &LetterFilter::default()).await, 5);
    let resolved = LetterFilter {
        state: LetterState::Resolved,
        ..LetterFilter::default()
    };
    assert_eq!(stored::<B>(&db.store, &resolved).await, 0);

    let audit = db.store.audit_log(10).await.unwrap();
    let actions: Vec<&str> = audit.iter().map(|a| a.action.as_str()).collect();
    assert_eq!(
        actions,
        [
            "unmute",
            "mute",
            "unmute",
            "mute",
            "reclassify",
            "resolve",
            "resolve"
        ]
    );
    assert!(
        audit
            .iter()
            .all(|a| a.operator == "ana" && !a.os_user.is_empty())
    );
    assert_eq!(audit[5].detail, "0 letters");

    broker.cleanup().await;
    db.drop_db().await;
}

/// A body over the stored limit, and text the database refuses (NUL, which
/// PostgreSQL keeps out of text; a payload JSON refuses): each is stored as
/// far as it fits, flagged, and kept whole on the side queue.
async fn a_letter_the_database_refuses_whole_is_stored_cut_and_kept_aside<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;
    let side = unstored_queue_name(config.queue());
    broker.track_queue(&side);
    let dead = broker.dead_letter_queue();

    let big = vec![b'x'; 4096];
    broker
        .publisher
        .publish_raw(
            "",
            &dead,
            &big,
            BasicProperties::default().with_message_id("big".into()),
        )
        .await
        .unwrap();
    let nul_body = br#"{"messageId":"nul\u0000id","payload":{"note":"a\u0000b"}}"#;
    broker
        .publisher
        .publish_raw(
            "",
            &dead,
            nul_body,
            BasicProperties::default()
                .with_message_id("nul\0id".into())
                .with_correlation_id("c\0".into()),
        )
        .await
        .unwrap();

    let ingesting =
        Ingesting::start(Ingester::new(db.store.clone(), &config).with_max_stored_body(1024));
    assert!(wait_stored::<B>(&db.store, 2).await, "both letters stored");
    assert!(
        wait_for(Duration::from_secs(30), || async {
            broker.ready(&dead).await == 0
        })
        .await
    );
    ingesting.stop().await;

    let letters = db
        .store
        .dead_letters(&LetterFilter::default(), None, 10)
        .await
        .unwrap();
    let big_letter = letters.iter().find(|l| l.message_id == "big").unwrap();
    assert!(big_letter.body_truncated);
    let record = db
        .store
        .dead_letter(&big_letter.letter_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.body.len(), 1024, "stored as far as it fits");
    let odd = letters.iter().find(|l| l.message_id != "big").unwrap();
    assert!(odd.message_id.starts_with("nul"), "{odd:?}");

    // The originals, whole, on the side queue.
    let kept = broker.drain(&side).await;
    let big_kept = kept
        .iter()
        .find(|d| d.properties.message_id().as_ref().map(|s| s.as_str()) == Some("big"))
        .expect("the big letter is kept whole");
    assert_eq!(big_kept.data, big);
    if <B as Backend>::NAME == "postgres" {
        assert!(
            odd.body_truncated,
            "PostgreSQL refuses NUL in text: {odd:?}"
        );
    }
    if odd.body_truncated {
        assert!(
            kept.iter().any(|d| d.data == nul_body),
            "the refused letter is kept whole"
        );
    }

    broker.cleanup().await;
    db.drop_db().await;
}

/// A message dead-lettered, replayed from the table and dead-lettered again
/// is two letters: one per failure. Mended, a replay applies it once.
async fn a_letter_replayed_that_fails_again_is_a_second_letter<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;
    broker.track_queue(&unstored_queue_name(config.queue()));
    let switch = unique("switch");
    set_broken(&switch, true);
    let message = TestBroker::message(&Job::with(Mode::PermanentWhileBroken {
        switch: switch.clone(),
    }));
    let id = message.meta().message_id.clone();
    broker.publish(&message).await;

    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let ingesting = Ingesting::start(Ingester::new(db.store.clone(), &config));
    assert!(wait_stored::<B>(&db.store, 1).await);

    let replayer = Replayer::new(
        db.store.clone(),
        std::sync::Arc::clone(&broker.connection),
        Actor::new("ana"),
    );
    let run = replayer
        .start(&LetterFilter::default(), None, false)
        .await
        .unwrap();
    assert_eq!(run.total, 1);
    let done = replayer.resume(&run.run_id, |_| {}).await.unwrap();
    assert_eq!((done.published, done.state.as_str()), (1, "finished"));

    // Still broken: it fails again, and that failure is a letter of its own.
    assert!(wait_stored::<B>(&db.store, 1).await);
    let unresolved = db
        .store
        .dead_letters(&LetterFilter::default(), None, 10)
        .await
        .unwrap();
    assert_eq!(unresolved.len(), 1);
    assert_eq!(unresolved[0].message_id, id);
    assert_eq!(unresolved[0].replay_id, format!("{}.1", run.run_id));
    let replayed = LetterFilter {
        state: LetterState::Replayed,
        ..LetterFilter::default()
    };
    let first = db.store.dead_letters(&replayed, None, 10).await.unwrap();
    assert_eq!(first.len(), 1, "the first failure is marked replayed");
    assert_ne!(first[0].letter_id, unresolved[0].letter_id);

    // Mended, the second letter's replay applies it, once.
    set_broken(&switch, false);
    let run = replayer
        .start(&LetterFilter::default(), None, false)
        .await
        .unwrap();
    replayer.resume(&run.run_id, |_| {}).await.unwrap();
    assert!(
        wait_for(Duration::from_secs(30), || async {
            db.effects_for(&id).await == 1
        })
        .await,
        "the mended replay applies"
    );
    assert!(matches!(
        replayer.start(&LetterFilter::default(), None, false).await,
        Err(ReplayError::NothingSelected(_))
    ));
    ingesting.stop().await;
    running.stop().await.unwrap();
    assert_eq!(db.effects_for(&id).await, 1);
    assert_eq!(stored::<B>(&db.store, &replayed).await, 2);

    broker.cleanup().await;
    db.drop_db().await;
}

/// A replay run stopped halfway resumes where it stopped; letters older
/// than the inbox window are refused unless forced, and forcing is audited.
async fn an_interrupted_replay_resumes_and_replays_each_letter_once<B: Backend>() {
    const N: usize = 200;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;
    broker.track_queue(&unstored_queue_name(config.queue()));
    let switch = unique("switch");
    set_broken(&switch, true);
    let messages: Vec<_> = (0..N)
        .map(|_| {
            TestBroker::message(&Job::with(Mode::PermanentWhileBroken {
                switch: switch.clone(),
            }))
        })
        .collect();
    for m in &messages {
        broker.publish(m).await;
    }
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(running.settled(N as u64, Duration::from_secs(60)).await);
    let ingesting = Ingesting::start(Ingester::new(db.store.clone(), &config));
    assert!(wait_stored::<B>(&db.store, N).await);
    ingesting.stop().await;
    set_broken(&switch, false);

    let replayer = std::sync::Arc::new(Replayer::new(
        db.store.clone(),
        std::sync::Arc::clone(&broker.connection),
        Actor::new("ana"),
    ));
    let too_old = replayer
        .start(&LetterFilter::default(), Some(Duration::ZERO), false)
        .await;
    assert!(
        matches!(too_old, Err(ReplayError::TooOld { count: N, .. })),
        "{too_old:?}"
    );
    let run = replayer
        .start(&LetterFilter::default(), Some(Duration::ZERO), true)
        .await
        .unwrap();
    assert_eq!(run.total, N as u64);
    let audit = db.store.audit_log(1).await.unwrap();
    assert!(audit[0].forced && audit[0].action == "replay", "{audit:?}");

    // Interrupted: the task is dropped once a few letters went out.
    let (half, mut halfway) = tokio::sync::mpsc::unbounded_channel();
    let interrupted = {
        let replayer = std::sync::Arc::clone(&replayer);
        let run_id = run.run_id.clone();
        tokio::spawn(async move {
            let _ = replayer
                .resume(&run_id, move |p| {
                    let _ = half.send(p.seq);
                })
                .await;
        })
    };
    while let Some(seq) = halfway.recv().await {
        if seq >= (N / 2) as u64 {
            break;
        }
    }
    interrupted.abort();
    let _ = interrupted.await;
    let midway = db.store.replay_run(&run.run_id).await.unwrap().unwrap();
    assert!(
        midway.published >= (N / 2) as u64 && midway.published < N as u64,
        "{midway:?}"
    );

    let done = replayer.resume(&run.run_id, |_| {}).await.unwrap();
    assert_eq!(
        (done.published, done.state.as_str()),
        (N as u64, "finished")
    );
    assert!(
        running.settled(2 * N as u64, Duration::from_secs(60)).await,
        "{:?}",
        running.stats.snapshot()
    );
    running.stop().await.unwrap();
    for m in &messages {
        assert_eq!(db.effects_for(&m.meta().message_id).await, 1);
    }
    let replayed = LetterFilter {
        state: LetterState::Replayed,
        ..LetterFilter::default()
    };
    assert_eq!(stored::<B>(&db.store, &replayed).await, N);

    broker.cleanup().await;
    db.drop_db().await;
}

/// Careful replay: the first copy's journaled outcome decides. Dead-lettered
/// again, nothing else goes; with the consumer down, "outcome unknown", even
/// though another copy of the same message id is journaled applied; resumed
/// with the consumer mended, the run finishes and each message applies once.
async fn careful_replay_goes_on_only_on_the_outcome_of_its_own_replay_id<B: Backend>() {
    const N: usize = 8;
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;
    broker.track_queue(&unstored_queue_name(config.queue()));
    let switch = unique("switch");
    set_broken(&switch, true);
    let messages: Vec<_> = (0..N)
        .map(|_| {
            TestBroker::message(&Job::with(Mode::PermanentWhileBroken {
                switch: switch.clone(),
            }))
        })
        .collect();
    for m in &messages {
        broker.publish(m).await;
    }
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let ingesting = Ingesting::start(Ingester::new(db.store.clone(), &config));
    assert!(wait_stored::<B>(&db.store, N).await);

    let replayer = Replayer::new(
        db.store.clone(),
        std::sync::Arc::clone(&broker.connection),
        Actor::new("ana"),
    )
    .careful(Duration::from_secs(30));
    // Still broken: the first copy is dead-lettered again, and the run stops.
    let run = replayer
        .start(&LetterFilter::default(), None, false)
        .await
        .unwrap();
    assert!(run.careful, "recorded as careful: a resume stays careful");
    let stopped = replayer.resume(&run.run_id, |_| {}).await;
    assert!(
        matches!(&stopped, Err(ReplayError::FailedAgain { replay_id, outcome, .. })
            if *replay_id == format!("{}.1", run.run_id) && outcome == "dead-lettered"),
        "{stopped:?}"
    );
    let after = db.store.replay_run(&run.run_id).await.unwrap().unwrap();
    assert_eq!((after.published, after.state.as_str()), (1, "stopped"));
    assert!(after.stop_reason.contains("failed again"), "{after:?}");

    // Consumer down: no outcome for this run's copy, whatever else the
    // journal says about the same message id.
    running.stop().await.unwrap();
    assert!(wait_stored::<B>(&db.store, N).await);
    let run = replayer
        .start(&LetterFilter::default(), None, false)
        .await
        .unwrap();
    let first = db
        .store
        .pending_replays(&run.run_id, 1)
        .await
        .unwrap()
        .remove(0);
    let first_letter = db
        .store
        .dead_letter(&first.letter_id)
        .await
        .unwrap()
        .unwrap();
    db.store
        .write_journal(&[JournalEntry {
            consumer: config.name().to_owned(),
            message_id: first_letter.letter.message_id.clone(),
            replay_id: String::new(),
            outcome: "applied".into(),
            detail: String::new(),
            at: Utc::now(),
        }])
        .await
        .unwrap();
    let quick = Replayer::new(
        db.store.clone(),
        std::sync::Arc::clone(&broker.connection),
        Actor::new("ana"),
    )
    .careful(Duration::from_secs(2));
    let unknown = quick.resume(&run.run_id, |_| {}).await;
    assert!(
        matches!(&unknown, Err(ReplayError::OutcomeUnknown { .. })),
        "{unknown:?}"
    );
    assert_eq!(
        db.store
            .replay_run(&run.run_id)
            .await
            .unwrap()
            .unwrap()
            .published,
        1
    );

    // Mended and running again: the resumed run finds its first copy
    // applied, and replays the rest.
    set_broken(&switch, false);
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let done = replayer.resume(&run.run_id, |_| {}).await.unwrap();
    assert_eq!(
        (done.published, done.state.as_str()),
        (N as u64, "finished")
    );
    assert_eq!(
        replayer
            .outcome_of(&format!("{}.1", run.run_id), Duration::from_secs(30))
            .await
            .unwrap(),
        CopyOutcome::Applied
    );
    for m in &messages {
        let id = m.meta().message_id.clone();
        assert!(
            wait_for(Duration::from_secs(30), || async {
                db.effects_for(&id).await == 1
            })
            .await,
            "{id} applies"
        );
    }
    // A replay of what already applied comes back a duplicate.
    let again = Replayer::new(
        db.store.clone(),
        std::sync::Arc::clone(&broker.connection),
        Actor::new("ana"),
    );
    let replayed = LetterFilter {
        state: LetterState::Replayed,
        letter_id: Some(first.letter_id.clone()),
        ..LetterFilter::default()
    };
    let run = again.start(&replayed, None, false).await.unwrap();
    again.resume(&run.run_id, |_| {}).await.unwrap();
    assert_eq!(
        again
            .outcome_of(&format!("{}.1", run.run_id), Duration::from_secs(30))
            .await
            .unwrap(),
        CopyOutcome::Duplicate,
        "the inbox already holds its message id"
    );
    let journal = db
        .store
        .journal_of_message(config.name(), &first_letter.letter.message_id, 50)
        .await
        .unwrap();
    let outcomes: Vec<&str> = journal.iter().map(|e| e.outcome.as_str()).collect();
    assert!(outcomes.contains(&"dead-lettered"), "{outcomes:?}");
    assert!(outcomes.contains(&"replayed"), "{outcomes:?}");
    running.stop().await.unwrap();
    ingesting.stop().await;
    for m in &messages {
        assert_eq!(db.effects_for(&m.meta().message_id).await, 1);
    }

    broker.cleanup().await;
    db.drop_db().await;
}

/// An edit must stay the same message: an envelope with the same id. It is
/// kept beside the original, audited with the fields it changed, refused
/// where edits are off, and a replay sends it.
async fn an_edit_is_checked_kept_beside_the_original_audited_and_replayed<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;
    broker.track_queue(&unstored_queue_name(config.queue()));
    let message = TestBroker::message(&Job::with(Mode::Permanent));
    let id = message.meta().message_id.clone();
    broker.publish(&message).await;
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let ingesting = Ingesting::start(Ingester::new(db.store.clone(), &config));
    assert!(wait_stored::<B>(&db.store, 1).await);
    let letter = db
        .store
        .dead_letters(&LetterFilter::default(), None, 1)
        .await
        .unwrap()
        .remove(0);
    let original = db
        .store
        .dead_letter(&letter.letter_id)
        .await
        .unwrap()
        .unwrap();
    let ana = Actor::new("ana");

    let fixed =
        set_payload_fields(&original, &[("mode.kind".to_owned(), "ok".to_owned())]).unwrap();
    let other_id = String::from_utf8(fixed.clone())
        .unwrap()
        .replace(&id, "someone-else");
    let refused = [
        (b"not json".to_vec(), "not an envelope"),
        (other_id.into_bytes(), "another message id"),
        (original.body.clone(), "unchanged"),
    ];
    for (body, why) in refused {
        let e = edit_letter(&db.store, &letter.letter_id, &body, "try", &ana).await;
        assert!(
            matches!(
                e,
                Err(EditError::NotAnEnvelope { .. }
                    | EditError::MessageIdChanged(_)
                    | EditError::Unchanged)
            ),
            "{why}: {e:?}"
        );
    }
    db.store.allow_edits(false, &ana).await.unwrap();
    assert!(matches!(
        edit_letter(&db.store, &letter.letter_id, &fixed, "fix", &ana).await,
        Err(EditError::NotAllowed)
    ));
    db.store.allow_edits(true, &ana).await.unwrap();
    edit_letter(&db.store, &letter.letter_id, &fixed, "customer asked", &ana)
        .await
        .unwrap();

    let edited = db
        .store
        .dead_letter(&letter.letter_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(edited.body, original.body, "the original is kept");
    let edit = edited.edit.as_ref().unwrap();
    assert_eq!(edit.body, fixed);
    assert_eq!(
        (edit.by.as_str(), edit.reason.as_str()),
        ("ana", "customer asked")
    );
    let audit = db.store.audit_log(1).await.unwrap().remove(0);
    assert_eq!(audit.action, "edit");
    assert!(audit.detail.contains("payload.mode.kind"), "{audit:?}");

    let replayer = Replayer::new(
        db.store.clone(),
        std::sync::Arc::clone(&broker.connection),
        ana.clone(),
    )
    .careful(Duration::from_secs(30));
    let run = replayer
        .start(&LetterFilter::default(), None, false)
        .await
        .unwrap();
    replayer.resume(&run.run_id, |_| {}).await.unwrap();
    assert_eq!(
        replayer
            .outcome_of(&format!("{}.1", run.run_id), Duration::from_secs(30))
            .await
            .unwrap(),
        CopyOutcome::Applied
    );
    running.stop().await.unwrap();
    ingesting.stop().await;
    assert_eq!(db.effects_for(&id).await, 1);

    broker.cleanup().await;
    db.drop_db().await;
}

/// Each consumer deletes its journal's rows past their retention, whether or
/// not an ingester runs; younger rows stay.
async fn the_consumer_keeps_its_journal_within_its_retention<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config = broker
        .builder()
        .with_journal_retention(Some(Duration::from_secs(86_400)))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
    let entry = |id: &str, age_days: i64| JournalEntry {
        consumer: config.name().to_owned(),
        message_id: id.to_owned(),
        replay_id: String::new(),
        outcome: "duplicate".into(),
        detail: String::new(),
        at: Utc::now() - chrono::Duration::days(age_days),
    };
    db.store
        .write_journal(&[entry("old", 2), entry("young", 0)])
        .await
        .unwrap();
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let name = config.name().to_owned();
    assert!(
        wait_for(Duration::from_secs(30), || async {
            db.store
                .journal_of_message(&name, "old", 10)
                .await
                .unwrap()
                .is_empty()
        })
        .await,
        "the old row is deleted"
    );
    running.stop().await.unwrap();
    assert_eq!(
        db.store
            .journal_of_message(&name, "young", 10)
            .await
            .unwrap()
            .len(),
        1
    );
    broker.cleanup().await;
    db.drop_db().await;
}

/// The same message failing again later (republished by its producer) after
/// its letter was resolved: the letter opens again with the new failure,
/// rather than the new failure being dropped as a copy already stored.
async fn a_letter_dealt_with_that_fails_again_is_opened_again<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;
    broker.track_queue(&unstored_queue_name(config.queue()));
    let message = TestBroker::message(&Job::with(Mode::Permanent));
    broker.publish(&message).await;
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let ingesting = Ingesting::start(Ingester::new(db.store.clone(), &config));
    assert!(wait_stored::<B>(&db.store, 1).await);
    let letter = db
        .store
        .dead_letters(&LetterFilter::default(), None, 1)
        .await
        .unwrap()
        .remove(0);
    db.store
        .resolve_dead_letters(
            &LetterFilter {
                letter_id: Some(letter.letter_id.clone()),
                ..LetterFilter::default()
            },
            &Actor::new("ana"),
        )
        .await
        .unwrap();
    assert_eq!(stored::<B>(&db.store, &LetterFilter::default()).await, 0);
    broker.publish(&message).await;
    assert!(
        wait_stored::<B>(&db.store, 1).await,
        "the letter is unresolved again"
    );
    let again = db
        .store
        .dead_letters(&LetterFilter::default(), None, 1)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(again.letter_id, letter.letter_id);
    assert!(again.last_failure > letter.last_failure, "{again:?}");
    ingesting.stop().await;
    running.stop().await.unwrap();
    broker.cleanup().await;
    db.drop_db().await;
}
