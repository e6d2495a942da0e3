//! What the Pod cache keeps of each step Pod ([`StepPod`]): deserialized
//! straight from the API server's JSON, a fraction of a [`Pod`], and turned
//! back into one for the engine ([`StepPod::to_pod`]).
//!
//! ```text
//!   watch pods (agentrun.dev/run) ──JSON──▶ StepPod ──▶ Store<StepPod> + PodIndex (index.rs)
//!                                                  └──▶ StepPod::to_pod ──▶ engine (World.pods)
//! ```

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, Pod, PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::Resource;
use serde::{Deserialize, Deserializer};

use crate::labels;

/// The one Pod condition the engine reads (D6: a disruption, not a failure).
const DISRUPTION_TARGET: &str = "DisruptionTarget";

/// A step Pod as the Pod cache and the expectations keep it: what the
/// operator reads of a Pod and nothing else: 624 bytes inline where a
/// k8s-openapi [`Pod`] is 2,416 even without its spec (an empty
/// `Option<PodSpec>` keeps its room). It is deserialized straight from the
/// API server's JSON, so the spec, the annotations (the context the operator
/// wrote itself), managedFields and the rest of the status are never built;
/// [`StepPod::to_pod`] turns it into the `Pod` the engine decides on.
///
/// Kept: identity (name, namespace, UID, creation and deletion timestamps,
/// the deletion grace period, owner references, finalizers), the six
/// `agentrun.dev/` labels the operator reads ([`StepLabels`]) and what
/// became of the Pod ([`StepPodStatus`]). `metadata.resourceVersion` is read
/// by the watch itself to resume; the Pod watch drops it before the cache
/// (see [`StepPod::forget_resource_version`]). Not kept, as nothing reads
/// them: annotations, managedFields, generation, generateName, selfLink,
/// other labels, the spec, the other conditions, images, container IDs,
/// addresses, start time, QoS class.
///
/// `metadata.labels` is always `None`: the labels are in [`StepPod::labels`]
/// (a `BTreeMap` of six labels costs ~1 KB a Pod, the struct a third of it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPod {
    pub metadata: ObjectMeta,
    pub labels: StepLabels,
    pub status: Option<StepPodStatus>,
}

/// The labels the operator reads of a step Pod: the run (the index and the
/// expectations), the attempt's coordinates and its idempotency key (the
/// engine). The names are those of [`crate::labels`]; a unit test holds them
/// together.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct StepLabels {
    #[serde(rename = "agentrun.dev/run")]
    pub run: Option<String>,
    #[serde(rename = "agentrun.dev/step")]
    pub step: Option<String>,
    #[serde(rename = "agentrun.dev/plan-revision")]
    pub plan_revision: Option<String>,
    #[serde(rename = "agentrun.dev/attempt")]
    pub attempt: Option<String>,
    #[serde(rename = "agentrun.dev/role")]
    pub role: Option<String>,
    #[serde(rename = "agentrun.dev/idempotency-key")]
    pub idempotency_key: Option<String>,
}

/// What became of a step Pod: its phase, reason and message, its
/// `DisruptionTarget` condition, and each container's name, state and last
/// state (without the terminated container's ID).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StepPodStatus {
    #[serde(default)]
    pub phase: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    /// Only the `DisruptionTarget` condition, if any.
    #[serde(
        default,
        rename = "conditions",
        deserialize_with = "disruption_targets"
    )]
    pub disruption_targets: Vec<PodCondition>,
    #[serde(default)]
    pub container_statuses: Option<Vec<StepContainerStatus>>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StepContainerStatus {
    pub name: String,
    #[serde(default)]
    pub state: Option<StepContainerState>,
    #[serde(default)]
    pub last_state: Option<StepContainerState>,
}

/// A k8s-openapi `ContainerState` (~200 bytes inline) with its larger parts
/// boxed: a container that is not terminated costs a few words.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct StepContainerState {
    #[serde(default)]
    pub running: Option<ContainerStateRunning>,
    #[serde(default, deserialize_with = "terminated_without_id")]
    pub terminated: Option<Box<ContainerStateTerminated>>,
    #[serde(default)]
    pub waiting: Option<Box<ContainerStateWaiting>>,
}

fn disruption_targets<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PodCondition>, D::Error> {
    let all: Option<Vec<PodCondition>> = Option::deserialize(d)?;
    Ok(only_disruption_targets(all))
}

fn only_disruption_targets(all: Option<Vec<PodCondition>>) -> Vec<PodCondition> {
    let mut kept: Vec<PodCondition> = all
        .into_iter()
        .flatten()
        .filter(|c| c.type_ == DISRUPTION_TARGET)
        .collect();
    // The filter reuses the list's allocation, room for every condition.
    kept.shrink_to_fit();
    kept
}

