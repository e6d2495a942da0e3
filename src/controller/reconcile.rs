//! One reconcile of one AgentRun: observe → decide → apply → requeue.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{Instrument as _, debug, instrument, warn};

use super::Context;
use super::apply;
use super::error::{Error, Result, backoff};
use super::queue::Action;
use super::world::{fork_source, obj_ref_string, observe, queued, read_recorded_pods};
use crate::api::AgentRun;
use crate::engine;
use crate::engine::reasons::{ConditionType, Reason};
use crate::metrics::CategoryLabel;

/// How many times one reconcile re-reads and re-decides after a 409 on the
/// status write before handing the run back to the queue.
const MAX_CONFLICTS: u32 = 5;
/// How many follow-up decisions one reconcile makes on the object its own
/// status write returned, when a decision asks to be looked at again at once.
const MAX_FOLLOW_UPS: u32 = 3;

/// Reconciles the run `run` names, as the cache shows it now; a failure is
/// logged and decides when the run is tried again ([`error_policy`]).
pub(super) async fn reconcile(run: super::RunRef, ctx: Arc<Context>) -> Action {
    ctx.caches_synced().await;
    ctx.resume.begin(&ctx);
    let Some(guard) = ctx.runs.get(&run) else {
        ctx.resume.reconciled(&ctx, &run);
        return Action::await_change(); // deleted
    };
    let action = match reconcile_one(guard.clone(), ctx.clone()).await {
        Ok(action) => action,
        Err(err) => {
            warn!(%run, error = %err, category = ?err.category(), "reconcile failed");
            error_policy(guard, &err, ctx.clone())
        }
    };
    ctx.resume.reconciled(&ctx, &run);
    action
}

