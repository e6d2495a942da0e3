//! The decision itself: one fixed order of stages over the facts of one run,
//! like the Job controller's sync.
//!
//! 1. terminal runs: release finalizers, TTL once recorded (D12, D18) — nothing
//!    else moves them; a run not started that already ran stops here (D18);
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

//!
//! One `Machine` holds the facts of one decision; its stages live in the
//! files beside this one: `finalizers` (stages 1 and 3), `running` (4),
//! `history` (1, D18), `limits` (5), `wait` and `signals` (wait steps, after 5), `advance` and `approvals`
//! (6), `saga` (the wind-down),
//! `derive` (7).

mod advance;
mod approvals;
mod attempt;
mod derive;
mod finalizers;
mod gate;
mod history;
mod journal;
mod limits;
mod queued;
mod running;
mod saga;
mod signals;
mod slot;
mod verify;
mod wait;

use std::collections::HashMap;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};

use super::conditions::{self as cond};
use super::names::{self, PodRole};
use super::observe::{self};
use super::plan::{self, Plan};
use super::reasons::{ConditionType, Reason};
use super::{Action, Decision, EventType, Observed, Refusal, Tally};
use agentrun_api::{AgentRun, AgentRunStatus, PlanSource, PlanStatus, RunPhase, StepSpec};

/// Largest result kept inline in one checkpoint (serialized bytes): a whole
/// termination message, so a result is only ever left out by the run-wide cap.
pub const MAX_INLINE_RESULT: usize = 4096;
/// Largest total of inline results across the run; later results are kept
/// out of status (`resultTruncated`) so a 500-step run stays < 256 KiB (D11).
pub const MAX_INLINE_RESULTS: usize = 48 * 1024;
/// Attempts a step's verify probe may fail before a person is asked.
pub const MAX_VERIFY_FAILURES: i32 = 3;
/// Disruptions of one step after which the run says it is stalled (D16):
/// it still resumes, after its backoff, once the cluster heals.
pub const STALL_AFTER_DISRUPTIONS: i32 = 3;
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
    let view = View::of(obs, input.clone());
    let mut m = Machine {
        view: &view,
        draft: Draft::from(input),
    };
    m.run();
    m.finish()
}

/// One decision: what it sees, behind a shared reference so no stage can
/// write it, and what it writes.
struct Machine<'v, 'a> {
    view: &'v View<'a>,
    draft: Draft,
}

/// What a decision sees: the run as committed and what the caches show for
/// it. No stage writes here; what a decision decides goes into [`Draft`].
struct View<'a> {
    run: &'a AgentRun,
    source: Option<&'a AgentRun>,
    /// Where the run waits for a place under the caps on active runs.
    queued: Option<&'a super::Queued>,
    /// What the run history says (D18).
    history: &'a super::History,
    /// What the author's CEL may spend (D22).
    cel: &'a super::cel::Limits,
    approvals: &'a [agentrun_api::Approval],
    signals: &'a [agentrun_api::Signal],
    /// The run's journal chunks (its UID in their spec).
    journals: Vec<&'a agentrun_api::StepJournal>,
    name: &'a str,
    uid: &'a str,
    now: Timestamp,
    /// `now` before truncation, for deadlines that must never come early.
    exact_now: Timestamp,
    /// The input status: what the API server has acknowledged.
    committed: AgentRunStatus,
    /// Our Pods (controlled by this run's UID) by name.
    pods: HashMap<&'a str, &'a Pod>,
    /// Creations the API server refused in this reconcile.
    refused: &'a [Refusal],
}

/// What a decision writes: the status being decided, the actions to apply
/// after it is committed, and what the caller learns of the decision.
struct Draft {
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
    /// A refusal this decision met: the run is stalled (D16).
    stalled: Option<(Reason, String)>,
    /// What this decision did, for the metrics.
    tally: Tally,
    /// Checkpoints of recorded attempts whose Pod was never seen.
    unseen: Vec<slot::Slot>,
    /// This decision creates the Pod of a recorded NonIdempotent attempt whose
    /// UID is not recorded yet: the next decision, right after the create,
    /// sees the Pod as created and records its UID, so that a Pod removed
    /// before anything else saw it is known to have existed (D6).
    uid_wanted: bool,
}

