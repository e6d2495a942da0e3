//! What the operator tells Prometheus (`/metrics`) and the kubelet
//! (`/healthz`, `/readyz`), served on two ports of their own.
//!
//! Counters move where the controller acts; gauges of runs by phase and
//! pending approvals are computed from the caches at scrape time, so they can
//! never drift from what the operator sees.

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
use prometheus_client::registry::Registry;

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
    pub tokens: Counter,
    pub duplicate_creates_suppressed: Counter,
    pub runs_by_phase: Family<PhaseLabel, Gauge>,
    pub approvals_pending: Gauge,
    pub leader: Gauge,
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
            tokens: Counter::default(),
            duplicate_creates_suppressed: Counter::default(),
            runs_by_phase: Family::default(),
            approvals_pending: Gauge::default(),
            leader: Gauge::default(),
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
            "tokens",
            "Tokens reported by step attempts, failed ones included (D9)",
            m.tokens.clone(),
        );
        r.register(
            "duplicate_creates_suppressed",
            "Creates that found the object already there (ours): no duplicate was made",
            m.duplicate_creates_suppressed.clone(),
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
            "leader",
            "1 while this instance holds the leader lease",
            m.leader.clone(),
        );
        Arc::new(m)
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
