//! D18 on the real control plane, with the operator and the simulated
//! kubelet: a finished run leaves a RunRecord that outlives its TTL; a
//! GitOps re-sync that applies the same manifest again after the TTL deleted
//! the run (server-side, under Argo CD's field manager) runs nothing; running
//! it again on purpose takes a new `agentrun.dev/rerun` value; a crash
//! between the record and the status loses nothing and writes no second one.
//! A record under a name the operator does not give is not history, and a
//! flood of runs past `--history-max-per-namespace` pushes no record out
//! inside its retention (D22). Who may write records: tests/authz/records.rs.

use std::time::Duration;

use agentrun_e2e::ledger::LedgerEvent;
use agentrun_e2e::support::kubectl::kubectl_ok;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, EffectOutcome, RunPhase, RunRecord};
use kube::Api;
use kube::ResourceExt;
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);
/// Argo CD's field manager for server-side apply.
const ARGO_CD: &str = "argocd-controller";

/// Executions of `run`'s steps the kubelet started, in order.
fn executions(s: &Scenario, run: &str) -> Vec<String> {
    s.ledger()
        .entries
        .into_iter()
        .filter(|e| e.event == LedgerEvent::Started && e.run.as_deref() == Some(run))
        .filter_map(|e| e.step)
        .collect()
}

fn manifest(s: &Scenario, name: &str, rerun: Option<&str>) -> Value {
    let mut metadata = json!({"name": name, "namespace": s.namespace()});
    if let Some(token) = rerun {
        metadata["annotations"] = json!({"agentrun.dev/rerun": token});
    }
    json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": metadata,
        "spec": {
            "ttlSecondsAfterFinished": 2,
            "steps": [sim_step("refund", "NonIdempotent", json!({"runMs": 50, "result": {"refund": "r-1"}}))],
        },
    })
}

/// What a GitOps controller does on every sync: a server-side apply of the
/// manifest in Git under its own field manager.
async fn sync(s: &Scenario, manifest: &Value) {
    let dir = tempdir(s);
    let path = dir.join(format!(
        "{}.json",
        manifest["metadata"]["name"].as_str().unwrap()
    ));
    std::fs::write(&path, manifest.to_string()).unwrap();
    kubectl_ok([
        "apply",
        "--server-side",
        "--field-manager",
        ARGO_CD,
        "-f",
        path.to_str().unwrap(),
    ])
    .await;
}

