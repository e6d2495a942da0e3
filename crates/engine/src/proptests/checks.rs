//! The invariants, checked at every applied action and every committed
//! status write against what the simulated API server holds and the ledger
//! of what each Pod did.

use super::*;

impl Sim {
    /// Checks an action against what the API server holds: `committed` as it
    /// was before this decision's write, the current status, and the ledger.
    pub(super) fn check_action(&mut self, committed: &AgentRunStatus, a: &Action) {
        let held = self.w.status();
        self.check_boundary_action(&held, a);
        match a {
            Action::CreatePod(pod) => {
                let l = pod.metadata.labels.clone().unwrap();
                let (role, step, rev, attempt) = (
                    l[labels::ROLE].clone(),
                    l[labels::STEP].clone(),
                    l[labels::PLAN_REVISION].parse::<i64>().unwrap(),
                    l[labels::ATTEMPT].parse::<i32>().unwrap(),
                );
                let key = l[labels::IDEMPOTENCY_KEY].clone();
                let pod_role = PodRole::from_label(&role).unwrap();
                assert_eq!(
                    key,
                    idempotency_key(UID, pod_role, &step, rev),
                    "D1: key derived from (uid, step, revision)"
                );
                let prev = self
                    .keys
                    .insert((role.clone(), step.clone(), rev), key.clone());
                assert!(
                    prev.is_none_or(|p| p == key),
                    "D1: the key is stable across attempts"
                );
                let name = pod.metadata.name.clone().unwrap();
                assert!(
                    !held.phase.is_some_and(RunPhase::is_terminal),
                    "{name} created for a run the API server holds as finished"
                );
                if pod_role == PodRole::Step {
                    self.check_waits_before(&held, &step, rev, &name);
                }
                let outcome = if pod_role == PodRole::Compensate {
                    held.compensations
                        .iter()
                        .find(|c| c.idempotency_key == key && c.phase.is_terminal())
                        .map(|c| format!("{:?}", c.phase))
                } else {
                    // A verify probe carries its step's key: each is judged
                    // by its own checkpoint.
                    held.steps
                        .iter()
                        .find(|c| {
                            c.idempotency_key == key
                                && PodRole::from(c.role) == pod_role
                                && (c.phase.is_terminal()
                                    || c.checkpoint == CheckpointState::Committed)
                        })
                        .map(|c| format!("{:?}", c.phase))
                };
                assert!(
                    outcome.is_none(),
                    "no Pod for a committed key: {name} created for key {key}, whose outcome ({}) the API server already holds",
                    outcome.unwrap_or_default()
                );
                let absent = !self.w.pods.contains_key(&name);
                if absent {
                    let live_same_key: Vec<&String> = self
                        .w
                        .pods
                        .iter()
                        .filter(|(_, p)| observe::is_live(p))
                        .filter(|(_, p)| {
                            p.metadata.labels.as_ref().unwrap()[labels::IDEMPOTENCY_KEY] == key
                        })
                        .map(|(n, _)| n)
                        .collect();
                    assert!(
                        live_same_key.is_empty(),
                        "D2: {name} created while an attempt with key {key} is live: {live_same_key:?}"
                    );
                }
                if pod_role == PodRole::Step {
                    self.check_rerun(&name, &key, attempt, absent);
                    self.check_effect_once(&name, &step, rev);
                    // Actions are applied only once the decided status is
                    // acknowledged (or a quorum read showed it current), so
                    // the checkpoints a launch depends on must be committed
                    // in what the API server holds (D4).
                    let plan = held.plan.clone().expect("a plan with any step Pod");
                    assert!(
                        plan.step_names.contains(&step),
                        "step {step} in the committed plan"
                    );
                    for earlier in &ancestors(&self.w.run.spec.steps, &step) {
                        // An input this revision runs again must have run again.
                        let rerun_here = rev == plan.revision
                            && (plan.rerun.is_empty() || plan.rerun.contains(earlier));
                        let input = held
                            .steps
                            .iter()
                            .filter(|c| {
                                c.role == StepRole::Step
                                    && &c.name == earlier
                                    && (c.plan_revision == rev
                                        || (!rerun_here && c.plan_revision < rev))
                                    // A wait for a signal that expired with
                                    // `onTimeout: Skip` lets the steps after it go on.
                                    && matches!(c.phase, StepPhase::Succeeded | StepPhase::Skipped)
                                    && c.checkpoint == CheckpointState::Committed
                            })
                            .max_by_key(|c| c.plan_revision);
                        let Some(input) = input else {
                            panic!(
                                "D4: {name} created before step {earlier}'s checkpoint was committed"
                            );
                        };
                        // D8: never started on a result older than its freshFor.
                        let fresh_for = self
                            .w
                            .run
                            .spec
                            .steps
                            .iter()
                            .any(|s| &s.name == earlier && s.fresh_for.is_some());
                        if fresh_for {
                            let done = input.finished_at.as_ref().expect("finishedAt").0;
                            assert!(
                                self.w.now
                                    < done
                                        .checked_add(SignedDuration::from_secs(FRESH_FOR))
                                        .unwrap(),
                                "D8: {name} created at {} on step {earlier}'s result of {done}, past its freshFor",
                                self.w.now
                            );
                        }
                    }
                }
            }
            Action::ReleaseFinalizer { pod } => {
                let Some(p) = self.w.pods.get(pod) else {
                    return;
                };
                if committed.phase.is_some_and(RunPhase::is_terminal) {
                    return;
                }
                let c = observe::coords(p).unwrap();
                let (attempt, phase) = if c.role == PodRole::Compensate {
                    let x = committed
                        .compensations
                        .iter()
                        .find(|x| x.name == c.step && x.plan_revision == c.plan_revision);
                    let x = x.expect("D5: released a compensation Pod the status does not know");
                    (x.attempt, x.phase)
                } else {
                    let x = committed.steps.iter().find(|x| {
                        x.name == c.step
                            && x.plan_revision == c.plan_revision
                            && PodRole::from(x.role) == c.role
                    });
                    let x = x.expect("D5: released a Pod the status does not know");
                    (x.attempt, x.phase)
                };
                assert!(
                    c.attempt < attempt || phase != StepPhase::Running,
                    "D5: finalizer of {pod} released before its outcome was committed"
                );
            }
            _ => {}
        }
    }

