//! Installing the operator: the Helm chart (lint, values schema, rendered RBAC
//! and Deployment, a real `helm install` on the plane), the kustomize bases
//! (server-side dry run, same install as the chart's defaults), and the CRD
//! copies both ship.
//!
//! ```text
//!   crds/agentrun.dev_crds.yaml ══ byte-identical ══ charts/agentrun-operator/crds/, config/crd/
//!   OPERATOR_RULES, LEASE_RULES (below) ══ rendered ClusterRole/Role ══ config/rbac
//!   helm install ──▶ plane ──▶ SubjectAccessReview as the operator's ServiceAccount
//! ```
//!
//! Needs `e2e/cluster tools` (kubectl, helm) and, for the install tests, the
//! plane (`make cluster-up`). Fails, never skips, when either is missing.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Command, Output};

use agentrun_e2e::support::kubectl::kubectl_binary;
use agentrun_e2e::{TestEnv, kubeconfig, repo_root};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use serde_json::Value;

const CHART: &str = "charts/agentrun-operator";
const GENERATED_CRDS: &str = "crds/agentrun.dev_crds.yaml";

/// Every permission the operator needs outside leader election, one line per
/// (API group, resource) with the reason. The chart and config/rbac must grant
/// exactly these: nothing missing, nothing more.
const OPERATOR_RULES: &[(&str, &str, &[&str])] = &[
    // watch runs; re-read after a status conflict; delete finished runs (TTL, D12)
    (
        "agentrun.dev",
        "agentruns",
        &["get", "list", "watch", "delete"],
    ),
    // guarded server-side apply of the status (checkpoints, D3/D4)
    ("agentrun.dev", "agentruns/status", &["patch"]),
    // blockOwnerDeletion on step Pods under OwnerReferencesPermissionEnforcement
    ("agentrun.dev", "agentruns/finalizers", &["update"]),
    // watch; read back on AlreadyExists; open approvals
    (
        "agentrun.dev",
        "approvals",
        &["get", "list", "watch", "create"],
    ),
    // Approved / Rejected / Expired phase by server-side apply
    ("agentrun.dev", "approvals/status", &["patch"]),
    // watch, read, create step Pods; delete retired attempts; release the result finalizer (D5)
    (
        "",
        "pods",
        &["get", "list", "watch", "create", "delete", "patch"],
    ),
    // kube-runtime's Recorder: create an Event, patch its series
    ("events.k8s.io", "events", &["create", "patch"]),
];

/// What kube-lease-manager does with its Lease: get it, create it when absent,
/// patch it (strategic merge and server-side apply). `None`: any name (create
/// cannot be limited by name); `Some`: only the release's Lease.
fn lease_rules(lease: &str) -> BTreeSet<Grant> {
    BTreeSet::from([
        grant("coordination.k8s.io", "leases", "create", None),
        grant("coordination.k8s.io", "leases", "get", Some(lease)),
        grant("coordination.k8s.io", "leases", "patch", Some(lease)),
    ])
}

/// One flattened RBAC permission: (apiGroup, resource, verb, resourceName).
type Grant = (String, String, String, Option<String>);

fn grant(group: &str, resource: &str, verb: &str, name: Option<&str>) -> Grant {
    (
        group.into(),
        resource.into(),
        verb.into(),
        name.map(Into::into),
    )
}

fn operator_grants() -> BTreeSet<Grant> {
    OPERATOR_RULES
        .iter()
        .flat_map(|(group, resource, verbs)| {
            verbs
                .iter()
                .map(move |verb| grant(group, resource, verb, None))
        })
        .collect()
}

/// Flattens a Role's or ClusterRole's `rules`, refusing wildcards, nonResourceURLs
/// and duplicate grants (a duplicate hides an edit made in only one place).
fn grants_of(role: &Value) -> BTreeSet<Grant> {
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

fn strings(v: &Value) -> Vec<String> {
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
fn helm_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("AGENTRUN_HELM").filter(|v| !v.is_empty()) {
        return PathBuf::from(path);
    }
    let kubectl = kubectl_binary();
    match kubectl.parent().map(|dir| dir.join("helm")) {
        Some(helm) if helm.is_file() => helm,
        _ => PathBuf::from("helm"),
    }
}

fn tool(binary: PathBuf) -> Command {
    let mut cmd = Command::new(binary);
    cmd.current_dir(repo_root())
        .arg("--kubeconfig")
        .arg(kubeconfig());
    cmd
}

fn helm_cmd() -> Command {
    tool(helm_binary())
}

fn kubectl_cmd() -> Command {
    tool(kubectl_binary())
}

/// Runs `cmd`, panicking if it cannot start (tools missing).
fn output(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| {
        panic!(
            "cannot run {:?}: {e} (run `e2e/cluster tools`, or `eval $(e2e/cluster env)`)",
            cmd.get_program()
        )
    })
}

