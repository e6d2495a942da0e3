//! The journal's only I/O: get, create and update one `StepJournal` chunk on
//! the API server, as the step Pod's own bound ServiceAccount token.
//!
//! ```text
//!   Journal ──GET/POST/PUT──▶ https://$KUBERNETES_SERVICE_HOST:$PORT
//!            /apis/agentrun.dev/v1alpha1/namespaces/<ns>/stepjournals/<name>
//!            Authorization: Bearer <AGENTRUN_JOURNAL_TOKEN_FILE>, CA <AGENTRUN_JOURNAL_CA_FILE>
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig, TlsProvider};

use super::error::{Error, Result};
use super::wire::{Chunk, GROUP_VERSION};

/// A write the API server refused in a way the journal reads: 403 (the
/// admission policy), 409 (a stale resourceVersion, or a chunk that exists
/// already) or 422 (the CRD's rules, e.g. an older attempt).
#[derive(Debug)]
pub(crate) struct Refusal {
    pub status: u16,
    pub message: String,
}

enum Token {
    None,
    /// Re-read at every request: the kubelet rotates a projected token.
    File(PathBuf),
}

/// Where the journal's chunks live and who writes them.
pub struct Api {
    agent: ureq::Agent,
    base: String,
    namespace: String,
    token: Token,
}

impl Api {
    /// An API server at `base_url` (`http://127.0.0.1:8080` in tests, or a
    /// local proxy such as `kubectl proxy`), without a token.
    pub fn new(base_url: &str, namespace: &str) -> Api {
        Api {
            agent: agent(TlsConfig::builder()),
            base: base_url.trim_end_matches('/').to_owned(),
            namespace: namespace.to_owned(),
            token: Token::None,
        }
    }

    /// The cluster's API server over HTTPS, trusting only the CA in
    /// `ca_file`, with the bearer token in `token_file`.
    pub fn in_cluster(
        host: &str,
        port: &str,
        ca_file: PathBuf,
        token_file: PathBuf,
        namespace: &str,
    ) -> Result<Api> {
        let pem = std::fs::read(&ca_file).map_err(|e| Error::Env {
            name: ca_file.display().to_string(),
            problem: format!("cannot be read: {e}"),
        })?;
        let certs: Vec<Certificate<'static>> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if certs.is_empty() {
            return Err(Error::Env {
                name: ca_file.display().to_string(),
                problem: "holds no PEM certificate".into(),
            });
        }
        let tls = TlsConfig::builder().root_certs(RootCerts::new_with_certs(&certs));
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        Ok(Api {
            agent: agent(tls),
            base: format!("https://{host}:{port}"),
            namespace: namespace.to_owned(),
            token: Token::File(token_file),
        })
    }

    fn url(&self, name: Option<&str>) -> String {
        let collection = format!(
            "{}/apis/{GROUP_VERSION}/namespaces/{}/stepjournals",
            self.base, self.namespace
        );
        match name {
            Some(n) => format!("{collection}/{n}"),
            None => collection,
        }
    }

    fn bearer(&self, verb: &'static str, chunk: &str) -> Result<Option<String>> {
        match &self.token {
            Token::None => Ok(None),
            Token::File(path) => std::fs::read_to_string(path)
                .map(|t| Some(format!("Bearer {}", t.trim())))
                .map_err(|e| Error::Transport {
                    verb,
                    chunk: chunk.to_owned(),
                    source: format!("reading the token {}: {e}", path.display()).into(),
                }),
        }
    }

    /// The chunk, or `None` when it does not exist.
    pub(crate) fn get(&self, name: &str) -> Result<Option<Chunk>> {
        let mut req = self.agent.get(self.url(Some(name)));
        if let Some(b) = self.bearer("get", name)? {
            req = req.header("Authorization", b);
        }
        let (status, body) = finish("get", name, req.call())?;
        match status {
            200 => parse("get", name, &body).map(Some),
            404 => Ok(None),
            _ => Err(api_error("get", name, status, &body)),
        }
    }

    pub(crate) fn create(&self, chunk: &Chunk) -> Result<Result<Chunk, Refusal>> {
        self.write("create", chunk)
    }

    /// An update guarded by the chunk's resourceVersion.
    pub(crate) fn update(&self, chunk: &Chunk) -> Result<Result<Chunk, Refusal>> {
        self.write("update", chunk)
    }

    fn write(&self, verb: &'static str, chunk: &Chunk) -> Result<Result<Chunk, Refusal>> {
        let name = chunk
            .metadata
            .get("name")
            .and_then(|n| n.as_str())
            .unwrap_or_default()
            .to_owned();
        let body = serde_json::to_vec(chunk).expect("a chunk serializes");
        let mut req = if verb == "create" {
            self.agent.post(self.url(None))
        } else {
            self.agent.put(self.url(Some(&name)))
        }
        .header("Content-Type", "application/json");
        if let Some(b) = self.bearer(verb, &name)? {
            req = req.header("Authorization", b);
        }
        let (status, text) = finish(verb, &name, req.send(&body[..]))?;
        match status {
            200 | 201 => parse(verb, &name, &text).map(Ok),
            403 | 409 | 422 => Ok(Err(Refusal {
                status,
                message: status_message(&text),
            })),
            _ => Err(api_error(verb, &name, status, &text)),
        }
    }
}

fn agent(tls: ureq::tls::TlsConfigBuilder) -> ureq::Agent {
    let tls = tls
        .provider(TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .build();
    ureq::Agent::config_builder()
        .tls_config(tls)
        // The API server is reached directly: a proxy set for the model's
        // traffic must not see the step's token.
        .proxy(None)
        .max_redirects(0)
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .new_agent()
}

fn finish(
    verb: &'static str,
    chunk: &str,
    res: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<(u16, String)> {
    let transport = |e: ureq::Error| Error::Transport {
        verb,
        chunk: chunk.to_owned(),
        source: Box::new(e),
    };
    let mut res = res.map_err(transport)?;
    let status = res.status().as_u16();
    let body = res
        .body_mut()
        .with_config()
        .limit(16 << 20)
        .read_to_string()
        .map_err(transport)?;
    Ok((status, body))
}

fn parse(verb: &'static str, chunk: &str, body: &str) -> Result<Chunk> {
    serde_json::from_str(body).map_err(|e| Error::Corrupt {
        chunk: chunk.to_owned(),
        problem: format!("the answer to {verb} is not a StepJournal: {e}"),
    })
}

/// The message of a Kubernetes `Status`, or the body as it came.
fn status_message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
        .unwrap_or_else(|| body.chars().take(1024).collect())
}

fn api_error(verb: &'static str, chunk: &str, status: u16, body: &str) -> Error {
    Error::Api {
        verb,
        chunk: chunk.to_owned(),
        status,
        message: status_message(body),
    }
}
