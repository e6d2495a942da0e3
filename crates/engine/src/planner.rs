//! A planner's plan (D17): a proposal, not an author. Its steps are drawn
//! from the catalog the run's author declared (`spec.steps`, admitted with
//! the author's rights); the planner fills names, container args and order.
//!
//! ```text
//!   planner result {"plan": [{"name": "refund-1", "uses": "refund", "args": [...]}]}
//!        │  each entry: the catalog step it uses, renamed, its args and dependsOn set;
//!        ▼  any other field must equal the catalog's, else refused naming it
//!   Vec<StepSpec> ──validate_steps──▶ plan revision 2
//! ```

use serde_json::Value;

use super::plan::validate_steps;
use agentrun_api::{MAX_STEPS, StepSpec};

/// What a planner writes into a plan step; everything else comes from the
/// catalog's step it names (D17).
const PLANNER_FILLS: [&str; 4] = ["name", "uses", "args", "dependsOn"];

/// The planner's `plan` field as steps, drawn from `catalog` (`spec.steps`,
/// the steps the run's author declared) and validated like the spec (D17).
///
/// A planner is a proposal, not an author: each plan step names a catalog
/// step (`uses`, by default its own `name`) and fills only its `name`, its
/// container's `args` and its place in the order (`dependsOn`). The image,
/// env and secrets, effect, approval gate, retries, compensation, verify,
/// `when` and `resultSchema` are the catalog's; a plan step that sets one
/// of them to anything else is refused, naming it.
pub fn parse_planner_plan(
    plan: Option<&Value>,
    catalog: &[StepSpec],
) -> Result<Vec<StepSpec>, String> {
    let Some(plan) = plan else {
        return Err("the planner's termination message has no \"plan\" field".into());
    };
    let Some(entries) = plan.as_array() else {
        return Err("the planner's plan is not a list of steps".into());
    };
    if entries.is_empty() {
        return Err("the planner's plan has no steps".into());
    }
    if entries.len() > MAX_STEPS {
        return Err(format!(
            "plan: {} steps, more than the {MAX_STEPS} a plan may have",
            entries.len()
        ));
    }
    let steps = entries
        .iter()
        .enumerate()
        .map(|(i, e)| from_catalog(e, catalog, &format!("plan[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    validate_steps(&steps, "plan")?;
    Ok(steps)
}

/// One plan step: the catalog step it names, with what the planner fills.
fn from_catalog(entry: &Value, catalog: &[StepSpec], at: &str) -> Result<StepSpec, String> {
    let Some(fields) = entry.as_object() else {
        return Err(format!(
            "{at}: the planner's plan is not a list of steps (a step is an object)"
        ));
    };
    let name = match fields.get("name") {
        Some(Value::String(n)) => n.as_str(),
        _ => {
            return Err(format!(
                "{at}.name: the planner's plan is not a list of steps (every step has a name)"
            ));
        }
    };
    let uses = match fields.get("uses") {
        None => name,
        Some(Value::String(u)) => u.as_str(),
        Some(_) => return Err(format!("{at}.uses: the name of a step of spec.steps")),
    };
    let Some(template) = catalog.iter().find(|s| s.name == uses) else {
        return Err(if catalog.is_empty() {
            format!(
                "{at} ({name}): spec.steps is empty, and a planner may only propose steps the run declares there (its catalog, D17)"
            )
        } else {
            let known: Vec<&str> = catalog.iter().map(|s| s.name.as_str()).collect();
            format!(
                "{at}.uses: {uses:?} is not a step of spec.steps, the catalog a planner draws from ({})",
                known.join(", ")
            )
        });
    };
    let mut step = template.clone();
    step.name = name.to_owned();
    step.depends_on = match fields.get("dependsOn") {
        None | Some(Value::Null) => None,
        Some(d) => Some(
            serde_json::from_value::<Vec<String>>(d.clone())
                .map_err(|e| format!("{at}.dependsOn: a list of step names: {e}"))?
                .into_boxed_slice(),
        ),
    };
    if let Some(args) = fields.get("args") {
        let args: Vec<String> = serde_json::from_value(args.clone())
            .map_err(|e| format!("{at}.args: a list of strings: {e}"))?;
        match step.container.as_mut() {
            Some(c) => c.args = args,
            None => {
                return Err(format!(
                    "{at}.args: catalog step {uses} is a wait; it has no container to take args"
                ));
            }
        }
    }
    // A plan step may repeat what the catalog says (a planner that echoes
    // whole steps), never change it.
    let fixed = serde_json::to_value(&step).unwrap_or_default();
    for (field, value) in fields {
        if PLANNER_FILLS.contains(&field.as_str()) {
            continue;
        }
        if fixed.get(field) != Some(value) {
            return Err(format!(
                "{at}.{field}: step {name} uses catalog step {uses}, whose {field} is the run author's: a planner fills only name, uses, args and dependsOn (D17)"
            ));
        }
    }
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planner_plans_are_validated_like_the_spec() {
        let catalog = || {
            let mut a: StepSpec = serde_json::from_value(serde_json::json!(
                {"name": "a", "container": {"image": "x"}, "timeout": "5 minutes"}))
            .unwrap();
            a.timeout = None;
            vec![a]
        };
        let cases = [
            ("missing", None, "no \"plan\" field"),
            ("empty", Some(serde_json::json!([])), "no steps"),
            (
                "wrong shape",
                Some(serde_json::json!([{"name": 1}])),
                "not a list of steps",
            ),
            (
                "bad name",
                Some(serde_json::json!([{"name": "Bad_Name", "uses": "a"}])),
                "must be a DNS label",
            ),
            (
                "duplicate",
                Some(serde_json::json!([{"name": "a"}, {"name": "a"}])),
                "used twice",
            ),
            (
                "unknown dependency",
                Some(serde_json::json!([{"name": "a", "dependsOn": ["z"]}])),
                "z",
            ),
        ];
        for (name, plan, want) in cases {
            let err = parse_planner_plan(plan.as_ref(), &catalog()).expect_err(name);
            assert!(err.contains(want), "{name}: {err}");
        }
        let ok = serde_json::json!([{"name": "a", "container": {"image": "x"}}]);
        assert_eq!(parse_planner_plan(Some(&ok), &catalog()).unwrap().len(), 1);
    }

    /// D17: the planner fills names, args and order; the author's catalog
    /// fixes what runs and how it is guarded.
    #[test]
    fn a_planner_draws_its_steps_from_the_catalog_and_fills_only_args_and_order() {
        let catalog: Vec<StepSpec> = serde_json::from_value(serde_json::json!([
            {"name": "refund", "effect": "NonIdempotent",
             "container": {"image": "pay:1", "args": ["--amount", "0"],
                           "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "pay", "key": "k"}}}]},
             "approval": {"required": true}},
            {"name": "pause", "wait": {"for": "30s"}},
        ]))
        .unwrap();
        let plan = serde_json::json!([
            {"name": "refund-1", "uses": "refund", "args": ["--amount", "40"]},
            {"name": "pause", "dependsOn": ["refund-1"]},
            {"name": "refund-2", "uses": "refund", "args": ["--amount", "60"], "dependsOn": ["pause"],
             "effect": "NonIdempotent"},
        ]);
        let steps = parse_planner_plan(Some(&plan), &catalog).unwrap();
        assert_eq!(steps.len(), 3);
        let r2 = &steps[2];
        assert_eq!(r2.name, "refund-2");
        assert_eq!(r2.container.as_ref().unwrap().args, ["--amount", "60"]);
        assert_eq!(r2.container.as_ref().unwrap().image, "pay:1");
        assert_eq!(
            r2.container.as_ref().unwrap().env,
            catalog[0].container.as_ref().unwrap().env
        );
        assert_eq!(r2.approval, catalog[0].approval, "the gate stays");
        assert_eq!(r2.depends_on.as_deref(), Some(&["pause".to_owned()][..]));

        let refused = [
            (
                serde_json::json!([{"name": "steal", "container": {"image": "evil:1"}}]),
                "plan[0].uses: \"steal\" is not a step of spec.steps, the catalog a planner draws from (refund, pause)",
            ),
            (
                serde_json::json!([{"name": "refund", "container": {"image": "evil:1"}}]),
                "plan[0].container: step refund uses catalog step refund, whose container is the run author's",
            ),
            (
                serde_json::json!([{"name": "refund", "approval": {"required": false}}]),
                "plan[0].approval: step refund uses catalog step refund",
            ),
            (
                serde_json::json!([{"name": "refund", "effect": "None"}]),
                "plan[0].effect:",
            ),
            (
                serde_json::json!([{"name": "refund", "when": "true"}]),
                "plan[0].when:",
            ),
            (
                serde_json::json!([{"name": "pause", "args": ["x"]}]),
                "plan[0].args: catalog step pause is a wait",
            ),
            (
                serde_json::json!([{"name": "refund", "args": "--all"}]),
                "plan[0].args: a list of strings",
            ),
        ];
        for (plan, want) in refused {
            let err = parse_planner_plan(Some(&plan), &catalog).expect_err(want);
            assert!(err.contains(want), "{err}\nwanted: {want}");
        }
        let err = parse_planner_plan(Some(&serde_json::json!([{"name": "a"}])), &[]).unwrap_err();
        assert!(err.contains("spec.steps is empty"), "{err}");
    }
}
