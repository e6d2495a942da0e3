//! The cluster benchmark (`make bench`): agentrun-operator on the local control
//! plane with simkubelet steps of 0 ms, at several concurrency levels.
//!
//! ```text
//!   bench ──creates N AgentRuns──▶ kube-apiserver ◀──watch/write── agentrun-operator (child, --namespace NS)
//!     │  watches Pods + AgentRuns          ▲  /metrics (admin cert)  ◀──watch/patch status── simkubelet (child)
//!     └─ scrapes apiserver_request_total ──┘  before/after; the operator's /metrics; /proc/<pid>/status
//! ```
//!
//! Figures per batch (one fresh namespace, operator and simkubelet each):
//! operator API writes per step, step hand-off latency (Pod seen Succeeded →
//! the next step's Pod seen, both by this driver's watch), steps per second,
//! operator RSS; then a resume batch (operator SIGKILLed with N runs in
//! flight) and the status size of one long run. It prints its figures; it is
//! not a test and asserts no target.
//!
//! `--peer jobs` and `--peer argo` run the same batches with another controller
//! instead of the operator: chains of Jobs (kube-controller-manager) or Argo
//! Workflows (a workflow-controller started per batch, simkubelet playing Argo's
//! `wait` sidecar); see docs/performance.md, "Side by side".

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentrun_e2e::http_get;
use agentrun_e2e::ledger::Ledger;
use agentrun_e2e::support::processes::{Process, free_port};
use agentrun_e2e::{TestNamespace, install_crds, repo_root};
use agentrun_operator::api::{AgentRun, RunPhase};
use agentrun_operator::labels;
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Config, ResourceExt};
use serde_json::{Value, json};
use tokio::process::Command;

/// Why the benchmark stopped.
#[derive(Debug, thiserror::Error)]
enum BenchError {
    /// A file, a child process or the network.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The API server refused a request or did not answer.
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The kubeconfig cannot be read or used.
    #[error("{what}: {message}")]
    Config { what: String, message: String },
    /// A binary the benchmark starts is not built.
    #[error("{} not found: build it with `cargo build --release -p agentrun-operator -p agentrun-e2e --bins`", .0.display())]
    NotBuilt(PathBuf),
    /// A stage did not reach its end in time, or ended wrongly: what was
    /// awaited and where the logs are.
    #[error("{0}")]
    Stage(String),
}

type Res<T> = Result<T, BenchError>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
    move |source| BenchError::Io {
        what: what.into(),
        source,
    }
}

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> BenchError {
    move |source| BenchError::Api {
        what: what.into(),
        source,
    }
}

