//! `--peer argo`: Argo Workflows' workflow-controller (v4.0.5, built by
//! `e2e/cluster argo`), started per batch namespaced to it, one Workflow of
//! sequential steps per run; simkubelet runs the step Pods and plays Argo's
//! `wait` sidecar (`--argo-task-results`).
//!
//! ```text
//!   driver ──POST workflows──▶ kube-apiserver ◀──watch/write── workflow-controller (child)
//!                                   ▲  pods/status, workflowtaskresults ── simkubelet (child)
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentrun_e2e::support::processes::{Process, free_port};
use agentrun_operator::api::RunPhase;
use agentrun_operator::labels;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::process::Command;

use super::{Controller, Names};
use crate::args::Args;
use crate::error::{BenchError, Res, api, io};
use crate::metrics::controller_metrics;
use crate::plane::{Setup, create_all, run_name, step_name};
use crate::watch::Watch;

/// Argo's directory: `--argo-dir`, else $AGENTRUN_ARGO_DIR, else where
/// `e2e/cluster argo` puts it (its cache, like the plane's binaries).
pub fn dir(args: &Args) -> PathBuf {
    args.argo_dir
        .clone()
        .or_else(|| std::env::var_os("AGENTRUN_ARGO_DIR").map(PathBuf::from))
        .unwrap_or_else(|| {
            agentrun_e2e::support::kubectl::cache_dir()
                .unwrap_or_else(|| PathBuf::from(".cache/agentrun-operator"))
                .join("argo-v4.0.5")
        })
}

fn controller_bin(setup: &Setup) -> PathBuf {
    setup.argo_dir.join("workflow-controller")
}

/// Server-side applies Argo's CRDs (every `*.yaml` in `dir`: the full ones,
/// with their schema, which Argo's install manifests apply).
async fn install_crds(client: &Client, dir: &Path) -> Res<()> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(format!(
            "reading {} (run `e2e/cluster argo`)",
            dir.display()
        )))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(BenchError::Stage(format!(
            "no Argo CRDs in {} (run `e2e/cluster argo`)",
            dir.display()
        )));
    }
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(io(format!("reading {}", f.display())))?;
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).map_err(|e| BenchError::Config {
                what: format!("parsing {}", f.display()),
                message: e.to_string(),
            })?;
        agentrun_e2e::apply_crd(client, &crd).await;
    }
    Ok(())
}

fn argo_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "argoproj.io".into(),
        version: "v1alpha1".into(),
        api_version: "argoproj.io/v1alpha1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// One Workflow: a `steps` template of `steps` sequential steps (one step per
/// group, so each waits for the one before), each its own container template
/// whose Pod carries the labels simkubelet and this driver's watch look for
/// (`podMetadata` for the run, the template's `metadata` for the step). The
/// command is explicit so the controller never looks an image up.
fn workflow_manifest(run: usize, steps: usize) -> DynamicObject {
    let groups: Vec<Value> = (0..steps)
        .map(|i| json!([{"name": step_name(i), "template": step_name(i)}]))
        .collect();
    let mut templates = vec![json!({"name": "chain", "steps": groups})];
    templates.extend((0..steps).map(|i| {
        json!({
            "name": step_name(i),
            "metadata": {"labels": {labels::STEP: step_name(i)}},
            "container": {"image": "registry.example/agent-step:1", "command": ["/step"]},
        })
    }));
    serde_json::from_value(json!({
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": run_name(run)},
        "spec": {
            "entrypoint": "chain",
            "podMetadata": {"labels": {labels::RUN: run_name(run), labels::ATTEMPT: "1"}},
            "templates": templates,
        },
    }))
    .expect("the Workflow manifest is an object")
}

/// The workflow-controller of one batch: namespaced to `ns`, leader election
/// off (as kcm's and the operator's in this benchmark), the admin kubeconfig
/// (so no RBAC), an executor image nothing pulls.
fn start_argo_controller(setup: &Setup, ns: &str, dir: &Path) -> Res<Process> {
    let a = &setup.args;
    let mut cmd = Command::new(controller_bin(setup));
    cmd.arg("--kubeconfig")
        .arg(&setup.kubeconfig)
        .args(["--namespace", ns, "--namespaced", "--managed-namespace", ns])
        .args(["--executor-image", "registry.example/argoexec:v4.0.5"])
        .arg(format!("--qps={}", a.argo_qps))
        .arg(format!("--burst={}", a.argo_burst))
        .args(["--loglevel", "info"])
        .env("LEADER_ELECTION_DISABLE", "true")
        .env_remove("KUBECONFIG");
    if !a.argo_requeue_time.is_empty() {
        cmd.env("DEFAULT_REQUEUE_TIME", &a.argo_requeue_time);
    }
    Process::start(
        "workflow-controller",
        cmd,
        dir.join("workflow-controller.log"),
    )
    .map_err(io("starting Argo's workflow-controller"))
}

