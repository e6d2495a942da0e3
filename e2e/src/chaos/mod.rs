//! The chaos suite: many runs under injected faults, judged from the
//! simkubelet ledger and the runs' statuses.
//!
//! ```text
//!   driver (direct to the apiserver) ── creates runs, answers Approvals, evicts and
//!        │                               deletes step Pods, watches every status version,
//!        │                               restarts kube-apiserver (e2e/cluster restart-apiserver)
//!        ├─ simkubelet --namespace <ns> --ledger <dir>/ledger.jsonl     (direct)
//!        ├─ FaultProxy 127.0.0.1:<port> ──TLS + admin cert──▶ kube-apiserver
//!        └─ 2 × agentrun-operator run --namespace <ns> --leader-elect   (through the proxy;
//!             SIGKILLed and restarted, the leader SIGSTOPped past its lease and resumed,
//!             some starts armed to abort right after a status write)
//!
//!   fault phase ──(enough faults, or every run finished, or --duration-limit)──▶
//!   settle phase (no faults; the approver still answers) ──▶ verdict
//! ```
//!
//! `chaos::run` is used by the `chaos` binary (the long run, `make chaos`) and
//! by `tests/chaos.rs` (the bounded short run inside `make test`).

pub mod operators;
pub mod proxy;
pub mod rng;
pub mod verdict;
pub mod workload;

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentrun_operator::api::{AgentRun, Approval, ApprovalKind};
use agentrun_operator::labels;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::ledger::Ledger;
use crate::support::env::TestEnv;
use crate::support::env::repo_root;
use crate::support::processes::{OperatorConfig, log_dir, start_simkubelet};
use operators::{OperatorCounts, Operators};
use proxy::{FaultCounts, FaultProxy, ProxyConfig};
use rng::Rng;
use verdict::{Evidence, Observer, Verdict};

/// How big and how hostile a chaos run is.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// Runs to create.
    pub runs: usize,
    /// Runs in flight at once.
    pub max_active: usize,
    /// Faults to inject before the fault phase may end.
    pub faults_min: u64,
    /// Of them, at least this many paused leaders and kube-apiserver restarts.
    pub paused_leaders_min: u64,
    pub apiserver_restarts_min: u64,
    /// And this many operator aborts right after a status write.
    pub failpoint_crashes_min: u64,
    /// Longest fault phase; then the faults stop whatever the count.
    pub duration_limit: Duration,
    /// How long runs get to finish once the faults stop.
    pub settle: Duration,
    pub seed: u64,
    pub proxy: ProxyConfig,
    /// Operator SIGKILL: the next one comes after a time uniform in this range.
    pub kill_every: (Duration, Duration),
    /// Operator processes: 2 elect a leader (and make pauses possible), 1 does not.
    pub operators: usize,
    /// `--lease-duration-seconds` of the operators.
    pub lease_duration_seconds: u64,
    /// Leader pauses (SIGSTOP past the lease, then SIGCONT), every so often.
    pub pause_every: Option<(Duration, Duration)>,
    /// How long a paused leader stays stopped beyond its lease duration.
    pub pause_beyond_lease: (Duration, Duration),
    /// Fraction of operator restarts armed with `after-status-write:<n>`, and the range of n.
    pub failpoint_rate: f64,
    pub failpoint_writes: (u64, u64),
    /// kube-apiserver restarts (`e2e/cluster restart-apiserver`), every so often.
    pub apiserver_restart_every: Option<(Duration, Duration)>,
    /// Bulk evictions of step Pods, every so often.
    pub evict_every: (Duration, Duration),
    /// Most Pods evicted in one bulk eviction.
    pub evict_max: usize,
    /// Plain Pod deletes, every so often.
    pub delete_every: (Duration, Duration),
    /// Name of the namespace prefix (a random suffix is added).
    pub name: String,
}

