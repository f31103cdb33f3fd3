//! The handler's transaction.

use std::ops::{Deref, DerefMut};

use sqlx::Database;

use super::{Dialect, StoreError, is_connection_error};
use crate::envelope::Metadata;
use crate::outbox_row::NewOutboxRow;
use crate::outgoing::Outgoing;

/// The open database transaction a handler writes in.
///
/// It dereferences to the driver's connection, so any sqlx query runs on it:
/// `sqlx::query("...").execute(tx.conn())`. warren owns the boundary: it begins the
/// transaction, claims the message, runs the handler, and commits or rolls back.
pub struct Tx<DB: Database> {
    inner: sqlx::Transaction<'static, DB>,
    /// The message being handled, whose ids outgoing messages carry on.
    cause: Option<Metadata>,
    /// Outbox rows written, so the relay can be woken after the commit.
    enqueued: usize,
}

impl<DB: Database> Tx<DB> {
    pub(crate) fn new(inner: sqlx::Transaction<'static, DB>) -> Self {
        Self {
            inner,
            cause: None,
            enqueued: 0,
        }
    }

    pub(crate) fn set_cause(&mut self, cause: Metadata) {
        self.cause = Some(cause);
    }

    pub(crate) fn enqueued(&self) -> usize {
        self.enqueued
    }

    /// The connection inside the transaction, for sqlx queries.
    pub fn conn(&mut self) -> &mut DB::Connection {
        &mut self.inner
    }

    pub(crate) async fn rollback(self) -> Result<(), StoreError> {
        self.inner.rollback().await.map_err(StoreError::Database)
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
        if let Err(e) = DB::check_before_commit(&mut self.inner).await {
            let _ = self.inner.rollback().await;
            return Err(if is_connection_error(&e) {
                StoreError::Database(e)
            } else {
                StoreError::Aborted(e)
            });
        }
        self.inner.commit().await.map_err(StoreError::Database)
    }

    /// Writes `message` to the outbox in this transaction, for the relay to publish
    /// to `exchange` with `routing_key` after the commit. Inside a handler the
    /// message is marked as caused by the message being handled (its correlation
    /// id carried over, its causation id set to the incoming message id). Returns
    /// the outgoing message id, fixed now and never regenerated.
    pub async fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: Outgoing,
    ) -> Result<String, StoreError> {
        let message = match &self.cause {
            Some(cause) => message.caused_by(cause),
            None => message,
        };
        insert_outbox::<DB>(&mut self.inner, exchange, routing_key, &message).await?;
        self.enqueued += 1;
        Ok(message.meta().message_id.clone())
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

/// Checks `message` and writes it to the outbox on `conn`: the one path behind
/// [`Tx::publish`] and [`enqueue`](crate::outbox::enqueue). A message that could
/// never be published is refused before anything is written.
pub(crate) async fn insert_outbox<DB: Dialect>(
    conn: &mut DB::Connection,
    exchange: &str,
    routing_key: &str,
    message: &Outgoing,
) -> Result<(), StoreError> {
    let row =
        NewOutboxRow::of(exchange, routing_key, message).map_err(StoreError::InvalidMessage)?;
    DB::insert_outbox(conn, &row).await
}
