//! The handler's transaction.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};

use sqlx::Database;

use super::{Dialect, StoreError, is_connection_error};
use crate::envelope::Metadata;
use crate::failure::{HandlerError, VersionGap};
use crate::message::Message;
use crate::outbox_row::NewOutboxRow;
use crate::outgoing::Outgoing;
use crate::trace_context::TraceContext;
use crate::version::{self, Gated, Verdict, VersionMode};

/// The open database transaction a handler writes in.
///
/// It dereferences to the driver's connection, so any sqlx query runs on it:
/// `sqlx::query("...").execute(tx.conn())`. warren owns the boundary: it begins the
/// transaction, claims the message, runs the handler, and commits or rolls back.
pub struct Tx<DB: Database> {
    inner: sqlx::Transaction<'static, DB>,
    /// The message being handled, whose ids outgoing messages carry on.
    cause: Option<Metadata>,
    /// The trace context outgoing messages continue: the handler's.
    trace: TraceContext,
    /// Outbox rows written, so the relay can be woken after the commit.
    enqueued: usize,
    /// Wake relays in other processes at commit if outbox rows were written
    /// (no relay in this process serves the store).
    notify_on_commit: bool,
    /// What the version gate saw.
    gated: Gated,
    /// In a batch handler's call: what the gate saw for each message, by
    /// message id.
    batch_gated: HashMap<String, Gated>,
    /// In a batch handler's call: the trace context each message's outbox
    /// rows continue, by message id.
    batch_traces: HashMap<String, TraceContext>,
    /// Puts back the session's lock timeout, where the transaction set one
    /// that outlives it (MySQL): run before it ends, so that the pooled
    /// connection goes back as it came.
    restore: Option<&'static str>,
    /// This process's turn to write, where writers take turns; declared last,
    /// so it is given up only once the transaction is.
    _turn: super::sql::WriteTurn,
}

impl<DB: Database> Tx<DB> {
    pub(crate) fn new(
        inner: sqlx::Transaction<'static, DB>,
        turn: super::sql::WriteTurn,
        notify_on_commit: bool,
    ) -> Self {
        Self {
            inner,
            cause: None,
            trace: TraceContext::default(),
            enqueued: 0,
            notify_on_commit,
            gated: Gated::default(),
            batch_gated: HashMap::new(),
            batch_traces: HashMap::new(),
            restore: None,
            _turn: turn,
        }
    }

    /// Runs `restore` before the transaction ends, commit or rollback.
    pub(crate) fn restore_before_end(&mut self, restore: &'static str) {
        self.restore = Some(restore);
    }

    pub(crate) fn set_cause(&mut self, cause: Metadata, trace: TraceContext) {
        self.cause = Some(cause);
        self.trace = trace;
    }

    /// Before a batch handler's call: no one message is the cause; each
    /// message's outbox rows continue the trace context given for it.
    pub(crate) fn set_batch_causes(&mut self, traces: HashMap<String, TraceContext>) {
        self.cause = None;
        self.trace = TraceContext::default();
        self.batch_traces = traces;
    }

    /// What the gate saw for each message of the batch handler's call just
    /// made, by message id.
    pub(crate) fn take_batch_gated(&mut self) -> HashMap<String, Gated> {
        self.batch_traces.clear();
        std::mem::take(&mut self.batch_gated)
    }

    pub(crate) fn enqueued(&self) -> usize {
        self.enqueued
    }

    /// What the version gate saw for the message just handled, leaving the
    /// next message of a batch to start afresh.
    pub(crate) fn take_gated(&mut self) -> Gated {
        std::mem::take(&mut self.gated)
    }

    /// The connection inside the transaction, for sqlx queries.
    pub fn conn(&mut self) -> &mut DB::Connection {
        &mut self.inner
    }
}

/// The savepoint a batch sets around each message, as every dialect spells it.
const SAVEPOINT: &str = "SAVEPOINT warren_message";
const RELEASE_SAVEPOINT: &str = "RELEASE SAVEPOINT warren_message";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT warren_message";

impl<DB: Dialect> Tx<DB> {
    pub(crate) async fn rollback(mut self) -> Result<(), StoreError> {
        if let Some(restore) = self.restore.take() {
            // Best effort: the next transaction begun on the connection puts
            // it back too.
            let _ = DB::execute_raw(&mut self.inner, restore).await;
        }
        self.inner.rollback().await.map_err(StoreError::Database)
    }

    async fn run_raw(&mut self, sql: &'static str) -> Result<(), StoreError> {
        DB::execute_raw(&mut self.inner, sql)
            .await
            .map_err(StoreError::Database)
    }

    /// Opens the savepoint of the next message of a batch.
    pub(crate) async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.run_raw(SAVEPOINT).await
    }

    /// Keeps what the message wrote since its savepoint. Fails where an
    /// earlier statement aborted the transaction (PostgreSQL), or the savepoint
    /// is gone (a statement that ended the transaction on MySQL).
    pub(crate) async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.run_raw(RELEASE_SAVEPOINT).await
    }

    /// Undoes what the message wrote since its savepoint, and closes it.
    pub(crate) async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        self.run_raw(ROLLBACK_TO_SAVEPOINT).await?;
        self.release_savepoint().await
    }
}

