//! How letters compare on every store: what a search value must be for
//! PostgreSQL, SQLite and MariaDB to find the same letters. Times are kept
//! to the millisecond (what SQLite stores); a payload number matches the
//! texts `serde_json` writes for numbers equal to it (what the ingester
//! stores). The operator input rules (`warren_admin::input`) build on these.

use std::borrow::Cow;

use chrono::{DateTime, Timelike, Utc};

/// Significant digits a number may have: every decimal of 15 digits or
/// fewer survives a trip through a 64-bit float, so the stores that compare
/// numbers as floats and those that compare them exactly agree.
pub const MAX_SIGNIFICANT_DIGITS: usize = 15;
/// Largest exponent (either sign) of a number, in its scientific form.
pub const MAX_EXPONENT: i32 = 300;
/// `t` cut to the millisecond, a leap second to the last millisecond of
/// the second before.
pub fn to_millisecond(t: DateTime<Utc>) -> DateTime<Utc> {
    let nanos = t.nanosecond().min(999_999_999);
    t.with_nanosecond(nanos / 1_000_000 * 1_000_000)
        .unwrap_or(t)
}

/// The texts warren's dead-letter store holds for JSON numbers equal to
/// `value`, when `value` is written as a JSON number within the
/// input rules (`warren_admin::input`); `None` otherwise (a value matched as text
/// only).
///
/// The store's payload copy is written by `serde_json`, so each number in it
/// is an integer (`149`) or the shortest text of a 64-bit float (`149.0`,
/// `1e21`): a number equal to `value` is one of these texts, and a store
/// that compares them as text agrees with one that compares numbers exactly.
pub(crate) fn number_texts(value: &str) -> Option<Vec<String>> {
    let number = JsonNumber::parse(value)?;
    number.check().ok()?;
    let float: f64 = value.parse().ok()?;
    let mut texts = Vec::with_capacity(3);
    if float == 0.0 {
        texts.extend(["0", "0.0", "-0.0"].map(str::to_owned));
        return Some(texts);
    }
    if number.is_integral() {
        // At most 15 significant digits: an integer this big or smaller
        // is exact as an i64 when its exponent is small enough.
        if let Some(int) = number.as_i128() {
            if let Ok(i) = i64::try_from(int) {
                texts.push(i.to_string());
            } else if let Ok(u) = u64::try_from(int) {
                texts.push(u.to_string());
            }
        }
    }
    // What the ingester's `Value::to_string` writes for it: the serializer's
    // float form (not `Number`'s `Display`, which may differ).
    texts.push(serde_json::to_string(&float).ok()?);
    Some(texts)
}

/// A value written in JSON's number grammar: `-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`.
pub struct JsonNumber<'a> {
    negative: bool,
    /// The digits, integer and fraction run together, leading and trailing
    /// zeros kept.
    digits: Cow<'a, str>,
    /// Where the decimal point sits in `digits`, counted from the left.
    point: i64,
    /// The written exponent (saturated).
    exponent: i64,
}

impl<'a> JsonNumber<'a> {
    /// `s` read in JSON's number grammar, or `None`.
    pub fn parse(s: &'a str) -> Option<Self> {
        let (negative, rest) = match s.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        if int_len == 0 || (int_len > 1 && rest.starts_with('0')) {
            return None;
        }
        let (int, mut rest) = rest.split_at(int_len);
        let mut fraction = "";
        if let Some(after) = rest.strip_prefix('.') {
            let n = after.bytes().take_while(u8::is_ascii_digit).count();
            if n == 0 {
                return None;
            }
            (fraction, rest) = after.split_at(n);
        }
        let mut exponent = 0i64;
        if let Some(after) = rest.strip_prefix(['e', 'E']) {
            let (sign, digits) = match after.as_bytes().first() {
                Some(b'-') => (-1, &after[1..]),
                Some(b'+') => (1, &after[1..]),
                _ => (1, after),
            };
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            exponent = sign
                * digits.bytes().fold(0i64, |n, d| {
                    n.saturating_mul(10).saturating_add(i64::from(d - b'0'))
                });
            rest = "";
        }
        if !rest.is_empty() {
            return None;
        }
        let digits = if fraction.is_empty() {
            Cow::Borrowed(int)
        } else {
            Cow::Owned(format!("{int}{fraction}"))
        };
        Some(Self {
            negative,
            digits,
            point: int_len as i64,
            exponent,
        })
    }

    /// The significant digits, without leading or trailing zeros, and the
    /// exponent of the number in scientific form (`d.ddd × 10^e`); `None`
    /// for zero.
    fn significant(&self) -> Option<(&str, i64)> {
        let leading = self.digits.bytes().take_while(|&b| b == b'0').count();
        if leading == self.digits.len() {
            return None;
        }
        let trimmed = self.digits[leading..].trim_end_matches('0');
        let scientific = self
            .exponent
            .saturating_add(self.point)
            .saturating_sub(leading as i64)
            .saturating_sub(1);
        Some((trimmed, scientific))
    }

    /// Why the number would not read the same in every store, if it would not.
    pub fn check(&self) -> Result<(), String> {
        let Some((digits, exponent)) = self.significant() else {
            return Ok(());
        };
        if digits.len() > MAX_SIGNIFICANT_DIGITS {
            return Err(format!("has {} significant digits", digits.len()));
        }
        if exponent.unsigned_abs() > MAX_EXPONENT.unsigned_abs().into() {
            return Err(format!("has the exponent {exponent}"));
        }
        Ok(())
    }

    fn is_integral(&self) -> bool {
        match self.significant() {
            None => true,
            Some((digits, exponent)) => exponent >= digits.len() as i64 - 1,
        }
    }

    /// The value as an integer, if it is one that fits.
    fn as_i128(&self) -> Option<i128> {
        let (digits, exponent) = self.significant()?;
        let zeros = u32::try_from(exponent - (digits.len() as i64 - 1)).ok()?;
        let mantissa: i128 = digits.parse().ok()?;
        let value = mantissa.checked_mul(10i128.checked_pow(zeros)?)?;
        Some(if self.negative { -value } else { value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_number_matches_the_texts_serde_writes_for_it() {
        let float = |x: f64| serde_json::Value::from(x).to_string();
        assert_eq!(number_texts("149").unwrap(), ["149", "149.0"]);
        assert_eq!(number_texts("1.49e2").unwrap(), ["149", "149.0"]);
        assert_eq!(number_texts("-0.5").unwrap(), ["-0.5"]);
        assert_eq!(number_texts("0").unwrap(), ["0", "0.0", "-0.0"]);
        assert_eq!(number_texts("-0e5").unwrap(), ["0", "0.0", "-0.0"]);
        assert_eq!(
            number_texts("1e19").unwrap(),
            ["10000000000000000000".to_owned(), float(1e19)]
        );
        assert_eq!(number_texts("1e21").unwrap(), [float(1e21)]);
        assert_eq!(number_texts("0.1").unwrap(), ["0.1"]);
        assert_eq!(number_texts("1e300").unwrap(), [float(1e300)]);
        for text in [
            "abc", "+5", ".5", "5.", "01", "inf", "NaN", "0x10", "1e301", "1 ",
        ] {
            assert_eq!(number_texts(text), None, "{text:?}");
        }
        // What the store holds is what serde_json writes for a parsed payload.
        for written in ["149", "149.0", "1.49e2", "12.50", "1e19", "-7", "1e-7"] {
            let held = serde_json::from_str::<serde_json::Value>(written)
                .unwrap()
                .to_string();
            assert!(
                number_texts(written).unwrap().contains(&held),
                "{written} held as {held}"
            );
        }
    }
}
