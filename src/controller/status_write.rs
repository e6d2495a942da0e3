//! The status write: a JSON patch of what changed, fenced by the
//! resourceVersion the decision was made on (D3), and the archive of a long
//! run's oldest checkpoints kept only where the API server keeps it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{debug, error, info};

use super::patch::{is_status, patch_params};
use crate::api::{AgentRun, AgentRunStatus, archive};

/// Writes `new` as the status of `run`: a JSON patch (RFC 6902) of only what
/// changed since the status the decision was made on, so that a step of a
/// long run sends a few hundred bytes rather than the whole status (which a
/// server-side apply of the owned status did, O(n) per step and O(n²) per
/// run). The patch first sets `metadata.resourceVersion` to the version the
/// decision was made on; the apiserver refuses an update whose
/// resourceVersion is not the stored one with 409 Conflict, so the write is
/// fenced exactly as the apply was (D3), and since the stored status is then
/// the one the diff was taken from, the patch applies to what it was made for.
///
/// A 422 means the patch did not apply to what is stored (a checkpoint it
/// replaces is gone: the run was re-planned on a newer copy); the whole
/// status is then written once instead, under the same precondition, which
/// answers 409 when the run has moved on.
pub(super) async fn write_status(
    runs: &Api<AgentRun>,
    run: &AgentRun,
    new: &AgentRunStatus,
) -> Result<AgentRun, kube::Error> {
    if archive_recheck_due(Instant::now()) {
        archive::set_enabled(true);
        ARCHIVE_KEPT.store(false, Ordering::Relaxed);
        info!(
            "asking the API server again whether it keeps status.archivedSteps (the next write that archives is a dry run first)"
        );
    }
    if archive_grows(run.status.as_ref(), new) && !ARCHIVE_KEPT.load(Ordering::Relaxed) {
        let dry_run = PatchParams {
            dry_run: true,
            ..patch_params()
        };
        let tried = send(runs, run, new, &dry_run).await?;
        if holds_every_checkpoint(&tried, new) {
            ARCHIVE_KEPT.store(true, Ordering::Relaxed);
            info!(
                "the API server keeps status.archivedSteps: long runs archive their oldest checkpoints"
            );
        } else {
            archive_off(Instant::now());
            error!(
                recheck_after = ?archive_recheck(),
                "the API server dropped status.archivedSteps (the AgentRun CRD is older than the operator: apply the CRDs of this release); every checkpoint stays in status.steps"
            );
        }
    }
    let written = send(runs, run, new, &patch_params()).await?;
    if holds_every_checkpoint(&written, new) {
        return Ok(written);
    }
    // The archive was dropped after all (the CRD was replaced since the dry
    // run): every checkpoint goes back into status.steps, at once, from the
    // status this write was made of.
    archive_off(Instant::now());
    error!(
        run = %run.name_any(),
        "the API server dropped status.archivedSteps (the AgentRun CRD was replaced by an older one); writing every checkpoint into status.steps"
    );
    let whole = status_patch(None, new, written.resource_version().as_deref());
    runs.patch_status(&run.name_any(), &patch_params(), &Patch::Json::<()>(whole))
        .await
}

/// Whether this process has seen the API server keep `status.archivedSteps`
/// (a dry run of the first write that archives checkpoints).
static ARCHIVE_KEPT: AtomicBool = AtomicBool::new(false);

/// Since when this process has kept every checkpoint inline because the API
/// server pruned `status.archivedSteps`. The CRDs of a release are applied
/// moments before its operator starts, so the answer may be the older CRD's:
/// after [`archive_recheck`] the operator asks again.
static ARCHIVE_OFF_SINCE: Mutex<Option<Instant>> = Mutex::new(None);