impl<DB: Dialect> Tx<DB> {
    /// Commits, after the dialect's check that the transaction can still commit.
    /// On PostgreSQL a failed statement aborts the whole transaction and `COMMIT`
    /// then quietly rolls back: a handler that ignored such an error would have
    /// its message acked with nothing applied. Running the check here, not in the
    /// caller, means no caller can forget it. A failed check rolls back and
    /// returns [`StoreError::Aborted`], unless the connection itself broke.
    pub(crate) async fn commit(mut self) -> Result<(), StoreError> {
        if let Some(restore) = self.restore.take()
            && let Err(e) = DB::execute_raw(&mut self.inner, restore).await
        {
            let _ = self.inner.rollback().await;
            return Err(StoreError::Database(e));
        }
        let notify = self.enqueued > 0 && self.notify_on_commit;
        if let Err(e) = DB::check_before_commit(&mut self.inner, notify).await {
            let _ = self.inner.rollback().await;
            return Err(if is_connection_error(&e) {
                StoreError::Database(e)
            } else {
                StoreError::Aborted(e)
            });
        }
        self.inner.commit().await.map_err(StoreError::Database)
    }

    /// The version gate: checks `version` of `entity` (in a namespace `scope`,
    /// e.g. "customer-credit") against the last applied one in
    /// `warren_versions`, locking that row until the transaction ends, and
    /// records `version` when the update applies.
    ///
    /// - [`Verdict::Apply`]: run the effect in this transaction.
    /// - [`Verdict::Stale`]: skip the effect and return `Ok(())`; the message is
    ///   acked and counted as `stale`.
    /// - A gap in [`VersionMode::Strict`] is an error to return with `?`: the
    ///   message waits in the shortest retry tier for the versions before it,
    ///   and is dead-lettered as `version-gap` after the consumer's gap patience.
    ///
    /// A version below 1 is a permanent error.
    ///
    /// ```no_run
    /// use warren::version::{Verdict, VersionMode};
    /// use warren::{HandlerError, Message, Tx};
    /// # #[derive(serde::Deserialize)] struct LimitSet { customer_id: String, version: i64 }
    /// async fn limit_set(msg: Message<LimitSet>, tx: &mut Tx<sqlx::Postgres>) -> Result<(), HandlerError> {
    ///     let p = &msg.payload;
    ///     match tx.check_version("customer-credit", &p.customer_id, p.version, VersionMode::LatestWins).await? {
    ///         Verdict::Stale { .. } => Ok(()),
    ///         Verdict::Apply { .. } => { /* the effect, on tx */ Ok(()) }
    ///     }
    /// }
    /// ```
    pub async fn check_version(
        &mut self,
        scope: &str,
        entity: &str,
        version: i64,
        mode: VersionMode,
    ) -> Result<Verdict, HandlerError> {
        let (verdict, gated) = self.gate(scope, entity, version, mode).await?;
        self.gated = gated;
        verdict
    }

    /// The version gate for `message` of a batch handler's
    /// [`Batch`](crate::Batch): as [`check_version`](Self::check_version),
    /// and the message is counted `stale` if the version was. Gates are
    /// checked in the order they are called, each seeing what the ones before
    /// it in the transaction recorded: two versions of one entity in one
    /// batch, checked in broker order, behave as if they came one after the
    /// other (under [`VersionMode::LatestWins`], version 2 then 1 leaves 1
    /// stale; 1 then 2 applies both, so a set-based write keeps the last one
    /// of each entity that applied).
    pub async fn check_version_of<T>(
        &mut self,
        message: &Message<T>,
        scope: &str,
        entity: &str,
        version: i64,
        mode: VersionMode,
    ) -> Result<Verdict, HandlerError> {
        let (verdict, gated) = self.gate(scope, entity, version, mode).await?;
        self.batch_gated
            .insert(message.meta.message_id.clone(), gated);
        verdict
    }

    /// Checks the gate; `Err` only for a database error, the gate's own
    /// outcome comes with what it saw.
    async fn gate(
        &mut self,
        scope: &str,
        entity: &str,
        version: i64,
        mode: VersionMode,
    ) -> Result<(Result<Verdict, HandlerError>, Gated), HandlerError> {
        if version < 1 {
            return Err(HandlerError::permanent(format!(
                "version of {entity:?} is {version}; versions start at 1"
            )));
        }
        let stored = DB::read_version(&mut self.inner, scope, entity)
            .await
            .map_err(store_to_handler)?;
        let mut gated = Gated {
            entity: Some(version::GatedVersion {
                entity: entity.to_owned(),
                version,
            }),
            stale: false,
        };
        let verdict = match version::decide(mode, stored, version) {
            Ok(verdict @ Verdict::Apply { .. }) => {
                DB::write_version(&mut self.inner, scope, entity, version)
                    .await
                    .map_err(store_to_handler)?;
                Ok(verdict)
            }
            Ok(verdict @ Verdict::Stale { .. }) => {
                gated.stale = true;
                Ok(verdict)
            }
            Err(stored) => Err(HandlerError::VersionGap(VersionGap {
                entity: entity.to_owned(),
                stored,
                got: version,
            })),
        };
        Ok((verdict, gated))
    }