#[derive(Parser, Debug, Clone)]
#[command(name = "bench", about = "agentrun-operator cluster benchmark")]
struct Args {
    /// Concurrent runs per batch, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,50,200,1000")]
    concurrency: Vec<usize>,
    /// Steps per run.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// The batches' runs are a fan-out: every step after the first depends on
    /// the first only, and `spec.parallelism` lets them all run at once (the
    /// status-size run stays a sequence). Compare its steps/s with a run of
    /// the same steps without it.
    #[arg(long, default_value_t = false)]
    fan_out: bool,
    /// Repeats of every figure (the table shows medians).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Runs in flight for the resume figure (0 skips it).
    #[arg(long, default_value_t = 1000)]
    resume_runs: usize,
    /// Wait for the resumed runs to finish (and count duplicates over their
    /// whole lives) instead of stopping once every run has its next Pod.
    #[arg(long, default_value_t = false)]
    resume_finish: bool,
    /// Steps of the run whose status size is measured (0 skips it).
    #[arg(long, default_value_t = 500)]
    status_steps: usize,
    /// Bytes of result each step of the status-size run reports (the engine's
    /// unit test uses 1,000-byte results; 0 reports `{}`).
    #[arg(long, default_value_t = 1000)]
    status_result_bytes: usize,
    /// Repeats of the status-size run (its size is deterministic; its time is not).
    #[arg(long, default_value_t = 1)]
    status_repeats: usize,
    /// A batch that has not finished after this long is aborted.
    #[arg(long, default_value_t = 900)]
    deadline_secs: u64,
    /// Parallel creates when submitting runs.
    #[arg(long, default_value_t = 16)]
    create_parallelism: usize,
    /// The operator binary (default: target/release/agentrun-operator).
    #[arg(long)]
    operator_bin: Option<PathBuf>,
    /// The simkubelet binary (default: target/release/simkubelet).
    #[arg(long)]
    simkubelet_bin: Option<PathBuf>,
    /// The control plane's directory (default: $AGENTRUN_E2E_DIR, else target/e2e-bench).
    #[arg(long)]
    e2e_dir: Option<PathBuf>,
    /// Also write the summary table (markdown) to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// RUST_LOG for the operator.
    #[arg(long, default_value = "info")]
    operator_log: String,
    /// The operator's `--step-events` (an Event per step start and success).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    step_events: bool,
    /// Steps of the status-size run at which the cost of a step is sampled
    /// (the window of `--long-window` steps ending there), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10,100,500")]
    long_marks: Vec<usize>,
    /// Steps per sampled window of the status-size run.
    #[arg(long, default_value_t = 10)]
    long_window: usize,
    /// Also write every batch's figures as JSON to this file (for tests).
    #[arg(long)]
    json: Option<PathBuf>,
    /// What runs the batches: `agentrun` (the operator, one AgentRun per
    /// run), `jobs` (kube-controller-manager's Job controller, one chain of
    /// single-Pod Jobs per run, the driver creating Job i+1 once it sees Job i
    /// Complete; the plane's kcm must run `job-controller`, see
    /// `AGENTRUN_KCM_ARGS` in e2e/cluster) or `argo` (Argo Workflows'
    /// workflow-controller, one Workflow of sequential steps per run; built by
    /// `e2e/cluster argo`).
    #[arg(long, value_enum, default_value_t = Peer::Agentrun)]
    peer: Peer,
    /// Argo's directory: `workflow-controller` and `crds/` (default:
    /// $AGENTRUN_ARGO_DIR, else the cache's argo-v4.0.5, as `e2e/cluster argo` builds it).
    #[arg(long)]
    argo_dir: Option<PathBuf>,
    /// The workflow-controller's client rate limit (`--qps`; Argo's default 20).
    #[arg(long, default_value_t = 20.0)]
    argo_qps: f32,
    /// The workflow-controller's client burst (`--burst`; Argo's default 30).
    #[arg(long, default_value_t = 30)]
    argo_burst: u32,
    /// The workflow-controller's `DEFAULT_REQUEUE_TIME` (how long a Workflow waits in
    /// its queue after a Pod or task-result event); empty keeps Argo's default (10s).
    #[arg(long, default_value = "")]
    argo_requeue_time: String,
    /// A label for this invocation's rows (e.g. the kcm client QPS).
    #[arg(long, default_value = "")]
    label: String,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Peer {
    Agentrun,
    Jobs,
    Argo,
}

/// Where things are.
struct Setup {
    args: Args,
    client: Client,
    e2e_dir: PathBuf,
    kubeconfig: PathBuf,
    operator_bin: PathBuf,
    simkubelet_bin: PathBuf,
    /// Argo's workflow-controller (`--peer argo` only).
    argo_controller_bin: PathBuf,
    out_dir: PathBuf,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match bench(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn bench(args: Args) -> Res<()> {
    let e2e_dir = args
        .e2e_dir
        .clone()
        .or_else(|| std::env::var_os("AGENTRUN_E2E_DIR").map(PathBuf::from))
        .unwrap_or_else(|| repo_root().join("target/e2e-bench"));
    let kubeconfig = e2e_dir.join("kubeconfig");
    let bin = |given: &Option<PathBuf>, name: &str| -> Res<PathBuf> {
        let p = given
            .clone()
            .unwrap_or_else(|| repo_root().join("target/release").join(name));
        if p.exists() {
            Ok(p)
        } else {
            Err(BenchError::NotBuilt(p))
        }
    };
    let operator_bin = bin(&args.operator_bin, "agentrun-operator")?;
    let simkubelet_bin = bin(&args.simkubelet_bin, "simkubelet")?;
    let argo_dir = args
        .argo_dir
        .clone()
        .or_else(|| std::env::var_os("AGENTRUN_ARGO_DIR").map(PathBuf::from))
        .unwrap_or_else(default_argo_dir);
    let argo_controller_bin = argo_dir.join("workflow-controller");
    if args.peer == Peer::Argo && !argo_controller_bin.exists() {
        return Err(BenchError::Stage(format!(
            "{} not found: build it with `e2e/cluster argo`",
            argo_controller_bin.display()
        )));
    }
    let client = connect(&kubeconfig).await?;
    install_crds(&client).await;
    if args.peer == Peer::Argo {
        install_argo_crds(&client, &argo_dir.join("crds/full")).await?;
    }
    let out_dir = e2e_dir.join("bench");
    std::fs::create_dir_all(&out_dir).map_err(io(format!("creating {}", out_dir.display())))?;
    let setup = Setup {
        args: args.clone(),
        client,
        e2e_dir,
        kubeconfig,
        operator_bin,
        simkubelet_bin,
        argo_controller_bin,
        out_dir,
    };
    println!("{}", machine_line(&setup));

    let mut batches: BTreeMap<usize, Vec<Batch>> = BTreeMap::new();
    for &n in &args.concurrency {
        for r in 1..=args.repeats {
            let b = match args.peer {
                Peer::Agentrun => run_batch(&setup, n, args.steps, r).await?,
                Peer::Jobs => job_batch(&setup, n, args.steps, r).await?,
                Peer::Argo => argo_batch(&setup, n, args.steps, r).await?,
            };
            println!("{}", b.line());
            batches.entry(n).or_default().push(b);
        }
    }
    let mut resumes = Vec::new();
    if args.resume_runs > 0 && args.peer == Peer::Agentrun {
        for r in 1..=args.repeats {
            let res = resume_batch(&setup, args.resume_runs, r).await?;
            println!("{}", res.line());
            resumes.push(res);
        }
    }
    let mut sizes = Vec::new();
    if args.status_steps > 0 && args.peer == Peer::Agentrun {
        for r in 1..=args.status_repeats {
            let s = status_size(&setup, args.status_steps, r).await?;
            println!("{}", s.line());
            sizes.push(s);
        }
    }
    let table = summary(&setup, &batches, &resumes, &sizes);
    println!("\n{table}");
    if let Some(path) = &args.report {
        std::fs::write(path, &table).map_err(io(format!("writing {}", path.display())))?;
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "batches": batches.values().flatten().map(Batch::json).collect::<Vec<_>>(),
        });
        std::fs::write(path, doc.to_string()).map_err(io(format!("writing {}", path.display())))?;
    }
    // Figures of runs that did not succeed describe no working operator.
    let failed: usize = batches.values().flatten().map(|b| b.failed_runs).sum();
    if failed > 0 {
        return Err(BenchError::Stage(format!(
            "{failed} runs did not succeed; logs in {}",
            setup.out_dir.display()
        )));
    }
    Ok(())
}

async fn connect(kubeconfig: &Path) -> Res<Client> {
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

fn machine_line(setup: &Setup) -> String {
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

// ---------------------------------------------------------------------------
// Child processes

struct Operator {
    proc: Process,
    metrics: SocketAddr,
    health: SocketAddr,
}

fn start_operator(setup: &Setup, ns: &str, dir: &Path) -> Res<Operator> {
    let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let health: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut cmd = Command::new(&setup.operator_bin);
    cmd.args(["run", "--namespace", ns, "--identity", "bench"])
        .arg("--metrics-addr")
        .arg(metrics.to_string())
        .arg("--health-addr")
        .arg(health.to_string())
        .arg(format!("--step-events={}", setup.args.step_events))
        .env("KUBECONFIG", &setup.kubeconfig)
        .env("RUST_LOG", &setup.args.operator_log)
        .env_remove("AGENTRUN_FAILPOINT")
        .env_remove("AGENTRUN_WATCH_NAMESPACE");
    let proc = Process::start("operator", cmd, dir.join("operator.log"))
        .map_err(io("starting the operator"))?;
    Ok(Operator {
        proc,
        metrics,
        health,
    })
}

fn start_simkubelet(setup: &Setup, ns: &str, dir: &Path) -> Res<Process> {
    let mut cmd = Command::new(&setup.simkubelet_bin);
    cmd.args(["--namespace", ns, "--default-run-ms", "0", "--ledger"])
        .arg(dir.join("ledger.jsonl"))
        .env("KUBECONFIG", &setup.kubeconfig)
        .env("RUST_LOG", "warn");
    if setup.args.peer == Peer::Argo {
        // Also Argo's wait sidecar: the step Pods' task results.
        cmd.arg("--argo-task-results");
    }
    Process::start("simkubelet", cmd, dir.join("simkubelet.log")).map_err(io("starting simkubelet"))
}

/// Waits for the operator's `/readyz` (caches listed); returns how long it took.
async fn wait_ready(op: &Operator, deadline: Duration) -> Res<Duration> {
    let start = Instant::now();
    loop {
        if let Ok((200, _)) = http_get(op.health, "/readyz").await {
            return Ok(start.elapsed());
        }
        if start.elapsed() > deadline {
            return Err(BenchError::Stage(format!(
                "operator not ready after {deadline:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `VmRSS` and `VmHWM` of a process, in KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
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

/// The control plane's processes, from `e2e/cluster up`'s PID files.
fn plane_pids(setup: &Setup) -> Vec<(&'static str, u32)> {
    ["kube-apiserver", "etcd"]
        .into_iter()
        .filter_map(|name| {
            let p =
                std::fs::read_to_string(setup.e2e_dir.join(format!("state/{name}.pid"))).ok()?;
            Some((name, p.trim().parse().ok()?))
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Metrics

/// `apiserver_request_total` by (verb, group, resource, subresource, code);
/// `apiserver_request_duration_seconds_{sum,count}` under code "sum"/"count".
type Requests = BTreeMap<(String, String, String, String, String), f64>;

fn parse_labels(s: &str) -> HashMap<&str, &str> {
    let mut out = HashMap::new();
    let mut rest = s;
    while let Some((k, after)) = rest.split_once("=\"") {
        let Some(end) = after.find('"') else { break };
        out.insert(k.trim_start_matches(','), &after[..end]);
        rest = &after[end + 1..];
    }
    out
}

/// Scrapes `/metrics` of the plane's kube-apiserver (with the admin client
/// certificate) or etcd (plain HTTP on loopback).
async fn scrape(setup: &Setup, which: &str) -> Res<String> {
    let port_file = if which == "etcd" {
        "etcd.port"
    } else {
        "apiserver.port"
    };
    let port = std::fs::read_to_string(setup.e2e_dir.join("state").join(port_file))
        .map_err(io(format!("reading the {which} port")))?;
    let pki = setup.e2e_dir.join("pki");
    let mut cmd = Command::new("curl");
    cmd.arg("-sf").arg("--max-time").arg("30");
    if which == "etcd" {
        cmd.arg(format!("http://127.0.0.1:{}/metrics", port.trim()));
    } else {
        cmd.arg("--cacert")
            .arg(pki.join("ca.crt"))
            .arg("--cert")
            .arg(pki.join("admin.crt"))
            .arg("--key")
            .arg(pki.join("admin.key"))
            .arg(format!("https://127.0.0.1:{}/metrics", port.trim()));
    }
    let out = cmd.output().await.map_err(io("running curl"))?;
    if !out.status.success() {
        return Err(BenchError::Stage(format!(
            "scraping {which} /metrics failed: {}",
            out.status
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `apiserver_request_total` and request durations, from the apiserver's `/metrics`.
async fn apiserver_requests(setup: &Setup) -> Res<Requests> {
    let text = scrape(setup, "apiserver").await?;
    let mut m = Requests::new();
    for line in text.lines() {
        let (rest, code) = if let Some(r) = line.strip_prefix("apiserver_request_total{") {
            (r, None)
        } else if let Some(r) = line.strip_prefix("apiserver_request_duration_seconds_sum{") {
            (r, Some("sum"))
        } else if let Some(r) = line.strip_prefix("apiserver_request_duration_seconds_count{") {
            (r, Some("count"))
        } else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let l = parse_labels(labels);
        let get = |k: &str| l.get(k).copied().unwrap_or("").to_owned();
        let v: f64 = value.trim().parse().unwrap_or(0.0);
        *m.entry((
            get("verb"),
            get("group"),
            get("resource"),
            get("subresource"),
            code.map_or_else(|| get("code"), str::to_owned),
        ))
        .or_default() += v;
    }
    Ok(m)
}

const WRITE_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// The operator's writes in a window: every write verb on pods (not
/// pods/status, which is simkubelet's), agentruns/status, approvals and
/// signals (and their status), run records, events; agentruns themselves
/// only for DELETE (TTL), since the driver POSTs them. Keyed "verb resource[/sub]".
fn operator_writes(before: &Requests, after: &Requests) -> (BTreeMap<String, f64>, f64) {
    let mut by = BTreeMap::new();
    let mut conflicts = 0.0;
    for (k, v) in after {
        let d = v - before.get(k).copied().unwrap_or(0.0);
        if d <= 0.0 {
            continue;
        }
        let (verb, _group, resource, sub, code) = k;
        if !WRITE_VERBS.contains(&verb.as_str()) || code == "sum" || code == "count" {
            continue;
        }
        let ours = match (resource.as_str(), sub.as_str()) {
            ("pods", "") => true,
            ("agentruns", "status") => true,
            ("agentruns", "") => verb == "DELETE",
            ("approvals", _) | ("signals", _) | ("runrecords", "") => true,
            ("events", "") => true,
            _ => false,
        };
        if !ours {
            continue;
        }
        if code == "409" {
            conflicts += d;
        }
        let name = if sub.is_empty() {
            format!("{verb} {resource}")
        } else {
            format!("{verb} {resource}/{sub}")
        };
        *by.entry(name).or_default() += d;
    }
    (by, conflicts)
}

/// Mean server-side latency (ms) of the operator's write kinds in a window,
/// from `apiserver_request_duration_seconds` (all callers of that kind).
fn server_latency(before: &Requests, after: &Requests) -> BTreeMap<String, f64> {
    let delta = |k: &(String, String, String, String, String)| {
        after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0)
    };
    let mut out = BTreeMap::new();
    for k in after.keys().filter(|k| k.4 == "count") {
        let (verb, group, resource, sub, _) = k;
        let interesting = matches!(
            (verb.as_str(), resource.as_str(), sub.as_str()),
            ("APPLY", "agentruns", "status")
                | ("POST", "pods", "")
                | ("PATCH", "pods", "")
                | ("PATCH", "pods", "status")
                | ("POST", "events", "")
        );
        let n = delta(k);
        if !interesting || n <= 0.0 {
            continue;
        }
        let sum_key = (
            verb.clone(),
            group.clone(),
            resource.clone(),
            sub.clone(),
            "sum".into(),
        );
        let name = if sub.is_empty() {
            format!("{verb} {resource}")
        } else {
            format!("{verb} {resource}/{sub}")
        };
        out.insert(name, delta(&sum_key) / n * 1000.0);
    }
    out
}

/// One metric value (sum over label sets) from the operator's `/metrics`.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

// ---------------------------------------------------------------------------
// Observation: the driver's own watches

#[derive(Clone, Debug, Default)]
struct PodSeen {
    run: String,
    step: String,
    attempt: String,
    first_seen: Option<Instant>,
    succeeded_seen: Option<Instant>,
}

#[derive(Default)]
struct Seen {
    pods: HashMap<String, PodSeen>,
    /// Run name → when it was first seen terminal, and its phase.
    finished: HashMap<String, (Instant, RunPhase)>,
}

type Shared = Arc<Mutex<Seen>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Seen> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Watches the namespace's step Pods and runs, recording when this driver
/// first saw each Pod, saw it Succeeded, and saw each run finish.
fn observe(client: &Client, ns: &str) -> (Shared, tokio::task::JoinHandle<()>) {
    let seen: Shared = Arc::default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), ns);
    let s1 = seen.clone();
    let pod_task = async move {
        let stream = watcher(pods, watcher::Config::default().labels(labels::RUN))
            .default_backoff()
            .applied_objects();
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            let Ok(pod) = ev else { continue };
            let now = Instant::now();
            let succeeded =
                pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded");
            let mut g = lock(&s1);
            let e = g.pods.entry(pod.name_any()).or_insert_with(|| {
                let l = pod.labels();
                let get = |k: &str| l.get(k).cloned().unwrap_or_default();
                PodSeen {
                    run: get(labels::RUN),
                    step: get(labels::STEP),
                    attempt: get(labels::ATTEMPT),
                    first_seen: Some(now),
                    succeeded_seen: None,
                }
            });
            if succeeded && e.succeeded_seen.is_none() {
                e.succeeded_seen = Some(now);
            }
        }
    };
    let s2 = seen.clone();
    let run_task = async move {
        let stream = watcher(runs, watcher::Config::default())
            .default_backoff()
            .applied_objects();
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            let Ok(run) = ev else { continue };
            let phase = run.status.as_ref().and_then(|s| s.phase);
            if let Some(p) = phase.filter(|p| p.is_terminal()) {
                lock(&s2)
                    .finished
                    .entry(run.name_any())
                    .or_insert((Instant::now(), p));
            }
        }
    };
    let task = tokio::spawn(async move {
        tokio::join!(pod_task, run_task);
    });
    (seen, task)
}

/// Polls `cond` on the observations every 20 ms until it holds or `deadline` passes.
async fn wait_seen(
    seen: &Shared,
    what: &str,
    deadline: Duration,
    cond: impl Fn(&Seen) -> Option<String>,
) -> Res<Instant> {
    let start = Instant::now();
    loop {
        let progress = cond(&lock(seen));
        match progress {
            None => return Ok(Instant::now()),
            Some(p) if start.elapsed() > deadline => {
                return Err(BenchError::Stage(format!(
                    "aborted: {what} not reached within {deadline:?} ({p})"
                )));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

// ---------------------------------------------------------------------------
// Runs

fn step_name(i: usize) -> String {
    format!("s{i:03}")
}

/// `steps` Idempotent steps; with `result_bytes > 0` each step reports a
/// string result of that many bytes (simkubelet's `SIM_STEP`), else `{}`.
/// A fan-out: every step after the first depends on the first only.
fn run_spec(steps: usize, result_bytes: usize, fan_out: bool) -> Value {
    let mut container = json!({"image": "registry.example/agent-step:1"});
    if result_bytes > 0 {
        let sim = json!({"result": "z".repeat(result_bytes)}).to_string();
        container["env"] = json!([{"name": "SIM_STEP", "value": sim}]);
    }
    let count = steps;
    let steps: Vec<Value> = (0..steps)
        .map(|i| {
            let mut step = json!({
                "name": step_name(i),
                "effect": "Idempotent",
                "container": container,
            });
            if fan_out {
                step["dependsOn"] = if i == 0 {
                    json!([])
                } else {
                    json!([step_name(0)])
                };
            }
            step
        })
        .collect();
    if fan_out {
        json!({"steps": steps, "parallelism": count.clamp(1, 100)})
    } else {
        json!({"steps": steps})
    }
}

fn run_name(i: usize) -> String {
    format!("r{i:05}")
}

/// Creates `n` runs of `steps` steps; returns when all creates are acknowledged.
async fn create_runs(
    setup: &Setup,
    ns: &str,
    n: usize,
    steps: usize,
    result_bytes: usize,
    fan_out: bool,
) -> Res<()> {
    let api: Api<AgentRun> = Api::namespaced(setup.client.clone(), ns);
    let spec = run_spec(steps, result_bytes, fan_out);
    futures::stream::iter((0..n).map(|i| {
        let api = api.clone();
        let spec = spec.clone();
        async move {
            let run: AgentRun = serde_json::from_value(json!({
                "apiVersion": "agentrun.dev/v1alpha1",
                "kind": "AgentRun",
                "metadata": {"name": run_name(i)},
                "spec": spec,
            }))
            .expect("the run manifest matches the AgentRun type");
            api.create(&PostParams::default(), &run)
                .await
                .map(|_| ())
                .map_err(self::api(format!("creating run {}", run_name(i))))
        }
    }))
    .buffer_unordered(setup.args.create_parallelism.max(1))
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// A fresh namespace and a directory for its logs and ledger.
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

async fn namespace(setup: &Setup, name: &str) -> Res<(TestNamespace, PathBuf)> {
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
async fn teardown(setup: &Setup, ns: TestNamespace) -> Res<()> {
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

// ---------------------------------------------------------------------------
// One measured batch

#[derive(Clone, Debug, Default)]
struct Batch {
    runs: usize,
    steps: usize,
    repeat: usize,
    wall_s: f64,
    steps_per_s: f64,
    writes_per_step: f64,
    writes: BTreeMap<String, f64>,
    /// Mean apiserver latency (ms) per write kind.
    server_ms: BTreeMap<String, f64>,
    conflicts_409: f64,
    handoff_p50_ms: f64,
    handoff_p99_ms: f64,
    handoff_max_ms: f64,
    handoffs: usize,
    /// CPU ms per step: operator, simkubelet, kube-apiserver, etcd.
    cpu_ms_per_step: BTreeMap<&'static str, f64>,
    rss_idle_kib: u64,
    rss_end_kib: u64,
    hwm_kib: u64,
    reconciles: f64,
    reconcile_mean_ms: f64,
    status_writes: f64,
    failed_runs: usize,
}

/// What every batch measures the same way, whichever controller ran it;
/// the operator's own reconcile figures are left at zero.
struct Window<'a> {
    runs: usize,
    steps: usize,
    repeat: usize,
    wall_s: f64,
    writes: (BTreeMap<String, f64>, f64),
    before: &'a Requests,
    after: &'a Requests,
    seen: &'a Seen,
    cpu_ms_per_step: BTreeMap<&'static str, f64>,
    rss_idle_kib: u64,
    rss_end_kib: u64,
    hwm_kib: u64,
}

impl From<Window<'_>> for Batch {
    fn from(w: Window<'_>) -> Batch {
        let total_steps = (w.runs * w.steps) as f64;
        let (writes, conflicts_409) = w.writes;
        let h = handoffs(w.seen, w.steps);
        Batch {
            runs: w.runs,
            steps: w.steps,
            repeat: w.repeat,
            wall_s: w.wall_s,
            steps_per_s: total_steps / w.wall_s,
            writes_per_step: writes.values().sum::<f64>() / total_steps,
            writes,
            server_ms: server_latency(w.before, w.after),
            conflicts_409,
            handoff_p50_ms: percentile(&h, 50.0),
            handoff_p99_ms: percentile(&h, 99.0),
            handoff_max_ms: h.last().copied().unwrap_or(f64::NAN),
            handoffs: h.len(),
            cpu_ms_per_step: w.cpu_ms_per_step,
            rss_idle_kib: w.rss_idle_kib,
            rss_end_kib: w.rss_end_kib,
            hwm_kib: w.hwm_kib,
            reconciles: 0.0,
            reconcile_mean_ms: 0.0,
            status_writes: 0.0,
            failed_runs: w
                .seen
                .finished
                .values()
                .filter(|(_, p)| *p != RunPhase::Succeeded)
                .count(),
        }
    }
}

impl Batch {
    fn json(&self) -> Value {
        json!({
            "runs": self.runs,
            "steps": self.steps,
            "repeat": self.repeat,
            "wallSeconds": self.wall_s,
            "writes": self.writes,
            "writesPerStep": self.writes_per_step,
            "conflicts409": self.conflicts_409,
            "handoffP50Ms": self.handoff_p50_ms,
            "handoffP99Ms": self.handoff_p99_ms,
            "cpuMsPerStep": self.cpu_ms_per_step,
            "rssIdleKiB": self.rss_idle_kib,
            "rssPeakKiB": self.hwm_kib,
            "failedRuns": self.failed_runs,
        })
    }

    fn line(&self) -> String {
        let writes: Vec<String> = self
            .writes
            .iter()
            .map(|(k, v)| format!("{k}={:.2}", v / (self.runs * self.steps) as f64))
            .collect();
        format!(
            "batch runs={} steps={} repeat={}: {:.1} s, {:.1} steps/s, {:.2} writes/step [{}] (409s {}), \
             hand-off p50 {:.1} ms p99 {:.1} ms max {:.1} ms (n={}), RSS idle {} KiB end {} KiB peak {} KiB, \
             reconciles {} (mean {:.2} ms), status writes {}, failed runs {}; apiserver mean ms [{}]; CPU ms/step [{}]",
            self.runs,
            self.steps,
            self.repeat,
            self.wall_s,
            self.steps_per_s,
            self.writes_per_step,
            writes.join(" "),
            self.conflicts_409,
            self.handoff_p50_ms,
            self.handoff_p99_ms,
            self.handoff_max_ms,
            self.handoffs,
            self.rss_idle_kib,
            self.rss_end_kib,
            self.hwm_kib,
            self.reconciles,
            self.reconcile_mean_ms,
            self.status_writes,
            self.failed_runs,
            self.server_ms
                .iter()
                .map(|(k, v)| format!("{k}={v:.1}"))
                .collect::<Vec<_>>()
                .join(" "),
            self.cpu_ms_per_step
                .iter()
                .map(|(k, v)| format!("{k}={v:.2}"))
                .collect::<Vec<_>>()
                .join(" "),
        )
    }
}

/// What a batch's watch saw and its wall time (the first create to the last
/// run seen finished), once the watch is stopped. A batch that did not finish
/// is torn down and its failure named, with where its logs are.
async fn settle(
    setup: &Setup,
    ns: TestNamespace,
    finished: Res<Instant>,
    seen: &Shared,
    t0: Instant,
    what: String,
    dir: &Path,
) -> Res<(TestNamespace, Seen, f64)> {
    if let Err(e) = finished {
        teardown(setup, ns).await?;
        return Err(BenchError::Stage(format!(
            "{what}: {e} (logs in {})",
            dir.display()
        )));
    }
    let g = std::mem::take(&mut *lock(seen));
    let last = g.finished.values().map(|(t, _)| *t).max().unwrap_or(t0);
    Ok((ns, g, last.duration_since(t0).as_secs_f64()))
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Hand-offs: for each run and step i ≥ 1, (first sight of step i's Pod) −
/// (sight of step i−1's Pod Succeeded), in ms.
fn handoffs(seen: &Seen, steps: usize) -> Vec<f64> {
    let mut by_run: HashMap<&str, HashMap<&str, &PodSeen>> = HashMap::new();
    for p in seen.pods.values() {
        // The first attempt of each step (a retry would have attempt > 1).
        let slot = by_run
            .entry(p.run.as_str())
            .or_default()
            .entry(p.step.as_str())
            .or_insert(p);
        if p.first_seen < slot.first_seen {
            *slot = p;
        }
    }
    let mut out = Vec::new();
    for steps_of in by_run.values() {
        for i in 1..steps {
            let (Some(prev), Some(next)) = (
                steps_of.get(step_name(i - 1).as_str()),
                steps_of.get(step_name(i).as_str()),
            ) else {
                continue;
            };
            if let (Some(done), Some(created)) = (prev.succeeded_seen, next.first_seen) {
                out.push(created.saturating_duration_since(done).as_secs_f64() * 1000.0);
            }
        }
    }
    out.sort_by(f64::total_cmp);
    out
}

async fn run_batch(setup: &Setup, n: usize, steps: usize, repeat: usize) -> Res<Batch> {
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let (ns, dir) = namespace(setup, &format!("bench-{n}x{steps}-r{repeat}")).await?;
    let nsname = ns.name().to_owned();
    eprintln!("[bench] batch {n} runs x {steps} steps, repeat {repeat}: namespace {nsname}");
    let mut kubelet = start_simkubelet(setup, &nsname, &dir)?;
    let mut op = start_operator(setup, &nsname, &dir)?;
    wait_ready(&op, Duration::from_secs(60)).await?;
    let (seen, watch_task) = observe(&setup.client, &nsname);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss_idle, _) = rss_kib(op.proc.pid().unwrap_or(0));

    let before = apiserver_requests(setup).await?;
    let mut pids = plane_pids(setup);
    pids.push(("operator", op.proc.pid().unwrap_or(0)));
    pids.push(("simkubelet", kubelet.pid().unwrap_or(0)));
    let cpu_before: Vec<f64> = pids.iter().map(|(_, p)| cpu_ms(*p)).collect();
    let t0 = Instant::now();
    create_runs(setup, &nsname, n, steps, 0, setup.args.fan_out).await?;
    let created = t0.elapsed();
    let result = wait_seen(&seen, "every run finished", deadline, |s| {
        (s.finished.len() < n).then(|| format!("{}/{n} runs finished", s.finished.len()))
    })
    .await;
    let (rss_end, hwm) = rss_kib(op.proc.pid().unwrap_or(0));
    let cpu: BTreeMap<&'static str, f64> = pids
        .iter()
        .zip(cpu_before)
        .map(|((name, p), before)| (*name, (cpu_ms(*p) - before) / (n * steps) as f64))
        .collect();
    // Let in-flight writes of the last runs (finalizer releases) land.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = apiserver_requests(setup).await?;
    let op_metrics = http_get(op.metrics, "/metrics")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    watch_task.abort();
    op.proc.kill().await;
    kubelet.kill().await;
    // The watch task is stopped: take what it saw.
    let (ns, g, wall) = settle(
        setup,
        ns,
        result,
        &seen,
        t0,
        format!("batch {n}x{steps} repeat {repeat}"),
        &dir,
    )
    .await?;
    let reconciles = metric(&op_metrics, "agentrun_reconcile_duration_seconds_count");
    let rsum = metric(&op_metrics, "agentrun_reconcile_duration_seconds_sum");
    let batch = Batch {
        reconciles,
        reconcile_mean_ms: if reconciles > 0.0 {
            rsum / reconciles * 1000.0
        } else {
            0.0
        },
        status_writes: metric(
            &op_metrics,
            "agentrun_checkpoint_write_duration_seconds_count",
        ),
        ..Batch::from(Window {
            runs: n,
            steps,
            repeat,
            wall_s: wall,
            writes: operator_writes(&before, &after),
            before: &before,
            after: &after,
            seen: &g,
            cpu_ms_per_step: cpu,
            rss_idle_kib: rss_idle,
            rss_end_kib: rss_end,
            hwm_kib: hwm,
        })
    };
    eprintln!(
        "[bench]   created {n} runs in {:.1} s; operator metrics: {}",
        created.as_secs_f64(),
        [
            "agentrun_steps_started_total",
            "agentrun_status_conflicts_total",
            "agentrun_duplicate_creates_suppressed_total",
            "agentrun_reconcile_errors_total",
        ]
        .iter()
        .map(|m| format!("{m}={}", metric(&op_metrics, m)))
        .collect::<Vec<_>>()
        .join(" ")
    );
    std::fs::write(dir.join("operator-metrics.txt"), &op_metrics)
        .map_err(io("writing operator-metrics.txt"))?;
    teardown(setup, ns).await?;
    Ok(batch)
}

// ---------------------------------------------------------------------------
// The Job controller as a peer

fn job_name(run: usize, step: usize) -> String {
    format!("{}-{}", run_name(run), step_name(step))
}

/// One single-Pod Job: step `step` of chain `run`. Its Pod carries the labels
/// simkubelet and this driver's watch look for.
fn job_manifest(run: usize, step: usize) -> k8s_openapi::api::batch::v1::Job {
    serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(run, step)},
        "spec": {
            "backoffLimit": 0,
            "completions": 1,
            "parallelism": 1,
            "template": {
                "metadata": {"labels": {
                    labels::RUN: run_name(run),
                    labels::STEP: step_name(step),
                    labels::ATTEMPT: "1",
                }},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "step", "image": "registry.example/agent-step:1"}],
                },
            },
        },
    }))
    .expect("the Job manifest matches the Job type")
}

/// The Job controller's writes in a window: every write verb on pods (not
/// pods/status, simkubelet's), jobs/status and events; jobs themselves only
/// for PUT/PATCH (the driver POSTs them). Keyed "verb resource[/sub]".
fn job_controller_writes(before: &Requests, after: &Requests) -> (BTreeMap<String, f64>, f64) {
    let mut by = BTreeMap::new();
    let mut conflicts = 0.0;
    for (k, v) in after {
        let d = v - before.get(k).copied().unwrap_or(0.0);
        let (verb, _group, resource, sub, code) = k;
        if d <= 0.0 || !WRITE_VERBS.contains(&verb.as_str()) || code == "sum" || code == "count" {
            continue;
        }
        let ours = match (resource.as_str(), sub.as_str()) {
            ("pods", "") | ("jobs", "status") | ("events", "") => true,
            ("jobs", "") => verb != "POST",
            _ => false,
        };
        if !ours {
            continue;
        }
        if code == "409" {
            conflicts += d;
        }
        let name = if sub.is_empty() {
            format!("{verb} {resource}")
        } else {
            format!("{verb} {resource}/{sub}")
        };
        *by.entry(name).or_default() += d;
    }
    (by, conflicts)
}

/// `n` chains of `steps` single-Pod Jobs run by kube-controller-manager: the
/// driver creates the first Job of every chain, then Job i+1 of a chain once
/// its watch shows Job i `Complete`. The same figures as [`run_batch`], the
/// controller being the plane's kube-controller-manager.
async fn job_batch(setup: &Setup, n: usize, steps: usize, repeat: usize) -> Res<Batch> {
    use k8s_openapi::api::batch::v1::Job;
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let (ns, dir) = namespace(setup, &format!("bench-jobs-{n}x{steps}-r{repeat}")).await?;
    let nsname = ns.name().to_owned();
    eprintln!("[bench] batch {n} Job chains x {steps} Jobs, repeat {repeat}: namespace {nsname}");
    let kcm_pid: u32 =
        std::fs::read_to_string(setup.e2e_dir.join("state/kube-controller-manager.pid"))
            .ok()
            .and_then(|p| p.trim().parse().ok())
            .ok_or_else(|| {
                BenchError::Stage("no kube-controller-manager pid in the plane's state".into())
            })?;
    let mut kubelet = start_simkubelet(setup, &nsname, &dir)?;
    let (seen, watch_task) = observe(&setup.client, &nsname);
    let jobs: Api<Job> = Api::namespaced(setup.client.clone(), &nsname);
    // The chain driver: Job i Complete → create Job i+1; the last one
    // Complete (or any Failed) → the chain is finished.
    let chains = {
        let jobs = jobs.clone();
        let seen = seen.clone();
        tokio::spawn(async move {
            let stream = watcher(jobs.clone(), watcher::Config::default())
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            let mut created: std::collections::HashSet<String> = std::collections::HashSet::new();
            while let Some(ev) = stream.next().await {
                let Ok(job) = ev else { continue };
                let cond = |t: &str| {
                    job.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == t && c.status == "True"))
                };
                let name = job.name_any();
                let Some((run, step)) = name.rsplit_once("-s") else {
                    continue;
                };
                let (Some(r), Ok(i)) = (
                    run.strip_prefix('r').and_then(|r| r.parse::<usize>().ok()),
                    step.parse::<usize>(),
                ) else {
                    continue;
                };
                if cond("Failed") {
                    lock(&seen)
                        .finished
                        .entry(run.to_owned())
                        .or_insert((Instant::now(), RunPhase::Failed));
                } else if cond("Complete") {
                    if i + 1 >= steps {
                        lock(&seen)
                            .finished
                            .entry(run.to_owned())
                            .or_insert((Instant::now(), RunPhase::Succeeded));
                    } else if created.insert(job_name(r, i + 1)) {
                        let jobs = jobs.clone();
                        tokio::spawn(async move {
                            if let Err(e) = jobs
                                .create(&PostParams::default(), &job_manifest(r, i + 1))
                                .await
                            {
                                eprintln!("[bench] creating Job {}: {e}", job_name(r, i + 1));
                            }
                        });
                    }
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss_idle, _) = rss_kib(kcm_pid);
    let before = apiserver_requests(setup).await?;
    let mut pids = plane_pids(setup);
    pids.push(("operator", kcm_pid));
    pids.push(("simkubelet", kubelet.pid().unwrap_or(0)));
    let cpu_before: Vec<f64> = pids.iter().map(|(_, p)| cpu_ms(*p)).collect();
    // kcm lives across batches, so its VmHWM is not this batch's: sample VmRSS.
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(rss_idle));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                let (rss, _) = rss_kib(kcm_pid);
                peak.fetch_max(rss, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let t0 = Instant::now();
    futures::stream::iter((0..n).map(|r| {
        let jobs = jobs.clone();
        async move {
            jobs.create(&PostParams::default(), &job_manifest(r, 0))
                .await
                .map(|_| ())
                .map_err(self::api(format!("creating Job {}", job_name(r, 0))))
        }
    }))
    .buffer_unordered(setup.args.create_parallelism.max(1))
    .try_collect::<Vec<()>>()
    .await?;
    let result = wait_seen(&seen, "every Job chain finished", deadline, |s| {
        (s.finished.len() < n).then(|| format!("{}/{n} chains finished", s.finished.len()))
    })
    .await;
    let cpu: BTreeMap<&'static str, f64> = pids
        .iter()
        .zip(cpu_before)
        .map(|((name, p), before)| (*name, (cpu_ms(*p) - before) / (n * steps) as f64))
        .collect();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    sampler.abort();
    let (rss_end, _) = rss_kib(kcm_pid);
    let after = apiserver_requests(setup).await?;
    watch_task.abort();
    chains.abort();
    kubelet.kill().await;
    // The watch task is stopped: take what it saw.
    let (ns, g, wall) = settle(
        setup,
        ns,
        result,
        &seen,
        t0,
        format!("Job batch {n}x{steps} repeat {repeat}"),
        &dir,
    )
    .await?;
    let batch = Batch::from(Window {
        runs: n,
        steps,
        repeat,
        wall_s: wall,
        writes: job_controller_writes(&before, &after),
        before: &before,
        after: &after,
        seen: &g,
        cpu_ms_per_step: cpu,
        rss_idle_kib: rss_idle,
        rss_end_kib: rss_end,
        hwm_kib: peak.load(std::sync::atomic::Ordering::Relaxed),
    });
    // Jobs (and their Pods) go with the namespace.
    teardown(setup, ns).await?;
    Ok(batch)
}

// ---------------------------------------------------------------------------
// Argo Workflows as a peer

/// Where `e2e/cluster argo` puts Argo (its cache, like the plane's binaries).
fn default_argo_dir() -> PathBuf {
    agentrun_e2e::support::kubectl::cache_dir()
        .unwrap_or_else(|| PathBuf::from(".cache/agentrun-operator"))
        .join("argo-v4.0.5")
}

/// Server-side applies Argo's CRDs (every `*.yaml` in `dir`: the full ones,
/// with their schema, which Argo's install manifests apply).
async fn install_argo_crds(client: &Client, dir: &Path) -> Res<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(format!(
            "reading {} (run `e2e/cluster argo`)",
            dir.display()
        )))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(BenchError::Stage(format!(
            "no Argo CRDs in {} (run `e2e/cluster argo`)",
            dir.display()
        )));
    }
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(io(format!("reading {}", f.display())))?;
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).map_err(|e| BenchError::Config {
                what: format!("parsing {}", f.display()),
                message: e.to_string(),
            })?;
        agentrun_e2e::apply_crd(client, &crd).await;
    }
    Ok(())
}

fn argo_resource(kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "argoproj.io".into(),
        version: "v1alpha1".into(),
        api_version: "argoproj.io/v1alpha1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// One Workflow: a `steps` template of `steps` sequential steps (one step per
/// group, so each waits for the one before), each its own container template
/// whose Pod carries the labels simkubelet and this driver's watch look for
/// (`podMetadata` for the run, the template's `metadata` for the step). The
/// command is explicit so the controller never looks an image up.
fn workflow_manifest(run: usize, steps: usize) -> kube::api::DynamicObject {
    let groups: Vec<Value> = (0..steps)
        .map(|i| json!([{"name": step_name(i), "template": step_name(i)}]))
        .collect();
    let mut templates = vec![json!({"name": "chain", "steps": groups})];
    templates.extend((0..steps).map(|i| {
        json!({
            "name": step_name(i),
            "metadata": {"labels": {labels::STEP: step_name(i)}},
            "container": {"image": "registry.example/agent-step:1", "command": ["/step"]},
        })
    }));
    serde_json::from_value(json!({
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": run_name(run)},
        "spec": {
            "entrypoint": "chain",
            "podMetadata": {"labels": {labels::RUN: run_name(run), labels::ATTEMPT: "1"}},
            "templates": templates,
        },
    }))
    .expect("the Workflow manifest is an object")
}

/// Argo's writes in a window: every write verb on pods (not pods/status,
/// simkubelet's kubelet part), events, workflows (not POST: the driver's),
/// workflowtaskresults (the emulated wait sidecar's creates and patches, the
/// controller's deletes), workflowtasksets, workflowartifactgctasks and
/// configmaps. Leases are left out: leader election is off, and the
/// apiserver's own identity leases would be counted. Keyed "verb resource[/sub]".
fn argo_writes(before: &Requests, after: &Requests) -> (BTreeMap<String, f64>, f64) {
    let mut by = BTreeMap::new();
    let mut conflicts = 0.0;
    for (k, v) in after {
        let d = v - before.get(k).copied().unwrap_or(0.0);
        let (verb, _group, resource, sub, code) = k;
        if d <= 0.0 || !WRITE_VERBS.contains(&verb.as_str()) || code == "sum" || code == "count" {
            continue;
        }
        let argos = match (resource.as_str(), sub.as_str()) {
            ("pods", "") | ("events", "") | ("configmaps", "") => true,
            ("workflowtaskresults" | "workflowtasksets" | "workflowartifactgctasks", _) => true,
            ("workflows", _) => verb != "POST",
            _ => false,
        };
        if !argos {
            continue;
        }
        if code == "409" {
            conflicts += d;
        }
        let name = if sub.is_empty() {
            format!("{verb} {resource}")
        } else {
            format!("{verb} {resource}/{sub}")
        };
        *by.entry(name).or_default() += d;
    }
    (by, conflicts)
}

/// The workflow-controller of one batch: namespaced to `ns`, leader election
/// off (as kcm's and the operator's in this benchmark), the admin kubeconfig
/// (so no RBAC), an executor image nothing pulls, metrics on `metrics_port`.
fn start_argo_controller(setup: &Setup, ns: &str, dir: &Path) -> Res<Process> {
    let a = &setup.args;
    let mut cmd = Command::new(&setup.argo_controller_bin);
    cmd.arg("--kubeconfig")
        .arg(&setup.kubeconfig)
        .args(["--namespace", ns, "--namespaced", "--managed-namespace", ns])
        .args(["--executor-image", "registry.example/argoexec:v4.0.5"])
        .arg(format!("--qps={}", a.argo_qps))
        .arg(format!("--burst={}", a.argo_burst))
        .args(["--loglevel", "info"])
        .env("LEADER_ELECTION_DISABLE", "true")
        .env_remove("KUBECONFIG");
    if !a.argo_requeue_time.is_empty() {
        cmd.env("DEFAULT_REQUEUE_TIME", &a.argo_requeue_time);
    }
    Process::start(
        "workflow-controller",
        cmd,
        dir.join("workflow-controller.log"),
    )
    .map_err(io("starting Argo's workflow-controller"))
}

/// Waits until the controller's log says its caches have synced.
async fn wait_argo_ready(log: &Path, deadline: Duration) -> Res<Duration> {
    let start = Instant::now();
    loop {
        let log_text = std::fs::read_to_string(log).unwrap_or_default();
        if log_text.contains(ARGO_READY_LINE) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > deadline {
            return Err(BenchError::Stage(format!(
                "Argo's workflow-controller not ready after {deadline:?} (no {ARGO_READY_LINE:?} in {})",
                log.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the workflow-controller logs first once its caches have synced (its
/// `workflowGarbageCollector` starts right after `WaitForCacheSync`).
const ARGO_READY_LINE: &str = "Performing periodic GC";

/// `n` Workflows of `steps` sequential steps run by Argo's workflow-controller
/// (started for this batch in its namespace), simkubelet running the step Pods
/// and writing their task results as Argo's `wait` sidecar. The same figures
/// as [`run_batch`].
async fn argo_batch(setup: &Setup, n: usize, steps: usize, repeat: usize) -> Res<Batch> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::DynamicObject;
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let (ns, dir) = namespace(setup, &format!("bench-argo-{n}x{steps}-r{repeat}")).await?;
    let nsname = ns.name().to_owned();
    eprintln!("[bench] batch {n} Workflows x {steps} steps, repeat {repeat}: namespace {nsname}");
    // The controller refuses to start without its ConfigMap; this one only
    // moves its metrics server off the shared :9090 (plain HTTP).
    let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let cms: Api<ConfigMap> = Api::namespaced(setup.client.clone(), &nsname);
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "workflow-controller-configmap"},
        "data": {"metricsConfig": format!("port: {}\nsecure: false\n", metrics.port())},
    }))
    .expect("the ConfigMap is valid");
    cms.create(&PostParams::default(), &cm)
        .await
        .map_err(api("creating workflow-controller-configmap"))?;
    let mut controller = start_argo_controller(setup, &nsname, &dir)?;
    let mut kubelet = start_simkubelet(setup, &nsname, &dir)?;
    if let Err(e) = wait_argo_ready(
        &dir.join("workflow-controller.log"),
        Duration::from_secs(60),
    )
    .await
    {
        controller.kill().await;
        kubelet.kill().await;
        teardown(setup, ns).await?;
        return Err(e);
    }
    let argo_pid = controller.pid().unwrap_or(0);
    let (seen, watch_task) = observe(&setup.client, &nsname);
    let workflows: Api<DynamicObject> = Api::namespaced_with(
        setup.client.clone(),
        &nsname,
        &argo_resource("Workflow", "workflows"),
    );
    // A Workflow is finished when its phase is Succeeded, Failed or Error.
    let finished_task = {
        let workflows = workflows.clone();
        let seen = seen.clone();
        tokio::spawn(async move {
            let stream = watcher(workflows, watcher::Config::default())
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                let Ok(wf) = ev else { continue };
                let phase = wf.data.pointer("/status/phase").and_then(Value::as_str);
                let outcome = match phase {
                    Some("Succeeded") => RunPhase::Succeeded,
                    Some("Failed" | "Error") => RunPhase::Failed,
                    _ => continue,
                };
                lock(&seen)
                    .finished
                    .entry(wf.name_any())
                    .or_insert((Instant::now(), outcome));
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss_idle, _) = rss_kib(argo_pid);
    let before = apiserver_requests(setup).await?;
    let mut pids = plane_pids(setup);
    pids.push(("operator", argo_pid));
    pids.push(("simkubelet", kubelet.pid().unwrap_or(0)));
    let cpu_before: Vec<f64> = pids.iter().map(|(_, p)| cpu_ms(*p)).collect();
    let t0 = Instant::now();
    futures::stream::iter((0..n).map(|r| {
        let workflows = workflows.clone();
        async move {
            workflows
                .create(&PostParams::default(), &workflow_manifest(r, steps))
                .await
                .map(|_| ())
                .map_err(self::api(format!("creating Workflow {}", run_name(r))))
        }
    }))
    .buffer_unordered(setup.args.create_parallelism.max(1))
    .try_collect::<Vec<()>>()
    .await?;
    let result = wait_seen(&seen, "every Workflow finished", deadline, |s| {
        (s.finished.len() < n).then(|| format!("{}/{n} Workflows finished", s.finished.len()))
    })
    .await;
    let (rss_end, hwm) = rss_kib(argo_pid);
    let cpu: BTreeMap<&'static str, f64> = pids
        .iter()
        .zip(cpu_before)
        .map(|((name, p), before)| (*name, (cpu_ms(*p) - before) / (n * steps) as f64))
        .collect();
    // Let the last writes (pod labels, task-result deletes) land.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = apiserver_requests(setup).await?;
    let argo_metrics = http_get(metrics, "/metrics")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    watch_task.abort();
    finished_task.abort();
    controller.kill().await;
    kubelet.kill().await;
    std::fs::write(dir.join("workflow-controller-metrics.txt"), &argo_metrics)
        .map_err(io("writing workflow-controller-metrics.txt"))?;
    // The watch task is stopped: take what it saw.
    let (ns, g, wall) = settle(
        setup,
        ns,
        result,
        &seen,
        t0,
        format!("Argo batch {n}x{steps} repeat {repeat}"),
        &dir,
    )
    .await?;
    let batch = Batch::from(Window {
        runs: n,
        steps,
        repeat,
        wall_s: wall,
        writes: argo_writes(&before, &after),
        before: &before,
        after: &after,
        seen: &g,
        cpu_ms_per_step: cpu,
        rss_idle_kib: rss_idle,
        rss_end_kib: rss_end,
        hwm_kib: hwm,
    });
    // Workflows, their Pods and task results go with the namespace.
    teardown(setup, ns).await?;
    Ok(batch)
}

// ---------------------------------------------------------------------------
// Resume

#[derive(Clone, Debug, Default)]
struct Resume {
    runs: usize,
    repeat: usize,
    ready_s: f64,
    all_next_s: f64,
    next_p50_s: f64,
    finished_s: f64,
    duplicate_pods: usize,
    duplicate_executions: usize,
    suppressed_creates: f64,
    rss_idle_kib: u64,
    hwm_kib: u64,
}

impl Resume {
    fn line(&self) -> String {
        format!(
            "resume runs={} repeat={}: operator ready {:.2} s after restart; every run has its next Pod after {:.2} s (p50 {:.2} s); \
             all finished after {:.1} s; duplicate Pods {}, steps executed more than once {}, creates suppressed {}; RSS idle {} KiB, peak after restart {} KiB",
            self.runs,
            self.repeat,
            self.ready_s,
            self.all_next_s,
            self.next_p50_s,
            self.finished_s,
            self.duplicate_pods,
            self.duplicate_executions,
            self.suppressed_creates,
            self.rss_idle_kib,
            self.hwm_kib
        )
    }
}

/// `n` runs of 3 steps wait on their first step's Pod; the operator is
/// SIGKILLed; the Pods succeed while it is down; it restarts. Measures the
/// time from the restart until every run's second step has its Pod, and
/// counts duplicate Pods and executions over the runs' whole lives.
async fn resume_batch(setup: &Setup, n: usize, repeat: usize) -> Res<Resume> {
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let steps = 3;
    let (ns, dir) = namespace(setup, &format!("bench-resume-{n}-r{repeat}")).await?;
    let nsname = ns.name().to_owned();
    eprintln!("[bench] resume {n} runs, repeat {repeat}: namespace {nsname}");
    let mut op = start_operator(setup, &nsname, &dir)?;
    wait_ready(&op, Duration::from_secs(60)).await?;
    let (seen, watch_task) = observe(&setup.client, &nsname);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss_idle, _) = rss_kib(op.proc.pid().unwrap_or(0));
    create_runs(setup, &nsname, n, steps, 0, false).await?;
    let first = step_name(0);
    let second = step_name(1);
    let has = |s: &Seen, step: &str| s.pods.values().filter(|p| p.step == step).count();
    let r = wait_seen(&seen, "every run has its first Pod", deadline, |s| {
        let k = has(s, &first);
        (k < n).then(|| format!("{k}/{n}"))
    })
    .await;
    if let Err(e) = r {
        op.proc.kill().await;
        teardown(setup, ns).await?;
        return Err(e);
    }
    // Settle so the kill lands with no write in flight, then SIGKILL.
    tokio::time::sleep(Duration::from_millis(500)).await;
    op.proc.kill().await;
    let mut kubelet = start_simkubelet(setup, &nsname, &dir)?;
    let r = wait_seen(
        &seen,
        "every first Pod succeeded (operator down)",
        deadline,
        |s| {
            let k = s
                .pods
                .values()
                .filter(|p| p.step == first && p.succeeded_seen.is_some())
                .count();
            (k < n).then(|| format!("{k}/{n}"))
        },
    )
    .await;
    if let Err(e) = r {
        kubelet.kill().await;
        teardown(setup, ns).await?;
        return Err(e);
    }
    let restart = Instant::now();
    let mut op = start_operator(setup, &nsname, &dir)?;
    let ready = wait_ready(&op, Duration::from_secs(120)).await?;
    let all_next = wait_seen(
        &seen,
        "every run has its next Pod after the restart",
        deadline,
        |s| {
            let k = has(s, &second);
            (k < n).then(|| format!("{k}/{n}"))
        },
    )
    .await;
    let finished = match all_next {
        Ok(t) if !setup.args.resume_finish => Ok(t),
        Ok(_) => {
            wait_seen(&seen, "every run finished", deadline, |s| {
                (s.finished.len() < n).then(|| format!("{}/{n}", s.finished.len()))
            })
            .await
        }
        Err(e) => Err(e),
    };
    let (_, hwm) = rss_kib(op.proc.pid().unwrap_or(0));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let op_metrics = http_get(op.metrics, "/metrics")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    watch_task.abort();
    op.proc.kill().await;
    kubelet.kill().await;
    if let Err(e) = finished {
        teardown(setup, ns).await?;
        return Err(BenchError::Stage(format!(
            "resume {n} repeat {repeat}: {e} (logs in {})",
            dir.display()
        )));
    }
    // The watch task is stopped: take what it saw.
    let g = std::mem::take(&mut *lock(&seen));
    let mut next: Vec<f64> = g
        .pods
        .values()
        .filter(|p| p.step == second)
        .filter_map(|p| p.first_seen)
        .map(|t| t.saturating_duration_since(restart).as_secs_f64())
        .collect();
    next.sort_by(f64::total_cmp);
    // Pods per (run, step): more than one, or an attempt other than 1, is a duplicate.
    let mut per_step: HashMap<(&str, &str), usize> = HashMap::new();
    for p in g.pods.values() {
        *per_step.entry((&p.run, &p.step)).or_default() += 1;
    }
    let duplicate_pods = per_step.values().map(|k| k - 1).sum::<usize>()
        + g.pods.values().filter(|p| p.attempt != "1").count();
    let ledger = Ledger::read(dir.join("ledger.jsonl"))
        .map_err(|e| BenchError::Stage(format!("reading the ledger: {e}")))?;
    let duplicate_executions = ledger
        .executions_by_key()
        .values()
        .filter(|k| **k > 1)
        .count();
    let finished_last = g
        .finished
        .values()
        .map(|(t, _)| *t)
        .max()
        .unwrap_or(restart);
    let res = Resume {
        runs: n,
        repeat,
        ready_s: ready.as_secs_f64(),
        all_next_s: next.last().copied().unwrap_or(f64::NAN),
        next_p50_s: percentile(&next, 50.0),
        finished_s: finished_last
            .saturating_duration_since(restart)
            .as_secs_f64(),
        duplicate_pods,
        duplicate_executions,
        suppressed_creates: metric(&op_metrics, "agentrun_duplicate_creates_suppressed_total"),
        rss_idle_kib: rss_idle,
        hwm_kib: hwm,
    };
    teardown(setup, ns).await?;
    Ok(res)
}

// ---------------------------------------------------------------------------
// Status size

#[derive(Clone, Debug, Default)]
struct StatusSize {
    steps: usize,
    repeat: usize,
    status_bytes: usize,
    object_bytes: usize,
    wall_s: f64,
    handoff_p50_ms: f64,
    handoff_p99_ms: f64,
    first_handoffs_ms: f64,
    last_handoffs_ms: f64,
    windows: Vec<LongWindow>,
}

/// What the plane and the operator had done at one instant of a long run.
#[derive(Clone, Debug, Default)]
struct Sample {
    /// Step Pods seen Succeeded.
    done: usize,
    /// CPU ms per process, read before and after the scrapes.
    cpu_before: BTreeMap<&'static str, f64>,
    cpu_after: BTreeMap<&'static str, f64>,
    /// Request bodies of the writes to agentruns (the operator's status
    /// writes; the driver's create is excluded): (bytes, count).
    status_body: (f64, f64),
    /// etcd's total bytes put.
    etcd_put_bytes: f64,
}

/// Reads CPU, scrapes the apiserver and etcd, reads CPU again: a window
/// opened with the second reading and closed with the first leaves the
/// scrapes out.
async fn sample(setup: &Setup, seen: &Shared, pids: &[(&'static str, u32)]) -> Res<Sample> {
    let cpu =
        || -> BTreeMap<&'static str, f64> { pids.iter().map(|(n, p)| (*n, cpu_ms(*p))).collect() };
    let cpu_before = cpu();
    let done = lock(seen)
        .pods
        .values()
        .filter(|p| p.succeeded_seen.is_some())
        .count();
    let text = scrape(setup, "apiserver").await?;
    let mut status_body = (0.0, 0.0);
    for line in text.lines() {
        let (rest, slot) =
            if let Some(r) = line.strip_prefix("apiserver_request_body_size_bytes_sum{") {
                (r, 0)
            } else if let Some(r) = line.strip_prefix("apiserver_request_body_size_bytes_count{") {
                (r, 1)
            } else {
                continue;
            };
        let Some((l, v)) = rest.rsplit_once("} ") else {
            continue;
        };
        let l = parse_labels(l);
        if l.get("resource") != Some(&"agentruns") || l.get("verb") == Some(&"create") {
            continue;
        }
        let v: f64 = v.trim().parse().unwrap_or(0.0);
        if slot == 0 {
            status_body.0 += v;
        } else {
            status_body.1 += v;
        }
    }
    let etcd = scrape(setup, "etcd").await?;
    let etcd_put_bytes = metric(&etcd, "etcd_debugging_mvcc_total_put_size_in_bytes");
    Ok(Sample {
        done,
        cpu_before,
        cpu_after: cpu(),
        status_body,
        etcd_put_bytes,
    })
}

/// The cost of the steps of one window of a long run.
#[derive(Clone, Debug, Default)]
struct LongWindow {
    mark: usize,
    steps: usize,
    handoff_p50_ms: f64,
    /// Mean request body of a status write.
    status_write_bytes: f64,
    status_writes: f64,
    /// Bytes etcd stored per step (every object written, Pods included).
    etcd_bytes_per_step: f64,
    cpu_ms_per_step: BTreeMap<&'static str, f64>,
}

impl LongWindow {
    fn between(mark: usize, a: &Sample, b: &Sample) -> LongWindow {
        let steps = b.done.saturating_sub(a.done).max(1);
        let writes = b.status_body.1 - a.status_body.1;
        LongWindow {
            mark,
            steps,
            handoff_p50_ms: f64::NAN,
            status_write_bytes: if writes > 0.0 {
                (b.status_body.0 - a.status_body.0) / writes
            } else {
                f64::NAN
            },
            status_writes: writes,
            etcd_bytes_per_step: (b.etcd_put_bytes - a.etcd_put_bytes) / steps as f64,
            cpu_ms_per_step: b
                .cpu_before
                .iter()
                .map(|(k, v)| {
                    (
                        *k,
                        (v - a.cpu_after.get(k).copied().unwrap_or(0.0)) / steps as f64,
                    )
                })
                .collect(),
        }
    }

    fn row(&self) -> String {
        let cpu = |k: &str| self.cpu_ms_per_step.get(k).copied().unwrap_or(f64::NAN);
        format!(
            "| {} | {} | {:.1} | {:.0} | {:.2} | {:.0} | {:.1} | {:.1} | {:.1} |",
            self.mark,
            self.steps,
            self.handoff_p50_ms,
            self.status_write_bytes,
            self.status_writes / self.steps as f64,
            self.etcd_bytes_per_step,
            cpu("kube-apiserver"),
            cpu("etcd"),
            cpu("operator"),
        )
    }
}

impl StatusSize {
    fn line(&self) -> String {
        format!(
            "status steps={} repeat={}: status {} bytes ({:.1} KiB), object {} bytes; {:.1} s, \
             hand-off p50 {:.1} ms p99 {:.1} ms (median of the first 50: {:.1} ms, of the last 50: {:.1} ms)",
            self.steps,
            self.repeat,
            self.status_bytes,
            self.status_bytes as f64 / 1024.0,
            self.object_bytes,
            self.wall_s,
            self.handoff_p50_ms,
            self.handoff_p99_ms,
            self.first_handoffs_ms,
            self.last_handoffs_ms
        )
    }
}

async fn status_size(setup: &Setup, steps: usize, repeat: usize) -> Res<StatusSize> {
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let (ns, dir) = namespace(setup, &format!("bench-status-{steps}-r{repeat}")).await?;
    let nsname = ns.name().to_owned();
    eprintln!("[bench] status size of a {steps}-step run, repeat {repeat}: namespace {nsname}");
    let mut kubelet = start_simkubelet(setup, &nsname, &dir)?;
    let mut op = start_operator(setup, &nsname, &dir)?;
    wait_ready(&op, Duration::from_secs(60)).await?;
    let (seen, watch_task) = observe(&setup.client, &nsname);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pids = {
        let mut p = plane_pids(setup);
        p.push(("operator", op.proc.pid().unwrap_or(0)));
        p.push(("simkubelet", kubelet.pid().unwrap_or(0)));
        p
    };
    let window = setup.args.long_window.max(1);
    // Windows of `window` steps ending at each mark: (start, end, mark).
    let mut marks: Vec<usize> = setup
        .args
        .long_marks
        .iter()
        .copied()
        .filter(|m| *m <= steps)
        .collect();
    marks.sort_unstable();
    marks.dedup();
    let mut starts: Vec<Option<Sample>> = vec![None; marks.len()];
    let mut measured = vec![false; marks.len()];
    let mut windows = Vec::new();
    let first = sample(setup, &seen, &pids).await?;
    for (i, m) in marks.iter().enumerate() {
        if *m <= window {
            starts[i] = Some(first.clone());
        }
    }
    let t0 = Instant::now();
    create_runs(
        setup,
        &nsname,
        1,
        steps,
        setup.args.status_result_bytes,
        false,
    )
    .await?;
    let succeeded = |s: &Seen| {
        s.pods
            .values()
            .filter(|p| p.succeeded_seen.is_some())
            .count()
    };
    let r = loop {
        let (done, finished) = {
            let g = lock(&seen);
            (succeeded(&g), !g.finished.is_empty())
        };
        for i in 0..marks.len() {
            let m = marks[i];
            if measured[i] {
                continue;
            }
            if starts[i].is_none() && done >= m.saturating_sub(window) {
                starts[i] = Some(sample(setup, &seen, &pids).await?);
            } else if done >= m
                && let Some(start) = starts[i].take()
            {
                let end = sample(setup, &seen, &pids).await?;
                windows.push(LongWindow::between(m, &start, &end));
                measured[i] = true;
            }
        }
        if finished {
            break Ok(Instant::now());
        }
        if t0.elapsed() > deadline {
            break Err(BenchError::Stage(format!(
                "aborted: the run did not finish within {deadline:?} ({done} Pods succeeded)"
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    watch_task.abort();
    op.proc.kill().await;
    kubelet.kill().await;
    let end = match r {
        Ok(t) => t,
        Err(e) => {
            teardown(setup, ns).await?;
            return Err(BenchError::Stage(format!(
                "status size: {e} (logs in {})",
                dir.display()
            )));
        }
    };
    let api: Api<AgentRun> = Api::namespaced(setup.client.clone(), &nsname);
    let run = api
        .get(&run_name(0))
        .await
        .map_err(self::api("reading the run"))?;
    let status_bytes = serde_json::to_vec(&run.status)
        .expect("a status serializes")
        .len();
    let object_bytes = serde_json::to_vec(&run).expect("a run serializes").len();
    // The watch task is stopped: take what it saw.
    let g = std::mem::take(&mut *lock(&seen));
    let h = handoffs(&g, steps);
    // Hand-offs in step order, to see whether they grow with the status.
    let ordered = {
        let by_step: HashMap<&str, &PodSeen> =
            g.pods.values().map(|p| (p.step.as_str(), p)).collect();
        let mut v = Vec::new();
        for i in 1..steps {
            if let (Some(a), Some(b)) = (
                by_step.get(step_name(i - 1).as_str()),
                by_step.get(step_name(i).as_str()),
            ) && let (Some(done), Some(created)) = (a.succeeded_seen, b.first_seen)
            {
                v.push(created.saturating_duration_since(done).as_secs_f64() * 1000.0);
            }
        }
        v
    };
    let med = |s: &[f64]| {
        let mut s = s.to_vec();
        s.sort_by(f64::total_cmp);
        percentile(&s, 50.0)
    };
    let k = ordered.len().min(50);
    // ordered[j] is the hand-off into step j + 1.
    for w in &mut windows {
        let hi = w.mark.saturating_sub(1).min(ordered.len());
        let lo = w.mark.saturating_sub(window).min(hi);
        w.handoff_p50_ms = med(&ordered[lo..hi]);
    }
    let res = StatusSize {
        windows,
        steps,
        repeat,
        status_bytes,
        object_bytes,
        wall_s: end.duration_since(t0).as_secs_f64(),
        handoff_p50_ms: percentile(&h, 50.0),
        handoff_p99_ms: percentile(&h, 99.0),
        first_handoffs_ms: med(&ordered[..k]),
        last_handoffs_ms: med(&ordered[ordered.len() - k..]),
    };
    teardown(setup, ns).await?;
    Ok(res)
}

// ---------------------------------------------------------------------------
// Summary

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| !x.is_nan());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// "median (min–max)" of one figure over the repeats.
fn spread(v: Vec<f64>, digits: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let m = median(v.clone());
    if v.len() > 1 {
        format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
    } else {
        format!("{m:.digits$}")
    }
}

fn summary(
    setup: &Setup,
    batches: &BTreeMap<usize, Vec<Batch>>,
    resumes: &[Resume],
    sizes: &[StatusSize],
) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "{}\n\nPeer: {}{}. Medians of {} repeats (min–max in brackets); {} steps per run, simkubelet steps of 0 ms.\n\n",
        machine_line(setup),
        match setup.args.peer {
            Peer::Agentrun => "AgentRuns (controller: agentrun-operator)",
            Peer::Jobs => "chains of single-Pod Jobs (controller: kube-controller-manager; \"operator\" columns are its figures, RSS peak sampled every 100 ms; the driver's POST jobs are not counted as the controller's)",
            Peer::Argo => "Argo Workflows of sequential steps (controller: workflow-controller v4.0.5, one per batch; \"operator\" columns are its figures, its writes include the task results simkubelet writes as Argo's wait sidecar; the driver's POST workflows are not counted)",
        },
        if setup.args.label.is_empty() { String::new() } else { format!(", {}", setup.args.label) },
        setup.args.repeats,
        setup.args.steps
    ));
    t.push_str("| runs | operator writes / step | hand-off p50 (ms) | hand-off p99 (ms) | steps / s | wall (s) | status 409s / step | reconciles / step | RSS idle (MiB) | RSS peak VmHWM (MiB) | failed runs |\n");
    t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let mib = |k: u64| k as f64 / 1024.0;
    for (n, bs) in batches {
        let per = |f: &dyn Fn(&Batch) -> f64| bs.iter().map(f).collect::<Vec<f64>>();
        let steps = |b: &Batch| (b.runs * b.steps) as f64;
        t.push_str(&format!(
            "| {n} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            spread(per(&|b| b.writes_per_step), 2),
            spread(per(&|b| b.handoff_p50_ms), 1),
            spread(per(&|b| b.handoff_p99_ms), 1),
            spread(per(&|b| b.steps_per_s), 1),
            spread(per(&|b| b.wall_s), 1),
            spread(per(&|b| b.conflicts_409 / steps(b)), 2),
            spread(per(&|b| b.reconciles / steps(b)), 2),
            spread(per(&|b| mib(b.rss_idle_kib)), 1),
            spread(per(&|b| mib(b.hwm_kib)), 1),
            bs.iter().map(|b| b.failed_runs).sum::<usize>(),
        ));
    }
    // Write breakdown per step, medians.
    let mut kinds: Vec<String> = batches
        .values()
        .flatten()
        .flat_map(|b| b.writes.keys().cloned())
        .collect();
    kinds.sort();
    kinds.dedup();
    if !kinds.is_empty() {
        t.push_str("\nOperator writes per step by (verb, resource), from `apiserver_request_total` deltas (all response codes):\n\n");
        t.push_str(&format!("| runs | {} |\n", kinds.join(" | ")));
        t.push_str(&format!("|---:|{}\n", "---:|".repeat(kinds.len())));
        for (n, bs) in batches {
            let cells: Vec<String> = kinds
                .iter()
                .map(|k| {
                    let v = bs
                        .iter()
                        .map(|b| {
                            b.writes.get(k).copied().unwrap_or(0.0) / (b.runs * b.steps) as f64
                        })
                        .collect();
                    format!("{:.2}", median(v))
                })
                .collect();
            t.push_str(&format!("| {n} | {} |\n", cells.join(" | ")));
        }
    }
    let mut kinds: Vec<String> = batches
        .values()
        .flatten()
        .flat_map(|b| b.server_ms.keys().cloned())
        .collect();
    kinds.sort();
    kinds.dedup();
    if !kinds.is_empty() {
        t.push_str("\nMean apiserver latency (ms) per request kind, from `apiserver_request_duration_seconds` deltas (PATCH pods/status is simkubelet's):\n\n");
        t.push_str(&format!("| runs | {} |\n", kinds.join(" | ")));
        t.push_str(&format!("|---:|{}\n", "---:|".repeat(kinds.len())));
        for (n, bs) in batches {
            let cells: Vec<String> = kinds
                .iter()
                .map(|k| {
                    let v = bs
                        .iter()
                        .filter_map(|b| b.server_ms.get(k).copied())
                        .collect();
                    format!("{:.1}", median(v))
                })
                .collect();
            t.push_str(&format!("| {n} | {} |\n", cells.join(" | ")));
        }
    }
    t.push_str("\nCPU time per step (ms; user + system from /proc/<pid>/stat over the measured window):\n\n");
    t.push_str(
        "| runs | operator | simkubelet | kube-apiserver | etcd |\n|---:|---:|---:|---:|---:|\n",
    );
    for (n, bs) in batches {
        let cell = |k: &str| {
            let v = bs
                .iter()
                .filter_map(|b| b.cpu_ms_per_step.get(k).copied())
                .collect();
            format!("{:.2}", median(v))
        };
        t.push_str(&format!(
            "| {n} | {} | {} | {} | {} |\n",
            cell("operator"),
            cell("simkubelet"),
            cell("kube-apiserver"),
            cell("etcd")
        ));
    }
    // RSS growth per run, from the largest batch against its idle RSS.
    if let Some((n, bs)) = batches.iter().next_back()
        && *n > 1
    {
        let growth: Vec<f64> = bs
            .iter()
            .map(|b| (b.hwm_kib as f64 - b.rss_idle_kib as f64) / *n as f64)
            .collect();
        t.push_str(&format!(
            "\nOperator RSS growth per run at {n} runs ((VmHWM − idle VmRSS) / runs): {} KiB\n",
            spread(growth, 1)
        ));
    }
    if !resumes.is_empty() {
        let per = |f: &dyn Fn(&Resume) -> f64| resumes.iter().map(f).collect::<Vec<f64>>();
        t.push_str(&format!(
            "\nResume, {} runs in flight, operator SIGKILLed and restarted: ready (caches listed) after {} s; \
             every run has its next Pod after {} s (p50 {} s); all runs finished after {} s; \
             duplicate Pods {} (total over repeats), steps executed more than once {}; creates suppressed {}; \
             operator RSS idle {} MiB, peak after the restart (VmHWM, {} runs and their Pods in cache) {} MiB, i.e. {} KiB per run\n",
            resumes[0].runs,
            spread(per(&|r| r.ready_s), 2),
            spread(per(&|r| r.all_next_s), 2),
            spread(per(&|r| r.next_p50_s), 2),
            if setup.args.resume_finish {
                spread(per(&|r| r.finished_s), 1)
            } else {
                "(not awaited: --resume-finish)".into()
            },
            resumes.iter().map(|r| r.duplicate_pods).sum::<usize>(),
            resumes.iter().map(|r| r.duplicate_executions).sum::<usize>(),
            spread(per(&|r| r.suppressed_creates), 0),
            spread(per(&|r| mib(r.rss_idle_kib)), 1),
            resumes[0].runs,
            spread(per(&|r| mib(r.hwm_kib)), 1),
            spread(
                per(&|r| (r.hwm_kib as f64 - r.rss_idle_kib as f64) / r.runs as f64),
                1
            ),
        ));
    }
    for s in sizes {
        t.push_str(&format!("\n{}\n", s.line()));
        if !s.windows.is_empty() {
            t.push_str(&format!(
                "\nCost of a step along that run (windows of {} steps ending at the step shown):\n\n",
                setup.args.long_window
            ));
            t.push_str("| step | steps in window | hand-off p50 (ms) | status write body (bytes) | status writes / step | etcd bytes put / step | kube-apiserver CPU ms / step | etcd CPU ms / step | operator CPU ms / step |\n");
            t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
            for w in &s.windows {
                t.push_str(&w.row());
                t.push('\n');
            }
        }
    }
    t
}
