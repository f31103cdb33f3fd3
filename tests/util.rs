//! Shared test fixtures: a private database (PostgreSQL schema or SQLite file) and
//! private broker names per test, a handler with a deliberately non-idempotent
//! effect, and helpers to publish, inspect queues and wait for conditions.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, Postgres, Sqlite};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use warren::lapin::options::{
    BasicAckOptions, BasicGetOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use warren::lapin::types::FieldTable;
use warren::lapin::{self, BasicProperties, Connection, message::Delivery};
use warren::{
    Consumer, ConsumerConfig, Error, HandlerError, Message, Outgoing, PgStore, Publisher, Registry,
    RetryPolicy, SqliteStore, StatsHandle, Store, Tx,
};

pub const EVENT: &str = "test.job";

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn pg_admin_url() -> String {
    std::env::var("WARREN_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A short random name unique to one test.
pub fn unique(prefix: &str) -> String {
    // The tail of a UUIDv7 is random; its head is the clock.
    let id = uuid::Uuid::now_v7().simple().to_string();
    format!("{prefix}_{}", &id[id.len() - 12..])
}

/// Polls `check` until it is true or `timeout` passes; returns the last answer.
pub async fn wait_for<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the test handler does with a message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Mode {
    /// Record the effect.
    Ok,
    /// Record the effect, then fail permanently (the record must roll back).
    Permanent,
    /// Record the effect and fail transiently on the first `n` attempts.
    Transient { n: u32 },
    /// Record the effect and panic on the first attempt.
    PanicOnce,
    /// Sleep `ms` on the first attempt only, then record the effect.
    SlowOnce { ms: u64 },
    /// Fail transiently on the first attempt, asking to be retried after `ms`.
    TransientAfter { ms: u64 },
    /// Abort the process: a message that kills whoever handles it.
    Abort,
    /// Fail permanently while `switch` is in the broken set, then succeed.
    PermanentWhileBroken { switch: String },
    /// Run a failing statement, ignore its error, and report success.
    SwallowError,
    /// Write an outbox event whose event type no AMQP property can carry, and
    /// pass on the outbox's refusal.
    EmitUnpublishable,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub mode: Mode,
    /// Sleep this long before doing anything, on every attempt.
    #[serde(default)]
    pub delay_ms: u64,
    /// Write this many outbox events (event type `test.out`) to `emit_to`, with
    /// routing key `out.event`, before anything can fail.
    #[serde(default)]
    pub emit: u32,
    #[serde(default)]
    pub emit_to: String,
}

impl Job {
    pub fn ok() -> Self {
        Job::with(Mode::Ok)
    }
    pub fn with(mode: Mode) -> Self {
        Job {
            mode,
            delay_ms: 0,
            emit: 0,
            emit_to: String::new(),
        }
    }
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
    pub job: Job,
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
// Only the CLI's tests (crates/warren-cli/tests, which share this file) call it.
#[allow(dead_code)]
pub fn set_broken(switch: &str, broken: bool) {
    let mut set = BROKEN.lock().unwrap();
    if broken {
        set.insert(switch.to_owned());
    } else {
        set.remove(switch);
    }
}

/// A database dialect under test.
pub trait Backend: warren::Dialect {
    type S: warren::OutboxStore + Store<Db = Self>;
    const NAME: &'static str;
    /// A fresh, private database with warren migrated and the effects table.
    fn create() -> impl Future<Output = TestDb<Self>> + Send;
    /// Opens a store on a URL produced by `create`.
    fn open(url: &str) -> impl Future<Output = Self::S> + Send;
    /// The non-idempotent effect: one new row per call.
    fn insert_effect<'a>(
        tx: &'a mut Tx<Self>,
        message_id: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
    /// The store's pool.
    fn pool(store: &Self::S) -> &sqlx::Pool<Self>;
    /// Runs a `SELECT count(...)` inside `tx`.
    fn count_in<'a>(
        tx: &'a mut Tx<Self>,
        sql: &'static str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;
    /// Runs a `SELECT count(...)` query.
    fn count(store: &Self::S, sql: String) -> impl Future<Output = i64> + Send;
    /// Runs a statement.
    fn exec(store: &Self::S, sql: String) -> impl Future<Output = ()> + Send;
}

pub struct TestDb<B: Backend> {
    pub store: B::S,
    /// A URL another process can open the same database with.
    // Read only by the crash tests, which need the `failpoints` feature; the CLI's
    // tests share this file from a package that has no such feature to test for.
    #[allow(dead_code)]
    pub url: String,
    cleanup: Cleanup,
}

enum Cleanup {
    Schema(String),
    Dir(#[allow(dead_code)] tempfile::TempDir),
}

impl<B: Backend> TestDb<B> {
    pub async fn effects(&self) -> i64 {
        B::count(&self.store, "SELECT count(*) FROM test_effects".into()).await
    }
    pub async fn distinct_effects(&self) -> i64 {
        B::count(
            &self.store,
            "SELECT count(DISTINCT message_id) FROM test_effects".into(),
        )
        .await
    }
    pub async fn effects_for(&self, message_id: &str) -> i64 {
        B::count(
            &self.store,
            format!("SELECT count(*) FROM test_effects WHERE message_id = '{message_id}'"),
        )
        .await
    }
    pub async fn inbox(&self, consumer: &str) -> i64 {
        B::count(
            &self.store,
            format!("SELECT count(*) FROM warren_inbox WHERE consumer_name = '{consumer}'"),
        )
        .await
    }
    pub async fn drop_db(self) {
        if let Cleanup::Schema(schema) = &self.cleanup {
            let admin = sqlx::PgPool::connect(&pg_admin_url()).await.unwrap();
            sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .execute(&admin)
                .await
                .unwrap();
        }
    }
}

const EFFECTS_PG: &str =
    "CREATE TABLE test_effects (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL)";
const EFFECTS_SQLITE: &str =
    "CREATE TABLE test_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL)";

impl Backend for Postgres {
    type S = PgStore;
    const NAME: &'static str = "postgres";

    async fn create() -> TestDb<Self> {
        let schema = unique("wt");
        let admin = sqlx::PgPool::connect(&pg_admin_url()).await.unwrap();
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        let base = pg_admin_url();
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-c%20search_path%3D{schema}");
        let store = Self::open(&url).await;
        store.migrate().await.unwrap();
        sqlx::query(EFFECTS_PG).execute(store.pool()).await.unwrap();
        TestDb {
            store,
            url,
            cleanup: Cleanup::Schema(schema),
        }
    }

    async fn open(url: &str) -> PgStore {
        PgStore::connect(url, 12).await.unwrap()
    }

    async fn insert_effect(tx: &mut Tx<Self>, message_id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO test_effects (message_id) VALUES ($1)")
            .bind(message_id)
            .execute(tx.conn())
            .await?;
        Ok(())
    }

    fn pool(store: &PgStore) -> &sqlx::Pool<Self> {
        store.pool()
    }

    async fn count_in(tx: &mut Tx<Self>, sql: &'static str) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(sql).fetch_one(tx.conn()).await
    }

    async fn count(store: &PgStore, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    async fn exec(store: &PgStore, sql: String) {
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }
}

impl Backend for Sqlite {
    type S = SqliteStore;
    const NAME: &'static str = "sqlite";

    async fn create() -> TestDb<Self> {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("test.db").display());
        let store = Self::open(&url).await;
        store.migrate().await.unwrap();
        sqlx::query(EFFECTS_SQLITE)
            .execute(store.pool())
            .await
            .unwrap();
        TestDb {
            store,
            url,
            cleanup: Cleanup::Dir(dir),
        }
    }

    async fn open(url: &str) -> SqliteStore {
        SqliteStore::connect(url).await.unwrap()
    }

    async fn insert_effect(tx: &mut Tx<Self>, message_id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO test_effects (message_id) VALUES (?)")
            .bind(message_id)
            .execute(tx.conn())
            .await?;
        Ok(())
    }

    fn pool(store: &SqliteStore) -> &sqlx::Pool<Self> {
        store.pool()
    }

    async fn count_in(tx: &mut Tx<Self>, sql: &'static str) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(sql).fetch_one(tx.conn()).await
    }

    async fn count(store: &SqliteStore, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    async fn exec(store: &SqliteStore, sql: String) {
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
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
    }
}

/// Short retry tiers, so tests are quick: 100 ms, 200 ms, 400 ms (four attempts).
pub const TEST_TIERS: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
];

/// Deliveries without an outcome before a message is poison, in tests.
pub const TEST_POISON_LIMIT: u32 = 3;

/// A consumer configuration with short delays, so tests are quick.
pub fn test_config(name: &str, queue: &str, exchange: &str) -> ConsumerConfig {
    ConsumerConfig::new(name, queue)
        .bind(exchange, ["test.#"])
        .with_retry(RetryPolicy::new(TEST_TIERS).with_poison_limit(TEST_POISON_LIMIT))
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

pub fn routes<B: Backend>() -> Registry<B> {
    Registry::new()
        .route(EVENT, 1, job::<B>)
        .route(EVENT, 2, job_v2::<B>)
        .route(OUT_EVENT, 1, out_event::<B>)
}

/// A test's broker names and a connection to inspect and publish with.
pub struct TestBroker {
    pub exchange: String,
    pub queue: String,
    pub name: String,
    pub connection: Arc<Connection>,
    pub publisher: Publisher,
    pub extra_queues: Mutex<Vec<String>>,
}

impl TestBroker {
    pub async fn new() -> Self {
        let base = unique("wt");
        let connection = Arc::new(warren::connect(&amqp_url(), "warren tests").await.unwrap());
        TestBroker {
            exchange: format!("{base}.events"),
            queue: format!("{base}.jobs"),
            name: format!("{base}-consumer"),
            publisher: Publisher::new(Arc::clone(&connection)),
            connection,
            extra_queues: Mutex::new(Vec::new()),
        }
    }

    /// The default test consumer configuration.
    pub fn config(&self) -> ConsumerConfig {
        test_config(&self.name, &self.queue, &self.exchange)
    }

    /// Declares a queue bound to the test exchange with `out.#`, where outbox events
    /// land, and returns its name.
    pub async fn capture(&self) -> String {
        let config = self.downstream_config();
        for q in warren::Topology::for_consumer(&config).queue_names() {
            self.track_queue(q);
        }
        self.declare_config(&config).await;
        config.queue
    }

    /// The configuration of a downstream consumer of the capture queue.
    pub fn downstream_config(&self) -> ConsumerConfig {
        test_config(
            &format!("{}-downstream", self.name),
            &format!("{}.capture", self.queue),
            &self.exchange,
        )
        .bind(&self.exchange, ["out.#"])
    }

    /// Remembers another queue to delete at cleanup.
    pub fn track_queue(&self, name: &str) {
        self.extra_queues.lock().unwrap().push(name.to_owned());
    }

    pub fn dead_letter_queue(&self) -> String {
        warren::dead_letter_queue_name(&self.queue)
    }

    /// Declares the default test consumer's topology, so publishes before the
    /// consumer starts are routed.
    pub async fn declare(&self) {
        self.declare_config(&self.config()).await;
    }

    pub async fn declare_config(&self, config: &ConsumerConfig) {
        let channel = self.connection.create_channel().await.unwrap();
        warren::declare(&channel, &warren::Topology::for_consumer(config))
            .await
            .unwrap();
        let _ = channel.close(200, "ok".into()).await;
    }

    /// Builds a valid message of version 1.
    pub fn message(job: &Job) -> Outgoing {
        Outgoing::new(EVENT, 1, job).unwrap()
    }

    pub async fn publish(&self, message: &Outgoing) {
        self.publisher
            .publish(&self.exchange, "test.job", message)
            .await
            .unwrap();
    }

    pub async fn publish_raw(&self, body: &[u8], properties: BasicProperties) {
        self.publisher
            .publish_raw(&self.exchange, "test.job", body, properties)
            .await
            .unwrap();
    }

    /// Ready messages in `queue` (not counting unacked ones).
    pub async fn ready(&self, queue: &str) -> u32 {
        self.passive(queue).await.message_count()
    }

    /// Consumers subscribed to `queue`.
    pub async fn consumers(&self, queue: &str) -> u32 {
        self.passive(queue).await.consumer_count()
    }

    async fn passive(&self, queue: &str) -> lapin::Queue {
        // A fresh channel: a passive declare of a missing queue closes its channel.
        let channel = self.connection.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = channel.close(200, "ok".into()).await;
        q
    }

    /// Takes every message from `queue` (acking each).
    pub async fn drain(&self, queue: &str) -> Vec<Delivery> {
        let channel = self.connection.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Some(msg) = channel
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            msg.delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .unwrap();
            out.push(msg.delivery);
        }
        let _ = channel.close(200, "ok".into()).await;
        out
    }

    pub async fn delete_queue(&self, queue: &str) {
        let channel = self.connection.create_channel().await.unwrap();
        let _ = channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
        let _ = channel.close(200, "ok".into()).await;
    }

    pub async fn cleanup(self) {
        let mut queues: Vec<String> = warren::Topology::for_consumer(&self.config())
            .queue_names()
            .map(String::from)
            .collect();
        queues.extend(self.extra_queues.lock().unwrap().drain(..));
        for q in &queues {
            self.delete_queue(q).await;
        }
        let channel = self.connection.create_channel().await.unwrap();
        let _ = channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.connection.close(200, "ok".into()).await;
    }
}

/// A consumer running in the background of a test.
pub struct Running {
    pub stats: StatsHandle,
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<(), Error>>,
}

impl Running {
    pub fn start<S: Store>(consumer: Consumer<S>) -> Self {
        Self::spawn(consumer.stats(), |stopped| async move {
            consumer.run(&amqp_url(), stopped).await
        })
    }

    /// Starts `consumer` with an outbox relay beside it (`run_with_relay`).
    pub fn start_with_relay<S: warren::OutboxStore>(
        consumer: Consumer<S>,
        relay: warren::RelayConfig,
    ) -> Self {
        Self::spawn(consumer.stats(), |stopped| async move {
            consumer.run_with_relay(&amqp_url(), relay, stopped).await
        })
    }

    /// Spawns what `run` makes of the shutdown future.
    fn spawn<F, Fut>(stats: StatsHandle, run: F) -> Self
    where
        F: FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
        Fut: Future<Output = Result<(), Error>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(run(Box::pin(async {
            let _ = stopped.await;
        })));
        Running {
            stats,
            stop: Some(stop),
            handle,
        }
    }

    /// True while `run` has not returned (nothing stopped the consumer).
    pub fn is_running(&self) -> bool {
        !self.handle.is_finished()
    }

    /// Requests a graceful shutdown and waits for `run` to return.
    pub async fn stop(mut self) -> Result<(), Error> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(60), self.handle)
            .await
            .expect("consumer did not stop within 60 s")
            .expect("consumer task panicked")
    }

    /// Waits until `applied + duplicates + dead_lettered` reaches `n`.
    pub async fn settled(&self, n: u64, timeout: Duration) -> bool {
        let stats = self.stats.clone();
        wait_for(timeout, move || {
            let s = stats.snapshot();
            async move { s.applied + s.duplicates + s.dead_lettered >= n }
        })
        .await
    }
}

/// Runs the test's default consumer until `n` deliveries have settled (applied,
/// duplicate or dead-lettered), stops it, and returns its counters.
pub async fn consume_until<B: Backend>(
    db: &TestDb<B>,
    broker: &TestBroker,
    n: u64,
) -> warren::ConsumerStats {
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    assert!(
        running.settled(n, Duration::from_secs(30)).await,
        "not settled: {:?}",
        running.stats.snapshot()
    );
    let stats = running.stats.snapshot();
    running.stop().await.unwrap();
    stats
}

/// Runs a test body once per backend.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name::<sqlx::Postgres>().await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$name::<sqlx::Sqlite>().await
                }
            }
        )*
    };
}

