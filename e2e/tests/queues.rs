//! Runs that queue instead of flooding, on the real control plane with the
//! operator (capped at one active run per namespace) and the simulated
//! kubelet: the runs over the cap wait in `Queued` with their positions,
//! start one at a time in creation order as places free, and an operator
//! killed and started again meanwhile neither starts a second run early nor
//! repeats a step; a cap raised while the operator is down starts the queued
//! runs once; a PriorityClass the platform team ranks first queues first.
//! The ledger says what really ran, and when.

use std::time::Duration;

use agentrun_e2e::ledger::{LedgerEntry, LedgerEvent};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::RunPhase;
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

fn entries(s: &Scenario, run: &str, event: LedgerEvent) -> Vec<LedgerEntry> {
    s.ledger()
        .entries
        .into_iter()
        .filter(|e| e.event == event && e.run.as_deref() == Some(run))
        .collect()
}

#[tokio::test]
async fn runs_over_the_cap_queue_in_order_and_start_as_places_free() {
    let mut s = Scenario::start_without_operator("queue-cap").await;
    s.operator_config
        .extra_env
        .push(("AGENTRUN_MAX_ACTIVE_RUNS_PER_NAMESPACE".into(), "1".into()));
    s.start_operator(None);
    for name in ["q1", "q2", "q3"] {
        s.create_run(
            name,
            json!({"steps": [sim_step("work", "Idempotent", json!({"runMs": 3000}))]}),
        )
        .await;
    }
    s.wait_run("q1", "running", RUN_TIMEOUT, |r| {
        phase(r) == Some(RunPhase::Running)
    })
    .await;
    let q3 = s
        .wait_run("q3", "second in the queue", RUN_TIMEOUT, |r| {
            status(r).queue_position == Some(2)
        })
        .await;
    assert_eq!(phase(&q3), Some(RunPhase::Queued));
    assert_eq!(status(&q3).started_at, None);
    let reason = status(&q3)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Succeeded")
        .unwrap();
    assert_eq!(reason.reason, "Queued");
    assert_eq!(
        reason.message,
        "queued at position 2: 1 of 1 runs active in namespace {ns} (maxActiveRunsPerNamespace)"
            .replace("{ns}", s.namespace())
    );
    // Positions follow creation order, whichever of the two queued runs the
    // operator wrote first.
    let q2 = s
        .wait_run("q2", "first in the queue", RUN_TIMEOUT, |r| {
            status(r).queue_position.is_some()
        })
        .await;
    assert_eq!(
        (phase(&q2), status(&q2).queue_position),
        (Some(RunPhase::Queued), Some(1))
    );

    // The operator dies while q1 runs and comes back: still one at a time.
    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    s.start_operator(None);

    for name in ["q1", "q2", "q3"] {
        let run = s.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{name}");
        assert_eq!(status(&run).queue_position, None, "{name}");
    }
    let started = |run: &str| {
        let e = entries(&s, run, LedgerEvent::Started);
        assert_eq!(e.len(), 1, "{run} ran once: {e:?}");
        e[0].started_at
    };
    let finished = |run: &str| {
        entries(&s, run, LedgerEvent::Finished)[0]
            .finished_at
            .expect("a finish time")
    };
    let (s1, s2, s3) = (started("q1"), started("q2"), started("q3"));
    assert!(s1 < s2 && s2 < s3, "creation order: {s1:?} {s2:?} {s3:?}");
    assert!(s2 >= finished("q1"), "q2 started after q1 ended");
    assert!(s3 >= finished("q2"), "q3 started after q2 ended");
    // q1's end wakes q2 at once, not at its next recheck.
    let gap = s3.duration_since(finished("q2")).as_millis();
    assert!(gap < 10_000, "q3 started {gap} ms after q2 ended");
    s.finish().await;
}

