//! A verify probe settles an unknown outcome, on the real control plane with the
//! operator and the simulated kubelet: a NonIdempotent step's Pod is lost after it
//! started, and the step's probe — run with the step's own key — answers what
//! the system saw. Counted in the ledger per step across attempts; a probe survives
//! operator crashes while it runs and right after its answer is committed.

use std::time::Duration;

use agentrun_e2e::ledger::LedgerEvent;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{ApprovalKind, EffectOutcome, Provenance, RunPhase, StepPhase};
use agentrun_operator::labels;
use kube::ResourceExt;
use kube::api::{EvictParams, ListParams};
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// A NonIdempotent `pay` step whose attempt 1 runs long enough to be
/// evicted, and whose probe answers `answer` (a SIM_STEP).
fn pay(answer: Value) -> Value {
    let mut step = sim_step(
        "pay",
        "NonIdempotent",
        json!({"attempts": [{"runMs": 60000}, {"runMs": 50, "result": {"paid": 2}}]}),
    );
    step["retry"] = json!({"limit": 1, "backoff": {"initial": "1s", "max": "1s"}});
    step["verify"] = json!({
        "image": "registry.example/agent-step:1",
        "env": [{"name": "SIM_STEP", "value": answer.to_string()}],
    });
    json!({"steps": [step]})
}

/// Executions of the step's own attempts (not its probe) in the ledger.
fn step_runs(s: &Scenario) -> usize {
    s.ledger()
        .entries
        .iter()
        .filter(|e| {
            e.event == LedgerEvent::Started
                && e.step.as_deref() == Some("pay")
                && e.role.as_deref() == Some("step")
        })
        .count()
}

async fn evict_attempt_1(s: &Scenario, run: &str) {
    let (_, pod) = s
        .wait_step_running(run, "pay", Duration::from_secs(30))
        .await;
    s.pods().evict(&pod, &EvictParams::default()).await.unwrap();
}

#[tokio::test]
async fn a_probe_that_finds_the_payment_records_the_step_and_nobody_is_asked() {
    let s = Scenario::start("verify-applied").await;
    s.create_run(
        "checkout",
        pay(json!({"runMs": 50, "rawMessage": "{\"effect\": \"Applied\", \"result\": {\"paymentId\": \"p-1\"}}"})),
    )
    .await;
    evict_attempt_1(&s, "checkout").await;
    let run = s.wait_finished("checkout", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let c = status(&run)
        .steps
        .into_iter()
        .find(|c| c.name == "pay" && c.role.is_step())
        .unwrap();
    assert_eq!(
        (c.effect, c.provenance, c.result),
        (
            Some(EffectOutcome::Applied),
            Some(Provenance::Verified),
            Some(json!({"paymentId": "p-1"}))
        )
    );
    assert_eq!(step_runs(&s), 1, "the step ran once");
    assert!(
        s.approvals()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "nobody was woken"
    );
    // The probe ran with the step's key.
    let probe = s
        .list_pods()
        .await
        .into_iter()
        .find(|p| p.labels().get(labels::ROLE).map(String::as_str) == Some("verify"))
        .expect("the probe's Pod");
    assert_eq!(probe.labels()[labels::IDEMPOTENCY_KEY], c.idempotency_key);
    s.finish().await;
}

#[tokio::test]
async fn a_probe_that_finds_nothing_lets_the_step_retry_with_the_same_key() {
    let s = Scenario::start("verify-not-applied").await;
    s.create_run(
        "checkout",
        pay(json!({"runMs": 50, "rawMessage": "{\"effect\": \"NotApplied\"}"})),
    )
    .await;
    evict_attempt_1(&s, "checkout").await;
    let run = s.wait_finished("checkout", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let keys: Vec<String> = s
        .ledger()
        .entries
        .iter()
        .filter(|e| e.event == LedgerEvent::Started && e.role.as_deref() == Some("step"))
        .map(|e| e.key().to_owned())
        .collect();
    assert_eq!(keys.len(), 2, "attempt 2 ran");
    assert_eq!(keys[0], keys[1], "with the same key");
    assert!(
        s.approvals()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    s.finish().await;
}

#[tokio::test]
async fn a_failing_probe_falls_back_to_a_person() {
    let s = Scenario::start("verify-fails").await;
    s.create_run(
        "checkout",
        pay(json!({"runMs": 50, "exitCode": 1, "rawMessage": "payments API unreachable"})),
    )
    .await;
    evict_attempt_1(&s, "checkout").await;
    let name = s
        .approval_of("checkout", Some("pay"), Duration::from_secs(60))
        .await;
    let a = s.approvals().get(&name).await.unwrap();
    assert_eq!(a.spec.kind, ApprovalKind::Reconcile);
    let reason = a.spec.context.unwrap().reason;
    assert!(reason.contains("its verify probe failed"), "{reason}");
    let run = s.runs().get("checkout").await.unwrap();
    let c = status(&run)
        .steps
        .into_iter()
        .find(|c| c.name == "pay" && c.role.is_step())
        .unwrap();
    assert_eq!(c.phase, StepPhase::WaitingForApproval);
    assert_eq!(step_runs(&s), 1, "nothing ran again");
    s.finish().await;
}

/// Executions of the step's probe in the ledger.
fn probe_runs(s: &Scenario) -> usize {
    s.ledger().starts("checkout", "pay", "verify")
}

/// The operator is killed (SIGKILL) while the probe runs and stays down until the probe
/// has answered; the operator that comes back reads that answer rather than asking
/// again, crashes right after it commits the verified checkpoint (failpoint
/// `after-checkpoint`; the probe's answer and the run's end go in one write), and the
/// third one goes on from that checkpoint. One execution
/// of the step, one of its probe, nobody asked.
#[tokio::test]
async fn a_probe_outlives_two_operator_crashes_and_is_neither_lost_nor_run_again() {
    let mut s = Scenario::start("verify-crash").await;
    s.create_run(
        "checkout",
        pay(json!({"runMs": 1500, "rawMessage": "{\"effect\": \"Applied\", \"result\": {\"paymentId\": \"p-7\"}}"})),
    )
    .await;
    evict_attempt_1(&s, "checkout").await;
    // The probe's Pod runs: kill the operator.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let probe = loop {
        let running = s.list_pods().await.into_iter().find(|p| {
            p.labels().get(labels::ROLE).map(String::as_str) == Some("verify")
                && p.status.as_ref().and_then(|st| st.phase.as_deref()) == Some("Running")
        });
        if let Some(p) = running {
            break p.name_any();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probe never ran"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    s.kill_operator().await;
    // Down until the probe has answered.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let pod = s.pods().get(&probe).await.expect("the probe's Pod stays");
        if pod.status.and_then(|st| st.phase).as_deref() == Some("Succeeded") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probe did not finish"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.start_operator(Some("after-checkpoint"));
    s.wait_operator_crash(Duration::from_secs(60)).await;
    s.start_operator(None);

    let run = s.wait_finished("checkout", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let c = status(&run)
        .steps
        .into_iter()
        .find(|c| c.name == "pay" && c.role.is_step())
        .unwrap();
    assert_eq!(
        (c.effect, c.provenance, c.result),
        (
            Some(EffectOutcome::Applied),
            Some(Provenance::Verified),
            Some(json!({"paymentId": "p-7"}))
        )
    );
    assert_eq!(step_runs(&s), 1, "the step ran once");
    assert_eq!(probe_runs(&s), 1, "the probe ran once");
    assert!(
        s.approvals()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "nobody was woken"
    );
    s.finish().await;
}
