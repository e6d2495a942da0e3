//! What the plugin prints, on objects captured from a real run on the plane
//! (`fixtures/`, written by e2e/tests/plugin.rs with
//! AGENTRUN_CAPTURE_FIXTURES), against golden files (`golden/`). After a
//! deliberate change of the output: `UPDATE_GOLDEN=1 cargo test -p kubectl-agentrun`,
//! then read the diff.

#[path = "render/journal.rs"]
mod journal;
#[path = "support/journal_fixtures.rs"]
mod journal_fixtures;

use std::path::PathBuf;

use agentrun_api::{AgentRun, Approval, Signal};
use jiff::{SignedDuration, Timestamp};
use kubectl_agentrun::identity::Identity;
use kubectl_agentrun::render::{self, Style};

fn dir(sub: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(sub)
}

fn fixture(name: &str) -> (AgentRun, Vec<Approval>) {
    let text = std::fs::read_to_string(dir("fixtures").join(format!("{name}.json")))
        .unwrap_or_else(|e| panic!("fixture {name}: {e}"));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    (
        serde_json::from_value(v["run"].clone()).unwrap(),
        serde_json::from_value(v["approvals"].clone()).unwrap(),
    )
}

/// The run's Signals in a fixture (none in captures from before Signals).
fn signals(name: &str) -> Vec<Signal> {
    let text = std::fs::read_to_string(dir("fixtures").join(format!("{name}.json"))).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    serde_json::from_value(v["signals"].clone()).unwrap_or_default()
}

/// Five minutes after the run was created: ages and expiries stay fixed.
fn now(run: &AgentRun) -> Timestamp {
    run.metadata.creation_timestamp.as_ref().unwrap().0 + SignedDuration::from_mins(5)
}

fn golden(name: &str, got: &str) {
    let path = dir("golden").join(format!("{name}.txt"));
    // Rewriting never passes: a golden that changed is written and the test fails, so
    // the change is reviewed and committed; under CI it is refused outright.
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        assert!(
            std::env::var_os("CI").is_none(),
            "UPDATE_GOLDEN is set under CI: goldens are compared there, never rewritten"
        );
        if std::fs::read_to_string(&path).ok().as_deref() != Some(got) {
            std::fs::create_dir_all(dir("golden")).unwrap();
            std::fs::write(&path, got).unwrap();
            panic!(
                "golden {} rewritten: review the diff, commit it, run again without UPDATE_GOLDEN",
                path.display()
            );
        }
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden {}: {e}; write it with UPDATE_GOLDEN=1",
            path.display()
        )
    });
    assert_eq!(
        got,
        want,
        "output of {name} differs from {}",
        path.display()
    );
}

fn fits_80_columns(text: &str) {
    for line in text.lines() {
        assert!(
            line.chars().count() <= 80,
            "wider than 80 columns: {line:?}"
        );
    }
}

fn alice() -> Identity {
    Identity {
        user: "alice".into(),
        groups: vec!["system:authenticated".into()],
    }
}

#[test]
fn list_shows_phase_step_progress_tokens_and_who_may_decide() {
    let (waiting, approvals) = fixture("refund-waiting");
    let (done, done_approvals) = fixture("charge-rejected");
    let mut all = approvals.clone();
    all.extend(done_approvals);
    let out = render::list(
        &[waiting.clone(), done],
        &all,
        false,
        now(&waiting),
        Style::default(),
    );
    golden("list", &out);
    for line in out.lines() {
        assert!(
            line.chars().count() <= 100,
            "wider than 100 columns: {line:?}"
        );
    }
    assert!(
        out.contains("WaitingForApproval") && out.contains("(user alice)"),
        "{out}"
    );
}

#[test]
fn describe_a_run_waiting_for_approval() {
    let (run, approvals) = fixture("refund-waiting");
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    golden("describe-waiting", &out);
    fits_80_columns(&out);
    assert!(out.contains("Waiting for: Approval"), "{out}");
}

