//! The fault-injecting proxy between the operator and the kube-apiserver.
//!
//! ```text
//!   operator ──http://127.0.0.1:<port> (no credentials)──▶ FaultProxy ──https + admin cert──▶ kube-apiserver
//!                                                            │
//!      writes (POST/PUT/PATCH/DELETE, not Events), with probability `write_fault_rate`:
//!        500 / 429 (Retry-After) / 409      answered by the proxy, never forwarded
//!        applied, then 504                   forwarded and applied; the answer is replaced by a 504
//!        applied, then connection dropped    forwarded and applied; the client gets no answer at all
//!      any non-watch response, with probability `delay_rate`: held back up to `max_delay`
//!      watch streams: cut (connection aborted mid-body) at a random moment, or ended
//!        there with an ERROR event `410 Gone` (one cut in three)
//!      watch requests from a resourceVersion, with probability `watch_gone_rate`:
//!        answered at once with an ERROR event `410 Gone` ("too old resource version"),
//!        never forwarded, as the apiserver answers a watch from a compacted version
//! ```
//!
//! Apart from the faults, a test can *stall* traffic on demand
//! ([`FaultProxy::stall`]): hold back, for a while, the requests or the watch
//! events of one resource — a slow link to the Lease, a cache that lags the
//! runs. Stalls are not faults: they are not counted and apply with faults off.
//! Likewise it can *hide* Pods from lists and watches
//! ([`FaultProxy::hide_pods`]), as a cache that lags the API server would,
//! while a read of the one Pod still shows it.
//!
//! It listens on loopback only and forwards with a `kube::Client` built from
//! the admin kubeconfig (TLS and client certificate handled there, its own
//! retries switched off so that no fault is hidden). Faults can be switched
//! off at run time (`set_enabled(false)`), so a chaos run can let the system
//! settle and then judge it. Every fault is counted by kind.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, warn};

use super::rng::Rng;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// What the proxy injects.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Fraction of faultable writes that get one of the write faults.
    pub write_fault_rate: f64,
    /// Fraction of non-watch responses that are held back.
    pub delay_rate: f64,
    /// Longest hold-back of a delayed response.
    pub max_delay: Duration,
    /// A watch stream is cut after a time uniform in this range.
    pub watch_cut_after: (Duration, Duration),
    /// Fraction of watches from a resourceVersion answered `410 Gone` at once.
    pub watch_gone_rate: f64,
    pub seed: u64,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            write_fault_rate: 0.15,
            delay_rate: 0.05,
            max_delay: Duration::from_millis(800),
            watch_cut_after: (Duration::from_secs(2), Duration::from_secs(15)),
            watch_gone_rate: 0.1,
            seed: 1,
        }
    }
}

/// The kinds of injected fault, each counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// 500 InternalError, not forwarded.
    Error500,
    /// 429 TooManyRequests with `Retry-After: 1`, not forwarded.
    Error429,
    /// 409 Conflict, not forwarded.
    Error409,
    /// Forwarded and applied; the client got 504 instead of the answer.
    AppliedThen504,
    /// Forwarded and applied; the connection was dropped without an answer.
    AppliedThenDropped,
    /// The response was held back.
    Delayed,
    /// A watch stream was aborted mid-flight.
    WatchCut,
    /// A watch was answered, or ended, with an ERROR event `410 Gone`.
    WatchGone,
}

const WRITE_FAULTS: [Fault; 5] = [
    Fault::Error500,
    Fault::Error429,
    Fault::Error409,
    Fault::AppliedThen504,
    Fault::AppliedThenDropped,
];

/// Counters of what the proxy did.
#[derive(Debug, Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub writes: AtomicU64,
    pub error_500: AtomicU64,
    pub error_429: AtomicU64,
    pub error_409: AtomicU64,
    pub applied_then_504: AtomicU64,
    pub applied_then_dropped: AtomicU64,
    pub delayed: AtomicU64,
    pub watch_cut: AtomicU64,
    pub watch_gone: AtomicU64,
    pub upstream_errors: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub requests: u64,
    pub writes: u64,
    pub error_500: u64,
    pub error_429: u64,
    pub error_409: u64,
    pub applied_then_504: u64,
    pub applied_then_dropped: u64,
    pub delayed: u64,
    pub watch_cut: u64,
    pub watch_gone: u64,
    pub upstream_errors: u64,
}

