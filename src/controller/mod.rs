//! The wiring: watch AgentRuns, their step Pods and Approvals (kube-runtime
//! watchers and caches); every event names a run, which waits its turn in
//! one line ([`queue`]); for each run observe (caches) → decide
//! ([`crate::engine`]) → apply (guarded status write, then the engine's
//! actions).
//!
//! ```text
//!   watch AgentRun ─┐
//!   watch Pod (agentrun.dev/run) ──owner─┤──▶ line ──▶ reconcile(run) ──▶ engine::decide ──▶ status (resourceVersion-guarded)
//!   watch Approval ──the run it names────┘                                          └─▶ create Pod / release finalizer / …
//! ```
//!
//! The operator holds no durable state in memory: the caches are rebuilt from
//! the API server after a restart, and every decision starts from the run's
//! committed status.

mod apply;
pub mod capacity;
pub mod clock;
mod decide;
mod error;
mod events;
mod expectations;
mod failpoints;
mod history;
mod index;
mod orphans;
mod owned;
mod queue;
mod reconcile;
mod relist;
mod resume;
mod status_write;
mod step_pod;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt, TryStreamExt, future};
use kube::core::DeserializeGuard;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{info, warn};

use crate::api::{AgentRun, Approval, Signal};
use crate::labels;
use crate::metrics::{Health, Metrics, NamespaceLabel, PhaseLabel, Refresh, WatchLabel};
use relist::CachedObjects;

pub use error::{Category, Error, Result};

const SYNCED_RUNS: u8 = 1;
const SYNCED_PODS: u8 = 2;
const SYNCED_APPROVALS: u8 = 4;
const SYNCED_SIGNALS: u8 = 8;
const SYNCED_ALL: u8 = SYNCED_RUNS | SYNCED_PODS | SYNCED_APPROVALS | SYNCED_SIGNALS;

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
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    /// Step Pods (label `agentrun.dev/run`) by run, as much of each as the
    /// operator reads ([`index::StepPod`]).
    pods: index::PodCache,
    /// Approvals, managedFields kept (the decider is read from them).
    pub approvals: Store<Approval>,
    /// The names of each run's Approvals (by run UID), from the same watch.
    approval_index: index::ApprovalIndex,
    /// Signals, managedFields kept (when a signal was sent, and by whom, is
    /// read from them).
    pub signals: Store<Signal>,
    /// The names of each run's Signals (by run UID), from the same watch.
    signal_index: index::SignalIndex,
    /// Publishes the engine's Events in the background.
    events: events::EventSink,
    /// Publish `StepStarted` and `StepSucceeded` (`--step-events`).
    step_events: bool,
    /// Pod writes this process just made that the cache may not show yet.
    expectations: Arc<expectations::Expectations>,
    /// Status writes this process just made that the run cache may not show yet.
    status_writes: expectations::StatusWrites,
    pub metrics: Arc<Metrics>,
    /// Which caches finished their initial list (bits `SYNCED_*`).
    synced: tokio::sync::watch::Receiver<u8>,
    /// Consecutive failures per run, for the per-object backoff.
    failures: Mutex<HashMap<ObjectRef<AgentRun>, u32>>,
    /// The runs as the watch last showed them; a run that does not
    /// deserialize is kept as its metadata and the error (see
    /// [`reconcile::unreadable`]), so it cannot stop the watch of the others.
    runs: Store<DeserializeGuard<AgentRun>>,
    /// Generations of unreadable runs whose `Stalled` condition was written.
    unreadable: Mutex<HashMap<String, i64>>,
    /// The deadline of one reconcile once it holds a slot.
    reconcile_timeout: std::time::Duration,
    /// This instance's Lease, its identity annotated on the step Pods it creates.
    leader: Option<Leader>,
    /// The time every decision is made at: never ahead of the API server's.
    pub clock: clock::Clock,
    /// The caps on active runs, and the admissions the run cache may not show yet.
    capacity: capacity::Capacity,
    /// The run history (D18), when kept.
    history: Option<crate::history::Settings>,
    /// The operator watches every namespace (and may read them).
    all_namespaces: bool,
    /// The first round after a start, and the work held behind it.
    resume: Arc<resume::Lane>,
}

