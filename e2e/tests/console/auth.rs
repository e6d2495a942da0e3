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

/// `--open` with `xdg-open` stubbed on PATH by a script that records what
/// the kernel shows of it: its arguments hold no token (nor does any
/// process's on the machine), only the `file://` address of a page in a
/// directory only its owner may enter, which sends the browser on with the
/// token and is removed once the token is traded for the cookie.
#[tokio::test]
async fn open_gives_the_browser_a_private_page_and_no_process_the_token() {
    use std::os::unix::fs::PermissionsExt;
    let s = Scenario::start_without_operator("console-open").await;
    let ns = s.namespace().to_owned();
    let dir = agentrun_e2e::support::processes::log_dir(&ns);
    let (stubs, seen, runtime) = (dir.join("stubs"), dir.join("seen"), dir.join("runtime"));
    for d in [&stubs, &seen, &runtime] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o700)).unwrap();
    let opener = stubs.join("xdg-open");
    std::fs::write(
        &opener,
        format!(
            r#"#!/bin/sh
out='{}'
tr '\0' ' ' < /proc/$$/cmdline > "$out/cmdline.tmp"
f=$(printf '%s' "$1" | sed 's|^file://||')
stat -c '%a' "$f" > "$out/file-mode"
stat -c '%a' "$(dirname "$f")" > "$out/dir-mode"
cp "$f" "$out/page.html"
printf '%s' "$f" > "$out/path"
mv "$out/cmdline.tmp" "$out/cmdline"
"#,
            seen.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&opener, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        stubs.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = tokio::process::Command::new(agentrun_e2e::support::processes::plugin_binary());
    cmd.arg("--kubeconfig")
        .arg(agentrun_e2e::kubeconfig())
        .args(["console", "-n", &ns, "--open"])
        .env("PATH", path)
        .env("XDG_RUNTIME_DIR", &runtime);
    let (_process, printed) = super::started(&ns, "open", cmd).await;
    let (base, token) = printed
        .split_once("?token=")
        .unwrap_or_else(|| panic!("the console printed no token: {printed}"));
    assert_eq!(token.len(), 64, "{printed}");

    let recorded = seen.join("cmdline");
    let deadline = Instant::now() + PAGE_TIMEOUT;
    while !recorded.exists() {
        assert!(Instant::now() < deadline, "the opener never ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let argv = std::fs::read_to_string(&recorded).unwrap();
    assert!(!argv.contains(token), "the opener's arguments: {argv}");
    assert!(
        argv.contains(&format!("file://{}", runtime.display())),
        "{argv}"
    );
    // Nothing on the machine shows the token in its arguments.
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline);
            assert!(
                !cmdline.contains(token),
                "{}: {cmdline}",
                entry.path().display()
            );
        }
    }
    let read = |f: &str| std::fs::read_to_string(seen.join(f)).unwrap();
    assert_eq!(
        (read("file-mode").trim(), read("dir-mode").trim()),
        ("600", "700")
    );
    let page = read("page.html");
    assert!(
        page.contains(&format!(r#"content="0;url={base}?token={token}""#)),
        "{page}"
    );
    // The browser trades the token: the page and its directory go.
    let port: u16 = base
        .trim_start_matches("http://127.0.0.1:")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let a = request([127, 0, 0, 1], port, "GET", &format!("/?token={token}"), "").await;
    assert_eq!(a.code, 303, "{}", a.head);
    let file = std::path::PathBuf::from(read("path"));
    let deadline = Instant::now() + PAGE_TIMEOUT;
    while file.exists() || file.parent().is_some_and(|d| d.exists()) {
        assert!(
            Instant::now() < deadline,
            "{} is still there",
            file.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.finish().await;
}
