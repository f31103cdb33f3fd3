//! The failure taxonomy: what a handler can say went wrong, and the reasons a
//! message ends in the dead-letter queue.

use std::fmt;
use std::time::Duration;

/// Boxed error a handler can wrap in a [`HandlerError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A handler's failure, classified by what should happen next.
///
/// The classification is the handler's to make, because only the handler knows
/// whether trying again can help:
///
/// ```
/// use std::time::Duration;
/// use warren::HandlerError;
///
/// // A dependency timed out: try again later.
/// let e = HandlerError::transient("payment provider timed out");
/// assert!(e.is_transient());
///
/// // The provider said "slow down, come back in 30 s".
/// let e = HandlerError::transient("rate limited").retry_after(Duration::from_secs(30));
/// assert_eq!(e.retry_after_hint(), Some(Duration::from_secs(30)));
///
/// // The message can never succeed: dead-letter it for a human.
/// let e = HandlerError::permanent("amount must not be negative");
/// assert!(e.is_permanent());
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum HandlerError {
    /// Trying again later may succeed (timeout, rate limit, lost connection).
    Transient {
        /// What went wrong.
        error: BoxError,
        /// The earliest the dependency wants to be asked again, if it said.
        retry_after: Option<Duration>,
    },
    /// Trying again cannot succeed (validation, business invariant).
    Permanent {
        /// What went wrong.
        error: BoxError,
    },
    /// Strict sequence: this version arrived before the one it follows. The
    /// message waits in the shortest retry tier, without using an attempt,
    /// until the missing version applies or the gap patience runs out. Made by
    /// [`Tx::check_version`](crate::Tx::check_version).
    VersionGap(VersionGap),
}

/// A version that arrived before its predecessor (strict sequence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionGap {
    /// The entity.
    pub entity: String,
    /// The version stored (last applied).
    pub stored: i64,
    /// The version that arrived.
    pub got: i64,
}

impl fmt::Display for VersionGap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "version gap for {:?}: expected version {}, got version {}",
            self.entity,
            self.stored.saturating_add(1),
            self.got
        )
    }
}

impl std::error::Error for VersionGap {}

impl HandlerError {
    /// A failure worth retrying.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        HandlerError::Transient {
            error: error.into(),
            retry_after: None,
        }
    }

    /// A failure that no retry can fix; the message is dead-lettered at once.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        HandlerError::Permanent {
            error: error.into(),
        }
    }

    /// Asks for the retry to wait at least `delay`. Has no effect on a permanent error.
    pub fn retry_after(self, delay: Duration) -> Self {
        match self {
            HandlerError::Transient { error, .. } => HandlerError::Transient {
                error,
                retry_after: Some(delay),
            },
            other => other,
        }
    }

    /// True if retrying may help.
    pub fn is_transient(&self) -> bool {
        matches!(self, HandlerError::Transient { .. })
    }

    /// True if the message should be dead-lettered at once.
    pub fn is_permanent(&self) -> bool {
        matches!(self, HandlerError::Permanent { .. })
    }

    /// The retry-after the handler asked for, if any.
    pub fn retry_after_hint(&self) -> Option<Duration> {
        match self {
            HandlerError::Transient { retry_after, .. } => *retry_after,
            HandlerError::Permanent { .. } | HandlerError::VersionGap(_) => None,
        }
    }

    /// The underlying error.
    pub fn error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        match self {
            HandlerError::Transient { error, .. } | HandlerError::Permanent { error } => {
                error.as_ref()
            }
            HandlerError::VersionGap(gap) => gap,
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Transient { error, .. } => write!(f, "transient: {error}"),
            HandlerError::Permanent { error } => write!(f, "permanent: {error}"),
            HandlerError::VersionGap(gap) => write!(f, "{gap}"),
        }
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.error())
    }
}

/// A database error inside a handler is transient: a lost connection, a deadlock or
/// a serialization failure all clear up on retry, and a bug that does not will use
/// up its attempts and land in the dead-letter queue. The exception is the
/// database refusing the data itself ([`crate::store::is_permanent_data_error`]): the
/// consumer finds that error in the chain and dead-letters the message at once.
/// Return [`HandlerError::permanent`] yourself where you know better.
impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        HandlerError::transient(e)
    }
}

