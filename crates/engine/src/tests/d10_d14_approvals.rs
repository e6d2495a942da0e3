//! D10/D14: durable approval waits; an approval releases exactly the step it was asked about.

use super::*;

#[test]
fn an_approval_gate_waits_with_zero_pods_and_requeues_at_expiry() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a").with_approval(Some("1h"), OnTimeout::Reject)]),
    );
    let d = w.settle();
    let name = "run-a-2b8d3c-r1-approve";
    let a = &w.approvals[name];
    assert_eq!(
        (a.spec.kind, a.spec.run_uid.as_str(), a.spec.plan_revision),
        (ApprovalKind::Approve, UID, 1)
    );
    assert_eq!(a.spec.expires_at.as_ref().map(|t| t.0), Some(t(3600)));
    assert_eq!(a.spec.question, "run a?");
    assert_eq!(a.metadata.owner_references.as_ref().unwrap()[0].uid, UID);
    assert!(w.pods.is_empty());
    assert_eq!(w.status().phase, Some(RunPhase::WaitingForApproval));
    assert_eq!(condition_of(&w, ConditionType::AwaitingApproval).0, "True");
    assert_eq!(d.requeue_after, secs(3600));
    w.advance(1000);
    assert_eq!(
        w.decide().requeue_after,
        secs(2600),
        "after a restart too: the timer is in the Approval"
    );
}

#[test]
fn approval_answers() {
    struct Case {
        name: &'static str,
        on_timeout: OnTimeout,
        act: fn(&mut World),
        phase: RunPhase,
        approval: ApprovalPhase,
        decided_by: &'static str,
    }
    let cases = [
        Case {
            name: "approved: the step runs",
            on_timeout: OnTimeout::Reject,
            act: |w| {
                w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice-ui");
            },
            phase: RunPhase::Running,
            approval: ApprovalPhase::Approved,
            decided_by: "alice-ui",
        },
        Case {
            name: "rejected: the run fails",
            on_timeout: OnTimeout::Reject,
            act: |w| {
                w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Rejected, "bob");
            },
            phase: RunPhase::Failed,
            approval: ApprovalPhase::Rejected,
            decided_by: "bob",
        },
        Case {
            name: "expired, onTimeout Reject: the run fails",
            on_timeout: OnTimeout::Reject,
            act: |w| w.advance(3600),
            phase: RunPhase::Failed,
            approval: ApprovalPhase::Expired,
            decided_by: "agentrun-operator",
        },
        Case {
            name: "expired, onTimeout Approve: the step runs",
            on_timeout: OnTimeout::Approve,
            act: |w| w.advance(3600),
            phase: RunPhase::Running,
            approval: ApprovalPhase::Expired,
            decided_by: "agentrun-operator",
        },
    ];
    for c in cases {
        let mut w = World::new(
            AgentRun::test().with_steps([step("a").with_approval(Some("1h"), c.on_timeout)]),
        );
        w.settle();
        (c.act)(&mut w);
        w.settle();
        assert_eq!(w.status().phase, Some(c.phase), "{}", c.name);
        let st = w.approvals["run-a-2b8d3c-r1-approve"]
            .status
            .clone()
            .unwrap();
        assert_eq!(
            (st.phase, st.decided_by.as_deref()),
            (c.approval, Some(c.decided_by)),
            "{}",
            c.name
        );
        assert_eq!(
            w.pods.contains_key("run-a-2b8d3c-r1-a1"),
            c.phase == RunPhase::Running,
            "{}",
            c.name
        );
    }
}

fn gated(timeout: Option<&str>, on_timeout: OnTimeout) -> World {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_approval(timeout, on_timeout)]));
    w.settle();
    w
}

/// A user edits the step (`kubectl apply`): a new generation.
fn edit_args(w: &mut World, args: &[&str]) {
    w.run.spec.steps[0].container.as_mut().unwrap().args =
        args.iter().map(|a| a.to_string()).collect();
    w.run.metadata.generation = w.run.metadata.generation.map(|g| g + 1);
}

fn args_of(w: &World, pod: &str) -> Vec<String> {
    w.pod(pod).spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap_or_default()
}

