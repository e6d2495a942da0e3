//! Carrying out one engine decision: the guarded status write first, then the
//! actions in order. Nothing is applied when the status write fails, so no
//! effect ever runs ahead of the checkpoint it depends on (D4).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType as KubeEventType};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use super::error::Error;
use super::owned::{self, held_by, refusal_cause};
use super::reconcile::World;
use super::{Context, failpoints, status_write};
use crate::api::{AgentRun, AgentRunStatus, Approval, CheckpointState, Signal};
use crate::engine::{Action, Decision, EventType, PodRole, Reason, Refusal, RefusalCause};
use crate::labels;
use crate::telemetry::{trace, transitions};

/// Why applying a decision stopped.
pub(super) enum Outcome {
    /// The status write hit a stale resourceVersion: re-read and re-decide.
    Conflict,
    /// The decision would create a Pod or an Approval, or change an
    /// Approval's status, without a status write, and a quorum read shows the
    /// run has moved on since: decide again on this copy.
    Stale(Box<AgentRun>),
    Failed(Error),
}

impl From<Error> for Outcome {
    fn from(e: Error) -> Self {
        Outcome::Failed(e)
    }
}

/// Whether a read of the leader Lease, from the API server and not a cache,
/// names this instance as its holder.
async fn holds_the_lease(ctx: &Context, leader: &super::Leader) -> bool {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(ctx.client.clone(), &leader.lease_namespace);
    match leases.get(&leader.lease_name).await {
        Ok(lease) => {
            lease.spec.and_then(|s| s.holder_identity).as_deref() == Some(leader.identity.as_str())
        }
        Err(err) => {
            debug!(error = %err, "reading the leader Lease failed");
            false
        }
    }
}

pub(super) fn is_status(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == code)
}

/// What applying a decision did.
pub(super) struct Applied {
    /// When to look at the run again.
    pub requeue: Option<Duration>,
    /// The run as the status write left it, when there was one.
    pub written: Option<AgentRun>,
    /// Creations the API server refused; the engine decides what they mean.
    pub refused: Vec<Refusal>,
}

/// How long a proof that the run is current (the status write, or the
/// fence's quorum read) stands for the Pod creations that follow it.
const PROOF_GOOD_FOR: Duration = Duration::from_secs(1);