impl<'a> View<'a> {
    fn of(obs: &'a Observed<'a>, committed: AgentRunStatus) -> Self {
        let run = obs.run;
        let uid = run.metadata.uid.as_deref().unwrap_or("");
        let pods = obs
            .pods
            .iter()
            .filter(|p| observe::owned_by(p, uid))
            .filter_map(|p| Some((p.metadata.name.as_deref()?, p)))
            .collect();
        View {
            run,
            source: obs.source,
            queued: obs.queued.as_ref(),
            history: &obs.history,
            cel: &obs.cel,
            approvals: obs.approvals,
            signals: obs.signals,
            journals: obs
                .journals
                .iter()
                .filter(|j| j.spec.run_uid == uid)
                .collect(),
            name: run.metadata.name.as_deref().unwrap_or(""),
            uid,
            // Status timestamps (metav1.Time) keep whole seconds. Deciding on the
            // same resolution keeps stamps and comparisons consistent with what
            // is read back; backoff deadlines round up (see `backoff_until`).
            now: whole_seconds(obs.now),
            exact_now: obs.now,
            committed,
            pods,
            refused: obs.refused,
        }
    }
}

impl From<AgentRunStatus> for Draft {
    /// A decision starts from the committed status.
    fn from(status: AgentRunStatus) -> Self {
        Draft {
            status,
            actions: Vec::new(),
            tally: Tally::default(),
            unseen: Vec::new(),
            uid_wanted: false,
            deadlines: Vec::new(),
            recorded: false,
            stalled: None,
        }
    }
}