#[test]
fn a_step_changed_while_its_approval_waits_needs_a_new_decision() {
    let mut w = gated(None, OnTimeout::Reject);
    let first = "run-a-2b8d3c-r1-approve";
    let asked = w.approvals[first].spec.step_digest.clone();
    assert_eq!(asked.as_ref().map(String::len), Some(64));
    assert_eq!(cp(&w, "a", 1).step_digest, asked);
    edit_args(&mut w, &["refund", "--amount=9999"]);
    // The person approves what they were shown, after the edit.
    assert!(w.decide_approval(first, Answer::Approved, "alice"));
    w.settle();
    assert!(w.pods.is_empty(), "the old approval released nothing");
    let second = "run-a-2b8d3c-r1-approve-2";
    let a2 = &w.approvals[second];
    assert_ne!(a2.spec.step_digest, asked, "bound to the step as it is now");
    let old = w.approvals[first].status.clone().unwrap();
    assert_eq!(old.phase, ApprovalPhase::Superseded);
    assert!(
        old.message
            .as_deref()
            .is_some_and(|m| m.contains(second) && m.contains("decision Approved was not applied")),
        "{old:?}"
    );
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.approval.as_deref()),
        (StepPhase::WaitingForApproval, Some(second))
    );
    assert!(w.decide_approval(second, Answer::Approved, "alice"));
    w.settle();
    assert_eq!(
        args_of(&w, "run-a-2b8d3c-r1-a1"),
        ["refund", "--amount=9999"]
    );
    assert_eq!(
        w.approvals[second].status.as_ref().map(|s| s.phase),
        Some(ApprovalPhase::Approved)
    );
}

#[test]
fn a_step_changed_after_approval_but_before_its_pod_exists_is_asked_again() {
    let mut w = gated(None, OnTimeout::Reject);
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    // The launch is written, then the operator dies before creating the Pod.
    let d = w.decide();
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    w.run.status = Some(d.status);
    edit_args(&mut w, &["something-else"]);
    let d = w.step();
    assert!(creates(&d).is_empty(), "{:?}", d.actions);
    w.settle();
    assert!(w.pods.is_empty());
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.approval.as_deref()),
        (
            StepPhase::WaitingForApproval,
            Some("run-a-2b8d3c-r1-approve-2")
        )
    );
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.contains("changed after it was approved")),
        "{a:?}"
    );
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve-2", Answer::Approved, "alice"));
    w.settle();
    // A new attempt: the first one's Pod never existed, and never will.
    assert_eq!(args_of(&w, "run-a-2b8d3c-r1-a2"), ["something-else"]);
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a2"]);
}

#[test]
fn a_decision_the_api_server_took_after_the_deadline_does_not_release_the_step() {
    let mut w = gated(Some("4s"), OnTimeout::Reject);
    // The operator is down past the deadline; then a person approves.
    w.advance(10);
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert!(w.created.is_empty(), "the step never ran");
    let st = w.approvals["run-a-2b8d3c-r1-approve"]
        .status
        .clone()
        .unwrap();
    assert_eq!(st.phase, ApprovalPhase::Expired);
    assert!(
        st.message
            .as_deref()
            .is_some_and(|m| m.contains("after the deadline")),
        "{st:?}"
    );
}

#[test]
fn a_decision_made_in_time_wins_over_an_expiry_seen_late() {
    let mut w = gated(Some("4s"), OnTimeout::Reject);
    w.advance(2);
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    // The operator looks only after the deadline.
    w.advance(60);
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Running));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"]);
}

#[test]
fn an_expiry_decided_on_a_stale_cache_never_overwrites_a_decision() {
    let mut w = gated(Some("4s"), OnTimeout::Reject);
    w.advance(3);
    let stale = w.clone();
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    // The operator's cache does not show the decision yet; it is past the deadline.
    let mut late = stale;
    late.advance(10);
    let d = late.decide();
    assert!(
        d.actions
            .iter()
            .any(|a| matches!(a, Action::SetApprovalStatus { status, .. } if status.phase == ApprovalPhase::Expired)),
        "the stale view asks to expire it"
    );
    assert_eq!(
        d.status,
        w.status(),
        "nothing is refused before the expiry is written"
    );
    w.now = late.now;
    w.commit(&d); // the guarded write meets the decision and fails
    assert_eq!(w.approvals["run-a-2b8d3c-r1-approve"].status, None);
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Running));
}

#[test]
fn approvals_the_run_no_longer_waits_on_are_superseded_and_refuse_decisions() {
    let mut w = gated(None, OnTimeout::Reject);
    w.run.spec.cancel = true;
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    let st = w.approvals["run-a-2b8d3c-r1-approve"]
        .status
        .clone()
        .unwrap();
    assert_eq!(st.phase, ApprovalPhase::Superseded);
    assert!(!w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    assert!(w.created.is_empty());
}

fn payments_leads() -> agentrun_api::Approvers {
    agentrun_api::Approvers {
        users: vec!["alice".into(), "bob".into(), "carol".into()],
        groups: Vec::new(),
        service_accounts: vec![agentrun_api::ServiceAccountRef {
            namespace: String::new(),
            name: "refund-bot".into(),
        }],
    }
}

/// Step `a` behind a gate that needs two of alice, bob, carol and the
/// refund bot; asked.
fn quorum_of_two() -> (World, &'static str) {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a")
            .with_approval(None, OnTimeout::Reject)
            .with_approvers(payments_leads(), 2)]),
    );
    w.settle();
    (w, "run-a-2b8d3c-r1-approve")
}