/// Reconciles that do work at once, granted first come, first served
/// ([`queue`]).
const CONCURRENT_RECONCILES: usize = 16;

impl Context {
    /// Waits until the Pod, Approval and Signal caches hold the cluster's state. Before
    /// that, a step Pod missing from the cache would look lost (D6) when it is
    /// merely not listed yet.
    async fn caches_synced(&self) {
        let mut synced = self.synced.clone();
        let _ = synced.wait_for(|m| *m == SYNCED_ALL).await;
    }

    fn record_failure(&self, run: &ObjectRef<AgentRun>) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = failures.entry(run.clone()).or_insert(0);
        *n += 1;
        *n
    }

    fn record_success(&self, run: &ObjectRef<AgentRun>) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(run);
    }
}

fn api_for<K>(client: &Client, scope: &Scope) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match &scope.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs the controller until `shutdown` resolves. In-flight reconciles finish
/// first; anything cut short is re-derived by the next instance.
pub async fn run(
    client: Client,
    scope: Scope,
    reporter: Reporter,
    metrics: Arc<Metrics>,
    health: Health,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    failpoints::warn_if_unsupported();
    let runs: Api<DeserializeGuard<AgentRun>> = api_for(&client, &scope);
    // Deserialized as `StepPod`: the spec and the rest are never built.
    let pods_api: Api<index::StepPod> = api_for(&client, &scope);
    let approvals_api: Api<Approval> = api_for(&client, &scope);
    let signals_api: Api<Signal> = api_for(&client, &scope);

    // Which caches have finished their initial list. (Store::wait_until_ready
    // wakes only one of several concurrent waiters, so readiness is taken from
    // the watch streams' InitDone events instead.)
    let (synced_tx, synced_rx) = tokio::sync::watch::channel(0u8);
    let synced_tx = Arc::new(synced_tx);

    let (runs_store, runs_writer) = reflector::store();
    let run_stream = watcher(runs, watcher::Config::default())
        .default_backoff()
        // The reconcile never reads a run's managedFields, which are as large
        // as its status: keep them out of the cache.
        .modify(|run: &mut DeserializeGuard<AgentRun>| run.managed_fields_mut().clear())
        .reflect(runs_writer)
        .inspect_ok(mark_synced(synced_tx.clone(), SYNCED_RUNS))
        // After a relist, only once the cache holds it (see `relist`).
        .cached_objects(runs_store.clone());

    let (pods, pods_writer) = reflector::store();
    let pod_index = index::PodIndex::default();
    let (orphan_tx, orphan_rx) = tokio::sync::mpsc::unbounded_channel();
    let expectations = Arc::new(expectations::Expectations::default());
    let pod_stream = watcher(
        pods_api,
        watcher::Config::default().labels(labels::STEP_POD_SELECTOR),
    )
    .default_backoff()
    // The watch has read the version it resumes from; nothing else does.
    .modify(index::StepPod::forget_resource_version)
    .reflect(pods_writer)
    .inspect_ok({
        let pod_index = pod_index.clone();
        let expectations = expectations.clone();
        move |event| {
            pod_index.apply(event);
            expectations.observe(event);
        }
    })
    .inspect_ok(mark_synced(synced_tx.clone(), SYNCED_PODS))
    .cached_objects(pods.clone())
    .inspect_ok({
        let orphan_tx = orphan_tx.clone();
        move |pod: &Arc<index::StepPod>| {
            if orphans::may_be_orphaned(pod) {
                let _ = orphan_tx.send(ObjectRef::from_obj(&**pod));
            }
        }
    });

    let (approvals, approvals_writer) = reflector::store();
    let approval_index = index::ApprovalIndex::default();
    let approval_stream = watcher(approvals_api, watcher::Config::default())
        .default_backoff()
        .reflect(approvals_writer)
        .inspect_ok({
            let approval_index = approval_index.clone();
            move |event| approval_index.apply(event)
        })
        .inspect_ok(mark_synced(synced_tx.clone(), SYNCED_APPROVALS))
        .cached_objects(approvals.clone());

    let (signals, signals_writer) = reflector::store();
    let signal_index = index::SignalIndex::default();
    let signal_stream = watcher(signals_api, watcher::Config::default())
        .default_backoff()
        .reflect(signals_writer)
        .inspect_ok({
            let signal_index = signal_index.clone();
            move |event| signal_index.apply(event)
        })
        .inspect_ok(mark_synced(synced_tx.clone(), SYNCED_SIGNALS))
        .cached_objects(signals.clone());

    let events = events::EventSink::spawn(client.clone(), reporter);
    // The notifier stops with the controller (below) and runs only where it
    // runs: on the leader.
    let (notifier_stop, notifier_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(settings) = scope.notify.clone() {
        let sink = events.clone();
        tokio::spawn(crate::notify::run(
            client.clone(),
            scope.namespace.clone(),
            settings,
            metrics.clone(),
            Arc::new(move |event, regarding| sink.publish(event, regarding)),
            || failpoints::hit("after-notify-send"),
            async move {
                let _ = notifier_stopped.await;
            },
        ));
    }
    let ctx = Arc::new(Context {
        events,
        step_events: scope.step_events,
        expectations,
        status_writes: expectations::StatusWrites::default(),
        client: client.clone(),
        pods: index::PodCache::new(pods.clone(), pod_index),
        approvals: approvals.clone(),
        approval_index,
        signals,
        signal_index,
        metrics: metrics.clone(),
        synced: synced_rx.clone(),
        failures: Mutex::new(HashMap::new()),
        runs: runs_store.clone(),
        unreadable: Mutex::new(HashMap::new()),
        reconcile_timeout: scope.reconcile_timeout,
        leader: scope.leader.clone(),
        clock: scope.clock.clone(),
        capacity: capacity::Capacity::new(scope.caps.clone()),
        history: scope.history.clone(),
        all_namespaces: scope.namespace.is_none(),
        resume: Arc::default(),
    });
    if let Some(history) = scope.history.clone() {
        tokio::spawn(history::prune_now_and_then(
            history,
            scope.clock.clone(),
            scope.namespace.is_none().then(|| client.clone()),
            metrics.clone(),
            synced_rx.clone(),
        ));
    }

    let run_stream = wake_queued(run_stream, runs_store.clone(), scope.caps);
    let triggers = triggers(
        run_stream,
        pod_stream,
        approval_stream,
        signal_stream,
        &metrics,
    );
    tokio::spawn(orphans::release_orphans(
        client.clone(),
        synced_rx.clone(),
        pods.clone(),
        orphan_tx,
        orphan_rx,
    ));
    {
        let mut synced_rx = synced_rx.clone();
        tokio::spawn(async move {
            if synced_rx.wait_for(|m| *m == SYNCED_ALL).await.is_ok() {
                health.set_ready(true);
                info!("caches synced");
            }
        });
    }
    metrics.set_refresh(gauges(runs_store, approvals, metrics.clone()));

    info!(namespace = ?scope.namespace, "controller started");
    let depth = metrics.clone();
    queue::run(
        triggers,
        CONCURRENT_RECONCILES,
        move |run| reconcile::reconcile(run, ctx.clone()),
        move |n| {
            depth.workqueue_depth.set(n as i64);
        },
        shutdown,
    )
    .await;
    drop(notifier_stop);
    info!("controller stopped");
}

/// The runs that the four watches' events name: a run's own, its step
/// Pods' (by owner reference), its Approvals' and its Signals' (the run they
/// name).
///
/// A watch error ends at [`retried_by_its_watch`]: each watch relists or
/// resumes on its own backoff (`default_backoff`) while the others go on, so
/// one failing watch (an API server restarting, a resource whose watch keeps
/// failing) holds back no other run's reconcile and no other cache.
fn triggers(
    runs: impl Stream<Item = Result<Arc<DeserializeGuard<AgentRun>>, watcher::Error>> + Send + 'static,
    pods: impl Stream<Item = Result<Arc<index::StepPod>, watcher::Error>> + Send + 'static,
    approvals: impl Stream<Item = Result<Arc<Approval>, watcher::Error>> + Send + 'static,
    signals: impl Stream<Item = Result<Arc<Signal>, watcher::Error>> + Send + 'static,
    metrics: &Arc<Metrics>,
) -> impl Stream<Item = RunRef> + Send + 'static {
    let runs = runs
        .filter_map(retried_by_its_watch("agentruns", metrics.clone()))
        .map(|run| ObjectRef::from_obj(&*run))
        .boxed();
    let pods = pods
        .filter_map(retried_by_its_watch("pods", metrics.clone()))
        .flat_map(|pod| {
            let ns = pod.namespace();
            let owners: Vec<RunRef> = pod
                .owner_references()
                .iter()
                .filter(|o| o.kind == "AgentRun" && o.api_version == AgentRun::api_version(&()))
                .filter_map(|o| Some(ObjectRef::new(&o.name).within(ns.as_deref()?)))
                .collect();
            futures::stream::iter(owners)
        })
        .boxed();
    let approvals = approvals
        .filter_map(retried_by_its_watch("approvals", metrics.clone()))
        .filter_map(|approval: Arc<Approval>| {
            // The Approval names its run; the owner reference says the same.
            future::ready(
                approval
                    .namespace()
                    .map(|ns| ObjectRef::new(&approval.spec.run_name).within(&ns)),
            )
        })
        .boxed();
    let signals = signals
        .filter_map(retried_by_its_watch("signals", metrics.clone()))
        .filter_map(|signal: Arc<Signal>| {
            future::ready(
                signal
                    .namespace()
                    .map(|ns| ObjectRef::new(&signal.spec.run_name).within(&ns)),
            )
        })
        .boxed();
    futures::stream::select_all([runs, pods, approvals, signals])
}

