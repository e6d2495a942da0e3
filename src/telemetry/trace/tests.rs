use super::*;
use crate::telemetry::transitions::{ApprovalWait, AttemptEnded};
use opentelemetry_sdk::trace::InMemorySpanExporter;

fn at(s: i64) -> jiff::Timestamp {
    jiff::Timestamp::from_second(1_800_000_000 + s).unwrap()
}

/// The tests install the global tracer provider: one at a time.
static GLOBAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A provider with the derived ids that keeps the spans in memory,
/// installed globally for as long as the guard is held.
fn capture() -> (
    std::sync::MutexGuard<'static, ()>,
    InMemorySpanExporter,
    SdkTracerProvider,
) {
    let one = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_id_generator(DerivedIds::default())
        .with_simple_exporter(exporter.clone())
        .build();
    global::set_tracer_provider(provider.clone());
    (one, exporter, provider)
}

/// The spans carry the derived ids whichever process emits them: an
/// attempt's span id is the one its Pod's TRACEPARENT names, and every
/// span hangs from the run's root.
#[test]
fn spans_take_the_ids_derived_from_the_run() {
    let (_one, exporter, provider) = capture();

    let mut run = AgentRun::new("r", Default::default());
    run.metadata.uid = Some("uid-1".into());
    run.metadata.namespace = Some("team-a".into());
    let facts = [
        Transition::AttemptEnded(AttemptEnded {
            role: PodRole::Step,
            step: "fetch".into(),
            plan_revision: 1,
            attempt: 2,
            idempotency_key: "k".into(),
            pod: Some("r-fetch-a2".into()),
            outcome: AttemptOutcome::Succeeded,
            effect: None,
            tokens: 9,
            started: at(10),
            ended: at(20),
        }),
        Transition::ApprovalWaitEnded(ApprovalWait {
            step: "deploy".into(),
            plan_revision: 1,
            approval: "r-deploy-approve".into(),
            then: crate::api::StepPhase::Running,
            started: at(20),
            ended: at(80),
        }),
        Transition::RunEnded {
            phase: crate::api::RunPhase::Succeeded,
            started: Some(at(0)),
            ended: at(90),
        },
    ];
    record(&run, &Default::default(), &facts, &[]);
    status_write(&run, at(85).into(), at(86).into(), "ok", 2);
    let _ = provider.force_flush();
    let spans = exporter.get_finished_spans().unwrap();
    let _ = provider.shutdown();

    // Independent of the code under test: python3,
    // hashlib.sha256(b"agentrun.dev/trace\x00uid-1").hexdigest()[:32] and
    // hashlib.sha256(b"agentrun.dev/run\x00uid-1").hexdigest()[:16].
    let trace = "63b736e5361b16f7721555f3fbb52da3";
    let root = "4c2c721a6c3ebdb9";
    assert_eq!(spans.len(), 4, "{spans:#?}");
    for s in &spans {
        assert_eq!(s.span_context.trace_id().to_string(), trace, "{}", s.name);
    }
    let named = |n: &str| spans.iter().find(|s| s.name == n).unwrap();
    let run_span = named("run");
    assert_eq!(run_span.span_context.span_id().to_string(), root);
    assert_eq!(run_span.parent_span_id, SpanId::INVALID);
    assert_eq!(run_span.start_time, SystemTime::from(at(0)));
    let attempt = named("attempt");
    assert_eq!(
        attempt.span_context.span_id().to_string(),
        ids::hex(&ids::attempt_span_id("uid-1", "step", "fetch", 1, 2))
    );
    assert_eq!(
        crate::telemetry::ids::attempt_traceparent("uid-1", "step", "fetch", 1, 2),
        format!("00-{trace}-{}-01", attempt.span_context.span_id())
    );
    assert_eq!(
        (attempt.start_time, attempt.end_time),
        (at(10).into(), at(20).into())
    );
    for n in ["attempt", "approval wait", "status write"] {
        assert_eq!(
            named(n).parent_span_id.to_string(),
            root,
            "{n} hangs from the run"
        );
    }
}

