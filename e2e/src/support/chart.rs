//! What the chart and install tests share: the permissions the operator
//! needs (one line per grant, with the reason), the tools (helm, kubectl)
//! and the chart rendered as JSON documents.
//!
//! ```text
//!   OPERATOR_RULES, lease_rules (below) ══ rendered ClusterRole/Role ══ config/rbac
//! ```
//!
//! Needs `e2e/cluster tools` (kubectl, helm); panics, never skips, when they
//! are missing.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output};

use crate::support::kubectl::kubectl_binary;
use crate::{kubeconfig, repo_root};
use serde_json::Value;

pub const CHART: &str = "charts/agentrun-operator";
pub const GENERATED_CRDS: &str = "crds/agentrun.dev_crds.yaml";

/// Every permission the operator needs outside leader election, one line per
/// (API group, resource) with the reason. The chart and config/rbac must grant
/// exactly these: nothing missing, nothing more.
pub const OPERATOR_RULES: &[(&str, &str, &[&str])] = &[
    // watch runs; re-read after a status conflict; delete finished runs (TTL, D12)
    (
        "agentrun.dev",
        "agentruns",
        &["get", "list", "watch", "delete"],
    ),
    // resourceVersion-guarded JSON patch of the status (checkpoints, D3/D4)
    ("agentrun.dev", "agentruns/status", &["patch"]),
    // blockOwnerDeletion on step Pods under OwnerReferencesPermissionEnforcement
    ("agentrun.dev", "agentruns/finalizers", &["update"]),
    // watch; read back on AlreadyExists; open approvals; the notifier's finalizer
    (
        "agentrun.dev",
        "approvals",
        &["get", "list", "watch", "create", "patch"],
    ),
    // Approved / Rejected / Expired phase by server-side apply
    ("agentrun.dev", "approvals/status", &["patch"]),
    // watch; read back on AlreadyExists; open a wait step's signal
    (
        "agentrun.dev",
        "signals",
        &["get", "list", "watch", "create"],
    ),
    // Received / Expired / Superseded phase by server-side apply
    ("agentrun.dev", "signals/status", &["patch"]),
    // run records (D18): look a new run up; record a finished one; replace
    // one no status named yet; prune past the retention
    (
        "agentrun.dev",
        "runrecords",
        &["get", "list", "create", "delete"],
    ),
    // watch, read, create step Pods; delete retired attempts; release the result finalizer (D5)
    (
        "",
        "pods",
        &["get", "list", "watch", "create", "delete", "patch"],
    ),
    // kube-runtime's Recorder: create an Event, patch its series
    ("events.k8s.io", "events", &["create", "patch"]),
    // step journals (D19): watched and read; a call that may have acted settled in the status
    ("agentrun.dev", "stepjournals", &["get", "list", "watch"]),
    ("agentrun.dev", "stepjournals/status", &["patch"]),
    // a journaled step's ServiceAccount bound to the journal-writer role (server-side apply)
    (
        "rbac.authorization.k8s.io",
        "rolebindings",
        &["get", "create", "patch"],
    ),
];

/// What kube-lease-manager does with its Lease: get it, create it when absent,
/// patch it (strategic merge and server-side apply). `None`: any name (create
/// cannot be limited by name); `Some`: only the release's Lease.
pub fn lease_rules(lease: &str) -> BTreeSet<Grant> {
    BTreeSet::from([
        grant("coordination.k8s.io", "leases", "create", None),
        grant("coordination.k8s.io", "leases", "get", Some(lease)),
        grant("coordination.k8s.io", "leases", "patch", Some(lease)),
    ])
}

/// One flattened RBAC permission: (apiGroup, resource, verb, resourceName).
pub type Grant = (String, String, String, Option<String>);

pub fn grant(group: &str, resource: &str, verb: &str, name: Option<&str>) -> Grant {
    (
        group.into(),
        resource.into(),
        verb.into(),
        name.map(Into::into),
    )
}

pub fn operator_grants() -> BTreeSet<Grant> {
    operator_grants_for("agentrun")
}

/// The operator's grants in a release whose `roles.prefix` is `prefix`
/// (the one role it may bind is `<prefix>-journal-writer`).
pub fn operator_grants_for(prefix: &str) -> BTreeSet<Grant> {
    let mut grants: BTreeSet<Grant> = OPERATOR_RULES
        .iter()
        .flat_map(|(group, resource, verbs)| {
            verbs
                .iter()
                .map(move |verb| grant(group, resource, verb, None))
        })
        .collect();
    let role = format!("{prefix}-journal-writer");
    grants.insert(grant(
        "rbac.authorization.k8s.io",
        "clusterroles",
        "bind",
        Some(&role),
    ));
    grants
}