#[instrument(skip(guard, ctx), fields(run = %guard.name_any(), namespace = guard.namespace().unwrap_or_default()))]
async fn reconcile_one(
    guard: Arc<DeserializeGuard<AgentRun>>,
    ctx: Arc<Context>,
) -> Result<Action> {
    let _in_flight = ctx.metrics.in_flight();
    let run = match &guard.0 {
        Ok(run) => Arc::new(run.clone()),
        Err(invalid) => return unreadable(&guard, invalid, &ctx).await,
    };
    if let (Some(ns), Some(name), Some(version)) = (
        run.metadata.namespace.as_deref(),
        run.metadata.name.as_deref(),
        run.metadata.resource_version.as_deref(),
    ) && ctx.status_writes.behind(ns, name, version)
    {
        // The cached copy is one this process has written over: a decision
        // on it would meet 409. The watch brings the newer copy and, with
        // it, the next reconcile, which sees every Pod event since. Should
        // the watch bring nothing, the run is looked at again once the
        // record is void.
        debug!(
            run = name,
            "the run cache is behind this process's own status write; waiting for its watch"
        );
        return Ok(Action::requeue(super::expectations::StatusWrites::TTL));
    }
    let started = std::time::Instant::now();
    // The run's trace: this reconcile's span (and its logs) belong to it.
    let span = tracing::info_span!(
        target: crate::telemetry::trace::TARGET,
        "reconcile",
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    if let Some(uid) = run.metadata.uid.as_deref() {
        crate::telemetry::trace::adopt(&span, uid);
    }
    // The Kubernetes client has no read timeout: a request that is never
    // answered would hold this slot for good. Past the deadline the
    // reconcile is dropped where it stands, as a crash would leave it (every
    // step of it is safe to cut short), and the run is tried again.
    let run_ref = obj_ref_string(&run);
    let result = match tokio::time::timeout(
        ctx.reconcile_timeout,
        Box::pin(reconcile_inner(run, &ctx)).instrument(span),
    )
    .await
    {
        Ok(result) => result,
        Err(_) => Err(Error::Timeout {
            run: run_ref,
            after: ctx.reconcile_timeout,
        }),
    };
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    result
}

async fn reconcile_inner(run: Arc<AgentRun>, ctx: &Arc<Context>) -> Result<Action> {
    let obj_ref = ObjectRef::from_obj(run.as_ref());
    let ns = run.namespace().ok_or(Error::MissingMetadata("namespace"))?;
    let runs: Api<AgentRun> = Api::namespaced(ctx.client.clone(), &ns);

    let mut current: Arc<AgentRun> = run;
    let mut conflicts = 0;
    let mut follow_ups = 0;
    // Creations refused while applying the previous decision, told to the
    // next one; each reconcile reports refusals to the engine once.
    let mut refused: Vec<engine::Refusal> = Vec::new();
    let mut refusals_told = false;
    loop {
        let mut world = observe(&current, ctx)?;
        let now = ctx.clock.now();
        read_recorded_pods(&current, &mut world, ctx, now).await?;
        let history = super::history::look_up(&current, now, ctx).await;
        let (decision, world) = super::decide::decide(super::decide::Facts {
            run: current.clone(),
            world,
            refused: refused.clone(),
            source: fork_source(&current, ctx),
            queued: queued(&current, ctx),
            history,
            now,
        })
        .await?;
        let creates = decision
            .actions
            .iter()
            .any(|a| matches!(a, engine::Action::CreatePod(_)));
        match apply::apply(&runs, &current, &world, decision, ctx).await {
            Ok(applied) => {
                ctx.record_success(&obj_ref);
                if let Some(written) = &applied.written {
                    if let Some(base) = current.metadata.resource_version.as_deref() {
                        ctx.status_writes.wrote(&ns, &current.name_any(), base);
                    }
                    current = Arc::new(written.clone());
                }
                if !applied.refused.is_empty() {
                    if !refusals_told {
                        // The engine records what the refusal means (a failed
                        // attempt, a stalled run) before anything else happens.
                        refusals_told = true;
                        refused = applied.refused;
                        continue;
                    }
                    refused.extend(applied.refused);
                }
                if refused
                    .iter()
                    .any(|r| r.cause != engine::RefusalCause::Rejected)
                {
                    // Tried again with backoff; the run already says why.
                    return Err(Error::CreateRefused {
                        run: obj_ref.to_string(),
                        names: refused
                            .iter()
                            .map(|r| r.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
                // A decision that wrote status and asks to be looked at again
                // at once (the Pod of the step it launched, the finalizer of
                // the step it committed) goes on from the object the write
                // returned: the cache may not have that write yet, and a
                // decision on the older copy would only meet a 409. One that
                // created a Pod whose UID the run must record (a NonIdempotent
                // attempt's, created again after a restart) goes on with that
                // Pod standing in for the cache, before its watch event.
                if (applied.written.is_some() || creates)
                    && applied.requeue == Some(Duration::ZERO)
                    && follow_ups < MAX_FOLLOW_UPS
                {
                    follow_ups += 1;
                    continue;
                }
                // A decision made on stand-ins looks again once they have
                // expired, in case no watch event comes to settle them.
                let requeue = if world.stand_ins {
                    let cap = super::expectations::Expectations::TTL;
                    Some(applied.requeue.map_or(cap, |after| after.min(cap)))
                } else {
                    applied.requeue
                };
                return Ok(match requeue {
                    Some(after) => Action::requeue(after),
                    None => Action::await_change(),
                });
            }
            Err(apply::Outcome::Stale(fresh)) => {
                // Pods were about to be created from a status that has moved
                // on (the fence in `apply`): decide again on the run as it is.
                conflicts += 1;
                if conflicts >= MAX_CONFLICTS {
                    return Err(Error::StatusConflict {
                        run: obj_ref.to_string(),
                        attempts: conflicts,
                    });
                }
                current = Arc::from(fresh);
            }
            Err(apply::Outcome::Conflict) => {
                ctx.metrics.status_conflicts.inc();
                conflicts += 1;
                if conflicts >= MAX_CONFLICTS {
                    return Err(Error::StatusConflict {
                        run: obj_ref.to_string(),
                        attempts: conflicts,
                    });
                }
                // Our view was stale: re-read the run and decide again.
                debug!(conflicts, "status write conflicted; re-reading the run");
                let name = current.name_any();
                current = Arc::new(runs.get(&name).await.map_err(|source| Error::Reread {
                    run: obj_ref.to_string(),
                    source,
                })?);
            }
            Err(apply::Outcome::Failed(err)) => return Err(err),
        }
    }
}

/// Field manager of the one condition written on a run the operator cannot
/// read: the rest of its status, owned by [`crate::labels::FIELD_MANAGER`], stays as
/// it was. The engine clears the condition once the run reads again.
const UNREADABLE_MANAGER: &str = "agentrun-operator-unreadable";

/// A run that does not deserialize (say, a spec written for a newer version
/// of the API than this operator knows) is left as it is: no Pod is started
/// or stopped for it, its phase is not touched, and the other runs go on. It
/// says so on the run, once per generation: `Stalled=True` with reason
/// `Unreadable` and the decoder's message, and a Warning Event (D13, D16).
pub(super) async fn unreadable(
    guard: &DeserializeGuard<AgentRun>,
    invalid: &InvalidObject,
    ctx: &Context,
) -> Result<Action> {
    let meta = &invalid.metadata;
    let name = meta.name.as_deref().ok_or(Error::MissingMetadata("name"))?;
    let ns = meta
        .namespace
        .as_deref()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let uid = meta.uid.clone().ok_or(Error::MissingMetadata("uid"))?;
    let generation = meta.generation.unwrap_or_default();
    let told = |ctx: &Context| {
        ctx.unreadable
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&uid)
            .copied()
    };
    if told(ctx) == Some(generation) {
        return Ok(Action::await_change());
    }
    let message = format!(
        "the operator cannot read this AgentRun ({}); nothing is done for the run until it changes",
        invalid.error
    );
    warn!(run = %name, namespace = %ns, error = %invalid.error, "run does not deserialize");
    let patch = json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "AgentRun",
        "status": {"conditions": [{
            "type": ConditionType::Stalled,
            "status": "True",
            "reason": Reason::Unreadable,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": Time(ctx.clock.now()),
        }]},
    });
    let runs: Api<DeserializeGuard<AgentRun>> = Api::namespaced(ctx.client.clone(), ns);
    runs.patch_status(
        name,
        &PatchParams::apply(UNREADABLE_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(|source| Error::WriteStatus {
        run: format!("{ns}/{name}"),
        source,
    })?;
    ctx.events.publish(
        Event {
            type_: EventType::Warning,
            reason: Reason::Unreadable.into(),
            note: Some(message),
            action: "Decode".into(),
            secondary: None,
        },
        guard.object_ref(&()),
    );
    ctx.unreadable
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(uid, generation);
    Ok(Action::await_change())
}

/// The run a guarded object stands for, readable or not.
fn run_ref(run: &DeserializeGuard<AgentRun>) -> ObjectRef<AgentRun> {
    ObjectRef::new(&run.name_any()).within(&run.namespace().unwrap_or_default())
}

pub(super) fn error_policy(
    run: Arc<DeserializeGuard<AgentRun>>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    let failures = ctx.record_failure(&run_ref(&run));
    ctx.metrics
        .reconcile_errors
        .get_or_create(&CategoryLabel {
            category: err.metric_label().to_owned(),
        })
        .inc();
    let delay: Duration = backoff(err.category(), failures);
    debug!(run = %run.name_any(), failures, ?delay, "backing off");
    Action::requeue(delay)
}
