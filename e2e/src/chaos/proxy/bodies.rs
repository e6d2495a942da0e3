//! What the proxy does to a response body: Pod lists and watches without the
//! hidden Pods, watch streams cut or ended with `410 Gone`, held back while
//! stalled.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};
use hyper::body::Frame;

use super::faults::Fault;
use super::state::State;

pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub(super) type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

pub(super) fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// The ERROR event of a watch whose resourceVersion is too old, as the
/// apiserver sends it (one JSON line of the watch stream).
pub(super) fn gone_event(what: &str) -> Bytes {
    let event = serde_json::json!({
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": format!("faultproxy: too old resource version (injected 410 for {what})"),
            "reason": "Expired",
            "code": 410,
        },
    });
    Bytes::from(format!("{event}\n"))
}

/// A Pod list without the hidden Pods (unparsable bodies pass unchanged).
pub(super) fn without_hidden_items(bytes: Bytes, state: &State) -> Bytes {
    let Ok(mut list) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return bytes;
    };
    if let Some(items) = list
        .get_mut("items")
        .and_then(serde_json::Value::as_array_mut)
    {
        items.retain(|pod| {
            !pod["metadata"]["name"]
                .as_str()
                .is_some_and(|name| state.hidden(name))
        });
    }
    Bytes::from(list.to_string())
}

/// A Pod watch without the events of hidden Pods: the stream is split into
/// its lines (one event each) and a line about a hidden Pod is dropped.
pub(super) fn without_hidden_events(body: ProxyBody, state: Arc<State>) -> ProxyBody {
    let frames = BodyStream::new(body);
    let stream = futures::stream::unfold(
        (frames, Vec::<u8>::new(), state, false),
        |(mut frames, mut pending, state, done)| async move {
            if done {
                return None;
            }
            loop {
                if let Some(end) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    let hidden = serde_json::from_slice::<serde_json::Value>(&line)
                        .ok()
                        .and_then(|e| e["object"]["metadata"]["name"].as_str().map(str::to_owned))
                        .is_some_and(|name| state.hidden(&name));
                    if hidden {
                        continue;
                    }
                    let frame: Result<Frame<Bytes>, BoxError> = Ok(Frame::data(Bytes::from(line)));
                    return Some((frame, (frames, pending, state, false)));
                }
                match frames.next().await {
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => pending.extend_from_slice(&data),
                        Err(other) => return Some((Ok(other), (frames, pending, state, false))),
                    },
                    Some(Err(err)) => return Some((Err(err), (frames, pending, state, true))),
                    None if pending.is_empty() => return None,
                    None => {
                        let rest = Bytes::from(std::mem::take(&mut pending));
                        return Some((Ok(Frame::data(rest)), (frames, pending, state, true)));
                    }
                }
            }
        },
    );
    BodyExt::boxed_unsync(StreamBody::new(stream))
}

/// The watch body, aborted with an error after `after` if faults are still on
/// then (otherwise it streams on until the server ends it).
/// One cut in three ends the stream with an ERROR event `410 Gone` instead.
/// Events are held back while a stall on `path` lasts.
pub(super) fn cut_after(
    body: kube::client::Body,
    after: Duration,
    path: String,
    what: String,
    state: Arc<State>,
) -> ProxyBody {
    struct Cut {
        frames: BodyStream<kube::client::Body>,
        timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
        state: Arc<State>,
        path: String,
        what: String,
        done: bool,
    }
    let cut = Cut {
        frames: BodyStream::new(body),
        timer: Some(Box::pin(tokio::time::sleep(after))),
        state,
        path,
        what,
        done: false,
    };
    let stream = futures::stream::unfold(cut, |mut c| async move {
        if c.done {
            return None;
        }
        loop {
            let frame = match c.timer.as_mut() {
                Some(timer) => {
                    tokio::select! {
                        frame = c.frames.next() => frame,
                        _ = timer.as_mut() => {
                            c.timer = None;
                            if c.state.enabled() {
                                c.done = true;
                                if c.state.with_rng(|rng| rng.below(3) == 0) {
                                    c.state.counters.count(Fault::WatchGone);
                                    let gone = Frame::data(gone_event(&c.what));
                                    return Some((Ok(gone), c));
                                }
                                c.state.counters.count(Fault::WatchCut);
                                let err: BoxError = "faultproxy: watch cut".into();
                                return Some((Err(err), c));
                            }
                            continue;
                        }
                    }
                }
                None => c.frames.next().await,
            };
            c.state.wait_stall(&c.path, true).await;
            return frame.map(|f| (f.map_err(|e| Box::new(e) as BoxError), c));
        }
    });
    BodyExt::boxed_unsync(StreamBody::new(
        stream.map(|f: Result<Frame<Bytes>, BoxError>| f),
    ))
}
