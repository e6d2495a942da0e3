//! Which step Pods belong to which run, kept beside the Pod cache so a
//! reconcile looks up its run's Pods instead of scanning every cached Pod.
//!
//! Fed by the same watch events as the cache: applied Pods are added, deleted
//! ones removed, and a re-list (`Init` … `InitDone`) rebuilds the index whole,
//! exactly as the cache itself is rebuilt.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::watcher;

use crate::labels;

type Key = (String, String);

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
