//! Step Pods on the real local node (`e2e/cluster node up`): a kubelet, containerd and runc
//! run the example refund agent and the node-probe image; the payments service on the
//! node bridge's gateway counts what really happened. No simkubelet runs here, and every
//! test fails (never skips) when the node is missing.

use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::node::{
    NODE_NAME, NODE_PROBE_IMAGE, Payments, container, node_scenario, pod_template,
};
use agentrun_e2e::support::scenario::{Scenario, phase, status, step_checkpoint};
use agentrun_operator::api::{AgentRun, RunPhase, StepPhase};
use k8s_openapi::api::core::v1::Pod;
use kube::api::EvictParams;
use serde_json::{Value, json};

/// Real containers start in seconds, but the machine is shared with builds.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

fn probe(args: &[&str]) -> Value {
    container(NODE_PROBE_IMAGE, args, json!([]))
}

fn assert_succeeded(run: &AgentRun) {
    assert_eq!(
        phase(run),
        Some(RunPhase::Succeeded),
        "run {} did not succeed: {}",
        run.metadata.name.as_deref().unwrap_or("?"),
        serde_json::to_string_pretty(&run.status).unwrap_or_default()
    );
}

async fn finished(s: &Scenario, name: &str) -> AgentRun {
    s.wait_finished(name, RUN_TIMEOUT).await
}

/// `config/samples/<sample>` as it is, after the ConfigMap `refund-agent` its steps read
/// (`envFrom`), pointing at the example payments service on the node's bridge.
async fn apply_sample(s: &Scenario, payments: &Payments, sample: &str) {
    let configmap = serde_json::to_string(&json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "refund-agent", "namespace": s.namespace()},
        "data": {"PAYMENTS_API_URL": payments.url()},
    }))
    .expect("json");
    let cm_file = agentrun_e2e::support::processes::log_dir(s.namespace()).join("configmap.json");
    std::fs::write(&cm_file, configmap).expect("writing the ConfigMap");
    let sample = agentrun_e2e::repo_root()
        .join("config/samples")
        .join(sample);
    for f in [&cm_file, &sample] {
        kubectl_ok([
            "apply".as_ref(),
            "-n".as_ref(),
            s.namespace().as_ref(),
            "-f".as_ref(),
            f.as_os_str(),
        ])
        .await;
    }
}

/// config/samples/agentrun_refund.yaml as it is, with the example image, against the
/// example payments service (its URL in the ConfigMap the sample reads).
#[tokio::test]
async fn refund_sample_runs_to_completion_on_the_real_node() {
    let s = node_scenario("node-refund").await;
    let payments = Payments::start(s.namespace(), 0.0).await;
    apply_sample(&s, &payments, "agentrun_refund.yaml").await;
    let waiting = s
        .wait_run(
            "refund-order-4711",
            "waiting for approval",
            RUN_TIMEOUT,
            |r| phase(r) == Some(RunPhase::WaitingForApproval),
        )
        .await;
    let approval = step_checkpoint(&waiting, "issue-refund")
        .approval
        .expect("issue-refund names its Approval");
    s.decide(&approval, "Approved", "checked the photos").await;
    let run = finished(&s, "refund-order-4711").await;
    assert_succeeded(&run);

    assert_eq!(
        step_checkpoint(&run, "lookup-order").result,
        Some(
            json!({"orderId": 4711, "amount": "23.90 EUR", "status": "delivered",
                    "customer": "c-1029", "note": "item arrived damaged"})
        )
    );
    // draft-refund read lookup-order's result from its context file.
    assert_eq!(
        step_checkpoint(&run, "draft-refund").result,
        Some(
            json!({"orderId": 4711, "amount": "23.90 EUR", "reason": "item arrived damaged",
                    "confidence": 0.92})
        )
    );
    let issue = step_checkpoint(&run, "issue-refund");
    assert_eq!(
        issue.result,
        Some(
            json!({"refundId": "re_0001", "orderId": 4711, "amount": "23.90 EUR",
                    "state": "succeeded", "replayed": false})
        )
    );
    assert_eq!(
        step_checkpoint(&run, "notify-customer").result,
        Some(json!({"messageId": "msg-00001", "channel": "email"}))
    );
    let draft_tokens = step_checkpoint(&run, "draft-refund")
        .tokens
        .expect("draft-refund reported tokens");
    assert!(
        draft_tokens.input > 0 && draft_tokens.output > 0,
        "{draft_tokens:?}"
    );
    assert_eq!(status(&run).tokens_used, draft_tokens.total());

    // What the payments service saw: one refund, made with the step's key.
    let ledger = payments.ledger().await;
    let refunds = ledger["refunds"].as_array().expect("refunds");
    assert_eq!(refunds.len(), 1, "ledger: {ledger}");
    assert_eq!(refunds[0]["idempotencyKey"], json!(issue.idempotency_key));
    assert_eq!(ledger["requestsByKey"][&issue.idempotency_key], json!(1));

    // The Pods really ran on the node.
    let pod = s
        .pods()
        .get(issue.pod.as_deref().expect("pod"))
        .await
        .expect("issue-refund pod");
    assert_eq!(
        pod.spec.and_then(|p| p.node_name).as_deref(),
        Some(NODE_NAME)
    );
    s.finish().await;
}

