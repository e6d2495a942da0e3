//! The chart's in-cluster console as rendered: off by default; on, it signs
//! each person in (`console.auth.mode`), its ServiceAccount's rights follow
//! the mode (nothing for token, impersonation only for proxy), and a
//! NetworkPolicy lets only the configured peers reach it. The objects on the
//! plane, serving people as themselves, are tested in
//! `console/in_cluster.rs`.
//!
//! Needs `e2e/cluster tools` (helm). Fails, never skips, when it is missing.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use agentrun_e2e::support::chart::*;
use serde_json::{Value, json};

const NAME: &str = "agentrun-operator-console";

fn console(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["--set", "console.enabled=true"];
    all.extend_from_slice(args);
    render("agentrun-operator", "agentrun-system", &all)
}

/// The console's objects of `kind`.
fn consoles<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    of_kind(docs, kind)
        .into_iter()
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "console")
        .collect()
}

const PROXY: &[&str] = &[
    "--set",
    "console.auth.mode=proxy",
    "--set",
    "console.auth.proxy.trustedCIDRs={10.42.0.0/16,fd00::/8}",
];

#[test]
fn chart_console_is_off_by_default() {
    let docs = render("agentrun-operator", "agentrun-system", &[]);
    assert!(
        docs.iter()
            .all(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] != "console"),
        "the console is off by default"
    );
}

/// Token mode (the default): people paste a token; the ServiceAccount holds
/// no role at all, and the console is told to sign people in.
#[test]
fn chart_console_in_token_mode_has_no_rights_of_its_own() {
    for docs in [console(&[]), console(&["--set", "watchNamespace=team-a"])] {
        for kind in ["Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"] {
            assert_eq!(consoles(&docs, kind), Vec::<&Value>::new(), "{kind}");
        }
        named(&docs, "ServiceAccount", NAME);
        let dep = named(&docs, "Deployment", NAME);
        assert_eq!(dep["spec"]["template"]["spec"]["serviceAccountName"], NAME);
        assert_eq!(strings(&container(dep)["command"]), ["/kubectl-agentrun"]);
    }
    assert_eq!(
        args_of(named(&console(&[]), "Deployment", NAME)),
        [
            "console",
            "--listen=0.0.0.0",
            "--port=8099",
            "--auth=token",
            "--session-ttl=8h"
        ]
    );
    assert_eq!(
        args_of(named(
            &console(&[
                "--set",
                "watchNamespace=team-a",
                "--set",
                "console.readOnly=true",
                "--set",
                "console.auth.token.sessionTTL=30m"
            ]),
            "Deployment",
            NAME
        )),
        [
            "--namespace=team-a",
            "console",
            "--read-only",
            "--listen=0.0.0.0",
            "--port=8099",
            "--auth=token",
            "--session-ttl=30m"
        ]
    );
}

/// Proxy mode: the ServiceAccount may impersonate users and groups and do
/// nothing else (cluster-wide: Kubernetes has no namespaced impersonation);
/// the console believes the headers from the trusted CIDRs only.
#[test]
fn chart_console_in_proxy_mode_may_only_impersonate() {
    let want: BTreeSet<Grant> = [
        grant("", "users", "impersonate", None),
        grant("", "groups", "impersonate", None),
    ]
    .into();
    for scoped in [&[][..], &["--set", "watchNamespace=team-a"][..]] {
        let mut args = PROXY.to_vec();
        args.extend_from_slice(scoped);
        let docs = console(&args);
        assert_eq!(grants_of(named(&docs, "ClusterRole", NAME)), want);
        let binding = named(&docs, "ClusterRoleBinding", NAME);
        assert_eq!(binding["roleRef"]["name"], NAME);
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": NAME, "namespace": "agentrun-system"}])
        );
        for kind in ["Role", "RoleBinding"] {
            assert_eq!(consoles(&docs, kind), Vec::<&Value>::new(), "{kind}");
        }
    }
    assert_eq!(
        args_of(named(&console(PROXY), "Deployment", NAME)),
        [
            "console",
            "--listen=0.0.0.0",
            "--port=8099",
            "--auth=proxy",
            "--trusted-proxy=10.42.0.0/16",
            "--trusted-proxy=fd00::/8",
            "--user-header=X-Forwarded-User",
            "--group-header=X-Forwarded-Groups"
        ]
    );
    let mut both = PROXY.to_vec();
    both.extend_from_slice(&[
        "--set",
        "console.auth.mode=proxy\\,token",
        "--set",
        "console.auth.proxy.userHeader=X-Forwarded-Email",
        "--set",
        "console.auth.proxy.userPrefix=oidc:",
    ]);
    let docs = console(&both);
    assert_eq!(grants_of(named(&docs, "ClusterRole", NAME)), want);
    assert_eq!(
        args_of(named(&docs, "Deployment", NAME)),
        [
            "console",
            "--listen=0.0.0.0",
            "--port=8099",
            "--auth=proxy,token",
            "--trusted-proxy=10.42.0.0/16",
            "--trusted-proxy=fd00::/8",
            "--user-header=X-Forwarded-Email",
            "--group-header=X-Forwarded-Groups",
            "--user-prefix=oidc:",
            "--session-ttl=8h"
        ]
    );
}