/// Runs `cmd` and returns stdout; panics with its output unless it succeeds.
fn ok(cmd: &mut Command) -> String {
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
async fn ok_async(cmd: Command) -> String {
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
fn documents(yaml: &str) -> Vec<Value> {
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
fn render(release: &str, namespace: &str, args: &[&str]) -> Vec<Value> {
    documents(&ok(helm_cmd()
        .args(["template", release, CHART, "--namespace", namespace])
        .args(args)))
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    match of_kind(docs, kind).as_slice() {
        [one] => one,
        other => panic!("expected one {kind}, found {}", other.len()),
    }
}

fn container(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["spec"]["containers"][0]
}

fn args_of(deployment: &Value) -> Vec<String> {
    strings(&container(deployment)["args"])
}

// ---------------------------------------------------------------------------
// The chart, rendered

#[test]
fn chart_lints_strictly_with_default_and_optional_values() {
    let variants: &[&[&str]] = &[
        &[],
        &["--set", "watchNamespace=team-a"],
        &[
            "--set",
            "replicaCount=2",
            "--set",
            "podDisruptionBudget.enabled=true",
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ],
        &[
            "--set",
            "leaderElection.enabled=false",
            "--set",
            "rbac.create=false",
        ],
    ];
    for args in variants {
        for strict in [false, true] {
            let mut cmd = helm_cmd();
            cmd.args(["lint", CHART]).args(*args);
            if strict {
                cmd.arg("--strict");
            }
            let out = ok(&mut cmd);
            assert!(
                out.contains("0 chart(s) failed"),
                "helm lint {args:?}:\n{out}"
            );
        }
    }
}

#[test]
fn chart_schema_refuses_bad_values() {
    let cases = [
        ("log format outside the enum", "logFormat=xml", "logFormat"),
        ("negative replicas", "replicaCount=-1", "replicaCount"),
        ("port out of range", "metrics.port=70000", "metrics/port"),
        (
            "pull policy outside the enum",
            "image.pullPolicy=Sometimes",
            "pullPolicy",
        ),
        (
            "namespace not a DNS label",
            "watchNamespace=Team_A",
            "watchNamespace",
        ),
        (
            "string for a boolean",
            "leaderElection.enabled=yes",
            "leaderElection",
        ),
        (
            "unknown value (a typo)",
            "watchNamespaces=team-a",
            "watchNamespaces",
        ),
    ];
    for (name, set, mentions) in cases {
        let out = output(helm_cmd().args(["template", "r", CHART, "--set"]).arg(set));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: {set} was accepted");
        assert!(
            stderr.contains(mentions),
            "{name}: error does not name {mentions}:\n{stderr}"
        );
    }

    // Two active operators would write the same runs.
    let out = output(helm_cmd().args([
        "template",
        "r",
        CHART,
        "--set",
        "replicaCount=2",
        "--set",
        "leaderElection.enabled=false",
    ]));
    assert!(
        !out.status.success(),
        "replicas > 1 without leader election was accepted"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("leaderElection.enabled"));
}

#[test]
fn chart_rbac_grants_exactly_the_operators_verbs() {
    let docs = render("agentrun-operator", "agentrun-system", &[]);

    let cluster_role = one(&docs, "ClusterRole");
    assert_eq!(cluster_role["metadata"]["name"], "agentrun-operator");
    let granted = grants_of(cluster_role);
    let expected = operator_grants();
    assert_eq!(
        granted,
        expected,
        "ClusterRole grants more than the operator uses: {:?}; misses: {:?}",
        granted.difference(&expected).collect::<Vec<_>>(),
        expected.difference(&granted).collect::<Vec<_>>()
    );

    let binding = one(&docs, "ClusterRoleBinding");
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], "agentrun-operator");
    assert_operator_subject(binding, "agentrun-operator", "agentrun-system");

    // Leader election: one Role, in the release namespace, for one Lease.
    let lease_role = one(&docs, "Role");
    assert_eq!(lease_role["metadata"]["namespace"], "agentrun-system");
    assert_eq!(grants_of(lease_role), lease_rules("agentrun-operator"));
    let lease_binding = one(&docs, "RoleBinding");
    assert_eq!(lease_binding["metadata"]["namespace"], "agentrun-system");
    assert_eq!(
        lease_binding["roleRef"]["name"],
        lease_role["metadata"]["name"]
    );
    assert_operator_subject(lease_binding, "agentrun-operator", "agentrun-system");

    // The Lease the Role names is the one the operator is told to use.
    let args = args_of(one(&docs, "Deployment"));
    assert!(args.contains(&"--leader-elect".to_owned()), "{args:?}");
    assert!(
        args.contains(&"--lease-name=agentrun-operator".to_owned()),
        "{args:?}"
    );
}

#[test]
fn chart_watching_one_namespace_grants_a_role_there_only() {
    let docs = render(
        "ops",
        "agentrun-system",
        &["--set", "watchNamespace=team-a"],
    );
    assert!(
        of_kind(&docs, "ClusterRole").is_empty(),
        "ClusterRole rendered for one namespace"
    );
    assert!(of_kind(&docs, "ClusterRoleBinding").is_empty());

    let roles = of_kind(&docs, "Role");
    let (watched, lease): (Vec<&Value>, Vec<&Value>) = roles
        .into_iter()
        .partition(|r| r["metadata"]["namespace"] == "team-a");
    let [watched] = watched.as_slice() else {
        panic!("one Role in team-a: {watched:?}")
    };
    assert_eq!(grants_of(watched), operator_grants());
    let [lease] = lease.as_slice() else {
        panic!("one leader-election Role: {lease:?}")
    };
    assert_eq!(lease["metadata"]["namespace"], "agentrun-system");
    assert_eq!(grants_of(lease), lease_rules("ops-agentrun-operator"));

    let binding = of_kind(&docs, "RoleBinding")
        .into_iter()
        .find(|b| b["metadata"]["namespace"] == "team-a")
        .expect("a RoleBinding in team-a");
    assert_eq!(binding["roleRef"]["kind"], "Role");
    assert_eq!(binding["roleRef"]["name"], watched["metadata"]["name"]);
    assert_operator_subject(binding, "ops-agentrun-operator", "agentrun-system");

    let args = args_of(one(&docs, "Deployment"));
    assert!(args.contains(&"--namespace=team-a".to_owned()), "{args:?}");

    // Without leader election: no Lease permissions and no --leader-elect.
    let docs = render(
        "ops",
        "agentrun-system",
        &["--set", "leaderElection.enabled=false"],
    );
    assert!(
        of_kind(&docs, "Role").is_empty(),
        "leader-election Role without leader election"
    );
    assert!(of_kind(&docs, "RoleBinding").is_empty());
    let args = args_of(one(&docs, "Deployment"));
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--lease") || a == "--leader-elect"),
        "{args:?}"
    );
}