/// Applies `decision` for `run`.
pub(super) async fn apply(
    runs: &Api<AgentRun>,
    run: &AgentRun,
    world: &World,
    mut decision: Decision,
    ctx: &Context,
) -> Result<Applied, Outcome> {
    // D18: a finished run's record is stored before any status names it.
    super::history::record(run, &mut decision.status, world, ctx).await;
    let name = run.name_any();
    let ns = run.namespace().ok_or(Error::MissingMetadata("namespace"))?;
    let run_ref = format!("{ns}/{name}");

    let current_status = run.status.clone().unwrap_or_default();
    let mut written_run = None;
    // When the proof that the run is current (the write, or the fence's
    // read) was asked for: it is no fresher than the request.
    let mut proven_at = std::time::Instant::now();
    if decision.status != current_status {
        // A JSON patch of what changed, guarded by the resourceVersion we
        // decided on: a stale or deposed operator gets 409 (D3).
        let started = std::time::Instant::now();
        let started_at = std::time::SystemTime::now();
        let written = status_write::write_status(runs, run, &decision.status).await;
        ctx.metrics
            .checkpoint_write_duration
            .observe(started.elapsed().as_secs_f64());
        let write_span = |result: &str| {
            let committed = decision
                .status
                .steps
                .iter()
                .filter(|c| c.checkpoint == CheckpointState::Committed)
                .count();
            trace::status_write(
                run,
                started_at,
                std::time::SystemTime::now(),
                result,
                committed,
            );
        };
        match written {
            Ok(written) => {
                debug!("status committed");
                written_run = Some(written);
                ctx.metrics.status_write("ok");
                ctx.metrics.count(&ns, &decision.tally);
                let facts =
                    transitions::between(&current_status, &decision.status, ctx.clock.now());
                ctx.metrics.observe(&facts);
                write_span("ok");
                trace::record(run, &decision.status, &facts);
                failpoints::hit("after-status-write");
                if commits_an_outcome(&current_status, &decision.status) {
                    failpoints::hit("after-checkpoint");
                }
            }
            Err(err) if is_status(&err, 409) => {
                ctx.metrics.status_write("conflict");
                write_span("conflict");
                return Err(Outcome::Conflict);
            }
            Err(source) => {
                ctx.metrics.status_write("error");
                write_span("error");
                return Err(Error::WriteStatus {
                    run: run_ref,
                    source,
                }
                .into());
            }
        }
    }

    // Effects a decision may ask for without a status write: a Pod whose
    // attempt it did not record (one missing from the cache), an Approval
    // or Signal never seen, their status (superseded, expired). Their intent
    // was committed earlier, and a paused or deposed operator, or a cache
    // behind the run, may be deciding on a status that has moved on (the
    // attempt closed, the run asked a person something else). A quorum read
    // proves the decision was made on the run as it stands.
    let acts_on_the_world = decision.actions.iter().any(|a| {
        matches!(
            a,
            Action::CreatePod(_)
                | Action::CreateApproval(_)
                | Action::SetApprovalStatus { .. }
                | Action::CreateSignal(_)
                | Action::SetSignalStatus { .. }
        )
    });
    if acts_on_the_world && written_run.is_none() {
        proven_at = std::time::Instant::now();
        let fresh = runs.get(&name).await.map_err(|source| Error::Reread {
            run: run_ref.clone(),
            source,
        })?;
        failpoints::hit("after-proof-read");
        if fresh.resource_version() != run.resource_version() {
            debug!("the run moved on since the decision; deciding again before acting");
            return Err(Outcome::Stale(Box::new(fresh)));
        }
    }

    // The run as the write (or the fence) proved it current.
    let proven_rv = written_run
        .as_ref()
        .map_or_else(|| run.resource_version(), |w| w.resource_version());

    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let approvals: Api<Approval> = Api::namespaced(ctx.client.clone(), &ns);
    let signals: Api<Signal> = Api::namespaced(ctx.client.clone(), &ns);
    let mut refused = Vec::new();
    let run_uid = run.uid().unwrap_or_default();
    let fail = |action: String, source: kube::Error| {
        Outcome::Failed(Error::Apply {
            run: run_ref.clone(),
            action,
            source,
        })
    };
    // Pod creations go first: they are the next step's hand-off, and nothing
    // else in a decision is a precondition for them (the status write is).
    let (creates, rest): (Vec<Action>, Vec<Action>) = decision
        .actions
        .into_iter()
        .partition(|a| matches!(a, Action::CreatePod(_)));
    for action in creates.into_iter().chain(rest) {
        match action {
            Action::CreatePod(pod) => {
                // A process paused (or starved) between the proof and this
                // create — a leader stopped past its lease, resumed — may be
                // about to start an attempt the run has closed since. Prove
                // the run current again before creating.
                if proven_at.elapsed() > PROOF_GOOD_FOR {
                    proven_at = std::time::Instant::now();
                    let fresh = runs.get(&name).await.map_err(|source| Error::Reread {
                        run: run_ref.clone(),
                        source,
                    })?;
                    failpoints::hit("after-proof-read");
                    if fresh.resource_version() != proven_rv {
                        debug!("the run moved on while this decision was applied; deciding again");
                        return Err(Outcome::Stale(Box::new(fresh)));
                    }
                    // The proof is only as fresh as the request it was asked
                    // in: an answer that took longer than PROOF_GOOD_FOR to
                    // arrive (a process stopped while it waited in the
                    // socket) proves nothing about now. Decide again; what
                    // that decision does is proven again in turn.
                    if proven_at.elapsed() > PROOF_GOOD_FOR {
                        debug!("the proof that the run is current came too late; deciding again");
                        return Err(Outcome::Stale(Box::new(fresh)));
                    }
                }
                let mut pod = pod;
                if let Some(leader) = &ctx.leader {
                    pod.annotations_mut()
                        .insert(labels::LEADER.to_owned(), leader.identity.clone());
                }
                failpoints::hit("before-create-pod");
                let pod_name = pod.name_any();
                let pp = PostParams {
                    field_manager: Some(labels::FIELD_MANAGER.into()),
                    ..Default::default()
                };
                let mut result = pods.create(&pp, &pod).await;
                if let (Err(kube::Error::Api(status)), Some(leader)) = (&result, &ctx.leader)
                    && status.code == 403
                    && status.message.contains(labels::NOT_THE_LEADER)
                {
                    if !holds_the_lease(ctx, leader).await {
                        // Deposed while this decision was applied: not the
                        // run's problem. The lease watch stops this process.
                        warn!(pod = %pod_name, message = %status.message, "a step pod was refused: this instance no longer leads");
                        return Err(fail(
                            format!("creating pod {pod_name}"),
                            result.unwrap_err(),
                        ));
                    }
                    // The Lease, read just now, names this instance: the policy
                    // decided on a stale copy of it (docs/operations.md, "Leader
                    // election"). Create without the fence rather than stop
                    // every run.
                    tracing::error!(pod = %pod_name, message = %status.message, "the step Pod fence refused the Lease holder: it reads a stale Lease; creating the Pod unfenced");
                    pod.annotations_mut().remove(labels::LEADER);
                    result = pods.create(&pp, &pod).await;
                }
                match result {
                    Ok(created) => {
                        info!(pod = %pod_name, "created step pod");
                        observe_handoff(ctx, &decision.status, &created);
                        ctx.expectations.created(created, &ctx.pods);
                        failpoints::hit("after-create-pod");
                    }
                    Err(err) if is_status(&err, 409) => {
                        // Create-if-absent: the Pod exists. Ours (same owner UID) is success.
                        let existing = pods
                            .get(&pod_name)
                            .await
                            .map_err(|e| fail(format!("reading existing pod {pod_name}"), e))?;
                        if !existing.owner_references().iter().any(|r| r.uid == run_uid) {
                            refused.push(Refusal {
                                message: held_by(existing.owner_references()),
                                name: pod_name,
                                cause: RefusalCause::NameTaken,
                            });
                            continue;
                        }
                        debug!(pod = %pod_name, "step pod already exists");
                        ctx.expectations.created(existing, &ctx.pods);
                        ctx.metrics.duplicate_creates_suppressed.inc();
                    }
                    Err(kube::Error::Api(status)) => {
                        info!(pod = %pod_name, code = status.code, message = %status.message, "the API server refused a step pod");
                        refused.push(Refusal {
                            name: pod_name,
                            cause: refusal_cause(&status),
                            message: status.message,
                        });
                    }
                    Err(err) => return Err(fail(format!("creating pod {pod_name}"), err)),
                }
            }
            Action::DeletePod {
                name: pod_name,
                reason,
            } => {
                info!(pod = %pod_name, %reason, "deleting step pod");
                match pods.delete(&pod_name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(err) if is_status(&err, 404) => {}
                    Err(err) => return Err(fail(format!("deleting pod {pod_name}"), err)),
                }
            }
            Action::ReleaseFinalizer { pod: pod_name } => {
                let cached = world.pods.iter().find(|p| p.name_any() == pod_name);
                // Behind the starts of the first round after a start (`resume`).
                if ctx.resume.hold_release(&ns, &pod_name, cached) {
                    continue;
                }
                if let Some(released) = release_finalizer(&pods, cached, &pod_name)
                    .await
                    .map_err(|e| fail(format!("releasing finalizer of pod {pod_name}"), e))?
                {
                    ctx.expectations.released(released, &ctx.pods);
                }
            }
            Action::CreateApproval(approval) => {
                let name = approval.name_any();
                match owned::create(
                    &approvals,
                    &approval,
                    &run_uid,
                    owned::not_this_runs_approval,
                )
                .await
                {
                    Ok(owned::Created::New) => info!(approval = %name, "created approval"),
                    Ok(owned::Created::Adopted) => {
                        ctx.metrics.duplicate_creates_suppressed.inc();
                    }
                    Ok(owned::Created::Refused(r)) => refused.push(r),
                    Err(err) => return Err(fail(format!("creating approval {name}"), err)),
                }
            }
            Action::CreateSignal(signal) => {
                let name = signal.name_any();
                match owned::create(&signals, &signal, &run_uid, owned::not_this_runs_signal).await
                {
                    Ok(owned::Created::New) => info!(signal = %name, "created signal"),
                    Ok(owned::Created::Adopted) => {
                        ctx.metrics.duplicate_creates_suppressed.inc();
                    }
                    Ok(owned::Created::Refused(r)) => refused.push(r),
                    Err(err) => return Err(fail(format!("creating signal {name}"), err)),
                }
            }
            Action::SetApprovalStatus {
                name,
                resource_version,
                status,
            } => owned::set_status(&approvals, &name, resource_version, &status)
                .await
                .map_err(|err| fail(format!("updating approval {name}"), err))?,
            Action::SetSignalStatus {
                name,
                resource_version,
                status,
            } => owned::set_status(&signals, &name, resource_version, &status)
                .await
                .map_err(|err| fail(format!("updating signal {name}"), err))?,
            Action::DeleteRun => {
                info!("deleting finished run (ttlSecondsAfterFinished)");
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: Some(run_uid.clone()),
                        resource_version: None,
                    }),
                    ..DeleteParams::background()
                };
                match runs.delete(&name, &dp).await {
                    Ok(_) => {}
                    Err(err) if is_status(&err, 404) || is_status(&err, 409) => {}
                    Err(err) => return Err(fail("deleting run".into(), err)),
                }
            }
            Action::Event {
                type_,
                reason,
                message,
            } => {
                if !ctx.step_events && ROUTINE_STEP_EVENTS.contains(&reason) {
                    // `--step-events=false`: status and the Pods record these.
                    continue;
                }
                // The recorder folds events with the same (type, reason, action)
                // into one series showing the first note; the note is the action
                // here, so only true repeats are folded.
                let action: String = message.chars().take(128).collect();
                let event = Event {
                    type_: match type_ {
                        EventType::Normal => KubeEventType::Normal,
                        EventType::Warning => KubeEventType::Warning,
                    },
                    reason: reason.into(),
                    note: Some(message),
                    action,
                    secondary: None,
                };
                // Events are best effort and never delay the run; the
                // routine ones wait behind the first round's starts.
                let regarding = run.object_ref(&());
                if !ROUTINE_STEP_EVENTS.contains(&reason) {
                    ctx.events.publish(event, regarding);
                } else if let Some((event, regarding)) = ctx.resume.hold_event(event, regarding) {
                    ctx.events.publish(event, regarding);
                }
            }
        }
    }
    Ok(Applied {
        requeue: decision.requeue_after.map(|d| d.unsigned_abs()),
        written: written_run,
        refused,
    })
}

