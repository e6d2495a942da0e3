//! An upgrade with runs in flight, as docs/install.md, "Upgrading", tells a user to do it:
//! the chart and the operator image of an earlier commit (`make test-upgrade` builds them
//! from a worktree of UPGRADE_FROM) installed on the real node with two replicas; runs
//! mid-step, waiting for an approval and in backoff; the new CRDs applied, then `helm
//! upgrade` to this checkout's chart and image. Every run finishes, each effect once, the
//! pending approval still decides, and the CRD change follows docs/operations.md, "API
//! versions: what may change".
//!
//! ```text
//!   UPGRADE_FROM: chart + image :VERSION-old ─▶ runs in flight (old CRDs, old operator)
//!       kubectl apply --server-side crds/ ─▶ helm upgrade --wait ─▶ image :VERSION (HEAD)
//!   payments.py (the ledger): one refund, one notification per logical step
//! ```
//!
//! Needs `--features upgrade` and AGENTRUN_UPGRADE_FROM_SRC / AGENTRUN_UPGRADE_FROM_IMAGE
//! (`make test-upgrade` sets all three); fails, never skips, without them, the node or the
//! images. It deletes and re-creates the plane's agentrun.dev CRDs: run it on a plane of
//! its own, as `make test-upgrade` does.

// Without the feature (`cargo test --test '*'`, make test) this file has no test.
#![cfg(feature = "upgrade")]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentrun_e2e::support::chart::{CHART, GENERATED_CRDS, kubectl_cmd, ok_async};
use agentrun_e2e::support::incluster::{
    Release, effects_per_step, import_image, operator_image_tarball, sample_prerequisites, steps,
    uninstall_as_documented,
};
use agentrun_e2e::support::node::{Payments, place_namespace_on_node, require_node};
use agentrun_e2e::support::processes::{OperatorConfig, log_dir};
use agentrun_e2e::support::scenario::{Scenario, phase, status, step_checkpoint};
use agentrun_e2e::{TestEnv, kubectl, kubectl_ok, repo_root, wait_for_deleted};
use agentrun_operator::api::{AgentRun, RunPhase, StepPhase};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(300);
const LEADER_TIMEOUT: Duration = Duration::from_secs(90);
const OLD_TAG_SUFFIX: &str = "upgrade-from";

fn required_env(name: &str) -> PathBuf {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{name} is not set: run `make test-upgrade`"))
}