fn assert_operator_subject(binding: &Value, sa: &str, namespace: &str) {
    let subjects = binding["subjects"].as_array().expect("subjects");
    assert_eq!(subjects.len(), 1, "{binding}");
    assert_eq!(subjects[0]["kind"], "ServiceAccount");
    assert_eq!(subjects[0]["name"], sa);
    assert_eq!(subjects[0]["namespace"], namespace);
}

#[test]
fn chart_deployment_is_restricted_probed_and_leader_elected() {
    let docs = render("agentrun-operator", "agentrun-system", &[]);
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from([
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Deployment",
            "Service",
        ]),
        "default install renders exactly these kinds (ServiceMonitor and PDB are opt-in)"
    );

    // Standard labels on every object.
    for doc in &docs {
        let labels = &doc["metadata"]["labels"];
        for key in [
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/managed-by",
            "helm.sh/chart",
        ] {
            assert!(
                labels[key].is_string(),
                "{} {} lacks {key}",
                doc["kind"],
                doc["metadata"]["name"]
            );
        }
    }

    let deployment = one(&docs, "Deployment");
    assert_eq!(deployment["spec"]["replicas"], 1);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "agentrun-operator");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );

    let c = container(deployment);
    assert_eq!(c["image"], "ghcr.io/agentrun-dev/agentrun-operator:0.1.0");
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        c["securityContext"]["capabilities"]["drop"],
        serde_json::json!(["ALL"])
    );
    assert_eq!(
        args_of(deployment),
        [
            "run",
            "--log-format=json",
            "--metrics-addr=0.0.0.0:8080",
            "--health-addr=0.0.0.0:8081",
            "--step-events=true",
            "--leader-elect",
            "--lease-name=agentrun-operator",
        ]
    );
    let env: BTreeMap<&str, &Value> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap(),
                &e["valueFrom"]["fieldRef"]["fieldPath"],
            )
        })
        .collect();
    assert_eq!(env["POD_NAME"], "metadata.name");
    assert_eq!(env["POD_NAMESPACE"], "metadata.namespace");

    let ports: BTreeMap<&str, &Value> = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| (p["name"].as_str().unwrap(), &p["containerPort"]))
        .collect();
    assert_eq!(ports["http-metrics"], 8080);
    assert_eq!(ports["health"], 8081);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "health");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "health");
    assert!(c["resources"]["requests"]["memory"].is_string());
    assert!(c["resources"]["limits"]["memory"].is_string());

    let service = one(&docs, "Service");
    let port = &service["spec"]["ports"][0];
    assert_eq!(
        (&port["name"], &port["port"]),
        (&"http-metrics".into(), &8080.into())
    );
    assert_eq!(port["targetPort"], "http-metrics");
    assert_eq!(
        service["spec"]["selector"], deployment["spec"]["selector"]["matchLabels"],
        "the metrics Service selects the operator Pods"
    );

    // The opt-in objects.
    let docs = render(
        "agentrun-operator",
        "agentrun-system",
        &[
            "--set",
            "replicaCount=3",
            "--set",
            "podDisruptionBudget.enabled=true",
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ],
    );
    let pdb = one(&docs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    let monitor = one(&docs, "ServiceMonitor");
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "http-metrics");
    let service = one(&docs, "Service");
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(
            &service["metadata"]["labels"][k], v,
            "ServiceMonitor selects the Service by {k}"
        );
    }
    // One replica: a PDB that never blocks a node drain.
    let docs = render("r", "ns", &["--set", "podDisruptionBudget.enabled=true"]);
    let pdb = one(&docs, "PodDisruptionBudget");
    assert!(pdb["spec"].get("minAvailable").is_none(), "{pdb}");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
}

