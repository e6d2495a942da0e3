//! Fencing on the real control plane: a leader paused past its lease
//! (SIGSTOP), deposed while it sleeps, and resumed (SIGCONT) wakes up with a
//! cache from before the takeover. It must not act on it: status writes are
//! guarded by the run's resourceVersion, and a Pod that status does not newly
//! record is created only after a quorum read shows the run has not moved on.
//!
//! ```text
//!   operator A (leader) ── SIGSTOP ─────────────── SIGCONT ─▶ acts on a stale cache for 4 s,
//!        │                                                     then steps down (exits)
//!   operator B (standby) ───── takes the Lease ── records the disruption of attempt 1,
//!        │                                        runs attempt 2 and the next steps
//!   driver: evicts / deletes attempt 1's Pod while A sleeps
//!
//!   each operator talks through its own FaultProxy (no faults): while A sleeps and
//!   for 4 s after it wakes, its AgentRun watch events and its Lease requests are
//!   held back, so it wakes to Pod events (attempt 1's Pod is gone) on a run cache
//!   from before the takeover (attempt 1 live) and still believes it leads
//! ```
//!
//! Judged from the simkubelet ledger and the Pods the API server holds, with
//! fixed expected values: every (step, attempt) ran exactly once, the
//! disrupted attempts exactly as often as they were disrupted, and no Pod
//! exists for an attempt that the final status has closed.
//!
//! One file per way a deposed leader could act, under `fencing/`: `paused_leader.rs` (the
//! scenario above, and a live Reconcile approval left alone), `proof_read.rs` (stopped while
//! the read that proves the run current is in flight), `lagging_cache.rs` (a running Pod
//! missing from a new leader's cache is read before it is called lost), `pod_fence.rs` (a
//! Pod create sent after the Lease moved on, refused by the API server). The pair of
//! operators, the Lease waits and the process checks they share are here.

#[path = "fencing/lagging_cache.rs"]
mod lagging_cache;
#[path = "fencing/paused_leader.rs"]
mod paused_leader;
#[path = "fencing/pod_fence.rs"]
mod pod_fence;
#[path = "fencing/proof_read.rs"]
mod proof_read;

use std::time::Duration;

use agentrun_e2e::chaos::proxy::FaultProxy;
use agentrun_e2e::support::processes::{OperatorConfig, Process, free_port, start_operator};
use agentrun_e2e::support::scenario::Scenario;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

const RUN: &str = "fenced";
const TIMEOUT: Duration = Duration::from_secs(60);
/// How long a resumed leader acts on its stale run cache before it can learn
/// that it lost the lease.
const STALE_WINDOW: Duration = Duration::from_secs(4);

use agentrun_e2e::support::scenario::lease_holder as holder;

/// How long past a Lease's expiry a standby may take to take it over.
const TAKEOVER_GRACE: jiff::SignedDuration = jiff::SignedDuration::from_secs(20);
/// The longest any wait for a holder lasts.
const HOLDER_WAIT_MAX: Duration = Duration::from_secs(120);

