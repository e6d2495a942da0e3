//! The run's trace: OpenTelemetry spans exported over OTLP (HTTP/protobuf),
//! configured by the standard `OTEL_*` variables and off unless
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `…_TRACES_ENDPOINT`) is set.
//!
//! ```text
//!   run  (trace id and span id from the run UID; emitted when the run ends)
//!    ├─ attempt  step/planner/compactor, one per attempt (span id from UID, step,
//!    │   │       revision, attempt = the step Pod's TRACEPARENT parent)
//!    │   └─ call  each model or tool call the attempt journaled (D19), emitted
//!    │            with the attempt from the journal the cache holds
//!    ├─ compensation
//!    ├─ approval wait
//!    ├─ re-plan
//!    ├─ status write          each acknowledged (or refused) status write
//!    └─ reconcile             the controller's work (tracing spans, logs carry its ids)
//! ```
//!
//! Nothing is held open in memory: every span is emitted once, at its end,
//! with its start time taken from status, by the process whose status write
//! ended it ([`super::transitions`]). An attempt launched before an operator
//! crash and ended after it is one span with its true start; a restart
//! neither loses the parent (its id is derived, not stored) nor emits a span
//! twice (the write that ends it happens once).

use std::time::SystemTime;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue, global};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};

use super::ids;
use super::transitions::{self, AttemptOutcome, Transition};
use crate::api::{AgentRun, CallState, StepJournal};
use crate::engine::PodRole;

const TRACER: &str = "agentrun-operator";
/// The `tracing` target of the spans that go to OpenTelemetry too.
pub const TARGET: &str = "agentrun::trace";

