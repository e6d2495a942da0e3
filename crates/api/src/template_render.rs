//! A run's spec from a template and the parameters it is given (D21):
//! every declared parameter resolved (given, else its default, else refused
//! when required), checked against its type and `enum`; every
//! `{{ params.<name> }}` replaced — as text in args, env values and approval
//! questions, as a CEL literal in `when` (a string parameter can never
//! become code) — and one anywhere else refused, naming where.
//!
//! ```text
//!   -p orderId=4711 ─▶ parse_param(integer) ─▶ 4711 ┐
//!   defaults ───────────────────────────────────────┼─▶ resolved params ─┐
//!   template.spec.run (JSON) ─▶ walk: placeholder where? ────────────────┴─▶ AgentRunSpec + spec.template
//!        args[*], env[*].value, approval.question : text      when : CEL literal      elsewhere : refused
//! ```

use std::collections::BTreeMap;

use serde_json::Value;

use super::{AgentRunSpec, AgentRunTemplate, ParamType, TemplateParam, TemplateRef};

/// Why a run cannot be created from a template.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RenderError {
    #[error("parameter {0} is not declared by the template (it declares: {1})")]
    Unknown(String, String),
    #[error("parameter {0} is required and was not given")]
    Missing(String),
    #[error("parameter {name}: {problem}")]
    Invalid { name: String, problem: String },
    #[error("spec.run.{path}: {problem}")]
    Placement { path: String, problem: String },
    #[error("the template's run is not a valid run spec: {0}")]
    Spec(String),
}

/// Parses `-p name=value`'s value as the parameter's type: an integer, a
/// boolean (`true`/`false`), JSON for an object, the text for a string.
pub fn parse_param(p: &TemplateParam, text: &str) -> Result<Value, RenderError> {
    let invalid = |problem: String| RenderError::Invalid {
        name: p.name.clone(),
        problem,
    };
    match p.type_ {
        ParamType::String => Ok(Value::String(text.to_owned())),
        ParamType::Integer => text
            .trim()
            .parse::<i64>()
            .map(Value::from)
            .map_err(|_| invalid(format!("{text:?} is not an integer"))),
        ParamType::Boolean => match text.trim() {
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            _ => Err(invalid(format!("{text:?} is not true or false"))),
        },
        ParamType::Object => {
            serde_json::from_str(text).map_err(|e| invalid(format!("{text:?} is not JSON: {e}")))
        }
    }
}

/// Whether `v` is a value of type `t`.
fn has_type(t: ParamType, v: &Value) -> bool {
    match t {
        ParamType::String => v.is_string(),
        ParamType::Integer => v.is_i64(),
        ParamType::Boolean => v.is_boolean(),
        ParamType::Object => true,
    }
}

/// Every declared parameter's value: given, else its default; refused when
/// a required one is missing, one is not declared, or a value does not fit.
fn resolve(
    params: &[TemplateParam],
    given: &BTreeMap<String, Value>,
) -> Result<BTreeMap<String, Value>, RenderError> {
    if let Some(name) = given.keys().find(|n| !params.iter().any(|p| &p.name == *n)) {
        let declared: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
        return Err(RenderError::Unknown(
            name.clone(),
            if declared.is_empty() {
                "none".into()
            } else {
                declared.join(", ")
            },
        ));
    }
    let mut out = BTreeMap::new();
    for p in params {
        // A required parameter is given by whoever starts the run: its
        // default, if the template has one, never applies.
        let fallback = p.default.as_ref().filter(|_| !p.required);
        let Some(v) = given.get(&p.name).or(fallback) else {
            if p.required {
                return Err(RenderError::Missing(p.name.clone()));
            }
            continue;
        };
        let invalid = |problem: String| RenderError::Invalid {
            name: p.name.clone(),
            problem,
        };
        if !has_type(p.type_, v) {
            return Err(invalid(format!("{v} is not of type {:?}", p.type_)));
        }
        if let Some(allowed) = &p.enum_
            && !allowed.contains(v)
        {
            let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
            return Err(invalid(format!("{v} is not one of {}", list.join(", "))));
        }
        out.insert(p.name.clone(), v.clone());
    }
    Ok(out)
}

/// How a placeholder at a path is filled.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// As text: args, env values, approval questions.
    Text,
    /// As a CEL literal: `when`.
    Cel,
}

/// Where a placeholder may stand, by the path's property names (list
/// indexes left out), from `spec.run`.
fn fill_at(path: &[String]) -> Option<Fill> {
    let names: Vec<&str> = path.iter().map(String::as_str).collect();
    // steps[*].<part>… or planner.<part>…
    let rest = match names.split_first() {
        Some((&("steps" | "planner"), rest)) => rest,
        _ => return None,
    };
    let container = |c: &str| matches!(c, "container" | "verify" | "compensate");
    match rest {
        ["when"] => Some(Fill::Cel),
        ["approval", "question"] => Some(Fill::Text),
        [c, "args"] | [c, "env", "value"] if container(c) => Some(Fill::Text),
        _ => None,
    }
}

