//! The reconciler's scenarios on the real control plane: the operator and the
//! simulated kubelet run as real processes; each scenario asserts on the
//! side-effect ledger (what the steps really did) and on the run's status.

use std::collections::BTreeMap;
use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::scenario::{Scenario, field_managers, phase, sim_step, status};
use agentrun_operator::api::{
    AgentRun, CheckpointState, EffectOutcome, RunPhase, StepCheckpoint, StepPhase,
};
use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{DeleteParams, EvictParams, ListParams};
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

fn step<'a>(run: &'a AgentRun, name: &str) -> &'a StepCheckpoint {
    run.status
        .as_ref()
        .and_then(|s| {
            s.steps
                .iter()
                .rev()
                .find(|c| c.name == name && c.role.is_step())
        })
        .unwrap_or_else(|| panic!("no checkpoint for step {name}"))
}

fn checkpoints_of<'a>(run: &'a AgentRun, name: &str) -> Vec<&'a StepCheckpoint> {
    run.status
        .as_ref()
        .map(|s| {
            s.steps
                .iter()
                .filter(|c| c.name == name && c.role.is_step())
                .collect()
        })
        .unwrap_or_default()
}

/// Asserts every idempotency key the run committed as succeeded ran exactly
/// once successfully, and that no key ran after its success (no duplicate).
fn assert_one_success_per_key(s: &Scenario, run: &AgentRun) {
    let ledger = s.ledger();
    let successes = ledger.successes_by_key();
    for c in &status(run).steps {
        if c.phase == StepPhase::Succeeded && c.pod.is_some() {
            assert_eq!(
                successes.get(&c.idempotency_key).copied().unwrap_or(0),
                1,
                "step {} (key {}) must have exactly one successful execution; ledger: {:?}",
                c.name,
                c.idempotency_key,
                ledger.entries
            );
        }
    }
    for (key, n) in &successes {
        assert!(
            *n <= 1,
            "key {key} succeeded {n} times: a committed step ran again"
        );
    }
}

/// Every step Pod gives up its result finalizer once the run is done (D5),
/// and, having ended, is labelled out of the operator's Pod watch; it is
/// kept, with its logs, until its run is deleted.
async fn assert_finalizers_released(s: &Scenario) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let pods = s.list_pods().await;
        assert!(!pods.is_empty(), "the run's Pods are kept");
        let held: Vec<String> = pods
            .iter()
            .filter(|p| {
                p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER)
                    || p.labels().get(labels::RELEASED).map(String::as_str) != Some("true")
            })
            .map(|p| p.name_any())
            .collect();
        if held.is_empty() {
            // Every write to a step Pod names its writer: the operator (the
            // create and the release), the kubelet (its status) and, on a
            // plane with the real (tainted) node joined, the scheduler (the
            // Pod's PodScheduled condition: unschedulable there).
            for p in &pods {
                let managers = field_managers(&p.metadata);
                assert!(
                    managers.iter().all(|m| [
                        labels::FIELD_MANAGER,
                        "simkubelet",
                        "kube-scheduler"
                    ]
                    .contains(&m.as_str())),
                    "pod {} was written by {managers:?}",
                    p.name_any()
                );
            }
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pods still hold the result finalizer or are not labelled {}: {held:?}",
            labels::RELEASED
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn four_steps() -> serde_json::Value {
    json!({"steps": [
        sim_step("lookup-order", "None", json!({"runMs": 50, "result": {"orderId": 4711}, "tokens": {"input": 100, "output": 20}})),
        sim_step("draft-refund", "None", json!({"runMs": 50, "result": {"amount": "23.90"}, "tokens": {"input": 300, "output": 80}})),
        sim_step("issue-refund", "NonIdempotent", json!({"runMs": 50, "result": {"refundId": "r-1"}})),
        sim_step("notify-customer", "Idempotent", json!({"runMs": 50, "result": {"sent": true}, "tokens": {"input": 10, "output": 5}})),
    ]})
}

#[tokio::test]
async fn four_step_run_succeeds_with_one_execution_per_key() {
    let s = Scenario::start("four-step-run").await;
    s.create_run("refund", four_steps()).await;
    let run = s.wait_finished("refund", RUN_TIMEOUT).await;

    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let st = status(&run);
    let names: Vec<&str> = st.steps.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "lookup-order",
            "draft-refund",
            "issue-refund",
            "notify-customer"
        ]
    );
    for c in &st.steps {
        assert_eq!(c.phase, StepPhase::Succeeded, "{}", c.name);
        assert_eq!(c.checkpoint, CheckpointState::Committed, "{}", c.name);
        assert_eq!(c.attempt, 1, "{}", c.name);
        assert_eq!(c.failures + c.disruptions, 0, "{}", c.name);
        assert!(
            c.finished_at.is_some() && c.started_at.is_some(),
            "{}",
            c.name
        );
    }
    assert_eq!(
        step(&run, "lookup-order").result,
        Some(json!({"orderId": 4711}))
    );
    assert_eq!(
        step(&run, "issue-refund").effect,
        Some(EffectOutcome::Applied)
    );
    assert_eq!(st.tokens_used, 100 + 20 + 300 + 80 + 10 + 5);
    assert_eq!(st.progress.as_deref(), Some("4/4"));
    assert!(st.completed_at.is_some());

    // The ledger: four keys, each executed once, and they are the keys in status.
    let ledger = s.ledger();
    let executions = ledger.executions_by_key();
    let keys: BTreeMap<String, usize> = st
        .steps
        .iter()
        .map(|c| (c.idempotency_key.clone(), 1))
        .collect();
    assert_eq!(executions, keys, "one execution per key");
    assert_one_success_per_key(&s, &run);
    assert_finalizers_released(&s).await;

    // Events tell the story of the run (published in the background).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let count = event_counts(&s, "refund").await;
        let n = |reason: &str| count.get(reason).copied().unwrap_or(0);
        let (started, succeeded, finished) =
            (n("StepStarted"), n("StepSucceeded"), n("RunSucceeded"));
        if started == 4 && succeeded == 4 && finished == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "events: StepStarted {started}, StepSucceeded {succeeded}, RunSucceeded {finished}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let events: kube::Api<k8s_openapi::api::events::v1::Event> = s.env().api();
    let ours = events
        .list(&ListParams::default())
        .await
        .expect("listing events")
        .items
        .into_iter()
        .filter(|e| e.reporting_controller.as_deref() == Some("agentrun-operator"))
        .collect::<Vec<_>>();
    assert!(
        ours.len() >= 9,
        "the run's Events, as the operator reports them: {ours:?}"
    );
    for e in ours {
        let managers = field_managers(&e.metadata);
        assert!(
            managers.iter().all(|m| m == labels::FIELD_MANAGER),
            "event {} ({:?}) was written by {managers:?}",
            e.name_any(),
            e.reason
        );
    }

    // What a person sees.
    let table = kubectl_ok(["get", "ar", "refund", "-n", s.namespace()]).await;
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME", "PHASE", "REASON", "STEP", "PROGRESS", "TOKENS", "DURATION", "AGE"
        ],
        "{table}"
    );
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(&row[..2], ["refund", "Succeeded"], "{table}");
    assert!(row.contains(&"4/4") && row.contains(&"515"), "{table}");
    // How long it took, as the operator recorded it when it finished.
    assert_eq!(
        Some(row[6]),
        st.duration.as_deref(),
        "the Duration column: {table}"
    );
    s.finish().await;
}

