//! A step's `when`: a CEL expression over the results of the steps it
//! depends on, evaluated with the CEL implementation the CRD rules use
//! (kube's `cel` feature links it). The expression sees one variable,
//! `steps`, a map from each dependency's name to `{"result": …, "phase":
//! "Succeeded" | "Skipped"}`; a skipped step has no `result`.
//!
//! Refused before the run starts (D13): an expression that does not parse,
//! or that names a step it does not depend on. A failure to evaluate (a
//! missing field, a wrong type, a value that is not a bool) is returned with
//! CEL's own message: the step fails with it, never skips silently.

use std::collections::BTreeMap;

use cel::common::ast::{Expr, IdedExpr, LiteralValue};
use cel::{Context, Program, Value};
use serde_json::Value as Json;

/// What the expression is told about one step it depends on.
pub struct Input<'a> {
    pub name: &'a str,
    pub phase: &'a str,
    pub result: Option<&'a Json>,
}

/// Parses `when` and checks that it names only the steps in `known`.
pub fn check(when: &str, known: &[&str]) -> Result<(), String> {
    let program = compile(when)?;
    for name in referenced_steps(program.expression()) {
        if !known.contains(&name.as_str()) {
            let deps = if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            };
            return Err(format!(
                "names step {name:?}, which this step does not depend on (it depends on: {deps})"
            ));
        }
    }
    Ok(())
}

/// Evaluates `when` against the steps it depends on.
pub fn evaluate(when: &str, inputs: &[Input]) -> Result<bool, String> {
    let program = compile(when)?;
    let mut steps: BTreeMap<String, Json> = BTreeMap::new();
    for i in inputs {
        let mut fields = serde_json::Map::new();
        fields.insert("phase".into(), Json::String(i.phase.to_owned()));
        if let Some(r) = i.result {
            fields.insert("result".into(), r.clone());
        }
        steps.insert(i.name.to_owned(), Json::Object(fields));
    }
    let mut context = Context::default();
    context
        .add_variable("steps", steps)
        .map_err(|e| format!("cannot pass the results to CEL: {e}"))?;
    match program.execute(&context) {
        Ok(Value::Bool(b)) => Ok(b),
        Ok(other) => Err(format!("evaluated to {}, not to a bool", describe(&other))),
        Err(e) => Err(format!("CEL error: {e}")),
    }
}

fn compile(when: &str) -> Result<Program, String> {
    // The parser of this CEL version panics on some malformed input; a spec
    // must never crash the operator (D13).
    match std::panic::catch_unwind(|| Program::compile(when)) {
        Ok(Ok(p)) => Ok(p),
        Ok(Err(e)) => Err(format!(
            "does not parse as CEL: {}",
            first_line(&e.to_string())
        )),
        Err(_) => Err("does not parse as CEL".into()),
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").trim().to_owned()
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::String(s) => format!("the string {s:?}"),
        Value::Int(i) => format!("the int {i}"),
        Value::UInt(i) => format!("the uint {i}"),
        Value::Float(f) => format!("the double {f}"),
        Value::List(_) => "a list".into(),
        Value::Map(_) => "a map".into(),
        _ => "a value of another type".into(),
    }
}

/// The names of the steps an expression reads: `steps.<name>` and
/// `steps['<name>']`, wherever they appear.
fn referenced_steps(e: &IdedExpr) -> Vec<String> {
    let mut out = Vec::new();
    walk(e, &mut out);
    out.sort();
    out.dedup();
    out
}

fn is_steps(e: &IdedExpr) -> bool {
    matches!(&e.expr, Expr::Ident(n) if n == "steps")
}

fn walk(e: &IdedExpr, out: &mut Vec<String>) {
    match &e.expr {
        Expr::Select(s) => {
            if is_steps(&s.operand) {
                out.push(s.field.clone());
            }
            walk(&s.operand, out);
        }
        Expr::Call(c) => {
            if c.func_name == "_[_]"
                && let [operand, key] = c.args.as_slice()
                && is_steps(operand)
                && let Expr::Literal(LiteralValue::String(name)) = &key.expr
            {
                out.push(name.to_string());
            }
            if let Some(t) = &c.target {
                walk(t, out);
            }
            for a in &c.args {
                walk(a, out);
            }
        }
        Expr::Comprehension(c) => {
            for x in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                walk(x, out);
            }
        }
        Expr::List(l) => l.elements.iter().for_each(|x| walk(x, out)),
        Expr::Map(m) => {
            for entry in &m.entries {
                if let cel::common::ast::EntryExpr::MapEntry(me) = &entry.expr {
                    walk(&me.key, out);
                    walk(&me.value, out);
                }
            }
        }
        Expr::Struct(s) => {
            for entry in &s.entries {
                if let cel::common::ast::EntryExpr::StructField(f) = &entry.expr {
                    walk(&f.value, out);
                }
            }
        }
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn expressions_are_checked_against_the_steps_they_may_read() {
        let cases: [(&str, &str, &[&str], Option<&str>); 6] = [
            (
                "a field of a dependency",
                "steps.detect.result.isSpam",
                &["detect"],
                None,
            ),
            (
                "a dashed name by index",
                "steps['spam-check'].result.score > 0.5",
                &["spam-check"],
                None,
            ),
            (
                "inside a macro",
                "steps.a.result.items.exists(i, i == steps.b.result.x)",
                &["a", "b"],
                None,
            ),
            (
                "a step it does not depend on",
                "steps.other.result.ok",
                &["detect"],
                Some(
                    "names step \"other\", which this step does not depend on (it depends on: detect)",
                ),
            ),
            (
                "no dependencies at all",
                "steps.a.result",
                &[],
                Some("it depends on: none"),
            ),
            (
                "not CEL",
                "steps.a.result ==",
                &["a"],
                Some("does not parse as CEL"),
            ),
        ];
        for (name, expr, known, want) in cases {
            let got = check(expr, known);
            match want {
                None => assert_eq!(got, Ok(()), "{name}"),
                Some(w) => {
                    let e = got.expect_err(name);
                    assert!(e.contains(w), "{name}: {e}");
                }
            }
        }
    }

    #[test]
    fn expressions_evaluate_over_results_and_say_why_they_cannot() {
        let spam = json!({"isSpam": true, "score": 0.9});
        let inputs = [
            Input {
                name: "detect",
                phase: "Succeeded",
                result: Some(&spam),
            },
            Input {
                name: "skipped",
                phase: "Skipped",
                result: None,
            },
        ];
        let cases: [(&str, Result<bool, &str>); 7] = [
            ("steps.detect.result.isSpam", Ok(true)),
            ("!steps.detect.result.isSpam", Ok(false)),
            (
                "steps.detect.result.score > 0.5 && steps.skipped.phase == 'Skipped'",
                Ok(true),
            ),
            ("has(steps.skipped.result)", Ok(false)),
            ("steps.detect.result.missing", Err("CEL error")),
            (
                "steps.detect.result.score",
                Err("evaluated to the double 0.9, not to a bool"),
            ),
            ("steps.skipped.result.x", Err("CEL error")),
        ];
        for (expr, want) in cases {
            let got = evaluate(expr, &inputs);
            match want {
                Ok(b) => assert_eq!(got, Ok(b), "{expr}"),
                Err(w) => {
                    let e = got.expect_err(expr);
                    assert!(e.contains(w), "{expr}: {e}");
                }
            }
        }
    }
}
