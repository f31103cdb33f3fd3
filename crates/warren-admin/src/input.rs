//! Every value an operator gives the console or the CLI (a query parameter, a
//! form field, a path segment, a flag), checked against one rule before any
//! store sees it.
//!
//! A value that breaks its rule is refused with an [`InputError`] naming the
//! parameter and the rule: the console answers 400 with it, the CLI exits 2.
//! What passes is something every store holds and compares alike: no NUL or
//! control character (PostgreSQL refuses a NUL in text), lengths within the
//! columns, times within what MariaDB's `DATETIME(6)` holds (and kept to the
//! millisecond, as SQLite keeps them), numbers that read the same as a
//! PostgreSQL `numeric` and as a 64-bit float.
//!
//! The rules follow the writers of each value: a message id is what an
//! inbox accepts ([`MAX_MESSAGE_ID_LEN`]), a group what a fingerprint or a
//! reclassification makes, a letter or run id what warren generates.
//!
//! ```
//! use warren_admin::input;
//!
//! assert_eq!(input::group("group", "9f2c41d07a5be613").unwrap(), "9f2c41d07a5be613");
//! let refused = input::text("event_type", "billing\0paid").unwrap_err();
//! assert_eq!(refused.parameter, "event_type");
//! assert!(refused.to_string().contains("no control character"));
//! ```

use std::fmt;

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};

use warren::__kit::{JsonNumber, to_millisecond};
pub use warren::__kit::{MAX_EXPONENT, MAX_SIGNIFICANT_DIGITS};
use warren::admin::printable;
use warren::amqp::MAX_SHORT_STRING_LEN;
use warren::envelope::MAX_MESSAGE_ID_LEN;
use warren::store::PageAfter;

/// Longest reason a letter is filed under, in bytes (the column's width).
pub const MAX_REASON_LEN: usize = 64;
/// Longest group key, in characters.
pub const MAX_GROUP_LEN: usize = 64;
/// Digits of a letter id or a replay run id.
pub const HEX_ID_LEN: usize = 32;
/// Keys in a payload field's dotted path, at most.
pub const MAX_FIELD_KEYS: usize = 16;
/// Longest payload field path, in bytes.
pub const MAX_FIELD_LEN: usize = 255;
/// Longest payload value searched for or set, and longest operator's note
/// (an edit's or a mute's reason), in bytes.
pub const MAX_VALUE_LEN: usize = 1024;
/// The earliest time accepted (MariaDB's `DATETIME` starts here).
pub const EARLIEST: &str = "1000-01-01T00:00:00Z";
/// The latest time accepted (MariaDB's `DATETIME(6)` ends here).
pub const LATEST: &str = "9999-12-31T23:59:59.999999Z";

/// The rule a kind of value follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rule {
    /// A message id, as an inbox accepts it.
    MessageId,
    /// An event type, a consumer's name, a correlation id: what travels in
    /// an AMQP short string.
    Text,
    /// The reason a letter was dead-lettered.
    Reason,
    /// A group key: a fingerprint, or the name a reclassification gave.
    Group,
    /// A letter id or a replay run id, as warren makes them.
    HexId,
    /// A point in time.
    Time,
    /// A page cursor (`TIME,LETTER`), as a previous page printed it.
    Cursor,
    /// A payload field: a dotted path of keys.
    FieldPath,
    /// A payload value searched for or set.
    FieldValue,
    /// An operator's note: an edit's or a mute's reason.
    Note,
}

impl Rule {
    /// Every rule, in the order the docs list them.
    pub const ALL: [Rule; 10] = [
        Rule::MessageId,
        Rule::Text,
        Rule::Reason,
        Rule::Group,
        Rule::HexId,
        Rule::Time,
        Rule::Cursor,
        Rule::FieldPath,
        Rule::FieldValue,
        Rule::Note,
    ];