/// Why a message was moved to the dead-letter queue; sent as the `x-warren-reason`
/// header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The body exceeded the size limit.
    BodyTooLarge,
    /// The content type was missing or not JSON, or its charset was not UTF-8.
    InvalidContentType,
    /// The AMQP `content_encoding` names an encoding warren does not decode
    /// (`gzip`, say): parsing the bytes as plain JSON would misread them.
    UnsupportedContentEncoding,
    /// The AMQP `message_id` property was missing or empty.
    MissingMessageId,
    /// The body was not valid JSON.
    InvalidJson,
    /// The JSON was not a valid envelope (missing or ill-typed field).
    InvalidEnvelope,
    /// The body's `messageId` differs from the AMQP `message_id` property.
    MessageIdMismatch,
    /// No handler is registered for the event type.
    UnknownEventType,
    /// The event type is known, but not in this schema version.
    UnknownSchemaVersion,
    /// The payload did not deserialize into the handler's type.
    InvalidPayload,
    /// The handler returned a permanent failure.
    Permanent,
    /// Every attempt the retry policy allows failed transiently.
    RetriesExhausted,
    /// Delivered again and again without any outcome being recorded: the message
    /// keeps killing the process that handles it.
    Poison,
    /// A message for a partitioned consumer without a usable partition key
    /// header (missing, empty, or not an AMQP long string).
    InvalidPartitionKey,
    /// Strict sequence: the version it follows never applied within the gap
    /// patience.
    VersionGap,
    /// A header nested more tables or arrays deep than the frame guard reads
    /// ([`MAX_HEADER_DEPTH`](crate::broker::guard::MAX_HEADER_DEPTH)); it was
    /// removed before the AMQP client read the message.
    HeadersTooDeep,
    /// The headers held more values than the frame guard reads
    /// ([`MAX_HEADER_ENTRIES`](crate::broker::guard::MAX_HEADER_ENTRIES)); the
    /// headers past it were removed.
    TooManyHeaders,
    /// Text the AMQP client reads as UTF-8 was not (a property, a header name,
    /// the exchange or routing key); the frame guard replaced or removed it.
    UnreadableFrame,
    /// A CloudEvent (structured or binary mode) that breaks the CloudEvents
    /// 1.0 rules or warren's: a missing or ill-typed attribute, a
    /// `specversion` other than 1.0, data that is not JSON, an attribute sent
    /// twice with different values.
    InvalidCloudEvent,
    /// A bare payload whose event type, schema version or id cannot be read
    /// as the consumer's format says.
    InvalidBarePayload,
    /// None of the formats the consumer accepts reads the message.
    UnrecognizedFormat,
    /// The key a route derives from the payload (for a message sent without
    /// an id) is empty, too long or holds a control character.
    InvalidDerivedKey,
    /// A MassTransit envelope that cannot be read: not its JSON shape, no
    /// `messageId`, or a `messageType` the consumer maps to no event type.
    InvalidMassTransit,
    /// An NServiceBus message that cannot be read: no `NServiceBus.MessageId`,
    /// enclosed types the consumer maps to no event type, a body that is
    /// not JSON.
    InvalidNServiceBus,
    /// A Spring AMQP message whose `__TypeId__` the consumer maps to no event
    /// type, or whose body is not JSON.
    InvalidSpringMessage,
}

impl DeadLetterReason {
    /// Every reason, for reports and tests.
    pub const ALL: [DeadLetterReason; 25] = [
        DeadLetterReason::BodyTooLarge,
        DeadLetterReason::InvalidContentType,
        DeadLetterReason::UnsupportedContentEncoding,
        DeadLetterReason::MissingMessageId,
        DeadLetterReason::InvalidJson,
        DeadLetterReason::InvalidEnvelope,
        DeadLetterReason::MessageIdMismatch,
        DeadLetterReason::UnknownEventType,
        DeadLetterReason::UnknownSchemaVersion,
        DeadLetterReason::InvalidPayload,
        DeadLetterReason::Permanent,
        DeadLetterReason::RetriesExhausted,
        DeadLetterReason::Poison,
        DeadLetterReason::InvalidPartitionKey,
        DeadLetterReason::VersionGap,
        DeadLetterReason::HeadersTooDeep,
        DeadLetterReason::TooManyHeaders,
        DeadLetterReason::UnreadableFrame,
        DeadLetterReason::InvalidCloudEvent,
        DeadLetterReason::InvalidBarePayload,
        DeadLetterReason::UnrecognizedFormat,
        DeadLetterReason::InvalidDerivedKey,
        DeadLetterReason::InvalidMassTransit,
        DeadLetterReason::InvalidNServiceBus,
        DeadLetterReason::InvalidSpringMessage,
    ];