/// The Events every step emits on its way through; `--step-events=false`
/// leaves them out and keeps the ones that call for attention.
const ROUTINE_STEP_EVENTS: [Reason; 2] = [Reason::StepStarted, Reason::StepSucceeded];

/// Removes `agentrun.dev/result` from a Pod, and only it: a strategic-merge
/// `$deleteFromPrimitiveList` deletes the one entry on the server, so a
/// finalizer someone else adds meanwhile is kept and no resourceVersion
/// precondition (and no 409 after a status update of the Pod) is needed.
/// Returns the patched Pod when a patch was sent.
pub(super) async fn release_finalizer(
    pods: &Api<Pod>,
    cached: Option<&Pod>,
    pod_name: &str,
) -> Result<Option<Pod>, kube::Error> {
    if cached.is_some_and(|p| !p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER)) {
        return Ok(None);
    }
    let patch = release_patch(cached);
    match pods
        .patch(pod_name, &patch_params(), &Patch::Strategic(&patch))
        .await
    {
        Ok(pod) => {
            debug!(pod = pod_name, "released result finalizer");
            Ok(Some(pod))
        }
        Err(err) if is_status(&err, 404) => Ok(None),
        Err(err) => Err(err),
    }
}

/// A patch by the operator, named as its writer in the object's
/// `managedFields` (an unnamed one is listed as `unknown`).
pub(super) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(labels::FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// The release of a Pod as [`release_finalizer`] sends it. A Pod seen ended
/// (`cached`) is also labelled [`labels::RELEASED`], in the same write, and
/// so leaves the operator's Pod watch: nothing in it is read again. A Pod
/// that may still run stays in view, since no attempt with its key may start
/// while it is live (D2), nor a compensation while any step Pod is.
fn release_patch(cached: Option<&Pod>) -> serde_json::Value {
    let mut patch = json!({
        "metadata": {
            "$deleteFromPrimitiveList/finalizers": [labels::RESULT_FINALIZER],
        }
    });
    if cached.is_some_and(|p| !crate::engine::is_live(p)) {
        patch["metadata"]["labels"] = json!({ labels::RELEASED: "true" });
    }
    patch
}

/// The hand-off to a step's first attempt: from the outcome it waited for
/// (committed in `status`) to the API server's acknowledgement of its Pod.
fn observe_handoff(ctx: &Context, status: &AgentRunStatus, pod: &Pod) {
    let label = |k: &str| pod.labels().get(k).cloned().unwrap_or_default();
    let (Some(role), Ok(attempt)) = (
        PodRole::from_label(&label(labels::ROLE)),
        label(labels::ATTEMPT).parse::<i32>(),
    ) else {
        return;
    };
    if let Some(since) = transitions::handoff_start(status, role, &label(labels::STEP), attempt) {
        let secs = jiff::Timestamp::now().duration_since(since).as_secs_f64();
        ctx.metrics.handoff_latency.observe(secs.max(0.0));
    }
}

/// Whether `new` commits a step outcome that `old` did not have.
fn commits_an_outcome(old: &AgentRunStatus, new: &AgentRunStatus) -> bool {
    let committed = |s: &AgentRunStatus| {
        s.steps
            .iter()
            .filter(|c| c.checkpoint == CheckpointState::Committed)
            .count()
    };
    committed(new) > committed(old)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    /// A Pod seen ended leaves the Pod watch with its release; one that may
    /// still run (or was not seen) keeps its place in it (D2).
    #[test]
    fn only_an_ended_pod_is_labelled_released() {
        use k8s_openapi::api::core::v1::{Pod, PodStatus};
        let pod = |phase: &str| Pod {
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let finalizer = json!([crate::labels::RESULT_FINALIZER]);
        for phase in ["Succeeded", "Failed"] {
            let patch = super::release_patch(Some(&pod(phase)));
            assert_eq!(
                patch["metadata"]["$deleteFromPrimitiveList/finalizers"],
                finalizer
            );
            assert_eq!(
                patch["metadata"]["labels"],
                json!({crate::labels::RELEASED: "true"}),
                "{phase}"
            );
        }
        for cached in [Some(pod("Pending")), Some(pod("Running")), None] {
            let patch = super::release_patch(cached.as_ref());
            assert_eq!(
                patch["metadata"]["$deleteFromPrimitiveList/finalizers"],
                finalizer
            );
            assert_eq!(patch["metadata"].get("labels"), None, "{cached:?}");
        }
    }
}