    /// What the rule applies to, as the docs' table names it.
    pub fn applies_to(self) -> &'static str {
        match self {
            Rule::MessageId => "message id",
            Rule::Text => "event type, consumer, correlation id",
            Rule::Reason => "reason",
            Rule::Group => "group",
            Rule::HexId => "letter id, replay run id",
            Rule::Time => "since, until",
            Rule::Cursor => "page cursor (after)",
            Rule::FieldPath => "payload field",
            Rule::FieldValue => "payload value",
            Rule::Note => "edit reason, mute reason",
        }
    }

    /// The rule in words: what the docs print and a refusal quotes.
    pub fn text(self) -> String {
        match self {
            Rule::MessageId => {
                format!("1 to {MAX_MESSAGE_ID_LEN} bytes, no control character")
            }
            Rule::Text => format!("1 to {MAX_SHORT_STRING_LEN} bytes, no control character"),
            Rule::Reason => format!("1 to {MAX_REASON_LEN} bytes, no control character"),
            Rule::Group => format!("1 to {MAX_GROUP_LEN} ASCII letters, digits, `.`, `_` or `-`"),
            Rule::HexId => format!("{HEX_ID_LEN} lowercase hexadecimal digits"),
            Rule::Time => format!(
                "from {EARLIEST} to {LATEST}, any offset read as UTC, compared to the millisecond"
            ),
            Rule::Cursor => {
                "`TIME,LETTER` as the previous page printed it, each part by its rule".to_owned()
            }
            Rule::FieldPath => format!(
                "1 to {MAX_FIELD_KEYS} keys joined by `.`, {MAX_FIELD_LEN} bytes in all, \
                 no empty key, no control character, `\"` or `\\`"
            ),
            Rule::FieldValue => format!(
                "at most {MAX_VALUE_LEN} bytes, no control character; written as a JSON \
                 number it matches numbers too, and then has at most \
                 {MAX_SIGNIFICANT_DIGITS} significant digits and an exponent from \
                 -{MAX_EXPONENT} to {MAX_EXPONENT}"
            ),
            Rule::Note => format!("at most {MAX_VALUE_LEN} bytes, no control character"),
        }
    }
}

/// A value refused: which parameter, what is wrong with it, and the rule it
/// breaks. Its text never holds the value's control characters raw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError {
    /// The parameter as the caller spells it (`group`, `--since`).
    pub parameter: String,
    /// The rule broken.
    pub rule: Rule,
    /// What is wrong, in words.
    pub problem: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}; the rule: {}",
            self.parameter,
            self.problem,
            self.rule.text()
        )
    }
}

impl std::error::Error for InputError {}

fn refuse<T>(parameter: &str, rule: Rule, problem: impl Into<String>) -> Result<T, InputError> {
    Err(InputError {
        parameter: parameter.to_owned(),
        rule,
        problem: problem.into(),
    })
}

/// A value quoted in a refusal: escaped, and cut short.
fn quoted(raw: &str) -> String {
    let shown: String = printable(raw).chars().take(40).collect();
    if shown.len() < printable(raw).len() {
        format!("\"{shown}…\"")
    } else {
        format!("\"{shown}\"")
    }
}

/// Text of `min..=max` bytes without a control character.
fn bounded(
    parameter: &str,
    rule: Rule,
    raw: &str,
    min: usize,
    max: usize,
) -> Result<String, InputError> {
    if raw.len() < min {
        return refuse(parameter, rule, "it is empty");
    }
    if raw.len() > max {
        return refuse(parameter, rule, format!("it is {} bytes", raw.len()));
    }
    if let Some(c) = raw.chars().find(|c| c.is_control()) {
        return refuse(
            parameter,
            rule,
            format!("it holds the control character {}", c.escape_unicode()),
        );
    }
    Ok(raw.to_owned())
}

/// A message id: [`Rule::MessageId`].
pub fn message_id(parameter: &str, raw: &str) -> Result<String, InputError> {
    bounded(parameter, Rule::MessageId, raw, 1, MAX_MESSAGE_ID_LEN)
}

/// An event type, a consumer's name or a correlation id: [`Rule::Text`].
pub fn text(parameter: &str, raw: &str) -> Result<String, InputError> {
    bounded(parameter, Rule::Text, raw, 1, MAX_SHORT_STRING_LEN)
}

/// A dead-letter reason: [`Rule::Reason`].
pub fn reason(parameter: &str, raw: &str) -> Result<String, InputError> {
    bounded(parameter, Rule::Reason, raw, 1, MAX_REASON_LEN)
}

/// An operator's note, possibly empty: [`Rule::Note`].
pub fn note(parameter: &str, raw: &str) -> Result<String, InputError> {
    bounded(parameter, Rule::Note, raw, 0, MAX_VALUE_LEN)
}

/// A group key: [`Rule::Group`].
pub fn group(parameter: &str, raw: &str) -> Result<String, InputError> {
    let ok = (1..=MAX_GROUP_LEN).contains(&raw.len())
        && raw
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(raw.to_owned())
    } else {
        refuse(
            parameter,
            Rule::Group,
            format!("{} is not a group", quoted(raw)),
        )
    }
}