#[test]
fn describe_an_approved_run_names_the_decider() {
    let (run, approvals) = fixture("refund-approved");
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    golden("describe-approved", &out);
    fits_80_columns(&out);
    assert!(out.contains("decision Approved by alice"), "{out}");
}

#[test]
fn describe_a_rejected_run_shows_its_compensation() {
    let (run, approvals) = fixture("charge-rejected");
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    golden("describe-rejected", &out);
    fits_80_columns(&out);
    assert!(out.contains("Compensations:\n  ✓ undo reserve"), "{out}");
}

#[test]
fn pending_says_who_may_decide() {
    let (run, approvals) = fixture("refund-waiting");
    let out = render::pending(&approvals, &alice(), now(&run), false);
    golden("pending-alice", &out);
    assert!(
        out.lines()
            .nth(1)
            .is_some_and(|l| l.ends_with("may decide")),
        "{out}"
    );
    let mallory = Identity {
        user: "mallory".into(),
        groups: vec![],
    };
    let out = render::pending(&approvals, &mallory, now(&run), false);
    assert!(
        out.lines()
            .nth(1)
            .is_some_and(|l| l.ends_with("not an approver")),
        "{out}"
    );
}

#[test]
fn colour_only_when_asked() {
    let (run, approvals) = fixture("refund-approved");
    let plain = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style { color: false },
    );
    assert!(!plain.contains('\x1b'));
    let coloured = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style { color: true },
    );
    assert!(coloured.contains("\x1b[32mSucceeded\x1b[0m"));
}

#[test]
fn describe_says_whether_the_approvers_were_told() {
    let (run, mut approvals) = fixture("refund-waiting");
    let st = approvals[0].status.get_or_insert_with(Default::default);
    st.conditions = vec![serde_json::from_value(serde_json::json!({
        "type": "Notified", "status": "False", "reason": "ChannelUnknown",
        "message": "requested notification to channel pay: channel pay is not configured in Secret ops/chan (channels: team)",
        "lastTransitionTime": "2026-12-02T01:00:00Z",
    }))
    .unwrap()];
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    assert!(
        out.contains("      not notified (ChannelUnknown): requested notification to channel pay"),
        "{out}"
    );
    fits_80_columns(&out);
    let st = approvals[0].status.as_mut().unwrap();
    st.conditions[0].status = "True".into();
    st.notifications = vec![serde_json::from_value(serde_json::json!({
        "id": "u.requested.team", "channel": "team", "event": "Requested", "state": "Delivered", "attempts": 1,
    }))
    .unwrap()];
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    assert!(out.contains("      notified: 1 delivered\n"), "{out}");
}

/// A step whose result its `resultSchema` refused: the mismatch, past the
/// first line of the message, is what a person needs, within 80 columns.
#[test]
fn describe_shows_why_a_result_was_refused() {
    let (mut run, approvals) = fixture("charge-rejected");
    let status = run.status.as_mut().unwrap();
    let step = status
        .steps
        .iter_mut()
        .find(|c| c.message.is_none())
        .expect("a step without a message");
    let name = step.name.clone();
    step.message = Some(
        "attempt 1 returned a result that does not match its resultSchema: at /: \"orderId\" is a required property; at /total: value is less than the minimum of 0; retry 1 of 2 after 1s"
            .into(),
    );
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    fits_80_columns(&out);
    let at = out.find(&format!(" {name} ")).expect("the step's line");
    let block: String = out[at..].lines().take(8).collect::<Vec<_>>().join("\n");
    // Wrapped between words: read it back as one text.
    let block = block.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        block.contains("\"orderId\" is a required property;"),
        "{block}"
    );
    assert!(
        block.contains("value is less than the minimum of 0"),
        "{block}"
    );
    let full = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        true,
        Style::default(),
    );
    assert!(full.contains("retry 1 of 2 after 1s"), "{full}");
}

