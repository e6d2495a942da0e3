//! The operator and the simulated kubelet as real child processes, so a test
//! can SIGKILL and restart them the way a node or a rollout would, or pause
//! them (SIGSTOP, SIGCONT) the way a stalled VM or a long GC pause would.
//!
//! Each process logs to `<e2e dir>/scenarios/<namespace>/<name>.log`; a failing
//! scenario prints the tails.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use super::env::{kubeconfig, repo_root};

/// The operator binary built by `cargo build --workspace --bins`.
pub fn operator_binary() -> PathBuf {
    let path = std::env::var_os("AGENTRUN_OPERATOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/debug/agentrun-operator"));
    assert!(
        path.exists(),
        "operator binary not found at {}: run `cargo build --workspace --bins` first (make test does)",
        path.display()
    );
    path
}

/// `kubectl agentrun ARGS` in namespace `ns`, as the plane's admin: its exit
/// code and its output (stdout, then stderr).
pub async fn kubectl_agentrun(ns: &str, args: &[&str]) -> (i32, String) {
    let out = tokio::process::Command::new(plugin_binary())
        .arg("--kubeconfig")
        .arg(crate::kubeconfig())
        .args(["-n", ns])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("running kubectl-agentrun");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// The `kubectl-agentrun` plugin binary.
pub fn plugin_binary() -> PathBuf {
    let path = std::env::var_os("AGENTRUN_PLUGIN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/debug/kubectl-agentrun"));
    assert!(
        path.exists(),
        "plugin binary not found at {}: run `cargo build --workspace --bins` first (make test does)",
        path.display()
    );
    path
}

/// The simkubelet binary of this crate.
pub fn simkubelet_binary() -> PathBuf {
    let path = std::env::var_os("AGENTRUN_SIMKUBELET_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/debug/simkubelet"));
    assert!(
        path.exists(),
        "simkubelet binary not found at {}: run `cargo build --workspace --bins` first (make test does)",
        path.display()
    );
    path
}

/// A free loopback port (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}

/// Where a scenario's process logs go.
/// Writes a copy of the e2e kubeconfig whose users act as `user`
/// (impersonation, e.g. `system:serviceaccount:NS:NAME`) to `path`, and
/// returns `path`: an operator started with it has exactly that user's rights.
pub fn impersonating_kubeconfig(user: &str, path: PathBuf) -> PathBuf {
    let admin = std::fs::read_to_string(kubeconfig()).expect("reading the e2e kubeconfig");
    let mut config: serde_yaml::Value = serde_yaml::from_str(&admin).expect("kubeconfig YAML");
    for entry in config["users"].as_sequence_mut().expect("kubeconfig users") {
        entry["user"]["as"] = user.into();
    }
    std::fs::write(
        &path,
        serde_yaml::to_string(&config).expect("kubeconfig YAML"),
    )
    .expect("writing the impersonating kubeconfig");
    path
}

pub fn log_dir(namespace: &str) -> PathBuf {
    let base = std::env::var_os("AGENTRUN_E2E_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/e2e"));
    let dir = base.join("scenarios").join(namespace);
    std::fs::create_dir_all(&dir).expect("creating the scenario log directory");
    dir
}

/// A child process that is killed (SIGKILL) when dropped.
pub struct Process {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Process {
    fn spawn(name: &str, cmd: Command, log: PathBuf) -> Process {
        Process::start(name, cmd, log).unwrap_or_else(|e| panic!("starting {name}: {e}"))
    }

    /// Starts `cmd` with stdout and stderr appended to `log`.
    pub fn start(name: &str, mut cmd: Command, log: PathBuf) -> std::io::Result<Process> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let err = out.try_clone()?;
        cmd.stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let child = cmd.spawn()?;
        Ok(Process {
            name: name.to_owned(),
            child: Some(child),
            log,
        })
    }

