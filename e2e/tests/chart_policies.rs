//! The chart's admission policies and people's roles as rendered, without a
//! control plane: which release they name, which halves install, which
//! subresources they guard, what the platform's pod metadata allow-list
//! becomes, and which standard roles the people's roles join. What the
//! policies do is proven on the plane (`authz.rs`, `approvers.rs`,
//! `signals.rs`).
//!
//! Needs `e2e/cluster tools` (helm). Fails, never skips, without it.

#![forbid(unsafe_code)]

use agentrun_e2e::support::chart::*;
use serde_json::{Value, json};

/// The admission policies name the release's own ServiceAccount as the
/// operator that may never decide; clusters without MutatingAdmissionPolicy
/// install only the validating half.
#[test]
fn chart_policies_name_the_operator_and_can_leave_out_the_mutating_half() {
    let docs = render("agentrun-operator", "agentrun-system", &[]);
    let approvals = named(
        &docs,
        "ValidatingAdmissionPolicy",
        "agentrun-operator-approvals",
    );
    let text = approvals["spec"]["validations"].to_string();
    assert!(
        text.contains("system:serviceaccount:agentrun-system:agentrun-operator"),
        "{text}"
    );
    assert_eq!(
        of_kind(&docs, "MutatingAdmissionPolicy").len(),
        3,
        "decider, requester and sender"
    );
    let signals = named(
        &docs,
        "ValidatingAdmissionPolicy",
        "agentrun-operator-signals",
    );
    assert!(
        signals["spec"]["validations"]
            .to_string()
            .contains("system:serviceaccount:agentrun-system:agentrun-operator"),
        "only the operator opens a Signal"
    );
    let records = named(
        &docs,
        "ValidatingAdmissionPolicy",
        "agentrun-operator-records",
    );
    assert!(
        records["spec"]["validations"]
            .to_string()
            .contains("system:serviceaccount:agentrun-system:agentrun-operator"),
        "only the operator writes RunRecords"
    );
    assert_eq!(
        records["spec"]["matchConstraints"]["resourceRules"][0]["operations"],
        serde_json::json!(["CREATE", "UPDATE", "DELETE"]),
        "a record deleted makes its run execute again on the next re-sync"
    );

    let validating_only = render(
        "agentrun-operator",
        "agentrun-system",
        &["--set", "admissionPolicies.mutating=false"],
    );
    assert!(of_kind(&validating_only, "MutatingAdmissionPolicy").is_empty());
    assert!(of_kind(&validating_only, "MutatingAdmissionPolicyBinding").is_empty());
    assert_eq!(
        of_kind(&validating_only, "ValidatingAdmissionPolicy").len(),
        6,
        "approvals, runs, signals, records, journals and the fence"
    );

    let none = render(
        "agentrun-operator",
        "agentrun-system",
        &["--set", "admissionPolicies.enabled=false"],
    );
    assert!(of_kind(&none, "ValidatingAdmissionPolicy").is_empty());
    assert!(of_kind(&none, "ValidatingAdmissionPolicyBinding").is_empty());

    // The step Pod fence reads the release's Lease, where the operator elects
    // its leader, and is left out without leader election or on request.
    let fence = named(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "agentrun-operator-step-pods",
    );
    assert_eq!(
        fence["spec"]["paramRef"],
        serde_json::json!({"name": "agentrun-operator", "namespace": "agentrun-system", "parameterNotFoundAction": "Allow"})
    );
    let policy = named(
        &docs,
        "ValidatingAdmissionPolicy",
        "agentrun-operator-step-pods",
    );
    assert_eq!(policy["spec"]["paramKind"]["kind"], "Lease");
    let deployment = named(&docs, "Deployment", "agentrun-operator");
    assert!(
        deployment
            .to_string()
            .contains("--lease-name=agentrun-operator"),
        "the fence and the operator name the same Lease"
    );
    for off in [
        "leaderElection.fencePods=false",
        "leaderElection.enabled=false",
    ] {
        let docs = render("agentrun-operator", "agentrun-system", &["--set", off]);
        assert!(
            !of_kind(&docs, "ValidatingAdmissionPolicy")
                .iter()
                .any(|p| p["metadata"]["name"] == "agentrun-operator-step-pods"),
            "{off}"
        );
    }
}

