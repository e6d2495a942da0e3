//! The notification channels, as the platform team configures them in the
//! operator's channel Secret (key `channels.yaml`):
//!
//! ```yaml
//! channels:
//!   - name: payments-oncall          # what steps[].approval.notify names
//!     url: https://hooks.example.com/agentrun
//!     format: json                   # json (default) | slack | msteams
//!     hmacKeyRef: payments-hmac      # a key of the same Secret: signs each body
//!     caRef: payments-ca.pem         # a key of the same Secret: the only CAs trusted
//!     clientCertRef: payments.crt    # keys of the same Secret: a client certificate
//!     clientKeyRef: payments.key     #   and its key (PEM), presented to the receiver
//!     allowHttp: false               # plain http to a host that is not loopback
//!     headers: {X-Team: payments}    # extra request headers
//!     default: true                  # told about every approval
//!     timeout: 10s                   # per request (default 10s)
//!     maxAttempts: 8                 # before a delivery is given up (default 8)
//! ```
//!
//! Each channel is read on its own: one that is wrong (a bad URL, a missing
//! signing key) is reported for the approvals that name it while the others
//! deliver.

use std::collections::BTreeMap;
use std::time::Duration as StdDuration;

use serde::Deserialize;

use crate::api::Duration;

/// The key of the channel Secret that holds the channel list.
pub const KEY: &str = "channels.yaml";
/// Request timeout when a channel names none.
pub const DEFAULT_TIMEOUT: StdDuration = StdDuration::from_secs(10);
/// Attempts before a delivery is given up when a channel names none.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 8;
/// The headers of every delivery (`send`).
/// The delivery id, stable across retries and restarts.
pub const DELIVERY_HEADER: &str = "x-agentrun-delivery";
/// `sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">`, with the channel's key.
pub const SIGNATURE_HEADER: &str = "x-agentrun-signature";
/// Unix seconds when the request was signed; receivers refuse old ones.
pub const TIMESTAMP_HEADER: &str = "x-agentrun-timestamp";
/// `requested`, `escalated`, `decided` or `expired`.
pub const EVENT_HEADER: &str = "x-agentrun-event";
/// Headers the operator sets itself; a channel cannot replace them.
const RESERVED_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "host",
    "user-agent",
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    EVENT_HEADER,
];

/// How a message is laid out for its receiver.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// The documented JSON document (docs/notifications.md).
    #[default]
    Json,
    /// A Slack incoming-webhook message (text and blocks).
    Slack,
    /// A Microsoft Teams workflow message (an Adaptive Card).
    Msteams,
}

/// One channel, ready to send to. Its URL, headers and keys are secrets:
/// `Debug` shows none of them.
#[derive(Clone, PartialEq)]
pub struct Channel {
    pub name: String,
    pub url: reqwest::Url,
    pub format: Format,
    /// The HMAC-SHA256 key, when bodies are signed.
    pub hmac_key: Option<Vec<u8>>,
    /// PEM certificates: the only roots trusted for this channel's HTTPS
    /// (a receiver with a private CA). `None`: the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM client certificate chain and private key, presented to the
    /// receiver (mutual TLS).
    pub client_identity_pem: Option<Vec<u8>>,
    /// Plain http to a host that is not loopback is allowed.
    pub allow_http: bool,
    pub headers: Vec<(String, String)>,
    pub default: bool,
    pub timeout: StdDuration,
    pub max_attempts: u32,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("name", &self.name)
            .field("host", &self.url.host_str())
            .field("format", &self.format)
            .field("signed", &self.hmac_key.is_some())
            .field("custom_ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.client_identity_pem.is_some())
            .field("allow_http", &self.allow_http)
            .field(
                "headers",
                &self.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("default", &self.default)
            .field("timeout", &self.timeout)
            .field("max_attempts", &self.max_attempts)
            .finish()
    }
}

/// The channels as the Secret last said.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Channels {
    /// `namespace/name` of the Secret, for messages.
    pub source: String,
    /// Every channel named in the file, or why it cannot be used.
    channels: BTreeMap<String, Result<Channel, String>>,
    /// Why nothing could be read (no Secret, no key, not YAML).
    problem: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    channels: Vec<serde_yaml::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Spec {
    name: String,
    url: String,
    #[serde(default)]
    format: Format,
    #[serde(default)]
    hmac_key_ref: Option<String>,
    #[serde(default)]
    ca_ref: Option<String>,
    #[serde(default)]
    client_cert_ref: Option<String>,
    #[serde(default)]
    client_key_ref: Option<String>,
    #[serde(default)]
    allow_http: bool,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    default: bool,
    #[serde(default)]
    timeout: Option<Duration>,
    #[serde(default)]
    max_attempts: Option<u32>,
}

impl Channels {
    /// No channel can be used, and why (shown on every approval that
    /// would be notified).
    pub fn unusable(source: &str, problem: impl Into<String>) -> Channels {
        Channels {
            source: source.to_owned(),
            channels: BTreeMap::new(),
            problem: Some(problem.into()),
        }
    }

