//! The frame guard: no frame the broker accepts can crash, hang or stall a
//! warren process.
//!
//! A producer can publish properties that the AMQP client cannot survive
//! reading: a header table nested thousands of levels deep (lapin parses field
//! tables and arrays by recursion, about 2 KB of stack a level, on an I/O
//! thread with the default 2 MiB stack), or text that is not UTF-8 where lapin
//! wants a `String` (a `message_id`, a header name, a routing key). The broker
//! takes both. The first aborts the process; the second closes the connection,
//! and the broker hands the same message to the next connection, forever.
//!
//! So every connection warren opens reads the broker through a guard
//! ([`connect`](super::connect)). It cuts the inbound bytes into frames and
//! walks each message's properties without recursion. Frames the client can
//! read pass byte for byte. A message's content header that it cannot read
//! safely is rewritten before the client sees it, always within the
//! negotiated frame size:
//!
//! - a header nesting more than [`MAX_HEADER_DEPTH`] tables or arrays is
//!   removed ([`Cause::TooDeep`]);
//! - headers past [`MAX_HEADER_ENTRIES`] values in all, counting every level,
//!   are removed ([`Cause::TooMany`]);
//! - text that is not UTF-8 has each bad byte replaced by `?`; a header whose
//!   name (at any level) is not UTF-8 is removed ([`Cause::Unreadable`]).
//!
//! What it did travels with the delivery as a report ([`Pruned`]), in a header
//! whose name no producer can know: [`take_pruned`] reads and removes it.
//! warren's consumer dead-letters such a delivery with the cause as its reason,
//! and the dead-letter tools show it. No deep value ever exists in the process:
//! not parsed, not dropped, cloned, printed or re-encoded.

use std::sync::OnceLock;

use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::amqp::header_str;

mod frames;
mod inspect;
mod kit;

pub use frames::FrameGuard;
pub(crate) use kit::connect;

/// The deepest a header value may nest: tables and arrays inside the headers
/// table, the value itself counted. `x-death` is 3 deep (an array of tables
/// holding an array). lapin needs about 2 KB of stack per level to parse,
/// drop, print or encode one, so 32 levels cost about 64 KB.
pub const MAX_HEADER_DEPTH: usize = 32;

/// The most values a message's headers may hold in all, every level counted
/// (each header, each element of an array, each entry of a nested table).
/// With the frame's bytes, this bounds what one message's headers take in
/// memory once parsed to about 1 MB. The headers warren and the broker
/// write on copies are counted apart ([`MAX_RECORD_ENTRIES`]), so a message
/// within the limit stays within it when retried or dead-lettered.
pub const MAX_HEADER_ENTRIES: usize = 10_000;

/// The most values the headers named by warren (`x-warren-*`) and by the
/// broker (`x-death`, `x-first-death-*`, `x-last-death-*`,
/// `x-delivery-count`, `x-acquired-count`) may hold, besides
/// [`MAX_HEADER_ENTRIES`]. warren's record on a copy takes about 20 values,
/// the broker's `x-death` about 10 per queue a message died in; past this
/// budget such headers count toward the other.
pub const MAX_RECORD_ENTRIES: usize = 1_000;

/// Why the guard rewrote a message's properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Cause {
    /// A header nested deeper than [`MAX_HEADER_DEPTH`].
    TooDeep,
    /// The headers held more than [`MAX_HEADER_ENTRIES`] values.
    TooMany,
    /// Text the client reads as UTF-8 was not: a property, a header name, the
    /// exchange or routing key; or a headers table that is not valid AMQP.
    Unreadable,
}

impl Cause {
    /// The stable, kebab-case name (the dead-letter reason warren uses).
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::TooDeep => "headers-too-deep",
            Cause::TooMany => "too-many-headers",
            Cause::Unreadable => "unreadable-frame",
        }
    }

    fn from_name(name: &str) -> Self {
        [Cause::TooDeep, Cause::TooMany]
            .into_iter()
            .find(|c| c.as_str() == name)
            .unwrap_or(Cause::Unreadable)
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the guard changed in one delivery's properties before the AMQP client
/// read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pruned {
    /// The most serious cause found (depth, then count, then text).
    pub cause: Cause,
    /// What was found, for people: which headers, which properties.
    pub detail: String,
    /// The names of the headers removed, quoted and escaped, comma-separated
    /// (cut to a few hundred bytes).
    pub removed: String,
    /// `sha256:` and the hex SHA-256 of every byte removed or replaced, in
    /// frame order: to match the message against the producer's copy. Empty
    /// for a content header too large to read at all.
    pub digest: String,
}

/// The name of the header that carries the guard's report: random per
/// process, so no producer can set it, and never published (every reader
/// takes it off).
fn marker_name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).expect("the operating system's random source works");
        format!("x-warren-guard-{}", hex::encode(nonce))
    })
}

/// Takes the guard's report off `properties`, if the guard rewrote them: a
/// delivery read from a connection made by [`connect`](super::connect) carries
/// it in a header only this process knows. warren's consumer and the
/// dead-letter tools call this on every delivery; call it on deliveries you
/// read from such a connection yourself, before you keep or republish them.
pub fn take_pruned(properties: &mut BasicProperties) -> Option<Pruned> {
    let name = marker_name();
    let headers = properties.headers().as_ref()?;
    let report = headers.inner().get(name)?;
    let table = match report {
        AMQPValue::FieldTable(t) => t.clone(),
        _ => Default::default(),
    };
    let mut rest = headers.inner().clone();
    rest.remove(name);
    *properties = properties.clone().with_headers(rest.into());
    let field = |key: &str| {
        header_str(&table, key)
            .map(|s| s.into_owned())
            .unwrap_or_default()
    };
    Some(Pruned {
        cause: Cause::from_name(&field("cause")),
        detail: field("detail"),
        removed: field("removed"),
        digest: field("digest"),
    })
}
