//! `simkubelet` against the real control plane: each test starts the binary for its own
//! fresh namespace, creates step Pods the way the operator labels them, and checks the
//! status a node would report and the ledger lines.
//!
//! Needs the plane (`make cluster-up`); fails, never skips, when it is not reachable.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use agentrun_e2e::ledger::{Ledger, LedgerEvent, Outcome};
use agentrun_operator::labels;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Namespace, Pod};
use kube::api::{DeleteParams, EvictParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{Condition, await_condition};
use kube::runtime::watcher;
use kube::{Api, Client, Config, ResourceExt};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(30);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the e2e crate is inside the repository")
        .to_path_buf()
}

/// The kubeconfig `e2e/cluster up` writes, unless KUBECONFIG points elsewhere.
fn kubeconfig() -> PathBuf {
    std::env::var_os("KUBECONFIG")
        .filter(|v| !v.is_empty())
        .and_then(|v| std::env::split_paths(&v).next())
        .unwrap_or_else(|| repo_root().join("target/e2e/kubeconfig"))
}

fn unreachable(why: impl std::fmt::Display) -> ! {
    panic!(
        "control plane not reachable ({}): {why}; start it with `make cluster-up`",
        kubeconfig().display()
    )
}

async fn client() -> Client {
    let path = kubeconfig();
    let file = Kubeconfig::read_from(&path).unwrap_or_else(|e| unreachable(e));
    let config = Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| unreachable(e));
    let client = Client::try_from(config).unwrap_or_else(|e| unreachable(e));
    match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
        Ok(Ok(_)) => client,
        Ok(Err(e)) => unreachable(e),
        Err(_) => unreachable("no answer within 10s"),
    }
}

/// A fresh namespace with a simkubelet of its own (restricted to it) writing a ledger.
/// Dropping it kills the simkubelet, releases the Pods' finalizers and deletes the namespace.
struct Fixture {
    client: Client,
    ns: String,
    ledger: PathBuf,
    log: PathBuf,
    sim: Option<tokio::process::Child>,
}

impl Fixture {
    async fn new(test: &str) -> Self {
        let client = client().await;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let ns = format!("sk-{test}-{:x}", nanos ^ std::process::id());
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": ns, "labels": {"agentrun.dev/e2e": "simkubelet"}}
                }))
                .expect("namespace manifest"),
            )
            .await
            .unwrap_or_else(|e| panic!("cannot create namespace {ns}: {e}"));
        let dir = repo_root().join("target/e2e/simkubelet-tests");
        std::fs::create_dir_all(&dir).expect("create target/e2e/simkubelet-tests");
        let mut fixture = Self {
            client,
            ledger: dir.join(format!("{ns}.ledger.jsonl")),
            log: dir.join(format!("{ns}.log")),
            ns,
            sim: None,
        };
        fixture.start_simkubelet();
        fixture
    }

    fn start_simkubelet(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the simkubelet log");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_simkubelet"))
            .arg("--kubeconfig")
            .arg(kubeconfig())
            .args(["--namespace", &self.ns])
            .arg("--ledger")
            .arg(&self.ledger)
            .env(
                "RUST_LOG",
                "debug,hyper=info,tower=info,rustls=info,kube=info",
            )
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start simkubelet");
        self.sim = Some(child);
    }

    async fn stop_simkubelet(&mut self) {
        if let Some(mut child) = self.sim.take() {
            child.kill().await.expect("kill simkubelet");
        }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn ledger(&self) -> Ledger {
        Ledger::read(&self.ledger).expect("ledger readable")
    }

    async fn create(&self, pod: Pod) -> Pod {
        self.pods()
            .create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("create pod {}: {e}", pod.name_any()))
    }

    /// Waits until `name` satisfies `cond`; on timeout, panics with the Pod and the log path.
    async fn wait(&self, name: &str, what: &str, cond: impl Condition<Pod>) -> Pod {
        match tokio::time::timeout(TIMEOUT, await_condition(self.pods(), name, cond)).await {
            Ok(Ok(Some(pod))) => pod,
            Ok(Ok(None)) => panic!("pod {name} was deleted while waiting until {what}"),
            Ok(Err(e)) => panic!("watching pod {name}: {e}"),
            Err(_) => {
                let now = self.pods().get_opt(name).await.ok().flatten();
                panic!(
                    "pod {name} not {what} within {TIMEOUT:?}; status {:#?}; simkubelet log {}",
                    now.and_then(|p| p.status),
                    self.log.display()
                )
            }
        }
    }

    /// Creates the Pod and records every phase it goes through until it is terminated.
    async fn run_to_end(&self, pod: Pod) -> (Vec<String>, Vec<Pod>) {
        let name = pod.name_any();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut events = watcher::watcher(self.pods(), config).boxed();
        // The watch is established (listed) before the Pod exists, so no phase is missed.
        loop {
            match events.try_next().await {
                Ok(Some(watcher::Event::InitDone)) => break,
                Ok(Some(_)) => {}
                Ok(None) => panic!("watch ended"),
                Err(e) => panic!("watch pods: {e}"),
            }
        }
        self.create(pod).await;
        let mut seen = Vec::new();
        let collect = async {
            while let Some(event) = events.try_next().await.expect("watch pods") {
                if let watcher::Event::Apply(p) = event {
                    let done = terminated(&p).is_some();
                    seen.push(p);
                    if done {
                        return;
                    }
                }
            }
        };
        if tokio::time::timeout(TIMEOUT, collect).await.is_err() {
            panic!(
                "pod {name} did not terminate within {TIMEOUT:?}; simkubelet log {}",
                self.log.display()
            );
        }
        let mut phases: Vec<String> = seen.iter().map(phase).collect();
        phases.dedup();
        (phases, seen)
    }

    /// Releases every finalizer (the operator's job) and deletes the namespace.
    async fn cleanup(mut self) {
        self.stop_simkubelet().await;
        release_and_delete(&self.client, &self.ns).await;
        self.ns.clear();
    }
}

