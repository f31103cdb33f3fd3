//! Reading one frame the way the AMQP client will, without building a value:
//! content headers are walked with an explicit stack, counting depth, values
//! and text that is not UTF-8; method frames that carry names a producer chose
//! are checked for UTF-8. What the client could not read, or could read only by
//! recursing past its stack, is rewritten; everything else is left byte for
//! byte as the broker sent it.

use std::ops::Range;

use sha2::{Digest, Sha256};

use super::{Cause, MAX_HEADER_DEPTH, MAX_HEADER_ENTRIES, MAX_RECORD_ENTRIES, marker_name};
use crate::headers::BROKER_HEADERS;

/// The content class every message travels in.
const BASIC: u16 = 60;

/// Bit of the `headers` property in the property flags.
const HEADERS_BIT: u16 = 13;

/// The basic class's properties, from the highest flag bit down, as the
/// client parses them.
const PROPERTIES: [(u16, Kind); 14] = [
    (15, Kind::Short("content_type")),
    (14, Kind::Short("content_encoding")),
    (HEADERS_BIT, Kind::Table),
    (12, Kind::Fixed(1)),
    (11, Kind::Fixed(1)),
    (10, Kind::Short("correlation_id")),
    (9, Kind::Short("reply_to")),
    (8, Kind::Short("expiration")),
    (7, Kind::Short("message_id")),
    (6, Kind::Fixed(8)),
    (5, Kind::Short("type")),
    (4, Kind::Short("user_id")),
    (3, Kind::Short("app_id")),
    (2, Kind::Short("cluster_id")),
];

