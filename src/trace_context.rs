//! W3C trace context (`traceparent`, `tracestate`) and W3C baggage, carried from
//! an incoming delivery, through the handler, into each outbox row it writes,
//! and out with the relay's publish.
//!
//! What a producer sends here is hostile input like the rest of its message:
//! every value is checked against its W3C grammar and its size caps before
//! warren keeps it, and what fails is dropped (the message itself is still
//! processed: a broken trace header is no reason to refuse a payment).
//!
//! - `traceparent`: version, a 32-hex trace id and a 16-hex parent id, neither
//!   all zeros, and flags. A later version is read as version `00`, as the
//!   recommendation says, and passed on as `00`.
//! - `tracestate`: at most [`MAX_TRACESTATE_MEMBERS`] members, each `key=value`
//!   by the grammar; one bad member drops the whole header, and without a
//!   valid `traceparent` it is dropped too.
//! - `baggage`: at most [`MAX_BAGGAGE_BYTES`] bytes of `key=value` members;
//!   anything else drops the whole header.
//!
//! The context travels whether or not the trace is sampled: the sampled flag
//! goes on as it came.

use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::headers::{HEADER_BAGGAGE, HEADER_TRACEPARENT, HEADER_TRACESTATE};

/// The most `tracestate` members kept (the W3C limit).
pub const MAX_TRACESTATE_MEMBERS: usize = 32;
/// The longest `baggage` header kept, in bytes (the W3C limit).
pub const MAX_BAGGAGE_BYTES: usize = 8192;
/// The longest `tracestate` header kept: 32 members of a 256-byte key and a
/// 256-byte value, with their separators.
pub const MAX_TRACESTATE_BYTES: usize = MAX_TRACESTATE_MEMBERS * 514;

/// A checked trace context: each part present only if it passed its check.
///
/// ```
/// use warren::trace_context::TraceContext;
///
/// let ctx = TraceContext::from_parts(
///     Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
///     Some("vendor=opaque"),
///     Some("tenant=acme"),
/// );
/// assert_eq!(ctx.trace_id(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
/// assert!(ctx.sampled());
///
/// // A malformed traceparent is dropped, and the tracestate with it.
/// let bad = TraceContext::from_parts(Some("00-xyz-01"), Some("vendor=opaque"), None);
/// assert!(bad.is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: Option<String>,
    tracestate: Option<String>,
    baggage: Option<String>,
}

impl TraceContext {
    /// The context a delivery's headers carry (string values only), each part
    /// checked; parts that fail are left out.
    pub fn from_headers(headers: Option<&FieldTable>) -> Self {
        let Some(headers) = headers else {
            return Self::default();
        };
        let text = |name: &str| match headers.inner().get(name) {
            Some(AMQPValue::LongString(s)) => std::str::from_utf8(s.as_bytes()).ok(),
            Some(AMQPValue::ShortString(s)) => Some(s.as_str()),
            _ => None,
        };
        Self::from_parts(
            text(HEADER_TRACEPARENT),
            text(HEADER_TRACESTATE),
            text(HEADER_BAGGAGE),
        )
    }

    /// The context of these header values, each checked; parts that fail are
    /// left out.
    pub fn from_parts(
        traceparent: Option<&str>,
        tracestate: Option<&str>,
        baggage: Option<&str>,
    ) -> Self {
        let traceparent = traceparent.and_then(check_traceparent);
        let tracestate = match traceparent {
            Some(_) => tracestate.and_then(check_tracestate),
            None => None,
        };
        Self {
            traceparent,
            tracestate,
            baggage: baggage.and_then(check_baggage),
        }
    }

    /// A context that continues `trace_id` under a new parent span id, keeping
    /// this context's tracestate, baggage and flags; what an instrumented
    /// span passes on.
    pub fn with_parent(&self, trace_id: &str, span_id: &str, sampled: bool) -> Self {
        let flags = if sampled { "01" } else { "00" };
        let traceparent = check_traceparent(&format!("00-{trace_id}-{span_id}-{flags}"));
        Self {
            tracestate: traceparent.as_ref().and(self.tracestate.clone()),
            traceparent,
            baggage: self.baggage.clone(),
        }
    }

    /// The `traceparent` value, normalized to version `00`.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// The `tracestate` value.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The `baggage` value.
    pub fn baggage(&self) -> Option<&str> {
        self.baggage.as_deref()
    }

    /// The trace id (32 lowercase hex digits).
    pub fn trace_id(&self) -> Option<&str> {
        self.traceparent.as_deref().map(|t| &t[3..35])
    }

    /// The parent span id (16 lowercase hex digits).
    pub fn parent_id(&self) -> Option<&str> {
        self.traceparent.as_deref().map(|t| &t[36..52])
    }