#[tokio::test]
async fn runs_in_flight_finish_across_an_upgrade_from_an_earlier_release() {
    let old_src = required_env("AGENTRUN_UPGRADE_FROM_SRC");
    let old_image = required_env("AGENTRUN_UPGRADE_FROM_IMAGE");
    let client = agentrun_e2e::client().await;
    require_node(&client).await;
    let version = env!("CARGO_PKG_VERSION");
    let old_ref = format!("ghcr.io/agentrun-dev/agentrun-operator:{version}-{OLD_TAG_SUFFIX}");
    // The earlier image under a tag of its own, then this checkout's under VERSION.
    import_image_as(&old_image, &old_ref).await;
    import_image(&operator_image_tarball()).await;

    let system = TestEnv::new("upgrade-system").await;
    let runs_env = TestEnv::new("upgrade-runs").await;
    for ns in [system.namespace(), runs_env.namespace()] {
        place_namespace_on_node(&client, ns).await;
    }
    // The earlier release's CRDs, as its `helm install` creates them on a new cluster.
    delete_agentrun_crds(&client).await;
    let mut release = Release::for_namespace(system.namespace());
    release
        .install(
            &old_src.join(CHART),
            &[
                "--set",
                &format!("image.tag={version}-{OLD_TAG_SUFFIX}"),
                "--wait=hookOnly",
            ],
        )
        .await;
    mount_token_for_the_earlier_chart(&client, &release).await;
    release.wait_rolled_out(&client, 2, RUN_TIMEOUT).await;
    let old_leader = release.wait_leader(&client, None, LEADER_TIMEOUT).await;
    let old_pods: Vec<String> = release
        .pods(&client)
        .await
        .iter()
        .map(|p| p.name_any())
        .collect();

    let ns = runs_env.namespace().to_owned();
    let s = Scenario {
        ledger_path: log_dir(&ns).join("ledger.jsonl"),
        operator_config: OperatorConfig::new(&ns),
        env: Some(runs_env),
        operator: None,
        simkubelet: None,
    };
    // Refunds settle after 45 s, so issue-refund is still running when the upgrade starts;
    // notifications fail (503) until after it, so a step is in backoff.
    let payments = Payments::start(&ns, 45.0).await;
    payments.outage(&["/notifications"]).await;
    sample_prerequisites(&client, &ns, &payments).await;
    let backoff_run = log_dir(&ns).join("notify-backoff.json");
    std::fs::write(&backoff_run, backoff_run_manifest().to_string()).expect("writing the run");
    let samples = repo_root().join("config/samples");
    for f in [
        samples.join("agentrun_evicted.yaml"),
        samples.join("agentrun_refund.yaml"),
        backoff_run,
    ] {
        kubectl_ok([
            "apply".as_ref(),
            "-n".as_ref(),
            ns.as_ref(),
            "-f".as_ref(),
            f.as_os_str(),
        ])
        .await;
    }

    // The three runs in flight under the earlier operator.
    let gate = s
        .approval_of("refund-order-4711", Some("issue-refund"), RUN_TIMEOUT)
        .await;
    let in_backoff = s
        .wait_run("notify-backoff", "in backoff", RUN_TIMEOUT, |r| {
            status(r).steps.iter().any(|c| {
                c.name == "notify-customer"
                    && c.phase == StepPhase::Pending
                    && c.failures >= 1
                    && c.next_attempt_at.is_some()
            })
        })
        .await;
    let (_, mid_step_pod) = s
        .wait_step_running("evict-demo", "issue-refund", RUN_TIMEOUT)
        .await;
    let failed_attempts = step_checkpoint(&in_backoff, "notify-customer").failures;

    // docs/install.md, "Upgrading": the CRDs first, then the chart.
    // Helm created the CRDs and owns their fields: without --force-conflicts, a field this
    // release changes (spec.steps' list type) is a conflict and nothing is applied.
    let unforced = kubectl_cmd()
        .args(["apply", "--server-side", "-f", GENERATED_CRDS])
        .output()
        .expect("running kubectl");
    let said = String::from_utf8_lossy(&unforced.stderr).into_owned();
    eprintln!("kubectl apply --server-side without --force-conflicts: {said}");
    assert!(
        !unforced.status.success() && said.contains("conflict"),
        "kubectl apply --server-side of the new CRDs without --force-conflicts: {said}"
    );
    let started = Instant::now();
    let mut apply = kubectl_cmd();
    apply.args([
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        GENERATED_CRDS,
    ]);
    ok_async(apply).await;
    // --force-conflicts only for the token volume this test patched into the earlier
    // Deployment (mount_token_for_the_earlier_chart): Helm takes it over from that patch.
    release
        .upgrade(&repo_root().join(CHART), &["--force-conflicts"])
        .await;
    eprintln!(
        "upgrade (CRDs and helm upgrade --wait): {:?}",
        started.elapsed()
    );
    release.wait_rolled_out(&client, 2, RUN_TIMEOUT).await;
    // The earlier operators finish their shutdown (terminationGracePeriodSeconds).
    let deadline = Instant::now() + Duration::from_secs(90);
    let new_pods = loop {
        let pods = release.pods(&client).await;
        if pods.iter().all(|p| !old_pods.contains(&p.name_any())) || Instant::now() > deadline {
            break pods;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let image = format!("ghcr.io/agentrun-dev/agentrun-operator:{version}");
    for p in &new_pods {
        assert!(
            !old_pods.contains(&p.name_any()),
            "{} outlived the upgrade",
            p.name_any()
        );
        let spec = p.spec.as_ref().expect("a Pod spec");
        assert_eq!(spec.containers[0].image.as_deref(), Some(image.as_str()));
    }
    let new_leader = release
        .wait_leader(&client, Some(&old_leader), LEADER_TIMEOUT)
        .await;

    // The issue-refund Pod the earlier operator started is still the step's attempt.
    let still = s.runs().get("evict-demo").await.expect("the run");
    let issue = step_checkpoint(&still, "issue-refund");
    assert_eq!(issue.pod.as_deref(), Some(mid_step_pod.as_str()));

    payments.outage(&[]).await;
    s.decide(&gate, "Approved", "decided after the upgrade")
        .await;
    let mut finished = Vec::new();
    for name in ["evict-demo", "refund-order-4711", "notify-backoff"] {
        let run = s.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(
            phase(&run),
            Some(RunPhase::Succeeded),
            "{name}: {}",
            serde_json::to_string_pretty(&run.status).unwrap_or_default()
        );
        finished.push(run);
    }
    let approval = s.approvals().get(&gate).await.expect("the Approval");
    let decided_by = approval
        .status
        .as_ref()
        .and_then(|st| st.decided_by.clone());
    assert!(
        decided_by.is_some(),
        "the decision names who made it: {:?}",
        approval.status
    );
    // The backoff step's attempt after the upgrade came from the new leader.
    let backoff = by_name(&finished, "notify-backoff");
    let notify = step_checkpoint(backoff, "notify-customer");
    assert!(notify.attempt > failed_attempts, "{notify:?}");
    let pod = s
        .pods()
        .get(notify.pod.as_deref().expect("a Pod"))
        .await
        .expect("its Pod");
    let leader_of_pod = pod.annotations().get("agentrun.dev/leader").cloned();
    assert!(
        new_pods.iter().any(|p| Some(p.name_any()) == leader_of_pod),
        "notify-customer's last attempt was created by {leader_of_pod:?}, not by the upgraded operator ({new_leader})"
    );

    let ledger = payments.ledger().await;
    assert_eq!(
        effects_per_step(&ledger, &finished),
        steps(&[
            ("evict-demo", "issue-refund", 1),
            ("notify-backoff", "notify-customer", 1),
            ("refund-order-4711", "issue-refund", 1),
            ("refund-order-4711", "notify-customer", 1),
        ]),
        "ledger: {ledger}"
    );
    for (key, n) in ledger["requestsByKey"].as_object().expect("requestsByKey") {
        assert_eq!(n, &json!(1), "{key} was sent {n} times; ledger: {ledger}");
    }

    crds_follow_the_written_policy(&client, &ns).await;
    uninstall_as_documented(&client, &mut release, &ns).await;
    s.finish().await;
    system.cleanup().await;
}

fn by_name<'a>(runs: &'a [AgentRun], name: &str) -> &'a AgentRun {
    runs.iter()
        .find(|r| r.name_any() == name)
        .unwrap_or_else(|| panic!("no run {name}"))
}