impl FaultCounts {
    /// Every injected fault (upstream errors are not injected and not counted).
    pub fn total(&self) -> u64 {
        self.error_500
            + self.error_429
            + self.error_409
            + self.applied_then_504
            + self.applied_then_dropped
            + self.delayed
            + self.watch_cut
            + self.watch_gone
    }
}

impl std::fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "requests={} writes={} err500={} err429={} err409={} applied_504={} applied_dropped={} delayed={} watch_cut={} watch_gone={} upstream_errors={}",
            self.requests,
            self.writes,
            self.error_500,
            self.error_429,
            self.error_409,
            self.applied_then_504,
            self.applied_then_dropped,
            self.delayed,
            self.watch_cut,
            self.watch_gone,
            self.upstream_errors
        )
    }
}

impl Counters {
    fn count(&self, fault: Fault) {
        let c = match fault {
            Fault::Error500 => &self.error_500,
            Fault::Error429 => &self.error_429,
            Fault::Error409 => &self.error_409,
            Fault::AppliedThen504 => &self.applied_then_504,
            Fault::AppliedThenDropped => &self.applied_then_dropped,
            Fault::Delayed => &self.delayed,
            Fault::WatchCut => &self.watch_cut,
            Fault::WatchGone => &self.watch_gone,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> FaultCounts {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FaultCounts {
            requests: l(&self.requests),
            writes: l(&self.writes),
            error_500: l(&self.error_500),
            error_429: l(&self.error_429),
            error_409: l(&self.error_409),
            applied_then_504: l(&self.applied_then_504),
            applied_then_dropped: l(&self.applied_then_dropped),
            delayed: l(&self.delayed),
            watch_cut: l(&self.watch_cut),
            watch_gone: l(&self.watch_gone),
            upstream_errors: l(&self.upstream_errors),
        }
    }
}

/// Traffic held back until `until`: requests whose path contains
/// `fragment` (unless `watches_only`), and the events of such watches.
struct Stall {
    fragment: String,
    watches_only: bool,
    until: tokio::time::Instant,
}

/// Pods whose name contains `fragment` left out of Pod lists and watch
/// events until `until`.
struct Hide {
    fragment: String,
    until: tokio::time::Instant,
}

struct State {
    upstream: kube::Client,
    config: ProxyConfig,
    enabled: AtomicBool,
    counters: Counters,
    rng: Mutex<Rng>,
    stalls: Mutex<Vec<Stall>>,
    hidden: Mutex<Vec<Hide>>,
}

impl State {
    fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    fn with_rng<T>(&self, f: impl FnOnce(&mut Rng) -> T) -> T {
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut rng)
    }

    /// Until when traffic on `path` is held back: a request (`event: false`)
    /// or an event of a watch (`event: true`).
    fn stalled_until(&self, path: &str, event: bool) -> Option<tokio::time::Instant> {
        let stalls = self.stalls.lock().unwrap_or_else(|p| p.into_inner());
        stalls
            .iter()
            .filter(|s| path.contains(&s.fragment) && (event || !s.watches_only))
            .map(|s| s.until)
            .max()
    }

    /// Whether a Pod of this name is hidden from lists and watches now.
    fn hidden(&self, name: &str) -> bool {
        let now = tokio::time::Instant::now();
        let hidden = self.hidden.lock().unwrap_or_else(|p| p.into_inner());
        hidden
            .iter()
            .any(|h| h.until > now && name.contains(&h.fragment))
    }

    fn hiding(&self) -> bool {
        let now = tokio::time::Instant::now();
        let hidden = self.hidden.lock().unwrap_or_else(|p| p.into_inner());
        hidden.iter().any(|h| h.until > now)
    }

    /// Stalls may be shortened while traffic waits: look again every 50 ms.
    async fn wait_stall(&self, path: &str, event: bool) {
        loop {
            let now = tokio::time::Instant::now();
            match self.stalled_until(path, event) {
                Some(until) if until > now => {
                    tokio::time::sleep((until - now).min(Duration::from_millis(50))).await;
                }
                _ => return,
            }
        }
    }
}

/// A running proxy; stops when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// Listens on `listen` (loopback) and forwards to `upstream`. Faults start enabled.
    pub async fn start(
        upstream: kube::Client,
        listen: SocketAddr,
        config: ProxyConfig,
    ) -> std::io::Result<FaultProxy> {
        assert!(
            listen.ip().is_loopback(),
            "the fault proxy listens on loopback only"
        );
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            upstream,
            rng: Mutex::new(Rng::new(config.seed)),
            config,
            enabled: AtomicBool::new(true),
            counters: Counters::default(),
            stalls: Mutex::new(Vec::new()),
            hidden: Mutex::new(Vec::new()),
        });
        let task = tokio::spawn(accept_loop(listener, state.clone()));
        Ok(FaultProxy { addr, state, task })
    }

    /// A proxy in front of the e2e plane on a free loopback port, with fault
    /// injection off (stalls still work): for tests that hold back traffic
    /// on demand.
    pub async fn quiet() -> FaultProxy {
        let upstream = upstream_client().await.expect("the proxy's client");
        let p = FaultProxy::start(
            upstream,
            "127.0.0.1:0".parse().unwrap(),
            ProxyConfig::default(),
        )
        .await
        .expect("starting a proxy");
        p.set_enabled(false);
        p
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Switches fault injection on or off; forwarding goes on either way.
    pub fn set_enabled(&self, enabled: bool) {
        self.state.enabled.store(enabled, Ordering::Relaxed);
    }

    pub fn counts(&self) -> FaultCounts {
        self.state.counters.snapshot()
    }

    /// Holds back traffic whose path contains `fragment` for `duration` from
    /// now: every such request (before it is forwarded) and every event of
    /// such a watch, or with `watches_only` only the watch events. What is
    /// held back is delivered, in order, when the stall ends.
    pub fn stall(&self, fragment: &str, watches_only: bool, duration: Duration) {
        let mut stalls = self.state.stalls.lock().unwrap_or_else(|p| p.into_inner());
        let now = tokio::time::Instant::now();
        stalls.retain(|s| s.until > now);
        stalls.push(Stall {
            fragment: fragment.to_owned(),
            watches_only,
            until: now + duration,
        });
    }

    /// Leaves the Pods whose name contains `fragment` out of every Pod list
    /// and Pod watch for `duration` from now (watches started meanwhile stay
    /// filtered until then), as a cache behind the API server would show
    /// them; a read of the one Pod is answered as usual.
    pub fn hide_pods(&self, fragment: &str, duration: Duration) {
        let mut hidden = self.state.hidden.lock().unwrap_or_else(|p| p.into_inner());
        hidden.push(Hide {
            fragment: fragment.to_owned(),
            until: tokio::time::Instant::now() + duration,
        });
    }

    /// Every stall ends `after` from now at the latest.
    pub fn end_stalls_in(&self, after: Duration) {
        let mut stalls = self.state.stalls.lock().unwrap_or_else(|p| p.into_inner());
        let end = tokio::time::Instant::now() + after;
        for s in stalls.iter_mut() {
            s.until = s.until.min(end);
        }
    }

    /// Writes a kubeconfig that points a client at the proxy (plain HTTP, no credentials).
    pub fn write_kubeconfig(&self, path: &Path, namespace: &str) -> std::io::Result<()> {
        std::fs::write(path, proxy_kubeconfig(self.addr, namespace))
    }
}

