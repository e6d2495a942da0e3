//! One HTTP delivery: resolve, check every address, pin the connection to
//! the one checked, sign, post, and say what came of it. Redirects are not
//! followed (a redirect could lead anywhere the guard refuses); proxies from
//! the environment are not used (they would connect for us, unchecked); the
//! HTTP client resolves no name but the channel's, to the address checked.
//! A channel's URL is a credential (Slack and Teams webhooks are): what
//! comes back names the channel's host at most, and a refusing receiver's
//! body is read only up to [`BODY_LIMIT`].

use std::net::{IpAddr, SocketAddr};
use std::time::Duration as StdDuration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::channels::Channel;
pub use super::channels::{DELIVERY_HEADER, EVENT_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER};
use super::guard::Guard;

/// How long name resolution may take.
const RESOLVE_TIMEOUT: StdDuration = StdDuration::from_secs(5);
/// How much of a refusing receiver's body is read at most; the rest is
/// never read (a receiver cannot make the operator buffer without bound).
pub const BODY_LIMIT: usize = 8 * 1024;
/// How much of a refusing receiver's body is kept in `lastError`.
const BODY_EXCERPT: usize = 200;
/// What stands in for a channel's secret in any message.
pub const REDACTED: &str = "<redacted>";

/// What one attempt came to. Every message names the channel's host at
/// most: never its URL, path, query, credentials or header values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer.
    Delivered,
    /// Worth another attempt (5xx, 408, 429, a timeout, a connection
    /// error); `after`: what the receiver asked for with `Retry-After`.
    Retry {
        error: String,
        after: Option<StdDuration>,
    },
    /// Not worth another attempt (another 4xx, a redirect).
    Failed(String),
    /// The address may not be called.
    Refused(String),
}

impl Outcome {
    fn map_error(self, f: impl Fn(String) -> String) -> Outcome {
        match self {
            Outcome::Delivered => Outcome::Delivered,
            Outcome::Retry { error, after } => Outcome::Retry {
                error: f(error),
                after,
            },
            Outcome::Failed(e) => Outcome::Failed(f(e)),
            Outcome::Refused(e) => Outcome::Refused(f(e)),
        }
    }
}

/// A message ready to go.
pub struct Message<'a> {
    pub delivery_id: &'a str,
    pub event: &'a str,
    pub body: &'a [u8],
    pub content_type: &'static str,
}

/// `sha256=<hex>` over `<timestamp>.<body>`.
pub fn signature(key: &[u8], timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let bytes = mac.finalize().into_bytes();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// The host of `url` as a name to resolve or an address, without brackets.
fn host_of(url: &reqwest::Url) -> Option<(String, Option<IpAddr>)> {
    let host = url.host_str().filter(|h| !h.is_empty())?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    Some((bare.to_owned(), bare.parse::<IpAddr>().ok()))
}

/// The address to connect to: the first one resolved, provided every
/// address the name resolves to may be called (a name that also resolves
/// to an internal address is refused as a whole).
pub fn pick(guard: &Guard, host: &str, addrs: &[SocketAddr]) -> Result<SocketAddr, String> {
    let first = addrs
        .first()
        .copied()
        .ok_or_else(|| format!("{host} resolves to no address"))?;
    for a in addrs {
        guard.check(a.ip()).map_err(|why| {
            if host.parse::<IpAddr>().is_ok() {
                why
            } else {
                format!("{host}: {why}")
            }
        })?;
    }
    Ok(first)
}

async fn resolve(
    host: &str,
    literal: Option<IpAddr>,
    port: u16,
) -> Result<Vec<SocketAddr>, String> {
    if let Some(ip) = literal {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(addrs)) => Ok(addrs.collect()),
        Ok(Err(e)) => Err(format!("resolving {host}: {e}")),
        Err(_) => Err(format!("resolving {host}: timed out")),
    }
}

/// The HTTP client's only resolver: the one name of the channel, to the
/// one address checked. Any other name (none is expected: no redirects, no
/// proxies) resolves to nothing, so no connection goes anywhere unchecked.
struct Checked {
    host: String,
    addr: SocketAddr,
}

impl reqwest::dns::Resolve for Checked {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let found = name
            .as_str()
            .eq_ignore_ascii_case(&self.host)
            .then_some(self.addr);
        Box::pin(async move {
            match found {
                Some(addr) => Ok(Box::new(std::iter::once(addr)) as reqwest::dns::Addrs),
                None => Err("only the channel's checked address is resolved".into()),
            }
        })
    }
}

/// Whether `ip` is a loopback address in any form.
fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Posts `msg` to `channel`. Whatever comes back is said without the
/// channel's secrets (its URL, credentials, header values, key).
pub async fn send(channel: &Channel, guard: &Guard, msg: &Message<'_>) -> Outcome {
    let outcome = attempt(channel, guard, msg).await;
    outcome.map_error(|e| redact(channel, &e))
}