fn tempdir(s: &Scenario) -> std::path::PathBuf {
    let dir = s.ledger_path.parent().unwrap().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until the TTL deleted the run `uid` (its name is free, or another run holds it).
async fn wait_deleted(s: &Scenario, name: &str, uid: &str) {
    let deadline = tokio::time::Instant::now() + RUN_TIMEOUT;
    loop {
        match s.runs().get_opt(name).await.unwrap() {
            Some(r) if r.uid().as_deref() == Some(uid) => {}
            _ => return,
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run {name} was not deleted by its TTL"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn records(s: &Scenario) -> Api<RunRecord> {
    s.env().api()
}

async fn records_of(s: &Scenario, run: &str) -> Vec<RunRecord> {
    let mut out: Vec<RunRecord> = records(s)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|r| r.spec.run.name == run)
        .collect();
    out.sort_by_key(|r| r.spec.outcome.completed_at.0);
    out
}

async fn finished(s: &Scenario, name: &str) -> AgentRun {
    s.wait_run(name, "finished or already ran", RUN_TIMEOUT, |r| {
        phase(r).is_some_and(RunPhase::is_terminal)
    })
    .await
}

#[tokio::test]
async fn a_gitops_resync_after_the_ttl_runs_nothing_again() {
    let s = Scenario::start("history-resync").await;
    let name = "refund-order-4711";
    sync(&s, &manifest(&s, name, None)).await;
    let first = finished(&s, name).await;
    assert_eq!(
        phase(&first),
        Some(RunPhase::Succeeded),
        "{:#?}",
        first.status
    );
    let first_uid = first.uid().unwrap();
    let key = status(&first).steps[0].idempotency_key.clone();
    wait_deleted(&s, name, &first_uid).await;

    // The record outlived the run.
    let recs = records_of(&s, name).await;
    assert_eq!(recs.len(), 1, "one record per finished run");
    let rec = &recs[0].spec;
    assert_eq!(rec.run.uid, first_uid);
    assert_eq!(rec.outcome.phase, RunPhase::Succeeded);
    assert_eq!(rec.steps[0].idempotency_key, key);
    assert_eq!(rec.steps[0].effect, Some(EffectOutcome::Applied));
    assert_eq!(
        status(&first).record.as_deref(),
        Some(recs[0].name_any().as_str()),
        "the status that ended the run names its record"
    );

    // The next sync creates it again: it runs nothing and says why.
    sync(&s, &manifest(&s, name, None)).await;
    let again = finished(&s, name).await;
    assert_ne!(again.uid().unwrap(), first_uid);
    assert_eq!(
        phase(&again),
        Some(RunPhase::AlreadyRan),
        "{:#?}",
        again.status
    );
    let prior = status(&again).already_ran.expect("names the earlier run");
    assert_eq!(prior.run_uid, first_uid);
    assert_eq!(prior.record, recs[0].name_any());
    assert_eq!(prior.outcome, "Succeeded");
    let ready = status(&again)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "AlreadyRan")
    );
    assert_eq!(
        executions(&s, name),
        ["refund"],
        "the refund was issued once"
    );
    // It stays (its TTL does not apply), so the next sync changes nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    sync(&s, &manifest(&s, name, None)).await;
    let still = s.runs().get(name).await.unwrap();
    assert_eq!(
        still.uid(),
        again.uid(),
        "a re-sync of a settled run is a no-op"
    );
    assert_eq!(executions(&s, name), ["refund"]);
    assert_eq!(
        records_of(&s, name).await.len(),
        1,
        "a run that ran nothing leaves no record"
    );

    // Running it again is a deliberate act: a new rerun value.
    s.runs().delete(name, &Default::default()).await.unwrap();
    wait_deleted(&s, name, &again.uid().unwrap()).await;
    sync(&s, &manifest(&s, name, Some("incident-42"))).await;
    let rerun = finished(&s, name).await;
    assert_eq!(
        phase(&rerun),
        Some(RunPhase::Succeeded),
        "{:#?}",
        rerun.status
    );
    assert_eq!(executions(&s, name), ["refund", "refund"]);
    wait_deleted(&s, name, &rerun.uid().unwrap()).await;
    let recs = records_of(&s, name).await;
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[1].spec.run.rerun.as_deref(), Some("incident-42"));
    // ... and syncing that manifest again does not run it a third time.
    sync(&s, &manifest(&s, name, Some("incident-42"))).await;
    let third = finished(&s, name).await;
    assert_eq!(phase(&third), Some(RunPhase::AlreadyRan));
    assert_eq!(
        status(&third).already_ran.unwrap().run_uid,
        rerun.uid().unwrap()
    );
    assert_eq!(executions(&s, name), ["refund", "refund"]);
    s.finish().await;
}

/// The operator dies right after storing the record, before the status
/// that names it: the next operator decides again, finds the record its
/// predecessor stored, and the run is recorded once and deleted once.
#[tokio::test]
async fn a_crash_between_the_record_and_the_status_loses_nothing() {
    let mut s = Scenario::start_without_operator("history-crash").await;
    s.start_operator(Some("after-record"));
    let name = "refund-order-4712";
    sync(&s, &manifest(&s, name, None)).await;
    s.wait_operator_crash(RUN_TIMEOUT).await;
    let run = s.runs().get(name).await.unwrap();
    assert!(
        !phase(&run).is_some_and(RunPhase::is_terminal),
        "the status write after the record never happened: {:#?}",
        run.status
    );
    let recs = records_of(&s, name).await;
    assert_eq!(recs.len(), 1, "the record was stored first");
    s.start_operator(None);
    wait_deleted(&s, name, &run.uid().unwrap()).await;
    let recs = records_of(&s, name).await;
    assert_eq!(recs.len(), 1, "one record, not two");
    assert_eq!(recs[0].spec.run.uid, run.uid().unwrap());
    assert_eq!(recs[0].spec.outcome.phase, RunPhase::Succeeded);
    assert_eq!(executions(&s, name), ["refund"]);
    s.finish().await;
}

