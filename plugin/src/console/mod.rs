//! `kubectl agentrun console`: a web app that reads and writes the
//! Kubernetes API as the person using it, like `kubectl proxy`: no rights of
//! its own that anyone borrows, RBAC and the approver policies apply
//! unchanged.
//!
//! ```text
//!   browser ──HTTP/SSE──▶ hardened ─▶ guard ─▶ authenticate ─▶ handler(User(view))
//!     local:      127.0.0.1:random, token in the printed URL, the kubeconfig's user
//!     in-cluster: --auth proxy (impersonates the header's user, from trusted peers)
//!                 --auth token (a pasted bearer token, kept per session)
//!   view (per person) ──watch/patch as them──▶ kube-apiserver
//!     ├─ reflector AgentRuns  ─┐
//!     ├─ reflector Approvals  ─┴─▶ change counter ─▶ their SSE streams
//!     ├─ per run page: its Events and Signals (a list each)
//!     ├─ history pages: history::Store list / get (read only)
//!     ├─ decisions: decision::send_decision (the CLI's own write)
//!     └─ retries: fork::create (the CLI's own fork, as them)
//! ```
//!
//! `pages`, `run_page`, `history_page` and `timeline` are pure renderings;
//! `sse` turns the watches into live fragments; `auth` (who a request is
//! for) and `sign_in` (the middleware, login and logout) tie requests to
//! people; `view` gives each person a client and watches of their own, and
//! `user` finds a request's view; `state` is what every request shares;
//! this module wires the server. No file here imports this one.

pub mod auth;
pub mod filter;
pub mod history_page;
pub mod namespace;
pub mod open;
pub mod pages;
pub mod proxy;
pub mod retry;
pub mod run_page;
pub mod sign_in;
mod sse;
pub mod state;
pub mod timeline;
pub mod user;
pub mod view;

use std::net::SocketAddr;
use std::sync::Arc;

use agentrun_api::{Approval, Decision};
use axum::Router;
use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use jiff::Timestamp;
use kube::{Api, Client};
use maud::Markup;
use serde::Deserialize;

use crate::client::{Error, events_of, journals_of, signals_of};
use crate::decision::send_decision;
use crate::render;
use auth::{Auth, Mode, Sessions};
use filter::{HistoryFilter, RunFilter};
use namespace::Scope;
use proxy::ProxyTrust;
use state::{Console, Options, Shared};
use user::User;
use view::View;

fn header_name(flag: &str, v: &str) -> Result<header::HeaderName, Error> {
    header::HeaderName::from_bytes(v.as_bytes())
        .map_err(|_| Error::Usage(format!("{flag}: {v:?} is not a header name")))
}

/// How requests are tied to people, from the flags; refuses a console that
/// would serve other machines as the kubeconfig's user.
fn auth_of(opts: &Options) -> Result<Auth, Error> {
    let proxy = opts.auth.contains(&Mode::Proxy);
    let token = opts.auth.contains(&Mode::Token);
    if !proxy && !opts.trusted_proxies.is_empty() {
        return Err(Error::Usage("--trusted-proxy needs --auth proxy".into()));
    }
    if !proxy && !token {
        if !opts.address.ip().is_loopback() {
            return Err(Error::Usage(format!(
                "--listen {}: a console other machines reach must sign each person in; add --auth proxy (behind an authenticating proxy) or --auth token (docs/console.md)",
                opts.address.ip()
            )));
        }
        return Ok(Auth::Local {
            token: auth::random_token(),
            cookie: format!("agentrun_console_{}", opts.address.port()),
        });
    }
    let proxy = if proxy {
        if opts.trusted_proxies.is_empty() {
            return Err(Error::Usage(
                "--auth proxy needs --trusted-proxy CIDR: the addresses of the proxy whose user header the console believes".into(),
            ));
        }
        Some(ProxyTrust {
            from: opts.trusted_proxies.clone(),
            user_header: header_name("--user-header", &opts.user_header)?,
            group_header: header_name("--group-header", &opts.group_header)?,
            user_prefix: opts.user_prefix.clone(),
            group_prefix: opts.group_prefix.clone(),
        })
    } else {
        None
    };
    Ok(Auth::Users {
        proxy,
        sessions: token.then(|| Sessions::new(opts.session_ttl)),
    })
}

