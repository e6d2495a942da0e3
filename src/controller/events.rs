//! Publishing the engine's Events off the reconcile path. An Event is a
//! record for people, not part of a checkpoint: a step's hand-off never waits
//! for one, and when the API server is too slow to keep up, Events are shed
//! rather than queued without bound.

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, Recorder};
use tokio::sync::mpsc;
use tracing::debug;

/// Events waiting to be published before new ones are dropped.
const BACKLOG: usize = 4096;
/// Events published at once.
const CONCURRENT: usize = 8;

/// A handle that queues Events for the publisher task.
#[derive(Clone)]
pub struct EventSink(mpsc::Sender<(Event, ObjectReference)>);

impl EventSink {
    /// Starts the publisher task and returns its sink.
    pub fn spawn(recorder: Recorder) -> EventSink {
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
