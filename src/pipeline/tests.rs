//! Every disposition of the pipeline against the in-memory broker and an
//! SQLite file: no broker, no database server, milliseconds each. The
//! end-to-end suite in `tests/` is the proof against the real ones; these are
//! for the edit-test loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lapin::BasicProperties;
use serde::{Deserialize, Serialize};
use sqlx::Sqlite;

use super::*;
use crate::admin::DeadLetterInfo;
use crate::broker::memory::MemoryBroker;
use crate::retry::RetryPolicy;
use crate::store::sqlite::SqliteStore;
use crate::store::{SigningKey, Tx};
use crate::{HandlerError, Message, Outgoing};

const EVENT: &str = "test.job";
const MS: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Job {
    /// Fail transiently while the attempt is at most this.
    fail_until: u32,
    permanent: bool,
    panic: bool,
    /// Sleep this long before finishing.
    #[serde(default)]
    hang_ms: u64,
}

impl Job {
    fn ok() -> Self {
        Job {
            fail_until: 0,
            permanent: false,
            panic: false,
            hang_ms: 0,
        }
    }
}

/// The handler's calls by message id: per message, because the tests run
/// side by side in one process.
static CALLS: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<String, u32>>> =
    std::sync::LazyLock::new(Default::default);

fn calls_of(message_id: &str) -> u32 {
    CALLS
        .lock()
        .unwrap()
        .get(message_id)
        .copied()
        .unwrap_or_default()
}

