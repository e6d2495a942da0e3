//! Pod status as a kubelet reports it. Nothing runs Pods on the e2e plane,
//! so tests (and simkubelet) move step Pods through their lifecycle with
//! these writes to `pods/status`:
//!
//! ```text
//!   Pending ──set_pod_running──▶ Running ──set_pod_terminated(0, msg)──▶ Succeeded
//!                                   │     ──set_pod_terminated(n, msg)──▶ Failed
//!                                   └─────set_pod_evicted(msg)─────────▶ Failed/Evicted + DisruptionTarget
//! ```

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

/// Exit code of a container killed by SIGKILL, as after an eviction.
pub const EXIT_KILLED: i32 = 137;

/// Marks the Pod Running: `startTime`, every container running and ready,
/// `Ready`/`ContainersReady` conditions True.
pub async fn set_pod_running(pods: &Api<Pod>, name: &str) -> kube::Result<Pod> {
    let pod = pods.get(name).await?;
    let now = time_now();
    let start = pod
        .status
        .as_ref()
        .and_then(|s| s.start_time.clone())
        .map_or_else(|| now.clone(), |t| json!(t));
    let statuses: Vec<Value> = containers(&pod)
        .map(|(name, image)| {
            json!({
                "name": name, "image": image, "imageID": "",
                "ready": true, "started": true, "restartCount": 0,
                "state": { "running": { "startedAt": now } },
            })
        })
        .collect();
    patch_status(
        pods,
        name,
        json!({
            "phase": "Running",
            "startTime": start,
            "containerStatuses": statuses,
            "conditions": [
                condition("Ready", "True", None, None, &now),
                condition("ContainersReady", "True", None, None, &now),
            ],
        }),
    )
    .await
}

/// Ends the Pod as its containers exiting with `exit_code` and writing
/// `message` as their termination message: phase Succeeded for 0, else Failed.
pub async fn set_pod_terminated(
    pods: &Api<Pod>,
    name: &str,
    exit_code: i32,
    message: &str,
) -> kube::Result<Pod> {
    let (phase, reason) = if exit_code == 0 {
        ("Succeeded", "Completed")
    } else {
        ("Failed", "Error")
    };
    terminate(pods, name, phase, None, exit_code, reason, message, None).await
}

/// Ends the Pod as a kubelet eviction does: phase Failed, reason `Evicted`,
/// a `DisruptionTarget` condition (reason `TerminationByKubelet`) and its
/// containers killed (exit code 137).
pub async fn set_pod_evicted(pods: &Api<Pod>, name: &str, message: &str) -> kube::Result<Pod> {
    let disruption = condition(
        "DisruptionTarget",
        "True",
        Some("TerminationByKubelet"),
        Some(message),
        &time_now(),
    );
    terminate(
        pods,
        name,
        "Failed",
        Some(("Evicted", message)),
        EXIT_KILLED,
        "Error",
        "",
        Some(disruption),
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn terminate(
    pods: &Api<Pod>,
    name: &str,
    phase: &str,
    pod_reason: Option<(&str, &str)>,
    exit_code: i32,
    container_reason: &str,
    message: &str,
    extra_condition: Option<Value>,
) -> kube::Result<Pod> {
    let pod = pods.get(name).await?;
    let now = time_now();
    let status = pod.status.as_ref();
    let pod_start = status
        .and_then(|s| s.start_time.clone())
        .map_or_else(|| now.clone(), |t| json!(t));
    let statuses: Vec<Value> = containers(&pod)
        .map(|(container, image)| {
            // Keep the container's own start when it was running.
            let started = status
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.name == container))
                .and_then(|c| c.state.as_ref()?.running.as_ref()?.started_at.clone())
                .map_or_else(|| pod_start.clone(), |t| json!(t));
            let mut terminated = json!({
                "exitCode": exit_code, "reason": container_reason,
                "startedAt": started, "finishedAt": now,
            });
            if !message.is_empty() {
                terminated["message"] = json!(message);
            }
            json!({
                "name": container, "image": image, "imageID": "",
                "ready": false, "started": false, "restartCount": 0,
                "state": { "terminated": terminated },
            })
        })
        .collect();
    let mut conditions = vec![
        condition("Ready", "False", Some("PodCompleted"), None, &now),
        condition("ContainersReady", "False", Some("PodCompleted"), None, &now),
    ];
    conditions.extend(extra_condition);
    let mut patch = json!({
        "phase": phase,
        "startTime": pod_start,
        "containerStatuses": statuses,
        "conditions": conditions,
    });
    if let Some((reason, message)) = pod_reason {
        patch["reason"] = json!(reason);
        patch["message"] = json!(message);
    }
    patch_status(pods, name, patch).await
}

/// A strategic-merge patch of `status`: conditions merge by type, container
/// statuses are replaced as a whole.
async fn patch_status(pods: &Api<Pod>, name: &str, status: Value) -> kube::Result<Pod> {
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Strategic(json!({ "status": status })),
    )
    .await
}

fn containers(pod: &Pod) -> impl Iterator<Item = (String, String)> + '_ {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
}

fn condition(
    type_: &str,
    status: &str,
    reason: Option<&str>,
    message: Option<&str>,
    at: &Value,
) -> Value {
    let mut c = json!({ "type": type_, "status": status, "lastTransitionTime": at });
    if let Some(reason) = reason {
        c["reason"] = json!(reason);
    }
    if let Some(message) = message {
        c["message"] = json!(message);
    }
    c
}

fn time_now() -> Value {
    json!(Time(Timestamp::now()))
}
