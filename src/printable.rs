//! Text that came from a message, made safe to print on a terminal.
//!
//! A message id, type, error or header is whatever a producer put there. Printed
//! raw, an ESC sequence in it can retitle the terminal, clear the screen or hide
//! what follows, and a bidi override can make one id look like another.

use std::borrow::Cow;

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

/// The bytes of a body as printable text: invalid UTF-8 as U+FFFD, control
/// characters escaped.
pub fn printable_bytes(bytes: &[u8]) -> String {
    printable(&String::from_utf8_lossy(bytes)).into_owned()
}

fn needs_escape(c: char) -> bool {
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
}