async fn job(msg: Message<Job>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> {
    *CALLS
        .lock()
        .unwrap()
        .entry(msg.meta.message_id.clone())
        .or_default() += 1;
    sqlx::query("INSERT INTO effects (message_id) VALUES (?)")
        .bind(&msg.meta.message_id)
        .execute(tx.conn())
        .await?;
    let j = &msg.payload;
    tokio::time::sleep(Duration::from_millis(j.hang_ms)).await;
    if j.panic {
        panic!("job panicked");
    }
    if j.permanent {
        return Err(HandlerError::permanent("never"));
    }
    if msg.attempt <= j.fail_until {
        return Err(HandlerError::transient(format!("attempt {}", msg.attempt)));
    }
    Ok(())
}

struct Fixture {
    pipeline: Pipeline<SqliteStore>,
    broker: Arc<MemoryBroker>,
    _dir: tempfile::TempDir,
    next_tag: AtomicU32,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(&format!("sqlite://{}", dir.path().join("t.db").display()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let key = store.signing_key().await.unwrap();
    let config = ConsumerConfig::builder("c", "q")
        .with_retry(
            RetryPolicy::new([100 * MS, 200 * MS])
                .with_max_attempts(3)
                .with_poison_limit(2),
        )
        .with_failure_backoff(MS)
        .with_solo_timeout(200 * MS)
        .build()
        .unwrap();
    // A barrier of its own, so that tests running side by side do not wait
    // on each other's suspects.
    let pipeline = Pipeline::new(
        config,
        store,
        Registry::new().route(EVENT, 1, job),
        SoloBarrier::default(),
    );
    let _ = pipeline.signer.set(Signer::new(&key));
    Fixture {
        pipeline,
        broker: Arc::new(MemoryBroker::default()),
        _dir: dir,
        next_tag: AtomicU32::new(1),
    }
}

impl Fixture {
    fn delivery(&self, body: Vec<u8>, properties: BasicProperties, redelivered: bool) -> Delivery {
        Delivery {
            tag: u64::from(self.next_tag.fetch_add(1, Ordering::SeqCst)),
            exchange: "events".into(),
            routing_key: EVENT.into(),
            redelivered,
            properties,
            body,
            pruned: None,
        }
    }

    fn message(&self, job: &Job) -> Delivery {
        let m = Outgoing::new(EVENT, 1, job).unwrap();
        self.delivery(m.body(), m.properties(), false)
    }

    /// The copy last published to `queue`, delivered again as the broker would.
    fn copy_from(&self, queue: &str) -> Delivery {
        let copy = self
            .broker
            .published()
            .into_iter()
            .rev()
            .find(|p| p.queue == queue)
            .unwrap_or_else(|| panic!("nothing published to {queue}"));
        self.delivery(copy.body, copy.properties, false)
    }

    async fn run(&self, delivery: Delivery) {
        self.pipeline
            .run(self.broker.as_ref(), Batch::of(delivery))
            .await;
    }

    async fn solo_runs_recorded(&self, message_id: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT COALESCE(SUM(runs), 0) FROM warren_solo_runs WHERE message_id = ?",
        )
        .bind(message_id)
        .fetch_one(self.pipeline.store.pool())
        .await
        .unwrap()
    }

    async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(self.pipeline.store.pool())
            .await
            .unwrap()
    }

    fn stats(&self) -> crate::telemetry::ConsumerStats {
        self.pipeline.telemetry.stats().snapshot()
    }

    fn record_of(&self, queue: &str) -> DeadLetterInfo {
        DeadLetterInfo::from_properties(&self.copy_from(queue).properties).unwrap()
    }
}

#[tokio::test]
async fn a_valid_message_is_applied_once_and_acked() {
    let f = fixture().await;
    let d = f.message(&Job::ok());
    let tag = d.tag;
    f.run(d).await;
    assert_eq!(f.broker.acked(), [(tag, false)]);
    assert!(f.broker.published().is_empty());
    assert_eq!(f.effects().await, 1);
    assert_eq!(f.stats().applied, 1);
}

#[tokio::test]
async fn a_duplicate_is_acked_without_running_the_handler() {
    let f = fixture().await;
    let d = f.message(&Job::ok());
    let again = Delivery {
        tag: 99,
        redelivered: true,
        ..d.clone()
    };
    f.run(d).await;
    f.run(again).await;
    assert_eq!(f.effects().await, 1);
    let s = f.stats();
    assert_eq!((s.applied, s.duplicates), (1, 1));
    assert_eq!(f.broker.acked().len(), 2);
}

#[tokio::test]
async fn transient_failures_climb_the_tiers_then_apply() {
    let f = fixture().await;
    f.run(f.message(&Job {
        fail_until: 2,
        ..Job::ok()
    }))
    .await;
    assert_eq!(f.stats().retried, 1);
    f.run(f.copy_from("q.retry.100ms")).await;
    assert_eq!(f.stats().retried, 2);
    f.run(f.copy_from("q.retry.200ms")).await;
    let s = f.stats();
    assert_eq!((s.applied, s.retried, s.dead_lettered), (1, 2, 0));
    assert_eq!(f.effects().await, 1, "failed attempts rolled back");
    assert_eq!(
        f.broker.acked().len(),
        3,
        "each delivery acked after its copy"
    );
}

#[tokio::test]
async fn exhausted_retries_are_dead_lettered_with_the_attempts() {
    let f = fixture().await;
    f.run(f.message(&Job {
        fail_until: 10,
        ..Job::ok()
    }))
    .await;
    f.run(f.copy_from("q.retry.100ms")).await;
    f.run(f.copy_from("q.retry.200ms")).await;
    let record = f.record_of("q.dead-letter");
    assert_eq!(record.reason, "retries-exhausted");
    assert_eq!(record.attempts, 3);
    assert_eq!(
        record.original_exchange, "events",
        "the route of the first delivery"
    );
    assert_eq!(f.effects().await, 0);
}

#[tokio::test]
async fn permanent_failures_and_invalid_input_are_dead_lettered_at_once() {
    let f = fixture().await;
    f.run(f.message(&Job {
        permanent: true,
        ..Job::ok()
    }))
    .await;
    assert_eq!(f.record_of("q.dead-letter").reason, "permanent-failure");
    let garbage = f.delivery(
        b"not json".to_vec(),
        BasicProperties::default()
            .with_message_id("m".into())
            .with_content_type("application/json".into()),
        false,
    );
    f.run(garbage).await;
    assert_eq!(f.record_of("q.dead-letter").reason, "invalid-json");
    assert_eq!(f.stats().dead_lettered, 2);
    assert_eq!(f.effects().await, 0);
}

/// One failure is one letter, however often it is dead-lettered (the ack
/// after the dead-letter confirm lost, the message back); the same message
/// failing again after a replay is another.
#[tokio::test]
async fn a_dead_letter_carries_the_id_of_its_failure() {
    let f = fixture().await;
    let failing = Job {
        permanent: true,
        ..Job::ok()
    };
    let m = Outgoing::new(EVENT, 1, &failing).unwrap();
    let letter_of = |f: &Fixture| {
        let copy = f.copy_from("q.dead-letter");
        let headers = copy.properties.headers().clone().unwrap();
        crate::amqp::header_str(&headers, crate::headers::HEADER_LETTER_ID)
            .unwrap()
            .into_owned()
    };
    f.run(f.delivery(m.body(), m.properties(), false)).await;
    let first = letter_of(&f);
    assert_eq!(
        first,
        crate::dead_letter::letter_id("c", &m.meta().message_id, "")
    );
    f.run(f.delivery(m.body(), m.properties(), true)).await;
    assert_eq!(
        letter_of(&f),
        first,
        "the same failure, dead-lettered again"
    );

    // A replay signs its id onto the copy.
    let mut headers = m.properties().headers().clone().unwrap_or_default();
    headers.insert(
        crate::headers::HEADER_REPLAY_ID.into(),
        crate::amqp::text("r-1"),
    );
    f.pipeline.signer().sign(&m.meta().message_id, &mut headers);
    f.run(f.delivery(m.body(), m.properties().with_headers(headers), false))
        .await;
    assert_eq!(
        letter_of(&f),
        crate::dead_letter::letter_id("c", &m.meta().message_id, "r-1"),
        "failed again after a replay: another letter"
    );
}

#[tokio::test]
async fn a_panic_is_a_transient_failure() {
    let f = fixture().await;
    f.run(f.message(&Job {
        panic: true,
        ..Job::ok()
    }))
    .await;
    let s = f.stats();
    assert_eq!((s.panics, s.retried), (1, 1));
    assert_eq!(f.effects().await, 0);
}

#[tokio::test]
async fn redeliveries_without_outcome_become_poison() {
    let f = fixture().await;
    let d = f.message(&Job::ok());
    // Two solo runs that died before any outcome: simulated by recording them
    // the way the pipeline does, then a third arrives.
    for _ in 0..2 {
        f.pipeline
            .store
            .record_solo_run("c", d.message_id())
            .await
            .unwrap();
    }
    let id = d.message_id().to_owned();
    f.run(Delivery {
        redelivered: true,
        ..d
    })
    .await;
    assert_eq!(f.record_of("q.dead-letter").reason, "poison");
    assert_eq!(f.effects().await, 0, "the handler never ran");
    assert_eq!(calls_of(&id), 0, "not even rolled back: not called");
}

#[tokio::test]
async fn a_suspect_runs_alone_is_counted_and_applied_and_its_count_forgotten() {
    let f = fixture().await;
    let d = f.message(&Job::ok());
    let id = d.message_id().to_owned();
    f.run(Delivery {
        redelivered: true,
        ..d
    })
    .await;
    let s = f.stats();
    assert_eq!((s.applied, s.solo_runs, s.suspects_waiting), (1, 1, 0));
    assert_eq!(
        f.solo_runs_recorded(&id).await,
        0,
        "cleared with the commit"
    );
}

#[tokio::test]
async fn a_first_delivery_is_no_suspect_and_leaves_no_record() {
    let f = fixture().await;
    let d = f.message(&Job::ok());
    let id = d.message_id().to_owned();
    f.run(d).await;
    assert_eq!((f.stats().applied, f.stats().solo_runs), (1, 0));
    assert_eq!(f.solo_runs_recorded(&id).await, 0);
}

#[tokio::test]
async fn a_suspect_that_outruns_its_solo_deadline_counts_like_a_crash() {
    let f = fixture().await;
    let d = f.message(&Job {
        hang_ms: 10_000,
        ..Job::ok()
    });
    let (id, tag) = (d.message_id().to_owned(), d.tag);
    let suspect = Delivery {
        redelivered: true,
        ..d
    };
    f.run(suspect.clone()).await;
    assert_eq!(f.broker.requeued(), [tag], "the delivery itself goes back");
    assert!(f.broker.acked().is_empty());
    assert_eq!(f.effects().await, 0, "rolled back");
    assert_eq!(f.solo_runs_recorded(&id).await, 1, "the run counts");
    // Poison limit 2: one more timed-out run, then the next is dead-lettered.
    f.run(suspect.clone()).await;
    f.run(suspect).await;
    assert_eq!(f.record_of("q.dead-letter").reason, "poison");
    assert_eq!(f.effects().await, 0);
    assert_eq!(
        f.solo_runs_recorded(&id).await,
        0,
        "forgotten once it moved on"
    );
}

#[tokio::test]
async fn a_transient_failure_of_a_suspect_moves_on_and_forgets_its_runs() {
    let f = fixture().await;
    let d = f.message(&Job {
        fail_until: 1,
        ..Job::ok()
    });
    let id = d.message_id().to_owned();
    f.run(Delivery {
        redelivered: true,
        ..d
    })
    .await;
    assert_eq!(f.stats().retried, 1);
    assert_eq!(f.solo_runs_recorded(&id).await, 0);
}

#[tokio::test]
async fn an_unreachable_retry_queue_puts_the_message_back() {
    let f = fixture().await;
    f.broker.refuse("q.retry.100ms");
    f.run(f.message(&Job {
        fail_until: 1,
        ..Job::ok()
    }))
    .await;
    assert_eq!(f.stats().returned, 1);
    let back = f.copy_from("q");
    assert_eq!(f.broker.acked().len(), 1, "acked once the copy is in q");
    // The copy back carries no attempt: the failed attempt is retried afresh.
    f.run(back).await;
    assert_eq!(f.stats().returned, 2, "the tier still refuses");
}

#[tokio::test]
async fn when_the_main_queue_refuses_too_the_delivery_is_nacked() {
    let f = fixture().await;
    f.broker.refuse("q.dead-letter");
    f.broker.refuse("q");
    let d = f.message(&Job {
        permanent: true,
        ..Job::ok()
    });
    let tag = d.tag;
    f.run(d).await;
    assert_eq!(f.broker.requeued(), [tag]);
    assert!(f.broker.acked().is_empty());
}

#[tokio::test]
async fn a_database_outage_returns_the_message_without_an_attempt_and_pauses_intake() {
    let f = fixture().await;
    f.pipeline.store.pool().close().await;
    f.run(f.message(&Job::ok())).await;
    let back = f.copy_from("q");
    assert!(
        back.properties
            .headers()
            .as_ref()
            .is_none_or(|h| !h.contains_key(HEADER_ATTEMPT)),
        "no attempt used"
    );
    assert_eq!(f.stats().returned, 1);
    assert!(
        !f.pipeline.telemetry.stats().health().database,
        "intake pauses"
    );
    assert_eq!(f.broker.acked().len(), 1);
}

#[tokio::test]
async fn shutdown_drain_acks_what_finishes_and_abandons_the_rest() {
    let f = Arc::new(fixture().await);
    let mut in_flight = tokio::task::JoinSet::new();
    let quick = f.message(&Job::ok());
    let quick_tag = quick.tag;
    let f2 = Arc::clone(&f);
    in_flight.spawn(async move { f2.run(quick).await });
    in_flight.spawn(async {
        // A handler that never ends.
        std::future::pending::<()>().await;
    });
    // Real time: SQLite's pool would time out under paused time.
    crate::shutdown::drain(&mut in_flight, Duration::from_millis(500)).await;
    assert!(in_flight.is_empty(), "the hung task was abandoned");
    assert_eq!(
        f.broker.acked(),
        [(quick_tag, false)],
        "only the finished one"
    );
}

impl Fixture {
    async fn run_together(&self, deliveries: Vec<Delivery>) -> Vec<Outcome> {
        let batch = Batch {
            deliveries,
            alone: false,
        };
        self.pipeline.run(self.broker.as_ref(), batch).await
    }

    fn with_config(
        mut self,
        f: impl FnOnce(ConsumerConfigBuilder) -> ConsumerConfigBuilder,
    ) -> Self {
        self.pipeline.config = f(self.pipeline.config.to_builder()).build().unwrap();
        self
    }
}

use crate::config::ConsumerConfigBuilder;

#[tokio::test]
async fn a_batch_commits_once_and_is_acked_with_one_multiple_ack() {
    let f = fixture().await;
    let batch: Vec<Delivery> = (0..5).map(|_| f.message(&Job::ok())).collect();
    let top = batch.last().unwrap().tag;
    let outcomes = f.run_together(batch).await;
    assert_eq!(outcomes, [Outcome::Applied; 5]);
    assert_eq!(f.effects().await, 5);
    assert_eq!(f.broker.acked(), [(top, true)]);
    let s = f.stats();
    assert_eq!((s.applied, s.batches, s.batched), (5, 1, 5));
}

#[tokio::test]
async fn a_failing_message_in_the_middle_of_a_batch_fails_alone() {
    let f = fixture().await;
    let mut batch: Vec<Delivery> = (0..5).map(|_| f.message(&Job::ok())).collect();
    batch[2] = f.message(&Job {
        fail_until: 1,
        ..Job::ok()
    });
    let failing = batch[2].tag;
    let outcomes = f.run_together(batch).await;
    assert_eq!(
        outcomes,
        [
            Outcome::Applied,
            Outcome::Applied,
            Outcome::Retried,
            Outcome::Applied,
            Outcome::Applied
        ],
        "each delivery's outcome in its place"
    );
    assert_eq!(f.effects().await, 4, "the failing one rolled back alone");
    let s = f.stats();
    assert_eq!((s.applied, s.retried), (4, 1));
    // Its retry comes back and applies: it was never claimed for good.
    f.run(f.copy_from("q.retry.100ms")).await;
    assert_eq!(f.effects().await, 5);
    assert!(
        f.broker.acked().iter().any(|&(t, _)| t == failing),
        "the failing delivery is acked once its copy is confirmed"
    );
}

#[tokio::test]
async fn a_panic_in_a_batch_poisons_nothing_else() {
    let f = fixture().await;
    let mut batch: Vec<Delivery> = (0..4).map(|_| f.message(&Job::ok())).collect();
    batch[1] = f.message(&Job {
        panic: true,
        ..Job::ok()
    });
    let outcomes = f.run_together(batch).await;
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Applied).count(),
        3
    );
    assert_eq!(f.effects().await, 3);
    let s = f.stats();
    assert_eq!(
        (s.applied, s.retried, s.panics),
        (3, 1, 1),
        "one panic counted once"
    );
}