async fn release_and_delete(client: &Client, ns: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    if let Ok(list) = pods.list(&Default::default()).await {
        for pod in list {
            if !pod.finalizers().is_empty() {
                let _ = pods
                    .patch(
                        &pod.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                    )
                    .await;
            }
        }
    }
    let _ = Api::<Namespace>::all(client.clone())
        .delete(ns, &DeleteParams::default())
        .await;
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if self.ns.is_empty() {
            return;
        }
        // A failed test still cleans up; the test's runtime may be unwinding, so use our own.
        let ns = std::mem::take(&mut self.ns);
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let Ok(file) = Kubeconfig::read_from(kubeconfig()) else {
                    return;
                };
                let options = KubeConfigOptions::default();
                let Ok(config) = Config::from_custom_kubeconfig(file, &options).await else {
                    return;
                };
                if let Ok(client) = Client::try_from(config) {
                    release_and_delete(&client, &ns).await;
                }
            });
        })
        .join();
    }
}

fn phase(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default()
}

fn terminated(pod: &Pod) -> Option<&ContainerStateTerminated> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .terminated
        .as_ref()
}

fn condition(pod: &Pod, kind: &str) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| c.status.clone())
}

fn is_running() -> impl Condition<Pod> {
    |pod: Option<&Pod>| pod.is_some_and(|p| phase(p) == "Running")
}

fn is_terminated() -> impl Condition<Pod> {
    |pod: Option<&Pod>| pod.is_some_and(|p| terminated(p).is_some())
}

/// A step Pod labelled and annotated as the operator makes them.
struct StepPod {
    name: String,
    key: String,
    attempt: u32,
    sim_step: Option<Value>,
    finalizer: bool,
    attempt_in_env: bool,
}

impl StepPod {
    fn new(name: &str) -> Self {
        Self {
            name: name.into(),
            key: format!("key-{name}"),
            attempt: 1,
            sim_step: None,
            finalizer: false,
            attempt_in_env: true,
        }
    }

    fn sim(mut self, sim_step: Value) -> Self {
        self.sim_step = Some(sim_step);
        self
    }

