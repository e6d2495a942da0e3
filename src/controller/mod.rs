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
mod context;
mod decide;
mod error;
mod events;
mod expectations;
mod failpoints;
mod history;
mod index;
mod orphans;
mod owned;
mod patch;
mod queue;
mod reconcile;
mod relist;
mod resume;
mod status_write;
mod step_pod;
mod world;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt, TryStreamExt, future};
use kube::core::DeserializeGuard;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{info, warn};

use crate::api::{AgentRun, Approval, Signal, StepJournal};
use crate::labels;
use crate::metrics::{Health, Metrics, NamespaceLabel, PhaseLabel, Refresh, WatchLabel};
use relist::CachedObjects;

use context::{
    CONCURRENT_RECONCILES, SYNCED_ALL, SYNCED_APPROVALS, SYNCED_JOURNALS, SYNCED_PODS, SYNCED_RUNS,
    SYNCED_SIGNALS, api_for,
};
pub use context::{Context, DEFAULT_JOURNAL_WRITER_ROLE, Leader, Scope};
pub use error::{Category, Error, Result};

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
    let journals_api: Api<StepJournal> = api_for(&client, &scope);

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

    let (journals, journals_writer) = reflector::store();
    let journal_index = index::JournalIndex::default();
    let journal_stream = watcher(journals_api, watcher::Config::default())
        .default_backoff()
        .modify(|j: &mut StepJournal| j.managed_fields_mut().clear())
        .reflect(journals_writer)
        .inspect_ok({
            let journal_index = journal_index.clone();
            let metrics = metrics.clone();
            move |event| {
                if matches!(event, watcher::Event::Apply(_)) {
                    metrics.journal_writes.inc();
                }
                journal_index.apply(event)
            }
        })
        .inspect_ok(mark_synced(synced_tx.clone(), SYNCED_JOURNALS))
        .cached_objects(journals.clone());

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
        journals,
        journal_index,
        journal_writers: Mutex::default(),
        journal_writer_role: scope.journal_writer_role.clone(),
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
        journal_stream,
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
    journals: impl Stream<Item = Result<Arc<StepJournal>, watcher::Error>> + Send + 'static,
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
    let journals = journals
        .filter_map(retried_by_its_watch("stepjournals", metrics.clone()))
        .filter_map(|chunk: Arc<StepJournal>| {
            future::ready(
                chunk
                    .namespace()
                    .map(|ns| ObjectRef::new(&chunk.spec.run_name).within(&ns)),
            )
        })
        .boxed();
    futures::stream::select_all([runs, pods, approvals, signals, journals])
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