#[tokio::test]
async fn two_copies_of_one_message_in_a_batch_apply_once() {
    let f = fixture().await;
    let first = f.message(&Job::ok());
    let copy = Delivery {
        tag: 50,
        ..first.clone()
    };
    let other = f.message(&Job::ok());
    let outcomes = f.run_together(vec![first, other, copy]).await;
    assert_eq!(
        outcomes,
        [Outcome::Applied, Outcome::Applied, Outcome::Duplicate]
    );
    assert_eq!(f.effects().await, 2);
}

#[tokio::test]
async fn a_copy_behind_a_failing_original_in_a_batch_still_applies_once() {
    let f = fixture().await;
    let failing = f.message(&Job {
        fail_until: 1,
        ..Job::ok()
    });
    let copy = Delivery {
        tag: 60,
        ..failing.clone()
    };
    f.run_together(vec![failing, f.message(&Job::ok()), copy])
        .await;
    // The original failed on its first attempt and the copy (also a first
    // attempt) failed the same way: both went to the retry tier, nothing applied.
    assert_eq!(f.effects().await, 1);
    f.run(f.copy_from("q.retry.100ms")).await;
    f.run(f.copy_from("q.retry.100ms")).await;
    assert_eq!(f.effects().await, 2, "one message id, applied once");
}

