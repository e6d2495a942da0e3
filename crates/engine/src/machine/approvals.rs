//! Approval gates and Reconcile approvals: asking (bound to the step's digest
//! and plan revision, D14), waiting durably with expiry ordered by the API
//! server (D10), acting on the decision, and keeping every Approval's status
//! true to whether the run still waits on it. The operator never decides for
//! a person (D15).

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::approval::{self, Answer};
use crate::names::{self, PodRole};
use crate::plan::{self, CheckpointIndex, Plan};
use crate::reasons::Reason;
use crate::{Action, EventType};
use agentrun_api::{
    ApprovalContext, ApprovalKind, Approvers, CheckpointState, Decision as Answered, EffectOutcome,
    OnTimeout, RunPhase, ServiceAccountRef, StepCheckpoint, StepPhase, StepRole, StepSpec,
};

use super::{APPROVAL_CONTEXT_STEPS, Machine};

impl<'a> Machine<'_, 'a> {
    /// The status each of the run's Approvals should show (D10): decided or
    /// expired while its step waits on it or once its decision was acted on;
    /// superseded when the run no longer waits on it — a changed step, a
    /// re-plan, a cancelled or finished run — so a late decision is refused by
    /// the API server instead of being answered into a void.
    pub(super) fn sync_approvals(&mut self) {
        let terminal = self.draft.status.phase.is_some_and(RunPhase::is_terminal);
        for a in self
            .view
            .approvals
            .iter()
            .filter(|a| a.spec.run_uid == self.view.uid)
        {
            let Some(name) = a.metadata.name.clone() else {
                continue;
            };
            let referenced = self
                .draft
                .status
                .steps
                .iter()
                .find(|c| c.approval.as_deref() == Some(&name) && c.phase != StepPhase::Superseded)
                .map(|c| c.phase);
            let why = if terminal {
                "the run has finished".to_owned()
            } else if let Some(other) = self.draft.status.steps.iter().find(|c| {
                c.name == a.spec.step
                    && c.plan_revision == a.spec.plan_revision
                    && c.approval.as_deref().is_some_and(|n| n != name)
            }) {
                format!(
                    "the step changed after this request; the run waits on Approval {} instead",
                    other.approval.clone().unwrap_or_default()
                )
            } else if referenced.is_some() {
                "the run no longer waits on it".to_owned()
            } else {
                let rev = self.draft.status.plan.as_ref().map_or(1, |p| p.revision);
                format!("the run no longer waits on it (plan revision {rev} is in force)")
            };
            if let Some(status) = approval::desired_status(a, self.view.now, referenced, &why) {
                self.draft.actions.push(Action::SetApprovalStatus {
                    name,
                    resource_version: a.metadata.resource_version.clone(),
                    status,
                });
            }
        }
    }

    pub(super) fn find_approval(&self, name: &str) -> Option<&'a agentrun_api::Approval> {
        self.view
            .approvals
            .iter()
            .find(|a| a.metadata.name.as_deref() == Some(name) && a.spec.run_uid == self.view.uid)
    }

    pub(super) fn approval_context(
        &self,
        plan: &Plan,
        reason: String,
        step: &StepSpec,
        key: &str,
        pod: Option<String>,
    ) -> ApprovalContext {
        let index = CheckpointIndex::new(&self.draft.status.steps);
        let mut completed: Vec<String> = (0..plan.steps.len())
            .filter_map(|i| {
                let c =
                    &self.draft.status.steps[index.effective(&self.draft.status.steps, plan, i)?];
                (c.phase == StepPhase::Succeeded).then(|| {
                    let r = c
                        .result
                        .as_ref()
                        .map(|r| r.to_string())
                        .unwrap_or_else(|| "null".into());
                    let short: String = r.chars().take(80).collect();
                    format!("{}: {short}", c.name)
                })
            })
            .collect();
        let skip = completed.len().saturating_sub(APPROVAL_CONTEXT_STEPS);
        completed.drain(..skip);
        ApprovalContext {
            reason,
            effect: Some(step.effect),
            idempotency_key: Some(key.to_owned()),
            pod,
            completed_steps: completed,
            repeats: None,
        }
    }

    /// Opens step `i`'s approval gate, or asks again on checkpoint `c` when
    /// the step changed after the last request (D14): records the wait and
    /// the digest of the step as asked about, then asks (intent, then effect).
    pub(super) fn ask_approval(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        c: Option<usize>,
        why: Option<String>,
    ) {
        let step = plan.steps[i];
        let digest = approval::step_digest(step, self.view.run.spec.pod_template.as_deref());
        let request = c
            .and_then(|c| self.draft.status.steps[c].approval.as_deref())
            .map_or(1, |n| names::approve_request(n) + 1);
        let approval = names::approve_name(
            self.view.name,
            self.view.uid,
            &step.name,
            plan.revision,
            request,
        );
        let c = match c {
            Some(c) => c,
            None => {
                self.draft.status.steps.push(StepCheckpoint {
                    name: step.name.clone(),
                    role: StepRole::Step,
                    plan_revision: plan.revision,
                    attempt: 0,
                    idempotency_key: self.key(PodRole::Step, &step.name, plan.revision),
                    ..StepCheckpoint::default()
                });
                self.draft.status.steps.len() - 1
            }
        };
        let message = match &why {
            None => format!("waiting for Approval {approval}"),
            Some(why) => format!("{why}; waiting for Approval {approval}"),
        };
        let now = self.view.now;
        let cp = &mut self.draft.status.steps[c];
        cp.phase = StepPhase::WaitingForApproval;
        cp.approval = Some(approval.clone());
        cp.step_digest = Some(digest);
        cp.pod = None;
        cp.started_at = Some(Time(now));
        cp.message = Some(message.clone());
        if let Some(t) = step
            .approval
            .as_ref()
            .and_then(|g| plan::duration(g.timeout.as_ref()))
        {
            self.draft.deadlines.push(self.at(t));
        }
        self.request_approval(plan, i, c);
        self.event(
            EventType::Normal,
            Reason::ApprovalRequested,
            format!("step {}: {message}", step.name),
        );
    }

    pub(super) fn request_approval(&mut self, plan: &Plan<'_>, i: usize, c: usize) {
        let step = plan.steps[i];
        let cp = self.draft.status.steps[c].clone();
        let Some(name) = cp.approval.clone() else {
            return;
        };
        // A Reconcile wait follows an attempt whose effect is unknown.
        let reconcile = names::is_reconcile(&name);
        let repeats = if reconcile {
            None
        } else {
            self.repeated_effect(plan, i)
                .filter(|_| cp.plan_revision == plan.revision)
        };
        let (kind, question, expires_at, on_timeout, why) = if !reconcile {
            let gate = step.approval.clone().filter(|g| g.required);
            let expires = gate
                .as_ref()
                .and_then(|g| plan::duration(g.timeout.as_ref()))
                .and_then(|t| {
                    cp.started_at
                        .as_ref()
                        .map(|s| s.0.checked_add(t).unwrap_or(Timestamp::MAX))
                });
            let asked = gate
                .as_ref()
                .and_then(|g| g.question.clone())
                .unwrap_or_else(|| format!("May step {} run?", step.name));
            match &repeats {
                None => (
                    ApprovalKind::Approve,
                    asked,
                    expires,
                    gate.map(|g| g.on_timeout).unwrap_or_default(),
                    format!("step {} requires approval before it starts", step.name),
                ),
                // Acting a second time is never consented to by a timeout.
                Some(r) => (
                    ApprovalKind::Approve,
                    format!(
                        "Step {} already acted at plan revision {} (effect {:?}, key {}). Run it again under a new key? Its effect would happen a second time.{}",
                        step.name,
                        r.plan_revision,
                        r.effect,
                        r.idempotency_key,
                        if gate.is_some() {
                            format!(" {asked}")
                        } else {
                            String::new()
                        }
                    ),
                    expires,
                    OnTimeout::Reject,
                    format!(
                        "plan revision {} needs step {} to run again, and it already acted at plan revision {}",
                        cp.plan_revision, step.name, r.plan_revision
                    ),
                ),
            }
        } else {
            (
                ApprovalKind::Reconcile,
                format!(
                    "Step {} (NonIdempotent) ended on attempt {} without saying it did not act, so it may have acted. Retry it with the same key, mark it succeeded, or mark it failed?",
                    step.name, cp.attempt
                ),
                None,
                OnTimeout::Reject,
                cp.message.clone().unwrap_or_default(),
            )
        };
        let pod = reconcile.then(|| cp.pod.clone()).flatten();
        let mut context = self.approval_context(plan, why, step, &cp.idempotency_key, pod);
        context.repeats = repeats;
        let step_digest = cp.step_digest.clone();
        // Who may answer is the gate's: a Reconcile question about a step
        // goes to the same people as its approval (one answer suffices).
        let gate = step.approval.clone().unwrap_or_default();
        let ns = self
            .view
            .run
            .metadata
            .namespace
            .as_deref()
            .unwrap_or_default();
        let approvers = gate.approvers.map(|a| Approvers {
            service_accounts: ServiceAccountRef::in_namespace(a.service_accounts, ns),
            ..a
        });
        let requested_by = self
            .view
            .run
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(agentrun_api::labels::REQUESTED_BY))
            .cloned();
        let a = approval::build(approval::Request {
            approvers,
            quorum: if reconcile {
                1
            } else {
                gate.quorum.unwrap_or(1)
            },
            separate_from_requester: !reconcile && gate.separate_from_requester,
            requested_by,
            notify: gate.notify,
            escalate: gate.escalate,
            name,
            namespace: self.view.run.metadata.namespace.clone(),
            owner: self.owner(),
            run_name: self.view.name,
            run_uid: self.view.uid,
            step: &step.name,
            plan_revision: cp.plan_revision,
            kind,
            question,
            context,
            expires_at,
            on_timeout,
            step_digest,
        });
        match self
            .view
            .refused
            .iter()
            .find(|r| r.name == a.metadata.name.as_deref().unwrap_or(""))
        {
            None => self.draft.actions.push(Action::CreateApproval(Box::new(a))),
            Some(r) => self.stall(&format!("step {}", step.name), "Approval", r),
        }
    }

    pub(super) fn wait_for_approval(&mut self, plan: &Plan<'_>, i: usize, c: usize) {
        let cp = self.draft.status.steps[c].clone();
        let Some(name) = cp.approval.clone() else {
            return;
        };
        let Some(a) = self.find_approval(&name) else {
            // Asked but not yet visible (or the create was lost): ask again.
            if let Some(t) = plan.steps[i]
                .approval
                .as_ref()
                .and_then(|g| plan::duration(g.timeout.as_ref()))
                && !names::is_reconcile(&name)
                && let Some(s) = &cp.started_at
            {
                self.draft
                    .deadlines
                    .push(s.0.checked_add(t).unwrap_or(Timestamp::MAX));
            }
            return self.request_approval(plan, i, c);
        };
        let step = plan.steps[i].name.clone();
        let reconcile = names::is_reconcile(&name);
        let answer = approval::answer(a, self.view.now);
        {
            // D14: the approval releases only the step it was asked about.
            let digest =
                approval::step_digest(plan.steps[i], self.view.run.spec.pod_template.as_deref());
            let asked = a.spec.step_digest.as_ref().or(cp.step_digest.as_ref());
            // Only an answer that lets the step run needs the step unchanged;
            // a Reconcile answered MarkSucceeded or MarkFailed is about the
            // past attempt, not about what runs next.
            let refused = matches!(
                answer,
                Answer::Decided {
                    decision: Answered::Rejected | Answered::MarkSucceeded | Answered::MarkFailed,
                    ..
                } | Answer::Expired {
                    on_timeout: OnTimeout::Reject
                }
            ) || (reconcile
                && matches!(answer, Answer::Expired { .. } | Answer::Expiring { .. }));
            if asked.is_some_and(|d| *d != digest) && !refused {
                self.draft.recorded = true;
                return self.ask_again(
                    plan,
                    i,
                    c,
                    format!("step {step} changed after Approval {name} was requested"),
                );
            }
        }
        match answer {
            Answer::Pending { expires_at } => {
                if let Some(at) = expires_at {
                    self.draft.deadlines.push(at);
                }
            }
            // The expiry is written to the Approval first (`sync_approvals`);
            // the watch brings the run back once it is.
            Answer::Expiring { .. } => {}
            // The question what an interrupted attempt did still stands: ask
            // it again, as a Reconcile question (D6), never as a gate.
            Answer::Superseded if reconcile => {
                self.draft.recorded = true;
                let again = names::reconcile_name(
                    self.view.name,
                    self.view.uid,
                    &step,
                    cp.plan_revision,
                    cp.attempt,
                    names::reconcile_request(&name) + 1,
                );
                let cp = &mut self.draft.status.steps[c];
                cp.approval = Some(again.clone());
                cp.message = Some(format!(
                    "Approval {name} was superseded while the run still needed its answer; waiting for Approval {again}"
                ));
                self.request_approval(plan, i, c);
            }
            Answer::Superseded => {
                self.draft.recorded = true;
                self.ask_approval(
                    plan,
                    i,
                    Some(c),
                    Some(format!("Approval {name} was superseded")),
                );
            }
            Answer::Expired { on_timeout } if !reconcile => match on_timeout {
                OnTimeout::Approve => {
                    self.event(
                        EventType::Normal,
                        Reason::ApprovalExpired,
                        format!("Approval {name} expired; onTimeout Approve: step {step} runs"),
                    );
                    self.launch(plan, PodRole::Step, &step, cp.plan_revision, cp.attempt + 1);
                }
                OnTimeout::Reject => self.refuse_step(
                    c,
                    Reason::ApprovalExpired,
                    format!("Approval {name} expired without a decision (onTimeout Reject)"),
                ),
            },
            Answer::Expired { .. } => {}
            Answer::Decided {
                decision,
                by,
                comment,
            } => self.act_on_decision(plan, i, c, &name, decision, by, comment),
        }
    }

    /// A person decided the Approval `name` checkpoint `c` waits on: the
    /// step runs (Approved, Retry), fails (Rejected, MarkFailed) or is
    /// recorded as applied by their word (MarkSucceeded).
    #[allow(clippy::too_many_arguments)]
    fn act_on_decision(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        c: usize,
        name: &str,
        decision: Answered,
        by: Option<String>,
        comment: Option<String>,
    ) {
        let reconcile = names::is_reconcile(name);
        let step = plan.steps[i].name.clone();
        let cp = self.draft.status.steps[c].clone();
        self.draft.status.steps[c].decided_by = by.clone();
        let by = by.map(|b| format!(" by {b}")).unwrap_or_default();
        let comment = comment.map(|c| format!(": {c}")).unwrap_or_default();
        match (reconcile, decision) {
            // A journaled step's question was about one call: the answer
            // settles that call, and the next attempt replays past it.
            (true, Answered::Retry) if self.settling(c) => {
                let by = self.draft.status.steps[c].decided_by.clone();
                self.settle_call(
                    c,
                    EffectOutcome::NotApplied,
                    None,
                    by.as_deref().unwrap_or("a person"),
                );
            }
            (true, Answered::MarkSucceeded) if self.settling(c) => {
                let by = self.draft.status.steps[c].decided_by.clone();
                let by = by.as_deref().unwrap_or("a person");
                let response = serde_json::json!({"settled": "Applied", "by": by}).to_string();
                self.settle_call(c, EffectOutcome::Applied, Some(response), by);
            }
            (false, Answered::Approved) | (true, Answered::Retry) => {
                let (rev, attempt) = (cp.plan_revision, cp.attempt + 1);
                let (reason, text) = if reconcile {
                    (
                        Reason::ReconcileDecided,
                        format!("Approval {name}: Retry{by}"),
                    )
                } else {
                    (
                        Reason::ApprovalGranted,
                        format!("Approval {name} approved{by}"),
                    )
                };
                self.draft.status.steps[c].message = Some(text.clone());
                self.event(EventType::Normal, reason, text);
                self.launch(plan, PodRole::Step, &step, rev, attempt);
            }
            (false, Answered::Rejected) => self.refuse_step(
                c,
                Reason::ApprovalRejected,
                format!("Approval {name} rejected{by}{comment}"),
            ),
            (true, Answered::MarkSucceeded) => {
                let fresh_for = plan::duration(plan.steps[i].fresh_for.as_ref());
                let now = self.view.now;
                let cp = &mut self.draft.status.steps[c];
                cp.phase = StepPhase::Succeeded;
                cp.checkpoint = CheckpointState::Committed;
                cp.effect = Some(EffectOutcome::Applied);
                cp.finished_at = Some(Time(now));
                cp.fresh_until =
                    fresh_for.map(|d| Time(now.checked_add(d).unwrap_or(Timestamp::MAX)));
                cp.provenance = Some(agentrun_api::Provenance::Marked);
                cp.message = Some(format!("marked succeeded{by}{comment}"));
                self.draft.recorded = true;
                self.event(
                    EventType::Normal,
                    Reason::ReconcileDecided,
                    format!("Approval {name}: MarkSucceeded{by}"),
                );
            }
            (true, Answered::MarkFailed) => self.refuse_step(
                c,
                Reason::StepFailed,
                format!("Approval {name}: marked failed{by}{comment}"),
            ),
            _ => {} // admission forbids mismatched decisions; ignore them
        }
    }

    /// An attempt of plan step checkpoint `c` ended in a way that may have
    /// acted, and the step is NonIdempotent: the run does not guess (D6). It
    /// asks the step's verify probe, if it has one and has not used it at
    /// this revision; otherwise a person, bound to the step as it is now
    /// (D14: a `Retry` runs exactly this).
    pub(super) fn ask_reconcile(&mut self, plan: &Plan<'_>, c: usize, what_happened: String) {
        // A journaled step is asked about the one call that may have acted.
        let what_happened = match self.note_open_call(plan, c) {
            Some(call) => format!("{what_happened}; {call}"),
            None => what_happened,
        };
        if self.can_verify(plan, c) {
            return self.start_verifying(plan, c, what_happened);
        }
        self.ask_person(plan, c, what_happened);
    }

    /// The Reconcile question itself: a person says what the attempt did.
    pub(super) fn ask_person(&mut self, plan: &Plan<'_>, c: usize, what_happened: String) {
        let digest = plan
            .step(&self.draft.status.steps[c].name)
            .map(|s| approval::step_digest(s, self.view.run.spec.pod_template.as_deref()));
        let (run, uid) = (self.view.name, self.view.uid);
        let cp = &mut self.draft.status.steps[c];
        let approval = names::reconcile_name(run, uid, &cp.name, cp.plan_revision, cp.attempt, 1);
        let message = format!(
            "{what_happened}; the step is NonIdempotent and may have acted: waiting for Approval {approval}"
        );
        cp.effect = Some(EffectOutcome::Unknown);
        cp.phase = StepPhase::WaitingForApproval;
        cp.approval = Some(approval);
        cp.step_digest = digest;
        cp.next_attempt_at = None;
        cp.message = Some(message.clone());
        let text = format!("step {}: {message}", cp.name);
        self.draft.recorded = true;
        self.event(EventType::Warning, Reason::StepOutcomeUnknown, text);
    }

    /// The step changed after checkpoint `c`'s question was asked: ask it
    /// again about the step as it is now — the same question, a new request.
    pub(super) fn ask_again(&mut self, plan: &Plan<'_>, i: usize, c: usize, why: String) {
        let cp = &self.draft.status.steps[c];
        let waiting_reconcile = cp.phase == StepPhase::WaitingForApproval
            && cp.approval.as_deref().is_some_and(names::is_reconcile);
        if !waiting_reconcile {
            return self.ask_approval(plan, i, Some(c), Some(why));
        }
        let old = cp.approval.clone().unwrap_or_default();
        let again = names::reconcile_name(
            self.view.name,
            self.view.uid,
            &cp.name,
            cp.plan_revision,
            cp.attempt,
            names::reconcile_request(&old) + 1,
        );
        let digest =
            approval::step_digest(plan.steps[i], self.view.run.spec.pod_template.as_deref());
        let cp = &mut self.draft.status.steps[c];
        cp.approval = Some(again.clone());
        cp.step_digest = Some(digest);
        cp.message = Some(format!("{why}; waiting for Approval {again}"));
        self.request_approval(plan, i, c);
        self.event(
            EventType::Normal,
            Reason::ApprovalRequested,
            format!(
                "step {}: {why}; waiting for Approval {again}",
                plan.steps[i].name
            ),
        );
    }

    /// A person (or an expiry) said no: the step fails and the run winds down.
    pub(super) fn refuse_step(&mut self, c: usize, why: Reason, message: String) {
        let now = self.view.now;
        let cp = &mut self.draft.status.steps[c];
        cp.phase = StepPhase::Failed;
        cp.checkpoint = CheckpointState::Committed;
        cp.finished_at = Some(Time(now));
        if cp.effect != Some(EffectOutcome::Unknown) || why == Reason::StepFailed {
            cp.effect = Some(EffectOutcome::NotApplied);
        }
        cp.message = Some(message.clone());
        let name = cp.name.clone();
        self.fail_run(why, format!("step {name}: {message}"));
    }
}
