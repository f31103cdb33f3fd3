//! Poison blame: a crash is blamed only on a message that provably ran alone.
//!
//! Consumer processes (this test binary re-run, as in `crash`) die at crash
//! points or on a message that aborts whoever handles it, and are restarted after
//! every death. Whatever came back redelivered runs alone; only deaths during
//! those solo runs count toward the poison limit. Counted at the end: every
//! valid message applied exactly once, and nothing but the real poison message
//! in the dead-letter queue.

use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use tokio::process::Child;

use warren::Outgoing;
use warren::topology::QueueType;
use warren_admin::DeadLetterInfo;

use crate::crash::{ChildOptions, ChildProcess, spawn_with};
use crate::util::{Backend, Job, Mode, TEST_POISON_LIMIT, TestBroker, TestDb, test_retry, unique};

const SIGABRT: i32 = 6;
/// How long a healthy message's handler takes.
const HANDLER_MS: u64 = 10;
/// The poison limit where crash points fire at random around healthy
/// messages (see `crashes_around_healthy_messages`).
const CHANCE_POISON_LIMIT: u32 = 6;

on_all_backends!(
    one_poison_message_among_a_thousand_is_the_only_dead_letter_on_quorum,
    one_poison_message_among_a_thousand_is_the_only_dead_letter_on_classic,
    crashes_around_healthy_messages_condemn_none_on_quorum,
    crashes_around_healthy_messages_condemn_none_on_classic,
    poison_amid_other_deaths_and_a_neighbour_consumer_is_still_the_only_dead_letter,
);

/// Prefetch and concurrency of the consumer processes, as in production.
fn options() -> ChildOptions {
    ChildOptions {
        prefetch: Some(32),
        concurrency: Some(8),
        ..ChildOptions::default()
    }
}

/// What a run of restarted processes went through.
#[derive(Debug, Default)]
struct Deaths {
    aborts: u32,
    sigterms: u32,
}

/// Runs consumer processes one after another, starting a new one after each
/// death, until `done` holds; then stops the last one with SIGTERM. Up to
/// `sigterms` times, a process is stopped with SIGTERM as soon as it logs that a
/// suspect runs alone, to mix deaths that are not the messages' fault into the
/// solo runs.
async fn run_until_done<B: Backend, F, Fut>(
    db: &TestDb<B>,
    broker: &TestBroker,
    queue_type: QueueType,
    failpoints: Option<&str>,
    options: ChildOptions,
    mut sigterms: u32,
    done: F,
) -> Deaths
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut deaths = Deaths::default();
    loop {
        let ChildProcess {
            mut child,
            mut lines,
        } = spawn_with::<B>(
            &db.url,
            broker,
            failpoints,
            queue_type,
            "consumer",
            options.clone(),
        );
        // Read the child's output as it comes, so that its logging never blocks
        // on a full pipe, and tell when a suspect starts running alone.
        let (solo_tx, mut solo) = tokio::sync::mpsc::unbounded_channel();
        let logs = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("suspect runs alone") {
                    let _ = solo_tx.send(());
                }
            }
        });
        loop {
            assert!(
                Instant::now() < deadline,
                "not done within 300 s after {deaths:?}"
            );
            if let Some(ended) = ended_within(&mut child, Duration::from_millis(200)).await {
                match ended {
                    Some(SIGABRT) => deaths.aborts += 1,
                    None => deaths.sigterms += 1,
                    Some(other) => panic!("the child died of signal {other}"),
                }
                break;
            }
            if done().await {
                sigterm(&child);
                let ended = ended_within(&mut child, Duration::from_secs(60)).await;
                // The effects are all there, but the process may still hold
                // deliveries it settles while it drains (redelivered copies
                // of a dead predecessor's messages, settled as duplicates),
                // and the crash points stay armed: a crash then is one like
                // any other, and the next process settles the rest. Nothing
                // else than a clean exit or a crash point's abort may end it.
                match ended {
                    Some(None) => {
                        logs.abort();
                        return deaths;
                    }
                    Some(Some(SIGABRT)) if failpoints.is_some() => {
                        deaths.aborts += 1;
                        break;
                    }
                    other => panic!("a clean exit on SIGTERM, not {other:?}"),
                }
            }
            if sigterms > 0 && solo.try_recv().is_ok() {
                sigterms -= 1;
                sigterm(&child);
                let ended = ended_within(&mut child, Duration::from_secs(60)).await;
                match ended {
                    Some(Some(SIGABRT)) => deaths.aborts += 1,
                    Some(_) => deaths.sigterms += 1,
                    None => panic!("the child should stop on SIGTERM"),
                }
                break;
            }
        }
        logs.abort();
    }
}

