//! The properties of each copy the consumer publishes from a delivery: to a
//! retry tier, parked for a version gap, to the dead-letter queue, back to its
//! own queue or on to another partition's. Each starts from [`copy_base`] and
//! adds warren's record; [`seal`](super::seal) then fits and signs it.

use chrono::Utc;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use std::collections::BTreeMap;

use super::MAX_ERROR_LEN;
use super::names::*;
use crate::amqp::{PERSISTENT, header_str, text, time, truncate};
use crate::version::GatedVersion;

/// What a copy records of the delivery it is made from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin<'a> {
    /// The delivery's trusted properties.
    pub(crate) properties: &'a BasicProperties,
    /// The exchange it was delivered from.
    pub(crate) exchange: &'a str,
    /// The routing key it was delivered with.
    pub(crate) routing_key: &'a str,
    /// The names of the headers the frame guard removed before the client
    /// read it ("" if none).
    pub(crate) removed: &'a str,
    /// The digest of every byte the frame guard removed or replaced ("" if
    /// none).
    pub(crate) digest: &'a str,
}

/// The copy of a delivery bound for a retry tier: its attempt count, failure
/// times, last error, original route and gated version recorded.
pub(crate) fn retry_copy(
    delivery: Origin<'_>,
    attempt: u32,
    error: &str,
    gated: Option<&GatedVersion>,
) -> BasicProperties {
    edit(copy_base(delivery.properties, false), |headers| {
        record_original_route(headers, delivery);
        let now = time(Utc::now());
        if !headers.contains_key(HEADER_FIRST_FAILURE) {
            headers.insert(HEADER_FIRST_FAILURE.into(), now.clone());
        }
        headers.insert(
            HEADER_ATTEMPT.into(),
            AMQPValue::LongLongInt(attempt.into()),
        );
        headers.insert(HEADER_LAST_FAILURE.into(), now);
        headers.insert(
            HEADER_LAST_ERROR.into(),
            text(truncate(error, MAX_ERROR_LEN)),
        );
        record_version(headers, gated);
    })
    .with_delivery_mode(PERSISTENT)
}

/// The copy of a delivery parked for a version gap: its attempt count
/// untouched, with the time the gap started waiting.
pub(crate) fn park_copy(
    delivery: Origin<'_>,
    since_ms: i64,
    gated: Option<&GatedVersion>,
) -> BasicProperties {
    edit(copy_base(delivery.properties, false), |headers| {
        record_original_route(headers, delivery);
        headers.insert(HEADER_GAP_SINCE.into(), AMQPValue::LongLongInt(since_ms));
        record_version(headers, gated);
    })
    .with_delivery_mode(PERSISTENT)
}

/// A dead-letter copy, its failure record already applied: with the id of
/// the letter, the version the gate checked and what the frame guard removed
/// from the delivery (the names of the headers and the digest of the bytes).
pub(crate) fn dead_letter_copy(
    with_record: BasicProperties,
    delivery: Origin<'_>,
    gated: Option<&GatedVersion>,
    letter_id: &str,
) -> BasicProperties {
    edit(with_record, |headers| {
        headers.insert(HEADER_LETTER_ID.into(), text(letter_id));
        if !delivery.removed.is_empty() {
            headers.insert(HEADER_DROPPED.into(), text(delivery.removed));
        }
        if !delivery.digest.is_empty() {
            headers.insert(HEADER_PRUNED_DIGEST.into(), text(delivery.digest));
        }
        record_version(headers, gated);
    })
}

/// A copy of a delivery that goes on unchanged, to its own queue or another
/// partition's: only its original route recorded, its per-message TTL kept.
pub(crate) fn onward_copy(delivery: Origin<'_>) -> BasicProperties {
    edit(copy_base(delivery.properties, true), |headers| {
        record_original_route(headers, delivery);
    })
}

/// The exchange and routing key the message was first published with: those an
/// earlier (signed) copy recorded, else this delivery's own. A copy travels
/// through the default exchange, and its dead-letter record should still name
/// the original route.
pub(crate) fn original_route(delivery: Origin<'_>) -> (String, String) {
    let headers = delivery.properties.headers().as_ref();
    let recorded = |name, fallback: &str| {
        headers
            .and_then(|h| header_str(h, name))
            .map_or_else(|| fallback.to_owned(), |c| c.into_owned())
    };
    (
        recorded(HEADER_ORIGINAL_EXCHANGE, delivery.exchange),
        recorded(HEADER_ORIGINAL_ROUTING_KEY, delivery.routing_key),
    )
}

/// `properties` with its header table changed by `change`, taken out once and
/// put back once.
fn edit(properties: BasicProperties, change: impl FnOnce(&mut FieldTable)) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    change(&mut headers);
    properties.with_headers(headers)
}

/// Records the delivery's exchange and routing key, unless an earlier copy
/// recorded the first ones.
fn record_original_route(headers: &mut FieldTable, delivery: Origin<'_>) {
    for (name, value) in [
        (HEADER_ORIGINAL_EXCHANGE, delivery.exchange),
        (HEADER_ORIGINAL_ROUTING_KEY, delivery.routing_key),
    ] {
        if !headers.contains_key(name) {
            headers.insert(name.into(), text(value));
        }
    }
}

/// Records the entity and version the gate checked, so that a replay of dead
/// letters can go in version order per entity.
fn record_version(headers: &mut FieldTable, gated: Option<&GatedVersion>) {
    if let Some(gated) = gated {
        headers.insert(
            HEADER_ENTITY.into(),
            text(truncate(&gated.entity, MAX_ERROR_LEN)),
        );
        headers.insert(HEADER_VERSION.into(), AMQPValue::LongLongInt(gated.version));
    }
}

/// `properties` without the broker's headers.
fn without_broker_headers(properties: &BasicProperties) -> BasicProperties {
    let Some(headers) = properties.headers() else {
        return properties.clone();
    };
    let kept: BTreeMap<_, _> = headers
        .inner()
        .iter()
        .filter(|(k, _)| !BROKER_HEADERS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    properties.clone().with_headers(FieldTable::from(kept))
}

/// `p` without its `user_id` and, unless `keep_expiration`, without a
/// per-message TTL (`expiration`).
pub(crate) fn rebuild(p: &BasicProperties, keep_expiration: bool) -> BasicProperties {
    let mut out = BasicProperties::default();
    macro_rules! copy {
        ($($get:ident => $set:ident),*) => {
            $(if let Some(v) = p.$get().clone() { out = out.$set(v); })*
        };
    }
    copy!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        headers => with_headers,
        delivery_mode => with_delivery_mode,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        app_id => with_app_id,
        cluster_id => with_cluster_id
    );
    if keep_expiration && let Some(v) = p.expiration().clone() {
        out = out.with_expiration(v);
    }
    out
}

/// The base of every copy warren publishes from a delivery: the delivery's
/// trusted properties without the broker's headers and without the `user_id`
/// (kept in [`HEADER_ORIGINAL_USER_ID`] unless an earlier copy already recorded
/// it); a per-message TTL only if `keep_expiration`.
pub fn copy_base(trusted: &BasicProperties, keep_expiration: bool) -> BasicProperties {
    let base = rebuild(&without_broker_headers(trusted), keep_expiration);
    let Some(user) = trusted.user_id() else {
        return base;
    };
    let mut headers = base.headers().clone().unwrap_or_default();
    if !headers.contains_key(HEADER_ORIGINAL_USER_ID) {
        headers.insert(HEADER_ORIGINAL_USER_ID.into(), text(user.as_str()));
    }
    base.with_headers(headers)
}
