//! Who is asking: every request but the static assets is tied to a person
//! before a handler runs, and the handlers act as that person (`View`).
//!
//! ```text
//!   local   (127.0.0.1, the kubeconfig's user)
//!     GET /?token=T ──T right──▶ 303 without T + cookie agentrun_console_PORT=T
//!     cookie == T (constant time) ──▶ Who::Local        else 401
//!   in the cluster (--auth proxy and/or token)
//!     peer in --trusted-proxy + X-Forwarded-User ──▶ Who::Proxy(user, groups) ─▶ impersonated
//!     cookie agentrun_session=S, S live           ──▶ Who::Session(S)        ─▶ the pasted token
//!     otherwise: GET of a page ─▶ /login (token mode); anything else 401
//! ```
//!
//! The pure parts (token comparison, cookies, the proxy's peer and headers)
//! are unit-tested here; the flows are tested against the API server in
//! `e2e/tests/console/auth.rs`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Form, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ipnet::IpNet;
use maud::{DOCTYPE, Markup, html};
use serde::Deserialize;

use super::Shared;
use crate::identity::Identity;

/// How people sign in to a console served beyond this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// An authenticating proxy in front names the user in a header; the
    /// console impersonates them.
    Proxy,
    /// The user pastes a bearer token on a login page; the console uses it.
    Token,
}

/// Whom the console trusts to name the user, and in which headers.
#[derive(Clone, Debug)]
pub struct ProxyTrust {
    /// Peers whose headers are believed; from anyone else they are refused.
    pub from: Vec<IpNet>,
    pub user_header: HeaderName,
    pub group_header: HeaderName,
    /// Put before the names the proxy gives, as the API server's own OIDC
    /// flags do (`--oidc-username-prefix`), so they match RBAC's subjects.
    pub user_prefix: String,
    pub group_prefix: String,
}

/// How requests are tied to a person.
pub enum Auth {
    /// The kubeconfig's user, for whoever holds the token of the printed URL.
    Local { token: String, cookie: String },
    /// Each signed-in user, as themselves.
    Users {
        proxy: Option<ProxyTrust>,
        sessions: Option<Sessions>,
    },
}

/// Whom a request acts for (set by [`authenticate`], read by the `User`
/// extractor).
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Who {
    /// The kubeconfig's user.
    Local,
    /// The user the trusted proxy named, with their groups.
    Proxy(Identity),
    /// A token-mode session, by its id.
    Session(String),
}

impl Who {
    /// For logs: never a session's id, which is a credential.
    pub fn label(&self) -> String {
        match self {
            Who::Local => "the kubeconfig's user".into(),
            Who::Proxy(id) => format!("{} (from the proxy)", id.user),
            Who::Session(_) => "a token session".into(),
        }
    }
}

impl std::fmt::Debug for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

/// The token-mode session cookie.
pub const SESSION_COOKIE: &str = "agentrun_session";

/// 32 random bytes from the operating system, as 64 hex digits.
pub fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Equal, in time that does not depend on where they differ.
pub fn same(given: &str, expected: &str) -> bool {
    use subtle::ConstantTimeEq;
    given.len() == expected.len() && bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
}

/// The value of cookie `name` (the last one when a browser sends several).
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v.trim())
        .next_back()
}

/// The `token` query parameter, and the same path and query without it.
pub fn split_token(uri: &Uri) -> (Option<String>, String) {
    let Some(query) = uri.query() else {
        return (None, uri.path().to_owned());
    };
    let mut token = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("token", v)) => token = Some(v.to_owned()),
            _ if pair == "token" => token = Some(String::new()),
            _ => rest.push(pair),
        }
    }
    let path = if rest.is_empty() {
        uri.path().to_owned()
    } else {
        format!("{}?{}", uri.path(), rest.join("&"))
    };
    (token, path)
}

/// Whether `peer` is one of the trusted proxies (an IPv4 peer seen on an
/// IPv6 socket counts as its IPv4 address).
pub fn trusted(peer: IpAddr, from: &[IpNet]) -> bool {
    let peer = peer.to_canonical();
    from.iter().any(|net| net.contains(&peer))
}

