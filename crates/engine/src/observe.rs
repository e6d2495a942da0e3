//! Reading step Pods: which Pods are ours, what coordinates their labels
//! carry, and what an attempt's Pod says about how it went. Disruption
//! (eviction, preemption, deletion, loss) is told apart from failure here (D6).
//! And whether an Approval or Signal found under a name the run needs is
//! the run's own ([`not_the_runs`]).

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use super::names::PodRole;
use agentrun_api::labels;

/// Pod `status.reason` values that mean the node took the Pod away.
const DISRUPTION_REASONS: &[&str] = &["Evicted", "Preempted", "NodeLost", "Shutdown", "Terminated"];
/// Exit codes of a container killed by SIGKILL / SIGTERM, as after a deletion.
const KILLED_EXIT_CODES: &[i32] = &[137, 143];

/// The Pods the run's status names as running or still stopping, and the
/// Pod of the last attempt of a step about to try again (D2: nothing with
/// its key starts while it is live), with the UID recorded for each, if any.
/// A decision must see each of them as the API server holds it: the
/// controller reads from the API server any the cache lacks (an ended Pod
/// leaves the watch once released), or holds under another UID than the one
/// recorded. So a Pod absent from `Observed` is gone, not merely not cached
/// yet, and an older Pod of the same name is never read as this one (D2, D6).
pub fn referenced_pods(
    run: &agentrun_api::AgentRun,
    now: jiff::Timestamp,
) -> Vec<(&str, Recorded<'_>)> {
    use agentrun_api::StepPhase;
    let Some(status) = run.status.as_ref() else {
        return Vec::new();
    };
    let about_to_try_again =
        |phase: StepPhase,
         next: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
         attempt: i32| {
            attempt >= 1
                && (phase == StepPhase::WaitingForApproval
                    || phase == StepPhase::Verifying
                    || (phase == StepPhase::Pending && next.is_none_or(|t| t.0 <= now)))
        };
    let steps = status
        .steps
        .iter()
        .filter(|c| {
            c.phase == StepPhase::Running
                || c.stopping
                || about_to_try_again(c.phase, c.next_attempt_at.as_ref(), c.attempt)
        })
        .filter_map(|c| {
            let recorded = match (c.pod_uid.as_deref(), c.pod_recreated) {
                (Some(uid), _) => Recorded::Uid(uid),
                (None, true) => Recorded::Recreated,
                (None, false) => Recorded::Nothing,
            };
            Some((c.pod.as_deref()?, recorded))
        });
    let compensations = status
        .compensations
        .iter()
        .filter(|c| {
            c.phase == StepPhase::Running
                || about_to_try_again(c.phase, c.next_attempt_at.as_ref(), c.attempt)
        })
        .filter_map(|c| {
            let recorded = c
                .pod_uid
                .as_deref()
                .map_or(Recorded::Nothing, Recorded::Uid);
            Some((c.pod.as_deref()?, recorded))
        });
    steps.chain(compensations).collect()
}

/// What the run's status recorded of a Pod it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded<'a> {
    /// Its UID.
    Uid(&'a str),
    /// That it was created again, and not yet its UID: a cached Pod of that
    /// name may be its predecessor.
    Recreated,
    Nothing,
}

/// Whether a Pod the run names must be read from the API server: the view
/// lacks it, shows it under another UID than the one recorded, or the Pod
/// was created again and which one the view shows is not known yet.
pub fn must_read(pods: &[Pod], name: &str, recorded: Recorded<'_>) -> bool {
    match pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
    {
        None => true,
        Some(p) => match recorded {
            Recorded::Uid(u) => p.metadata.uid.as_deref() != Some(u),
            Recorded::Recreated => true,
            Recorded::Nothing => false,
        },
    }
}

/// The coordinates a step Pod carries in its labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodCoords {
    pub role: PodRole,
    pub step: String,
    pub plan_revision: i64,
    pub attempt: i32,
}

pub fn coords(pod: &Pod) -> Option<PodCoords> {
    let labels = pod.metadata.labels.as_ref()?;
    Some(PodCoords {
        role: PodRole::from_label(labels.get(labels::ROLE)?)?,
        step: labels.get(labels::STEP)?.clone(),
        plan_revision: labels.get(labels::PLAN_REVISION)?.parse().ok()?,
        attempt: labels.get(labels::ATTEMPT)?.parse().ok()?,
    })
}

/// Whether the Pod is controlled by the run with this UID.
pub fn owned_by(pod: &Pod, run_uid: &str) -> bool {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == run_uid && o.controller == Some(true))
}

pub fn has_result_finalizer(pod: &Pod) -> bool {
    pod.metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == labels::RESULT_FINALIZER)
}

/// Live: not in a terminal phase. A deleted Pod whose containers still run is live (D2).
pub fn is_live(pod: &Pod) -> bool {
    !matches!(phase(pod), "Succeeded" | "Failed")
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn terminated(pod: &Pod) -> Option<&ContainerStateTerminated> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref())
}