    /// Reads the channel Secret's data.
    pub fn parse(source: &str, data: &BTreeMap<String, Vec<u8>>) -> Channels {
        let Some(file) = data.get(KEY) else {
            let keys = data.keys().cloned().collect::<Vec<_>>().join(", ");
            return Channels::unusable(
                source,
                format!("Secret {source} has no key {KEY} (keys: {keys})"),
            );
        };
        let file: File = match serde_yaml::from_slice(file) {
            Ok(f) => f,
            Err(e) => {
                return Channels::unusable(source, format!("{KEY} in Secret {source}: {e}"));
            }
        };
        let mut channels = BTreeMap::new();
        for (i, value) in file.channels.into_iter().enumerate() {
            let name = value
                .get("name")
                .and_then(|n| n.as_str())
                .map(str::to_owned);
            let parsed = serde_yaml::from_value::<Spec>(value)
                .map_err(|e| e.to_string())
                .and_then(|spec| channel(spec, data));
            match name {
                None => {
                    tracing::warn!(source, index = i, "a notification channel has no name");
                }
                Some(name) if channels.contains_key(&name) => {
                    channels.insert(
                        name.clone(),
                        Err(format!("channel {name} is defined more than once")),
                    );
                }
                Some(name) => {
                    channels.insert(
                        name.clone(),
                        parsed.map_err(|e| format!("channel {name} in Secret {source}: {e}")),
                    );
                }
            }
        }
        Channels {
            source: source.to_owned(),
            channels,
            problem: None,
        }
    }

    /// The channel `name`, or why it cannot be sent to.
    pub fn get(&self, name: &str) -> Result<&Channel, Problem> {
        if let Some(p) = &self.problem {
            return Err(Problem::Unreadable(p.clone()));
        }
        match self.channels.get(name) {
            Some(Ok(c)) => Ok(c),
            Some(Err(e)) => Err(Problem::Invalid(e.clone())),
            None => {
                let known = self.channels.keys().cloned().collect::<Vec<_>>();
                let known = if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                };
                Err(Problem::Unknown(format!(
                    "channel {name} is not configured in Secret {} (channels: {known})",
                    self.source
                )))
            }
        }
    }

    /// The channels told about every approval.
    pub fn defaults(&self) -> impl Iterator<Item = &str> {
        self.channels
            .iter()
            .filter(|(_, c)| c.as_ref().is_ok_and(|c| c.default))
            .map(|(n, _)| n.as_str())
    }
}

/// Why a channel cannot be sent to. The kind is the reason of the
/// approval's `Notified` condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// The Secret is missing or unreadable.
    Unreadable(String),
    /// The channel is configured wrongly.
    Invalid(String),
    /// No channel of that name is configured.
    Unknown(String),
}

impl Problem {
    pub fn message(&self) -> &str {
        match self {
            Problem::Unreadable(m) | Problem::Invalid(m) | Problem::Unknown(m) => m,
        }
    }
}