/// Waits for the child to end, for at most `timeout`: `Some(signal)` (`None`
/// inside for a clean exit), or `None` if it is still running.
async fn ended_within(child: &mut Child, timeout: Duration) -> Option<Option<i32>> {
    let status = tokio::time::timeout(timeout, child.wait()).await.ok()?;
    let status = status.unwrap();
    Some(if status.success() {
        None
    } else {
        Some(status.signal().unwrap_or(-1))
    })
}

fn sigterm(child: &Child) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
}

/// Declares the test consumer's topology with the processes' settings.
async fn declare(broker: &TestBroker, queue_type: QueueType) {
    declare_with_limit(broker, queue_type, TEST_POISON_LIMIT).await;
}

/// [`declare`], for processes whose poison limit is `poison_limit` (a quorum
/// queue's delivery limit follows from it).
async fn declare_with_limit(broker: &TestBroker, queue_type: QueueType, poison_limit: u32) {
    let config = broker
        .builder()
        .with_queue_type(queue_type)
        .with_prefetch(32)
        .with_concurrency(8)
        .with_retry(test_retry(poison_limit))
        .build()
        .unwrap();
    broker.declare_config(&config).await;
}

/// Done with a poison run: every valid message applied and one dead letter, or
/// more than one dead letter (a failure the checks then name).
async fn poison_settled<B: Backend>(
    db: &TestDb<B>,
    broker: &TestBroker,
    dlq: &str,
    valid: usize,
) -> bool {
    let dead = broker.ready(dlq).await;
    dead > 1 || (dead == 1 && db.distinct_effects().await == valid as i64)
}

/// No outbox row left to publish: the relay is idle, so its crash point cannot
/// fire any more.
async fn outbox_drained<B: Backend>(db: &TestDb<B>) -> bool {
    use warren::store::OutboxStore;
    db.store.outbox_counts().await.is_ok_and(|c| c.pending == 0)
}

/// Publishes `n` valid messages straight to `queue` (each writing an outbox
/// event if `emit`) and returns their ids. Each takes a few milliseconds, so
/// that a process dying on one message takes others down mid-handler.
async fn publish(broker: &TestBroker, queue: &str, n: usize, emit: bool) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let job = if emit {
            Job::slow(HANDLER_MS).emitting(1, &broker.exchange)
        } else {
            Job::slow(HANDLER_MS)
        };
        let m = TestBroker::message(&job);
        ids.push(m.meta().message_id.clone());
        broker.publish_to(queue, &m).await;
    }
    ids
}

async fn poison(broker: &TestBroker, queue: &str) -> String {
    let killer: Outgoing = TestBroker::message(&Job::with(Mode::Abort));
    broker.publish_to(queue, &killer).await;
    killer.meta().message_id.clone()
}

/// Every valid message applied exactly once; the dead-letter queue holds exactly
/// `poison` (or nothing), filed as `poison`.
async fn assert_blame<B: Backend>(
    db: &TestDb<B>,
    broker: &TestBroker,
    dead_letter_queue: &str,
    valid: usize,
    poison: Option<&str>,
) {
    let dead = broker.drain(dead_letter_queue).await;
    let ids: Vec<String> = dead
        .iter()
        .map(|d| {
            d.properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default()
        })
        .collect();
    match poison {
        Some(id) => {
            assert_eq!(ids, [id], "only the poison message is dead-lettered");
            let info = DeadLetterInfo::from_properties(&dead[0].properties).unwrap();
            assert_eq!(info.reason, "poison");
        }
        None => {
            // The reason and error say which path condemned it: warren's own
            // poison count, or the broker's delivery-limit backstop.
            let why: Vec<String> = dead
                .iter()
                .map(|d| match DeadLetterInfo::from_properties(&d.properties) {
                    Some(info) => format!(
                        "{} after {} attempts: {}",
                        info.reason, info.attempts, info.error
                    ),
                    None => "no dead-letter record".into(),
                })
                .collect();
            assert!(
                ids.is_empty(),
                "healthy messages dead-lettered: {ids:?}, why: {why:?}"
            );
        }
    }
    assert_eq!(
        db.distinct_effects().await,
        valid as i64,
        "every valid message applied"
    );
    assert_eq!(db.effects().await, valid as i64, "none applied twice");
}

