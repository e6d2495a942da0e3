//! The control plane the batches run on, and what every batch does on it
//! whichever controller runs it: the client, simkubelet, one fresh namespace
//! per batch (created on a quiet plane, torn down to nothing), the names and
//! parallel creates of the runs, and the CPU and memory of the processes.
//!
//! ```text
//!   e2e/cluster up ─▶ $E2E_DIR/{kubeconfig, state/<proc>.pid, state/<proc>.port, pki/}
//!   namespace() ─▶ bench-… (Pods, runs, logs in $E2E_DIR/bench/<ns>/) ─▶ teardown()
//! ```

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentrun_e2e::TestNamespace;
use agentrun_e2e::support::processes::Process;
use agentrun_operator::labels;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::process::Command;

use crate::args::Args;
use crate::error::{BenchError, Res, api, io};

/// Where things are.
pub struct Setup {
    pub args: Args,
    pub client: Client,
    pub e2e_dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub operator_bin: PathBuf,
    pub simkubelet_bin: PathBuf,
    /// Argo's `workflow-controller` and `crds/` (`--peer argo` only).
    pub argo_dir: PathBuf,
    pub out_dir: PathBuf,
}

pub async fn connect(kubeconfig: &Path) -> Res<Client> {
    let file = Kubeconfig::read_from(kubeconfig).map_err(|e| BenchError::Config {
        what: format!("reading {}", kubeconfig.display()),
        message: format!("{e} (is the bench plane up? `AGENTRUN_E2E_DIR=… e2e/cluster up`)"),
    })?;
    let mut config = Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .map_err(|e| BenchError::Config {
            what: format!("loading {}", kubeconfig.display()),
            message: e.to_string(),
        })?;
    // The driver itself lists and watches thousands of objects.
    config.read_timeout = Some(Duration::from_secs(120));
    let client = Client::try_from(config).map_err(api("building the client"))?;
    client
        .apiserver_version()
        .await
        .map_err(api("control plane not reachable"))?;
    Ok(client)
}

pub fn machine_line(setup: &Setup) -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_owned())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024 / 1024);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "# machine: {cpus} CPUs, {mem} GiB, Linux {}; operator {}; simkubelet {}",
        kernel.trim(),
        setup.operator_bin.display(),
        setup.simkubelet_bin.display()
    )
}

/// simkubelet on `ns`: every step Pod runs 0 ms; `extra` flags are a peer's
/// (Argo's `--argo-task-results`).
pub fn start_simkubelet(setup: &Setup, ns: &str, dir: &Path, extra: &[&str]) -> Res<Process> {
    let mut cmd = Command::new(&setup.simkubelet_bin);
    cmd.args(["--namespace", ns, "--default-run-ms", "0", "--ledger"])
        .arg(dir.join("ledger.jsonl"))
        .args(extra)
        .env("KUBECONFIG", &setup.kubeconfig)
        .env("RUST_LOG", "warn");
    Process::start("simkubelet", cmd, dir.join("simkubelet.log")).map_err(io("starting simkubelet"))
}

// ---------------------------------------------------------------------------
// CPU and memory of the processes

/// `VmRSS` and `VmHWM` of a process, in KiB.
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU time (user + system) of a process so far, in ms (USER_HZ = 100).
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some((_, rest)) = stat.rsplit_once(") ") else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) * 10.0
}