#[derive(Clone, Copy)]
enum Kind {
    Short(&'static str),
    Table,
    Fixed(usize),
}

/// What a method frame left for the content header that follows it on the
/// same channel: the names it carried that were not UTF-8, and their bytes.
#[derive(Debug, Default)]
pub(super) struct Carried {
    fields: Vec<&'static str>,
    original: Vec<u8>,
}

/// Replaces every byte of each invalid UTF-8 sequence in `bytes` with `?`, in
/// place: the length stays, so the frame around it does too.
fn make_utf8(bytes: &mut [u8]) {
    let mut at = 0;
    while let Err(e) = std::str::from_utf8(&bytes[at..]) {
        let bad = at + e.valid_up_to();
        let len = e.error_len().unwrap_or(bytes.len() - bad);
        bytes[bad..bad + len].fill(b'?');
        at = bad + len;
    }
}

/// Checks the short strings of a method frame payload (class, method,
/// arguments) that name things a producer chose, and makes them UTF-8 in
/// place. Returns what a following content header must report, for the
/// methods that carry a message.
pub(super) fn method(payload: &mut [u8]) -> Option<Carried> {
    if payload.len() < 4 {
        return None;
    }
    let class = u16::from_be_bytes([payload[0], payload[1]]);
    let id = u16::from_be_bytes([payload[2], payload[3]]);
    // (offset of the first short string, the fixed fields between strings)
    let layout: &[Step] = match (class, id) {
        // basic.deliver: consumer-tag, delivery-tag, redelivered, exchange, routing-key
        (60, 60) => &[
            Step::Short("consumer tag"),
            Step::Skip(9),
            Step::Short("exchange"),
            Step::Short("routing key"),
        ],
        // basic.get-ok: delivery-tag, redelivered, exchange, routing-key, count
        (60, 71) => &[
            Step::Skip(9),
            Step::Short("exchange"),
            Step::Short("routing key"),
        ],
        // basic.return: reply-code, reply-text, exchange, routing-key
        (60, 50) => &[
            Step::Skip(2),
            Step::Short("reply text"),
            Step::Short("exchange"),
            Step::Short("routing key"),
        ],
        // connection.close and channel.close: reply-code, reply-text, ...
        (10, 50) | (20, 40) => &[Step::Skip(2), Step::Short("reply text")],
        _ => return None,
    };
    let carries = class == BASIC;
    let mut carried = Carried::default();
    let mut at = 4;
    for step in layout {
        match *step {
            Step::Skip(n) => at += n,
            Step::Short(field) => {
                let len = usize::from(*payload.get(at)?);
                let text = payload.get_mut(at + 1..at + 1 + len)?;
                if std::str::from_utf8(text).is_err() {
                    carried.fields.push(field);
                    carried.original.extend_from_slice(text);
                    make_utf8(text);
                }
                at += 1 + len;
            }
        }
    }
    (carries && !carried.fields.is_empty()).then_some(carried)
}

enum Step {
    Skip(usize),
    Short(&'static str),
}

/// What walking one header value found.
struct Walked {
    /// Where the value ends.
    end: usize,
    /// Values in it, itself included (counted until it passes the limit).
    values: usize,
    too_deep: bool,
    /// A table key in it is not UTF-8.
    unreadable_key: bool,
}

/// The frame is not what AMQP allows: a length past its container, a type the
/// client does not know. The broker refuses such frames from publishers, so
/// one here is not a producer's doing; the whole headers table goes.
struct Malformed;

fn u32_at(p: &[u8], at: usize) -> Result<usize, Malformed> {
    let bytes = p.get(at..at + 4).ok_or(Malformed)?;
    Ok(u32::from_be_bytes(bytes.try_into().map_err(|_| Malformed)?) as usize)
}

/// Bytes a scalar of type `tag` takes after its tag, or `None` for a type
/// whose length is prefixed (or that the client does not know).
fn scalar_len(tag: u8) -> Option<usize> {
    Some(match tag {
        b't' | b'b' | b'B' => 1,
        b's' | b'U' | b'u' => 2,
        b'I' | b'i' | b'f' => 4,
        b'l' | b'L' | b'd' | b'T' => 8,
        b'D' => 5,
        b'V' => 0,
        _ => return None,
    })
}

/// Walks the value of type `tag` at `at`, inside a container ending at
/// `limit`, without recursion: an explicit stack of the open tables and arrays.
fn walk_value(p: &[u8], mut at: usize, tag: u8, limit: usize) -> Result<Walked, Malformed> {
    let mut walked = Walked {
        end: 0,
        values: 1,
        too_deep: false,
        unreadable_key: false,
    };
    let sized = |at: usize, len: usize| (at + len <= limit).then_some(at + len).ok_or(Malformed);
    match tag {
        b'S' | b'x' => {
            walked.end = sized(at + 4, u32_at(p, at)?)?;
            return Ok(walked);
        }
        b'F' | b'A' => {}
        _ => {
            walked.end = sized(at, scalar_len(tag).ok_or(Malformed)?)?;
            return Ok(walked);
        }
    }
    // (end, is a table) of every open container, the outermost first.
    let mut open: Vec<(usize, bool)> = Vec::new();
    let outer_end = sized(at + 4, u32_at(p, at)?)?;
    open.push((outer_end, tag == b'F'));
    at += 4;
    while let Some(&(end, table)) = open.last() {
        if at == end {
            open.pop();
            continue;
        }
        if table {
            let len = usize::from(*p.get(at).ok_or(Malformed)?);
            let key = p.get(at + 1..at + 1 + len).ok_or(Malformed)?;
            if at + 1 + len > end {
                return Err(Malformed);
            }
            walked.unreadable_key |= std::str::from_utf8(key).is_err();
            at += 1 + len;
        }
        if at >= end {
            return Err(Malformed);
        }
        let tag = p[at];
        at += 1;
        walked.values += 1;
        match tag {
            b'F' | b'A' => {
                let inner_end = at + 4 + u32_at(p, at)?;
                if inner_end > end {
                    return Err(Malformed);
                }
                open.push((inner_end, tag == b'F'));
                at += 4;
                if open.len() > MAX_HEADER_DEPTH {
                    // Nothing deeper is read: the whole header goes.
                    walked.too_deep = true;
                    walked.end = outer_end;
                    return Ok(walked);
                }
            }
            b'S' | b'x' => {
                let len = u32_at(p, at)?;
                at = (at + 4 + len <= end)
                    .then_some(at + 4 + len)
                    .ok_or(Malformed)?;
            }
            _ => {
                let len = scalar_len(tag).ok_or(Malformed)?;
                at = (at + len <= end).then_some(at + len).ok_or(Malformed)?;
            }
        }
        if walked.values > MAX_HEADER_ENTRIES {
            walked.end = outer_end;
            return Ok(walked);
        }
    }
    walked.end = outer_end;
    Ok(walked)
}

/// True for a header name warren or the broker writes on the copies of a
/// message.
fn is_record(name: &[u8]) -> bool {
    name.starts_with(b"x-warren-") || BROKER_HEADERS.iter().any(|b| b.as_bytes() == name)
}

/// One header of the headers table, as found.
struct Entry {
    /// Its bytes: name, type and value.
    span: Range<usize>,
    /// Where its name starts and ends inside the span.
    name: Range<usize>,
    values: usize,
    /// Named by warren (`x-warren-*`) or the broker (`x-death`, ...): the
    /// record a copy carries beside the producer's headers, which is counted
    /// apart.
    record: bool,
    verdict: Option<Cause>,
}

/// The findings on one content header, gathered before anything is written.
#[derive(Default)]
struct Findings {
    /// Property names whose text was not UTF-8 (replaced in the rewrite).
    fields: Vec<&'static str>,
    /// Headers removed, by cause, with their names shown for people.
    removed: Vec<(Cause, String)>,
    /// The whole headers table could not be read.
    malformed_headers: bool,
    /// The properties were not read at all: the frame took this many bytes.
    oversize: Option<usize>,
    /// `sha256:` and the digest of every byte removed or replaced, in frame
    /// order; empty when the properties were not read.
    digest: String,
}

impl Findings {
    fn any(&self) -> bool {
        !self.fields.is_empty() || !self.removed.is_empty() || self.malformed_headers
    }