impl ChaosConfig {
    /// The long run: 200 runs, at least 1,000 faults.
    pub fn long(seed: u64) -> ChaosConfig {
        ChaosConfig {
            runs: 200,
            max_active: 30,
            faults_min: 1000,
            paused_leaders_min: 6,
            apiserver_restarts_min: 2,
            failpoint_crashes_min: 5,
            duration_limit: Duration::from_secs(900),
            settle: Duration::from_secs(180),
            seed,
            proxy: ProxyConfig {
                seed,
                ..ProxyConfig::default()
            },
            kill_every: (Duration::from_secs(4), Duration::from_secs(12)),
            operators: 2,
            lease_duration_seconds: 6,
            // The 200 runs take about 200 s here: often enough that each kind
            // of fault is met several times before they are done.
            pause_every: Some((Duration::from_secs(8), Duration::from_secs(20))),
            pause_beyond_lease: (Duration::from_secs(2), Duration::from_secs(5)),
            failpoint_rate: 0.3,
            failpoint_writes: (1, 40),
            apiserver_restart_every: Some((Duration::from_secs(45), Duration::from_secs(90))),
            evict_every: (Duration::from_secs(3), Duration::from_secs(8)),
            evict_max: 6,
            delete_every: (Duration::from_secs(3), Duration::from_secs(8)),
            name: "chaos".into(),
        }
    }

    /// The bounded short run for `make test`.
    pub fn short(seed: u64) -> ChaosConfig {
        ChaosConfig {
            runs: 40,
            max_active: 16,
            faults_min: 300,
            paused_leaders_min: 2,
            apiserver_restarts_min: 1,
            failpoint_crashes_min: 1,
            duration_limit: Duration::from_secs(120),
            settle: Duration::from_secs(60),
            kill_every: (Duration::from_secs(5), Duration::from_secs(10)),
            pause_every: Some((Duration::from_secs(10), Duration::from_secs(20))),
            // The standby needs up to a second past the expiry to take the Lease.
            pause_beyond_lease: (Duration::from_secs(2), Duration::from_secs(4)),
            failpoint_rate: 0.5,
            failpoint_writes: (1, 12),
            // One restart while the runs are busy, perhaps a second one.
            apiserver_restart_every: Some((Duration::from_secs(20), Duration::from_secs(60))),
            // A step costs few writes; a fifth of them failing keeps the
            // short run above its fault minimum.
            proxy: ProxyConfig {
                seed,
                write_fault_rate: 0.2,
                ..ProxyConfig::default()
            },
            ..ChaosConfig::long(seed)
        }
    }
}

/// What a chaos run did and the verdict on it.
#[derive(Clone, Debug)]
pub struct Report {
    pub namespace: String,
    pub proxy: FaultCounts,
    pub operators: OperatorCounts,
    pub apiserver_restarts: u64,
    /// Restarts that did not bring kube-apiserver back (each fails the run).
    pub apiserver_restart_failures: Vec<String>,
    pub evictions: u64,
    pub deletions: u64,
    pub approvals_answered: u64,
    pub status_versions: u64,
    /// Step Pods still holding `agentrun.dev/result` 30 s after the last run
    /// finished, or why they could not be counted.
    pub finalizers_held: Result<usize, String>,
    /// Errors of the driver's watch of runs: all, and the expected ones
    /// (410 Gone, or inside a kube-apiserver restart).
    pub watch_errors: u64,
    pub watch_errors_expected: u64,
    pub fault_phase: Duration,
    pub wall_time: Duration,
    pub verdict: Verdict,
    pub faults_min: u64,
    pub paused_leaders_min: u64,
    pub apiserver_restarts_min: u64,
    pub failpoint_crashes_min: u64,
}

impl Report {
    /// Every injected fault: proxy faults, operator kills, paused leaders,
    /// failpoint aborts, kube-apiserver restarts, evicted and deleted Pods.
    pub fn faults(&self) -> u64 {
        self.proxy.total()
            + self.operators.kills
            + self.operators.paused_leaders
            + self.operators.failpoint_crashes
            + self.apiserver_restarts
            + self.evictions
            + self.deletions
    }

    /// The one summary line.
    pub fn summary(&self) -> String {
        format!(
            "faults={} runs={} duplicates={} lost={} stuck={} reconcile_approvals={} paused_leaders={}",
            self.faults(),
            self.verdict.runs,
            self.verdict.duplicates,
            self.verdict.lost,
            self.verdict.stuck,
            self.verdict.reconcile_approvals,
            self.operators.paused_leaders
        )
    }