/// The placeholders in `text`: (byte range, parameter name) each.
fn placeholders(text: &str) -> Result<Vec<(std::ops::Range<usize>, String)>, String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(open) = text[from..].find("{{").map(|i| from + i) {
        let Some(close) = text[open..].find("}}").map(|i| open + i + 2) else {
            return Err(format!("an unclosed {{{{ at byte {open}"));
        };
        let inner = text[open + 2..close - 2].trim();
        let Some(name) = inner.strip_prefix("params.") else {
            return Err(format!(
                "{{{{ {inner} }}}}: only {{{{ params.<name> }}}} may stand between braces"
            ));
        };
        out.push((open..close, name.to_owned()));
        from = close;
    }
    Ok(out)
}

/// A value as text (a string as it is; anything else as compact JSON).
fn as_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Calls `each` with every string under `v` that holds a placeholder, where
/// it may stand (`None`: nowhere) and its path as shown in errors.
fn strings(
    v: &mut Value,
    path: &mut Vec<String>,
    shown: &mut Vec<String>,
    each: &mut impl FnMut(&mut String, Option<Fill>, String) -> Result<(), RenderError>,
) -> Result<(), RenderError> {
    match v {
        Value::String(s) if s.contains("{{") => each(s, fill_at(path), shown.join("")),
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                shown.push(format!("[{i}]"));
                let r = strings(item, path, shown, each);
                shown.pop();
                r?;
            }
            Ok(())
        }
        Value::Object(map) => {
            for (k, item) in map.iter_mut() {
                path.push(k.clone());
                shown.push(if shown.is_empty() {
                    k.clone()
                } else {
                    format!(".{k}")
                });
                let r = strings(item, path, shown, each);
                shown.pop();
                path.pop();
                r?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Every placeholder stands where one may, names a declared parameter, and
/// is well formed — whatever the parameters given: a template that breaks
/// this is refused before any value is looked at.
fn check(run: &mut Value, declared: &[TemplateParam]) -> Result<(), RenderError> {
    strings(
        run,
        &mut Vec::new(),
        &mut Vec::new(),
        &mut |s, how, path| {
            let placement = |problem: String| RenderError::Placement {
                path: path.clone(),
                problem,
            };
            if how.is_none() {
                return Err(placement(super::PARAM_FORBIDDEN.to_owned()));
            }
            for (_, name) in placeholders(s).map_err(placement)? {
                if !declared.iter().any(|p| p.name == name) {
                    return Err(placement(format!(
                        "{{{{ params.{name} }}}}: the template declares no parameter {name}"
                    )));
                }
            }
            Ok(())
        },
    )
}

/// Fills every placeholder (after [`check`]): as text, or in `when` as a
/// CEL literal.
fn fill(run: &mut Value, params: &BTreeMap<String, Value>) -> Result<(), RenderError> {
    strings(
        run,
        &mut Vec::new(),
        &mut Vec::new(),
        &mut |s, how, path| {
            let found = placeholders(s).map_err(|problem| RenderError::Placement {
                path: path.clone(),
                problem,
            })?;
            let mut out = String::with_capacity(s.len());
            let mut at = 0;
            for (range, name) in found {
                out.push_str(&s[at..range.start]);
                let Some(value) = params.get(&name) else {
                    return Err(RenderError::Placement {
                        path,
                        problem: format!("parameter {name} has no value (not given, no default)"),
                    });
                };
                match how {
                    // JSON is a CEL literal: a string is quoted and escaped, so
                    // a parameter is data in `when`, never code.
                    Some(Fill::Cel) => out.push_str(&value.to_string()),
                    _ => out.push_str(&as_text(value)),
                }
                at = range.end;
            }
            out.push_str(&s[at..]);
            *s = out;
            Ok(())
        },
    )
}

/// The spec of a run created from `template` with `given` parameters:
/// the template's run with every placeholder filled, and `spec.template`
/// recording the template, its generation and the parameters.
pub fn render(
    template: &AgentRunTemplate,
    given: &BTreeMap<String, Value>,
) -> Result<AgentRunSpec, RenderError> {
    let declared = &template.spec.params;
    let mut run =
        serde_json::to_value(&template.spec.run).map_err(|e| RenderError::Spec(e.to_string()))?;
    check(&mut run, declared)?;
    let params = resolve(declared, given)?;
    fill(&mut run, &params)?;
    let mut spec: AgentRunSpec =
        serde_json::from_value(run).map_err(|e| RenderError::Spec(e.to_string()))?;
    spec.template = Some(Box::new(TemplateRef {
        name: template.metadata.name.clone().unwrap_or_default(),
        generation: template.metadata.generation.unwrap_or_default(),
        params,
    }));
    Ok(spec)
}

#[cfg(test)]
mod tests;