async fn one_poison_message_among_a_thousand_is_the_only_dead_letter_on_quorum<B: Backend>() {
    one_poison_message_among_a_thousand::<B>(QueueType::Quorum).await;
}

async fn one_poison_message_among_a_thousand_is_the_only_dead_letter_on_classic<B: Backend>() {
    one_poison_message_among_a_thousand::<B>(QueueType::Classic).await;
}

/// 1000 valid messages and one that aborts the process every time it runs,
/// prefetch 32, concurrency 8. Its neighbours come back with it after every
/// death, but only it ever dies alone: it alone is dead-lettered, after the
/// poison limit of solo runs.
async fn one_poison_message_among_a_thousand<B: Backend>(queue_type: QueueType) {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    declare(&broker, queue_type).await;
    let mut valid = publish(&broker, &broker.queue, 500, false).await;
    let killer = poison(&broker, &broker.queue).await;
    valid.extend(publish(&broker, &broker.queue, 500, false).await);

    let dlq = broker.dead_letter_queue();
    let deaths = run_until_done(&db, &broker, queue_type, None, options(), 0, || {
        poison_settled(&db, &broker, &dlq, valid.len())
    })
    .await;
    assert_blame(&db, &broker, &dlq, valid.len(), Some(&killer)).await;
    // Once with its neighbours, then once per solo run up to the limit.
    assert_eq!(
        deaths.aborts,
        TEST_POISON_LIMIT + 1,
        "died with neighbours once, then alone up to the limit"
    );

    broker.cleanup().await;
    db.drop_db().await;
}

async fn crashes_around_healthy_messages_condemn_none_on_quorum<B: Backend>() {
    crashes_around_healthy_messages::<B>(QueueType::Quorum).await;
}

async fn crashes_around_healthy_messages_condemn_none_on_classic<B: Backend>() {
    crashes_around_healthy_messages::<B>(QueueType::Classic).await;
}

/// The three crash points armed at 3% each over 1000 valid messages (each
/// writing an outbox event, so that the relay's crash point fires too),
/// restarting after every death: many deaths fall within one prefetch window,
/// and no healthy message is dead-lettered.
#[allow(clippy::print_stderr)]
async fn crashes_around_healthy_messages<B: Backend>(queue_type: QueueType) {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    declare_with_limit(&broker, queue_type, CHANCE_POISON_LIMIT).await;
    let capture = broker.capture().await;
    let mut valid = Vec::new();

    let dlq = broker.dead_letter_queue();
    // 3%, not 1%: a crash point fires once per transaction, and batches of
    // 16 to 32 leave few transactions, too few at 1% to be sure of the five
    // deaths asserted below (a run of 2000 saw four). At 3% each death's
    // redelivered window runs alone, a transaction a message, and deaths
    // follow deaths: dozens a run (79 in a run of 2000, 30 to 63 in six runs
    // of 1000, which keep the test's length and CPU, a process start per
    // death, at half).
    let failpoints = "before-commit=0.03;after-commit-before-ack=0.03;\
                      relay-after-publish-before-mark=0.03";
    // A crash point may fire while a healthy message runs alone, and the
    // process cannot tell that death from one its handler caused: at the
    // tests' limit of 3, a message whose solo runs met a crash point three
    // times in a row is poison by the rule (seen once in CI: "ran alone 3
    // times and the process died each time"). A solo run meets one with a
    // chance of a few percent, and a run has dozens of deaths, each followed
    // by a window of solo runs; at a limit of 6 a condemnation by
    // coincidence needs five more such draws in a row after one. What this test proves is that no
    // death around a healthy message is blamed on it unless it ran alone.
    let opts = ChildOptions {
        relay: true,
        poison_limit: Some(CHANCE_POISON_LIMIT),
        ..options()
    };
    // The deaths are drawn at random, and a round of 1000 can end with
    // fewer than the five the proof needs (one in about 150 stressed runs:
    // an early transaction drew none, and the one death came late, with
    // few solo runs after it). Another 1000 then follow, up to four rounds:
    // the test asserts what the crash points did, never their luck.
    let mut deaths = Deaths::default();
    for _round in 0..4 {
        valid.extend(publish(&broker, &broker.queue, 1000, true).await);
        let round = run_until_done(
            &db,
            &broker,
            queue_type,
            Some(failpoints),
            opts.clone(),
            0,
            || async {
                // Anything dead-lettered fails the test below; no need to wait.
                broker.ready(&dlq).await > 0
                    || (db.distinct_effects().await == valid.len() as i64
                        && outbox_drained(&db).await)
            },
        )
        .await;
        deaths.aborts += round.aborts;
        deaths.sigterms += round.sigterms;
        if deaths.aborts >= 5 || broker.ready(&dlq).await > 0 {
            break;
        }
    }
    // For the record of a stressed run: how many died (dozens, usually).
    eprintln!("{deaths:?}");
    assert!(deaths.aborts >= 5, "the crash points fired: {deaths:?}");
    assert_blame(&db, &broker, &dlq, valid.len(), None).await;
    assert!(
        broker.ready(&capture).await >= valid.len() as u32,
        "every outbox event published at least once"
    );

    broker.cleanup().await;
    db.drop_db().await;
}