/// The processes whose CPU a batch counts: the plane's kube-apiserver and
/// etcd (from `e2e/cluster up`'s PID files), the controller (the "operator"
/// column, whichever peer it is) and simkubelet.
pub fn processes(setup: &Setup, controller: u32, kubelet: u32) -> Vec<(&'static str, u32)> {
    let mut pids: Vec<(&'static str, u32)> = ["kube-apiserver", "etcd"]
        .into_iter()
        .filter_map(|name| Some((name, plane_pid(setup, name)?)))
        .collect();
    pids.push(("operator", controller));
    pids.push(("simkubelet", kubelet));
    pids
}

/// A process of the plane, from its PID file.
pub fn plane_pid(setup: &Setup, name: &str) -> Option<u32> {
    std::fs::read_to_string(setup.e2e_dir.join(format!("state/{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// CPU ms of each process so far.
pub fn cpu_now(pids: &[(&'static str, u32)]) -> BTreeMap<&'static str, f64> {
    pids.iter().map(|(n, p)| (*n, cpu_ms(*p))).collect()
}

/// CPU ms per step of each process since `before`.
pub fn cpu_per_step(
    before: &BTreeMap<&'static str, f64>,
    pids: &[(&'static str, u32)],
    steps: usize,
) -> BTreeMap<&'static str, f64> {
    cpu_now(pids)
        .into_iter()
        .map(|(name, now)| {
            let was = before.get(name).copied().unwrap_or(0.0);
            (name, (now - was) / steps as f64)
        })
        .collect()
}

/// The highest VmRSS of a process that outlives the batch (kube-controller-manager),
/// sampled every 100 ms, since its VmHWM is not this batch's.
pub struct RssPeak {
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl RssPeak {
    pub fn sample(pid: u32, from: u64) -> RssPeak {
        let peak = Arc::new(AtomicU64::new(from));
        let task = tokio::spawn({
            let peak = peak.clone();
            async move {
                loop {
                    let (rss, _) = rss_kib(pid);
                    peak.fetch_max(rss, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        RssPeak { peak, task }
    }

    pub fn stop(self) -> u64 {
        self.task.abort();
        self.peak.load(Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------------------
// Runs: names and creates

pub fn step_name(i: usize) -> String {
    format!("s{i:03}")
}

pub fn run_name(i: usize) -> String {
    format!("r{i:05}")
}

/// Creates objects `0..n` (`--create-parallelism` at a time); returns when
/// every create is acknowledged, or with the first refusal.
pub async fn create_all<K>(
    setup: &Setup,
    api: &Api<K>,
    n: usize,
    manifest: impl Fn(usize) -> K,
    name: impl Fn(usize) -> String,
) -> Res<()>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
{
    futures::stream::iter((0..n).map(|i| {
        let object = manifest(i);
        let what = name(i);
        async move {
            api.create(&PostParams::default(), &object)
                .await
                .map(|_| ())
                .map_err(self::api(format!("creating {what}")))
        }
    }))
    .buffer_unordered(setup.args.create_parallelism.max(1))
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// One namespace per batch

/// Waits until no namespace of the plane is being deleted: the write counts
/// are the plane's, and a namespace going away (an earlier batch's, or
/// another test's on a shared plane) deletes runs, Approvals, Pods and Events
/// and releases finalizers within the window.
async fn quiet_plane(setup: &Setup) -> Res<()> {
    let namespaces: Api<Namespace> = Api::all(setup.client.clone());
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let terminating: Vec<String> = namespaces
            .list(&Default::default())
            .await
            .map_err(api("listing namespaces"))?
            .into_iter()
            .filter(|n| n.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Terminating"))
            .map(|n| n.name_any())
            .collect();
        if terminating.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Stage(format!(
                "namespaces still being deleted after 180 s: {terminating:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A fresh namespace and a directory for its logs and ledger, once the plane
/// is quiet.
pub async fn namespace(setup: &Setup, name: &str) -> Res<(TestNamespace, PathBuf)> {
    quiet_plane(setup).await?;
    let ns = TestNamespace::create(&setup.client, name).await;
    let dir = setup.out_dir.join(ns.name());
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    // The serviceaccount and root-CA controllers write into a new namespace;
    // let them finish before a measured window opens.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok((ns, dir))
}

/// Releases leftover finalizers, deletes the namespace and waits until it is
/// gone, so the next batch starts on an idle etcd.
pub async fn teardown(setup: &Setup, ns: TestNamespace) -> Res<()> {
    let name = ns.name().to_owned();
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), &name);
    if let Ok(list) = pods.list(&ListParams::default().labels(labels::RUN)).await {
        let held: Vec<String> = list
            .into_iter()
            .filter(|p| !p.finalizers().is_empty())
            .map(|p| p.name_any())
            .collect();
        futures::stream::iter(held.into_iter().map(|p| {
            let pods = pods.clone();
            async move {
                let _ = pods
                    .patch(
                        &p,
                        &PatchParams::default(),
                        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                    )
                    .await;
            }
        }))
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    }
    ns.cleanup(&setup.client).await;
    let nss: Api<Namespace> = Api::all(setup.client.clone());
    let start = Instant::now();
    while nss.get_opt(&name).await.ok().flatten().is_some() {
        if start.elapsed() > Duration::from_secs(600) {
            eprintln!("warning: namespace {name} still terminating after 600 s; going on");
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}
