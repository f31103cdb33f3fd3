//! warren: RabbitMQ consumers that stay correct under at-least-once delivery.
//!
//! A message may arrive twice, a process may die between its database commit and
//! its ack, a producer may send garbage. warren makes each of those normal: every
//! delivery is validated, claimed in a transactional inbox in the same database
//! transaction as the handler's writes, and acked only after that commit. The
//! business effect is applied once; nothing is silently lost; every failure is
//! visible.
//!
//! ```text
//! deliver -> validate -> BEGIN; claim inbox (consumer, message_id); handler; COMMIT -> ack
//! ```
//!
//! # Layout
//!
//! - `envelope`: parse and validate what arrives ([`Envelope`]).
//! - `outgoing`: build what leaves, with its AMQP properties ([`Outgoing`]).
//! - `handler`: the handler API: [`Message`], the [`Handler`] trait every `async fn` fits.
//! - `registry`: the allowlist from `(event type, schema version)` to handler ([`Registry`]).
//! - `failure`: the failure taxonomy: [`HandlerError`], [`DeadLetterReason`].
//! - `retention`: how long the inbox must remember, and purging it ([`purge_inbox`]).
//! - `retry`: delay tiers, attempt and poison limits as data ([`RetryPolicy`]).
//! - `store`: the inbox and the handler's transaction ([`Store`], [`Tx`], [`PgStore`], [`SqliteStore`]).
//! - `outbox`: outgoing messages written in the business transaction ([`outbox::enqueue`], [`Tx::publish`]).
//! - `outbox_row`: the rows of `warren_outbox`, shared by the outbox, the store and the relay.
//! - `relay`: publishes committed outbox rows with confirms ([`Relay`]).
//! - `relay_config`: a relay's settings ([`RelayConfig`]).
//! - `beside`: the relay run beside a consumer, supervised ([`Consumer::run_with_relay`]).
//! - `config`: a consumer's settings, checked in one place ([`ConsumerConfig`]).
//! - `config_error`: which setting is wrong and why ([`ConfigError`]).
//! - `consumer`: reconnection, intake and the relay beside it ([`Consumer`]).
//! - `session`: one connected period with the broker, its monitor, the drain.
//! - `dispatcher`: which buffered deliveries run next; how far an ack may reach.
//! - `pipeline`: **the rule**: validate, claim, handle, commit, then settle, per delivery.
//! - `disposition`: what an outcome means (ack, retry, dead-letter, return): a pure decision.
//! - `topology`: exchanges and queues as data ([`Topology`]).
//! - `broker`: every AMQP call: connections, declaring, publishing with confirms
//!   ([`Publisher`]), subscriptions, and the pipeline's port (with an in-memory double).
//! - `amqp`: AMQP values: delivery mode, the short-string limit, header readers.
//! - `tls`: `amqps://` with a private CA or a client certificate ([`TlsOptions`]).
//! - `dead_letter`: the headers a dead-lettered copy carries ([`DeadLetterInfo`]).
//! - `headers`: what a copy keeps and drops, warren's signed headers, frame-size bounds.
//! - `dlq`: list, show, replay and purge a dead-letter queue ([`DeadLetterQueue`]).
//! - `telemetry`: per-message logs, metrics and counters ([`ConsumerStats`]).
//! - `database_url`: which database a URL names, passwords redacted ([`DatabaseUrl`]).
//! - `printable`: message-derived text made safe for a terminal ([`printable`]).
//! - `idempotency`: stable keys for external calls ([`idempotency_key`]).
//! - `shutdown`: SIGTERM/SIGINT as a future ([`shutdown_signal`]).
//! - `failpoint`: crash points for crash tests (feature `failpoints`).
//! - `testing`: a test kit that runs handlers without a broker (feature `testing`).
//!
//! The guide below is the README; its examples compile as doc-tests.
#![doc = ""]
#![doc = include_str!("../README.md")]
// A build without a store serves tools that need only warren's names and types
// (warren-chaos needs the crash points); the shared store plumbing has no user
// there, and gating each piece would scatter cfgs over code that changes often.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite")),
    allow(dead_code, unused)
)]