    /// SIGKILL and wait: no graceful shutdown, like a node losing power.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// SIGTERM and wait up to `timeout` for a clean exit; returns its success.
    pub async fn terminate(&mut self, timeout: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return false;
        };
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        match tokio::time::timeout(timeout, child.wait()).await {
            Ok(Ok(status)) => status.success(),
            _ => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                false
            }
        }
    }

    /// The process id, while it has not been reaped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    fn signal(&self, signal: &str) -> bool {
        let Some(pid) = self.pid() else {
            return false;
        };
        std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// SIGSTOP: the process stops dead (timers, sockets and all) until
    /// [`Process::resume`]; returns whether the signal was sent.
    pub fn pause(&self) -> bool {
        self.signal("-STOP")
    }

    /// SIGCONT after [`Process::pause`].
    pub fn resume(&self) -> bool {
        self.signal("-CONT")
    }

    /// Whether the process has exited (e.g. at a failpoint), with its status.
    pub fn try_exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits until the process exits by itself.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let status = tokio::time::timeout(timeout, child.wait()).await.ok()?.ok();
        self.child = None;
        status
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of the log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let start = all.len().saturating_sub(lines);
        format!(
            "--- {} ({}) ---\n{}",
            self.name,
            self.log.display(),
            all[start..].join("\n")
        )
    }
}

/// How to start the operator for one scenario.
#[derive(Clone, Debug)]
pub struct OperatorConfig {
    pub namespace: String,
    /// Watch every namespace, not only `namespace` (its log and Lease stay
    /// there). Every run on the plane is then this operator's: only for a
    /// test that has the plane to itself.
    pub all_namespaces: bool,
    /// Instance identity (also the lease holder identity).
    pub identity: String,
    pub leader_elect: bool,
    /// `--lease-duration-seconds` with `leader_elect` (renewed a third of it early).
    pub lease_duration_seconds: u64,
    /// `AGENTRUN_FAILPOINT`, e.g. `after-create-pod:1`.
    pub failpoint: Option<String>,
    pub metrics_port: u16,
    pub health_port: u16,
    /// Run as this user (impersonation through a kubeconfig is left to the caller).
    pub kubeconfig: PathBuf,
    pub extra_env: Vec<(String, String)>,
}

impl OperatorConfig {
    pub fn new(namespace: &str) -> OperatorConfig {
        OperatorConfig {
            namespace: namespace.to_owned(),
            all_namespaces: false,
            identity: format!("operator-{namespace}"),
            leader_elect: false,
            lease_duration_seconds: 6,
            failpoint: None,
            metrics_port: free_port(),
            health_port: free_port(),
            kubeconfig: kubeconfig(),
            extra_env: vec![],
        }
    }
}

/// Starts the operator watching the scenario's namespace only (or every
/// namespace, with `all_namespaces`).
pub fn start_operator(cfg: &OperatorConfig) -> Process {
    let mut cmd = Command::new(operator_binary());
    cmd.arg("run");
    if !cfg.all_namespaces {
        cmd.arg("--namespace").arg(&cfg.namespace);
    }
    cmd.arg("--identity")
        .arg(&cfg.identity)
        .arg("--metrics-addr")
        .arg(format!("127.0.0.1:{}", cfg.metrics_port))
        .arg("--health-addr")
        .arg(format!("127.0.0.1:{}", cfg.health_port))
        .env("KUBECONFIG", &cfg.kubeconfig)
        // AGENTRUN_E2E_OPERATOR_LOG replaces the filter, e.g. to see the
        // watches' requests: `info,kube_runtime=debug,kube_client=debug`.
        .env(
            "RUST_LOG",
            std::env::var("AGENTRUN_E2E_OPERATOR_LOG").unwrap_or_else(|_| {
                "info,agentrun_operator=debug,kube_lease_manager=info".to_owned()
            }),
        )
        .env_remove("AGENTRUN_FAILPOINT");
    if cfg.leader_elect {
        cmd.arg("--leader-elect")
            .arg("--lease-namespace")
            .arg(&cfg.namespace)
            .arg("--lease-duration-seconds")
            .arg(cfg.lease_duration_seconds.to_string());
    }
    if let Some(fp) = &cfg.failpoint {
        cmd.env("AGENTRUN_FAILPOINT", fp);
    }
    for (k, v) in &cfg.extra_env {
        cmd.env(k, v);
    }
    let log = log_dir(&cfg.namespace).join(format!("{}.log", cfg.identity));
    Process::spawn(&format!("operator {}", cfg.identity), cmd, log)
}

/// Starts a simkubelet for the namespace, appending to `ledger`.
pub fn start_simkubelet(namespace: &str, ledger: &Path) -> Process {
    let mut cmd = Command::new(simkubelet_binary());
    cmd.arg("--namespace")
        .arg(namespace)
        .arg("--ledger")
        .arg(ledger)
        .env("KUBECONFIG", kubeconfig())
        .env("RUST_LOG", "info");
    let log = log_dir(namespace).join("simkubelet.log");
    Process::spawn("simkubelet", cmd, log)
}
