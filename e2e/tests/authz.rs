//! A run grants nothing its author does not hold (D17), and what the operator
//! wrote on an Approval stays as written (D15), as the API server enforces
//! them with the chart's policies (templates/admission-policies.yaml). Every
//! person acts through kubectl with impersonation (`--as`), so RBAC and the
//! policies see exactly them; each rule is shown both ways: the user without
//! the right is refused, with a message naming the permission, and the user
//! who holds it is admitted.
//!
//! ```text
//!   frank  may create and patch runs, nothing else        ──▶ refused
//!   gina   may also get secrets/db-password, configmaps/app-config,
//!          impersonate serviceaccounts/deployer, use priorityclasses/high ──▶ admitted
//!   erin   may create pods in the namespace               ──▶ admitted
//! ```
//!
//! The Approval half lives in `authz/approvals.rs`, the plugin's quorum
//! vote path in `authz/votes.rs`, step Pods' labels, annotations,
//! nodeSelector and tolerations in `authz/pod_metadata.rs`, the status of
//! Approvals and Signals in `authz/status.rs`, RunRecords (only the operator
//! writes them, D22) in `authz/records.rs`. Needs the plane and
//! `e2e/cluster tools`; fails, never skips, without them.

#[path = "authz/approvals.rs"]
mod approvals;
#[path = "authz/planner.rs"]
mod planner;
#[path = "authz/pod_metadata.rs"]
mod pod_metadata;
#[path = "authz/records.rs"]
mod records;
#[path = "authz/status.rs"]
mod status;
#[path = "authz/votes.rs"]
mod votes;

use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, manifest, run_doc, wait_enforced,
};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_operator::api::RunPhase;
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// Cluster-scoped grants (a PriorityClass is not namespaced) for one test,
/// deleted when dropped, also when the test panics.
struct ClusterGrant(String);

impl ClusterGrant {
    async fn use_priority_class(ns: &str, user: &str, class: &str) -> ClusterGrant {
        let name = format!("authz-{ns}");
        let role = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": [{"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"],
                       "resourceNames": [class], "verbs": ["use"]}],
        });
        let binding = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        });
        let list = json!({"apiVersion": "v1", "kind": "List", "items": [role, binding]});
        kubectl_ok(["apply", "-f", &manifest(&name, &list)]).await;
        ClusterGrant(name)
    }
}

impl Drop for ClusterGrant {
    fn drop(&mut self) {
        let _ = std::process::Command::new(agentrun_e2e::support::kubectl::kubectl_binary())
            .arg("--kubeconfig")
            .arg(agentrun_e2e::kubeconfig())
            .args([
                "delete",
                "--ignore-not-found",
                "clusterrole,clusterrolebinding",
            ])
            .arg(&self.0)
            .output();
    }
}

/// RBAC in `ns`: frank, gina and erin author runs; gina holds exactly the
/// objects the table names (by resourceNames); erin may create Pods.
async fn grant_authors(ns: &str) -> ClusterGrant {
    let role = |name: &str, rules: Value| {
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": name, "namespace": ns}, "rules": rules})
    };
    let binding = |name: &str, users: &[&str]| {
        let subjects: Vec<Value> = users
            .iter()
            .map(|u| json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": u}))
            .collect();
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name, "namespace": ns},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": subjects})
    };
    let items = vec![
        role(
            "authors",
            json!([{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"],
                    "verbs": ["create", "get", "list", "watch", "patch", "update"]}]),
        ),
        binding("authors", &["frank", "gina", "erin"]),
        role(
            "holder",
            json!([
                {"apiGroups": [""], "resources": ["secrets"],
                 "resourceNames": ["db-password", "registry-cred"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["configmaps"],
                 "resourceNames": ["app-config"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["serviceaccounts"],
                 "resourceNames": ["deployer"], "verbs": ["impersonate"]},
            ]),
        ),
        binding("holder", &["gina"]),
        role(
            "pod-creators",
            json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]),
        ),
        binding("pod-creators", &["erin"]),
    ];
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    kubectl_ok(["apply", "-f", &manifest(&format!("authors-{ns}"), &list)]).await;
    kubectl_ok(["-n", ns, "create", "serviceaccount", "deployer"]).await;
    ClusterGrant::use_priority_class(ns, "gina", "high").await
}