/// A TCP proxy in front of the broker (the one `AMQP_URL` names) that can be
/// taken down and brought back, or frozen (connections stay open and nothing
/// passes, like a broker that stopped answering), to fault one client without
/// touching the shared broker.
pub struct Proxy {
    pub port: u16,
    state: tokio::sync::watch::Sender<ProxyState>,
    task: JoinHandle<()>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProxyMode {
    Up,
    Down,
    Frozen,
}

/// What new connections get (`mode`), and how many times the proxy was taken
/// down and frozen. A watch shows only its latest value, so a down and a freeze
/// in quick succession could not be told apart as signals; as counters that only
/// grow, a connection compares them with their values when it opened and sees
/// every fault that happened since, whatever it missed in between.
#[derive(Debug, Clone, Copy)]
struct ProxyState {
    mode: ProxyMode,
    downs: u64,
    freezes: u64,
}

/// A fault that reached one connection.
enum Fault {
    Down,
    Frozen,
}

/// Waits for the next fault since `opened`: a down wins over a freeze. The
/// proxy going away counts as down.
async fn next_fault(
    state: &mut tokio::sync::watch::Receiver<ProxyState>,
    opened: ProxyState,
) -> Fault {
    loop {
        let now = *state.borrow_and_update();
        if now.downs > opened.downs {
            return Fault::Down;
        }
        if now.freezes > opened.freezes {
            return Fault::Frozen;
        }
        if state.changed().await.is_err() {
            return Fault::Down;
        }
    }
}

/// Waits until the proxy is taken down after `opened` (or goes away).
async fn next_down(state: &mut tokio::sync::watch::Receiver<ProxyState>, opened: ProxyState) {
    while state.borrow_and_update().downs <= opened.downs {
        if state.changed().await.is_err() {
            return;
        }
    }
}

/// The broker's `host:port`, from `AMQP_URL`.
fn broker_address() -> String {
    let url = url::Url::parse(&amqp_url()).expect("AMQP_URL is a URL");
    let host = url.host_str().unwrap_or("127.0.0.1");
    let port = url
        .port()
        .unwrap_or(if url.scheme() == "amqps" { 5671 } else { 5672 });
    format!("{host}:{port}")
}

impl Proxy {
    pub async fn start() -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let upstream = broker_address();
        let (state, _) = tokio::sync::watch::channel(ProxyState {
            mode: ProxyMode::Up,
            downs: 0,
            freezes: 0,
        });
        let state2 = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let mut watch = state2.subscribe();
                let opened = *watch.borrow_and_update();
                let upstream = upstream.clone();
                match opened.mode {
                    ProxyMode::Down => drop(client), // refused, as a stopped broker would
                    ProxyMode::Frozen => {
                        // Accepted and never answered, until the proxy goes down.
                        tokio::spawn(async move {
                            next_down(&mut watch, opened).await;
                            drop(client);
                        });
                    }
                    ProxyMode::Up => {
                        tokio::spawn(async move {
                            let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await
                            else {
                                return;
                            };
                            let fault = tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
                                fault = next_fault(&mut watch, opened) => fault,
                            };
                            if let Fault::Frozen = fault {
                                // Both ends stay open and nothing passes.
                                next_down(&mut watch, opened).await;
                            }
                        });
                    }
                }
            }
        });
        Proxy { port, state, task }
    }

    /// `AMQP_URL` with the proxy in place of the broker.
    pub fn url(&self) -> String {
        let mut url = url::Url::parse(&amqp_url()).expect("AMQP_URL is a URL");
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(self.port)).unwrap();
        url.into()
    }

    /// Cuts every connection and refuses new ones.
    pub fn down(&self) {
        self.state.send_modify(|s| {
            s.mode = ProxyMode::Down;
            s.downs += 1;
        });
    }

    /// Stops passing bytes on every connection without closing any, and accepts
    /// new ones without ever answering.
    pub fn freeze(&self) {
        self.state.send_modify(|s| {
            s.mode = ProxyMode::Frozen;
            s.freezes += 1;
        });
    }

    /// Accepts and forwards new connections again.
    pub fn up(&self) {
        self.state.send_modify(|s| s.mode = ProxyMode::Up);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.down();
        self.task.abort();
    }
}