/// The user and groups a trusted proxy named, prefixed: `None` without the
/// user header; an error when the header is repeated, empty or not text (a
/// proxy that appends to a client's header must not make two users one), or
/// when it names a `system:` user or group (Kubernetes' own identities, such
/// as `system:masters`, are never a person signed in through a proxy).
/// Groups come comma-separated, in one header or several.
pub fn proxied(headers: &HeaderMap, trust: &ProxyTrust) -> Result<Option<Identity>, &'static str> {
    let mut users = headers.get_all(&trust.user_header).iter();
    let Some(user) = users.next() else {
        return Ok(None);
    };
    if users.next().is_some() {
        return Err("the proxy's user header is repeated");
    }
    let user = user
        .to_str()
        .map_err(|_| "the proxy's user header is not text")?
        .trim();
    if user.is_empty() {
        return Err("the proxy's user header is empty");
    }
    if user.starts_with("system:") {
        return Err("the proxy named a system: user");
    }
    let mut groups = Vec::new();
    for v in headers.get_all(&trust.group_header) {
        let v = v
            .to_str()
            .map_err(|_| "the proxy's group header is not text")?;
        for g in v.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            if g.starts_with("system:") {
                return Err("the proxy named a system: group");
            }
            groups.push(format!("{}{g}", trust.group_prefix));
        }
    }
    Ok(Some(Identity {
        user: format!("{}{user}", trust.user_prefix),
        groups,
    }))
}

/// Token-mode sessions: a random id in the browser's cookie, the pasted
/// token here, until it expires or the user signs out.
pub struct Sessions {
    ttl: Duration,
    live: Mutex<HashMap<String, Session>>,
}

#[derive(Clone)]
pub struct Session {
    pub token: String,
    pub expires: Instant,
}

