//! The transactional outbox: outgoing messages written in the same transaction as
//! the business change, published by the relay after the commit.
//!
//! Inside a handler, use [`Tx::publish`](crate::Tx::publish). Anywhere else (a web
//! request's own transaction, say), call [`enqueue`] on the connection of your
//! open transaction; the row commits or rolls back with it.

use crate::outgoing::Outgoing;
pub use crate::outgoing::{InvalidOutgoing, WireFormat};
pub use crate::relay::{RelayStats, RelayStatsHandle};
pub use crate::relay_config::{
    DEFAULT_BATCH_DEADLINE, DEFAULT_BATCH_SIZE, DEFAULT_HOUSEKEEPING_INTERVAL,
    DEFAULT_POLL_INTERVAL, DEFAULT_RETENTION,
};
use crate::store::{Dialect, StoreError};

pub use crate::outbox_row::{
    FailedRow, NewOutboxRow, OutboxRow, OutboxStatus, RowOutcome, StoredProperties,
};

/// Writes `message` to the outbox on `conn`, inside the caller's open transaction.
/// The relay publishes it to `exchange` with `routing_key` once that transaction
/// has committed; if it rolls back, the message never existed.
///
/// A message that could never be published (an id, event type or correlation id
/// the AMQP properties cannot carry, an exchange or routing key over 255 bytes)
/// is refused here with [`StoreError::InvalidMessage`], while the caller can
/// still act on it, rather than stored to fail in the relay later.
///
/// On PostgreSQL it also notifies relays in other processes, delivered when
/// the transaction commits (several in one transaction arrive as one); wake
/// a relay in this process with [`Wakeups::wake`](crate::store::Wakeups::wake)
/// after the commit.
pub async fn enqueue<DB: Dialect>(
    conn: &mut DB::Connection,
    exchange: &str,
    routing_key: &str,
    message: &Outgoing,
) -> Result<(), StoreError> {
    crate::store::insert_outbox::<DB>(conn, exchange, routing_key, std::slice::from_ref(message))
        .await?;
    if let Some(notify) = DB::SQL.notify_outbox {
        DB::execute_raw(conn, notify).await?;
    }
    Ok(())
}
