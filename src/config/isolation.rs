//! How a batch keeps one failing message from undoing the others.

/// Subtransactions one PostgreSQL transaction can hold before its backend's
/// cache of them overflows (`PGPROC_MAX_CACHED_SUBXIDS`); past it every
/// concurrent snapshot, on replicas too, has to look them up the slow way.
pub const MAX_SUBTRANSACTIONS: u32 = 64;

/// How a batch keeps one failing message from undoing the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchIsolation {
    /// No savepoints (the default). A message whose handler fails is decided
    /// at once; the transaction rolls back and the other messages run again
    /// without it. Free when nothing fails; a failure costs the messages
    /// before it a second run of their handlers.
    #[default]
    Replay,
    /// A savepoint around each message's claim, handler and outbox rows: a
    /// failing message rolls back to its savepoint alone and the others go on
    /// in the same transaction. Each savepoint that writes is a PostgreSQL
    /// subtransaction, so a batch holds at most
    /// [`MAX_SUBTRANSACTIONS`] / (1 + `handler_savepoints`) messages, where
    /// `handler_savepoints` is the most savepoints a handler opens itself for
    /// one message. Costs two statements per message even when nothing fails.
    Savepoints {
        /// The most savepoints a handler opens itself per message (0 if none).
        handler_savepoints: u32,
    },
}