/// A run whose one effect fails while the provider is down and is retried after a backoff.
fn backoff_run_manifest() -> serde_json::Value {
    let container = |args: &[&str]| {
        json!({"image": agentrun_e2e::support::node::REFUND_AGENT_IMAGE,
               "imagePullPolicy": "IfNotPresent", "args": args,
               "envFrom": [{"configMapRef": {"name": "refund-agent"}}]})
    };
    json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "notify-backoff"},
        "spec": {
            "podTemplate": {"tolerations": [
                {"key": "agentrun.dev/node", "operator": "Exists", "effect": "NoSchedule"}]},
            "steps": [
                {"name": "lookup-order", "effect": "None", "timeout": "60s",
                 "container": container(&["lookup-order", "--order-id=4711"])},
                {"name": "notify-customer", "effect": "Idempotent", "timeout": "60s",
                 "retry": {"limit": 6, "backoff": {"initial": "20s", "max": "40s"}},
                 "container": container(&["notify-customer", "--template=refund-issued"])},
            ],
        },
    })
}

async fn import_image_as(tarball: &std::path::Path, reference: &str) {
    assert!(tarball.is_file(), "no image at {}", tarball.display());
    let out = tokio::process::Command::new(repo_root().join("e2e/cluster"))
        .args(["node", "import", "--as", reference])
        .arg(tarball)
        .output()
        .await
        .expect("running e2e/cluster node import");
    assert!(
        out.status.success(),
        "e2e/cluster node import --as {reference} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deletes every agentrun.dev CRD (and with them every object of theirs on the plane).
async fn delete_agentrun_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let ours: Vec<String> = crds
        .list(&ListParams::default())
        .await
        .expect("listing CRDs")
        .into_iter()
        .filter(|c| c.spec.group == "agentrun.dev")
        .map(|c| c.name_any())
        .collect();
    for name in &ours {
        crds.delete(name, &DeleteParams::default()).await.ok();
    }
    for name in &ours {
        wait_for_deleted(&crds, name, Duration::from_secs(120)).await;
    }
}

/// The earlier chart left the operator's API token to the ServiceAccount admission
/// plugin, which this plane does not run: its Deployment gets the same token volume the
/// current chart mounts, which `helm upgrade --force-conflicts` then takes over (a user's
/// upgrade needs no such flag: their earlier Deployment was never patched).
async fn mount_token_for_the_earlier_chart(client: &Client, release: &Release) {
    let patch = json!({"spec": {"template": {"spec": {
        "automountServiceAccountToken": false,
        "containers": [{"name": "operator", "volumeMounts": [{
            "name": "kube-api-access",
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": true}]}],
        "volumes": [{"name": "kube-api-access", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace",
                "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}],
    }}}});
    Api::<Deployment>::namespaced(client.clone(), &release.namespace)
        .patch(
            &release.name,
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
        .unwrap_or_else(|e| panic!("mounting the token in the earlier Deployment: {e}"));
}

/// docs/operations.md, "API versions: what may change": one version, stored as
/// v1alpha1; the new rule is in force for new objects (the old runs above were written
/// under the earlier schema and finished under this one).
async fn crds_follow_the_written_policy(client: &Client, namespace: &str) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [
        "agentruns.agentrun.dev",
        "approvals.agentrun.dev",
        "signals.agentrun.dev",
        "runrecords.agentrun.dev",
    ] {
        let crd = crds
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("CRD {name}: {e}"));
        let stored = crd
            .status
            .and_then(|s| s.stored_versions)
            .unwrap_or_default();
        assert_eq!(stored, vec!["v1alpha1".to_owned()], "{name}");
    }
    let duplicate = json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "twice", "namespace": namespace},
        "spec": {"steps": [
            {"name": "a", "container": {"image": "x"}},
            {"name": "a", "container": {"image": "y"}}]},
    });
    let file = log_dir(namespace).join("twice.json");
    std::fs::write(&file, duplicate.to_string()).expect("writing the run");
    let out = kubectl([
        "create".as_ref(),
        "--dry-run=server".as_ref(),
        "-f".as_ref(),
        file.as_os_str(),
    ])
    .await;
    assert!(
        !out.success() && out.stderr.contains("step names must be unique"),
        "a run with two steps named a: {}{}",
        out.stdout,
        out.stderr
    );
}