    /// The most serious cause found: depth first, then the count, then text.
    fn cause(&self) -> Cause {
        let mut causes: Vec<Cause> = self.removed.iter().map(|(c, _)| *c).collect();
        if self.malformed_headers || !self.fields.is_empty() {
            causes.push(Cause::Unreadable);
        }
        causes.into_iter().min().unwrap_or(Cause::Unreadable)
    }
}

/// One content header's properties as found: each present property's span,
/// and the headers table's entries.
struct Found<'p> {
    payload: &'p [u8],
    flags: u16,
    spans: Vec<(u16, Kind, Range<usize>)>,
    /// `None` when the headers table is not valid AMQP (or absent).
    entries: Option<Vec<Entry>>,
}

impl Found<'_> {
    fn entries(&self) -> &[Entry] {
        self.entries.as_deref().unwrap_or_default()
    }

    fn kept_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.entries
            .iter_mut()
            .flatten()
            .filter(|e| e.verdict.is_none())
    }

    /// The payload with the entries that have no verdict and then `marker` as
    /// its headers table, every short string made UTF-8, and every other
    /// property as it was. The flags stay as they were (bits 0 and 1 too,
    /// which neither RabbitMQ nor lapin reads), but for the headers bit.
    fn assemble(&self, marker: &[u8]) -> Vec<u8> {
        let p = self.payload;
        let mut out = Vec::with_capacity(p.len() + marker.len() + 8);
        out.extend_from_slice(&p[..12]);
        out.extend_from_slice(&(self.flags | 1 << HEADERS_BIT).to_be_bytes());
        let table = |out: &mut Vec<u8>| {
            let at = out.len();
            out.extend_from_slice(&[0; 4]);
            for e in self.entries().iter().filter(|e| e.verdict.is_none()) {
                out.extend_from_slice(&p[e.span.clone()]);
            }
            out.extend_from_slice(marker);
            let len = (out.len() - at - 4) as u32;
            out[at..at + 4].copy_from_slice(&len.to_be_bytes());
        };
        let mut wrote_table = false;
        for (bit, kind, span) in &self.spans {
            if *bit <= HEADERS_BIT && !wrote_table {
                table(&mut out);
                wrote_table = true;
            }
            match kind {
                Kind::Table => {}
                Kind::Short(_) => {
                    let start = out.len();
                    out.extend_from_slice(&p[span.clone()]);
                    make_utf8(&mut out[start + 1..]);
                }
                Kind::Fixed(_) => out.extend_from_slice(&p[span.clone()]),
            }
        }
        if !wrote_table {
            table(&mut out);
        }
        out
    }

    /// The digest of every byte removed or replaced, in frame order: what a
    /// method frame before it replaced, then each property's.
    fn digest(&self, carried: &[u8]) -> String {
        let p = self.payload;
        let mut d = Sha256::new();
        d.update(carried);
        for (_, kind, span) in &self.spans {
            match kind {
                Kind::Short(_) if std::str::from_utf8(&p[span.start + 1..span.end]).is_err() => {
                    d.update(&p[span.start + 1..span.end]);
                }
                Kind::Table if self.entries.is_none() => d.update(&p[span.start + 4..span.end]),
                Kind::Table => {
                    for e in self.entries().iter().filter(|e| e.verdict.is_some()) {
                        d.update(&p[e.span.clone()]);
                    }
                }
                _ => {}
            }
        }
        let hex: String = hex::encode(d.finalize());
        format!("sha256:{hex}")
    }
}

