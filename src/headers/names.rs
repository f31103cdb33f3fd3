//! The names of the headers warren writes and reads.

/// Header: failed attempts so far, set on copies sent to retry tiers. warren
/// counts attempts here, never in `x-death`.
pub const HEADER_ATTEMPT: &str = "x-warren-attempt";
/// Header: the error of the last failed attempt, on retry copies.
pub const HEADER_LAST_ERROR: &str = "x-warren-last-error";
/// Header: when the message was last replayed from the dead-letter queue.
pub const HEADER_REPLAYED_AT: &str = "x-warren-replayed-at";
/// Header: the id of the replay that sent this copy (from the dead-letter
/// store). The consumer journals the copy's outcome under it, and a copy
/// that fails again is a new dead letter, told apart by it.
pub const HEADER_REPLAY_ID: &str = "x-warren-replay-id";
/// Header: the id of one dead letter, on the copy warren dead-letters: the
/// same for every copy of one failure, so that storing it is effectively
/// once (see [`letter_id`](crate::admin::letter_id)).
pub const HEADER_LETTER_ID: &str = "x-warren-letter-id";

/// Header: why the message was dead-lettered (a [`DeadLetterReason`](crate::admin::DeadLetterReason) name).
pub const HEADER_REASON: &str = "x-warren-reason";
/// Header: the error text.
pub const HEADER_ERROR: &str = "x-warren-error";
/// Header: how many times the message was attempted.
pub const HEADER_ATTEMPTS: &str = "x-warren-attempts";
/// Header: the exchange the message was originally published to.
pub const HEADER_ORIGINAL_EXCHANGE: &str = "x-warren-original-exchange";
/// Header: the routing key the message was originally published with.
pub const HEADER_ORIGINAL_ROUTING_KEY: &str = "x-warren-original-routing-key";
/// Header: the consumer that gave up on the message.
pub const HEADER_CONSUMER: &str = "x-warren-consumer";
/// Header: the queue the message was consumed from.
pub const HEADER_QUEUE: &str = "x-warren-queue";
/// Header: when the message first failed (RFC 3339).
pub const HEADER_FIRST_FAILURE: &str = "x-warren-first-failure";
/// Header: when the message last failed (RFC 3339).
pub const HEADER_LAST_FAILURE: &str = "x-warren-last-failure";
/// Header: on a dead letter whose message was read, the id warren knew it by
/// ([`Identity::key`](crate::format::Identity::key)): the inbox's, the
/// journal's and the dead-letter store's, whatever the AMQP `message_id`.
pub const HEADER_MESSAGE_KEY: &str = "x-warren-message-key";
/// Header: on a dead letter whose message was read, the format it was read
/// in (`warren`, `bare`, `cloudevents`, ...).
pub const HEADER_FORMAT: &str = "x-warren-format";
/// Header: on a dead letter whose message was read, its event type as read
/// (a CloudEvent's `type`, a framework's mapped type), which the AMQP `type`
/// property may not carry.
pub const HEADER_EVENT_TYPE: &str = "x-warren-event-type";

/// Header: when a strict-sequence gap started waiting (milliseconds since the
/// epoch), on parked copies.
pub const HEADER_GAP_SINCE: &str = "x-warren-gap-since";
/// Header: the entity the version gate checked, on retry, parked and
/// dead-lettered copies (replays go in version order per entity).
pub const HEADER_ENTITY: &str = "x-warren-entity";
/// Header: the version the version gate checked, beside [`HEADER_ENTITY`].
pub const HEADER_VERSION: &str = "x-warren-version";

/// Header: the partition key a producer sets, as an AMQP long string (the
/// header a partitioned consumer hashes on unless configured otherwise).
pub const HEADER_PARTITION_KEY: &str = "partition-key";

/// Header: a bare payload's schema version, as warren publishes one
/// ([`OutgoingFormat::Bare`](crate::OutgoingFormat::Bare)); read it with
/// [`VersionFrom::Header`](crate::format::VersionFrom::Header).
pub const HEADER_SCHEMA_VERSION: &str = "schema-version";

/// Header: warren's signature over its own `x-warren-*` headers and the message id.
pub const HEADER_SIGNATURE: &str = "x-warren-signature";
/// Header: a table of the `x-warren-*` headers a delivery carried without a
/// valid signature: set by a producer or a tool, never by warren's consumer.
pub const HEADER_UNVERIFIED: &str = "x-warren-unverified";
/// Header: the AMQP `user_id` the original publisher set. Copies warren publishes
/// cannot keep the property (the broker refuses a `user_id` other than the
/// publishing connection's user), so it is recorded here instead.
pub const HEADER_ORIGINAL_USER_ID: &str = "x-warren-original-user-id";
/// Header: names of producer headers dropped from a copy: because, with
/// warren's record added, the headers no longer fit in one AMQP frame, or
/// because the frame guard removed them before the message was read
/// ([`guard`](crate::broker::guard)).
pub const HEADER_DROPPED: &str = "x-warren-dropped-headers";
/// Header: on a message the frame guard rewrote, `sha256:` and the hex digest
/// of every byte it removed or replaced, in frame order.
pub const HEADER_PRUNED_DIGEST: &str = "x-warren-pruned-digest";

/// Headers the broker adds on its own (dead-lettering history, quorum delivery
/// counts). A republished copy drops them: they describe the old copy's life, a
/// producer may have forged them, and newer brokers ignore client-set `x-death`.
pub(crate) const BROKER_HEADERS: &[&str] = &[
    "x-death",
    "x-acquired-count",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-delivery-count",
];

/// Header: the W3C `traceparent` (see [`crate::trace_context`]).
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// Header: the W3C `tracestate`.
pub const HEADER_TRACESTATE: &str = "tracestate";
/// Header: W3C `baggage`.
pub const HEADER_BAGGAGE: &str = "baggage";
/// Header: when the relay published the message, in milliseconds since the
/// epoch by the relay's clock (an AMQP long long int). The AMQP `timestamp`
/// property is when the event occurred, in whole seconds.
pub const HEADER_PUBLISHED_AT_MS: &str = "published-at-ms";
