//! The chart's admission policies and people's roles (templates/admission-policies.yaml,
//! templates/roles.yaml), rendered by helm for one test namespace and applied to the
//! plane, for the tests that need the API server to enforce who may decide.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::chart::{CHART, helm_cmd, ok};
use crate::support::scenario::sim_step;
use crate::{KubectlOutput, kubectl, kubectl_ok, repo_root};

/// The chart's policies and people's roles, installed for one namespace:
/// deleted again when dropped, also when the test panics.
pub struct Policies {
    file: PathBuf,
    pub release: String,
}

impl Policies {
    /// Renders the policies for release `agentrun-operator-<suffix>` with a
    /// namespace selector matching only `namespace`, applies them and waits
    /// until the API server enforces all four.
    pub async fn install(namespace: &str, extra: &[&str]) -> Policies {
        let suffix = namespace.rsplit('-').next().expect("namespace suffix");
        let release = format!("agentrun-operator-{suffix}");
        let selector = json!({"matchLabels": {"kubernetes.io/metadata.name": namespace}});
        let yaml = ok(helm_cmd()
            .current_dir(repo_root())
            .args(["template", &release, CHART, "--namespace", namespace])
            .args(["--show-only", "templates/admission-policies.yaml"])
            .args(["--show-only", "templates/roles.yaml"])
            .arg("--set")
            .arg(format!("roles.prefix={release}"))
            .arg("--set-json")
            .arg(format!("admissionPolicies.namespaceSelector={selector}"))
            .args(extra));
        let file = manifests_dir().join(format!("policies-{release}.yaml"));
        std::fs::write(&file, yaml).expect("writing the rendered policies");
        let p = Policies { file, release };
        kubectl_ok(["apply", "--server-side", "-f", p.path()]).await;
        p
    }

    /// The policies for `namespace`, with `users` holding the release's
    /// approver role there (whom only each approval's own policy tells
    /// apart), enforced.
    pub async fn with_approvers(namespace: &str, users: &[&str]) -> Policies {
        let p = Policies::install(namespace, &[]).await;
        let role = format!("--clusterrole={}-approver", p.release);
        let mut args = vec!["-n", namespace, "create", "rolebinding", "approvers", &role];
        let users: Vec<String> = users.iter().map(|u| format!("--user={u}")).collect();
        args.extend(users.iter().map(String::as_str));
        kubectl_ok(args).await;
        wait_enforced(namespace, true).await;
        p
    }

    /// RBAC in `namespace`: `users` may create and read AgentRuns there.
    pub async fn grant_authors(&self, namespace: &str, users: &[&str]) {
        kubectl_ok([
            "-n",
            namespace,
            "create",
            "role",
            "authors",
            "--verb=create,get,list,watch",
            "--resource=agentruns.agentrun.dev",
        ])
        .await;
        self.bind(namespace, "authors", "--role=authors", users)
            .await;
    }

    /// Binds the release's people's role `<release>-<role>` (`approver`,
    /// `signaler`, `viewer`) in `namespace` to `subjects`, kubectl's own
    /// flags (`--user=ci-bot`, `--serviceaccount=ns:sa`, `--group=g`).
    pub async fn grant_role(&self, namespace: &str, role: &str, subjects: &[&str]) {
        let cluster_role = format!("--clusterrole={}-{role}", self.release);
        self.bind(namespace, &format!("{role}s"), &cluster_role, subjects)
            .await;
    }

    async fn bind(&self, namespace: &str, name: &str, role: &str, subjects: &[&str]) {
        let users: Vec<String> = subjects
            .iter()
            .map(|s| {
                if s.starts_with("--") {
                    (*s).to_owned()
                } else {
                    format!("--user={s}")
                }
            })
            .collect();
        let mut args = vec!["-n", namespace, "create", "rolebinding", name, role];
        args.extend(users.iter().map(String::as_str));
        kubectl_ok(args).await;
    }

    fn path(&self) -> &str {
        self.file.to_str().expect("utf-8 path")
    }

    /// The username of the release's operator ServiceAccount.
    pub fn operator(&self, namespace: &str) -> String {
        format!("system:serviceaccount:{namespace}:{}", self.release)
    }
}

impl Drop for Policies {
    fn drop(&mut self) {
        let _ = std::process::Command::new(crate::support::kubectl::kubectl_binary())
            .arg("--kubeconfig")
            .arg(crate::kubeconfig())
            .args(["delete", "--ignore-not-found", "-f"])
            .arg(&self.file)
            .output();
    }
}

/// kubectl as `user` in `groups` (impersonation, `--as`, `--as-group`), in
/// namespace `ns`: RBAC and the admission policies see exactly that user.
pub async fn kubectl_as(user: &str, groups: &[&str], ns: &str, args: &[&str]) -> KubectlOutput {
    let mut all = vec!["--as".to_owned(), user.to_owned()];
    for g in groups {
        all.push("--as-group".into());
        all.push((*g).to_owned());
    }
    all.extend(["-n".to_owned(), ns.to_owned()]);
    all.extend(args.iter().map(|a| (*a).to_owned()));
    kubectl(all).await
}

/// Panics unless `out` is a refusal whose message says `want`.
pub fn assert_refused(out: &KubectlOutput, want: &str) {
    assert!(
        !out.success(),
        "expected a refusal saying {want:?}; got {out:?}"
    );
    assert!(
        out.stderr.contains(want),
        "the refusal does not say {want:?}:\n{}",
        out.stderr
    );
}

/// Panics unless `out` succeeded; `what` says what should have been admitted.
pub fn assert_admitted(out: &KubectlOutput, what: &str) {
    assert!(out.success(), "{what} was refused:\n{}", out.stderr);
}

