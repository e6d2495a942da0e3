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
//! The pure parts (token comparison, cookies) are unit-tested here, the
//! proxy's peer and headers in `proxy.rs`; the flows are tested against the API server in
//! `e2e/tests/console/auth.rs`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, Uri, header};
use maud::{Markup, html};

use super::proxy::ProxyTrust;
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

/// Token-mode sessions: a random id in the browser's cookie, the pasted
/// token here, until it expires or the user signs out.
pub struct Sessions {
    ttl: Duration,
    live: Mutex<HashMap<String, Session>>,
}

#[derive(Clone)]
pub struct Session {
    pub token: String,
    /// Who the API server said the token is, at sign-in.
    pub user: String,
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

    /// A new session for `token`, which the API server took for `user`
    /// (checked by the caller); its id.
    pub fn open(&self, token: String, user: String) -> String {
        let id = random_token();
        let s = Session {
            token,
            user,
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

/// Percent-encodes everything but unreserved characters and `/`.
pub(super) fn encode(s: &str) -> String {
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
    use super::super::proxy::tests::headers;
    use super::*;

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
    fn a_session_lives_until_it_expires_or_is_closed() {
        let s = Sessions::new(Duration::from_secs(60));
        let id = s.open("tok".into(), "alice".into());
        assert_eq!(id.len(), 64);
        assert_eq!(
            s.get(&id).map(|s| (s.token, s.user)),
            Some(("tok".into(), "alice".into()))
        );
        assert!(s.get("nope").is_none());
        s.close(&id);
        assert!(s.get(&id).is_none());
        let brief = Sessions::new(Duration::ZERO);
        let id = brief.open("tok".into(), "alice".into());
        assert!(brief.get(&id).is_none(), "expired at once");
    }
}