    /// Whether the message itself was at fault as it arrived (malformed,
    /// unknown, unreadable): a producer's error, not this service's. The
    /// others (a handler's permanent failure, retries exhausted, poison, a
    /// version gap) are failures of the work.
    pub fn is_invalid_input(self) -> bool {
        !matches!(
            self,
            Self::Permanent | Self::RetriesExhausted | Self::Poison | Self::VersionGap
        )
    }

    /// The stable, kebab-case name used in headers, metrics and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::BodyTooLarge => "body-too-large",
            DeadLetterReason::InvalidContentType => "invalid-content-type",
            DeadLetterReason::UnsupportedContentEncoding => "unsupported-content-encoding",
            DeadLetterReason::MissingMessageId => "missing-message-id",
            DeadLetterReason::InvalidJson => "invalid-json",
            DeadLetterReason::InvalidEnvelope => "invalid-envelope",
            DeadLetterReason::MessageIdMismatch => "message-id-mismatch",
            DeadLetterReason::UnknownEventType => "unknown-event-type",
            DeadLetterReason::UnknownSchemaVersion => "unknown-schema-version",
            DeadLetterReason::InvalidPayload => "invalid-payload",
            DeadLetterReason::Permanent => "permanent-failure",
            DeadLetterReason::RetriesExhausted => "retries-exhausted",
            DeadLetterReason::Poison => "poison",
            DeadLetterReason::InvalidPartitionKey => "invalid-partition-key",
            DeadLetterReason::VersionGap => "version-gap",
            DeadLetterReason::HeadersTooDeep => "headers-too-deep",
            DeadLetterReason::TooManyHeaders => "too-many-headers",
            DeadLetterReason::UnreadableFrame => "unreadable-frame",
            DeadLetterReason::InvalidCloudEvent => "invalid-cloudevent",
            DeadLetterReason::InvalidBarePayload => "invalid-bare-payload",
            DeadLetterReason::UnrecognizedFormat => "unrecognized-format",
            DeadLetterReason::InvalidDerivedKey => "invalid-derived-key",
            DeadLetterReason::InvalidMassTransit => "invalid-masstransit",
            DeadLetterReason::InvalidNServiceBus => "invalid-nservicebus",
            DeadLetterReason::InvalidSpringMessage => "invalid-spring-message",
        }
    }

    /// Parses a name produced by [`as_str`](Self::as_str).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_failures_guide_lists_every_reason_as_the_code_names_it() {
        let guide = include_str!("../docs/failures.md");
        for reason in DeadLetterReason::ALL {
            let row = format!(
                "| `{reason:?}` | `{}` | {} |",
                reason.as_str(),
                if reason.is_invalid_input() {
                    "yes"
                } else {
                    "no"
                }
            );
            assert!(guide.contains(&row), "docs/failures.md lacks {row}");
        }
    }

    use super::*;

    #[test]
    fn reason_names_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for r in DeadLetterReason::ALL {
            assert_eq!(DeadLetterReason::from_name(r.as_str()), Some(r));
            assert!(seen.insert(r.as_str()));
        }
    }

    #[test]
    fn retry_after_only_applies_to_transient() {
        let p = HandlerError::permanent("no").retry_after(Duration::from_secs(1));
        assert_eq!(p.retry_after_hint(), None);
        let t = HandlerError::transient("later").retry_after(Duration::from_secs(1));
        assert_eq!(t.retry_after_hint(), Some(Duration::from_secs(1)));
    }
}
