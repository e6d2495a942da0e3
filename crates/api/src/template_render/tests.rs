use std::collections::BTreeMap;

use kube::core::cel::Validator;
use serde_json::{Value, json};

use super::*;
use crate::{AgentRunTemplate, PARAM_FORBIDDEN};

/// Template `refund` (generation 3): orderId (integer, required), tier
/// (string, gold|silver, default silver), note (string), and `run`.
fn template(run: Value) -> AgentRunTemplate {
    let mut t: AgentRunTemplate = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "AgentRunTemplate",
        "metadata": {"name": "refund", "generation": 3},
        "spec": {
            "params": [
                {"name": "orderId", "type": "integer", "required": true},
                {"name": "tier", "enum": ["gold", "silver"], "default": "silver"},
                {"name": "note"},
                {"name": "limits", "type": "object", "default": {"eur": 50}},
            ],
            "run": run,
        },
    }))
    .unwrap();
    t.metadata.generation = Some(3);
    t
}

fn refund_run() -> Value {
    json!({"steps": [
        {"name": "lookup", "effect": "None",
         "container": {"image": "agent:1", "args": ["lookup", "--order={{ params.orderId }}"],
                       "env": [{"name": "TIER", "value": "{{params.tier}}"},
                               {"name": "LIMITS", "value": "{{ params.limits }}"}]}},
        {"name": "refund", "effect": "NonIdempotent", "dependsOn": ["lookup"],
         "when": "steps.lookup.result.tier == {{ params.tier }}",
         "approval": {"required": true, "question": "Refund order {{ params.orderId }} ({{ params.tier }})?"},
         "container": {"image": "agent:1", "args": ["refund"]}},
    ]})
}

fn given(pairs: &[(&str, Value)]) -> BTreeMap<String, Value> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