    /// Whether the sampled flag is set.
    pub fn sampled(&self) -> bool {
        self.traceparent
            .as_deref()
            .and_then(|t| u8::from_str_radix(&t[53..55], 16).ok())
            .is_some_and(|flags| flags & 1 == 1)
    }

    /// True when no part is present.
    pub fn is_empty(&self) -> bool {
        self.traceparent.is_none() && self.tracestate.is_none() && self.baggage.is_none()
    }

    /// Sets the present parts as long-string headers, replacing what `headers`
    /// held under those names; absent parts are removed, so that a stale
    /// context never travels beside a new one.
    pub fn write_headers(&self, headers: &mut FieldTable) {
        let parts = [
            (HEADER_TRACEPARENT, &self.traceparent),
            (HEADER_TRACESTATE, &self.tracestate),
            (HEADER_BAGGAGE, &self.baggage),
        ];
        // The table has no removal; it is rebuilt without the stale parts.
        if parts
            .iter()
            .any(|(name, value)| value.is_none() && headers.contains_key(name))
        {
            let mut kept = headers.inner().clone();
            kept.retain(|k, _| !parts.iter().any(|(name, _)| k.as_str() == *name));
            *headers = FieldTable::from(kept);
        }
        for (name, value) in parts {
            if let Some(v) = value {
                headers.insert(
                    ShortString::from(name),
                    AMQPValue::LongString(v.as_str().into()),
                );
            }
        }
    }
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The `traceparent` normalized to version `00`, or `None` if it fails the
/// grammar.
fn check_traceparent(value: &str) -> Option<String> {
    let value = value.trim_matches([' ', '\t']);
    if value.len() < 55 || !value.is_ascii() {
        return None;
    }
    let (version, rest) = (&value[..2], &value[..55]);
    if !is_lower_hex(version) || version == "ff" {
        return None;
    }
    // Version 00 is exactly 55 characters; a later version may add fields
    // after a dash, which are not read.
    if (version == "00" && value.len() != 55) || (value.len() > 55 && &value[55..56] != "-") {
        return None;
    }
    let bytes = rest.as_bytes();
    if bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
        return None;
    }
    let (trace_id, parent_id, flags) = (&rest[3..35], &rest[36..52], &rest[53..55]);
    let all_zero = |s: &str| s.bytes().all(|b| b == b'0');
    if !is_lower_hex(trace_id) || !is_lower_hex(parent_id) || !is_lower_hex(flags) {
        return None;
    }
    if all_zero(trace_id) || all_zero(parent_id) {
        return None;
    }
    Some(format!("00-{trace_id}-{parent_id}-{flags}"))
}

/// A `tracestate` key: `lcalpha 0*255(lcalpha / DIGIT / "_" / "-"/ "*" / "/")`,
/// or a multi-tenant `tenant@system` key.
fn is_tracestate_key(key: &str) -> bool {
    let part = |s: &str, max: usize, first_digit: bool| {
        let mut chars = s.bytes();
        let Some(first) = chars.next() else {
            return false;
        };
        s.len() <= max
            && (first.is_ascii_lowercase() || (first_digit && first.is_ascii_digit()))
            && chars.all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'_' | b'-' | b'*' | b'/')
            })
    };
    match key.split_once('@') {
        None => part(key, 256, false),
        Some((tenant, system)) => part(tenant, 241, true) && part(system, 14, false),
    }
}

/// A `tracestate` value: up to 256 printable ASCII characters, no `,` or `=`,
/// not ending in a space.
fn is_tracestate_value(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 256
        && !value.ends_with(' ')
        && value
            .bytes()
            .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
}

fn check_tracestate(value: &str) -> Option<String> {
    if value.len() > MAX_TRACESTATE_BYTES {
        return None;
    }
    let mut members = Vec::new();
    for member in value.split(',') {
        let member = member.trim_matches([' ', '\t']);
        if member.is_empty() {
            continue;
        }
        let (key, val) = member.split_once('=')?;
        if !is_tracestate_key(key) || !is_tracestate_value(val) {
            return None;
        }
        members.push(member);
    }
    if members.is_empty() || members.len() > MAX_TRACESTATE_MEMBERS {
        return None;
    }
    Some(members.join(","))
}

/// An HTTP token character (RFC 9110), what a baggage key is made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A baggage value character: printable ASCII but for space, `"`, `,`, `;`
/// and `\` (others are percent-encoded).
fn is_baggage_octet(b: u8) -> bool {
    matches!(b, 0x21 | 0x23..=0x2b | 0x2d..=0x3a | 0x3c..=0x5b | 0x5d..=0x7e)
}