impl<'a> Machine<'_, 'a> {
    fn run(&mut self) {
        self.draft.status.observed_generation = self.view.run.metadata.generation;
        if self.view.run.metadata.deletion_timestamp.is_some() {
            // The run is going away; its results have nowhere to go. Its Pods
            // are the garbage collector's to delete (foreground) or to keep
            // (`--cascade=orphan`): only their finalizers are released.
            let mut pods: Vec<&Pod> = self.view.pods.values().copied().collect();
            pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            for pod in pods
                .into_iter()
                .filter(|p| observe::has_result_finalizer(p))
            {
                self.draft.actions.push(Action::ReleaseFinalizer {
                    pod: pod.metadata.name.clone().unwrap_or_default(),
                });
            }
            return;
        }
        if self.draft.status.phase.is_some_and(RunPhase::is_terminal) {
            self.terminal();
            return;
        }
        // D18: a run not started that already ran, or whose history cannot
        // be read, starts nothing.
        if super::needs_lookup(self.view.run) && !self.recognise() {
            return;
        }
        self.note_spec();
        if self.draft.status.phase.is_none() {
            self.draft.status.phase = Some(RunPhase::Pending);
        }
        if self.draft.status.started_at.is_none() {
            // Not started: it waits while the caps on active runs are
            // reached (a run being cancelled goes on, to its end).
            if let Some(q) = self.view.queued.filter(|_| !self.view.run.spec.cancel) {
                return self.wait_in_queue(q);
            }
            self.draft.status.started_at = Some(Time(self.view.now));
            self.draft.status.queue_position = None;
        }
        // The spec only changes with the generation: validate it once per generation.
        let validated = self.view.committed.plan.is_some()
            && self.view.committed.observed_generation == self.view.run.metadata.generation;
        let spec_error = if validated {
            None
        } else {
            plan::validate_spec(&self.view.run.spec).err()
        };
        if self.draft.status.plan.is_none() {
            self.draft.status.plan = Some(PlanStatus {
                revision: 1,
                reason: "initial plan from spec.steps".into(),
                source: PlanSource::Spec,
                step_names: self
                    .view
                    .run
                    .spec
                    .steps
                    .iter()
                    .map(|s| s.name.clone())
                    .collect(),
                steps: Vec::new(),
                rerun: Vec::new(),
                rerun_from: None,
            });
            if spec_error.is_none() && self.view.run.spec.fork_of.is_some() {
                self.start_fork();
            }
        }
        let plan_status = self.draft.status.plan.clone().unwrap_or_default();
        let spec = &self.view.run.spec;
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
                    self.fail_run(Reason::InvalidSpec, e);
                }
                let empty = Plan {
                    revision: plan_status.revision,
                    steps: Vec::new(),
                    deps: Vec::new(),
                    order: Vec::new(),
                    rerun: plan::Rerun::All,
                };
                self.wind_down(&empty);
                self.derive(&empty);
                self.sync_approvals();
                self.sync_signals();
                return;
            }
        };
        self.release_accounted_pods();
        self.observe_journals(&plan);
        self.observe_running(&plan);
        self.enforce_limits();
        self.observe_waits(&plan);
        self.create_unseen(&plan);
        if self.failing() {
            self.wind_down(&plan);
        } else if !self.draft.recorded {
            self.advance(&plan);
        }
        // A planner's plan or a re-plan may have changed the plan in force.
        let plan_status = self.draft.status.plan.clone().unwrap_or_default();
        match Plan::resolve(spec, &plan_status) {
            Ok(p) => self.derive(&p),
            Err(_) => self.derive(&plan),
        }
        // Last: which Approvals and Signals the run waits on is known only now.
        self.sync_approvals();
        self.sync_signals();
        self.compact_status();
    }

    /// A fork's first decision: carry over the source run's checkpoints and
    /// run the rest (`fork::fork_plan`), or say why it cannot start.
    fn start_fork(&mut self) {
        let Some(fork) = self.view.run.spec.fork_of.clone() else {
            return;
        };
        match super::fork::fork_plan(self.view.source, &self.view.run.spec, self.view.now) {
            Ok(f) => {
                if let Some(p) = self.draft.status.plan.as_mut() {
                    p.reason = format!(
                        "fork of run {} from step {}: {} carried over",
                        fork.run_name,
                        fork.from_step,
                        if f.inherited.is_empty() {
                            "nothing".to_owned()
                        } else {
                            f.inherited.join(", ")
                        }
                    );
                    p.rerun = f.runs.clone();
                }
                self.draft.status.steps.extend(f.checkpoints);
                self.draft.status.forked_from = Some(Box::new(agentrun_api::ForkedFrom {
                    run_name: fork.run_name.clone(),
                    run_uid: fork.run_uid.clone(),
                    from_step: fork.from_step.clone(),
                    requested_by: self
                        .view
                        .run
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(agentrun_api::labels::REQUESTED_BY))
                        .cloned(),
                    inherited: f.inherited.clone(),
                }));
                let mut text = format!(
                    "forked from run {} at step {}; runs {}",
                    fork.run_name,
                    fork.from_step,
                    f.runs.join(", ")
                );
                if !f.acts_again.is_empty() {
                    text.push_str(&format!(
                        "; {} acted before and will ask before acting again",
                        f.acts_again.join(", ")
                    ));
                }
                self.event(EventType::Normal, Reason::Forked, text);
            }
            Err(e) => {
                let why = match e {
                    super::fork::ForkRefused::SourceGone(_) => Reason::ForkSourceGone,
                    _ => Reason::ForkRefused,
                };
                self.fail_run(why, e.message().to_owned());
            }
        }
    }

    fn finish(self) -> Decision {
        let terminal = self.draft.status.phase.is_some_and(RunPhase::is_terminal);
        let requeue_after =
            if (self.draft.status != self.view.committed || self.draft.uid_wanted) && !terminal {
                Some(SignedDuration::ZERO)
            } else {
                self.draft
                    .deadlines
                    .iter()
                    .min()
                    .map(|at| at.duration_since(self.view.now).max(SignedDuration::ZERO))
            };
        Decision {
            status: self.draft.status,
            actions: self.draft.actions,
            requeue_after,
            tally: self.draft.tally,
        }
    }

    // -----------------------------------------------------------------------
    // Small helpers
    // -----------------------------------------------------------------------

    fn event(&mut self, type_: EventType, reason: Reason, message: String) {
        self.draft.actions.push(Action::Event {
            type_,
            reason,
            message,
        });
    }

    /// Sets a condition of the run at this decision's time and generation.
    fn set_condition(
        &mut self,
        type_: ConditionType,
        status: &str,
        reason: Reason,
        message: String,
    ) {
        let generation = self.view.run.metadata.generation;
        cond::set(
            &mut self.draft.status.conditions,
            type_,
            status,
            reason,
            message,
            generation,
            self.view.now,
        );
    }

    /// When a backoff of `d` that starts now ends, rounded up to the whole
    /// second that status can hold: the retry never comes before `d` has
    /// passed, and at most a second after.
    fn backoff_until(&self, d: SignedDuration) -> Timestamp {
        let exact = self.view.exact_now.checked_add(d).unwrap_or(Timestamp::MAX);
        let whole = whole_seconds(exact);
        if whole < exact {
            whole
                .checked_add(SignedDuration::from_secs(1))
                .unwrap_or(Timestamp::MAX)
        } else {
            whole
        }
    }

    /// The run reached its terminal phase now: when, and how long it took
    /// from its start (`kubectl get`'s Duration).
    fn complete(&mut self) {
        let now = self.view.now;
        self.draft.status.completed_at = Some(Time(now));
        self.draft.status.duration = self
            .draft
            .status
            .started_at
            .as_ref()
            .map(|s| human_duration(now.duration_since(s.0)));
    }

    fn at(&self, d: SignedDuration) -> Timestamp {
        self.view.now.checked_add(d).unwrap_or(Timestamp::MAX)
    }

    fn due(&mut self, at: Option<&Time>) -> bool {
        match at {
            Some(t) if t.0 > self.view.now => {
                self.draft.deadlines.push(t.0);
                false
            }
            _ => true,
        }
    }

    fn failing(&self) -> bool {
        cond::is_true(&self.draft.status.conditions, ConditionType::FailureTarget)
    }

    fn owner(&self) -> OwnerReference {
        OwnerReference {
            api_version: "agentrun.dev/v1alpha1".into(),
            kind: "AgentRun".into(),
            name: self.view.name.to_owned(),
            uid: self.view.uid.to_owned(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    fn key(&self, role: PodRole, step: &str, rev: i64) -> String {
        names::idempotency_key(self.view.uid, role, step, rev)
    }

    /// Whether a live Pod of ours carries this idempotency key (D2).
    fn live_pod_with_key(&self, key: &str) -> bool {
        self.view.pods.values().any(|p| {
            observe::is_live(p)
                && p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(agentrun_api::labels::IDEMPOTENCY_KEY))
                    .map(String::as_str)
                    == Some(key)
        })
    }

    fn step_spec(&self, plan: &Plan<'_>, name: &str) -> Option<StepSpec> {
        plan.step(name)
            .or_else(|| self.view.run.spec.steps.iter().find(|s| s.name == name))
            .or_else(|| {
                self.draft
                    .status
                    .plan
                    .as_ref()?
                    .steps
                    .iter()
                    .find(|s| s.name == name)
            })
            .cloned()
    }
}

/// `t` truncated to whole seconds, the resolution of `metav1.Time`.
fn whole_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// A run's length as `kubectl get` shows a Job's: `45s`, `3m12s`, `95m`,
/// `5h20m`, `30h`, `3d4h`, `12d`.
pub fn human_duration(d: SignedDuration) -> String {
    let s = d.as_secs().max(0);
    let (m, h, days) = (s / 60, s / 3600, s / 86400);
    match s {
        _ if s < 120 => format!("{s}s"),
        _ if m < 10 && s % 60 == 0 => format!("{m}m"),
        _ if m < 10 => format!("{m}m{}s", s % 60),
        _ if m < 180 => format!("{m}m"),
        _ if h < 8 && m % 60 == 0 => format!("{h}h"),
        _ if h < 8 => format!("{h}h{}m", m % 60),
        _ if h < 48 => format!("{h}h"),
        _ if h < 24 * 8 && h % 24 == 0 => format!("{days}d"),
        _ if h < 24 * 8 => format!("{days}d{}h", h % 24),
        _ => format!("{days}d"),
    }
}

fn timeout_text(d: SignedDuration) -> String {
    let secs = d.as_secs();
    if d.subsec_nanos() == 0 {
        format!("{secs}s")
    } else {
        format!("{:.3}s", d.as_secs_f64())
    }
}