#[test]
fn parameters_fill_args_env_questions_as_text_and_when_as_a_literal() {
    let spec = render(&template(refund_run()), &given(&[("orderId", json!(4711))])).unwrap();
    let lookup = spec.steps[0].container.as_ref().unwrap();
    assert_eq!(lookup.args, ["lookup", "--order=4711"]);
    let env: Vec<_> = lookup
        .env
        .iter()
        .map(|e| (e.name.as_str(), e.value.as_deref().unwrap()))
        .collect();
    assert_eq!(env, [("TIER", "silver"), ("LIMITS", r#"{"eur":50}"#)]);
    let refund = &spec.steps[1];
    assert_eq!(
        refund.when.as_deref(),
        Some(r#"steps.lookup.result.tier == "silver""#)
    );
    assert_eq!(
        refund.approval.as_ref().unwrap().question.as_deref(),
        Some("Refund order 4711 (silver)?")
    );
    // The run records where it came from, defaults filled in.
    let t = spec.template.unwrap();
    assert_eq!((t.name.as_str(), t.generation), ("refund", 3));
    assert_eq!(
        serde_json::to_value(&t.params).unwrap(),
        json!({"orderId": 4711, "tier": "silver", "limits": {"eur": 50}})
    );
}

#[test]
fn a_string_parameter_in_when_is_data_never_code() {
    // A value that would end the string and add a clause, were it pasted.
    let mut t = template(refund_run());
    t.spec.params[1].enum_ = None;
    let sly = r#"x" || true || "y"#;
    let spec = render(&t, &given(&[("orderId", json!(1)), ("tier", json!(sly))])).unwrap();
    let when = spec.steps[1].when.as_deref().unwrap();
    assert_eq!(when, r#"steps.lookup.result.tier == "x\" || true || \"y""#);
    // Still one comparison with one string literal: the CEL parser agrees.
    let schema = json!({"type": "object", "properties": {"tier": {"type": "string"}},
        "x-kubernetes-validations": [{"rule": format!("self.tier == {}", &when["steps.lookup.result.tier == ".len()..])}]});
    let ok = Validator::new().validate(&schema, &json!({"tier": sly}), None);
    assert!(ok.is_ok(), "{ok:?}");
    let no = Validator::new().validate(&schema, &json!({"tier": "x"}), None);
    assert!(no.is_err(), "the literal is the whole value, nothing more");
}

#[test]
fn parameters_are_checked_against_what_the_template_declares() {
    let t = template(refund_run());
    let cases = [
        (
            given(&[]),
            "parameter orderId is required and was not given",
        ),
        (
            given(&[("orderId", json!(1)), ("amount", json!(5))]),
            "parameter amount is not declared by the template (it declares: orderId, tier, note, limits)",
        ),
        (
            given(&[("orderId", json!("4711"))]),
            "parameter orderId: \"4711\" is not of type Integer",
        ),
        (
            given(&[("orderId", json!(1)), ("tier", json!("bronze"))]),
            "parameter tier: \"bronze\" is not one of \"gold\", \"silver\"",
        ),
    ];
    for (g, want) in cases {
        assert_eq!(render(&t, &g).unwrap_err().to_string(), want);
    }
    // A placeholder of a declared parameter with no value, and of none.
    let mut run = refund_run();
    run["steps"][0]["container"]["args"] = json!(["{{ params.note }}"]);
    let e = render(&template(run), &given(&[("orderId", json!(1))])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "spec.run.steps[0].container.args[0]: parameter note has no value (not given, no default)"
    );
    let mut run = refund_run();
    run["steps"][0]["container"]["args"] = json!(["{{ params.amount }}", "{{ inputs.x }}"]);
    let e = render(&template(run), &given(&[("orderId", json!(1))])).unwrap_err();
    assert!(
        e.to_string()
            .contains("the template declares no parameter amount"),
        "{e}"
    );
}

#[test]
fn a_parameter_where_it_could_change_who_runs_what_is_refused_naming_where() {
    type Edit = fn(&mut Value);
    let cases: [(&str, Edit); 6] = [
        ("steps[0].container.image", |r| {
            r["steps"][0]["container"]["image"] = json!("agent:{{ params.note }}")
        }),
        ("steps[1].effect", |r| {
            r["steps"][1]["effect"] = json!("{{ params.note }}")
        }),
        ("podTemplate.serviceAccountName", |r| {
            r["podTemplate"] = json!({"serviceAccountName": "{{ params.note }}"})
        }),
        (
            "steps[0].container.env[0].valueFrom.secretKeyRef.name",
            |r| r["steps"][0]["container"]["env"][0] = json!({"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "{{ params.note }}", "key": "k"}}}),
        ),
        ("steps[1].approval.approvers.groups[0]", |r| {
            r["steps"][1]["approval"]["approvers"] = json!({"groups": ["{{ params.note }}"]})
        }),
        ("steps[0].container.command[0]", |r| {
            r["steps"][0]["container"]["command"] = json!(["{{ params.note }}"])
        }),
    ];
    for (path, edit) in cases {
        let mut run = refund_run();
        edit(&mut run);
        let t: Result<AgentRunTemplate, _> = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRunTemplate",
            "metadata": {"name": "refund"},
            "spec": {"params": [
                {"name": "orderId", "type": "integer"}, {"name": "tier"},
                {"name": "note", "default": "x"}, {"name": "limits", "type": "object"},
            ], "run": run},
        }));
        // An effect is an enum: a placeholder there is not even a template.
        let Ok(t) = t else {
            assert_eq!(path, "steps[1].effect");
            continue;
        };
        let e = render(&t, &given(&[])).unwrap_err();
        assert_eq!(
            e,
            RenderError::Placement {
                path: path.into(),
                problem: PARAM_FORBIDDEN.into()
            },
            "{path}"
        );
    }
}

#[test]
fn parse_param_reads_each_type() {
    let p = |t: ParamType| TemplateParam {
        name: "p".into(),
        type_: t,
        ..TemplateParam::default()
    };
    assert_eq!(
        parse_param(&p(ParamType::Integer), " 42").unwrap(),
        json!(42)
    );
    assert_eq!(
        parse_param(&p(ParamType::Boolean), "false").unwrap(),
        json!(false)
    );
    assert_eq!(
        parse_param(&p(ParamType::String), "42").unwrap(),
        json!("42")
    );
    assert_eq!(
        parse_param(&p(ParamType::Object), r#"{"a": [1]}"#).unwrap(),
        json!({"a": [1]})
    );
    for (t, text) in [
        (ParamType::Integer, "4.5"),
        (ParamType::Boolean, "yes"),
        (ParamType::Object, "{"),
    ] {
        assert!(parse_param(&p(t), text).is_err(), "{t:?} {text}");
    }
}

/// The admission guard: the template CRD's own rules refuse a placeholder in
/// an image, a ServiceAccount, a Secret reference or an approval gate, and
/// leave args, env values, when and questions alone.
#[test]
fn the_template_crd_refuses_a_parameter_in_an_image_a_secret_or_a_gate() {
    let crd = AgentRunTemplate::guarded_crd();
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    let spec_schema = &schema["openAPIV3Schema"]["properties"]["spec"];
    let check = |run: Value| {
        let spec = json!({"params": [{"name": "note"}], "run": run});
        match Validator::new().validate(spec_schema, &spec, None) {
            Ok(()) => String::new(),
            Err(e) => format!("{e:?}"),
        }
    };
    assert_eq!(
        check(refund_run()),
        "",
        "args, env values, when and questions"
    );
    let refused = [
        json!({"steps": [{"name": "a", "container": {"image": "agent:{{ params.note }}"}}]}),
        json!({"steps": [{"name": "a", "container": {"image": "a"}, "verify": {"image": "{{ params.note }}"}}]}),
        json!({"steps": [{"name": "a", "container": {"image": "a"}}], "podTemplate": {"serviceAccountName": "{{ params.note }}"}}),
        json!({"steps": [{"name": "a", "container": {"image": "a", "env": [{"name": "K",
            "valueFrom": {"secretKeyRef": {"name": "{{ params.note }}", "key": "k"}}}]}}]}),
        json!({"steps": [{"name": "a", "container": {"image": "a", "envFrom": [{"secretRef": {"name": "{{ params.note }}"}}]}}]}),
        json!({"steps": [{"name": "a", "container": {"image": "a"},
            "approval": {"approvers": {"groups": ["{{ params.note }}"]}}}]}),
    ];
    for run in refused {
        let got = check(run.clone());
        assert!(got.contains("may not be used here"), "{run}: {got:?}");
    }
}
