//! Which step Pods, Approvals and Signals belong to which run, kept beside
//! their caches so a reconcile looks up its run's objects instead of
//! scanning every cached one ([`Index`]). What the cache keeps of each Pod
//! is in `step_pod`.
//!
//! Fed by the same watch events as the cache: applied objects are added,
//! deleted ones removed, and a re-list (`Init` … `InitDone`) rebuilds the
//! index whole, exactly as the cache itself is rebuilt. Pods are filed by
//! their run's name (their label), Approvals and Signals by their run's UID.
//!
//! ```text
//!   watch pods (agentrun.dev/run) ──JSON──▶ StepPod ──▶ Store<StepPod> + PodIndex
//!                                                  └──▶ StepPod::to_pod ──▶ engine (World.pods)
//!   watch approvals ──▶ Store<Approval> + ApprovalIndex ──▶ engine (World.approvals)
//!   watch signals   ──▶ Store<Signal> + SignalIndex     ──▶ engine (World.signals)
//!   watch stepjournals ─▶ Store<StepJournal> + JournalIndex ─▶ engine (World.journals)
//! ```

use std::collections::{BTreeSet, HashMap};
use std::marker::PhantomData;
use std::sync::{Arc, RwLock};

use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

pub use super::step_pod::StepPod;
use crate::api::{Approval, Signal, StepJournal};

type Key = (String, String);

#[derive(Default)]
struct Inner {
    live: HashMap<Key, BTreeSet<String>>,
    /// Being rebuilt by a re-list; swapped in at `InitDone`.
    relist: Option<HashMap<Key, BTreeSet<String>>>,
}

/// What an [`Index`] files an object under: its namespace and the run it
/// belongs to, and its name.
pub trait Filed {
    fn filed(&self) -> Option<(Key, String)>;
}

/// Step Pods by their run's name (label `agentrun.dev/run`).
impl Filed for StepPod {
    fn filed(&self) -> Option<(Key, String)> {
        let ns = self.namespace()?;
        let run = self.labels.run.clone()?;
        Some(((ns, run), self.name_any()))
    }
}

/// Approvals by their run's UID (`spec.runUid`).
impl Filed for Approval {
    fn filed(&self) -> Option<(Key, String)> {
        let ns = self.namespace()?;
        Some(((ns, self.spec.run_uid.clone()), self.name_any()))
    }
}

/// Signals by their run's UID (`spec.runUid`).
impl Filed for Signal {
    fn filed(&self) -> Option<(Key, String)> {
        let ns = self.namespace()?;
        Some(((ns, self.spec.run_uid.clone()), self.name_any()))
    }
}

/// Journal chunks by their run's UID (`spec.runUid`).
impl Filed for StepJournal {
    fn filed(&self) -> Option<(Key, String)> {
        let ns = self.namespace()?;
        Some(((ns, self.spec.run_uid.clone()), self.name_any()))
    }
}

/// Object names by (namespace, run), kept from the watch events of one
/// cache, so that a reconcile reads its run's objects instead of scanning
/// every cached one.
pub struct Index<K>(Arc<RwLock<Inner>>, PhantomData<fn(&K)>);

/// Pod names by (namespace, run name).
pub type PodIndex = Index<StepPod>;
/// Approval names by (namespace, run UID).
pub type ApprovalIndex = Index<Approval>;
/// Signal names by (namespace, run UID).
pub type SignalIndex = Index<Signal>;
/// Journal chunk names by (namespace, run UID).
pub type JournalIndex = Index<StepJournal>;

impl<K> Clone for Index<K> {
    fn clone(&self) -> Self {
        Index(self.0.clone(), PhantomData)
    }
}

impl<K> Default for Index<K> {
    fn default() -> Self {
        Index(Arc::default(), PhantomData)
    }
}