/// The platform team ranks a PriorityClass first: a run of that class,
/// created last, starts before the runs queued ahead of it in creation
/// order; they follow in creation order.
#[tokio::test]
async fn a_run_of_a_listed_priority_class_starts_first() {
    let mut s = Scenario::start_without_operator("queue-priority").await;
    let class = format!("urgent-{}", s.namespace());
    agentrun_e2e::kubectl_ok([
        "create",
        "priorityclass",
        &class,
        "--value=1000",
        "--description=queued first by the operator",
    ])
    .await;
    s.operator_config
        .extra_env
        .push(("AGENTRUN_MAX_ACTIVE_RUNS_PER_NAMESPACE".into(), "1".into()));
    s.operator_config.extra_env.push((
        "AGENTRUN_QUEUE_PRIORITY_CLASSES".into(),
        format!("other-class,{class}"),
    ));
    s.start_operator(None);
    let work = || json!([sim_step("work", "Idempotent", json!({"runMs": 2000}))]);
    s.create_run("p1", json!({"steps": work()})).await;
    s.wait_run("p1", "running", RUN_TIMEOUT, |r| {
        phase(r) == Some(RunPhase::Running)
    })
    .await;
    for name in ["p2", "p3"] {
        s.create_run(name, json!({"steps": work()})).await;
    }
    // Created a second later than p3, so creation order alone would put it last.
    tokio::time::sleep(Duration::from_secs(1)).await;
    s.create_run(
        "urgent",
        json!({"steps": work(), "podTemplate": {"priorityClassName": class}}),
    )
    .await;
    let urgent = s
        .wait_run("urgent", "first in the queue", RUN_TIMEOUT, |r| {
            status(r).queue_position == Some(1)
        })
        .await;
    assert_eq!(phase(&urgent), Some(RunPhase::Queued));
    // (p2 and p3 say their new places at their next look at the queue:
    // a run queued ahead of them does not wake them.)
    for name in ["p1", "p2", "p3", "urgent"] {
        let run = s.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{name}");
    }
    let started = |run: &str| {
        let e = entries(&s, run, LedgerEvent::Started);
        assert_eq!(e.len(), 1, "{run} ran once: {e:?}");
        e[0].started_at
    };
    let order = ["p1", "urgent", "p2", "p3"].map(started);
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "p1, then urgent, then p2 and p3 in creation order: {order:?}"
    );
    agentrun_e2e::kubectl_ok(["delete", "priorityclass", &class]).await;
    s.finish().await;
}

/// The cap is raised while the operator is down (a `helm upgrade` of
/// `queue.maxActiveRunsPerNamespace`): the operator that starts with the new
/// cap starts the queued runs together, each once, and stops none that ran.
#[tokio::test]
async fn a_cap_raised_during_a_restart_starts_the_queued_runs_once() {
    let mut s = Scenario::start_without_operator("queue-raise").await;
    let cap = |n: &str| {
        (
            "AGENTRUN_MAX_ACTIVE_RUNS_PER_NAMESPACE".to_owned(),
            n.to_owned(),
        )
    };
    s.operator_config.extra_env.push(cap("1"));
    s.start_operator(None);
    let work = json!([sim_step("work", "Idempotent", json!({"runMs": 4000}))]);
    for name in ["r1", "r2", "r3"] {
        s.create_run(name, json!({"steps": work})).await;
    }
    s.wait_run("r1", "running", RUN_TIMEOUT, |r| {
        phase(r) == Some(RunPhase::Running)
    })
    .await;
    s.wait_run("r3", "queued", RUN_TIMEOUT, |r| {
        status(r).queue_position == Some(2)
    })
    .await;
    s.kill_operator().await;
    s.operator_config
        .extra_env
        .retain(|(k, _)| !k.starts_with("AGENTRUN_MAX_ACTIVE"));
    s.operator_config.extra_env.push(cap("3"));
    s.start_operator(None);
    for name in ["r2", "r3"] {
        s.wait_run(name, "started under the raised cap", RUN_TIMEOUT, |r| {
            status(r).started_at.is_some()
        })
        .await;
    }
    let r1 = s.runs().get("r1").await.unwrap();
    assert_ne!(
        phase(&r1),
        Some(RunPhase::Queued),
        "a started run is never queued again"
    );
    for name in ["r1", "r2", "r3"] {
        let run = s.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{name}");
        assert_eq!(
            entries(&s, name, LedgerEvent::Started).len(),
            1,
            "{name} ran once"
        );
    }
    // r2 and r3 ran side by side: the second started before the first ended.
    let started = entries(&s, "r3", LedgerEvent::Started)[0].started_at;
    let r2_end = entries(&s, "r2", LedgerEvent::Finished)[0]
        .finished_at
        .expect("a finish time");
    assert!(
        started < r2_end,
        "r3 started {started:?}, r2 ended {r2_end:?}"
    );
    s.finish().await;
}
