//! What simkubelet reads from a Pod once, when its life starts (its identity,
//! containers and the step's behaviour from `SIM_STEP`), and how a step ended:
//! the facts both the Pod's task (pod.rs) and the statuses it reports (status.rs)
//! are made from.

use std::time::Duration;

use agentrun_e2e::ledger::{LedgerEntry, LedgerEvent, Outcome};
use agentrun_operator::labels;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::argo::{ArgoTask, step_container};
use crate::effects;
use crate::journal_store::JournalId;
use crate::sim_step::{Behaviour, SimStep};
use crate::{SIGKILL_EXIT, SIM_STEP};

#[derive(Clone, Debug)]
pub(crate) struct PodFacts {
    pub(crate) name: String,
    pub(crate) namespace: String,
    pub(crate) uid: String,
    pub(crate) generation: Option<i64>,
    pub(crate) run: Option<String>,
    pub(crate) step: Option<String>,
    pub(crate) role: Option<String>,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) attempt: Option<u32>,
    /// (name, image) of every regular container.
    pub(crate) containers: Vec<(String, String)>,
    /// Index in `containers` of the step: the first, or Argo's `main`.
    pub(crate) step_container: usize,
    /// Names of the init containers (they have run to completion once the Pod runs).
    pub(crate) init_containers: Vec<(String, String)>,
    /// The task result this Pod's Argo `wait` sidecar writes (`--argo-task-results`).
    pub(crate) argo: Option<ArgoTask>,
    pub(crate) behaviour: std::result::Result<Behaviour, String>,
    /// A journaled step's journal (env `AGENTRUN_JOURNAL` and the rest).
    pub(crate) journal: Option<JournalId>,
    /// A verify probe asked about one journaled call: its key (`AGENTRUN_CALL_KEY`).
    pub(crate) call_key: Option<String>,
}