/// Flattens a Role's or ClusterRole's `rules`, refusing wildcards, nonResourceURLs
/// and duplicate grants (a duplicate hides an edit made in only one place).
pub fn grants_of(role: &Value) -> BTreeSet<Grant> {
    let name = &role["metadata"]["name"];
    let rules = role["rules"]
        .as_array()
        .unwrap_or_else(|| panic!("{name}: no rules"));
    let mut out = BTreeSet::new();
    for rule in rules {
        assert!(
            rule.get("nonResourceURLs").is_none(),
            "{name}: nonResourceURLs in {rule}"
        );
        let names: Vec<Option<String>> = match rule.get("resourceNames") {
            Some(ns) => strings(ns).into_iter().map(Some).collect(),
            None => vec![None],
        };
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                for verb in strings(&rule["verbs"]) {
                    for rn in &names {
                        for s in [&group, &resource, &verb] {
                            assert!(!s.contains('*'), "{name}: wildcard in {rule}");
                        }
                        let g = (group.clone(), resource.clone(), verb.clone(), rn.clone());
                        assert!(out.insert(g.clone()), "{name}: {g:?} granted twice");
                    }
                }
            }
        }
    }
    out
}

pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected a list of strings, got {v}"))
        .iter()
        .map(|s| {
            s.as_str()
                .unwrap_or_else(|| panic!("not a string: {s}"))
                .to_owned()
        })
        .collect()
}

// ---------------------------------------------------------------------------
// The tools

/// The helm binary: `$AGENTRUN_HELM`, else the one `e2e/cluster tools`
/// installs next to kubectl, else `helm` on PATH.
pub fn helm_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("AGENTRUN_HELM").filter(|v| !v.is_empty()) {
        return PathBuf::from(path);
    }
    let kubectl = kubectl_binary();
    match kubectl.parent().map(|dir| dir.join("helm")) {
        Some(helm) if helm.is_file() => helm,
        _ => PathBuf::from("helm"),
    }
}

pub fn tool(binary: PathBuf) -> Command {
    let mut cmd = Command::new(binary);
    cmd.current_dir(repo_root())
        .arg("--kubeconfig")
        .arg(kubeconfig());
    cmd
}

pub fn helm_cmd() -> Command {
    tool(helm_binary())
}

pub fn kubectl_cmd() -> Command {
    tool(kubectl_binary())
}

/// Runs `cmd`, panicking if it cannot start (tools missing).
pub fn output(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| {
        panic!(
            "cannot run {:?}: {e} (run `e2e/cluster tools`, or `eval $(e2e/cluster env)`)",
            cmd.get_program()
        )
    })
}

/// Runs `cmd` and returns stdout; panics with its output unless it succeeds.
pub fn ok(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).expect("tool output is UTF-8")
}

/// The async flavour, for tests on a runtime.
pub async fn ok_async(cmd: Command) -> String {
    let described = format!("{cmd:?}");
    let out = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {described}: {e} (run `e2e/cluster tools`)"));
    assert!(
        out.status.success(),
        "{described} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).expect("tool output is UTF-8")
}

/// Every non-empty document of a YAML stream, as JSON values.
pub fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let v: serde_yaml::Value =
                serde::Deserialize::deserialize(doc).expect("the tool printed valid YAML");
            serde_json::to_value(v).expect("YAML documents convert to JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// `helm template <release> <chart> -n <namespace> <args>`, as documents.
pub fn render(release: &str, namespace: &str, args: &[&str]) -> Vec<Value> {
    documents(&ok(helm_cmd()
        .args(["template", release, CHART, "--namespace", namespace])
        .args(args)))
}

pub fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

pub fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    match of_kind(docs, kind).as_slice() {
        [one] => one,
        other => panic!("expected one {kind}, found {}", other.len()),
    }
}

/// The one object of `kind` named `name`.
pub fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    match of_kind(docs, kind)
        .into_iter()
        .filter(|d| d["metadata"]["name"] == name)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [one] => one,
        other => panic!("expected one {kind} {name}, found {}", other.len()),
    }
}

/// Kinds that are not namespaced (kustomize's namespace transformer still
/// writes a namespace into those it does not know).
pub const CLUSTER_SCOPED: &[&str] = &[
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
];

pub fn container(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["spec"]["containers"][0]
}

pub fn args_of(deployment: &Value) -> Vec<String> {
    strings(&container(deployment)["args"])
}
