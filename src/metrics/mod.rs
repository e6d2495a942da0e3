//! What the operator tells Prometheus (`/metrics`) and the kubelet
//! (`/healthz`, `/readyz`), served on two ports of their own.
//!
//! Counters move where the controller acts, from what the engine decided (the
//! decision's [`Tally`]) once the status write holding it is acknowledged;
//! histograms of durations come from the same write (the facts of
//! [`crate::telemetry::transitions`], timed from status); gauges of runs by
//! phase and pending approvals are computed from the caches at scrape time, so
//! they can never drift from what the operator sees. No label carries a run,
//! step or Pod name: every label has a small, fixed set of values (namespaces
//! are as many as the cluster has).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::engine::Tally;
use crate::telemetry::transitions::Transition;

/// Label set `{category="…"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabel {
    pub category: String,
}

/// Label set `{phase="…"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: String,
}

/// Label set `{namespace="…"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NamespaceLabel {
    pub namespace: String,
}

/// Label set `{role="…", outcome="…"}` of an attempt.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    /// `step`, `planner`, `compactor` or `compensate`.
    pub role: String,
    /// `Succeeded`, `Failed`, `Disrupted` or `Stopped`.
    pub outcome: String,
}

/// Label set `{outcome="…"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

/// Label set `{result="…"}` of a status write: `ok`, `conflict` or `error`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

/// Label set `{kind="…"}` of the work held behind the first round after a
/// start: `release` (a result finalizer) or `event` (a routine Event).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

/// A notification delivery attempt: the channel and what came of it
/// (`delivered`, `retry`, `failed`, `refused`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NotificationLabels {
    pub channel: String,
    pub outcome: String,
}

/// A notification channel.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChannelLabel {
    pub channel: String,
}

/// A watch of the run controller: `agentruns`, `pods` or `approvals`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchLabel {
    pub watch: String,
}

/// Label set of `agentrun_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Seconds, 10 ms to about 3 h: an event to its notification's delivery,
/// retries included.
fn notification_latencies() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.5, 14))
}

/// Seconds, 0.5 s to about 9 h: steps, approval waits and runs.
fn long_durations() -> Histogram {
    Histogram::new(exponential_buckets(0.5, 2.0, 16))
}

/// Every metric the operator exports.
pub struct Metrics {
    pub reconcile_duration: Histogram,
    pub reconcile_errors: Family<CategoryLabel, Counter>,
    pub steps_started: Counter,
    pub steps_succeeded: Counter,
    pub steps_failed: Counter,
    pub steps_disrupted: Counter,
    pub checkpoint_write_duration: Histogram,
    pub status_conflicts: Counter,
    pub replans: Counter,
    /// Journal chunk writes the operator saw (each a step's append, D19).
    pub journal_writes: Counter,
    /// Journaled calls found started and never answered.
    pub journal_unknown_calls: Counter,
    /// Journaled calls settled by a verify probe or a person.
    pub journal_settled_calls: Counter,
    /// Steps failed because their journal passed its cap.
    pub journal_over_cap: Counter,
    pub tokens: Family<NamespaceLabel, Counter>,
    pub duplicate_creates_suppressed: Counter,
    /// Finished runs whose record was stored (D18).
    pub history_records: Counter,
    /// Reads or writes of the run history that failed.
    pub history_errors: Counter,
    /// Per namespace, the records inside the retention beyond
    /// `--history-max-per-namespace`, as the last pruning counted them:
    /// kept (D22), reported.
    pub history_over_cap: Family<NamespaceLabel, Gauge>,
    pub status_writes: Family<ResultLabel, Counter>,
    /// Finalizer releases and routine Events held until the first round
    /// after a start was over (`controller::resume`).
    pub held_behind_starts: Family<KindLabel, Counter>,
    pub step_duration: HistogramFamily<AttemptLabels>,
    pub handoff_latency: Histogram,
    pub approval_wait: Histogram,
    pub run_duration: HistogramFamily<OutcomeLabel>,
    pub workqueue_depth: Gauge,
    pub reconciles_in_flight: Gauge,
    pub runs_by_phase: Family<PhaseLabel, Gauge>,
    pub approvals_pending: Gauge,
    pub approval_expiry: Family<NamespaceLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub runs_stalled: Family<NamespaceLabel, Gauge>,
    pub progress_age: Family<NamespaceLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub leader: Gauge,
    pub notifications: Family<NotificationLabels, Counter>,
    pub notification_latency: HistogramFamily<ChannelLabel>,
    pub watch_errors: Family<WatchLabel, Counter>,
    /// Sets the cache-derived gauges; installed by the controller once its caches exist.
    refresh: std::sync::Mutex<Option<Refresh>>,
}