/// How long the archive stays off before the operator asks again: 5 minutes,
/// or `AGENTRUN_ARCHIVE_RECHECK_SECONDS` (the tests' shorter wait).
fn archive_recheck() -> Duration {
    static RECHECK: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *RECHECK.get_or_init(|| {
        std::env::var("AGENTRUN_ARCHIVE_RECHECK_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(300), Duration::from_secs)
    })
}

fn archive_off(now: Instant) {
    archive::set_enabled(false);
    *ARCHIVE_OFF_SINCE.lock().unwrap_or_else(|e| e.into_inner()) = Some(now);
}

/// Whether the archive has been off for [`archive_recheck`]: true once per
/// period, which then starts again only if the next dry run is pruned too.
fn archive_recheck_due(now: Instant) -> bool {
    let mut off = ARCHIVE_OFF_SINCE.lock().unwrap_or_else(|e| e.into_inner());
    match *off {
        Some(since) if now.saturating_duration_since(since) >= archive_recheck() => {
            *off = None;
            true
        }
        _ => false,
    }
}

/// Whether writing `new` over `old` moves checkpoints into the archive.
fn archive_grows(old: Option<&AgentRunStatus>, new: &AgentRunStatus) -> bool {
    let archived = archive::archived_len(&new.steps);
    archived > old.map_or(0, |s| archive::archived_len(&s.steps))
}

/// Whether the object the API server answered with holds every checkpoint
/// of the status written (an archive it pruned would take some away).
fn holds_every_checkpoint(answer: &AgentRun, new: &AgentRunStatus) -> bool {
    answer.status.as_ref().map_or(0, |s| s.steps.len()) == new.steps.len()
}

/// The status patch of `new` over what `run` holds, and the whole status
/// once if the patch does not apply.
async fn send(
    runs: &Api<AgentRun>,
    run: &AgentRun,
    new: &AgentRunStatus,
    params: &PatchParams,
) -> Result<AgentRun, kube::Error> {
    let name = run.name_any();
    let rv = run.resource_version();
    let patch = status_patch(run.status.as_ref(), new, rv.as_deref());
    match runs
        .patch_status(&name, params, &Patch::Json::<()>(patch))
        .await
    {
        Err(err) if is_status(&err, 422) && run.status.is_some() => {
            debug!(error = %err, "the status diff does not apply; writing the whole status");
            let whole = status_patch(None, new, rv.as_deref());
            runs.patch_status(&name, params, &Patch::Json::<()>(whole))
                .await
        }
        other => other,
    }
}

/// The JSON patch that turns `old` (the status the decision was made on;
/// `None` when the run has none yet) into `new`, under a resourceVersion
/// precondition when `resource_version` is known.
///
/// The apiserver applies a patch to the stored object before it compares
/// resourceVersions, so a patch decided on a status that has moved on must
/// still apply to the newer one for the write to end in 409 rather than in
/// 422. Hence whole values only: a changed top-level field is set whole, a
/// changed checkpoint (of `steps`, `compensations`) is replaced whole at its
/// index, new checkpoints are added at theirs — paths that a newer status
/// has too, since checkpoints are only ever appended.
pub(super) fn status_patch(
    old: Option<&AgentRunStatus>,
    new: &AgentRunStatus,
    resource_version: Option<&str>,
) -> json_patch::Patch {
    use serde_json::Value;
    let to_json = |s: &AgentRunStatus| serde_json::to_value(s).unwrap_or_default();
    let mut ops = Vec::new();
    if let Some(rv) = resource_version {
        ops.push(json!({"op": "replace", "path": "/metadata/resourceVersion", "value": rv}));
    }
    let (Some(old), Value::Object(new)) = (old.map(to_json), to_json(new)) else {
        ops.push(json!({"op": "add", "path": "/status", "value": to_json(new)}));
        return serde_json::from_value(Value::Array(ops))
            .expect("the operations built here are JSON patch operations");
    };
    let empty = serde_json::Map::new();
    let old = old.as_object().unwrap_or(&empty);
    // Checkpoints moved into the archive shift every index of `steps`: the
    // list is then set whole, with the archive, in the same write.
    let archived = old.get("archivedSteps") != new.get("archivedSteps");
    // Status keys are camelCase field names: no '/' or '~' to escape.
    for (key, value) in &new {
        match (old.get(key), value) {
            (Some(a), b) if a == b => {}
            (Some(Value::Array(a)), Value::Array(b))
                if key == "compensations" || (key == "steps" && !archived) =>
            {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    if x != y {
                        ops.push(json!({"op": "replace", "path": format!("/status/{key}/{i}"), "value": y}));
                    }
                }
                for (i, y) in b.iter().enumerate().skip(a.len()) {
                    ops.push(
                        json!({"op": "add", "path": format!("/status/{key}/{i}"), "value": y}),
                    );
                }
                for i in (b.len()..a.len()).rev() {
                    ops.push(json!({"op": "remove", "path": format!("/status/{key}/{i}")}));
                }
            }
            _ => ops.push(json!({"op": "add", "path": format!("/status/{key}"), "value": value})),
        }
    }
    for key in old.keys().filter(|k| !new.contains_key(*k)) {
        ops.push(json!({"op": "remove", "path": format!("/status/{key}")}));
    }
    serde_json::from_value(Value::Array(ops))
        .expect("the operations built here are JSON patch operations")
}

#[cfg(test)]
mod tests {
    use super::status_patch;
    use crate::api::{AgentRunStatus, CheckpointState, StepCheckpoint, StepPhase};
    use serde_json::{Value, json};

    fn checkpoint(i: usize, phase: StepPhase) -> StepCheckpoint {
        StepCheckpoint {
            name: format!("step-{i:03}"),
            plan_revision: 1,
            attempt: 1,
            idempotency_key: format!("key-{i:03}"),
            pod: Some(format!("run-step-{i:03}-1")),
            phase,
            checkpoint: if phase == StepPhase::Succeeded {
                CheckpointState::Committed
            } else {
                CheckpointState::default()
            },
            result: (phase == StepPhase::Succeeded).then(|| json!({"rows": "z".repeat(1000)})),
            ..Default::default()
        }
    }

