//! A real Jaeger (v2, all-in-one, in-memory) on loopback for the trace
//! tests: OTLP/HTTP in, its HTTP query API out. Built by `e2e/cluster
//! jaeger` into the cache; `$AGENTRUN_JAEGER` (set by `e2e/cluster env`)
//! names the binary. A test that needs it fails when it is missing.
//!
//! ```text
//!   operator ──OTLP/HTTP──▶ 127.0.0.1:<otlp>  jaeger  127.0.0.1:<query> ◀── GET /api/traces/<id>
//! ```

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::{Child, Command};

use super::processes::{free_port, log_dir};

pub struct Jaeger {
    child: Child,
    /// `http://127.0.0.1:<port>`: what `OTEL_EXPORTER_OTLP_ENDPOINT` takes.
    pub otlp_endpoint: String,
    query: String,
    pub log: PathBuf,
}

/// The binary: `$AGENTRUN_JAEGER`, else `jaeger` on PATH.
pub fn jaeger_binary() -> PathBuf {
    let path = std::env::var_os("AGENTRUN_JAEGER")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("jaeger"));
    assert!(
        path.is_file() || which(&path),
        "jaeger not found at {}: run `e2e/cluster jaeger` and `eval \"$(e2e/cluster env)\"` (make test does)",
        path.display()
    );
    path
}

fn which(name: &std::path::Path) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

impl Jaeger {
    /// Starts Jaeger for `namespace` (its config and log go to the scenario's
    /// log directory) and waits until its query API answers.
    pub async fn start(namespace: &str) -> Jaeger {
        let binary = jaeger_binary();
        let (otlp, query, grpc) = (free_port(), free_port(), free_port());
        let dir = log_dir(namespace);
        let config = dir.join("jaeger.yaml");
        std::fs::write(
            &config,
            format!(
                r#"service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{grpc}
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"#
            ),
        )
        .expect("writing the jaeger config");
        let log = dir.join("jaeger.log");
        let out = std::fs::File::create(&log).expect("creating the jaeger log");
        let err = out.try_clone().expect("cloning the log handle");
        let child = Command::new(&binary)
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        let jaeger = Jaeger {
            child,
            otlp_endpoint: format!("http://127.0.0.1:{otlp}"),
            query: format!("http://127.0.0.1:{query}"),
            log,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if jaeger.try_get("/api/services").await.is_some() {
                return jaeger;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "jaeger did not answer within 60 s; its log:\n{}",
                std::fs::read_to_string(&jaeger.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn try_get(&self, path: &str) -> Option<Value> {
        let out = Command::new("curl")
            .args(["-sf", "--max-time", "5"])
            .arg(format!("{}{path}", self.query))
            .output()
            .await
            .ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// `GET <query API><path>` as JSON; panics unless it answers.
    pub async fn get(&self, path: &str) -> Value {
        self.try_get(path)
            .await
            .unwrap_or_else(|| panic!("GET {}{path} failed", self.query))
    }

    /// The spans Jaeger holds for a trace (hex id), or none.
    pub async fn spans(&self, trace_id: &str) -> Vec<Value> {
        match self.try_get(&format!("/api/traces/{trace_id}")).await {
            Some(v) => v["data"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|t| t["spans"].as_array().cloned().unwrap_or_default())
                .collect(),
            None => Vec::new(),
        }
    }

    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}
