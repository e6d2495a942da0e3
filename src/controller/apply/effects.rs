//! The effects stage: the decision's actions, once its status is committed
//! and the run proven current. Pod creations go first: they are the next
//! step's hand-off, and nothing else in a decision is a precondition for them
//! (the status write is).

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType as KubeEventType};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, info, warn};

use super::commit::Proof;
use super::{Outcome, Target};
use crate::api::{AgentRun, AgentRunStatus, Approval, Signal, StepJournal};
use crate::controller::owned::{self, Created, held_by, refusal_cause};
use crate::controller::patch::{is_status, patch_params};
use crate::controller::world::World;
use crate::controller::{Context, Leader, failpoints};
use crate::engine::{Action, EventType, PodRole, Reason, Refusal, RefusalCause};
use crate::labels;
use crate::telemetry::transitions;
use serde_json::json;

/// Carries out `actions`, Pod creations first; returns the creations the
/// API server refused.
pub(super) async fn act(
    runs: &Api<AgentRun>,
    target: &Target<'_>,
    world: &World,
    status: &AgentRunStatus,
    actions: Vec<Action>,
    proof: &mut Proof,
    ctx: &Context,
) -> Result<Vec<Refusal>, Outcome> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &target.ns);
    let approvals: Api<Approval> = Api::namespaced(ctx.client.clone(), &target.ns);
    let signals: Api<Signal> = Api::namespaced(ctx.client.clone(), &target.ns);
    let mut refused = Vec::new();
    let (creates, rest): (Vec<Action>, Vec<Action>) = actions
        .into_iter()
        .partition(|a| matches!(a, Action::CreatePod(_)));
    for action in creates.into_iter().chain(rest) {
        match action {
            Action::CreatePod(pod) => {
                proof.renew(runs, target).await?;
                refused.extend(create_pod(&pods, target, pod, status, ctx).await?);
            }
            Action::DeletePod { name, reason } => {
                info!(pod = %name, %reason, "deleting step pod");
                match pods.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(err) if is_status(&err, 404) => {}
                    Err(err) => return Err(target.failed(format!("deleting pod {name}"), err)),
                }
            }
            Action::ReleaseFinalizer { pod } => release(&pods, target, world, &pod, ctx).await?,
            Action::CreateApproval(approval) => {
                let name = approval.name_any();
                let created = create_owned(
                    &approvals,
                    &approval,
                    target,
                    owned::not_this_runs_approval,
                    ctx,
                )
                .await
                .map_err(|err| target.failed(format!("creating approval {name}"), err))?;
                match created {
                    Created::New => info!(approval = %name, "created approval"),
                    Created::Adopted => {}
                    Created::Refused(r) => refused.push(r),
                }
            }
            Action::CreateSignal(signal) => {
                let name = signal.name_any();
                let created =
                    create_owned(&signals, &signal, target, owned::not_this_runs_signal, ctx)
                        .await
                        .map_err(|err| target.failed(format!("creating signal {name}"), err))?;
                match created {
                    Created::New => info!(signal = %name, "created signal"),
                    Created::Adopted => {}
                    Created::Refused(r) => refused.push(r),
                }
            }
            Action::SetApprovalStatus {
                name,
                resource_version,
                status,
            } => owned::set_status(&approvals, &name, resource_version, &status)
                .await
                .map_err(|err| target.failed(format!("updating approval {name}"), err))?,
            Action::SetSignalStatus {
                name,
                resource_version,
                status,
            } => owned::set_status(&signals, &name, resource_version, &status)
                .await
                .map_err(|err| target.failed(format!("updating signal {name}"), err))?,
            Action::SettleCall { chunk, settlement } => {
                let journals: Api<StepJournal> = Api::namespaced(ctx.client.clone(), &target.ns);
                match super::journal::settle(&journals, &chunk, &settlement).await {
                    Ok(()) => {}
                    // Another write moved the chunk: the next decision tries again.
                    Err(err) if is_status(&err, 409) => {
                        return Err(target.failed(format!("settling a call in {chunk}"), err));
                    }
                    // Refused: the run says so, and it is tried again with
                    // backoff whatever the code (a policy or RBAC fixed, a
                    // chunk restored), since the step waits for it (D16).
                    Err(kube::Error::Api(status)) => refused.push(Refusal {
                        name: chunk,
                        cause: RefusalCause::Transient,
                        message: status.message,
                    }),
                    Err(err) => {
                        return Err(target.failed(format!("settling a call in {chunk}"), err));
                    }
                }
            }
            Action::DeleteRun => delete_run(runs, target).await?,
            Action::Event {
                type_,
                reason,
                message,
            } => publish(target.run, type_, reason, message, ctx),
        }
    }
    Ok(refused)
}