// ---------------------------------------------------------------------------
// The CRD copies and the kustomize bases

#[test]
fn crd_copies_are_byte_identical_to_the_generated_crds() {
    let root = repo_root();
    let generated = std::fs::read(root.join(GENERATED_CRDS)).expect("crds/ is checked in");
    for copy in [
        "charts/agentrun-operator/crds/agentrun.dev_crds.yaml",
        "config/crd/agentrun.dev_crds.yaml",
    ] {
        let bytes = std::fs::read(root.join(copy)).unwrap_or_else(|e| panic!("{copy}: {e}"));
        assert!(
            bytes == generated,
            "{copy} differs from {GENERATED_CRDS}: run `cp {GENERATED_CRDS} {copy}` and commit"
        );
    }
}

#[test]
fn samples_kustomization_lists_every_sample() {
    let dir = repo_root().join("config/samples");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("config/samples exists")
        .map(|e| {
            e.expect("readable dir")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    let kustomization: Value = documents(
        &std::fs::read_to_string(dir.join("kustomization.yaml"))
            .expect("config/samples/kustomization.yaml"),
    )
    .remove(0);
    let listed: BTreeSet<String> = strings(&kustomization["resources"]).into_iter().collect();
    assert_eq!(
        listed, on_disk,
        "config/samples/kustomization.yaml must list every sample"
    );

    let rendered = documents(&ok(kubectl_cmd().args(["kustomize", "config/samples"])));
    assert_eq!(rendered.len(), on_disk.len(), "one object per sample file");
    assert!(
        rendered
            .iter()
            .all(|d| d["apiVersion"] == "agentrun.dev/v1alpha1")
    );
}

/// Where `a` and `b` first differ (`path: a vs b`), or `None`. Numbers compare
/// by value: kustomize prints `100.0` as `100`.
fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let null = Value::Null;
                let (xa, yb) = (x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null));
                first_difference(xa, yb, &format!("{path}.{k}"))
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (xa, yb))| first_difference(xa, yb, &format!("{path}[{i}]"))),
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => None,
        _ if a == b => None,
        _ => {
            let short = |v: &Value| {
                let mut s = v.to_string();
                s.truncate(200);
                s
            };
            Some(format!("{path}: {} vs {}", short(a), short(b)))
        }
    }
}

