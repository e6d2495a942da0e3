//! `kubectl agentrun console`: a web app on 127.0.0.1 that reads and writes
//! the Kubernetes API with the user's own kubeconfig, like `kubectl proxy`:
//! no credentials or state of its own, RBAC and the approver policies apply
//! unchanged.
//!
//! ```text
//!   browser ──HTTP/SSE──▶ console (127.0.0.1) ──watch/patch as the user──▶ kube-apiserver
//!                           ├─ reflector AgentRuns  ─┐
//!                           ├─ reflector Approvals  ─┴─▶ change counter ─▶ SSE streams
//!                           ├─ per run page: its Events and Signals (a list each)
//!                           ├─ history pages: history::Store list / get (read only)
//!                           ├─ decisions: decide::send_decision (the CLI's own write)
//!                           └─ retries: retry::create (the CLI's own fork, as the user)
//! ```
//!
//! `pages`, `run_page`, `history_page` and `timeline` are pure renderings;
//! `sse` turns the watches into live fragments; this module wires the server.

pub mod filter;
pub mod history_page;
pub mod pages;
pub mod retry;
pub mod run_page;
mod sse;
pub mod timeline;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agentrun_operator::api::{AgentRun, Approval, Decision};
use axum::Router;
use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use jiff::Timestamp;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};
use maud::Markup;
use serde::Deserialize;

use crate::commands::{Error, events_of, whoami};
use crate::decide::send_decision;
use crate::identity::Identity;
use agentrun_operator::history::{ApiStore, Store};
use filter::{HistoryFilter, RunFilter};

/// How `kubectl agentrun console` was asked to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// `-n`: one namespace; none: all the user may list, else the context's.
    pub namespace: Option<String>,
    /// 127.0.0.1 unless `--listen` (read-only only).
    pub address: SocketAddr,
    pub open: bool,
    /// No decisions: no forms, no write route.
    pub read_only: bool,
}

/// Where the console looks: one namespace, or all the user may list.
#[derive(Clone, Debug)]
pub enum Scope {
    Namespace(String),
    All,
}

/// What every handler shares: the user's client and identity, the watches'
/// stores, and a counter that moves on every change they see.
pub struct Console {
    client: Client,
    me: Identity,
    scope: Scope,
    /// Where finished runs' records are read (as the user; never written).
    history: Store,
    runs: reflector::Store<AgentRun>,
    approvals: reflector::Store<Approval>,
    changes: tokio::sync::watch::Sender<u64>,
    port: u16,
    /// Decisions are offered (not the read-only view).
    decide: bool,
    /// What each watch last failed with, until it succeeds again.
    trouble: Trouble,
    /// Requests must name 127.0.0.1 or localhost (not when listening wider,
    /// read-only, behind a Service).
    loopback: bool,
}

type Shared = Arc<Console>;

/// A watch's last error by what it watches, shown on every page.
type Trouble = Arc<std::sync::Mutex<std::collections::BTreeMap<&'static str, String>>>;

/// The API server's own message where there is one.
fn said(e: &watcher::Error) -> String {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.message.clone(),
        watcher::Error::WatchError(s) => s.message.clone(),
        other => other.to_string(),
    }
}

fn note(trouble: &Trouble, what: &'static str, error: Option<String>) {
    if let Ok(mut t) = trouble.lock() {
        match error {
            Some(e) => t.insert(what, format!("watching {what}: {e}")),
            None => t.remove(what),
        };
    }
}

impl Console {
    fn frame(&self) -> pages::Frame<'_> {
        let warnings = self
            .trouble
            .lock()
            .map(|t| t.values().cloned().collect())
            .unwrap_or_default();
        pages::Frame {
            me: &self.me,
            warnings,
        }
    }
    fn runs(&self) -> Vec<AgentRun> {
        self.runs.state().iter().map(|r| (**r).clone()).collect()
    }
    fn approvals(&self) -> Vec<Approval> {
        self.approvals
            .state()
            .iter()
            .map(|a| (**a).clone())
            .collect()
    }
    fn namespaces(&self) -> Vec<String> {
        let mut ns: Vec<String> = self
            .runs
            .state()
            .iter()
            .filter_map(|r| r.metadata.namespace.clone())
            .collect();
        ns.sort();
        ns.dedup();
        ns
    }
    fn run(&self, ns: &str, name: &str) -> Option<(AgentRun, Vec<Approval>)> {
        let run = self
            .runs
            .get(&reflector::ObjectRef::new(name).within(ns))
            .map(|r| (*r).clone())?;
        let uid = run.metadata.uid.clone().unwrap_or_default();
        let mut approvals: Vec<Approval> = self
            .approvals()
            .into_iter()
            .filter(|a| a.spec.run_uid == uid)
            .collect();
        approvals.sort_by_key(|a| a.metadata.creation_timestamp.as_ref().map(|t| t.0));
        Some((run, approvals))
    }
}

