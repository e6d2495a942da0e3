//! Who the local console serves, both ways, against the API server, and the
//! raw HTTP the sign-in tests speak (the cluster's modes are in
//! `console/in_cluster.rs`).
//!
//! ```text
//!   the printed URL's token ─▶ cookie ─▶ pages, streams, decisions; else 401
//! ```

use std::time::{Duration, Instant};

use agentrun_e2e::support::scenario::{Scenario, sim_step};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{PAGE_TIMEOUT, browser, console, raw};

/// One request's status line and headers (lowercase) and body.
pub(super) struct Answer {
    pub(super) code: u16,
    pub(super) head: String,
    pub(super) body: String,
}

/// A raw HTTP/1.0 request from `from` (a loopback address) to the console;
/// a POST carries a decision.
pub(super) async fn request(
    from: [u8; 4],
    port: u16,
    method: &str,
    path: &str,
    headers: &str,
) -> Answer {
    let form = (method == "POST").then_some("decision=Approved");
    exchange(from, port, method, path, headers, form).await
}

/// A raw HTTP/1.0 request from `from` to the console, with `form` (URL-encoded)
/// as its body if given.
pub(super) async fn exchange(
    from: [u8; 4],
    port: u16,
    method: &str,
    path: &str,
    headers: &str,
    form: Option<&str>,
) -> Answer {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind((std::net::Ipv4Addr::from(from), 0).into())
        .expect("binding the client's loopback address");
    let mut s = socket
        .connect(([127, 0, 0, 1], port).into())
        .await
        .expect("connecting to the console");
    let (body, ctype) = match form {
        Some(f) => (f, "Content-Type: application/x-www-form-urlencoded\r\n"),
        None => ("", ""),
    };
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n{headers}{ctype}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(PAGE_TIMEOUT, s.read_to_end(&mut buf))
        .await
        .expect("an answer in time")
        .unwrap();
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Answer {
        code: head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        head: head.to_ascii_lowercase(),
        body: body.to_owned(),
    }
}

/// An open Server-Sent Events stream from the console.
pub(super) struct Stream {
    conn: tokio::net::TcpStream,
    pub(super) text: String,
}

impl Stream {
    pub(super) async fn open(port: u16, path: &str, headers: &str) -> Stream {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let req = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n{headers}\r\n");
        conn.write_all(req.as_bytes()).await.unwrap();
        Stream {
            conn,
            text: String::new(),
        }
    }

    /// Reads until what has come contains `want` (panics after `timeout`).
    pub(super) async fn until(&mut self, want: &str, timeout: Duration) -> &str {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 8192];
        while !self.text.contains(want) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.conn.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => self.text.push_str(&String::from_utf8_lossy(&buf[..n])),
                _ => panic!(
                    "no {want:?} in the stream within {timeout:?}: {}",
                    self.text
                ),
            }
        }
        &self.text
    }
}

/// The first event of the stream at `path`, read with `headers`.
pub(super) async fn first_event(port: u16, path: &str, headers: &str) -> String {
    let mut s = Stream::open(port, path, headers).await;
    s.until("event: ", PAGE_TIMEOUT).await;
    s.until("\n\n", PAGE_TIMEOUT).await.to_owned()
}