    /// The breakdown behind the summary line.
    pub fn details(&self) -> String {
        let v = &self.verdict;
        let o = &self.operators;
        let finalizers = match &self.finalizers_held {
            Ok(n) => n.to_string(),
            Err(e) => format!("unknown ({e})"),
        };
        let mut out = format!(
            "namespace={} wall={:.0}s fault_phase={:.0}s\nproxy: {}\nkills={} paused_leaders={} takeovers_during_pause={} failpoint_crashes={} (armed starts {}) self_exits={} apiserver_restarts={} evictions={} deletions={}\napprovals_answered={} status_versions_seen={} watch_errors={} (expected {}) finalizers_held={}\nexecutions={} successful_executions={} phases={:?}\nduplicates: after_commit={} second_success={} overlapping={} blind_reruns={}; unapproved={} unobserved={} watch_failures={} reconcile_unexpected={}",
            self.namespace,
            self.wall_time.as_secs_f64(),
            self.fault_phase.as_secs_f64(),
            self.proxy,
            o.kills,
            o.paused_leaders,
            o.takeovers,
            o.failpoint_crashes,
            o.failpoints_armed,
            o.self_exits,
            self.apiserver_restarts,
            self.evictions,
            self.deletions,
            self.approvals_answered,
            self.status_versions,
            self.watch_errors,
            self.watch_errors_expected,
            finalizers,
            v.executions,
            v.successful_executions,
            v.phases,
            v.after_commit,
            v.second_success,
            v.overlapping,
            v.blind_reruns,
            v.unapproved,
            v.unobserved,
            v.watch_failures,
            v.reconcile_unexpected,
        );
        match &self.finalizers_held {
            Ok(0) => {}
            Ok(n) => out.push_str(&format!(
                "\nfinalizers: {n} step Pods still hold {} (D5)",
                labels::RESULT_FINALIZER
            )),
            Err(e) => out.push_str(&format!("\nfinalizers: could not be counted: {e}")),
        }
        for f in &self.apiserver_restart_failures {
            out.push_str(&format!("\napiserver restart failed: {f}"));
        }
        if self.faults() < self.faults_min {
            out.push_str(&format!(
                "\ntoo few faults: {} < --faults-min {}",
                self.faults(),
                self.faults_min
            ));
        }
        if !self.enough_of_each_fault() {
            out.push_str(&format!(
                "\ntoo few of a kind: paused_leaders={} (min {}), apiserver_restarts={} (min {}), failpoint_crashes={} (min {})",
                o.paused_leaders,
                self.paused_leaders_min,
                self.apiserver_restarts,
                self.apiserver_restarts_min,
                o.failpoint_crashes,
                self.failpoint_crashes_min
            ));
        }
        for f in &v.findings {
            out.push('\n');
            out.push_str(f);
        }
        out
    }

    /// The verdict passed, every result finalizer was released, every
    /// kube-apiserver restart came back, and enough faults were injected to
    /// mean something.
    pub fn passed(&self) -> bool {
        self.verdict.passed()
            && self.finalizers_held == Ok(0)
            && self.apiserver_restart_failures.is_empty()
            && self.faults() >= self.faults_min
            && self.enough_of_each_fault()
    }

    /// The faults that need a minimum of their own happened that often.
    pub fn enough_of_each_fault(&self) -> bool {
        self.operators.paused_leaders >= self.paused_leaders_min
            && self.apiserver_restarts >= self.apiserver_restarts_min
            && self.operators.failpoint_crashes >= self.failpoint_crashes_min
    }
}

/// What the driver's helpers share.
#[derive(Default)]
struct Shared {
    observer: Mutex<Observer>,
    disrupted_keys: Mutex<BTreeSet<String>>,
    approvals_answered: Mutex<u64>,
    /// While kube-apiserver restarts (and a little after), watch errors are expected.
    apiserver_unsettled: Mutex<Option<Instant>>,
}

