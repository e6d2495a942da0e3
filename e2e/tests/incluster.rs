//! The operator in the cluster, as the README installs it: its image (`make image`)
//! imported into the real node, `helm install --wait` of charts/agentrun-operator with two
//! replicas and the admission policies, every sample of config/samples run on real
//! containers to the end, the leader's Pod deleted while a step runs, /metrics and /readyz
//! through the Service, then the uninstall docs/install.md describes, leaving nothing.
//!
//! ```text
//!   release namespace: Deployment (2 replicas on the node) ─ Lease ─ metrics Service
//!        │ (kubernetes Service, kube-proxy)
//!   runs namespace:    config/samples ─▶ step Pods on the node ─▶ payments.py (ledger)
//! ```
//!
//! Fails (never skips) without the node (`e2e/cluster node up`) or the image (`make image`).

use std::time::Duration;

use agentrun_e2e::support::chart::CHART;
use agentrun_e2e::support::incluster::{
    Release, effects_per_step, import_image, operator_image_tarball, sample_prerequisites, steps,
    uninstall_as_documented,
};
use agentrun_e2e::support::node::{
    NODE_NAME, Payments, place_namespace_on_node, require_node, run_probe,
};
use agentrun_e2e::support::processes::{OperatorConfig, log_dir};
use agentrun_e2e::support::scenario::{Scenario, phase, status, step_checkpoint};
use agentrun_e2e::{TestEnv, kubectl_ok, repo_root};
use agentrun_operator::api::{AgentRun, RunPhase, StepPhase};
use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use kube::{Api, Client, ResourceExt};
use serde_json::json;

/// Real containers start in seconds, but the machine is shared with builds.
const RUN_TIMEOUT: Duration = Duration::from_secs(300);
const LEADER_TIMEOUT: Duration = Duration::from_secs(90);
/// The sample runs, each to finish Succeeded.
const SAMPLES: &[&str] = &[
    "email-triage",
    "evict-demo",
    "expense-ex-77",
    "expert-review",
    "refund-order-4711",
    "return-4711",
];