/// The client the proxy forwards with: the e2e kubeconfig's cluster and
/// credentials (`KUBECONFIG`, else `$AGENTRUN_E2E_DIR/kubeconfig`), with kube's
/// own retries of 429/503/504 switched off so that no fault is hidden.
pub async fn upstream_client() -> Result<kube::Client, String> {
    let mut config = crate::support::env::load_config().await?;
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| format!("building the upstream client: {e}"))
}

/// A kubeconfig for a client of the proxy at `addr`.
pub fn proxy_kubeconfig(addr: SocketAddr, namespace: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: faultproxy\n  cluster:\n    server: http://{addr}\nusers:\n- name: faultproxy\n  user: {{}}\ncontexts:\n- name: faultproxy\n  context:\n    cluster: faultproxy\n    user: faultproxy\n    namespace: {namespace}\ncurrent-context: faultproxy\n"
    )
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(err) => {
                warn!(error = %err, "faultproxy: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(req, state.clone()));
            if let Err(err) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(error = %err, "faultproxy: connection ended");
            }
        });
    }
}

fn is_watch(req: &Request<Incoming>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

/// A watch that resumes from a resourceVersion (not `0`, which means "any"):
/// the kind the apiserver answers `410 Gone` when that version is compacted.
fn watches_from_a_version(query: Option<&str>) -> bool {
    query.is_some_and(|q| {
        q.split('&').any(|kv| {
            kv.strip_prefix("resourceVersion=")
                .is_some_and(|v| !v.is_empty() && v != "0")
        })
    })
}

/// The ERROR event of a watch whose resourceVersion is too old, as the
/// apiserver sends it (one JSON line of the watch stream).
fn gone_event(what: &str) -> Bytes {
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

fn is_write(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

/// Events are best effort for the operator; faulting them proves nothing.
fn is_event(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').collect();
    path.starts_with("/apis/events.k8s.io/")
        || matches!(
            segments.as_slice(),
            ["", "api", "v1", "namespaces", _, "events", ..]
        )
}

fn status_response(code: StatusCode, reason: &str, message: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("faultproxy: {message}"),
        "reason": reason,
        "code": code.as_u16(),
    })
    .to_string();
    let mut resp = Response::new(full(Bytes::from(body)));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    if code == StatusCode::TOO_MANY_REQUESTS {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
    }
    resp
}

fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Headers that belong to one hop and must not be forwarded.
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if matches!(
            name.as_str(),
            "host"
                | "connection"
                | "keep-alive"
                | "transfer-encoding"
                | "content-length"
                | "te"
                | "trailer"
                | "upgrade"
                | "proxy-connection"
        ) {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
) -> Result<Response<ProxyBody>, BoxError> {
    let counters = &state.counters;
    counters.requests.fetch_add(1, Ordering::Relaxed);
    let watch = is_watch(&req);
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let faultable = is_write(&method) && !is_event(&path);
    if is_write(&method) {
        counters.writes.fetch_add(1, Ordering::Relaxed);
    }
    let fault = if faultable && state.enabled() {
        state.with_rng(|rng| {
            rng.chance(state.config.write_fault_rate)
                .then(|| *rng.pick(&WRITE_FAULTS))
        })
    } else {
        None
    };
    let what = format!("{method} {path}");
    if !watch {
        state.wait_stall(&path, false).await;
    }
    if watch
        && state.enabled()
        && watches_from_a_version(req.uri().query())
        && state.with_rng(|rng| rng.chance(state.config.watch_gone_rate))
    {
        counters.count(Fault::WatchGone);
        let mut resp = Response::new(full(gone_event(&what)));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        return Ok(resp);
    }
    match fault {
        Some(Fault::Error500) => {
            counters.count(Fault::Error500);
            return Ok(status_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                &format!("injected 500 for {what}"),
            ));
        }
        Some(Fault::Error429) => {
            counters.count(Fault::Error429);
            return Ok(status_response(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                &format!("injected 429 for {what}"),
            ));
        }
        Some(Fault::Error409) => {
            counters.count(Fault::Error409);
            return Ok(status_response(
                StatusCode::CONFLICT,
                "Conflict",
                &format!("injected 409 for {what}"),
            ));
        }
        _ => {}
    }

    // Forward.
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let uri = parts
        .uri
        .path_and_query()
        .map(|pq| pq.as_str().to_owned())
        .unwrap_or_else(|| "/".into());
    let mut upstream_req = Request::builder().method(parts.method).uri(uri);
    if let Some(headers) = upstream_req.headers_mut() {
        copy_headers(&parts.headers, headers);
    }
    let upstream_req = upstream_req.body(kube::client::Body::from(body.to_vec()))?;
    let resp = match state.upstream.send(upstream_req).await {
        Ok(resp) => resp,
        Err(err) => {
            counters.upstream_errors.fetch_add(1, Ordering::Relaxed);
            return Ok(status_response(
                StatusCode::BAD_GATEWAY,
                "InternalError",
                &format!("upstream error for {what}: {err}"),
            ));
        }
    };

    match fault {
        Some(Fault::AppliedThen504) => {
            // Wait for the whole answer, so the write has certainly been applied.
            let _ = resp.into_body().collect().await;
            counters.count(Fault::AppliedThen504);
            return Ok(status_response(
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                &format!("injected timeout after the server applied {what}"),
            ));
        }
        Some(Fault::AppliedThenDropped) => {
            let _ = resp.into_body().collect().await;
            counters.count(Fault::AppliedThenDropped);
            // An error from the service makes hyper close the connection unanswered.
            return Err(format!("faultproxy: dropped the answer to {what}").into());
        }
        _ => {}
    }

    let (parts, body) = resp.into_parts();
    let mut out = Response::builder().status(parts.status);
    if let Some(headers) = out.headers_mut() {
        copy_headers(&parts.headers, headers);
    }
    let pod_collection = method == Method::GET && is_pod_collection(&path);
    if pod_collection && !watch && state.hiding() {
        let bytes = body.collect().await?.to_bytes();
        return Ok(out.body(full(without_hidden_items(bytes, &state)))?);
    }
    let body: ProxyBody = if watch {
        let after = state.with_rng(|rng| {
            rng.duration(
                state.config.watch_cut_after.0,
                state.config.watch_cut_after.1,
            )
        });
        let filter = pod_collection && state.hiding();
        let body = cut_after(body, after, path, what, state.clone());
        if filter {
            without_hidden_events(body, state.clone())
        } else {
            body
        }
    } else {
        let delay = state.enabled() && state.with_rng(|rng| rng.chance(state.config.delay_rate));
        if delay {
            let d = state.with_rng(|rng| rng.duration(Duration::ZERO, state.config.max_delay));
            counters.count(Fault::Delayed);
            tokio::time::sleep(d).await;
        }
        body.map_err(|e| Box::new(e) as BoxError).boxed_unsync()
    };
    Ok(out.body(body)?)
}

/// A list or watch of Pods: `/api/v1/pods` or `/api/v1/namespaces/NS/pods`.
fn is_pod_collection(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').collect();
    matches!(
        segments.as_slice(),
        ["", "api", "v1", "pods"] | ["", "api", "v1", "namespaces", _, "pods"]
    )
}

/// A Pod list without the hidden Pods (unparsable bodies pass unchanged).
fn without_hidden_items(bytes: Bytes, state: &State) -> Bytes {
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
fn without_hidden_events(body: ProxyBody, state: Arc<State>) -> ProxyBody {
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
fn cut_after(
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn kubeconfig_points_at_the_proxy_without_credentials() {
        let text = proxy_kubeconfig("127.0.0.1:4000".parse().unwrap(), "ns");
        let kc: kube::config::Kubeconfig = serde_yaml::from_str(&text).expect("valid kubeconfig");
        let cluster = kc.clusters[0].cluster.as_ref().expect("cluster");
        assert_eq!(cluster.server.as_deref(), Some("http://127.0.0.1:4000"));
        assert!(
            kc.auth_infos[0]
                .auth_info
                .as_ref()
                .is_none_or(|a| a.client_certificate.is_none())
        );
    }
}