impl Shared {
    fn apiserver_unsettled(&self) -> bool {
        lock(&self.apiserver_unsettled).is_some_and(|until| Instant::now() < until)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the chaos suite on the control plane of the current kubeconfig, in a
/// fresh namespace, and returns the report. The namespace is deleted when the
/// verdict passed and kept (for inspection) when it did not.
pub async fn run(cfg: ChaosConfig) -> Report {
    let wall = Instant::now();
    let env = TestEnv::new(&cfg.name).await;
    let ns = env.namespace().to_owned();
    let client = env.client();
    let dir = log_dir(&ns);
    let ledger_path = dir.join("ledger.jsonl");
    info!(namespace = %ns, dir = %dir.display(), "chaos run starting");
    let mut simkubelet = start_simkubelet(&ns, &ledger_path);
    let plane_dir = cfg.apiserver_restart_every.map(|_| {
        plane_dir()
            .unwrap_or_else(|e| panic!("chaos: kube-apiserver restarts need the e2e plane: {e}"))
    });

    // The proxy forwards as admin, with the client's own retries off.
    let upstream = proxy::upstream_client()
        .await
        .unwrap_or_else(|e| panic!("chaos: {e}"));
    let proxy = FaultProxy::start(
        upstream,
        "127.0.0.1:0".parse().expect("loopback"),
        cfg.proxy.clone(),
    )
    .await
    .expect("chaos: starting the fault proxy");
    let operator_kubeconfig = dir.join("operator-kubeconfig");
    proxy
        .write_kubeconfig(&operator_kubeconfig, &ns)
        .expect("chaos: writing the operator kubeconfig");
    let mut op_cfg = OperatorConfig::new(&ns);
    op_cfg.kubeconfig = operator_kubeconfig;
    op_cfg.lease_duration_seconds = cfg.lease_duration_seconds;
    // As the chart installs it with leader election: the API server refuses a
    // step Pod from an operator that no longer holds the Lease.
    let fence = cfg.operators > 1;
    if fence {
        crate::support::policies::fence_namespace(&ns).await;
    }
    let mut operators = Operators::start(
        &op_cfg,
        cfg.operators,
        Api::namespaced(client.clone(), &ns),
        cfg.failpoint_rate,
        cfg.failpoint_writes,
    );
    if fence {
        crate::support::policies::wait_fenced(&ns).await;
    }

    let shared = Arc::new(Shared::default());
    let runs_api: Api<AgentRun> = Api::namespaced(client.clone(), &ns);
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let approvals_api: Api<Approval> = Api::namespaced(client.clone(), &ns);

    let watch_task = tokio::spawn(watch_runs(runs_api.clone(), shared.clone()));
    let approver_task = tokio::spawn(approve(
        approvals_api.clone(),
        ledger_path.clone(),
        shared.clone(),
        cfg.seed,
    ));

    let mut rng = Rng::new(cfg.seed);
    let mut workload_rng = rng.fork(1);
    let mut chaos_rng = rng.fork(2);
    let plans: Vec<workload::RunPlan> = (0..cfg.runs)
        .map(|i| workload::generate(&mut workload_rng, i))
        .collect();
    let mut created: Vec<String> = Vec::new();

    let mut evictions = 0u64;
    let mut deletions = 0u64;
    let mut apiserver_restarts = 0u64;
    let mut apiserver_restart_failures: Vec<String> = Vec::new();
    let mut restarting: Option<tokio::task::JoinHandle<Result<Duration, String>>> = None;
    let start = Instant::now();
    let next = |rng: &mut Rng, now: Instant, every: (Duration, Duration)| {
        now + rng.duration(every.0, every.1)
    };
    let mut next_kill = next(&mut chaos_rng, start, cfg.kill_every);
    let mut next_evict = next(&mut chaos_rng, start, cfg.evict_every);
    let mut next_delete = next(&mut chaos_rng, start, cfg.delete_every);
    let mut next_pause = cfg.pause_every.map(|e| next(&mut chaos_rng, start, e));
    let mut next_restart = cfg
        .apiserver_restart_every
        .map(|e| next(&mut chaos_rng, start, e));
    let lease = Duration::from_secs(cfg.lease_duration_seconds);
    let faults_now = |proxy: &FaultProxy, ops: &Operators, ev: u64, del: u64, restarts: u64| {
        proxy.counts().total()
            + ops.counts.kills
            + ops.counts.paused_leaders
            + ops.counts.failpoint_crashes
            + restarts
            + ev
            + del
    };

    // Fault phase.
    loop {
        let terminal = lock(&shared.observer).terminal();
        let all_created = created.len() == plans.len();
        let faults = faults_now(&proxy, &operators, evictions, deletions, apiserver_restarts);
        let enough = faults >= cfg.faults_min
            && operators.counts.paused_leaders >= cfg.paused_leaders_min
            && operators.counts.failpoint_crashes >= cfg.failpoint_crashes_min
            && apiserver_restarts >= cfg.apiserver_restarts_min;
        if all_created && restarting.is_none() && (enough || terminal >= created.len()) {
            break;
        }
        if start.elapsed() >= cfg.duration_limit && restarting.is_none() {
            warn!("duration limit reached; stopping the faults");
            break;
        }
        submit(&runs_api, &plans, &mut created, terminal, cfg.max_active).await;

        operators.tick(&mut chaos_rng, true);
        operators.resume_due(false).await;
        let now = Instant::now();
        if let Some(task) = restarting.take_if(|t| t.is_finished()) {
            match task.await {
                Ok(Ok(took)) => info!(?took, "kube-apiserver is back"),
                Ok(Err(e)) => apiserver_restart_failures.push(e),
                Err(e) => apiserver_restart_failures.push(format!("the restart task failed: {e}")),
            }
            *lock(&shared.apiserver_unsettled) = Some(Instant::now() + Duration::from_secs(15));
        }
        let busy = operators.pausing() || restarting.is_some();
        if now >= next_kill {
            if !busy {
                operators.kill_one(&mut chaos_rng).await;
            }
            next_kill = next(&mut chaos_rng, now, cfg.kill_every);
        }
        // A pause or a restart that cannot happen now (another one is under
        // way, no standby is up) is tried again a second later.
        let retry = now + Duration::from_secs(1);
        if let (Some(at), Some(every)) = (next_pause, cfg.pause_every)
            && now >= at
        {
            let hold =
                lease + chaos_rng.duration(cfg.pause_beyond_lease.0, cfg.pause_beyond_lease.1);
            let paused = !busy && operators.pause_leader(hold).await;
            next_pause = Some(if paused {
                next(&mut chaos_rng, now, every)
            } else {
                retry
            });
        }
        if let (Some(at), Some(every), Some(plane)) = (
            next_restart,
            cfg.apiserver_restart_every,
            plane_dir.as_ref(),
        ) && now >= at
        {
            if busy || operators.pausing() {
                next_restart = Some(retry);
            } else {
                *lock(&shared.apiserver_unsettled) = Some(now + Duration::from_secs(3600));
                apiserver_restarts += 1;
                info!(apiserver_restarts, "restarting kube-apiserver");
                restarting = Some(tokio::spawn(restart_apiserver(plane.clone())));
                next_restart = Some(next(&mut chaos_rng, now, every));
            }
        }
        if now >= next_evict {
            evictions += disrupt(&pods_api, &shared, &mut chaos_rng, cfg.evict_max, true).await;
            next_evict = next(&mut chaos_rng, now, cfg.evict_every);
        }
        if now >= next_delete {
            deletions += disrupt(&pods_api, &shared, &mut chaos_rng, 3, false).await;
            next_delete = next(&mut chaos_rng, now, cfg.delete_every);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fault_phase = start.elapsed();
    proxy.set_enabled(false);
    operators.resume_due(true).await;
    info!(
        faults = faults_now(&proxy, &operators, evictions, deletions, apiserver_restarts),
        "faults stopped; settling"
    );

    // Settle phase: no faults; the approver keeps answering. Operators that
    // exit (a deposed leader steps down; an armed failpoint fires) come back.
    let settle_start = Instant::now();
    loop {
        operators.tick(&mut chaos_rng, false);
        let terminal = lock(&shared.observer).terminal();
        submit(&runs_api, &plans, &mut created, terminal, cfg.max_active).await;
        if created.len() == plans.len() && terminal >= created.len() {
            break;
        }
        if settle_start.elapsed() >= cfg.settle {
            warn!(terminal, runs = created.len(), "settle deadline passed");
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Let the last finalizer releases and ledger lines land.
    let finalizers_held = wait_finalizers_released(
        &pods_api,
        &mut operators,
        &mut chaos_rng,
        Duration::from_secs(30),
    )
    .await;
    approver_task.abort();
    operators.stop().await;
    simkubelet.kill().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    watch_task.abort();
    lock(&shared.observer).watch_stopped();

    let final_runs = runs_api
        .list(&ListParams::default())
        .await
        .expect("chaos: listing the runs")
        .items;
    let approvals = approvals_api
        .list(&ListParams::default())
        .await
        .expect("chaos: listing the approvals")
        .items;
    let ledger = Ledger::read(&ledger_path).expect("chaos: reading the ledger");
    let observer = std::mem::take(&mut *lock(&shared.observer));
    let disrupted_keys = lock(&shared.disrupted_keys).clone();
    let verdict = verdict::verdict(&Evidence {
        created: &created,
        final_runs: &final_runs,
        approvals: &approvals,
        ledger: &ledger,
        observer: &observer,
        disrupted_keys: &disrupted_keys,
    });
    let report = Report {
        namespace: ns.clone(),
        proxy: proxy.counts(),
        operators: operators.counts,
        apiserver_restarts,
        apiserver_restart_failures,
        evictions,
        deletions,
        approvals_answered: *lock(&shared.approvals_answered),
        status_versions: observer.versions,
        finalizers_held,
        watch_errors: observer.watch_errors,
        watch_errors_expected: observer.watch_errors_expected,
        fault_phase,
        wall_time: wall.elapsed(),
        verdict,
        faults_min: cfg.faults_min,
        paused_leaders_min: cfg.paused_leaders_min,
        apiserver_restarts_min: cfg.apiserver_restarts_min,
        failpoint_crashes_min: cfg.failpoint_crashes_min,
    };
    if report.passed() {
        release_finalizers(&pods_api).await;
        env.cleanup().await;
    } else {
        warn!(namespace = %ns, dir = %dir.display(), "verdict failed: namespace and logs kept");
        std::mem::forget(env); // keep the namespace for inspection
    }
    report
}

/// The directory of the e2e plane behind the kubeconfig (`e2e/cluster up`
/// writes `<dir>/kubeconfig` and `<dir>/state/`), which `e2e/cluster
/// restart-apiserver` needs as `AGENTRUN_E2E_DIR`.
fn plane_dir() -> Result<std::path::PathBuf, String> {
    let kubeconfig = crate::support::env::kubeconfig();
    let dir = kubeconfig
        .parent()
        .ok_or_else(|| format!("{} has no directory", kubeconfig.display()))?
        .to_path_buf();
    if !dir.join("state/kube-apiserver.pid").exists() {
        return Err(format!(
            "{} is not the kubeconfig of an `e2e/cluster up` plane (no state/kube-apiserver.pid beside it)",
            kubeconfig.display()
        ));
    }
    Ok(dir)
}

/// `e2e/cluster restart-apiserver` on the plane in `dir`; how long it took.
async fn restart_apiserver(dir: std::path::PathBuf) -> Result<Duration, String> {
    let started = Instant::now();
    let out = tokio::process::Command::new(repo_root().join("e2e/cluster"))
        .arg("restart-apiserver")
        .env("AGENTRUN_E2E_DIR", &dir)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| format!("running e2e/cluster restart-apiserver: {e}"))?;
    if out.status.success() {
        Ok(started.elapsed())
    } else {
        Err(format!(
            "e2e/cluster restart-apiserver exited {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Creates runs until `max_active` are in flight.
async fn submit(
    runs: &Api<AgentRun>,
    plans: &[workload::RunPlan],
    created: &mut Vec<String>,
    terminal: usize,
    max_active: usize,
) {
    while created.len() < plans.len() && created.len() - terminal.min(created.len()) < max_active {
        let plan = &plans[created.len()];
        let run: AgentRun = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": plan.name},
            "spec": workload::spec(plan),
        }))
        .expect("chaos: generated spec deserializes");
        match runs.create(&PostParams::default(), &run).await {
            Ok(_) => created.push(plan.name.clone()),
            Err(kube::Error::Api(s)) if s.code == 409 => created.push(plan.name.clone()),
            Err(err) => {
                warn!(run = %plan.name, error = %err, "creating a run failed; will retry");
                return;
            }
        }
    }
}

/// Evicts (or deletes) up to `max` random step Pods that still hold their
/// result finalizer, recording their keys. Returns how many were accepted.
async fn disrupt(pods: &Api<Pod>, shared: &Shared, rng: &mut Rng, max: usize, evict: bool) -> u64 {
    let Ok(list) = pods.list(&ListParams::default().labels(labels::RUN)).await else {
        return 0;
    };
    let mut candidates: Vec<Pod> = list
        .items
        .into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER)
        })
        .collect();
    let mut done = 0;
    let n = rng.range(1, max as u64) as usize;
    let running = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    for _ in 0..n.min(candidates.len()) {
        // Mostly Pods whose step is running (where a disruption matters most),
        // sometimes a Pending one or one whose result is not yet committed.
        let running_ix: Vec<usize> = (0..candidates.len())
            .filter(|i| running(&candidates[*i]))
            .collect();
        let ix = if !running_ix.is_empty() && rng.chance(0.8) {
            *rng.pick(&running_ix)
        } else {
            rng.below(candidates.len() as u64) as usize
        };
        let pod = candidates.swap_remove(ix);
        let name = pod.name_any();
        let result = if evict {
            pods.evict(&name, &EvictParams::default()).await.map(|_| ())
        } else {
            pods.delete(&name, &DeleteParams::default())
                .await
                .map(|_| ())
        };
        match result {
            Ok(()) => {
                done += 1;
                if let Some(key) = pod.annotations().get(labels::IDEMPOTENCY_KEY) {
                    lock(&shared.disrupted_keys).insert(key.clone());
                }
                info!(pod = %name, evict, "disrupted step pod");
            }
            Err(err) => info!(pod = %name, error = %err, "disrupting a pod failed"),
        }
    }
    done
}

/// Watches every version of every run (directly, not through the proxy).
/// Its errors are evidence too: a `410 Gone` (the watcher re-lists) or an
/// error while kube-apiserver restarts is expected as long as the watch
/// resumes; any other error, or the end of the stream, fails the run.
async fn watch_runs(runs: Api<AgentRun>, shared: Arc<Shared>) {
    let mut stream = watcher(runs, watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Apply(run) | watcher::Event::InitApply(run)) => {
                lock(&shared.observer).observe(&run, jiff::Timestamp::now());
            }
            Ok(watcher::Event::Delete(run)) => lock(&shared.observer).deleted(&run.name_any()),
            Ok(watcher::Event::InitDone) => lock(&shared.observer).watch_ok(),
            Ok(watcher::Event::Init) => {}
            Err(err) => {
                let gone = matches!(&err, watcher::Error::WatchError(s) if s.code == 410);
                let expected = gone || shared.apiserver_unsettled();
                warn!(error = %err, expected, "chaos watch of runs");
                lock(&shared.observer).watch_error(
                    &err.to_string(),
                    expected,
                    jiff::Timestamp::now(),
                );
            }
        }
    }
    lock(&shared.observer).watch_ended(jiff::Timestamp::now());
}

fn hash_of(seed: u64, s: &str) -> u64 {
    let mut h = DefaultHasher::new();
    (seed, s).hash(&mut h);
    h.finish()
}

/// The scripted approver: answers every open Approval as a person would.
/// `Approve`: Approved, or Rejected for about one in ten (by a hash of the name).
/// `Reconcile`: once no execution of the key is still running in the ledger,
/// `MarkSucceeded` if one succeeded, else `Retry` — what a person checking the
/// external system with the idempotency key would answer.
async fn approve(
    approvals: Api<Approval>,
    ledger_path: std::path::PathBuf,
    shared: Arc<Shared>,
    seed: u64,
) {
    let mut first_seen: BTreeMap<String, Instant> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let Ok(list) = approvals.list(&ListParams::default()).await else {
            continue;
        };
        let mut ledger: Option<Ledger> = None;
        for a in list.items {
            if a.spec.decision.is_some() {
                continue;
            }
            let name = a.name_any();
            let seen = *first_seen.entry(name.clone()).or_insert_with(Instant::now);
            let think = Duration::from_millis(hash_of(seed, &name) % 800);
            if seen.elapsed() < think {
                continue;
            }
            let (decision, comment) = match a.spec.kind {
                ApprovalKind::Approve => {
                    if hash_of(seed ^ 0xA5, &name).is_multiple_of(10) {
                        ("Rejected", "chaos approver: rejected".to_owned())
                    } else {
                        ("Approved", "chaos approver: approved".to_owned())
                    }
                }
                ApprovalKind::Reconcile => {
                    let key = a
                        .spec
                        .context
                        .as_ref()
                        .and_then(|c| c.idempotency_key.clone())
                        .unwrap_or_default();
                    let l = ledger
                        .get_or_insert_with(|| Ledger::read(&ledger_path).unwrap_or_default());
                    let started = l.executions().filter(|e| e.key() == key).count();
                    let finished = l.finishes().filter(|e| e.key() == key).count();
                    if started > finished && seen.elapsed() < Duration::from_secs(10) {
                        continue; // an execution is still running: look again later
                    }
                    if l.successes_by_key().get(&key).copied().unwrap_or(0) > 0 {
                        (
                            "MarkSucceeded",
                            format!("chaos approver: the ledger shows key {key} succeeded"),
                        )
                    } else {
                        (
                            "Retry",
                            format!("chaos approver: the ledger shows no success for key {key}"),
                        )
                    }
                }
            };
            let patch = json!({"spec": {"decision": decision, "comment": comment}});
            match approvals
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    *lock(&shared.approvals_answered) += 1;
                    info!(approval = %name, decision, "answered");
                }
                Err(err) => warn!(approval = %name, error = %err, "answering failed"),
            }
        }
    }
}