#[tokio::test]
async fn chart_on_the_node_runs_the_samples_survives_its_leader_and_uninstalls_clean() {
    let client = agentrun_e2e::client().await;
    require_node(&client).await;
    import_image(&operator_image_tarball()).await;

    // The release's namespace, and the runs' (a scenario with no operator process).
    let system = TestEnv::new("incluster-system").await;
    let runs_env = TestEnv::new("incluster-runs").await;
    for ns in [system.namespace(), runs_env.namespace()] {
        place_namespace_on_node(&client, ns).await;
    }
    let ns = runs_env.namespace().to_owned();
    let s = Scenario {
        ledger_path: log_dir(&ns).join("ledger.jsonl"),
        operator_config: OperatorConfig::new(&ns),
        env: Some(runs_env),
        operator: None,
        simkubelet: None,
    };

    // helm install --wait, as the README says, with two replicas.
    let mut release = Release::for_namespace(system.namespace());
    release.install(&repo_root().join(CHART), &[]).await;
    let pods = release.pods(&client).await;
    let image = format!(
        "ghcr.io/agentrun-dev/agentrun-operator:{}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(pods.len(), 2, "{:?}", names(&pods));
    for p in &pods {
        let spec = p.spec.as_ref().expect("a Pod spec");
        assert_eq!(
            spec.node_name.as_deref(),
            Some(NODE_NAME),
            "{}",
            p.name_any()
        );
        assert_eq!(spec.containers[0].image.as_deref(), Some(image.as_str()));
    }
    let leader = release.wait_leader(&client, None, LEADER_TIMEOUT).await;

    // Every sample, as `kubectl apply -k config/samples` applies them.
    let payments = Payments::start(&ns, 20.0).await;
    sample_prerequisites(&client, &ns, &payments).await;
    let samples = repo_root().join("config/samples");
    kubectl_ok([
        "apply".as_ref(),
        "-n".as_ref(),
        ns.as_ref(),
        "-k".as_ref(),
        samples.as_os_str(),
    ])
    .await;

    // The refund's gate; then its leader is deleted while issue-refund runs.
    let gate = s
        .approval_of("refund-order-4711", Some("issue-refund"), RUN_TIMEOUT)
        .await;
    s.decide(&gate, "Approved", "checked the photos").await;
    let (_, step_pod) = s
        .wait_step_running("refund-order-4711", "issue-refund", RUN_TIMEOUT)
        .await;
    let before = s.runs().get("refund-order-4711").await.expect("the run");
    assert_eq!(
        step_checkpoint(&before, "issue-refund").phase,
        StepPhase::Running,
        "issue-refund runs when its operator goes"
    );
    let created_by = s
        .pods()
        .get(&step_pod)
        .await
        .expect("the step Pod")
        .annotations()
        .get("agentrun.dev/leader")
        .cloned();
    assert_eq!(created_by.as_deref(), Some(leader.as_str()));
    let deleted = std::time::Instant::now();
    Api::<Pod>::namespaced(client.clone(), system.namespace())
        .delete(&leader, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting the leader's Pod {leader}: {e}"));
    let successor = release
        .wait_leader(&client, Some(&leader), LEADER_TIMEOUT)
        .await;
    // The standby, or the Pod the Deployment started in the leader's place: whichever
    // takes the Lease first once the deleted leader's term is over.
    eprintln!(
        "leader {leader} deleted; {successor} took over after {:?} ({})",
        deleted.elapsed(),
        if names(&pods).contains(&successor) {
            "the standby"
        } else {
            "the replacement"
        }
    );

    // The expense's three gates and the return's scan.
    for gate in ["manager-approval", "budget-check", "compliance-check"] {
        let apv = s
            .approval_of("expense-ex-77", Some(gate), RUN_TIMEOUT)
            .await;
        s.decide(&apv, "Approved", "within policy").await;
    }
    let waiting = s
        .wait_run("return-4711", "waiting for the scan", RUN_TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.name == "parcel-received" && c.phase == StepPhase::Waiting)
        })
        .await;
    let signal = step_checkpoint(&waiting, "parcel-received")
        .signal
        .expect("the Signal");
    let scan = json!({"spec": {"id": "scan-0042", "data": {"condition": "damaged"}}});
    kubectl_ok([
        "-n",
        &ns,
        "patch",
        "signal",
        &signal,
        "--type",
        "merge",
        "-p",
        &scan.to_string(),
    ])
    .await;

    let mut finished = Vec::new();
    for name in SAMPLES {
        let run = s.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(
            phase(&run),
            Some(RunPhase::Succeeded),
            "{name}: {}",
            serde_json::to_string_pretty(&run.status).unwrap_or_default()
        );
        finished.push(run);
    }
    // The step that ran across the change of leader was recorded once, by the successor.
    let refund = by_name(&finished, "refund-order-4711");
    let issue = step_checkpoint(refund, "issue-refund");
    assert_eq!(
        (issue.attempt, issue.pod.as_deref()),
        (1, Some(step_pod.as_str()))
    );
    assert_eq!(
        issue.result.as_ref().expect("a result")["state"],
        "succeeded"
    );

    // Every effect once, per logical step, as the payments service saw them.
    let ledger = payments.ledger().await;
    assert_eq!(
        effects_per_step(&ledger, &finished),
        steps(&[
            ("evict-demo", "issue-refund", 1),
            ("expense-ex-77", "reimburse", 1),
            ("refund-order-4711", "issue-refund", 1),
            ("refund-order-4711", "notify-customer", 1),
            ("return-4711", "notify-customer", 1),
        ]),
        "ledger: {ledger}"
    );
    for (key, n) in ledger["requestsByKey"].as_object().expect("requestsByKey") {
        assert_eq!(n, &json!(1), "{key} was sent {n} times; ledger: {ledger}");
    }

    metrics_and_readyz_answer_through_the_service(&client, &release, &ns).await;
    uninstall_as_documented(&client, &mut release, &ns).await;
    s.finish().await;
    system.cleanup().await;
}

fn by_name<'a>(runs: &'a [AgentRun], name: &str) -> &'a AgentRun {
    runs.iter()
        .find(|r| r.name_any() == name)
        .unwrap_or_else(|| panic!("no run {name}"))
}

fn names(pods: &[Pod]) -> Vec<String> {
    pods.iter().map(ResourceExt::name_any).collect()
}

/// A Pod in the runs' namespace asks the release's Service by its DNS name, as Prometheus
/// and a probe in the cluster would: /metrics (the operator's families) and /readyz.
async fn metrics_and_readyz_answer_through_the_service(
    client: &Client,
    release: &Release,
    namespace: &str,
) {
    let service = format!("{}-metrics.{}.svc", release.name, release.namespace);
    let script = format!(
        r##"
import json, time, urllib.request
def get(url):
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
m, metrics = get("http://{service}:8080/metrics")
r, ready = get("http://{service}:8081/readyz")
families = sorted({{l.split()[2] for l in metrics.splitlines() if l.startswith("# TYPE agentrun_leader ")}})
open("/dev/termination-log", "w").write(json.dumps(
    {{"metrics": m, "families": families, "readyz": r, "body": ready}}))
"##
    );
    let out = run_probe(client, namespace, &script, json!({}), json!([])).await;
    assert_eq!(
        out,
        json!({"metrics": 200, "families": ["agentrun_leader"], "readyz": 200, "body": "ok"})
    );
}
