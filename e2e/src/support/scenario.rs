//! One scenario = one namespace with its own operator and simkubelet
//! processes and its own side-effect ledger, so scenarios run in parallel
//! without seeing each other.
//!
//! ```text
//!   Scenario::start("evicted_step_resumes_with_same_key")
//!     ├─ TestEnv (client, CRDs, namespace)
//!     ├─ simkubelet --namespace <ns> --ledger <dir>/ledger.jsonl
//!     └─ agentrun-operator run --namespace <ns>      (kill / restart at will)
//! ```
//!
//! When a scenario panics, the guard prints the tails of both processes' logs.

use std::path::PathBuf;
use std::time::Duration;

use agentrun_operator::api::{AgentRun, AgentRunStatus, Approval, RunPhase};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

use super::processes::{
    OperatorConfig, Process, free_port, log_dir, start_operator, start_simkubelet,
};
use super::test_env::TestEnv;
use crate::ledger::Ledger;

/// A running scenario.
pub struct Scenario {
    pub env: Option<TestEnv>,
    pub ledger_path: PathBuf,
    pub operator: Option<Process>,
    pub operator_config: OperatorConfig,
    pub simkubelet: Option<Process>,
}

impl Scenario {
    /// Namespace, simkubelet and an operator without failpoints.
    pub async fn start(test_name: &str) -> Scenario {
        let mut s = Scenario::start_without_operator(test_name).await;
        s.operator = Some(start_operator(&s.operator_config));
        s
    }

    /// Namespace and simkubelet; the test starts operators itself.
    pub async fn start_without_operator(test_name: &str) -> Scenario {
        let env = TestEnv::new(test_name).await;
        let ns = env.namespace().to_owned();
        let ledger_path = log_dir(&ns).join("ledger.jsonl");
        let simkubelet = Some(start_simkubelet(&ns, &ledger_path));
        // simkubelet creates its ledger as it starts; a test reads it only
        // once it exists (a missing ledger is an error, never "nothing ran").
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !ledger_path.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "simkubelet did not create its ledger {} within 30 s",
                ledger_path.display()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Scenario {
            operator_config: OperatorConfig::new(&ns),
            env: Some(env),
            ledger_path,
            operator: None,
            simkubelet,
        }
    }

    pub fn env(&self) -> &TestEnv {
        self.env.as_ref().expect("the scenario is running")
    }

    pub fn namespace(&self) -> &str {
        self.env().namespace()
    }

    pub fn runs(&self) -> Api<AgentRun> {
        self.env().api()
    }

    pub fn pods(&self) -> Api<Pod> {
        self.env().api()
    }

    /// Every Pod in the scenario's namespace, as the API server has them now.
    pub async fn list_pods(&self) -> Vec<Pod> {
        self.pods()
            .list(&kube::api::ListParams::default())
            .await
            .expect("listing pods")
            .items
    }

    pub fn approvals(&self) -> Api<Approval> {
        self.env().api()
    }