/// `kubectl kustomize config/default`, and the chart rendered with default
/// values as release `agentrun-operator` in `agentrun-system`, describe the
/// same install.
#[test]
fn kustomize_default_is_the_charts_default_install() {
    let kustomized = documents(&ok(kubectl_cmd().args(["kustomize", "config/default"])));
    let charted = render("agentrun-operator", "agentrun-system", &["--include-crds"]);

    let key = |d: &Value| {
        (
            d["kind"].as_str().unwrap_or_default().to_owned(),
            d["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            d["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        )
    };
    let by_key = |docs: &[Value]| -> BTreeMap<_, Value> {
        docs.iter()
            .filter(|d| d["kind"] != "Namespace")
            .map(|d| (key(d), d.clone()))
            .collect()
    };
    let (k, c) = (by_key(&kustomized), by_key(&charted));
    assert_eq!(
        k.keys().collect::<Vec<_>>(),
        c.keys().collect::<Vec<_>>(),
        "config/default and the chart create different objects"
    );
    let ns = one(&kustomized, "Namespace");
    assert_eq!(ns["metadata"]["name"], "agentrun-system");

    for (key, kd) in &k {
        let cd = &c[key];
        let fields: &[&str] = match key.0.as_str() {
            "ClusterRole" | "Role" => &["rules"],
            "ClusterRoleBinding" | "RoleBinding" => &["roleRef", "subjects"],
            "CustomResourceDefinition" => &["spec"],
            "Service" => &["spec"],
            "ServiceAccount" => &["automountServiceAccountToken"],
            "Deployment" => &[],
            other => panic!("unexpected kind {other} in config/default"),
        };
        for f in fields {
            if let Some(diff) = first_difference(&kd[*f], &cd[*f], f) {
                panic!("{key:?} differs between config/default and the chart at {diff}");
            }
        }
    }
    let (kd, cd) = (one(&kustomized, "Deployment"), one(&charted, "Deployment"));
    for f in ["replicas", "selector"] {
        assert_eq!(kd["spec"][f], cd["spec"][f], "Deployment spec.{f} differs");
    }
    if let Some(diff) = first_difference(
        &kd["spec"]["template"]["spec"],
        &cd["spec"]["template"]["spec"],
        "spec.template.spec",
    ) {
        panic!("the operator Pod spec differs between config/manager and the chart at {diff}");
    }
    // And config/rbac is the same table the chart is checked against.
    assert_eq!(
        grants_of(one(&kustomized, "ClusterRole")),
        operator_grants()
    );
    assert_eq!(
        grants_of(one(&kustomized, "Role")),
        lease_rules("agentrun-operator")
    );
}

/// `kubectl apply --dry-run=server -k config/default` on the real plane. The
/// objects go into `agentrun-system`, which a dry run cannot create first; so
/// the test applies a one-line overlay of config/default that moves them into
/// its own (existing) namespace, leaving config/default itself untouched.
#[tokio::test]
async fn kustomize_default_applies_on_the_server() {
    let env = TestEnv::new("kustomize_default_applies").await;
    let overlay = repo_root()
        .join("target/install-overlays")
        .join(env.namespace());
    std::fs::create_dir_all(&overlay).expect("creating the overlay directory");
    // kustomize accepts only relative paths to other kustomizations.
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
             namespace: {}\nresources:\n  - ../../../config/default\n",
            env.namespace()
        ),
    )
    .expect("writing the overlay");

    let mut cmd = kubectl_cmd();
    cmd.args(["apply", "--dry-run=server", "-k"]).arg(&overlay);
    let out = ok_async(cmd).await;
    std::fs::remove_dir_all(&overlay).ok();
    for line in [
        "customresourcedefinition.apiextensions.k8s.io/agentruns.agentrun.dev",
        "customresourcedefinition.apiextensions.k8s.io/approvals.agentrun.dev",
        "serviceaccount/agentrun-operator",
        "clusterrole.rbac.authorization.k8s.io/agentrun-operator",
        "clusterrolebinding.rbac.authorization.k8s.io/agentrun-operator",
        "role.rbac.authorization.k8s.io/agentrun-operator-leader-election",
        "rolebinding.rbac.authorization.k8s.io/agentrun-operator-leader-election",
        "deployment.apps/agentrun-operator",
        "service/agentrun-operator-metrics",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(line) && l.ends_with("(server dry run)")),
            "{line} not applied:\n{out}"
        );
    }
    env.cleanup().await;
}

// ---------------------------------------------------------------------------
// helm install on the plane

/// A Helm release that is uninstalled when dropped (also when the test
/// panics), so no ClusterRole outlives its test.
struct Release {
    name: String,
    namespace: String,
    installed: bool,
}

impl Release {
    /// `agentrun-operator-<the namespace's random suffix>`: unique, and it
    /// contains the chart name, so every object (the ClusterRole too) is named
    /// exactly this.
    fn for_namespace(namespace: &str) -> Release {
        let suffix = namespace
            .rsplit('-')
            .next()
            .expect("namespace has a suffix");
        Release {
            name: format!("agentrun-operator-{suffix}"),
            namespace: namespace.to_owned(),
            installed: false,
        }
    }

    async fn install(&mut self, extra: &[&str]) -> String {
        let mut cmd = helm_cmd();
        // The CRDs are cluster-wide and already installed (server-side apply,
        // by TestEnv); crd_copies_are_byte_identical_to_the_generated_crds
        // covers the chart's copy.
        cmd.args([
            "install",
            &self.name,
            CHART,
            "--namespace",
            &self.namespace,
            "--skip-crds",
        ])
        .args(extra);
        self.installed = true;
        ok_async(cmd).await
    }

    async fn uninstall(mut self) {
        self.installed = false;
        let mut cmd = helm_cmd();
        cmd.args([
            "uninstall",
            &self.name,
            "--namespace",
            &self.namespace,
            "--wait",
        ]);
        ok_async(cmd).await;
    }

