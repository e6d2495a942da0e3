//! Publishing the engine's Events off the reconcile path. An Event is a
//! record for people, not part of a checkpoint: a step's hand-off never waits
//! for one, and when the API server is too slow to keep up, Events are shed
//! rather than queued without bound.
//!
//! The Events are those kube-runtime's `Recorder` publishes (events.k8s.io/v1,
//! the same name, fields and series), by a recorder of its own here: kube's
//! keeps every Event it published for six minutes, whole and with a copy of
//! its key, to fold repeats into a series, and scans them all on every
//! publish. At 1,000 runs that was 20,000 cached Events, the largest share of
//! the operator's heap (docs/performance-history.md, "Where the memory goes"). This
//! one keeps a digest of the key and what a repeat needs to rebuild the
//! first Event: when it was published and, only when it differs from the
//! action, its note.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, Patch, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::debug;

use crate::labels;

/// Events waiting to be published before new ones are dropped.
const BACKLOG: usize = 4096;
/// Events published at once.
const CONCURRENT: usize = 8;
/// How long a published Event is remembered for folding repeats into its
/// series (kube-runtime's and client-go's six minutes).
const CACHE_TTL: SignedDuration = SignedDuration::from_mins(6);
/// How often remembered Events past the TTL are swept out. An Event past the
/// TTL is never folded into, swept or not.
const SWEEP_EVERY: SignedDuration = SignedDuration::from_secs(10);

/// A handle that queues Events for the publisher task.
#[derive(Clone)]
pub struct EventSink(mpsc::Sender<(Event, ObjectReference)>);

impl EventSink {
    /// Starts the publisher task and returns its sink.
    pub fn spawn(client: Client, reporter: Reporter) -> EventSink {
        let recorder = Recorder::new(client, reporter);
        let (tx, rx) = mpsc::channel::<(Event, ObjectReference)>(BACKLOG);
        tokio::spawn(async move {
            tokio_stream_from(rx)
                .for_each_concurrent(CONCURRENT, |(event, regarding)| {
                    let recorder = recorder.clone();
                    async move {
                        if let Err(err) = recorder.publish(&event, &regarding).await {
                            debug!(error = %err, reason = %event.reason, "publishing event failed");
                        }
                    }
                })
                .await;
        });
        EventSink(tx)
    }

    /// Queues an Event; drops it when the backlog is full.
    pub fn publish(&self, event: Event, regarding: ObjectReference) {
        if let Err(err) = self.0.try_send((event, regarding)) {
            debug!(error = %err, "event backlog full; dropping an event");
        }
    }
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// SHA-256 of an Event's identity: type, action, reason, reporter and every
/// field of the regarding and related references (kube's `EventKey`).
type Key = [u8; 32];

/// What a published Event leaves behind.
#[derive(Clone, Debug, PartialEq)]
struct Published {
    /// Its `eventTime`, which also names it.
    at: Timestamp,
    /// Its note, when it is not the action (it usually is).
    note: Note,
    /// Its series, once it was repeated: count and last observation.
    series: Option<(i32, Timestamp)>,
}

#[derive(Clone, Debug, PartialEq)]
enum Note {
    None,
    SameAsAction,
    Text(Box<str>),
}

impl Note {
    fn of(event: &Event) -> Note {
        match event.note.as_deref() {
            None => Note::None,
            Some(n) if n == event.action => Note::SameAsAction,
            Some(n) => Note::Text(n.into()),
        }
    }

    fn text(&self, event: &Event) -> Option<String> {
        match self {
            Note::None => None,
            Note::SameAsAction => Some(event.action.clone()),
            Note::Text(n) => Some(n.to_string()),
        }
    }
}

impl Published {
    fn last_seen(&self) -> Timestamp {
        self.series.map_or(self.at, |(_, last)| last)
    }
}

#[derive(Default)]
struct Cache {
    published: HashMap<Key, Published>,
    swept: Option<Timestamp>,
}

/// Publishes Events as kube-runtime's `Recorder` does: a new Event is
/// created; a repeat (same key within the TTL) patches the first one's
/// series, resending the first Event with the series set.
#[derive(Clone)]
struct Recorder {
    client: Client,
    reporter: Arc<Reporter>,
    cache: Arc<Mutex<Cache>>,
}

impl Recorder {
    fn new(client: Client, reporter: Reporter) -> Recorder {
        Recorder {
            client,
            reporter: Arc::new(reporter),
            cache: Arc::default(),
        }
    }

