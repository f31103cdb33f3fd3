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
//! # Where things are
//!
//! The crate root holds what a service needs to run a consumer: [`Consumer`],
//! [`ConsumerConfig`], [`Registry`], handlers ([`Message`], [`State`], [`Tx`],
//! [`HandlerError`]), the stores ([`PgStore`], [`SqliteStore`]), the outbox
//! ([`Outgoing`], [`Relay`], [`RelayConfig`]), [`RetryPolicy`], [`Topology`],
//! [`TlsOptions`] and [`Error`]. Everything else is in a public module:
//!
//! - [`config`]: defaults and the [`ConsumerConfigBuilder`](config::ConsumerConfigBuilder).
//! - [`handler`]: the [`Handler`] trait every `async fn` fits, and its markers.
//! - [`envelope`]: what arrives, validated ([`Envelope`], [`envelope::Metadata`]).
//! - [`outbox`]: writing outgoing messages outside a handler, and the outbox rows.
//! - [`relay`]: the relay's defaults and counters.
//! - [`store`]: the [`Store`] and [`store::OutboxStore`] traits, dialects, database errors.
//! - [`retry`]: delay tiers and the poison limit as data.
//! - [`topology`]: exchanges, queues and bindings as data, and queue names.
//! - [`broker`]: connecting, declaring, publishing with confirms ([`Publisher`]).
//! - [`headers`]: the `x-warren-*` headers on the copies warren publishes.
//! - [`amqp`]: AMQP values: the short-string limit, header readers.
//! - [`telemetry`]: counters, health, and the log filter that keeps payloads out.
//! - [`tls`]: `amqps://` with a private CA or a client certificate.
//! - [`admin`]: operator tooling: dead-letter queues, inbox retention, URLs.
//! - [`failpoint`]: crash points for crash tests (feature `failpoints`).
//! - `testing`: a test kit that runs handlers without a broker (feature `testing`).
//!
//! Inside, the rule itself is `pipeline` (validate and route, apply in units
//! of work, settle, finish, per delivery; `pipeline::engine` is the one place
//! a transaction runs); `disposition` decides what an outcome means;
//! `dispatcher` decides which buffered deliveries run next, and how many to a
//! batch; `session` is one connected period with the broker; `consumer`
//! reconnects around it.
//!
//! The guide below is the README; its examples compile as doc-tests.
#![doc = ""]
#![doc = include_str!("../README.md")]
// A build without a store serves tools that need only warren's names and types
// (warren-chaos needs the crash points); the shared store plumbing has no user
// there, and gating each piece would scatter cfgs over code that changes often.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code, unused)
)]

pub mod amqp;
mod backoff;
mod barrier;
pub mod broker;
pub mod config;
mod config_error;
mod consumer;
mod database_url;
mod dead_letter;
mod dispatcher;
mod disposition;
pub mod envelope;
mod error;
pub mod failpoint;
mod failure;
pub mod handler;
pub mod headers;
mod idempotency;
pub mod outbox;
mod outbox_row;
mod outgoing;
pub mod partition;
mod pipeline;
mod printable;
mod registry;
pub mod relay;
mod relay_config;
mod retention;
pub mod retry;
mod shutdown;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod topology;
pub mod version;

/// Operator tooling: dead-letter queues (list, show, replay, purge), inbox
/// retention, database URLs, and making message-derived text safe to print.
/// The `warren` binary is built from these.
pub mod admin {
    pub use crate::database_url::{DatabaseUrl, redact_url, split_url_list};
    pub use crate::dead_letter::{
        DeadLetter, DeadLetterInfo, DeadLetterQueue, ReplayReport, Replayed, Selection,
    };
    pub use crate::printable::{printable, printable_bytes};
    pub use crate::retention::{
        DEFAULT_REPLAY_MARGIN, MAX_RETENTION, PURGE_BATCH, check_window, purge_inbox,
    };
}

pub use broker::Publisher;
pub use config::ConsumerConfig;
pub use config_error::ConfigError;
pub use consumer::Consumer;
pub use dead_letter::DeadLetterInfo;
pub use dead_letter::DeadLetterQueue;
pub use envelope::Envelope;
pub use error::Error;
pub use failure::{BoxError, DeadLetterReason, HandlerError};
pub use handler::{Handler, Message, State};
pub use idempotency::idempotency_key;
pub use outgoing::Outgoing;
pub use registry::Registry;
pub use relay::Relay;
pub use relay_config::RelayConfig;
pub use retry::RetryPolicy;
pub use shutdown::shutdown_signal;
#[cfg(feature = "mysql")]
pub use store::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::PgStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
pub use store::{Store, StoreError, Tx};
pub use telemetry::StatsHandle;
pub use tls::TlsOptions;
pub use topology::{QueueType, Topology};

/// The AMQP client warren is built on, re-exported so that applications use the
/// same version.
pub use lapin;
/// The SQL toolkit warren is built on, re-exported so that handlers use the same
/// version.
pub use sqlx;