fn terminated_without_id<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Box<ContainerStateTerminated>>, D::Error> {
    let t: Option<ContainerStateTerminated> = Option::deserialize(d)?;
    Ok(t.map(without_container_id))
}

fn without_container_id(t: ContainerStateTerminated) -> Box<ContainerStateTerminated> {
    Box::new(ContainerStateTerminated {
        container_id: None,
        ..t
    })
}

/// The metadata fields a [`StepPod`] keeps, as they come on the wire.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
    deletion_grace_period_seconds: Option<i64>,
    labels: Option<StepLabels>,
    owner_references: Option<Vec<OwnerReference>>,
    finalizers: Option<Vec<String>>,
}

impl<'de> Deserialize<'de> for StepPod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Unknown fields (apiVersion, kind, spec, the rest of metadata and
        // status) are skipped by the deserializer, never built.
        #[derive(Deserialize)]
        struct Wire {
            #[serde(default)]
            metadata: WireMeta,
            #[serde(default)]
            status: Option<StepPodStatus>,
        }
        let Wire {
            metadata: m,
            status,
        } = Wire::deserialize(d)?;
        let mut pod = StepPod {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                creation_timestamp: m.creation_timestamp,
                deletion_timestamp: m.deletion_timestamp,
                deletion_grace_period_seconds: m.deletion_grace_period_seconds,
                owner_references: m.owner_references,
                finalizers: m.finalizers,
                ..ObjectMeta::default()
            },
            labels: m.labels.unwrap_or_default(),
            status,
        };
        pod.shrink();
        Ok(pod)
    }
}

impl Resource for StepPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        <Pod as Resource>::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        <Pod as Resource>::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        <Pod as Resource>::version(dt)
    }
    fn api_version(dt: &()) -> Cow<'_, str> {
        <Pod as Resource>::api_version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        <Pod as Resource>::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl StepPod {
    /// Drops `metadata.resourceVersion`, which only the watch reads (to
    /// resume from the last event it delivered): nothing in the operator reads
    /// a cached Pod's version, and the cache's key would keep a copy of it.
    pub fn forget_resource_version(&mut self) {
        self.metadata.resource_version = None;
    }

    /// The Pod the engine decides on: the fields kept, everything else empty.
    pub fn to_pod(&self) -> Pod {
        let l = &self.labels;
        let pod_labels: BTreeMap<String, String> = [
            (labels::RUN, &l.run),
            (labels::STEP, &l.step),
            (labels::PLAN_REVISION, &l.plan_revision),
            (labels::ATTEMPT, &l.attempt),
            (labels::ROLE, &l.role),
            (labels::IDEMPOTENCY_KEY, &l.idempotency_key),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_owned(), v.clone()?)))
        .collect();
        Pod {
            metadata: ObjectMeta {
                labels: (!pod_labels.is_empty()).then_some(pod_labels),
                ..self.metadata.clone()
            },
            spec: None,
            status: self.status.as_ref().map(|s| PodStatus {
                phase: s.phase.clone(),
                reason: s.reason.clone(),
                message: s.message.clone(),
                conditions: (!s.disruption_targets.is_empty())
                    .then(|| s.disruption_targets.clone()),
                container_statuses: s.container_statuses.as_ref().map(|cs| {
                    cs.iter()
                        .map(|c| ContainerStatus {
                            name: c.name.clone(),
                            state: c.state.as_ref().map(StepContainerState::to_state),
                            last_state: c.last_state.as_ref().map(StepContainerState::to_state),
                            ..ContainerStatus::default()
                        })
                        .collect()
                }),
                ..PodStatus::default()
            }),
        }
    }

    /// Gives back what a list grown while deserializing holds beyond its
    /// length (a `Vec` grown from empty has room for four).
    fn shrink(&mut self) {
        let m = &mut self.metadata;
        m.owner_references.iter_mut().for_each(Vec::shrink_to_fit);
        m.finalizers.iter_mut().for_each(Vec::shrink_to_fit);
        if let Some(cs) = self
            .status
            .as_mut()
            .and_then(|s| s.container_statuses.as_mut())
        {
            cs.shrink_to_fit();
        }
    }
}

impl StepContainerState {
    fn to_state(&self) -> ContainerState {
        ContainerState {
            running: self.running.clone(),
            terminated: self.terminated.as_deref().cloned(),
            waiting: self.waiting.as_deref().cloned(),
        }
    }
}

impl From<ContainerState> for StepContainerState {
    fn from(s: ContainerState) -> Self {
        StepContainerState {
            running: s.running,
            terminated: s.terminated.map(without_container_id),
            waiting: s.waiting.map(Box::new),
        }
    }
}

