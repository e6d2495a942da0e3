//! The operator as a user installs it: its image imported into the real node's
//! containerd, the chart installed with `helm install --wait`, its replicas in Pods on
//! the node, reaching the apiserver through the `kubernetes` Service.
//!
//! ```text
//!   make image ─▶ dist/agentrun-operator-image-VERSION-linux-amd64.tar
//!        └─ e2e/cluster node import ─▶ containerd (k8s.io) ─▶ kubelet
//!   helm install --wait ─▶ Deployment (replicas on the node) ─▶ Lease (one leader)
//!   config/samples ─▶ step Pods on the node ─▶ payments.py on the bridge (the ledger)
//! ```
//!
//! Shared by `tests/incluster.rs` and `tests/upgrade.rs`. Everything here panics, never
//! skips, when the node, the image or the tools are missing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentrun_operator::api::{AgentRun, Approval};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use super::chart::{helm_cmd, ok_async};
use super::env::repo_root;
use super::node::Payments;

/// How long `helm install --wait` and `helm upgrade --wait` may take.
pub const HELM_TIMEOUT: &str = "5m";

/// The operator image tarball `make image` (`release/build image`) writes for this
/// checkout's version, or `$AGENTRUN_OPERATOR_IMAGE_TAR`.
pub fn operator_image_tarball() -> PathBuf {
    if let Some(path) = std::env::var_os("AGENTRUN_OPERATOR_IMAGE_TAR").filter(|v| !v.is_empty()) {
        return PathBuf::from(path);
    }
    repo_root().join(format!(
        "dist/agentrun-operator-image-{}-linux-amd64.tar",
        env!("CARGO_PKG_VERSION")
    ))
}