/// Reads the properties of a content header payload as lapin does: one flag
/// word, the basic class's properties for bits 15 to 2 whatever the class.
/// `None` if they run past the payload (the client reports that itself).
fn find(payload: &[u8]) -> Option<Found<'_>> {
    if payload.len() < 14 {
        return None;
    }
    let flags = u16::from_be_bytes([payload[12], payload[13]]);
    let mut found = Found {
        payload,
        flags,
        spans: Vec::with_capacity(PROPERTIES.len()),
        entries: None,
    };
    let mut at = 14usize;
    for (bit, kind) in PROPERTIES {
        if flags & (1 << bit) == 0 {
            continue;
        }
        let len = match kind {
            Kind::Short(_) => 1 + usize::from(*payload.get(at)?),
            Kind::Table => u32_at(payload, at).ok()?.checked_add(4)?,
            Kind::Fixed(n) => n,
        };
        let span = at..at.checked_add(len)?;
        payload.get(span.clone())?;
        if let Kind::Table = kind {
            found.entries = headers(payload, span.start + 4..span.end).ok();
        }
        found.spans.push((bit, kind, span));
        at += len;
    }
    Some(found)
}

/// Inspects a content header frame's payload. `None` when the client can read
/// it as it is (the common case: nothing is copied); otherwise the payload to
/// pass on instead, with what was removed or replaced reported in the guard's
/// marker header. `frame_max` bounds the whole rewritten frame.
pub(super) fn content_header(
    payload: &[u8],
    carried: Option<Carried>,
    frame_max: usize,
) -> Option<Vec<u8>> {
    let Some(mut found) = find(payload) else {
        // Properties past the end of the frame: lapin refuses the frame as it
        // is. What a method before it replaced still needs its report.
        return carried.map(|c| unread(payload, payload.len() + 8, Some(c)));
    };
    let carried = carried.unwrap_or_default();
    let mut findings = Findings {
        fields: carried.fields,
        ..Findings::default()
    };
    for (_, kind, span) in &found.spans {
        if let Kind::Short(name) = kind
            && std::str::from_utf8(&payload[span.start + 1..span.end]).is_err()
        {
            findings.fields.push(name);
        }
        if let Kind::Table = kind {
            findings.malformed_headers = found.entries.is_none();
        }
    }
    // A copy warren published (a retry, a dead letter) carries warren's
    // record and, back from a retry tier, the broker's: counted apart, so a
    // message within the limits stays within them on every copy.
    let (mut kept, mut recorded) = (0usize, 0usize);
    for entry in found.entries.iter_mut().flatten() {
        if entry.verdict.is_none() {
            if entry.record && recorded + entry.values <= MAX_RECORD_ENTRIES {
                recorded += entry.values;
            } else if kept + entry.values <= MAX_HEADER_ENTRIES {
                kept += entry.values;
            } else {
                entry.verdict = Some(Cause::TooMany);
            }
        }
        if let Some(cause) = entry.verdict {
            findings
                .removed
                .push((cause, shown(&payload[entry.name.clone()])));
        }
    }
    if !findings.any() {
        if payload.len() + 8 <= frame_max {
            return None;
        }
        // The broker sent a frame past the negotiated size, which the client
        // refuses: a quorum queue adds `x-delivery-count` to a redelivery of
        // a message that filled its frame. The broker's own headers go first,
        // as on every copy warren publishes, and need no report; if that is
        // not enough, the frame is cut to fit like one with something
        // unreadable in it.
        if let Some(fitted) = without_broker_headers(&mut found, payload.len() + 8 - frame_max) {
            return Some(fitted);
        }
    }
    Some(rewrite(found, findings, &carried.original, frame_max))
}