/// A letter id or a replay run id: [`Rule::HexId`].
pub fn hex_id(parameter: &str, raw: &str) -> Result<String, InputError> {
    let ok = raw.len() == HEX_ID_LEN
        && raw
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok {
        Ok(raw.to_owned())
    } else {
        refuse(
            parameter,
            Rule::HexId,
            format!("{} is not an id", quoted(raw)),
        )
    }
}

/// A time as an operator writes it: RFC 3339 (any offset), a date
/// (midnight UTC), or a date and time without an offset (`2026-12-02T17:30`,
/// `2026-12-02 17:30:05`, read as UTC). Checked by [`instant`].
pub fn time(parameter: &str, raw: &str) -> Result<DateTime<Utc>, InputError> {
    let raw = raw.trim();
    let parsed = DateTime::parse_from_rfc3339(raw)
        .map(|t| t.with_timezone(&Utc))
        .ok()
        .or_else(|| {
            [
                "%Y-%m-%dT%H:%M",
                "%Y-%m-%dT%H:%M:%S%.f",
                "%Y-%m-%d %H:%M",
                "%Y-%m-%d %H:%M:%S%.f",
            ]
            .iter()
            .find_map(|f| NaiveDateTime::parse_from_str(raw, f).ok())
            .map(|t| t.and_utc())
        })
        .or_else(|| {
            NaiveDate::parse_from_str(raw, "%Y-%m-%d")
                .ok()
                .and_then(|d| d.and_hms_opt(0, 0, 0))
                .map(|t| t.and_utc())
        });
    match parsed {
        Some(t) => instant(parameter, t),
        None => refuse(
            parameter,
            Rule::Time,
            format!(
                "{} is not a time: write 2026-12-02, 2026-12-02T17:30 or RFC 3339",
                quoted(raw)
            ),
        ),
    }
}

/// A point in time within [`EARLIEST`]..=[`LATEST`], kept to the
/// millisecond (SQLite keeps no more, and every store must compare alike);
/// a leap second reads as the millisecond before it.
pub fn instant(parameter: &str, t: DateTime<Utc>) -> Result<DateTime<Utc>, InputError> {
    let (earliest, latest) = bounds();
    if t < earliest {
        return refuse(parameter, Rule::Time, format!("{t} is before {EARLIEST}"));
    }
    if t > latest {
        return refuse(parameter, Rule::Time, format!("{t} is after {LATEST}"));
    }
    Ok(to_millisecond(t))
}

fn bounds() -> (DateTime<Utc>, DateTime<Utc>) {
    let parse = |s| {
        DateTime::parse_from_rfc3339(s)
            .expect("the bounds are RFC 3339")
            .with_timezone(&Utc)
    };
    (parse(EARLIEST), parse(LATEST))
}

/// A page cursor: [`Rule::Cursor`].
pub fn cursor(parameter: &str, raw: &str) -> Result<PageAfter, InputError> {
    let Some((when, letter)) = raw.split_once(',') else {
        return refuse(
            parameter,
            Rule::Cursor,
            "it is not a cursor: use the value the previous page printed",
        );
    };
    let last_failure = time(parameter, when).map_err(|e| InputError {
        rule: Rule::Cursor,
        ..e
    })?;
    let letter_id = hex_id(parameter, letter).map_err(|e| InputError {
        rule: Rule::Cursor,
        ..e
    })?;
    Ok(PageAfter {
        last_failure,
        letter_id,
    })
}

/// A payload field's dotted path: [`Rule::FieldPath`].
pub fn field_path(parameter: &str, raw: &str) -> Result<String, InputError> {
    let rule = Rule::FieldPath;
    if raw.is_empty() {
        return refuse(parameter, rule, "it is empty");
    }
    if raw.len() > MAX_FIELD_LEN {
        return refuse(parameter, rule, format!("it is {} bytes", raw.len()));
    }
    let keys = raw.split('.').count();
    if keys > MAX_FIELD_KEYS {
        return refuse(parameter, rule, format!("it has {keys} keys"));
    }
    if raw.split('.').any(str::is_empty) {
        return refuse(parameter, rule, "it has an empty key");
    }
    if let Some(c) = raw
        .chars()
        .find(|&c| c.is_control() || c == '"' || c == '\\')
    {
        return refuse(parameter, rule, format!("it holds {}", c.escape_default()));
    }
    Ok(raw.to_owned())
}