/// The people's roles aggregate into the standard ones, except sending a
/// signal: it says an event outside happened, so it is bound per namespace
/// to whoever sees the event and is part of no standard role, admin
/// included (docs/security.md, "Who may send a signal").
#[test]
fn chart_roles_aggregate_into_the_standard_ones_but_sending_a_signal_into_none() {
    let docs = render("agentrun-operator", "agentrun-system", &[]);
    let viewer = named(&docs, "ClusterRole", "agentrun-viewer");
    assert_eq!(
        viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"],
        "true"
    );
    let approver = named(&docs, "ClusterRole", "agentrun-approver");
    assert_eq!(
        approver["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"],
        "true"
    );
    assert!(
        approver["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"].is_null(),
        "viewers do not decide"
    );
    let signaler = named(&docs, "ClusterRole", "agentrun-signaler");
    let aggregated: Vec<&String> = signaler["metadata"]["labels"]
        .as_object()
        .expect("labels")
        .keys()
        .filter(|k| k.starts_with("rbac.authorization.k8s.io/aggregate-to-"))
        .collect();
    assert!(aggregated.is_empty(), "{aggregated:?}");
    assert!(
        grants_of(signaler).contains(&grant("agentrun.dev", "signals", "patch", None)),
        "the role itself still sends"
    );
}

/// The status of an Approval or a Signal is the operator's record of what
/// became of it: both policies match the `/status` subresource too, and
/// name the release's operator as the only writer.
#[test]
fn chart_policies_guard_the_status_of_approvals_and_signals() {
    let docs = render("agentrun-operator", "agentrun-system", &[]);
    for (policy, resources) in [
        (
            "agentrun-operator-approvals",
            ["approvals", "approvals/status"],
        ),
        ("agentrun-operator-signals", ["signals", "signals/status"]),
    ] {
        let p = named(&docs, "ValidatingAdmissionPolicy", policy);
        assert_eq!(
            p["spec"]["matchConstraints"]["resourceRules"][0]["resources"],
            json!(resources),
            "{policy}"
        );
        let status_rule = p["spec"]["validations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| {
                v["expression"]
                    .as_str()
                    .unwrap()
                    .contains("request.subResource != 'status'")
            })
            .unwrap_or_else(|| panic!("{policy} has no rule for status writes"));
        assert!(
            status_rule["expression"]
                .as_str()
                .unwrap()
                .contains("system:serviceaccount:agentrun-system:agentrun-operator"),
            "{status_rule}"
        );
    }
}

/// The variable of the runs policy named `name`, as rendered.
fn runs_variable(docs: &[Value], name: &str) -> String {
    let runs = named(docs, "ValidatingAdmissionPolicy", "agentrun-operator-runs");
    runs["spec"]["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no variable {name}"))["expression"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The platform's pod metadata allow-list becomes CEL lists in the runs
/// policy, empty by default (an author without `create pods` sets none);
/// the values schema refuses an entry the policy could not match.
#[test]
fn chart_pod_metadata_allow_list_renders_into_the_runs_policy() {
    let defaults = render("agentrun-operator", "agentrun-system", &[]);
    for field in ["labels", "annotations", "nodeSelector", "tolerations"] {
        assert_eq!(runs_variable(&defaults, &format!("{field}Allowed")), "[]");
    }
    let allowed = json!({
        "labels": ["team", "tier=batch"],
        "annotations": ["example.com/owner"],
        "nodeSelector": ["pool=agents"],
        "tolerations": ["dedicated=agents:NoSchedule", "gpu:NoExecute"],
    });
    let docs = render(
        "agentrun-operator",
        "agentrun-system",
        &[
            "--set-json",
            &format!("admissionPolicies.podMetadata={allowed}"),
        ],
    );
    for (field, want) in [
        ("labels", r#"["team","tier=batch"]"#),
        ("annotations", r#"["example.com/owner"]"#),
        ("nodeSelector", r#"["pool=agents"]"#),
        (
            "tolerations",
            r#"["dedicated=agents:NoSchedule","gpu:NoExecute"]"#,
        ),
    ] {
        assert_eq!(runs_variable(&docs, &format!("{field}Allowed")), want);
    }

    for (set, mentions) in [
        (r#"{"labels": ["=batch"]}"#, "labels"),
        (r#"{"labels": ["tier = batch"]}"#, "labels"),
        (
            r#"{"tolerations": ["dedicated=agents:Sometimes"]}"#,
            "tolerations",
        ),
        (r#"{"tolerations": ["a=b=c"]}"#, "tolerations"),
        (r#"{"affinity": ["zone"]}"#, "affinity"),
    ] {
        let out = output(
            helm_cmd()
                .args(["template", "r", CHART, "--set-json"])
                .arg(format!("admissionPolicies.podMetadata={set}")),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} was accepted");
        assert!(stderr.contains(mentions), "{set}: {stderr}");
    }
}