impl PodFacts {
    pub(crate) fn of(pod: &Pod, default_run: Duration, argo_task_results: bool) -> Self {
        let labels = pod.labels();
        let containers: Vec<(String, String)> = pod
            .spec
            .as_ref()
            .map(|s| {
                s.containers
                    .iter()
                    .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let init_containers: Vec<(String, String)> = pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .map(|cs| {
                cs.iter()
                    .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let argo = argo_task_results.then(|| ArgoTask::of(pod)).flatten();
        let step_container = step_container(pod, argo.is_some());
        let env = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.get(step_container))
            .and_then(|c| c.env.as_ref());
        let env_value = |name: &str| {
            env.and_then(|env| env.iter().find(|e| e.name == name))
                .map(|e| e.value.clone())
        };
        let attempt = env_value(labels::env::ATTEMPT)
            .flatten()
            .or_else(|| labels.get(labels::ATTEMPT).cloned())
            .and_then(|a| a.trim().parse::<u32>().ok());
        let idempotency_key = pod
            .annotations()
            .get(labels::IDEMPOTENCY_KEY)
            .cloned()
            .or_else(|| env_value(labels::env::IDEMPOTENCY_KEY).flatten());
        let behaviour = match env_value(SIM_STEP) {
            None => Ok(SimStep::default()),
            Some(None) => Err(format!("{SIM_STEP} must be a literal value")),
            Some(Some(json)) => SimStep::parse(&json),
        }
        .and_then(|s| s.for_run(labels.get(labels::RUN).map(String::as_str)))
        .and_then(|s| s.for_attempt(attempt.unwrap_or(1)))
        .map(|s| s.behaviour(default_run));
        let journal = env_value(labels::env::JOURNAL)
            .flatten()
            .map(|prefix| JournalId {
                prefix,
                run: labels.get(labels::RUN).cloned().unwrap_or_default(),
                run_uid: env_value(labels::env::RUN_UID)
                    .flatten()
                    .unwrap_or_default(),
                step: labels.get(labels::STEP).cloned().unwrap_or_default(),
                plan_revision: env_value(labels::env::PLAN_REVISION)
                    .flatten()
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(1),
                attempt: attempt.unwrap_or(1) as i32,
                step_key: idempotency_key.clone().unwrap_or_default(),
            });
        let behaviour = behaviour.and_then(|b| match (&b.journal, &journal) {
            (Some(_), None) => Err(format!(
                "{SIM_STEP}.journal needs a journaled step (env {})",
                labels::env::JOURNAL
            )),
            _ => Ok(b),
        });
        Self {
            name: pod.name_any(),
            namespace: pod.namespace().unwrap_or_default(),
            uid: pod.uid().unwrap_or_default(),
            generation: pod.metadata.generation,
            run: labels.get(labels::RUN).cloned(),
            step: labels.get(labels::STEP).cloned(),
            role: labels.get(labels::ROLE).cloned(),
            idempotency_key,
            attempt,
            containers,
            step_container,
            init_containers,
            argo,
            behaviour,
            journal,
            call_key: env_value(labels::env::CALL_KEY).flatten(),
        }
    }

    /// Whether this Pod's attempt acted, having run for `ran`: a probe only
    /// reads; a step acts once it ran past its `actAtMs`.
    pub(crate) fn acts(
        &self,
        behaviour: &Behaviour,
        ran: Duration,
        said_not_applied: bool,
    ) -> bool {
        self.role.as_deref() != Some("verify")
            && behaviour.probe.is_none()
            && effects::acted(ran, behaviour.act_at, said_not_applied)
    }

    pub(crate) fn ledger_entry(&self, started_at: Timestamp) -> LedgerEntry {
        LedgerEntry {
            event: LedgerEvent::Started,
            pod: self.name.clone(),
            namespace: self.namespace.clone(),
            uid: self.uid.clone(),
            run: self.run.clone(),
            step: self.step.clone(),
            idempotency_key: self.idempotency_key.clone(),
            attempt: self.attempt,
            role: self.role.clone(),
            started_at,
            exit_code: None,
            outcome: None,
            finished_at: None,
            reported_effect: None,
            acted: None,
            call: None,
        }
    }
}

/// How a step ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The step exited by itself with this code.
    Exited(i32),
    /// Killed (SIGKILL) because the Pod is being deleted.
    Killed,
}

impl Ending {
    pub(crate) fn exit_code(self) -> i32 {
        match self {
            Ending::Exited(code) => code,
            Ending::Killed => SIGKILL_EXIT,
        }
    }

    pub(crate) fn outcome(self) -> Outcome {
        match self {
            Ending::Exited(0) => Outcome::Succeeded,
            Ending::Exited(_) => Outcome::Failed,
            Ending::Killed => Outcome::Killed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::argo::argo_pod;
    use serde_json::json;

    #[test]
    fn an_argo_pods_step_is_main_and_its_task_result_is_named_after_the_node() {
        let facts = PodFacts::of(&argo_pod(), Duration::ZERO, true);
        assert_eq!(facts.step_container, 1);
        assert_eq!(
            facts.argo,
            Some(ArgoTask {
                node_id: "r00000-456".into(),
                workflow: "r00000".into(),
                workflow_uid: "wf-uid".into(),
            })
        );
        assert_eq!(
            facts.argo.unwrap().placeholder(),
            json!({
                "apiVersion": "argoproj.io/v1alpha1",
                "kind": "WorkflowTaskResult",
                "metadata": {
                    "name": "r00000-456",
                    "labels": {
                        "workflows.argoproj.io/workflow": "r00000",
                        "workflows.argoproj.io/report-outputs-completed": "false",
                    },
                    "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                                         "name": "r00000", "uid": "wf-uid"}],
                },
            })
        );
        // Without the flag the same Pod is an ordinary one: the first container is the step.
        let plain = PodFacts::of(&argo_pod(), Duration::ZERO, false);
        assert_eq!((plain.step_container, plain.argo), (0, None));
    }
}