/// Keeps `writer`'s store in step with `api` (as the user), moves the change
/// counter on every event, and records why the watch fails while it does.
fn spawn_watch<K>(
    api: Api<K>,
    writer: reflector::store::Writer<K>,
    what: &'static str,
    changes: tokio::sync::watch::Sender<u64>,
    trouble: Trouble,
) where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    tokio::spawn(async move {
        let mut s = watcher(api, watcher::Config::default())
            .default_backoff()
            .modify(|o: &mut K| o.meta_mut().managed_fields = None)
            .reflect(writer)
            .boxed();
        while let Some(ev) = s.next().await {
            match ev {
                Ok(_) => {
                    note(&trouble, what, None);
                    changes.send_modify(|n| *n += 1);
                }
                Err(e) => {
                    eprintln!("console: watching {what}: {}", said(&e));
                    note(&trouble, what, Some(said(&e)));
                }
            }
        }
    });
}

/// Starts the watches and serves until interrupted.
pub async fn serve(client: Client, default_namespace: String, opts: Options) -> Result<(), Error> {
    let me = whoami(&client).await?;
    let scope = match opts.namespace.clone() {
        Some(ns) => Scope::Namespace(ns),
        None => {
            // All namespaces when the user may list runs there, else the context's.
            let all = Api::<AgentRun>::all(client.clone());
            match all.list(&kube::api::ListParams::default().limit(1)).await {
                Ok(_) => Scope::All,
                Err(kube::Error::Api(s)) if s.code == 403 => Scope::Namespace(default_namespace),
                Err(e) => return Err(crate::commands::api("listing AgentRuns")(e)),
            }
        }
    };
    let (runs_api, apv_api): (Api<AgentRun>, Api<Approval>) = match &scope {
        Scope::All => (Api::all(client.clone()), Api::all(client.clone())),
        Scope::Namespace(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
    };
    let (changes, _) = tokio::sync::watch::channel(0u64);
    let (runs, runs_w) = reflector::store();
    let (approvals, apv_w) = reflector::store();
    let trouble: Trouble = Arc::default();
    spawn_watch(
        runs_api,
        runs_w,
        "AgentRuns",
        changes.clone(),
        trouble.clone(),
    );
    spawn_watch(
        apv_api,
        apv_w,
        "Approvals",
        changes.clone(),
        trouble.clone(),
    );
    // Loopback unless read-only (clap enforces it too): a console that
    // decides acts with the user's credentials.
    let loopback = opts.address.ip().is_loopback();
    if !loopback && !opts.read_only {
        return Err(Error::Usage("--listen needs --read-only".into()));
    }
    let listener = tokio::net::TcpListener::bind(opts.address).await?;
    let port = listener.local_addr()?.port();
    let history = Store::Api(ApiStore::new(
        client.clone(),
        match &scope {
            Scope::Namespace(ns) => Some(ns.clone()),
            Scope::All => None,
        },
    ));
    let console = Arc::new(Console {
        client,
        me,
        scope: scope.clone(),
        history,
        runs,
        approvals,
        changes,
        port,
        decide: !opts.read_only,
        trouble,
        loopback,
    });
    // Serve once the first lists are in; a watch the API server refuses
    // shows on every page instead of keeping the console from starting.
    let ready = Duration::from_secs(10);
    let _ = tokio::time::timeout(ready, console.runs.wait_until_ready()).await;
    let _ = tokio::time::timeout(ready, console.approvals.wait_until_ready()).await;
    let url = format!("http://{}:{port}/", opts.address.ip());
    let mode = if opts.read_only { ", read-only" } else { "" };
    let what = match &scope {
        Scope::All => "all namespaces".to_owned(),
        Scope::Namespace(ns) => format!("namespace {ns}"),
    };
    println!(
        "console: {url} ({what}, as {}{mode}); Ctrl-C to stop",
        console.me.user
    );
    if opts.open {
        let opener = if cfg!(target_os = "macos") {
            "open"
        } else {
            "xdg-open"
        };
        if let Err(e) = std::process::Command::new(opener).arg(&url).spawn() {
            eprintln!("console: could not open a browser ({opener}: {e}); open {url}");
        }
    }
    axum::serve(listener, router(console))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// The routes; the read-only view has no write route at all.
fn router(console: Shared) -> Router {
    let mut r = Router::new()
        .route("/", get(runs_page))
        .route("/approvals", get(inbox_page))
        .route("/ns/{ns}/runs/{run}", get(run_page))
        .route("/history", get(history_list))
        .route("/ns/{ns}/history/{record}", get(history_record));
    if console.decide {
        r = r.route("/ns/{ns}/approvals/{name}/decide", post(decide));
        r = r
            .route("/ns/{ns}/runs/{run}/retry", post(retry::create))
            .route("/ns/{ns}/runs/{run}/retry/preview", get(retry::preview));
    }
    r.route("/events/runs", get(sse::runs))
        .route("/events/approvals", get(sse::approvals))
        .route("/events/ns/{ns}/runs/{run}", get(sse::run))
        .route("/assets/{file}", get(asset))
        .layer(middleware::from_fn_with_state(console.clone(), guard))
        .layer(middleware::from_fn(hardened))
        .with_state(console)
}

/// The Content-Security-Policy of every response: the console's own
/// scripts, styles and streams only, no plugins, no forms to elsewhere, and
/// no page may frame it (clickjacking a decision).
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// Every response, refusals included, says it may not be framed, sniffed
/// or sent on as a referrer.
async fn hardened(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_FRAME_OPTIONS,
        header::HeaderValue::from_static("DENY"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        header::HeaderValue::from_static("no-referrer"),
    );
    res
}

/// Requests must name this console as their host (no DNS rebinding), and a
/// write must come from its own pages (an htmx request with no foreign
/// Origin): another site in the browser cannot decide as the user.
async fn guard(State(c): State<Shared>, req: Request, next: Next) -> Response {
    if let Err((code, why)) = allowed(&c, req.method(), req.headers()) {
        return (code, why).into_response();
    }
    next.run(req).await
}

fn allowed(
    c: &Console,
    method: &axum::http::Method,
    headers: &HeaderMap,
) -> Result<(), (StatusCode, &'static str)> {
    let h = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    let ours = [
        format!("127.0.0.1:{}", c.port),
        format!("localhost:{}", c.port),
    ];
    if c.loopback && !h(header::HOST).is_some_and(|host| ours.iter().any(|o| o == host)) {
        return Err((
            StatusCode::MISDIRECTED_REQUEST,
            "not this console's address",
        ));
    }
    if method == axum::http::Method::POST {
        let origin_ok =
            h(header::ORIGIN).is_none_or(|o| ours.iter().any(|host| o == format!("http://{host}")));
        let htmx = headers.get("hx-request").is_some_and(|v| v == "true");
        if !origin_ok || !htmx {
            return Err((
                StatusCode::FORBIDDEN,
                "decisions come from the console's own pages",
            ));
        }
    }
    Ok(())
}

fn page(m: Markup) -> Response {
    m.into_response()
}

async fn runs_page(State(c): State<Shared>, Query(f): Query<RunFilter>) -> Response {
    let (runs, approvals) = (c.runs(), c.approvals());
    page(pages::runs_page(
        &c.frame(),
        &runs,
        &approvals,
        &c.namespaces(),
        &f,
        Timestamp::now(),
    ))
}

async fn inbox_page(State(c): State<Shared>) -> Response {
    page(pages::inbox_page(
        &c.frame(),
        &c.approvals(),
        Timestamp::now(),
        c.decide,
    ))
}

async fn run_page(State(c): State<Shared>, Path((ns, name)): Path<(String, String)>) -> Response {
    let Some((run, approvals)) = c.run(&ns, &name) else {
        let what = format!("No AgentRun {name} in namespace {ns} (or you may not list it).");
        return (StatusCode::NOT_FOUND, pages::not_found(&c.frame(), &what)).into_response();
    };
    let mut frame = c.frame();
    let events = events_of(&c.client, &ns, &name).await.unwrap_or_else(|e| {
        frame.warnings.push(e.to_string());
        Vec::new()
    });
    let signals = crate::signal::signals_of(&c.client, &ns, &run).await;
    page(run_page::run_page(
        &frame,
        &run,
        &approvals,
        &signals,
        &events,
        c.decide,
        Timestamp::now(),
    ))
}

/// The records that match the filter, newest first, through the history
/// store as the user; a filter it cannot use or the store's refusal is the
/// page's message, never an error page.
async fn history_list(State(c): State<Shared>, Query(f): Query<HistoryFilter>) -> Response {
    let now = Timestamp::now();
    let all = matches!(c.scope, Scope::All);
    let show = |listed: history_page::Listed<'_>| {
        page(history_page::history_page(
            &c.frame(),
            listed,
            &f,
            all,
            &c.namespaces(),
            now,
        ))
    };
    let mut q = match f.to_query(&c.scope, now) {
        Ok(q) => q,
        Err(why) => return show(history_page::Listed::Trouble(&why)),
    };
    // One more than shown, to say whether there are more.
    let limit = q.limit.unwrap_or(filter::HISTORY_LIMIT);
    q.limit = Some(limit + 1);
    match c.history.list(&q).await {
        Ok(mut records) => {
            let more = records.len() > limit;
            records.truncate(limit);
            show(history_page::Listed::Records {
                records: &records,
                more,
            })
        }
        Err(e) => show(history_page::Listed::Trouble(&history_page::trouble(&e))),
    }
}

/// One record, read-only in every mode.
async fn history_record(
    State(c): State<Shared>,
    Path((ns, record)): Path<(String, String)>,
) -> Response {
    if let Scope::Namespace(own) = &c.scope
        && *own != ns
    {
        let what = format!("This console shows namespace {own} only.");
        return (StatusCode::NOT_FOUND, pages::not_found(&c.frame(), &what)).into_response();
    }
    match c.history.get(&ns, &record).await {
        Ok(Some(r)) => {
            let live = c
                .runs
                .get(&reflector::ObjectRef::new(&r.run.name).within(&ns))
                .is_some_and(|run| run.metadata.uid.as_deref() == Some(r.run.uid.as_str()));
            page(history_page::record_page(
                &c.frame(),
                &r,
                live,
                Timestamp::now(),
            ))
        }
        Ok(None) => {
            let what = match runrecords_served(&c.client).await {
                Some(false) => "The API server does not serve RunRecords: the RunRecord CRD is not installed. Install the CRDs of an operator with the history (docs/install.md).".to_owned(),
                _ => format!(
                    "No RunRecord {record} in namespace {ns}: it may have passed the operator's retention window, or you may not read it."
                ),
            };
            (StatusCode::NOT_FOUND, pages::not_found(&c.frame(), &what)).into_response()
        }
        Err(e) => page(history_page::record_unreadable(
            &c.frame(),
            &ns,
            &record,
            &history_page::trouble(&e),
        )),
    }
}

/// Whether the API server serves RunRecords (discovery, which every signed-in
/// user may read): a 404 on a record is then a missing record, not a missing
/// CRD. `None` when discovery itself failed.
async fn runrecords_served(client: &Client) -> Option<bool> {
    use kube::Resource;
    let gv = format!(
        "{}/{}",
        agentrun_operator::api::RunRecord::group(&()),
        agentrun_operator::api::RunRecord::version(&())
    );
    match client.list_api_group_resources(&gv).await {
        Ok(list) => Some(
            list.resources
                .iter()
                .any(|r| r.name == agentrun_operator::api::RunRecord::plural(&())),
        ),
        Err(kube::Error::Api(s)) if s.code == 404 => Some(false),
        Err(_) => None,
    }
}

#[derive(Deserialize)]
struct DecideForm {
    decision: String,
    #[serde(default)]
    comment: String,
}

/// One decision, as the user, through the CLI's own write. The result is a
/// line for the page's decisions log: what was recorded, or the refusal.
async fn decide(
    State(c): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    Form(form): Form<DecideForm>,
) -> Response {
    let outcome = async {
        let d: Decision = serde_json::from_value(serde_json::Value::String(form.decision.clone()))
            .map_err(|_| format!("unknown decision {:?}", form.decision))?;
        let a = Api::<Approval>::namespaced(c.client.clone(), &ns)
            .get(&name)
            .await
            .map_err(|e| crate::commands::api(format!("reading approval {name}"))(e).to_string())?;
        let comment = Some(form.comment.trim()).filter(|s| !s.is_empty());
        send_decision(&c.client, &a, &c.me, d, comment)
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    pages::decision_result(&name, &outcome).into_response()
}

async fn asset(Path(file): Path<String>) -> Response {
    let (body, kind): (&'static [u8], &str) = match file.as_str() {
        "htmx.min.js" => (
            include_bytes!("../../assets/htmx.min.js"),
            "text/javascript",
        ),
        "htmx-ext-sse.min.js" => (
            include_bytes!("../../assets/htmx-ext-sse.min.js"),
            "text/javascript",
        ),
        "console.js" => (include_bytes!("../../assets/console.js"), "text/javascript"),
        "console.css" => (include_bytes!("../../assets/console.css"), "text/css"),
        _ => return StatusCode::NOT_FOUND.into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        body,
    )
        .into_response()
}