/// Starts the watches (locally) and serves until interrupted.
pub async fn serve(
    config: kube::Config,
    default_namespace: String,
    mut opts: Options,
) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(opts.address).await?;
    let port = listener.local_addr()?.port();
    opts.address.set_port(port);
    let auth = auth_of(&opts)?;
    let local = match &auth {
        Auth::Local { .. } => {
            let client =
                Client::try_from(config.clone()).map_err(|e| Error::Config(e.to_string()))?;
            Some(Arc::new(
                View::start(
                    client,
                    opts.namespace.clone(),
                    |_| default_namespace.clone(),
                    !opts.read_only,
                    false,
                )
                .await?,
            ))
        }
        Auth::Users { .. } => None,
    };
    let console = Arc::new(Console {
        loopback: matches!(auth, Auth::Local { .. }),
        auth,
        config,
        local,
        views: view::Views::default(),
        namespace: opts.namespace.clone(),
        default_namespace,
        port,
        decide: !opts.read_only,
        launch: std::sync::Mutex::default(),
    });
    let mode = if opts.read_only { ", read-only" } else { "" };
    let url = match (&console.auth, &console.local) {
        (Auth::Local { token, .. }, Some(v)) => {
            let url = format!("http://{}:{port}/?token={token}", opts.address.ip());
            let what = match &v.scope {
                Scope::All => "all namespaces".to_owned(),
                Scope::Namespace(ns) => format!("namespace {ns}"),
            };
            println!(
                "console: {url} ({what}, as {}{mode}); Ctrl-C to stop",
                v.me.user
            );
            url
        }
        _ => {
            let url = format!("http://{}/", opts.address);
            let how: Vec<String> = opts
                .auth
                .iter()
                .map(|m| format!("{m:?}").to_lowercase())
                .collect();
            println!(
                "console: {url} (each person as themselves, signed in by {}{mode}); Ctrl-C to stop",
                how.join(" or ")
            );
            url
        }
    };
    if opts.open {
        open_browser(&console, &url);
    }
    let served = axum::serve(
        listener,
        router(console.clone()).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await;
    console.launched();
    Ok(served?)
}

/// Opens `url` in the default browser. A URL with the local token goes
/// through a page only this user can read ([`open`]): the opener's
/// arguments, which anyone on the machine can read, never hold it.
fn open_browser(console: &Shared, url: &str) {
    let opener = open::opener();
    let address = match console.auth {
        Auth::Local { .. } => match open::LaunchPage::write(&open::base_dir(), url) {
            Ok(page) => {
                let address = page.address();
                if let Ok(mut l) = console.launch.lock() {
                    *l = Some(page);
                }
                let c = console.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(open::KEEP).await;
                    c.launched();
                });
                address
            }
            Err(e) => {
                eprintln!(
                    "console: could not write a page for the browser ({e}); open the URL above"
                );
                return;
            }
        },
        Auth::Users { .. } => url.to_owned(),
    };
    // tokio's child is reaped when it exits; the console does not wait for it.
    if let Err(e) = tokio::process::Command::new(opener).arg(&address).spawn() {
        eprintln!("console: could not open a browser ({opener}: {e}); open the URL above");
        console.launched();
    }
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
    if console.namespace.is_none() && matches!(console.auth, Auth::Users { .. }) {
        r = r.route("/namespace", get(namespace::choose_namespace));
    }
    if let Auth::Users {
        sessions: Some(_), ..
    } = &console.auth
    {
        r = r
            .route("/login", get(sign_in::login_form).post(sign_in::login))
            .route("/logout", post(sign_in::logout));
    }
    r.route("/events/runs", get(sse::runs))
        .route("/events/approvals", get(sse::approvals))
        .route("/events/ns/{ns}/runs/{run}", get(sse::run))
        .route("/assets/{file}", get(asset))
        .layer(middleware::from_fn_with_state(
            console.clone(),
            sign_in::authenticate,
        ))
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

