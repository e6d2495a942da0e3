//! Places under the total cap go round-robin across namespaces, on the real
//! control plane: one operator watching every namespace with
//! `--max-active-runs 2`, and a simulated kubelet per namespace. Namespace A's
//! five runs come first and take both places; B's one run, created after
//! them, gets the next place A frees instead of waiting behind A's three
//! others. The ledgers say what really ran, and when.
//!
//! A test binary of its own: an operator that watches every namespace acts
//! on every run of the plane, so no other test may run beside it (the tests
//! of one binary run in parallel; binaries run one after another).

use std::time::Duration;

use agentrun_e2e::ledger::{LedgerEntry, LedgerEvent};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, RunPhase};
use jiff::Timestamp;
use kube::Api;
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(120);

fn entry(s: &Scenario, run: &str, event: LedgerEvent) -> LedgerEntry {
    let e: Vec<LedgerEntry> = s
        .ledger()
        .entries
        .into_iter()
        .filter(|e| e.event == event && e.run.as_deref() == Some(run))
        .collect();
    assert_eq!(e.len(), 1, "{run} {event:?} once: {e:?}");
    e[0].clone()
}

/// Waits until no run outside `ours` is live on the plane (the namespaces of
/// tests that ran before are being deleted), and fails, naming them, if
/// some stay: an operator watching every namespace would take them on.
async fn plane_to_ourselves(ours: &[&str]) {
    let all = Api::<AgentRun>::all(agentrun_e2e::client().await);
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let others: Vec<String> = all
            .list(&Default::default())
            .await
            .expect("listing every run")
            .items
            .into_iter()
            .filter(|r| {
                let ns = r.metadata.namespace.as_deref().unwrap_or_default();
                !ours.contains(&ns)
                    && r.metadata.deletion_timestamp.is_none()
                    && !phase(r).is_some_and(|p| p.is_terminal())
            })
            .map(|r| {
                format!(
                    "{}/{}",
                    r.metadata.namespace.unwrap_or_default(),
                    r.metadata.name.unwrap_or_default()
                )
            })
            .collect();
        if others.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "this test needs the plane to itself; live runs of others: {others:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[tokio::test]
async fn a_namespaces_burst_waits_behind_another_namespaces_run_under_the_total_cap() {
    let mut a = Scenario::start_without_operator("fair-a").await;
    let b = Scenario::start_without_operator("fair-b").await;
    plane_to_ourselves(&[a.namespace(), b.namespace()]).await;
    a.operator_config.all_namespaces = true;
    a.operator_config
        .extra_env
        .push(("AGENTRUN_MAX_ACTIVE_RUNS".into(), "2".into()));
    a.start_operator(None);
    let work = |ms: u64| json!({"steps": [sim_step("work", "Idempotent", json!({"runMs": ms}))]});
    // a1 frees the first place, well after b1 is created; a2 the second.
    for (name, ms) in [
        ("a1", 6000),
        ("a2", 12000),
        ("a3", 2000),
        ("a4", 2000),
        ("a5", 2000),
    ] {
        a.create_run(name, work(ms)).await;
    }
    for name in ["a1", "a2"] {
        a.wait_run(name, "started", RUN_TIMEOUT, |r| {
            status(r).started_at.is_some()
        })
        .await;
    }
    a.wait_run("a5", "third in A's queue", RUN_TIMEOUT, |r| {
        status(r).queue_position == Some(3)
    })
    .await;
    let b1 = b.create_run("b1", work(2000)).await;
    let b1_created = b1.metadata.creation_timestamp.expect("a creation time").0;
    let queued = b
        .wait_run("b1", "queued", RUN_TIMEOUT, |r| {
            status(r).queue_position.is_some()
        })
        .await;
    assert_eq!(
        (phase(&queued), status(&queued).queue_position),
        (Some(RunPhase::Queued), Some(1))
    );
    let why = status(&queued)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Succeeded")
        .expect("a Succeeded condition")
        .message;
    assert_eq!(
        why,
        "queued at position 1: 2 of 2 runs active in all namespaces (maxActiveRuns)"
    );

    for name in ["a1", "a2", "a3", "a4", "a5"] {
        let run = a.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{name}");
    }
    let run = b.wait_finished("b1", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));

    let started = |s: &Scenario, run: &str| entry(s, run, LedgerEvent::Started).started_at;
    let finished = |s: &Scenario, run: &str| {
        entry(s, run, LedgerEvent::Finished)
            .finished_at
            .expect("a finish time")
    };
    let a1_end = finished(&a, "a1");
    assert!(
        b1_created < a1_end,
        "b1 was created ({b1_created}) before a1 freed its place ({a1_end}); the setup was too slow"
    );
    // b1 takes the place a1 frees; A's queue goes on after it.
    let (b1_start, a3_start) = (started(&b, "b1"), started(&a, "a3"));
    assert!(
        b1_start >= a1_end && b1_start < a3_start,
        "b1 started at {b1_start}, after a1 ended ({a1_end}) and before a3 ({a3_start})"
    );
    let order = ["a3", "a4", "a5"].map(|r| started(&a, r));
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "A's queue in creation order: {order:?}"
    );
    // Sharing never broke the cap: at each start, at most two step Pods ran.
    let spans: Vec<(Timestamp, Timestamp)> = ["a1", "a2", "a3", "a4", "a5"]
        .iter()
        .map(|r| (started(&a, r), finished(&a, r)))
        .chain([(b1_start, finished(&b, "b1"))])
        .collect();
    for (start, _) in &spans {
        let running = spans
            .iter()
            .filter(|(s, f)| s <= start && start < f)
            .count();
        assert!(running <= 2, "{running} running at {start}: {spans:?}");
    }
    b.finish().await;
    a.finish().await;
}
