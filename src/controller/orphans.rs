//! Step Pods whose run is gone. While a run exists, the engine releases each
//! Pod's result finalizer after committing its outcome (D5). Once the run is
//! deleted (TTL or by a person) nothing is left to record the result into, and
//! the garbage collector's deletion of the Pod would wait on the finalizer
//! forever, so the finalizer is released here.

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::{info, warn};

use super::apply::release_finalizer;
use crate::api::AgentRun;
use crate::labels;

/// A Pod being deleted that still holds our finalizer.
pub(super) fn may_be_orphaned(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        && pod
            .finalizers()
            .iter()
            .any(|f| f == labels::RESULT_FINALIZER)
}

/// Consumes Pods flagged by [`may_be_orphaned`] and releases the finalizer of
/// those whose owning run no longer exists (checked against the API server,
/// not the cache, so a run that is merely not cached yet keeps its Pods).
pub(super) async fn release_orphans(
    client: Client,
    mut synced: tokio::sync::watch::Receiver<u8>,
    pods: Store<Pod>,
    mut rx: UnboundedReceiver<ObjectRef<Pod>>,
) {
    if synced
        .wait_for(|m| *m & super::SYNCED_RUNS != 0)
        .await
        .is_err()
    {
        return;
    }
    while let Some(pod_ref) = rx.recv().await {
        let Some(pod) = pods.get(&pod_ref) else {
            continue;
        };
        let Some(ns) = pod.namespace() else { continue };
        let Some(owner) = pod
            .owner_references()
            .iter()
            .find(|r| r.kind == "AgentRun" && r.controller == Some(true))
            .cloned()
        else {
            continue;
        };
        let run_api: Api<AgentRun> = Api::namespaced(client.clone(), &ns);
        let run_exists = match run_api.get_opt(&owner.name).await {
            Ok(Some(run)) => run.uid().as_deref() == Some(owner.uid.as_str()),
            Ok(None) => false,
            Err(err) => {
                warn!(pod = %pod_ref, error = %err, "checking the owner of a deleted pod");
                true
            }
        };
        if run_exists {
            continue;
        }
        let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        match release_finalizer(&pod_api, Some(&*pod), &pod.name_any()).await {
            Ok(Some(_)) => info!(pod = %pod_ref, "released finalizer of a pod whose run is gone"),
            Ok(None) => {}
            Err(err) => warn!(pod = %pod_ref, error = %err, "releasing finalizer of orphaned pod"),
        }
    }
}