    /// D6: after a NonIdempotent attempt may have acted — disrupted once
    /// started, timed out, failed without saying it did not act — the step
    /// runs again with the same key (a later attempt, or the same Pod created
    /// anew) only after a person answered `Retry` on the Reconcile Approval
    /// about that attempt's Pod.
    /// D10 for time: a step Pod is created only once every wait step it
    /// comes after has woken, by the API server's clock; and every wait for
    /// a signal it comes after took its signal, or expired (its Signal says
    /// so) with `onTimeout: Skip`.
    pub(super) fn check_waits_before(
        &self,
        held: &AgentRunStatus,
        step: &str,
        rev: i64,
        pod: &str,
    ) {
        let steps = &self.w.run.spec.steps;
        for anc in ancestors(steps, step) {
            let Some(w) = steps
                .iter()
                .find(|s| s.name == anc)
                .and_then(|s| s.wait.as_ref())
            else {
                continue;
            };
            let wait = held
                .steps
                .iter()
                .filter(|c| c.role == StepRole::Step && c.name == anc && c.plan_revision <= rev)
                .max_by_key(|c| c.plan_revision)
                .unwrap_or_else(|| panic!("{pod} created before wait {anc} started"));
            if w.signal.is_some() {
                let expired = wait
                    .signal
                    .as_ref()
                    .and_then(|n| self.w.signals.get(n))
                    .and_then(|s| s.status.as_ref())
                    .is_some_and(|s| s.phase == agentrun_api::SignalPhase::Expired);
                assert!(
                    wait.phase == StepPhase::Succeeded
                        || (wait.phase == StepPhase::Skipped && expired),
                    "D10: {pod} created before wait {anc} took its signal or expired ({:?})",
                    wait.phase
                );
                continue;
            }
            let woke = wait.wake_at.as_ref().map(|t| t.0);
            assert!(
                wait.phase == StepPhase::Succeeded && woke.is_some_and(|t| t <= self.w.now),
                "D10: {pod} created at {} before wait {anc} woke ({:?}, wakes {woke:?})",
                self.w.now,
                wait.phase
            );
        }
    }

    pub(super) fn check_rerun(&self, name: &str, key: &str, attempt: i32, absent: bool) {
        for e in self.ledger.values().filter(|e| {
            e.key == key
                && e.role == PodRole::Step
                && (e.disrupted || (e.non_idempotent && e.may_have_acted() && !e.succeeded))
        }) {
            if e.attempt > attempt || (e.attempt == attempt && !absent) || force_removed_unseen(e) {
                continue;
            }
            let retried = self.w.approvals.values().any(|a| {
                a.spec.kind == ApprovalKind::Reconcile
                    && a.spec.step == e.step
                    && a.spec.plan_revision == e.plan_revision
                    && a.spec.decision == Some(Answer::Retry)
                    && a.spec.context.as_ref().and_then(|c| c.pod.as_deref()) == Some(&e.name)
            });
            // Or the step's verify probe, with the same key, found it not applied.
            let verified = self.ledger.values().any(|v| {
                v.role == PodRole::Verify
                    && v.key == e.key
                    && v.seq > e.seq
                    && v.succeeded
                    && v.said_not_applied
            });
            let retried = retried || verified;
            assert!(
                retried,
                "D6: {name} runs NonIdempotent step {} (key {key}) again after Pod {} of attempt {} may have acted, without a Retry decision on its Reconcile Approval; approvals: {:?}",
                e.step,
                e.name,
                e.attempt,
                self.w
                    .approvals
                    .values()
                    .map(|a| (&a.metadata.name, a.spec.kind, a.spec.decision))
                    .collect::<Vec<_>>()
            );
        }
    }

