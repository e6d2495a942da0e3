//! Step Pods whose run is gone. While a run exists, the engine releases each
//! Pod's result finalizer after committing its outcome (D5). Once the run is
//! deleted (TTL or by a person) nothing is left to record the result into, and
//! the garbage collector's deletion of the Pod would wait on the finalizer
//! forever, so the finalizer is released here.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tracing::{info, warn};

use super::apply::release_finalizer;
use super::index::StepPod;
use crate::api::AgentRun;
use crate::labels;

/// A Pod that holds our finalizer and is being deleted or has no AgentRun
/// controlling it any more (`kubectl delete --cascade=orphan` removes the
/// owner reference and leaves the Pod): its run may be gone.
pub(super) fn may_be_orphaned(pod: &StepPod) -> bool {
    pod.finalizers()
        .iter()
        .any(|f| f == labels::RESULT_FINALIZER)
        && (pod.metadata.deletion_timestamp.is_some() || controlling_run(pod).is_none())
}

fn controlling_run(pod: &StepPod) -> Option<&OwnerReference> {
    pod.owner_references()
        .iter()
        .find(|r| r.kind == "AgentRun" && r.controller == Some(true))
}

/// Delay before looking again at a Pod whose check or release failed:
/// doubling from one second, capped at five minutes.
fn retry_delay(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.min(8)).min(Duration::from_secs(300))
}

/// Consumes Pods flagged by [`may_be_orphaned`] and releases the finalizer of
/// those whose owning run no longer exists (checked against the API server,
/// not the cache, so a run that is merely not cached yet keeps its Pods). A
/// Pod whose check or release fails is looked at again with backoff: no Pod
/// of ours keeps the finalizer after its run is gone (D5).
pub(super) async fn release_orphans(
    client: Client,
    mut synced: tokio::sync::watch::Receiver<u8>,
    pods: Store<StepPod>,
    tx: UnboundedSender<ObjectRef<StepPod>>,
    mut rx: UnboundedReceiver<ObjectRef<StepPod>>,
) {
    if synced
        .wait_for(|m| *m & super::SYNCED_RUNS != 0)
        .await
        .is_err()
    {
        return;
    }
    let mut failures: HashMap<ObjectRef<StepPod>, u32> = HashMap::new();
    while let Some(pod_ref) = rx.recv().await {
        match release_if_orphaned(&client, &pods, &pod_ref).await {
            Ok(()) => {
                failures.remove(&pod_ref);
            }
            Err(err) => {
                let n = failures.entry(pod_ref.clone()).or_insert(0);
                *n += 1;
                let delay = retry_delay(*n);
                warn!(pod = %pod_ref, error = %err, retry_in = ?delay, "releasing the finalizer of a pod whose run may be gone");
                let tx = tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = tx.send(pod_ref);
                });
            }
        }
    }
}

async fn release_if_orphaned(
    client: &Client,
    pods: &Store<StepPod>,
    pod_ref: &ObjectRef<StepPod>,
) -> Result<(), kube::Error> {
    let Some(pod) = pods.get(pod_ref) else {
        return Ok(()); // gone
    };
    if !may_be_orphaned(&pod) {
        return Ok(());
    }
    let Some(ns) = pod.namespace() else {
        return Ok(());
    };
    if let Some(owner) = controlling_run(&pod) {
        let run_api: Api<AgentRun> = Api::namespaced(client.clone(), &ns);
        let run_exists = run_api
            .get_opt(&owner.name)
            .await?
            .is_some_and(|run| run.uid().as_deref() == Some(owner.uid.as_str()));
        if run_exists {
            return Ok(()); // the run's own reconcile releases it (D5)
        }
    }
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    if release_finalizer(&pod_api, Some(&pod.to_pod()), &pod.name_any())
        .await?
        .is_some()
    {
        info!(pod = %pod_ref, "released finalizer of a pod whose run is gone");
    }
    Ok(())
}
