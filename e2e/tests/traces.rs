//! A run's trace in a real Jaeger: one trace per run, whose span tree holds
//! every attempt (a retry included), the approval wait and the run itself,
//! across an operator SIGKILL in the middle; no span's parent is missing; and
//! each step Pod's TRACEPARENT names its attempt's span.
//!
//! ```text
//!   Scenario (plane, simkubelet, operator with OTEL_EXPORTER_OTLP_ENDPOINT)
//!     run: fetch (fails once, retried) ─▶ deploy (approval; operator SIGKILLed while it waits)
//!     Jaeger ◀── spans        test ──GET /api/traces/<trace id>──▶ Jaeger
//! ```
//!
//! Needs the plane and `e2e/cluster jaeger` (`make test`); fails when either is missing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use agentrun_e2e::support::jaeger::Jaeger;
use agentrun_e2e::support::scenario::{Scenario, sim_step, status};
use agentrun_operator::api::{RunPhase, StepPhase};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(60);

fn tag<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["tags"]
        .as_array()?
        .iter()
        .find(|t| t["key"] == key)
        .map(|t| &t["value"])
}

fn parent(span: &Value) -> Option<String> {
    span["references"]
        .as_array()?
        .iter()
        .find(|r| r["refType"] == "CHILD_OF")
        .and_then(|r| r["spanID"].as_str())
        .map(str::to_owned)
}

fn traceparent(pod: &Pod) -> String {
    pod.spec.as_ref().unwrap().containers[0]
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "TRACEPARENT")
        .and_then(|e| e.value.clone())
        .expect("the step Pod has a TRACEPARENT")
}

