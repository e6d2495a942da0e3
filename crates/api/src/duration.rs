//! Kubernetes-style durations ("90s", "15m", "1h30m") as they appear in specs.
//!
//! The string is kept as written so that a value which slipped past admission
//! still deserializes; the engine parses it and refuses it with a condition
//! rather than breaking the watch.

use std::{borrow::Cow, fmt, str::FromStr};

use jiff::SignedDuration;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// The duration pattern as a literal, for CEL rules built with `concat!`.
#[macro_export]
#[doc(hidden)]
macro_rules! duration_pattern {
    () => {
        r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
    };
}

/// The pattern the CRD schema enforces: one or more `<number><unit>` terms with
/// units `ms`, `s`, `m` or `h`, the subset of Go's `time.ParseDuration` that
/// people write in manifests.
pub const DURATION_PATTERN: &str = duration_pattern!();

/// A duration written the Kubernetes way, e.g. `"90s"`, `"15m"`, `"72h"`, `"1h30m"`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Duration(String);

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {reason} (write e.g. \"90s\", \"15m\", \"1h30m\")")]
pub struct DurationError {
    input: String,
    reason: &'static str,
}

impl Duration {
    /// Parses the string into a signed duration.
    pub fn parse(&self) -> Result<SignedDuration, DurationError> {
        parse_duration(&self.0)
    }

    /// The string as written in the manifest.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A duration of whole seconds, written as `"<n>s"`.
    pub fn from_secs(secs: i64) -> Self {
        Duration(format!("{secs}s"))
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_duration(s)?;
        Ok(Duration(s.to_owned()))
    }
}

impl From<&str> for Duration {
    /// Wraps the string without checking it; use [`str::parse`] to check.
    fn from(s: &str) -> Self {
        Duration(s.to_owned())
    }
}

fn parse_duration(input: &str) -> Result<SignedDuration, DurationError> {
    let err = |reason| DurationError {
        input: input.to_owned(),
        reason,
    };
    if input.is_empty() {
        return Err(err("empty"));
    }
    let mut total_nanos: i128 = 0;
    let mut rest = input;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| err("missing unit"))?;
        if digits == 0 {
            return Err(err("expected a number"));
        }
        let number = &rest[..digits];
        rest = &rest[digits..];
        let (unit_nanos, unit_len): (i128, usize) = if rest.starts_with("ms") {
            (1_000_000, 2)
        } else if rest.starts_with('s') {
            (1_000_000_000, 1)
        } else if rest.starts_with('m') {
            (60_000_000_000, 1)
        } else if rest.starts_with('h') {
            (3_600_000_000_000, 1)
        } else {
            return Err(err("unit must be ms, s, m or h"));
        };
        rest = &rest[unit_len..];
        let (whole, frac) = match number.split_once('.') {
            Some((w, f)) if !w.is_empty() && !f.is_empty() && !f.contains('.') => (w, f),
            Some(_) => return Err(err("malformed number")),
            None => (number, ""),
        };
        let whole: i128 = whole.parse().map_err(|_| err("number too large"))?;
        let mut nanos = whole
            .checked_mul(unit_nanos)
            .ok_or_else(|| err("number too large"))?;
        if !frac.is_empty() {
            let digits = frac.len().min(18) as u32;
            let frac: i128 = frac[..digits as usize]
                .parse()
                .map_err(|_| err("malformed number"))?;
            nanos += frac * unit_nanos / 10i128.pow(digits);
        }
        total_nanos = total_nanos
            .checked_add(nanos)
            .ok_or_else(|| err("number too large"))?;
    }
    // A hundred years is far beyond any budget a run can use.
    if total_nanos > 100 * 365 * 24 * 3_600_000_000_000 {
        return Err(err("longer than 100 years"));
    }
    Ok(SignedDuration::from_nanos_i128(total_nanos))
}

impl JsonSchema for Duration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
            "maxLength": 32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_people_write() {
        let cases = [
            ("90s", 90_000),
            ("15m", 900_000),
            ("72h", 259_200_000),
            ("1h30m", 5_400_000),
            ("250ms", 250),
            ("1.5s", 1_500),
            ("0s", 0),
        ];
        for (input, millis) in cases {
            let d: Duration = input.parse().unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(d.parse().unwrap().as_millis(), millis, "{input}");
        }
    }

    #[test]
    fn refuses_malformed_durations_with_the_input_quoted() {
        for input in [
            "",
            "10",
            "s",
            "10d",
            "1.s",
            "-5s",
            "1h 30m",
            "99999999999999999999h",
        ] {
            let err = input.parse::<Duration>().expect_err(input);
            assert!(err.to_string().contains(&format!("{input:?}")), "{err}");
        }
    }

    #[test]
    fn schema_pattern_agrees_with_the_parser() {
        // Admission (the pattern) and the engine (the parser) must accept the same strings.
        let re = regex::Regex::new(DURATION_PATTERN).unwrap();
        for s in [
            "90s", "1h30m", "1.5h", "3ms", "2h2h", "10", "1.s", "5x", "", "1h 30m", "-1s",
        ] {
            assert_eq!(re.is_match(s), s.parse::<Duration>().is_ok(), "{s:?}");
        }
    }
}