/// The gate's approver policy travels into the Approval, where the API
/// server's policies read it: approvers (ServiceAccounts resolved to the
/// run's namespace), quorum, and who created the run.
#[test]
fn an_approval_carries_the_gates_approvers_quorum_and_the_runs_creator() {
    let mut run = AgentRun::test().with_steps([step("a")
        .with_approval(None, OnTimeout::Reject)
        .with_approvers(payments_leads(), 2)]);
    run.spec.steps[0]
        .approval
        .as_mut()
        .unwrap()
        .separate_from_requester = true;
    run.metadata.annotations = Some([(labels::REQUESTED_BY.to_owned(), "dave".to_owned())].into());
    let mut w = World::new(run);
    w.settle();
    let a = &w.approvals["run-a-2b8d3c-r1-approve"].spec;
    let approvers = a.approvers.clone().expect("approvers copied");
    assert_eq!(approvers.users, ["alice", "bob", "carol"]);
    assert_eq!(approvers.service_accounts[0].namespace, "default");
    assert_eq!(
        (
            a.quorum,
            a.separate_from_requester,
            a.requested_by.as_deref()
        ),
        (2, true, Some("dave"))
    );
}

/// Quorum 2: one vote leaves the run waiting (the Approval says 1/2); the
/// second distinct approver's vote releases the step exactly once, also when
/// the decision is taken again and again (a restart, a requeue).
#[test]
fn a_quorum_releases_the_step_once_after_enough_distinct_votes() {
    let (mut w, name) = quorum_of_two();
    assert!(w.vote(name, "alice", Answer::Approved));
    w.settle();
    assert!(w.pods.is_empty(), "one vote of two starts nothing");
    assert_eq!(w.status().phase, Some(RunPhase::WaitingForApproval));
    let status = w.approvals[name].status.clone().unwrap();
    assert_eq!(
        (status.phase, status.votes.as_deref()),
        (ApprovalPhase::Pending, Some("1/2"))
    );
    // A decision field is not how a quorum is answered: it is not read.
    w.decide_approval(name, Answer::Approved, "kubectl-patch");
    w.settle();
    assert!(
        w.pods.is_empty(),
        "spec.decision does not stand in for a vote"
    );
    assert!(w.vote(name, "bob", Answer::Approved));
    let d = w.step();
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    w.settle();
    w.settle();
    assert_eq!(cp(&w, "a", 1).attempt, 1, "released exactly once");
    assert_eq!(w.status().step_executions, 1);
    let a = w.approvals[name].status.clone().unwrap();
    assert_eq!(
        (a.phase, a.votes.as_deref(), a.decided_by.as_deref()),
        (ApprovalPhase::Approved, Some("2/2"), Some("alice, bob"))
    );
    assert_eq!(cp(&w, "a", 1).decided_by.as_deref(), Some("alice, bob"));
    w.succeed("run-a-2b8d3c-r1-a1", &ok_message(json!(1), 0));
    assert_eq!(
        cp(&w, "a", 1).message,
        None,
        "a succeeded step no longer says what it waited for"
    );
    assert_eq!(cp(&w, "a", 1).decided_by.as_deref(), Some("alice, bob"));
}

/// One rejection rejects, whatever the approvals so far.
#[test]
fn one_rejecting_vote_rejects_the_step() {
    let (mut w, name) = quorum_of_two();
    w.vote(name, "alice", Answer::Approved);
    w.vote(name, "carol", Answer::Rejected);
    w.settle();
    assert!(w.pods.is_empty());
    assert_ended(&w, RunPhase::Failed, Reason::ApprovalRejected);
    let a = w.approvals[name].status.clone().unwrap();
    assert_eq!(
        (a.phase, a.decided_by.as_deref()),
        (ApprovalPhase::Rejected, Some("carol"))
    );
    assert!(
        !w.vote(name, "bob", Answer::Approved),
        "decided: no more votes"
    );
}

/// The person the API server recorded as the decider is who the Approval,
/// the Event and the run's status name, not the tool they used (D15).
#[test]
fn the_recorded_decider_is_named_not_the_tool() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_approval(None, OnTimeout::Reject)]));
    w.settle();
    let name = "run-a-2b8d3c-r1-approve";
    w.decide_approval(name, Answer::Approved, "kubectl-patch");
    w.approvals.get_mut(name).unwrap().spec.decided_by = Some("alice".into());
    let d = w.step();
    let granted: Vec<String> = d
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Event {
                reason: Reason::ApprovalGranted,
                message,
                ..
            } => Some(message.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(granted, [format!("Approval {name} approved by alice")]);
    w.settle();
    assert_eq!(
        w.approvals[name]
            .status
            .as_ref()
            .unwrap()
            .decided_by
            .as_deref(),
        Some("alice")
    );
    assert_eq!(cp(&w, "a", 1).decided_by.as_deref(), Some("alice"));
}

