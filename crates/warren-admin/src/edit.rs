//! Editing a stored letter before it is replayed: the edit must still be the
//! same message (in the format it came in, with the same id, so that the
//! inbox still protects its effect), the original is kept beside it, and who
//! edited it and why goes to the audit table.

use warren::admin::DeadLetterReason;
use warren::envelope::{Envelope, Incoming};
use warren::store::{Actor, DeadLetterRecord, DeadLetterStore, StoreError};

use crate::layout::Layout;

/// Why an edit was refused.
#[derive(Debug, thiserror::Error)]
pub enum EditError {
    /// Edits are switched off on this database.
    #[error(
        "editing dead letters is switched off here (`warren dead-letters policy --edit on` allows it)"
    )]
    NotAllowed,
    /// No letter has the id.
    #[error("no dead letter {0:?}")]
    NoSuchLetter(String),
    /// The letter's body was cut when stored.
    #[error("letter {0} was stored cut; its whole body is only on the side queue")]
    Cut(String),
    /// The letter has no message id: nothing would keep a replay from
    /// applying twice.
    #[error(
        "letter {0} has no message id; its replay could not be deduplicated, so it is not edited"
    )]
    NoMessageId(String),
    /// The edit is no longer a valid envelope.
    #[error("the edit is not a valid envelope ({reason}): {detail}")]
    NotAnEnvelope {
        /// The reason the consumer would give.
        reason: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The edit of a letter in another format is no longer one of it.
    #[error("the edit is not a valid {format} message: {detail}")]
    NotReadable {
        /// The letter's format.
        format: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The letter's id was derived from its payload by its route: an edit
    /// could change it, and nothing here can recompute it.
    #[error(
        "letter {0} is keyed by a key its route derives from the payload; an edit could change the key, so it is not edited"
    )]
    DerivedKey(String),
    /// The letter was read in an application's own format.
    #[error("{0}")]
    UnknownFormat(String),
    /// The edit changes the message id.
    #[error("the edit changes the message id; the inbox would no longer recognize it ({0})")]
    MessageIdChanged(String),
    /// The edit changes nothing.
    #[error("the edit changes nothing")]
    Unchanged,
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Checks `body` as an edit of letter `letter_id` and keeps it, with
/// `reason`, audited as done by `actor`. The payload fields it changes are
/// named in the audit line.
pub async fn edit_letter<S: DeadLetterStore>(
    store: &S,
    letter_id: &str,
    body: &[u8],
    reason: &str,
    actor: &Actor,
) -> Result<(), EditError> {
    if !store.edits_allowed().await? {
        return Err(EditError::NotAllowed);
    }
    let record = store
        .dead_letter(letter_id)
        .await?
        .ok_or_else(|| EditError::NoSuchLetter(letter_id.to_owned()))?;
    if record.letter.body_truncated {
        return Err(EditError::Cut(letter_id.to_owned()));
    }
    let message_id = record.letter.message_id.as_str();
    if message_id.is_empty() {
        return Err(EditError::NoMessageId(letter_id.to_owned()));
    }
    let layout = Layout::of_record(&record).map_err(EditError::UnknownFormat)?;
    let before: serde_json::Value =
        serde_json::from_slice(record.body_to_send()).unwrap_or_default();
    let (after, event_type) = if layout.format == "warren" {
        let envelope = Envelope::parse(
            Incoming {
                message_id: Some(message_id),
                content_type: Some("application/json"),
                ..Incoming::body_only(body)
            },
            usize::MAX,
        )
        .map_err(|e| match e.reason {
            DeadLetterReason::MessageIdMismatch => EditError::MessageIdChanged(e.detail),
            reason => EditError::NotAnEnvelope {
                reason: reason.as_str(),
                detail: e.detail,
            },
        })?;
        let after: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let m = envelope.meta;
        (after, format!("{} v{}", m.event_type, m.schema_version))
    } else {
        (
            checked_edit(&layout, message_id, letter_id, &before, body)?,
            record.letter.event_type.clone(),
        )
    };
    if before == after {
        return Err(EditError::Unchanged);
    }
    let changed = changed_fields(&before, &after, "");
    let detail = format!(
        "{event_type}: changed {}",
        if changed.is_empty() {
            "formatting only".to_owned()
        } else {
            changed.join(", ")
        }
    );
    if store
        .edit_dead_letter(letter_id, body, reason, &detail, actor)
        .await?
    {
        Ok(())
    } else {
        Err(EditError::NoSuchLetter(letter_id.to_owned()))
    }
}