    fn service_account(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
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

/// Whether the API server's authorizer lets `user` (a ServiceAccount, with
/// its groups) do `verb` on `group/resource` (`resource/sub` for a
/// subresource) in `namespace`, optionally on the object `name`.
async fn allowed(
    client: &Client,
    user: &str,
    verb: &str,
    group: &str,
    resource: &str,
    namespace: &str,
    name: Option<&str>,
) -> bool {
    let sa_namespace = user
        .split(':')
        .nth(2)
        .expect("system:serviceaccount:<ns>:<name>");
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(s.to_owned())),
        None => (resource, None),
    };
    let review = SubjectAccessReview {
        metadata: ObjectMeta::default(),
        spec: SubjectAccessReviewSpec {
            user: Some(user.to_owned()),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{sa_namespace}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.to_owned()),
                verb: Some(verb.to_owned()),
                group: Some(group.to_owned()),
                resource: Some(resource.to_owned()),
                subresource,
                name: name.map(str::to_owned),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        status: None,
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap_or_else(|e| panic!("SubjectAccessReview {verb} {group}/{resource}: {e}"));
    answer.status.expect("the authorizer answers").allowed
}

/// Things the operator never does; the ServiceAccount must not be able to.
const NEVER: &[(&str, &str, &str)] = &[
    ("get", "", "secrets"),
    ("list", "", "configmaps"),
    ("update", "", "pods"),
    ("patch", "", "pods/status"),
    ("create", "", "pods/exec"),
    ("create", "", "events"),
    ("create", "agentrun.dev", "agentruns"),
    ("update", "agentrun.dev", "agentruns"),
    ("patch", "agentrun.dev", "agentruns"),
    ("update", "agentrun.dev", "agentruns/status"),
    ("delete", "agentrun.dev", "approvals"),
    ("patch", "agentrun.dev", "approvals"),
    ("update", "agentrun.dev", "approvals/status"),
    ("delete", "events.k8s.io", "events"),
];

async fn assert_operator_permissions(client: &Client, user: &str, namespace: &str, expect: bool) {
    for (group, resource, verbs) in OPERATOR_RULES {
        for verb in *verbs {
            assert_eq!(
                allowed(client, user, verb, group, resource, namespace, None).await,
                expect,
                "{user} {verb} {group}/{resource} in {namespace}: expected allowed={expect}"
            );
        }
    }
    for (verb, group, resource) in NEVER {
        assert!(
            !allowed(client, user, verb, group, resource, namespace, None).await,
            "{user} may {verb} {group}/{resource} in {namespace}, which the operator never does"
        );
    }
}

async fn assert_lease_permissions(client: &Client, user: &str, namespace: &str, lease: &str) {
    for (verb, name, expect) in [
        ("create", None, true),
        ("get", Some(lease), true),
        ("patch", Some(lease), true),
        ("get", Some("someone-elses-lease"), false),
        ("patch", Some("someone-elses-lease"), false),
        ("update", Some(lease), false),
        ("delete", Some(lease), false),
        ("list", None, false),
        ("watch", None, false),
    ] {
        assert_eq!(
            allowed(
                client,
                user,
                verb,
                "coordination.k8s.io",
                "leases",
                namespace,
                name
            )
            .await,
            expect,
            "{user} {verb} lease {name:?} in {namespace}: expected allowed={expect}"
        );
    }
}

#[tokio::test]
async fn helm_install_creates_every_object_with_least_privilege() {
    let env = TestEnv::new("helm_install_all_namespaces").await;
    let client = env.client();
    let ns = env.namespace().to_owned();
    let mut release = Release::for_namespace(&ns);
    let name = release.name.clone();
    release.install(&[]).await;

    let sa: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let roles: Api<Role> = Api::namespaced(client.clone(), &ns);
    let role_bindings: Api<RoleBinding> = Api::namespaced(client.clone(), &ns);
    let cluster_roles: Api<ClusterRole> = Api::all(client.clone());
    let cluster_role_bindings: Api<ClusterRoleBinding> = Api::all(client.clone());

    sa.get(&name)
        .await
        .unwrap_or_else(|e| panic!("ServiceAccount {name}: {e}"));
    let cluster_role = cluster_roles
        .get(&name)
        .await
        .unwrap_or_else(|e| panic!("ClusterRole {name}: {e}"));
    assert_eq!(
        grants_of(&serde_json::to_value(&cluster_role).unwrap()),
        operator_grants(),
        "the ClusterRole on the server"
    );
    let binding = cluster_role_bindings
        .get(&name)
        .await
        .unwrap_or_else(|e| panic!("ClusterRoleBinding {name}: {e}"));
    assert_eq!(binding.role_ref.name, name);
    let lease_role = format!("{name}-leader-election");
    roles
        .get(&lease_role)
        .await
        .unwrap_or_else(|e| panic!("Role {lease_role}: {e}"));
    role_bindings
        .get(&lease_role)
        .await
        .unwrap_or_else(|e| panic!("RoleBinding {lease_role}: {e}"));
    let deployment = deployments
        .get(&name)
        .await
        .unwrap_or_else(|e| panic!("Deployment {name}: {e}"));
    let pod = deployment
        .spec
        .and_then(|s| s.template.spec)
        .expect("pod spec");
    assert_eq!(pod.service_account_name.as_deref(), Some(name.as_str()));
    services
        .get(&format!("{name}-metrics"))
        .await
        .unwrap_or_else(|e| panic!("Service {name}-metrics: {e}"));

    // What the ServiceAccount may do, asked of the real authorizer: every
    // operator verb in any namespace (ClusterRole), nothing more, and the
    // release's own Lease only.
    let user = release.service_account();
    let elsewhere = TestEnv::new("helm_install_all_namespaces_other").await;
    for namespace in [ns.as_str(), elsewhere.namespace()] {
        assert_operator_permissions(&client, &user, namespace, true).await;
    }
    assert_lease_permissions(&client, &user, &ns, &name).await;
    assert!(
        !allowed(
            &client,
            &user,
            "create",
            "coordination.k8s.io",
            "leases",
            elsewhere.namespace(),
            None
        )
        .await,
        "Lease permissions reach beyond the release namespace"
    );

    release.uninstall().await;
    assert!(
        cluster_roles
            .get_opt(&name)
            .await
            .expect("reading ClusterRoles")
            .is_none(),
        "helm uninstall left ClusterRole {name}"
    );
    assert!(
        cluster_role_bindings
            .get_opt(&name)
            .await
            .expect("reading bindings")
            .is_none()
    );
    elsewhere.cleanup().await;
    env.cleanup().await;
}

#[tokio::test]
async fn helm_install_watching_one_namespace_grants_nothing_elsewhere() {
    let env = TestEnv::new("helm_install_one_namespace").await;
    let watched = TestEnv::new("helm_install_one_namespace_watched").await;
    let client = env.client();
    let ns = env.namespace().to_owned();
    let mut release = Release::for_namespace(&ns);
    let name = release.name.clone();
    release
        .install(&["--set", &format!("watchNamespace={}", watched.namespace())])
        .await;

    let cluster_roles: Api<ClusterRole> = Api::all(client.clone());
    assert!(
        cluster_roles
            .get_opt(&name)
            .await
            .expect("reading ClusterRoles")
            .is_none(),
        "a ClusterRole was created for a single-namespace install"
    );
    let role = Api::<Role>::namespaced(client.clone(), watched.namespace())
        .get(&name)
        .await
        .unwrap_or_else(|e| panic!("Role {name} in the watched namespace: {e}"));
    assert_eq!(
        grants_of(&serde_json::to_value(&role).unwrap()),
        operator_grants()
    );
    let deployment = Api::<Deployment>::namespaced(client.clone(), &ns)
        .get(&name)
        .await
        .unwrap_or_else(|e| panic!("Deployment {name}: {e}"));
    let args = deployment
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|p| p.containers.into_iter().next())
        .and_then(|c| c.args)
        .expect("operator args");
    assert!(
        args.contains(&format!("--namespace={}", watched.namespace())),
        "{args:?}"
    );

