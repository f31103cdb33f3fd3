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
//! The crate root holds what a service needs to run a consumer, and nothing
//! else: [`Consumer`] with its [`ConsumerConfig`] and [`Registry`]; handlers'
//! [`Message`], [`State`], [`Tx`] and [`HandlerError`]; the stores
//! [`PgStore`], [`SqliteStore`] and [`MySqlStore`]; the outbox's [`Outgoing`],
//! [`Relay`] and [`RelayConfig`]; [`Error`] and [`shutdown_signal`]; and the
//! `sqlx` and `lapin` it is built on. Everything else is in one public module,
//! by one path:
//!
//! - [`config`]: defaults, the [`ConsumerConfigBuilder`](config::ConsumerConfigBuilder),
//!   [`ConfigError`](config::ConfigError), batch isolation and lanes.
//! - [`handler`]: the [`Handler`](handler::Handler) trait every `async fn`
//!   fits, [`BoxError`](handler::BoxError), [`idempotency_key`](handler::idempotency_key).
//! - [`envelope`]: what arrives, validated ([`Envelope`](envelope::Envelope),
//!   [`Metadata`](envelope::Metadata)).
//! - [`outbox`]: writing outgoing messages outside a handler, the outbox rows,
//!   and the relay's defaults and counters.
//! - [`store`]: the [`Store`](store::Store) trait and the capabilities a store
//!   adds, dialects, database errors.
//! - [`retry`]: delay tiers and the poison limit as data ([`RetryPolicy`](retry::RetryPolicy)).
//! - [`topology`]: exchanges, queues and bindings as data, and queue names.
//! - [`partition`]: per-entity order through partition queues.
//! - [`version`]: version gates checked in the business transaction.
//! - [`broker`]: connecting, declaring, publishing with confirms
//!   ([`Publisher`](broker::Publisher)), and the frame guard.
//! - [`headers`]: the `x-warren-*` headers on the copies warren publishes.
//! - [`amqp`]: AMQP values: the short-string limit, header readers.
//! - [`telemetry`]: counters, health, and the log filter that keeps payloads out.
//! - [`tls`]: `amqps://` with a private CA or a client certificate.
//! - [`admin`]: what the runtime shares with the operators' tools of the
//!   `warren_admin` crate: dead-letter records and reasons, inbox retention,
//!   URLs, printable text.
//! - [`failpoint`]: crash points for crash tests (feature `failpoints`); their
//!   names are the `warren_failpoints` crate's.
//! - `testing`: a test kit that runs handlers without a broker (feature `testing`).
//!
//! **lapin's types are part of the API**, by choice: an AMQP message's
//! properties and header values are [`lapin::BasicProperties`] and
//! [`lapin::types`] wherever warren reads or builds them ([`Outgoing`], the
//! `headers`, `amqp` and `broker` modules), and [`broker::connect`] returns a
//! [`lapin::Connection`]. Wrapping them would copy lapin's model of AMQP for
//! nothing. warren re-exports the lapin it is built on, so an application
//! uses the same one; a new major version of lapin is a new major version of
//! warren.
//!
//! Inside, the rule itself is `pipeline` (validate and route, apply in units
//! of work, settle, finish, per delivery; `pipeline::engine` is the one place
//! a transaction runs); `disposition` decides what an outcome means;
//! `dispatcher` decides which buffered deliveries run next, and how many to a
//! batch; `consumer` runs sessions with the broker (`consumer::session`) and
//! reconnects around them.
//!
//! The page below is the README; the guides it links to are the modules of
//! [`guide`]. Their examples compile as doc-tests.
#![doc = ""]
#![doc = include_str!("../README.md")]
// docs.rs builds with `--cfg docsrs` on nightly: each item gated by a feature
// says which one it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
// A build without a store serves tools that need only warren's names and types
// (warren-chaos needs the crash points); the shared store plumbing has no user
// there, and gating each piece would scatter cfgs over code that changes often.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code, unused)
)]

/// The guides, one topic to a page: the files of the repository's `docs/`
/// folder that a user of the library needs, included here so that their
/// examples compile as doc-tests. The guides about the repository itself
/// (performance, the cluster, billing, chaos, the architecture, the suite)
/// stay in `docs/` on their own; the doctor's is the `warren_doctor`
/// crate's.
pub mod guide {
    #[doc = include_str!("../docs/handlers.md")]
    pub mod handlers {}
    #[doc = include_str!("../docs/testing.md")]
    pub mod testing {}
    #[doc = include_str!("../docs/failures.md")]
    pub mod failures {}
    #[doc = include_str!("../docs/formats.md")]
    pub mod formats {}
    #[doc = include_str!("../docs/dead-letters.md")]
    pub mod dead_letters {}
    #[doc = include_str!("../docs/console.md")]
    pub mod console {}
    #[doc = include_str!("../docs/ordering.md")]
    pub mod ordering {}
    #[doc = include_str!("../docs/production.md")]
    pub mod production {}
    #[doc = include_str!("../docs/tracing.md")]
    pub mod tracing {}
    #[doc = include_str!("../docs/cli.md")]
    pub mod cli {}
    #[doc = include_str!("../docs/tls.md")]
    pub mod tls {}
    #[doc = include_str!("../docs/guarantees.md")]
    pub mod guarantees {}
}

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
pub mod format;
pub mod handler;
pub mod headers;
mod idempotency;
mod message;
#[cfg(feature = "otel")]
pub mod otel;
pub mod outbox;
mod outbox_row;
mod outgoing;
pub mod partition;
mod pipeline;
mod printable;
mod registry;
mod relay;
mod relay_config;
mod retention;
pub mod retry;
mod shutdown;
mod spans;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod topology;
pub mod trace_context;
pub mod version;

