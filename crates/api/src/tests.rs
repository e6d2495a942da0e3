//! The CEL rules on the types, evaluated without an apiserver (kube's `cel`
//! feature). The same rules are proven against the real apiserver in
//! `e2e/tests/api_admission.rs`.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kube::core::cel::{Validator, validate_cel, validate_cel_update};
use serde_json::{Value, json};

use super::*;

fn run(spec: Value) -> AgentRun {
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": "refund-4711", "namespace": "support"},
        "spec": spec,
    }))
    .expect("test spec deserializes")
}

fn approval(kind: &str, decision: Option<&str>) -> Approval {
    let mut spec = json!({
        "runName": "refund-4711", "runUid": "0b7c6a1e-0000-4000-8000-000000000001",
        "step": "issue-refund", "planRevision": 1, "kind": kind, "question": "Refund 23.90 EUR?",
    });
    if let Some(d) = decision {
        spec["decision"] = json!(d);
    }
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
        "metadata": {"name": "refund-4711-issue-refund-r1", "namespace": "support"},
        "spec": spec,
    }))
    .expect("test approval deserializes")
}

fn step(name: &str) -> Value {
    json!({"name": name, "container": {"image": "ghcr.io/example/agent:1"}})
}

fn messages(result: Result<(), kube::core::cel::ValidationErrors>) -> String {
    match result {
        Ok(()) => String::new(),
        Err(e) => format!("{e:?}"),
    }
}

#[test]
fn valid_runs_pass_the_rules() {
    let cases = [
        ("one step", json!({"steps": [step("lookup")]})),
        ("planner only", json!({"planner": step("plan")})),
        (
            "backoff within bounds",
            json!({"steps": [{"name": "pay", "container": {"image": "x"},
                "retry": {"limit": 3, "backoff": {"initial": "5s", "max": "1m"}}}]}),
        ),
    ];
    for (name, spec) in cases {
        assert_eq!(messages(validate_cel(&run(spec))), "", "{name}");
    }
}

#[test]
fn invalid_runs_are_refused_with_a_message_naming_the_field() {
    let cases = [
        (
            "no steps and no planner",
            json!({"steps": []}),
            "at least one step is required",
        ),
        (
            "steps omitted and no planner",
            json!({}),
            "at least one step is required",
        ),
        (
            "two steps of one name",
            json!({"steps": [step("fetch"), step("summarize"), step("fetch")]}),
            "step names must be unique",
        ),
        (
            "a signal's senders naming nobody",
            json!({"steps": [{"name": "settle", "wait": {"signal": {"senders": {}}}}]}),
            "wait.signal.senders: name at least one user, group or serviceAccount",
        ),
        (
            "backoff initial longer than max",
            json!({"steps": [{"name": "pay", "container": {"image": "x"},
                "retry": {"backoff": {"initial": "10m", "max": "1m"}}}]}),
            "backoff.initial must not be longer than backoff.max",
        ),
    ];
    for (name, spec, expected) in cases {
        let got = messages(validate_cel(&run(spec)));
        assert!(
            got.contains(expected),
            "{name}: expected {expected:?} in {got:?}"
        );
    }
}

#[test]
fn approval_decisions_must_match_the_kind() {
    let cases = [
        ("Approve", "Approved", true),
        ("Approve", "Rejected", true),
        ("Approve", "Retry", false),
        ("Reconcile", "Retry", true),
        ("Reconcile", "MarkSucceeded", true),
        ("Reconcile", "MarkFailed", true),
        ("Reconcile", "Approved", false),
    ];
    for (kind, decision, ok) in cases {
        let got = messages(validate_cel(&approval(kind, Some(decision))));
        assert_eq!(got.is_empty(), ok, "{kind}/{decision}: {got}");
        if !ok {
            assert!(
                got.contains("an Approve approval takes Approved or Rejected"),
                "{got}"
            );
        }
    }
}

#[test]
fn a_decision_is_final_once_made() {
    let pending = approval("Approve", None);
    let approved = approval("Approve", Some("Approved"));
    let rejected = approval("Approve", Some("Rejected"));
    assert_eq!(
        messages(validate_cel_update(&approved, &pending)),
        "",
        "deciding is allowed"
    );
    assert_eq!(
        messages(validate_cel_update(&approved, &approved)),
        "",
        "no-op update is allowed"
    );
    let changed = messages(validate_cel_update(&rejected, &approved));
    assert!(changed.contains("a decision is final"), "{changed}");
    let removed = messages(validate_cel_update(&pending, &approved));
    assert!(removed.contains("a decision is final"), "{removed}");
}