impl Sessions {
    pub fn new(ttl: Duration) -> Sessions {
        Sessions {
            ttl,
            live: Mutex::default(),
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// A new session for `token` (checked by the caller); its id.
    pub fn open(&self, token: String) -> String {
        let id = random_token();
        let s = Session {
            token,
            expires: Instant::now() + self.ttl,
        };
        if let Ok(mut live) = self.live.lock() {
            live.retain(|_, s| s.expires > Instant::now());
            live.insert(id.clone(), s);
        }
        id
    }

    /// The session `id`, while it lives.
    pub fn get(&self, id: &str) -> Option<Session> {
        let live = self.live.lock().ok()?;
        live.get(id).filter(|s| s.expires > Instant::now()).cloned()
    }

    pub fn close(&self, id: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(id);
        }
    }
}

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

/// Percent-encodes everything but unreserved characters and `/`.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Where to go after signing in: a path on this console, never elsewhere
/// (`//host` or `/\host` would leave it).
pub fn next_page(next: &str) -> &str {
    let local = next.starts_with('/') && !next.starts_with("//") && !next.starts_with("/\\");
    if local { next } else { "/" }
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
        Ok(client) => crate::commands::whoami(&client).await,
        Err(e) => Err(e),
    };
    match checked {
        Ok(me) if !me.user.is_empty() && me.user != "system:anonymous" => {
            let id = sessions.open(token);
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

/// The sign-out button in the header (token mode).
pub fn sign_out() -> Markup {
    html! {
        form class="signout" method="post" action="/logout" {
            button type="submit" { "Sign out" }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trust() -> ProxyTrust {
        ProxyTrust {
            from: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
            user_header: HeaderName::from_static("x-forwarded-user"),
            group_header: HeaderName::from_static("x-forwarded-groups"),
            user_prefix: String::new(),
            group_prefix: String::new(),
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn a_token_is_256_random_bits_in_hex() {
        let (a, b) = (random_token(), random_token());
        assert_eq!(a.len(), 64);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
    }

    #[test]
    fn tokens_match_only_when_equal() {
        let t = "3f".repeat(32);
        for (given, want) in [
            (t.clone(), true),
            (format!("{}0", &t[..63]), false),
            (t[..63].to_owned(), false),
            (format!("{t}0"), false),
            (String::new(), false),
            (t.to_uppercase(), false),
        ] {
            assert_eq!(same(&given, &t), want, "{given:?}");
        }
    }

    #[test]
    fn the_token_is_split_from_the_rest_of_the_query() {
        let cases = [
            ("/", None, "/"),
            ("/?token=ab", Some("ab"), "/"),
            (
                "/?phase=Failed&token=ab&q=x",
                Some("ab"),
                "/?phase=Failed&q=x",
            ),
            ("/approvals?token=", Some(""), "/approvals"),
            ("/ns/a/runs/b?sort=oldest", None, "/ns/a/runs/b?sort=oldest"),
            ("/?tokens=ab", None, "/?tokens=ab"),
        ];
        for (uri, token, rest) in cases {
            let (t, r) = split_token(&uri.parse().unwrap());
            assert_eq!((t.as_deref(), r.as_str()), (token, rest), "{uri}");
        }
    }

    #[test]
    fn after_signing_in_only_a_page_of_this_console_is_next() {
        for (next, want) in [
            ("/ns/shop/runs/refund?x=1", "/ns/shop/runs/refund?x=1"),
            ("/", "/"),
            ("", "/"),
            ("//evil.example/", "/"),
            ("/\\evil.example", "/"),
            ("https://evil.example/", "/"),
            ("ns/shop", "/"),
        ] {
            assert_eq!(next_page(next), want, "{next:?}");
        }
        assert_eq!(
            encode("/ns/a/runs/b?phase=x&q=a b"),
            "/ns/a/runs/b%3Fphase%3Dx%26q%3Da%20b"
        );
    }

    #[test]
    fn cookies_are_read_by_exact_name() {
        let h = headers(&[
            ("cookie", "agentrun_console_80=wrong; agentrun_console_8=x"),
            ("cookie", "other=1; agentrun_console_8=right"),
        ]);
        assert_eq!(cookie(&h, "agentrun_console_8"), Some("right"));
        assert_eq!(cookie(&h, "agentrun_console_80"), Some("wrong"));
        assert_eq!(cookie(&h, "agentrun_console"), None);
        assert_eq!(cookie(&HeaderMap::new(), "other"), None);
    }

    #[test]
    fn only_peers_in_the_trusted_ranges_are_proxies() {
        let from = trust().from;
        for (peer, want) in [
            ("10.1.2.3", true),
            ("11.0.0.1", false),
            ("127.0.0.1", false),
            ("::ffff:10.9.9.9", true),
            ("::ffff:192.168.0.1", false),
            ("fd12::1", true),
            ("fe80::1", false),
        ] {
            assert_eq!(trusted(peer.parse().unwrap(), &from), want, "{peer}");
        }
        let one: Vec<IpNet> = vec!["127.0.0.1/32".parse().unwrap()];
        assert!(trusted("127.0.0.1".parse().unwrap(), &one));
        assert!(!trusted("127.0.0.3".parse().unwrap(), &one));
    }

    #[test]
    fn the_proxys_headers_name_one_user_and_their_groups() {
        let t = trust();
        let id = |user: &str, groups: &[&str]| Identity {
            user: user.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        };
        let ok = [
            (headers(&[]), None),
            (
                headers(&[("x-forwarded-user", "alice")]),
                Some(id("alice", &[])),
            ),
            (
                headers(&[
                    ("X-Forwarded-User", " alice@example.com "),
                    ("x-forwarded-groups", "dev, ops,,"),
                    ("x-forwarded-groups", "oncall"),
                ]),
                Some(id("alice@example.com", &["dev", "ops", "oncall"])),
            ),
            (headers(&[("x-forwarded-groups", "dev")]), None),
        ];
        for (h, want) in ok {
            assert_eq!(proxied(&h, &t), Ok(want), "{h:?}");
        }
        for h in [
            headers(&[("x-forwarded-user", "alice"), ("x-forwarded-user", "bob")]),
            headers(&[("x-forwarded-user", "  ")]),
            headers(&[("x-forwarded-user", "system:admin")]),
            headers(&[
                ("x-forwarded-user", "alice"),
                ("x-forwarded-groups", "dev,system:masters"),
            ]),
        ] {
            assert!(proxied(&h, &t).is_err(), "{h:?}");
        }
        let prefixed = ProxyTrust {
            user_prefix: "oidc:".into(),
            group_prefix: "oidc:".into(),
            ..trust()
        };
        assert_eq!(
            proxied(
                &headers(&[("x-forwarded-user", "alice"), ("x-forwarded-groups", "dev")]),
                &prefixed
            ),
            Ok(Some(id("oidc:alice", &["oidc:dev"])))
        );
        let mut bad = HeaderMap::new();
        bad.insert(
            "x-forwarded-user",
            HeaderValue::from_bytes(b"al\xffice").unwrap(),
        );
        assert!(proxied(&bad, &t).is_err());
    }

    #[test]
    fn a_session_lives_until_it_expires_or_is_closed() {
        let s = Sessions::new(Duration::from_secs(60));
        let id = s.open("tok".into());
        assert_eq!(id.len(), 64);
        assert_eq!(s.get(&id).map(|s| s.token), Some("tok".into()));
        assert!(s.get("nope").is_none());
        s.close(&id);
        assert!(s.get(&id).is_none());
        let brief = Sessions::new(Duration::ZERO);
        let id = brief.open("tok".into());
        assert!(brief.get(&id).is_none(), "expired at once");
    }
}