/// Requests must name this console as their host (locally: no DNS
/// rebinding), and a write must come from its own pages (an htmx request
/// with no foreign Origin): another site in the browser cannot decide as the
/// user. The sign-in forms are plain form posts, so they must carry this
/// console's Origin.
async fn guard(State(c): State<Shared>, req: Request, next: Next) -> Response {
    if let Err((code, why)) = allowed(&c, req.method(), req.uri().path(), req.headers()) {
        return (code, why).into_response();
    }
    next.run(req).await
}

fn allowed(
    c: &Console,
    method: &axum::http::Method,
    path: &str,
    headers: &HeaderMap,
) -> Result<(), (StatusCode, &'static str)> {
    let h = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    // Locally the loopback names; behind an ingress, the name it was asked by.
    let ours: Vec<String> = if c.loopback {
        vec![
            format!("127.0.0.1:{}", c.port),
            format!("localhost:{}", c.port),
        ]
    } else {
        h(header::HOST).map(str::to_owned).into_iter().collect()
    };
    if c.loopback && !h(header::HOST).is_some_and(|host| ours.iter().any(|o| o == host)) {
        return Err((
            StatusCode::MISDIRECTED_REQUEST,
            "not this console's address",
        ));
    }
    if method == axum::http::Method::POST {
        let same_origin = |o: &str| {
            ours.iter().any(|host| {
                o == format!("http://{host}") || (!c.loopback && o == format!("https://{host}"))
            })
        };
        let origin = h(header::ORIGIN);
        let sign_in = path == "/login" || path == "/logout";
        let ok = if sign_in {
            origin.is_some_and(same_origin)
        } else {
            origin.is_none_or(same_origin) && headers.get("hx-request").is_some_and(|v| v == "true")
        };
        if !ok {
            let why = if sign_in {
                "signing in and out happens on the console's own pages"
            } else {
                "decisions come from the console's own pages"
            };
            return Err((StatusCode::FORBIDDEN, why));
        }
    }
    Ok(())
}

fn page(m: Markup) -> Response {
    m.into_response()
}

