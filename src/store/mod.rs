//! Storage: the inbox claim and the handler's transaction, and what a store
//! can do beyond them, one capability to a trait.
//!
//! Each backend lives in its own module behind a cargo feature and carries its own
//! migrations. The consumer only ever asks a store to begin a transaction, claim a
//! message in it, and commit; it never formats SQL.
//!
//! - `inbox`: the core every store implements ([`Store`], [`InboxEntry`]).
//! - `capabilities`: what a store may add ([`SigningKey`], [`SoloRuns`],
//!   [`Leases`], [`Retention`]) and what a consumer needs of all of them
//!   ([`ConsumerStore`]).
//! - `outbox`: the relay's side ([`OutboxStore`]).
//! - `checkup`: what `warren doctor` asks a database ([`Checkup`]).
//! - `tx`: the handler's transaction ([`Tx`]); its commit runs the dialect's check.
//! - `error`: [`StoreError`] and the questions callers ask of database errors.
//! - `dialect`: what a SQL database supplies: statements and hooks (`SqlDialect`).
//! - `sql`: the one implementation of every trait over a dialect (`SqlStore`,
//!   which `PgStore`, `SqliteStore` and `MySqlStore` name for their dialect).
//! - `migrations`: warren's tables as `.sql` files per dialect.
//! - `postgres`, `sqlite`, `mysql`: connecting, and each dialect's statements and
//!   hooks.

/// Writes a store trait with the message the compiler gives when a type
/// that is not a store stands where one goes: most often a database
/// (`sqlx::Postgres`) where its store (`PgStore`) belongs.
macro_rules! store_trait {
    ($($item:tt)*) => {
        #[diagnostic::on_unimplemented(
            message = "`{Self}` is not a warren store",
            label = "a store goes here, not a database",
            note = "a store is `warren::PgStore`, `warren::SqliteStore` or `warren::MySqlStore`: \
                    write `Consumer<PgStore>` or `TestConsumer<PgStore>`; the database \
                    (`sqlx::Postgres`) is what a handler's `Tx<sqlx::Postgres>` names"
        )]
        $($item)*
    };
}

mod capabilities;
mod checkup;
pub(crate) mod compare;
mod dead_letters;
pub(crate) mod dialect;
mod error;
mod inbox;
mod journal;
mod migrations;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
mod outbox;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod sql;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
mod trail;
pub(crate) mod tx;

pub use capabilities::{ConsumerStore, Lease, LeaseStep, Leases, Retention, SigningKey, SoloRuns};
pub use checkup::{Checkup, InboxSize};
pub use dead_letters::{
    Actor, AuditEntry, DeadLetterGroup, DeadLetterRecord, DeadLetterStats, DeadLetterStore,
    GroupMute, LetterEdit, LetterFilter, LetterReplay, LetterState, NewDeadLetter, PageAfter,
    PendingReplay, ReplayCandidate, ReplayRun, StoredDeadLetter,
};
pub use error::{
    StoreError, database_text, error_text, is_connection_error, is_lock_conflict,
    is_permanent_data_error,
};
pub use inbox::{InboxEntry, Store};
pub use journal::{Journal, JournalEntry};
pub use outbox::{OutboxCounts, OutboxListener, OutboxStore};
pub use sql::SqlStore;
pub use trail::{InboxRecord, OutboxRecord, Trail};

pub(crate) use error::is_after_abort;
// The root names it (`warren::Tx`); inside, it is the store's.
pub(crate) use tx::Tx;

pub(crate) use tx::insert_outbox;

/// A database dialect warren's store runs on and writes its outbox in:
/// PostgreSQL (`sqlx::Postgres`), SQLite (`sqlx::Sqlite`) or MySQL/MariaDB
/// (`sqlx::MySql`).
///
/// Sealed: a dialect is a set of statements and hooks inside warren, so a new
/// database is added to warren rather than implemented outside it. Write outbox
/// rows in a dialect's transaction with [`Tx::publish`] or
/// [`enqueue`](crate::outbox::enqueue).
pub trait Dialect: dialect::SqlDialect {}

impl<D: dialect::SqlDialect> Dialect for D {}

/// The name of the signing key in `warren_settings`.
pub(crate) const SIGNING_KEY_SETTING: &str = "header-signing-key";

/// 256 random bits from the operating system, hex-encoded.
pub(crate) fn new_signing_key() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source is available");
    hex::encode(bytes)
}

/// Wake-ups for the relays of one store: each relay holds a receiver and sees
/// every wake-up sent after it last looked, so none is lost while a relay is
/// busy publishing, and every relay on the store wakes, not just one.
#[derive(Debug, Clone)]
pub struct Wakeups(std::sync::Arc<tokio::sync::watch::Sender<u64>>);

impl Default for Wakeups {
    fn default() -> Self {
        Self(std::sync::Arc::new(tokio::sync::watch::Sender::new(0)))
    }
}

impl Wakeups {
    /// Wakes every relay of the store. Call it after committing a transaction
    /// that wrote outbox rows with [`enqueue`](crate::outbox::enqueue); the
    /// consumer does so itself for handlers' [`Tx::publish`].
    pub fn wake(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.subscribe()
    }

    /// True while a relay of this process waits on these wake-ups.
    pub(crate) fn listened(&self) -> bool {
        self.0.receiver_count() > 0
    }
}
