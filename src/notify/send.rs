//! One HTTP delivery: resolve, check every address, pin the connection to
//! the one checked, sign, post, and say what came of it. Redirects are not
//! followed (a redirect could lead anywhere the guard refuses); proxies from
//! the environment are not used (they would connect for us, unchecked).

use std::net::SocketAddr;
use std::time::Duration as StdDuration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::channels::Channel;
use super::guard::Guard;

/// The delivery id, stable across retries and restarts.
pub const DELIVERY_HEADER: &str = "x-agentrun-delivery";
/// `sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">`, with the channel's key.
pub const SIGNATURE_HEADER: &str = "x-agentrun-signature";
/// Unix seconds when the request was signed; receivers refuse old ones.
pub const TIMESTAMP_HEADER: &str = "x-agentrun-timestamp";
/// `requested`, `escalated`, `decided` or `expired`.
pub const EVENT_HEADER: &str = "x-agentrun-event";
/// How long name resolution may take.
const RESOLVE_TIMEOUT: StdDuration = StdDuration::from_secs(5);
/// How much of a refusing receiver's body is kept in `lastError`.
const BODY_EXCERPT: usize = 200;

/// What one attempt came to.
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
            if host.parse::<std::net::IpAddr>().is_ok() {
                why
            } else {
                format!("{host}: {why}")
            }
        })?;
    }
    Ok(first)
}

async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
    if let Ok(ip) = host.trim_matches(['[', ']']).parse::<std::net::IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(addrs)) => Ok(addrs.collect()),
        Ok(Err(e)) => Err(format!("resolving {host}: {e}")),
        Err(_) => Err(format!("resolving {host}: timed out")),
    }
}

/// Posts `msg` to `channel`.
pub async fn send(channel: &Channel, guard: &Guard, msg: &Message<'_>) -> Outcome {
    let url = &channel.url;
    let host = url.host_str().unwrap_or_default().to_owned();
    let port = url.port_or_known_default().unwrap_or(443);
    let addrs = match resolve(&host, port).await {
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
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(channel.timeout)
        .connect_timeout(channel.timeout)
        .user_agent(concat!("agentrun-operator/", env!("CARGO_PKG_VERSION")));
    if let Some(pem) = &channel.ca_pem {
        match reqwest::Certificate::from_pem_bundle(pem) {
            Ok(certs) => builder = builder.tls_certs_only(certs),
            Err(e) => return Outcome::Failed(format!("caRef: {e}")),
        }
    }
    if host.parse::<std::net::IpAddr>().is_err() {
        // Connect to the address checked, whatever the name resolves to now.
        builder = builder.resolve(&host, addr);
    }
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => return Outcome::Failed(format!("building the HTTP client: {e}")),
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
    let response = match req.body(msg.body.to_vec()).send().await {
        Ok(r) => r,
        Err(e) if e.is_timeout() => {
            return Outcome::Retry {
                error: format!("no answer from {host} within {:?}", channel.timeout),
                after: None,
            };
        }
        Err(e) => {
            return Outcome::Retry {
                error: format!("{}: {}", host, error_chain(&e)),
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
        let target = redirect_target(url, &location, guard).await;
        return Outcome::Failed(format!(
            "HTTP {} redirect to {location:?} not followed{target}: point the channel at the final URL",
            status.as_u16()
        ));
    }
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(StdDuration::from_secs);
    let body = response.text().await.unwrap_or_default();
    let excerpt: String = body.chars().take(BODY_EXCERPT).collect();
    let error = format!("HTTP {}: {}", status.as_u16(), excerpt.trim());
    match status.as_u16() {
        408 | 429 | 500..=599 => Outcome::Retry {
            error,
            after: retry_after,
        },
        _ => Outcome::Failed(error),
    }
}

/// For the message about a redirect: whether its target would be refused.
async fn redirect_target(base: &reqwest::Url, location: &str, guard: &Guard) -> String {
    let Ok(target) = base.join(location) else {
        return String::new();
    };
    let host = target.host_str().unwrap_or_default().to_owned();
    let port = target.port_or_known_default().unwrap_or(443);
    match resolve(&host, port).await {
        Ok(addrs) => match pick(guard, &host, &addrs) {
            Err(why) => format!(" (and the target is refused: {why})"),
            Ok(_) => String::new(),
        },
        Err(_) => String::new(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_covers_the_timestamp_and_the_body() {
        // Known answer: HMAC-SHA256("key", "1700000000.{}").
        let s = signature(b"key", 1_700_000_000, b"{}");
        assert!(s.starts_with("sha256="), "{s}");
        assert_eq!(s.len(), "sha256=".len() + 64);
        assert_ne!(s, signature(b"key", 1_700_000_001, b"{}"));
        assert_ne!(s, signature(b"key", 1_700_000_000, b"{ }"));
        assert_ne!(s, signature(b"other", 1_700_000_000, b"{}"));
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
}