async fn kill_at(failpoint: &str, test: &str) {
    let mut s = Scenario::start_without_operator(test).await;
    s.start_operator(Some(failpoint));
    s.create_run("refund", four_steps()).await;
    s.wait_operator_crash(RUN_TIMEOUT).await;
    s.start_operator(None);
    let run = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let st = status(&run);
    assert_eq!(st.steps.len(), 4);
    let executions = s.ledger().executions_by_key();
    for c in &st.steps {
        assert_eq!(c.phase, StepPhase::Succeeded, "{}", c.name);
        assert_eq!(
            executions.get(&c.idempotency_key),
            Some(&1),
            "step {} ran once",
            c.name
        );
    }
    assert_eq!(executions.len(), 4, "no other executions: {executions:?}");
    assert_eq!(
        st.tokens_used,
        535 - 20,
        "every reported token counted once"
    );
    assert_one_success_per_key(&s, &run);
    assert_finalizers_released(&s).await;
    s.finish().await;
}

#[tokio::test]
async fn operator_killed_right_after_creating_a_step_pod_resumes_without_duplicates() {
    kill_at("after-create-pod:2", "kill-after-create").await;
}

#[tokio::test]
async fn operator_killed_after_checkpoint_before_finalizer_release_resumes() {
    kill_at("after-checkpoint:2", "kill-after-checkpoint").await;
}

