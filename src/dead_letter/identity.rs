//! Which failure a dead letter is: an id the same for every copy of one
//! failure, and different for each failure of one message.
//!
//! A message can be dead-lettered more than once for one failure: the
//! consumer publishes the dead-letter copy, waits for the broker's confirm,
//! and acks the original; if that ack is lost (a failover, a crash), the
//! original comes back, fails the same way, and is dead-lettered again. Those
//! copies are one letter. The same message id failing again after an
//! operator replayed it is a second letter: the replay's id, which the
//! replayed copy carries, tells them apart. A random id would make two
//! letters of one failure; the message id alone would make one letter of two.

use sha2::{Digest, Sha256};

/// The id of the dead letter of `message_id`, failed in `consumer` after
/// the replay `replay_id` ("" for a message never replayed): 32 hex digits,
/// the same wherever and however often it is computed.
pub fn letter_id(consumer: &str, message_id: &str, replay_id: &str) -> String {
    digest(&[
        b"warren letter v1",
        consumer.as_bytes(),
        message_id.as_bytes(),
        replay_id.as_bytes(),
    ])
}

/// The id of a letter that carries no message id (dead-lettered as
/// `missing-message-id`, or by the broker itself): derived from what it is
/// made of, its body and route and, for one the broker dead-lettered, its
/// death record (`extra`).
pub fn letter_id_of_content(
    consumer: &str,
    body: &[u8],
    exchange: &str,
    routing_key: &str,
    extra: &str,
) -> String {
    digest(&[
        b"warren content letter v1",
        consumer.as_bytes(),
        body,
        exchange.as_bytes(),
        routing_key.as_bytes(),
        extra.as_bytes(),
    ])
}

/// The first 128 bits of SHA-256 over `parts`, each prefixed by its length
/// so that no two different lists of parts run together into one input.
fn digest(parts: &[&[u8]]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hex::encode(&hash.finalize()[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_failure_is_one_letter_and_a_replay_makes_another() {
        let first = letter_id("billing", "m-1", "");
        assert_eq!(first, letter_id("billing", "m-1", ""), "deterministic");
        assert_eq!(first.len(), 32);
        assert_ne!(
            first,
            letter_id("billing", "m-1", "r-1"),
            "failed again after a replay"
        );
        assert_ne!(first, letter_id("billing", "m-2", ""));
        assert_ne!(
            first,
            letter_id("ledger", "m-1", ""),
            "another consumer's letter"
        );
        // Parts do not run together: ("ab", "c") is not ("a", "bc").
        assert_ne!(letter_id("ab", "c", ""), letter_id("a", "bc", ""));
    }

    #[test]
    fn letters_without_an_id_are_told_apart_by_what_they_hold() {
        let a = letter_id_of_content("c", b"{}", "ex", "rk", "");
        assert_eq!(a, letter_id_of_content("c", b"{}", "ex", "rk", ""));
        assert_ne!(a, letter_id_of_content("c", b"{ }", "ex", "rk", ""));
        assert_ne!(
            a,
            letter_id_of_content("c", b"{}", "ex", "rk", "delivery_limit 1")
        );
    }
}
