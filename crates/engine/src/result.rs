//! The step result contract: the JSON a step container writes to its
//! termination message, `{"result": …, "tokens": {"input": n, "output": n},
//! "plan": […], "summary": "…"}`. Parsing never panics; every refusal quotes
//! what was wrong so a person can fix the step.

use serde_json::Value;

use agentrun_api::{EffectOutcome, TokenUsage};

/// The kubelet keeps at most 4 KiB of termination message.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// How much of a bad message is quoted back in status.
const QUOTE_CHARS: usize = 120;

/// What one finished attempt reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    pub result: Value,
    pub tokens: TokenUsage,
    /// Planner only: the raw plan, validated by `plan::parse_planner_plan`.
    pub plan: Option<Value>,
    /// Compactor only.
    pub summary: Option<String>,
    /// What the step says it did to the outside world (`"effect"`), if it says.
    pub effect: Option<EffectOutcome>,
    /// A journaled step: the tokens of every model call its journal holds,
    /// each once (`"journalTokens"`), as the attempt saw the journal at its end.
    pub journal_tokens: Option<TokenUsage>,
}

/// Parses a termination message. An empty or absent message is a null result.
pub fn parse(message: Option<&str>) -> Result<StepReport, String> {
    let Some(message) = message.map(str::trim).filter(|m| !m.is_empty()) else {
        return Ok(StepReport {
            result: Value::Null,
            ..StepReport::default()
        });
    };
    if message.len() > MAX_MESSAGE_BYTES {
        return Err(format!(
            "termination message is {} bytes, over the {MAX_MESSAGE_BYTES}-byte limit: {}",
            message.len(),
            quote(message)
        ));
    }
    let value: Value = serde_json::from_str(message)
        .map_err(|e| format!("termination message is not JSON ({e}): {}", quote(message)))?;
    let Value::Object(mut fields) = value else {
        return Err(format!(
            "termination message must be a JSON object with result, tokens, plan or summary: {}",
            quote(message)
        ));
    };
    let tokens = match fields.remove("tokens") {
        None | Some(Value::Null) => TokenUsage::default(),
        Some(t) => parse_tokens(&t).ok_or_else(|| {
            format!(
                "termination message field tokens must be {{\"input\": n, \"output\": n}} with non-negative integers, got {}",
                quote(&t.to_string())
            )
        })?,
    };
    let summary = match fields.remove("summary") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            return Err(format!(
                "termination message field summary must be a string, got {}",
                quote(&other.to_string())
            ));
        }
    };
    let plan = match fields.remove("plan") {
        None | Some(Value::Null) => None,
        Some(p @ Value::Array(_)) => Some(p),
        Some(other) => {
            return Err(format!(
                "termination message field plan must be an array of steps, got {}",
                quote(&other.to_string())
            ));
        }
    };
    let effect = match fields.remove("effect") {
        None | Some(Value::Null) => None,
        Some(e) => Some(parse_effect(&e).ok_or_else(|| {
            format!(
                "termination message field effect must be \"Applied\", \"NotApplied\" or \"Unknown\", got {}",
                quote(&e.to_string())
            )
        })?),
    };
    let journal_tokens = match fields.remove("journalTokens") {
        None | Some(Value::Null) => None,
        Some(t) => Some(parse_tokens(&t).ok_or_else(|| {
            format!(
                "termination message field journalTokens must be {{\"input\": n, \"output\": n}} with non-negative integers, got {}",
                quote(&t.to_string())
            )
        })?),
    };
    Ok(StepReport {
        result: fields.remove("result").unwrap_or(Value::Null),
        tokens,
        plan,
        summary,
        effect,
        journal_tokens,
    })
}

fn parse_effect(v: &Value) -> Option<EffectOutcome> {
    match v.as_str()? {
        "Applied" => Some(EffectOutcome::Applied),
        "NotApplied" => Some(EffectOutcome::NotApplied),
        "Unknown" => Some(EffectOutcome::Unknown),
        _ => None,
    }
}

/// What a failed attempt said about its effect, best effort: only a message
/// that is a JSON object with `"effect": "NotApplied"` says the attempt did
/// not act (D6). Anything else — no message, a partial or malformed one —
/// says nothing, and the attempt may have acted.
pub fn reported_effect(message: Option<&str>) -> Option<EffectOutcome> {
    let v: Value = serde_json::from_str(message?.trim()).ok()?;
    parse_effect(v.get("effect")?)
}

/// What a failed attempt said about its failure, for its checkpoint: the
/// `error` of its result (`{"result": {"error": "…"}, "tokens": …}`, what the
/// step SDKs write), or the start of a message that is not JSON.
pub fn failure_reason(message: Option<&str>) -> Option<String> {
    let m = message?.trim();
    if m.is_empty() {
        return None;
    }
    match serde_json::from_str::<Value>(m) {
        Ok(v) => {
            let error = v
                .get("result")
                .and_then(|r| r.get("error"))
                .or_else(|| v.get("error"))?;
            let text = error
                .as_str()
                .map_or_else(|| error.to_string(), str::to_owned);
            (!text.is_empty()).then(|| quote(&text))
        }
        Err(_) => Some(quote(m)),
    }
}