/// The entries of a headers table spanning `region` (after its length).
fn headers(p: &[u8], region: Range<usize>) -> Result<Vec<Entry>, Malformed> {
    let mut entries = Vec::with_capacity(8);
    let mut at = region.start;
    while at < region.end {
        let start = at;
        let len = usize::from(p[at]);
        let name = at + 1..at + 1 + len;
        if name.end >= region.end {
            return Err(Malformed);
        }
        let tag = p[name.end];
        let walked = walk_value(p, name.end + 1, tag, region.end)?;
        let verdict = if walked.too_deep {
            Some(Cause::TooDeep)
        } else if walked.values > MAX_HEADER_ENTRIES {
            Some(Cause::TooMany)
        } else if walked.unreadable_key || std::str::from_utf8(&p[name.clone()]).is_err() {
            Some(Cause::Unreadable)
        } else {
            None
        };
        entries.push(Entry {
            span: start..walked.end,
            record: is_record(&p[name.clone()]),
            name,
            values: walked.values,
            verdict,
        });
        at = walked.end;
    }
    Ok(entries)
}

/// A content header in place of one that cannot be read at all (past four
/// times the frame size, or with properties running past its end): the class
/// and body size of the original, and a headers table holding the report
/// alone. `payload` needs only its first 12 bytes.
pub(super) fn unread(payload: &[u8], size: usize, carried: Option<Carried>) -> Vec<u8> {
    let mut findings = Findings {
        malformed_headers: true,
        oversize: Some(size),
        ..Findings::default()
    };
    if let Some(carried) = carried {
        findings.fields.extend(carried.fields);
    }
    let marker = marker(&findings);
    let mut out = payload
        .get(..12)
        .unwrap_or(&[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        .to_vec();
    out.resize(12, 0);
    out.extend_from_slice(&(1u16 << HEADERS_BIT).to_be_bytes());
    out.extend_from_slice(&(marker.len() as u32).to_be_bytes());
    out.extend_from_slice(&marker);
    out
}

/// Most bytes of the detail and of the list of removed names in the marker:
/// it must fit beside the other properties in the smallest frame AMQP allows.
const MAX_DETAIL: usize = 300;
const MAX_NAMES: usize = 400;
/// The most bytes the marker entry takes: its name, and the four fields at
/// their longest.
const MAX_MARKER: usize = 1024;

/// The payload rebuilt: every property as it was but for text made UTF-8 and
/// the removed headers, with the marker added to the headers table. Past the
/// frame, the largest headers left go too, in one pass.
fn rewrite(
    mut found: Found<'_>,
    mut findings: Findings,
    carried: &[u8],
    frame_max: usize,
) -> Vec<u8> {
    let budget = frame_max.saturating_sub(8 + MAX_MARKER);
    let mut size = found.assemble(&[]).len();
    let payload = found.payload;
    if size > budget {
        let mut largest: Vec<&mut Entry> = found.kept_mut().collect();
        largest.sort_by_key(|e| std::cmp::Reverse(e.span.len()));
        for e in largest {
            if size <= budget {
                break;
            }
            size -= e.span.len();
            e.verdict = Some(Cause::TooMany);
            findings
                .removed
                .push((Cause::TooMany, shown(&payload[e.name.clone()])));
        }
    }
    findings.digest = found.digest(carried);
    let marker = marker(&findings);
    debug_assert!(marker.len() <= MAX_MARKER);
    found.assemble(&marker)
}

/// The payload without the broker's own headers, largest first, until it is
/// `over` bytes shorter; `None` (and nothing changed) if they are not enough.
fn without_broker_headers(found: &mut Found<'_>, over: usize) -> Option<Vec<u8>> {
    let payload = found.payload;
    let mut broker: Vec<&mut Entry> = found
        .kept_mut()
        .filter(|e| {
            BROKER_HEADERS
                .iter()
                .any(|b| b.as_bytes() == &payload[e.name.clone()])
        })
        .collect();
    broker.sort_by_key(|e| std::cmp::Reverse(e.span.len()));
    let freed: usize = broker.iter().map(|e| e.span.len()).sum();
    if freed < over {
        return None;
    }
    let mut freed = 0;
    let mut names = Vec::new();
    for e in broker {
        if freed >= over {
            break;
        }
        freed += e.span.len();
        e.verdict = Some(Cause::TooMany);
        names.push(shown(&payload[e.name.clone()]));
    }
    tracing::debug!(
        removed = names.join(", "),
        "a delivery came past the negotiated frame size; the broker's headers were removed to fit"
    );
    Some(found.assemble(&[]))
}

/// The guard's marker entry: its name, then a table of cause, detail, the
/// names removed and the digest of every byte removed or replaced.
fn marker(findings: &Findings) -> Vec<u8> {
    let cause = findings.cause();
    let mut detail = Vec::new();
    let names = |cause: Cause| {
        findings
            .removed
            .iter()
            .filter(move |(c, _)| *c == cause)
            .map(|(_, n)| n.clone())
            .collect::<Vec<_>>()
    };
    let deep = names(Cause::TooDeep);
    if !deep.is_empty() {
        detail.push(format!(
            "{} more than {MAX_HEADER_DEPTH} tables or arrays deep: removed",
            list(&deep, "nests", "nest")
        ));
    }
    let many = names(Cause::TooMany);
    if !many.is_empty() {
        detail.push(format!(
            "{} the headers past {MAX_HEADER_ENTRIES} values or the frame: removed",
            list(&many, "takes", "take")
        ));
    }
    let unreadable = names(Cause::Unreadable);
    if !unreadable.is_empty() {
        detail.push(format!(
            "{} a name that is not UTF-8: removed",
            list(&unreadable, "has", "have")
        ));
    }
    if let Some(size) = findings.oversize {
        detail.push(format!(
            "a content header of {size} bytes, past what the guard reads: its properties were not read"
        ));
    } else if findings.malformed_headers {
        detail.push("the headers table is not valid AMQP: removed".to_owned());
    }
    if !findings.fields.is_empty() {
        detail.push(format!(
            "{} not UTF-8: each bad byte replaced by ?",
            findings.fields.join(", ")
        ));
    }
    let detail = detail.join("; ");
    let mut removed = String::new();
    for (_, name) in &findings.removed {
        if removed.len() > MAX_NAMES {
            break;
        }
        if !removed.is_empty() {
            removed.push_str(", ");
        }
        removed.push_str(name);
    }
    let mut table = Vec::new();
    let mut field = |key: &str, value: &str| {
        table.push(key.len() as u8);
        table.extend_from_slice(key.as_bytes());
        table.push(b'S');
        table.extend_from_slice(&(value.len() as u32).to_be_bytes());
        table.extend_from_slice(value.as_bytes());
    };
    field("cause", cause.as_str());
    field("detail", cut(&detail, MAX_DETAIL));
    field("removed", cut(&removed, MAX_NAMES));
    field("digest", &findings.digest);
    let name = marker_name();
    let mut out = Vec::with_capacity(table.len() + name.len() + 6);
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.push(b'F');
    out.extend_from_slice(&(table.len() as u32).to_be_bytes());
    out.extend_from_slice(&table);
    out
}

/// "header a nests" or "3 headers (a, b, c) nest".
fn list(names: &[String], one_verb: &str, many_verb: &str) -> String {
    match names {
        [one] => format!("header {one} {one_verb}"),
        many => format!("{} headers ({}) {many_verb}", many.len(), many.join(", ")),
    }
}

/// A header name as found, quoted, with bytes that are not printable UTF-8
/// escaped: it goes into a header that operators read.
fn shown(name: &[u8]) -> String {
    let text: String = name
        .utf8_chunks()
        .flat_map(|chunk| {
            let valid = chunk.valid().chars().map(|c| {
                if c.is_control() || c == '"' || c == '\\' {
                    c.escape_default().collect::<String>()
                } else {
                    c.to_string()
                }
            });
            let invalid = chunk.invalid().iter().map(|b| format!("\\x{b:02x}"));
            valid.chain(invalid).collect::<Vec<_>>()
        })
        .collect();
    format!("\"{}\"", cut(&text, 64))
}

/// `s` cut to at most `max` bytes on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    crate::amqp::truncate(s, max)
}

#[cfg(test)]
#[path = "inspect_tests.rs"]
pub(super) mod tests;
