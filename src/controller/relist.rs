//! The objects a watch's events name, each handed on once the cache holds it.
//!
//! A watch that is cut (an API server restart, the AgentRun CRD replaced
//! under the operator, which tears down the storage the watch was served
//! from) and cannot resume from its last version (410 Gone) lists again.
//! The reflector collects that list aside and swaps it into its store only
//! when the list ends (`InitDone`). kube-runtime's `touched_objects` hands on
//! each listed object as it comes, before the swap, so a reconcile could
//! start while the store still held the state from before the watch was
//! cut: a run created in the gap was not there, the reconcile took it for
//! deleted, and nothing named the run again until it changed. That run
//! never started; the operator seemed blind to it. Here a list's objects are
//! held until it ends and handed on after the swap, so every reconcile they
//! start finds what was listed. Events after the list go on at once, as
//! before: the reflector stores each one before it is handed on.
//!
//! An object deleted while the watch was down is not in the list, and no
//! watch event says it went. The store held it before the list; once the
//! list is in, it is handed on too (the copy from before), as a delete event
//! would have been, so the run it names is looked at and finds it gone.

use std::hash::Hash;
use std::sync::Arc;

use futures::{Stream, StreamExt, future};
use kube::Resource;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

pub(super) trait CachedObjects<K>:
    Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Sized
where
    K: Resource + Clone + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    /// The object of each event, a list's once the list has ended and
    /// `store` (the reflector's, which this stream has passed) holds it, and
    /// then those the list no longer has; errors pass through (the watch
    /// lists again after its backoff). A list is held as references, not as
    /// a second copy of what it listed.
    fn cached_objects(self, store: Store<K>) -> impl Stream<Item = Result<Arc<K>, watcher::Error>> {
        self.scan(Relist::default(), move |relist: &mut Relist<K>, event| {
            let out = match event {
                Ok(watcher::Event::Apply(obj) | watcher::Event::Delete(obj)) => {
                    vec![Ok(Arc::new(obj))]
                }
                // A list that failed part way is listed again from the start.
                Ok(watcher::Event::Init) => {
                    relist.listed.clear();
                    relist.before = store.state();
                    Vec::new()
                }
                Ok(watcher::Event::InitApply(obj)) => {
                    relist.listed.push(ObjectRef::from_obj(&obj));
                    Vec::new()
                }
                Ok(watcher::Event::InitDone) => {
                    let listed = relist.listed.drain(..).filter_map(|r| store.get(&r));
                    let gone = std::mem::take(&mut relist.before)
                        .into_iter()
                        .filter(|obj| store.get(&ObjectRef::from_obj(&**obj)).is_none());
                    listed.chain(gone).map(Ok).collect()
                }
                Err(err) => vec![Err(err)],
            };
            future::ready(Some(futures::stream::iter(out)))
        })
        .flatten()
    }
}

/// A list under way: what it has listed so far, and what the store held
/// when it began.
struct Relist<K: Resource> {
    listed: Vec<ObjectRef<K>>,
    before: Vec<Arc<K>>,
}

impl<K: Resource> Default for Relist<K> {
    fn default() -> Self {
        Relist {
            listed: Vec::new(),
            before: Vec::new(),
        }
    }
}

impl<K, S> CachedObjects<K> for S
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
    K: Resource + Clone + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use kube::runtime::WatchStreamExt;
    use kube::runtime::reflector::{self, ObjectRef};
    use watcher::Event;

    use super::*;

    fn object(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    /// A watch lists, sees "b" created, is cut and lists again, now with
    /// "c", which was created while it was down. Each object is handed on
    /// only once the store holds it (a deleted one once it is gone); with
    /// `touched_objects`, "c" was handed on while the store still held the
    /// first list, and a reconcile of "c" would have found nothing. Cut once
    /// more, the watch lists again without "a", deleted meanwhile: "a" is
    /// handed on once the store no longer holds it, as a delete would be.
    #[tokio::test]
    async fn a_listed_object_is_handed_on_once_the_store_holds_it() {
        let (store, writer) = reflector::store::<ConfigMap>();
        let events = futures::stream::iter([
            Ok(Event::Init),
            Ok(Event::InitApply(object("a"))),
            Ok(Event::InitDone),
            Ok(Event::Apply(object("b"))),
            Err(watcher::Error::NoResourceVersion),
            Ok(Event::Init),
            Ok(Event::InitApply(object("a"))),
            // The list fails part way and starts again.
            Err(watcher::Error::NoResourceVersion),
            Ok(Event::Init),
            Ok(Event::InitApply(object("a"))),
            Ok(Event::InitApply(object("b"))),
            Ok(Event::InitApply(object("c"))),
            Ok(Event::InitDone),
            Ok(Event::Delete(object("b"))),
            // Cut again; "a" is deleted meanwhile.
            Err(watcher::Error::NoResourceVersion),
            Ok(Event::Init),
            Ok(Event::InitApply(object("c"))),
            Ok(Event::InitDone),
        ]);
        let mut objects = events.reflect(writer).cached_objects(store.clone()).boxed();
        // Each object handed on, and whether the store held it then.
        let mut seen = Vec::new();
        let mut errors = 0;
        while let Some(item) = objects.next().await {
            match item {
                Ok(obj) => seen.push((
                    obj.metadata.name.clone().unwrap(),
                    store.get(&ObjectRef::from_obj(&obj)).is_some(),
                )),
                Err(_) => errors += 1,
            }
        }
        let held = |name: &str, cached: bool| (name.to_owned(), cached);
        assert_eq!(
            seen,
            [
                held("a", true),
                held("b", true),
                held("a", true),
                held("b", true),
                held("c", true),
                held("b", false),
                held("c", true),
                held("a", false),
            ]
        );
        assert_eq!(errors, 3);
    }
}
