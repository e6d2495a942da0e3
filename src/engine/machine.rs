//! The decision itself: one fixed order of stages over the facts of one run,
//! like the Job controller's sync.
//!
//! 1. terminal runs: release finalizers, TTL (D12) — nothing else moves them;
//! 2. plan: validate the spec, start plan revision 1 (D13);
//! 3. release finalizers of Pods whose outcome the input status holds (D5);
//! 4. observe the running attempt: record its outcome (D3, D6, D7, D9);
//! 5. run limits: cancel, active deadline, token budget;
//! 6. unless this decision recorded a failure, a disruption, a re-plan or a
//!    planner's plan: start what comes next — planner, approval gate, re-plan
//!    on stale input (D8), compactor (D11), the next attempt (D1, D2) — or
//!    wind down through compensation. A step's success and the launch of the
//!    step after it share one status write; the controller applies actions
//!    only once that write is acknowledged, so the next Pod never exists
//!    before the checkpoint it depends on is saved (D4);
//! 7. derive phase, progress and conditions from the result.

use std::collections::HashMap;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use serde_json::Value;

use super::approval::{self, Answer};
use super::conditions::{self as cond, FALSE, TRUE, UNKNOWN};
use super::context::{self, Identity, PriorResult};
use super::names::{self, PodRole};
use super::observe::{self, Observation};
use super::plan::{self, CheckpointIndex, Plan};
use super::pods::{self, PodRequest};
use super::reasons::{condition, reason};
use super::result;
use super::{Action, Decision, EventType, Observed, Refusal, RefusalCause};
use crate::api::{
    AgentRun, AgentRunStatus, ApprovalContext, ApprovalKind, CheckpointState,
    CompensationCheckpoint, DEFAULT_CONTEXT_BYTES, Decision as Answered, Effect, EffectOutcome,
    MAX_CONTEXT_BYTES, OnTimeout, PlanSource, PlanStatus, RunPhase, StepCheckpoint, StepContainer,
    StepPhase, StepRole, StepSpec, TokenUsage,
};

/// Largest result kept inline in one checkpoint (serialized bytes): a whole
/// termination message, so a result is only ever left out by the run-wide cap.
pub const MAX_INLINE_RESULT: usize = 4096;
/// Largest total of inline results across the run; later results are kept
/// out of status (`resultTruncated`) so a 500-step run stays < 256 KiB (D11).
pub const MAX_INLINE_RESULTS: usize = 48 * 1024;
/// Re-plans for stale input before the run gives up: a freshness budget
/// shorter than the steps (or approvals) after it can never be met.
pub const MAX_REPLANS: i64 = 20;
/// D11: above this size the status is compacted: the oldest finished
/// checkpoints are cut to their facts (see `StepCheckpoint::compacted`) and
/// finished compactor checkpoints whose step has started are dropped.
pub const COMPACT_STATUS_ABOVE: usize = 128 * 1024;
/// D11: most checkpoints a run's status holds. A re-plan that could take it
/// past this is refused. With maximal names a compacted checkpoint is about
/// 320 bytes, so 520 of them, the inline results (48 KiB) and the plan's step
/// names (25 KiB) stay under etcd's budget of 256 KiB.
pub const MAX_CHECKPOINTS: usize = 520;
/// Prior results named in an Approval's context.
const APPROVAL_CONTEXT_STEPS: usize = 20;

pub(super) fn decide(obs: &Observed) -> Decision {
    let input = obs.run.status.clone().unwrap_or_default();
    let mut m = Machine::new(obs, input);
    m.run();
    m.finish()
}

struct Machine<'a> {
    run: &'a AgentRun,
    approvals: &'a [crate::api::Approval],
    name: &'a str,
    uid: &'a str,
    now: Timestamp,
    /// `now` before truncation, for deadlines that must never come early.
    exact_now: Timestamp,
    /// The input status: what the API server has acknowledged.
    committed: AgentRunStatus,
    /// The status being decided.
    status: AgentRunStatus,
    actions: Vec<Action>,
    deadlines: Vec<Timestamp>,
    /// This decision recorded something that changes what comes next (a
    /// failure, a disruption, a re-plan, a planner's plan): the next decision
    /// starts from it once it is committed. A step's success is not among
    /// them: what follows it is decided in the same write (D4 holds because
    /// actions are applied only after that write).
    recorded: bool,
    /// Our Pods (controlled by this run's UID) by name.
    pods: HashMap<&'a str, &'a Pod>,
    /// Creations the API server refused in this reconcile.
    refused: &'a [Refusal],
    /// A refusal this decision met: the run is stalled (D16).
    stalled: Option<(&'static str, String)>,
}

impl<'a> Machine<'a> {
    fn new(obs: &'a Observed<'a>, input: AgentRunStatus) -> Self {
        let run = obs.run;
        let uid = run.metadata.uid.as_deref().unwrap_or("");
        let pods = obs
            .pods
            .iter()
            .filter(|p| observe::owned_by(p, uid))
            .filter_map(|p| Some((p.metadata.name.as_deref()?, p)))
            .collect();
        Machine {
            run,
            approvals: obs.approvals,
            name: run.metadata.name.as_deref().unwrap_or(""),
            uid,
            // Status timestamps (metav1.Time) keep whole seconds. Deciding on the
            // same resolution keeps stamps and comparisons consistent with what
            // is read back; backoff deadlines round up (see `backoff_until`).
            now: whole_seconds(obs.now),
            exact_now: obs.now,
            status: input.clone(),
            committed: input,
            actions: Vec::new(),
            deadlines: Vec::new(),
            recorded: false,
            pods,
            refused: obs.refused,
            stalled: None,
        }
    }

    fn run(&mut self) {
        self.status.observed_generation = self.run.metadata.generation;
        if self.run.metadata.deletion_timestamp.is_some() {
            // The run is going away; its results have nowhere to go. Its Pods
            // are the garbage collector's to delete (foreground) or to keep
            // (`--cascade=orphan`): only their finalizers are released.
            let mut pods: Vec<&Pod> = self.pods.values().copied().collect();
            pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            for pod in pods
                .into_iter()
                .filter(|p| observe::has_result_finalizer(p))
            {
                self.actions.push(Action::ReleaseFinalizer {
                    pod: pod.metadata.name.clone().unwrap_or_default(),
                });
            }
            return;
        }
        if self.status.phase.is_some_and(RunPhase::is_terminal) {
            self.terminal();
            return;
        }
        if self.status.phase.is_none() {
            self.status.phase = Some(RunPhase::Pending);
        }
        if self.status.started_at.is_none() {
            self.status.started_at = Some(Time(self.now));
        }
        // The spec only changes with the generation: validate it once per generation.
        let validated = self.committed.plan.is_some()
            && self.committed.observed_generation == self.run.metadata.generation;
        let spec_error = if validated {
            None
        } else {
            plan::validate_spec(&self.run.spec).err()
        };
        if self.status.plan.is_none() {
            self.status.plan = Some(PlanStatus {
                revision: 1,
                reason: "initial plan from spec.steps".into(),
                source: PlanSource::Spec,
                step_names: self.run.spec.steps.iter().map(|s| s.name.clone()).collect(),
                steps: Vec::new(),
                rerun_from: None,
            });
        }
        let plan_status = self.status.plan.clone().unwrap_or_default();
        let spec = &self.run.spec;
        let resolved = match spec_error {
            Some(e) => Err(e),
            None => Plan::resolve(spec, &plan_status),
        };
        let plan = match resolved {
            Ok(plan) => plan,
            Err(e) => {
                // D13: refuse with a clear condition and wait; no hot loop.
                self.release_accounted_pods();
                if !self.failing() {
                    self.fail_run(reason::INVALID_SPEC, e);
                }
                let empty = Plan {
                    revision: plan_status.revision,
                    steps: Vec::new(),
                    rerun_from: 0,
                };
                self.wind_down(&empty);
                self.derive(&empty);
                self.sync_approvals();
                return;
            }
        };
        self.release_accounted_pods();
        self.observe_running(&plan);
        self.enforce_limits();
        if self.failing() {
            self.wind_down(&plan);
        } else if !self.recorded {
            self.advance(&plan);
        }
        // A planner's plan or a re-plan may have changed the plan in force.
        let plan_status = self.status.plan.clone().unwrap_or_default();
        match Plan::resolve(spec, &plan_status) {
            Ok(p) => self.derive(&p),
            Err(_) => self.derive(&plan),
        }
        // Last: which Approvals the run waits on is known only now.
        self.sync_approvals();
        self.compact_status();
    }

    /// D11: keeps the status under its size budget whatever the names and
    /// the number of steps. Only finished checkpoints are touched, and only
    /// what no rule reads again: the facts of every outcome stay.
    fn compact_status(&mut self) {
        if self.status == self.committed {
            return; // nothing is written: nothing grows
        }
        let size = |s: &AgentRunStatus| serde_json::to_vec(s).map_or(0, |v| v.len());
        let mut excess = size(&self.status).saturating_sub(COMPACT_STATUS_ABOVE);
        if excess == 0 {
            return;
        }
        // Compactors whose step has started: their summary is in the status.
        let started: std::collections::HashSet<(String, i64)> = self
            .status
            .steps
            .iter()
            .filter(|c| c.role == StepRole::Step)
            .map(|c| (c.name.clone(), c.plan_revision))
            .collect();
        self.status.steps.retain(|c| {
            let drop = excess > 0
                && c.role == StepRole::Compactor
                && c.phase.is_terminal()
                && !c.stopping
                && started.contains(&(c.name.clone(), c.plan_revision));
            if drop {
                excess = excess.saturating_sub(serde_json::to_vec(c).map_or(0, |v| v.len()));
            }
            !drop
        });
        for c in self.status.steps.iter_mut() {
            if excess == 0 {
                break;
            }
            if !c.phase.is_terminal()
                || c.checkpoint != CheckpointState::Committed
                || c.stopping
                || c.compacted
            {
                continue;
            }
            let before = serde_json::to_vec(&*c).map_or(0, |v| v.len());
            c.pod = None;
            c.pod_uid = None;
            c.started_at = None;
            c.tokens = None;
            c.message = None;
            c.compacted = true;
            let after = serde_json::to_vec(&*c).map_or(0, |v| v.len());
            excess = excess.saturating_sub(before.saturating_sub(after));
        }
    }

