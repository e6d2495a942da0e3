//! The Pod statuses a node reports: running, and terminated with the step's
//! exit code and termination message.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, PodCondition,
    PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::SIGKILL_EXIT;
use crate::facts::{Ending, PodFacts};

fn condition(kind: &str, ready: bool, at: Timestamp, facts: &PodFacts) -> PodCondition {
    PodCondition {
        type_: kind.into(),
        status: if ready { "True" } else { "False" }.into(),
        last_transition_time: Some(Time(at)),
        observed_generation: facts.generation,
        ..PodCondition::default()
    }
}

fn container_id(facts: &PodFacts, name: &str) -> String {
    format!("sim://{}/{name}", facts.uid)
}

pub(crate) fn running_status(facts: &PodFacts, start_time: Timestamp, now: Timestamp) -> PodStatus {
    let conditions = [
        "PodScheduled",
        "PodReadyToStartContainers",
        "Initialized",
        "ContainersReady",
        "Ready",
    ]
    .into_iter()
    .map(|kind| condition(kind, true, now, facts))
    .collect();
    let container_statuses = facts
        .containers
        .iter()
        .map(|(name, image)| {
            let running = ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(Time(now)),
                }),
                ..ContainerState::default()
            };
            container_status(facts, name, image, (true, true), running)
        })
        .collect();
    PodStatus {
        phase: Some("Running".into()),
        start_time: Some(Time(start_time)),
        observed_generation: facts.generation,
        conditions: Some(conditions),
        container_statuses: Some(container_statuses),
        init_container_statuses: init_statuses(facts, now),
        ..PodStatus::default()
    }
}

/// The status after the step ended. Conditions are merged by type (strategic merge), so
/// those set by others — `DisruptionTarget` from the eviction API — are kept.
pub(crate) fn terminated_status(
    facts: &PodFacts,
    started_at: Option<Timestamp>,
    finished_at: Timestamp,
    ending: Ending,
    message: Option<String>,
) -> PodStatus {
    let succeeded = ending == Ending::Exited(0);
    let names: Vec<&str> = facts.containers.iter().map(|(n, _)| n.as_str()).collect();
    let not_ready = |kind: &str| {
        let mut c = condition(kind, false, finished_at, facts);
        if succeeded {
            c.reason = Some("PodCompleted".into());
        } else {
            c.reason = Some("ContainersNotReady".into());
            c.message = Some(format!(
                "containers with unready status: [{}]",
                names.join(" ")
            ));
        }
        c
    };
    let conditions = vec![
        not_ready("Ready"),
        not_ready("ContainersReady"),
        condition("PodReadyToStartContainers", false, finished_at, facts),
        condition("PodScheduled", true, finished_at, facts),
        condition("Initialized", true, finished_at, facts),
    ];
    let container_statuses = facts
        .containers
        .iter()
        .enumerate()
        .map(|(i, (name, image))| {
            // The step's container has the step's exit code; the others stop with it.
            let exit_code = match ending {
                Ending::Killed => SIGKILL_EXIT,
                e if i == facts.step_container => e.exit_code(),
                _ => 0,
            };
            container_status(
                facts,
                name,
                image,
                (false, false),
                ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code,
                        reason: Some(if exit_code == 0 { "Completed" } else { "Error" }.into()),
                        message: if i == facts.step_container {
                            message.clone()
                        } else {
                            None
                        },
                        started_at: started_at.map(Time),
                        finished_at: Some(Time(finished_at)),
                        container_id: Some(container_id(facts, name)),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                },
            )
        })
        .collect();
    PodStatus {
        phase: Some(if succeeded { "Succeeded" } else { "Failed" }.into()),
        start_time: Some(Time(started_at.unwrap_or(finished_at))),
        observed_generation: facts.generation,
        conditions: Some(conditions),
        container_statuses: Some(container_statuses),
        init_container_statuses: started_at.and_then(|at| init_statuses(facts, at)),
        ..PodStatus::default()
    }
}

/// Init containers have completed by the time the Pod runs (none: `None`).
fn init_statuses(facts: &PodFacts, at: Timestamp) -> Option<Vec<ContainerStatus>> {
    if facts.init_containers.is_empty() {
        return None;
    }
    let statuses = facts
        .init_containers
        .iter()
        .map(|(name, image)| {
            container_status(
                facts,
                name,
                image,
                (true, false),
                ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 0,
                        reason: Some("Completed".into()),
                        started_at: Some(Time(at)),
                        finished_at: Some(Time(at)),
                        container_id: Some(container_id(facts, name)),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                },
            )
        })
        .collect();
    Some(statuses)
}

/// A container's status in `state`; `(ready, started)` as a kubelet reports them.
fn container_status(
    facts: &PodFacts,
    name: &str,
    image: &str,
    (ready, started): (bool, bool),
    state: ContainerState,
) -> ContainerStatus {
    ContainerStatus {
        name: name.to_owned(),
        image: image.to_owned(),
        image_id: format!("sim://{image}"),
        container_id: Some(container_id(facts, name)),
        ready,
        started: Some(started),
        restart_count: 0,
        state: Some(state),
        ..ContainerStatus::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::argo::argo_pod;
    use std::time::Duration;

    #[test]
    fn an_argo_pod_ends_with_main_exit_code_wait_zero_and_init_completed() {
        let facts = PodFacts::of(&argo_pod(), Duration::ZERO, true);
        let at = Timestamp::UNIX_EPOCH;
        let status = terminated_status(&facts, Some(at), at, Ending::Exited(3), Some("m".into()));
        let codes: Vec<(String, i32, Option<String>)> = status
            .container_statuses
            .unwrap()
            .into_iter()
            .map(|c| {
                let t = c.state.unwrap().terminated.unwrap();
                (c.name, t.exit_code, t.message)
            })
            .collect();
        assert_eq!(
            codes,
            [
                ("wait".into(), 0, None),
                ("main".into(), 3, Some("m".into()))
            ]
        );
        let init = status.init_container_statuses.unwrap();
        assert_eq!(init.len(), 1);
        assert_eq!(
            init[0]
                .state
                .as_ref()
                .unwrap()
                .terminated
                .as_ref()
                .unwrap()
                .exit_code,
            0
        );
        assert_eq!(status.phase.as_deref(), Some("Failed"));
    }
}