/// A Pod as the API server returned it after a write, kept as the cache
/// keeps it (the expectations stand in for cached copies).
impl From<Pod> for StepPod {
    fn from(pod: Pod) -> Self {
        let m = pod.metadata;
        let mut all = m.labels.unwrap_or_default();
        let mut label = |k: &str| all.remove(k);
        let labels = StepLabels {
            run: label(labels::RUN),
            step: label(labels::STEP),
            plan_revision: label(labels::PLAN_REVISION),
            attempt: label(labels::ATTEMPT),
            role: label(labels::ROLE),
            idempotency_key: label(labels::IDEMPOTENCY_KEY),
        };
        let mut step_pod = StepPod {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                creation_timestamp: m.creation_timestamp,
                deletion_timestamp: m.deletion_timestamp,
                deletion_grace_period_seconds: m.deletion_grace_period_seconds,
                owner_references: m.owner_references,
                finalizers: m.finalizers,
                ..ObjectMeta::default()
            },
            labels,
            status: pod.status.map(|s| StepPodStatus {
                phase: s.phase,
                reason: s.reason,
                message: s.message,
                disruption_targets: only_disruption_targets(s.conditions),
                container_statuses: s.container_statuses.map(|cs| {
                    cs.into_iter()
                        .map(|c| StepContainerStatus {
                            name: c.name,
                            state: c.state.map(StepContainerState::from),
                            last_state: c.last_state.map(StepContainerState::from),
                        })
                        .collect()
                }),
            }),
        };
        step_pod.shrink();
        step_pod
    }
}

#[cfg(test)]
mod tests {
    use kube::ResourceExt;

    use super::*;