/// A payload value searched for or set: [`Rule::FieldValue`].
pub fn field_value(parameter: &str, raw: &str) -> Result<String, InputError> {
    let value = bounded(parameter, Rule::FieldValue, raw, 0, MAX_VALUE_LEN)?;
    if let Some(number) = JsonNumber::parse(&value)
        && let Err(problem) = number.check()
    {
        return refuse(
            parameter,
            Rule::FieldValue,
            format!("the number {} {problem}", quoted(&value)),
        );
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_without_control_characters_within_their_length_pass() {
        assert_eq!(
            text("type", "billing.invoice-paid.v1").unwrap(),
            "billing.invoice-paid.v1"
        );
        assert_eq!(text("type", "é %_\\ \u{202e}").unwrap(), "é %_\\ \u{202e}");
        for bad in [
            "",
            "a\0b",
            "a\u{1b}[2J",
            "a\u{9b}",
            "a\u{7f}",
            &"x".repeat(256),
        ] {
            let e = text("type", bad).unwrap_err();
            assert_eq!(e.parameter, "type");
            assert!(!e.to_string().chars().any(|c| c.is_control()), "{e}");
        }
        assert!(message_id("message_id", &"m".repeat(MAX_MESSAGE_ID_LEN)).is_ok());
        assert!(message_id("message_id", &"m".repeat(MAX_MESSAGE_ID_LEN + 1)).is_err());
        assert!(note("reason", "").is_ok());
    }

    #[test]
    fn groups_and_ids_follow_their_writers() {
        assert!(group("group", "9f2c41d07a5be613").is_ok());
        assert!(group("group", "Card-Declines_2026.q4").is_ok());
        for bad in ["", "a b", "é", "a/b", &"g".repeat(65)] {
            assert!(group("group", bad).is_err(), "{bad:?}");
        }
        let id = warren::admin::letter_id("c", "m", "");
        assert!(hex_id("letter", &id).is_ok());
        for bad in [
            "",
            "ABCDEF0123456789ABCDEF0123456789",
            &id[1..],
            "../etc/passwd",
        ] {
            assert!(hex_id("letter", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn times_are_read_as_utc_within_datetime6_to_the_millisecond() {
        let t = time("since", "2026-12-02T17:30:00.123456+02:00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-12-02T15:30:00.123+00:00");
        assert!(time("since", "2026-12-02").is_ok());
        assert!(time("since", "2026-12-02T17:30").is_ok());
        assert!(time("since", "1000-01-01").is_ok());
        assert!(time("since", "9999-12-31T23:59:59.999999Z").is_ok());
        for bad in [
            "+10000-01-01",
            "0999-12-31",
            "-0001-01-01",
            "yesterday",
            "2026-13-01",
            "",
        ] {
            let e = time("since", bad).unwrap_err();
            assert_eq!(e.rule, Rule::Time, "{bad:?}");
        }
        let leap = time("until", "2016-12-31T23:59:60.5Z").unwrap();
        assert_eq!(leap.timestamp_subsec_millis(), 999);
    }

    #[test]
    fn cursors_are_a_time_and_a_letter() {
        let id = warren::admin::letter_id("c", "m", "");
        let c = cursor("after", &format!("2026-12-02T17:30:00.5Z,{id}")).unwrap();
        assert_eq!(c.letter_id, id);
        assert!(cursor("after", "junk").is_err());
        assert!(cursor("after", &format!("+10000-01-01T00:00:00Z,{id}")).is_err());
        assert!(cursor("after", "2026-12-02T17:30:00Z,x\0").is_err());
    }

    #[test]
    fn field_paths_are_keys_joined_by_dots() {
        assert!(field_path("field", "customerId").is_ok());
        assert!(field_path("field", "card.holder name.prénom").is_ok());
        let seventeen = "k.".repeat(16) + "k";
        for bad in ["", ".a", "a..b", "a\"b", "a\\b", "a\0b", &seventeen] {
            assert!(field_path("field", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn numbers_in_values_are_within_what_every_store_reads_alike() {
        for ok in [
            "149",
            "149.0",
            "-0.5",
            "1e300",
            "1E-300",
            "123456789012345",
            "abc",
            "1e-20000x",
        ] {
            assert!(field_value("value", ok).is_ok(), "{ok:?}");
        }
        for bad in [
            "1e-20000",
            "1e301",
            "1234567890123456",
            "0.1234567890123456",
        ] {
            let e = field_value("value", bad).unwrap_err();
            assert_eq!(e.rule, Rule::FieldValue, "{bad:?}");
        }
        assert!(field_value("value", "a\0").is_err());
    }

    #[test]
    fn every_rule_is_named_and_worded() {
        for rule in Rule::ALL {
            assert!(!rule.applies_to().is_empty());
            assert!(!rule.text().is_empty());
        }
    }
}
