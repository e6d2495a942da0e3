//! Step journals as a step Pod writes them (D19, docs/journal.md): a token
//! bound to the Pod from the API server's TokenRequest (so the API server
//! puts the Pod's name in the request's identity, as for a mounted token),
//! and chunks built the way the step SDKs build them.

use agentrun_operator::api::{
    CallKind, CallState, CallTokens, Effect, JournalEntry, StepJournal, StepJournalSpec, call_key,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::Api;
use kube::{Client, ResourceExt};

use crate::kubectl_ok;

/// The operator's setting of the ClusterRole it binds a journaled step's
/// ServiceAccount to (`--journal-writer-role`): a test's policies render it
/// as `<release>-journal-writer`.
pub const JOURNAL_WRITER_ENV: &str = "AGENTRUN_JOURNAL_WRITER_ROLE";
use crate::support::env::client_with_token;

/// A client that is step Pod `pod` of namespace `ns`: a token the API
/// server binds to the Pod (`kubectl create token --bound-object-kind Pod`).
pub async fn as_pod(client: &Client, ns: &str, pod: &str) -> Client {
    client_with_token(&pod_token(client, ns, pod).await).await
}

/// A token of Pod `pod`'s ServiceAccount bound to the Pod (what the API
/// server projects into a journaled step's Pod), valid ten minutes.
pub async fn pod_token(client: &Client, ns: &str, pod: &str) -> String {
    let p: Pod = Api::namespaced(client.clone(), ns)
        .get(pod)
        .await
        .unwrap_or_else(|e| panic!("reading pod {pod}: {e}"));
    let sa = p
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".to_owned());
    let uid = p.uid().expect("a Pod has a UID");
    let out = kubectl_ok([
        "-n",
        ns,
        "create",
        "token",
        &sa,
        "--bound-object-kind=Pod",
        &format!("--bound-object-name={pod}"),
        &format!("--bound-object-uid={uid}"),
        "--duration=10m",
    ])
    .await;
    out.trim().to_owned()
}

/// Chunk `n` of the journal with chunk prefix `prefix`, owned by its run,
/// written by `attempt`, holding `entries`.
pub fn chunk(
    prefix: &str,
    n: i32,
    run: &agentrun_operator::api::AgentRun,
    step: &str,
    attempt: i32,
    entries: Vec<JournalEntry>,
) -> StepJournal {
    let mut j = StepJournal::new(
        &format!("{prefix}{n}"),
        StepJournalSpec {
            run_name: run.name_any(),
            run_uid: run.uid().unwrap_or_default(),
            step: step.to_owned(),
            plan_revision: 1,
            chunk: n,
            first_seq: entries.first().map_or(0, |e| e.seq),
            attempt,
            sealed: false,
            entries,
        },
    );
    j.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "agentrun.dev/v1alpha1".into(),
        kind: "AgentRun".into(),
        name: run.name_any(),
        uid: run.uid().unwrap_or_default(),
        ..OwnerReference::default()
    }]);
    j.metadata.labels = Some([(agentrun_operator::labels::RUN.to_owned(), run.name_any())].into());
    j
}

/// A model call answered, or a NonIdempotent tool call answered or only
/// started (`Intent`), as recorded by `attempt` under the step key `key`.
pub fn entry(seq: i64, kind: CallKind, state: CallState, key: &str, attempt: i32) -> JournalEntry {
    let call_id = format!("call_{seq}");
    JournalEntry {
        seq,
        kind,
        request_digest: format!("{seq:064x}"),
        effect: (kind == CallKind::Tool).then_some(Effect::NonIdempotent),
        key: (kind == CallKind::Tool).then(|| call_key(key, &call_id)),
        name: (kind == CallKind::Tool).then(|| "issue_refund".to_owned()),
        state,
        attempt,
        response: (state == CallState::Done).then(|| r#"{"ok":true}"#.to_owned()),
        error: None,
        tokens: (kind == CallKind::Model).then_some(CallTokens {
            input: 300,
            output: 40,
            cached: 0,
        }),
        started_at: None,
        finished_at: None,
        call_id,
    }
}