/// Creates a step Pod if absent, annotated with this instance's identity when
/// it leads (the fence's policy checks it). Returns a refusal the engine
/// decides on: the name held by another owner, or the API server's no.
async fn create_pod(
    pods: &Api<Pod>,
    target: &Target<'_>,
    mut pod: Box<Pod>,
    status: &AgentRunStatus,
    ctx: &Context,
) -> Result<Option<Refusal>, Outcome> {
    if let Some(leader) = &ctx.leader {
        pod.annotations_mut()
            .insert(labels::LEADER.to_owned(), leader.identity.clone());
    }
    failpoints::hit("before-create-pod");
    let pod_name = pod.name_any();
    // A journaled step's Pod writes its journal with its ServiceAccount.
    if super::journal::is_journaled(&pod)
        && let Err(err) = super::journal::bind_writer(ctx, &target.ns, &pod).await
    {
        return match err {
            kube::Error::Api(status) => Ok(Some(Refusal {
                name: pod_name,
                cause: refusal_cause(&status),
                message: format!(
                    "the step journals its calls, and its ServiceAccount could not be bound to the journal-writer role {}: {}",
                    ctx.journal_writer_role, status.message
                ),
            })),
            err => Err(target.failed(
                format!("binding the journal writer for pod {pod_name}"),
                err,
            )),
        };
    }
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
            return Err(target.failed(format!("creating pod {pod_name}"), result.unwrap_err()));
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
            observe_handoff(ctx, status, &created);
            ctx.expectations.created(created, &ctx.pods);
            failpoints::hit("after-create-pod");
            Ok(None)
        }
        Err(err) if is_status(&err, 409) => {
            // Create-if-absent: the Pod exists. Ours (same owner UID) is success.
            let existing = pods
                .get(&pod_name)
                .await
                .map_err(|e| target.failed(format!("reading existing pod {pod_name}"), e))?;
            if !existing
                .owner_references()
                .iter()
                .any(|r| r.uid == target.uid)
            {
                return Ok(Some(Refusal {
                    message: held_by(existing.owner_references()),
                    name: pod_name,
                    cause: RefusalCause::NameTaken,
                }));
            }
            debug!(pod = %pod_name, "step pod already exists");
            ctx.expectations.created(existing, &ctx.pods);
            ctx.metrics.duplicate_creates_suppressed.inc();
            Ok(None)
        }
        Err(kube::Error::Api(status)) => {
            info!(pod = %pod_name, code = status.code, message = %status.message, "the API server refused a step pod");
            Ok(Some(Refusal {
                name: pod_name,
                cause: refusal_cause(&status),
                message: status.message,
            }))
        }
        Err(err) => Err(target.failed(format!("creating pod {pod_name}"), err)),
    }
}

/// Releases a step Pod's result finalizer, unless the first round after a
/// start holds it back (`resume`).
async fn release(
    pods: &Api<Pod>,
    target: &Target<'_>,
    world: &World,
    pod_name: &str,
    ctx: &Context,
) -> Result<(), Outcome> {
    let cached = world.pods.iter().find(|p| p.name_any() == pod_name);
    if ctx.resume.hold_release(&target.ns, pod_name, cached) {
        return Ok(());
    }
    if let Some(released) = release_finalizer(pods, cached, pod_name)
        .await
        .map_err(|e| target.failed(format!("releasing finalizer of pod {pod_name}"), e))?
    {
        ctx.expectations.released(released, &ctx.pods);
    }
    Ok(())
}

/// Creates an Approval or a Signal the run owns, or adopts the run's own one
/// found under its name (counted as a duplicate create suppressed).
async fn create_owned<K>(
    api: &Api<K>,
    wanted: &K,
    target: &Target<'_>,
    foreign: fn(&K, &K, &str) -> Option<String>,
    ctx: &Context,
) -> Result<Created, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + Serialize + DeserializeOwned,
{
    let created = owned::create(api, wanted, &target.uid, foreign).await?;
    if matches!(created, Created::Adopted) {
        ctx.metrics.duplicate_creates_suppressed.inc();
    }
    Ok(created)
}

/// Deletes the finished run (`ttlSecondsAfterFinished`), only the one
/// decided on (its UID).
async fn delete_run(runs: &Api<AgentRun>, target: &Target<'_>) -> Result<(), Outcome> {
    info!("deleting finished run (ttlSecondsAfterFinished)");
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(target.uid.clone()),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    match runs.delete(&target.name, &dp).await {
        Ok(_) => Ok(()),
        Err(err) if is_status(&err, 404) || is_status(&err, 409) => Ok(()),
        Err(err) => Err(target.failed("deleting run".into(), err)),
    }
}

/// Publishes one of the engine's Events, in the background: best effort,
/// never delaying the run.
fn publish(run: &AgentRun, type_: EventType, reason: Reason, message: String, ctx: &Context) {
    if !ctx.step_events && ROUTINE_STEP_EVENTS.contains(&reason) {
        // `--step-events=false`: status and the Pods record these.
        return;
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
    // The routine ones wait behind the first round's starts.
    let regarding = run.object_ref(&());
    if !ROUTINE_STEP_EVENTS.contains(&reason) {
        ctx.events.publish(event, regarding);
    } else if let Some((event, regarding)) = ctx.resume.hold_event(event, regarding) {
        ctx.events.publish(event, regarding);
    }
}

/// Whether a read of the leader Lease, from the API server and not a cache,
/// names this instance as its holder.
async fn holds_the_lease(ctx: &Context, leader: &Leader) -> bool {
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

/// The Events every step emits on its way through; `--step-events=false`
/// leaves them out and keeps the ones that call for attention.
const ROUTINE_STEP_EVENTS: [Reason; 2] = [Reason::StepStarted, Reason::StepSucceeded];

/// Removes `agentrun.dev/result` from a Pod, and only it: a strategic-merge
/// `$deleteFromPrimitiveList` deletes the one entry on the server, so a
/// finalizer someone else adds meanwhile is kept and no resourceVersion
/// precondition (and no 409 after a status update of the Pod) is needed.
/// Returns the patched Pod when a patch was sent.
pub(in crate::controller) async fn release_finalizer(
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