    /// D1, D8: the contract protects a step's effect, (run, step name),
    /// across plan revisions. A step that acts runs at a later revision
    /// (under a new key) after one of its executions may have acted only if
    /// a person approved acting again (an Approval with `repeats`).
    pub(super) fn check_effect_once(&self, name: &str, step: &str, rev: i64) {
        let Some(earlier) = self.ledger.values().find(|e| {
            e.acts
                && e.step == step
                && e.plan_revision < rev
                && e.may_have_acted()
                && !force_removed_unrecorded(e)
        }) else {
            return;
        };
        let approved = self.w.approvals.values().any(|a| {
            a.spec.kind == ApprovalKind::Approve
                && a.spec.step == step
                && a.spec.plan_revision == rev
                && a.spec.decision == Some(Answer::Approved)
                && a.spec.context.as_ref().is_some_and(|c| c.repeats.is_some())
        });
        assert!(
            approved,
            "D1: {name} runs step {step} at plan revision {rev} under a new key after Pod {} (revision {}) may have acted, without a person approving the repeat",
            earlier.name, earlier.plan_revision
        );
    }

    pub(super) fn check_world(&self) {
        let mut live: HashMap<String, BTreeSet<String>> = HashMap::new();
        for (n, p) in self.w.pods.iter().filter(|(_, p)| observe::is_live(p)) {
            live.entry(p.metadata.labels.as_ref().unwrap()[labels::IDEMPOTENCY_KEY].clone())
                .or_default()
                .insert(n.clone());
        }
        assert!(
            live.values().all(|names| names.len() <= 1),
            "D2: two live attempts for one key: {live:?}"
        );
    }
}

/// The one way left to run an attempt that may have acted again without a
/// person's word, and what it takes: someone strips the result finalizer
/// (D5) and removes the Pod before any decision saw it, and the operator
/// dies, or its write fails, between creating the Pod and recording its UID.
/// The API server then holds nothing that tells that Pod from one never
/// created, and the attempt is created again under its name and key. Treating
/// every Pod never seen as one that may have acted would instead ask a person
/// after every crash between a launch and its create.
pub(super) fn force_removed_unseen(e: &Execution) -> bool {
    e.vanished && !e.uid_recorded && !e.seen_by_operator
}

/// The same override, for what a step's effect across revisions rests on: a
/// Pod whose UID was not recorded (every step that is not NonIdempotent)
/// and that someone force-removed, finalizer and all, before its outcome was
/// read leaves nothing behind that says it acted. Its attempt runs again
/// under the same key, which is what `Idempotent` allows; a later revision
/// knows nothing of the lost outcome.
pub(super) fn force_removed_unrecorded(e: &Execution) -> bool {
    e.vanished && !e.uid_recorded
}

/// D3 and D9 across one committed write.
pub(super) fn check_status_transition(before: &AgentRunStatus, after: &AgentRunStatus) {
    // D10: a wait's wake is fixed when it starts.
    for old in before.steps.iter().filter(|c| c.wake_at.is_some()) {
        if let Some(new) = after.steps.iter().find(|c| {
            c.role == old.role && c.name == old.name && c.plan_revision == old.plan_revision
        }) {
            assert_eq!(
                new.wake_at, old.wake_at,
                "D10: wait {} moved its wake",
                old.name
            );
        }
    }
    assert!(
        after.tokens_used >= before.tokens_used,
        "D9: tokens never decrease"
    );
    assert!(
        after.step_executions >= before.step_executions,
        "D3: a write never takes the run back (stepExecutions {} -> {})",
        before.step_executions,
        after.step_executions
    );
    if before.phase.is_some_and(RunPhase::is_terminal) {
        assert_eq!(before.phase, after.phase, "terminal phases are sticky");
    }
    for old in before.steps.iter().filter(|c| c.phase.is_terminal()) {
        let new = after
            .steps
            .iter()
            .find(|c| {
                c.role == old.role && c.name == old.name && c.plan_revision == old.plan_revision
            })
            .expect("D3: a recorded checkpoint is never lost");
        // An attempt closed while its Pod ran (`stopping`) gains, once, what
        // that Pod reports when it stops: its tokens, if none was kept, its
        // result, and, if it turns out to have started, an effect that may
        // have happened (Unknown). Nothing recorded before changes.
        let outcome = |c: &StepCheckpoint| {
            let mut c = c.clone();
            if old.stopping {
                c.stopping = false;
                c.tokens = None;
                c.message = None;
                if c.effect == Some(EffectOutcome::Unknown)
                    && old.effect != Some(EffectOutcome::Applied)
                {
                    c.effect = old.effect;
                }
                if old.result.is_none() {
                    c.result = None;
                    c.result_truncated = old.result_truncated;
                }
            }
            c
        };
        assert_eq!(
            outcome(new),
            outcome(old),
            "D3: a recorded checkpoint never changes"
        );
        assert!(
            new.tokens.map_or(0, |t| t.total()) >= old.tokens.map_or(0, |t| t.total()),
            "D9: a checkpoint's tokens never decrease"
        );
    }
    for c in &after.steps {
        assert_eq!(
            c.idempotency_key,
            idempotency_key(UID, c.role.into(), &c.name, c.plan_revision),
            "D1"
        );
    }
}
