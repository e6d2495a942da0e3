//! The real local node (`e2e/cluster node up`): a kubelet with containerd and runc that
//! runs step Pods for real, beside the plane's simulated kubelets.
//!
//! ```text
//!   node scenario (namespace, operator; no simkubelet)
//!     ├─ AgentRun podTemplate: nodeSelector agentrun.dev/node=real + toleration of its taint
//!     │     └─▶ kube-scheduler binds the step Pod to agentrun-node ─▶ kubelet ─▶ containerd
//!     └─ payments.py on the node bridge's gateway (10.213.0.1), reached by the step Pods
//! ```
//!
//! simkubelet ignores Pods that tolerate the node's taint or are bound to a node, so the
//! two never report the same Pod. Without a node every helper here panics and says how to
//! start one: node tests never pass by skipping.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::process::Command;

use super::env::repo_root;
use super::http::http_get;
use super::processes::{Process, log_dir};

pub const NODE_NAME: &str = "agentrun-node";
/// Label and taint key of the node (value `real`).
pub const NODE_KEY: &str = "agentrun.dev/node";
/// The node bridge's gateway: this machine, as the Pods see it.
pub const GATEWAY: &str = "10.213.0.1";
pub const REFUND_AGENT_IMAGE: &str = "agentrun.local/refund-agent:0.1.0";
pub const NODE_PROBE_IMAGE: &str = "agentrun.local/node-probe:0.1.0";

const HOW: &str = "start it with `e2e/cluster up && e2e/cluster node up` (root; make test does)";

/// Panics unless the node is registered, Ready, and its kubelet renewed its Lease within
/// the last 40 s (there is no node-lifecycle controller to mark a dead kubelet NotReady).
pub async fn require_node(client: &Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .get_opt(NODE_NAME)
        .await
        .unwrap_or_else(|e| panic!("reading node {NODE_NAME}: {e}"))
        .unwrap_or_else(|| panic!("no node {NODE_NAME} on the plane: {HOW}"));
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.clone());
    assert_eq!(
        ready.as_deref(),
        Some("True"),
        "node {NODE_NAME} is not Ready: {HOW}"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let renewed = leases
        .get_opt(NODE_NAME)
        .await
        .unwrap_or_else(|e| panic!("reading the node lease: {e}"))
        .and_then(|l| l.spec.and_then(|s| s.renew_time))
        .unwrap_or_else(|| panic!("node {NODE_NAME} has no heartbeat lease: {HOW}"));
    let age = jiff::Timestamp::now().duration_since(renewed.0);
    assert!(
        age < jiff::SignedDuration::from_secs(40),
        "node {NODE_NAME}'s kubelet last renewed its lease {age:?} ago (dead?): {HOW}"
    );
}

/// The podTemplate that puts a run's step Pods on the real node.
pub fn pod_template() -> Value {
    json!({
        "nodeSelector": {NODE_KEY: "real"},
        "tolerations": [{"key": NODE_KEY, "operator": "Equal", "value": "real", "effect": "NoSchedule"}],
    })
}

/// The example's payments service on the bridge gateway, on a port of its own.
pub struct Payments {
    pub process: Process,
    pub port: u16,
}

impl Payments {
    /// Starts `examples/refund-agent/payments.py`; new refunds stay pending `settle_seconds`.
    pub async fn start(namespace: &str, settle_seconds: f64) -> Payments {
        let settle = settle_seconds.to_string();
        let (process, port) = start_on_gateway(
            namespace,
            "payments",
            "examples/refund-agent/payments.py",
            &["--settle-seconds", &settle],
        )
        .await;
        Payments { process, port }
    }

    /// The URL step Pods use.
    pub fn url(&self) -> String {
        format!("http://{GATEWAY}:{}", self.port)
    }

    /// Everything the service recorded: refunds, notifications, requests per key.
    pub async fn ledger(&self) -> Value {
        let body = self
            .get("/ledger")
            .await
            .unwrap_or_else(|e| panic!("GET /ledger: {e}\n{}", self.process.log_tail(20)));
        serde_json::from_str(&body).expect("the ledger is JSON")
    }