mod amqp;
mod beside;
mod broker;
mod config;
mod config_error;
mod consumer;
mod database_url;
mod dead_letter;
mod dispatcher;
mod disposition;
mod dlq;
mod envelope;
mod error;
pub mod failpoint;
mod failure;
mod handler;
mod headers;
mod idempotency;
pub mod outbox;
mod outbox_row;
mod outgoing;
mod pipeline;
mod printable;
mod registry;
mod relay;
mod relay_config;
mod retention;
mod retry;
mod session;
mod shutdown;
mod store;
mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
mod tls;
mod topology;

pub use amqp::{MAX_SHORT_STRING_LEN, header_int, header_str};
pub use broker::{
    BatchItem, BrokerError, CALL_TIMEOUT, CONFIRM_TIMEOUT, CONNECT_TIMEOUT, Publisher, QueueInfo,
    connect, connect_with_tls, declare, delete, inspect_queue,
};
pub use config::{
    ConsumerConfig, DEFAULT_CONCURRENCY, DEFAULT_FAILURE_BACKOFF, DEFAULT_PREFETCH,
    DEFAULT_SHUTDOWN_TIMEOUT,
};
pub use config_error::ConfigError;
pub use consumer::Consumer;
pub use database_url::{DatabaseUrl, redact_url, split_url_list};
pub use dead_letter::DeadLetterInfo;
pub use dlq::{DeadLetter, DeadLetterQueue, ReplayReport, Replayed, Selection};
pub use envelope::{
    CONTENT_TYPE_JSON, DEFAULT_MAX_BODY_BYTES, Envelope, Incoming, InvalidMessage,
    MAX_MESSAGE_ID_LEN, Metadata,
};
pub use error::Error;
pub use failure::{BoxError, DeadLetterReason, HandlerError};
pub use handler::{Handler, Message, State, Stateless, WithState};
pub use headers::{
    HEADER_ATTEMPT, HEADER_ATTEMPTS, HEADER_CONSUMER, HEADER_DROPPED, HEADER_ERROR,
    HEADER_FIRST_FAILURE, HEADER_LAST_ERROR, HEADER_LAST_FAILURE, HEADER_ORIGINAL_EXCHANGE,
    HEADER_ORIGINAL_ROUTING_KEY, HEADER_ORIGINAL_USER_ID, HEADER_QUEUE, HEADER_REASON,
    HEADER_REPLAYED_AT, HEADER_SIGNATURE, HEADER_UNVERIFIED,
};
pub use idempotency::idempotency_key;
pub use outgoing::{InvalidOutgoing, Outgoing};
pub use printable::{printable, printable_bytes};
pub use registry::Registry;
pub use relay::{Relay, RelayStats, RelayStatsHandle};
pub use relay_config::{
    DEFAULT_BATCH_DEADLINE, DEFAULT_BATCH_SIZE, DEFAULT_HOUSEKEEPING_INTERVAL,
    DEFAULT_POLL_INTERVAL, DEFAULT_RETENTION, RelayConfig,
};
pub use retention::{DEFAULT_REPLAY_MARGIN, MAX_RETENTION, PURGE_BATCH, check_window, purge_inbox};
pub use retry::{
    DEFAULT_POISON_LIMIT, DEFAULT_TIERS, RetryDecision, RetryPolicy, format_delay, parse_delay,
};
pub use shutdown::shutdown_signal;
#[cfg(feature = "postgres")]
pub use store::PgStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
pub use store::{
    Dialect, InboxEntry, OutboxCounts, OutboxListener, OutboxStore, SqlStore, Store, StoreError,
    Tx, Wakeups, is_connection_error, is_permanent_data_error,
};
pub use telemetry::{ConsumerStats, Health, Outcome, PAYLOAD_SAFE_LOG_DIRECTIVES, StatsHandle};
pub use tls::{ENV_CA_FILE, ENV_CLIENT_CERT, ENV_CLIENT_KEY, TlsError, TlsOptions};
pub use topology::{
    ArgValue, BindingSpec, ExchangeKind, ExchangeSpec, QueueLayout, QueueSpec, QueueType, Topology,
    UNBOUNDED_DELIVERY_LIMIT, dead_letter_queue_name, retry_queue_name,
};

/// The AMQP client warren is built on, re-exported so that applications use the
/// same version.
pub use lapin;
/// The SQL toolkit warren is built on, re-exported so that handlers use the same
/// version.
pub use sqlx;
