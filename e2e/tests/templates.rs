//! AgentRunTemplate on the real control plane (D21, D17): a run submitted
//! from a template with parameters runs with them filled in and records
//! where it came from; a template that puts a parameter where it could
//! change who runs what is refused by the API server; and a run from a
//! template may use only what the person who submits it may use, whoever
//! wrote the template (`--as`, both ways).
//!
//! ```text
//!   admin: kubectl apply AgentRunTemplate refund (orderId integer, tier enum)
//!   kubectl agentrun submit refund -p orderId=4711 ─▶ AgentRun (spec rendered, spec.template) ─▶ Succeeded
//!   template with {{ params.x }} in an image / Secret / gate / ServiceAccount ─▶ refused
//!   frank (runs only) / gina (holds the Secret): submit a template that reads Secret db-password
//! ```

use std::time::Duration;

use agentrun_e2e::support::kubectl::{kubectl, kubectl_ok};
use agentrun_e2e::support::policies::{Policies, manifest, wait_enforced};
use agentrun_e2e::support::processes::kubectl_agentrun;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{PARAM_FORBIDDEN, RunPhase, labels};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(60);

/// Template `name` in `ns` whose run is `run`, with parameters `params`.
fn template(ns: &str, name: &str, params: Value, run: Value) -> String {
    manifest(
        &format!("template-{name}-{ns}"),
        &json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRunTemplate",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"params": params, "run": run},
        }),
    )
}

