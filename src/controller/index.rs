//! Which step Pods belong to which run, kept beside the Pod cache so a
//! reconcile looks up its run's Pods instead of scanning every cached Pod;
//! and what the cache keeps of each Pod ([`trim`]).
//!
//! Fed by the same watch events as the cache: applied Pods are added, deleted
//! ones removed, and a re-list (`Init` … `InitDone`) rebuilds the index whole,
//! exactly as the cache itself is rebuilt.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStatus, Pod, PodStatus,
};
use kube::ResourceExt;
use kube::runtime::watcher;

use crate::labels;

type Key = (String, String);

/// The one Pod condition the engine reads (D6: a disruption, not a failure).
const DISRUPTION_TARGET: &str = "DisruptionTarget";

/// Trims a step Pod to what the operator reads of it, for the Pod cache and
/// for the expectations standing in for it: its identity (name, namespace,
/// UID, labels, owner references, finalizers, deletion timestamp and grace
/// period) and what became of it (phase, reason, message, the
/// `DisruptionTarget` condition, each container's name, state and last
/// state). The rest — spec, annotations (the context the operator wrote
/// itself), managedFields, the other conditions, images and container IDs,
/// addresses — is most of the object and is never read.
pub fn trim(pod: &mut Pod) {
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

#[derive(Default)]
struct Inner {
    live: HashMap<Key, BTreeSet<String>>,
    /// Being rebuilt by a re-list; swapped in at `InitDone`.
    relist: Option<HashMap<Key, BTreeSet<String>>>,
}

/// Pod names by (namespace, run name).
#[derive(Clone, Default)]
pub struct PodIndex(Arc<RwLock<Inner>>);

fn key(pod: &Pod) -> Option<(Key, String)> {
    let ns = pod.namespace()?;
    let run = pod.labels().get(labels::RUN)?.clone();
    Some(((ns, run), pod.name_any()))
}

impl PodIndex {
    /// Applies one watch event; call it after the cache has applied the same event.
    pub fn apply(&self, event: &watcher::Event<Pod>) {
        let mut inner = self.0.write().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Apply(pod) => {
                if let Some((k, name)) = key(pod) {
                    inner.live.entry(k).or_default().insert(name);
                }
            }
            watcher::Event::Delete(pod) => {
                if let Some((k, name)) = key(pod)
                    && let Some(names) = inner.live.get_mut(&k)
                {
                    names.remove(&name);
                    if names.is_empty() {
                        inner.live.remove(&k);
                    }
                }
            }
            watcher::Event::Init => inner.relist = Some(HashMap::new()),
            watcher::Event::InitApply(pod) => {
                if let Some((k, name)) = key(pod) {
                    inner
                        .relist
                        .get_or_insert_with(HashMap::new)
                        .entry(k)
                        .or_default()
                        .insert(name);
                }
            }
            watcher::Event::InitDone => {
                if let Some(rebuilt) = inner.relist.take() {
                    inner.live = rebuilt;
                }
            }
        }
    }

    /// The names of the Pods labelled with `run` in `namespace`.
    pub fn pods_of(&self, namespace: &str, run: &str) -> Vec<String> {
        let inner = self.0.read().unwrap_or_else(|e| e.into_inner());
        inner
            .live
            .get(&(namespace.to_owned(), run.to_owned()))
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn pod(ns: &str, run: &str, name: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                labels: Some([(labels::RUN.to_owned(), run.to_owned())].into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// What a kubelet adds that the engine never reads.
    fn as_a_kubelet_reports(mut pod: Pod) -> Pod {
        use k8s_openapi::api::core::v1::PodCondition;
        pod.metadata.annotations = Some([("seen-by".to_owned(), "kubelet".to_owned())].into());
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
                if let Some(t) = c.state.as_mut().and_then(|s| s.terminated.as_mut()) {
                    t.container_id = Some("sim://c".into());
                }
            }
        }
        pod
    }

    #[test]
    fn the_engine_decides_alike_on_a_trimmed_pod() {
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
                .cloned()
                .map(|mut p| {
                    trim(&mut p);
                    p
                })
                .collect();
            assert!(
                trimmed
                    .iter()
                    .all(|p| p.spec.is_none() && p.annotations().is_empty())
            );
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
    fn follows_applies_deletes_and_relists() {
        let index = PodIndex::default();
        index.apply(&watcher::Event::Apply(pod("a", "r1", "p1")));
        index.apply(&watcher::Event::Apply(pod("a", "r1", "p2")));
        index.apply(&watcher::Event::Apply(pod("b", "r1", "p3")));
        assert_eq!(index.pods_of("a", "r1"), ["p1", "p2"]);
        assert_eq!(index.pods_of("b", "r1"), ["p3"]);

        index.apply(&watcher::Event::Delete(pod("a", "r1", "p1")));
        assert_eq!(index.pods_of("a", "r1"), ["p2"]);

        // A re-list replaces the index only when it is complete.
        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(pod("a", "r1", "p4")));
        assert_eq!(index.pods_of("a", "r1"), ["p2"], "unchanged until InitDone");
        index.apply(&watcher::Event::InitDone);
        assert_eq!(index.pods_of("a", "r1"), ["p4"]);
        assert!(
            index.pods_of("b", "r1").is_empty(),
            "p3 vanished during the gap"
        );
    }
}
