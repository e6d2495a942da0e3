//! The chart's `history:` values as rendered, without a control plane: the
//! store and its retention become operator flags; with PostgreSQL the URL
//! reaches the operator only from a Secret (an env `secretKeyRef`, never an
//! argument or a literal value), a private CA is mounted from a Secret; the
//! values schema refuses what the operator would.
//!
//! Needs `e2e/cluster tools` (helm). Fails, never skips, without it.

#![forbid(unsafe_code)]

use agentrun_e2e::support::chart::*;
use serde_json::{Value, json};

fn deployment(args: &[&str]) -> Value {
    let docs = render("ops", "agentrun-system", args);
    of_kind(&docs, "Deployment")[0].clone()
}

fn env_named<'a>(deployment: &'a Value, name: &str) -> Option<&'a Value> {
    container(deployment)["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
}

fn history_args(deployment: &Value) -> Vec<String> {
    args_of(deployment)
        .into_iter()
        .filter(|a| a.starts_with("--history"))
        .collect()
}

#[test]
fn chart_history_defaults_to_runrecords_for_720h() {
    let d = deployment(&[]);
    assert_eq!(
        history_args(&d),
        [
            "--history-store=api",
            "--history-retention=720h",
            "--history-max-per-namespace=1000"
        ]
    );
    assert!(env_named(&d, "AGENTRUN_HISTORY_DATABASE_URL").is_none());
    assert_eq!(volume_names(&d), ["kube-api-access"], "no CA volume");
}

/// The names of the Deployment's volumes; the operator's own token
/// (`kube-api-access`) is always one.
fn volume_names(d: &Value) -> Vec<&str> {
    d["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .map(|vs| vs.iter().filter_map(|v| v["name"].as_str()).collect())
        .unwrap_or_default()
}

/// The item of `list` (volumes, volume mounts) named `name`.
fn named<'v>(list: &'v Value, name: &str) -> Option<&'v Value> {
    list.as_array()?.iter().find(|v| v["name"] == name)
}

#[test]
fn chart_history_in_postgres_takes_the_url_from_a_secret_only() {
    let d = deployment(&[
        "--set",
        "history.store=postgres",
        "--set",
        "history.retention=2160h",
        "--set",
        "history.maxPerNamespace=50000",
        "--set",
        "history.database.existingSecret=agentrun-history-db",
        "--set",
        "history.database.key=DATABASE_URL",
    ]);
    assert_eq!(
        history_args(&d),
        [
            "--history-store=postgres",
            "--history-retention=2160h",
            "--history-max-per-namespace=50000"
        ]
    );
    assert_eq!(
        env_named(&d, "AGENTRUN_HISTORY_DATABASE_URL"),
        Some(&json!({
            "name": "AGENTRUN_HISTORY_DATABASE_URL",
            "valueFrom": {"secretKeyRef": {"name": "agentrun-history-db", "key": "DATABASE_URL"}},
        }))
    );
    assert_eq!(volume_names(&d), ["kube-api-access"], "no CA volume");

    // A private CA: mounted from its Secret, read-only, named by the flag.
    let d = deployment(&[
        "--set",
        "history.store=postgres",
        "--set",
        "history.database.existingSecret=agentrun-history-db",
        "--set",
        "history.database.caSecret=agentrun-history-db-ca",
    ]);
    assert!(
        history_args(&d).contains(
            &"--history-database-ca-file=/etc/agentrun/history-database-ca/ca.crt".into()
        ),
        "{:?}",
        history_args(&d)
    );
    assert_eq!(volume_names(&d), ["kube-api-access", "history-database-ca"]);
    assert_eq!(
        named(
            &d["spec"]["template"]["spec"]["volumes"],
            "history-database-ca"
        ),
        Some(&json!({"name": "history-database-ca", "secret": {
            "secretName": "agentrun-history-db-ca",
            "items": [{"key": "ca.crt", "path": "ca.crt"}],
        }}))
    );
    assert_eq!(
        named(&container(&d)["volumeMounts"], "history-database-ca"),
        Some(
            &json!({"name": "history-database-ca", "mountPath": "/etc/agentrun/history-database-ca", "readOnly": true})
        )
    );
    for strict in [false, true] {
        let mut cmd = helm_cmd();
        cmd.args(["lint", CHART]).args([
            "--set",
            "history.store=postgres",
            "--set",
            "history.database.existingSecret=agentrun-history-db",
            "--set",
            "history.database.caSecret=agentrun-history-db-ca",
        ]);
        if strict {
            cmd.arg("--strict");
        }
        let out = ok(&mut cmd);
        assert!(out.contains("0 chart(s) failed"), "{out}");
    }
}

#[test]
fn chart_history_off_passes_no_retention() {
    let d = deployment(&["--set", "history.store=off"]);
    assert_eq!(history_args(&d), ["--history-store=off"]);
}

#[test]
fn chart_history_schema_refuses_what_the_operator_would() {
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "postgres without the Secret of its URL",
            &["history.store=postgres"],
            "existingSecret",
        ),
        ("an unknown store", &["history.store=mysql"], "store"),
        (
            "days, which the flag does not take",
            &["history.retention=30d"],
            "retention",
        ),
        (
            "no record kept",
            &["history.maxPerNamespace=0"],
            "maxPerNamespace",
        ),
        (
            "a URL where the Secret's name goes",
            &[
                "history.store=postgres",
                "history.database.existingSecret=postgres://u:p@db/x",
            ],
            "existingSecret",
        ),
    ];
    for (name, sets, mentions) in cases {
        let mut cmd = helm_cmd();
        cmd.args(["template", "r", CHART]);
        for s in *sets {
            cmd.args(["--set", s]);
        }
        let out = output(&mut cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: {sets:?} was accepted");
        assert!(
            stderr.contains(mentions),
            "{name}: the error does not name {mentions}:\n{stderr}"
        );
    }
}

/// The operator's rules plus `get, list namespaces` when PostgreSQL keeps
/// the history and the operator watches every namespace (records outlive a
/// namespace there); no namespace rule otherwise, and none in a Role.
#[test]
fn chart_history_in_postgres_may_read_namespaces_only_cluster_wide() {
    let postgres = [
        "--set",
        "history.store=postgres",
        "--set",
        "history.database.existingSecret=agentrun-history-db",
    ];
    let grants = |args: &[&str]| {
        let docs = render("ops", "agentrun-system", args);
        let roles: Vec<_> = ["ClusterRole", "Role"]
            .iter()
            .flat_map(|k| of_kind(&docs, k))
            .filter(|r| r["metadata"]["name"] == "ops-agentrun-operator")
            .cloned()
            .collect();
        assert_eq!(roles.len(), 1, "one operator role");
        (roles[0]["kind"].clone(), grants_of(&roles[0]))
    };
    let mut with_namespaces = operator_grants();
    with_namespaces.insert(grant("", "namespaces", "get", None));
    with_namespaces.insert(grant("", "namespaces", "list", None));

    assert_eq!(grants(&postgres), (json!("ClusterRole"), with_namespaces));
    assert_eq!(grants(&[]), (json!("ClusterRole"), operator_grants()));
    let scoped = [&postgres[..], &["--set", "watchNamespace=team-a"]].concat();
    assert_eq!(grants(&scoped), (json!("Role"), operator_grants()));
}