/// A refund: lookup (its result carries the order id and tier it was
/// given, through SIM_STEP's env value) then refund, gated by a question.
fn refund_template(ns: &str) -> String {
    let mut lookup = sim_step(
        "lookup",
        "None",
        json!({"result": {"order": "ORDER", "tier": "TIER"}}),
    );
    // The parameters go into the env value the simulated step reads.
    let env = lookup["container"]["env"][0]["value"]
        .as_str()
        .unwrap()
        .replace(r#""ORDER""#, "{{ params.orderId }}")
        .replace("TIER", "{{ params.tier }}");
    lookup["container"]["env"][0]["value"] = json!(env);
    lookup["container"]["args"] = json!(["lookup", "--order={{ params.orderId }}"]);
    let mut refund = sim_step(
        "refund",
        "Idempotent",
        json!({"result": {"refunded": true}}),
    );
    refund["dependsOn"] = json!(["lookup"]);
    refund["when"] = json!("steps.lookup.result.tier == {{ params.tier }}");
    template(
        ns,
        "refund",
        json!([
            {"name": "orderId", "type": "integer", "required": true, "description": "the order to refund"},
            {"name": "tier", "enum": ["gold", "silver"], "default": "silver"},
        ]),
        json!({"steps": [lookup, refund]}),
    )
}

#[tokio::test]
async fn a_run_submitted_from_a_template_runs_with_its_parameters() {
    let s = Scenario::start("templates-submit").await;
    let ns = s.namespace().to_owned();
    kubectl_ok(["apply", "-f", &refund_template(&ns)]).await;

    let (code, out) = kubectl_agentrun(
        &ns,
        &[
            "submit",
            "refund",
            "-p",
            "orderId=4711",
            "--name",
            "refund-4711",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("agentrun refund-4711 created from template refund (generation 1) with orderId=4711 tier=\"silver\""),
        "{out}"
    );
    let run = s.wait_finished("refund-4711", TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    // The parameters reached the step, and `when` compared the tier as data.
    let st = status(&run);
    let lookup = st.steps.iter().find(|c| c.name == "lookup").unwrap();
    assert_eq!(
        lookup
            .result
            .as_ref()
            .map(|r| serde_json::to_value(r).unwrap()),
        Some(json!({"order": 4711, "tier": "silver"}))
    );
    assert!(
        st.steps
            .iter()
            .any(|c| c.name == "refund" && c.phase == agentrun_operator::api::StepPhase::Succeeded),
        "the refund ran: {:?}",
        st.steps
    );
    // The run records where it came from, and is labelled with it.
    let t = run.spec.template.as_deref().expect("spec.template");
    assert_eq!((t.name.as_str(), t.generation), ("refund", 1));
    assert_eq!(
        serde_json::to_value(&t.params).unwrap(),
        json!({"orderId": 4711, "tier": "silver"})
    );
    assert_eq!(
        run.metadata.labels.as_ref().unwrap()[labels::TEMPLATE],
        "refund"
    );
    // spec.template is immutable.
    let edit = kubectl([
        "-n",
        &ns,
        "patch",
        "ar",
        "refund-4711",
        "--type=merge",
        "-p",
        r#"{"spec":{"template":{"name":"other"}}}"#,
    ])
    .await;
    assert!(!edit.success(), "{edit:?}");
    assert!(
        edit.stderr.contains("spec.template is immutable"),
        "{}",
        edit.stderr
    );

    // Parameters the template does not take, or of the wrong type, create nothing.
    for (p, want) in [
        ("orderId=x", "\"x\" is not an integer"),
        ("amount=5", "declares no parameter amount"),
    ] {
        let (code, out) = kubectl_agentrun(&ns, &["submit", "refund", "-p", p]).await;
        assert_ne!(code, 0, "{out}");
        assert!(out.contains(want), "{p}: {out}");
    }
    let (code, out) = kubectl_agentrun(
        &ns,
        &["submit", "refund", "-p", "orderId=1", "-p", "tier=bronze"],
    )
    .await;
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains(r#""bronze" is not one of "gold", "silver""#),
        "{out}"
    );
    let runs = kubectl_ok(["-n", &ns, "get", "ar", "-o", "name"]).await;
    assert_eq!(runs.trim(), "agentrun.agentrun.dev/refund-4711", "{runs}");
    s.finish().await;
}

#[tokio::test]
async fn a_template_that_puts_a_parameter_where_it_changes_who_runs_what_is_refused() {
    let s = Scenario::start_without_operator("templates-refused").await;
    let ns = s.namespace().to_owned();
    let params = json!([{"name": "x"}]);
    let step = |extra: Value| {
        let mut st = sim_step("a", "None", json!({}));
        for (k, v) in extra.as_object().unwrap() {
            st[k] = v.clone();
        }
        st
    };
    let cases = [
        (
            "image",
            json!({"steps": [step(json!({"container": {"image": "registry.example/{{ params.x }}:1"}}))]}),
        ),
        (
            "secret",
            json!({"steps": [step(json!({"container": {"image": "a", "env": [{"name": "K",
                "valueFrom": {"secretKeyRef": {"name": "{{ params.x }}", "key": "k"}}}]}}))]}),
        ),
        (
            "gate",
            json!({"steps": [step(json!({"approval": {"required": true,
                "approvers": {"groups": ["{{ params.x }}"]}}}))]}),
        ),
        (
            "serviceaccount",
            json!({"steps": [step(json!({}))], "podTemplate": {"serviceAccountName": "{{ params.x }}"}}),
        ),
    ];
    for (what, run) in cases {
        let out = kubectl(["apply", "-f", &template(&ns, what, params.clone(), run)]).await;
        assert!(!out.success(), "{what}: {out:?}");
        assert!(
            out.stderr.contains(PARAM_FORBIDDEN),
            "{what}: {}",
            out.stderr
        );
    }
    // Two parameters of one name.
    let twice = kubectl([
        "apply",
        "-f",
        &template(
            &ns,
            "twice",
            json!([{"name": "x"}, {"name": "x", "type": "integer"}]),
            json!({"steps": [step(json!({}))]}),
        ),
    ])
    .await;
    assert!(!twice.success(), "{twice:?}");
    assert!(
        twice
            .stderr
            .contains("spec.params: parameter names must be unique"),
        "{}",
        twice.stderr
    );
    // The same placeholders in args, env values, when and a question are fine.
    let fine = json!({"steps": [step(json!({
        "when": "{{ params.x }} == 'y'",
        "approval": {"required": true, "question": "Go on with {{ params.x }}?"},
        "container": {"image": "a", "args": ["{{ params.x }}"], "env": [{"name": "X", "value": "{{ params.x }}"}]},
    }))]});
    kubectl_ok(["apply", "-f", &template(&ns, "fine", params, fine)]).await;
    s.finish().await;
}

#[tokio::test]
async fn a_run_from_a_template_uses_only_what_its_submitter_may_use() {
    let s = Scenario::start_without_operator("templates-authz").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    // frank and gina may read templates and create runs; gina also holds
    // Secret db-password.
    let rbac = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "submitters", "namespace": ns},
         "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"], "verbs": ["create", "get"]},
                   {"apiGroups": ["agentrun.dev"], "resources": ["agentruntemplates"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "submitters", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "submitters"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "frank"},
                      {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "gina"}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "holder", "namespace": ns},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["db-password"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "holder", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "holder"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "gina"}]},
    ]});
    kubectl_ok(["apply", "-f", &manifest(&format!("submitters-{ns}"), &rbac)]).await;
    wait_enforced(&ns, true).await;
    // The template, written by the admin, reads the Secret.
    let mut st = sim_step("migrate", "NonIdempotent", json!({}));
    st["container"]["env"] = json!([
        {"name": "TABLE", "value": "{{ params.table }}"},
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "password"}}},
    ]);
    kubectl_ok([
        "apply",
        "-f",
        &template(
            &ns,
            "migrate",
            json!([{"name": "table", "required": true}]),
            json!({"steps": [st]}),
        ),
    ])
    .await;

    let (code, out) = kubectl_agentrun(
        &ns,
        &[
            "--as",
            "frank",
            "submit",
            "migrate",
            "-p",
            "table=orders",
            "--name",
            "by-frank",
        ],
    )
    .await;
    assert_ne!(code, 0, "frank may not: {out}");
    assert!(
        out.contains("frank may not use Secret db-password in run by-frank"),
        "{out}"
    );
    let (code, out) = kubectl_agentrun(
        &ns,
        &[
            "--as",
            "gina",
            "submit",
            "migrate",
            "-p",
            "table=orders",
            "--name",
            "by-gina",
        ],
    )
    .await;
    assert_eq!(code, 0, "gina holds the Secret: {out}");
    let run = kubectl_ok([
        "-n",
        &ns,
        "get",
        "ar",
        "by-gina",
        "-o",
        "jsonpath={.metadata.annotations}",
    ])
    .await;
    assert!(
        run.contains(&format!(r#""{}":"gina""#, labels::REQUESTED_BY)),
        "the run is gina's: {run}"
    );
    drop(p);
    s.finish().await;
}
