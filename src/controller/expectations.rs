//! What this process just did to step Pods and its Pod cache may not show yet
//! (the Job controller's "expectations").
//!
//! A reconcile that runs right after its own Pod create or finalizer release
//! decides on a cache the watch has not caught up with: the new Pod looks
//! missing and the released one still holds the finalizer, so the engine asks
//! for the same write again. The write would be harmless (create-if-absent,
//! an idempotent release), but it is an API call on every step. An entry here
//! stands for the cache until the watch delivers the change or the entry
//! expires. Nothing here is durable or needs to be: after a restart the
//! caches are listed fresh and a repeated write is still safe.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::watcher;

use super::index::{PodCache, StepPod};
use crate::labels;

/// How long an unconfirmed write stands for the cache. Long enough for a
/// watch under load; short enough that a Pod which vanished before the cache
/// ever saw it is created again without much delay.
const TTL: Duration = Duration::from_secs(30);

type Key = (String, String);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Write {
    /// Created by this process; not yet in the cache.
    Created,
    /// Its result finalizer released by this process; the cache still shows it.
    Released,
}

struct Entry {
    write: Write,
    /// The Pod as the API server returned it after the write, kept as the
    /// cache keeps it.
    pod: StepPod,
    at: Instant,
}

/// What settling an entry needs of a Pod the watch delivered.
struct Seen {
    key: Key,
    uid: Option<String>,
    /// It still holds the result finalizer.
    held: bool,
}

impl Seen {
    fn of(pod: &StepPod) -> Option<Seen> {
        Some(Seen {
            key: (pod.namespace()?, pod.name_any()),
            uid: pod.metadata.uid.clone(),
            held: pod
                .finalizers()
                .iter()
                .any(|f| f == labels::RESULT_FINALIZER),
        })
    }
}

/// Recent Pod writes by (namespace, Pod name), and the Pods of a re-list in
/// progress.
#[derive(Default)]
pub struct Expectations(Mutex<HashMap<Key, Entry>>, Mutex<Option<Vec<Seen>>>);

impl Expectations {
    /// Records a Pod this process created, as the API server returned it,
    /// unless `cache` (read under the same lock the watch settles entries
    /// with) already shows it.
    pub fn created(&self, pod: Pod, cache: &PodCache) {
        self.record(Write::Created, pod, cache);
    }

    /// Records a Pod whose result finalizer this process released, as the
    /// API server returned it, unless `cache` already shows the release.
    pub fn released(&self, pod: Pod, cache: &PodCache) {
        self.record(Write::Released, pod, cache);
    }

    /// The Pods of `run` in `namespace` as a reconcile decides on them: the
    /// copies in `cache`, each replaced by this process's own write of it
    /// while the cache does not show that write; and whether any was.
    ///
    /// The cache is read under the lock the watch settles entries with, so
    /// no entry is settled while it is read: every write is seen, in its
    /// entry or in the cache. And no entry stands for a copy older than the
    /// cache's, because the watch does not get past the event that settles
    /// it (the next event is applied only once `observe` returns).
    pub fn pods_of(&self, cache: &PodCache, namespace: &str, run: &str) -> (Vec<Pod>, bool) {
        let (cached, standing) = {
            let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let standing: Vec<StepPod> = map
                .iter()
                .filter(|((ns, _), e)| {
                    ns == namespace
                        && e.at.elapsed() < TTL
                        && e.pod.labels.run.as_deref() == Some(run)
                })
                .map(|(_, e)| e.pod.clone())
                .collect();
            (cache.pods_of(namespace, run), standing)
        };
        let stood_in = !standing.is_empty();
        let mut pods: BTreeMap<String, Pod> =
            cached.iter().map(|p| (p.name_any(), p.to_pod())).collect();
        for pod in standing {
            pods.insert(pod.name_any(), pod.to_pod());
        }
        (pods.into_values().collect(), stood_in)
    }

    /// How long an entry stands at most: a reconcile that decided on one
    /// looks again by then, in case no watch event comes to settle it.
    pub const TTL: Duration = TTL;