/// Waits until no step Pod holds the result finalizer (every run is finished,
/// so every result is committed and every finalizer due for release, D5);
/// returns how many still hold it at the deadline. A Pod list that fails is
/// an error: nothing was counted. Operators that exit meanwhile come back.
async fn wait_finalizers_released(
    pods: &Api<Pod>,
    operators: &mut Operators,
    rng: &mut Rng,
    timeout: Duration,
) -> Result<usize, String> {
    let deadline = Instant::now() + timeout;
    loop {
        operators.tick(rng, false);
        let held = pods
            .list(&ListParams::default().labels(labels::RUN))
            .await
            .map_err(|e| format!("listing step Pods: {e}"))?
            .items
            .iter()
            .filter(|p| p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER))
            .count();
        if held == 0 || Instant::now() >= deadline {
            return Ok(held);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Step Pods hold the result finalizer; release them so the namespace can go.
async fn release_finalizers(pods: &Api<Pod>) {
    if let Ok(list) = pods.list(&ListParams::default()).await {
        for pod in list {
            let _ = pods
                .patch(
                    &pod.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
                )
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            namespace: "ns".into(),
            proxy: FaultCounts {
                error_500: 300,
                ..FaultCounts::default()
            },
            operators: OperatorCounts {
                paused_leaders: 2,
                failpoint_crashes: 1,
                ..OperatorCounts::default()
            },
            apiserver_restarts: 1,
            apiserver_restart_failures: vec![],
            evictions: 0,
            deletions: 0,
            approvals_answered: 0,
            status_versions: 0,
            finalizers_held: Ok(0),
            watch_errors: 0,
            watch_errors_expected: 0,
            fault_phase: Duration::from_secs(60),
            wall_time: Duration::from_secs(90),
            verdict: Verdict::default(),
            faults_min: 300,
            paused_leaders_min: 2,
            apiserver_restarts_min: 1,
            failpoint_crashes_min: 1,
        }
    }

    #[test]
    fn a_clean_report_passes_and_its_summary_counts_paused_leaders() {
        let r = report();
        assert!(r.passed(), "{}", r.details());
        assert_eq!(
            r.summary(),
            "faults=304 runs=0 duplicates=0 lost=0 stuck=0 reconcile_approvals=0 paused_leaders=2"
        );
    }

    #[test]
    fn a_held_or_uncounted_finalizer_fails_the_run() {
        let mut r = report();
        r.finalizers_held = Ok(1);
        assert!(!r.passed());
        assert!(r.details().contains("finalizers: 1 step Pods still hold"));
        r.finalizers_held = Err("listing step Pods: connection refused".into());
        assert!(!r.passed());
        assert!(r.details().contains("finalizers_held=unknown"));
    }

    #[test]
    fn an_unexpected_reconcile_approval_or_a_failed_restart_fails_the_run() {
        let mut r = report();
        r.verdict.reconcile_unexpected = 1;
        assert!(!r.passed());
        let mut r = report();
        r.apiserver_restart_failures
            .push("kube-apiserver did not come back".into());
        assert!(!r.passed());
    }

    #[test]
    fn too_few_of_a_kind_fails_the_run() {
        for f in [
            |r: &mut Report| r.operators.paused_leaders = 1,
            |r: &mut Report| r.apiserver_restarts = 0,
            |r: &mut Report| r.operators.failpoint_crashes = 0,
            |r: &mut Report| r.proxy.error_500 = 200,
        ] {
            let mut r = report();
            f(&mut r);
            assert!(!r.passed(), "{}", r.details());
        }
    }
}
