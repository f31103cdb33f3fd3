//! What made a letter fail, as a key: letters that failed for the same cause
//! share it, so they are seen, replayed and muted as one group.

use sha2::{Digest, Sha256};

/// The group key of a letter: the reason, the shape of the error text
/// ([`error_shape`]) and the event type, hashed to 16 hex digits.
pub fn fingerprint(reason: &str, error: &str, event_type: &str) -> String {
    let mut hash = Sha256::new();
    for part in [reason, &error_shape(error), event_type] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hex::encode(&hash.finalize()[..8])
}

/// An error text with what varies from one message to the next taken out:
/// quoted values become `"…"`, numbers `<n>`, and words with digits in them
/// (ids like `cus_832`, `inv-10394`, UUIDs, hashes) `<id>`. "customer cus_832
/// not found" and "customer cus_77 not found" have one shape.
pub fn error_shape(error: &str) -> String {
    let mut out = String::with_capacity(error.len());
    let mut chars = error.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' | '`' => {
                // A quoted value, to its closing quote (or the end).
                for d in chars.by_ref() {
                    if d == c {
                        break;
                    }
                }
                out.push(c);
                out.push('…');
                out.push(c);
            }
            c if is_word(c) => {
                let mut word = String::from(c);
                while let Some(&d) = chars.peek() {
                    if is_word(d) {
                        word.push(d);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push_str(&word_shape(&word));
            }
            c => out.push(c),
        }
    }
    out
}

/// Letters, digits, and the joints of ids (`_`, `-`, `.` between them).
fn is_word(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '-' | '.')
}

fn word_shape(word: &str) -> String {
    let trimmed = word.trim_end_matches(['.', '-']);
    let tail = &word[trimmed.len()..];
    if !trimmed.chars().any(|c| c.is_ascii_digit()) {
        return word.to_owned();
    }
    let numeric = trimmed
        .chars()
        .all(|c| c.is_ascii_digit() || c == '.' || c == '-');
    format!("{}{tail}", if numeric { "<n>" } else { "<id>" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_varies_between_messages_is_taken_out() {
        assert_eq!(
            error_shape("customer cus_832 not found"),
            "customer <id> not found"
        );
        assert_eq!(
            error_shape("amount -12.50 below 0 for invoice inv-10394."),
            "amount <n> below <n> for invoice <id>."
        );
        assert_eq!(
            error_shape(r#"unknown currency "XYZ" in 'line 3'"#),
            r#"unknown currency "…" in '…'"#
        );
        assert_eq!(
            error_shape("row 0190f2a4-1b2c-7d3e-8f40-123456789abc locked"),
            "row <id> locked"
        );
        assert_eq!(error_shape("timeout"), "timeout");
    }

    #[test]
    fn one_cause_is_one_group() {
        let a = fingerprint(
            "permanent-failure",
            "customer cus_1 not found",
            "billing.x.v1",
        );
        let b = fingerprint(
            "permanent-failure",
            "customer cus_22 not found",
            "billing.x.v1",
        );
        assert_eq!(a, b);
        assert_eq!(a.len(), 16);
        assert_ne!(
            a,
            fingerprint(
                "retries-exhausted",
                "customer cus_1 not found",
                "billing.x.v1"
            )
        );
        assert_ne!(
            a,
            fingerprint(
                "permanent-failure",
                "customer cus_1 not found",
                "billing.y.v1"
            )
        );
        assert_ne!(
            a,
            fingerprint(
                "permanent-failure",
                "invoice cus_1 not found",
                "billing.x.v1"
            )
        );
    }
}