#[test]
fn approval_identity_is_immutable() {
    let old = approval("Approve", None);
    let mut moved = old.clone();
    moved.spec.run_uid = "another-uid".into();
    let got = messages(validate_cel_update(&moved, &old));
    assert!(got.contains("spec.runUid is immutable"), "{got}");

    // What decides an expiry is fixed when the approval is requested.
    let mut flipped = old.clone();
    flipped.spec.on_timeout = OnTimeout::Approve;
    let got = messages(validate_cel_update(&flipped, &old));
    assert!(got.contains("spec.onTimeout is immutable"), "{got}");
}

/// Separation of duties survives a patch that removes the field: a rule on
/// the optional field alone would not run, and removal would turn it off.
#[test]
fn separation_from_the_requester_cannot_be_removed_or_added() {
    let mut separated = approval("Approve", None);
    separated.spec.separate_from_requester = true;
    separated.spec.requested_by = Some("dave".into());
    let mut removed = separated.clone();
    removed.spec.separate_from_requester = false;
    assert_eq!(
        serde_json::to_value(&removed.spec)
            .unwrap()
            .get("separateFromRequester"),
        None,
        "false is written as an absent field"
    );
    let got = messages(validate_cel_update(&removed, &separated));
    assert!(
        got.contains("spec.separateFromRequester is immutable"),
        "{got}"
    );
    let got = messages(validate_cel_update(&separated, &removed));
    assert!(
        got.contains("spec.separateFromRequester is immutable"),
        "{got}"
    );
    assert_eq!(messages(validate_cel_update(&separated, &separated)), "");
}

/// Who may send a signal is fixed when the run begins to wait: the senders
/// and the separation cannot be changed, added or removed (a removal is a
/// patch a rule on the optional field alone would not see).
#[test]
fn a_signals_senders_and_separation_cannot_be_changed_or_removed() {
    let opened: Signal = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Signal",
        "metadata": {"name": "order-settle-r1-signal", "namespace": "support"},
        "spec": {
            "runName": "order", "runUid": "0b7c6a1e-0000-4000-8000-000000000001",
            "step": "settle", "planRevision": 1, "requestedBy": "dave",
            "senders": {"users": ["ci-bot"]}, "separateFromRequester": true,
        },
    }))
    .expect("test signal deserializes");
    type Edit = fn(&mut SignalSpec);
    let edits: [(&str, Edit, &str); 4] = [
        (
            "senders removed",
            |s| s.senders = None,
            "spec.senders is immutable",
        ),
        (
            "a sender added",
            |s| s.senders.as_mut().unwrap().users.push("mallory".into()),
            "spec.senders is immutable",
        ),
        (
            "separation removed",
            |s| s.separate_from_requester = false,
            "spec.separateFromRequester is immutable",
        ),
        (
            "senders and separation removed at once",
            |s| {
                s.senders = None;
                s.separate_from_requester = false;
            },
            "spec.separateFromRequester is immutable",
        ),
    ];
    for (what, edit, want) in edits {
        let mut edited = opened.clone();
        edit(&mut edited.spec);
        let got = messages(validate_cel_update(&edited, &opened));
        assert!(got.contains(want), "{what}: {got}");
        let got = messages(validate_cel_update(&opened, &edited));
        assert!(got.contains(want), "{what}, the other way: {got}");
    }
    let mut sent = opened.clone();
    sent.spec.id = Some("pay-1".into());
    sent.spec.sent_by = Some("ci-bot".into());
    assert_eq!(messages(validate_cel_update(&sent, &opened)), "");
}

#[test]
fn zero_durations_are_refused_where_they_make_no_sense() {
    for field in ["freshFor", "timeout"] {
        let mut s = step("lookup");
        s[field] = json!("0s");
        let got = messages(validate_cel(&run(json!({"steps": [s]}))));
        assert!(
            got.contains(&format!("{field} must be longer than 0s")),
            "{field}: {got}"
        );
    }
}

#[test]
fn a_planner_plan_is_checked_by_the_step_schema() {
    // The engine validates planner output with the same schema and rules.
    let crd = AgentRun::crd();
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    let step_schema =
        &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["steps"]["items"];
    let bad = json!({"name": "pay", "container": {"image": "x"},
        "retry": {"backoff": {"initial": "10m", "max": "1m"}}});
    let got = messages(Validator::new().validate(step_schema, &bad, None));
    assert!(got.contains("backoff.initial"), "{got}");
}

#[test]
fn crds_are_namespaced_with_status_and_short_names() {
    for (crd, short) in [(AgentRun::crd(), "ar"), (Approval::crd(), "apv")] {
        assert_eq!(crd.spec.scope, "Namespaced");
        assert_eq!(
            crd.spec.names.short_names.as_deref(),
            Some(&[short.to_string()][..])
        );
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["agentrun-all".to_string()][..])
        );
        let version = &crd.spec.versions[0];
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
    }
}

