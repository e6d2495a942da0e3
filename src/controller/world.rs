//! Observe: what the cluster shows for one run ([`World`]), gathered from the
//! caches, with the Pods the status names read from the API server when the
//! cache lacks them; and the facts the caches give the decision beside it
//! (the run's place in the queue, a fork's source).

use k8s_openapi::api::core::v1::Pod;
use kube::api::Patch;
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{debug, warn};

use super::Context;
use super::error::{Error, Result};
use super::patch::patch_params;
use crate::api::{AgentRun, Approval, Signal, StepJournal};
use crate::engine;
/// What the cluster shows for one run, gathered from the caches.
pub(super) struct World {
    pub pods: Vec<Pod>,
    pub approvals: Vec<Approval>,
    pub signals: Vec<Signal>,
    /// The run's journal chunks (by run UID; the engine reads only the
    /// names it expects).
    pub journals: Vec<StepJournal>,
    /// Some Pods are this process's own recent writes standing in for the
    /// cache (see `expectations`).
    pub stand_ins: bool,
}

/// Gathers the run's step Pods (by label, then by owner UID so a same-named
/// newer run never sees an older run's Pods) and its Approvals (by run UID).
pub(super) fn observe(run: &AgentRun, ctx: &Context) -> Result<World> {
    let name = run
        .metadata
        .name
        .as_deref()
        .ok_or(Error::MissingMetadata("name"))?;
    let ns = run
        .metadata
        .namespace
        .as_deref()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let uid = run
        .metadata
        .uid
        .as_deref()
        .ok_or(Error::MissingMetadata("uid"))?;
    let owned_by_run =
        |refs: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference]| {
            refs.iter().any(|r| r.uid == uid)
        };
    // Pods this process created or released moments ago stand in for cached
    // copies the watch has not updated yet, so the engine does not ask for the
    // same write again.
    let (pods, stand_ins) = ctx.expectations.pods_of(&ctx.pods, ns, name);
    let pods = pods
        .into_iter()
        .filter(|p| owned_by_run(p.owner_references()))
        .collect();
    let approvals = ctx
        .approval_index
        .read(&ctx.approvals, ns, uid)
        .filter(|a| a.spec.run_uid == uid && owned_by_run(a.owner_references()))
        .map(|a| (*a).clone())
        .collect();
    let signals = ctx
        .signal_index
        .read(&ctx.signals, ns, uid)
        .filter(|s| s.spec.run_uid == uid && owned_by_run(s.owner_references()))
        .map(|s| (*s).clone())
        .collect();
    let journals = ctx
        .journal_index
        .read(&ctx.journals, ns, uid)
        .filter(|j| j.spec.run_uid == uid)
        .map(|j| (*j).clone())
        .collect();
    Ok(World {
        pods,
        approvals,
        signals,
        journals,
        stand_ins,
    })
}

/// Reads the Pods the run's status names as running or still stopping that
/// the cache does not hold. The cache can be behind the run: a new leader's
/// Pod list older than the run it read, whose previous leader created or
/// recorded the Pod in between; a Pod watch that relists or stalls; a Pod
/// whose `agentrun.dev/run` label someone removed, which the watch no longer
/// selects. Taken as absent, such a Pod would look lost, never created, or
/// stopped — and the next attempt could start beside it (D2), or a stopping
/// attempt's report be given up on. It is called absent on the API server's
/// word only: a Pod found is decided on as read, a Pod not found is gone.
pub(super) async fn read_recorded_pods(
    run: &AgentRun,
    world: &mut World,
    ctx: &Context,
    now: jiff::Timestamp,
) -> Result<()> {
    let unseen: Vec<&str> = engine::referenced_pods(run, now)
        .into_iter()
        .filter(|(name, recorded)| engine::must_read(&world.pods, name, *recorded))
        .map(|(name, _)| name)
        .collect();
    if unseen.is_empty() {
        return Ok(());
    }
    let ns = run.namespace().ok_or(Error::MissingMetadata("namespace"))?;
    let uid = run
        .metadata
        .uid
        .as_deref()
        .ok_or(Error::MissingMetadata("uid"))?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    for name in unseen {
        let read = pods.get_opt(name).await.map_err(|source| Error::ReadPod {
            run: obj_ref_string(run),
            pod: name.to_owned(),
            source,
        })?;
        // The API server's copy replaces whatever the cache showed.
        world
            .pods
            .retain(|p| p.metadata.name.as_deref() != Some(name));
        match read {
            Some(pod) if pod.owner_references().iter().any(|r| r.uid == uid) => {
                debug!(
                    pod = name,
                    "the Pod cache does not show a Pod the run names as it is; deciding on the Pod as read"
                );
                let run_name = run.name_any();
                let labelled = pod
                    .labels()
                    .get(crate::labels::RUN)
                    .is_some_and(|r| *r == run_name);
                if !labelled {
                    // Its run label was removed: the Pod watch no longer
                    // selects it, and nothing would wake the run when it
                    // ends. The operator's own label is put back.
                    let patch = json!({"metadata": {"labels": {crate::labels::RUN: run_name}}});
                    match pods
                        .patch(name, &patch_params(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => warn!(
                            pod = name,
                            "put back the run label someone removed from a step Pod"
                        ),
                        Err(err) => {
                            warn!(pod = name, error = %err, "could not put back a step Pod's run label")
                        }
                    }
                }
                world.pods.push(pod);
            }
            _ => debug!(pod = name, "a Pod the run names is gone"),
        }
    }
    Ok(())
}

/// Where a run that has not started waits, when the caps on active runs are
/// reached ([`super::capacity`]); `None` lets it start.
pub(super) fn queued(run: &AgentRun, ctx: &Context) -> Option<engine::Queued> {
    let caps = ctx.capacity.caps();
    let seat = super::capacity::Seat::of(run, caps);
    if seat.started || seat.gone || !caps.any() {
        return None;
    }
    let all: Vec<super::capacity::Seat> = ctx
        .runs
        .state()
        .iter()
        .filter_map(|g| {
            g.0.as_ref()
                .ok()
                .map(|r| super::capacity::Seat::of(r, caps))
        })
        .collect();
    ctx.capacity.admit(&seat, &all)
}

/// For a fork's first decision, its source run as the cache shows it (the
/// engine checks its UID). Once the fork has a plan it needs no source.
pub(super) fn fork_source(run: &AgentRun, ctx: &Context) -> Option<AgentRun> {
    let fork = run.spec.fork_of.as_ref()?;
    if run.status.as_ref().is_some_and(|s| s.plan.is_some()) {
        return None;
    }
    let key = super::RunRef::new(&fork.run_name).within(&run.namespace()?);
    let guard = ctx.runs.get(&key)?;
    guard.0.as_ref().ok().cloned()
}

/// `namespace/name`, as the run is named in logs and the Pods read.
pub(super) fn obj_ref_string(run: &AgentRun) -> String {
    format!(
        "{}/{}",
        run.metadata.namespace.as_deref().unwrap_or_default(),
        run.metadata.name.as_deref().unwrap_or_default()
    )
}
