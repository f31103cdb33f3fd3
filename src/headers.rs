//! Headers on copies warren publishes: which of a delivery's headers can be
//! trusted, what a copy drops, and how large its headers may grow.
//!
//! A producer can set any header, including every `x-warren-*` one warren uses
//! for its bookkeeping, and on RabbitMQ 3.10 the broker's own headers too. So
//! warren signs the `x-warren-*` headers it writes with an HMAC whose key lives in
//! the database ([`Store::signing_key`](crate::Store::signing_key)), and believes
//! such a header only under a valid signature. Anything else named `x-warren-*` is
//! moved, untouched, into one table header, [`HEADER_UNVERIFIED`], where operators
//! still see it, labelled as not warren's.

use std::collections::BTreeMap;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use sha2::Sha256;

use crate::amqp::{header_str, text, truncate};

mod copies;
pub(crate) use copies::{
    Origin, dead_letter_copy, onward_copy, original_route, park_copy, retry_copy,
};

/// Header: failed attempts so far, set on copies sent to retry tiers. warren
/// counts attempts here, never in `x-death`.
pub const HEADER_ATTEMPT: &str = "x-warren-attempt";
/// Header: the error of the last failed attempt, on retry copies.
pub const HEADER_LAST_ERROR: &str = "x-warren-last-error";
/// Header: when the message was last replayed from the dead-letter queue.
pub const HEADER_REPLAYED_AT: &str = "x-warren-replayed-at";

/// Header: why the message was dead-lettered (a [`DeadLetterReason`](crate::DeadLetterReason) name).
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

/// Error texts are cut to this many bytes: enough to diagnose, too little to carry
/// a payload along by accident.
pub(crate) const MAX_ERROR_LEN: usize = 2000;

/// Error texts in a copy are cut to this when its headers would not fit a frame.
const SHRUNK_ERROR_LEN: usize = 200;

/// Room kept free in a frame for the property flags and short-string properties
/// around the headers table.
const FRAME_MARGIN: usize = 2048;

/// The frame size assumed when a connection reports none (RabbitMQ's default).
pub(crate) const DEFAULT_FRAME_MAX: usize = 128 * 1024;

fn is_warren(name: &str) -> bool {
    name.starts_with("x-warren-")
}

/// Signs and verifies warren's own headers. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Signer {
    key: Arc<[u8]>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer(***)")
    }
}

impl Signer {
    pub(crate) fn new(key: &[u8]) -> Self {
        Self { key: key.into() }
    }

    /// The MAC over the message id and every signed header, in name order. Each
    /// part is length-prefixed, so no two different header sets encode alike.
    fn mac(&self, message_id: &str, headers: &FieldTable) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        let mut part = |bytes: &[u8]| {
            mac.update(&(bytes.len() as u64).to_be_bytes());
            mac.update(bytes);
        };
        part(message_id.as_bytes());
        for (name, value) in headers.inner() {
            let name = name.as_str();
            if !is_warren(name) || name == HEADER_SIGNATURE || name == HEADER_UNVERIFIED {
                continue;
            }
            part(name.as_bytes());
            match value {
                AMQPValue::LongString(s) => {
                    part(b"S");
                    part(s.as_bytes());
                }
                AMQPValue::LongLongInt(i) => {
                    part(b"l");
                    part(&i.to_be_bytes());
                }
                // warren writes only the two types above; anything else is
                // covered by its debug form, which is enough to make it count.
                other => {
                    part(b"?");
                    part(format!("{other:?}").as_bytes());
                }
            }
        }
        mac
    }

    /// Adds the signature over `headers`' `x-warren-*` entries.
    pub(crate) fn sign(&self, message_id: &str, headers: &mut FieldTable) {
        let tag = self.mac(message_id, headers).finalize().into_bytes();
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        headers.insert(HEADER_SIGNATURE.into(), text(&hex));
    }

    /// True if `headers` carries a valid signature over its `x-warren-*` entries.
    pub(crate) fn verify(&self, message_id: &str, headers: &FieldTable) -> bool {
        let Some(AMQPValue::LongString(given)) = headers.inner().get(HEADER_SIGNATURE) else {
            return false;
        };
        let Some(given) = decode_hex(given.as_bytes()) else {
            return false;
        };
        self.mac(message_id, headers).verify_slice(&given).is_ok()
    }

    /// The delivery's properties as warren may rely on them: `x-warren-*` headers
    /// without a valid signature are moved into [`HEADER_UNVERIFIED`]; the
    /// broker's headers are left for the caller to judge.
    pub(crate) fn trusted(&self, properties: &BasicProperties) -> BasicProperties {
        let Some(headers) = properties.headers() else {
            return properties.clone();
        };
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
            .unwrap_or_default();
        let claims = headers
            .inner()
            .keys()
            .any(|k| is_warren(k.as_str()) && k.as_str() != HEADER_UNVERIFIED);
        if !claims || self.verify(message_id, headers) {
            return properties.clone();
        }
        let mut kept = BTreeMap::new();
        let mut unverified = match headers.inner().get(HEADER_UNVERIFIED) {
            Some(AMQPValue::FieldTable(t)) => t.clone(),
            _ => FieldTable::default(),
        };
        for (name, value) in headers.inner() {
            if name.as_str() == HEADER_UNVERIFIED {
                continue;
            }
            if is_warren(name.as_str()) {
                unverified.insert(name.clone(), value.clone());
            } else {
                kept.insert(name.clone(), value.clone());
            }
        }
        kept.insert(
            ShortString::from(HEADER_UNVERIFIED),
            AMQPValue::FieldTable(unverified),
        );
        properties.clone().with_headers(FieldTable::from(kept))
    }
}