    /// The example refund agent's container running `args`, pointed at this service.
    pub fn agent(&self, args: &[&str]) -> Value {
        container(
            REFUND_AGENT_IMAGE,
            args,
            json!([{"name": "PAYMENTS_API_URL", "value": self.url()}]),
        )
    }

    /// Waits (up to 60 s) until the service has made a refund; its idempotency key.
    pub async fn wait_for_refund(&self) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(key) = self.ledger().await["refunds"][0]["idempotencyKey"].as_str() {
                return key.to_owned();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no refund was requested\n{}",
                self.process.log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Takes the provider down for requests under `paths` (503), or brings
    /// it back (`&[]`).
    pub async fn outage(&self, paths: &[&str]) {
        self.put("/outage", paths).await
    }

    /// Changes under `paths` are made and their answers held until the next
    /// call (`&[]` releases them): a call that acted and whose caller was
    /// lost before it heard.
    pub async fn stall(&self, paths: &[&str]) {
        self.put("/stall", paths).await
    }

    async fn put(&self, path: &str, paths: &[&str]) {
        let addr = SocketAddr::new(GATEWAY.parse().expect("an IPv4 address"), self.port);
        let body = serde_json::json!({ "paths": paths }).to_string();
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            super::http::http_request(addr, "PUT", path, Some(&body)),
        )
        .await;
        assert!(
            matches!(answer, Ok(Ok((200, _)))),
            "PUT {path}: {answer:?}\n{}",
            self.process.log_tail(20)
        );
    }

    async fn get(&self, path: &str) -> Result<String, String> {
        gateway_get(self.port, path).await
    }
}