    /// Creates a run from its spec.
    pub async fn create_run(&self, name: &str, spec: Value) -> AgentRun {
        let run: AgentRun = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": name, "namespace": self.namespace()},
            "spec": spec,
        }))
        .expect("scenario run spec deserializes");
        self.runs()
            .create(&PostParams::default(), &run)
            .await
            .unwrap_or_else(|e| panic!("creating run {name}: {e}"))
    }

    /// SIGKILLs the operator.
    pub async fn kill_operator(&mut self) {
        if let Some(mut op) = self.operator.take() {
            op.kill().await;
        }
    }

    /// The running operator's log file.
    pub fn operator_log(&self) -> std::path::PathBuf {
        self.operator
            .as_ref()
            .expect("an operator is running")
            .log_path()
            .to_owned()
    }

    /// (Re)starts the operator with `failpoint` (or none), on loopback ports
    /// of its own: the ports a killed operator had may be anyone's by now (an
    /// outgoing connection's local port comes from the same range), and
    /// `operator_config` names the new ones.
    pub fn start_operator(&mut self, failpoint: Option<&str>) {
        self.operator_config.metrics_port = free_port();
        self.operator_config.health_port = free_port();
        let mut cfg = self.operator_config.clone();
        cfg.failpoint = failpoint.map(str::to_owned);
        self.operator = Some(start_operator(&cfg));
    }

    /// Waits until the operator process exits by itself (a failpoint fired).
    pub async fn wait_operator_crash(&mut self, timeout: Duration) {
        let op = self.operator.as_mut().expect("an operator is running");
        let status = op.wait_exit(timeout).await;
        assert!(
            status.is_some(),
            "the operator did not reach its failpoint within {timeout:?}\n{}",
            op.log_tail(60)
        );
        self.operator = None;
    }

    /// Waits until the run satisfies `check` (polling its status every 200 ms).
    pub async fn wait_run(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        check: impl Fn(&AgentRun) -> bool,
    ) -> AgentRun {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = None;
        loop {
            if let Ok(Some(run)) = self.runs().get_opt(name).await {
                if check(&run) {
                    return run;
                }
                last = Some(run);
            }
            if tokio::time::Instant::now() >= deadline {
                let status = last
                    .and_then(|r| r.status)
                    .map(|s| serde_json::to_string_pretty(&s).unwrap_or_default())
                    .unwrap_or_else(|| "no status".into());
                panic!(
                    "timed out after {timeout:?} waiting for run {name} to be {what}; status:\n{status}"
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until step `step`'s current attempt is recorded and its Pod is
    /// running; returns the run as it was then and the Pod's name.
    pub async fn wait_step_running(
        &self,
        run: &str,
        step: &str,
        timeout: Duration,
    ) -> (AgentRun, String) {
        let recorded = self
            .wait_run(run, &format!("running step {step}"), timeout, |r| {
                status(r).steps.iter().any(|c| {
                    c.name == step
                        && c.phase == agentrun_operator::api::StepPhase::Running
                        && c.pod.is_some()
                })
            })
            .await;
        let pod = status(&recorded)
            .steps
            .iter()
            .rev()
            .find(|c| c.name == step && c.pod.is_some())
            .and_then(|c| c.pod.clone())
            .expect("the attempt's Pod is recorded");
        let is_running = |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                == Some("Running")
        };
        super::wait::wait_for(&self.pods(), &pod, is_running, timeout).await;
        (recorded, pod)
    }

    /// Waits until the run records an Approval (for `step`, or any) and the
    /// Approval exists; returns its name.
    pub async fn approval_of(&self, run: &str, step: Option<&str>, timeout: Duration) -> String {
        let asks = |c: &agentrun_operator::api::StepCheckpoint| {
            c.approval.is_some() && step.is_none_or(|s| c.name == s)
        };
        let r = self
            .wait_run(run, "waiting on an Approval", timeout, |r| {
                status(r).steps.iter().any(asks)
            })
            .await;
        let name = status(&r)
            .steps
            .iter()
            .find(|c| asks(c))
            .and_then(|c| c.approval.clone())
            .expect("the approval's name");
        super::wait::wait_for(
            &self.approvals(),
            &name,
            |a: Option<&Approval>| a.is_some(),
            timeout,
        )
        .await;
        name
    }

    /// Waits for a terminal phase and returns the run.
    pub async fn wait_finished(&self, name: &str, timeout: Duration) -> AgentRun {
        self.wait_run(name, "finished", timeout, |r| {
            phase(r).is_some_and(RunPhase::is_terminal)
        })
        .await
    }

    /// The ledger as written so far.
    pub fn ledger(&self) -> Ledger {
        Ledger::read(&self.ledger_path).unwrap_or_else(|e| panic!("reading the ledger: {e}"))
    }

    /// Sets an Approval's decision the way a person would with kubectl, once
    /// the Approval exists (the run records its name just before creating it).
    pub async fn decide(&self, approval: &str, decision: &str, comment: &str) {
        crate::wait_for(
            &self.approvals(),
            approval,
            |a: Option<&Approval>| a.is_some(),
            Duration::from_secs(30),
        )
        .await;
        let patch = json!({"spec": {"decision": decision, "comment": comment}});
        // With the chart's policies, the validating one refuses a decision
        // that the mutating one has not stamped with its decider; the API
        // server starts enforcing the two a moment apart after an install.
        // Until a dry run of the decision passes, the real one waits.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let dry_run = PatchParams {
                dry_run: true,
                ..Default::default()
            };
            match self
                .approvals()
                .patch(approval, &dry_run, &Patch::Merge(&patch))
                .await
            {
                Err(kube::Error::Api(e))
                    if e.code == 403
                        && e.message
                            .contains("spec.decidedBy must be the user who decides")
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                _ => break,
            }
        }
        self.approvals()
            .patch(approval, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("deciding {approval}: {e}"));
    }

    /// Waits until no step Pod of the namespace holds the result finalizer
    /// (D5); panics with the ones that still do after `timeout`.
    pub async fn wait_finalizers_released(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let held: Vec<String> = self
                .list_pods()
                .await
                .iter()
                .filter(|p| {
                    p.finalizers()
                        .iter()
                        .any(|f| f == agentrun_operator::labels::RESULT_FINALIZER)
                })
                .map(|p| p.name_any())
                .collect();
            if held.is_empty() {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "step Pods still hold {}: {held:?}",
                agentrun_operator::labels::RESULT_FINALIZER
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops the processes and deletes the namespace.
    pub async fn finish(mut self) {
        self.kill_operator().await;
        if let Some(mut k) = self.simkubelet.take() {
            k.kill().await;
        }
        // Step Pods hold our finalizer; release them so the namespace can go.
        if let Ok(pods) = self.pods().list(&Default::default()).await {
            for pod in pods {
                let _ = self
                    .pods()
                    .patch(
                        &pod.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                    )
                    .await;
            }
        }
        // Approvals may hold the notifier's finalizer; release them too.
        if let Ok(approvals) = self.approvals().list(&Default::default()).await {
            for a in approvals {
                let _ = self
                    .approvals()
                    .patch(
                        &a.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                    )
                    .await;
            }
        }
        if let Some(env) = self.env.take() {
            env.cleanup().await;
        }
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for p in [self.operator.as_ref(), self.simkubelet.as_ref()]
                .into_iter()
                .flatten()
            {
                eprintln!("{}", p.log_tail(80));
            }
            eprintln!("ledger: {}", self.ledger_path.display());
        }
    }
}

/// The field managers an object's `managedFields` name: who wrote it, as
/// `kubectl get --show-managed-fields` shows them.
pub fn field_managers(meta: &kube::api::ObjectMeta) -> std::collections::BTreeSet<String> {
    meta.managed_fields
        .iter()
        .flatten()
        .map(|m| m.manager.clone().unwrap_or_default())
        .collect()
}

/// The run's phase.
pub fn phase(run: &AgentRun) -> Option<RunPhase> {
    run.status.as_ref().and_then(|s| s.phase)
}

/// The run's status (empty if none yet).
pub fn status(run: &AgentRun) -> AgentRunStatus {
    run.status.clone().unwrap_or_default()
}

/// A step spec for the simulated kubelet: `sim` is the `SIM_STEP` JSON.
/// The latest checkpoint of step `name` (its own, not a probe's or a
/// compensation's), or a panic naming it.
pub fn step_checkpoint(run: &AgentRun, name: &str) -> agentrun_operator::api::StepCheckpoint {
    status(run)
        .steps
        .into_iter()
        .rev()
        .find(|c| c.name == name && c.role.is_step())
        .unwrap_or_else(|| panic!("no checkpoint for step {name}"))
}

pub fn sim_step(name: &str, effect: &str, sim: Value) -> Value {
    json!({
        "name": name,
        "effect": effect,
        "container": {
            "image": "registry.example/agent-step:1",
            "env": [{"name": "SIM_STEP", "value": sim.to_string()}],
        },
    })
}

/// Who holds the operator's leader Lease (`agentrun-operator`) right now.
pub async fn lease_holder(
    leases: &kube::Api<k8s_openapi::api::coordination::v1::Lease>,
) -> Option<String> {
    leases
        .get_opt("agentrun-operator")
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
}

/// Events on run `run` by reason, counting the repeats of a series.
pub async fn event_counts(s: &Scenario, run: &str) -> std::collections::BTreeMap<String, i32> {
    let events: kube::Api<k8s_openapi::api::events::v1::Event> = s.env().api();
    let list = events
        .list(&kube::api::ListParams::default())
        .await
        .expect("listing events");
    let mut counts = std::collections::BTreeMap::new();
    for e in list
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(run))
    {
        *counts
            .entry(e.reason.clone().unwrap_or_default())
            .or_insert(0) += e.series.as_ref().map_or(1, |s| s.count);
    }
    counts
}
