//! Services and cluster DNS on the real local node (`e2e/cluster node up`), as every
//! cluster has them: kube-proxy (nftables) turns a ClusterIP into its endpoints, CoreDNS
//! answers for cluster.local behind the kube-dns Service (10.0.0.10).
//!
//! ```text
//!   probe Pod ──DNS──▶ 10.0.0.10:53 ─kube-proxy─▶ CoreDNS (10.213.0.1:53, host process)
//!       │
//!       ├─▶ kubernetes.default.svc:443 (10.0.0.1) ─kube-proxy─▶ kube-apiserver (host address)
//!       └─▶ payments:8080 (Service) ─kube-proxy─▶ payments Pod (Deployment, deploy.yaml)
//! ```
//!
//! Every test fails (never skips) when the node is missing. The last one stops the node and
//! starts it again: the others hold the node (a shared lock) while they use it.

use std::path::Path;
use std::time::Duration;

use agentrun_e2e::support::journal::JOURNAL_WRITER_ENV;
use agentrun_e2e::support::node::{
    NODE_NAME, e2e_dir, node_scenario, place_namespace_on_node, require_node, run_probe,
};
use agentrun_e2e::support::policies::{Policies, wait_enforced};
use agentrun_e2e::support::scenario::{phase, step_checkpoint};
use agentrun_e2e::{TestEnv, kubectl_ok, repo_root, wait_for};
use agentrun_operator::api::RunPhase;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::RwLock;

/// Pods start in seconds, but the machine is shared with builds.
const POD_TIMEOUT: Duration = Duration::from_secs(180);
const RUN_TIMEOUT: Duration = Duration::from_secs(240);

/// Held shared by the tests that use the node, exclusively by the one that restarts it.
static NODE: RwLock<()> = RwLock::const_new(());

/// Applies examples/refund-agent/deploy.yaml as it is (its comment's command) and waits
/// until the payments Deployment has an available replica.
async fn deploy_payments(client: &Client, namespace: &str) {
    let manifest = repo_root().join("examples/refund-agent/deploy.yaml");
    apply(namespace, &manifest).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    wait_for(
        &deployments,
        "payments",
        |d: Option<&Deployment>| {
            d.and_then(|d| d.status.as_ref())
                .and_then(|s| s.available_replicas)
                == Some(1)
        },
        POD_TIMEOUT,
    )
    .await;
    // The ReplicaSet's Pod runs for real, on the node.
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let listed = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=payments"))
        .await
        .expect("listing the payments Pods");
    let nodes: Vec<_> = listed
        .items
        .iter()
        .map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
        .collect();
    assert_eq!(nodes, vec![Some(NODE_NAME.to_owned())], "payments Pods");
}

async fn apply(namespace: &str, file: &Path) {
    kubectl_ok([
        "apply".as_ref(),
        "-n".as_ref(),
        namespace.as_ref(),
        "-f".as_ref(),
        file.as_os_str(),
    ])
    .await;
}

