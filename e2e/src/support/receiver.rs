//! A webhook receiver for the notification tests: an HTTP server on
//! 127.0.0.1 that records every request and answers as scripted per path
//! (a status, a redirect, or no answer at all), then 200.
//!
//! ```text
//!   let r = Receiver::start().await;
//!   r.script("/team", [Reply::Status(500), Reply::Status(500)]);   // then 200
//!   channel url: r.url("/team")
//!   r.wait_for("/team", 3, timeout).await  → the requests, in arrival order
//!
//!   let (r, ca_pem) = Receiver::start_tls(dir).await;   // HTTPS, a certificate for
//!                                                        // 127.0.0.1 from a test CA
//! ```

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// How the receiver answers one request.
#[derive(Clone, Debug)]
pub enum Reply {
    Status(u16),
    /// 302 with this `Location`.
    Redirect(String),
    /// This status with `Retry-After: <secs>`.
    RetryAfter(u16, u64),
    /// Reads the request and never answers.
    Hang,
}

/// One request as it arrived.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    pub at: Instant,
    /// The same moment on the wall clock, to compare with API timestamps.
    pub wall: jiff::Timestamp,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

#[derive(Default)]
struct State {
    scripts: HashMap<String, VecDeque<Reply>>,
    received: Vec<Received>,
}

/// The running receiver; stops when dropped.
pub struct Receiver {
    pub addr: SocketAddr,
    scheme: &'static str,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    pub async fn start() -> Receiver {
        Receiver::serve(None).await
    }

    /// An HTTPS receiver whose certificate (for IP 127.0.0.1) is signed by a
    /// CA made for it in `dir` with openssl; returns the CA's PEM.
    pub async fn start_tls(dir: &Path) -> (Receiver, String) {
        let (config, ca) = tls_config(dir);
        let r = Receiver::serve(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config)))).await;
        (r, ca)
    }

    async fn serve(tls: Option<tokio_rustls::TlsAcceptor>) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the receiver on 127.0.0.1");
        let addr = listener.local_addr().expect("the receiver's address");
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = shared.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(req, state.clone()));
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        None => {
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                        Some(acceptor) => {
                            // A client that refuses the certificate ends here.
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = http.serve_connection(TokioIo::new(stream), service).await;
                            }
                        }
                    }
                });
            }
        });
        Receiver {
            addr,
            scheme,
            state,
            task,
        }
    }

    /// `http(s)://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addr)
    }

    /// The replies for the next requests to `path`; after them, 200.
    pub fn script(&self, path: &str, replies: impl IntoIterator<Item = Reply>) {
        let mut s = self.state.lock().unwrap();
        s.scripts
            .entry(path.to_owned())
            .or_default()
            .extend(replies);
    }

    /// Every request to `path` so far.
    pub fn received(&self, path: &str) -> Vec<Received> {
        let s = self.state.lock().unwrap();
        s.received
            .iter()
            .filter(|r| r.path == path)
            .cloned()
            .collect()
    }

    /// Every request so far.
    pub fn all(&self) -> Vec<Received> {
        self.state.lock().unwrap().received.clone()
    }

    /// Waits until `path` got at least `n` requests; returns them all.
    pub async fn wait_for(&self, path: &str, n: usize, timeout: Duration) -> Vec<Received> {
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.received(path);
            if got.len() >= n {
                return got;
            }
            if Instant::now() >= deadline {
                let all: Vec<String> = self
                    .all()
                    .iter()
                    .map(|r| format!("{} {:?}", r.path, r.header("x-agentrun-delivery")))
                    .collect();
                panic!(
                    "timed out after {timeout:?}: {path} got {} of {n} requests; all requests: {all:?}",
                    got.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    state: Arc<Mutex<State>>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let path = req.uri().path().to_owned();
    let headers = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_ascii_lowercase(),
                v.to_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let body = req.into_body().collect().await?.to_bytes().to_vec();
    let reply = {
        let mut s = state.lock().unwrap();
        s.received.push(Received {
            path: path.clone(),
            headers,
            body,
            at: Instant::now(),
            wall: jiff::Timestamp::now(),
        });
        s.scripts.get_mut(&path).and_then(VecDeque::pop_front)
    };
    let response = |status: u16| {
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(format!("receiver says {status}"))))
            .expect("a valid response")
    };
    Ok(match reply {
        None => response(200),
        Some(Reply::Status(code)) => response(code),
        Some(Reply::RetryAfter(code, secs)) => Response::builder()
            .status(code)
            .header("retry-after", secs.to_string())
            .body(Full::new(Bytes::from("later")))
            .expect("a valid response"),
        Some(Reply::Redirect(to)) => Response::builder()
            .status(302)
            .header("location", to)
            .body(Full::new(Bytes::new()))
            .expect("a valid response"),
        Some(Reply::Hang) => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            response(200)
        }
    })
}

/// A CA and a server certificate for 127.0.0.1 made with openssl in `dir`;
/// the rustls server configuration and the CA's PEM.
fn tls_config(dir: &Path) -> (rustls::ServerConfig, String) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    std::fs::create_dir_all(dir).expect("creating the receiver's certificate directory");
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("running openssl (the notification tests need it)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "1",
                "-subj",
                "/CN=agentrun receiver test CA",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        ]
        .concat(),
    );
    openssl(
        &[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .expect("writing the extensions file");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "server.ext",
    ]);
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("server.pem"))
        .expect("reading server.pem")
        .collect::<Result<_, _>>()
        .expect("server.pem holds certificates");
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).expect("reading server.key");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS 1.2 and 1.3")
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("the server certificate and key match");
    let ca = std::fs::read_to_string(dir.join("ca.pem")).expect("reading ca.pem");
    (config, ca)
}