/// Checks the edit of a letter in a format other than warren's envelope:
/// JSON, its payload where the format keeps it, the members that say who
/// it is unchanged. Returns the edit, parsed.
fn checked_edit(
    layout: &Layout,
    message_id: &str,
    letter_id: &str,
    before: &serde_json::Value,
    body: &[u8],
) -> Result<serde_json::Value, EditError> {
    if message_id.starts_with(warren::__kit::format::DERIVED_PREFIX) {
        return Err(EditError::DerivedKey(letter_id.to_owned()));
    }
    let format = layout.format;
    let mut after: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| EditError::NotReadable {
            format,
            detail: format!("not JSON: {e}"),
        })?;
    if layout.payload_mut(&mut after).is_none() {
        return Err(EditError::NotReadable {
            format,
            detail: format!("it has no {:?} member", layout.payload_path()),
        });
    }
    for member in layout.identity {
        if before.get(member) != after.get(member) {
            return Err(EditError::MessageIdChanged(format!(
                "{member} was {}, is {}",
                before.get(member).unwrap_or(&serde_json::Value::Null),
                after.get(member).unwrap_or(&serde_json::Value::Null),
            )));
        }
    }
    Ok(after)
}

/// Sets each `path=value` in the payload of `record`'s body (the edited
/// one if it has one), wherever its format keeps the payload (a dotted
/// path; the value read as JSON where it parses, else as a string), and
/// returns the new body.
pub fn set_payload_fields(
    record: &DeadLetterRecord,
    sets: &[(String, String)],
) -> Result<Vec<u8>, String> {
    let layout = Layout::of_record(record)?;
    set_fields(record.body_to_send(), layout, sets)
}

fn set_fields(body: &[u8], layout: Layout, sets: &[(String, String)]) -> Result<Vec<u8>, String> {
    let mut envelope: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("the letter's body is not JSON: {e}"))?;
    let payload = layout.payload_mut(&mut envelope).ok_or_else(|| {
        format!(
            "the letter's body has no {:?} member",
            layout.payload_path()
        )
    })?;
    for (path, value) in sets {
        let value = serde_json::from_str(value)
            .unwrap_or_else(|_| serde_json::Value::String(value.clone()));
        let mut at = &mut *payload;
        let steps: Vec<&str> = path.split('.').collect();
        for (i, step) in steps.iter().enumerate() {
            let object = at
                .as_object_mut()
                .ok_or_else(|| format!("payload.{} is not an object", steps[..i].join(".")))?;
            if i + 1 == steps.len() {
                object.insert((*step).to_owned(), value.clone());
                break;
            }
            at = object
                .entry((*step).to_owned())
                .or_insert_with(|| serde_json::Value::Object(Default::default()));
        }
    }
    serde_json::to_vec(&envelope).map_err(|e| e.to_string())
}

/// The dotted paths whose values differ between `a` and `b`.
fn changed_fields(a: &serde_json::Value, b: &serde_json::Value, at: &str) -> Vec<String> {
    use serde_json::Value::Object;
    match (a, b) {
        (Object(x), Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .flat_map(|k| {
                    let path = if at.is_empty() {
                        k.clone()
                    } else {
                        format!("{at}.{k}")
                    };
                    let none = serde_json::Value::Null;
                    changed_fields(x.get(k).unwrap_or(&none), y.get(k).unwrap_or(&none), &path)
                })
                .collect()
        }
        (x, y) if x == y => Vec::new(),
        _ => vec![at.to_owned()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_set_in_the_payload_and_changes_named() {
        let body = br#"{"messageId":"m","payload":{"amount":1,"card":{"exp":"1/30"}}}"#;
        let sets = [
            ("amount".to_owned(), "12.5".to_owned()),
            ("card.exp".to_owned(), "12/30".to_owned()),
            ("note".to_owned(), "hi".to_owned()),
        ];
        let warren = Layout::of("warren", None).unwrap();
        let edited = set_fields(body, warren, &sets).unwrap();
        let a: serde_json::Value = serde_json::from_slice(body).unwrap();
        let b: serde_json::Value = serde_json::from_slice(&edited).unwrap();
        assert_eq!(b["payload"]["amount"], 12.5);
        assert_eq!(b["payload"]["card"]["exp"], "12/30");
        assert_eq!(b["payload"]["note"], "hi");
        assert_eq!(
            changed_fields(&a, &b, ""),
            ["payload.amount", "payload.card.exp", "payload.note"]
        );
        assert!(set_fields(b"nope", warren, &sets).is_err());
        let bare =
            set_fields(br#"{"amount":1}"#, Layout::of("bare", None).unwrap(), &sets).unwrap();
        let bare: serde_json::Value = serde_json::from_slice(&bare).unwrap();
        assert_eq!(
            (bare["amount"].clone(), bare["card"]["exp"].clone()),
            (12.5.into(), "12/30".into())
        );
    }
}
