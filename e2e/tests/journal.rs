//! The step journal (D19, D22) on the real control plane, with the chart's
//! admission policies, the operator and the simulated kubelet: a step Pod
//! writes its own step's journal with a token the API server binds to it, and
//! nobody else writes, rewrites or deletes one; a lost attempt is judged by
//! its journal; a call that may have acted is settled in the journal before
//! the next attempt.
//!
//! ```text
//!   step Pod a1 ──TokenRequest(bound to a1)──▶ token ──▶ StepJournal <run>-<step>-<tag>-r1-journal-0
//!        other step's chunk, other attempt, status, delete ──▶ refused (the journals policy)
//!   namespace user with RBAC on stepjournals ──▶ refused
//!   a1 evicted, every call answered ──▶ a2, same key, nobody asked
//!   a1 evicted during a NonIdempotent call ──▶ probe (AGENTRUN_CALL_KEY) ──▶ settlement in status ──▶ a2
//!   the Python SDK, as a1 with its bound token: a model call recorded, then asked
//!   again with another prompt ──▶ JournalMismatch naming position 0, nothing recorded
//! ```

use std::time::Duration;

use agentrun_e2e::support::env::{kubeconfig, repo_root};
use agentrun_e2e::support::journal::{JOURNAL_WRITER_ENV, as_pod, chunk, entry, pod_token};
use agentrun_e2e::support::policies::{
    Policies, assert_refused, kubectl_as, manifest, wait_enforced,
};
use agentrun_e2e::support::scenario::{Scenario, sim_step, status, step_checkpoint};
use agentrun_operator::api::{CallKind, CallState, EffectOutcome, StepJournal, StepPhase};
use agentrun_operator::engine::journal_prefix;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, EvictParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(90);

/// A scenario with the chart's policies for its namespace and an operator
/// that binds journaled steps to the release's journal-writer role.
async fn start(name: &str) -> (Scenario, Policies) {
    let mut s = Scenario::start_without_operator(name).await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    wait_enforced(&ns, true).await;
    s.operator_config.extra_env.push((
        JOURNAL_WRITER_ENV.into(),
        format!("{}-journal-writer", p.release),
    ));
    s.start_operator(None);
    (s, p)
}

/// A journaled NonIdempotent `refund` step whose attempt 1 runs until it is
/// stopped and whose attempt 2 succeeds; then a `notify` step.
fn refund_run(verify: Option<Value>) -> Value {
    let mut refund = sim_step(
        "refund",
        "NonIdempotent",
        json!({"attempts": [{"runMs": 120000}, {"runMs": 50, "result": {"refundId": "rf-1"}}]}),
    );
    refund["journal"] = json!({});
    refund["retry"] = json!({"limit": 1, "backoff": {"initial": "1s", "max": "1s"}});
    if let Some(answer) = verify {
        refund["verify"] = json!({
            "image": "registry.example/agent-step:1",
            "env": [{"name": "SIM_STEP", "value": answer.to_string()}],
        });
    }
    json!({"steps": [refund, sim_step("notify", "Idempotent", json!({}))]})
}

fn refusal(err: kube::Error) -> String {
    match err {
        kube::Error::Api(s) => format!("{} {}", s.code, s.message),
        other => panic!("expected the API server's refusal, got {other}"),
    }
}