fn check_baggage(value: &str) -> Option<String> {
    if value.len() > MAX_BAGGAGE_BYTES || value.trim().is_empty() {
        return None;
    }
    for member in value.split(',') {
        let mut parts = member.split(';');
        let (key, val) = parts.next()?.split_once('=')?;
        let (key, val) = (key.trim_matches([' ', '\t']), val.trim_matches([' ', '\t']));
        if key.is_empty() || !key.bytes().all(is_tchar) || !val.bytes().all(is_baggage_octet) {
            return None;
        }
        for property in parts {
            let (pkey, pval) = match property.split_once('=') {
                Some((k, v)) => (k.trim_matches([' ', '\t']), v.trim_matches([' ', '\t'])),
                None => (property.trim_matches([' ', '\t']), ""),
            };
            if pkey.is_empty() || !pkey.bytes().all(is_tchar) || !pval.bytes().all(is_baggage_octet)
            {
                return None;
            }
        }
    }
    Some(value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_kept_and_read() {
        let ctx = TraceContext::from_parts(Some(PARENT), None, None);
        assert_eq!(ctx.traceparent(), Some(PARENT));
        assert_eq!(ctx.parent_id(), Some("00f067aa0ba902b7"));
        assert!(ctx.sampled());
        let unsampled = TraceContext::from_parts(Some(&PARENT.replace("-01", "-00")), None, None);
        assert_eq!(
            unsampled.trace_id(),
            ctx.trace_id(),
            "unsampled still travels"
        );
        assert!(!unsampled.sampled());
    }

    #[test]
    fn malformed_traceparents_are_dropped() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\u{e9}",
        ] {
            let ctx = TraceContext::from_parts(Some(bad), Some("a=b"), None);
            assert!(ctx.is_empty(), "{bad:?} was kept");
        }
    }

    #[test]
    fn a_later_version_is_read_as_version_00() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-whatever";
        let ctx = TraceContext::from_parts(Some(later), None, None);
        assert_eq!(ctx.traceparent(), Some(PARENT));
    }

    #[test]
    fn tracestate_is_capped_and_checked() {
        let members: Vec<String> = (0..32).map(|i| format!("k{i}=v{i}")).collect();
        let ok = TraceContext::from_parts(Some(PARENT), Some(&members.join(",")), None);
        assert_eq!(ok.tracestate().map(|s| s.split(',').count()), Some(32));
        let too_many: Vec<String> = (0..33).map(|i| format!("k{i}=v{i}")).collect();
        let over = TraceContext::from_parts(Some(PARENT), Some(&too_many.join(",")), None);
        assert_eq!(over.tracestate(), None);
        assert_eq!(over.traceparent(), Some(PARENT), "the traceparent stays");
        for bad in [
            "Upper=v",
            "k=v=w",
            "k=",
            "k=v\n",
            "=v",
            "k=v,bad",
            &"k=v".repeat(20_000),
        ] {
            let ctx = TraceContext::from_parts(Some(PARENT), Some(bad), None);
            assert_eq!(ctx.tracestate(), None, "{bad:?} was kept");
        }
        let tenant = TraceContext::from_parts(Some(PARENT), Some(" acme@vendor=x , b=y "), None);
        assert_eq!(tenant.tracestate(), Some("acme@vendor=x,b=y"));
    }

    #[test]
    fn baggage_is_capped_and_checked() {
        let ok = TraceContext::from_parts(None, None, Some("tenant=acme, user=42;secure"));
        assert_eq!(ok.baggage(), Some("tenant=acme, user=42;secure"));
        let big = format!("k={}", "v".repeat(MAX_BAGGAGE_BYTES));
        for bad in [big.as_str(), "k v=1", "k=a b", "k=\"x\"", "novalue", ""] {
            let ctx = TraceContext::from_parts(None, None, Some(bad));
            assert_eq!(ctx.baggage(), None, "{bad:?} was kept");
        }
    }

    #[test]
    fn headers_are_read_as_strings_only_and_written_back() {
        let mut headers = FieldTable::default();
        headers.insert(
            HEADER_TRACEPARENT.into(),
            AMQPValue::LongString(PARENT.into()),
        );
        headers.insert(HEADER_TRACESTATE.into(), AMQPValue::LongLongInt(7));
        headers.insert(HEADER_BAGGAGE.into(), AMQPValue::LongString("a=1".into()));
        let ctx = TraceContext::from_headers(Some(&headers));
        assert_eq!(ctx.traceparent(), Some(PARENT));
        assert_eq!(ctx.tracestate(), None);
        let next = ctx.with_parent(ctx.trace_id().unwrap(), "1111111111111111", false);
        let mut out = FieldTable::default();
        out.insert(
            HEADER_TRACESTATE.into(),
            AMQPValue::LongString("stale=1".into()),
        );
        next.write_headers(&mut out);
        assert_eq!(TraceContext::from_headers(Some(&out)), next);
        assert!(!out.inner().contains_key(HEADER_TRACESTATE));
        assert_eq!(next.parent_id(), Some("1111111111111111"));
        assert_eq!(next.baggage(), Some("a=1"));
    }
}
