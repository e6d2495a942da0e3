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

mod bodies;
mod faults;
mod requests;
mod state;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, warn};

use super::rng::Rng;
use bodies::{
    BoxError, ProxyBody, cut_after, full, gone_event, without_hidden_events, without_hidden_items,
};
use faults::WRITE_FAULTS;
use requests::{is_event, is_pod_collection, is_watch, is_write, watches_from_a_version};
use state::{Hide, Stall, State};

pub use faults::{Counters, Fault, FaultCounts, ProxyConfig};

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

#[cfg(test)]
mod tests {
    use super::*;
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