#[tokio::test]
async fn operator_down_while_a_pod_succeeds_records_the_result_on_restart() {
    let mut s = Scenario::start("kill-before-checkpoint").await;
    let spec = json!({"steps": [
        sim_step("slow", "NonIdempotent", json!({"runMs": 3000, "result": {"done": 1}, "tokens": {"input": 7, "output": 3}})),
        sim_step("after", "None", json!({"runMs": 50})),
    ]});
    s.create_run("slow-run", spec).await;
    // Its Pod must exist: the launch is recorded in status before the Pod is created.
    let (_, pod) = s.wait_step_running("slow-run", "slow", RUN_TIMEOUT).await;
    // The Pod succeeds while no operator is there to record it.
    s.kill_operator().await;
    agentrun_e2e::wait_for(
        &s.pods(),
        &pod,
        |p: Option<&Pod>| p.and_then(|p| p.status.as_ref()?.phase.as_deref()) == Some("Succeeded"),
        Duration::from_secs(30),
    )
    .await;
    let held = s.pods().get(&pod).await.unwrap();
    assert!(
        held.finalizers()
            .iter()
            .any(|f| f == labels::RESULT_FINALIZER),
        "the finalizer holds the result"
    );
    s.start_operator(None);
    let run = s.wait_finished("slow-run", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(step(&run, "slow").result, Some(json!({"done": 1})));
    assert_eq!(status(&run).tokens_used, 10);
    assert_eq!(s.ledger().executions_by_key().len(), 2);
    assert_one_success_per_key(&s, &run);
    s.finish().await;
}

#[tokio::test]
async fn evicted_step_resumes_with_same_key() {
    let s = Scenario::start("evicted-step").await;
    let spec = json!({"steps": [
        {"name": "crawl", "effect": "Idempotent",
         "retry": {"limit": 0},
         "container": {"image": "registry.example/crawler:1", "env": [{"name": "SIM_STEP",
            "value": json!({"attempts": [{"runMs": 30000}, {"runMs": 50, "result": {"pages": 12}}]}).to_string()}]}},
    ]});
    s.create_run("crawl", spec).await;
    let (running, pod) = s.wait_step_running("crawl", "crawl", RUN_TIMEOUT).await;
    let first = step(&running, "crawl").clone();
    s.pods()
        .evict(&pod, &EvictParams::default())
        .await
        .expect("eviction accepted");

    let run = s.wait_finished("crawl", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let c = step(&run, "crawl");
    assert_eq!(
        c.idempotency_key, first.idempotency_key,
        "same key after eviction"
    );
    assert_eq!(c.disruptions, 1);
    assert_eq!(c.failures, 0, "the retry budget is untouched");
    assert_eq!(c.attempt, 2);
    assert_ne!(
        c.pod.as_deref(),
        Some(pod.as_str()),
        "a new pod for the new attempt"
    );
    let executions = s.ledger().executions_by_key();
    assert_eq!(
        executions.get(&c.idempotency_key),
        Some(&2),
        "ran twice under one key"
    );
    assert_one_success_per_key(&s, &run);
    s.finish().await;
}

#[tokio::test]
async fn deleted_non_idempotent_step_asks_a_person_and_each_decision_does_what_it_says() {
    let s = Scenario::start("reconcile-decisions").await;
    let spec = || {
        json!({"steps": [
            {"name": "pay", "effect": "NonIdempotent",
             "container": {"image": "registry.example/pay:1", "env": [{"name": "SIM_STEP",
                "value": json!({"attempts": [{"runMs": 30000}, {"runMs": 50, "result": {"paid": true}}]}).to_string()}]}},
            sim_step("receipt", "None", json!({"runMs": 50})),
        ]})
    };
    for (run_name, decision) in [
        ("retry", "Retry"),
        ("marksucceeded", "MarkSucceeded"),
        ("markfailed", "MarkFailed"),
    ] {
        s.create_run(run_name, spec()).await;
        let running = s
            .wait_run(run_name, "running", RUN_TIMEOUT, |r| {
                status(r)
                    .steps
                    .iter()
                    .any(|c| c.phase == StepPhase::Running && c.pod_uid.is_some())
            })
            .await;
        let pod = step(&running, "pay").pod.clone().unwrap();
        s.pods()
            .delete(&pod, &DeleteParams::default())
            .await
            .expect("deleting the pod");

        let waiting = s
            .wait_run(
                run_name,
                "waiting for a Reconcile decision",
                RUN_TIMEOUT,
                |r| {
                    step_opt(r, "pay").is_some_and(|c| {
                        c.effect == Some(EffectOutcome::Unknown) && c.approval.is_some()
                    })
                },
            )
            .await;
        assert_eq!(phase(&waiting), Some(RunPhase::WaitingForApproval));
        let approval_name = step(&waiting, "pay").approval.clone().unwrap();
        let approval = asked(&s, &approval_name).await;
        assert_eq!(format!("{:?}", approval.spec.kind), "Reconcile");
        let live_pods = s
            .pods()
            .list(&ListParams::default().labels(&format!("{}={run_name}", labels::RUN)))
            .await
            .unwrap()
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .count();
        assert_eq!(live_pods, 0, "nothing runs while a person decides");

        s.decide(&approval_name, decision, "checked the payment provider")
            .await;
        let run = s.wait_finished(run_name, RUN_TIMEOUT).await;
        let pay = step(&run, "pay");
        let executions = s.ledger().executions_by_key();
        match decision {
            "Retry" => {
                assert_eq!(phase(&run), Some(RunPhase::Succeeded));
                assert_eq!(
                    executions.get(&pay.idempotency_key),
                    Some(&2),
                    "rerun with the same key"
                );
            }
            "MarkSucceeded" => {
                assert_eq!(phase(&run), Some(RunPhase::Succeeded));
                assert_eq!(pay.phase, StepPhase::Succeeded);
                assert_eq!(
                    executions.get(&pay.idempotency_key),
                    Some(&1),
                    "not run again"
                );
            }
            _ => {
                assert_eq!(phase(&run), Some(RunPhase::Failed));
                assert_eq!(pay.phase, StepPhase::Failed);
                assert_eq!(
                    executions.get(&pay.idempotency_key),
                    Some(&1),
                    "not run again"
                );
                assert!(
                    step_opt(&run, "receipt").is_none_or(|c| c.pod.is_none()),
                    "no later step ran"
                );
            }
        }
    }
    s.finish().await;
}

fn step_opt<'a>(run: &'a AgentRun, name: &str) -> Option<&'a StepCheckpoint> {
    run.status.as_ref().and_then(|s| {
        s.steps
            .iter()
            .rev()
            .find(|c| c.name == name && c.role.is_step())
    })
}