#[test]
fn wrap_breaks_between_words_and_says_when_it_cut() {
    assert_eq!(render::wrap("a bb ccc", 4, 3), ["a bb", "ccc"]);
    assert_eq!(render::wrap("a bb ccc dddd", 4, 2), ["a bb", "ccc…"]);
    assert_eq!(render::wrap("abcdefgh", 4, 3), ["abc…"]);
    assert!(render::wrap("", 4, 3).is_empty());
}

/// A wait step shows when it wakes, and how long until then.
#[test]
fn describe_shows_when_a_wait_wakes() {
    use agentrun_api::{RunPhase, StepCheckpoint, StepPhase};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let (mut run, approvals) = fixture("refund-waiting");
    let now = now(&run);
    let status = run.status.as_mut().unwrap();
    status.phase = Some(RunPhase::Waiting);
    status.steps.push(StepCheckpoint {
        name: "cool-off".into(),
        plan_revision: 1,
        phase: StepPhase::Waiting,
        started_at: Some(Time(now)),
        wake_at: Some(Time(now + SignedDuration::from_mins(90))),
        message: Some(format!(
            "waits until {}",
            now + SignedDuration::from_mins(90)
        )),
        ..StepCheckpoint::default()
    });
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now,
        false,
        Style::default(),
    );
    fits_80_columns(&out);
    let wake = now + SignedDuration::from_mins(90);
    assert!(out.contains("◷ cool-off"), "{out}");
    assert!(out.contains(&format!("wakes at {wake} (in 90m)")), "{out}");
}

/// A queued run says where it waits and why, as its condition does.
#[test]
fn describe_says_where_a_queued_run_waits() {
    use agentrun_api::RunPhase;
    let (mut run, approvals) = fixture("refund-waiting");
    let now = now(&run);
    let status = run.status.as_mut().unwrap();
    status.phase = Some(RunPhase::Queued);
    status.queue_position = Some(2);
    status.steps.clear();
    for c in status
        .conditions
        .iter_mut()
        .filter(|c| c.type_ == "Succeeded")
    {
        c.reason = "Queued".into();
        c.message = "queued at position 2: 5 of 5 runs active in namespace payments (maxActiveRunsPerNamespace)".into();
    }
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now,
        false,
        Style::default(),
    );
    fits_80_columns(&out);
    let text = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        text.contains("Waiting for: a place to start, queued at position 2: 5 of 5 runs active in namespace payments"),
        "{out}"
    );
}

/// A run waiting on a signal says for what, until when, and the command
/// that sends it; the list says it waits for a signal.
#[test]
fn describe_a_run_waiting_for_a_signal() {
    let (run, approvals) = fixture("signal-waiting");
    let sigs = signals("signal-waiting");
    assert_eq!(sigs.len(), 1, "the fixture holds the run's Signal");
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            signals: &sigs,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    golden("describe-signal-waiting", &out);
    fits_80_columns(&out);
    for want in [
        "Waiting for: signal on step settle, until 2026-12-04T06:31:54Z (in 4m)\n",
        "      waits for signal (payment settled): Signal pay-settle-3329c0-r1-signal\n",
        "      expires at 2026-12-04T06:31:54Z (in 4m)\n",
        "      send with: kubectl agentrun signal pay settle --data '{…}'\n",
    ] {
        assert!(out.contains(want), "{want:?} in\n{out}");
    }
    assert!(
        !out.contains("wakes at"),
        "a signal expires, it does not wake:\n{out}"
    );
    let listed = render::list(
        std::slice::from_ref(&run),
        &approvals,
        false,
        now(&run),
        Style::default(),
    );
    golden("list-signal", &listed);
    assert!(
        listed.contains("   signal (payment settled)   "),
        "{listed}"
    );
}

