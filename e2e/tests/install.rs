//! Installing the operator on the plane: the kustomize base applied with a
//! server-side dry run, a real `helm install` checked with
//! SubjectAccessReviews as the operator's ServiceAccount, and the operator
//! itself driving runs under exactly the chart's RBAC. The chart as rendered
//! is checked in `chart.rs`.
//!
//! ```text
//!   helm install ──▶ plane ──▶ SubjectAccessReview as the operator's ServiceAccount
//! ```
//!
//! Needs `e2e/cluster tools` (kubectl, helm) and the plane (`make
//! cluster-up`). Fails, never skips, when either is missing.

#![forbid(unsafe_code)]

use agentrun_e2e::support::chart::*;
use agentrun_e2e::{TestEnv, repo_root};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

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
        "customresourcedefinition.apiextensions.k8s.io/signals.agentrun.dev",
        "customresourcedefinition.apiextensions.k8s.io/runrecords.agentrun.dev",
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

    /// The release's `roles.prefix`: its people's and journal writer's
    /// ClusterRoles are named after it.
    fn roles_prefix(&self) -> String {
        format!(
            "agentrun-{}",
            self.namespace.rsplit('-').next().unwrap_or("x")
        )
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
        // Releases side by side: their people's ClusterRoles get their own
        // names, and their admission policies apply to their own namespace.
        .arg("--set")
        .arg(format!("roles.prefix={}", self.roles_prefix()))
        .arg("--set-json")
        .arg(format!(
            r#"admissionPolicies.namespaceSelector={{"matchLabels":{{"kubernetes.io/metadata.name":"{}"}}}}"#,
            self.namespace
        ))
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
    // It patches an Approval's finalizer (the notifier), never replaces one.
    ("update", "agentrun.dev", "approvals"),
    ("update", "agentrun.dev", "approvals/status"),
    // Senders send signals; the operator opens and closes them.
    ("patch", "agentrun.dev", "signals"),
    ("update", "agentrun.dev", "signals"),
    ("delete", "agentrun.dev", "signals"),
    // A record is history: written once, never changed.
    ("update", "agentrun.dev", "runrecords"),
    ("patch", "agentrun.dev", "runrecords"),
    ("delete", "events.k8s.io", "events"),
    // Step Pods write their journals; the operator only reads them and settles calls.
    ("create", "agentrun.dev", "stepjournals"),
    ("update", "agentrun.dev", "stepjournals"),
    ("delete", "agentrun.dev", "stepjournals"),
    // It binds the journal writer's role; it never removes or rewrites a binding.
    ("delete", "rbac.authorization.k8s.io", "rolebindings"),
    ("update", "rbac.authorization.k8s.io", "rolebindings"),
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
        operator_grants_for(&release.roles_prefix()),
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
        operator_grants_for(&release.roles_prefix())
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
/// (impersonation), with leader election and notifications, drives a gated
/// run to success (telling the channel of the request and the decision) and
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
        .install(&[
            "--set",
            &format!("watchNamespace={ns}"),
            "--set",
            "notifications.secretName=agentrun-channels",
        ])
        .await;
    // The API server loads the chart's admission policies a moment after
    // they exist, the validating before the mutating at times: a run
    // created in between is refused for the creator the mutating one did
    // not stamp yet.
    agentrun_e2e::support::policies::wait_enforced(&ns, true).await;
    // Notifications: the chart lets the operator read its one channel Secret.
    let receiver = agentrun_e2e::support::receiver::Receiver::start().await;
    let channels = format!(
        "channels:\n- {{name: team, url: '{}', default: true}}\n",
        receiver.url("/team")
    );
    ok_async({
        let mut cmd = kubectl_cmd();
        cmd.args([
            "create",
            "secret",
            "generic",
            "agentrun-channels",
            "-n",
            &ns,
        ])
        .arg(format!("--from-literal=channels.yaml={channels}"));
        cmd
    })
    .await;
    s.operator_config.extra_env.extend([
        (
            "AGENTRUN_NOTIFY_SECRET".to_owned(),
            format!("{ns}/agentrun-channels"),
        ),
        (
            "AGENTRUN_NOTIFY_ALLOW_CIDR".to_owned(),
            "127.0.0.1/32".to_owned(),
        ),
        // The release's journal-writer ClusterRole, as its Deployment passes it.
        (
            agentrun_e2e::support::journal::JOURNAL_WRITER_ENV.to_owned(),
            format!("{}-journal-writer", release.roles_prefix()),
        ),
    ]);

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
    // The request went out, read from the Secret under the chart's Role.
    receiver.wait_for("/team", 1, TIMEOUT).await;
    s.decide(&approval, "Approved", "fine").await;
    receiver.wait_for("/team", 2, TIMEOUT).await;
    let run = s.wait_finished("gated", TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    // TTL: the operator deletes the finished run itself.
    wait_for_deleted(&s.runs(), "gated", TIMEOUT).await;

    // A journaled loop loses its Pod between its refund call and the
    // answer: the probe finds the refund, and the operator settles the call
    // in the journal's status under the chart's Role (D19).
    let mut agent = sim_step(
        "agent",
        "NonIdempotent",
        json!({"result": {"ok": true}, "journal": {"calls": [
            {"kind": "Model"}, {"kind": "Tool", "actMs": 50, "recordMs": 20000},
        ]}}),
    );
    agent["journal"] = json!({});
    agent["verify"] = json!({
        "image": "registry.example/agent-step:1",
        "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "probe": {"result": {"refund": "rf-1"}}}).to_string()}],
    });
    s.create_run("looped", json!({"steps": [agent]})).await;
    let (_, pod) = s.wait_step_running("looped", "agent", TIMEOUT).await;
    let made = || {
        s.ledger()
            .calls()
            .any(|(e, c)| e.run.as_deref() == Some("looped") && c.id == "call_1")
    };
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !made() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "call_1 was never made"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.pods()
        .delete(&pod, &Default::default())
        .await
        .expect("deleting the loop's Pod");
    let looped = s.wait_finished("looped", TIMEOUT).await;
    assert_eq!(
        phase(&looped),
        Some(RunPhase::Succeeded),
        "{:?}",
        looped.status
    );
    let outcomes = ok_async({
        let mut cmd = kubectl_cmd();
        cmd.args(["get", "sj", "-n", &ns])
            .args(["-o", "jsonpath={.items[*].status.settlements[*].outcome}"]);
        cmd
    })
    .await;
    assert_eq!(outcomes.trim(), "Applied", "settled by the operator");

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
    // Searched for refusals only once it shows lines it must have: a missing
    // or wrong log never passes for a clean one.
    let log = std::fs::read_to_string(&log_path).expect("the operator's log");
    assert!(
        log.contains("acquired the leader lease") && log.contains("created step pod"),
        "the operator's log lacks the lines of the run it just did:\n{log}"
    );
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
        agentrun_e2e::support::policies::wait_enforced(&ns, true).await;

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