    let user = release.service_account();
    assert_operator_permissions(&client, &user, watched.namespace(), true).await;
    assert_operator_permissions(&client, &user, &ns, false).await;
    assert_lease_permissions(&client, &user, &ns, &name).await;

    release.uninstall().await;
    watched.cleanup().await;
    env.cleanup().await;
}

/// The strongest check that the chart's RBAC is enough, not just as written:
/// the real operator, authenticated as the chart's ServiceAccount
/// (impersonation), with leader election, drives a gated run to success and
/// deletes it after its TTL, and never hits a 403 on the way.
#[tokio::test]
async fn operator_runs_a_gated_run_under_the_charts_rbac() {
    use agentrun_e2e::support::processes::{impersonating_kubeconfig, log_dir, start_operator};
    use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
    use agentrun_e2e::wait_for_deleted;
    use agentrun_operator::api::RunPhase;
    use serde_json::json;
    use std::time::Duration;

    const TIMEOUT: Duration = Duration::from_secs(90);
    let mut s = Scenario::start_without_operator("operator_runs_under_chart_rbac").await;
    let ns = s.namespace().to_owned();
    // Release `agentrun-operator` watching its own namespace: Role, RoleBinding
    // and the Lease Role for `agentrun-operator` (the operator's default Lease)
    // all in `ns`, nothing cluster-wide.
    let mut release = Release {
        name: "agentrun-operator".into(),
        namespace: ns.clone(),
        installed: false,
    };
    release
        .install(&["--set", &format!("watchNamespace={ns}")])
        .await;

    // A kubeconfig that acts as the chart's ServiceAccount.
    let mut cfg = s.operator_config.clone();
    cfg.kubeconfig = impersonating_kubeconfig(
        &release.service_account(),
        log_dir(&ns).join("operator-as-serviceaccount.kubeconfig"),
    );
    cfg.leader_elect = true;
    s.operator_config = cfg.clone();
    s.operator = Some(start_operator(&cfg));

    let spec = json!({
        "ttlSecondsAfterFinished": 2,
        "steps": [
            sim_step("draft", "None", json!({"runMs": 50, "result": {"amount": 5}})),
            {"name": "issue", "effect": "NonIdempotent",
             "approval": {"required": true, "question": "Issue the refund?", "onTimeout": "Reject"},
             "container": {"image": "registry.example/pay:1",
                           "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50}).to_string()}]}},
        ],
    });
    s.create_run("gated", spec).await;
    let waiting = s
        .wait_run("gated", "waiting for approval", TIMEOUT, |r| {
            phase(r) == Some(RunPhase::WaitingForApproval)
                && r.status
                    .as_ref()
                    .is_some_and(|st| st.steps.iter().any(|c| c.approval.is_some()))
        })
        .await;
    let approval = waiting
        .status
        .as_ref()
        .and_then(|st| st.steps.iter().find_map(|c| c.approval.clone()))
        .expect("the gate names its Approval");
    s.decide(&approval, "Approved", "fine").await;
    let run = s.wait_finished("gated", TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    // TTL: the operator deletes the finished run itself.
    wait_for_deleted(&s.runs(), "gated", TIMEOUT).await;

    // The Lease was taken under the chart's Role.
    let lease = ok_async({
        let mut cmd = kubectl_cmd();
        cmd.args(["get", "lease", "agentrun-operator", "-n", &ns])
            .args(["-o", "jsonpath={.spec.holderIdentity}"]);
        cmd
    })
    .await;
    assert_eq!(lease, cfg.identity, "the operator holds its Lease");

    let log_path = s
        .operator
        .as_ref()
        .expect("operator running")
        .log_path()
        .to_owned();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let denied: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("forbidden") || l.contains("Forbidden"))
        .collect();
    assert!(
        denied.is_empty(),
        "the operator was denied under the chart's RBAC:\n{}",
        denied.join("\n")
    );

    s.kill_operator().await;
    release.uninstall().await;
    s.finish().await;
}

/// The other half of least privilege: the chart grants nothing the operator
/// can do without. With one verb taken out of the chart's Role, the operator
/// running as the chart's ServiceAccount can no longer drive a run: it is
/// refused (403) and the run does not finish.
#[tokio::test]
async fn one_verb_fewer_and_the_operator_cannot_drive_a_run() {
    use agentrun_e2e::support::processes::{impersonating_kubeconfig, log_dir, start_operator};
    use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
    use agentrun_operator::api::RunPhase;
    use serde_json::json;
    use std::time::Duration;

    // (apiGroup, resource, verb): each is on the operator's path for every run.
    let removed: &[(&str, &str, &str)] = &[
        ("", "pods", "create"),
        ("agentrun.dev", "agentruns/status", "patch"),
    ];
    for (i, (group, resource, verb)) in removed.iter().enumerate() {
        let mut s = Scenario::start_without_operator(&format!("one-verb-fewer-{i}")).await;
        let ns = s.namespace().to_owned();
        let mut release = Release {
            name: "agentrun-operator".into(),
            namespace: ns.clone(),
            installed: false,
        };
        release
            .install(&["--set", &format!("watchNamespace={ns}")])
            .await;

        // Take the one verb out of the chart's Role.
        let roles: Api<Role> = s.env().api();
        let mut role = roles
            .get(&release.name)
            .await
            .expect("the chart's Role in the watched namespace");
        let mut found = false;
        for rule in role.rules.iter_mut().flatten() {
            let groups = rule.api_groups.clone().unwrap_or_default();
            let resources = rule.resources.clone().unwrap_or_default();
            if groups.iter().any(|g| g == group) && resources.iter().any(|r| r == resource) {
                let before = rule.verbs.len();
                rule.verbs.retain(|v| v != verb);
                found |= rule.verbs.len() < before;
            }
        }
        assert!(found, "the chart grants {verb} on {group}/{resource}");
        if let Some(rules) = role.rules.as_mut() {
            rules.retain(|r| !r.verbs.is_empty());
        }
        roles
            .replace(&release.name, &PostParams::default(), &role)
            .await
            .expect("replacing the Role");

        let mut cfg = s.operator_config.clone();
        cfg.kubeconfig = impersonating_kubeconfig(
            &release.service_account(),
            log_dir(&ns).join("operator-one-verb-fewer.kubeconfig"),
        );
        s.operator_config = cfg.clone();
        s.operator = Some(start_operator(&cfg));

        s.create_run(
            "starved",
            json!({"steps": [sim_step("only", "None", json!({"runMs": 50}))]}),
        )
        .await;
        // Long enough for a healthy operator to finish it many times over.
        tokio::time::sleep(Duration::from_secs(15)).await;
        let run = s.runs().get("starved").await.expect("the run exists");
        assert_ne!(
            phase(&run),
            Some(RunPhase::Succeeded),
            "without {verb} on {group}/{resource} the run must not finish"
        );
        let log =
            std::fs::read_to_string(s.operator.as_ref().expect("operator running").log_path())
                .unwrap_or_default();
        assert!(
            log.contains("forbidden") || log.contains("Forbidden"),
            "the operator's log shows the refusal of {verb} on {group}/{resource}"
        );
        s.kill_operator().await;
        release.uninstall().await;
        s.finish().await;
    }
}
