//! Pod metadata is a grant too (D17): the labels, annotations, nodeSelector
//! and tolerations a run puts on its step Pods join Services, match
//! NetworkPolicies and reach dedicated nodes, so an author who may not
//! create Pods sets only what the platform's allow-list in the chart values
//! (`admissionPolicies.podMetadata`) holds. Each rule both ways, as the real
//! user, on create and on an update.
//!
//! ```text
//!   allow-list: labels team, tier=batch; annotation example.com/owner;
//!               nodeSelector pool=agents; toleration dedicated=agents:NoSchedule
//!   frank (runs only)  app: payments, tier=web, prometheus.io/scrape, pool=payments,
//!                      dedicated=payments:NoSchedule, tolerate-all ──▶ refused
//!   frank              what the allow-list holds                  ──▶ admitted
//!   erin (create pods) anything                                   ──▶ admitted
//! ```

use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, wait_enforced,
};
use agentrun_e2e::support::scenario::{Scenario, sim_step};
use serde_json::{Value, json};

use super::{create_as, grant_authors};

const ALLOWED: &str = r#"admissionPolicies.podMetadata={"labels": ["team", "tier=batch"], "annotations": ["example.com/owner"], "nodeSelector": ["pool=agents"], "tolerations": ["dedicated=agents:NoSchedule"]}"#;

fn with_pod(pod: Value) -> Value {
    json!({"steps": [sim_step("a", "None", json!({}))], "podTemplate": pod})
}

/// What frank may not set without `create pods`, and what the refusal says
/// after "spec.podTemplate.<field>: frank may not ".
fn outside(ns: &str) -> Vec<(&'static str, Value, String)> {
    let needs = |run: &str, field: &str, allows: &str| {
        format!(
            " in run {run}: that needs permission to create pods in namespace {ns}, or an entry for it in the chart value admissionPolicies.podMetadata.{field} (it allows: {allows})"
        )
    };
    vec![
        (
            "service-label",
            json!({"labels": {"app": "payments"}}),
            format!(
                "labels: frank may not label step Pods app=payments{}",
                needs("service-label", "labels", "team, tier=batch")
            ),
        ),
        (
            "other-value",
            json!({"labels": {"team": "a", "tier": "web"}}),
            format!(
                "labels: frank may not label step Pods tier=web{}",
                needs("other-value", "labels", "team, tier=batch")
            ),
        ),
        (
            "scrape",
            json!({"annotations": {"prometheus.io/scrape": "true"}}),
            format!(
                "annotations: frank may not annotate step Pods with prometheus.io/scrape{}",
                needs("scrape", "annotations", "example.com/owner")
            ),
        ),
        (
            "node-pool",
            json!({"nodeSelector": {"pool": "payments"}}),
            format!(
                "nodeSelector: frank may not select nodes for step Pods by pool=payments{}",
                needs("node-pool", "nodeSelector", "pool=agents")
            ),
        ),
        (
            "dedicated",
            json!({"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "payments", "effect": "NoSchedule"}]}),
            format!(
                "tolerations: frank may not let step Pods tolerate dedicated=payments:NoSchedule{}",
                needs("dedicated", "tolerations", "dedicated=agents:NoSchedule")
            ),
        ),
        (
            "tolerate-all",
            json!({"tolerations": [{"operator": "Exists"}]}),
            format!(
                "tolerations: frank may not let step Pods tolerate *{}",
                needs("tolerate-all", "tolerations", "dedicated=agents:NoSchedule")
            ),
        ),
    ]
}

#[tokio::test]
async fn pod_metadata_outside_the_platforms_allow_list_needs_the_right_to_create_pods() {
    let s = Scenario::start_without_operator("authz-pod-metadata").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &["--set-json", ALLOWED]).await;
    let _cluster = grant_authors(&ns).await;
    wait_enforced(&ns, true).await;

    for (what, pod, refused) in outside(&ns) {
        let out = create_as("frank", &ns, what, &with_pod(pod.clone())).await;
        assert_refused(&out, &format!("spec.podTemplate.{refused}"));
        assert_admitted(
            &create_as("erin", &ns, what, &with_pod(pod)).await,
            &format!("{what} by erin, who may create pods"),
        );
    }
    let within = with_pod(json!({
        "labels": {"team": "payments", "tier": "batch"},
        "annotations": {"example.com/owner": "frank"},
        "nodeSelector": {"pool": "agents"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "agents",
                         "effect": "NoSchedule"}],
    }));
    assert_admitted(
        &create_as("frank", &ns, "within", &within).await,
        "frank's run within the allow-list",
    );

    // On update, the writer's rights again: frank may not add a label to
    // the run he made, nor change a step of erin's run that carries one;
    // suspending it, which changes no step, he may.
    let add_label =
        json!([{"op": "add", "path": "/spec/podTemplate/labels/app", "value": "payments"}])
            .to_string();
    let out = kubectl_as(
        "frank",
        &[],
        &ns,
        &["patch", "ar", "within", "--type", "json", "-p", &add_label],
    )
    .await;
    assert_refused(
        &out,
        "spec.podTemplate.labels: frank may not label step Pods app=payments in run within",
    );
    let new_image = json!([{"op": "replace", "path": "/spec/steps/0/container/image",
                            "value": "registry.example/agent-step:2"}])
    .to_string();
    let out = kubectl_as(
        "frank",
        &[],
        &ns,
        &[
            "patch",
            "ar",
            "service-label",
            "--type",
            "json",
            "-p",
            &new_image,
        ],
    )
    .await;
    assert_refused(
        &out,
        "spec.podTemplate.labels: frank may not label step Pods app=payments in run service-label",
    );
    let suspend = json!({"spec": {"suspend": true}}).to_string();
    let out = kubectl_as(
        "frank",
        &[],
        &ns,
        &[
            "patch",
            "ar",
            "service-label",
            "--type",
            "merge",
            "-p",
            &suspend,
        ],
    )
    .await;
    assert_admitted(&out, "suspending erin's run, which changes no step");
    drop(p);
    s.finish().await;
}
