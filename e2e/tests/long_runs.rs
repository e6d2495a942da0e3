//! Long runs on the real control plane with the operator and the simulated
//! kubelet: past 50 checkpoints the oldest are stored compressed in
//! `status.archivedSteps` (crates/api/src/archive.rs), and nothing of the contract
//! moves: every step runs once, across an operator restart, and every
//! checkpoint reads back. Under an AgentRun CRD that prunes the archive (one
//! older than the operator), the operator finds out before it archives and
//! keeps every checkpoint in `status.steps`, and asks again a while later. And an operator whose CRD is
//! replaced under it, as every upgrade does, still sees the runs created after.
//!
//! ```text
//!   c0 … c24 | c25 … c59      stored: archivedSteps {count: 25, data} + steps [c25 … c59]
//! ```
//!
//! Fails (never skips) without the plane.

use std::collections::BTreeMap;
use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::ledger::LedgerEvent;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{CheckpointState, RunPhase, StepPhase};
use serde_json::{Value, json};
use tokio::sync::RwLock;

const RUN_TIMEOUT: Duration = Duration::from_secs(240);
const STEPS: usize = 60;

/// The AgentRun CRD is the cluster's: the test that replaces it holds this
/// exclusively, the others shared.
static CRD: RwLock<()> = RwLock::const_new(());

/// `n` quick steps of every effect in turn.
fn long_spec(n: usize) -> Value {
    let effects = ["None", "Idempotent", "NonIdempotent"];
    let steps: Vec<Value> = (0..n)
        .map(|i| sim_step(&format!("s{i:02}"), effects[i % 3], json!({"runMs": 5})))
        .collect();
    json!({ "steps": steps })
}

/// The run as the API server stores it.
async fn stored(s: &Scenario, run: &str) -> Value {
    let out = kubectl_ok(["get", "agentrun", run, "-n", s.namespace(), "-o", "json"]).await;
    serde_json::from_str(&out).expect("kubectl get -o json prints JSON")
}

/// How many Pods the kubelet started for each step of `run`.
fn starts(s: &Scenario, run: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for e in s.ledger().entries {
        if e.event == LedgerEvent::Started && e.run.as_deref() == Some(run) {
            *out.entry(e.step.unwrap_or_default()).or_default() += 1;
        }
    }
    out
}