#[tokio::test]
async fn a_batch_past_its_time_limit_commits_what_ran_and_leaves_the_rest() {
    let f = fixture()
        .await
        .with_config(|c| c.with_batch_time_limit(30 * MS));
    let slow = Job {
        hang_ms: 20,
        ..Job::ok()
    };
    let batch: Vec<Delivery> = (0..6).map(|_| f.message(&slow)).collect();
    let outcomes = f.run_together(batch).await;
    assert_eq!(outcomes, [Outcome::Applied; 6]);
    assert_eq!(f.effects().await, 6);
    let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM warren_inbox")
        .fetch_one(f.pipeline.store.pool())
        .await
        .unwrap();
    assert_eq!(
        inbox, 6,
        "claims of the rest were taken back, then made again"
    );
    let s = f.stats();
    assert!(s.batches >= 2, "cut into several transactions: {s:?}");
}

fn with_savepoints(c: ConsumerConfigBuilder) -> ConsumerConfigBuilder {
    c.with_batch_isolation(crate::config::BatchIsolation::Savepoints {
        handler_savepoints: 0,
    })
}

#[tokio::test]
async fn with_savepoints_a_failing_message_rolls_back_alone_in_the_same_transaction() {
    let f = fixture().await.with_config(with_savepoints);
    let mut batch: Vec<Delivery> = (0..5).map(|_| f.message(&Job::ok())).collect();
    batch[2] = f.message(&Job {
        fail_until: 1,
        ..Job::ok()
    });
    batch[4] = f.message(&Job {
        permanent: true,
        ..Job::ok()
    });
    let outcomes = f.run_together(batch).await;
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Applied).count(),
        3
    );
    assert_eq!(
        f.effects().await,
        3,
        "both failures rolled back to their savepoints"
    );
    let s = f.stats();
    assert_eq!(
        (s.applied, s.retried, s.dead_lettered, s.batches, s.batched),
        (3, 1, 1, 1, 3),
        "one transaction, nothing replayed: {s:?}"
    );
    // The retry comes back and applies: its claim went with its savepoint.
    f.run(f.copy_from("q.retry.100ms")).await;
    assert_eq!(f.effects().await, 4);
}

