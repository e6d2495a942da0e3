//! `--peer agentrun` (the default): agentrun-operator, started per batch with
//! `--namespace NS`, one AgentRun per run.
//!
//! ```text
//!   driver ──POST agentruns──▶ kube-apiserver ◀──watch/write── agentrun-operator (child)
//!                                   ▲  /metrics, /readyz on loopback ports of its own
//!                                   └──watch/patch pods/status── simkubelet (child)
//! ```
//!
//! The resume and status-size measurements start the operator with
//! [`start_operator`] and submit with [`create_runs`] too.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use agentrun_e2e::http_get;
use agentrun_e2e::support::processes::{Process, free_port};
use agentrun_operator::api::AgentRun;
use kube::Api;
use serde_json::{Value, json};
use tokio::process::Command;

use super::{Controller, Names};
use crate::batch::Batch;
use crate::error::{BenchError, Res, io};
use crate::metrics::{controller_metrics, metric};
use crate::plane::{Setup, create_all, run_name, step_name};
use crate::watch::Watch;

/// A running operator, and the namespace's runs it reconciles.
pub struct Operator {
    pub proc: Process,
    pub metrics: SocketAddr,
    health: SocketAddr,
    pub runs: Api<AgentRun>,
}

pub fn start_operator(setup: &Setup, ns: &str, dir: &Path) -> Res<Operator> {
    let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let health: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut cmd = Command::new(&setup.operator_bin);
    cmd.args(["run", "--namespace", ns, "--identity", "bench"])
        .arg("--metrics-addr")
        .arg(metrics.to_string())
        .arg("--health-addr")
        .arg(health.to_string())
        .arg(format!("--step-events={}", setup.args.step_events))
        .env("KUBECONFIG", &setup.kubeconfig)
        .env("RUST_LOG", &setup.args.operator_log)
        .env_remove("AGENTRUN_FAILPOINT")
        .env_remove("AGENTRUN_WATCH_NAMESPACE");
    let proc = Process::start("operator", cmd, dir.join("operator.log"))
        .map_err(io("starting the operator"))?;
    Ok(Operator {
        proc,
        metrics,
        health,
        runs: Api::namespaced(setup.client.clone(), ns),
    })
}

/// Waits for the operator's `/readyz` (caches listed); returns how long it took.
pub async fn wait_ready(op: &Operator, deadline: Duration) -> Res<Duration> {
    let start = Instant::now();
    loop {
        if let Ok((200, _)) = http_get(op.health, "/readyz").await {
            return Ok(start.elapsed());
        }
        if start.elapsed() > deadline {
            return Err(BenchError::Stage(format!(
                "operator not ready after {deadline:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `steps` Idempotent steps; with `result_bytes > 0` each step reports a
/// string result of that many bytes (simkubelet's `SIM_STEP`), else `{}`.
/// A fan-out: every step after the first depends on the first only.
fn run_spec(steps: usize, result_bytes: usize, fan_out: bool) -> Value {
    let mut container = json!({"image": "registry.example/agent-step:1"});
    if result_bytes > 0 {
        let sim = json!({"result": "z".repeat(result_bytes)}).to_string();
        container["env"] = json!([{"name": "SIM_STEP", "value": sim}]);
    }
    let count = steps;
    let steps: Vec<Value> = (0..steps)
        .map(|i| {
            let mut step = json!({
                "name": step_name(i),
                "effect": "Idempotent",
                "container": container,
            });
            if fan_out {
                step["dependsOn"] = if i == 0 {
                    json!([])
                } else {
                    json!([step_name(0)])
                };
            }
            step
        })
        .collect();
    if fan_out {
        json!({"steps": steps, "parallelism": count.clamp(1, 100)})
    } else {
        json!({"steps": steps})
    }
}

/// Creates `n` runs of `steps` steps; returns when all creates are acknowledged.
pub async fn create_runs(
    setup: &Setup,
    runs: &Api<AgentRun>,
    n: usize,
    steps: usize,
    result_bytes: usize,
    fan_out: bool,
) -> Res<()> {
    let spec = run_spec(steps, result_bytes, fan_out);
    let manifest = |i: usize| -> AgentRun {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": run_name(i)},
            "spec": spec,
        }))
        .expect("the run manifest matches the AgentRun type")
    };
    create_all(setup, runs, n, manifest, |i| format!("run {}", run_name(i))).await
}

impl Controller for Operator {
    const NAMES: Names = Names {
        namespace: "bench-",
        run: "run",
        runs: "runs",
        steps: "steps",
        batch: "batch",
    };
    const DESCRIPTION: &'static str = "AgentRuns (controller: agentrun-operator)";
    const METRICS_FILE: Option<&'static str> = Some("operator-metrics.txt");

    async fn start(setup: &Setup, ns: &str, dir: &Path) -> Res<Operator> {
        let op = start_operator(setup, ns, dir)?;
        wait_ready(&op, Duration::from_secs(60)).await?;
        Ok(op)
    }

    fn pid(&self) -> u32 {
        self.proc.pid().unwrap_or(0)
    }

    fn follow(&self, watch: &mut Watch, _steps: usize) {
        watch.finish_on(self.runs.clone(), |run: &AgentRun| {
            let phase = run.status.as_ref().and_then(|s| s.phase);
            phase.filter(|p| p.is_terminal())
        });
    }

    async fn submit(&self, setup: &Setup, n: usize, steps: usize) -> Res<()> {
        create_runs(setup, &self.runs, n, steps, 0, setup.args.fan_out).await
    }

    /// Every write verb on pods (not pods/status, which is simkubelet's),
    /// agentruns/status, approvals and signals (and their status), run
    /// records, events; agentruns themselves only for DELETE (TTL), since the
    /// driver POSTs them.
    fn writes(verb: &str, resource: &str, sub: &str) -> bool {
        match (resource, sub) {
            ("pods", "") => true,
            ("agentruns", "status") => true,
            ("agentruns", "") => verb == "DELETE",
            ("approvals", _) | ("signals", _) | ("runrecords", "") => true,
            ("events", "") => true,
            _ => false,
        }
    }

    async fn metrics(&self) -> String {
        controller_metrics(self.metrics).await
    }

    async fn stop(mut self) {
        self.proc.kill().await;
    }

    /// Its reconciles and status writes, from its `/metrics`.
    fn figures(batch: &mut Batch, metrics: &str, created: Duration) -> Res<()> {
        let reconciles = metric(metrics, "agentrun_reconcile_duration_seconds_count")?;
        let rsum = metric(metrics, "agentrun_reconcile_duration_seconds_sum")?;
        batch.reconciles = reconciles;
        batch.reconcile_mean_ms = if reconciles > 0.0 {
            rsum / reconciles * 1000.0
        } else {
            0.0
        };
        batch.status_writes = metric(metrics, "agentrun_checkpoint_write_duration_seconds_count")?;
        eprintln!(
            "[bench]   created {} runs in {:.1} s; operator metrics: {}",
            batch.runs,
            created.as_secs_f64(),
            [
                "agentrun_steps_started_total",
                "agentrun_status_conflicts_total",
                "agentrun_duplicate_creates_suppressed_total",
                "agentrun_reconcile_errors_total",
            ]
            .iter()
            .map(|m| match metric(metrics, m) {
                Ok(v) => format!("{m}={v}"),
                Err(e) => format!("{m}: {e}"),
            })
            .collect::<Vec<_>>()
            .join(" ")
        );
        Ok(())
    }
}
