//! A step's `when`: a CEL expression over the results of the steps it
//! depends on, evaluated with the CEL implementation the CRD rules use
//! (kube's `cel` feature links it), within a cost budget ([`super::cel`],
//! D22). The expression sees one variable, `steps`, a map from each
//! dependency's name to `{"result": …, "phase": "Succeeded" | "Skipped"}`; a
//! skipped step has no `result`.
//!
//! Refused before the run starts (D13): an expression that does not parse,
//! builds a message, or names a step it does not depend on. A failure to
//! evaluate (a missing field, a wrong type, a value that is not a bool, a
//! spent budget) is returned with its reason: the step fails with it, never
//! skips silently.

use std::collections::BTreeMap;

use cel::Value;
use cel::common::ast::{Expr, IdedExpr, LiteralValue};
use serde_json::Value as Json;

use super::cel::{self as bounded, Limits};

/// What the expression is told about one step it depends on.
pub struct Input<'a> {
    pub name: &'a str,
    pub phase: &'a str,
    pub result: Option<&'a Json>,
}

/// Parses `when` and checks that it names only the steps in `known`.
pub fn check(when: &str, known: &[&str]) -> Result<(), String> {
    let expr = bounded::compile(when)?;
    for name in referenced_steps(expr.expression()) {
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

/// Evaluates `when` against the steps it depends on, within `limits`.
pub fn evaluate(when: &str, inputs: &[Input], limits: &Limits) -> Result<bool, String> {
    let expr = bounded::compile(when)?;
    let bind = |context: &mut cel::Context| {
        context
            .add_variable("steps", variables(inputs))
            .map_err(|e| format!("cannot pass the results to CEL: {e}"))
    };
    match bounded::evaluate(&expr, bind, limits) {
        Ok(Value::Bool(b)) => Ok(b),
        Ok(other) => Err(format!("evaluated to {}, not to a bool", describe(&other))),
        Err(e) => Err(e.to_string()),
    }
}

fn variables(inputs: &[Input]) -> BTreeMap<String, Json> {
    let mut steps: BTreeMap<String, Json> = BTreeMap::new();
    for i in inputs {
        let mut fields = serde_json::Map::new();
        fields.insert("phase".into(), Json::String(i.phase.to_owned()));
        if let Some(r) = i.result {
            fields.insert("result".into(), r.clone());
        }
        steps.insert(i.name.to_owned(), Json::Object(fields));
    }
    steps
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
    bounded::visit(e, &mut |x| match &x.expr {
        Expr::Select(s) if is_steps(&s.operand) => out.push(s.field.clone()),
        Expr::Call(c) if c.func_name == "_[_]" => {
            if let [operand, key] = c.args.as_slice()
                && is_steps(operand)
                && let Expr::Literal(LiteralValue::String(name)) = &key.expr
            {
                out.push(name.to_string());
            }
        }
        _ => {}
    });
    out.sort();
    out.dedup();
    out
}

fn is_steps(e: &IdedExpr) -> bool {
    matches!(&e.expr, Expr::Ident(n) if n == "steps")
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
            let got = evaluate(expr, &inputs, &Limits::default());
            match want {
                Ok(b) => assert_eq!(got, Ok(b), "{expr}"),
                Err(w) => {
                    let e = got.expect_err(expr);
                    assert!(e.contains(w), "{expr}: {e}");
                }
            }
        }
    }

    /// Ten nested loops over ten numbers: 10^10 iterations unbounded, minutes
    /// of a worker. Metered, it stops once its budget is spent.
    const RUNAWAY: &str = "[0,1,2,3,4,5,6,7,8,9].all(a, [0,1,2,3,4,5,6,7,8,9].all(b, \
        [0,1,2,3,4,5,6,7,8,9].all(c, [0,1,2,3,4,5,6,7,8,9].all(d, \
        [0,1,2,3,4,5,6,7,8,9].all(e, [0,1,2,3,4,5,6,7,8,9].all(f, \
        [0,1,2,3,4,5,6,7,8,9].all(g, [0,1,2,3,4,5,6,7,8,9].all(h, \
        [0,1,2,3,4,5,6,7,8,9].all(i, [0,1,2,3,4,5,6,7,8,9].all(j, \
        a + b + c + d + e + f + g + h + i + j >= 0))))))))))";

    #[test]
    fn a_runaway_expression_stops_at_its_budget() {
        let limits = Limits {
            cost: 10_000,
            interrupt: None,
        };
        let e = evaluate(RUNAWAY, &[], &limits).unwrap_err();
        assert_eq!(
            e,
            "exceeds the cost budget of 10000 an expression may spend; it was stopped (simplify it: fewer nested loops over the results)"
        );
        // The same expression with the default budget also stops (it is the
        // budget, not the small limit, that ends it).
        let e = evaluate(RUNAWAY, &[], &Limits::default()).unwrap_err();
        assert!(e.starts_with("exceeds the cost budget of 1000000"), "{e}");
    }

    #[test]
    fn an_absorbed_error_does_not_hide_a_spent_budget() {
        // `||` absorbs an error when its other side is true: the budget error
        // of the left side must still end the evaluation.
        let expr = format!(
            "({}) || true",
            RUNAWAY.replace(".all(", ".exists(").replace(">= 0", "< 0")
        );
        let limits = Limits {
            cost: 5_000,
            interrupt: None,
        };
        let e = evaluate(&expr, &[], &limits).unwrap_err();
        assert!(e.starts_with("exceeds the cost budget of 5000"), "{e}");
    }

    #[test]
    fn a_raised_interrupt_stops_the_evaluation() {
        let interrupt = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let limits = Limits {
            cost: u64::MAX,
            interrupt: Some(interrupt),
        };
        assert_eq!(
            evaluate(RUNAWAY, &[], &limits),
            Err("was stopped at its evaluation deadline".to_owned())
        );
    }

    #[test]
    fn operations_pay_for_the_size_of_what_they_touch() {
        // A list of 2,000 numbers from a result: one `in` touches all of them.
        let items: Vec<u32> = (0..2000).collect();
        let result = json!({ "items": items });
        let inputs = [Input {
            name: "a",
            phase: "Succeeded",
            result: Some(&result),
        }];
        let spent = |expr: &str| {
            let compiled = bounded::compile(expr).unwrap();
            bounded::cost(&compiled, |c| {
                c.add_variable("steps", variables(&inputs))
                    .map_err(|e| e.to_string())
            })
        };
        let one = spent("1999 in steps.a.result.items");
        assert!((2000..2100).contains(&one), "{one}");
        // Each of the 2,000 iterations touches the whole list again.
        let nested = spent("steps.a.result.items.all(x, x in steps.a.result.items)");
        assert!(nested > 4_000_000, "{nested}");
        assert!(
            evaluate(
                "steps.a.result.items.all(x, x in steps.a.result.items)",
                &inputs,
                &Limits::default()
            )
            .unwrap_err()
            .starts_with("exceeds the cost budget")
        );
        // What `when` is for stays far inside the budget.
        let typical =
            spent("steps.a.result.items.exists(x, x == 1999) && size(steps.a.result.items) > 10");
        assert!(typical < 50_000, "{typical}");
    }

    #[test]
    fn what_cannot_be_evaluated_is_refused_when_checked() {
        let cases: [(&str, &str); 3] = [
            ("Foo{}", "builds a message (Foo{…}), which is not supported"),
            (
                "steps.a.result.x == google.protobuf.Int64Value{value: 1}",
                "builds a message",
            ),
            (
                "__agentrun_loop(1, true)",
                "calls __agentrun_loop, which is reserved",
            ),
        ];
        for (expr, want) in cases {
            let e = check(expr, &["a"]).unwrap_err();
            assert!(e.contains(want), "{expr}: {e}");
            // And never reaches the interpreter, whose message support panics.
            let e = evaluate(expr, &[], &Limits::default()).unwrap_err();
            assert!(e.contains(want), "{expr}: {e}");
        }
    }
}