async fn runs_page(User(c): User, Query(f): Query<RunFilter>) -> Response {
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

async fn inbox_page(User(c): User) -> Response {
    page(pages::inbox_page(
        &c.frame(),
        &c.approvals(),
        Timestamp::now(),
        c.decide,
    ))
}

async fn run_page(User(c): User, Path((ns, name)): Path<(String, String)>) -> Response {
    let Some((run, approvals)) = c.run(&ns, &name) else {
        let what = format!("No AgentRun {name} in namespace {ns} (or you may not list it).");
        return (StatusCode::NOT_FOUND, pages::not_found(&c.frame(), &what)).into_response();
    };
    let mut frame = c.frame();
    let events = events_of(&c.client, &ns, &name).await.unwrap_or_else(|e| {
        frame.warnings.push(e.to_string());
        Vec::new()
    });
    let signals = signals_of(&c.client, &ns, &run).await;
    let journals = journals_of(&c.client, &ns, &run).await.unwrap_or_else(|e| {
        if render::journal::journaled(&run) {
            frame.warnings.push(e.to_string());
        }
        Vec::new()
    });
    let related = render::Related {
        approvals: &approvals,
        signals: &signals,
        journals: &journals,
        events: &events,
    };
    page(run_page::run_page(
        &frame,
        &run,
        &related,
        c.decide,
        Timestamp::now(),
    ))
}

/// The records that match the filter, newest first, through the history
/// store as the user; a filter it cannot use or the store's refusal is the
/// page's message, never an error page.
async fn history_list(User(c): User, Query(f): Query<HistoryFilter>) -> Response {
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
async fn history_record(User(c): User, Path((ns, record)): Path<(String, String)>) -> Response {
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
                .get(&kube::runtime::reflector::ObjectRef::new(&r.run.name).within(&ns))
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
        agentrun_api::RunRecord::group(&()),
        agentrun_api::RunRecord::version(&())
    );
    match client.list_api_group_resources(&gv).await {
        Ok(list) => Some(
            list.resources
                .iter()
                .any(|r| r.name == agentrun_api::RunRecord::plural(&())),
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
    User(c): User,
    Path((ns, name)): Path<(String, String)>,
    Form(form): Form<DecideForm>,
) -> Response {
    let outcome = async {
        let d: Decision = serde_json::from_value(serde_json::Value::String(form.decision.clone()))
            .map_err(|_| format!("unknown decision {:?}", form.decision))?;
        let a = Api::<Approval>::namespaced(c.client.clone(), &ns)
            .get(&name)
            .await
            .map_err(|e| crate::client::api(format!("reading approval {name}"))(e).to_string())?;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn opts(listen: &str, auth: &[Mode], trusted: &[&str]) -> Options {
        Options {
            namespace: None,
            address: SocketAddr::new(listen.parse().unwrap(), 8099),
            open: false,
            read_only: false,
            auth: auth.to_vec(),
            trusted_proxies: trusted.iter().map(|c| c.parse().unwrap()).collect(),
            user_header: "X-Forwarded-User".into(),
            group_header: "X-Forwarded-Groups".into(),
            user_prefix: String::new(),
            group_prefix: String::new(),
            session_ttl: Duration::from_secs(3600),
        }
    }

    fn refusal(o: &Options) -> String {
        match auth_of(o) {
            Err(Error::Usage(why)) => why,
            Err(e) => panic!("not a usage error: {e}"),
            Ok(_) => panic!("accepted: {o:?}"),
        }
    }

    #[test]
    fn beyond_loopback_the_console_signs_each_person_in() {
        for listen in ["0.0.0.0", "10.1.2.3", "::"] {
            let why = refusal(&opts(listen, &[], &[]));
            assert!(
                why.contains("--auth proxy") && why.contains("--auth token"),
                "{why}"
            );
        }
        let why = refusal(&opts("0.0.0.0", &[Mode::Proxy], &[]));
        assert!(why.contains("--trusted-proxy"), "{why}");
        let why = refusal(&opts("0.0.0.0", &[Mode::Token], &["10.0.0.0/8"]));
        assert!(why.contains("--trusted-proxy needs --auth proxy"), "{why}");
        let mut bad = opts("0.0.0.0", &[Mode::Proxy], &["10.0.0.0/8"]);
        bad.user_header = "X User".into();
        assert!(refusal(&bad).contains("--user-header"));

        match auth_of(&opts("127.0.0.1", &[], &[])) {
            Ok(Auth::Local { token, cookie }) => {
                assert_eq!(token.len(), 64);
                assert_eq!(cookie, "agentrun_console_8099");
            }
            _ => panic!("loopback without --auth is the local console"),
        }
        match auth_of(&opts(
            "0.0.0.0",
            &[Mode::Proxy, Mode::Token],
            &["10.0.0.0/8"],
        )) {
            Ok(Auth::Users {
                proxy: Some(p),
                sessions: Some(_),
            }) => assert_eq!(p.from, ["10.0.0.0/8".parse::<ipnet::IpNet>().unwrap()]),
            _ => panic!("proxy and token"),
        }
        assert!(matches!(
            auth_of(&opts("0.0.0.0", &[Mode::Token], &[])),
            Ok(Auth::Users {
                proxy: None,
                sessions: Some(_)
            })
        ));
    }
}