/// Whether `url`'s host is loopback by its very name or address. An
/// IPv4-mapped loopback (`::ffff:127.0.0.1`) is one: a dual-stack socket
/// delivers it to 127.0.0.1. An IPv4-compatible one (`::127.0.0.1`) is not.
fn loopback_host(url: &reqwest::Url) -> bool {
    let host = url.host_str().unwrap_or_default();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// A key of the channel Secret, not empty.
fn key<'a>(
    data: &'a BTreeMap<String, Vec<u8>>,
    field: &str,
    key: &str,
) -> Result<&'a Vec<u8>, String> {
    match data.get(key) {
        Some(k) if !k.is_empty() => Ok(k),
        Some(_) => Err(format!("{field} {key}: the key is empty")),
        None => Err(format!("{field} {key}: the Secret has no such key")),
    }
}

/// One channel. The URL is a credential: no message quotes it.
fn channel(spec: Spec, data: &BTreeMap<String, Vec<u8>>) -> Result<Channel, String> {
    let url = reqwest::Url::parse(&spec.url).map_err(|e| format!("url: {e}"))?;
    if !matches!(url.scheme(), "https" | "http") {
        return Err(format!(
            "url: the scheme must be https (or http), not {}",
            url.scheme()
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("url: it has no host".to_owned());
    }
    if url.scheme() == "http" && !spec.allow_http && !loopback_host(&url) {
        return Err(format!(
            "url: plain http to {} (not loopback) is refused; use https, or set allowHttp: true",
            url.host_str().unwrap_or_default()
        ));
    }
    let hmac_key = match &spec.hmac_key_ref {
        None => None,
        Some(k) => Some(key(data, "hmacKeyRef", k)?.clone()),
    };
    let ca_pem = match &spec.ca_ref {
        None => None,
        Some(key) => {
            let pem = data
                .get(key)
                .ok_or_else(|| format!("caRef {key}: the Secret has no such key"))?;
            match reqwest::Certificate::from_pem_bundle(pem) {
                Ok(certs) if !certs.is_empty() => Some(pem.clone()),
                Ok(_) => return Err(format!("caRef {key}: no PEM certificate in it")),
                Err(e) => return Err(format!("caRef {key}: {e}")),
            }
        }
    };
    if ca_pem.is_some() && url.scheme() != "https" {
        return Err("caRef is for an https url".to_owned());
    }
    let client_identity_pem = match (&spec.client_cert_ref, &spec.client_key_ref) {
        (None, None) => None,
        (Some(cert), Some(private)) => {
            let mut pem = key(data, "clientCertRef", cert)?.clone();
            pem.push(b'\n');
            pem.extend_from_slice(key(data, "clientKeyRef", private)?);
            // Never quote the parser's error: it may carry the key's bytes.
            if reqwest::Identity::from_pem(&pem).is_err() {
                return Err(format!(
                    "clientCertRef {cert} and clientKeyRef {private}: not a PEM certificate and a PEM private key"
                ));
            }
            Some(pem)
        }
        _ => return Err("clientCertRef and clientKeyRef go together".to_owned()),
    };
    if client_identity_pem.is_some() && url.scheme() != "https" {
        return Err("clientCertRef is for an https url".to_owned());
    }
    let mut headers = Vec::new();
    for (name, value) in spec.headers {
        if RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
            return Err(format!("header {name} is set by the operator"));
        }
        reqwest::header::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header {name:?} is not a valid header name"))?;
        reqwest::header::HeaderValue::from_str(&value)
            .map_err(|_| format!("header {name}: the value is not a valid header value"))?;
        headers.push((name, value));
    }
    let timeout = match spec.timeout {
        None => DEFAULT_TIMEOUT,
        Some(d) => {
            let d = d.parse().map_err(|e| format!("timeout: {e}"))?;
            StdDuration::try_from(d).map_err(|_| "timeout must be positive".to_owned())?
        }
    };
    let max_attempts = spec.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
    if !(1..=20).contains(&max_attempts) {
        return Err(format!("maxAttempts {max_attempts}: between 1 and 20"));
    }
    Ok(Channel {
        name: spec.name,
        url,
        format: spec.format,
        hmac_key,
        ca_pem,
        client_identity_pem,
        allow_http: spec.allow_http,
        headers,
        default: spec.default,
        timeout,
        max_attempts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(yaml: &str) -> BTreeMap<String, Vec<u8>> {
        BTreeMap::from([
            (KEY.to_owned(), yaml.as_bytes().to_vec()),
            ("hmac".to_owned(), b"s3cret".to_vec()),
        ])
    }

    #[test]
    fn every_field_is_read() {
        let c = Channels::parse(
            "ops/chan",
            &data(
                "channels:\n- name: a\n  url: https://h.example/x\n  format: slack\n  hmacKeyRef: hmac\n  headers: {X-Team: pay}\n  default: true\n  timeout: 2s\n  maxAttempts: 3\n",
            ),
        );
        let a = c.get("a").unwrap();
        assert_eq!(a.format, Format::Slack);
        assert_eq!(a.hmac_key.as_deref(), Some(&b"s3cret"[..]));
        assert_eq!(a.headers, vec![("X-Team".to_owned(), "pay".to_owned())]);
        assert_eq!(a.timeout, StdDuration::from_secs(2));
        assert_eq!(a.max_attempts, 3);
        assert_eq!(c.defaults().collect::<Vec<_>>(), vec!["a"]);
    }

    #[test]
    fn a_wrong_channel_does_not_take_the_others_down() {
        let c = Channels::parse(
            "ops/chan",
            &data(
                "channels:\n- name: good\n  url: https://h.example/\n- name: nokey\n  url: https://h.example/\n  hmacKeyRef: missing\n- name: badurl\n  url: ftp://h.example/\n- name: typo\n  url: https://h.example/\n  formatt: json\n",
            ),
        );
        assert!(c.get("good").is_ok());
        let err = |n| c.get(n).unwrap_err();
        assert_eq!(
            err("nokey"),
            Problem::Invalid(
                "channel nokey in Secret ops/chan: hmacKeyRef missing: the Secret has no such key"
                    .into()
            )
        );
        assert!(err("badurl").message().contains("the scheme must be https"));
        assert!(err("typo").message().contains("unknown field `formatt`"));
        assert_eq!(
            err("nope"),
            Problem::Unknown(
                "channel nope is not configured in Secret ops/chan (channels: badurl, good, nokey, typo)"
                    .into()
            )
        );
    }

    #[test]
    fn an_unreadable_file_is_said_for_every_channel() {
        let c = Channels::parse("ops/chan", &data("channels: [unterminated"));
        match c.get("any") {
            Err(Problem::Unreadable(m)) => {
                assert!(m.starts_with("channels.yaml in Secret ops/chan:"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        let none = Channels::parse("ops/chan", &BTreeMap::new());
        assert_eq!(
            none.get("x"),
            Err(Problem::Unreadable(
                "Secret ops/chan has no key channels.yaml (keys: )".into()
            ))
        );
    }

    #[test]
    fn a_ca_must_be_pem_and_for_https() {
        let mut d = data(
            "channels:\n- {name: a, url: 'https://h.example/', caRef: ca}\n- {name: b, url: 'https://h.example/', caRef: nope}\n- {name: c, url: 'http://h.example/', caRef: ca}\n",
        );
        d.insert("ca".into(), b"not a certificate".to_vec());
        let c = Channels::parse("ops/chan", &d);
        assert!(
            c.get("a")
                .unwrap_err()
                .message()
                .contains("caRef ca: no PEM certificate"),
            "{:?}",
            c.get("a")
        );
        assert!(
            c.get("b")
                .unwrap_err()
                .message()
                .contains("caRef nope: the Secret has no such key")
        );
        assert!(c.get("c").is_err());
    }

    #[test]
    fn reserved_headers_and_duplicates_are_refused() {
        let c = Channels::parse(
            "ops/chan",
            &data(
                "channels:\n- name: a\n  url: https://h.example/\n  headers: {X-AgentRun-Signature: forged}\n- name: b\n  url: https://h.example/\n- name: b\n  url: https://h.example/\n",
            ),
        );
        assert!(
            c.get("a")
                .unwrap_err()
                .message()
                .contains("is set by the operator")
        );
        assert!(
            c.get("b")
                .unwrap_err()
                .message()
                .contains("defined more than once")
        );
    }

    #[test]
    fn plain_http_is_for_loopback_or_a_channel_that_says_so() {
        let c = Channels::parse(
            "ops/chan",
            &data(
                "channels:\n- {name: remote, url: 'http://hooks.example/x'}\n- {name: optin, url: 'http://hooks.example/x', allowHttp: true}\n- {name: local, url: 'http://127.0.0.1:9/x'}\n- {name: named, url: 'http://localhost:9/x'}\n- {name: v6, url: 'http://[::1]:9/x'}\n- {name: mapped, url: 'http://[::ffff:127.0.0.1]:9/x'}\n- {name: compat, url: 'http://[::127.0.0.1]:9/x'}\n",
            ),
        );
        assert_eq!(
            c.get("remote").unwrap_err().message(),
            "channel remote in Secret ops/chan: url: plain http to hooks.example (not loopback) is refused; use https, or set allowHttp: true"
        );
        assert!(c.get("optin").unwrap().allow_http);
        for n in ["local", "named", "v6", "mapped"] {
            assert!(c.get(n).is_ok(), "{n}: {:?}", c.get(n));
        }
        // ::/96 (IPv4-compatible, deprecated) is not routed to loopback: not exempt.
        assert!(
            c.get("compat")
                .unwrap_err()
                .message()
                .contains("(not loopback) is refused"),
            "{:?}",
            c.get("compat")
        );
    }

    #[test]
    fn no_problem_quotes_the_url_and_debug_hides_it() {
        let c = Channels::parse(
            "ops/chan",
            &data(
                "channels:\n- {name: a, url: 'ftp://h.example/services/T0/s3cret'}\n- {name: b, url: 'https://h.example:99999/services/s3cret'}\n- {name: ok, url: 'https://user:pw-s3cret@h.example/services/s3cret', headers: {Authorization: Bearer s3cret}}\n",
            ),
        );
        for n in ["a", "b"] {
            let m = c.get(n).unwrap_err().message().to_owned();
            assert!(!m.contains("s3cret") && !m.contains("h.example/"), "{m}");
        }
        let dbg = format!("{:?}", c);
        assert!(!dbg.contains("s3cret"), "{dbg}");
        assert!(dbg.contains("h.example"), "{dbg}");
    }

    #[test]
    fn a_client_certificate_comes_with_its_key_for_https() {
        let mut d = data(
            "channels:\n- {name: half, url: 'https://h.example/', clientCertRef: crt}\n- {name: junk, url: 'https://h.example/', clientCertRef: crt, clientKeyRef: key}\n- {name: nokey, url: 'https://h.example/', clientCertRef: crt, clientKeyRef: nope}\n",
        );
        d.insert("crt".into(), b"not a certificate".to_vec());
        d.insert(
            "key".into(),
            b"-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END PRIVATE KEY-----\n"
                .to_vec(),
        );
        let c = Channels::parse("ops/chan", &d);
        let err = |n| c.get(n).unwrap_err().message().to_owned();
        assert!(
            err("half").ends_with("clientCertRef and clientKeyRef go together"),
            "{}",
            err("half")
        );
        assert!(
            err("junk").ends_with("clientCertRef crt and clientKeyRef key: not a PEM certificate and a PEM private key"),
            "{}",
            err("junk")
        );
        assert!(!err("junk").contains("c2VjcmV0"), "{}", err("junk"));
        assert!(
            err("nokey").ends_with("clientKeyRef nope: the Secret has no such key"),
            "{}",
            err("nokey")
        );
    }
}