#[tokio::test]
async fn context_file_holds_the_previous_steps_result() {
    let s = node_scenario("node-context").await;
    s.create_run(
        "context",
        json!({
            "podTemplate": pod_template(),
            "steps": [
                {"name": "first", "effect": "None", "timeout": "60s",
                 "container": probe(&["sleep", "--seconds", "0.1"])},
                {"name": "second", "effect": "None", "timeout": "60s",
                 "container": probe(&["context"])},
            ],
        }),
    )
    .await;
    let run = finished(&s, "context").await;
    assert_succeeded(&run);
    let second = step_checkpoint(&run, "second");
    assert_eq!(
        second.result,
        Some(json!({
            "results": [{"step": "first", "result": {"slept": 0.1}}],
            "idempotencyKey": second.idempotency_key,
            "attempt": 1,
        }))
    );
    s.finish().await;
}

/// config/samples/agentrun_evicted.yaml as it is, following its own comments: the
/// payments service keeps a new refund pending 20 s, issue-refund's Pod is evicted while
/// it waits (as the comment's `kubectl create --raw …/eviction` does), and what the
/// comment says to expect is what happens.
#[tokio::test]
async fn evicted_sample_runs_as_it_is_and_refunds_once() {
    let s = node_scenario("node-evict-sample").await;
    let payments = Payments::start(s.namespace(), 20.0).await;
    apply_sample(&s, &payments, "agentrun_evicted.yaml").await;
    let (before, pod) = s
        .wait_step_running("evict-demo", "issue-refund", RUN_TIMEOUT)
        .await;
    let key = step_checkpoint(&before, "issue-refund")
        .idempotency_key
        .clone();
    payments.wait_for_refund().await;
    let eviction = format!(
        r#"{{"apiVersion":"policy/v1","kind":"Eviction","metadata":{{"name":"{pod}","namespace":"{}"}}}}"#,
        s.namespace()
    );
    let file = agentrun_e2e::support::processes::log_dir(s.namespace()).join("eviction.json");
    std::fs::write(&file, eviction).expect("writing the Eviction");
    let raw = format!("/api/v1/namespaces/{}/pods/{pod}/eviction", s.namespace());
    kubectl_ok([
        "create".as_ref(),
        "--raw".as_ref(),
        raw.as_ref(),
        "-f".as_ref(),
        file.as_os_str(),
    ])
    .await;

    let run = finished(&s, "evict-demo").await;
    assert_succeeded(&run);
    let issue = step_checkpoint(&run, "issue-refund");
    // "disruptions: 1 and failures: 0 … a new attempt Pod with the same key"
    assert_eq!((issue.disruptions, issue.failures), (1, 0), "{issue:#?}");
    assert_eq!(issue.idempotency_key, key);
    assert_ne!(issue.pod.as_deref(), Some(pod.as_str()));
    // "answers with the first refund (result "replayed": true)"
    assert_eq!(
        issue.result.as_ref().map(|r| r["replayed"].clone()),
        Some(json!(true))
    );
    // "GET /ledger shows one refund and two requests with that key"
    let ledger = payments.ledger().await;
    assert_eq!(
        ledger["refunds"].as_array().map(Vec::len),
        Some(1),
        "ledger: {ledger}"
    );
    assert_eq!(ledger["requestsByKey"][&key], json!(2), "ledger: {ledger}");
    s.finish().await;
}

