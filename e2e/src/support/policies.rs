//! The chart's admission policies and people's roles (templates/admission-policies.yaml,
//! templates/roles.yaml), rendered by helm for one test namespace and applied to the
//! plane, for the tests that need the API server to enforce who may decide.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::chart::{CHART, helm_cmd, ok};
use crate::support::scenario::sim_step;
use crate::{kubectl, kubectl_ok, repo_root};

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
        let file = repo_root()
            .join("target")
            .join(format!("policies-{release}.yaml"));
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

/// Writes `doc` to a file under target/ and returns its path, for `kubectl -f`.
pub fn manifest(name: &str, doc: &Value) -> String {
    let path = repo_root().join("target").join(format!("{name}.json"));
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