#[test]
fn a_step_edited_during_its_retry_backoff_is_asked_about_again() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a")
            .with_approval(None, OnTimeout::Reject)
            .with_retry(1, "30s", "30s")]),
    );
    w.settle();
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    w.settle();
    // Attempt 1 fails (saying it did not act): a retry in 30 s.
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, NOT_APPLIED));
    w.settle();
    // During the backoff, the step's arguments are edited.
    w.run.spec.steps[0].container.as_mut().unwrap().args = vec!["--force".into()];
    w.run.metadata.generation = Some(2);
    w.advance(31);
    w.settle();
    assert_eq!(
        w.created,
        ["run-a-2b8d3c-r1-a1"],
        "no attempt under the old approval"
    );
    let a = cp(&w, "a", 1);
    assert_eq!(a.phase, StepPhase::WaitingForApproval);
    assert_eq!(a.approval.as_deref(), Some("run-a-2b8d3c-r1-approve-2"));
    let asked = &w.approvals["run-a-2b8d3c-r1-approve-2"];
    assert_eq!(asked.spec.step_digest, a.step_digest);
    assert_ne!(
        asked.spec.step_digest,
        w.approvals["run-a-2b8d3c-r1-approve"].spec.step_digest
    );
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve-2", Answer::Approved, "alice"));
    w.settle();
    let pod = w.pod("run-a-2b8d3c-r1-a2");
    assert_eq!(
        pod.spec.unwrap().containers[0].args,
        Some(vec!["--force".into()])
    );
    assert_eq!(
        pod.metadata.annotations.unwrap()[labels::STEP_DIGEST],
        a.step_digest.unwrap(),
        "the Pod says what it runs"
    );
}

/// A Reject vote that reached the API server after the quorum was met, but
/// before the operator wrote the outcome (so its status write met 409), does
/// not turn the applied approval into a rejection, and does not take the
/// credit from the approvers: the order of the votes is the server's.
#[test]
fn a_vote_after_the_quorum_changes_nothing_and_is_said() {
    let (mut w, name) = quorum_of_two();
    assert!(w.vote(name, "alice", Answer::Approved));
    assert!(w.vote(name, "bob", Answer::Approved));
    // The decision that releases the step is made...
    let d = w.decide();
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    // ...but carol's Reject lands before it is applied, so the Approval's
    // status write, guarded by the version the decision saw, is refused.
    assert!(w.vote(name, "carol", Answer::Rejected));
    w.commit(&d);
    assert_eq!(
        w.approvals[name].status.as_ref().map(|s| s.phase),
        Some(ApprovalPhase::Pending),
        "the guarded status write was refused"
    );
    w.settle();
    assert_eq!(
        cp(&w, "a", 1).phase,
        StepPhase::Running,
        "the step runs as approved"
    );
    let a = w.approvals[name].status.clone().unwrap();
    assert_eq!(
        (a.phase, a.decided_by.as_deref()),
        (ApprovalPhase::Approved, Some("alice, bob"))
    );
    assert_eq!(
        a.message.as_deref(),
        Some("decision Approved applied; votes after it were not applied: carol (Rejected)")
    );
}

/// Where the API server's word on when a decision was made is missing (a
/// client cleared managedFields), a decision seen only after the deadline
/// counts as late: the expiry applies (D10, D15).
#[test]
fn a_decision_without_the_servers_time_counts_as_late_past_the_deadline() {
    let run = || {
        World::new(
            AgentRun::test().with_steps([step("a").with_approval(Some("10m"), OnTimeout::Reject)]),
        )
    };
    let name = "run-a-2b8d3c-r1-approve";
    // Seen before the deadline: in time, whatever managedFields says.
    let mut w = run();
    w.settle();
    w.advance(60);
    assert!(w.decide_approval(name, Answer::Approved, "alice"));
    w.approvals.get_mut(name).unwrap().metadata.managed_fields = None;
    w.settle();
    assert_eq!(cp(&w, "a", 1).phase, StepPhase::Running);
    // Seen only after the deadline: late.
    let mut w = run();
    w.settle();
    w.advance(60);
    assert!(w.decide_approval(name, Answer::Approved, "alice"));
    w.approvals.get_mut(name).unwrap().metadata.managed_fields = None;
    w.advance(600);
    w.settle();
    assert!(w.pods.is_empty(), "never run on a decision of unknown time");
    assert_ended(&w, RunPhase::Failed, Reason::ApprovalExpired);
    let a = w.approvals[name].status.clone().unwrap();
    assert_eq!(a.phase, ApprovalPhase::Expired);
}