    /// A run `done` steps in, step `done` running.
    fn status(done: usize) -> AgentRunStatus {
        let mut steps: Vec<StepCheckpoint> = (0..done)
            .map(|i| checkpoint(i, StepPhase::Succeeded))
            .collect();
        steps.push(checkpoint(done, StepPhase::Running));
        AgentRunStatus {
            steps,
            ..Default::default()
        }
    }

    fn stored(rv: &str, status: Option<&AgentRunStatus>) -> Value {
        let mut doc = json!({"metadata": {"name": "run", "resourceVersion": rv}});
        if let Some(s) = status {
            doc["status"] = serde_json::to_value(s).unwrap();
        }
        doc
    }

    #[test]
    fn committing_step_500_sends_that_step_and_the_next_not_the_whole_status() {
        let (old, new) = (status(499), status(500));
        let patch = status_patch(Some(&old), &new, Some("41"));
        let bytes = serde_json::to_vec(&patch).unwrap().len();
        let checkpoints = serde_json::to_vec(&new.steps).unwrap().len();
        assert!(
            checkpoints > 500_000,
            "the checkpoints are large: {checkpoints} bytes"
        );
        assert!(bytes < 4_000, "the patch is {bytes} bytes");
        // Applied to what the apiserver stores, it yields the new status.
        let mut doc = stored("41", Some(&old));
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc, stored("41", Some(&new)));
    }

    #[test]
    fn the_commit_that_fills_a_batch_moves_it_into_the_archive_in_the_same_write() {
        // 524 committed and one running: 500 may go, the archive grows from 475 to 500.
        let (old, new) = (status(523), status(524));
        let patch = status_patch(Some(&old), &new, Some("41"));
        let ops = serde_json::to_value(&patch).unwrap();
        let paths: Vec<&str> = ops
            .as_array()
            .unwrap()
            .iter()
            .map(|op| op["path"].as_str().unwrap())
            .collect();
        assert!(paths.contains(&"/status/archivedSteps"), "{paths:?}");
        assert!(
            paths.contains(&"/status/steps"),
            "the list is set whole: {paths:?}"
        );
        let mut doc = stored("41", Some(&old));
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc, stored("41", Some(&new)));
        assert_eq!(doc["status"]["archivedSteps"]["count"], 500);
        let back: AgentRunStatus = serde_json::from_value(doc["status"].clone()).unwrap();
        assert_eq!(back, new, "every checkpoint reads back, in order");
    }

    #[test]
    fn the_patch_carries_the_resource_version_it_was_decided_on_first() {
        let patch =
            serde_json::to_value(status_patch(Some(&status(1)), &status(2), Some("7"))).unwrap();
        assert_eq!(
            patch[0],
            json!({"op": "replace", "path": "/metadata/resourceVersion", "value": "7"})
        );
        // On a run that has moved on, the stored resourceVersion is replaced by
        // the stale one: the apiserver answers 409 (fenced on the plane, e2e/tests/fencing.rs).
        let mut doc = stored("9", Some(&status(1)));
        let patch: json_patch::Patch = serde_json::from_value(patch).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc["metadata"]["resourceVersion"], "7");
    }

    fn condition(
        type_: &str,
        message: &str,
    ) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        serde_json::from_value(json!({
            "type": type_, "status": "True", "reason": "Testing", "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }))
        .unwrap()
    }

    /// The apiserver applies the patch to what it stores, then compares
    /// resourceVersions: a patch decided on a status that has moved on must
    /// apply to the newer one, so that the answer is 409 (and the operator
    /// re-reads), not 422.
    #[test]
    fn a_patch_decided_on_a_stale_status_applies_to_the_newer_one() {
        let mut old = status(3);
        old.conditions = vec![
            condition("Progressing", "step 3"),
            condition("Waiting", "a person"),
        ];
        let mut new = status(4);
        new.conditions = vec![
            condition("Progressing", "step 4"),
            condition("Waiting", "a person, again"),
        ];
        // Stored meanwhile: two more steps, one condition fewer.
        let mut newer = status(5);
        newer.conditions = vec![condition("Progressing", "step 5")];
        let patch = status_patch(Some(&old), &new, Some("10"));
        let mut doc = stored("12", Some(&newer));
        json_patch::patch(&mut doc, &patch).expect("the patch applies to the newer status");
        assert_eq!(
            doc["metadata"]["resourceVersion"], "10",
            "the stale version: 409"
        );
    }

    #[test]
    fn a_run_without_status_gets_the_whole_status() {
        let new = status(0);
        let patch = status_patch(None, &new, Some("3"));
        let mut doc = stored("3", None);
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc, stored("3", Some(&new)));
    }

    #[test]
    fn removed_fields_are_removed() {
        let old = status(3);
        let mut new = old.clone();
        new.steps[3].pod = None;
        new.steps.truncate(3);
        let mut doc = stored("5", Some(&old));
        json_patch::patch(&mut doc, &status_patch(Some(&old), &new, Some("5"))).unwrap();
        assert_eq!(doc, stored("5", Some(&new)));
    }
}