/// Running a recorded manifest again is decided when the run is created: with
/// the chart's runs policy, the `agentrun.dev/rerun` annotation goes in with
/// the create (by whoever may create runs) and nobody adds or changes it on
/// an existing run — frank, who may patch runs, is refused; his other
/// annotation edits are not.
#[tokio::test]
async fn the_rerun_annotation_is_set_at_creation_only() {
    use agentrun_e2e::support::policies::{
        Policies, assert_admitted, assert_refused, kubectl_as, wait_enforced,
    };
    let s = Scenario::start_without_operator("history-rerun-policy").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    p.grant_authors(&ns, &["erin"]).await;
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "role",
        "patchers",
        "--verb=get,patch,update",
        "--resource=agentruns.agentrun.dev",
    ])
    .await;
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "patchers",
        "--role=patchers",
        "--user=frank",
    ])
    .await;
    wait_enforced(&ns, true).await;

    let dir = tempdir(&s);
    let write = |name: &str, doc: &Value| {
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, doc.to_string()).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let with = write("with", &manifest(&s, "refund-with", Some("incident-42")));
    assert_admitted(
        &kubectl_as("erin", &[], &ns, &["create", "-f", &with]).await,
        "erin creates a run with agentrun.dev/rerun",
    );
    let without = write("without", &manifest(&s, "refund-without", None));
    assert_admitted(
        &kubectl_as("erin", &[], &ns, &["create", "-f", &without]).await,
        "erin creates a run without it",
    );
    let refusal = "metadata.annotations[agentrun.dev/rerun] runs a recorded manifest again on purpose and is set when the run is created";
    for (run, value) in [("refund-without", "sneaky"), ("refund-with", "incident-43")] {
        let out = kubectl_as(
            "frank",
            &[],
            &ns,
            &[
                "annotate",
                "--overwrite",
                "agentrun",
                run,
                &format!("agentrun.dev/rerun={value}"),
            ],
        )
        .await;
        assert_refused(&out, refusal);
    }
    assert_refused(
        &kubectl_as(
            "frank",
            &[],
            &ns,
            &["annotate", "agentrun", "refund-with", "agentrun.dev/rerun-"],
        )
        .await,
        refusal,
    );
    assert_admitted(
        &kubectl_as(
            "frank",
            &[],
            &ns,
            &[
                "annotate",
                "agentrun",
                "refund-with",
                "team.example/ticket=T-1",
            ],
        )
        .await,
        "frank may annotate otherwise",
    );
    drop(p);
    s.finish().await;
}