    /// Writes `message` to the outbox in this transaction, for the relay to publish
    /// to `exchange` with `routing_key` after the commit. Inside a handler the
    /// message is marked as caused by the message being handled (its correlation
    /// id carried over, its causation id set to the incoming message id) and
    /// continues its trace, unless the message has a trace context of its own.
    /// The context is captured now, with the row, so that the relay publishes
    /// each row with the context of the handler that wrote it. Returns the
    /// outgoing message id, fixed now and never regenerated.
    ///
    /// In a batch handler, where no one message is being handled, name the
    /// message with [`publish_for`](Self::publish_for) or
    /// [`publish_all`](Self::publish_all); here the message is marked as
    /// caused by nothing.
    pub async fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: Outgoing,
    ) -> Result<String, StoreError> {
        let message = match self.cause.clone() {
            Some(cause) => self.carried(message, &cause),
            None => message,
        };
        self.write(exchange, routing_key, &[message])
            .await
            .map(|mut ids| ids.remove(0))
    }

    /// As [`publish`](Self::publish), the outgoing message caused by
    /// `cause`, a message of a batch handler's [`Batch`](crate::Batch): its
    /// correlation id carried over, its causation id set to the message's
    /// id, its trace continued from the message's.
    pub async fn publish_for<T>(
        &mut self,
        cause: &Message<T>,
        exchange: &str,
        routing_key: &str,
        message: Outgoing,
    ) -> Result<String, StoreError> {
        let message = self.carried(message, &cause.meta);
        self.write(exchange, routing_key, &[message])
            .await
            .map(|mut ids| ids.remove(0))
    }

    /// Writes one outgoing message for each `(cause, message)` to the outbox
    /// in one statement (for up to 500 of them), each caused by its message
    /// as with [`publish_for`](Self::publish_for): a batch handler's events
    /// for its whole batch. Returns the outgoing message ids, in order.
    /// Nothing is written if any of them could never be published.
    pub async fn publish_all<'m, T: 'm>(
        &mut self,
        exchange: &str,
        routing_key: &str,
        events: impl IntoIterator<Item = (&'m Message<T>, Outgoing)>,
    ) -> Result<Vec<String>, StoreError> {
        let messages: Vec<Outgoing> = events
            .into_iter()
            .map(|(cause, message)| self.carried(message, &cause.meta))
            .collect();
        self.write(exchange, routing_key, &messages).await
    }

    /// `message` caused by `cause`, continuing its trace unless it has a
    /// trace context of its own.
    fn carried(&self, message: Outgoing, cause: &Metadata) -> Outgoing {
        let mut message = message.caused_by(cause);
        if message.trace_context().is_empty() {
            let trace = self
                .batch_traces
                .get(&cause.message_id)
                .unwrap_or(&self.trace);
            if !trace.is_empty() {
                message = message.with_trace_context(trace.clone());
            }
        }
        message
    }

    /// Writes `messages` to the outbox, counted for the relay's wake-up.
    async fn write(
        &mut self,
        exchange: &str,
        routing_key: &str,
        messages: &[Outgoing],
    ) -> Result<Vec<String>, StoreError> {
        let ids = insert_outbox::<DB>(&mut self.inner, exchange, routing_key, messages).await?;
        self.enqueued += ids.len();
        Ok(ids)
    }
}

impl<DB: Database> Deref for Tx<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

/// Checks `messages` and writes them to the outbox on `conn`, in one
/// statement: the one path behind [`Tx::publish`] and
/// [`enqueue`](crate::outbox::enqueue). A message that could never be
/// published is refused before anything is written. Wakes no relay: the
/// transaction's owner does, once. Returns the messages' ids.
pub(crate) async fn insert_outbox<DB: Dialect>(
    conn: &mut DB::Connection,
    exchange: &str,
    routing_key: &str,
    messages: &[Outgoing],
) -> Result<Vec<String>, StoreError> {
    let rows = messages
        .iter()
        .map(|m| NewOutboxRow::of(exchange, routing_key, m))
        .collect::<Result<Vec<_>, _>>()
        .map_err(StoreError::InvalidMessage)?;
    DB::insert_outbox(conn, &rows).await?;
    Ok(messages
        .iter()
        .map(|m| m.meta().message_id.clone())
        .collect())
}

/// A store error inside the gate, as the handler returns it: a database error
/// keeps its classification (an outage costs no attempt); anything else is
/// transient.
fn store_to_handler(e: StoreError) -> HandlerError {
    match e {
        StoreError::Database(e) => HandlerError::from(e),
        other => HandlerError::transient(other),
    }
}