impl<K: Filed> Index<K> {
    /// Applies one watch event; call it after the cache has applied the same event.
    pub fn apply(&self, event: &watcher::Event<K>) {
        let mut inner = self.0.write().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Apply(obj) => {
                if let Some((k, name)) = obj.filed() {
                    inner.live.entry(k).or_default().insert(name);
                }
            }
            watcher::Event::Delete(obj) => {
                if let Some((k, name)) = obj.filed()
                    && let Some(names) = inner.live.get_mut(&k)
                {
                    names.remove(&name);
                    if names.is_empty() {
                        inner.live.remove(&k);
                    }
                }
            }
            watcher::Event::Init => inner.relist = Some(HashMap::new()),
            watcher::Event::InitApply(obj) => {
                if let Some((k, name)) = obj.filed() {
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

    /// The names of the objects filed under `run` in `namespace`.
    pub fn names_of(&self, namespace: &str, run: &str) -> Vec<String> {
        let inner = self.0.read().unwrap_or_else(|e| e.into_inner());
        inner
            .live
            .get(&(namespace.to_owned(), run.to_owned()))
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn names(&self, namespace: &str, run: &str, name: &str) -> bool {
        let inner = self.0.read().unwrap_or_else(|e| e.into_inner());
        inner
            .live
            .get(&(namespace.to_owned(), run.to_owned()))
            .is_some_and(|names| names.contains(name))
    }

    /// The cached objects filed under `run` in `namespace`, read from `store`.
    pub fn read<'s>(
        &self,
        store: &'s Store<K>,
        namespace: &str,
        run: &str,
    ) -> impl Iterator<Item = Arc<K>> + 's
    where
        K: Resource<DynamicType = ()> + Clone + 'static,
    {
        let ns = namespace.to_owned();
        self.names_of(namespace, run)
            .into_iter()
            .filter_map(move |name| store.get(&ObjectRef::new(&name).within(&ns)))
    }
}

/// The step Pod cache as a reconcile reads it: the index names a run's Pods
/// and the store holds them.
///
/// One watch event writes the store first and the index after it, so for a
/// moment a new Pod is in the store and not yet named. Whoever asks whether
/// the cache shows a Pod (the expectations, before they stand in for it)
/// asks here, where reconciles read, not the store alone.
#[derive(Clone)]
pub struct PodCache {
    store: Store<StepPod>,
    index: PodIndex,
}

impl PodCache {
    pub fn new(store: Store<StepPod>, index: PodIndex) -> PodCache {
        PodCache { store, index }
    }

    /// The cached Pods labelled with `run` in `namespace`.
    pub fn pods_of(&self, namespace: &str, run: &str) -> Vec<Arc<StepPod>> {
        self.index.read(&self.store, namespace, run).collect()
    }

    /// The cached copy of `pod`, if [`PodCache::pods_of`] shows one.
    pub fn get(&self, pod: &StepPod) -> Option<Arc<StepPod>> {
        let (ns, run) = (
            pod.metadata.namespace.as_deref()?,
            pod.labels.run.as_deref()?,
        );
        let name = pod.metadata.name.as_deref()?;
        if !self.index.names(ns, run, name) {
            return None;
        }
        self.store.get(&ObjectRef::new(name).within(ns))
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::labels;

    fn pod(ns: &str, run: &str, name: &str) -> StepPod {
        StepPod::from(Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                labels: Some([(labels::RUN.to_owned(), run.to_owned())].into()),
                ..Default::default()
            },
            ..Default::default()
        })
    }

    fn approval(ns: &str, run_uid: &str, name: &str) -> Approval {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"runName": "r", "runUid": run_uid, "step": "s", "planRevision": 1, "kind": "Approve"},
        }))
        .expect("test approval deserializes")
    }

    /// A reconcile reads its run's Approvals by UID, not every cached one:
    /// a same-named newer run (another UID) and another namespace are apart.
    #[test]
    fn files_approvals_by_run_uid_and_reads_them_from_the_store() {
        let (store, mut writer) = kube::runtime::reflector::store::<Approval>();
        let index = ApprovalIndex::default();
        let mut deliver = |event: watcher::Event<Approval>| {
            writer.apply_watcher_event(&event);
            index.apply(&event);
        };
        deliver(watcher::Event::Apply(approval("a", "u1", "g1")));
        deliver(watcher::Event::Apply(approval("a", "u1", "g2")));
        deliver(watcher::Event::Apply(approval("a", "u2", "g3")));
        deliver(watcher::Event::Apply(approval("b", "u1", "g4")));
        let read = |ns: &str, uid: &str| -> Vec<String> {
            index.read(&store, ns, uid).map(|a| a.name_any()).collect()
        };
        assert_eq!(read("a", "u1"), ["g1", "g2"]);
        assert_eq!(read("a", "u2"), ["g3"]);
        assert_eq!(read("b", "u1"), ["g4"]);
        deliver(watcher::Event::Delete(approval("a", "u1", "g1")));
        assert_eq!(read("a", "u1"), ["g2"]);
        assert!(read("a", "u3").is_empty());
    }

    #[test]
    fn follows_applies_deletes_and_relists() {
        let index = PodIndex::default();
        index.apply(&watcher::Event::Apply(pod("a", "r1", "p1")));
        index.apply(&watcher::Event::Apply(pod("a", "r1", "p2")));
        index.apply(&watcher::Event::Apply(pod("b", "r1", "p3")));
        assert_eq!(index.names_of("a", "r1"), ["p1", "p2"]);
        assert_eq!(index.names_of("b", "r1"), ["p3"]);

        index.apply(&watcher::Event::Delete(pod("a", "r1", "p1")));
        assert_eq!(index.names_of("a", "r1"), ["p2"]);

        // A re-list replaces the index only when it is complete.
        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(pod("a", "r1", "p4")));
        assert_eq!(
            index.names_of("a", "r1"),
            ["p2"],
            "unchanged until InitDone"
        );
        index.apply(&watcher::Event::InitDone);
        assert_eq!(index.names_of("a", "r1"), ["p4"]);
        assert!(
            index.names_of("b", "r1").is_empty(),
            "p3 vanished during the gap"
        );
    }
}
