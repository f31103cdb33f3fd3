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
    match headers.inner().get(name)? {
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
