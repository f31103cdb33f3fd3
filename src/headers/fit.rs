//! How large a copy's headers may grow: cut to fit one frame, warren's error
//! texts first, then the producer's largest headers; and the seal that signs
//! what is left.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use super::Signer;
use super::names::*;
use super::signer::is_warren;
use crate::amqp::{header_str, text, truncate};

/// Error texts are cut to this many bytes: enough to diagnose, too little to carry
/// a payload along by accident.
pub(crate) const MAX_ERROR_LEN: usize = 2000;

/// Error texts in a copy are cut to this when its headers would not fit a frame.
pub(super) const SHRUNK_ERROR_LEN: usize = 200;

/// Room kept free in a frame for the property flags and short-string properties
/// around the headers table.
const FRAME_MARGIN: usize = 2048;

/// The frame size assumed when a connection reports none (RabbitMQ's default).
pub(crate) const DEFAULT_FRAME_MAX: usize = 128 * 1024;

/// warren's own headers on a copy at their largest, in bytes, with the room
/// kept around them: three error texts at their longest (the error, the last
/// error, the gated entity), the original route (two short strings), the
/// names of dropped headers (cut to 1000 bytes), letter id and digest, about
/// 1 KB of counts, times and names. A broker's frame size should leave room
/// for these beside the producer's own headers.
pub const LARGEST_OWN_HEADERS: usize =
    3 * MAX_ERROR_LEN + 2 * 255 + 1000 + 200 + 1024 + FRAME_MARGIN;

/// [`LARGEST_OWN_HEADERS`] with the error texts cut as short as warren cuts
/// them to fit a frame: a frame smaller than this leaves no room for
/// warren's own record, and a copy would lose its attempt count.
pub const SMALLEST_OWN_HEADERS: usize =
    3 * SHRUNK_ERROR_LEN + 2 * 255 + 1000 + 200 + 1024 + FRAME_MARGIN;

/// Finishes a copy: makes its headers fit a frame of `frame_max` bytes, then
/// signs warren's headers.
pub(crate) fn seal(
    properties: BasicProperties,
    signer: &Signer,
    frame_max: usize,
) -> BasicProperties {
    let mut properties = fit(properties, frame_max);
    let mut headers = properties.headers().clone().unwrap_or_default();
    let message_id = properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    signer.sign(&message_id, &mut headers);
    properties = properties.with_headers(headers);
    properties
}

/// `properties` with headers small enough for one frame: first warren's error
/// texts are shortened, then the producer's largest headers are dropped (their
/// names recorded in [`HEADER_DROPPED`]). The body is never touched. Without
/// this, a huge error text or producer header would make every copy of the
/// message fail to publish, and the message would circle forever.
pub(crate) fn fit(properties: BasicProperties, frame_max: usize) -> BasicProperties {
    let budget = frame_max.saturating_sub(FRAME_MARGIN).max(1024);
    let Some(headers) = properties.headers().clone() else {
        return properties;
    };
    if table_len(&headers) <= budget {
        return properties;
    }
    let mut headers = headers;
    for name in [HEADER_ERROR, HEADER_LAST_ERROR] {
        if let Some(AMQPValue::LongString(value)) = headers.inner().get(name) {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            headers.insert(name.into(), text(truncate(&value, SHRUNK_ERROR_LEN)));
        }
    }
    let mut dropped = Vec::new();
    while table_len(&headers) > budget {
        // Largest first; warren's own record goes last, the signature never.
        let largest = headers
            .inner()
            .iter()
            .filter(|(k, _)| k.as_str() != HEADER_SIGNATURE && k.as_str() != HEADER_DROPPED)
            .max_by_key(|(k, v)| (!is_warren(k.as_str()), value_len(v)))
            .map(|(k, _)| k.clone());
        let Some(name) = largest else { break };
        let mut rest = headers.inner().clone();
        rest.remove(&name);
        headers = FieldTable::from(rest);
        dropped.push(name.to_string());
    }
    if !dropped.is_empty() {
        // Names the guard recorded before stay first.
        let mut names = header_str(&headers, HEADER_DROPPED)
            .map(|n| vec![n.into_owned()])
            .unwrap_or_default();
        names.extend(dropped);
        let names = names.join(", ");
        headers.insert(HEADER_DROPPED.into(), text(truncate(&names, 1000)));
    }
    properties.with_headers(headers)
}

/// Checks that `properties` fits in one frame of `frame_max` bytes; the broker
/// would close the channel on a larger one.
pub(crate) fn check_frame_size(
    properties: &BasicProperties,
    frame_max: usize,
) -> Result<(), String> {
    let size = properties.headers().as_ref().map_or(0, table_len);
    let limit = frame_max.saturating_sub(FRAME_MARGIN / 2);
    if size > limit {
        return Err(format!(
            "its headers take {size} bytes, more than fit in one {frame_max}-byte frame"
        ));
    }
    Ok(())
}

/// The encoded size of a field table, as AMQP writes it.
fn table_len(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + 1 + value_len(v))
        .sum::<usize>()
}

fn value_len(value: &AMQPValue) -> usize {
    match value {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldArray(a) => {
            4 + a.as_slice().iter().map(|v| 1 + value_len(v)).sum::<usize>()
        }
        AMQPValue::FieldTable(t) => table_len(t),
        AMQPValue::Void => 0,
    }
}