#[tokio::test]
async fn a_step_pod_writes_only_its_own_steps_journal_as_its_own_attempt() {
    let (s, p) = start("journal-admission").await;
    let ns = s.namespace().to_owned();
    s.create_run("refund", refund_run(None)).await;
    let (run, pod) = s.wait_step_running("refund", "refund", TIMEOUT).await;
    let uid = run.uid().unwrap();
    let key = step_checkpoint(&run, "refund").idempotency_key;

    // The operator bound the step's ServiceAccount to the journal-writer role.
    let binding = Api::<RoleBinding>::namespaced(s.env().client(), &ns)
        .get("agentrun-journal-writer-default")
        .await
        .expect("the operator binds a journaled step's ServiceAccount");
    assert_eq!(
        binding.role_ref.name,
        format!("{}-journal-writer", p.release)
    );

    let client = as_pod(&s.env().client(), &ns, &pod).await;
    let journals: Api<StepJournal> = Api::namespaced(client, &ns);
    let own = journal_prefix("refund", &uid, "refund", 1);
    let pp = PostParams::default();

    // Its own chunk, as its own attempt: admitted, and appended to.
    let mut c0 = chunk(&own, 0, &run, "refund", 1, vec![]);
    let created = journals
        .create(&pp, &c0)
        .await
        .expect("a step Pod writes its own journal");
    c0.metadata.resource_version = created.resource_version();
    c0.spec.entries = vec![entry(0, CallKind::Model, CallState::Done, &key, 1)];
    journals
        .replace(&c0.name_any(), &pp, &c0)
        .await
        .expect("and appends to it");

    // Another step's journal of the same run.
    let other = journal_prefix("refund", &uid, "notify", 1);
    let e = journals
        .create(&pp, &chunk(&other, 0, &run, "notify", 1, vec![]))
        .await
        .unwrap_err();
    let said = refusal(e);
    assert!(
        said.contains("may write only its own step's chunks"),
        "{said}"
    );
    // Its own step's chunk as another attempt.
    let e = journals
        .create(&pp, &chunk(&own, 1, &run, "refund", 2, vec![]))
        .await
        .unwrap_err();
    let said = refusal(e);
    assert!(said.contains("is attempt 1"), "{said}");
    // A chunk not owned by its run would outlive it.
    let mut orphan = chunk(&own, 1, &run, "refund", 1, vec![]);
    orphan.metadata.owner_references = None;
    let e = journals.create(&pp, &orphan).await.unwrap_err();
    let said = refusal(e);
    assert!(said.contains("is owned by its AgentRun refund"), "{said}");
    // Settling a call is the operator's.
    let settle = json!({"status": {"settlements": [{"seq": 0, "attempt": 1, "outcome": "Applied", "by": "me", "at": "2026-01-01T00:00:00Z"}]}});
    let e = journals
        .patch_status(
            &c0.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&settle),
        )
        .await
        .unwrap_err();
    // (RBAC already: the journal-writer role has no status.)
    let said = refusal(e);
    assert!(said.contains("stepjournals/status"), "{said}");
    // Deleting one would make a retry call again what was done (RBAC
    // already; the policy below, for whoever RBAC lets through).
    let e = journals
        .delete(&c0.name_any(), &DeleteParams::default())
        .await
        .unwrap_err();
    let said = refusal(e);
    assert!(said.contains("cannot delete"), "{said}");

    // A person of the namespace with every RBAC right on journals still may
    // not plant or rewrite one (D22): admission, not RBAC alone.
    let admin = s.env().client();
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "journal-all", "namespace": ns},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["stepjournals", "stepjournals/status"], "verbs": ["*"]}],
    });
    agentrun_e2e::kubectl_ok([
        "apply",
        "-f",
        &manifest(&format!("journal-all-{ns}"), &role),
    ])
    .await;
    agentrun_e2e::kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "journal-all",
        "--role=journal-all",
        "--user=mallory",
    ])
    .await;
    let planted = serde_json::to_value(chunk(&own, 1, &run, "refund", 1, vec![])).unwrap();
    let out = kubectl_as(
        "mallory",
        &[],
        &ns,
        &[
            "create",
            "-f",
            &manifest(&format!("planted-{ns}"), &planted),
        ],
    )
    .await;
    assert_refused(&out, "writes no journal");
    let out = kubectl_as(
        "mallory",
        &[],
        &ns,
        &["delete", "stepjournal", &c0.name_any()],
    )
    .await;
    assert_refused(&out, "goes with its run");
    let settle_doc = settle.to_string();
    let out = kubectl_as(
        "mallory",
        &[],
        &ns,
        &[
            "patch",
            "stepjournal",
            &c0.name_any(),
            "--subresource=status",
            "--type=merge",
            "-p",
            &settle_doc,
        ],
    )
    .await;
    assert_refused(&out, "only the operator");

    // The fence: once a newer attempt wrote the chunk, attempt 1 may not.
    let as_admin: Api<StepJournal> = Api::namespaced(admin, &ns);
    let mut taken = as_admin.get(&c0.name_any()).await.unwrap();
    taken.spec.attempt = 2;
    as_admin.replace(&c0.name_any(), &pp, &taken).await.unwrap();
    let mut late = journals.get(&c0.name_any()).await.unwrap();
    late.spec.attempt = 1;
    late.spec
        .entries
        .push(entry(1, CallKind::Tool, CallState::Intent, &key, 1));
    let e = journals
        .replace(&c0.name_any(), &pp, &late)
        .await
        .unwrap_err();
    let said = refusal(e);
    assert!(
        said.contains("a newer attempt has taken this journal over"),
        "{said}"
    );
    s.finish().await;
}