/// The poison test again with deaths that are nobody's fault mixed in: the
/// relay's crash point armed, SIGTERMs sent while suspects run alone, and a
/// second consumer with its own stream in the same process (the barrier is the
/// process's). Still only the poison
/// message is dead-lettered.
async fn poison_amid_other_deaths_and_a_neighbour_consumer_is_still_the_only_dead_letter<
    B: Backend,
>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    declare(&broker, QueueType::Quorum).await;
    let capture = broker.capture().await;
    let neighbour = unique("wt_neighbour");
    // On the test exchange, as the child declares it.
    let neighbour_config =
        crate::util::test_config(&neighbour, &format!("{neighbour}.jobs"), &broker.exchange)
            .with_prefetch(32)
            .with_concurrency(8)
            .build()
            .unwrap();
    for q in warren::topology::Topology::for_consumer(&neighbour_config).queue_names() {
        broker.track_queue(q);
    }
    broker.declare_config(&neighbour_config).await;

    let mut valid = publish(&broker, &broker.queue, 300, true).await;
    let killer = poison(&broker, &broker.queue).await;
    valid.extend(publish(&broker, &broker.queue, 300, true).await);
    valid.extend(publish(&broker, neighbour_config.queue(), 600, false).await);

    let dlq = broker.dead_letter_queue();
    let neighbour_dlq = warren::topology::dead_letter_queue_name(neighbour_config.queue());
    let opts = ChildOptions {
        relay: true,
        neighbour: Some(neighbour.clone()),
        ..options()
    };
    let deaths = run_until_done(
        &db,
        &broker,
        QueueType::Quorum,
        Some("relay-after-publish-before-mark=0.02"),
        opts,
        5,
        || async {
            // The relay's crash point fires while outbox rows are pending: done
            // only once they are published, so that the last SIGTERM finds an
            // idle relay and the process can exit cleanly.
            poison_settled(&db, &broker, &dlq, valid.len()).await
                && (broker.ready(&dlq).await > 1 || outbox_drained(&db).await)
        },
    )
    .await;
    assert_blame(&db, &broker, &dlq, valid.len(), Some(&killer)).await;
    assert!(
        deaths.aborts > TEST_POISON_LIMIT,
        "the poison message died alone up to the limit: {deaths:?}"
    );
    assert!(
        deaths.sigterms > 0,
        "SIGTERMs landed in solo runs: {deaths:?}"
    );
    assert_eq!(
        broker.ready(&neighbour_dlq).await,
        0,
        "the neighbour lost nothing"
    );
    let _ = capture;

    broker.cleanup().await;
    db.drop_db().await;
}
