//! The console tests' harness: the console process (local, as a user),
//! raw HTTP to it, and headless Chromium through chromedriver.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentrun_e2e::kubeconfig;
use agentrun_e2e::support::processes::{Process, free_port, log_dir, plugin_binary};
use agentrun_e2e::support::scenario::sim_step;
use fantoccini::{Client, ClientBuilder};
use serde_json::{Value, json};

use super::PAGE_TIMEOUT;

/// A program on PATH, or a panic that says how to install it.
pub(super) fn required(program: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{program} not found on PATH: the console tests need it; run `e2e/cluster browser` (apt-get install chromium chromium-driver)")
        })
}

/// The console, started as `user` (none: the plane's admin) in `ns`.
pub(super) struct Console {
    pub(super) _process: Process,
    /// `http://127.0.0.1:PORT/`, without the session's token.
    pub(super) url: String,
    pub(super) port: u16,
    /// The session's token, from the URL the console printed.
    pub(super) token: String,
}

impl Console {
    /// `path` (relative to the root) with the session's token: the console
    /// trades it for its cookie and sends the browser on to `path`.
    pub(super) fn at(&self, path: &str) -> String {
        let sep = if path.contains('?') { '&' } else { '?' };
        format!("{}{path}{sep}token={}", self.url, self.token)
    }

    /// The `Cookie` header line the console's redirect sets.
    pub(super) fn cookie(&self) -> String {
        format!("Cookie: agentrun_console_{}={}\r\n", self.port, self.token)
    }

    /// GET `path` with the session's cookie: the status code and the body.
    pub(super) async fn get(&self, path: &str) -> (u16, String) {
        raw(
            self.port,
            "GET",
            path,
            &format!("Host: 127.0.0.1:{}\r\n{}", self.port, self.cookie()),
            "",
        )
        .await
    }

    /// GET `path` with the session's cookie, which must answer 200.
    pub(super) async fn get_ok(&self, path: &str) -> String {
        match self.get(path).await {
            (200, body) => body,
            (code, body) => panic!("GET {path}: HTTP {code}: {body}"),
        }
    }
}

pub(super) async fn console(ns: &str, user: Option<&str>) -> Console {
    console_with(ns, user, &["-n", ns]).await
}

/// The console with `extra` arguments (no `-n`: all namespaces it may list)
/// on a port of its choosing; its log goes to `ns`'s scenario directory.
pub(super) async fn console_with(ns: &str, user: Option<&str>, extra: &[&str]) -> Console {
    let mut cmd = tokio::process::Command::new(plugin_binary());
    cmd.arg("--kubeconfig").arg(kubeconfig());
    if let Some(u) = user {
        cmd.args(["--as", u]);
    }
    cmd.arg("console").args(extra);
    let (process, printed) = started(ns, user.unwrap_or("admin"), cmd).await;
    let (base, token) = printed
        .split_once("?token=")
        .unwrap_or_else(|| panic!("the console printed no token: {printed}"));
    let port = base
        .trim_start_matches("http://127.0.0.1:")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|_| panic!("the console printed no loopback port: {printed}"));
    Console {
        _process: process,
        url: base.to_owned(),
        port,
        token: token.to_owned(),
    }
}

/// Starts `cmd` (a console) logging to a file named after `who`, and waits
/// for the URL it prints.
pub(super) async fn started(
    ns: &str,
    who: &str,
    cmd: tokio::process::Command,
) -> (Process, String) {
    static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = log_dir(ns).join(format!("console-{}-{n}.log", who.replace(':', "_")));
    let process =
        Process::start("console", cmd, log.clone()).expect("starting kubectl-agentrun console");
    let deadline = Instant::now() + PAGE_TIMEOUT;
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(url) = text
            .lines()
            .find_map(|l| l.strip_prefix("console: "))
            .and_then(|l| l.split_whitespace().next())
            .filter(|u| u.starts_with("http://"))
        {
            return (process, url.to_owned());
        }
        assert!(
            Instant::now() < deadline,
            "the console printed no URL within {PAGE_TIMEOUT:?}\n{}",
            process.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A raw HTTP/1.0 request to the console: the status code and the body.
pub(super) async fn raw(
    port: u16,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connecting to the console");
    let req = format!(
        "{method} {path} HTTP/1.0\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, body.to_owned())
}

/// A raw HTTP/1.0 POST of a decision to the console with `headers`: the
/// status code.
pub(super) async fn post(port: u16, path: &str, headers: &str) -> u16 {
    let headers = format!("{headers}Content-Type: application/x-www-form-urlencoded\r\n");
    raw(port, "POST", path, &headers, "decision=Approved")
        .await
        .0
}

/// Headless Chromium through a chromedriver of its own.
pub(super) struct Browser {
    pub(super) client: Client,
    _driver: Process,
}

pub(super) async fn browser(ns: &str) -> Browser {
    let chromium = required("chromium");
    let port = free_port();
    let mut cmd = tokio::process::Command::new(required("chromedriver"));
    cmd.arg(format!("--port={port}"));
    let driver = Process::start("chromedriver", cmd, log_dir(ns).join("chromedriver.log"))
        .expect("starting chromedriver");
    let caps: serde_json::Map<String, Value> = serde_json::from_value(json!({
        "goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1280,900", "--hide-scrollbars"],
        }
    }))
    .unwrap();
    let deadline = Instant::now() + PAGE_TIMEOUT;
    loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(client) => {
                return Browser {
                    client,
                    _driver: driver,
                };
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!(
                "no Chromium session through chromedriver within {PAGE_TIMEOUT:?}: {e}\n{}",
                driver.log_tail(40)
            ),
        }
    }
}

impl Browser {
    pub(super) async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("opening {url}: {e}"));
    }

    /// Evaluates `js` (a function body returning a value) until it returns
    /// something other than null/false, or panics saying `what`.
    pub(super) async fn wait_js(&self, what: &str, timeout: Duration, js: &str) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.client.execute(js, vec![]).await.unwrap_or(Value::Null);
            if !(v.is_null() || v == Value::Bool(false)) {
                return v;
            }
            if Instant::now() >= deadline {
                let body = self
                    .client
                    .execute("return document.body.innerText", vec![])
                    .await
                    .unwrap_or_default();
                panic!("timed out after {timeout:?} waiting for {what}; the page reads:\n{body}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(super) async fn screenshot(&self, file: &str) {
        let Some(dir) = std::env::var_os("AGENTRUN_CONSOLE_SCREENSHOTS") else {
            return;
        };
        let png = self.client.screenshot().await.expect("a screenshot");
        std::fs::write(PathBuf::from(dir).join(file), png).expect("writing the screenshot");
    }

    pub(super) async fn close(self) {
        let _ = self.client.close().await;
    }
}

pub(super) fn gated(step: &str) -> Value {
    let mut s = sim_step(step, "NonIdempotent", json!({}));
    s["approval"] =
        json!({"question": format!("May {step} run?"), "approvers": {"users": ["alice"]}});
    s
}
