//! The kube-runtime wiring: watch AgentRuns, their step Pods and Approvals;
//! for each run observe (caches) → decide ([`crate::engine`]) → apply
//! (guarded status write, then the engine's actions).
//!
//! ```text
//!   watch AgentRun ─┐
//!   watch Pod (agentrun.dev/run) ──owns──┤──▶ reconcile(run) ──▶ engine::decide ──▶ status (resourceVersion-guarded)
//!   watch Approval ──by run UID──────────┘                                     └─▶ create Pod / release finalizer / …
//! ```
//!
//! The operator holds no durable state in memory: the caches are rebuilt from
//! the API server after a restart, and every decision starts from the run's
//! committed status.

mod apply;
mod error;
mod orphans;
mod reconcile;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{info, warn};

use crate::api::{AgentRun, Approval};
use crate::labels;

pub use error::{Category, Error, Result};

/// Where the operator looks for runs.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    /// Watch only this namespace; `None` watches all namespaces.
    pub namespace: Option<String>,
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    /// Step Pods (label `agentrun.dev/run`), managedFields trimmed.
    pub pods: Store<Pod>,
    /// Approvals, managedFields kept (the decider is read from them).
    pub approvals: Store<Approval>,
    pub recorder: Recorder,
    /// Consecutive failures per run, for the per-object backoff.
    failures: Mutex<HashMap<ObjectRef<AgentRun>, u32>>,
}

impl Context {
    fn record_failure(&self, run: &ObjectRef<AgentRun>) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = failures.entry(run.clone()).or_insert(0);
        *n += 1;
        *n
    }

    fn record_success(&self, run: &ObjectRef<AgentRun>) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(run);
    }
}

fn api_for<K>(client: &Client, scope: &Scope) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match &scope.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs the controller until `shutdown` resolves. In-flight reconciles finish
/// first; anything cut short is re-derived by the next instance.
pub async fn run(
    client: Client,
    scope: Scope,
    reporter: Reporter,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let runs: Api<AgentRun> = api_for(&client, &scope);
    let pods_api: Api<Pod> = api_for(&client, &scope);
    let approvals_api: Api<Approval> = api_for(&client, &scope);

    let (pods, pods_writer) = reflector::store();
    let (orphan_tx, orphan_rx) = tokio::sync::mpsc::unbounded_channel();
    let pod_stream = watcher(pods_api, watcher::Config::default().labels(labels::RUN))
        .default_backoff()
        .modify(|pod: &mut Pod| {
            pod.managed_fields_mut().clear();
        })
        .reflect(pods_writer)
        .touched_objects()
        .inspect_ok(move |pod: &Pod| {
            if orphans::may_be_orphaned(pod) {
                let _ = orphan_tx.send(ObjectRef::from_obj(pod));
            }
        });

    let (approvals, approvals_writer) = reflector::store();
    let approval_stream = watcher(approvals_api, watcher::Config::default())
        .default_backoff()
        .reflect(approvals_writer)
        .touched_objects();

    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client: client.clone(),
        pods: pods.clone(),
        approvals,
        failures: Mutex::new(HashMap::new()),
    });

    let controller = Controller::new(runs, watcher::Config::default())
        .with_config(controller::Config::default().concurrency(16))
        .owns_stream(pod_stream)
        .watches_stream(approval_stream, |approval: Approval| {
            // The Approval names its run; the owner reference says the same.
            let ns = approval.namespace()?;
            Some(ObjectRef::<AgentRun>::new(&approval.spec.run_name).within(&ns))
        })
        .graceful_shutdown_on(shutdown);

    tokio::spawn(orphans::release_orphans(
        client.clone(),
        controller.store(),
        pods,
        orphan_rx,
    ));

    info!(namespace = ?scope.namespace, "controller started");
    controller
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((run, _)) => tracing::trace!(%run, "reconciled"),
                Err(controller::Error::ReconcilerFailed(err, run)) => {
                    warn!(%run, error = %err, category = ?err.category(), "reconcile failed")
                }
                Err(err) => tracing::debug!(error = %err, "controller event"),
            }
        })
        .await;
    info!("controller stopped");
}
