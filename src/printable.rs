//! Text that came from a message, made safe to print on a terminal.
//!
//! A message id, type, error or header is whatever a producer put there. Printed
//! raw, an ESC sequence in it can retitle the terminal, clear the screen or hide
//! what follows, and a bidi override can make one id look like another.
//! Tables escape such a character as `\u{202e}`; JSON as `\u202e`, which
//! every JSON reader turns back into the character (serde_json itself
//! writes C1 controls and bidi characters raw, so the JSON output has a
//! formatter of its own).

use std::borrow::Cow;
use std::io;

use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter, PrettyFormatter};

/// `s` with every control character (C0 including ESC, CR, LF and TAB; DEL; C1)
/// and every bidirectional formatting character replaced by a visible escape
/// such as `\u{1b}`. Everything else, including other non-ASCII text, is kept.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if needs_escape(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A whole page (HTML) with the characters [`printable`] escapes shown as
/// `\u{..}`, except the line breaks and tabs its own layout is made of.
/// Markup never holds the others, so every one of them came from a value.
pub fn printable_page(page: &str) -> Cow<'_, str> {
    let escaped = |c: char| needs_escape(c) && !matches!(c, '\n' | '\r' | '\t');
    if !page.chars().any(escaped) {
        return Cow::Borrowed(page);
    }
    let mut out = String::with_capacity(page.len() + 8);
    for c in page.chars() {
        if escaped(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The bytes of a body as printable text: invalid UTF-8 as U+FFFD, control
/// characters escaped.
pub fn printable_bytes(bytes: &[u8]) -> String {
    printable(&String::from_utf8_lossy(bytes)).into_owned()
}

/// `value` as compact JSON, every character [`printable`] escapes written
/// as a `\uXXXX` escape instead of raw.
pub fn printable_json<T: Serialize + ?Sized>(value: &T) -> String {
    write_json(value, Escaping(CompactFormatter))
}

/// [`printable_json`], pretty-printed.
pub fn printable_json_pretty<T: Serialize + ?Sized>(value: &T) -> String {
    write_json(value, Escaping(PrettyFormatter::new()))
}

fn write_json<T: Serialize + ?Sized, F: Formatter>(value: &T, formatter: F) -> String {
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    // Serializing into memory fails only for a map with keys that are not
    // strings, which no caller builds; an empty answer is still safe to print.
    if value.serialize(&mut serializer).is_err() {
        return String::new();
    }
    String::from_utf8(out).unwrap_or_default()
}

/// A JSON formatter that writes what `F` writes, with the characters
/// [`printable`] escapes turned into `\uXXXX` inside strings. serde_json
/// escapes C0 controls, `"` and `\` before a fragment reaches it.
struct Escaping<F>(F);

impl<F: Formatter> Formatter for Escaping<F> {
    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        let mut start = 0;
        for (at, c) in fragment.char_indices() {
            if needs_escape(c) {
                writer.write_all(&fragment.as_bytes()[start..at])?;
                // Every escaped character is in the Basic Multilingual Plane.
                write!(writer, "\\u{:04x}", u32::from(c))?;
                start = at + c.len_utf8();
            }
        }
        writer.write_all(&fragment.as_bytes()[start..])
    }

    fn begin_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.begin_array(writer)
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.end_array(writer)
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.0.begin_array_value(writer, first)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.end_array_value(writer)
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.begin_object(writer)
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.end_object(writer)
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.0.begin_object_key(writer, first)
    }

    fn end_object_key<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.end_object_key(writer)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.begin_object_value(writer)
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.0.end_object_value(writer)
    }
}

/// Whether `c` is printed escaped: C0 and C1 controls, DEL, the
/// bidirectional marks, embeddings, overrides and isolates, and the line and
/// paragraph separators.
pub(crate) fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            // marks, embeddings, overrides, isolates, the Arabic letter mark
            '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{061c}'
                // line and paragraph separators break a line like LF
                | '\u{2028}' | '\u{2029}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_controls_are_escaped() {
        let id = "ok\u{1b}]0;pwned\u{7}\u{1b}[2J\r\n\u{9b}31m\u{202e}cba";
        let shown = printable(id);
        assert!(!shown.chars().any(needs_escape), "{shown}");
        assert_eq!(
            shown,
            r"ok\u{1b}]0;pwned\u{7}\u{1b}[2J\u{d}\u{a}\u{9b}31m\u{202e}cba"
        );
        assert!(matches!(printable("plain-id é"), Cow::Borrowed(_)));
        assert_eq!(
            printable_bytes(b"{\"a\":\"\x1b[2J\xff\"}"),
            r#"{"a":"\u{1b}[2J�"}"#
        );
    }

    #[test]
    fn json_output_escapes_the_same_characters_and_reads_back() {
        let hostile = "ok\u{1b}[2J\u{7f}\u{85}\u{9b}31m\u{61c}\u{200e}\u{200f}\u{2028}\u{2029}\u{202a}\u{202e}\u{2066}\u{2069}é\"\\";
        let value = serde_json::json!({ hostile: [hostile, 1.5] });
        for out in [printable_json(&value), printable_json_pretty(&value)] {
            // Pretty output's own line breaks are the only raw ones.
            assert!(
                !out.chars().filter(|&c| c != '\n').any(needs_escape),
                "{out}"
            );
            assert!(out.contains("\\u009b") && out.contains("\\u202e") && out.contains('é'));
            let back: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(back, value);
        }
    }
}