/// Waits until `identity` holds the Lease. The bound is the Lease's, not
/// a fixed time from when the wait began: it fails once the Lease someone
/// else holds has gone unrenewed for its duration plus [`TAKEOVER_GRACE`]
/// (by its own `renewTime`), i.e. when a standby that tries every two
/// seconds should long have taken it; or after [`HOLDER_WAIT_MAX`] whatever
/// the Lease says. A starved machine that renews late moves the bound with it.
async fn wait_holder(leases: &Api<Lease>, identity: &str, logs: &[&Process]) {
    let cap = tokio::time::Instant::now() + HOLDER_WAIT_MAX;
    loop {
        if holder(leases).await.as_deref() == Some(identity) {
            return;
        }
        let overdue = leases
            .get_opt("agentrun-operator")
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec)
            .and_then(|spec| {
                let renewed = spec.renew_time.or(spec.acquire_time)?.0;
                let duration = i64::from(spec.lease_duration_seconds?);
                let expired = renewed + jiff::SignedDuration::from_secs(duration);
                Some(jiff::Timestamp::now() > expired + TAKEOVER_GRACE)
            })
            .unwrap_or(false);
        if overdue || tokio::time::Instant::now() >= cap {
            let tails: Vec<String> = logs.iter().map(|p| p.log_tail(40)).collect();
            panic!(
                "{identity} never took the lease (holder: {:?})\n{}",
                holder(leases).await,
                tails.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn log_len(p: &Process) -> usize {
    std::fs::read_to_string(p.log_path()).map_or(0, |t| t.len())
}

fn log_since(p: &Process, from: usize) -> String {
    let text = std::fs::read_to_string(p.log_path()).unwrap_or_default();
    text.get(from..).unwrap_or_default().to_owned()
}

/// Two leader-electing operators, each through its own proxy (faults off),
/// `operator-a` holding the Lease.
struct Pair {
    proxies: Vec<FaultProxy>,
    cfgs: Vec<OperatorConfig>,
    ops: Vec<Option<Process>>,
    leases: Api<Lease>,
}

impl Pair {
    async fn start(s: &Scenario) -> Pair {
        Pair::start_with(s, None).await
    }

    /// Like `start`, with `failpoint` (AGENTRUN_FAILPOINT) for operator A.
    async fn start_with(s: &Scenario, failpoint: Option<&str>) -> Pair {
        let leases: Api<Lease> = s.env().api();
        let mut proxies = Vec::new();
        let mut cfgs = Vec::new();
        for id in ["operator-a", "operator-b"] {
            let p = FaultProxy::quiet().await;
            let kubeconfig = agentrun_e2e::support::processes::log_dir(s.namespace())
                .join(format!("{id}-kubeconfig"));
            p.write_kubeconfig(&kubeconfig, s.namespace())
                .expect("writing the proxy kubeconfig");
            proxies.push(p);
            let mut c = s.operator_config.clone();
            c.kubeconfig = kubeconfig;
            c.leader_elect = true;
            c.lease_duration_seconds = 6;
            c.identity = id.into();
            c.metrics_port = free_port();
            c.health_port = free_port();
            if id == "operator-a" {
                c.failpoint = failpoint.map(str::to_owned);
            }
            cfgs.push(c);
        }
        let mut ops: Vec<Option<Process>> = vec![Some(start_operator(&cfgs[0])), None];
        wait_holder(&leases, "operator-a", &[ops[0].as_ref().unwrap()]).await;
        ops[1] = Some(start_operator(&cfgs[1]));
        Pair {
            proxies,
            cfgs,
            ops,
            leases,
        }
    }

    /// SIGSTOPs `leader` with its Lease requests and the watch events of
    /// `stale` (path fragments, e.g. `/agentruns`) held back, and waits until
    /// `standby` holds the Lease.
    async fn pause(&mut self, leader: usize, standby: usize, stale: &[&str]) -> Process {
        assert_eq!(
            holder(&self.leases).await.as_deref(),
            Some(self.cfgs[leader].identity.as_str()),
            "the leader before the pause"
        );
        let paused = self.ops[leader].take().expect("the leader runs");
        let link = &self.proxies[leader];
        for fragment in stale {
            link.stall(fragment, true, Duration::from_secs(300));
        }
        link.stall("/leases", false, Duration::from_secs(300));
        assert!(paused.pause(), "SIGSTOP {}", self.cfgs[leader].identity);
        wait_holder(
            &self.leases,
            &self.cfgs[standby].identity.clone(),
            &[self.ops[standby].as_ref().unwrap()],
        )
        .await;
        paused
    }

    /// SIGCONTs `paused` (slot `leader`): for STALE_WINDOW it acts on its
    /// stale run cache; it must then step down. Restarts it as a standby and
    /// returns what it logged after it woke.
    async fn resume(&mut self, leader: usize, mut paused: Process) -> String {
        let from = log_len(&paused);
        self.proxies[leader].end_stalls_in(STALE_WINDOW);
        assert!(paused.resume(), "SIGCONT {}", self.cfgs[leader].identity);
        let exit = paused.wait_exit(Duration::from_secs(30)).await;
        assert!(
            exit.is_some(),
            "{} kept running after it lost the lease\n{}",
            self.cfgs[leader].identity,
            paused.log_tail(60)
        );
        let after = log_since(&paused, from);
        assert!(
            after.contains("lost the leader lease"),
            "{} exited without saying it lost the lease:\n{after}",
            self.cfgs[leader].identity
        );
        // Back as a standby (same identity, the Lease is not its own).
        self.cfgs[leader].metrics_port = free_port();
        self.cfgs[leader].health_port = free_port();
        self.ops[leader] = Some(start_operator(&self.cfgs[leader]));
        after
    }

    async fn stop(&mut self) {
        for p in self.ops.iter_mut().flatten() {
            p.kill().await;
        }
    }
}

/// Whether the process is stopped (SIGSTOP): state `T` in /proc.
fn stopped(p: &Process) -> bool {
    let Some(pid) = p.pid() else { return false };
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

async fn wait_stopped(p: &Process, what: &str) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !stopped(p) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the operator never stopped {what}\n{}",
            p.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