/// A step whose container (`part` "container") or whose compensation or
/// verify container (`part` "compensate", "verify") carries `extra`.
fn step_with(name: &str, part: &str, extra: Value) -> Value {
    let mut s = sim_step(name, "Idempotent", json!({}));
    if part != "container" {
        s[part] = json!({"image": "registry.example/agent-step:1"});
    }
    if let (Some(c), Some(e)) = (s[part].as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    s
}

fn secret_env(secret: &str) -> Value {
    json!({"env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}]})
}

/// One reference a run can make the operator use, and the permission it needs.
struct Reference {
    what: &'static str,
    spec: Value,
    /// What the refusal of a user without it says, after "frank may not ".
    refused: String,
}

fn references(ns: &str) -> Vec<Reference> {
    let because = |run: &str, perm: &str| {
        format!(
            " in run {run}: that needs permission to create pods in namespace {ns}, or to {perm}"
        )
    };
    let secret = |run: &str| {
        format!(
            "use Secret db-password{}",
            because(run, "get secrets/db-password")
        )
    };
    let config = |run: &str| {
        format!(
            "use ConfigMap app-config{}",
            because(run, "get configmaps/app-config")
        )
    };
    let steps = |s: Value| json!({"steps": [s]});
    vec![
        Reference {
            what: "env-secret",
            spec: steps(step_with("a", "container", secret_env("db-password"))),
            refused: secret("env-secret"),
        },
        Reference {
            what: "envfrom-secret",
            spec: steps(step_with(
                "a",
                "container",
                json!({"envFrom": [{"secretRef": {"name": "db-password"}}]}),
            )),
            refused: secret("envfrom-secret"),
        },
        Reference {
            what: "pull-secret",
            spec: json!({"steps": [sim_step("a", "None", json!({}))],
                         "podTemplate": {"imagePullSecrets": [{"name": "registry-cred"}]}}),
            refused: format!(
                "use Secret registry-cred{}",
                because("pull-secret", "get secrets/registry-cred")
            ),
        },
        Reference {
            what: "env-configmap",
            spec: steps(step_with(
                "a",
                "container",
                json!({"env": [{"name": "MODE",
                "valueFrom": {"configMapKeyRef": {"name": "app-config", "key": "mode"}}}]}),
            )),
            refused: config("env-configmap"),
        },
        Reference {
            what: "envfrom-configmap",
            spec: steps(step_with(
                "a",
                "container",
                json!({"envFrom": [{"configMapRef": {"name": "app-config"}}]}),
            )),
            refused: config("envfrom-configmap"),
        },
        Reference {
            what: "service-account",
            spec: json!({"steps": [sim_step("a", "None", json!({}))],
                         "podTemplate": {"serviceAccountName": "deployer"}}),
            refused: format!(
                "run steps as ServiceAccount deployer{}",
                because("service-account", "impersonate serviceaccounts/deployer")
            ),
        },
        Reference {
            what: "priority-class",
            spec: json!({"steps": [sim_step("a", "None", json!({}))],
                         "podTemplate": {"priorityClassName": "high"}}),
            refused: format!(
                "use PriorityClass high{}",
                because(
                    "priority-class",
                    "use priorityclasses.scheduling.k8s.io/high"
                )
            ),
        },
        Reference {
            what: "compensation",
            spec: steps(step_with("a", "compensate", secret_env("db-password"))),
            refused: secret("compensation"),
        },
        Reference {
            what: "verify",
            spec: steps(step_with("a", "verify", secret_env("db-password"))),
            refused: secret("verify"),
        },
        Reference {
            what: "planner",
            spec: json!({"planner": step_with("plan", "container", secret_env("db-password"))}),
            refused: secret("planner"),
        },
        Reference {
            what: "compactor",
            spec: json!({"steps": [sim_step("a", "None", json!({}))],
                         "context": {"compactor": {"image": "registry.example/compact:1",
                                                   "envFrom": [{"secretRef": {"name": "db-password"}}]}}}),
            refused: secret("compactor"),
        },
    ]
}

async fn create_as(user: &str, ns: &str, name: &str, spec: &Value) -> agentrun_e2e::KubectlOutput {
    let mut doc = run_doc(name, vec![], json!({}));
    doc["spec"] = spec.clone();
    let file = manifest(&format!("{name}-{user}-{ns}"), &doc);
    kubectl_as(user, &[], ns, &["create", "-f", &file]).await
}

/// Every way a run reaches a Secret, ConfigMap, ServiceAccount, image pull
/// secret or PriorityClass through the operator's Pods is checked with the
/// rights of the user who creates it: frank (runs only) is refused, naming
/// the permission he lacks; gina (who holds exactly those objects) and erin
/// (who may create Pods) are admitted. Holding one Secret is not holding
/// another, and the default ServiceAccount needs nothing.
#[tokio::test]
async fn a_run_names_only_what_its_author_may_use() {
    let s = Scenario::start_without_operator("authz-references").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    let _cluster = grant_authors(&ns).await;
    wait_enforced(&ns, true).await;

    for r in references(&ns) {
        let out = create_as("frank", &ns, r.what, &r.spec).await;
        assert_refused(&out, &format!("frank may not {}", r.refused));
        for user in ["gina", "erin"] {
            let name = format!("{}-{user}", r.what);
            assert_admitted(
                &create_as(user, &ns, &name, &r.spec).await,
                &format!("{} by {user}", r.what),
            );
        }
    }
    // gina holds db-password, not every Secret.
    let other = json!({"steps": [step_with("a", "container", secret_env("other-secret"))]});
    assert_refused(
        &create_as("gina", &ns, "other-secret", &other).await,
        &format!(
            "gina may not use Secret other-secret in run other-secret: that needs permission to create pods in namespace {ns}, or to get secrets/other-secret"
        ),
    );
    let plain = json!({"steps": [sim_step("a", "None", json!({}))],
                       "podTemplate": {"serviceAccountName": "default"}});
    assert_admitted(
        &create_as("frank", &ns, "plain", &plain).await,
        "the default ServiceAccount",
    );
    // A wait step has no container: the policy still reads every other
    // step's, with and without a wait beside them.
    let waits = json!({"steps": [{"name": "hold", "wait": {"for": "1m"}},
                                 sim_step("a", "None", json!({}))]});
    assert_admitted(
        &create_as("frank", &ns, "waits", &waits).await,
        "a wait step and a plain step",
    );
    let waits_secret = json!({"steps": [{"name": "hold", "wait": {"for": "1m"}},
                                        step_with("a", "container", secret_env("db-password"))]});
    assert_refused(
        &create_as("frank", &ns, "waits-secret", &waits_secret).await,
        "frank may not use Secret db-password in run waits-secret",
    );
    // One authorization check per name: past 8 names of a kind, only a user
    // who may create Pods names them.
    let many: Vec<Value> = (0..9)
        .map(|i| json!({"secretRef": {"name": format!("s{i}")}}))
        .collect();
    let many = json!({"steps": [step_with("a", "container", json!({"envFrom": many}))]});
    assert_refused(
        &create_as("gina", &ns, "many-secrets", &many).await,
        "gina may not use 9 Secrets in run many-secrets",
    );
    assert_admitted(
        &create_as("erin", &ns, "many-secrets", &many).await,
        "9 Secrets by erin",
    );
    drop(p);
    s.finish().await;
}

/// An update that changes what a step will run is checked against the user
/// who makes it, not the creator: erin's run runs as ServiceAccount deployer;
/// frank, who may only patch runs, cannot change its next step's image or
/// add a Secret to it (and suspending it, which changes no step, he may);
/// gina, who may use deployer, may. The operator never starts frank's image:
/// the step that ran after the approval runs erin's.
#[tokio::test]
async fn an_update_is_checked_against_the_user_who_makes_it() {
    let s = Scenario::start("authz-update").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    let _cluster = grant_authors(&ns).await;
    let approver = format!("--clusterrole={}-approver", p.release);
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "approvers",
        &approver,
        "--user=alice",
    ])
    .await;
    wait_enforced(&ns, true).await;

    let mut deploy = sim_step("deploy", "Idempotent", json!({}));
    deploy["approval"] = json!({"approvers": {"users": ["alice"]}});
    let spec = json!({
        "steps": [sim_step("build", "None", json!({})), deploy],
        "podTemplate": {"serviceAccountName": "deployer"},
    });
    assert_admitted(
        &create_as("erin", &ns, "release", &spec).await,
        "erin's run",
    );
    let apv = s.approval_of("release", Some("deploy"), RUN_TIMEOUT).await;

    let evil_image =
        json!([{"op": "replace", "path": "/spec/steps/1/container/image", "value": "registry.example/evil:1"}])
            .to_string();
    let add_secret = json!([{"op": "add", "path": "/spec/steps/1/container/env/-",
        "value": {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "t"}}}}])
    .to_string();
    let sa_refusal = format!(
        "frank may not run steps as ServiceAccount deployer in run release: that needs permission to create pods in namespace {ns}, or to impersonate serviceaccounts/deployer"
    );
    for patch in [&evil_image, &add_secret] {
        let out = kubectl_as(
            "frank",
            &[],
            &ns,
            &["patch", "ar", "release", "--type", "json", "-p", patch],
        )
        .await;
        assert_refused(&out, &sa_refusal);
    }
    for suspend in [true, false] {
        let body = json!({"spec": {"suspend": suspend}}).to_string();
        let out = kubectl_as(
            "frank",
            &[],
            &ns,
            &["patch", "ar", "release", "--type", "merge", "-p", &body],
        )
        .await;
        assert_admitted(&out, "suspend/resume, which change no step");
    }
    for patch in [&evil_image, &add_secret] {
        let out = kubectl_as(
            "gina",
            &[],
            &ns,
            &[
                "patch",
                "ar",
                "release",
                "--type",
                "json",
                "-p",
                patch,
                "--dry-run=server",
            ],
        )
        .await;
        assert_admitted(&out, "gina's change (she may use deployer and db-password)");
    }

    let out = kubectl_as(
        "alice",
        &[],
        &ns,
        &[
            "patch",
            "apv",
            &apv,
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"decision":"Approved"}}"#,
        ],
    )
    .await;
    assert_admitted(&out, "alice's approval");
    let done = s.wait_finished("release", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let images: Vec<String> = s
        .list_pods()
        .await
        .iter()
        .flat_map(|p| p.spec.iter().flat_map(|s| s.containers.iter()))
        .filter_map(|c| c.image.clone())
        .collect();
    assert_eq!(
        images,
        [
            "registry.example/agent-step:1",
            "registry.example/agent-step:1"
        ],
        "both steps ran erin's image, none frank's"
    );
    drop(p);
    s.finish().await;
}