#[tokio::test]
async fn with_savepoints_copies_and_panics_keep_every_message_once() {
    let f = fixture().await.with_config(with_savepoints);
    let first = f.message(&Job::ok());
    let copy = Delivery {
        tag: 70,
        ..first.clone()
    };
    let panicking = f.message(&Job {
        panic: true,
        ..Job::ok()
    });
    let other = f.message(&Job::ok());
    let outcomes = f.run_together(vec![first, panicking, other, copy]).await;
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Applied).count(),
        2,
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == Outcome::Duplicate)
            .count(),
        1,
        "{outcomes:?}"
    );
    assert_eq!(f.effects().await, 2);
    let s = f.stats();
    assert_eq!((s.retried, s.panics), (1, 1), "{s:?}");
}

#[test]
fn savepoints_cap_a_batch_at_the_subtransactions_left() {
    use crate::config::{BatchIsolation, ConsumerConfig};
    let config = |handler_savepoints| {
        ConsumerConfig::builder("c", "q")
            .with_prefetch(500)
            .with_batch_size(200)
            .with_batch_isolation(BatchIsolation::Savepoints { handler_savepoints })
            .build()
    };
    assert_eq!(config(0).unwrap().batch_size(), 64);
    assert_eq!(config(3).unwrap().batch_size(), 16);
    assert_eq!(config(40).unwrap().batch_size(), 1);
    let refused = config(64).unwrap_err().to_string();
    assert!(refused.contains("batch isolation"), "{refused}");
}