impl Metrics {
    /// Creates the metrics and registers them under the `agentrun_` prefix.
    pub fn register(registry: &mut Registry) -> Arc<Self> {
        let m = Metrics {
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            reconcile_errors: Family::default(),
            steps_started: Counter::default(),
            steps_succeeded: Counter::default(),
            steps_failed: Counter::default(),
            steps_disrupted: Counter::default(),
            checkpoint_write_duration: Histogram::new(exponential_buckets(0.001, 2.0, 12)),
            status_conflicts: Counter::default(),
            replans: Counter::default(),
            journal_writes: Counter::default(),
            journal_unknown_calls: Counter::default(),
            journal_settled_calls: Counter::default(),
            journal_over_cap: Counter::default(),
            tokens: Family::default(),
            duplicate_creates_suppressed: Counter::default(),
            history_records: Counter::default(),
            history_errors: Counter::default(),
            history_over_cap: Family::default(),
            status_writes: Family::default(),
            held_behind_starts: Family::default(),
            step_duration: Family::new_with_constructor(long_durations),
            handoff_latency: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            approval_wait: long_durations(),
            run_duration: Family::new_with_constructor(long_durations),
            workqueue_depth: Gauge::default(),
            reconciles_in_flight: Gauge::default(),
            runs_by_phase: Family::default(),
            approvals_pending: Gauge::default(),
            approval_expiry: Family::default(),
            runs_stalled: Family::default(),
            progress_age: Family::default(),
            leader: Gauge::default(),
            notifications: Family::default(),
            notification_latency: Family::new_with_constructor(notification_latencies),
            watch_errors: Family::default(),
            refresh: std::sync::Mutex::new(None),
        };
        let r = registry.sub_registry_with_prefix("agentrun");
        r.register(
            "reconcile_duration_seconds",
            "Time of one reconcile",
            m.reconcile_duration.clone(),
        );
        r.register(
            "reconcile_errors",
            "Failed reconciles by error category",
            m.reconcile_errors.clone(),
        );
        r.register(
            "steps_started",
            "Step, planner, compactor and compensation attempts launched",
            m.steps_started.clone(),
        );
        r.register(
            "steps_succeeded",
            "Step attempts whose success was committed",
            m.steps_succeeded.clone(),
        );
        r.register(
            "steps_failed",
            "Step attempts that failed (exit code, timeout, bad result)",
            m.steps_failed.clone(),
        );
        r.register(
            "steps_disrupted",
            "Step attempts lost to eviction, preemption or deletion",
            m.steps_disrupted.clone(),
        );
        r.register(
            "checkpoint_write_duration_seconds",
            "Latency of the resourceVersion-guarded status write",
            m.checkpoint_write_duration.clone(),
        );
        r.register(
            "status_conflicts",
            "Status writes refused with 409 (stale view)",
            m.status_conflicts.clone(),
        );
        r.register(
            "replans",
            "Plan revisions created after a stale input",
            m.replans.clone(),
        );
        r.register(
            "journal_writes",
            "Step journal chunk writes seen (appends by step Pods, D19)",
            m.journal_writes.clone(),
        );
        r.register(
            "journal_unknown_calls",
            "Journaled calls found started and never answered (they may have acted)",
            m.journal_unknown_calls.clone(),
        );
        r.register(
            "journal_settled_calls",
            "Journaled calls that may have acted, settled by a verify probe or a person",
            m.journal_settled_calls.clone(),
        );
        r.register(
            "journal_over_cap",
            "Steps failed because their journal passed journal.maxBytes",
            m.journal_over_cap.clone(),
        );
        r.register(
            "tokens",
            "Tokens reported by step attempts, failed ones included (D9), by namespace",
            m.tokens.clone(),
        );
        r.register(
            "notifications",
            "Approval notification delivery attempts by channel and outcome (delivered, retry, failed, refused)",
            m.notifications.clone(),
        );
        r.register(
            "notification_latency_seconds",
            "Time from an approval event (asked, escalated, decided, expired) to its notification's delivery",
            m.notification_latency.clone(),
        );
        r.register(
            "watch_errors",
            "Errors of the controller's watches (agentruns, pods, approvals); each watch relists or resumes after its own backoff",
            m.watch_errors.clone(),
        );
        r.register(
            "build",
            "The operator's version",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
            }),
        );
        r.register(
            "held_behind_starts",
            "Finalizer releases and routine Events held until every run found at a start had been reconciled once, by kind",
            m.held_behind_starts.clone(),
        );
        r.register(
            "status_writes",
            "Run status writes by result: ok, conflict (409, re-decided) or error",
            m.status_writes.clone(),
        );
        r.register(
            "step_duration_seconds",
            "One attempt, from its launch to the checkpoint of its outcome, by role and outcome",
            m.step_duration.clone(),
        );
        r.register(
            "handoff_latency_seconds",
            "From a committed step outcome to the API server's acknowledgement of the next step's Pod",
            m.handoff_latency.clone(),
        );
        r.register(
            "approval_wait_seconds",
            "A step's wait for a person, from the request to the decision seen by the operator",
            m.approval_wait.clone(),
        );
        r.register(
            "run_duration_seconds",
            "A run from its start to its end, by outcome (Succeeded, Failed, Cancelled)",
            m.run_duration.clone(),
        );
        r.register(
            "workqueue_depth",
            "Runs due for a reconcile and waiting in line for one of the concurrent reconcile slots",
            m.workqueue_depth.clone(),
        );
        r.register(
            "reconciles_in_flight",
            "Reconciles holding a slot",
            m.reconciles_in_flight.clone(),
        );
        r.register(
            "duplicate_creates_suppressed",
            "Creates that found the object already there (ours): no duplicate was made",
            m.duplicate_creates_suppressed.clone(),
        );
        r.register(
            "history_records",
            "Finished runs whose record was stored (RunRecord or PostgreSQL)",
            m.history_records.clone(),
        );
        r.register(
            "history_errors",
            "Reads or writes of the run history that failed",
            m.history_errors.clone(),
        );
        r.register(
            "history_records_over_cap",
            "Run records inside the retention beyond --history-max-per-namespace, by namespace, at the last pruning: kept, never pruned early",
            m.history_over_cap.clone(),
        );
        r.register(
            "runs",
            "AgentRuns by phase, as cached",
            m.runs_by_phase.clone(),
        );
        r.register(
            "approvals_pending",
            "Approvals waiting for a decision",
            m.approvals_pending.clone(),
        );
        r.register(
            "approval_expiry_soonest_seconds",
            "Seconds until the first pending Approval with an expiry expires, by namespace (negative: overdue)",
            m.approval_expiry.clone(),
        );
        r.register(
            "runs_stalled",
            "Runs whose Stalled condition is True (they cannot progress by themselves), by namespace",
            m.runs_stalled.clone(),
        );
        r.register(
            "run_progress_age_seconds_max",
            "Among active runs (not finished, not waiting for a person, not suspended), the longest time since one made progress (a step launched or ended), by namespace",
            m.progress_age.clone(),
        );
        r.register(
            "leader",
            "1 while this instance holds the leader lease",
            m.leader.clone(),
        );
        Arc::new(m)
    }

    /// Counts what one decision did; called once its status write (if any)
    /// is acknowledged, so a decision dropped on a conflict counts nothing.
    pub fn count(&self, namespace: &str, tally: &Tally) {
        self.steps_started.inc_by(tally.started);
        self.steps_succeeded.inc_by(tally.succeeded);
        self.steps_failed.inc_by(tally.failed);
        self.steps_disrupted.inc_by(tally.disrupted);
        self.replans.inc_by(tally.replans);
        self.journal_unknown_calls.inc_by(tally.calls_unknown);
        self.journal_settled_calls.inc_by(tally.calls_settled);
        self.journal_over_cap.inc_by(tally.journals_over_cap);
        if tally.tokens > 0 {
            self.tokens
                .get_or_create(&NamespaceLabel {
                    namespace: namespace.to_owned(),
                })
                .inc_by(tally.tokens);
        }
    }

    /// Observes the durations a committed write ended.
    pub fn observe(&self, transitions: &[Transition]) {
        for t in transitions {
            match t {
                Transition::AttemptEnded(e) => self
                    .step_duration
                    .get_or_create(&AttemptLabels {
                        role: e.role.label().to_owned(),
                        outcome: e.outcome.as_str().to_owned(),
                    })
                    .observe(seconds(e.started, e.ended)),
                Transition::ApprovalWaitEnded(w) => {
                    self.approval_wait.observe(seconds(w.started, w.ended))
                }
                Transition::RunEnded {
                    phase,
                    started: Some(started),
                    ended,
                } => self
                    .run_duration
                    .get_or_create(&OutcomeLabel {
                        outcome: format!("{phase:?}"),
                    })
                    .observe(seconds(*started, *ended)),
                Transition::RunEnded { started: None, .. } | Transition::Replanned { .. } => {}
            }
        }
    }

    /// A status write's result.
    pub fn status_write(&self, result: &'static str) {
        self.status_writes
            .get_or_create(&ResultLabel {
                result: result.to_owned(),
            })
            .inc();
    }

    /// Work held behind the first round after a start.
    pub fn held_behind_starts(&self, kind: &str, n: usize) {
        self.held_behind_starts
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .inc_by(n as u64);
    }

    /// Counts a reconcile holding a slot until the guard is dropped.
    pub fn in_flight(self: &Arc<Self>) -> GaugeGuard {
        GaugeGuard::new(self.reconciles_in_flight.clone())
    }

    /// Installs the function that computes the cache-derived gauges.
    pub fn set_refresh(&self, refresh: Refresh) {
        *self.refresh.lock().unwrap_or_else(|e| e.into_inner()) = Some(refresh);
    }

    fn refresh(&self) {
        let refresh = self
            .refresh
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(refresh) = refresh {
            refresh();
        }
    }
}

