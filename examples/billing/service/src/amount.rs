//! Money as an exact decimal, read from the JSON text the producer wrote.
//!
//! serde_json hands numbers over as `f64` (or `u64`/`i64`) unless the raw text is
//! kept, and `f64` cannot hold `0.1`, let alone a 30-digit amount. billing keeps
//! the payload's amount as raw JSON and parses the text here into an integer
//! count of the smallest unit written (`minor / 10^scale`). An `i128` holds 38
//! digits, more than the 28 + 3 the contract admits, which is why this is not
//! `rust_decimal` (28 significant digits, so a 30-digit amount would not fit).

use std::fmt;

/// Amounts must be below `10^MAX_INTEGER_DIGITS` (at most 28 digits before the
/// decimal point).
pub const MAX_INTEGER_DIGITS: usize = 28;

/// More fractional digits than this fit no currency; refused before parsing so
/// that the `i128` cannot overflow.
const MAX_SCALE: usize = 9;

/// An exact decimal amount: `minor / 10^scale`, with `scale` the number of
/// digits the producer wrote after the decimal point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amount {
    minor: i128,
    scale: u32,
}

/// Why a JSON value is not an amount. Every case is permanent: the same text
/// fails the same way on every attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AmountError {
    /// Not a JSON number or a string holding a decimal.
    NotADecimal(String),
    /// Written with an exponent (`1e308`, `1.5E2`).
    Exponent(String),
    /// At or above `10^28`.
    OutOfRange(String),
    /// More digits after the point than any currency has.
    TooPrecise(String),
}

impl fmt::Display for AmountError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AmountError::NotADecimal(t) => write!(
                f,
                "amount {t} is not a decimal number (a JSON number or a string such as \"12.50\")"
            ),
            AmountError::Exponent(t) => write!(
                f,
                "amount {t} is written with an exponent; write it as a plain decimal such as 12.50"
            ),
            AmountError::OutOfRange(t) => write!(
                f,
                "amount {t} is out of range: at most {MAX_INTEGER_DIGITS} digits before the decimal point"
            ),
            AmountError::TooPrecise(t) => write!(
                f,
                "amount {t} has more digits after the decimal point than any currency allows"
            ),
        }
    }
}

impl std::error::Error for AmountError {}

/// The start of a value from a message, for error texts: the value is untrusted
/// and may be megabytes long.
pub fn shown(text: &str) -> String {
    const MAX: usize = 40;
    let mut out: String = text
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(MAX).is_some() {
        out.push_str("...");
    }
    out
}

impl Amount {
    /// Zero, at scale 0.
    pub const ZERO: Amount = Amount { minor: 0, scale: 0 };

    /// Reads a payload's raw JSON amount: a number (`12.5`) or a string holding
    /// the same plain-decimal form (`"12.50"`), exactly as written.
    pub fn from_json(raw: &str) -> Result<Amount, AmountError> {
        let raw = raw.trim();
        if raw.starts_with('"') {
            let text: String =
                serde_json::from_str(raw).map_err(|_| AmountError::NotADecimal(shown(raw)))?;
            Amount::parse(&text)
        } else {
            Amount::parse(raw)
        }
    }

    /// Parses a plain decimal in JSON's number grammar without an exponent:
    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?`.
    pub fn parse(text: &str) -> Result<Amount, AmountError> {
        let not_decimal = || AmountError::NotADecimal(shown(text));
        let (negative, unsigned) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        if unsigned.contains(['e', 'E']) && unsigned.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(AmountError::Exponent(shown(text)));
        }
        let (int, frac) = match unsigned.split_once('.') {
            Some((i, f)) => (i, Some(f)),
            None => (unsigned, None),
        };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(int) || (int.len() > 1 && int.starts_with('0')) {
            return Err(not_decimal());
        }
        if frac.is_some_and(|f| !digits(f)) {
            return Err(not_decimal());
        }
        let frac = frac.unwrap_or("");
        if int.len() > MAX_INTEGER_DIGITS {
            return Err(AmountError::OutOfRange(shown(text)));
        }
        if frac.len() > MAX_SCALE {
            return Err(AmountError::TooPrecise(shown(text)));
        }
        // At most 28 + 9 digits: below 10^37, well inside i128.
        let magnitude: i128 = format!("{int}{frac}").parse().map_err(|_| not_decimal())?;
        Ok(Amount {
            minor: if negative { -magnitude } else { magnitude },
            scale: frac.len() as u32,
        })
    }

    /// Digits after the decimal point, as written.
    pub fn scale(self) -> u32 {
        self.scale
    }

    /// True below zero (`-0.00` is zero).
    pub fn is_negative(self) -> bool {
        self.minor < 0
    }

    /// The largest whole number not above the amount: the loyalty points.
    pub fn floor(self) -> i128 {
        self.minor.div_euclid(10_i128.pow(self.scale))
    }

    /// The exact sum, at the larger of the two scales; `None` on overflow.
    pub fn checked_add(self, other: Amount) -> Option<Amount> {
        let scale = self.scale.max(other.scale);
        let widen = |a: Amount| a.minor.checked_mul(10_i128.checked_pow(scale - a.scale)?);
        Some(Amount {
            minor: widen(self)?.checked_add(widen(other)?)?,
            scale,
        })
    }
}

/// The canonical text: no exponent, no leading zeros, exactly `scale` digits
/// after the point. This is what both databases store and give back.
impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.minor < 0 { "-" } else { "" };
        let digits = self.minor.unsigned_abs().to_string();
        let scale = self.scale as usize;
        if scale == 0 {
            return write!(f, "{sign}{digits}");
        }
        let digits = format!("{digits:0>width$}", width = scale + 1);
        let (int, frac) = digits.split_at(digits.len() - scale);
        write!(f, "{sign}{int}.{frac}")
    }
}

impl std::str::FromStr for Amount {
    type Err = AmountError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Amount::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thirty_digits_and_tenths_are_exact() {
        let big = "1234567890123456789012345678.90";
        let a = Amount::from_json(big).unwrap();
        assert_eq!(a.to_string(), big);
        assert_eq!(a.floor(), 1_234_567_890_123_456_789_012_345_678);
        let sum = Amount::parse("0.1")
            .unwrap()
            .checked_add(Amount::parse("0.2").unwrap())
            .unwrap();
        assert_eq!(sum.to_string(), "0.3");
        assert_eq!(Amount::from_json("\"12.50\"").unwrap().to_string(), "12.50");
        assert_eq!(Amount::parse("0.05").unwrap().to_string(), "0.05");
        assert_eq!(Amount::parse("-0.00").unwrap().to_string(), "0.00");
        assert_eq!(
            Amount::parse("9223372036854775808").unwrap().floor(),
            9_223_372_036_854_775_808
        );
    }

    #[test]
    fn floats_exponents_and_junk_are_refused() {
        for (text, want) in [
            ("1e308", "exponent"),
            ("1.5E2", "exponent"),
            ("10000000000000000000000000000", "out of range"),
            ("0.0000000001", "more digits"),
            ("012", "not a decimal"),
            ("1.", "not a decimal"),
            (".5", "not a decimal"),
            ("true", "not a decimal"),
            ("\"12,50\"", "not a decimal"),
            ("\" 1\"", "not a decimal"),
            ("null", "not a decimal"),
        ] {
            let err = Amount::from_json(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn shown_truncates_and_escapes() {
        assert_eq!(shown("a\0b"), "a\\0b");
        assert_eq!(shown(&"x".repeat(8000)), format!("{}...", "x".repeat(40)));
    }
}