#[test]
fn each_guard_cause_is_dead_lettered_under_the_reason_of_its_name() {
    use crate::broker::guard::Cause;
    for cause in [Cause::TooDeep, Cause::TooMany, Cause::Unreadable] {
        assert_eq!(reason_of(cause).as_str(), cause.as_str());
    }
}

/// A replayed copy keeps its replay id through the retry tiers, signed, and
/// its applied outcome is journaled in the transaction that applies it: a
/// careful replay waits on exactly that row.
#[tokio::test]
async fn a_replayed_copy_keeps_its_replay_id_through_retries_and_journals_its_outcome() {
    use crate::store::Journal;
    let f = fixture().await;
    let m = Outgoing::new(
        EVENT,
        1,
        &Job {
            fail_until: 1,
            ..Job::ok()
        },
    )
    .unwrap();
    let mut headers = m.properties().headers().clone().unwrap_or_default();
    headers.insert(
        crate::headers::HEADER_REPLAY_ID.into(),
        crate::amqp::text("run.1"),
    );
    f.pipeline.signer().sign(&m.meta().message_id, &mut headers);
    f.run(f.delivery(m.body(), m.properties().with_headers(headers), false))
        .await;
    let copy = f.copy_from("q.retry.100ms");
    let trusted = f.pipeline.signer().trusted(&copy.properties);
    let replay_id = trusted
        .headers()
        .as_ref()
        .and_then(|h| crate::amqp::header_str(h, crate::headers::HEADER_REPLAY_ID))
        .map(|s| s.into_owned());
    assert_eq!(replay_id.as_deref(), Some("run.1"), "signed, and kept");
    f.run(copy).await;
    assert_eq!(f.stats().applied, 1);
    let journal = f.pipeline.store.journal_of_replay("run.1").await.unwrap();
    let outcomes: Vec<&str> = journal.iter().map(|e| e.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        ["applied"],
        "written with the effect (the retried row goes through the writer, not running here)"
    );
}