/// Each run event, and when the run frees a place under the caps on active
/// runs (it finished, is being deleted, or was cancelled before it started),
/// the runs queued behind it: its namespace's, or every namespace's under a
/// total cap. They look at the caps again at once rather than at their next
/// recheck.
fn wake_queued(
    runs: impl Stream<Item = Result<Arc<DeserializeGuard<AgentRun>>, watcher::Error>> + Send + 'static,
    store: Store<DeserializeGuard<AgentRun>>,
    caps: capacity::Caps,
) -> impl Stream<Item = Result<Arc<DeserializeGuard<AgentRun>>, watcher::Error>> + Send + 'static {
    runs.flat_map(move |event| {
        let mut out = Vec::new();
        if caps.any()
            && let Ok(guard) = &event
            && let Ok(run) = &guard.0
            && capacity::Seat::of(run, &caps).gone
        {
            let ns = run.metadata.namespace.clone();
            out.extend(
                store
                    .state()
                    .into_iter()
                    .filter(|g| {
                        g.0.as_ref().is_ok_and(|r| {
                            let s = capacity::Seat::of(r, &caps);
                            !s.started
                                && !s.gone
                                && (caps.total.is_some() || r.metadata.namespace == ns)
                        })
                    })
                    .map(Ok),
            );
        }
        out.insert(0, event);
        futures::stream::iter(out)
    })
}

