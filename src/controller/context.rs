//! What every reconcile shares ([`Context`]), and where the operator looks
//! and what it tells people ([`Scope`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource};

use super::{capacity, clock, events, expectations, index, resume};
use crate::api::{AgentRun, Approval, Signal, StepJournal};
use crate::metrics::Metrics;

pub(super) const SYNCED_RUNS: u8 = 1;
pub(super) const SYNCED_PODS: u8 = 2;
pub(super) const SYNCED_APPROVALS: u8 = 4;
pub(super) const SYNCED_SIGNALS: u8 = 8;
pub(super) const SYNCED_JOURNALS: u8 = 16;
/// The chart's journal-writer ClusterRole with its default prefix.
pub const DEFAULT_JOURNAL_WRITER_ROLE: &str = "agentrun-journal-writer";
pub(super) const SYNCED_ALL: u8 =
    SYNCED_RUNS | SYNCED_PODS | SYNCED_APPROVALS | SYNCED_SIGNALS | SYNCED_JOURNALS;

/// Where the operator looks for runs, and what it tells people.
#[derive(Clone, Debug)]
pub struct Scope {
    /// Watch only this namespace; `None` watches all namespaces.
    pub namespace: Option<String>,
    /// Publish an Event for every step start and success, not only for
    /// retries, disruptions, approvals, re-plans and the run's end.
    pub step_events: bool,
    /// Notify people about approvals (`--notify-secret`); `None`: no
    /// notifications are sent.
    pub notify: Option<crate::notify::Settings>,
    /// How long one reconcile may take once it has its slot before it is
    /// abandoned and tried again (`--reconcile-timeout-seconds`).
    pub reconcile_timeout: std::time::Duration,
    /// This instance in the leader Lease (`--leader-elect`): its identity is
    /// set on the step Pods it creates (`agentrun.dev/leader`); `None` without
    /// leader election.
    pub leader: Option<Leader>,
    /// Where every decision's `now` comes from ([`clock`]); the client the
    /// controller is given should feed it (`Clock::layer`).
    pub clock: clock::Clock,
    /// Caps on the runs active at once (`--max-active-runs-per-namespace`,
    /// `--max-active-runs`); the rest queue ([`capacity`]).
    pub caps: capacity::Caps,
    /// The run history (D18): finished runs are recorded, runs created again
    /// recognised. `None`: no history (`--history-store=off`).
    pub history: Option<crate::history::Settings>,
    /// The ClusterRole a journaled step's ServiceAccount is bound to in the
    /// run's namespace (`--journal-writer-role`, docs/journal.md).
    pub journal_writer_role: String,
}

/// This instance's place in leader election.
#[derive(Clone, Debug)]
pub struct Leader {
    pub identity: String,
    pub lease_name: String,
    pub lease_namespace: String,
}

impl Default for Scope {
    fn default() -> Self {
        Scope {
            namespace: None,
            step_events: true,
            notify: None,
            reconcile_timeout: std::time::Duration::from_secs(60),
            leader: None,
            clock: clock::Clock::default(),
            caps: capacity::Caps::default(),
            history: None,
            journal_writer_role: DEFAULT_JOURNAL_WRITER_ROLE.to_owned(),
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    /// Step Pods (label `agentrun.dev/run`) by run, as much of each as the
    /// operator reads ([`index::StepPod`]).
    pub(super) pods: index::PodCache,
    /// Approvals, managedFields kept (the decider is read from them).
    pub approvals: Store<Approval>,
    /// The names of each run's Approvals (by run UID), from the same watch.
    pub(super) approval_index: index::ApprovalIndex,
    /// Signals, managedFields kept (when a signal was sent, and by whom, is
    /// read from them).
    pub signals: Store<Signal>,
    /// The names of each run's Signals (by run UID), from the same watch.
    pub(super) signal_index: index::SignalIndex,
    /// Step journal chunks (D19), managedFields dropped.
    pub journals: Store<StepJournal>,
    /// The names of each run's journal chunks (by run UID), from the same watch.
    pub(super) journal_index: index::JournalIndex,
    /// ServiceAccounts already bound to the journal-writer role, by
    /// (namespace, name): each is bound once per process.
    pub(super) journal_writers: Mutex<std::collections::HashSet<(String, String)>>,
    pub(super) journal_writer_role: String,
    /// Publishes the engine's Events in the background.
    pub(super) events: events::EventSink,
    /// Publish `StepStarted` and `StepSucceeded` (`--step-events`).
    pub(super) step_events: bool,
    /// Pod writes this process just made that the cache may not show yet.
    pub(super) expectations: Arc<expectations::Expectations>,
    /// Status writes this process just made that the run cache may not show yet.
    pub(super) status_writes: expectations::StatusWrites,
    pub metrics: Arc<Metrics>,
    /// Which caches finished their initial list (bits `SYNCED_*`).
    pub(super) synced: tokio::sync::watch::Receiver<u8>,
    /// Consecutive failures per run, for the per-object backoff.
    pub(super) failures: Mutex<HashMap<ObjectRef<AgentRun>, u32>>,
    /// The runs as the watch last showed them; a run that does not
    /// deserialize is kept as its metadata and the error (see
    /// [`super::reconcile::unreadable`]), so it cannot stop the watch of the others.
    pub(super) runs: Store<DeserializeGuard<AgentRun>>,
    /// Generations of unreadable runs whose `Stalled` condition was written.
    pub(super) unreadable: Mutex<HashMap<String, i64>>,
    /// The deadline of one reconcile once it holds a slot.
    pub(super) reconcile_timeout: std::time::Duration,
    /// This instance's Lease, its identity annotated on the step Pods it creates.
    pub(super) leader: Option<Leader>,
    /// The time every decision is made at: never ahead of the API server's.
    pub clock: clock::Clock,
    /// The caps on active runs, and the admissions the run cache may not show yet.
    pub(super) capacity: capacity::Capacity,
    /// The run history (D18), when kept.
    pub(super) history: Option<crate::history::Settings>,
    /// The operator watches every namespace (and may read them).
    pub(super) all_namespaces: bool,
    /// The first round after a start, and the work held behind it.
    pub(super) resume: Arc<resume::Lane>,
}

/// Reconciles that do work at once, granted first come, first served
/// ([`queue`]).
pub(super) const CONCURRENT_RECONCILES: usize = 16;

impl Context {
    /// Waits until the Pod, Approval and Signal caches hold the cluster's state. Before
    /// that, a step Pod missing from the cache would look lost (D6) when it is
    /// merely not listed yet.
    pub(super) async fn caches_synced(&self) {
        let mut synced = self.synced.clone();
        let _ = synced.wait_for(|m| *m == SYNCED_ALL).await;
    }

    pub(super) fn record_failure(&self, run: &ObjectRef<AgentRun>) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = failures.entry(run.clone()).or_insert(0);
        *n += 1;
        *n
    }

    pub(super) fn record_success(&self, run: &ObjectRef<AgentRun>) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(run);
    }
}

pub(super) fn api_for<K>(client: &Client, scope: &Scope) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match &scope.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}