/// A journaled step's `journalTokens` from a message that may be malformed.
pub fn journal_tokens_best_effort(message: Option<&str>) -> Option<TokenUsage> {
    message
        .and_then(|m| serde_json::from_str::<Value>(m.trim()).ok())
        .and_then(|v| parse_tokens(v.get("journalTokens")?))
}

/// Tokens from a message that may be malformed: failed and disrupted attempts
/// still count what they report (D9), and report nothing when unreadable.
pub fn tokens_best_effort(message: Option<&str>) -> TokenUsage {
    // Tokens were spent even when the rest of the message is unusable (D9).
    message
        .and_then(|m| serde_json::from_str::<Value>(m.trim()).ok())
        .and_then(|v| parse_tokens(v.get("tokens")?))
        .unwrap_or_default()
}

fn parse_tokens(v: &Value) -> Option<TokenUsage> {
    let obj = v.as_object()?;
    let field = |k: &str| match obj.get(k) {
        None => Some(0),
        Some(n) => n.as_i64().filter(|n| *n >= 0),
    };
    Some(TokenUsage {
        input: field("input")?,
        output: field("output")?,
    })
}

/// The start of `s`, on a char boundary, in quotes.
pub fn quote(s: &str) -> String {
    let mut q: String = s.chars().take(QUOTE_CHARS).collect();
    if q.len() < s.len() {
        q.push('…');
    }
    format!("{q:?}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_the_contract() {
        struct Case {
            name: &'static str,
            message: Option<&'static str>,
            want: StepReport,
        }
        let cases = [
            Case {
                name: "absent message is a null result",
                message: None,
                want: StepReport::default(),
            },
            Case {
                name: "blank message is a null result",
                message: Some("  \n"),
                want: StepReport::default(),
            },
            Case {
                name: "result and tokens",
                message: Some(r#"{"result": {"rows": 3}, "tokens": {"input": 10, "output": 5}}"#),
                want: StepReport {
                    result: json!({"rows": 3}),
                    tokens: TokenUsage {
                        input: 10,
                        output: 5,
                    },
                    ..Default::default()
                },
            },
            Case {
                name: "summary and plan",
                message: Some(r#"{"summary": "short", "plan": []}"#),
                want: StepReport {
                    summary: Some("short".into()),
                    plan: Some(json!([])),
                    ..Default::default()
                },
            },
            Case {
                name: "unknown fields are ignored",
                message: Some(r#"{"result": 1, "extra": true}"#),
                want: StepReport {
                    result: json!(1),
                    ..Default::default()
                },
            },
        ];
        for c in cases {
            assert_eq!(parse(c.message).unwrap(), c.want, "{}", c.name);
        }
    }

    #[test]
    fn an_attempt_says_it_did_not_act_only_in_so_many_words() {
        let cases: [(&str, Option<&str>, Option<EffectOutcome>); 6] = [
            ("no message", None, None),
            ("not JSON", Some("refund failed"), None),
            (
                "no effect field",
                Some(r#"{"result": {"error": "x"}}"#),
                None,
            ),
            (
                "not applied",
                Some(r#"{"result": {"error": "card declined"}, "effect": "NotApplied"}"#),
                Some(EffectOutcome::NotApplied),
            ),
            (
                "unknown",
                Some(r#"{"effect": "Unknown"}"#),
                Some(EffectOutcome::Unknown),
            ),
            (
                "a misspelling says nothing",
                Some(r#"{"effect": "notapplied"}"#),
                None,
            ),
        ];
        for (name, message, want) in cases {
            assert_eq!(reported_effect(message), want, "{name}");
        }
        let report = parse(Some(r#"{"result": 1, "effect": "NotApplied"}"#)).unwrap();
        assert_eq!(report.effect, Some(EffectOutcome::NotApplied));
        let err = parse(Some(r#"{"effect": "Maybe"}"#)).unwrap_err();
        assert!(err.contains("effect must be"), "{err}");
    }

    #[test]
    fn refuses_bad_messages_quoting_the_problem() {
        let big = format!(r#"{{"result": "{}"}}"#, "x".repeat(5000));
        let cases: [(&str, &str, &str); 6] = [
            ("not JSON", "done!", "not JSON"),
            ("not an object", "[1,2]", "must be a JSON object"),
            (
                "negative tokens",
                r#"{"tokens": {"input": -1}}"#,
                "tokens must be",
            ),
            ("tokens not an object", r#"{"tokens": 7}"#, "tokens must be"),
            (
                "summary not a string",
                r#"{"summary": 7}"#,
                "summary must be a string",
            ),
            (
                "plan not an array",
                r#"{"plan": {}}"#,
                "plan must be an array",
            ),
        ];
        for (name, message, want) in cases {
            let err = parse(Some(message)).expect_err(name);
            assert!(err.contains(want), "{name}: {err}");
        }
        let err = parse(Some(&big)).expect_err("too large");
        assert!(err.contains("over the 4096-byte limit"), "{err}");
        assert!(err.len() < 400, "the quote is bounded: {err}");
    }

    #[test]
    fn quotes_stay_on_char_boundaries() {
        let s = "é".repeat(500);
        assert!(parse(Some(&s)).unwrap_err().contains('é'));
    }
}
