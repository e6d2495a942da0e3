//! The result finalizers at the end of a chaos run: the driver waits until
//! every step Pod has given its up (D5), then, on a passing run, releases
//! whatever is left so the namespace can go.

use std::time::{Duration, Instant};

use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use super::operators::Operators;
use super::rng::Rng;

/// Waits until no step Pod holds the result finalizer (every run is finished,
/// so every result is committed and every finalizer due for release, D5);
/// returns how many still hold it at the deadline. A Pod list that fails is
/// an error: nothing was counted. Operators that exit meanwhile come back.
pub(super) async fn wait_finalizers_released(
    pods: &Api<Pod>,
    operators: &mut Operators,
    rng: &mut Rng,
    timeout: Duration,
) -> Result<usize, String> {
    let deadline = Instant::now() + timeout;
    loop {
        operators.tick(rng, false);
        let held = pods
            .list(&ListParams::default().labels(labels::RUN))
            .await
            .map_err(|e| format!("listing step Pods: {e}"))?
            .items
            .iter()
            .filter(|p| p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER))
            .count();
        if held == 0 || Instant::now() >= deadline {
            return Ok(held);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Step Pods hold the result finalizer; release them so the namespace can go.
pub(super) async fn release_finalizers(pods: &Api<Pod>) {
    if let Ok(list) = pods.list(&ListParams::default()).await {
        for pod in list {
            let _ = pods
                .patch(
                    &pod.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                )
                .await;
        }
    }
}
