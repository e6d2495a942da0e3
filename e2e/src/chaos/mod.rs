//! The chaos suite: many runs under injected faults, judged from the
//! simkubelet ledger and the runs' statuses.
//!
//! ```text
//!   driver (direct to the apiserver) ── creates runs, answers Approvals, evicts and
//!        │                               deletes step Pods, watches every status version
//!        ├─ simkubelet --namespace <ns> --ledger <dir>/ledger.jsonl     (direct)
//!        ├─ FaultProxy 127.0.0.1:<port> ──TLS + admin cert──▶ kube-apiserver
//!        └─ agentrun-operator run --namespace <ns>   (through the proxy; SIGKILLed and restarted)
//!
//!   fault phase ──(enough faults, or every run finished, or --duration-limit)──▶
//!   settle phase (no faults; the approver still answers) ──▶ verdict
//! ```
//!
//! `chaos::run` is used by the `chaos` binary (the long run, `make chaos`) and
//! by `tests/chaos.rs` (the bounded short run inside `make test`).

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
use crate::support::processes::{
    OperatorConfig, Process, log_dir, start_operator, start_simkubelet,
};
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
    /// Longest fault phase; then the faults stop whatever the count.
    pub duration_limit: Duration,
    /// How long runs get to finish once the faults stop.
    pub settle: Duration,
    pub seed: u64,
    pub proxy: ProxyConfig,
    /// Operator SIGKILL: the next one comes after a time uniform in this range.
    pub kill_every: (Duration, Duration),
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
            duration_limit: Duration::from_secs(900),
            settle: Duration::from_secs(180),
            seed,
            proxy: ProxyConfig {
                seed,
                ..ProxyConfig::default()
            },
            kill_every: (Duration::from_secs(4), Duration::from_secs(12)),
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
            duration_limit: Duration::from_secs(120),
            settle: Duration::from_secs(60),
            kill_every: (Duration::from_secs(4), Duration::from_secs(9)),
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
    pub operator_kills: u64,
    pub evictions: u64,
    pub deletions: u64,
    pub approvals_answered: u64,
    pub status_versions: u64,
    /// Step Pods still holding `agentrun.dev/result` 30 s after the last run finished.
    pub finalizers_held: usize,
    pub fault_phase: Duration,
    pub wall_time: Duration,
    pub verdict: Verdict,
    pub faults_min: u64,
}

impl Report {
    /// Every injected fault: proxy faults, operator kills, evicted and deleted Pods.
    pub fn faults(&self) -> u64 {
        self.proxy.total() + self.operator_kills + self.evictions + self.deletions
    }

    /// The one summary line.
    pub fn summary(&self) -> String {
        format!(
            "faults={} runs={} duplicates={} lost={} stuck={} reconcile_approvals={}",
            self.faults(),
            self.verdict.runs,
            self.verdict.duplicates,
            self.verdict.lost,
            self.verdict.stuck,
            self.verdict.reconcile_approvals
        )
    }

    /// The breakdown behind the summary line.
    pub fn details(&self) -> String {
        let v = &self.verdict;
        let mut out = format!(
            "namespace={} wall={:.0}s fault_phase={:.0}s\nproxy: {}\nkills={} evictions={} deletions={} approvals_answered={} status_versions_seen={} finalizers_held={}\nexecutions={} successful_executions={} phases={:?} reconcile_unexpected={}",
            self.namespace,
            self.wall_time.as_secs_f64(),
            self.fault_phase.as_secs_f64(),
            self.proxy,
            self.operator_kills,
            self.evictions,
            self.deletions,
            self.approvals_answered,
            self.status_versions,
            self.finalizers_held,
            v.executions,
            v.successful_executions,
            v.phases,
            v.reconcile_unexpected,
        );
        if self.faults() < self.faults_min {
            out.push_str(&format!(
                "\ntoo few faults: {} < --faults-min {}",
                self.faults(),
                self.faults_min
            ));
        }
        for f in &v.findings {
            out.push('\n');
            out.push_str(f);
        }
        out
    }

