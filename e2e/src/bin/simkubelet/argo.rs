//! Argo Workflows' wait sidecar (`--argo-task-results`).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::{error, warn};

/// Argo's container names (`workflow/common`): the step and its sidecar.
const ARGO_MAIN: &str = "main";
const ARGO_WAIT: &str = "wait";
/// Labels and the annotation argoexec and the controller use.
const ARGO_LABEL_WORKFLOW: &str = "workflows.argoproj.io/workflow";
const ARGO_LABEL_OUTPUTS_COMPLETED: &str = "workflows.argoproj.io/report-outputs-completed";
const ARGO_ANNOTATION_NODE_ID: &str = "workflows.argoproj.io/node-id";

/// Which container is the step: Argo's `main` when this Pod is an Argo step, else the first.
pub(crate) fn step_container(pod: &Pod, argo: bool) -> usize {
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice());
    argo.then(|| containers?.iter().position(|c| c.name == ARGO_MAIN))
        .flatten()
        .unwrap_or(0)
}

/// What the `wait` sidecar of an Argo step Pod knows: the controller hands it the node ID,
/// the Workflow's name and UID in its env (`ARGO_NODE_ID`, `ARGO_WORKFLOW_NAME`,
/// `ARGO_WORKFLOW_UID`); the node-id annotation, the workflow label and the Pod's owner are
/// the same facts on the Pod itself.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ArgoTask {
    pub(crate) node_id: String,
    pub(crate) workflow: String,
    pub(crate) workflow_uid: String,
}

impl ArgoTask {
    /// `None` for a Pod without Argo's `wait` and `main` containers.
    pub(crate) fn of(pod: &Pod) -> Option<Self> {
        let spec = pod.spec.as_ref()?;
        let wait = spec.containers.iter().find(|c| c.name == ARGO_WAIT)?;
        spec.containers.iter().find(|c| c.name == ARGO_MAIN)?;
        let env = |name: &str| {
            wait.env
                .iter()
                .flatten()
                .find(|e| e.name == name)
                .and_then(|e| e.value.clone())
        };
        let owner = pod
            .owner_references()
            .iter()
            .find(|o| o.kind == "Workflow" && o.api_version.starts_with("argoproj.io/"));
        Some(Self {
            node_id: env("ARGO_NODE_ID")
                .or_else(|| pod.annotations().get(ARGO_ANNOTATION_NODE_ID).cloned())?,
            workflow: env("ARGO_WORKFLOW_NAME")
                .or_else(|| pod.labels().get(ARGO_LABEL_WORKFLOW).cloned())
                .or_else(|| owner.map(|o| o.name.clone()))?,
            workflow_uid: env("ARGO_WORKFLOW_UID").or_else(|| owner.map(|o| o.uid.clone()))?,
        })
    }

    pub(crate) fn api_resource() -> ApiResource {
        ApiResource {
            group: "argoproj.io".into(),
            version: "v1alpha1".into(),
            api_version: "argoproj.io/v1alpha1".into(),
            kind: "WorkflowTaskResult".into(),
            plural: "workflowtaskresults".into(),
        }
    }

    /// argoexec's `createTaskResult`: an empty `NodeResult`, not yet complete.
    pub(crate) fn placeholder(&self) -> Value {
        json!({
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "WorkflowTaskResult",
            "metadata": {
                "name": self.node_id,
                "labels": {
                    ARGO_LABEL_WORKFLOW: self.workflow,
                    ARGO_LABEL_OUTPUTS_COMPLETED: "false",
                },
                "ownerReferences": [{
                    "apiVersion": "argoproj.io/v1alpha1",
                    "kind": "Workflow",
                    "name": self.workflow,
                    "uid": self.workflow_uid,
                }],
            },
        })
    }
}

/// argoexec's `ReportOutputs` patch for a container template without outputs
/// (`json.Marshal(&WorkflowTaskResult{NodeResult: {Outputs: &{}}})`).
fn argo_outputs_patch() -> Value {
    json!({"metadata": {"creationTimestamp": null}, "outputs": {}})
}

/// argoexec's `FinalizeOutput` patch.
fn argo_completed_patch() -> Value {
    json!({
        "metadata": {
            "creationTimestamp": null,
            "labels": {ARGO_LABEL_OUTPUTS_COMPLETED: "true"},
        },
    })
}

/// Writes one Pod's task result, retrying transient errors as argoexec does (capped
/// backoff), for as long as the Pod exists.
pub(crate) struct TaskResultWriter<'a> {
    pub(crate) api: Api<DynamicObject>,
    pub(crate) task: &'a ArgoTask,
    pub(crate) pod: &'a str,
}

impl TaskResultWriter<'_> {
    /// argoexec `wait`'s `InitializeOutput`: create the placeholder (one that exists
    /// already is argoexec's `upsertTaskResult` finding it: left as it is).
    pub(crate) async fn create_placeholder(&self, rx: &mut watch::Receiver<bool>) {
        let obj: DynamicObject = serde_json::from_value(self.task.placeholder())
            .expect("the task result is a valid object");
        self.retry(rx, "create", || async {
            match self.api.create(&PostParams::default(), &obj).await {
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                other => other.map(|_| ()),
            }
        })
        .await;
    }

    /// `ReportOutputs` (the outputs; none here) then `FinalizeOutput` (complete).
    pub(crate) async fn report_outputs(&self, rx: &mut watch::Receiver<bool>) {
        for (what, patch) in [
            ("report outputs", argo_outputs_patch()),
            ("finalize", argo_completed_patch()),
        ] {
            self.retry(rx, what, || async {
                self.api
                    .patch(
                        &self.task.node_id,
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                    .map(|_| ())
            })
            .await;
        }
    }

    async fn retry<F, Fut>(&self, rx: &mut watch::Receiver<bool>, what: &str, write: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = kube::Result<()>>,
    {
        let mut backoff = Duration::from_millis(50);
        loop {
            match write().await {
                Ok(()) => return,
                Err(kube::Error::Api(s))
                    if (400..500).contains(&s.code) && s.code != 429 && s.code != 408 =>
                {
                    error!(pod = %self.pod, task_result = %self.task.node_id, what,
                        code = s.code, message = %s.message, "task result write rejected");
                    return;
                }
                Err(e) => {
                    warn!(pod = %self.pod, task_result = %self.task.node_id, what, error = %e,
                        ?backoff, "task result write failed; retrying");
                }
            }
            if rx.has_changed().is_err() {
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

/// An Argo step Pod as workflow-controller v4.0.5 makes it (init; wait and main): the
/// fixture of the tests of what simkubelet reads from one (facts.rs) and reports (status.rs).
#[cfg(test)]
pub(crate) fn argo_pod() -> Pod {
    serde_json::from_value(json!({
        "metadata": {
            "name": "r00000-s001-123", "uid": "pod-uid",
            "labels": {"workflows.argoproj.io/workflow": "r00000", "agentrun.dev/run": "r00000"},
            "annotations": {"workflows.argoproj.io/node-id": "r00000-456"},
            "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                                 "name": "r00000", "uid": "wf-uid", "controller": true}],
        },
        "spec": {
            "initContainers": [{"name": "init", "image": "argoexec"}],
            "containers": [
                {"name": "wait", "image": "argoexec", "env": [
                    {"name": "ARGO_NODE_ID", "value": "r00000-456"},
                    {"name": "ARGO_WORKFLOW_NAME", "value": "r00000"},
                    {"name": "ARGO_WORKFLOW_UID", "value": "wf-uid"}]},
                {"name": "main", "image": "step"},
            ],
        },
    }))
    .unwrap()
}