#[tokio::test]
async fn a_lost_attempt_whose_calls_were_answered_runs_again_and_an_open_call_is_settled_first() {
    let (s, _p) = start("journal-resume").await;
    let ns = s.namespace().to_owned();
    // The probe finds the refund of the open call made.
    s.create_run(
        "refund",
        refund_run(Some(json!({"runMs": 50, "rawMessage": "{\"effect\": \"Applied\", \"result\": {\"refundId\": \"rf-9\"}}"}))),
    )
    .await;
    let (run, pod) = s.wait_step_running("refund", "refund", TIMEOUT).await;
    let uid = run.uid().unwrap();
    let key = step_checkpoint(&run, "refund").idempotency_key;
    let journals: Api<StepJournal> =
        Api::namespaced(as_pod(&s.env().client(), &ns, &pod).await, &ns);
    let prefix = journal_prefix("refund", &uid, "refund", 1);
    // Attempt 1 answered three calls and started a NonIdempotent fourth.
    let entries = vec![
        entry(0, CallKind::Model, CallState::Done, &key, 1),
        entry(1, CallKind::Tool, CallState::Done, &key, 1),
        entry(2, CallKind::Model, CallState::Done, &key, 1),
        entry(3, CallKind::Tool, CallState::Intent, &key, 1),
    ];
    journals
        .create(
            &PostParams::default(),
            &chunk(&prefix, 0, &run, "refund", 1, entries),
        )
        .await
        .expect("attempt 1 records its calls");
    s.pods().evict(&pod, &EvictParams::default()).await.unwrap();

    // The probe is asked about call 3, with the call's own key.
    let probe = s
        .wait_run("refund", "the probe of call 3", TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.role == agentrun_operator::api::StepRole::Verify && c.pod.is_some())
        })
        .await;
    let probe_pod = status(&probe)
        .steps
        .iter()
        .find(|c| c.role == agentrun_operator::api::StepRole::Verify)
        .and_then(|c| c.pod.clone())
        .unwrap();
    let p = s.pods().get(&probe_pod).await.unwrap();
    let env: Vec<(String, String)> = p.spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    let call_key = agentrun_operator::api::call_key(&key, "call_3");
    assert!(
        env.contains(&("AGENTRUN_CALL_KEY".into(), call_key)),
        "{env:?}"
    );
    assert!(
        env.contains(&("AGENTRUN_CALL_SEQ".into(), "3".into())),
        "{env:?}"
    );

    let done = s.wait_finished("refund", TIMEOUT).await;
    let c = step_checkpoint(&done, "refund");
    assert_eq!(
        (c.phase, c.attempt),
        (StepPhase::Succeeded, 2),
        "{:?}",
        c.message
    );
    // Settled in the journal, by the probe, with what it found.
    let settled = journals.get(&format!("{prefix}0")).await.unwrap();
    let s0 = &settled.status.expect("settled").settlements[0];
    assert_eq!(
        (s0.seq, s0.outcome, s0.by.as_str()),
        (3, EffectOutcome::Applied, "verify")
    );
    assert_eq!(s0.response.as_deref(), Some(r#"{"refundId":"rf-9"}"#));
    // Nobody was asked, and the journal's two model calls count once.
    assert!(
        s.approvals()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert_eq!(status(&done).tokens_used, 680);
    s.finish().await;
}

/// The Python SDK's loop (sdk/python) as attempt 1 of the run's `refund`
/// step, with a token bound to its Pod: asks the model `prompt` at
/// position 0; prints what it got, or the mismatch and exits 3.
fn python_loop(env: &[(&str, String)], prompt: &str) -> (std::process::ExitStatus, String, String) {
    const SCRIPT: &str = r#"
import base64, json, os, sys, tempfile
from agentrun_step.journal import Journal, JournalMismatch
if "PLANE_CA_B64" in os.environ:
    ca = tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False)
    ca.write(base64.b64decode(os.environ["PLANE_CA_B64"])); ca.close()
    os.environ["AGENTRUN_JOURNAL_CA_FILE"] = ca.name
j = Journal.from_env()
prompt = sys.argv[1]
ask = lambda req: ({"role": "assistant", "content": "answer to " + prompt}, {"input": 12, "output": 3})
try:
    got = j.model({"model": "gpt-test", "messages": [{"role": "user", "content": prompt}]}, ask)
except JournalMismatch as e:
    print(json.dumps({"mismatch": str(e), "seq": e.seq})); sys.exit(3)
print(json.dumps({"answer": got, "new": j.new, "replayed": j.replayed}))
"#;
    let out = std::process::Command::new("python3")
        .args(["-c", SCRIPT, prompt])
        .env("PYTHONPATH", repo_root().join("sdk/python"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("python3 runs (the SDK's tests need it too)");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_python_sdk_refuses_a_changed_prompt_on_retry_and_names_the_position() {
    let (s, _p) = start("journal-sdk-mismatch").await;
    let ns = s.namespace().to_owned();
    s.create_run("refund", refund_run(None)).await;
    let (run, pod) = s.wait_step_running("refund", "refund", TIMEOUT).await;
    let uid = run.uid().unwrap();
    let key = step_checkpoint(&run, "refund").idempotency_key;
    let token = tempfile_with(&pod_token(&s.env().client(), &ns, &pod).await);
    let kc = kube::config::Kubeconfig::read_from(kubeconfig()).expect("the plane's kubeconfig");
    let cluster = kc.clusters[0].cluster.clone().expect("a cluster");
    // The CA as a file (the kubeconfig names one) or as base64 the script decodes.
    let ca = match (
        &cluster.certificate_authority,
        &cluster.certificate_authority_data,
    ) {
        (Some(path), _) => ("AGENTRUN_JOURNAL_CA_FILE", path.clone()),
        (None, Some(data)) => ("PLANE_CA_B64", data.clone()),
        (None, None) => panic!("the plane's kubeconfig names no CA"),
    };
    let server = cluster.server.clone().expect("a server");
    let (host, port) = server
        .strip_prefix("https://")
        .and_then(|hp| hp.trim_end_matches('/').rsplit_once(':'))
        .unwrap_or_else(|| panic!("an https://host:port server, got {server}"));
    let env = [
        (
            "KUBERNETES_SERVICE_HOST",
            host.trim_matches(['[', ']']).to_owned(),
        ),
        ("KUBERNETES_SERVICE_PORT", port.to_owned()),
        (
            "AGENTRUN_JOURNAL",
            journal_prefix("refund", &uid, "refund", 1),
        ),
        ("AGENTRUN_NAMESPACE", ns.clone()),
        ("AGENTRUN_RUN", "refund".to_owned()),
        ("AGENTRUN_RUN_UID", uid.clone()),
        ("AGENTRUN_STEP", "refund".to_owned()),
        ("AGENTRUN_PLAN_REVISION", "1".to_owned()),
        ("AGENTRUN_ATTEMPT", "1".to_owned()),
        ("AGENTRUN_IDEMPOTENCY_KEY", key),
        ("AGENTRUN_JOURNAL_TOKEN_FILE", token.display().to_string()),
        (ca.0, ca.1),
    ];
    // The loop asks, and its answer is recorded through the API server.
    let (status, out, err) = python_loop(&env, "refund order 4711");
    assert!(status.success(), "{out}{err}");
    assert!(out.contains(r#""new": 1"#), "{out}");
    // Its container restarts with the same prompt: replayed, not asked.
    let (status, out, err) = python_loop(&env, "refund order 4711");
    assert!(status.success(), "{out}{err}");
    assert!(
        out.contains(r#""replayed": 1"#) && out.contains(r#""new": 0"#),
        "{out}"
    );
    // ... and with another prompt: refused, naming the position.
    let (status, out, err) = python_loop(&env, "refund order 4712");
    assert_eq!(status.code(), Some(3), "{out}{err}");
    assert!(out.contains(r#""seq": 0"#), "{out}");
    assert!(out.contains("journal position 0"), "{out}");
    // The journal holds the first answer, once.
    let journals: Api<StepJournal> = Api::namespaced(s.env().client(), &ns);
    let c0 = journals
        .get(&format!("{}0", journal_prefix("refund", &uid, "refund", 1)))
        .await
        .unwrap();
    assert_eq!(c0.spec.entries.len(), 1);
    assert!(
        c0.spec.entries[0]
            .response
            .as_deref()
            .is_some_and(|r| r.contains("answer to refund order 4711")),
        "{:?}",
        c0.spec.entries[0].response
    );
    s.finish().await;
}

/// A file holding `text`, kept for the test's life.
fn tempfile_with(text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("agentrun-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("token-{}", text.len()));
    std::fs::write(&path, text).unwrap();
    path
}