    fn key(mut self, key: &str) -> Self {
        self.key = key.into();
        self
    }

    fn attempt(mut self, attempt: u32, in_env: bool) -> Self {
        self.attempt = attempt;
        self.attempt_in_env = in_env;
        self
    }

    fn with_finalizer(mut self) -> Self {
        self.finalizer = true;
        self
    }

    fn build(&self) -> Pod {
        let mut env = vec![
            json!({"name": labels::env::IDEMPOTENCY_KEY, "value": self.key}),
            json!({"name": labels::env::RUN, "value": "run-1"}),
            json!({"name": labels::env::STEP, "value": "charge"}),
        ];
        if self.attempt_in_env {
            env.push(json!({"name": labels::env::ATTEMPT, "value": self.attempt.to_string()}));
        }
        if let Some(sim) = &self.sim_step {
            env.push(json!({"name": "SIM_STEP", "value": sim.to_string()}));
        }
        let finalizers: Vec<&str> = if self.finalizer {
            vec![labels::RESULT_FINALIZER]
        } else {
            vec![]
        };
        serde_json::from_value(json!({
            "metadata": {
                "name": self.name,
                "labels": {
                    labels::RUN: "run-1",
                    labels::STEP: "charge",
                    labels::ATTEMPT: self.attempt.to_string(),
                    labels::ROLE: "step",
                    labels::PLAN_REVISION: "1",
                },
                "annotations": { labels::IDEMPOTENCY_KEY: self.key },
                "finalizers": finalizers,
            },
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": false,
                "containers": [{
                    "name": "step",
                    "image": "example.com/agent-step:1",
                    "env": env,
                }],
            },
        }))
        .expect("pod manifest")
    }
}

#[tokio::test]
async fn default_pod_goes_pending_running_succeeded_with_empty_result() {
    let fx = Fixture::new("default").await;
    let (phases, seen) = fx.run_to_end(StepPod::new("plain").build()).await;
    assert_eq!(phases, ["Pending", "Running", "Succeeded"]);

    let running = seen
        .iter()
        .find(|p| phase(p) == "Running")
        .expect("a Running pod was seen");
    let status = running.status.as_ref().expect("status");
    assert!(status.start_time.is_some(), "startTime set when Running");
    let started = status
        .container_statuses
        .as_ref()
        .expect("containerStatuses")[0]
        .state
        .as_ref()
        .and_then(|s| s.running.as_ref())
        .and_then(|r| r.started_at.clone());
    assert!(started.is_some(), "state.running.startedAt when Running");
    for kind in ["PodScheduled", "Initialized", "ContainersReady", "Ready"] {
        assert_eq!(
            condition(running, kind).as_deref(),
            Some("True"),
            "{kind} while Running"
        );
    }
    assert!(
        running
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "spec untouched"
    );

    let done = seen.last().expect("final pod");
    let t = terminated(done).expect("terminated");
    assert_eq!(t.exit_code, 0);
    assert_eq!(t.reason.as_deref(), Some("Completed"));
    assert_eq!(t.message.as_deref(), Some(r#"{"result":{}}"#));
    assert!(t.started_at.is_some() && t.finished_at.is_some());
    assert_eq!(condition(done, "Ready").as_deref(), Some("False"));

    // The ledger's finished line follows the status write by a moment.
    let ledger = eventually_ledger(&fx, |l| l.finishes().count() == 1).await;
    let uid = done.uid().expect("uid");
    let lines: Vec<_> = ledger.for_pod(&uid).collect();
    assert_eq!(lines.len(), 2, "started + finished: {lines:?}");
    assert_eq!(lines[0].event, LedgerEvent::Started);
    assert_eq!(lines[0].idempotency_key.as_deref(), Some("key-plain"));
    assert_eq!(lines[0].attempt, Some(1));
    assert_eq!(lines[0].run.as_deref(), Some("run-1"));
    assert_eq!(lines[0].step.as_deref(), Some("charge"));
    assert_eq!(lines[0].role.as_deref(), Some("step"));
    assert_eq!(lines[1].event, LedgerEvent::Finished);
    assert_eq!(lines[1].outcome, Some(Outcome::Succeeded));
    assert_eq!(lines[1].exit_code, Some(0));
    assert!(lines[1].finished_at >= Some(lines[1].started_at));
    assert_eq!(
        ledger.successes_by_key(),
        BTreeMap::from([("key-plain".into(), 1)])
    );
    fx.cleanup().await;
}

#[tokio::test]
async fn exit_code_3_fails_the_pod_with_its_message() {
    let fx = Fixture::new("exit3").await;
    let sim = json!({"runMs": 50, "exitCode": 3, "result": {"orderId": 42},
                     "tokens": {"input": 120, "output": 40}});
    let (phases, seen) = fx.run_to_end(StepPod::new("fails").sim(sim).build()).await;
    assert_eq!(phases, ["Pending", "Running", "Failed"]);
    let t = terminated(seen.last().expect("final pod")).expect("terminated");
    assert_eq!(t.exit_code, 3);
    assert_eq!(t.reason.as_deref(), Some("Error"));
    let message: Value =
        serde_json::from_str(t.message.as_deref().expect("message")).expect("JSON message");
    assert_eq!(
        message,
        json!({"result": {"orderId": 42}, "tokens": {"input": 120, "output": 40}})
    );
    let ledger = eventually_ledger(&fx, |l| l.finishes().count() == 1).await;
    let finished: Vec<_> = ledger.finishes().collect();
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].outcome, Some(Outcome::Failed));
    assert_eq!(finished[0].exit_code, Some(3));
    assert_eq!(ledger.successes_by_key(), BTreeMap::new());
    fx.cleanup().await;
}