/// Starts `script` (Python, from the repo) listening on the bridge gateway on
/// a port of its own, with `args`, and waits (up to 20 s) until it answers
/// `GET /healthz`: a service the node's Pods reach at `GATEWAY`.
async fn start_on_gateway(
    namespace: &str,
    name: &str,
    script: &str,
    args: &[&str],
) -> (Process, u16) {
    let port = std::net::TcpListener::bind((GATEWAY, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("binding {GATEWAY} (is the node's bridge up? {HOW}): {e}"));
    let mut cmd = Command::new("python3");
    cmd.arg(repo_root().join(script))
        .arg("--listen")
        .arg(format!("{GATEWAY}:{port}"))
        .args(args);
    let process = Process::start(name, cmd, log_dir(namespace).join(format!("{name}.log")))
        .unwrap_or_else(|e| panic!("starting {script}: {e}"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while gateway_get(port, "/healthz").await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} did not start\n{}",
            process.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (process, port)
}

/// `GET path` of a service on the bridge gateway: the body of a 200, else why not.
async fn gateway_get(port: u16, path: &str) -> Result<String, String> {
    let addr = SocketAddr::new(GATEWAY.parse().expect("an IPv4 address"), port);
    match tokio::time::timeout(Duration::from_secs(5), http_get(addr, path)).await {
        Ok(Ok((200, body))) => Ok(body),
        Ok(Ok((code, body))) => Err(format!("HTTP {code}: {body}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer within 5 s".into()),
    }
}

/// The example's scripted OpenAI-compatible model (examples/mock-model) on the bridge
/// gateway, on a port of its own: it logs every request it answers.
pub struct MockModel {
    pub process: Process,
    pub port: u16,
}

impl MockModel {
    /// Starts `examples/mock-model/server.py` with its refund scenario.
    pub async fn start(namespace: &str) -> MockModel {
        let (process, port) = start_on_gateway(
            namespace,
            "mock-model",
            "examples/mock-model/server.py",
            &["--scenario", "refund"],
        )
        .await;
        MockModel { process, port }
    }

    /// The base URL step Pods use (`OPENAI_BASE_URL`).
    pub fn url(&self) -> String {
        format!("http://{GATEWAY}:{}/v1", self.port)
    }

    /// Every chat request it answered, oldest first: `{n, at, body, reply}`.
    pub async fn requests(&self) -> Vec<Value> {
        let body = self
            .get("/requests")
            .await
            .unwrap_or_else(|e| panic!("GET /requests: {e}\n{}", self.process.log_tail(20)));
        serde_json::from_str(&body).expect("the request log is JSON")
    }

    async fn get(&self, path: &str) -> Result<String, String> {
        gateway_get(self.port, path).await
    }
}

/// A scenario whose step Pods run on the real node: namespace and operator, no simkubelet.
/// Panics first if the node is not there.
pub async fn node_scenario(test_name: &str) -> super::scenario::Scenario {
    let env = super::test_env::TestEnv::new(test_name).await;
    require_node(&env.client()).await;
    let ns = env.namespace().to_owned();
    let operator_config = super::processes::OperatorConfig::new(&ns);
    let operator = Some(super::processes::start_operator(&operator_config));
    super::scenario::Scenario {
        ledger_path: log_dir(&ns).join("ledger.jsonl"),
        env: Some(env),
        operator,
        operator_config,
        simkubelet: None,
    }
}

/// Places every Pod of `namespace` on the node, so plain manifests (a Deployment such as
/// examples/refund-agent/deploy.yaml) run there as they are: the plane's PodNodeSelector
/// and PodTolerationRestriction admission plugins add the node's selector and a
/// toleration of its taint from these namespace annotations.
pub async fn place_namespace_on_node(client: &Client, namespace: &str) {
    let toleration =
        json!([{"key": NODE_KEY, "operator": "Equal", "value": "real", "effect": "NoSchedule"}]);
    let patch = json!({"metadata": {"annotations": {
        "scheduler.alpha.kubernetes.io/node-selector": format!("{NODE_KEY}=real"),
        "scheduler.alpha.kubernetes.io/defaultTolerations": toleration.to_string(),
    }}});
    Api::<Namespace>::all(client.clone())
        .patch(namespace, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("annotating namespace {namespace} for the node: {e}"));
}

/// Where `e2e/cluster` keeps the plane and the node (`AGENTRUN_E2E_DIR`, else
/// `<repo>/target/e2e`); the node's pidfiles are under `node/state/`.
pub fn e2e_dir() -> PathBuf {
    std::env::var_os("AGENTRUN_E2E_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/e2e"))
}

/// A step container of one of the node's images (never pulled: imported by `node up`).
pub fn container(image: &str, args: &[&str], env: Value) -> Value {
    json!({"image": image, "imagePullPolicy": "IfNotPresent", "args": args, "env": env})
}

/// How long a probe Pod may take: Pods start in seconds, but the machine is shared with builds.
const PROBE_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs `script` (Python) in a Pod of the example image on the node and returns what it
/// wrote to its termination message, as JSON. `container` adds fields to the container
/// (env, mounts), `volumes` are the Pod's. Panics, with the message (the traceback on
/// failure), unless the Pod ran on the node and succeeded.
pub async fn run_probe(
    client: &Client,
    namespace: &str,
    script: &str,
    container: Value,
    volumes: Value,
) -> Value {
    let name = "probe";
    let mut probe = json!({
        "name": name,
        "image": REFUND_AGENT_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-c", script],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    });
    if let (Some(probe), Value::Object(extra)) = (probe.as_object_mut(), container) {
        probe.extend(extra);
    }
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "nodeSelector": {"agentrun.dev/node": "real"},
            "tolerations": [{"key": "agentrun.dev/node", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [probe],
            "volumes": volumes,
        },
    }))
    .expect("a Pod");
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    pods.create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("creating Pod {name}: {e}"));
    let done = super::wait::wait_for(
        &pods,
        name,
        |p: Option<&Pod>| matches!(pod_phase(p).as_deref(), Some("Succeeded") | Some("Failed")),
        PROBE_TIMEOUT,
    )
    .await
    .expect("the Pod exists");
    let message = done
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .and_then(|t| t.message.clone())
        .unwrap_or_default();
    assert_eq!(
        pod_phase(Some(&done)).as_deref(),
        Some("Succeeded"),
        "probe {name} failed:\n{message}"
    );
    assert_eq!(
        done.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(NODE_NAME)
    );
    serde_json::from_str(&message)
        .unwrap_or_else(|e| panic!("probe {name} wrote no JSON ({e}):\n{message}"))
}

fn pod_phase(p: Option<&Pod>) -> Option<String> {
    p.and_then(|p| p.status.as_ref())
        .and_then(|s| s.phase.clone())
}