/// Without the mutating policies (`admissionPolicies.mutating=false`) the
/// chart still enforces separation of duties, for the steps a planner
/// proposes too: `helm template` renders no MutatingAdmissionPolicy, a run
/// without its creator annotation is refused, and the creator of a run
/// whose planner proposed a step with `separateFromRequester` may not
/// approve it; another approver may.
#[tokio::test]
async fn without_the_mutating_policies_separation_holds_for_a_planners_steps() {
    use agentrun_e2e::support::chart::{of_kind, render};
    let off = ["--set", "admissionPolicies.mutating=false"];
    let docs = render("agentrun-operator", "agentrun-system", &off);
    assert!(of_kind(&docs, "MutatingAdmissionPolicy").is_empty());
    assert_eq!(
        of_kind(&docs, "ValidatingAdmissionPolicy").len(),
        6,
        "approvals, runs, signals, records, journals and the fence"
    );

    let s = Scenario::start("authz-no-mutating").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &off).await;
    let approver = format!("--clusterrole={}-approver", p.release);
    for args in [
        vec![
            "create",
            "role",
            "authors",
            "--verb=create,get",
            "--resource=agentruns.agentrun.dev",
        ],
        vec![
            "create",
            "rolebinding",
            "authors",
            "--role=authors",
            "--user=dave",
        ],
        vec![
            "create",
            "rolebinding",
            "approvers",
            &approver,
            "--user=dave",
            "--user=alice",
        ],
    ] {
        let mut all = vec!["-n", ns.as_str()];
        all.extend(args);
        kubectl_ok(all).await;
    }
    wait_enforced(&ns, false).await;

    let mut pay = sim_step("pay", "NonIdempotent", json!({}));
    pay["approval"] =
        json!({"approvers": {"users": ["dave", "alice"]}, "separateFromRequester": true});
    // The planner proposes `pay` from the catalog the author declared (D17):
    // its gate, separation included, is the author's.
    let planner = sim_step("plan", "None", json!({"plan": [{"name": "pay"}]}));
    let mut run = run_doc("planned", vec![pay], json!({"planner": planner}));
    let unsigned = manifest(&format!("planned-unsigned-{ns}"), &run);
    assert_refused(
        &kubectl_as("dave", &[], &ns, &["create", "-f", &unsigned]).await,
        "metadata.annotations[agentrun.dev/requested-by] must be set to the user who creates the run (dave): separation of duties rests on it",
    );
    run["metadata"]["annotations"] = json!({agentrun_operator::labels::REQUESTED_BY: "dave"});
    let signed = manifest(&format!("planned-{ns}"), &run);
    assert_admitted(
        &kubectl_as("dave", &[], &ns, &["create", "-f", &signed]).await,
        "dave's signed run",
    );

    let apv = s.approval_of("planned", Some("pay"), RUN_TIMEOUT).await;
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(
        (
            a.spec.requested_by.as_deref(),
            a.spec.separate_from_requester
        ),
        (Some("dave"), true)
    );
    let decide =
        |user: &str| json!({"spec": {"decision": "Approved", "decidedBy": user}}).to_string();
    assert_refused(
        &kubectl_as(
            "dave",
            &[],
            &ns,
            &[
                "patch",
                "apv",
                &apv,
                "--type",
                "merge",
                "-p",
                &decide("dave"),
            ],
        )
        .await,
        "dave created run planned and may not approve it (separateFromRequester)",
    );
    let pay_pods = s
        .list_pods()
        .await
        .into_iter()
        .filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(agentrun_operator::labels::STEP))
                .map(String::as_str)
                == Some("pay")
        })
        .count();
    assert_eq!(pay_pods, 0, "nothing refused started the step");
    assert_admitted(
        &kubectl_as(
            "alice",
            &[],
            &ns,
            &[
                "patch",
                "apv",
                &apv,
                "--type",
                "merge",
                "-p",
                &decide("alice"),
            ],
        )
        .await,
        "alice's approval",
    );
    let done = s.wait_finished("planned", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded), "{:?}", done.status);
    drop(p);
    s.finish().await;
}
