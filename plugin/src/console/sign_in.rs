//! Signing in and out: the middleware that ties each request to a person
//! before a handler runs ([`authenticate`]), and token mode's login and
//! logout pages (the diagram is `auth`'s).

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Form, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, html};
use serde::Deserialize;

use super::auth::{Auth, SESSION_COOKIE, Who, cookie, encode, next_page, same, split_token};
use super::proxy::{proxied, trusted};
use super::state::Shared;

/// Ties each request to a person ([`Who`] in its extensions) or refuses it.
/// The assets (a readiness probe reads one) and the login page are open.
pub async fn authenticate(
    State(c): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    if path.starts_with("/assets/") {
        return next.run(req).await;
    }
    let page = req.method() == Method::GET && !path.starts_with("/events/");
    match &c.auth {
        Auth::Local {
            token,
            cookie: name,
        } => {
            let (given, rest) = split_token(req.uri());
            if let Some(given) = given {
                if !same(&given, token) {
                    return refused(LOCAL_REFUSAL);
                }
                if page {
                    // `--open`'s page has done its work.
                    c.launched();
                    // The token leaves the address bar (and history) at once.
                    let set = format!("{name}={token}; HttpOnly; SameSite=Strict; Path=/");
                    return see_other(&rest, Some(&set));
                }
            } else if !cookie(req.headers(), name).is_some_and(|v| same(v, token)) {
                return refused(LOCAL_REFUSAL);
            }
            req.extensions_mut().insert(Who::Local);
        }
        Auth::Users { proxy, sessions } => {
            if path == "/login" && sessions.is_some() {
                return next.run(req).await;
            }
            let mut who = None;
            if let Some(p) = proxy
                && trusted(peer.ip(), &p.from)
            {
                match proxied(req.headers(), p) {
                    Ok(Some(id)) => who = Some(Who::Proxy(id)),
                    Ok(None) => {}
                    Err(why) => return refused(why),
                }
            }
            if who.is_none()
                && let Some(s) = sessions
                && let Some(id) = cookie(req.headers(), SESSION_COOKIE)
                && s.get(id).is_some()
            {
                who = Some(Who::Session(id.to_owned()));
            }
            match who {
                Some(w) => {
                    req.extensions_mut().insert(w);
                }
                None if sessions.is_some() && page => {
                    let next = req.uri().path_and_query().map_or("/", |p| p.as_str());
                    let to = format!("/login?next={}", encode(next));
                    return see_other(&to, None);
                }
                None if sessions.is_some() => return refused(SIGN_IN),
                None => return refused(PROXY_REFUSAL),
            }
        }
    }
    next.run(req).await
}

const LOCAL_REFUSAL: &str = "This console needs the address it printed when it started (http://127.0.0.1:PORT/?token=…): open that URL. Each start prints a new one.";
const PROXY_REFUSAL: &str = "This console serves signed-in users only, through its authenticating proxy: open it at the address your platform team published.";
const SIGN_IN: &str = "Not signed in, or the session expired: sign in again at /login.";

/// 401 with a short page saying what to do.
fn refused(why: &str) -> Response {
    let body = html! {
        (DOCTYPE)
        html lang="en" {
            head { meta charset="utf-8"; title { "Not signed in · agentrun console" }
                   link rel="stylesheet" href="/assets/console.css"; }
            body { main { h1 { "Not signed in" } p class="warning" { (why) } } }
        }
    };
    (StatusCode::UNAUTHORIZED, body).into_response()
}

fn see_other(to: &str, set_cookie: Option<&str>) -> Response {
    let mut res = (StatusCode::SEE_OTHER, [(header::LOCATION, to.to_owned())]).into_response();
    if let Some(c) = set_cookie.and_then(|c| HeaderValue::from_str(c).ok()) {
        res.headers_mut().insert(header::SET_COOKIE, c);
    }
    res
}

/// `Secure` when the browser reached the console over HTTPS (behind an
/// ingress that says so); a hint only: the flag can only withhold the cookie.
fn secure(headers: &HeaderMap) -> &'static str {
    let https = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    if https { "; Secure" } else { "" }
}

fn login_page(status: StatusCode, trouble: Option<&str>, next: &str) -> Response {
    let body = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "Sign in · agentrun console" }
                link rel="stylesheet" href="/assets/console.css";
            }
            body {
                main id="main" {
                    h1 { "Sign in" }
                    @if let Some(t) = trouble { p class="warning" role="alert" { (t) } }
                    p { "Paste a bearer token the API server accepts for you, e.g. from "
                        code { "kubectl create token" } " or your identity provider's ID token. "
                        "The console keeps it in memory for this session and reads and writes "
                        "as you with it: you see what RBAC lets you list." }
                    form class="login" method="post" action="/login" {
                        input type="hidden" name="next" value=(next_page(next));
                        label { "Token " input type="password" name="token" autocomplete="off" required; }
                        button type="submit" { "Sign in" }
                    }
                }
            }
        }
    };
    (status, body).into_response()
}

#[derive(Deserialize)]
pub struct After {
    #[serde(default)]
    next: String,
}

pub async fn login_form(axum::extract::Query(n): axum::extract::Query<After>) -> Response {
    login_page(StatusCode::OK, None, &n.next)
}

#[derive(Deserialize)]
pub struct LoginForm {
    token: String,
    #[serde(default)]
    next: String,
}

/// Checks the token with a SelfSubjectReview as its holder, then opens a
/// session for it.
pub async fn login(
    State(c): State<Shared>,
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> Response {
    let Auth::Users {
        sessions: Some(sessions),
        ..
    } = &c.auth
    else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let token = f.token.trim().to_owned();
    if token.is_empty() {
        return login_page(StatusCode::UNAUTHORIZED, Some("No token given."), &f.next);
    }
    let checked = match c.token_client(&token) {
        Ok(client) => crate::client::whoami(&client).await,
        Err(e) => Err(e),
    };
    match checked {
        Ok(me) if !me.user.is_empty() && me.user != "system:anonymous" => {
            let id = sessions.open(token, me.user.clone());
            let set = format!(
                "{SESSION_COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{}",
                sessions.ttl().as_secs(),
                secure(&headers)
            );
            eprintln!("console: {} signed in", me.user);
            see_other(next_page(&f.next), Some(&set))
        }
        Ok(_) => login_page(
            StatusCode::UNAUTHORIZED,
            Some("The API server took this token for an anonymous user."),
            &f.next,
        ),
        Err(e) => login_page(
            StatusCode::UNAUTHORIZED,
            Some(&format!("The API server did not accept this token: {e}")),
            &f.next,
        ),
    }
}

/// Ends the session: its token is forgotten and its watches stop.
pub async fn logout(State(c): State<Shared>, headers: HeaderMap) -> Response {
    if let Auth::Users {
        sessions: Some(sessions),
        ..
    } = &c.auth
        && let Some(id) = cookie(&headers, SESSION_COOKIE)
    {
        sessions.close(id);
        c.forget(&Who::Session(id.to_owned()));
    }
    let clear = format!("{SESSION_COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0");
    see_other("/login", Some(&clear))
}