/// A run as the cache keys it.
type RunRef = ObjectRef<DeserializeGuard<AgentRun>>;

/// Logs and counts a watch's error and drops it (see [`triggers`]); the
/// watch itself relists or resumes after its backoff.
fn retried_by_its_watch<K: Send + 'static>(
    watch: &'static str,
    metrics: Arc<Metrics>,
) -> impl FnMut(Result<K, watcher::Error>) -> future::Ready<Option<K>> + Send + 'static {
    move |item| {
        future::ready(match item {
            Ok(object) => Some(object),
            Err(err) => {
                warn!(watch, error = %err, "watch failed; it is retried with backoff");
                metrics
                    .watch_errors
                    .get_or_create(&WatchLabel {
                        watch: watch.to_owned(),
                    })
                    .inc();
                None
            }
        })
    }
}

/// Marks `bit` in `synced` when a watch stream finishes its initial list.
fn mark_synced<K>(
    synced: Arc<tokio::sync::watch::Sender<u8>>,
    bit: u8,
) -> impl FnMut(&watcher::Event<K>) {
    move |event| {
        if matches!(event, watcher::Event::InitDone) {
            synced.send_modify(|m| *m |= bit);
        }
    }
}

/// Sets the cache-derived gauges: runs by phase, stalled runs, progress,
/// pending approvals and their expiry.
fn gauges(
    runs: Store<DeserializeGuard<AgentRun>>,
    approvals: Store<Approval>,
    metrics: Arc<Metrics>,
) -> Refresh {
    Arc::new(move || {
        let (runs, approvals) = (runs.state(), approvals.state());
        let g = crate::telemetry::gauges::compute(
            runs.iter().filter_map(|r| r.0.as_ref().ok()),
            approvals.iter().map(|a| a.as_ref()),
            jiff::Timestamp::now(),
        );
        for (phase, n) in g.runs_by_phase {
            metrics
                .runs_by_phase
                .get_or_create(&PhaseLabel { phase })
                .set(n);
        }
        metrics.approvals_pending.set(g.approvals_pending);
        // Namespaces come and go: only the ones with something to say are exported.
        metrics.approval_expiry.clear();
        for (namespace, secs) in g.approval_expiry {
            metrics
                .approval_expiry
                .get_or_create(&NamespaceLabel { namespace })
                .set(secs);
        }
        metrics.runs_stalled.clear();
        for (namespace, n) in g.runs_stalled {
            metrics
                .runs_stalled
                .get_or_create(&NamespaceLabel { namespace })
                .set(n);
        }
        metrics.progress_age.clear();
        for (namespace, secs) in g.progress_age {
            metrics
                .progress_age
                .get_or_create(&NamespaceLabel { namespace })
                .set(secs);
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus_client::registry::Registry;
    use tokio::time::Instant;

    use super::*;

    /// The Approval watch fails six times in a row, as it does while the API
    /// server restarts; then a run changes. Its reconcile starts at once, and
    /// the errors are counted. (A backoff of the merged trigger stream, as
    /// kube-runtime's controller applies, would hold it back at least 0.8 s,
    /// its first delay; the bound below is half that, far above an in-process
    /// hand-over.)
    #[tokio::test]
    async fn a_failing_watch_holds_back_no_reconcile() {
        let metrics = Metrics::register(&mut Registry::default());
        let run = Arc::new(DeserializeGuard(Ok(AgentRun::test())));

        let (changed, runs) = futures::channel::mpsc::unbounded();
        let approvals =
            futures::stream::iter((0..6).map(|_| Err(watcher::Error::NoResourceVersion)))
                .chain(futures::stream::pending());
        let (seen, mut reconciled) = tokio::sync::mpsc::unbounded_channel::<Instant>();
        tokio::spawn(queue::run(
            triggers(
                runs.map(Ok),
                futures::stream::pending(),
                approvals,
                futures::stream::pending(),
                &metrics,
            ),
            1,
            move |_run| {
                let _ = seen.send(Instant::now());
                future::ready(queue::Action::await_change())
            },
            |_| {},
            future::pending(),
        ));

        // The errors are taken before the run changes.
        tokio::time::sleep(Duration::from_millis(10)).await;
        let changed_at = Instant::now();
        changed.unbounded_send(run).unwrap();
        let started = reconciled.recv().await.expect("a reconcile");
        assert!(
            started - changed_at < Duration::from_millis(400),
            "the run's reconcile started {:?} after it changed",
            started - changed_at
        );
        let errors = metrics
            .watch_errors
            .get_or_create(&WatchLabel {
                watch: "approvals".into(),
            })
            .get();
        assert_eq!(errors, 6);
    }
}
