//! Publishing the engine's Events off the reconcile path. An Event is a
//! record for people, not part of a checkpoint: a step's hand-off never waits
//! for one, and when the API server is too slow to keep up, Events are shed
//! rather than queued without bound.

use std::hash::{Hash, Hasher};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, Recorder, Reporter};
use tokio::sync::mpsc;
use tracing::debug;

/// Events waiting to be published before new ones are dropped.
const BACKLOG: usize = 4096;
/// Events published at once.
const CONCURRENT: usize = 8;
/// Recorders the Events are spread over, by the object they regard. kube's
/// `Recorder` expires its cache (every Event of the last six minutes, kept to
/// fold repeats into a series) by scanning all of it on every publish, so one
/// recorder for N busy runs costs O(N) per Event; a shard holds 1/SHARDS of
/// them. Repeats regard the same object, so they still meet in one cache.
const SHARDS: usize = 64;

/// A handle that queues Events for the publisher task.
#[derive(Clone)]
pub struct EventSink(mpsc::Sender<(Event, ObjectReference)>);

impl EventSink {
    /// Starts the publisher task and returns its sink.
    pub fn spawn(client: Client, reporter: Reporter) -> EventSink {
        let recorders: Vec<Recorder> = (0..SHARDS)
            .map(|_| Recorder::new(client.clone(), reporter.clone()))
            .collect();
        let (tx, rx) = mpsc::channel::<(Event, ObjectReference)>(BACKLOG);
        tokio::spawn(async move {
            tokio_stream_from(rx)
                .for_each_concurrent(CONCURRENT, |(event, regarding)| {
                    let recorder = recorders[shard(&regarding)].clone();
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

/// The recorder shard of the object an Event regards.
fn shard(regarding: &ObjectReference) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&regarding.namespace, &regarding.name, &regarding.uid).hash(&mut h);
    (h.finish() % SHARDS as u64) as usize
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests {
    use super::{SHARDS, shard};
    use k8s_openapi::api::core::v1::ObjectReference;

    fn run(name: &str) -> ObjectReference {
        ObjectReference {
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        }
    }

    #[test]
    fn events_of_one_run_share_a_shard_and_runs_spread_over_all() {
        assert_eq!(shard(&run("a")), shard(&run("a")));
        let used: std::collections::HashSet<usize> =
            (0..1000).map(|i| shard(&run(&format!("r{i}")))).collect();
        assert_eq!(used.len(), SHARDS, "1,000 runs use every shard");
    }
}