async fn attempt(channel: &Channel, guard: &Guard, msg: &Message<'_>) -> Outcome {
    let url = &channel.url;
    let Some((host, literal)) = host_of(url) else {
        return Outcome::Failed("the channel's url has no host".into());
    };
    let port = url.port_or_known_default().unwrap_or(443);
    let addrs = match resolve(&host, literal, port).await {
        Ok(a) => a,
        Err(e) => {
            return Outcome::Retry {
                error: e,
                after: None,
            };
        }
    };
    let addr = match pick(guard, &host, &addrs) {
        Ok(a) => a,
        Err(why) => return Outcome::Refused(why),
    };
    if url.scheme() == "http" && !channel.allow_http && !is_loopback(addr.ip()) {
        return Outcome::Refused(format!(
            "{host} is reached at {} over plain http; use https, or set allowHttp: true on the channel",
            addr.ip()
        ));
    }
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(channel.timeout)
        .connect_timeout(channel.timeout)
        .user_agent(concat!("agentrun-operator/", env!("CARGO_PKG_VERSION")));
    if let Some(pem) = &channel.ca_pem {
        match reqwest::Certificate::from_pem_bundle(pem) {
            Ok(certs) => builder = builder.tls_certs_only(certs),
            Err(e) => return Outcome::Failed(format!("caRef: {}", error_chain(&e.without_url()))),
        }
    }
    if let Some(pem) = &channel.client_identity_pem {
        match reqwest::Identity::from_pem(pem) {
            Ok(id) => builder = builder.identity(id),
            Err(e) => {
                return Outcome::Failed(format!(
                    "clientCertRef/clientKeyRef: {}",
                    error_chain(&e.without_url())
                ));
            }
        }
    }
    if literal.is_none() {
        // Connect to the address checked, whatever the name resolves to now.
        builder = builder.dns_resolver(std::sync::Arc::new(Checked {
            host: host.clone(),
            addr,
        }));
    }
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => {
            return Outcome::Failed(format!(
                "building the HTTP client: {}",
                error_chain(&e.without_url())
            ));
        }
    };
    let timestamp = jiff::Timestamp::now().as_second();
    let mut req = client
        .post(url.clone())
        .header(reqwest::header::CONTENT_TYPE, msg.content_type)
        .header(DELIVERY_HEADER, msg.delivery_id)
        .header(EVENT_HEADER, msg.event)
        .header(TIMESTAMP_HEADER, timestamp.to_string());
    if let Some(key) = &channel.hmac_key {
        req = req.header(SIGNATURE_HEADER, signature(key, timestamp, msg.body));
    }
    for (k, v) in &channel.headers {
        req = req.header(k, v);
    }
    let mut response = match req.body(msg.body.to_vec()).send().await {
        Ok(r) => r,
        Err(e) if e.is_timeout() => {
            return Outcome::Retry {
                error: format!("no answer from {host} within {:?}", channel.timeout),
                after: None,
            };
        }
        Err(e) => {
            // reqwest puts the request's URL in its errors: never kept.
            return Outcome::Retry {
                error: format!("{host}: {}", error_chain(&e.without_url())),
                after: None,
            };
        }
    };
    let status = response.status();
    if status.is_success() {
        return Outcome::Delivered;
    }
    if status.is_redirection() {
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|l| l.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let (to, target) = redirect_target(url, &location, guard).await;
        return Outcome::Failed(format!(
            "HTTP {} redirect to {to} not followed{target}: point the channel at the final URL",
            status.as_u16()
        ));
    }
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(StdDuration::from_secs);
    let body = read_bounded(&mut response, BODY_LIMIT).await;
    // Redacted before it is cut: a secret the cut splits would not match.
    let excerpt: String = redact(channel, &String::from_utf8_lossy(&body))
        .chars()
        .take(BODY_EXCERPT)
        .collect();
    let error = format!("HTTP {}: {}", status.as_u16(), excerpt.trim());
    match status.as_u16() {
        408 | 429 | 500..=599 => Outcome::Retry {
            error,
            after: retry_after,
        },
        _ => Outcome::Failed(error),
    }
}

/// At most `limit` bytes of the body; the rest is left unread (the
/// connection is dropped with the response).
async fn read_bounded(response: &mut reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    body
}