/// Whether the environment asks for traces.
pub fn enabled_by_env() -> bool {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.trim() == "none");
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Builds the tracer provider from `OTEL_*` (endpoint, headers, timeout,
/// sampler, batch settings, resource attributes) and installs it globally;
/// `None` when traces are off.
pub fn init() -> Result<Option<SdkTracerProvider>, opentelemetry_otlp::ExporterBuildError> {
    use opentelemetry_otlp::WithExportConfig as _;
    if !enabled_by_env() {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()?;
    let mut resource = opentelemetry_sdk::Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(TRACER);
    }
    let provider = SdkTracerProvider::builder()
        .with_id_generator(DerivedIds::default())
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    global::set_tracer_provider(provider.clone());
    Ok(Some(provider))
}

thread_local! {
    /// The ids the next span started on this thread takes (see [`DerivedIds`]).
    static NEXT: std::cell::Cell<(Option<TraceId>, Option<SpanId>)> =
        const { std::cell::Cell::new((None, None)) };
}

/// The SDK takes every id from its generator: this one hands out the derived
/// ids [`emit`] puts in place for the one span it starts (synchronously, on
/// this thread), and random ids otherwise (the `reconcile` spans).
#[derive(Debug, Default)]
struct DerivedIds(RandomIdGenerator);

impl IdGenerator for DerivedIds {
    fn new_trace_id(&self) -> TraceId {
        let (trace, span) = NEXT.get();
        NEXT.set((None, span));
        trace.unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        let (trace, span) = NEXT.get();
        NEXT.set((trace, None));
        span.unwrap_or_else(|| self.0.new_span_id())
    }
}

/// Whether the run's trace is sampled: the configured sampler's decision
/// for its root span, a function of the trace id alone (`traceidratio`),
/// so every process decides alike.
fn sampled(trace_id: TraceId) -> bool {
    use opentelemetry_sdk::trace::SamplingDecision;
    static SAMPLER: std::sync::OnceLock<Box<dyn opentelemetry_sdk::trace::ShouldSample>> =
        std::sync::OnceLock::new();
    // The SDK's own reading of OTEL_TRACES_SAMPLER(_ARG), once.
    let sampler = SAMPLER.get_or_init(|| opentelemetry_sdk::trace::Config::default().sampler);
    let result = sampler.should_sample(None, trace_id, "run", &SpanKind::Internal, &[], &[]);
    matches!(result.decision, SamplingDecision::RecordAndSample)
}

/// A run's ids.
#[derive(Clone, Debug)]
pub struct RunTrace {
    pub uid: String,
    pub trace_id: TraceId,
    pub run_span: SpanId,
}

impl RunTrace {
    pub fn of(uid: &str) -> RunTrace {
        RunTrace {
            uid: uid.to_owned(),
            trace_id: TraceId::from_bytes(ids::trace_id(uid)),
            run_span: SpanId::from_bytes(ids::run_span_id(uid)),
        }
    }

    /// The run's root span as a (remote) parent: what every other span of the
    /// run hangs from, whichever process emits it.
    pub fn parent(&self) -> Context {
        self.child(self.run_span)
    }

    /// Span `span` of the run as a (remote) parent.
    fn child(&self, span: SpanId) -> Context {
        let flags = if sampled(self.trace_id) {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        Context::new().with_remote_span_context(SpanContext::new(
            self.trace_id,
            span,
            flags,
            true,
            TraceState::default(),
        ))
    }
}

/// One finished span.
struct Finished {
    name: &'static str,
    id: SpanId,
    /// `None`: the run's root.
    parent: Option<Context>,
    start: SystemTime,
    end: SystemTime,
    attributes: Vec<KeyValue>,
    error: Option<String>,
}

fn emit(run: &RunTrace, span: Finished) {
    let tracer = global::tracer(TRACER);
    let builder = tracer
        .span_builder(span.name)
        .with_kind(SpanKind::Internal)
        .with_start_time(span.start)
        .with_attributes(span.attributes);
    // A root takes the derived trace id too (a child inherits its parent's).
    NEXT.set((Some(run.trace_id), Some(span.id)));
    let cx = span.parent.unwrap_or_default();
    let mut s = builder.start_with_context(&tracer, &cx);
    NEXT.set((None, None));
    if let Some(message) = span.error {
        s.set_status(Status::error(message));
    }
    s.end_with_timestamp(span.end);
}

fn system(t: jiff::Timestamp) -> SystemTime {
    SystemTime::from(t)
}

fn run_attributes(run: &AgentRun) -> Vec<KeyValue> {
    vec![
        KeyValue::new(
            "agentrun.run",
            run.metadata.name.clone().unwrap_or_default(),
        ),
        KeyValue::new(
            "k8s.namespace.name",
            run.metadata.namespace.clone().unwrap_or_default(),
        ),
        KeyValue::new(
            "agentrun.run.uid",
            run.metadata.uid.clone().unwrap_or_default(),
        ),
    ]
}

/// Emits the spans that the acknowledged write from `old` to `new` ended;
/// `journals` are the run's journal chunks as the cache holds them (each
/// ended attempt's journaled calls become its children).
pub fn record(
    run: &AgentRun,
    new: &crate::api::AgentRunStatus,
    facts: &[Transition],
    journals: &[&StepJournal],
) {
    let Some(uid) = run.metadata.uid.as_deref() else {
        return;
    };
    let t = RunTrace::of(uid);
    for fact in facts {
        match fact {
            Transition::AttemptEnded(e) => {
                let mut attributes = vec![
                    KeyValue::new("agentrun.step", e.step.clone()),
                    KeyValue::new("agentrun.role", e.role.label()),
                    KeyValue::new("agentrun.plan_revision", e.plan_revision),
                    KeyValue::new("agentrun.attempt", i64::from(e.attempt)),
                    KeyValue::new("agentrun.idempotency_key", e.idempotency_key.clone()),
                    KeyValue::new("agentrun.outcome", e.outcome.as_str()),
                    KeyValue::new("agentrun.tokens", e.tokens),
                ];
                if let Some(effect) = e.effect {
                    attributes.push(KeyValue::new("agentrun.effect", format!("{effect:?}")));
                }
                if let Some(pod) = &e.pod {
                    attributes.push(KeyValue::new("k8s.pod.name", pod.clone()));
                }
                let error = match e.outcome {
                    AttemptOutcome::Failed => Some("the attempt failed".to_owned()),
                    AttemptOutcome::Disrupted => Some("the attempt was disrupted".to_owned()),
                    _ => None,
                };
                let id = SpanId::from_bytes(ids::attempt_span_id(
                    uid,
                    e.role.label(),
                    &e.step,
                    e.plan_revision,
                    e.attempt,
                ));
                if e.role == PodRole::Step {
                    calls(&t, run, id, e, journals);
                }
                emit(
                    &t,
                    Finished {
                        name: if e.role == PodRole::Compensate {
                            "compensation"
                        } else {
                            "attempt"
                        },
                        id,
                        parent: Some(t.parent()),
                        start: system(e.started),
                        end: system(e.ended),
                        attributes,
                        error,
                    },
                );
            }
            Transition::ApprovalWaitEnded(w) => emit(
                &t,
                Finished {
                    name: "approval wait",
                    id: SpanId::from_bytes(ids::approval_span_id(uid, &w.approval)),
                    parent: Some(t.parent()),
                    start: system(w.started),
                    end: system(w.ended),
                    attributes: vec![
                        KeyValue::new("agentrun.step", w.step.clone()),
                        KeyValue::new("agentrun.plan_revision", w.plan_revision),
                        KeyValue::new("agentrun.approval", w.approval.clone()),
                        KeyValue::new("agentrun.step.then", format!("{:?}", w.then)),
                    ],
                    error: None,
                },
            ),
            Transition::Replanned {
                revision,
                reason,
                at,
            } => emit(
                &t,
                Finished {
                    name: "re-plan",
                    id: SpanId::from_bytes(ids::replan_span_id(uid, *revision)),
                    parent: Some(t.parent()),
                    start: system(*at),
                    end: system(*at),
                    attributes: vec![
                        KeyValue::new("agentrun.plan_revision", *revision),
                        KeyValue::new("agentrun.replan.reason", reason.clone()),
                    ],
                    error: None,
                },
            ),
            Transition::RunEnded {
                phase,
                started,
                ended,
            } => {
                let mut attributes = run_attributes(run);
                attributes.push(KeyValue::new("agentrun.phase", format!("{phase:?}")));
                attributes.push(KeyValue::new("agentrun.tokens_used", new.tokens_used));
                attributes.push(KeyValue::new(
                    "agentrun.step_executions",
                    i64::from(new.step_executions),
                ));
                let start = started
                    .or(run.metadata.creation_timestamp.as_ref().map(|t| t.0))
                    .unwrap_or(*ended);
                emit(
                    &t,
                    Finished {
                        name: "run",
                        id: t.run_span,
                        parent: None,
                        start: system(start),
                        end: system(*ended),
                        attributes,
                        error: (*phase != crate::api::RunPhase::Succeeded)
                            .then(|| format!("the run ended {phase:?}")),
                    },
                );
            }
        }
    }
}

/// One span per call attempt `e` journaled, as a child of its span: what
/// was asked (model or tool, its name and effect), how it ended, its
/// tokens. Calls the attempt replayed were not made again and get none; a
/// call the cache has not caught up with when the attempt ends gets none
/// either (no span is ever emitted twice, one may be missing).
fn calls(
    t: &RunTrace,
    run: &AgentRun,
    attempt: SpanId,
    e: &transitions::AttemptEnded,
    journals: &[&StepJournal],
) {
    if journals.is_empty() {
        return;
    }
    let prefix = crate::engine::journal_prefix(
        run.metadata.name.as_deref().unwrap_or_default(),
        &t.uid,
        &e.step,
        e.plan_revision,
    );
    let parent = t.child(attempt);
    let made = journals
        .iter()
        .filter(|j| {
            j.spec.run_uid == t.uid
                && j.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(&prefix))
        })
        .flat_map(|j| j.spec.entries.iter())
        .filter(|c| c.attempt == e.attempt);
    for c in made {
        let start = c.started_at.as_ref().map_or(e.started, |s| s.0);
        let end = c.finished_at.as_ref().map_or(e.ended, |s| s.0).max(start);
        let mut attributes = vec![
            KeyValue::new("agentrun.step", e.step.clone()),
            KeyValue::new("agentrun.call.seq", c.seq),
            KeyValue::new("agentrun.call.id", c.call_id.clone()),
            KeyValue::new("agentrun.call.kind", format!("{:?}", c.kind)),
            KeyValue::new("agentrun.call.state", format!("{:?}", c.state)),
        ];
        if let Some(n) = &c.name {
            attributes.push(KeyValue::new("agentrun.call.name", n.clone()));
        }
        if let Some(effect) = c.effect {
            attributes.push(KeyValue::new("agentrun.call.effect", format!("{effect:?}")));
        }
        if let Some(k) = &c.key {
            attributes.push(KeyValue::new("agentrun.call.key", k.clone()));
        }
        if let Some(tk) = c.tokens {
            // The OpenTelemetry GenAI conventions' names.
            attributes.push(KeyValue::new("gen_ai.usage.input_tokens", tk.input));
            attributes.push(KeyValue::new("gen_ai.usage.output_tokens", tk.output));
        }
        let error = match c.state {
            CallState::Intent => Some("the call started and was never answered".to_owned()),
            CallState::NotApplied => Some(
                c.error
                    .clone()
                    .unwrap_or_else(|| "the tool did not act".to_owned()),
            ),
            CallState::Done => c.error.clone(),
        };
        emit(
            t,
            Finished {
                name: "call",
                id: SpanId::from_bytes(ids::call_span_id(
                    &t.uid,
                    &e.step,
                    e.plan_revision,
                    c.seq,
                    e.attempt,
                )),
                parent: Some(parent.clone()),
                start: system(start),
                end: system(end),
                attributes,
                error,
            },
        );
    }
}

/// A status write of the run, as a child of the run's span.
pub fn status_write(
    run: &AgentRun,
    start: SystemTime,
    end: SystemTime,
    result: &str,
    committed: usize,
) {
    let Some(uid) = run.metadata.uid.as_deref() else {
        return;
    };
    let t = RunTrace::of(uid);
    emit(
        &t,
        Finished {
            name: "status write",
            id: SpanId::from_bytes(random_span_id()),
            parent: Some(t.parent()),
            start,
            end,
            attributes: vec![
                KeyValue::new("agentrun.write.result", result.to_owned()),
                KeyValue::new(
                    "agentrun.write.resource_version",
                    run.metadata.resource_version.clone().unwrap_or_default(),
                ),
                KeyValue::new("agentrun.write.outcomes_committed", committed as i64),
            ],
            error: (result != "ok").then(|| format!("status write: {result}")),
        },
    );
}

/// A fresh span id for spans that are emitted once and never referred to.
fn random_span_id() -> [u8; 8] {
    RandomIdGenerator::default().new_span_id().to_bytes()
}

/// Makes `span` (a `tracing` span of target [`TARGET`]) a child of the run's
/// span, and records `trace_id` and `span_id` on it for the logs.
pub fn adopt(span: &tracing::Span, uid: &str) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let t = RunTrace::of(uid);
    let _ = span.set_parent(t.parent());
    span.record("trace_id", tracing::field::display(t.trace_id));
    let id = span.context().span().span_context().span_id();
    let id = if id == SpanId::INVALID {
        t.run_span
    } else {
        id
    };
    span.record("span_id", tracing::field::display(id));
}

#[cfg(test)]
mod tests;