/// A record under a name the operator does not give (an administrator's
/// copy, or one planted before only the operator could write records) is
/// not history: with the run's own record gone and only such a copy left,
/// the manifest created again runs.
#[tokio::test]
async fn a_record_under_another_name_never_makes_a_run_already_ran() {
    let s = Scenario::start("history-planted-name").await;
    let name = "refund-order-4713";
    sync(&s, &manifest(&s, name, None)).await;
    let first = finished(&s, name).await;
    assert_eq!(phase(&first), Some(RunPhase::Succeeded));
    wait_deleted(&s, name, &first.uid().unwrap()).await;
    let recs = records_of(&s, name).await;
    assert_eq!(recs.len(), 1);
    let original = &recs[0];

    // The same record, labels and annotations, under another name (as the
    // plane's administrator, in system:masters); the operator's own removed.
    let mut copy = RunRecord::new(&format!("{name}-copy"), original.spec.clone());
    copy.metadata.labels = original.metadata.labels.clone();
    copy.metadata.annotations = original.metadata.annotations.clone();
    records(&s)
        .create(&Default::default(), &copy)
        .await
        .unwrap();
    records(&s)
        .delete(&original.name_any(), &Default::default())
        .await
        .unwrap();

    sync(&s, &manifest(&s, name, None)).await;
    let again = finished(&s, name).await;
    assert_eq!(
        phase(&again),
        Some(RunPhase::Succeeded),
        "a copy under another name is not the run's history: {:#?}",
        again.status
    );
    assert_eq!(executions(&s, name), ["refund", "refund"]);
    s.finish().await;
}

/// D22: `--history-max-per-namespace` never pushes a record out inside its
/// retention. With a cap of 2 and a pruning every second, four cheap runs
/// after the refund leave five records; the refund's stays, its GitOps
/// re-creation still runs nothing, and the namespace is reported past the
/// cap (the gauge, the operator's warning).
#[tokio::test]
async fn a_flood_of_runs_past_the_cap_does_not_push_out_a_record_inside_its_retention() {
    let mut s = Scenario::start_without_operator("history-flood").await;
    s.operator_config.extra_env = vec![
        ("AGENTRUN_HISTORY_MAX_PER_NAMESPACE".into(), "2".into()),
        ("AGENTRUN_HISTORY_PRUNE_SECONDS".into(), "1".into()),
    ];
    s.start_operator(None);
    let name = "refund-order-4714";
    sync(&s, &manifest(&s, name, None)).await;
    let first = finished(&s, name).await;
    assert_eq!(phase(&first), Some(RunPhase::Succeeded));
    wait_deleted(&s, name, &first.uid().unwrap()).await;

    let cheap = json!({
        "ttlSecondsAfterFinished": 1,
        "steps": [sim_step("noop", "None", json!({"runMs": 10}))],
    });
    let mut uids = Vec::new();
    for i in 0..4 {
        let run = s.create_run(&format!("cheap-{i}"), cheap.clone()).await;
        uids.push(run.uid().unwrap());
    }
    // The TTL waits for each record: deleted means recorded.
    for (i, uid) in uids.iter().enumerate() {
        wait_deleted(&s, &format!("cheap-{i}"), uid).await;
    }
    // Three prunings at least, with five records against a cap of two.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let kept = records_of(&s, name).await;
    assert_eq!(
        kept.len(),
        1,
        "the refund's record, inside its retention, was pushed out by the count"
    );
    let all = records(&s).list(&Default::default()).await.unwrap().items;
    assert_eq!(all.len(), 5, "nothing inside the retention is removed");

    // Reported by the pruning (a scrape may fall between two).
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], s.operator_config.metrics_port));
    let series = format!(
        "agentrun_history_records_over_cap{{namespace=\"{}\"}} 3",
        s.namespace()
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = agentrun_e2e::support::http::http_get(addr, "/metrics")
            .await
            .unwrap();
        assert_eq!(code, 200);
        let history: Vec<&str> = body.lines().filter(|l| l.contains("history")).collect();
        if history.contains(&series.as_str()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {series} in:\n{}",
            history.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let log = std::fs::read_to_string(s.operator_log()).unwrap();
    assert!(
        log.contains("more run records inside the retention than --history-max-per-namespace"),
        "the operator does not warn"
    );

    sync(&s, &manifest(&s, name, None)).await;
    let again = finished(&s, name).await;
    assert_eq!(
        phase(&again),
        Some(RunPhase::AlreadyRan),
        "{:#?}",
        again.status
    );
    assert_eq!(
        executions(&s, name),
        ["refund"],
        "the refund was issued once"
    );
    s.finish().await;
}