/// Seconds from `a` to `b`, never negative (clocks of two writers may differ).
fn seconds(a: jiff::Timestamp, b: jiff::Timestamp) -> f64 {
    b.duration_since(a).as_secs_f64().max(0.0)
}

/// Holds one unit of a gauge; gives it back when dropped (a reconcile
/// cancelled while it waits counts down too).
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    fn new(gauge: Gauge) -> Self {
        gauge.inc();
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Computes the gauges that come from the caches, just before a scrape.
pub type Refresh = Arc<dyn Fn() + Send + Sync>;

#[derive(Clone)]
struct MetricsState {
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
}

async fn metrics_handler(State(state): State<MetricsState>) -> impl IntoResponse {
    state.metrics.refresh();
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "encoding metrics failed".to_owned(),
        ),
    }
}

/// Serves `/metrics` on `listener` until the process ends.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: Registry,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    let state = MetricsState {
        registry: Arc::new(registry),
        metrics,
    };
    let app = axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .with_state(state);
    axum::serve(listener, app).await
}

/// Liveness and readiness. Ready once the caches are synced (or while this
/// instance stands by for the lease: a standby is healthy, just not leading).
#[derive(Clone, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}

/// Serves `/healthz` and `/readyz` on `listener` until the process ends.
pub async fn serve_health(
    listener: tokio::net::TcpListener,
    health: Health,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(h): State<Health>| async move {
                if h.is_ready() {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "caches not synced")
                }
            }),
        )
        .with_state(health);
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests;