/// Each call an attempt journaled is a child of its attempt's span,
/// with what was asked and how it ended; calls of another attempt (a
/// replay makes none) and of another run are not its.
#[test]
fn an_attempts_journaled_calls_are_its_children() {
    use crate::api::{CallKind, CallTokens, Effect, JournalEntry, StepJournalSpec};
    let (_one, exporter, provider) = capture();

    let mut run = AgentRun::new("r", Default::default());
    run.metadata.uid = Some("uid-1".into());
    let entry = |seq: i64, kind: CallKind, state: CallState, attempt: i32| JournalEntry {
        seq,
        call_id: format!("call_{seq}"),
        kind,
        request_digest: "d".into(),
        effect: (kind == CallKind::Tool).then_some(Effect::NonIdempotent),
        key: (kind == CallKind::Tool).then(|| format!("key-{seq}")),
        name: Some(
            if kind == CallKind::Tool {
                "issue_refund"
            } else {
                "gpt"
            }
            .into(),
        ),
        state,
        attempt,
        response: None,
        error: None,
        tokens: (kind == CallKind::Model).then_some(CallTokens {
            input: 300,
            output: 40,
            cached: 0,
        }),
        started_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(12))),
        finished_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(13))),
    };
    let chunk = |run_uid: &str| {
        StepJournal::new(
            &format!(
                "{}0",
                crate::engine::journal_prefix("r", "uid-1", "refund", 1)
            ),
            StepJournalSpec {
                run_name: "r".into(),
                run_uid: run_uid.into(),
                step: "refund".into(),
                plan_revision: 1,
                chunk: 0,
                first_seq: 0,
                attempt: 2,
                sealed: false,
                entries: vec![
                    entry(0, CallKind::Model, CallState::Done, 1),
                    entry(1, CallKind::Model, CallState::Done, 2),
                    entry(2, CallKind::Tool, CallState::Intent, 2),
                ],
            },
        )
    };
    let (ours, theirs) = (chunk("uid-1"), chunk("uid-2"));
    let facts = [Transition::AttemptEnded(AttemptEnded {
        role: PodRole::Step,
        step: "refund".into(),
        plan_revision: 1,
        attempt: 2,
        idempotency_key: "k".into(),
        pod: None,
        outcome: AttemptOutcome::Disrupted,
        effect: None,
        tokens: 0,
        started: at(10),
        ended: at(20),
    })];
    record(&run, &Default::default(), &facts, &[&ours, &theirs]);
    let _ = provider.force_flush();
    let spans = exporter.get_finished_spans().unwrap();
    let _ = provider.shutdown();

    let calls: Vec<_> = spans.iter().filter(|s| s.name == "call").collect();
    assert_eq!(calls.len(), 2, "attempt 2's calls, once each: {calls:#?}");
    let attempt = ids::attempt_span_id("uid-1", "step", "refund", 1, 2);
    for c in &calls {
        assert_eq!(
            c.parent_span_id.to_bytes(),
            attempt,
            "a child of its attempt"
        );
        assert_eq!((c.start_time, c.end_time), (at(12).into(), at(13).into()));
    }
    let attr = |s: &opentelemetry_sdk::trace::SpanData, k: &str| {
        s.attributes
            .iter()
            .find(|a| a.key.as_str() == k)
            .map(|a| a.value.to_string())
    };
    let model = calls[0];
    assert_eq!(
        model.span_context.span_id().to_bytes(),
        ids::call_span_id("uid-1", "refund", 1, 1, 2)
    );
    assert_eq!(
        attr(model, "gen_ai.usage.input_tokens").as_deref(),
        Some("300")
    );
    assert_eq!(model.status, Status::Unset);
    let tool = calls[1];
    assert_eq!(
        attr(tool, "agentrun.call.name").as_deref(),
        Some("issue_refund")
    );
    assert_eq!(
        attr(tool, "agentrun.call.effect").as_deref(),
        Some("NonIdempotent")
    );
    assert_eq!(attr(tool, "agentrun.call.key").as_deref(), Some("key-2"));
    assert_eq!(
        tool.status,
        Status::error("the call started and was never answered")
    );
}
