//! The registry's counting and what the chart's alerts and dashboard read.
use super::*;
use crate::engine::testing::{PodExt, World, ok_message, step};
use crate::telemetry::transitions;
use serde_json::json;

/// Drives `w` to rest the way the controller does: every decision whose
/// status differs is "acknowledged", then counted and observed.
fn settle_counted(w: &mut World, m: &Metrics) {
    for _ in 0..50 {
        let old = w.status();
        let d = w.decide();
        if d.status == old && d.actions.is_empty() {
            return;
        }
        if d.status != old {
            m.count("team-a", &d.tally);
            m.observe(&transitions::between(&old, &d.status, w.now));
        }
        w.commit(&d);
    }
    panic!("the run did not settle: {:#?}", w.status());
}

fn scrape(registry: &Registry) -> String {
    let mut body = String::new();
    prometheus_client::encoding::text::encode(&mut body, registry).unwrap();
    body
}

/// The value of the sample line that starts with `series ` exactly.
fn sample(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series}:\n{body}"))
}

/// Every `agentrun_*` name the chart's PrometheusRule and the Grafana
/// dashboard read is one this registry encodes once its family has a series
/// (prometheus-client leaves a family without one out of a scrape). The
/// live scrape in e2e/tests/metrics.rs checks the same names on a real
/// operator for every family its scenario gives a series.
#[test]
fn every_metric_the_alerts_and_dashboard_read_is_registered() {
    let mut registry = Registry::default();
    let m = Metrics::register(&mut registry);
    let ns = || NamespaceLabel {
        namespace: "team-a".into(),
    };
    m.reconcile_errors
        .get_or_create(&CategoryLabel {
            category: "conflict".into(),
        })
        .inc();
    m.tokens.get_or_create(&ns()).inc();
    m.status_writes
        .get_or_create(&ResultLabel {
            result: "ok".into(),
        })
        .inc();
    m.step_duration
        .get_or_create(&AttemptLabels {
            role: "step".into(),
            outcome: "Succeeded".into(),
        })
        .observe(1.0);
    m.run_duration
        .get_or_create(&OutcomeLabel {
            outcome: "Succeeded".into(),
        })
        .observe(1.0);
    m.runs_by_phase
        .get_or_create(&PhaseLabel {
            phase: "Running".into(),
        })
        .set(1);
    m.approval_expiry.get_or_create(&ns()).set(1.0);
    m.runs_stalled.get_or_create(&ns()).set(1);
    m.progress_age.get_or_create(&ns()).set(1.0);
    let body = scrape(&registry);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    for file in [
        "charts/agentrun-operator/templates/prometheusrule.yaml",
        "charts/agentrun-operator/dashboards/agentrun-operator.json",
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let names = metric_names(&text);
        assert!(names.len() >= 5, "{file}: {names:?}");
        for name in names {
            let sampled = body.lines().any(|l| {
                l.strip_prefix(name.as_str())
                    .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
            });
            if !sampled {
                missing.push(format!("{file}: {name}"));
            }
        }
    }
    assert!(missing.is_empty(), "not exported: {missing:#?}\n{body}");
}

/// The `agentrun_…` identifiers in a text.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices("agentrun_")
        .filter(|(i, _)| !text[..*i].chars().next_back().is_some_and(ident))
        .map(|(i, _)| {
            let rest = &text[i..];
            rest[..rest.find(|c| !ident(c)).unwrap_or(rest.len())].to_owned()
        })
        .collect()
}

/// A step that times out once, whose stopped Pod then reports, and whose
/// retry succeeds: one failure, three successes, four launches. The
/// failure used to be counted twice (once per Event it caused).
#[test]
fn a_timed_out_attempt_is_one_failure_in_metrics() {
    let mut registry = Registry::default();
    let m = Metrics::register(&mut registry);
    let mut w = World::new(crate::api::AgentRun::test().with_steps([
        step("a"),
        step("b").with_timeout("1m").with_retry(1, "1s", "1s"),
        step("c"),
    ]));
    settle_counted(&mut w, &m);
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.succeeded(&ok_message(json!(1), 7))
    });
    settle_counted(&mut w, &m);
    w.update_pod("run-b-59c772-r1-a1", |p| p.running());
    settle_counted(&mut w, &m);
    w.advance(62);
    settle_counted(&mut w, &m);
    // The stopped Pod ends (SIGTERM) and reports its tokens.
    w.update_pod("run-b-59c772-r1-a1", |p| {
        p.exited(143, &ok_message(json!(null), 5))
    });
    settle_counted(&mut w, &m);
    w.advance(2);
    settle_counted(&mut w, &m);
    let retry = w.status().steps[1].pod.clone().expect("b's retry launched");
    assert_ne!(retry, "run-b-59c772-r1-a1");
    w.update_pod(&retry, |p| p.succeeded(&ok_message(json!(2), 11)));
    settle_counted(&mut w, &m);
    let c = w.status().steps[2].pod.clone().expect("c launched");
    w.update_pod(&c, |p| p.succeeded(&ok_message(json!(3), 1)));
    settle_counted(&mut w, &m);
    assert_eq!(
        w.status().phase,
        Some(crate::api::RunPhase::Succeeded),
        "{:#?}",
        w.status()
    );

    let body = scrape(&registry);
    assert_eq!(sample(&body, "agentrun_steps_failed_total"), 1.0, "{body}");
    assert_eq!(sample(&body, "agentrun_steps_started_total"), 4.0);
    assert_eq!(sample(&body, "agentrun_steps_succeeded_total"), 3.0);
    assert_eq!(sample(&body, "agentrun_steps_disrupted_total"), 0.0);
    assert_eq!(
        sample(&body, r#"agentrun_tokens_total{namespace="team-a"}"#),
        24.0
    );
    let attempts = |outcome: &str| {
        sample(
            &body,
            &format!(r#"agentrun_step_duration_seconds_count{{role="step",outcome="{outcome}"}}"#),
        )
    };
    assert_eq!(attempts("Failed"), 1.0);
    assert_eq!(attempts("Succeeded"), 3.0);
    // b's first attempt ran from its launch to the timeout: 62 s.
    assert_eq!(
        sample(
            &body,
            r#"agentrun_step_duration_seconds_sum{role="step",outcome="Failed"}"#
        ),
        62.0
    );
    assert_eq!(
        sample(
            &body,
            r#"agentrun_run_duration_seconds_count{outcome="Succeeded"}"#
        ),
        1.0
    );
}

#[test]
fn build_info_names_the_version() {
    let mut registry = Registry::default();
    let _m = Metrics::register(&mut registry);
    let body = scrape(&registry);
    assert!(
        body.contains(&format!(
            "agentrun_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{body}"
    );
}

#[test]
fn gauge_guards_give_back_what_they_hold() {
    let mut registry = Registry::default();
    let m = Metrics::register(&mut registry);
    let a = m.in_flight();
    let b = m.in_flight();
    assert_eq!(m.reconciles_in_flight.get(), 2);
    drop(a);
    assert_eq!(m.reconciles_in_flight.get(), 1);
    drop(b);
    assert_eq!(m.reconciles_in_flight.get(), 0);
}
