//! The test handler and its payloads: a job says how the handler behaves, and
//! the handler writes a non-idempotent effect before it fails (if it does), so a
//! failure that does not roll back shows up as an extra row. Also the routes and
//! the quick consumer configuration the tests run with.

use std::collections::{HashMap, HashSet};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use warren::config::ConsumerConfigBuilder;
use warren::retry::RetryPolicy;
use warren::{ConsumerConfig, HandlerError, Message, Outgoing, Registry, Tx};

use crate::db::Backend;

/// The event type of the test handler's messages.
pub const EVENT: &str = "test.job";

/// What the test handler does with a message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Mode {
    /// Record the effect.
    Ok,
    /// Record the effect, then fail permanently (the record must roll back).
    Permanent,
    /// Record the effect and fail transiently on the first `n` attempts.
    Transient {
        /// The attempts that fail.
        n: u32,
    },
    /// Record the effect and panic on the first attempt.
    PanicOnce,
    /// Sleep `ms` on the first attempt only, then record the effect.
    SlowOnce {
        /// How long the first attempt sleeps.
        ms: u64,
    },
    /// Fail transiently on the first attempt, asking to be retried after `ms`.
    TransientAfter {
        /// The retry delay asked for.
        ms: u64,
    },
    /// Abort the process: a message that kills whoever handles it.
    Abort,
    /// Fail permanently while `switch` is in the broken set, then succeed.
    PermanentWhileBroken {
        /// The switch `break_jobs` sets and clears.
        switch: String,
    },
    /// Run a failing statement, ignore its error, and report success.
    SwallowError,
    /// Write an outbox event whose event type no AMQP property can carry, and
    /// pass on the outbox's refusal.
    EmitUnpublishable,
    /// In a batch handler: fail the whole batch (transiently) whenever this
    /// message is in it.
    FailBatch,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
/// The test message: what the handler does with it.
pub struct Job {
    /// What the handler does.
    pub mode: Mode,
    /// Sleep this long before doing anything, on every attempt.
    #[serde(default)]
    pub delay_ms: u64,
    /// Write this many outbox events (event type `test.out`) to `emit_to`, with
    /// routing key `out.event`, before anything can fail.
    #[serde(default)]
    pub emit: u32,
    #[serde(default)]
    /// The exchange `emit` writes to.
    pub emit_to: String,
}

impl Job {
    /// A job that records its effect.
    pub fn ok() -> Self {
        Job::with(Mode::Ok)
    }
    /// A job in `mode`, with no delay and no events.
    pub fn with(mode: Mode) -> Self {
        Job {
            mode,
            delay_ms: 0,
            emit: 0,
            emit_to: String::new(),
        }
    }
    /// A job that sleeps `ms` on every attempt, then records its effect.
    pub fn slow(ms: u64) -> Self {
        Job {
            delay_ms: ms,
            ..Job::ok()
        }
    }
    /// Also writes `n` outbox events to `exchange`.
    pub fn emitting(mut self, n: u32, exchange: &str) -> Self {
        self.emit = n;
        self.emit_to = exchange.to_owned();
        self
    }
}

/// Version 2 of the job: a different payload shape, handled side by side.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobV2 {
    /// What the handler does.
    pub job: Job,
    /// A field version 1 did not have.
    pub note: String,
}

static ATTEMPTS: LazyLock<Mutex<HashMap<String, Vec<Instant>>>> = LazyLock::new(Default::default);
static REPORTED: LazyLock<Mutex<HashMap<String, Vec<u32>>>> = LazyLock::new(Default::default);
static BROKEN: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

/// Counts attempts per message id, outside any transaction (so rollbacks do not
/// undo the count), and remembers when each began.
pub fn attempt(message_id: &str) -> u32 {
    let mut map = ATTEMPTS.lock().unwrap();
    let times = map.entry(message_id.to_owned()).or_default();
    times.push(Instant::now());
    times.len() as u32
}

/// When each attempt at `message_id` began.
pub fn attempt_times(message_id: &str) -> Vec<Instant> {
    ATTEMPTS
        .lock()
        .unwrap()
        .get(message_id)
        .cloned()
        .unwrap_or_default()
}

