//! The chart and the kustomize bases as rendered, without a control plane:
//! lint, values schema, RBAC and Deployment, the CRD copies both ship, and
//! that the kustomize default is the chart's default install. The install on
//! the plane is in `install.rs`; the console's objects in `chart_console.rs`;
//! the admission policies and people's roles in `chart_policies.rs`.
//!
//! ```text
//!   crds/agentrun.dev_crds.yaml ══ byte-identical ══ charts/agentrun-operator/crds/, config/crd/
//!   OPERATOR_RULES, lease_rules ══ rendered ClusterRole/Role ══ config/rbac
//! ```
//!
//! Needs `e2e/cluster tools` (kubectl, helm). Fails, never skips, when they
//! are missing.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

use agentrun_e2e::repo_root;
use agentrun_e2e::support::chart::*;
use serde_json::Value;

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
        &["--set", "console.enabled=true"],
        &[
            "--set",
            "console.enabled=true",
            "--set",
            "console.auth.mode=proxy\\,token",
            "--set",
            "console.auth.proxy.trustedCIDRs={10.0.0.0/8}",
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
        (
            "a negative cap on active runs",
            "queue.maxActiveRunsPerNamespace=-1",
            "maxActiveRunsPerNamespace",
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

    let cluster_role = named(&docs, "ClusterRole", "agentrun-operator");
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
    // Only the people's roles and the journal writer's are cluster-wide
    // (bound per namespace by whoever grants them, the operator for a
    // journaled step's ServiceAccount); the operator's own are not.
    let cluster_roles: Vec<&str> = of_kind(&docs, "ClusterRole")
        .iter()
        .filter_map(|r| r["metadata"]["name"].as_str())
        .collect();
    assert_eq!(
        cluster_roles,
        [
            "agentrun-viewer",
            "agentrun-approver",
            "agentrun-signaler",
            "agentrun-journal-writer"
        ],
        "operator ClusterRole rendered for one namespace"
    );
    // The policies apply in the watched namespace only.
    for b in of_kind(&docs, "ValidatingAdmissionPolicyBinding") {
        assert_eq!(
            b["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
            "team-a"
        );
    }
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
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "MutatingAdmissionPolicy",
            "MutatingAdmissionPolicyBinding",
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
            "--journal-writer-role=agentrun-journal-writer",
            "--history-store=api",
            "--history-retention=720h",
            "--history-max-per-namespace=1000",
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

/// The caps on active runs reach the operator as flags, and only when set.
#[test]
fn chart_queue_caps_become_operator_flags() {
    let docs = render(
        "ops",
        "agentrun-system",
        &[
            "--set",
            "queue.maxActiveRunsPerNamespace=5",
            "--set",
            "queue.maxActiveRuns=40",
            "--set-json",
            "queue.priorityClasses=[\"incident\",\"interactive\"]",
        ],
    );
    let deployment = of_kind(&docs, "Deployment")[0];
    let args = args_of(deployment);
    assert!(
        args.contains(&"--max-active-runs-per-namespace=5".to_string())
            && args.contains(&"--max-active-runs=40".to_string())
            && args.contains(&"--queue-priority-classes=incident,interactive".to_string()),
        "{args:?}"
    );
    let defaults = render("ops", "agentrun-system", &[]);
    let args = args_of(of_kind(&defaults, "Deployment")[0]);
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--max-active-runs") || a.starts_with("--queue-priority")),
        "no cap by default: {args:?}"
    );
}

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
        let kind = d["kind"].as_str().unwrap_or_default();
        let namespace = match CLUSTER_SCOPED.contains(&kind) {
            true => "",
            false => d["metadata"]["namespace"].as_str().unwrap_or_default(),
        };
        (
            kind.to_owned(),
            namespace.to_owned(),
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
            "ValidatingAdmissionPolicy"
            | "ValidatingAdmissionPolicyBinding"
            | "MutatingAdmissionPolicy"
            | "MutatingAdmissionPolicyBinding" => &["spec"],
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
        grants_of(named(&kustomized, "ClusterRole", "agentrun-operator")),
        operator_grants()
    );
    assert_eq!(
        grants_of(one(&kustomized, "Role")),
        lease_rules("agentrun-operator")
    );
}

/// With notifications on, the operator is told where its channels are and
/// may read that one Secret (and list the Service CIDRs it refuses), no
/// other Secret; with them off, it gets no Secret access at all.
#[test]
fn chart_notifications_read_one_secret_only() {
    let off = render("agentrun-operator", "agentrun-system", &[]);
    for d in &off {
        let kind = d["kind"].as_str().unwrap_or_default();
        if kind == "Role" || kind == "ClusterRole" {
            assert!(
                !d["rules"].to_string().contains("secrets"),
                "secrets granted without notifications: {}",
                d["metadata"]["name"]
            );
        }
    }
    assert!(
        !args_of(one(&off, "Deployment"))
            .iter()
            .any(|a| a.starts_with("--notify")),
        "no notification flags by default"
    );
    let on = render(
        "agentrun-operator",
        "agentrun-system",
        &[
            "--set",
            "notifications.secretName=agentrun-channels",
            "--set",
            "notifications.allowCidrs={10.20.0.0/16,fd00::/8}",
            "--set",
            "notifications.consoleUrl=https://console.example",
        ],
    );
    let args = args_of(one(&on, "Deployment"));
    for want in [
        "--notify-secret=agentrun-system/agentrun-channels",
        "--notify-allow-cidr=10.20.0.0/16",
        "--notify-allow-cidr=fd00::/8",
        "--console-url=https://console.example",
    ] {
        assert!(args.contains(&want.to_owned()), "{want} missing: {args:?}");
    }
    let role = named(&on, "Role", "agentrun-operator-notifications");
    assert_eq!(role["metadata"]["namespace"], "agentrun-system");
    let name = Some("agentrun-channels".to_owned());
    let expected: BTreeSet<_> = ["get", "list", "watch"]
        .into_iter()
        .map(|v| {
            (
                String::new(),
                "secrets".to_owned(),
                v.to_owned(),
                name.clone(),
            )
        })
        .collect();
    assert_eq!(grants_of(role), expected);
    let binding = named(&on, "RoleBinding", "agentrun-operator-notifications");
    assert_operator_subject(binding, "agentrun-operator", "agentrun-system");
    let cidrs = named(&on, "ClusterRole", "agentrun-operator-notifications");
    assert_eq!(
        grants_of(cidrs),
        BTreeSet::from([(
            "networking.k8s.io".to_owned(),
            "servicecidrs".to_owned(),
            "list".to_owned(),
            None
        )])
    );
    let out = output(helm_cmd().args([
        "template",
        "r",
        CHART,
        "--set",
        "notifications.consoleUrl=console.example",
    ]));
    assert!(
        !out.status.success(),
        "a console URL without a scheme was accepted"
    );
}
