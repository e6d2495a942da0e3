//! `/metrics` of an operator on the plane, scraped after a run whose middle
//! step times out once and is retried: every counter counts each attempt
//! once, and the histograms and gauges the dashboard and alerts read exist
//! with their bounded labels.
//!
//! Needs the plane (`make test`); fails when it is missing.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, sim_step, status};
use agentrun_operator::api::RunPhase;
use serde_json::json;

async fn scrape(port: u16) -> String {
    let out = tokio::process::Command::new("curl")
        .args(["-sf", "--max-time", "5"])
        .arg(format!("http://127.0.0.1:{port}/metrics"))
        .output()
        .await
        .expect("running curl");
    assert!(out.status.success(), "scraping /metrics failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of the sample whose series is exactly `series`.
fn sample(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{body}"))
}

/// Every `agentrun_*` name the chart's PrometheusRule and the Grafana dashboard
/// read has a sample in this live scrape, except the families this scenario
/// gives no series (prometheus-client leaves those out of a scrape): nothing
/// waits for a person, nothing failed, stalled or is still running when it is
/// scraped. That list is exact, so it shrinks when the scenario grows; the unit
/// test `every_metric_the_alerts_and_dashboard_read_is_registered` checks all of
/// them with a series in every family.
fn every_metric_the_alerts_and_dashboard_read_is_exported(body: &str) {
    const NO_SERIES_HERE: [&str; 4] = [
        "agentrun_approval_expiry_soonest_seconds",
        "agentrun_reconcile_errors_total",
        "agentrun_run_progress_age_seconds_max",
        "agentrun_runs_stalled",
    ];
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut read = std::collections::BTreeSet::new();
    for file in [
        "charts/agentrun-operator/templates/prometheusrule.yaml",
        "charts/agentrun-operator/dashboards/agentrun-operator.json",
    ] {
        let text = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("reading {file}: {e}"));
        read.extend(
            text.match_indices("agentrun_")
                .filter(|(i, _)| !text[..*i].chars().next_back().is_some_and(ident))
                .map(|(i, _)| {
                    let rest = &text[i..];
                    rest[..rest.find(|c| !ident(c)).unwrap_or(rest.len())].to_owned()
                }),
        );
    }
    assert!(
        read.len() >= 20,
        "only {} metric names read: {read:?}",
        read.len()
    );
    let unsampled: Vec<&str> = read
        .iter()
        .map(String::as_str)
        .filter(|name| {
            !body.lines().any(|l| {
                l.strip_prefix(name)
                    .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
            })
        })
        .collect();
    assert_eq!(
        unsampled, NO_SERIES_HERE,
        "names an alert or a panel reads without a sample in the scrape:\n{body}"
    );
}

#[tokio::test]
async fn a_timed_out_attempt_is_counted_once_on_a_real_operator() {
    let s = Scenario::start("metrics-timeout").await;
    let mut slow = sim_step(
        "slow",
        "Idempotent",
        json!({"attempts": [{"hang": true}, {"runMs": 50, "tokens": {"input": 5, "output": 6}}]}),
    );
    slow["timeout"] = json!("2s");
    slow["retry"] = json!({"limit": 1, "backoff": {"initial": "1s", "max": "1s"}});
    let steps = json!({"steps": [
        sim_step("first", "None", json!({"runMs": 50, "tokens": {"input": 1, "output": 2}})),
        slow,
        sim_step("last", "None", json!({"runMs": 50})),
    ]});
    s.create_run("measured", steps).await;
    let run = s.wait_finished("measured", Duration::from_secs(60)).await;
    assert_eq!(
        status(&run).phase,
        Some(RunPhase::Succeeded),
        "{:#?}",
        status(&run)
    );
    let slow_cp = status(&run)
        .steps
        .iter()
        .find(|c| c.name == "slow")
        .cloned()
        .unwrap();
    assert_eq!((slow_cp.attempt, slow_cp.failures), (2, 1));
    // The stopped Pod's report and the finalizer release come after the
    // retry's launch: give them a moment to be counted (or double-counted).
    tokio::time::sleep(Duration::from_secs(2)).await;

    let body = scrape(s.operator_config.metrics_port).await;
    assert_eq!(
        sample(&body, "agentrun_steps_failed_total"),
        1.0,
        "one timeout, one failure"
    );
    assert_eq!(sample(&body, "agentrun_steps_started_total"), 4.0);
    assert_eq!(sample(&body, "agentrun_steps_succeeded_total"), 3.0);
    assert_eq!(sample(&body, "agentrun_steps_disrupted_total"), 0.0);
    let ns = s.namespace().to_owned();
    assert_eq!(
        sample(
            &body,
            &format!("agentrun_tokens_total{{namespace=\"{ns}\"}}")
        ),
        14.0
    );
    let attempts = |outcome: &str| {
        sample(
            &body,
            &format!("agentrun_step_duration_seconds_count{{role=\"step\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(attempts("Failed"), 1.0);
    assert_eq!(attempts("Succeeded"), 3.0);
    // The timed-out attempt ran its 2 s timeout at least.
    assert!(
        sample(
            &body,
            "agentrun_step_duration_seconds_sum{role=\"step\",outcome=\"Failed\"}"
        ) >= 2.0
    );
    assert_eq!(
        sample(
            &body,
            "agentrun_run_duration_seconds_count{outcome=\"Succeeded\"}"
        ),
        1.0
    );
    // Hand-offs: first → slow and slow → last (the retry is backoff, not a hand-off).
    assert_eq!(sample(&body, "agentrun_handoff_latency_seconds_count"), 2.0);
    assert!(
        body.contains(&format!(
            "agentrun_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{body}"
    );
    assert!(sample(&body, "agentrun_status_writes_total{result=\"ok\"}") >= 4.0);
    assert_eq!(sample(&body, "agentrun_workqueue_depth"), 0.0);
    assert_eq!(sample(&body, "agentrun_runs{phase=\"Succeeded\"}"), 1.0);
    assert_eq!(sample(&body, "agentrun_runs{phase=\"Running\"}"), 0.0);
    every_metric_the_alerts_and_dashboard_read_is_exported(&body);
    // Bounded labels: no run, step or Pod name anywhere.
    for name in ["measured", "slow", "first"] {
        assert!(
            !body
                .lines()
                .any(|l| !l.starts_with('#') && l.contains(name)),
            "a series carries {name}:\n{body}"
        );
    }
    s.finish().await;
}

/// `kubectl wait --for=condition=Ready` (kstatus' Ready) returns once a run
/// succeeded, and not for a run that failed, which says `Ready=False` with the
/// failure's reason instead.
#[tokio::test]
async fn kubectl_wait_for_ready_follows_the_run() {
    use agentrun_e2e::support::kubectl::{kubectl, kubectl_ok};
    let s = Scenario::start("ready-condition").await;
    let ns = s.namespace().to_owned();
    s.create_run(
        "good",
        json!({"steps": [sim_step("only", "None", json!({"runMs": 300}))]}),
    )
    .await;
    s.create_run(
        "bad",
        json!({"steps": [sim_step("only", "None", json!({"runMs": 50, "exitCode": 1}))]}),
    )
    .await;
    kubectl_ok([
        "wait",
        "--for=condition=Ready",
        "agentrun/good",
        "-n",
        &ns,
        "--timeout=60s",
    ])
    .await;
    let bad = s.wait_finished("bad", Duration::from_secs(60)).await;
    assert_eq!(status(&bad).phase, Some(RunPhase::Failed));
    let waited = kubectl([
        "wait",
        "--for=condition=Ready",
        "agentrun/bad",
        "-n",
        &ns,
        "--timeout=2s",
    ])
    .await;
    assert!(!waited.success(), "a failed run is not Ready");
    let reason = kubectl_ok([
        "get", "agentrun/bad", "-n", &ns,
        "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}/{.status.conditions[?(@.type==\"Ready\")].reason}/{.status.conditions[?(@.type==\"Reconciling\")].status}",
    ])
    .await;
    assert_eq!(reason, "False/StepFailed/False");
    s.finish().await;
}