fn gated(timeout: Option<&str>, on_timeout: &str) -> serde_json::Value {
    let mut approval =
        json!({"required": true, "question": "Issue the refund?", "onTimeout": on_timeout});
    if let Some(t) = timeout {
        approval["timeout"] = json!(t);
    }
    json!({"steps": [
        sim_step("draft", "None", json!({"runMs": 50, "result": {"amount": 5}})),
        {"name": "issue", "effect": "NonIdempotent", "approval": approval,
         "container": {"image": "registry.example/pay:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50}).to_string()}]}},
    ]})
}

async fn wait_for_gate(s: &Scenario, run: &str) -> String {
    let waiting = s
        .wait_run(run, "waiting for approval", RUN_TIMEOUT, |r| {
            phase(r) == Some(RunPhase::WaitingForApproval)
                && step_opt(r, "issue").is_some_and(|c| c.approval.is_some())
        })
        .await;
    let name = step(&waiting, "issue").approval.clone().unwrap();
    asked(s, &name).await;
    name
}

/// The Approval a run named in its status, once it exists: the run names it
/// just before creating it.
async fn asked(s: &Scenario, name: &str) -> agentrun_operator::api::Approval {
    agentrun_e2e::wait_for(
        &s.approvals(),
        name,
        |a: Option<&agentrun_operator::api::Approval>| a.is_some(),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|| panic!("Approval {name} was named but never created"))
}

#[tokio::test]
async fn approvals_gate_steps_durably_across_restarts_and_expiry() {
    let mut s = Scenario::start("approvals").await;

    // Approved, with an operator restart while waiting.
    s.create_run("approved", gated(None, "Reject")).await;
    let name = wait_for_gate(&s, "approved").await;
    s.kill_operator().await;
    s.decide(&name, "Approved", "looks right").await;
    s.start_operator(None);
    let run = s.wait_finished("approved", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(step(&run, "issue").phase, StepPhase::Succeeded);
    let approval = s.approvals().get(&name).await.unwrap();
    assert_eq!(
        approval
            .status
            .map(|st| format!("{:?}", st.phase))
            .as_deref(),
        Some("Approved")
    );

    // Rejected: the gated step never runs.
    s.create_run("rejected", gated(None, "Reject")).await;
    let name = wait_for_gate(&s, "rejected").await;
    s.decide(&name, "Rejected", "amount too high").await;
    let run = s.wait_finished("rejected", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    assert!(
        step(&run, "issue").pod.is_none(),
        "a rejected step never gets a pod"
    );

    // Expiry applies onTimeout, also when the operator was down at the deadline.
    s.create_run("expire-reject", gated(Some("3s"), "Reject"))
        .await;
    s.create_run("expire-approve", gated(Some("3s"), "Approve"))
        .await;
    wait_for_gate(&s, "expire-reject").await;
    wait_for_gate(&s, "expire-approve").await;
    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    s.start_operator(None);
    let rejected = s.wait_finished("expire-reject", RUN_TIMEOUT).await;
    assert_eq!(phase(&rejected), Some(RunPhase::Failed));
    assert!(step(&rejected, "issue").pod.is_none());
    let approved = s.wait_finished("expire-approve", RUN_TIMEOUT).await;
    assert_eq!(phase(&approved), Some(RunPhase::Succeeded));
    assert_eq!(step(&approved, "issue").phase, StepPhase::Succeeded);
    // What really ran: a gated step once when released, never otherwise.
    for (run, issue_runs) in [
        ("approved", 1),
        ("rejected", 0),
        ("expire-reject", 0),
        ("expire-approve", 1),
    ] {
        assert_eq!(executions_of(&s, run, "draft"), 1, "{run}: draft");
        assert_eq!(executions_of(&s, run, "issue"), issue_runs, "{run}: issue");
    }
    s.finish().await;
}

#[tokio::test]
async fn stale_input_after_resume_replans_and_reruns_under_a_new_key() {
    let mut s = Scenario::start_without_operator("freshness").await;
    // Crash right after the first checkpoint, stay down past its freshness budget.
    s.start_operator(Some("after-checkpoint:1"));
    s.create_run("fresh", json!({"steps": [
        {"name": "quote", "effect": "None", "freshFor": "3s",
         "container": {"image": "registry.example/quote:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "result": {"price": 10}}).to_string()}]}},
        sim_step("buy", "Idempotent", json!({"runMs": 50})),
    ]}))
    .await;
    s.wait_operator_crash(RUN_TIMEOUT).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    s.start_operator(None);
    // buy's launch at revision 1 was recorded just before the crash and its Pod is
    // not there: it may have been created and acted, so running buy again under the
    // new revision's key (a second effect) waits for a person (D1, D6).
    let waiting = s
        .wait_run("fresh", "buy asks before acting again", RUN_TIMEOUT, |r| {
            step_opt(r, "buy").is_some_and(|c| c.plan_revision == 2 && c.approval.is_some())
        })
        .await;
    let approval = step(&waiting, "buy").approval.clone().unwrap();
    let question = serde_json::to_string(&asked(&s, &approval).await.spec).unwrap();
    assert!(
        question.contains("already acted at plan revision 1"),
        "the question says why: {question}"
    );
    s.decide(&approval, "Approved", "the provider has no such order")
        .await;
    let run = s.wait_finished("fresh", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let st = status(&run);
    let plan = st.plan.clone().expect("a plan");
    assert_eq!(plan.revision, 2, "re-planned once");
    assert!(
        plan.reason.contains("quote"),
        "the reason names the stale step: {}",
        plan.reason
    );
    let quotes = checkpoints_of(&run, "quote");
    assert_eq!(
        quotes.len(),
        2,
        "the stale checkpoint is kept and the step ran again"
    );
    assert_ne!(
        quotes[0].idempotency_key, quotes[1].idempotency_key,
        "new key for the new revision"
    );
    assert_eq!(quotes[1].plan_revision, 2);
    let buy = step(&run, "buy");
    assert_eq!(buy.plan_revision, 2);
    // Its launch at revision 1 was recorded with the quote's checkpoint, just
    // before the crash; on restart it was superseded (effect Unknown: its Pod was
    // never seen), and the ledger below shows it never ran.
    let buys = checkpoints_of(&run, "buy");
    assert_eq!(
        buys.iter()
            .map(|c| (c.plan_revision, c.phase))
            .collect::<Vec<_>>(),
        [(1, StepPhase::Superseded), (2, StepPhase::Succeeded)]
    );
    // What really ran: the quote once per revision, each under its own key,
    // and buy once, under its revision-2 key.
    let executions = s.ledger().executions_by_key();
    assert_eq!(executions.get(&quotes[0].idempotency_key), Some(&1));
    assert_eq!(executions.get(&quotes[1].idempotency_key), Some(&1));
    assert_eq!(executions.get(&buy.idempotency_key), Some(&1));
    assert_eq!(
        executions.get(&buys[0].idempotency_key),
        None,
        "never on the stale quote"
    );
    assert_eq!(executions_of(&s, "fresh", "quote"), 2);
    assert_eq!(executions_of(&s, "fresh", "buy"), 1);
    s.finish().await;
}

#[tokio::test]
async fn failing_step_retries_with_backoff_then_fails_and_compensates_in_reverse() {
    let s = Scenario::start("retry-compensate").await;
    let compensate = |tag: &str| json!({"image": "registry.example/undo:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "result": {"undone": tag}}).to_string()}]});
    s.create_run("saga", json!({"steps": [
        {"name": "reserve", "effect": "Idempotent", "compensate": compensate("reserve"),
         "container": {"image": "registry.example/reserve:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50}).to_string()}]}},
        {"name": "charge", "effect": "Idempotent", "compensate": compensate("charge"),
         "container": {"image": "registry.example/charge:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50}).to_string()}]}},
        {"name": "ship", "effect": "Idempotent", "retry": {"limit": 2, "backoff": {"initial": "1s", "max": "2s"}},
         "container": {"image": "registry.example/ship:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "exitCode": 3}).to_string()}]}},
    ]}))
    .await;
    let run = s.wait_finished("saga", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:?}", run.status);
    let ship = step(&run, "ship");
    assert_eq!(ship.phase, StepPhase::Failed);
    assert_eq!(ship.failures, 3, "first attempt + 2 retries");
    assert_eq!(ship.attempt, 3);
    let ledger = s.ledger();
    let ship_runs: Vec<_> = ledger
        .executions()
        .filter(|e| e.step.as_deref() == Some("ship"))
        .collect();
    assert_eq!(ship_runs.len(), 3);
    // Backoff: 1s then 2s between attempts (the scheduler may add latency, never remove it).
    let gap = |a: usize, b: usize| {
        ship_runs[b]
            .started_at
            .duration_since(ship_runs[a].started_at)
    };
    assert!(
        gap(0, 1) >= jiff::SignedDuration::from_millis(1000),
        "first backoff {:?}",
        gap(0, 1)
    );
    assert!(
        gap(1, 2) >= jiff::SignedDuration::from_millis(2000),
        "second backoff {:?}",
        gap(1, 2)
    );
    // Compensation of the applied steps, in reverse order.
    let comp: Vec<_> = ledger
        .executions()
        .filter(|e| e.role.as_deref() == Some("compensate"))
        .map(|e| e.step.clone().unwrap_or_default())
        .collect();
    assert_eq!(comp, ["charge", "reserve"], "compensated in reverse");
    let st = status(&run);
    let done: Vec<_> = st
        .compensations
        .iter()
        .map(|c| (c.name.as_str(), c.phase))
        .collect();
    assert_eq!(
        done,
        [
            ("charge", StepPhase::Succeeded),
            ("reserve", StepPhase::Succeeded)
        ]
    );
    s.finish().await;
}

#[tokio::test]
async fn token_budget_exceeded_stops_new_steps_with_a_clear_condition() {
    let s = Scenario::start("token-budget").await;
    s.create_run("budget", json!({"budget": {"tokens": 100}, "steps": [
        sim_step("think", "None", json!({"runMs": 50, "tokens": {"input": 60, "output": 20}})),
        sim_step("think-more", "None", json!({"runMs": 50, "tokens": {"input": 30, "output": 20}})),
        sim_step("act", "Idempotent", json!({"runMs": 50})),
    ]}))
    .await;
    let run = s.wait_finished("budget", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    let st = status(&run);
    assert_eq!(st.tokens_used, 130);
    let cond = st
        .conditions
        .iter()
        .find(|c| c.type_ == "BudgetExceeded")
        .expect("a BudgetExceeded condition");
    assert_eq!(cond.status, "True");
    assert!(
        cond.message.contains("130") && cond.message.contains("100"),
        "{}",
        cond.message
    );
    assert!(
        step_opt(&run, "act").is_none_or(|c| c.pod.is_none()),
        "no step starts past the budget"
    );
    assert_eq!(executions_of(&s, "budget", "think"), 1);
    assert_eq!(executions_of(&s, "budget", "think-more"), 1);
    assert_eq!(
        executions_of(&s, "budget", "act"),
        0,
        "nothing ran past the budget"
    );
    s.finish().await;
}

#[tokio::test]
async fn finished_run_is_deleted_after_its_ttl_with_its_pods_and_approvals() {
    let s = Scenario::start("ttl").await;
    let mut spec = gated(None, "Reject");
    spec["ttlSecondsAfterFinished"] = json!(2);
    s.create_run("short-lived", spec).await;
    let approval = wait_for_gate(&s, "short-lived").await;
    s.decide(&approval, "Approved", "ok").await;
    s.wait_finished("short-lived", RUN_TIMEOUT).await;
    agentrun_e2e::wait_for_deleted(&s.runs(), "short-lived", Duration::from_secs(30)).await;
    // The garbage collector removes what the run owned.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let pods = s.list_pods().await.len();
        let approvals = s
            .approvals()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len();
        if pods == 0 && approvals == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{pods} pods and {approvals} approvals left after the run was deleted"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    s.finish().await;
}

#[tokio::test]
async fn two_operators_one_acts_and_the_standby_takes_over_without_duplicates() {
    let s = Scenario::start_without_operator("leader-election").await;
    let mut a_cfg = s.operator_config.clone();
    a_cfg.leader_elect = true;
    a_cfg.identity = "operator-a".into();
    let mut b_cfg = a_cfg.clone();
    b_cfg.identity = "operator-b".into();
    b_cfg.metrics_port = agentrun_e2e::support::processes::free_port();
    b_cfg.health_port = agentrun_e2e::support::processes::free_port();
    let mut a = agentrun_e2e::support::processes::start_operator(&a_cfg);
    // Let A take the lease first.
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = s.env().api();
    let holder = || agentrun_e2e::support::scenario::lease_holder(&leases);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while holder().await.as_deref() != Some("operator-a") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "operator-a never took the lease\n{}",
            a.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut b = agentrun_e2e::support::processes::start_operator(&b_cfg);

    let slow = json!({"steps": (0..6).map(|i| sim_step(&format!("s{i}"), "NonIdempotent", json!({"runMs": 700}))).collect::<Vec<_>>()});
    s.create_run("ha", slow).await;
    s.wait_run("ha", "past its second step", RUN_TIMEOUT, |r| {
        status(r)
            .steps
            .iter()
            .filter(|c| c.phase == StepPhase::Succeeded)
            .count()
            >= 2
    })
    .await;
    let b_log = std::fs::read_to_string(b.log_path()).unwrap_or_default();
    assert!(
        !b_log.contains("created step pod"),
        "the standby acted:\n{b_log}"
    );
    a.kill().await;

    let run = s.wait_finished("ha", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(holder().await.as_deref(), Some("operator-b"));
    let executions = s.ledger().executions_by_key();
    assert_eq!(executions.len(), 6);
    assert!(
        executions.values().all(|n| *n == 1),
        "no step ran twice: {executions:?}"
    );
    let pods = s.list_pods().await.len();
    assert_eq!(pods, 6, "no duplicate pods");
    b.kill().await;
    s.finish().await;
}

/// `/metrics` moves while a run progresses.
#[tokio::test]
async fn metrics_count_steps_and_checkpoints() {
    let s = Scenario::start("metrics").await;
    s.create_run("measured", four_steps()).await;
    s.wait_finished("measured", RUN_TIMEOUT).await;
    let body = agentrun_e2e::get_ok(s.operator_config.metrics_port, "/metrics").await;
    let value = |name: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing:\n{body}"))
    };
    assert_eq!(value("agentrun_steps_started_total"), 4.0);
    assert_eq!(value("agentrun_steps_succeeded_total"), 4.0);
    assert!(value("agentrun_checkpoint_write_duration_seconds_count") >= 4.0);
    assert!(
        body.contains("agentrun_runs{phase=\"Succeeded\"} 1"),
        "{body}"
    );
    assert_eq!(value("agentrun_leader"), 1.0);
    let health = agentrun_e2e::get_ok(s.operator_config.health_port, "/readyz").await;
    assert_eq!(health.trim(), "ok");
    s.finish().await;
}

/// An instance restarted with the same identity (a Pod that restarts in place)
/// takes its Lease back at once instead of waiting for it to expire.
#[tokio::test]
async fn restarted_leader_with_the_same_identity_takes_its_lease_back_at_once() {
    let mut s = Scenario::start_without_operator("lease-same-identity").await;
    let mut cfg = s.operator_config.clone();
    cfg.leader_elect = true;
    cfg.identity = "operator-same".into();
    s.operator_config = cfg;
    s.start_operator(None);
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = s.env().api();
    let renewed = || async {
        leases
            .get_opt("agentrun-operator")
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec)
            .filter(|spec| spec.holder_identity.as_deref() == Some("operator-same"))
            .and_then(|spec| spec.renew_time.or(spec.acquire_time))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while renewed().await.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the operator never took the lease"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // SIGKILL: the Lease is not released and stays valid for its 6 s duration.
    s.kill_operator().await;
    s.start_operator(None);
    let restarted = tokio::time::Instant::now();
    s.create_run(
        "after-restart",
        json!({"steps": [sim_step("only", "None", json!({"runMs": 10}))]}),
    )
    .await;
    let run = s.wait_finished("after-restart", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    let took = restarted.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the restarted leader acted after {took:?}: it waited for its own Lease to expire"
    );
    s.finish().await;
}

/// `kubectl delete ar --cascade=foreground` keeps the run until its Pods are
/// gone, while each Pod waits on the result finalizer: the operator must still
/// act on a run that is being deleted, or both wait forever.
#[tokio::test]
async fn foreground_deletion_of_a_running_run_completes() {
    let s = Scenario::start("foreground-delete").await;
    s.create_run(
        "doomed",
        json!({"steps": [sim_step("slow", "Idempotent", json!({"runMs": 60000}))]}),
    )
    .await;
    s.wait_step_running("doomed", "slow", RUN_TIMEOUT).await;
    s.runs()
        .delete("doomed", &DeleteParams::foreground())
        .await
        .expect("foreground deletion accepted");
    agentrun_e2e::wait_for_deleted(&s.runs(), "doomed", Duration::from_secs(30)).await;
    let pods = s.list_pods().await.len();
    assert_eq!(pods, 0, "the run's Pods went with it");
    s.finish().await;
}

/// D5 whatever the deletion mode: once a running run is deleted, in the
/// background or with its Pods orphaned, no Pod keeps `agentrun.dev/result`.
#[tokio::test]
async fn no_pod_keeps_the_result_finalizer_after_its_run_is_gone() {
    let s = Scenario::start("orphan-delete").await;
    let slow = || json!({"steps": [sim_step("slow", "Idempotent", json!({"runMs": 60000}))]});
    for (run, propagation) in [("background", "Background"), ("orphaned", "Orphan")] {
        s.create_run(run, slow()).await;
        s.wait_step_running(run, "slow", RUN_TIMEOUT).await;
        // The launch is recorded before the Pod is created: wait for the Pod.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !s
            .list_pods()
            .await
            .iter()
            .any(|p| p.name_any().starts_with(run))
        {
            assert!(std::time::Instant::now() < deadline, "no Pod for {run}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let params = DeleteParams {
            propagation_policy: Some(match propagation {
                "Orphan" => kube::api::PropagationPolicy::Orphan,
                _ => kube::api::PropagationPolicy::Background,
            }),
            ..DeleteParams::default()
        };
        s.runs()
            .delete(run, &params)
            .await
            .expect("deletion accepted");
        agentrun_e2e::wait_for_deleted(&s.runs(), run, Duration::from_secs(30)).await;
    }
    s.wait_finalizers_released(Duration::from_secs(30)).await;
    // The orphaned run's Pod stays (that is what Orphan asks for), released.
    let left: Vec<String> = s.list_pods().await.iter().map(|p| p.name_any()).collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].starts_with("orphaned-slow-"), "{left:?}");
    s.finish().await;
}

/// D13 and D16: a run the operator cannot read — here a spec written for a
/// newer API whose schema allows an effect this operator does not know —
/// says so on the run (`Stalled`, reason `Unreadable`, and a Warning Event),
/// and the runs beside it go on. Without the guard, the one object failed the
/// list of every run and nothing was reconciled at all.
#[tokio::test]
async fn a_run_the_operator_cannot_read_says_so_and_holds_up_no_other_run() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let mut s = Scenario::start_without_operator("unreadable").await;
    let client = s.env().client();
    let original = agentrun_operator::api::crds()
        .into_iter()
        .find(|c| c.name_any() == "agentruns.agentrun.dev")
        .expect("the AgentRun CRD");
    let mut newer = serde_json::to_value(&original).unwrap();
    let effect = &mut newer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["steps"]["items"]["properties"]["effect"];
    assert!(effect["enum"].is_array(), "the effect schema: {effect}");
    effect.as_object_mut().unwrap().remove("enum");
    let newer: CustomResourceDefinition = serde_json::from_value(newer).unwrap();
    agentrun_e2e::support::crds::apply_crd(&client, &newer).await;
    let created = {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            // The schema change reaches the API server's handlers shortly
            // after the CRD is Established.
            let run: AgentRun = serde_json::from_value(json!({
                "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                "metadata": {"name": "from-the-future"},
                "spec": {"steps": [{"name": "a", "container": {"image": "tool:1"}}]},
            }))
            .unwrap();
            let mut raw = serde_json::to_value(&run).unwrap();
            raw["spec"]["steps"][0]["effect"] = json!("Sometimes");
            let api: kube::Api<kube::core::DynamicObject> = kube::Api::namespaced_with(
                client.clone(),
                s.namespace(),
                &kube::discovery::ApiResource::erase::<AgentRun>(&()),
            );
            let obj: kube::core::DynamicObject = serde_json::from_value(raw).unwrap();
            match api.create(&Default::default(), &obj).await {
                Ok(o) => break o,
                Err(e) if std::time::Instant::now() < deadline => {
                    eprintln!("not accepted yet: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("creating the run from the newer API: {e}"),
            }
        }
    };
    agentrun_e2e::support::crds::apply_crd(&client, &original).await;
    s.start_operator(None);
    s.create_run(
        "beside-it",
        json!({"steps": [sim_step("a", "Idempotent", json!({"runMs": 100}))]}),
    )
    .await;
    let done = s.wait_finished("beside-it", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    // The typed Api cannot read it either: look at it untyped.
    let api: kube::Api<kube::core::DynamicObject> = kube::Api::namespaced_with(
        client.clone(),
        s.namespace(),
        &kube::discovery::ApiResource::erase::<AgentRun>(&()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let condition = loop {
        let obj = api
            .get("from-the-future")
            .await
            .expect("the unreadable run");
        let found = obj.data["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Stalled").cloned());
        if let Some(c) = found {
            break c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no Stalled condition: {:?}",
            obj.data["status"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(condition["status"], "True", "{condition}");
    assert_eq!(condition["reason"], "Unreadable", "{condition}");
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(message.contains("Sometimes"), "{message}");
    assert!(
        created.data["status"].is_null(),
        "the operator never wrote a phase for it"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !event_counts(&s, "from-the-future")
        .await
        .contains_key("Unreadable")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no Unreadable Event: {:?}",
            event_counts(&s, "from-the-future").await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        s.ledger()
            .entries
            .iter()
            .all(|e| e.run.as_deref() != Some("from-the-future")),
        "nothing ran for it"
    );
    s.finish().await;
}

/// Events on run `run` by reason, counting the repeats of a series.
async fn event_counts(s: &Scenario, run: &str) -> BTreeMap<String, i32> {
    let events: kube::Api<k8s_openapi::api::events::v1::Event> = s.env().api();
    let list = events
        .list(&ListParams::default())
        .await
        .expect("listing events");
    let mut counts = BTreeMap::new();
    for e in list
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(run))
    {
        *counts
            .entry(e.reason.clone().unwrap_or_default())
            .or_insert(0) += e.series.as_ref().map_or(1, |s| s.count);
    }
    counts
}

/// `--step-events=false` leaves out the two Events every step emits, and
/// keeps the ones that call for attention.
#[tokio::test]
async fn without_step_events_only_what_calls_for_attention_is_published() {
    let mut s = Scenario::start_without_operator("quiet-events").await;
    s.operator_config
        .extra_env
        .push(("AGENTRUN_STEP_EVENTS".into(), "false".into()));
    s.start_operator(None);
    s.create_run("quiet", json!({"steps": [
        {"name": "flaky", "effect": "Idempotent", "retry": {"limit": 1, "backoff": {"initial": "1s"}},
         "container": {"image": "registry.example/flaky:1", "env": [{"name": "SIM_STEP",
            "value": json!({"attempts": [{"runMs": 50, "exitCode": 2}, {"runMs": 50}]}).to_string()}]}},
        sim_step("report", "None", json!({"runMs": 50})),
    ]}))
    .await;
    let run = s.wait_finished("quiet", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let counts = loop {
        let counts = event_counts(&s, "quiet").await;
        if counts.contains_key("RunSucceeded") && counts.contains_key("StepRetrying") {
            // Events are published in the order they were decided; give any
            // straggler from earlier decisions a moment before counting.
            tokio::time::sleep(Duration::from_secs(1)).await;
            break event_counts(&s, "quiet").await;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no RunSucceeded and StepRetrying Events yet: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(counts.get("StepRetrying"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("RunSucceeded"), Some(&1), "{counts:?}");
    assert!(
        !counts.contains_key("StepStarted") && !counts.contains_key("StepSucceeded"),
        "{counts:?}"
    );
    // Status still records every start and success.
    for c in &status(&run).steps {
        assert!(
            c.started_at.is_some() && c.finished_at.is_some(),
            "{}",
            c.name
        );
    }
    s.finish().await;
}

/// The ledger's executions of one step of one run.
fn executions_of(s: &Scenario, run: &str, step: &str) -> usize {
    s.ledger()
        .executions()
        .filter(|e| e.run.as_deref() == Some(run) && e.step.as_deref() == Some(step))
        .count()
}

async fn approval_phase(s: &Scenario, name: &str) -> Option<String> {
    let a = s.approvals().get(name).await.unwrap();
    a.status.map(|st| format!("{:?}", st.phase))
}

#[tokio::test]
async fn an_approval_releases_only_the_step_it_was_asked_about() {
    let mut s = Scenario::start("approval-binding").await;

    // D14: the step is edited while its approval waits; the old approval
    // cannot release the new step.
    s.create_run("edited", gated(None, "Reject")).await;
    let first = wait_for_gate(&s, "edited").await;
    let edit =
        json!([{"op": "add", "path": "/spec/steps/1/container/args", "value": ["--amount=9999"]}]);
    s.runs()
        .patch(
            "edited",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::<()>::Json(serde_json::from_value(edit).unwrap()),
        )
        .await
        .expect("editing the gated step");
    let waiting = s
        .wait_run("edited", "a second approval request", RUN_TIMEOUT, |r| {
            step_opt(r, "issue")
                .and_then(|c| c.approval.as_deref())
                .is_some_and(|a| a != first)
        })
        .await;
    let second = step(&waiting, "issue").approval.clone().unwrap();
    assert_eq!(phase(&waiting), Some(RunPhase::WaitingForApproval));
    agentrun_e2e::wait_for(
        &s.approvals(),
        &first,
        |a: Option<&agentrun_operator::api::Approval>| {
            a.and_then(|a| a.status.as_ref())
                .is_some_and(|st| format!("{:?}", st.phase) == "Superseded")
        },
        Duration::from_secs(30),
    )
    .await;
    // The person approves what they were shown: the API server refuses it.
    let patch = json!({"spec": {"decision": "Approved", "comment": "the amount I was shown"}});
    let refused = s
        .approvals()
        .patch(
            &first,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await;
    let message = match refused {
        Err(kube::Error::Api(status)) => status.message,
        other => panic!("a decision on a superseded approval must be refused: {other:?}"),
    };
    assert!(
        message.contains("Superseded")
            && message.contains(&second)
            && message.contains("can no longer be decided"),
        "{message}"
    );
    assert_eq!(executions_of(&s, "edited", "issue"), 0, "nothing ran");
    s.decide(&second, "Approved", "the new amount").await;
    let run = s.wait_finished("edited", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(executions_of(&s, "edited", "issue"), 1);
    let pod = s
        .pods()
        .get(step(&run, "issue").pod.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(
        pod.spec.unwrap().containers[0]
            .args
            .clone()
            .unwrap_or_default(),
        ["--amount=9999"],
        "what ran is what the second approval was asked about"
    );

    // D10: a decision the API server took after the deadline does not win
    // over onTimeout Reject, even with the operator down at the deadline.
    s.create_run("late", gated(Some("3s"), "Reject")).await;
    let name = wait_for_gate(&s, "late").await;
    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    s.decide(&name, "Approved", "sorry, I was away").await;
    s.start_operator(None);
    let run = s.wait_finished("late", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    assert_eq!(
        executions_of(&s, "late", "issue"),
        0,
        "the late approval released nothing"
    );
    assert_eq!(approval_phase(&s, &name).await.as_deref(), Some("Expired"));

    s.finish().await;
}

#[tokio::test]
async fn runs_whose_names_join_alike_each_get_their_own_pods() {
    let s = Scenario::start("names").await;
    let one = |step: &str| json!({"steps": [sim_step(step, "Idempotent", json!({"runMs": 50}))]});
    // `hx` + `b-c` and `hx-b` + `c` both read `hx-b-c`.
    s.create_run("hx", one("b-c")).await;
    s.create_run("hx-b", one("c")).await;
    for name in ["hx", "hx-b"] {
        let run = s.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{name}");
    }
    assert_eq!(executions_of(&s, "hx", "b-c"), 1);
    assert_eq!(executions_of(&s, "hx-b", "c"), 1);
    s.finish().await;
}

#[tokio::test]
async fn a_step_pod_the_api_server_refuses_fails_the_step_with_its_message() {
    let s = Scenario::start("refused").await;
    let mut spec = json!({"steps": [sim_step("a", "Idempotent", json!({"runMs": 50}))]});
    // The Priority admission plugin refuses a Pod naming a missing class.
    spec["podTemplate"] = json!({"priorityClassName": "no-such-class"});
    s.create_run("refused", spec).await;
    let run = s.wait_finished("refused", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    let a = step(&run, "a");
    let message = a.message.clone().unwrap_or_default();
    assert!(
        message.contains("refused its Pod") && message.contains("no-such-class"),
        "{message}"
    );
    assert_eq!(executions_of(&s, "refused", "a"), 0);
    let events = kubectl_ok(&[
        "get",
        "events",
        "-n",
        s.namespace(),
        "--field-selector",
        "reason=FailedCreate,type=Warning",
        "-o",
        "jsonpath={.items[*].note}{.items[*].message}",
    ])
    .await;
    assert!(
        events.contains("no-such-class"),
        "Warning Event FailedCreate: {events}"
    );
    s.finish().await;
}

/// The Rust step SDK reads what the operator really gives a step Pod — its
/// `AGENTRUN_*` environment and the context annotation mounted as the
/// context file — not a hand-written context: the second step sees the
/// first one's result, its own idempotency key, and sends them on.
#[tokio::test]
async fn the_step_sdk_reads_the_context_the_operator_writes() {
    let s = Scenario::start("sdk-context").await;
    s.create_run(
        "sdk",
        json!({"steps": [
            sim_step("lookup", "None", json!({"runMs": 50, "result": {"orderId": "4711", "amount": "12.00 EUR"}})),
            sim_step("refund", "Idempotent", json!({"runMs": 3000})),
        ]}),
    )
    .await;
    let (run, pod_name) = s.wait_step_running("sdk", "refund", RUN_TIMEOUT).await;
    let pod = s.pods().get(&pod_name).await.expect("the refund Pod");
    let container = &pod.spec.as_ref().unwrap().containers[0];
    let mut env: std::collections::HashMap<String, String> = container
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    let context = pod
        .annotations()
        .get(labels::CONTEXT)
        .expect("the context annotation")
        .clone();
    let file = agentrun_e2e::support::processes::log_dir(s.namespace()).join("context.json");
    std::fs::write(&file, &context).expect("writing the context file");
    env.insert(
        agentrun_step::ENV_CONTEXT_FILE.into(),
        file.to_string_lossy().into_owned(),
    );
    let step = agentrun_step::Step::from_env(&env)
        .unwrap_or_else(|e| panic!("the SDK refused the operator's context: {e}\n{context}"));
    assert_eq!(
        step.result_of("lookup").expect("lookup's result"),
        &json!({"orderId": "4711", "amount": "12.00 EUR"})
    );
    let key = status(&run)
        .steps
        .iter()
        .find(|c| c.name == "refund")
        .map(|c| c.idempotency_key.clone())
        .unwrap();
    assert!(
        step.headers()
            .iter()
            .any(|(h, v)| h.eq_ignore_ascii_case("idempotency-key") && *v == key),
        "{:?}",
        step.headers()
    );
    s.wait_finished("sdk", RUN_TIMEOUT).await;
    s.finish().await;
}