/// For the message about a redirect: where it points (its host only: a
/// redirect's path and query can be as secret as the channel's own) and
/// whether that host would be refused.
async fn redirect_target(base: &reqwest::Url, location: &str, guard: &Guard) -> (String, String) {
    let Ok(target) = base.join(location) else {
        return ("an unreadable location".to_owned(), String::new());
    };
    let Some((host, literal)) = host_of(&target) else {
        return ("a location without a host".to_owned(), String::new());
    };
    let port = target.port_or_known_default().unwrap_or(443);
    let to = format!(
        "{}://{}",
        target.scheme(),
        target.host_str().unwrap_or_default()
    );
    let refused = match resolve(&host, literal, port).await {
        Ok(addrs) => match pick(guard, &host, &addrs) {
            Err(why) => format!(" (and the target is refused: {why})"),
            Ok(_) => String::new(),
        },
        Err(_) => String::new(),
    };
    (to, refused)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// The parts of a channel that are secret: its URL (whole, and the path,
/// query and credentials on their own), its header values and its key.
fn secrets(channel: &Channel) -> Vec<String> {
    let url = &channel.url;
    let mut out = vec![url.as_str().to_owned()];
    let path = url.path();
    if path.len() > 1 {
        out.push(path.to_owned());
        out.push(path.trim_start_matches('/').to_owned());
    }
    if let Some(q) = url.query() {
        out.push(format!("{path}?{q}"));
        out.push(q.to_owned());
    }
    out.extend(url.password().map(str::to_owned));
    if !url.username().is_empty() {
        out.push(url.username().to_owned());
    }
    out.extend(channel.headers.iter().map(|(_, v)| v.clone()));
    out.extend(
        channel
            .hmac_key
            .as_deref()
            .and_then(|k| std::str::from_utf8(k).ok())
            .map(str::to_owned),
    );
    // Short values would blank out ordinary words; a secret is not short.
    out.retain(|s| s.len() >= 4);
    // Longest first, so a part never leaves the rest of the whole behind.
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out.dedup();
    out
}

/// `text` with every secret of `channel` replaced by [`REDACTED`].
pub fn redact(channel: &Channel, text: &str) -> String {
    let mut text = text.to_owned();
    for secret in secrets(channel) {
        text = text.replace(&secret, REDACTED);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_of_the_timestamp_a_dot_and_the_body() {
        // Known answers, computed with openssl, not with this code:
        //   printf '1700000000.{}' | openssl dgst -sha256 -hmac key
        assert_eq!(
            signature(b"key", 1_700_000_000, b"{}"),
            "sha256=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
        //   printf '1750000000.{"event":"requested"}' | openssl dgst -sha256 -hmac receiver-shared-secret
        assert_eq!(
            signature(
                b"receiver-shared-secret",
                1_750_000_000,
                br#"{"event":"requested"}"#
            ),
            "sha256=f069de562670af38334b99d645a72f433704066a3466d7a3a1e172bebdbe4541"
        );
    }

    #[test]
    fn a_name_that_resolves_inside_the_cluster_is_refused() {
        let g = Guard::default();
        let public: SocketAddr = "93.184.216.34:443".parse().unwrap();
        let private: SocketAddr = "10.0.0.5:443".parse().unwrap();
        assert_eq!(pick(&g, "hooks.example.com", &[public]), Ok(public));
        let err = pick(&g, "refunds.internal", &[private]).unwrap_err();
        assert_eq!(
            err,
            "refunds.internal: address 10.0.0.5 is private; the operator does not call it unless --notify-allow-cidr allows it"
        );
        // One internal address among public ones is enough to refuse.
        assert!(pick(&g, "mixed.example", &[public, private]).is_err());
        assert!(pick(&g, "nothing.example", &[]).is_err());
    }

    use std::collections::BTreeMap;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::notify::channels::{Channels, KEY};

    /// Loopback allowed, as `--notify-allow-cidr 127.0.0.1/32` does.
    fn loopback() -> Guard {
        Guard {
            allow: vec!["127.0.0.1/32".parse().unwrap()],
            services: vec![],
        }
    }

    fn channel(yaml_channel: &str) -> Channel {
        let data = BTreeMap::from([
            (
                KEY.to_owned(),
                format!("channels:\n- {yaml_channel}\n").into_bytes(),
            ),
            ("hmac".to_owned(), b"the-signing-key".to_vec()),
        ]);
        let c = Channels::parse("ops/chan", &data);
        c.get("c").cloned().unwrap_or_else(|p| panic!("{p:?}"))
    }

    fn message() -> Message<'static> {
        // As the notifier does when it starts.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Message {
            delivery_id: "u1.requested.c",
            event: "requested",
            body: b"{}",
            content_type: "application/json",
        }
    }

    /// A receiver on 127.0.0.1 that reads one request and answers with
    /// `head`, then writes `body` chunks for as long as it is read; returns
    /// its port and how many body bytes it got to write.
    async fn answering(
        head: String,
        body: Option<Vec<u8>>,
    ) -> (u16, tokio::task::JoinHandle<usize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let _ = s.read(&mut buf).await;
            s.write_all(head.as_bytes()).await.unwrap();
            let mut written = 0;
            if let Some(chunk) = body {
                let framed = [
                    format!("{:x}\r\n", chunk.len()).into_bytes(),
                    chunk,
                    b"\r\n".to_vec(),
                ]
                .concat();
                while written < 512 * 1024 * 1024 {
                    if s.write_all(&framed).await.is_err() {
                        break;
                    }
                    written += framed.len();
                }
            }
            written
        });
        (port, task)
    }

    #[tokio::test]
    async fn a_refusing_receivers_body_is_read_only_up_to_the_limit() {
        // 500, then a body that never ends.
        let (port, server) = answering(
            "HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n".into(),
            Some(vec![b'A'; 16 * 1024]),
        )
        .await;
        let c = channel(&format!(
            "{{name: c, url: 'http://127.0.0.1:{port}/hook', timeout: 20s}}"
        ));
        let started = std::time::Instant::now();
        let outcome = send(&c, &loopback(), &message()).await;
        assert!(
            started.elapsed() < StdDuration::from_secs(5),
            "the body was read until the request timed out ({:?})",
            started.elapsed()
        );
        assert_eq!(
            outcome,
            Outcome::Retry {
                error: format!("HTTP 500: {}", "A".repeat(BODY_EXCERPT)),
                after: None
            }
        );
        let written = server.await.unwrap();
        assert!(
            written < 64 * 1024 * 1024,
            "the receiver got to write {written} bytes"
        );
    }

    #[tokio::test]
    async fn no_message_carries_the_channels_url_or_secrets() {
        const SECRET_PATH: &str = "/services/T0001/B0002/XyZzY-webhook-token";
        // Nothing listens there: the connection error.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let c = channel(&format!(
            "{{name: c, url: 'http://127.0.0.1:{closed}{SECRET_PATH}?token=q-s3cret', headers: {{Authorization: Bearer hdr-s3cret}}}}"
        ));
        let refused = send(&c, &loopback(), &message()).await;
        // A receiver that echoes what it was called with, and one that
        // redirects to another secret URL.
        // The secret starts before the excerpt's end and runs past it.
        let said = format!(
            "{}no hook at {SECRET_PATH}?token=q-s3cret ok",
            ".".repeat(BODY_EXCERPT - 40)
        );
        let (echo, _) = answering(
            format!(
                "HTTP/1.1 404 Not Found\r\ncontent-length: {}\r\n\r\n{said}",
                said.len()
            ),
            None,
        )
        .await;
        let echoed = send(
            &channel(&format!(
                "{{name: c, url: 'http://127.0.0.1:{echo}{SECRET_PATH}?token=q-s3cret'}}"
            )),
            &loopback(),
            &message(),
        )
        .await;
        let (moved, _) = answering(
            "HTTP/1.1 301 Moved\r\nlocation: https://hooks.example/services/T9/B9/other-secret\r\ncontent-length: 0\r\n\r\n".into(),
            None,
        )
        .await;
        let redirected = send(
            &channel(&format!(
                "{{name: c, url: 'http://127.0.0.1:{moved}{SECRET_PATH}'}}"
            )),
            &loopback(),
            &message(),
        )
        .await;
        for (what, outcome) in [
            ("refused", &refused),
            ("echoed", &echoed),
            ("redirected", &redirected),
        ] {
            let text = format!("{outcome:?}");
            for secret in [
                "XyZzY",
                "q-s3cret",
                "hdr-s3cret",
                "other-secret",
                "/services/",
            ] {
                assert!(!text.contains(secret), "{what}: {secret} in {text}");
            }
        }
        match &refused {
            Outcome::Retry { error, .. } => {
                assert!(
                    error.starts_with("127.0.0.1: error sending request"),
                    "{error}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            echoed,
            Outcome::Failed(format!(
                "HTTP 404: {}no hook at {REDACTED} ok",
                ".".repeat(BODY_EXCERPT - 40)
            ))
        );
        assert_eq!(
            redirected,
            Outcome::Failed(
                "HTTP 301 redirect to https://hooks.example not followed: point the channel at the final URL".into()
            )
        );
        assert!(!format!("{c:?}").contains("XyZzY"), "{c:?}");
    }

    #[tokio::test]
    async fn plain_http_goes_to_loopback_only_unless_the_channel_allows_it() {
        // A name that resolves to a public address over http: refused at
        // the address actually connected to (the guard allows it here).
        let g = Guard {
            allow: vec!["0.0.0.0/0".parse().unwrap()],
            services: vec![],
        };
        let c = channel("{name: c, url: 'http://localhost:9/', timeout: 1s}");
        let mut public = c.clone();
        public.url = "http://93.184.216.34:9/".parse().unwrap();
        assert_eq!(
            send(&public, &g, &message()).await,
            Outcome::Refused(
                "93.184.216.34 is reached at 93.184.216.34 over plain http; use https, or set allowHttp: true on the channel".into()
            )
        );
    }
}