/// Every cached run keeps its plan: what most steps leave out is boxed, so
/// a step costs about a third of its unboxed room (904 bytes).
#[test]
fn a_step_spec_is_small() {
    use std::mem::size_of;
    assert!(size_of::<StepSpec>() <= 344, "{}", size_of::<StepSpec>());
    assert!(
        size_of::<StepContainer>() <= 176,
        "{}",
        size_of::<StepContainer>()
    );
}

/// Every run is cached, and copied while it is reconciled: its optional
/// parts most runs leave out (the planner, context, Pod defaults, the fork's
/// source and origin, the template it came from, the earlier run it already
/// ran as) are boxed, so an
/// absent one costs a pointer, not its room (a run was 1,968 bytes inline).
#[test]
fn an_agentrun_is_small() {
    use std::mem::size_of;
    assert!(size_of::<AgentRun>() <= 952, "{}", size_of::<AgentRun>());
    assert!(
        size_of::<AgentRunSpec>() <= 136,
        "{}",
        size_of::<AgentRunSpec>()
    );
}

/// `kubectl explain` shows each field's own description: none is the Go
/// documentation of the Kubernetes type it is made of ("Time is a wrapper
/// around time.Time …"), which says nothing about the field.
#[test]
fn every_field_says_what_it_is_not_what_its_type_is() {
    fn walk(schema: &Value, path: &str, found: &mut Vec<String>) {
        match schema {
            Value::Object(map) => {
                let description = map.get("description").and_then(Value::as_str);
                if description.is_some_and(|d| {
                    d.starts_with("Time is a wrapper") || d.starts_with("MicroTime is version")
                }) {
                    found.push(path.to_string());
                }
                for (k, v) in map {
                    let next = match k.as_str() {
                        "properties" | "items" => path.to_string(),
                        _ => format!("{path}.{k}"),
                    };
                    walk(v, &next, found);
                }
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, path, found)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    for crd in crds() {
        let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
        walk(&schema, &crd.spec.names.kind, &mut found);
    }
    assert!(found.is_empty(), "described by their type: {found:?}");
}

/// Every list of a CRD: its path (`.spec.steps`, `[]` for the items of a
/// list) and its `x-kubernetes-list-type` with the map keys, `None` where
/// the schema leaves it to the default (atomic).
fn list_types(crd: &CustomResourceDefinition) -> Vec<(String, Option<String>)> {
    fn walk(schema: &Value, path: &str, out: &mut Vec<(String, Option<String>)>) {
        if schema["type"] == "array" {
            let kind = schema["x-kubernetes-list-type"].as_str().map(|t| {
                match schema["x-kubernetes-list-map-keys"].as_array() {
                    Some(keys) => format!("{t} {}", Value::Array(keys.clone())),
                    None => t.to_owned(),
                }
            });
            out.push((path.to_owned(), kind));
            walk(&schema["items"], &format!("{path}[]"), out);
        }
        if let Some(properties) = schema["properties"].as_object() {
            for (name, property) in properties {
                walk(property, &format!("{path}.{name}"), out);
            }
        }
    }
    let mut out = Vec::new();
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    walk(&schema["openAPIV3Schema"], "", &mut out);
    out
}

/// The plan and the operator's own records are atomic lists, said so in
/// the CRD: one field each to the field manager (which every status write
/// pays for per item otherwise), one owner under server-side apply.
#[test]
fn the_plan_and_the_checkpoints_are_atomic_lists() {
    let types = list_types(&AgentRun::crd());
    for path in [
        ".spec.steps",
        ".status.steps",
        ".status.compensations",
        ".status.plan.steps",
        ".status.plan.stepNames",
        ".status.plan.rerun",
        ".status.specDigests",
        ".status.forkedFrom.inherited",
    ] {
        let found = types.iter().find(|(p, _)| p == path);
        assert_eq!(
            found.map(|(_, t)| t.as_deref()),
            Some(Some("atomic")),
            "{path}"
        );
    }
}

/// The only list-maps are the conditions (keyed by `type`, what
/// kstatus-style readers and a second writer's apply of one condition
/// expect) and an Approval's deliveries (keyed by `id`: the notifier applies
/// one delivery at a time beside the engine's fields).
#[test]
fn the_only_list_maps_are_conditions_and_deliveries() {
    let maps: Vec<(String, String)> = crds()
        .iter()
        .flat_map(|crd| {
            list_types(crd)
                .into_iter()
                .filter(|(_, t)| t.as_deref().is_some_and(|t| t.starts_with("map")))
                .map(|(p, t)| (format!("{} {p}", crd.spec.names.kind), t.unwrap()))
        })
        .collect();
    assert_eq!(
        maps,
        [
            (
                "AgentRun .status.conditions".to_owned(),
                r#"map ["type"]"#.to_owned()
            ),
            (
                "Approval .status.conditions".to_owned(),
                r#"map ["type"]"#.to_owned()
            ),
            (
                "Approval .status.notifications".to_owned(),
                r#"map ["id"]"#.to_owned()
            ),
        ]
    );
}
