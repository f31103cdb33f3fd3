//! AMQP values as warren writes and reads them: the persistent delivery mode,
//! the short-string limit, and header values. A leaf: it imports nothing of
//! warren's.

use chrono::{DateTime, SecondsFormat, Utc};
use lapin::types::{AMQPValue, FieldTable};

/// AMQP delivery mode 2: the broker writes the message to disk.
pub(crate) const PERSISTENT: u8 = 2;

/// Longest value, in bytes, of an AMQP short string: the limit of every property
/// an envelope field is copied into (`type`, `correlation_id`, `message_id`). A
/// longer value accepted here would be refused, or worse, panic the client, the
/// moment warren published a message carrying it on.
pub const MAX_SHORT_STRING_LEN: usize = 255;

/// `s` cut to at most `max` bytes, on a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A time as an RFC 3339 header value.
pub(crate) fn time(t: DateTime<Utc>) -> AMQPValue {
    AMQPValue::LongString(t.to_rfc3339_opts(SecondsFormat::Millis, true).into())
}

/// A text header value.
pub(crate) fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

/// Reads a header as text, whichever string type the producer used.
pub fn header_str<'a>(headers: &'a FieldTable, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => Some(s.as_str().into()),
        _ => None,
    }
}

/// Reads an integer header, whichever integer type the producer used.
pub fn header_int(headers: &FieldTable, name: &str) -> Option<i64> {
    int_value(headers.inner().get(name)?)
}

/// An integer value, whichever integer type the producer used (amqplib, for
/// one, sends the smallest that fits: 8 or 16 bits).
pub fn int_value(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(v) => Some((*v).into()),
        AMQPValue::ShortShortUInt(v) => Some((*v).into()),
        AMQPValue::ShortInt(v) => Some((*v).into()),
        AMQPValue::ShortUInt(v) => Some((*v).into()),
        AMQPValue::LongInt(v) => Some((*v).into()),
        AMQPValue::LongUInt(v) => Some((*v).into()),
        AMQPValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

/// A header table as JSON, every value decoded to what it says: strings as
/// text (bytes that are not UTF-8 replaced), numbers as numbers, tables and
/// arrays as objects and arrays, byte arrays as hex. What operators read and
/// search, in place of the client's byte arrays. Headers nest at most as deep
/// as the frame guard lets through, so the recursion is bounded.
pub fn table_to_json(table: &FieldTable) -> serde_json::Value {
    serde_json::Value::Object(
        table
            .inner()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), value_to_json(v)))
            .collect(),
    )
}

/// One header value as JSON (see [`table_to_json`]).
pub fn value_to_json(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value as J;
    match value {
        AMQPValue::Boolean(b) => J::Bool(*b),
        AMQPValue::ShortShortInt(v) => J::from(*v),
        AMQPValue::ShortShortUInt(v) => J::from(*v),
        AMQPValue::ShortInt(v) => J::from(*v),
        AMQPValue::ShortUInt(v) => J::from(*v),
        AMQPValue::LongInt(v) => J::from(*v),
        AMQPValue::LongUInt(v) => J::from(*v),
        AMQPValue::LongLongInt(v) => J::from(*v),
        AMQPValue::Float(v) => J::from(f64::from(*v)),
        AMQPValue::Double(v) => J::from(*v),
        AMQPValue::DecimalValue(d) => {
            let scaled = f64::from(d.value) / 10f64.powi(i32::from(d.scale));
            J::from(scaled)
        }
        AMQPValue::ShortString(s) => J::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => J::String(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::FieldArray(a) => J::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::Timestamp(t) => J::from(*t),
        AMQPValue::FieldTable(t) => table_to_json(t),
        AMQPValue::ByteArray(b) => {
            J::String(b.as_slice().iter().map(|x| format!("{x:02x}")).collect())
        }
        AMQPValue::Void => J::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_read_as_what_they_say() {
        let mut inner = FieldTable::default();
        inner.insert("count".into(), AMQPValue::LongUInt(2));
        let mut t = FieldTable::default();
        t.insert("x-warren-reason".into(), text("invalid-json"));
        t.insert("attempts".into(), AMQPValue::LongLongInt(3));
        t.insert("nested".into(), AMQPValue::FieldTable(inner));
        t.insert("raw".into(), AMQPValue::ByteArray(vec![0xca, 0xfe].into()));
        t.insert("bad".into(), AMQPValue::LongString(vec![b'a', 0xff].into()));
        assert_eq!(
            table_to_json(&t),
            serde_json::json!({
                "x-warren-reason": "invalid-json",
                "attempts": 3,
                "nested": { "count": 2 },
                "raw": "cafe",
                "bad": "a\u{fffd}",
            })
        );
    }
}