/// A console that would believe anyone's header, or sign no one in, does
/// not render.
#[test]
fn chart_console_refuses_a_proxy_it_cannot_tell_apart_or_no_sign_in() {
    for (set, mentions) in [
        (
            vec!["console.auth.mode=proxy"],
            "console.auth.proxy.trustedCIDRs",
        ),
        (vec!["console.auth.mode=none"], "mode"),
        (
            vec![
                "console.auth.mode=proxy",
                "console.auth.proxy.trustedCIDRs={everyone}",
            ],
            "trustedCIDRs",
        ),
        (vec!["console.networkPolicy.from=null"], "from"),
    ] {
        let mut cmd = helm_cmd();
        cmd.args(["template", "r", CHART, "--set", "console.enabled=true"]);
        for s in &set {
            cmd.args(["--set", s]);
        }
        let out = output(&mut cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set:?} was accepted");
        assert!(stderr.contains(mentions), "{set:?}: {stderr}");
    }
}

/// The NetworkPolicy selects the console's Pods only and lets in the
/// configured peers only, on the console's port: by default the release
/// namespace's oauth2-proxy Pods.
#[test]
fn chart_console_network_policy_admits_only_the_configured_peers() {
    let docs = console(&[]);
    let np = named(&docs, "NetworkPolicy", NAME);
    assert_eq!(np["metadata"]["namespace"], "agentrun-system");
    let pod_labels = &named(&docs, "Deployment", NAME)["spec"]["template"]["metadata"]["labels"];
    let selector = np["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .unwrap();
    assert!(selector.iter().all(|(k, v)| &pod_labels[k] == v), "{np}");
    let operator_labels =
        &named(&docs, "Deployment", "agentrun-operator")["spec"]["template"]["metadata"]["labels"];
    assert!(
        !selector.iter().all(|(k, v)| &operator_labels[k] == v),
        "the policy must not select the operator: {np}"
    );
    assert_eq!(np["spec"]["policyTypes"], json!(["Ingress"]));
    assert_eq!(
        np["spec"]["ingress"],
        json!([{
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "oauth2-proxy"}}}],
            "ports": [{"port": "http", "protocol": "TCP"}],
        }])
    );
    let values = repo_root_file("target/console-np-values.yaml");
    std::fs::write(
        &values,
        "console:\n  enabled: true\n  networkPolicy:\n    from:\n      - namespaceSelector:\n          matchLabels:\n            kubernetes.io/metadata.name: ingress-nginx\n        podSelector:\n          matchLabels:\n            app.kubernetes.io/name: ingress-nginx\n",
    )
    .unwrap();
    let docs = render(
        "agentrun-operator",
        "agentrun-system",
        &["-f", values.to_str().unwrap()],
    );
    assert_eq!(
        named(&docs, "NetworkPolicy", NAME)["spec"]["ingress"][0]["from"],
        json!([{
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ingress-nginx"}},
        }])
    );
    let off = console(&["--set", "console.networkPolicy.enabled=false"]);
    assert!(of_kind(&off, "NetworkPolicy").is_empty());
}

fn repo_root_file(path: &str) -> std::path::PathBuf {
    agentrun_e2e::repo_root().join(path)
}