    /// Settles entries from one watch event of the Pod cache.
    pub fn observe(&self, event: &watcher::Event<StepPod>) {
        let settle = |seen: Option<Seen>, deleted: bool| {
            let Some(seen) = seen else { return };
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let Some(entry) = map.get(&seen.key) else {
                return;
            };
            let settled = deleted
                || entry.pod.metadata.uid != seen.uid
                || match entry.write {
                    Write::Created => true,
                    Write::Released => !seen.held,
                };
            if settled {
                map.remove(&seen.key);
            }
        };
        // A re-list (after a 410, say) fills the cache only at InitDone:
        // until then the cache still holds its old content, so a stand-in
        // must stay until the re-listed copy is really in the cache, or the
        // Pod would look gone in between (D6: a NonIdempotent step's Pod
        // seen and then gone asks a person).
        let mut relist = self.1.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Apply(pod) => settle(Seen::of(pod), false),
            watcher::Event::Delete(pod) => settle(Seen::of(pod), true),
            watcher::Event::Init => *relist = Some(Vec::new()),
            // Only what settling needs, not a second copy of every Pod.
            watcher::Event::InitApply(pod) => {
                relist.get_or_insert_with(Vec::new).extend(Seen::of(pod))
            }
            watcher::Event::InitDone => {
                let relisted = relist.take().unwrap_or_default();
                // A released Pod the re-list left out is gone, or ended and
                // labelled out of the watch by its release: settled either way.
                let listed: std::collections::HashSet<&Key> =
                    relisted.iter().map(|s| &s.key).collect();
                self.0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|key, e| e.write != Write::Released || listed.contains(key));
                for seen in relisted {
                    settle(Some(seen), false);
                }
            }
        }
    }

    fn record(&self, write: Write, pod: Pod, cache: &PodCache) {
        // Stands for a cached copy, so it is kept as the cache keeps one.
        let mut pod = StepPod::from(pod);
        pod.forget_resource_version();
        let Some(ns) = pod.namespace() else { return };
        let now = Instant::now();
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, e| now.duration_since(e.at) < TTL);
        // The watch may have delivered the change before the API server's
        // answer came back; it then settled nothing, and an entry made now
        // would hide newer cached copies until it expires. The cache (store
        // and index) is written before the watch event reaches `observe`,
        // which waits for this lock, so checking it here leaves no gap.
        let cached = cache.get(&pod);
        let shown = match write {
            Write::Created => cached.is_some_and(|c| c.uid() == pod.uid()),
            Write::Released => cached.is_none_or(|c| {
                c.uid() != pod.uid()
                    || !c.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER)
            }),
        };
        if shown {
            return;
        }
        map.insert(
            (ns, pod.name_any()),
            Entry {
                write,
                pod,
                at: now,
            },
        );
    }
}

/// Status writes this process made that the run cache may not show yet: for
/// each run, the resourceVersions its recent writes were made on. A cached
/// copy at one of them is older than this process's own write, and a
/// decision on it could only meet 409 Conflict, at the cost of the API
/// server applying a patch to the whole stored object and of a re-read. The
/// run's watch brings the newer copy, and a reconcile with it, so a reconcile
/// that finds the cache behind waits for that, and looks again after [`TTL`]
/// in case it never comes. Past [`TTL`] the entry is void and a reconcile
/// decides on what it has (and meets the 409 if the cache is still behind):
/// a watch that stopped delivering cannot hold a run up.
#[derive(Default)]
pub struct StatusWrites(Mutex<HashMap<Key, Bases>>);

struct Bases {
    /// The resourceVersions the writes were made on, oldest first.
    versions: Vec<String>,
    /// When the last of them was written.
    at: Instant,
}

impl StatusWrites {
    /// How long a recorded write stands; a reconcile that found the cache
    /// behind looks again by then.
    pub const TTL: Duration = TTL;

    /// Records a status write of the run `name` in `namespace` made on the
    /// copy at `base`.
    pub fn wrote(&self, namespace: &str, name: &str, base: &str) {
        let now = Instant::now();
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Entries of runs deleted right after a write are never read again.
        map.retain(|_, b| now.duration_since(b.at) < TTL);
        let bases = map
            .entry((namespace.to_owned(), name.to_owned()))
            .or_insert_with(|| Bases {
                versions: Vec::new(),
                at: now,
            });
        bases.versions.push(base.to_owned());
        bases.at = now;
    }