/// Whether any container ever started: a NonIdempotent step that never
/// started cannot have acted.
pub fn started(pod: &Pod) -> bool {
    matches!(phase(pod), "Running" | "Succeeded")
        || pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
            .any(|c| {
                let running = c
                    .state
                    .as_ref()
                    .is_some_and(|s| s.running.is_some() || s.terminated.is_some());
                running
                    || c.last_state
                        .as_ref()
                        .is_some_and(|s| s.terminated.is_some())
            })
}

fn disruption_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if let Some(c) = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")
    {
        return Some(
            c.reason
                .clone()
                .unwrap_or_else(|| "DisruptionTarget".into()),
        );
    }
    status
        .reason
        .as_deref()
        .filter(|r| DISRUPTION_REASONS.contains(r))
        .map(str::to_owned)
}

/// Whether the container stopped after the Pod's deletion was requested
/// (`deletionTimestamp` is the request plus the grace period). Unknown
/// stop times count as stopped by the deletion.
fn stopped_by_deletion(pod: &Pod, term: Option<&ContainerStateTerminated>) -> bool {
    let Some(deleting) = pod.metadata.deletion_timestamp.as_ref() else {
        return false;
    };
    let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(30);
    let requested = deleting
        .0
        .checked_sub(jiff::SignedDuration::from_secs(grace))
        .unwrap_or(deleting.0);
    term.and_then(|t| t.finished_at.as_ref())
        .is_none_or(|f| f.0 >= requested)
}

/// What the Pod of a running attempt shows.
#[derive(Clone, Debug, PartialEq)]
pub enum Observation {
    /// Not in the cache and never seen: just created, or the create was lost.
    NotSeen,
    /// Seen once, now gone or replaced by another object of the same name.
    Vanished,
    /// Pending or running.
    Live { uid: Option<String> },
    /// Being deleted, containers still running: wait for it to stop (D2).
    Terminating { uid: Option<String> },
    Succeeded {
        message: Option<String>,
        /// When the container finished, as the kubelet reported it.
        finished_at: Option<jiff::Timestamp>,
    },
    Failed {
        exit_code: i32,
        reason: String,
        message: Option<String>,
    },
    Disrupted {
        reason: String,
        started: bool,
        message: Option<String>,
    },
}

/// Classifies the Pod of an attempt; `seen_uid` is the UID status recorded.
pub fn observe(pod: Option<&Pod>, seen_uid: Option<&str>) -> Observation {
    let Some(pod) = pod else {
        return if seen_uid.is_some() {
            Observation::Vanished
        } else {
            Observation::NotSeen
        };
    };
    let uid = pod.metadata.uid.clone();
    if let (Some(seen), Some(uid)) = (seen_uid, uid.as_deref())
        && seen != uid
    {
        return Observation::Vanished;
    }
    let term = terminated(pod);
    let message = term.and_then(|t| t.message.clone());
    let deleting = pod.metadata.deletion_timestamp.is_some();
    match phase(pod) {
        "Succeeded" => Observation::Succeeded {
            message,
            finished_at: term.and_then(|t| t.finished_at.as_ref()).map(|t| t.0),
        },
        "Failed" => {
            let killed = term.is_none_or(|t| KILLED_EXIT_CODES.contains(&t.exit_code));
            match disruption_reason(pod) {
                Some(reason) => Observation::Disrupted {
                    reason,
                    started: started(pod),
                    message,
                },
                // Deleted by someone else while it ran: a disruption, also
                // when the container caught SIGTERM and exited on its own.
                None if deleting && (killed || stopped_by_deletion(pod, term)) => {
                    Observation::Disrupted {
                        reason: "Deleted".into(),
                        started: started(pod),
                        message,
                    }
                }
                None => Observation::Failed {
                    exit_code: term.map_or(-1, |t| t.exit_code),
                    reason: term
                        .and_then(|t| t.reason.clone())
                        .or_else(|| pod.status.as_ref().and_then(|s| s.reason.clone()))
                        .unwrap_or_else(|| "Error".into()),
                    message,
                },
            }
        }
        _ if deleting => Observation::Terminating { uid },
        _ => Observation::Live { uid },
    }
}

/// Why an object with these owners and these fields (name, differs from
/// what the run asks) is not the run's; `None` when its controller is the
/// run and no field differs.
pub fn not_the_runs<'f>(
    owners: &[OwnerReference],
    run_uid: &str,
    fields: impl IntoIterator<Item = (&'f str, bool)>,
) -> Option<String> {
    let controller = owners.iter().find(|o| o.controller == Some(true));
    if controller.is_none_or(|o| o.uid != run_uid) {
        return Some(held_by(owners));
    }
    let differs: Vec<&str> = fields
        .into_iter()
        .filter_map(|(field, differs)| differs.then_some(field))
        .collect();
    (!differs.is_empty()).then(|| {
        format!(
            "it names this run as its controller, but its spec differs from what the run asks in {}",
            differs.join(", ")
        )
    })
}

/// Who holds a name the run needs, for the message on the run.
pub fn held_by(owners: &[OwnerReference]) -> String {
    match owners
        .iter()
        .find(|o| o.controller == Some(true))
        .or(owners.first())
    {
        Some(o) => format!("it is owned by {} {} (uid {})", o.kind, o.name, o.uid),
        None => "it has no owner".into(),
    }
}
