//! Printing what came from a message: times, one-line text, ids, always made
//! safe to print.

use warren_admin::printable;

pub(crate) fn time(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|| "-".into())
}

/// Message-derived text, escaped by [`warren_admin::printable`], cut to `max` characters.
pub(crate) fn one_line(s: &str, max: usize) -> String {
    let flat = printable(s);
    if flat.chars().count() <= max {
        flat.into_owned()
    } else {
        flat.chars()
            .take(max.saturating_sub(1))
            .chain(['…'])
            .collect()
    }
}

/// A message id for display: escaped, `(none)` if empty.
pub(crate) fn id(message_id: &str) -> std::borrow::Cow<'_, str> {
    if message_id.is_empty() {
        "(none)".into()
    } else {
        printable(message_id)
    }
}