    /// Whether the cached copy of the run, at `version`, is one this
    /// process has already written over. A copy at any other version is
    /// newer than every write recorded, which are then forgotten.
    pub fn behind(&self, namespace: &str, name: &str, version: &str) -> bool {
        let key = (namespace.to_owned(), name.to_owned());
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bases) = map.get(&key) else {
            return false;
        };
        if bases.at.elapsed() < TTL && bases.versions.iter().any(|v| v == version) {
            return true;
        }
        map.remove(&key);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};

    use crate::controller::index::PodIndex;

    fn pod(name: &str, uid: &str, finalizer: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                labels: Some([(labels::RUN.to_owned(), "r1".to_owned())].into()),
                finalizers: finalizer.then(|| vec![labels::RESULT_FINALIZER.to_owned()]),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The Pods that stand in for the cache, by name.
    fn names(e: &Expectations, ns: &str, run: &str) -> Vec<String> {
        let empty = PodCache::new(reflector::store().0, PodIndex::default());
        e.pods_of(&empty, ns, run)
            .0
            .iter()
            .map(|p| p.name_any())
            .collect()
    }

    /// The Pod cache and the watch, in the order of the Pod watch: the store
    /// is written, then the index, then `observe` runs.
    struct Watch(Writer<StepPod>, PodIndex);

    fn step_pod(event: watcher::Event<Pod>) -> watcher::Event<StepPod> {
        match event {
            watcher::Event::Apply(p) => watcher::Event::Apply(StepPod::from(p)),
            watcher::Event::Delete(p) => watcher::Event::Delete(StepPod::from(p)),
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitApply(p) => watcher::Event::InitApply(StepPod::from(p)),
            watcher::Event::InitDone => watcher::Event::InitDone,
        }
    }

    impl Watch {
        fn deliver(&mut self, e: &Expectations, event: watcher::Event<Pod>) {
            let event = self.write_store(event);
            self.finish(e, &event);
        }

        /// The first half of a delivery: the store holds the event, the
        /// index does not name its Pod yet.
        fn write_store(&mut self, event: watcher::Event<Pod>) -> watcher::Event<StepPod> {
            let event = step_pod(event);
            self.0.apply_watcher_event(&event);
            event
        }

        fn finish(&mut self, e: &Expectations, event: &watcher::Event<StepPod>) {
            self.1.apply(event);
            e.observe(event);
        }
    }

    fn cache() -> (PodCache, Store<StepPod>, Watch) {
        let (store, writer) = reflector::store();
        let index = PodIndex::default();
        (
            PodCache::new(store.clone(), index.clone()),
            store,
            Watch(writer, index),
        )
    }

    /// What a reconcile decides on, by name.
    fn seen(e: &Expectations, cache: &PodCache) -> Vec<String> {
        e.pods_of(cache, "ns", "r1")
            .0
            .iter()
            .map(|p| p.name_any())
            .collect()
    }

    #[test]
    fn a_created_pod_stands_for_the_cache_until_the_watch_shows_it() {
        let e = Expectations::default();
        let (cache, _, mut watch) = cache();
        e.created(pod("p1", "u1", true), &cache);
        assert_eq!(names(&e, "ns", "r1"), ["p1"]);
        assert!(names(&e, "other", "r1").is_empty(), "per namespace");
        assert!(names(&e, "ns", "r2").is_empty(), "per run");
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u1", true)));
        assert!(names(&e, "ns", "r1").is_empty());
    }

    /// The create's answer can come back while the watch is between the
    /// store and the index: the store holds the new Pod, a reconcile does not
    /// see it yet. The stand-in is kept until the watch has done both.
    #[test]
    fn a_pod_in_the_store_and_not_yet_in_the_index_still_has_its_stand_in() {
        let e = Expectations::default();
        let (cache, store, mut watch) = cache();
        let half = watch.write_store(watcher::Event::Apply(pod("p1", "u1", true)));
        assert!(store.get(&ObjectRef::new("p1").within("ns")).is_some());
        e.created(pod("p1", "u1", true), &cache);
        assert_eq!(seen(&e, &cache), ["p1"], "a reconcile now sees the Pod");
        watch.finish(&e, &half);
        assert!(names(&e, "ns", "r1").is_empty(), "settled by the watch");
        assert_eq!(seen(&e, &cache), ["p1"]);
    }

    #[test]
    fn a_relisted_pod_settles_its_stand_in_only_once_the_cache_holds_it() {
        let e = Expectations::default();
        let (cache, store, mut watch) = cache();
        e.created(pod("p1", "u1", true), &cache);
        // A 410 restarts the watch: the cache keeps its old content until InitDone.
        watch.deliver(&e, watcher::Event::Init);
        watch.deliver(&e, watcher::Event::InitApply(pod("p1", "u1", true)));
        assert!(store.get(&ObjectRef::new("p1").within("ns")).is_none());
        assert_eq!(names(&e, "ns", "r1"), ["p1"], "not gone in between");
        watch.deliver(&e, watcher::Event::InitDone);
        assert!(store.get(&ObjectRef::new("p1").within("ns")).is_some());
        assert!(names(&e, "ns", "r1").is_empty());
    }

    #[test]
    fn a_write_the_watch_delivered_before_its_answer_is_not_recorded() {
        let e = Expectations::default();
        let (cache, _, mut watch) = cache();
        // The Pod was created, ran and succeeded before the create's answer came back.
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u1", true)));
        e.created(pod("p1", "u1", true), &cache);
        assert!(
            names(&e, "ns", "r1").is_empty(),
            "it would hide the newer copy"
        );
        watch.deliver(&e, watcher::Event::Apply(pod("p2", "u2", false)));
        e.released(pod("p2", "u2", false), &cache);
        e.released(pod("p3", "u3", false), &cache);
        assert!(names(&e, "ns", "r1").is_empty(), "released, or gone");
    }

    #[test]
    fn a_release_stands_until_the_finalizer_is_gone_or_the_pod_is() {
        let e = Expectations::default();
        let (cache, _, mut watch) = cache();
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u1", true)));
        watch.deliver(&e, watcher::Event::Apply(pod("p2", "u2", true)));
        e.released(pod("p1", "u1", false), &cache);
        e.released(pod("p2", "u2", false), &cache);
        assert_eq!(names(&e, "ns", "r1"), ["p1", "p2"]);
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u1", true)));
        assert_eq!(
            names(&e, "ns", "r1"),
            ["p1", "p2"],
            "an event from before the release does not settle it"
        );
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u1", false)));
        watch.deliver(&e, watcher::Event::Delete(pod("p2", "u2", true)));
        assert!(names(&e, "ns", "r1").is_empty());
    }

    /// The release of an ended Pod labels it out of the Pod watch
    /// (`labels::STEP_POD_SELECTOR`), which then sends a delete carrying the
    /// Pod as it was before, finalizer and all: that settles the release, and
    /// no reconcile sees the Pod again. A re-list leaves it out, which
    /// settles a release whose delete the watch missed.
    #[test]
    fn a_pod_released_out_of_the_watch_is_settled_by_its_leaving() {
        let e = Expectations::default();
        let (cache, store, mut watch) = cache();
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u1", true)));
        watch.deliver(&e, watcher::Event::Apply(pod("p2", "u2", true)));
        e.released(pod("p1", "u1", false), &cache);
        e.released(pod("p2", "u2", false), &cache);
        assert_eq!(seen(&e, &cache), ["p1", "p2"]);
        watch.deliver(&e, watcher::Event::Delete(pod("p1", "u1", true)));
        assert!(store.get(&ObjectRef::new("p1").within("ns")).is_none());
        assert_eq!(seen(&e, &cache), ["p2"]);
        // The watch is cut before p2's delete; the re-list leaves p2 out.
        e.created(pod("p3", "u3", true), &cache);
        watch.deliver(&e, watcher::Event::Init);
        watch.deliver(&e, watcher::Event::InitDone);
        assert_eq!(
            names(&e, "ns", "r1"),
            ["p3"],
            "a create the re-list does not show yet still stands"
        );
        assert_eq!(seen(&e, &cache), ["p3"]);
    }

    #[test]
    fn a_pod_of_the_same_name_with_another_uid_settles_the_entry() {
        let e = Expectations::default();
        let (cache, _, mut watch) = cache();
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u1", true)));
        e.released(pod("p1", "u1", false), &cache);
        watch.deliver(&e, watcher::Event::Apply(pod("p1", "u2", true)));
        assert!(names(&e, "ns", "r1").is_empty());
    }

    /// A cached run at a version this process wrote over waits for the
    /// watch; the copy the watch brings (or anyone's newer one) is decided on,
    /// and the writes are forgotten then.
    #[test]
    fn a_cached_run_this_process_wrote_over_is_behind_until_the_watch_brings_a_newer_one() {
        let w = StatusWrites::default();
        assert!(!w.behind("ns", "r1", "7"), "nothing written");
        // A reconcile writes on 7 (giving 8), and its follow-up on 8.
        w.wrote("ns", "r1", "7");
        w.wrote("ns", "r1", "8");
        assert!(w.behind("ns", "r1", "7"));
        assert!(w.behind("ns", "r1", "8"));
        assert!(!w.behind("other", "r1", "7"), "per namespace");
        assert!(!w.behind("ns", "r2", "7"), "per run");
        assert!(
            !w.behind("ns", "r1", "9"),
            "the watch brought the last write"
        );
        assert!(!w.behind("ns", "r1", "7"), "forgotten once caught up");
    }
}