#[tokio::test]
async fn attempts_script_picks_the_entry_of_each_attempt() {
    let fx = Fixture::new("attempts").await;
    let sim = json!({"attempts": [
        {"runMs": 20, "exitCode": 1},
        {"runMs": 20, "exitCode": 2},
        {"runMs": 20, "result": {"ok": true}},
    ]});
    // Attempts 1 and 3 say so in env AGENTRUN_ATTEMPT, 2 and 4 only in the label.
    for attempt in 1..=4 {
        let pod = StepPod::new(&format!("try-{attempt}"))
            .key("shared")
            .attempt(attempt, attempt % 2 == 1)
            .sim(sim.clone());
        fx.create(pod.build()).await;
    }
    let mut exits = Vec::new();
    for attempt in 1..=4 {
        let pod = fx
            .wait(&format!("try-{attempt}"), "terminated", is_terminated())
            .await;
        exits.push((phase(&pod), terminated(&pod).map(|t| t.exit_code)));
    }
    assert_eq!(
        exits,
        [
            ("Failed".into(), Some(1)),
            ("Failed".into(), Some(2)),
            ("Succeeded".into(), Some(0)),
            ("Succeeded".into(), Some(0)),
        ]
    );
    let ledger = eventually_ledger(&fx, |l| l.finishes().count() == 4).await;
    assert_eq!(
        ledger.executions_by_key(),
        BTreeMap::from([("shared".into(), 4)])
    );
    assert_eq!(
        ledger.successes_by_key(),
        BTreeMap::from([("shared".into(), 2)])
    );
    let mut attempts: Vec<_> = ledger.executions().filter_map(|e| e.attempt).collect();
    attempts.sort();
    assert_eq!(attempts, [1, 2, 3, 4]);
    fx.cleanup().await;
}