    fn finish(self) -> Decision {
        let terminal = self.status.phase.is_some_and(RunPhase::is_terminal);
        let requeue_after = if self.status != self.committed && !terminal {
            Some(SignedDuration::ZERO)
        } else {
            self.deadlines
                .iter()
                .min()
                .map(|at| at.duration_since(self.now).max(SignedDuration::ZERO))
        };
        Decision {
            status: self.status,
            actions: self.actions,
            requeue_after,
        }
    }

    // -----------------------------------------------------------------------
    // Small helpers
    // -----------------------------------------------------------------------

    fn event(&mut self, type_: EventType, reason: &'static str, message: String) {
        self.actions.push(Action::Event {
            type_,
            reason,
            message,
        });
    }

    /// Emits the creation of `pod`, unless the API server refused it in this
    /// reconcile: then the refusal is returned and the run shows it (D16).
    fn create_pod(&mut self, what: &str, pod: Pod) -> Option<&'a Refusal> {
        let name = pod.metadata.name.as_deref().unwrap_or("");
        match self.refused.iter().find(|r| r.name == name) {
            None => {
                self.actions.push(Action::CreatePod(Box::new(pod)));
                None
            }
            Some(r) => {
                self.stall(what, "Pod", r);
                Some(r)
            }
        }
    }

    /// Records that a creation the run needs was refused: a `Stalled`
    /// condition and a Warning Event, both with the API server's message.
    fn stall(&mut self, what: &str, kind: &str, r: &Refusal) {
        let (why, text) = match r.cause {
            RefusalCause::NameTaken => (
                reason::NAME_TAKEN,
                format!(
                    "{what}: {kind} {} exists but does not belong to this run; delete or rename it: {}",
                    r.name, r.message
                ),
            ),
            RefusalCause::Rejected | RefusalCause::Transient => (
                reason::FAILED_CREATE,
                format!(
                    "{what}: the API server refused {kind} {}: {}",
                    r.name, r.message
                ),
            ),
        };
        self.event(EventType::Warning, reason::FAILED_CREATE, text.clone());
        self.stalled = Some((why, text));
    }

    /// When a backoff of `d` that starts now ends, rounded up to the whole
    /// second that status can hold: the retry never comes before `d` has
    /// passed, and at most a second after.
    fn backoff_until(&self, d: SignedDuration) -> Timestamp {
        let exact = self.exact_now.checked_add(d).unwrap_or(Timestamp::MAX);
        let whole = whole_seconds(exact);
        if whole < exact {
            whole
                .checked_add(SignedDuration::from_secs(1))
                .unwrap_or(Timestamp::MAX)
        } else {
            whole
        }
    }

    fn at(&self, d: SignedDuration) -> Timestamp {
        self.now.checked_add(d).unwrap_or(Timestamp::MAX)
    }

    fn due(&mut self, at: Option<&Time>) -> bool {
        match at {
            Some(t) if t.0 > self.now => {
                self.deadlines.push(t.0);
                false
            }
            _ => true,
        }
    }

    fn failing(&self) -> bool {
        cond::is_true(&self.status.conditions, condition::FAILURE_TARGET)
    }

    fn owner(&self) -> OwnerReference {
        OwnerReference {
            api_version: "agentrun.dev/v1alpha1".into(),
            kind: "AgentRun".into(),
            name: self.name.to_owned(),
            uid: self.uid.to_owned(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    fn key(&self, role: PodRole, step: &str, rev: i64) -> String {
        names::idempotency_key(self.uid, role, step, rev)
    }

    /// Whether a live Pod of ours carries this idempotency key (D2).
    fn live_pod_with_key(&self, key: &str) -> bool {
        self.pods.values().any(|p| {
            observe::is_live(p)
                && p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(crate::labels::IDEMPOTENCY_KEY))
                    .map(String::as_str)
                    == Some(key)
        })
    }

    fn step_spec(&self, plan: &Plan<'_>, name: &str) -> Option<StepSpec> {
        plan.step(name)
            .or_else(|| self.run.spec.steps.iter().find(|s| s.name == name))
            .or_else(|| {
                self.status
                    .plan
                    .as_ref()?
                    .steps
                    .iter()
                    .find(|s| s.name == name)
            })
            .cloned()
    }

    // -----------------------------------------------------------------------
    // Finalizers (D5) and terminal runs (D12)
    // -----------------------------------------------------------------------

    /// Whether the input status accounts for this Pod's attempt: its slot has
    /// moved past it or is no longer running it.
    fn accounted(&self, pod: &Pod) -> Option<bool> {
        let c = observe::coords(pod)?;
        let (attempt, phase) = match c.role {
            PodRole::Compensate => {
                let cp = self
                    .committed
                    .compensations
                    .iter()
                    .find(|x| x.name == c.step && x.plan_revision == c.plan_revision)?;
                (cp.attempt, cp.phase)
            }
            role => {
                let step_role = match role {
                    PodRole::Planner => StepRole::Planner,
                    PodRole::Compactor => StepRole::Compactor,
                    _ => StepRole::Step,
                };
                let cp = self.committed.steps.iter().find(|x| {
                    x.role == step_role && x.name == c.step && x.plan_revision == c.plan_revision
                })?;
                (cp.attempt, cp.phase)
            }
        };
        Some(c.attempt < attempt || (c.attempt == attempt && phase != StepPhase::Running))
    }

    fn release_accounted_pods(&mut self) {
        let mut pods: Vec<&Pod> = self.pods.values().copied().collect();
        pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        for pod in pods {
            if self.accounted(pod) != Some(true) || self.awaits_report(pod) {
                continue;
            }
            self.stop_and_release(pod, "the attempt is already accounted for");
        }
    }

    /// For the Pod of an attempt the operator ended while it still ran
    /// (`stopping`): true while the Pod is still stopping, so it keeps its
    /// finalizer; once it has stopped, what it reported is recorded — its
    /// tokens, and the result of a step that finished after all, which a
    /// compensation may need — and it may be released in the same decision,
    /// since actions follow the write (D5, D9). A Pod still running when its
    /// grace period has ended is on a lost node and is given up on.
    fn awaits_report(&mut self, pod: &Pod) -> bool {
        let Some(c) = observe::coords(pod) else {
            return false;
        };
        let role = match c.role {
            PodRole::Step => StepRole::Step,
            PodRole::Planner => StepRole::Planner,
            PodRole::Compactor => StepRole::Compactor,
            PodRole::Compensate => return false,
        };
        let Some(i) = self.status.steps.iter().position(|x| {
            x.stopping
                && x.role == role
                && x.name == c.step
                && x.plan_revision == c.plan_revision
                && x.attempt == c.attempt
        }) else {
            return false;
        };
        if observe::is_live(pod) {
            match pod.metadata.deletion_timestamp.as_ref() {
                Some(gone_by) if gone_by.0 <= self.now => {
                    let cp = &mut self.status.steps[i];
                    cp.stopping = false;
                    cp.message = Some(format!(
                        "{}; its Pod did not stop within its grace period (a lost node?), so what it reports is not awaited",
                        cp.message.as_deref().unwrap_or("stopped")
                    ));
                    return false;
                }
                Some(gone_by) => self.deadlines.push(gone_by.0),
                None => {
                    self.actions.push(Action::DeletePod {
                        name: pod.metadata.name.clone().unwrap_or_default(),
                        reason: "the attempt has ended".into(),
                    });
                }
            }
            return true;
        }
        let (message, exited_ok) = match observe::observe(Some(pod), None) {
            Observation::Succeeded { message } => (message, true),
            Observation::Failed { message, .. } | Observation::Disrupted { message, .. } => {
                (message, false)
            }
            _ => (None, false),
        };
        let tokens = result::tokens_best_effort(message.as_deref());
        self.add_tokens(i, tokens);
        let report = exited_ok
            .then(|| result::parse(message.as_deref()).ok())
            .flatten();
        let (result, truncated) = match report {
            Some(r) => self.cap_result(r.result),
            None => (None, false),
        };
        let cp = &mut self.status.steps[i];
        cp.stopping = false;
        let told = cp.message.clone().unwrap_or_else(|| "stopped".into());
        if exited_ok && cp.result.is_none() {
            cp.result = result;
            cp.result_truncated |= truncated;
            cp.message = Some(format!(
                "{told}; its Pod then finished with exit code 0, and its result is kept"
            ));
        } else if tokens.total() > 0 {
            cp.message = Some(format!(
                "{told}; its Pod then stopped, reporting {} tokens",
                tokens.total()
            ));
        }
        false
    }

    fn stop_and_release(&mut self, pod: &Pod, why: &str) {
        let name = pod.metadata.name.clone().unwrap_or_default();
        if observe::is_live(pod) && pod.metadata.deletion_timestamp.is_none() {
            self.actions.push(Action::DeletePod {
                name: name.clone(),
                reason: why.to_owned(),
            });
        }
        if observe::has_result_finalizer(pod) {
            self.actions.push(Action::ReleaseFinalizer { pod: name });
        }
    }

    fn release_all_pods(&mut self) {
        let mut pods: Vec<&Pod> = self.pods.values().copied().collect();
        pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        for pod in pods {
            self.stop_and_release(pod, "the run has finished");
        }
    }

    /// Terminal phases are sticky: only cleanup and TTL remain.
    fn terminal(&mut self) {
        // Once terminal no outcome can change the run, so every Pod may go;
        // all attempts were accounted for before the run became terminal.
        self.release_all_pods();
        self.sync_approvals();
        if let (Some(ttl), Some(done)) = (
            self.run.spec.ttl_seconds_after_finished,
            &self.status.completed_at,
        ) {
            let at = done
                .0
                .checked_add(SignedDuration::from_secs(ttl.max(0).into()))
                .unwrap_or(Timestamp::MAX);
            if at <= self.now {
                self.actions.push(Action::DeleteRun);
            } else {
                self.deadlines.push(at);
            }
        }
    }

    // -----------------------------------------------------------------------
    // Approvals (D10)
    // -----------------------------------------------------------------------

    /// The status each of the run's Approvals should show (D10): decided or
    /// expired while its step waits on it or once its decision was acted on;
    /// superseded when the run no longer waits on it — a changed step, a
    /// re-plan, a cancelled or finished run — so a late decision is refused by
    /// the API server instead of being answered into a void.
    fn sync_approvals(&mut self) {
        let terminal = self.status.phase.is_some_and(RunPhase::is_terminal);
        for a in self.approvals.iter().filter(|a| a.spec.run_uid == self.uid) {
            let Some(name) = a.metadata.name.clone() else {
                continue;
            };
            let referenced = self
                .status
                .steps
                .iter()
                .find(|c| c.approval.as_deref() == Some(&name) && c.phase != StepPhase::Superseded)
                .map(|c| c.phase);
            let why = if terminal {
                "the run has finished".to_owned()
            } else if let Some(other) = self.status.steps.iter().find(|c| {
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
                let rev = self.status.plan.as_ref().map_or(1, |p| p.revision);
                format!("the run no longer waits on it (plan revision {rev} is in force)")
            };
            if let Some(status) = approval::desired_status(a, self.now, referenced, &why) {
                self.actions.push(Action::SetApprovalStatus {
                    name,
                    resource_version: a.metadata.resource_version.clone(),
                    status,
                });
            }
        }
    }

    fn find_approval(&self, name: &str) -> Option<&'a crate::api::Approval> {
        self.approvals
            .iter()
            .find(|a| a.metadata.name.as_deref() == Some(name) && a.spec.run_uid == self.uid)
    }

    fn approval_context(
        &self,
        plan: &Plan,
        reason: String,
        step: &StepSpec,
        key: &str,
        pod: Option<String>,
    ) -> ApprovalContext {
        let index = CheckpointIndex::new(&self.status.steps);
        let mut completed: Vec<String> = (0..plan.steps.len())
            .filter_map(|i| {
                let c = &self.status.steps[index.effective(&self.status.steps, plan, i)?];
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
        }
    }

    // -----------------------------------------------------------------------
    // Observing running attempts
    // -----------------------------------------------------------------------

    fn observe_running(&mut self, plan: &Plan<'_>) {
        let running: Vec<usize> = (0..self.status.steps.len())
            .filter(|&i| self.status.steps[i].phase == StepPhase::Running)
            .collect();
        for i in running {
            self.observe_step(plan, i);
        }
        let running: Vec<usize> = (0..self.status.compensations.len())
            .filter(|&i| self.status.compensations[i].phase == StepPhase::Running)
            .collect();
        for i in running {
            self.observe_compensation(plan, i);
        }
    }

    fn observe_step(&mut self, plan: &Plan<'_>, i: usize) {
        let cp = self.status.steps[i].clone();
        let pod_name = cp.pod.clone().unwrap_or_default();
        let pod = self.pods.get(pod_name.as_str()).copied();
        match observe::observe(pod, cp.pod_uid.as_deref()) {
            Observation::NotSeen => {
                // Intent is in status; the create may not have happened (a
                // crash between the write and the create) or the cache may
                // lag. Create-if-absent makes repeating it safe, but a create
                // made now starts the step now: it must still be allowed to.
                if self.run.spec.suspend {
                    return;
                }
                if cp.role == StepRole::Step
                    && cp.plan_revision == plan.revision
                    && let Some(at) = plan.steps.iter().position(|s| s.name == cp.name)
                {
                    if self.replan_if_stale(plan, at) {
                        return; // D8: never started on inputs that went stale meanwhile
                    }
                    let digest =
                        approval::step_digest(plan.steps[at], self.run.spec.pod_template.as_ref());
                    if cp.step_digest.as_ref().is_some_and(|d| *d != digest) {
                        // D14: approved, then changed before its Pod existed.
                        self.recorded = true;
                        return self.ask_approval(
                            plan,
                            at,
                            Some(i),
                            Some(format!(
                                "step {} changed after it was approved and before its Pod was created",
                                cp.name
                            )),
                        );
                    }
                }
                if let Some(pod) = self.pod_for_step(plan, &cp) {
                    let what = format!("step {}", cp.name);
                    if let Some(r) = self.create_pod(&what, pod)
                        && r.cause == RefusalCause::Rejected
                    {
                        // The same Pod would be refused again: a failed attempt.
                        let why = format!(
                            "attempt {}: the API server refused its Pod {}: {}",
                            cp.attempt, r.name, r.message
                        );
                        self.on_failure(plan, i, why, TokenUsage::default(), false);
                    }
                }
            }
            Observation::Live { uid } => {
                if cp.pod_uid.is_none() && uid.is_some() && self.may_have_acted_matters(plan, &cp) {
                    self.status.steps[i].pod_uid = uid;
                }
                self.check_timeout(plan, i);
            }
            Observation::Terminating { uid } => {
                if cp.pod_uid.is_none() && uid.is_some() && self.may_have_acted_matters(plan, &cp) {
                    self.status.steps[i].pod_uid = uid;
                }
            }
            Observation::Succeeded { message } => self.on_success(plan, i, message.as_deref()),
            Observation::Failed {
                exit_code,
                reason,
                message,
            } => {
                let tokens = result::tokens_best_effort(message.as_deref());
                let why = format!(
                    "attempt {} exited with code {exit_code} ({reason})",
                    cp.attempt
                );
                self.on_failure(plan, i, why, tokens, false);
            }
            Observation::Disrupted {
                reason,
                started,
                message,
            } => {
                let tokens = result::tokens_best_effort(message.as_deref());
                self.on_disruption(plan, i, &reason, started, tokens);
            }
            Observation::Vanished => {
                self.on_disruption(plan, i, "its Pod vanished", true, TokenUsage::default());
            }
        }
    }

    /// Whether a Pod of this attempt that vanished unseen must be told apart
    /// from one never created, which costs a status write to record its UID.
    /// Only a NonIdempotent step's answer differs (a Reconcile approval
    /// instead of running again with the same key, D6). For every other step
    /// a vanished Pod is created again under the same name and key, which is
    /// what a disruption leads to anyway. The result finalizer keeps every
    /// deleted or evicted Pod visible until its outcome is committed, so only
    /// a Pod whose finalizer someone stripped can vanish at all.
    fn may_have_acted_matters(&self, plan: &Plan<'_>, cp: &StepCheckpoint) -> bool {
        cp.role == StepRole::Step
            && self
                .step_spec(plan, &cp.name)
                .is_none_or(|s| s.effect == Effect::NonIdempotent)
    }

    fn check_timeout(&mut self, plan: &Plan<'_>, i: usize) {
        let cp = &self.status.steps[i];
        let timeout = match cp.role {
            StepRole::Step => self
                .step_spec(plan, &cp.name)
                .and_then(|s| plan::duration(s.timeout.as_ref())),
            StepRole::Planner => self
                .run
                .spec
                .planner
                .as_ref()
                .and_then(|s| plan::duration(s.timeout.as_ref())),
            StepRole::Compactor => None,
        };
        let (Some(timeout), Some(launched)) = (timeout, cp.started_at.as_ref()) else {
            return;
        };
        // Step time starts when the Pod exists: a Pod created late (the
        // operator died between recording the launch and creating it) is not
        // charged for the downtime. Both stamps hold whole seconds; the event
        // happened within the second after, so counting from the end of that
        // second stops an attempt at most a second late, never early.
        let created = cp
            .pod
            .as_deref()
            .and_then(|p| self.pods.get(p))
            .and_then(|p| p.metadata.creation_timestamp.as_ref())
            .map(|t| t.0);
        let from = created.map_or(launched.0, |c| c.max(launched.0));
        let deadline = from
            .checked_add(SignedDuration::from_secs(1))
            .and_then(|t| t.checked_add(timeout))
            .unwrap_or(Timestamp::MAX);
        if deadline > self.now {
            self.deadlines.push(deadline);
            return;
        }
        let pod = cp.pod.clone().unwrap_or_default();
        let started = self
            .pods
            .get(pod.as_str())
            .is_none_or(|p| observe::started(p));
        let why = format!(
            "attempt {} timed out after {}",
            cp.attempt,
            timeout_text(timeout)
        );
        self.actions.push(Action::DeletePod {
            name: pod.clone(),
            reason: why.clone(),
        });
        self.event(
            EventType::Warning,
            reason::STEP_TIMED_OUT,
            format!("step {}: {why}", cp.name),
        );
        self.on_failure(plan, i, why, TokenUsage::default(), started);
        // What the Pod reports while it stops is still recorded (D9).
        self.status.steps[i].stopping = true;
    }

    fn add_tokens(&mut self, i: usize, t: TokenUsage) {
        if t.total() == 0 {
            return;
        }
        let cp = &mut self.status.steps[i];
        let mut sum = cp.tokens.unwrap_or_default();
        sum.input = sum.input.saturating_add(t.input);
        sum.output = sum.output.saturating_add(t.output);
        cp.tokens = Some(sum);
        self.status.tokens_used = self.status.tokens_used.saturating_add(t.total());
    }

    fn on_success(&mut self, plan: &Plan<'_>, i: usize, message: Option<&str>) {
        let attempt = self.status.steps[i].attempt;
        let report = match result::parse(message) {
            Ok(r) => r,
            Err(e) => {
                let why = format!("attempt {attempt} returned an unusable result: {e}");
                // Whatever tokens it reported were spent all the same (D9).
                let tokens = result::tokens_best_effort(message);
                return self.on_failure(plan, i, why, tokens, true);
            }
        };
        let role = self.status.steps[i].role;
        let planned = match role {
            StepRole::Planner => match plan::parse_planner_plan(report.plan.as_ref()) {
                Ok(steps) => Some(steps),
                Err(e) => {
                    // An invalid plan is a failed attempt: retried within
                    // `retry.limit`, then the run fails for that reason.
                    let name = self.status.steps[i].name.clone();
                    let why = format!("attempt {attempt} returned an invalid plan: {e}");
                    self.on_failure(plan, i, why, report.tokens, false);
                    if self.status.steps[i].phase == StepPhase::Failed {
                        cond::set(
                            &mut self.status.conditions,
                            condition::FAILURE_TARGET,
                            TRUE,
                            reason::INVALID_PLAN,
                            format!("planner {name}: {e}"),
                            self.run.metadata.generation,
                            self.now,
                        );
                    }
                    return;
                }
            },
            _ => None,
        };
        self.add_tokens(i, report.tokens);
        let spec = match role {
            StepRole::Step => self.step_spec(plan, &self.status.steps[i].name),
            StepRole::Planner => self.run.spec.planner.clone(),
            StepRole::Compactor => None,
        };
        let (inline, truncated) = self.cap_result(report.result);
        let cp = &mut self.status.steps[i];
        cp.phase = StepPhase::Succeeded;
        cp.checkpoint = CheckpointState::Committed;
        cp.finished_at = Some(Time(self.now));
        cp.pod_uid = None;
        cp.next_attempt_at = None;
        cp.result = inline;
        cp.result_truncated = truncated;
        if role == StepRole::Step {
            let effect = spec.as_ref().map_or(Effect::NonIdempotent, |s| s.effect);
            cp.effect = Some(if effect == Effect::None {
                EffectOutcome::NotApplied
            } else {
                EffectOutcome::Applied
            });
        }
        let fresh_for = spec
            .as_ref()
            .and_then(|s| plan::duration(s.fresh_for.as_ref()));
        cp.fresh_until = fresh_for.map(|d| Time(self.now.checked_add(d).unwrap_or(Timestamp::MAX)));
        let name = cp.name.clone();
        let attempt = cp.attempt;
        if truncated && role == StepRole::Step {
            // D11 keeps status small; D16 says so where people look.
            let why = format!(
                "its result was not kept: a run keeps at most {} KiB of step results inline (and {} KiB per step); later steps, the compactor and its compensation do not receive it",
                MAX_INLINE_RESULTS / 1024,
                MAX_INLINE_RESULT / 1024
            );
            cp.message = Some(format!("succeeded on attempt {attempt}; {why}"));
            self.event(
                EventType::Warning,
                reason::RESULT_NOT_KEPT,
                format!("step {name}: {why}"),
            );
        }
        match role {
            StepRole::Step => self.event(
                EventType::Normal,
                reason::STEP_SUCCEEDED,
                format!("step {name} succeeded on attempt {attempt}"),
            ),
            StepRole::Compactor => {
                // A compactor that returns no summary keeps the one there was.
                if report.summary.is_some() {
                    self.status.summary = report.summary;
                }
                self.event(
                    EventType::Normal,
                    reason::CONTEXT_COMPACTED,
                    format!("context compacted before step {name}"),
                );
            }
            StepRole::Planner => {
                // The new plan is resolved and started by the next decision.
                self.recorded = true;
                self.adopt_plan(&name, planned.unwrap_or_default());
            }
        }
    }

    /// Keeps the result inline only within the per-step and per-run caps (D11).
    fn cap_result(&self, result: Value) -> (Option<Value>, bool) {
        if result.is_null() {
            return (None, false);
        }
        let size = serde_json::to_string(&result).map_or(usize::MAX, |s| s.len());
        let used: usize = self
            .status
            .steps
            .iter()
            .filter_map(|c| c.result.as_ref())
            .map(|r| serde_json::to_string(r).map_or(0, |s| s.len()))
            .sum();
        if size > MAX_INLINE_RESULT || used + size > MAX_INLINE_RESULTS {
            (None, true)
        } else {
            (Some(result), false)
        }
    }

    fn adopt_plan(&mut self, planner: &str, steps: Vec<StepSpec>) {
        let revision = self.status.plan.as_ref().map_or(1, |p| p.revision) + 1;
        let names: Vec<String> = steps.iter().map(|s| s.name.clone()).collect();
        let message = format!(
            "plan revision {revision} from planner {planner}: {} steps",
            names.len()
        );
        self.status.plan = Some(PlanStatus {
            revision,
            reason: format!("plan from planner {planner}"),
            source: PlanSource::Planner,
            step_names: names,
            steps,
            rerun_from: None,
        });
        self.event(EventType::Normal, reason::PLAN_ADOPTED, message);
    }

    fn retry_limit(
        &self,
        plan: &Plan<'_>,
        cp: &StepCheckpoint,
    ) -> (i32, Option<crate::api::Backoff>) {
        let spec = match cp.role {
            StepRole::Step => self.step_spec(plan, &cp.name),
            StepRole::Planner => self.run.spec.planner.clone(),
            StepRole::Compactor => None,
        };
        let retry = spec.and_then(|s| s.retry);
        (
            retry.as_ref().map_or(0, |r| r.limit.max(0)),
            retry.and_then(|r| r.backoff),
        )
    }

    /// Where a failed attempt leaves its step or compensation, `failures`
    /// counting this one: retried after its backoff (never early, see
    /// `backoff_until`) or, past `limit`, failed for good.
    fn after_failure(
        &self,
        why: &str,
        failures: i32,
        limit: i32,
        backoff: Option<&crate::api::Backoff>,
    ) -> AfterFailure {
        if failures > limit {
            return AfterFailure::Exhausted(format!("{why}; no retries left (limit {limit})"));
        }
        let delay = plan::backoff(backoff, failures);
        AfterFailure::Retry {
            at: Time(self.backoff_until(delay)),
            message: format!(
                "{why}; retry {failures} of {limit} after {}",
                timeout_text(delay)
            ),
        }
    }

    /// A failed attempt (exit code, timeout, bad result) consumes the retry
    /// budget. `may_have_acted`: the attempt ran without reporting a failure
    /// of its own (timed out, or exited 0 with an unusable result), so its
    /// effect is `Unknown` (D7) and a compensation covers it; a step that
    /// exits non-zero reports that it did not act.
    fn on_failure(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        why: String,
        tokens: TokenUsage,
        may_have_acted: bool,
    ) {
        self.add_tokens(i, tokens);
        if may_have_acted && self.status.steps[i].role == StepRole::Step {
            let effect = self
                .step_spec(plan, &self.status.steps[i].name)
                .map_or(Effect::NonIdempotent, |s| s.effect);
            if effect != Effect::None {
                self.status.steps[i].effect = Some(EffectOutcome::Unknown);
            }
        }
        let (limit, backoff) = self.retry_limit(plan, &self.status.steps[i]);
        let failures = self.status.steps[i].failures + 1;
        let next = self.after_failure(&why, failures, limit, backoff.as_ref());
        let now = self.now;
        let cp = &mut self.status.steps[i];
        cp.failures = failures;
        cp.pod_uid = None;
        self.recorded = true;
        match next {
            AfterFailure::Exhausted(message) => {
                cp.phase = StepPhase::Failed;
                cp.checkpoint = CheckpointState::Committed;
                cp.finished_at = Some(Time(now));
                cp.next_attempt_at = None;
                if cp.role == StepRole::Step && cp.effect.is_none() {
                    cp.effect = Some(EffectOutcome::NotApplied);
                }
                cp.message = Some(message.clone());
                let (role, name) = (cp.role, cp.name.clone());
                if role == StepRole::Compactor {
                    // Without a summary the oldest results are simply left out.
                    self.event(
                        EventType::Warning,
                        reason::STEP_FAILED,
                        format!("compactor before {name}: {message}"),
                    );
                } else {
                    self.fail_run(reason::STEP_FAILED, format!("step {name}: {message}"));
                }
            }
            AfterFailure::Retry { at, message } => {
                cp.phase = StepPhase::Pending;
                cp.next_attempt_at = Some(at);
                cp.message = Some(message.clone());
                let name = cp.name.clone();
                self.event(
                    EventType::Warning,
                    reason::STEP_RETRYING,
                    format!("step {name}: {message}"),
                );
            }
        }
    }

    /// A disruption does not consume the retry budget (D6); a NonIdempotent
    /// step that may have acted asks a person instead of running again (D7).
    fn on_disruption(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        why: &str,
        started: bool,
        tokens: TokenUsage,
    ) {
        self.add_tokens(i, tokens);
        let effect = match self.status.steps[i].role {
            StepRole::Step => self
                .step_spec(plan, &self.status.steps[i].name)
                .map_or(Effect::NonIdempotent, |s| s.effect),
            _ => Effect::None,
        };
        let run = self.name.to_owned();
        let uid = self.uid.to_owned();
        let cp = &mut self.status.steps[i];
        cp.disruptions += 1;
        cp.pod_uid = None;
        cp.next_attempt_at = None;
        self.recorded = true;
        if effect == Effect::NonIdempotent && started {
            let approval =
                names::reconcile_name(&run, &uid, &cp.name, cp.plan_revision, cp.attempt);
            let message = format!(
                "attempt {} was disrupted ({why}) after it started; the step is NonIdempotent and may have acted: waiting for Approval {approval}",
                cp.attempt
            );
            cp.effect = Some(EffectOutcome::Unknown);
            cp.phase = StepPhase::WaitingForApproval;
            cp.approval = Some(approval);
            cp.message = Some(message.clone());
            let name = cp.name.clone();
            self.event(
                EventType::Warning,
                reason::STEP_OUTCOME_UNKNOWN,
                format!("step {name}: {message}"),
            );
        } else {
            if started && effect != Effect::None && cp.role == StepRole::Step {
                // It may have acted before it was stopped; the rerun with the
                // same key settles it (Applied on success).
                cp.effect = Some(EffectOutcome::Unknown);
            }
            let message = format!(
                "attempt {} was disrupted ({why}); it runs again with the same key",
                cp.attempt
            );
            cp.phase = StepPhase::Pending;
            cp.message = Some(message.clone());
            let name = cp.name.clone();
            self.event(
                EventType::Normal,
                reason::STEP_DISRUPTED,
                format!("step {name}: {message}"),
            );
        }
    }

    // -----------------------------------------------------------------------
    // Run limits
    // -----------------------------------------------------------------------

    fn enforce_limits(&mut self) {
        if self.failing() {
            return;
        }
        let spec = &self.run.spec;
        if spec.cancel {
            return self.fail_run(reason::CANCELLED, "spec.cancel is set".into());
        }
        if let (Some(secs), Some(started)) = (
            spec.active_deadline_seconds,
            self.status.started_at.as_ref(),
        ) {
            let at = started
                .0
                .checked_add(SignedDuration::from_secs(secs.max(0)))
                .unwrap_or(Timestamp::MAX);
            if at <= self.now {
                return self.fail_run(
                    reason::DEADLINE_EXCEEDED,
                    format!("the run exceeded activeDeadlineSeconds ({secs})"),
                );
            }
            self.deadlines.push(at);
        }
        if let Some(budget) = spec.budget.as_ref().and_then(|b| b.tokens)
            && self.status.tokens_used > budget
        {
            self.budget_exceeded(
                reason::TOKEN_BUDGET_EXCEEDED,
                format!(
                    "{} tokens used, over the budget of {budget}",
                    self.status.tokens_used
                ),
            );
        }
    }

    fn budget_exceeded(&mut self, why: &'static str, message: String) {
        let generation = self.run.metadata.generation;
        cond::set(
            &mut self.status.conditions,
            condition::BUDGET_EXCEEDED,
            TRUE,
            why,
            message.clone(),
            generation,
            self.now,
        );
        self.fail_run(why, message);
    }

    /// The run is bound to fail (or be cancelled): stop what runs, record
    /// why, and wind down through compensation.
    fn fail_run(&mut self, why: &'static str, message: String) {
        let generation = self.run.metadata.generation;
        cond::set(
            &mut self.status.conditions,
            condition::FAILURE_TARGET,
            TRUE,
            why,
            message.clone(),
            generation,
            self.now,
        );
        self.recorded = true;
        let now = self.now;
        let effects: HashMap<String, Effect> = self
            .run
            .spec
            .steps
            .iter()
            .chain(self.status.plan.iter().flat_map(|p| p.steps.iter()))
            .map(|s| (s.name.clone(), s.effect))
            .collect();
        for i in 0..self.status.steps.len() {
            let cp = &self.status.steps[i];
            if cp.phase.is_terminal() {
                continue;
            }
            let mut effect = cp.effect;
            if cp.phase == StepPhase::Running {
                let pod_name = cp.pod.clone().unwrap_or_default();
                let pod = self.pods.get(pod_name.as_str()).copied();
                // Unseen Pods may exist: assume they started.
                let started = pod.is_none_or(observe::started);
                if cp.role == StepRole::Step
                    && effects.get(&cp.name).is_some_and(|e| *e != Effect::None)
                {
                    effect = Some(if started {
                        EffectOutcome::Unknown
                    } else {
                        EffectOutcome::NotApplied
                    });
                }
                if pod
                    .is_none_or(|p| p.metadata.deletion_timestamp.is_none() && observe::is_live(p))
                {
                    self.actions.push(Action::DeletePod {
                        name: pod_name,
                        reason: format!("stopping: {message}"),
                    });
                }
                // A Pod that is still running may yet report a result (which
                // its compensation needs) and tokens: they are still recorded.
                self.status.steps[i].stopping = pod.is_some_and(observe::is_live);
            } else if cp.role == StepRole::Step && effect.is_none() {
                effect = Some(EffectOutcome::NotApplied);
            }
            let cp = &mut self.status.steps[i];
            cp.effect = if cp.role == StepRole::Step {
                effect
            } else {
                None
            };
            cp.phase = StepPhase::Failed;
            cp.checkpoint = CheckpointState::Committed;
            cp.finished_at = Some(Time(now));
            cp.pod_uid = None;
            cp.next_attempt_at = None;
            cp.message = Some(format!("stopped: {message}"));
        }
        let type_ = if why == reason::CANCELLED {
            EventType::Normal
        } else {
            EventType::Warning
        };
        self.event(type_, why, message);
    }

    // -----------------------------------------------------------------------
    // Starting what comes next
    // -----------------------------------------------------------------------

    fn advance(&mut self, plan: &Plan<'_>) {
        if self.run.spec.suspend {
            return;
        }
        if let Some(planner) = self.planning() {
            let rev = plan.revision;
            match self
                .status
                .steps
                .iter()
                .position(|c| c.role == StepRole::Planner && c.plan_revision == rev)
            {
                None => self.launch(plan, StepRole::Planner, &planner.name, 1),
                Some(i) => {
                    let cp = self.status.steps[i].clone();
                    if cp.phase == StepPhase::Pending && self.due(cp.next_attempt_at.as_ref()) {
                        self.launch(plan, StepRole::Planner, &planner.name, cp.attempt + 1);
                    }
                }
            }
            return;
        }
        let index = CheckpointIndex::new(&self.status.steps);
        let cursor = (0..plan.steps.len()).find_map(|i| {
            match index.effective(&self.status.steps, plan, i) {
                Some(c) if self.status.steps[c].phase == StepPhase::Succeeded => None,
                other => Some((i, other)),
            }
        });
        let Some((i, slot)) = cursor else {
            return self.succeed_run(plan);
        };
        let name = plan.steps[i].name.clone();
        let Some(c) = slot else {
            return self.start_step(plan, i);
        };
        let cp = self.status.steps[c].clone();
        match cp.phase {
            StepPhase::Pending if self.due(cp.next_attempt_at.as_ref()) => {
                self.launch(plan, StepRole::Step, &name, cp.attempt + 1)
            }
            StepPhase::WaitingForApproval => self.wait_for_approval(plan, i, c),
            _ => {}
        }
    }

    fn planning(&self) -> Option<StepSpec> {
        let plan = self.status.plan.as_ref()?;
        (plan.source == PlanSource::Spec && plan.revision == 1)
            .then(|| self.run.spec.planner.clone())
            .flatten()
    }

    fn succeed_run(&mut self, plan: &Plan) {
        self.status.phase = Some(RunPhase::Succeeded);
        self.status.completed_at = Some(Time(self.now));
        self.event(
            EventType::Normal,
            reason::RUN_SUCCEEDED,
            format!(
                "all {} steps of plan revision {} succeeded",
                plan.steps.len(),
                plan.revision
            ),
        );
        if let Some(ttl) = self.run.spec.ttl_seconds_after_finished {
            self.deadlines
                .push(self.at(SignedDuration::from_secs(ttl.max(0).into())));
        }
    }

    /// Step `i` has no checkpoint at this revision yet.
    fn start_step(&mut self, plan: &Plan<'_>, i: usize) {
        if self.replan_if_stale(plan, i) {
            return;
        }
        let step = plan.steps[i];
        let Some(gate) = step.approval.as_ref().filter(|g| g.required) else {
            return self.launch(plan, StepRole::Step, &step.name, 1);
        };
        if self.compaction_blocks(plan, i) {
            return;
        }
        if gate.required {
            self.ask_approval(plan, i, None, None);
        }
    }

    /// Opens step `i`'s approval gate, or asks again on checkpoint `c` when
    /// the step changed after the last request (D14): records the wait and
    /// the digest of the step as asked about, then asks (intent, then effect).
    fn ask_approval(&mut self, plan: &Plan<'_>, i: usize, c: Option<usize>, why: Option<String>) {
        let step = plan.steps[i];
        let digest = approval::step_digest(step, self.run.spec.pod_template.as_ref());
        let request = c
            .and_then(|c| self.status.steps[c].approval.as_deref())
            .map_or(1, |n| names::approve_request(n) + 1);
        let approval = names::approve_name(self.name, self.uid, &step.name, plan.revision, request);
        let c = match c {
            Some(c) => c,
            None => {
                self.status.steps.push(StepCheckpoint {
                    name: step.name.clone(),
                    role: StepRole::Step,
                    plan_revision: plan.revision,
                    attempt: 0,
                    idempotency_key: self.key(PodRole::Step, &step.name, plan.revision),
                    ..StepCheckpoint::default()
                });
                self.status.steps.len() - 1
            }
        };
        let message = match &why {
            None => format!("waiting for Approval {approval}"),
            Some(why) => format!("{why}; waiting for Approval {approval}"),
        };
        let now = self.now;
        let cp = &mut self.status.steps[c];
        cp.phase = StepPhase::WaitingForApproval;
        cp.effect = None;
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
            self.deadlines.push(self.at(t));
        }
        self.request_approval(plan, i, c);
        self.event(
            EventType::Normal,
            reason::APPROVAL_REQUESTED,
            format!("step {}: {message}", step.name),
        );
    }

    fn request_approval(&mut self, plan: &Plan<'_>, i: usize, c: usize) {
        let step = plan.steps[i];
        let cp = self.status.steps[c].clone();
        let Some(name) = cp.approval.clone() else {
            return;
        };
        // A Reconcile wait follows a lost attempt whose effect is unknown.
        let reconcile = cp.effect == Some(EffectOutcome::Unknown);
        let (kind, question, expires_at, on_timeout, why) = if !reconcile {
            let gate = step.approval.clone().unwrap_or_default();
            let expires = plan::duration(gate.timeout.as_ref()).and_then(|t| {
                cp.started_at
                    .as_ref()
                    .map(|s| s.0.checked_add(t).unwrap_or(Timestamp::MAX))
            });
            (
                ApprovalKind::Approve,
                gate.question
                    .unwrap_or_else(|| format!("May step {} run?", step.name)),
                expires,
                gate.on_timeout,
                format!("step {} requires approval before it starts", step.name),
            )
        } else {
            (
                ApprovalKind::Reconcile,
                format!(
                    "Step {} (NonIdempotent) was interrupted on attempt {} and may have acted. Retry it with the same key, mark it succeeded, or mark it failed?",
                    step.name, cp.attempt
                ),
                None,
                OnTimeout::Reject,
                cp.message.clone().unwrap_or_default(),
            )
        };
        let pod = reconcile.then(|| cp.pod.clone()).flatten();
        let context = self.approval_context(plan, why, step, &cp.idempotency_key, pod);
        let step_digest = (!reconcile).then(|| cp.step_digest.clone()).flatten();
        let a = approval::build(approval::Request {
            name,
            namespace: self.run.metadata.namespace.clone(),
            owner: self.owner(),
            run_name: self.name,
            run_uid: self.uid,
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
            .refused
            .iter()
            .find(|r| r.name == a.metadata.name.as_deref().unwrap_or(""))
        {
            None => self.actions.push(Action::CreateApproval(Box::new(a))),
            Some(r) => self.stall(&format!("step {}", step.name), "Approval", r),
        }
    }

    fn wait_for_approval(&mut self, plan: &Plan<'_>, i: usize, c: usize) {
        let cp = self.status.steps[c].clone();
        let Some(name) = cp.approval.clone() else {
            return;
        };
        let Some(a) = self.find_approval(&name) else {
            // Asked but not yet visible (or the create was lost): ask again.
            if let Some(t) = plan.steps[i]
                .approval
                .as_ref()
                .and_then(|g| plan::duration(g.timeout.as_ref()))
                && cp.effect != Some(EffectOutcome::Unknown)
                && let Some(s) = &cp.started_at
            {
                self.deadlines
                    .push(s.0.checked_add(t).unwrap_or(Timestamp::MAX));
            }
            return self.request_approval(plan, i, c);
        };
        let step = plan.steps[i].name.clone();
        let reconcile = cp.effect == Some(EffectOutcome::Unknown);
        let answer = approval::answer(a, self.now);
        if !reconcile {
            // D14: the approval releases only the step it was asked about.
            let digest = approval::step_digest(plan.steps[i], self.run.spec.pod_template.as_ref());
            let asked = a.spec.step_digest.as_ref().or(cp.step_digest.as_ref());
            let refused = matches!(
                answer,
                Answer::Decided {
                    decision: Answered::Rejected,
                    ..
                } | Answer::Expired {
                    on_timeout: OnTimeout::Reject
                }
            );
            if asked.is_some_and(|d| *d != digest) && !refused {
                self.recorded = true;
                return self.ask_approval(
                    plan,
                    i,
                    Some(c),
                    Some(format!(
                        "step {step} changed after Approval {name} was requested"
                    )),
                );
            }
        }
        match answer {
            Answer::Pending { expires_at } => {
                if let Some(at) = expires_at {
                    self.deadlines.push(at);
                }
            }
            // The expiry is written to the Approval first (`sync_approvals`);
            // the watch brings the run back once it is.
            Answer::Expiring { .. } => {}
            Answer::Superseded => {
                self.recorded = true;
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
                        reason::APPROVAL_EXPIRED,
                        format!("Approval {name} expired; onTimeout Approve: step {step} runs"),
                    );
                    self.launch(plan, StepRole::Step, &step, cp.attempt + 1);
                }
                OnTimeout::Reject => self.refuse_step(
                    c,
                    reason::APPROVAL_EXPIRED,
                    format!("Approval {name} expired without a decision (onTimeout Reject)"),
                ),
            },
            Answer::Expired { .. } => {}
            Answer::Decided {
                decision,
                by,
                comment,
            } => {
                let by = by.map(|b| format!(" by {b}")).unwrap_or_default();
                let comment = comment.map(|c| format!(": {c}")).unwrap_or_default();
                match (reconcile, decision) {
                    (false, Answered::Approved) => {
                        self.event(
                            EventType::Normal,
                            reason::APPROVAL_GRANTED,
                            format!("Approval {name} approved{by}"),
                        );
                        self.launch(plan, StepRole::Step, &step, cp.attempt + 1);
                    }
                    (false, Answered::Rejected) => self.refuse_step(
                        c,
                        reason::APPROVAL_REJECTED,
                        format!("Approval {name} rejected{by}{comment}"),
                    ),
                    (true, Answered::Retry) => {
                        self.event(
                            EventType::Normal,
                            reason::RECONCILE_DECIDED,
                            format!("Approval {name}: Retry{by}"),
                        );
                        self.launch(plan, StepRole::Step, &step, cp.attempt + 1);
                    }
                    (true, Answered::MarkSucceeded) => {
                        let fresh_for = plan::duration(plan.steps[i].fresh_for.as_ref());
                        let now = self.now;
                        let cp = &mut self.status.steps[c];
                        cp.phase = StepPhase::Succeeded;
                        cp.checkpoint = CheckpointState::Committed;
                        cp.effect = Some(EffectOutcome::Applied);
                        cp.finished_at = Some(Time(now));
                        cp.fresh_until =
                            fresh_for.map(|d| Time(now.checked_add(d).unwrap_or(Timestamp::MAX)));
                        cp.message = Some(format!("marked succeeded{by}{comment}"));
                        self.recorded = true;
                        self.event(
                            EventType::Normal,
                            reason::RECONCILE_DECIDED,
                            format!("Approval {name}: MarkSucceeded{by}"),
                        );
                    }
                    (true, Answered::MarkFailed) => self.refuse_step(
                        c,
                        reason::STEP_FAILED,
                        format!("Approval {name}: marked failed{by}{comment}"),
                    ),
                    _ => {} // admission forbids mismatched decisions; ignore them
                }
            }
        }
    }

    /// A person (or an expiry) said no: the step fails and the run winds down.
    fn refuse_step(&mut self, c: usize, why: &'static str, message: String) {
        let now = self.now;
        let cp = &mut self.status.steps[c];
        cp.phase = StepPhase::Failed;
        cp.checkpoint = CheckpointState::Committed;
        cp.finished_at = Some(Time(now));
        if cp.effect != Some(EffectOutcome::Unknown) || why == reason::STEP_FAILED {
            cp.effect = Some(EffectOutcome::NotApplied);
        }
        cp.message = Some(message.clone());
        let name = cp.name.clone();
        self.fail_run(why, format!("step {name}: {message}"));
    }

    /// D8: before a step starts, every input must be within its freshness
    /// budget; otherwise re-plan from the earliest stale step.
    fn replan_if_stale(&mut self, plan: &Plan<'_>, i: usize) -> bool {
        let index = CheckpointIndex::new(&self.status.steps);
        let stale = (0..i).find_map(|j| {
            let c = &self.status.steps[index.effective(&self.status.steps, plan, j)?];
            let until = c.fresh_until.as_ref()?;
            (until.0 <= self.now).then_some((j, until.0))
        });
        // No timer for freshness: it only matters when a step is about to start.
        let Some((j, since)) = stale else {
            return false;
        };
        let revision = plan.revision + 1;
        let stale_name = plan.steps[j].name.clone();
        let replans = self.status.plan.as_ref().map_or(0, |p| p.revision) - 1;
        if replans >= MAX_REPLANS {
            self.fail_run(
                reason::INPUT_STALE,
                format!(
                    "the result of step {stale_name} went stale again after {replans} re-plans; its freshFor is shorter than what must happen before the steps that use it"
                ),
            );
            return true;
        }
        let rerun = plan.steps.len() - j;
        let kept = self.status.steps.len();
        if kept + rerun > MAX_CHECKPOINTS {
            self.fail_run(
                reason::STATUS_BUDGET_EXCEEDED,
                format!(
                    "the result of step {stale_name} went stale, but running the {rerun} steps from it again would keep {} checkpoints in status, more than the {MAX_CHECKPOINTS} a run may hold",
                    kept + rerun
                ),
            );
            return true;
        }
        let reason_text = format!(
            "the result of step {stale_name} went stale at {since}; steps from {stale_name} on run again at plan revision {revision}"
        );
        for cp in self.status.steps.iter_mut() {
            if !cp.phase.is_terminal() && cp.plan_revision < revision {
                cp.phase = StepPhase::Superseded;
                cp.message = Some(format!("superseded by plan revision {revision}"));
            }
        }
        if let Some(p) = self.status.plan.as_mut() {
            p.revision = revision;
            p.reason = reason_text.clone();
            p.rerun_from = Some(stale_name);
        }
        self.recorded = true;
        self.event(EventType::Normal, reason::REPLANNED, reason_text);
        true
    }

    /// D11: when the context of step `i` would exceed `maxBytes` and a
    /// compactor is configured, it runs first. Returns whether it blocks.
    fn compaction_blocks(&mut self, plan: &Plan<'_>, i: usize) -> bool {
        if self
            .run
            .spec
            .context
            .as_ref()
            .and_then(|c| c.compactor.as_ref())
            .is_none()
        {
            return false;
        }
        let name = plan.steps[i].name.clone();
        let index = CheckpointIndex::new(&self.status.steps);
        match index.at(
            &self.status.steps,
            StepRole::Compactor,
            &name,
            plan.revision,
        ) {
            Some(c) => {
                let cp = self.status.steps[c].clone();
                match cp.phase {
                    StepPhase::Running => true,
                    StepPhase::Pending => {
                        if self.due(cp.next_attempt_at.as_ref()) {
                            self.launch(plan, StepRole::Compactor, &name, cp.attempt + 1);
                        }
                        true
                    }
                    _ => false,
                }
            }
            None => {
                let key = self.key(PodRole::Step, &name, plan.revision);
                let results = self.prior_results(plan, i, self.now);
                let summary = self.status.summary.clone();
                let identity = Identity {
                    run: self.name,
                    run_uid: self.uid,
                    step: &name,
                    role: PodRole::Step.label(),
                    attempt: 1,
                    idempotency_key: &key,
                    plan_revision: plan.revision,
                };
                let refs: Vec<PriorResult> = results
                    .iter()
                    .map(|(s, r)| PriorResult { step: s, result: r })
                    .collect();
                if context::full_size(&identity, summary.as_deref(), &refs)
                    <= self.max_context_bytes()
                {
                    return false;
                }
                self.launch(plan, StepRole::Compactor, &name, 1);
                true
            }
        }
    }

    fn max_context_bytes(&self) -> usize {
        let max = self
            .run
            .spec
            .context
            .as_ref()
            .and_then(|c| c.max_bytes)
            .unwrap_or(DEFAULT_CONTEXT_BYTES);
        max.clamp(1024, MAX_CONTEXT_BYTES) as usize
    }

    /// Fresh results of the steps before `i` not yet folded into the summary.
    fn prior_results(&self, plan: &Plan, i: usize, at: Timestamp) -> Vec<(String, Value)> {
        let compacted_before = self
            .status
            .steps
            .iter()
            .rposition(|c| c.role == StepRole::Compactor && c.phase == StepPhase::Succeeded);
        let index = CheckpointIndex::new(&self.status.steps);
        (0..i.min(plan.steps.len()))
            .filter_map(|j| {
                let c = index.effective(&self.status.steps, plan, j)?;
                if compacted_before.is_some_and(|k| c < k) {
                    return None;
                }
                let cp = &self.status.steps[c];
                let fresh = cp.fresh_until.as_ref().is_none_or(|t| t.0 > at);
                (cp.phase == StepPhase::Succeeded && fresh)
                    .then(|| cp.result.clone().map(|r| (cp.name.clone(), r)))
                    .flatten()
            })
            .collect()
    }

    /// Starts attempt `attempt` of a step, planner or compactor: records the
    /// intent in status and emits the Pod (D1, D2).
    fn launch(&mut self, plan: &Plan<'_>, role: StepRole, name: &str, attempt: i32) {
        if self.run.spec.suspend {
            return;
        }
        if role == StepRole::Step {
            let Some(i) = plan.steps.iter().position(|s| s.name == name) else {
                return;
            };
            if self.replan_if_stale(plan, i) || self.compaction_blocks(plan, i) {
                return;
            }
        }
        if let Some(budget) = self
            .run
            .spec
            .budget
            .as_ref()
            .and_then(|b| b.step_executions)
            && self.status.step_executions >= budget
        {
            return self.budget_exceeded(
                reason::STEP_BUDGET_EXCEEDED,
                format!(
                    "{} step Pods created, the budget of {budget} is spent",
                    self.status.step_executions
                ),
            );
        }
        let rev = plan.revision;
        let key = self.key(role.into(), name, rev);
        if self.live_pod_with_key(&key) {
            return; // an earlier attempt is still stopping (D2)
        }
        let pod_name = names::pod_name(self.name, self.uid, role.into(), name, rev, attempt);
        let index = CheckpointIndex::new(&self.status.steps);
        let c = match index.at(&self.status.steps, role, name, rev) {
            Some(c) => c,
            None => {
                self.status.steps.push(StepCheckpoint {
                    name: name.to_owned(),
                    role,
                    plan_revision: rev,
                    idempotency_key: key,
                    ..StepCheckpoint::default()
                });
                self.status.steps.len() - 1
            }
        };
        let cp = &mut self.status.steps[c];
        cp.attempt = attempt;
        cp.pod = Some(pod_name.clone());
        cp.pod_uid = None;
        cp.phase = StepPhase::Running;
        cp.started_at = Some(Time(self.now));
        cp.next_attempt_at = None;
        self.status.step_executions = self.status.step_executions.saturating_add(1);
        let cp = self.status.steps[c].clone();
        if let Some(pod) = self.pod_for_step(plan, &cp) {
            // A new attempt has a new name: nothing was refused for it yet.
            self.actions.push(Action::CreatePod(Box::new(pod)));
        }
        let what = match role {
            StepRole::Step => format!("step {name}"),
            StepRole::Planner => format!("planner {name}"),
            StepRole::Compactor => format!("compactor before step {name}"),
        };
        self.event(
            EventType::Normal,
            reason::STEP_STARTED,
            format!("{what}: attempt {attempt} as Pod {pod_name}"),
        );
    }

    /// The Pod of a checkpoint's current attempt, rebuilt deterministically
    /// from status (the context as of the attempt's start).
    fn pod_for_step(&self, plan: &Plan<'_>, cp: &StepCheckpoint) -> Option<Pod> {
        let at = cp.started_at.as_ref().map_or(self.now, |t| t.0);
        let role: PodRole = cp.role.into();
        let i = plan
            .steps
            .iter()
            .position(|s| s.name == cp.name)
            .unwrap_or(plan.steps.len());
        let (container, results, max): (StepContainer, _, usize) = match cp.role {
            StepRole::Step => {
                let spec = self.step_spec(plan, &cp.name)?;
                (
                    spec.container,
                    self.prior_results(plan, i, at),
                    self.max_context_bytes(),
                )
            }
            StepRole::Planner => (
                self.run.spec.planner.as_ref()?.container.clone(),
                Vec::new(),
                self.max_context_bytes(),
            ),
            StepRole::Compactor => (
                self.run.spec.context.as_ref()?.compactor.clone()?,
                self.prior_results(plan, i, at),
                MAX_CONTEXT_BYTES as usize,
            ),
        };
        let refs: Vec<PriorResult> = results
            .iter()
            .map(|(s, r)| PriorResult { step: s, result: r })
            .collect();
        let identity = Identity {
            run: self.name,
            run_uid: self.uid,
            step: &cp.name,
            role: role.label(),
            attempt: cp.attempt,
            idempotency_key: &cp.idempotency_key,
            plan_revision: cp.plan_revision,
        };
        let ctx = context::materialise(&identity, self.status.summary.as_deref(), &refs, max);
        Some(pods::build(PodRequest {
            name: names::pod_name(
                self.name,
                self.uid,
                role,
                &cp.name,
                cp.plan_revision,
                cp.attempt,
            ),
            namespace: self.run.metadata.namespace.clone(),
            owner: self.owner(),
            run: self.name,
            step: &cp.name,
            role,
            plan_revision: cp.plan_revision,
            attempt: cp.attempt,
            idempotency_key: &cp.idempotency_key,
            container: &container,
            defaults: self.run.spec.pod_template.as_ref(),
            context_json: ctx.json,
        }))
    }

    // -----------------------------------------------------------------------
    // Winding down: compensation (the saga), then a terminal phase
    // -----------------------------------------------------------------------

    fn wind_down(&mut self, plan: &Plan<'_>) {
        // Nothing new starts while a step Pod of this run is still live. Past
        // the run's active deadline, a Pod still not stopped when its grace
        // period ended is on a lost node: its effect is already recorded as
        // Unknown, and waiting for it would hang the run past its deadline.
        let past_deadline = cond::get(&self.status.conditions, condition::FAILURE_TARGET)
            .is_some_and(|c| c.reason == reason::DEADLINE_EXCEEDED);
        let mut step_pod_live = false;
        for p in self.pods.values() {
            if !observe::is_live(p)
                || observe::coords(p).is_none_or(|c| c.role == PodRole::Compensate)
            {
                continue;
            }
            match p.metadata.deletion_timestamp.as_ref() {
                Some(gone_by) if past_deadline && gone_by.0 <= self.now => {}
                Some(gone_by) if past_deadline => {
                    self.deadlines.push(gone_by.0);
                    step_pod_live = true;
                }
                _ => step_pod_live = true,
            }
        }
        if step_pod_live {
            return;
        }
        let targets = self.compensation_targets(plan);
        for (name, rev, container) in targets {
            let existing = self
                .status
                .compensations
                .iter()
                .position(|c| c.name == name && c.plan_revision == rev);
            let Some(k) = existing else {
                if !self.recorded && !self.run.spec.suspend {
                    self.launch_compensation(plan, &name, rev, &container, 1);
                }
                return;
            };
            let cp = self.status.compensations[k].clone();
            match cp.phase {
                StepPhase::Running => return,
                StepPhase::Pending => {
                    if !self.recorded
                        && !self.run.spec.suspend
                        && self.due(cp.next_attempt_at.as_ref())
                    {
                        self.launch_compensation(plan, &name, rev, &container, cp.attempt + 1);
                    }
                    return;
                }
                _ => continue,
            }
        }
        self.finish_failed();
    }

    /// Applied (or possibly applied) steps with a compensation, latest first.
    fn compensation_targets(&self, plan: &Plan<'_>) -> Vec<(String, i64, StepContainer)> {
        self.status
            .steps
            .iter()
            .rev()
            .filter(|c| c.role == StepRole::Step)
            .filter(|c| {
                matches!(
                    c.effect,
                    Some(EffectOutcome::Applied | EffectOutcome::Unknown)
                )
            })
            .filter_map(|c| {
                let container = self.step_spec(plan, &c.name)?.compensate?;
                Some((c.name.clone(), c.plan_revision, container))
            })
            .collect()
    }

    fn launch_compensation(
        &mut self,
        plan: &Plan<'_>,
        name: &str,
        rev: i64,
        container: &StepContainer,
        attempt: i32,
    ) {
        let key = self.key(PodRole::Compensate, name, rev);
        if self.live_pod_with_key(&key) {
            return;
        }
        let pod_name =
            names::pod_name(self.name, self.uid, PodRole::Compensate, name, rev, attempt);
        let k = match self
            .status
            .compensations
            .iter()
            .position(|c| c.name == name && c.plan_revision == rev)
        {
            Some(k) => k,
            None => {
                self.status.compensations.push(CompensationCheckpoint {
                    name: name.to_owned(),
                    plan_revision: rev,
                    idempotency_key: key,
                    ..CompensationCheckpoint::default()
                });
                self.status.compensations.len() - 1
            }
        };
        let cp = &mut self.status.compensations[k];
        cp.attempt = attempt;
        cp.pod = Some(pod_name.clone());
        cp.pod_uid = None;
        cp.phase = StepPhase::Running;
        cp.started_at = Some(Time(self.now));
        cp.next_attempt_at = None;
        let cp = cp.clone();
        self.actions.push(Action::CreatePod(Box::new(
            self.compensation_pod(plan, &cp, container),
        )));
        self.event(
            EventType::Normal,
            reason::COMPENSATION_STARTED,
            format!("compensating step {name} (plan revision {rev}): attempt {attempt} as Pod {pod_name}"),
        );
    }

    fn compensation_pod(
        &self,
        _plan: &Plan<'_>,
        cp: &CompensationCheckpoint,
        container: &StepContainer,
    ) -> Pod {
        let step_result = self
            .status
            .steps
            .iter()
            .find(|c| {
                c.role == StepRole::Step && c.name == cp.name && c.plan_revision == cp.plan_revision
            })
            .and_then(|c| c.result.clone());
        let results: Vec<(String, Value)> = step_result
            .map(|r| (cp.name.clone(), r))
            .into_iter()
            .collect();
        let refs: Vec<PriorResult> = results
            .iter()
            .map(|(s, r)| PriorResult { step: s, result: r })
            .collect();
        let identity = Identity {
            run: self.name,
            run_uid: self.uid,
            step: &cp.name,
            role: PodRole::Compensate.label(),
            attempt: cp.attempt,
            idempotency_key: &cp.idempotency_key,
            plan_revision: cp.plan_revision,
        };
        let ctx = context::materialise(&identity, None, &refs, self.max_context_bytes());
        pods::build(PodRequest {
            name: names::pod_name(
                self.name,
                self.uid,
                PodRole::Compensate,
                &cp.name,
                cp.plan_revision,
                cp.attempt,
            ),
            namespace: self.run.metadata.namespace.clone(),
            owner: self.owner(),
            run: self.name,
            step: &cp.name,
            role: PodRole::Compensate,
            plan_revision: cp.plan_revision,
            attempt: cp.attempt,
            idempotency_key: &cp.idempotency_key,
            container,
            defaults: self.run.spec.pod_template.as_ref(),
            context_json: ctx.json,
        })
    }

    fn observe_compensation(&mut self, plan: &Plan<'_>, k: usize) {
        let cp = self.status.compensations[k].clone();
        let pod = self.pods.get(cp.pod.as_deref().unwrap_or("")).copied();
        let (limit, backoff) = {
            let spec = self.step_spec(plan, &cp.name);
            let retry = spec.and_then(|s| s.retry);
            (
                retry.as_ref().map_or(0, |r| r.limit.max(0)),
                retry.and_then(|r| r.backoff),
            )
        };
        let now = self.now;
        let failed = |why: String, m: &mut Self| {
            let failures = m.status.compensations[k].failures + 1;
            let next = m.after_failure(&why, failures, limit, backoff.as_ref());
            let c = &mut m.status.compensations[k];
            c.failures = failures;
            c.pod_uid = None;
            m.recorded = true;
            match next {
                AfterFailure::Exhausted(message) => {
                    c.phase = StepPhase::Failed;
                    c.finished_at = Some(Time(now));
                    c.message = Some(message);
                    let message = format!("compensation of step {}: {why}", c.name);
                    m.event(EventType::Warning, reason::COMPENSATION_FAILED, message);
                }
                AfterFailure::Retry { at, message } => {
                    c.phase = StepPhase::Pending;
                    c.next_attempt_at = Some(at);
                    c.message = Some(message);
                }
            }
        };
        let observation = observe::observe(pod, cp.pod_uid.as_deref());
        // A compensation's tokens are spent like any step's (D9).
        let tokens = match &observation {
            Observation::Succeeded { message }
            | Observation::Failed { message, .. }
            | Observation::Disrupted { message, .. } => {
                result::tokens_best_effort(message.as_deref())
            }
            _ => TokenUsage::default(),
        };
        if tokens.total() > 0 {
            let c = &mut self.status.compensations[k];
            let mut sum = c.tokens.unwrap_or_default();
            sum.input = sum.input.saturating_add(tokens.input);
            sum.output = sum.output.saturating_add(tokens.output);
            c.tokens = Some(sum);
            self.status.tokens_used = self.status.tokens_used.saturating_add(tokens.total());
        }
        match observation {
            Observation::NotSeen => {
                if let Some(container) = self.step_spec(plan, &cp.name).and_then(|s| s.compensate) {
                    let pod = self.compensation_pod(plan, &cp, &container);
                    let what = format!("compensation of step {}", cp.name);
                    if let Some(r) = self.create_pod(&what, pod)
                        && r.cause == RefusalCause::Rejected
                    {
                        let why = format!(
                            "attempt {}: the API server refused its Pod {}: {}",
                            cp.attempt, r.name, r.message
                        );
                        failed(why, self);
                    }
                }
            }
            // Compensations are repeatable: one whose Pod vanished unseen is
            // simply created again, so its UID is not worth a write.
            Observation::Live { .. } | Observation::Terminating { .. } => {}
            Observation::Succeeded { message } => match result::parse(message.as_deref()) {
                Ok(_) => {
                    let c = &mut self.status.compensations[k];
                    c.phase = StepPhase::Succeeded;
                    c.finished_at = Some(Time(now));
                    c.pod_uid = None;
                    self.recorded = true;
                    let message = format!("compensation of step {} succeeded", cp.name);
                    self.event(EventType::Normal, reason::COMPENSATION_SUCCEEDED, message);
                }
                Err(e) => failed(
                    format!("attempt {} returned an unusable result: {e}", cp.attempt),
                    self,
                ),
            },
            Observation::Failed {
                exit_code, reason, ..
            } => failed(
                format!(
                    "attempt {} exited with code {exit_code} ({reason})",
                    cp.attempt
                ),
                self,
            ),
            Observation::Disrupted { .. } | Observation::Vanished => {
                // Compensations run with their own key and are meant to be repeatable.
                let c = &mut self.status.compensations[k];
                c.disruptions += 1;
                c.pod_uid = None;
                c.phase = StepPhase::Pending;
                c.message = Some(format!(
                    "attempt {} was disrupted; it runs again with the same key",
                    cp.attempt
                ));
                self.recorded = true;
            }
        }
    }

    fn finish_failed(&mut self) {
        let target = cond::get(&self.status.conditions, condition::FAILURE_TARGET).cloned();
        let why = target
            .as_ref()
            .map_or(reason::RUN_FAILED.to_owned(), |c| c.reason.clone());
        let message = target.map(|c| c.message).unwrap_or_default();
        let cancelled = why == reason::CANCELLED;
        self.status.phase = Some(if cancelled {
            RunPhase::Cancelled
        } else {
            RunPhase::Failed
        });
        self.status.completed_at = Some(Time(self.now));
        let failed_compensations: Vec<String> = self
            .status
            .compensations
            .iter()
            .filter(|c| c.phase == StepPhase::Failed)
            .map(|c| c.name.clone())
            .collect();
        let mut text = message;
        if !failed_compensations.is_empty() {
            text.push_str(&format!(
                "; compensation failed for: {}",
                failed_compensations.join(", ")
            ));
        }
        if cancelled {
            self.event(EventType::Normal, reason::RUN_CANCELLED, text);
        } else {
            self.event(EventType::Warning, reason::RUN_FAILED, text);
        }
        if let Some(ttl) = self.run.spec.ttl_seconds_after_finished {
            self.deadlines
                .push(self.at(SignedDuration::from_secs(ttl.max(0).into())));
        }
    }

    // -----------------------------------------------------------------------
    // Phase, progress and conditions
    // -----------------------------------------------------------------------

    fn derive(&mut self, plan: &Plan<'_>) {
        let index = CheckpointIndex::new(&self.status.steps);
        let done = (0..plan.steps.len())
            .filter(|&i| {
                index
                    .effective(&self.status.steps, plan, i)
                    .is_some_and(|c| self.status.steps[c].phase == StepPhase::Succeeded)
            })
            .count();
        self.status.progress = Some(format!("{done}/{}", plan.steps.len()));
        let waiting = self
            .status
            .steps
            .iter()
            .rfind(|c| c.phase == StepPhase::WaitingForApproval)
            .cloned();
        let active = self
            .status
            .steps
            .iter()
            .rfind(|c| !c.phase.is_terminal())
            .map(|c| c.name.clone())
            .or_else(|| {
                self.status
                    .compensations
                    .iter()
                    .rfind(|c| !c.phase.is_terminal())
                    .map(|c| c.name.clone())
            });
        if active.is_some() {
            self.status.current_step = active;
        }
        let failing = self.failing();
        let phase = match self.status.phase {
            Some(p) if p.is_terminal() => p,
            _ if failing => RunPhase::Compensating,
            _ if self.planning().is_some() => RunPhase::Planning,
            _ if waiting.is_some() => RunPhase::WaitingForApproval,
            _ => RunPhase::Running,
        };
        self.status.phase = Some(phase);

        let g = self.run.metadata.generation;
        let now = self.now;
        let conds = &mut self.status.conditions;
        let target = cond::get(conds, condition::FAILURE_TARGET).cloned();
        match phase {
            RunPhase::Succeeded => cond::set(
                conds,
                condition::SUCCEEDED,
                TRUE,
                reason::RUN_SUCCEEDED,
                format!("{done} steps succeeded"),
                g,
                now,
            ),
            RunPhase::Failed | RunPhase::Cancelled => {
                let (r, m) = target.map_or((reason::RUN_FAILED.to_owned(), String::new()), |c| {
                    (c.reason, c.message)
                });
                cond::set(conds, condition::SUCCEEDED, FALSE, &r, m, g, now)
            }
            p => {
                let r = match p {
                    RunPhase::Planning => reason::PLANNING,
                    RunPhase::WaitingForApproval => reason::WAITING_FOR_APPROVAL,
                    RunPhase::Compensating => reason::COMPENSATING,
                    RunPhase::Pending => reason::PENDING,
                    _ => reason::RUNNING,
                };
                cond::set(
                    conds,
                    condition::SUCCEEDED,
                    UNKNOWN,
                    r,
                    format!("{done}/{} steps done", plan.steps.len()),
                    g,
                    now,
                )
            }
        }
        let stalled = self.stalled.take().filter(|_| !phase.is_terminal());
        let (status, r) = if phase.is_terminal() {
            (FALSE, reason::FINISHED)
        } else if let Some((why, _)) = &stalled {
            (FALSE, *why)
        } else if self.run.spec.suspend {
            (FALSE, reason::SUSPENDED)
        } else if phase == RunPhase::WaitingForApproval {
            (FALSE, reason::WAITING_FOR_APPROVAL)
        } else if phase == RunPhase::Compensating {
            (TRUE, reason::COMPENSATING)
        } else {
            (TRUE, reason::RUNNING)
        };
        cond::set(
            conds,
            condition::PROGRESSING,
            status,
            r,
            String::new(),
            g,
            now,
        );
        let creating = self
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_) | Action::CreateApproval(_)));
        match stalled {
            Some((why, message)) => {
                cond::set(conds, condition::STALLED, TRUE, why, message, g, now)
            }
            // Cleared once what was refused exists (nothing is being created
            // again) or the run is over.
            None if cond::is_true(conds, condition::STALLED)
                && (phase.is_terminal() || !creating) =>
            {
                cond::set(
                    conds,
                    condition::STALLED,
                    FALSE,
                    reason::UNBLOCKED,
                    String::new(),
                    g,
                    now,
                )
            }
            None => {}
        }
        match &waiting {
            Some(w) if !phase.is_terminal() => cond::set(
                conds,
                condition::AWAITING_APPROVAL,
                TRUE,
                reason::WAITING_FOR_APPROVAL,
                format!(
                    "step {} waits for Approval {}",
                    w.name,
                    w.approval.clone().unwrap_or_default()
                ),
                g,
                now,
            ),
            _ => cond::set(
                conds,
                condition::AWAITING_APPROVAL,
                FALSE,
                reason::NO_APPROVAL_PENDING,
                String::new(),
                g,
                now,
            ),
        }
        if let Some(plan_status) = &self.status.plan
            && let Some(from) = &plan_status.rerun_from
        {
            let rerun_done = plan
                .steps
                .iter()
                .position(|s| &s.name == from)
                .and_then(|i| index.effective(&self.status.steps, plan, i))
                .is_some_and(|c| self.status.steps[c].phase == StepPhase::Succeeded);
            let (s, r) = if rerun_done {
                (FALSE, reason::INPUTS_FRESH)
            } else {
                (TRUE, reason::INPUT_STALE)
            };
            cond::set(
                &mut self.status.conditions,
                condition::STALE,
                s,
                r,
                plan_status.reason.clone(),
                g,
                now,
            );
        }
    }
}

/// `t` truncated to whole seconds, the resolution of `metav1.Time`.
/// Where a failed attempt leaves its step or compensation.
enum AfterFailure {
    /// No retries left; the message says why.
    Exhausted(String),
    /// Retried at `at`.
    Retry { at: Time, message: String },
}

fn whole_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

fn timeout_text(d: SignedDuration) -> String {
    let secs = d.as_secs();
    if d.subsec_nanos() == 0 {
        format!("{secs}s")
    } else {
        format!("{:.3}s", d.as_secs_f64())
    }
}