fn decode_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    hex.chunks(2)
        .map(|pair| {
            let digit = |c: u8| (c as char).to_digit(16);
            Some((digit(pair[0])? * 16 + digit(pair[1])?) as u8)
        })
        .collect()
}

/// `properties` without the broker's headers.
pub(crate) fn without_broker_headers(properties: &BasicProperties) -> BasicProperties {
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
pub(crate) fn copy_base(trusted: &BasicProperties, keep_expiration: bool) -> BasicProperties {
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

/// Finishes a copy: makes its headers fit a frame of `frame_max` bytes, then
/// signs warren's headers.
pub(crate) fn seal(
    properties: BasicProperties,
    signer: &Signer,
    frame_max: usize,
) -> BasicProperties {
    let mut properties = fit(properties, frame_max);
    let mut headers = properties.headers().clone().unwrap_or_default();
    let message_id = properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    signer.sign(&message_id, &mut headers);
    properties = properties.with_headers(headers);
    properties
}

/// `properties` with headers small enough for one frame: first warren's error
/// texts are shortened, then the producer's largest headers are dropped (their
/// names recorded in [`HEADER_DROPPED`]). The body is never touched. Without
/// this, a huge error text or producer header would make every copy of the
/// message fail to publish, and the message would circle forever.
pub(crate) fn fit(properties: BasicProperties, frame_max: usize) -> BasicProperties {
    let budget = frame_max.saturating_sub(FRAME_MARGIN).max(1024);
    let Some(headers) = properties.headers().clone() else {
        return properties;
    };
    if table_len(&headers) <= budget {
        return properties;
    }
    let mut headers = headers;
    for name in [HEADER_ERROR, HEADER_LAST_ERROR] {
        if let Some(AMQPValue::LongString(value)) = headers.inner().get(name) {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            headers.insert(name.into(), text(truncate(&value, SHRUNK_ERROR_LEN)));
        }
    }
    let mut dropped = Vec::new();
    while table_len(&headers) > budget {
        // Largest first; warren's own record goes last, the signature never.
        let largest = headers
            .inner()
            .iter()
            .filter(|(k, _)| k.as_str() != HEADER_SIGNATURE && k.as_str() != HEADER_DROPPED)
            .max_by_key(|(k, v)| (!is_warren(k.as_str()), value_len(v)))
            .map(|(k, _)| k.clone());
        let Some(name) = largest else { break };
        let mut rest = headers.inner().clone();
        rest.remove(&name);
        headers = FieldTable::from(rest);
        dropped.push(name.to_string());
    }
    if !dropped.is_empty() {
        // Names the guard recorded before stay first.
        let mut names = header_str(&headers, HEADER_DROPPED)
            .map(|n| vec![n.into_owned()])
            .unwrap_or_default();
        names.extend(dropped);
        let names = names.join(", ");
        headers.insert(HEADER_DROPPED.into(), text(truncate(&names, 1000)));
    }
    properties.with_headers(headers)
}

/// Checks that `properties` fits in one frame of `frame_max` bytes; the broker
/// would close the channel on a larger one.
pub(crate) fn check_frame_size(
    properties: &BasicProperties,
    frame_max: usize,
) -> Result<(), String> {
    let size = properties.headers().as_ref().map_or(0, table_len);
    let limit = frame_max.saturating_sub(FRAME_MARGIN / 2);
    if size > limit {
        return Err(format!(
            "its headers take {size} bytes, more than fit in one {frame_max}-byte frame"
        ));
    }
    Ok(())
}

/// The encoded size of a field table, as AMQP writes it.
fn table_len(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + 1 + value_len(v))
        .sum::<usize>()
}

fn value_len(value: &AMQPValue) -> usize {
    match value {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldArray(a) => {
            4 + a.as_slice().iter().map(|v| 1 + value_len(v)).sum::<usize>()
        }
        AMQPValue::FieldTable(t) => table_len(t),
        AMQPValue::Void => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), v.clone());
        }
        BasicProperties::default()
            .with_message_id("m1".into())
            .with_headers(table)
    }

    #[test]
    fn signed_headers_are_trusted_and_forged_ones_set_apart() {
        let signer = Signer::new(b"key");
        let mut headers = FieldTable::default();
        headers.insert(HEADER_ATTEMPT.into(), AMQPValue::LongLongInt(2));
        signer.sign("m1", &mut headers);
        let signed = BasicProperties::default()
            .with_message_id("m1".into())
            .with_headers(headers.clone());
        assert_eq!(signer.trusted(&signed), signed);

        // The same headers on another message, with another key, or altered.
        let moved = signed.clone().with_message_id("m2".into());
        let other_key = Signer::new(b"other");
        let mut altered = headers.clone();
        altered.insert(HEADER_ATTEMPT.into(), AMQPValue::LongLongInt(1));
        let altered = signed.clone().with_headers(altered);
        let forged = props(&[
            (HEADER_ATTEMPT, AMQPValue::LongLongInt(999)),
            ("tenant", text("acme")),
        ]);
        for (case, p, s) in [
            ("moved", &moved, &signer),
            ("other key", &signed, &other_key),
            ("altered", &altered, &signer),
            ("forged", &forged, &signer),
        ] {
            let t = s.trusted(p);
            let h = t.headers().as_ref().unwrap();
            assert!(!h.contains_key(HEADER_ATTEMPT), "{case}: not believed");
            let Some(AMQPValue::FieldTable(set_apart)) = h.inner().get(HEADER_UNVERIFIED) else {
                panic!("{case}: kept apart");
            };
            assert!(set_apart.contains_key(HEADER_ATTEMPT), "{case}");
        }
        let t = signer.trusted(&forged);
        let h = t.headers().as_ref().unwrap();
        assert_eq!(
            header_str(h, "tenant").unwrap(),
            "acme",
            "the producer's own headers are kept"
        );
    }

    #[test]
    fn copies_drop_user_id_and_broker_headers_but_record_the_user() {
        let p = props(&[("x-delivery-count", AMQPValue::LongLongInt(9))])
            .with_user_id("A".into())
            .with_expiration("100".into());
        let copy = copy_base(&p, false);
        assert_eq!(*copy.user_id(), None);
        assert_eq!(*copy.expiration(), None);
        let h = copy.headers().as_ref().unwrap();
        assert!(!h.contains_key("x-delivery-count"));
        assert_eq!(header_str(h, HEADER_ORIGINAL_USER_ID).unwrap(), "A");
    }

    #[test]
    fn oversized_headers_are_cut_to_fit_a_frame() {
        let p = props(&[
            ("big", text(&"x".repeat(200_000))),
            ("small", text("keep")),
            (HEADER_ERROR, text(&"e".repeat(5000))),
        ]);
        assert!(check_frame_size(&p, DEFAULT_FRAME_MAX).is_err());
        let fitted = fit(p, DEFAULT_FRAME_MAX);
        check_frame_size(&fitted, DEFAULT_FRAME_MAX).unwrap();
        let h = fitted.headers().as_ref().unwrap();
        assert!(!h.contains_key("big"));
        assert_eq!(header_str(h, "small").unwrap(), "keep");
        assert_eq!(header_str(h, HEADER_DROPPED).unwrap(), "big");
        assert!(header_str(h, HEADER_ERROR).unwrap().len() <= SHRUNK_ERROR_LEN);
    }
}