#[tokio::test]
async fn a_run_is_one_trace_across_a_retry_an_approval_and_an_operator_kill() {
    let mut s = Scenario::start_without_operator("traces").await;
    let jaeger = Jaeger::start(s.namespace()).await;
    s.operator_config.extra_env = vec![
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
            jaeger.otlp_endpoint.clone(),
        ),
        // Batches go out fast, so a SIGKILL while the run waits loses nothing.
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
        ("OTEL_SERVICE_NAME".into(), "agentrun-operator".into()),
        ("AGENTRUN_LOG_FORMAT".into(), "json".into()),
    ];
    s.start_operator(None);

    let mut fetch = sim_step(
        "fetch",
        "Idempotent",
        json!({"attempts": [{"exitCode": 1, "runMs": 50}, {"exitCode": 0, "runMs": 50}]}),
    );
    fetch["retry"] = json!({"limit": 2, "backoff": {"initial": "1s", "max": "1s"}});
    let mut deploy = sim_step("deploy", "Idempotent", json!({"runMs": 50}));
    deploy["approval"] = json!({"required": true, "question": "Deploy?"});
    let run = s
        .create_run("traced", json!({"steps": [fetch, deploy]}))
        .await;
    let uid = run.metadata.uid.clone().unwrap();

    // Waiting for a person, with the wait's span open in status only.
    let waiting = s
        .wait_run("traced", "waiting for approval", RUN_TIMEOUT, |r| {
            status(r).phase == Some(RunPhase::WaitingForApproval)
        })
        .await;
    let approval = status(&waiting)
        .steps
        .iter()
        .find(|c| c.name == "deploy")
        .and_then(|c| c.approval.clone())
        .expect("deploy waits on an Approval");
    tokio::time::sleep(Duration::from_millis(1500)).await; // one batch out
    // Both instances append to one log (same identity): what the first
    // wrote ends where the kill leaves it.
    let log_path = s.operator.as_ref().unwrap().log_path().to_owned();
    s.kill_operator().await;
    let killed_at = jiff::Timestamp::now();
    let first_instance_bytes = std::fs::metadata(&log_path).map_or(0, |m| m.len()) as usize;
    // The operator's clock is never ahead of the API server's and may read up
    // to a second behind it (its `Date` header has whole seconds), so the
    // span the next instance ends reads up to a second early: it starts more
    // than a second after the kill, so its end still says it outlived it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.start_operator(None);
    s.decide(&approval, "Approved", "ship it").await;
    let done = s.wait_finished("traced", RUN_TIMEOUT).await;
    assert_eq!(
        status(&done).phase,
        Some(RunPhase::Succeeded),
        "{:#?}",
        status(&done)
    );
    let fetch_cp = status(&done)
        .steps
        .iter()
        .find(|c| c.name == "fetch")
        .cloned()
        .unwrap();
    assert_eq!(
        (fetch_cp.attempt, fetch_cp.failures, fetch_cp.phase),
        (2, 1, StepPhase::Succeeded)
    );

    // The step Pods' TRACEPARENTs: every attempt's Pod, by (step, attempt).
    let mut parents: BTreeMap<(String, String), (String, String)> = BTreeMap::new();
    for pod in s.list_pods().await {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let key = (
            labels["agentrun.dev/step"].clone(),
            labels["agentrun.dev/attempt"].clone(),
        );
        let tp = traceparent(&pod);
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4, "{tp}");
        parents.insert(key, (parts[1].to_owned(), parts[2].to_owned()));
    }
    assert_eq!(
        parents.len(),
        3,
        "fetch a1, fetch a2, deploy a1: {parents:?}"
    );
    let trace_ids: BTreeSet<&String> = parents.values().map(|(t, _)| t).collect();
    assert_eq!(
        trace_ids.len(),
        1,
        "one trace for the run's Pods: {parents:?}"
    );
    let trace_id = (*trace_ids.iter().next().unwrap()).clone();

    // Jaeger: wait for the run's root span (emitted last, at the run's end).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans = jaeger.spans(&trace_id).await;
        if spans.iter().any(|s| s["operationName"] == "run") {
            break spans;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no run span in Jaeger for trace {trace_id} after 30 s; spans: {spans:#?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // One trace: every span the operator exported belongs to this run's.
    let traces = jaeger
        .get("/api/traces?service=agentrun-operator&limit=100&lookback=1h")
        .await;
    let ids: BTreeSet<String> = traces["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["traceID"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        ids,
        BTreeSet::from([trace_id.clone()]),
        "one trace for one run"
    );

    let by_id: BTreeMap<String, &Value> = spans
        .iter()
        .map(|s| (s["spanID"].as_str().unwrap().to_owned(), s))
        .collect();
    let roots: Vec<&&Value> = by_id.values().filter(|s| parent(s).is_none()).collect();
    assert_eq!(roots.len(), 1, "one root: {roots:#?}");
    let root = roots[0];
    assert_eq!(root["operationName"], "run");
    assert_eq!(
        tag(root, "agentrun.run.uid").and_then(Value::as_str),
        Some(uid.as_str())
    );
    assert_eq!(
        tag(root, "agentrun.phase").and_then(Value::as_str),
        Some("Succeeded")
    );
    let root_id = root["spanID"].as_str().unwrap();
    for (id, span) in &by_id {
        if let Some(p) = parent(span) {
            assert!(
                by_id.contains_key(&p),
                "span {id} ({}) has a parent {p} not in the trace",
                span["operationName"]
            );
        }
    }

    let attempts: BTreeMap<(String, i64), &Value> = by_id
        .values()
        .filter(|s| s["operationName"] == "attempt")
        .map(|s| {
            (
                (
                    tag(s, "agentrun.step")
                        .and_then(Value::as_str)
                        .unwrap()
                        .to_owned(),
                    tag(s, "agentrun.attempt").and_then(Value::as_i64).unwrap(),
                ),
                *s,
            )
        })
        .collect();
    let keys: Vec<(&str, i64)> = attempts.keys().map(|(s, a)| (s.as_str(), *a)).collect();
    assert_eq!(
        keys,
        [("deploy", 1), ("fetch", 1), ("fetch", 2)],
        "one span per attempt"
    );
    let outcome = |k: (&str, i64)| {
        tag(attempts[&(k.0.to_owned(), k.1)], "agentrun.outcome")
            .and_then(Value::as_str)
            .unwrap()
            .to_owned()
    };
    assert_eq!(outcome(("fetch", 1)), "Failed");
    assert_eq!(outcome(("fetch", 2)), "Succeeded");
    assert_eq!(outcome(("deploy", 1)), "Succeeded");
    for ((step, attempt), span) in &attempts {
        assert_eq!(
            parent(span).as_deref(),
            Some(root_id),
            "{step} a{attempt} hangs from the run"
        );
        let (t, p) = &parents[&(step.clone(), attempt.to_string())];
        assert_eq!(t, &trace_id);
        assert_eq!(
            span["spanID"].as_str(),
            Some(p.as_str()),
            "the Pod of {step} attempt {attempt} names its attempt's span as TRACEPARENT parent"
        );
        assert_eq!(
            tag(span, "agentrun.idempotency_key")
                .and_then(Value::as_str)
                .map(str::len),
            Some(32)
        );
    }
    assert_eq!(
        tag(
            attempts[&("fetch".to_owned(), 1)],
            "agentrun.idempotency_key"
        ),
        tag(
            attempts[&("fetch".to_owned(), 2)],
            "agentrun.idempotency_key"
        ),
        "a retry keeps its key (D1)"
    );

    // The approval wait began before the SIGKILL and ended after it: one span
    // with its true start, emitted by the instance that saw the decision.
    let waits: Vec<&&Value> = by_id
        .values()
        .filter(|s| s["operationName"] == "approval wait")
        .collect();
    assert_eq!(waits.len(), 1, "{waits:#?}");
    let wait = waits[0];
    assert_eq!(
        tag(wait, "agentrun.approval").and_then(Value::as_str),
        Some(approval.as_str())
    );
    let start_us = wait["startTime"].as_i64().unwrap();
    let end_us = start_us + wait["duration"].as_i64().unwrap();
    let killed_us = killed_at.as_microsecond();
    assert!(
        start_us < killed_us && killed_us < end_us,
        "the wait spans the kill: {start_us} < {killed_us} < {end_us}"
    );
    assert_eq!(parent(wait).as_deref(), Some(root_id));

    // Status writes and reconciles hang from the run too.
    assert!(by_id.values().any(|s| s["operationName"] == "status write"));
    assert!(by_id.values().any(|s| s["operationName"] == "reconcile"));

    // The logs of both operator instances carry the run's trace id — the
    // second one's too, which took the run's trace context from its status
    // after the first was killed — and the span ids of reconciles that
    // Jaeger holds.
    let log = std::fs::read_to_string(&log_path).unwrap();
    let mut split = first_instance_bytes.min(log.len());
    while !log.is_char_boundary(split) {
        split -= 1;
    }
    let traced_in = |part: &str| -> Vec<Value> {
        part.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["span"]["trace_id"] == trace_id.as_str())
            .collect()
    };
    let (first, second) = (traced_in(&log[..split]), traced_in(&log[split..]));
    assert!(
        !first.is_empty(),
        "no log line of the first instance carries trace_id {trace_id}"
    );
    assert!(
        !second.is_empty(),
        "no log line of the instance started after the kill carries trace_id {trace_id}"
    );
    let traced: Vec<Value> = first.into_iter().chain(second).collect();
    let reconcile_ids: BTreeSet<&str> = by_id
        .values()
        .filter(|s| s["operationName"] == "reconcile")
        .filter_map(|s| s["spanID"].as_str())
        .collect();
    assert!(
        traced.iter().any(|l| l["span"]["span_id"]
            .as_str()
            .is_some_and(|id| reconcile_ids.contains(id))),
        "no log line names a reconcile span Jaeger holds"
    );

    jaeger.stop().await;
    s.finish().await;
}
