//! A step's `resultSchema`: checked with the plan (a schema too large or that
//! does not compile is an invalid spec, D13, whether a person or a planner
//! wrote it) and applied when a successful attempt's result is read, before
//! anything is committed. References resolve only within the schema: nothing
//! is fetched from the network or the operator's file system.

use serde_json::Value;

use agentrun_api::MAX_RESULT_SCHEMA_BYTES;

/// How many mismatches a message names; the rest are counted.
const SHOWN: usize = 3;
/// How long one mismatch may be in a message.
const MISMATCH_CHARS: usize = 160;

/// The most memory one compiled `pattern` may take.
const PATTERN_BYTES: usize = 1 << 20;

fn compile(schema: &Value) -> Result<jsonschema::Validator, String> {
    jsonschema::options()
        // `format` asserts (a `date-time` must be one), as a boundary check
        // should; a format the validator does not know is not checked.
        .should_validate_formats(true)
        // Patterns run on a linear-time engine (D22): a pattern the author
        // wrote is matched against data from outside (a signal's), and a
        // backtracking engine would let one of them take a worker for as
        // long as the pattern likes. Look-around and back-references, which
        // need backtracking, make the schema unusable (D13).
        .with_pattern_options(jsonschema::PatternOptions::regex().size_limit(PATTERN_BYTES))
        .build(schema)
        .map_err(|e| cap(&e.to_string()))
}

/// Whether `schema` can be used: a JSON object of at most
/// `MAX_RESULT_SCHEMA_BYTES` that compiles.
pub fn check(schema: &Value) -> Result<(), String> {
    if !schema.is_object() {
        return Err("must be a JSON Schema object".into());
    }
    let size = schema.to_string().len();
    if size > MAX_RESULT_SCHEMA_BYTES {
        return Err(format!(
            "{size} bytes as JSON, over the {} KiB a result schema may have",
            MAX_RESULT_SCHEMA_BYTES / 1024
        ));
    }
    compile(schema)
        .map(drop)
        .map_err(|e| format!("is not a usable JSON Schema: {e}"))
}

/// What is wrong with `result` under `schema`, if anything: the first
/// mismatches, each with where in the result it is (a JSON pointer). The
/// values themselves are not quoted: a result may hold what status must not.
pub fn mismatches(schema: &Value, result: &Value) -> Result<(), String> {
    let validator =
        compile(schema).map_err(|e| format!("its resultSchema does not compile: {e}"))?;
    let errors: Vec<String> = validator
        .iter_errors(result)
        .map(|e| {
            let at = e.instance_path().as_str();
            let at = if at.is_empty() { "/" } else { at };
            cap(&format!("at {at}: {}", e.masked()))
        })
        .collect();
    if errors.is_empty() {
        return Ok(());
    }
    let more = errors.len().saturating_sub(SHOWN);
    let mut text = errors
        .into_iter()
        .take(SHOWN)
        .collect::<Vec<_>>()
        .join("; ");
    if more > 0 {
        text.push_str(&format!("; and {more} more"));
    }
    Err(text)
}

fn cap(text: &str) -> String {
    match text.char_indices().nth(MISMATCH_CHARS) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn order() -> Value {
        json!({
            "type": "object",
            "required": ["orderId", "total"],
            "properties": {
                "orderId": {"type": "string", "pattern": "^o-[0-9]+$"},
                "total": {"type": "number", "minimum": 0},
                "at": {"type": "string", "format": "date-time"}
            }
        })
    }

    #[test]
    fn a_pattern_that_needs_backtracking_makes_the_schema_unusable() {
        // Look-ahead and back-references: a backtracking engine runs these
        // for as long as the input makes it, on data from outside.
        for pattern in ["^(a|aa)+(?=b)", "^(a+)\\1$"] {
            let schema = json!({"type": "string", "pattern": pattern});
            let e = check(&schema).unwrap_err();
            assert!(
                e.starts_with("is not a usable JSON Schema"),
                "{pattern}: {e}"
            );
        }
        // What a linear-time engine matches stays usable.
        let schema = json!({"type": "string", "pattern": "^(a+)+$"});
        assert_eq!(check(&schema), Ok(()));
        let long = format!("{}!", "a".repeat(10_000));
        assert!(mismatches(&schema, &json!(long)).is_err());
    }

    #[test]
    fn a_matching_result_passes() {
        assert_eq!(
            mismatches(&order(), &json!({"orderId": "o-7", "total": 3.5})),
            Ok(())
        );
    }

    #[test]
    fn mismatches_name_where_and_what_without_quoting_values() {
        let e =
            mismatches(&order(), &json!({"orderId": "secret-token-x", "total": -1})).unwrap_err();
        assert!(e.contains("at /orderId:"), "{e}");
        assert!(e.contains("at /total:"), "{e}");
        assert!(!e.contains("secret-token-x"), "values are not quoted: {e}");
        let e = mismatches(&order(), &json!("just text")).unwrap_err();
        assert!(e.starts_with("at /:"), "{e}");
    }

    #[test]
    fn formats_are_checked() {
        let e = mismatches(
            &order(),
            &json!({"orderId": "o-1", "total": 1, "at": "yesterday"}),
        )
        .unwrap_err();
        assert!(e.contains("at /at:"), "{e}");
    }

    #[test]
    fn only_the_first_mismatches_are_named() {
        let schema = json!({"type": "array", "items": {"type": "integer"}});
        let e = mismatches(&schema, &json!(["a", "b", "c", "d", "e"])).unwrap_err();
        assert_eq!(e.matches("at /").count(), SHOWN, "{e}");
        assert!(e.ends_with("; and 2 more"), "{e}");
    }

    #[test]
    fn schemas_that_cannot_be_used_are_refused() {
        assert_eq!(check(&order()), Ok(()));
        assert!(check(&json!(true)).unwrap_err().contains("object"));
        let e = check(&json!({"type": "no-such-type"})).unwrap_err();
        assert!(e.starts_with("is not a usable JSON Schema"), "{e}");
        // Nothing is fetched: a remote reference does not compile.
        let e = check(&json!({"$ref": "https://example.com/order.json"})).unwrap_err();
        assert!(e.starts_with("is not a usable JSON Schema"), "{e}");
        let big = json!({"description": "x".repeat(MAX_RESULT_SCHEMA_BYTES)});
        assert!(check(&big).unwrap_err().contains("8 KiB"));
        // A local reference is fine.
        let local = json!({"$defs": {"id": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/id"}}});
        assert_eq!(check(&local), Ok(()));
    }
}