/// Once received: the id and the sender, from the Signal; without the
/// Signal (gone, or not readable) the step's message still names the id.
#[test]
fn describe_a_received_signal_names_its_id_and_sender() {
    let (run, approvals) = fixture("signal-received");
    let sigs = signals("signal-received");
    let out = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            signals: &sigs,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    golden("describe-signal-received", &out);
    fits_80_columns(&out);
    assert!(
        out.contains("      result {\"amount\":12}\n      signal pay-1 from ci-bot\n"),
        "{out}"
    );
    assert!(!out.contains("released by"), "{out}");
    assert!(!out.contains("Waiting for"), "{out}");

    let bare = render::describe(
        &run,
        &render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        now(&run),
        false,
        Style::default(),
    );
    for want in [
        "      signal from ci-bot\n",
        "      Signal pay-settle-3329c0-r1-signal: pay-1 from ci-bot\n",
    ] {
        assert!(bare.contains(want), "{want:?} in\n{bare}");
    }
}

/// A record built from a captured run (D18), as the operator builds it.
fn record_of(name: &str) -> agentrun_api::RunRecordSpec {
    let (run, approvals) = fixture(name);
    let status = run.status.clone().unwrap();
    agentrun_history::build(&run, &status, &approvals, &signals(name))
}

#[test]
fn history_lists_records_newest_first_and_shows_one_in_full() {
    let (run, _) = fixture("refund-approved");
    let approved = record_of("refund-approved");
    let rejected = record_of("charge-rejected");
    let later = approved
        .outcome
        .completed_at
        .0
        .max(rejected.outcome.completed_at.0);
    let now = later + SignedDuration::from_hours(2);
    let q = agentrun_history::Query::default();
    let listed = q.arrange(vec![approved.clone(), rejected.clone()]);
    golden("history-list", &render::history_table(&listed, true, now));
    let detail = render::record_detail(&approved, now, Style::default());
    // Every step's idempotency key and effect, and who approved: the audit's questions.
    for c in &run.status.as_ref().unwrap().steps {
        assert!(detail.contains(&c.idempotency_key), "{detail}");
    }
    assert!(detail.contains("Approved by"), "{detail}");
    golden("history-refund-approved", &detail);
}

#[test]
fn describe_links_a_run_to_its_record_or_to_the_run_that_already_ran() {
    let (mut run, _) = fixture("refund-approved");
    assert_eq!(render::history_line(&run), "", "no record named yet");
    run.status.as_mut().unwrap().record = Some("refund-1a2b3c4d".into());
    let line = render::history_line(&run);
    assert!(line.contains("Record: RunRecord refund-1a2b3c4d"), "{line}");
    assert!(line.contains("kubectl agentrun history"), "{line}");
    let status = run.status.as_mut().unwrap();
    status.record = None;
    status.already_ran = Some(Box::new(agentrun_api::AlreadyRan {
        record: "refund-0ld0uid0".into(),
        run_uid: "0ld0uid0-1".into(),
        outcome: "Succeeded".into(),
        completed_at: status.completed_at.clone().unwrap(),
    }));
    let line = render::history_line(&run);
    assert!(line.starts_with("Already ran: run "), "{line}");
    assert!(line.contains("RunRecord refund-0ld0uid0"), "{line}");
    assert!(line.contains("agentrun.dev/rerun"), "{line}");
}

#[test]
fn history_refuses_an_outcome_a_record_cannot_have() {
    use clap::Parser;
    let cli = kubectl_agentrun::cli::Cli::try_parse_from([
        "kubectl-agentrun",
        "history",
        "--outcome",
        "Running",
    ])
    .unwrap();
    let kubectl_agentrun::cli::Command::History(args) = cli.command else {
        panic!("parsed as history");
    };
    let err =
        kubectl_agentrun::commands::history::query(&args, "default", Timestamp::now()).unwrap_err();
    assert!(
        err.to_string().contains("Succeeded, Failed or Cancelled"),
        "{err}"
    );
}