/// Waits until the controller's log says its caches have synced.
async fn wait_argo_ready(log: &Path, deadline: Duration) -> Res<Duration> {
    let start = Instant::now();
    loop {
        let log_text = std::fs::read_to_string(log).unwrap_or_default();
        if log_text.contains(ARGO_READY_LINE) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > deadline {
            return Err(BenchError::Stage(format!(
                "Argo's workflow-controller not ready after {deadline:?} (no {ARGO_READY_LINE:?} in {})",
                log.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the workflow-controller logs first once its caches have synced (its
/// `workflowGarbageCollector` starts right after `WaitForCacheSync`).
const ARGO_READY_LINE: &str = "Performing periodic GC";

/// A batch's workflow-controller, its metrics address, the namespace's Workflows.
pub struct WorkflowController {
    proc: Process,
    metrics: SocketAddr,
    workflows: Api<DynamicObject>,
}

impl Controller for WorkflowController {
    const NAMES: Names = Names {
        namespace: "bench-argo-",
        run: "Workflow",
        runs: "Workflows",
        steps: "steps",
        batch: "Argo batch",
    };
    const DESCRIPTION: &'static str = "Argo Workflows of sequential steps (controller: workflow-controller v4.0.5, one per batch; \"operator\" columns are its figures, its writes include the task results simkubelet writes as Argo's wait sidecar; the driver's POST workflows are not counted)";
    /// Also Argo's wait sidecar: the step Pods' task results.
    const SIMKUBELET_ARGS: &'static [&'static str] = &["--argo-task-results"];
    const METRICS_FILE: Option<&'static str> = Some("workflow-controller-metrics.txt");

    async fn prepare(setup: &Setup) -> Res<()> {
        let bin = controller_bin(setup);
        if !bin.exists() {
            return Err(BenchError::Stage(format!(
                "{} not found: build it with `e2e/cluster argo`",
                bin.display()
            )));
        }
        install_crds(&setup.client, &setup.argo_dir.join("crds/full")).await
    }

    /// The controller refuses to start without its ConfigMap; this one only
    /// moves its metrics server off the shared :9090 (plain HTTP).
    async fn start(setup: &Setup, ns: &str, dir: &Path) -> Res<WorkflowController> {
        let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let cms: Api<ConfigMap> = Api::namespaced(setup.client.clone(), ns);
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": "workflow-controller-configmap"},
            "data": {"metricsConfig": format!("port: {}\nsecure: false\n", metrics.port())},
        }))
        .expect("the ConfigMap is valid");
        cms.create(&PostParams::default(), &cm)
            .await
            .map_err(api("creating workflow-controller-configmap"))?;
        let mut proc = start_argo_controller(setup, ns, dir)?;
        let log = dir.join("workflow-controller.log");
        if let Err(e) = wait_argo_ready(&log, Duration::from_secs(60)).await {
            proc.kill().await;
            return Err(e);
        }
        let workflows = argo_resource("Workflow", "workflows");
        Ok(WorkflowController {
            proc,
            metrics,
            workflows: Api::namespaced_with(setup.client.clone(), ns, &workflows),
        })
    }

    fn pid(&self) -> u32 {
        self.proc.pid().unwrap_or(0)
    }

    /// A Workflow is finished when its phase is Succeeded, Failed or Error.
    fn follow(&self, watch: &mut Watch, _steps: usize) {
        watch.finish_on(self.workflows.clone(), |wf: &DynamicObject| {
            match wf.data.pointer("/status/phase").and_then(Value::as_str) {
                Some("Succeeded") => Some(RunPhase::Succeeded),
                Some("Failed" | "Error") => Some(RunPhase::Failed),
                _ => None,
            }
        });
    }

    async fn submit(&self, setup: &Setup, n: usize, steps: usize) -> Res<()> {
        let manifest = |r: usize| workflow_manifest(r, steps);
        create_all(setup, &self.workflows, n, manifest, |r| {
            format!("Workflow {}", run_name(r))
        })
        .await
    }

    /// Every write verb on pods (not pods/status, simkubelet's kubelet part),
    /// events, workflows (not POST: the driver's), workflowtaskresults (the
    /// emulated wait sidecar's creates and patches, the controller's deletes),
    /// workflowtasksets, workflowartifactgctasks and configmaps. Leases are
    /// left out: leader election is off, and the apiserver's own identity
    /// leases would be counted.
    fn writes(verb: &str, resource: &str, sub: &str) -> bool {
        match (resource, sub) {
            ("pods", "") | ("events", "") | ("configmaps", "") => true,
            ("workflowtaskresults" | "workflowtasksets" | "workflowartifactgctasks", _) => true,
            ("workflows", _) => verb != "POST",
            _ => false,
        }
    }

    async fn metrics(&self) -> String {
        controller_metrics(self.metrics).await
    }

    async fn stop(mut self) {
        self.proc.kill().await;
    }
}