    /// What the API server and a kubelet add that the operator never reads.
    fn as_a_kubelet_reports(mut pod: Pod) -> Pod {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
        let m = &mut pod.metadata;
        m.annotations
            .get_or_insert_with(BTreeMap::new)
            .insert("seen-by".to_owned(), "kubelet".to_owned());
        m.labels
            .get_or_insert_with(BTreeMap::new)
            .insert("team".to_owned(), "payments".to_owned());
        m.resource_version = Some("4711".into());
        m.generation = Some(1);
        m.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some("simkubelet".into()),
            operation: Some("Apply".into()),
            ..ManagedFieldsEntry::default()
        }]);
        if let Some(s) = pod.status.as_mut() {
            s.host_ip = Some("10.0.0.1".into());
            s.pod_ip = Some("10.1.0.7".into());
            s.qos_class = Some("BestEffort".into());
            s.conditions
                .get_or_insert_with(Vec::new)
                .push(PodCondition {
                    type_: "Ready".into(),
                    status: "False".into(),
                    reason: Some("PodCompleted".into()),
                    ..PodCondition::default()
                });
            for c in s.container_statuses.iter_mut().flatten() {
                c.image = "ghcr.io/example/agent:1".into();
                c.image_id = "sim://ghcr.io/example/agent:1".into();
                c.container_id = Some("sim://c".into());
                c.restart_count = 1;
                c.last_state = Some(ContainerState::default());
                if let Some(t) = c.state.as_mut().and_then(|s| s.terminated.as_mut()) {
                    t.container_id = Some("sim://c".into());
                }
            }
        }
        pod
    }

    /// What the cache kept of a Pod before [`StepPod`] (a trimmed `Pod`),
    /// less the metadata nothing reads: the reference `to_pod` must meet.
    fn trimmed_as_before(mut pod: Pod) -> Pod {
        pod.metadata.managed_fields = None;
        pod.metadata.annotations = None;
        pod.spec = None;
        if let Some(status) = pod.status.take() {
            pod.status = Some(PodStatus {
                phase: status.phase,
                reason: status.reason,
                message: status.message,
                conditions: status
                    .conditions
                    .map(|cs| {
                        cs.into_iter()
                            .filter(|c| c.type_ == DISRUPTION_TARGET)
                            .collect::<Vec<_>>()
                    })
                    .filter(|cs| !cs.is_empty()),
                container_statuses: status.container_statuses.map(|cs| {
                    cs.into_iter()
                        .map(|c| ContainerStatus {
                            name: c.name,
                            state: c.state.map(trim_state),
                            last_state: c.last_state.map(trim_state),
                            ..ContainerStatus::default()
                        })
                        .collect()
                }),
                ..PodStatus::default()
            });
        }
        // Newly left out.
        pod.metadata.resource_version = None;
        pod.metadata.generation = None;
        if let Some(l) = pod.metadata.labels.as_mut() {
            l.retain(|k, _| k.starts_with("agentrun.dev/"));
        }
        pod
    }

    fn trim_state(state: ContainerState) -> ContainerState {
        ContainerState {
            terminated: state.terminated.map(|t| ContainerStateTerminated {
                container_id: None,
                ..t
            }),
            ..state
        }
    }

    /// As the Pod watch caches it: from the API server's JSON.
    fn cached(pod: &Pod) -> StepPod {
        let json = serde_json::to_vec(pod).unwrap();
        let mut step_pod: StepPod = serde_json::from_slice(&json).unwrap();
        step_pod.forget_resource_version();
        step_pod
    }

    #[test]
    fn the_engine_decides_alike_on_a_cached_step_pod() {
        use crate::api::{AgentRun, Effect};
        use crate::engine::testing::{PodExt, World, ok_message, step, t};

        let mut w = World::new(
            AgentRun::test().with_steps([
                step("lookup").with_effect(Effect::None),
                step("refund")
                    .with_effect(Effect::Idempotent)
                    .with_retry(2, "1s", "1s"),
                step("notify").with_effect(Effect::Idempotent),
            ]),
        );
        let same = |w: &World, stage: &str| {
            let whole: Vec<Pod> = w.pods.values().cloned().map(as_a_kubelet_reports).collect();
            let trimmed: Vec<Pod> = whole
                .iter()
                .map(|p| {
                    let step_pod = cached(p);
                    // The expectations keep the API server's answer to a
                    // write the same way.
                    let mut answered = StepPod::from(p.clone());
                    answered.forget_resource_version();
                    assert_eq!(step_pod, answered, "{stage}");
                    step_pod.to_pod()
                })
                .collect();
            for (t, p) in trimmed.iter().zip(&whole) {
                assert!(t.spec.is_none() && t.annotations().is_empty());
                assert_eq!(t, &trimmed_as_before(p.clone()), "{stage}");
            }
            assert_eq!(w.decide_with(&whole), w.decide_with(&trimmed), "{stage}");
        };
        w.settle();
        same(
            &w,
            "first pod created (pending, spec and context annotation)",
        );
        let lookup = w.live_pods()[0].clone();
        w.update_pod(&lookup, |p| p.running());
        same(&w, "running");
        w.update_pod(&lookup, |p| {
            p.succeeded(&ok_message(serde_json::json!({"order": 1}), 5))
        });
        same(&w, "succeeded, finalizer held");
        w.settle();
        same(&w, "committed and released");
        let refund = w.live_pods()[0].clone();
        w.update_pod(&refund, |p| p.evicted(true));
        same(&w, "evicted after it started (DisruptionTarget)");
        w.settle();
        let retry = w.live_pods()[0].clone();
        w.update_pod(&retry, |p| p.running().deleting(t(5)));
        same(&w, "deleted while running");
        w.update_pod(&retry, |p| p.exited(143, "").deleting(t(5)));
        same(&w, "stopped by the deletion");
        w.update_pod(&retry, |p| p.exited(2, "boom"));
        same(&w, "failed on its own");
    }

    #[test]
    fn a_step_pod_reads_the_operators_labels_and_is_a_pod_to_the_api() {
        let json = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "r1-a-r1-a1",
                "namespace": "ns",
                "labels": {
                    (labels::RUN): "r1",
                    (labels::STEP): "a",
                    (labels::PLAN_REVISION): "1",
                    (labels::ATTEMPT): "1",
                    (labels::ROLE): "step",
                    (labels::IDEMPOTENCY_KEY): "k",
                    "team": "payments",
                },
            },
            "spec": {"containers": [{"name": "step", "image": "agent:1"}]},
        });
        let pod: StepPod = serde_json::from_value(json).unwrap();
        let l = &pod.labels;
        assert_eq!(
            [
                &l.run,
                &l.step,
                &l.plan_revision,
                &l.attempt,
                &l.role,
                &l.idempotency_key
            ]
            .map(|v| v.as_deref()),
            [
                Some("r1"),
                Some("a"),
                Some("1"),
                Some("1"),
                Some("step"),
                Some("k")
            ]
        );
        assert!(pod.metadata.labels.is_none() && pod.status.is_none());
        assert_eq!(pod.to_pod().labels().len(), 6);
        assert_eq!(
            StepPod::url_path(&(), Some("ns")),
            Pod::url_path(&(), Some("ns"))
        );
        assert_eq!(StepPod::api_version(&()), "v1");
        assert_eq!(StepPod::kind(&()), "Pod");
    }

    /// The point of the type: a cached Pod's own allocation is a quarter of
    /// a k8s-openapi `Pod`'s (2,416 bytes), and a container's status a
    /// seventh of a `ContainerStatus` (752).
    #[test]
    fn a_step_pod_is_small() {
        use std::mem::size_of;
        assert!(size_of::<StepPod>() <= 640, "{}", size_of::<StepPod>());
        assert!(
            size_of::<StepContainerStatus>() <= 112,
            "{}",
            size_of::<StepContainerStatus>()
        );
    }
}