    /// The verdict passed and enough faults were injected to mean something.
    pub fn passed(&self) -> bool {
        self.verdict.passed() && self.faults() >= self.faults_min
    }
}

/// What the driver's helpers share.
#[derive(Default)]
struct Shared {
    observer: Mutex<Observer>,
    disrupted_keys: Mutex<BTreeSet<String>>,
    approvals_answered: Mutex<u64>,
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
    let mut operator: Option<Process> = Some(start_operator(&op_cfg));

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

    let mut kills = 0u64;
    let mut evictions = 0u64;
    let mut deletions = 0u64;
    let start = Instant::now();
    let mut next_kill = start + chaos_rng.duration(cfg.kill_every.0, cfg.kill_every.1);
    let mut next_evict = start + chaos_rng.duration(cfg.evict_every.0, cfg.evict_every.1);
    let mut next_delete = start + chaos_rng.duration(cfg.delete_every.0, cfg.delete_every.1);
    let mut restart_at: Option<Instant> = None;

    // Fault phase.
    loop {
        let terminal = lock(&shared.observer).terminal();
        let all_created = created.len() == plans.len();
        let faults = proxy.counts().total() + kills + evictions + deletions;
        if all_created && (faults >= cfg.faults_min || terminal >= created.len()) {
            break;
        }
        if start.elapsed() >= cfg.duration_limit {
            warn!("duration limit reached; stopping the faults");
            break;
        }
        submit(&runs_api, &plans, &mut created, terminal, cfg.max_active).await;

        let now = Instant::now();
        if let Some(at) = restart_at
            && now >= at
        {
            operator = Some(start_operator(&op_cfg));
            restart_at = None;
        }
        if now >= next_kill && operator.is_some() {
            if let Some(mut op) = operator.take() {
                op.kill().await;
            }
            kills += 1;
            restart_at =
                Some(now + chaos_rng.duration(Duration::ZERO, Duration::from_millis(1500)));
            next_kill = now + chaos_rng.duration(cfg.kill_every.0, cfg.kill_every.1);
            info!(kills, "operator killed");
        }
        if now >= next_evict {
            evictions += disrupt(&pods_api, &shared, &mut chaos_rng, cfg.evict_max, true).await;
            next_evict = now + chaos_rng.duration(cfg.evict_every.0, cfg.evict_every.1);
        }
        if now >= next_delete {
            deletions += disrupt(&pods_api, &shared, &mut chaos_rng, 3, false).await;
            next_delete = now + chaos_rng.duration(cfg.delete_every.0, cfg.delete_every.1);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fault_phase = start.elapsed();
    proxy.set_enabled(false);
    if operator.is_none() {
        operator = Some(start_operator(&op_cfg));
    }
    info!(
        faults = proxy.counts().total() + kills + evictions + deletions,
        "faults stopped; settling"
    );

    // Settle phase: no faults; the approver keeps answering.
    let settle_start = Instant::now();
    loop {
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
    let finalizers_held = wait_finalizers_released(&pods_api, Duration::from_secs(30)).await;
    approver_task.abort();
    if let Some(mut op) = operator.take() {
        op.kill().await;
    }
    simkubelet.kill().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    watch_task.abort();

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
        operator_kills: kills,
        evictions,
        deletions,
        approvals_answered: *lock(&shared.approvals_answered),
        status_versions: observer.versions,
        finalizers_held,
        fault_phase,
        wall_time: wall.elapsed(),
        verdict,
        faults_min: cfg.faults_min,
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
            Ok(_) => {}
            Err(err) => warn!(error = %err, "chaos watch of runs"),
        }
    }
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
/// returns how many still hold it at the deadline.
async fn wait_finalizers_released(pods: &Api<Pod>, timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    loop {
        let held = match pods.list(&ListParams::default().labels(labels::RUN)).await {
            Ok(list) => list
                .items
                .iter()
                .filter(|p| p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER))
                .count(),
            Err(_) => usize::MAX,
        };
        if held == 0 || Instant::now() >= deadline {
            return if held == usize::MAX { 0 } else { held };
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