/// The attempt numbers the consumer passed to the handler for `message_id`.
pub fn reported_attempts(message_id: &str) -> Vec<u32> {
    REPORTED
        .lock()
        .unwrap()
        .get(message_id)
        .cloned()
        .unwrap_or_default()
}

/// Breaks or mends the jobs that name `switch`.
pub fn set_broken(switch: &str, broken: bool) {
    let mut set = BROKEN.lock().unwrap();
    if broken {
        set.insert(switch.to_owned());
    } else {
        set.remove(switch);
    }
}

/// The test handler: does what the job's mode says, with a non-idempotent effect.
pub async fn job<B: Backend>(msg: Message<Job>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    REPORTED
        .lock()
        .unwrap()
        .entry(msg.meta.message_id.clone())
        .or_default()
        .push(msg.attempt);
    run_job::<B>(&msg.payload, &msg.meta.message_id, tx).await
}

/// The version-2 handler: same effect, different payload shape.
pub async fn job_v2<B: Backend>(msg: Message<JobV2>, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    assert!(!msg.payload.note.is_empty());
    run_job::<B>(&msg.payload.job, &msg.meta.message_id, tx).await
}

async fn run_job<B: Backend>(job: &Job, id: &str, tx: &mut Tx<B>) -> Result<(), HandlerError> {
    if job.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(job.delay_ms)).await;
    }
    let n = attempt(id);
    // The effect is written before any failure, so a failure that does not roll
    // back would show up as an extra row.
    B::insert_effect(tx, id).await?;
    for i in 0..job.emit {
        let event = Outgoing::new(OUT_EVENT, 1, &serde_json::json!({ "n": i })).unwrap();
        tx.publish(&job.emit_to, "out.event", event).await.unwrap();
    }
    match job.mode {
        Mode::Ok => Ok(()),
        Mode::Permanent => Err(HandlerError::permanent("the job says it can never succeed")),
        Mode::Transient { n: fail } if n <= fail => Err(HandlerError::transient(format!(
            "attempt {n} of a flaky job"
        ))),
        Mode::Transient { .. } => Ok(()),
        Mode::PanicOnce if n == 1 => panic!("job panicked on attempt {n}"),
        Mode::PanicOnce => Ok(()),
        Mode::SlowOnce { ms } => {
            if n == 1 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Ok(())
        }
        Mode::TransientAfter { ms } if n == 1 => {
            Err(HandlerError::transient("come back later").retry_after(Duration::from_millis(ms)))
        }
        Mode::TransientAfter { .. } => Ok(()),
        Mode::Abort => std::process::abort(),
        Mode::EmitUnpublishable => {
            let event = Outgoing::new("e".repeat(300), 1, &serde_json::json!({})).unwrap();
            tx.publish(&job.emit_to, "out.event", event).await?;
            Ok(())
        }
        Mode::SwallowError => {
            let _ = B::count_in(tx, "SELECT count(*) FROM no_such_table").await;
            Ok(())
        }
        Mode::PermanentWhileBroken { ref switch } => {
            if BROKEN.lock().unwrap().contains(switch) {
                Err(HandlerError::permanent("broken until mended"))
            } else {
                Ok(())
            }
        }
        // A batch handler's mode; a handler of one message has no batch.
        Mode::FailBatch => Ok(()),
    }
}

/// Short retry tiers, so tests are quick: 100 ms, 200 ms, 400 ms (four attempts).
pub const TEST_TIERS: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
];

/// Deaths while a message ran alone before it is poison, in tests.
pub const TEST_POISON_LIMIT: u32 = 3;

/// The tests' short retry tiers, with `poison_limit` deaths alone before poison.
pub fn test_retry(poison_limit: u32) -> RetryPolicy {
    RetryPolicy::new(TEST_TIERS).with_poison_limit(poison_limit)
}