/// What the runtime shares with the operator tooling: the record a
/// dead-lettered copy carries and the id of its failure, the dead-letter
/// reasons, inbox retention, database URLs, and making message-derived text
/// safe to print. The tools themselves (the dead-letter ingester, queue
/// browsing and replay, the store's replays, edits, fingerprints, the
/// operators' input rules) are the `warren_admin` crate's (package
/// `warren-mq-admin`), which re-exports everything here: the `warren` CLI
/// and the console are built on it.
pub mod admin {
    pub use crate::database_url::{DatabaseUrl, redact_url, split_url_list};
    pub use crate::dead_letter::{DeadLetterInfo, letter_id, letter_id_of_content};
    pub use crate::failure::DeadLetterReason;
    pub use crate::printable::{
        printable, printable_bytes, printable_json, printable_json_pretty, printable_page,
    };
    pub use crate::relay_config::DEFAULT_RETENTION;
    pub use crate::retention::{
        DEFAULT_REPLAY_MARGIN, MAX_RETENTION, PURGE_BATCH, check_window, cutoff, purge_inbox,
    };
}

/// The runtime's parts that warren's own crates build on: the broker session
/// the dead-letter ingester consumes through, the signer of warren's
/// headers, and the helpers the operators' tools share with the pipeline.
/// Not part of warren's API and under no semver promise: `warren-mq-admin`
/// depends on this exact version of warren.
#[doc(hidden)]
pub mod __kit {
    pub use crate::backoff::Backoff;
    pub use crate::dead_letter::record::id_and_type;
    pub use crate::headers::copies::copy_base;
    pub use crate::headers::signer::Signer;
    pub use crate::shutdown::cancel_on;
    pub use crate::store::compare::{
        JsonNumber, MAX_EXPONENT, MAX_SIGNIFICANT_DIGITS, to_millisecond,
    };
    pub use crate::version::GatedVersion;

    /// The broker session a consumer runs on, and the calls around it.
    pub mod broker {
        use std::future::Future;

        use lapin::Channel;
        use lapin::types::ShortString;

        use crate::broker::BrokerError;
        pub use crate::broker::port::{Amqp, Delivery, Port, Subscription};

        /// Closes `channel` if it is still open, within the broker call timeout.
        pub async fn close_channel(channel: &Channel, reason: &str) {
            crate::broker::close_channel(channel, reason).await;
        }

        /// Runs a broker call within the call timeout, naming `what` if it ran out.
        pub async fn deadline<T, E>(
            what: &str,
            call: impl Future<Output = Result<T, E>>,
        ) -> Result<T, BrokerError>
        where
            BrokerError: From<E>,
        {
            crate::broker::deadline(what, call).await
        }

        /// `value` as an AMQP short string, or an error naming `field`.
        pub fn short(field: &str, value: &str) -> Result<ShortString, BrokerError> {
            crate::broker::short(field, value)
        }
    }

    /// AMQP values as warren writes them in headers.
    pub mod amqp {
        use chrono::{DateTime, Utc};
        use lapin::types::AMQPValue;

        /// `s` cut to at most `max` bytes, on a character boundary.
        pub fn truncate(s: &str, max: usize) -> &str {
            crate::amqp::truncate(s, max)
        }

        /// A time as a header value.
        pub fn time(t: DateTime<Utc>) -> AMQPValue {
            crate::amqp::time(t)
        }

        /// Text as a header value.
        pub fn text(s: &str) -> AMQPValue {
            crate::amqp::text(s)
        }
    }

    /// What the formats share with the operators' tools.
    pub mod format {
        /// The prefix of an id derived from a payload's key.
        pub const DERIVED_PREFIX: &str = crate::format::DERIVED_PREFIX;

        /// A content type's essence: lower case, no parameters.
        pub fn essence(content_type: &str) -> String {
            crate::format::essence(content_type)
        }
    }
}

pub use config::settings::ConsumerConfig;
pub use consumer::Consumer;
pub use error::Error;
pub use failure::HandlerError;
pub use handler::{Batch, BatchError, BatchResult};
pub use message::{Message, State};
pub use outgoing::{Outgoing, OutgoingFormat};
pub use registry::Registry;
pub use relay::Relay;
pub use relay_config::RelayConfig;
pub use shutdown::shutdown_signal;
#[cfg(feature = "mysql")]
pub use store::mysql::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::postgres::PgStore;
#[cfg(feature = "sqlite")]
pub use store::sqlite::SqliteStore;
pub use store::tx::Tx;

/// The AMQP client warren is built on, re-exported so that applications use the
/// same version.
pub use lapin;
/// The SQL toolkit warren is built on, re-exported so that handlers use the same
/// version.
pub use sqlx;