/// Locally: no token or a wrong one is refused with a page that says what
/// to open; the printed token is traded for an HttpOnly, SameSite=Strict
/// cookie and dropped from the address; with the cookie pages, streams and
/// decisions are served (and in Chromium the page is live).
#[tokio::test]
async fn the_local_console_serves_only_whoever_has_the_printed_token() {
    let s = Scenario::start("console-token").await;
    let ns = s.namespace().to_owned();
    s.create_run(
        "report",
        json!({"steps": [sim_step("fetch", "Idempotent", json!({}))]}),
    )
    .await;
    let c = console(&ns, None).await;
    assert_eq!(c.token.len(), 64, "256 bits in hex: {}", c.token);
    assert!(
        c.token.bytes().all(|b| b.is_ascii_hexdigit()),
        "{}",
        c.token
    );
    let wrong = "0".repeat(64);
    let wrong_cookie = format!("Cookie: agentrun_console_{}={wrong}\r\n", c.port);
    let lo = [127, 0, 0, 1];
    let decide = format!("/ns/{ns}/approvals/nope/decide");
    for (case, method, path, headers) in [
        (
            "a page without a token",
            "GET",
            "/".to_owned(),
            String::new(),
        ),
        (
            "a wrong token",
            "GET",
            format!("/?token={wrong}"),
            String::new(),
        ),
        (
            "a short token",
            "GET",
            format!("/?token={}", &c.token[..63]),
            String::new(),
        ),
        (
            "a wrong cookie",
            "GET",
            "/approvals".to_owned(),
            wrong_cookie.clone(),
        ),
        (
            "the stream without a cookie",
            "GET",
            "/events/runs".to_owned(),
            String::new(),
        ),
        (
            "a history page",
            "GET",
            "/history".to_owned(),
            String::new(),
        ),
        (
            "a decision without a cookie",
            "POST",
            decide.clone(),
            "HX-Request: true\r\n".to_owned(),
        ),
        (
            "a decision with a wrong cookie",
            "POST",
            decide.clone(),
            format!("HX-Request: true\r\n{wrong_cookie}"),
        ),
    ] {
        let a = request(lo, c.port, method, &path, &headers).await;
        assert_eq!(a.code, 401, "{case}: {}\n{}", a.head, a.body);
        assert!(
            a.body.contains("open that URL"),
            "{case}: the refusal says what to open: {}",
            a.body
        );
        assert!(!a.head.contains("set-cookie"), "{case}: {}", a.head);
    }
    // The right token: a cookie for this console, and the address without it.
    let a = request(
        lo,
        c.port,
        "GET",
        &format!("/?phase=Running&token={}", c.token),
        "",
    )
    .await;
    assert_eq!(a.code, 303, "{}", a.head);
    assert!(
        a.head.contains("\r\nlocation: /?phase=running\r\n"),
        "{}",
        a.head
    );
    assert!(
        a.head.contains(&format!(
            "\r\nset-cookie: agentrun_console_{}={}; httponly; samesite=strict; path=/\r\n",
            c.port, c.token
        )),
        "{}",
        a.head
    );
    // With the cookie: the pages, the stream and the decision route answer.
    let runs = c.get_ok("/").await;
    assert!(runs.contains(r#"data-run="report""#), "{runs}");
    c.get_ok("/approvals").await;
    c.get_ok("/history").await;
    let event = first_event(c.port, "/events/runs", &c.cookie()).await;
    assert!(
        event.contains("200 OK") && event.contains("event: runs") && event.contains("report"),
        "{event}"
    );
    let (code, body) = raw(
        c.port,
        "POST",
        &decide,
        &format!(
            "Host: 127.0.0.1:{}\r\nHX-Request: true\r\n{}Content-Type: application/x-www-form-urlencoded\r\n",
            c.port,
            c.cookie()
        ),
        "decision=Approved",
    )
    .await;
    assert!(
        code == 200 && body.contains("reading approval nope") && body.contains("not found"),
        "the decision reached the API server as the user: HTTP {code}: {body}"
    );
    // In Chromium: the tokened URL leaves the address bar, and the page is live.
    let b = browser(&ns).await;
    b.goto(&c.at("approvals")).await;
    let href = b
        .wait_js(
            "the inbox, without the token in its address",
            PAGE_TIMEOUT,
            "return document.getElementById('whoami') && location.href",
        )
        .await;
    assert_eq!(href, format!("{}approvals", c.url));
    b.goto(&c.url).await;
    b.wait_js(
        "the live runs table",
        PAGE_TIMEOUT,
        "const e = document.getElementById('runs'); return e && e.getAttribute('data-live') === 'open' && document.querySelector('tr[data-run=\"report\"]') !== null",
    )
    .await;
    b.close().await;
    // Each start makes a new token: this one's cookie opens nothing there.
    let other = console(&ns, None).await;
    assert_ne!(other.token, c.token);
    let a = request(
        lo,
        other.port,
        "GET",
        "/",
        &format!("Cookie: agentrun_console_{}={}\r\n", other.port, c.token),
    )
    .await;
    assert_eq!(a.code, 401);
    s.finish().await;
}