    async fn publish(&self, ev: &Event, regarding: &ObjectReference) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = key(&self.reporter, ev, regarding);
        let earlier = {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if cache.swept.is_none_or(|t| t + SWEEP_EVERY <= now) {
                cache
                    .published
                    .retain(|_, p| p.last_seen() + CACHE_TTL > now);
                cache.swept = Some(now);
            }
            cache
                .published
                .get(&key)
                .filter(|p| p.last_seen() + CACHE_TTL > now)
                .cloned()
        };
        let published = match earlier {
            Some(first) => Published {
                series: Some((first.series.map_or(2, |(count, _)| count + 1), now)),
                ..first
            },
            None => Published {
                at: now,
                note: Note::of(ev),
                series: None,
            },
        };
        let event = k8s_event(&self.reporter, ev, regarding, &published);
        let events: Api<K8sEvent> = Api::namespaced(
            self.client.clone(),
            regarding.namespace.as_deref().unwrap_or("default"),
        );
        if event.series.is_some() {
            let name = event.metadata.name.as_deref().unwrap_or_default();
            events
                .patch(name, &super::patch::patch_params(), &Patch::Merge(&event))
                .await?;
        } else {
            let params = PostParams {
                field_manager: Some(labels::FIELD_MANAGER.into()),
                ..Default::default()
            };
            events.create(&params, &event).await?;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.published.insert(key, published);
        Ok(())
    }
}

fn key(reporter: &Reporter, ev: &Event, regarding: &ObjectReference) -> Key {
    let mut h = Sha256::new();
    // Every field length-prefixed and every option tagged: no two keys
    // encode alike.
    let mut field = |s: Option<&str>| match s {
        None => h.update([0]),
        Some(s) => {
            h.update([1]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
    };
    field(Some(match ev.type_ {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    }));
    field(Some(&ev.action));
    field(Some(&ev.reason));
    field(Some(&reporter.controller));
    field(reporter.instance.as_deref());
    for r in [Some(regarding), ev.secondary.as_ref()] {
        match r {
            None => field(None),
            Some(r) => {
                field(Some(""));
                field(r.api_version.as_deref());
                field(r.kind.as_deref());
                field(r.name.as_deref());
                field(r.namespace.as_deref());
                field(r.uid.as_deref());
                field(r.resource_version.as_deref());
                field(r.field_path.as_deref());
            }
        }
    }
    h.finalize().into()
}

/// The Event kube-runtime's `Recorder` sends: for a repeat, the first Event
/// (its name, time and note) with the series set.
fn k8s_event(
    reporter: &Reporter,
    ev: &Event,
    regarding: &ObjectReference,
    published: &Published,
) -> K8sEvent {
    K8sEvent {
        action: Some(ev.action.clone()),
        reason: Some(ev.reason.clone()),
        event_time: Some(MicroTime(published.at)),
        regarding: Some(regarding.clone()),
        note: published.note.text(ev),
        metadata: ObjectMeta {
            namespace: regarding.namespace.clone(),
            name: Some(format!(
                "{}.{:x}",
                regarding.name.as_ref().unwrap_or(&reporter.controller),
                published.at.as_nanosecond()
            )),
            ..Default::default()
        },
        reporting_controller: Some(reporter.controller.clone()),
        reporting_instance: Some(
            reporter
                .instance
                .clone()
                .unwrap_or_else(|| reporter.controller.clone()),
        ),
        series: published.series.map(|(count, last)| EventSeries {
            count,
            last_observed_time: MicroTime(last),
        }),
        type_: Some(
            match ev.type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            }
            .into(),
        ),
        related: ev.secondary.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reporter() -> Reporter {
        Reporter {
            controller: "agentrun-operator".into(),
            instance: Some("op-0".into()),
        }
    }

    fn run(resource_version: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("agentrun.dev/v1alpha1".into()),
            kind: Some("AgentRun".into()),
            name: Some("refund-4711".into()),
            namespace: Some("shop".into()),
            uid: Some("0c5e9b2d".into()),
            resource_version: Some(resource_version.into()),
            field_path: None,
        }
    }

    fn event(action: &str, note: Option<&str>) -> Event {
        Event {
            type_: EventType::Normal,
            reason: "StepStarted".into(),
            note: note.map(Into::into),
            action: action.into(),
            secondary: None,
        }
    }

    #[test]
    fn the_key_is_every_field_of_kube_runtimes_event_key_and_nothing_else() {
        let r = reporter();
        let base = key(&r, &event("step lookup started", None), &run("7"));
        assert_eq!(
            base,
            key(&r, &event("step lookup started", Some("other")), &run("7")),
            "not the note"
        );
        assert_ne!(
            base,
            key(&r, &event("step lookup started", None), &run("8")),
            "the resourceVersion"
        );
        assert_ne!(
            base,
            key(&r, &event("step refund started", None), &run("7")),
            "the action"
        );
        let mut warning = event("step lookup started", None);
        warning.type_ = EventType::Warning;
        assert_ne!(base, key(&r, &warning, &run("7")), "the type");
        let mut related = event("step lookup started", None);
        related.secondary = Some(run("7"));
        assert_ne!(base, key(&r, &related, &run("7")), "the related object");
        let other = Reporter {
            instance: None,
            ..reporter()
        };
        assert_ne!(
            base,
            key(&other, &event("step lookup started", None), &run("7")),
            "the reporter"
        );
        // Length-prefixed: moving a character from one field to the next is another key.
        let mut a = event("ab", None);
        a.reason = "c".into();
        let mut b = event("a", None);
        b.reason = "bc".into();
        assert_ne!(key(&r, &a, &run("7")), key(&r, &b, &run("7")));
    }

    #[test]
    fn a_remembered_event_is_a_hundred_bytes_or_so_not_a_kilobyte() {
        // kube-runtime's cache entry (its key and the whole Event) is 1,080
        // bytes before any of its strings.
        assert!(std::mem::size_of::<(Key, Published)>() <= 128);
    }

    #[test]
    fn a_new_event_is_what_kube_runtimes_recorder_creates() {
        let at: Timestamp = "2026-12-02T09:14:03.123456789Z".parse().unwrap();
        let ev = event("step lookup started", Some("step lookup started"));
        let published = Published {
            at,
            note: Note::of(&ev),
            series: None,
        };
        assert_eq!(published.note, Note::SameAsAction, "no copy of the note");
        let sent = k8s_event(&reporter(), &ev, &run("7"), &published);
        assert_eq!(
            serde_json::to_value(&sent).unwrap(),
            serde_json::json!({
                "action": "step lookup started",
                "apiVersion": "events.k8s.io/v1",
                "eventTime": "2026-12-02T09:14:03.123456Z",
                "kind": "Event",
                "metadata": {"name": "refund-4711.18ed64f818eb9b15", "namespace": "shop"},
                "note": "step lookup started",
                "reason": "StepStarted",
                "regarding": {
                    "apiVersion": "agentrun.dev/v1alpha1",
                    "kind": "AgentRun",
                    "name": "refund-4711",
                    "namespace": "shop",
                    "resourceVersion": "7",
                    "uid": "0c5e9b2d"
                },
                "reportingController": "agentrun-operator",
                "reportingInstance": "op-0",
                "type": "Normal"
            })
        );
    }

    #[test]
    fn a_repeat_resends_the_first_event_with_its_series() {
        let first_at: Timestamp = "2026-12-02T09:14:03Z".parse().unwrap();
        let again_at: Timestamp = "2026-12-02T09:15:00Z".parse().unwrap();
        let first = event("step lookup started", Some("the first note"));
        let published = Published {
            at: first_at,
            note: Note::of(&first),
            series: None,
        };
        // The note is not part of the key: the repeat resends the first one.
        let again = event("step lookup started", Some("a later note"));
        let repeat = Published {
            series: Some((2, again_at)),
            ..published.clone()
        };
        let created = k8s_event(&reporter(), &first, &run("7"), &published);
        let patched = k8s_event(&reporter(), &again, &run("7"), &repeat);
        assert_eq!(patched.metadata.name, created.metadata.name);
        assert_eq!(patched.event_time, created.event_time);
        assert_eq!(patched.note.as_deref(), Some("the first note"));
        assert_eq!(
            patched.series,
            Some(EventSeries {
                count: 2,
                last_observed_time: MicroTime(again_at),
            })
        );
        assert_eq!(
            K8sEvent {
                series: None,
                ..patched
            },
            created,
            "otherwise the first Event"
        );
    }
}