#[cfg(test)]
mod proxy_tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Regression (issue 10): `down()` sent two watch signals in a row to close
    /// frozen connections, and a watch may deliver them as one, which left those
    /// connections frozen instead of closed. A freeze followed at once by a down
    /// now closes every connection, frozen or not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn down_right_after_freeze_closes_connections() {
        for _ in 0..20 {
            let proxy = Proxy::start().await;
            let mut open = tokio::net::TcpStream::connect(("127.0.0.1", proxy.port))
                .await
                .unwrap();
            // The AMQP header: the broker answers with connection.start.
            open.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
            let mut buf = [0u8; 7];
            open.read_exact(&mut buf).await.unwrap();
            proxy.freeze();
            let mut frozen = tokio::net::TcpStream::connect(("127.0.0.1", proxy.port))
                .await
                .unwrap();
            tokio::task::yield_now().await;
            proxy.down();
            for stream in [&mut open, &mut frozen] {
                let mut rest = Vec::new();
                let closed =
                    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest))
                        .await;
                assert!(closed.is_ok(), "a connection stayed open after down()");
            }
        }
    }

    #[test]
    fn the_proxy_forwards_to_the_broker_amqp_url_names() {
        let url = url::Url::parse(&amqp_url()).unwrap();
        assert!(broker_address().ends_with(&format!(":{}", url.port().unwrap_or(5672))));
    }
}