#[tokio::test]
async fn evicted_step_reruns_with_the_same_key_and_refunds_once() {
    let s = node_scenario("node-evict").await;
    // A refund stays pending 20 s: the step is still running when it is evicted.
    let payments = Payments::start(s.namespace(), 20.0).await;
    s.create_run(
        "evict",
        json!({
            "podTemplate": pod_template(),
            "steps": [
                {"name": "lookup-order", "effect": "None", "timeout": "60s",
                 "container": payments.agent(&["lookup-order", "--order-id=4711"])},
                {"name": "draft-refund", "effect": "None", "timeout": "60s",
                 "container": payments.agent(&["draft-refund"])},
                {"name": "issue-refund", "effect": "Idempotent", "timeout": "120s",
                 "container": payments.agent(&["issue-refund", "--from-context=draft-refund"])},
            ],
        }),
    )
    .await;
    let (before, pod) = s
        .wait_step_running("evict", "issue-refund", RUN_TIMEOUT)
        .await;
    let key = step_checkpoint(&before, "issue-refund")
        .idempotency_key
        .clone();
    // Evict once the refund exists: the effect has happened, the step has not finished.
    payments.wait_for_refund().await;
    s.pods()
        .evict(&pod, &EvictParams::default())
        .await
        .expect("eviction accepted");
    // The kubelet stops the container and reports the disruption; the watch sees that
    // update before the Pod goes (the operator's finalizer holds it until its outcome is
    // recorded).
    let p = agentrun_e2e::wait_for(
        &s.pods(),
        &pod,
        |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|st| st.phase.as_deref())
                == Some("Failed")
        },
        Duration::from_secs(60),
    )
    .await
    .expect("the evicted Pod, Failed");
    let cond = p
        .status
        .as_ref()
        .and_then(|st| st.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "DisruptionTarget").cloned())
        .expect("the evicted Pod carries DisruptionTarget");
    assert_eq!(
        (cond.status.as_str(), cond.reason.as_deref()),
        ("True", Some("EvictionByEvictionAPI"))
    );
    // SIGTERM reached the agent, which stopped at once (the SDK's handler: 128 + 15),
    // rather than being killed after the grace period (137).
    let exit = p
        .status
        .and_then(|st| st.container_statuses)
        .and_then(|cs| cs.into_iter().next())
        .and_then(|c| c.state)
        .and_then(|st| st.terminated)
        .map(|t| t.exit_code);
    assert_eq!(exit, Some(143));

    let run = finished(&s, "evict").await;
    assert_succeeded(&run);
    let issue = step_checkpoint(&run, "issue-refund");
    assert_eq!(issue.idempotency_key, key, "same key after the eviction");
    assert_eq!(
        (issue.disruptions, issue.failures, issue.attempt),
        (1, 0, 2)
    );
    assert_ne!(
        issue.pod.as_deref(),
        Some(pod.as_str()),
        "a new Pod for attempt 2"
    );
    assert_eq!(
        issue.result,
        Some(
            json!({"refundId": "re_0001", "orderId": 4711, "amount": "23.90 EUR",
                    "state": "succeeded", "replayed": true})
        )
    );
    // Two requests carried the key; the payments service refunded once.
    let ledger = payments.ledger().await;
    assert_eq!(
        ledger["refunds"].as_array().map(Vec::len),
        Some(1),
        "ledger: {ledger}"
    );
    assert_eq!(ledger["requestsByKey"][&key], json!(2), "ledger: {ledger}");

    // `kubectl agentrun logs` shows both attempts, in order, each headed.
    let out = tokio::process::Command::new(agentrun_e2e::support::processes::plugin_binary())
        .arg("--kubeconfig")
        .arg(agentrun_e2e::kubeconfig())
        .args(["-n", s.namespace(), "logs", "evict", "issue-refund"])
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("running kubectl-agentrun logs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let second_pod = issue.pod.clone().expect("attempt 2's Pod");
    let at = |needle: String| {
        text.find(&needle).unwrap_or_else(|| {
            panic!(
                "the logs lack {needle:?}:\n{text}\nstderr: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
    };
    // The evicted attempt's Pod was deleted, and its logs with it, once its
    // disruption was recorded: it is named in order, not skipped.
    let first = at("==> step issue-refund, attempt 1: its Pod is gone".to_owned());
    let second = at(format!(
        "==> {second_pod} (step issue-refund, attempt 2, step) <=="
    ));
    let said = at(r#"refund-agent issue-refund: {"refundId": "re_0001""#.to_owned());
    assert!(
        first < second && second < said,
        "attempts out of order:\n{text}"
    );
    assert!(
        !text.contains(&pod),
        "the evicted Pod {pod} is gone:\n{text}"
    );
    s.finish().await;
}

#[tokio::test]
async fn oom_killed_step_is_a_failure_with_that_reason() {
    let s = node_scenario("node-oom").await;
    let mut c = probe(&["oom", "--mib", "400"]);
    c["resources"] = json!({"limits": {"memory": "64Mi"}, "requests": {"memory": "64Mi"}});
    s.create_run(
        "oom",
        json!({
            "podTemplate": pod_template(),
            "steps": [{"name": "hog", "effect": "None", "timeout": "90s",
                       "retry": {"limit": 0}, "container": c}],
        }),
    )
    .await;
    let run = finished(&s, "oom").await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    let hog = step_checkpoint(&run, "hog");
    assert_eq!(hog.phase, StepPhase::Failed);
    assert_eq!(hog.failures, 1);
    let message = hog.message.unwrap_or_default();
    assert!(
        message.contains("OOMKilled"),
        "checkpoint message: {message}"
    );
    s.finish().await;
}

const PARTIAL: &str = r#"{"result":{"error":"upstream tool returned 503 after 2 of 5 pages","pagesDone":2},"tokens":{"input":12,"output":3}}"#;

async fn run_partial(s: &Scenario) -> AgentRun {
    s.create_run(
        "partial",
        json!({
            "podTemplate": pod_template(),
            "steps": [{"name": "pages", "effect": "None", "timeout": "60s",
                       "retry": {"limit": 0}, "container": probe(&["fail-partial"])}],
        }),
    )
    .await;
    s.wait_finished("partial", RUN_TIMEOUT).await
}

#[tokio::test]
async fn non_zero_exit_with_a_partial_message_is_a_failure_that_counts_its_tokens() {
    let s = node_scenario("node-partial").await;
    let run = run_partial(&s).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    let pages = step_checkpoint(&run, "pages");
    assert_eq!((pages.phase, pages.failures), (StepPhase::Failed, 1));
    assert_eq!(
        pages.message.as_deref(),
        Some(
            r#"attempt 1 exited with code 3 (Error): "upstream tool returned 503 after 2 of 5 pages"; no retries left (limit 0)"#
        )
    );
    // Tokens of a failed attempt still count (D9): read from the partial message.
    assert_eq!(status(&run).tokens_used, 15);
    // The kubelet delivered the partial message in the container's terminated state.
    let pod = s
        .pods()
        .get(pages.pod.as_deref().expect("pod"))
        .await
        .expect("the step Pod");
    let term = pod
        .status
        .and_then(|st| st.container_statuses)
        .and_then(|cs| cs.into_iter().next())
        .and_then(|c| c.state)
        .and_then(|st| st.terminated)
        .expect("a terminated container");
    assert_eq!(
        (term.exit_code, term.message.as_deref()),
        (3, Some(PARTIAL))
    );
    s.finish().await;
}

/// A failed attempt's checkpoint says what the step said: the `error` the SDK
/// wrote into its termination message, next to the exit code.
#[tokio::test]
async fn a_failed_attempts_partial_message_is_shown_in_its_checkpoint() {
    let s = node_scenario("node-partial-shown").await;
    let run = run_partial(&s).await;
    let message = step_checkpoint(&run, "pages").message.unwrap_or_default();
    assert!(
        message.contains("upstream tool returned 503 after 2 of 5 pages"),
        "checkpoint message: {message}"
    );
    s.finish().await;
}

#[tokio::test]
async fn kubectl_logs_shows_a_step_pods_output() {
    let s = node_scenario("node-logs").await;
    s.create_run(
        "logs",
        json!({
            "podTemplate": pod_template(),
            "steps": [{"name": "talk", "effect": "None", "timeout": "60s",
                       "container": probe(&["logs", "--lines", "3"])}],
        }),
    )
    .await;
    let run = finished(&s, "logs").await;
    assert_succeeded(&run);
    let pod = step_checkpoint(&run, "talk").pod.expect("pod");
    let out = kubectl_ok(["logs", "-n", s.namespace(), &pod]).await;
    assert_eq!(
        out,
        "probe log line 1 of 3 (step talk)\nprobe log line 2 of 3 (step talk)\nprobe log line 3 of 3 (step talk)\n"
    );
    s.finish().await;
}