/// The ledger once `done` holds (or after 5 s, for the caller's assertions to explain):
/// simkubelet appends a line only after the apiserver accepted the status the test saw.
async fn eventually_ledger(fx: &Fixture, done: impl Fn(&Ledger) -> bool) -> Ledger {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let ledger = fx.ledger();
        if done(&ledger) || tokio::time::Instant::now() > deadline {
            return ledger;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn deleting_a_running_pod_kills_it_with_137_and_keeps_it_for_the_finalizer() {
    let fx = Fixture::new("delete").await;
    fx.create(
        StepPod::new("hangs")
            .sim(json!({"hang": true}))
            .with_finalizer()
            .build(),
    )
    .await;
    let running = fx.wait("hangs", "Running", is_running()).await;
    // Hanging: still Running well past the default run time.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let still = fx.pods().get("hangs").await.expect("get pod");
    assert_eq!(phase(&still), "Running", "a hanging step stays Running");

    fx.pods()
        .delete("hangs", &DeleteParams::default())
        .await
        .expect("delete pod");
    let pod = fx.wait("hangs", "terminated", is_terminated()).await;
    assert_eq!(phase(&pod), "Failed");
    let t = terminated(&pod).expect("terminated");
    assert_eq!(t.exit_code, 137);
    assert_eq!(t.reason.as_deref(), Some("Error"));
    assert!(
        pod.metadata.deletion_timestamp.is_some(),
        "deletionTimestamp kept"
    );
    assert_eq!(
        pod.finalizers(),
        [labels::RESULT_FINALIZER],
        "finalizer kept"
    );
    assert_eq!(pod.uid(), running.uid());

    let ledger = eventually_ledger(&fx, |l| l.finishes().count() == 1).await;
    let lines: Vec<_> = ledger.entries.iter().collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[1].outcome, Some(Outcome::Killed));
    assert_eq!(lines[1].exit_code, Some(137));
    fx.cleanup().await;
}

#[tokio::test]
async fn evicted_running_pod_is_killed_and_keeps_disruption_target() {
    let fx = Fixture::new("evict").await;
    fx.create(
        StepPod::new("evicted")
            .sim(json!({"runMs": 60000}))
            .with_finalizer()
            .build(),
    )
    .await;
    fx.wait("evicted", "Running", is_running()).await;
    fx.pods()
        .evict("evicted", &EvictParams::default())
        .await
        .expect("evict pod");
    let pod = fx.wait("evicted", "terminated", is_terminated()).await;
    assert_eq!(phase(&pod), "Failed");
    assert_eq!(terminated(&pod).map(|t| t.exit_code), Some(137));
    assert!(pod.metadata.deletion_timestamp.is_some());
    assert_eq!(
        condition(&pod, "DisruptionTarget").as_deref(),
        Some("True"),
        "DisruptionTarget set by the eviction API is kept: {:#?}",
        pod.status.as_ref().and_then(|s| s.conditions.as_ref())
    );
    fx.cleanup().await;
}

#[tokio::test]
async fn restarted_simkubelet_resumes_running_pods_and_reruns_nothing() {
    let mut fx = Fixture::new("restart").await;
    fx.create(StepPod::new("quick").sim(json!({"runMs": 10})).build())
        .await;
    fx.create(StepPod::new("slow").sim(json!({"runMs": 4000})).build())
        .await;
    fx.wait("quick", "terminated", is_terminated()).await;
    let running = fx.wait("slow", "Running", is_running()).await;
    // simkubelet writes the Running status, then the ledger line: stopped in
    // between, the start would never be recorded.
    let before = eventually_ledger(&fx, |l| l.executions().count() == 2).await;
    fx.stop_simkubelet().await;
    assert_eq!(before.executions().count(), 2, "{before:?}");

    fx.start_simkubelet();
    let done = fx.wait("slow", "terminated", is_terminated()).await;
    assert_eq!(phase(&done), "Succeeded");
    let started_at = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.running.as_ref().map(|r| r.started_at.clone()))
            .flatten()
    };
    assert_eq!(
        terminated(&done).and_then(|t| t.started_at.clone()),
        started_at(&running),
        "the resumed step keeps its original start"
    );
    let ledger = eventually_ledger(&fx, |l| l.finishes().count() == 2).await;
    assert_eq!(
        ledger.executions_by_key(),
        BTreeMap::from([("key-quick".into(), 1), ("key-slow".into(), 1)]),
        "nothing re-run after the restart"
    );
    assert_eq!(
        ledger.successes_by_key(),
        BTreeMap::from([("key-quick".into(), 1), ("key-slow".into(), 1)])
    );
    fx.cleanup().await;
}
