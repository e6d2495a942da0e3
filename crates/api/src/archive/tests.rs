use super::*;
use crate::{AgentRunStatus, StepPhase};
use serde_json::{Value, json};

fn checkpoint(i: usize, phase: StepPhase, checkpoint: CheckpointState) -> StepCheckpoint {
    StepCheckpoint {
        name: format!("s{i:03}"),
        plan_revision: 1,
        attempt: 1,
        idempotency_key: format!("{i:032x}"),
        pod: Some(format!("run-s{i:03}-r1-a1")),
        phase,
        checkpoint,
        result: Some(json!({"n": i})),
        ..Default::default()
    }
}

/// `done` finished and committed checkpoints, then `running` running ones.
fn status(done: usize, running: usize) -> AgentRunStatus {
    let mut steps: Vec<_> = (0..done)
        .map(|i| checkpoint(i, StepPhase::Succeeded, CheckpointState::Committed))
        .collect();
    steps.extend(
        (done..done + running).map(|i| checkpoint(i, StepPhase::Running, CheckpointState::Pending)),
    );
    AgentRunStatus {
        steps,
        ..Default::default()
    }
}

fn stored(status: &AgentRunStatus) -> Value {
    serde_json::to_value(status).unwrap()
}

#[test]
fn a_short_run_stores_every_checkpoint_in_steps() {
    let s = status(ARCHIVE_BATCH + KEEP_INLINE - 2, 1);
    let v = stored(&s);
    assert_eq!(
        v["steps"].as_array().unwrap().len(),
        ARCHIVE_BATCH + KEEP_INLINE - 1
    );
    assert!(v.get("archivedSteps").is_none(), "{v}");
    let s = status(ARCHIVE_BATCH + KEEP_INLINE - 1, 1);
    assert_eq!(stored(&s)["archivedSteps"]["count"], ARCHIVE_BATCH);
}

#[test]
fn a_long_run_archives_whole_batches_of_its_settled_prefix_and_reads_back_the_same() {
    let s = status(499, 1);
    let v = stored(&s);
    // 499 settled of 500, 25 kept: 475 go, a whole number of batches.
    assert_eq!(v["archivedSteps"]["count"], 475);
    assert_eq!(v["steps"].as_array().unwrap().len(), 25);
    assert_eq!(v["steps"][0]["name"], "s475");
    let s = status(510, 1);
    // 510 settled of 511, 25 kept: 486 may go, whole batches: 475.
    assert_eq!(stored(&s)["archivedSteps"]["count"], 475);
    let back: AgentRunStatus = serde_json::from_value(v).unwrap();
    assert_eq!(
        back,
        status(499, 1),
        "what is read back is every checkpoint, in order"
    );
}

#[test]
fn nothing_after_an_unsettled_checkpoint_is_archived() {
    let mut s = status(400, 0);
    s.steps[30].phase = StepPhase::Running;
    s.steps[30].checkpoint = CheckpointState::Pending;
    assert_eq!(archived_len(&s.steps), 25);
    s.steps[30] = checkpoint(30, StepPhase::Failed, CheckpointState::Committed);
    s.steps[30].stopping = true; // its Pod is still being stopped: it may still change
    assert_eq!(archived_len(&s.steps), 25);
    s.steps[30].stopping = false;
    assert_eq!(archived_len(&s.steps), 375);
}

#[test]
fn the_same_checkpoints_give_the_same_bytes() {
    let a = encode(&status(100, 0).steps).unwrap();
    let b = encode(&status(100, 0).steps).unwrap();
    assert_eq!(a, b);
    // and not from the memo alone: a fresh compression of other input differs.
    assert_ne!(a, encode(&status(101, 0).steps).unwrap());
}

#[test]
fn an_archive_that_does_not_read_is_an_error_not_an_empty_history() {
    let mut v = stored(&status(100, 0));
    v["archivedSteps"]["count"] = json!(51);
    let err = serde_json::from_value::<AgentRunStatus>(v.clone()).unwrap_err();
    assert!(
        err.to_string()
            .contains("holds 75 checkpoints, its count says 51"),
        "{err}"
    );
    v["archivedSteps"]["data"] = json!("not base64!");
    let err = serde_json::from_value::<AgentRunStatus>(v).unwrap_err();
    assert!(err.to_string().contains("not base64"), "{err}");
}

#[test]
fn a_status_written_before_the_archive_existed_reads_as_it_did() {
    let v = json!({"steps": [{"name": "a", "planRevision": 1, "attempt": 1,
        "idempotencyKey": "k", "phase": "Succeeded", "checkpoint": "Committed"}],
        "tokensUsed": 0, "stepExecutions": 1});
    let s: AgentRunStatus = serde_json::from_value(v).unwrap();
    assert_eq!(s.steps.len(), 1);
    assert_eq!(s.steps[0].name, "a");
    let empty: AgentRunStatus = serde_json::from_value(json!({})).unwrap();
    assert!(empty.steps.is_empty());
    assert!(stored(&empty).get("steps").is_none());
}