/// Imports `tarball` into the node's containerd (`e2e/cluster node import`), where the
/// kubelet finds the image without pulling it. Panics when the tarball is missing.
pub async fn import_image(tarball: &Path) {
    assert!(
        tarball.is_file(),
        "no operator image at {}: build it with `make image` (make test does)",
        tarball.display()
    );
    let out = tokio::process::Command::new(repo_root().join("e2e/cluster"))
        .args(["node", "import"])
        .arg(tarball)
        .output()
        .await
        .unwrap_or_else(|e| panic!("running e2e/cluster node import: {e}"));
    assert!(
        out.status.success(),
        "e2e/cluster node import {} failed:\n{}",
        tarball.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Helm release of the operator, uninstalled when dropped (also when the test panics),
/// so that its cluster-wide admission policies never outlive the test.
pub struct Release {
    pub name: String,
    pub namespace: String,
    installed: bool,
}

impl Release {
    /// `agentrun-operator-<suffix of the namespace>`: the chart's full name (every object,
    /// the Lease too, is named exactly this) and unique on the plane.
    pub fn for_namespace(namespace: &str) -> Release {
        let suffix = namespace.rsplit('-').next().expect("a suffixed namespace");
        Release {
            name: format!("agentrun-operator-{suffix}"),
            namespace: namespace.to_owned(),
            installed: false,
        }
    }

    /// Values every install here sets: two replicas, and people's ClusterRoles named
    /// after the release so two releases (or a leftover) never collide.
    pub fn values(&self) -> Vec<String> {
        let suffix = self.name.rsplit('-').next().unwrap_or("x");
        vec![
            "--set".into(),
            "replicaCount=2".into(),
            "--set".into(),
            format!("roles.prefix=agentrun-{suffix}"),
        ]
    }

    /// `helm install <name> <chart> -n <namespace> --wait` with [`Release::values`] and `extra`.
    pub async fn install(&mut self, chart: &Path, extra: &[&str]) -> String {
        let mut cmd = helm_cmd();
        cmd.args(["install", &self.name])
            .arg(chart)
            .args([
                "--namespace",
                &self.namespace,
                "--wait",
                "--timeout",
                HELM_TIMEOUT,
            ])
            .args(self.values())
            .args(extra);
        self.installed = true;
        ok_async(cmd).await
    }

    /// `helm upgrade <name> <chart> -n <namespace> --wait` with the same values.
    pub async fn upgrade(&self, chart: &Path, extra: &[&str]) -> String {
        let mut cmd = helm_cmd();
        cmd.args(["upgrade", &self.name])
            .arg(chart)
            .args([
                "--namespace",
                &self.namespace,
                "--wait",
                "--timeout",
                HELM_TIMEOUT,
            ])
            .args(self.values())
            .args(extra);
        ok_async(cmd).await
    }

    /// `helm uninstall <name> -n <namespace> --wait`.
    pub async fn uninstall(&mut self) -> String {
        self.installed = false;
        let mut cmd = helm_cmd();
        cmd.args(["uninstall", &self.name, "--namespace", &self.namespace])
            .args(["--wait", "--timeout", HELM_TIMEOUT]);
        ok_async(cmd).await
    }

    /// The operator's Pods, as the API server has them now (terminating ones too).
    pub async fn pods(&self, client: &Client) -> Vec<Pod> {
        let selector = format!(
            "app.kubernetes.io/instance={},app.kubernetes.io/component=operator",
            self.name
        );
        Api::<Pod>::namespaced(client.clone(), &self.namespace)
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("listing the operator's Pods")
            .items
    }

    /// Who holds the release's Lease now.
    pub async fn leader(&self, client: &Client) -> Option<String> {
        Api::<Lease>::namespaced(client.clone(), &self.namespace)
            .get_opt(&self.name)
            .await
            .expect("reading the Lease")
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty())
    }

    /// Waits until the Lease names a running, ready operator Pod other than `not`, and
    /// returns its name.
    pub async fn wait_leader(
        &self,
        client: &Client,
        not: Option<&str>,
        timeout: Duration,
    ) -> String {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let holder = self.leader(client).await;
            let pods = self.pods(client).await;
            if let Some(h) = &holder
                && Some(h.as_str()) != not
                && pods.iter().any(|p| &p.name_any() == h && ready(p))
            {
                return h.clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no new leader within {timeout:?}: the Lease names {holder:?}; Pods: {:?}",
                pods.iter()
                    .map(|p| (p.name_any(), ready(p)))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until the Deployment has `replicas` updated, available replicas and no
    /// others (a rollout is over).
    pub async fn wait_rolled_out(&self, client: &Client, replicas: i32, timeout: Duration) {
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &self.namespace);
        super::wait::wait_for(
            &deployments,
            &self.name,
            move |d: Option<&Deployment>| {
                let Some(s) = d.and_then(|d| d.status.as_ref()) else {
                    return false;
                };
                let current = d.and_then(|d| d.metadata.generation) == s.observed_generation;
                current
                    && s.replicas == Some(replicas)
                    && s.updated_replicas == Some(replicas)
                    && s.available_replicas == Some(replicas)
            },
            timeout,
        )
        .await;
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if self.installed {
            let _ = helm_cmd()
                .args(["uninstall", &self.name, "--namespace", &self.namespace])
                .output();
        }
    }
}

pub fn ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What the samples need in `namespace` besides the runs (examples/refund-agent/deploy.yaml
/// without its payments Deployment): the step Pods' ServiceAccount, and the ConfigMap the
/// steps read PAYMENTS_API_URL from, pointing at `payments` on the node's bridge.
pub async fn sample_prerequisites(client: &Client, namespace: &str, payments: &Payments) {
    let sa: ServiceAccount = serde_json::from_value(json!({
        "metadata": {"name": "refund-agent"},
        "automountServiceAccountToken": false,
    }))
    .expect("a ServiceAccount");
    Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap_or_else(|e| panic!("creating ServiceAccount refund-agent: {e}"));
    let cm = serde_json::from_value(json!({
        "metadata": {"name": "refund-agent"},
        "data": {"PAYMENTS_API_URL": payments.url()},
    }))
    .expect("a ConfigMap");
    Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap_or_else(|e| panic!("creating ConfigMap refund-agent: {e}"));
}

/// Every effect the payments service recorded (refunds, payouts, notifications), counted
/// per logical step — (run, step) — by the idempotency key each request carried, looked up
/// in the runs' checkpoints. An effect whose key no checkpoint names counts under
/// `("?", key)`, so it shows up in the comparison instead of being dropped.
pub fn effects_per_step(ledger: &Value, runs: &[AgentRun]) -> BTreeMap<(String, String), usize> {
    let mut owner = BTreeMap::new();
    for run in runs {
        for c in run.status.iter().flat_map(|s| s.steps.iter()) {
            owner.insert(c.idempotency_key.clone(), (run.name_any(), c.name.clone()));
        }
    }
    let mut counts = BTreeMap::new();
    for kind in ["refunds", "payouts", "notifications"] {
        for effect in ledger[kind].as_array().into_iter().flatten() {
            let key = effect["idempotencyKey"].as_str().unwrap_or_default();
            let step = owner
                .get(key)
                .cloned()
                .unwrap_or_else(|| ("?".to_owned(), key.to_owned()));
            *counts.entry(step).or_default() += 1;
        }
    }
    counts
}

/// The `(run, step)` pairs of `literal`, as owned strings.
pub fn steps(literal: &[(&str, &str, usize)]) -> BTreeMap<(String, String), usize> {
    literal
        .iter()
        .map(|(r, s, n)| ((r.to_string(), s.to_string()), *n))
        .collect()
}

/// What an uninstall may leave behind that it should not: finalizers on the runs, their
/// Approvals and Pods in `runs_namespace`, Leases in the release namespace, the
/// release's admission policies and bindings, and Pods (the operator's or the runs').
/// One line per object; empty when clean.
pub async fn leftovers(client: &Client, release: &Release, runs_namespace: &str) -> Vec<String> {
    let mut left = Vec::new();
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), runs_namespace);
    for r in runs
        .list(&ListParams::default())
        .await
        .expect("listing runs")
    {
        left.push(format!(
            "AgentRun {} (finalizers {:?})",
            r.name_any(),
            r.finalizers()
        ));
    }
    let approvals: Api<Approval> = Api::namespaced(client.clone(), runs_namespace);
    for a in approvals
        .list(&ListParams::default())
        .await
        .expect("listing approvals")
    {
        left.push(format!(
            "Approval {} (finalizers {:?})",
            a.name_any(),
            a.finalizers()
        ));
    }
    for ns in [runs_namespace, release.namespace.as_str()] {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        for p in pods
            .list(&ListParams::default())
            .await
            .expect("listing pods")
        {
            left.push(format!(
                "Pod {ns}/{} (finalizers {:?})",
                p.name_any(),
                p.finalizers()
            ));
        }
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), &release.namespace);
    for l in leases
        .list(&ListParams::default())
        .await
        .expect("listing leases")
    {
        left.push(format!("Lease {}/{}", release.namespace, l.name_any()));
    }
    // The chart names every policy and binding after the release.
    for (group_version, plural) in [
        (
            "admissionregistration.k8s.io/v1",
            "validatingadmissionpolicies",
        ),
        (
            "admissionregistration.k8s.io/v1",
            "validatingadmissionpolicybindings",
        ),
        (
            "admissionregistration.k8s.io/v1",
            "mutatingadmissionpolicies",
        ),
        (
            "admissionregistration.k8s.io/v1",
            "mutatingadmissionpolicybindings",
        ),
    ] {
        let (group, version) = group_version.split_once('/').expect("group/version");
        let gvk = kube::api::GroupVersionKind::gvk(group, version, plural);
        let resource = kube::api::ApiResource::from_gvk_with_plural(&gvk, plural);
        let api: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &resource);
        for o in api
            .list(&ListParams::default())
            .await
            .unwrap_or_else(|e| panic!("listing {plural}: {e}"))
            .into_iter()
            .filter(|o| o.name_any().starts_with(&release.name))
        {
            left.push(format!("{plural} {}", o.name_any()));
        }
    }
    left
}

