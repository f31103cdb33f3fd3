//! Idempotency keys for effects outside the database.
//!
//! The inbox protects what the handler writes in its transaction. A call to a
//! payment provider, an email service or any other API is outside it: if the
//! process dies after the call and before the commit, the message comes back and
//! the call is made again. Providers that accept an `Idempotency-Key` header
//! recognize the second call when it carries the same key, so the key must be the
//! same on every attempt: derived from the message, never random.

use uuid::Uuid;

/// Namespace of warren's keys (a fixed, random UUID), so that they do not collide
/// with name-based UUIDs derived by other software from the same text.
const NAMESPACE: Uuid = Uuid::from_u128(0x5f3c_9a4e_2b7d_4c1a_8e6f_0d9b_3a2c_71e4);

/// A stable key for one external step of handling one message by one consumer:
/// the same inputs always give the same key, different inputs different keys. It
/// is a UUID (name-based, version 5), which providers accept as an
/// `Idempotency-Key`.
///
/// ```
/// let key = warren::handler::idempotency_key("billing", "019ad6b4-8a1e-7c3e-9f0a-5b2c1d3e4f50", "capture-payment");
/// assert_eq!(key, warren::handler::idempotency_key("billing", "019ad6b4-8a1e-7c3e-9f0a-5b2c1d3e4f50", "capture-payment"));
/// assert_ne!(key, warren::handler::idempotency_key("billing", "019ad6b4-8a1e-7c3e-9f0a-5b2c1d3e4f50", "send-receipt"));
/// ```
pub fn idempotency_key(consumer: &str, message_id: &str, step: &str) -> String {
    // Length-prefixed parts: ("a", "bc") and ("ab", "c") must not meet.
    let mut name = Vec::with_capacity(consumer.len() + message_id.len() + step.len() + 24);
    for part in [consumer, message_id, step] {
        name.extend_from_slice(&(part.len() as u64).to_be_bytes());
        name.extend_from_slice(part.as_bytes());
    }
    Uuid::new_v5(&NAMESPACE, &name).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_and_distinct() {
        let k = idempotency_key("c", "m", "s");
        assert_eq!(k, idempotency_key("c", "m", "s"));
        assert_ne!(k, idempotency_key("c2", "m", "s"));
        assert_ne!(k, idempotency_key("c", "m2", "s"));
        assert_ne!(
            idempotency_key("a", "bc", "s"),
            idempotency_key("ab", "c", "s")
        );
        assert!(Uuid::parse_str(&k).is_ok());
        // Fixed forever: a changed derivation would re-run every external call
        // whose message is redelivered across an upgrade.
        assert_eq!(
            idempotency_key("billing", "m-1", "record-payment").len(),
            36
        );
    }
}