/// A Pod resolves the apiserver's Service by its full name and gets an answer from it on
/// 10.0.0.1:443 through kube-proxy, verified with the plane's CA (kube-root-ca.crt).
#[tokio::test]
async fn pod_reaches_the_apiserver_through_the_kubernetes_service_by_name() {
    let _node = NODE.read().await;
    let env = TestEnv::new("node-svc-kubernetes").await;
    require_node(&env.client()).await;
    let script = r#"
import json, socket, ssl, urllib.request
out = {"address": socket.gethostbyname("kubernetes.default.svc.cluster.local"),
       "nameservers": [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")]}
ctx = ssl.create_default_context(cafile="/ca/ca.crt")
# The short name goes through the resolv.conf search path.
with urllib.request.urlopen("https://kubernetes.default.svc/version", context=ctx, timeout=10) as r:
    out["status"] = r.status
    out["gitVersion"] = json.load(r)["gitVersion"]
open("/dev/termination-log", "w").write(json.dumps(out))
"#;
    let out = run_probe(
        &env.client(),
        env.namespace(),
        script,
        json!({"volumeMounts": [{"name": "ca", "mountPath": "/ca"}]}),
        json!([{"name": "ca", "configMap": {"name": "kube-root-ca.crt"}}]),
    )
    .await;
    assert_eq!(
        out,
        json!({"address": "10.0.0.1", "nameservers": ["10.0.0.10"], "status": 200,
               "gitVersion": "v1.36.3"})
    );
    env.cleanup().await;
}

/// examples/refund-agent/deploy.yaml as it is: its Deployment runs the payments service
/// on the node, and another Pod reaches it by the name the ConfigMap gives the samples
/// (PAYMENTS_API_URL=http://payments:8080).
#[tokio::test]
async fn pod_reaches_the_example_payments_deployment_by_service_name() {
    let _node = NODE.read().await;
    let env = TestEnv::new("node-svc-payments").await;
    let client = env.client();
    require_node(&client).await;
    place_namespace_on_node(&client, env.namespace()).await;
    deploy_payments(&client, env.namespace()).await;
    // kube-proxy programs the Service a moment after the EndpointSlice changes.
    let script = r#"
import json, os, time, urllib.request
url = os.environ["PAYMENTS_API_URL"] + "/healthz"
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            out = {"url": url, "status": r.status, "body": json.load(r)}
            break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
open("/dev/termination-log", "w").write(json.dumps(out))
"#;
    let out = run_probe(
        &client,
        env.namespace(),
        script,
        json!({"envFrom": [{"configMapRef": {"name": "refund-agent"}}]}),
        json!([]),
    )
    .await;
    assert_eq!(
        out,
        json!({"url": "http://payments:8080/healthz", "status": 200, "body": {"ok": true}})
    );
    env.cleanup().await;
}

/// The refund sample as its comment tells a user to run it: deploy.yaml, then
/// config/samples/agentrun_refund.yaml. Its steps reach the payments Deployment by the
/// Service name in the ConfigMap, and the money moves there.
#[tokio::test]
async fn refund_sample_reaches_the_payments_service_by_name() {
    let _node = NODE.read().await;
    let s = node_scenario("node-svc-refund").await;
    let client = s.env.as_ref().expect("a scenario has its env").client();
    place_namespace_on_node(&client, s.namespace()).await;
    deploy_payments(&client, s.namespace()).await;
    apply(
        s.namespace(),
        &repo_root().join("config/samples/agentrun_refund.yaml"),
    )
    .await;
    let waiting = s
        .wait_run(
            "refund-order-4711",
            "waiting for approval",
            RUN_TIMEOUT,
            |r| phase(r) == Some(RunPhase::WaitingForApproval),
        )
        .await;
    // lookup-order read the order from the payments service, by name.
    assert_eq!(
        step_checkpoint(&waiting, "lookup-order").result,
        Some(
            json!({"orderId": 4711, "amount": "23.90 EUR", "status": "delivered",
                    "customer": "c-1029", "note": "item arrived damaged"})
        )
    );
    let approval = step_checkpoint(&waiting, "issue-refund")
        .approval
        .expect("issue-refund names its Approval");
    s.decide(&approval, "Approved", "checked the photos").await;
    let run = s.wait_finished("refund-order-4711", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    // deploy.yaml's service settles a refund after 20 s; the step waited for it.
    assert_eq!(
        step_checkpoint(&run, "issue-refund").result,
        Some(
            json!({"refundId": "re_0001", "orderId": 4711, "amount": "23.90 EUR",
                    "state": "succeeded", "replayed": false})
        )
    );
    s.finish().await;
}

/// The journaled refund loop sample as its comment tells a user to run it: deploy.yaml
/// (payments and the mock model, by Service name), then
/// config/samples/agentrun_refund_loop.yaml, with the chart's policies and roles in the
/// namespace: the operator binds the sample's ServiceAccount to the journal-writer role,
/// the `openai` loop journals its calls, and the money moves once.
#[tokio::test]
async fn refund_loop_sample_journals_its_calls_and_reaches_the_mock_model_by_name() {
    let _node = NODE.read().await;
    let mut s = node_scenario("node-svc-loop").await;
    let client = s.env.as_ref().expect("a scenario has its env").client();
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    wait_enforced(&ns, true).await;
    s.kill_operator().await;
    s.operator_config.extra_env.push((
        JOURNAL_WRITER_ENV.into(),
        format!("{}-journal-writer", p.release),
    ));
    s.start_operator(None);
    place_namespace_on_node(&client, &ns).await;
    deploy_payments(&client, &ns).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    wait_for(
        &deployments,
        "mock-model",
        |d: Option<&Deployment>| {
            d.and_then(|d| d.status.as_ref())
                .and_then(|s| s.available_replicas)
                == Some(1)
        },
        POD_TIMEOUT,
    )
    .await;
    apply(
        &ns,
        &repo_root().join("config/samples/agentrun_refund_loop.yaml"),
    )
    .await;
    let run = s.wait_finished("refund-loop-4711", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let c = step_checkpoint(&run, "refund");
    let journal = c.journal.expect("the step's journal summary");
    // Six model turns and six tool calls (examples/mock-model's refund scenario).
    assert_eq!(journal.calls, 12, "{journal:?}");
    assert!(journal.tokens.is_some_and(|t| t.input > 0), "{journal:?}");
    assert_eq!(
        run.status.as_ref().map(|s| s.tokens_used),
        journal.tokens.map(|t| t.input + t.output),
        "the step's tokens are its journal's"
    );
    s.finish().await;
}

/// The PIDs in the node's pidfiles of the processes `node up` adds.
fn service_pids() -> Vec<(&'static str, u32)> {
    let state = e2e_dir().join("node/state");
    ["kube-proxy", "coredns", "workload-controllers"]
        .into_iter()
        .map(|name| {
            let file = state.join(format!("{name}.pid"));
            let pid = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{} ({e}): is the node up?", file.display()));
            (name, pid.trim().parse().expect("a PID"))
        })
        .collect()
}

/// The command line of process `pid`, if it runs.
fn cmdline(pid: u32) -> Option<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
}

/// Every running process whose command line names `needle`.
fn processes_naming(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("reading /proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        if let Some(cmd) = cmdline(pid).filter(|c| c.contains(needle)) {
            found.push(format!("{pid}: {cmd}"));
        }
    }
    found
}

async fn cluster(args: &[&str]) -> String {
    let out = tokio::process::Command::new(repo_root().join("e2e/cluster"))
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("running e2e/cluster {args:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "e2e/cluster {args:?} failed:\n{text}");
    text
}

async fn nft_has_kube_proxy_table() -> bool {
    tokio::process::Command::new("nft")
        .args(["list", "table", "ip", "kube-proxy"])
        .output()
        .await
        .expect("running nft")
        .status
        .success()
}

/// `e2e/cluster node down` stops kube-proxy, CoreDNS and the workload controllers and
/// removes kube-proxy's rules; `node up` brings them back (the node is left up).
#[tokio::test]
async fn node_down_stops_kube_proxy_and_coredns_and_up_restarts_them() {
    let _node = NODE.write().await;
    let client = agentrun_e2e::client().await;
    require_node(&client).await;
    let before = service_pids();
    for (name, pid) in &before {
        let cmd = cmdline(*pid).unwrap_or_else(|| panic!("{name} (PID {pid}) is not running"));
        assert!(cmd.contains(&format!("/{}", binary(name))), "{name}: {cmd}");
    }
    assert!(
        nft_has_kube_proxy_table().await,
        "kube-proxy made no nftables table"
    );
    let node_dir = e2e_dir().join("node");
    let node_dir = node_dir.to_str().expect("a UTF-8 path");

    cluster(&["node", "down"]).await;
    for (name, pid) in &before {
        assert_eq!(cmdline(*pid), None, "{name} (PID {pid}) outlived node down");
    }
    for binary in ["kube-proxy", "coredns"] {
        let left: Vec<_> = processes_naming(node_dir)
            .into_iter()
            .filter(|p| p.contains(binary))
            .collect();
        assert!(left.is_empty(), "{binary} processes left: {left:#?}");
    }
    assert!(
        !nft_has_kube_proxy_table().await,
        "kube-proxy's nftables table outlived node down"
    );

    cluster(&["node", "up"]).await;
    require_node(&client).await;
    for (name, pid) in service_pids() {
        assert!(cmdline(pid).is_some(), "{name} did not come back");
    }
    assert!(nft_has_kube_proxy_table().await);
}

fn binary(process: &str) -> &str {
    match process {
        "workload-controllers" => "kube-controller-manager",
        other => other,
    }
}