/// A consumer configuration with short delays, so tests are quick.
pub fn test_config(name: &str, queue: &str, exchange: &str) -> ConsumerConfigBuilder {
    ConsumerConfig::builder(name, queue)
        .bind(exchange, ["test.#"])
        .with_retry(test_retry(TEST_POISON_LIMIT))
        .with_failure_backoff(Duration::from_millis(200))
        .with_shutdown_timeout(Duration::from_secs(10))
}

/// The event type the test handler writes to the outbox.
pub const OUT_EVENT: &str = "test.out";

/// A downstream handler for outbox events: records one effect per message.
pub async fn out_event<B: Backend>(
    msg: Message<serde_json::Value>,
    tx: &mut Tx<B>,
) -> Result<(), HandlerError> {
    B::insert_effect(tx, &msg.meta.message_id).await?;
    Ok(())
}

/// The batch handler: every job of the batch counted, its effect written
/// for every message in one statement before anything can fail, the outbox
/// events of all of them in one statement; then each job's mode decides,
/// per message, what failed. A panic or a `FailBatch` job fails the batch as
/// a whole.
pub async fn job_batch<B: Backend>(
    batch: warren::Batch<Job>,
    tx: &mut Tx<B>,
) -> warren::BatchResult {
    let mut failed = Vec::new();
    let mut panics = false;
    let mut fail_batch = false;
    for msg in &batch {
        let n = attempt(&msg.meta.message_id);
        REPORTED
            .lock()
            .unwrap()
            .entry(msg.meta.message_id.clone())
            .or_default()
            .push(msg.attempt);
        match msg.payload.mode {
            Mode::Permanent => failed.push((
                msg,
                HandlerError::permanent("the job says it can never succeed"),
            )),
            Mode::Transient { n: fail } if n <= fail => failed.push((
                msg,
                HandlerError::transient(format!("attempt {n} of a flaky job")),
            )),
            Mode::PanicOnce if n == 1 => panics = true,
            Mode::FailBatch => fail_batch = true,
            _ => {}
        }
    }
    let ids: Vec<String> = batch.iter().map(|m| m.meta.message_id.clone()).collect();
    BATCH_CALLS.lock().unwrap().push(ids.clone());
    B::insert_effects(tx, &ids).await?;
    let events: Vec<_> = batch
        .iter()
        .flat_map(|m| {
            (0..m.payload.emit).map(move |i| {
                let event = Outgoing::new(OUT_EVENT, 1, &serde_json::json!({ "n": i })).unwrap();
                (m, event)
            })
        })
        .collect();
    if let Some((first, _)) = events.first() {
        let exchange = first.payload.emit_to.clone();
        tx.publish_all(&exchange, "out.event", events)
            .await
            .unwrap();
    }
    if panics {
        panic!("a job of the batch panicked on its first attempt");
    }
    if fail_batch {
        return Err(warren::BatchError::all(HandlerError::transient(
            "a job fails every batch it is in",
        )));
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(warren::BatchError::messages(failed))
    }
}

static BATCH_CALLS: LazyLock<Mutex<Vec<Vec<String>>>> = LazyLock::new(Default::default);

/// The sizes of the batches [`job_batch`] was called with whose messages are
/// among `ids` (a test's own), in the order of the calls.
pub fn batch_calls_of(ids: &HashSet<String>) -> Vec<usize> {
    BATCH_CALLS
        .lock()
        .unwrap()
        .iter()
        .filter(|call| call.iter().any(|id| ids.contains(id)))
        .map(Vec::len)
        .collect()
}

/// Routes version 1 of the job to the batch handler.
pub fn batch_routes<B: Backend>() -> Registry<B> {
    Registry::new()
        .route_batch(EVENT, 1, job_batch::<B>)
        .route(OUT_EVENT, 1, out_event::<B>)
}

/// The test consumer's routes: the job handler for versions 1 and 2, and the handler of
/// the events it writes.
pub fn routes<B: Backend>() -> Registry<B> {
    Registry::new()
        .route(EVENT, 1, job::<B>)
        .route(EVENT, 2, job_v2::<B>)
        .route(OUT_EVENT, 1, out_event::<B>)
}