#[tokio::test]
async fn a_long_run_archives_its_oldest_checkpoints_and_runs_each_step_once_across_a_restart() {
    let _crd = CRD.read().await;
    let mut s = Scenario::start("long-archive").await;
    s.create_run("long", long_spec(STEPS)).await;

    // The operator is killed once the archive is stored, and started again.
    let deadline = tokio::time::Instant::now() + RUN_TIMEOUT;
    while stored(&s, "long").await["status"]["archivedSteps"]["count"] != json!(25) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no archive within {RUN_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.kill_operator().await;
    s.start_operator(None);

    let run = s.wait_finished("long", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    // Read back: every checkpoint, in order, each committed once.
    let st = status(&run);
    let names: Vec<&str> = st.steps.iter().map(|c| c.name.as_str()).collect();
    let want: Vec<String> = (0..STEPS).map(|i| format!("s{i:02}")).collect();
    assert_eq!(names, want, "every checkpoint, in start order");
    for c in &st.steps {
        assert_eq!(c.phase, StepPhase::Succeeded, "{c:?}");
        assert_eq!(c.checkpoint, CheckpointState::Committed, "{c:?}");
        assert_eq!(c.attempt, 1, "{c:?}");
    }
    // As stored: the oldest 25 archived, 35 readable.
    let raw = stored(&s, "long").await;
    assert_eq!(
        raw["status"]["archivedSteps"]["count"], 25,
        "{}",
        raw["status"]
    );
    let inline = raw["status"]["steps"].as_array().expect("status.steps");
    assert_eq!(inline.len(), STEPS - 25);
    assert_eq!(inline[0]["name"], "s25");
    // Each step's Pod started once: the archive is never mistaken for steps not run.
    let starts = starts(&s, "long");
    assert_eq!(starts.len(), STEPS, "{starts:?}");
    assert!(starts.values().all(|&n| n == 1), "{starts:?}");
    s.finish().await;
}

/// Puts the installed AgentRun CRD back: [`RestoreCrd::now`], or when
/// dropped (the test may panic).
struct RestoreCrd(Option<Value>);

impl RestoreCrd {
    fn now(&mut self) {
        let Some(crd) = self.0.take() else {
            return;
        };
        let file = std::env::temp_dir().join(format!("agentrun-crd-{}.json", std::process::id()));
        std::fs::write(&file, crd.to_string()).expect("writing the CRD");
        let status = std::process::Command::new(agentrun_e2e::support::kubectl::kubectl_binary())
            .args(["replace", "-f"])
            .arg(&file)
            .status()
            .expect("running kubectl replace");
        assert!(status.success(), "putting the AgentRun CRD back failed");
    }
}

impl Drop for RestoreCrd {
    fn drop(&mut self) {
        self.now();
    }
}

/// Waits until the API server keeps `status.archivedSteps` (`kept`) or
/// prunes it: it serves a replaced CRD's schema a moment after the replace,
/// and an operator whose dry run meets the older schema keeps every
/// checkpoint inline for its lifetime.
async fn wait_archive_served(s: &Scenario, run: &str, kept: bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = kubectl_ok([
            "patch",
            "agentrun",
            run,
            "-n",
            s.namespace(),
            "--subresource=status",
            "--type=merge",
            "--dry-run=server",
            "-o",
            "json",
            "-p",
            r#"{"status":{"archivedSteps":{"count":0,"data":""}}}"#,
        ])
        .await;
        let answer: Value = serde_json::from_str(&out).expect("kubectl patch -o json prints JSON");
        if answer["status"]["archivedSteps"].is_object() == kept {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "status.archivedSteps kept: {} 60 s after the CRD was replaced",
            !kept
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The installed AgentRun CRD as `kubectl replace` takes it back, and the
/// same CRD without `status.archivedSteps` (the one before the archive existed).
async fn installed_and_older_crd() -> (Value, Value) {
    let crd_json = kubectl_ok(["get", "crd", "agentruns.agentrun.dev", "-o", "json"]).await;
    let installed: Value = serde_json::from_str(&crd_json).unwrap();
    let mut original = installed.clone();
    for k in [
        "resourceVersion",
        "uid",
        "creationTimestamp",
        "generation",
        "managedFields",
    ] {
        original["metadata"].as_object_mut().unwrap().remove(k);
    }
    original.as_object_mut().unwrap().remove("status");
    let mut older = installed;
    older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        .as_object_mut()
        .unwrap()
        .remove("archivedSteps")
        .expect("the installed CRD has status.archivedSteps");
    (original, older)
}

/// `kubectl replace` of the AgentRun CRD with `crd`.
async fn replace_crd(crd: &Value) {
    let file =
        std::env::temp_dir().join(format!("agentrun-replaced-crd-{}.json", std::process::id()));
    std::fs::write(&file, crd.to_string()).unwrap();
    kubectl_ok(["replace", "-f", file.to_str().unwrap()]).await;
}

/// Steps of the run "pruned": past the 50 checkpoints a status keeps inline.
const PRUNED_STEPS: usize = 55;

/// A scenario without an operator yet, the older CRD in place of the one
/// the test environment installed, and the run "pruned" created under it
/// (its status served without `archivedSteps`). The operator starts once
/// that CRD is served: replacing a CRD under a running operator is
/// `an_operator_whose_crd_is_replaced_under_it_still_sees_new_runs`'s.
async fn pruned_run_under_the_older_crd(test_name: &str) -> (Scenario, RestoreCrd) {
    let s = Scenario::start_without_operator(test_name).await;
    let (original, older) = installed_and_older_crd().await;
    let restore = RestoreCrd(Some(original));
    replace_crd(&older).await;
    s.create_run("pruned", long_spec(PRUNED_STEPS)).await;
    wait_archive_served(&s, "pruned", false).await;
    (s, restore)
}

/// The run "pruned" of `n` steps finishes with every checkpoint in
/// `status.steps`, each step run once, and the operator says why.
async fn pruned_run_stays_inline(s: &Scenario, n: usize) {
    let run = s.wait_finished("pruned", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    assert_eq!(status(&run).steps.len(), n);
    let raw = stored(s, "pruned").await;
    assert!(
        raw["status"].get("archivedSteps").is_none(),
        "{}",
        raw["status"]
    );
    assert_eq!(raw["status"]["steps"].as_array().map(Vec::len), Some(n));
    let pruned_starts = starts(s, "pruned");
    assert_eq!(pruned_starts.len(), n, "{pruned_starts:?}");
    assert!(pruned_starts.values().all(|&k| k == 1), "{pruned_starts:?}");
    let log = std::fs::read_to_string(s.operator_log()).expect("the operator's log");
    assert!(
        log.contains("the API server dropped status.archivedSteps"),
        "the operator says why it keeps every checkpoint inline"
    );
}

#[tokio::test]
async fn under_a_crd_that_prunes_the_archive_every_checkpoint_stays_in_steps() {
    let _crd = CRD.write().await;
    let (mut s, mut restore) = pruned_run_under_the_older_crd("long-pruned").await;
    s.start_operator(None);
    pruned_run_stays_inline(&s, PRUNED_STEPS).await;
    restore.now();
    wait_archive_served(&s, "pruned", true).await;
    s.finish().await;
}

/// An operator that found the archive pruned asks again: once the CRD of
/// this release is applied, the same process archives the next long run.
#[tokio::test]
async fn an_operator_that_found_the_archive_pruned_archives_again_once_the_crd_is_applied() {
    let _crd = CRD.write().await;
    let (mut s, mut restore) = pruned_run_under_the_older_crd("long-recheck").await;
    // It asks again 2 s after it found the archive pruned (5 minutes by default).
    s.operator_config
        .extra_env
        .push(("AGENTRUN_ARCHIVE_RECHECK_SECONDS".into(), "2".into()));
    s.start_operator(None);
    pruned_run_stays_inline(&s, PRUNED_STEPS).await;
    // The CRD of this release is applied after all: the same operator asks
    // again and archives the next long run.
    restore.now();
    wait_archive_served(&s, "pruned", true).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    s.create_run("archived", long_spec(PRUNED_STEPS)).await;
    let run = s.wait_finished("archived", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    assert_eq!(status(&run).steps.len(), PRUNED_STEPS);
    let raw = stored(&s, "archived").await;
    assert_eq!(
        raw["status"]["archivedSteps"]["count"],
        25,
        "the next long run is archived again ({} checkpoints inline)",
        raw["status"]["steps"].as_array().map_or(0, Vec::len)
    );
    let archived_starts = starts(&s, "archived");
    assert_eq!(archived_starts.len(), PRUNED_STEPS, "{archived_starts:?}");
    assert!(
        archived_starts.values().all(|&k| k == 1),
        "{archived_starts:?}"
    );
    let log = std::fs::read_to_string(s.operator_log()).expect("the operator's log");
    assert!(
        log.contains("asking the API server again whether it keeps status.archivedSteps"),
        "the operator says it asks again"
    );
    s.finish().await;
}

/// What every upgrade does (docs/install.md: the CRDs first, then `helm
/// upgrade`): the AgentRun CRD is replaced under a running operator, the API
/// server rebuilds its storage and ends the watches it served, and the
/// operator's watch cannot resume (410 Gone) and lists again. A run created
/// in that gap still starts and finishes, and so does one created after the
/// CRD is put back.
///
/// The operator is stopped (SIGSTOP) across each replace, so the run created
/// meanwhile reaches it only through that list. The reconcile of a listed
/// run used to be able to start before the reflector's cache held the list,
/// take the run for deleted and never look at it again: the operator seemed
/// blind to it (three times in `make test` under load; the race itself is
/// `controller::relist`'s unit test).
#[tokio::test]
async fn an_operator_whose_crd_is_replaced_under_it_still_sees_new_runs() {
    const SEEN: Duration = Duration::from_secs(60);
    // The API server tears an old storage down, ending its watches, a
    // second after it stops serving new requests from it.
    const TEARDOWN: Duration = Duration::from_secs(3);
    let _crd = CRD.write().await;
    let s = Scenario::start("crd-replaced").await;
    // The operator's watches are established before the CRD changes.
    s.create_run("before", long_spec(3)).await;
    s.wait_finished("before", RUN_TIMEOUT).await;
    let (original, older) = installed_and_older_crd().await;
    let mut restore = RestoreCrd(Some(original));
    let operator = s.operator.as_ref().expect("an operator is running");
    for (step, run) in ["replaced", "restored"].into_iter().enumerate() {
        assert!(operator.pause(), "SIGSTOP to the operator");
        if step == 0 {
            replace_crd(&older).await;
        } else {
            restore.now();
        }
        tokio::time::sleep(TEARDOWN).await;
        s.create_run(run, long_spec(3)).await;
        assert!(operator.resume(), "SIGCONT to the operator");
        let done = s.wait_finished(run, SEEN).await;
        assert_eq!(
            phase(&done),
            Some(RunPhase::Succeeded),
            "{:#?}",
            done.status
        );
        let starts = starts(&s, run);
        assert_eq!(starts.len(), 3, "{starts:?}");
        assert!(starts.values().all(|&k| k == 1), "{starts:?}");
    }
    // Each run came through a list: the watch was told its version is gone.
    let log = std::fs::read_to_string(s.operator_log()).expect("the operator's log");
    let relists = log
        .lines()
        .filter(|l| {
            l.contains("watch failed") && l.contains("\"agentruns\"") && l.contains("Expired")
        })
        .count();
    assert!(
        relists >= 2,
        "the AgentRun watch expired {relists} times, not after each replace"
    );
    // The next test's operator meets the full schema.
    wait_archive_served(&s, "restored", true).await;
    s.finish().await;
}
