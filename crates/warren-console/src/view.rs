//! What the pages show, made from the store's rows: ages, masked payloads,
//! and the text of each value. Escaping is the templates' job; nothing here
//! builds HTML.

use chrono::{DateTime, Utc};
use serde_json::Value;

/// What a masked value shows until an operator asks to see it.
pub(crate) const MASK: &str = "••• masked •••";

/// An age a person reads at a glance: `42s`, `17m`, `5h`, `3d`.
pub(crate) fn age(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let secs = (now - at).num_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// A time as the pages print it, to the second, in UTC.
pub(crate) fn time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// The payload as the letter page shows it: JSON pretty-printed, with the
/// `masked` fields (at any depth) hidden unless `reveal`; other bytes as
/// text, invalid UTF-8 replaced. Whether anything was masked comes back too.
pub(crate) fn payload(body: &[u8], masked: &[String], reveal: bool) -> (String, bool) {
    match serde_json::from_slice::<Value>(body) {
        Ok(mut v) => {
            let hid = !reveal && mask(&mut v, masked);
            (serde_json::to_string_pretty(&v).unwrap_or_default(), hid)
        }
        Err(_) => (String::from_utf8_lossy(body).into_owned(), false),
    }
}

/// Replaces the values of `fields` in `v`, at any depth; whether any was.
fn mask(v: &mut Value, fields: &[String]) -> bool {
    let mut any = false;
    match v {
        Value::Object(map) => {
            for (k, child) in map.iter_mut() {
                if fields.iter().any(|f| f == k) {
                    *child = Value::String(MASK.into());
                    any = true;
                } else {
                    any |= mask(child, fields);
                }
            }
        }
        Value::Array(items) => {
            for child in items {
                any |= mask(child, fields);
            }
        }
        _ => {}
    }
    any
}

/// Percent-encodes `s` for a URL's path segment or query value.
pub(crate) fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_fields_are_masked_at_any_depth_until_revealed() {
        let body = br#"{"card":"4111","order":{"card":"5500","n":1},"items":[{"card":"x"}]}"#;
        let masked = vec!["card".to_owned()];
        let (shown, hid) = payload(body, &masked, false);
        assert!(hid);
        assert!(!shown.contains("4111") && !shown.contains("5500") && !shown.contains("\"x\""));
        assert!(shown.contains("\"n\": 1"));
        let (shown, hid) = payload(body, &masked, true);
        assert!(!hid);
        assert!(shown.contains("4111") && shown.contains("5500"));
    }

    #[test]
    fn bytes_that_are_not_json_show_as_text() {
        let (shown, hid) = payload(b"<script>\xff", &["card".into()], false);
        assert_eq!(shown, "<script>\u{fffd}");
        assert!(!hid);
    }

    #[test]
    fn ages_read_at_a_glance() {
        let now = Utc::now();
        assert_eq!(age(now - chrono::Duration::seconds(5), now), "5s");
        assert_eq!(age(now - chrono::Duration::minutes(17), now), "17m");
        assert_eq!(age(now - chrono::Duration::hours(5), now), "5h");
        assert_eq!(age(now - chrono::Duration::days(3), now), "3d");
        assert_eq!(age(now + chrono::Duration::days(3), now), "0s");
    }
}