/// Where the files given to `kubectl -f` are written: one directory under
/// target/, not its top.
fn manifests_dir() -> std::path::PathBuf {
    let dir = repo_root().join("target/e2e-manifests");
    std::fs::create_dir_all(&dir).expect("creating target/e2e-manifests");
    dir
}

/// Writes `doc` to a file under target/e2e-manifests and returns its path,
/// for `kubectl -f`.
pub fn manifest(name: &str, doc: &Value) -> String {
    let path = manifests_dir().join(format!("{name}.json"));
    std::fs::write(&path, doc.to_string()).expect("writing a manifest");
    path.to_string_lossy().into_owned()
}

pub fn run_doc(name: &str, steps: Vec<Value>, extra_spec: Value) -> Value {
    let mut spec = json!({"steps": steps});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra_spec.as_object()) {
        s.extend(e.clone());
    }
    json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name},
        "spec": spec,
    })
}

/// Waits until the policies are enforced: a dry-run create with a forged
/// creator is refused, and a dry-run create without one gets it stamped.
pub async fn wait_enforced(ns: &str, mutating: bool) {
    let probe = |annotated: bool| {
        let mut doc = run_doc(
            "policy-probe",
            vec![sim_step("a", "Idempotent", json!({}))],
            json!({}),
        );
        if annotated {
            doc["metadata"]["annotations"] =
                json!({agentrun_operator::labels::REQUESTED_BY: "nobody"});
        }
        manifest(&format!("probe-{ns}-{annotated}"), &doc)
    };
    let (forged, plain) = (probe(true), probe(false));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let refused = kubectl(["-n", ns, "create", "--dry-run=server", "-f", &forged]).await;
        let stamped = kubectl([
            "-n",
            ns,
            "create",
            "--dry-run=server",
            "-f",
            &plain,
            "-o",
            "jsonpath={.metadata.annotations}",
        ])
        .await;
        if !refused.success()
            && (!mutating
                || stamped
                    .stdout
                    .contains(agentrun_operator::labels::REQUESTED_BY))
        {
            // The Approval policies are read by the same informers; give
            // them the same second.
            tokio::time::sleep(Duration::from_secs(1)).await;
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the admission policies are not enforced after 30 s: {refused:?} {stamped:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits until the step Pod fence of `ns` is enforced: once its Lease has a
/// holder, a dry-run create of a step Pod that names another creator is
/// refused. Call it after the leader is elected.
pub async fn wait_fenced(ns: &str) {
    wait_refused(ns, "nobody-holds-this").await
}

/// Waits until the API server's fence refuses a step Pod created by
/// `creator` in `ns`: after the Lease moved away from `creator`, once the
/// fence's view of the Lease (the API server's own informer) has caught up.
pub async fn wait_refused(ns: &str, creator: &str) {
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "fence-probe",
            "annotations": {agentrun_operator::labels::LEADER: creator},
        },
        "spec": {"containers": [{"name": "c", "image": "registry.example/probe:1"}]},
    });
    let file = manifest(&format!("fence-probe-{ns}-{creator}"), &pod);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = kubectl(["-n", ns, "create", "--dry-run=server", "-f", &file]).await;
        if !out.success()
            && out
                .stderr
                .contains(agentrun_operator::labels::NOT_THE_LEADER)
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the step Pod fence does not refuse a Pod created by {creator} after 30 s \
             (the API server's view of the Lease is stale or the policy finds no params): {out:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The label that puts a test namespace under the plane's step Pod fence.
pub const FENCED: &str = "e2e.agentrun.dev/fenced";

/// Puts `namespace` under the chart's step Pod fence (templates/leader-fence.yaml):
/// the API server refuses a step Pod whose creator (`agentrun.dev/leader`)
/// does not hold the Lease `agentrun-operator` of the Pod's own namespace,
/// where the tests' operators elect their leader. Enforced once [`wait_fenced`]
/// returns.
///
/// The policy is installed once for the whole plane and never deleted: after
/// some cycles of creating and deleting such a policy (a `paramKind` Lease)
/// within one kube-apiserver's life, a new one was seen to find no params
/// (and so, with `parameterNotFoundAction: Allow`, to refuse nothing) until the
/// API server restarted. Its binding selects the namespaces labelled [`FENCED`]
/// and looks the Lease up in the namespace of each Pod (no `paramRef.namespace`).
pub async fn fence_namespace(namespace: &str) {
    let rendered = ok(helm_cmd()
        .current_dir(repo_root())
        .args([
            "template",
            "agentrun-e2e-fence",
            CHART,
            "--namespace",
            "default",
        ])
        .args(["--show-only", "templates/leader-fence.yaml"])
        .args(["--set", "leaderElection.leaseName=agentrun-operator"])
        .arg("--set-json")
        .arg(format!(
            "admissionPolicies.namespaceSelector={}",
            json!({"matchLabels": {FENCED: "true"}})
        )));
    let mut items = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&rendered) {
        let mut v: Value = serde::Deserialize::deserialize(doc).expect("the rendered fence");
        if v.is_null() {
            continue;
        }
        if let Some(param_ref) = v
            .pointer_mut("/spec/paramRef")
            .and_then(Value::as_object_mut)
        {
            param_ref.remove("namespace");
        }
        items.push(v);
    }
    assert_eq!(items.len(), 2, "the fence is a policy and its binding");
    let file = manifest(
        "plane-fence",
        &json!({"apiVersion": "v1", "kind": "List", "items": items}),
    );
    kubectl_ok(["apply", "--server-side", "-f", &file]).await;
    kubectl_ok([
        "label",
        "namespace",
        namespace,
        &format!("{FENCED}=true"),
        "--overwrite",
    ])
    .await;
}
