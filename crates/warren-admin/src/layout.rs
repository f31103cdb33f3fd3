//! Where a letter's body keeps the business payload and who the message
//! is, by the format its consumer read it in: what redaction, `--set` and
//! the edit check need of every format, not of warren's envelope alone.

use warren::__kit::format::essence;
use warren::format::CONTENT_TYPE_STRUCTURED;
use warren::store::DeadLetterRecord;

/// The layout of a letter's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The member of the body's JSON object that holds the payload; `None`:
    /// the body is the payload.
    pub(crate) payload: Option<&'static str>,
    /// The members of the body that say who the message is (its id, a
    /// CloudEvent's source): an edit that changes one is a different
    /// message. Empty when the id travels in properties or headers, which an
    /// edit does not touch.
    pub(crate) identity: &'static [&'static str],
    /// The format's name as the letter recorded it (`warren` for a letter
    /// refused before a format read it, as warren's envelope was the only
    /// layout before formats).
    pub(crate) format: &'static str,
}

impl Layout {
    /// The layout of a letter read in `format` (its `x-warren-format`
    /// header), sent with `content_type`. `None` for a format warren does
    /// not ship: an application's own, whose layout only it knows.
    pub(crate) fn of(format: &str, content_type: Option<&str>) -> Option<Layout> {
        let (payload, identity, format): (_, &'static [&'static str], _) = match format {
            "" | "warren" => (Some("payload"), &["messageId"], "warren"),
            "bare" => (None, &[], "bare"),
            "cloudevents"
                if content_type.map(essence).as_deref() == Some(CONTENT_TYPE_STRUCTURED) =>
            {
                (
                    Some("data"),
                    &["id", "source", "specversion"],
                    "cloudevents",
                )
            }
            "cloudevents" => (None, &[], "cloudevents"),
            "masstransit" => (Some("message"), &["messageId"], "masstransit"),
            "nservicebus" => (None, &[], "nservicebus"),
            "spring" => (None, &[], "spring"),
            _ => return None,
        };
        Some(Layout {
            payload,
            identity,
            format,
        })
    }

    /// The layout of a stored letter: its format from its headers, its
    /// content type from its properties.
    pub(crate) fn of_record(record: &DeadLetterRecord) -> Result<Layout, String> {
        let format = record
            .header_texts()
            .into_iter()
            .find(|(name, _)| name == warren::headers::HEADER_FORMAT)
            .map(|(_, v)| v)
            .unwrap_or_default();
        let properties: serde_json::Value =
            serde_json::from_str(&record.properties).unwrap_or_default();
        let content_type = properties["content_type"].as_str();
        Layout::of(&format, content_type).ok_or_else(|| {
            format!(
                "letter {} was read in the application's own format {format:?}, whose layout warren does not know",
                record.letter.letter_id
            )
        })
    }

    /// The payload within `body`, parsed: `None` if the body is not JSON or
    /// has no payload member.
    pub(crate) fn payload_mut<'a>(
        &self,
        body: &'a mut serde_json::Value,
    ) -> Option<&'a mut serde_json::Value> {
        match self.payload {
            None => Some(body),
            Some(member) => body.get_mut(member),
        }
    }

    /// Where `--set` paths start, as the audit line names them.
    pub(crate) fn payload_path(&self) -> &'static str {
        self.payload.unwrap_or("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_shipped_format_has_its_layout() {
        let of = |f, ct| Layout::of(f, ct).map(|l| (l.payload, l.identity.len()));
        assert_eq!(of("", None), Some((Some("payload"), 1)));
        assert_eq!(
            of("warren", Some("application/json")),
            Some((Some("payload"), 1))
        );
        assert_eq!(of("bare", None), Some((None, 0)));
        assert_eq!(
            of(
                "cloudevents",
                Some("application/cloudevents+json; charset=utf-8")
            ),
            Some((Some("data"), 3))
        );
        assert_eq!(of("cloudevents", Some("application/json")), Some((None, 0)));
        assert_eq!(of("masstransit", None), Some((Some("message"), 1)));
        assert_eq!(of("nservicebus", None), Some((None, 0)));
        assert_eq!(of("spring", None), Some((None, 0)));
        assert_eq!(of("acme-avro", None), None);
    }
}
