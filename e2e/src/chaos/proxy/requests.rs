//! Which requests the proxy may fault or filter: watches, writes, Events,
//! and lists and watches of Pods.

use http::{Method, Request};
use hyper::body::Incoming;

pub(super) fn is_watch(req: &Request<Incoming>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

/// A watch that resumes from a resourceVersion (not `0`, which means "any"):
/// the kind the apiserver answers `410 Gone` when that version is compacted.
pub(super) fn watches_from_a_version(query: Option<&str>) -> bool {
    query.is_some_and(|q| {
        q.split('&').any(|kv| {
            kv.strip_prefix("resourceVersion=")
                .is_some_and(|v| !v.is_empty() && v != "0")
        })
    })
}

pub(super) fn is_write(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

/// Events are best effort for the operator; faulting them proves nothing.
pub(super) fn is_event(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').collect();
    path.starts_with("/apis/events.k8s.io/")
        || matches!(
            segments.as_slice(),
            ["", "api", "v1", "namespaces", _, "events", ..]
        )
}

/// A list or watch of Pods: `/api/v1/pods` or `/api/v1/namespaces/NS/pods`.
pub(super) fn is_pod_collection(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').collect();
    matches!(
        segments.as_slice(),
        ["", "api", "v1", "pods"] | ["", "api", "v1", "namespaces", _, "pods"]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::proxy::bodies::gone_event;

    #[test]
    fn classifies_requests() {
        assert!(is_write(&Method::PATCH) && is_write(&Method::DELETE));
        assert!(!is_write(&Method::GET));
        assert!(is_event("/apis/events.k8s.io/v1/namespaces/ns/events"));
        assert!(is_event("/api/v1/namespaces/ns/events/e"));
        assert!(!is_event("/api/v1/namespaces/ns/pods/events"));
    }

    #[test]
    fn only_watches_from_a_version_can_be_too_old() {
        assert!(watches_from_a_version(Some(
            "watch=true&resourceVersion=4711&timeoutSeconds=290"
        )));
        assert!(!watches_from_a_version(Some(
            "watch=true&resourceVersion=0"
        )));
        assert!(!watches_from_a_version(Some("watch=true&resourceVersion=")));
        assert!(!watches_from_a_version(Some("watch=true")));
        let line = gone_event("GET /api/v1/pods");
        let event: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(event["type"], "ERROR");
        assert_eq!(event["object"]["code"], 410);
        assert!(line.ends_with(b"\n"));
    }

    #[test]
    fn only_pod_lists_and_watches_are_pod_collections() {
        assert!(is_pod_collection("/api/v1/pods"));
        assert!(is_pod_collection("/api/v1/namespaces/ns/pods"));
        assert!(!is_pod_collection("/api/v1/namespaces/ns/pods/p"));
        assert!(!is_pod_collection("/api/v1/namespaces/ns/pods/p/status"));
        assert!(!is_pod_collection(
            "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentruns"
        ));
    }
}