/// docs/install.md, "Uninstalling": delete the runs while the operator runs (it releases
/// its finalizers), `helm uninstall`, then the Lease the operator created (Helm did not).
/// Nothing is left: no run, Approval or Pod with a finalizer, no Lease, no policy of the
/// release, no Pod. The CRDs stay, as Helm leaves them.
pub async fn uninstall_as_documented(client: &Client, release: &mut Release, runs_namespace: &str) {
    crate::kubectl_ok([
        "delete",
        "agentruns",
        "--all",
        "-n",
        runs_namespace,
        "--wait",
        "--timeout=120s",
    ])
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), runs_namespace);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    // The step Pods go with their runs (garbage collection, after their finalizers).
    loop {
        let left = pods
            .list(&ListParams::default().labels("agentrun.dev/run"))
            .await
            .expect("listing step Pods");
        if left.items.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "step Pods outlived their runs: {:?}",
            left.items
                .iter()
                .map(|p| (p.name_any(), p.finalizers().to_vec()))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The probe Pod is the test's own.
    pods.delete("probe", &DeleteParams::default().grace_period(0))
        .await
        .ok();
    release.uninstall().await;
    crate::kubectl_ok([
        "delete",
        "lease",
        &release.name,
        "-n",
        &release.namespace,
        "--ignore-not-found",
    ])
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let left = leftovers(client, release, runs_namespace).await;
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "left after the uninstall: {left:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.get("agentruns.agentrun.dev")
        .await
        .expect("the CRDs stay, as Helm leaves them");
}
