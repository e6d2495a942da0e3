//! The evidence indexed once for every rule: each execution (a ledger
//! `started` line with its `finished` line), by idempotency key and by
//! logical step (run, step name) across plan revisions; the declared effect
//! of every step; and the people's answers that let a step act again.
//!
//! ```text
//!   ledger ──pair by Pod UID──▶ executions ──▶ by_key  (one key: retries, D1–D3, D6)
//!                                         └──▶ by_step (run, step): every key, every revision
//!   final runs ──▶ effect of (run, step)       Approvals ──▶ Retry decisions, approved repeats
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};

use agentrun_operator::api::{
    Approval, ApprovalKind, ApprovalPhase, Decision, Effect, EffectOutcome,
};
use jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

use super::{Evidence, decision_time};
use crate::ledger::{LedgerEvent, Outcome};

/// One execution: a Pod that started running.
#[derive(Clone, Debug)]
pub(super) struct Execution<'a> {
    pub pod: &'a str,
    pub run: &'a str,
    pub step: &'a str,
    pub key: &'a str,
    /// Label `agentrun.dev/role` (`None`: a step).
    pub role: Option<&'a str>,
    pub started_at: Timestamp,
    pub outcome: Option<Outcome>,
    pub finished_at: Option<Timestamp>,
    /// Its termination message said `effect: NotApplied`.
    pub said_not_applied: bool,
    /// Its termination message said `effect: Applied` (a probe's answer).
    pub said_applied: bool,
    /// Whether it performed its effect, as the simulated system records it
    /// (`None`: the ledger does not say).
    pub acted: Option<bool>,
    /// A probe of its key that started after it ended answered `NotApplied`,
    /// and the ledger does not say it acted: it is known not to have acted.
    pub probed_not_applied: bool,
}

impl Execution<'_> {
    /// Until when it was live. A Pod that vanished is logged when simkubelet
    /// noticed, a little after the fact: allow that much.
    pub fn live_until(&self) -> Timestamp {
        match (self.finished_at, self.outcome) {
            (Some(f), Some(Outcome::Killed)) => f - SignedDuration::from_millis(50),
            (Some(f), _) => f,
            (None, _) => Timestamp::MAX,
        }
    }

    pub fn succeeded(&self) -> bool {
        self.outcome == Some(Outcome::Succeeded)
    }

    /// A step of the plan (not a planner, compactor, compensation or probe).
    pub fn is_step(&self) -> bool {
        self.role.is_none_or(|r| r == "step")
    }

    /// It started, so it may have acted, unless it said it did not or a
    /// probe found it did not.
    pub fn may_have_acted(&self) -> bool {
        !self.said_not_applied && !self.probed_not_applied
    }

    /// It ended without a result that says whether it acted: killed, failed
    /// without saying `NotApplied`, or never seen to end (D6 "may have acted"),
    /// and no probe found it did not act.
    pub fn unsettled(&self) -> bool {
        let unknown = match self.outcome {
            Some(Outcome::Succeeded) => false,
            Some(Outcome::Failed) => !self.said_not_applied,
            Some(Outcome::Killed) | None => true,
        };
        unknown && !self.probed_not_applied
    }

    /// A step execution whose Pod lacked the run or step label: nothing
    /// can be judged about it, which is itself a finding.
    pub fn unlabelled(&self) -> bool {
        self.is_step() && (self.run.is_empty() || self.step.is_empty())
    }

    /// A verify probe (role `verify`).
    pub fn is_probe(&self) -> bool {
        self.role == Some("verify")
    }

    /// `run r key k pod p started t (outcome)`.
    pub fn describe(&self) -> String {
        format!(
            "run {} key {} pod {} started {} ({:?})",
            self.run, self.key, self.pod, self.started_at, self.outcome
        )
    }
}

/// A person's answer that lets a step act again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Leave<'a> {
    /// The key the approval is about.
    pub key: Option<&'a str>,
    /// When the API server took the decision (whole seconds); `None` if it
    /// does not say, which counts as after every execution: the operator
    /// treats a decision it cannot place in time as late, and the referee is
    /// at least as strict.
    pub at: Option<Timestamp>,
    pub kind: LeaveKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LeaveKind {
    /// A Reconcile question answered `Retry`: the attempt did not act, run it again.
    Retry,
    /// An `Approve` question with `spec.context.repeats`, approved: act a second time.
    Repeat,
}

impl Leave<'_> {
    /// Given before an execution that started at `t`.
    pub fn before(&self, t: Timestamp) -> bool {
        self.at.is_some_and(|at| at <= t)
    }
}

/// The evidence, indexed.
pub(super) struct Facts<'a> {
    pub e: &'a Evidence<'a>,
    /// Every execution, ordered by key, then by start.
    pub executions: Vec<Execution<'a>>,
    /// Per key, its executions in start order (verify probes, which carry
    /// their step's key and only read, are left out).
    pub by_key: BTreeMap<&'a str, Vec<usize>>,
    /// Per key, its verify probes in start order.
    pub probes: BTreeMap<&'a str, Vec<usize>>,
    /// Per (run, step name), the step's executions under every key and plan
    /// revision, in start order. Steps of the plan only.
    pub by_step: BTreeMap<(&'a str, &'a str), Vec<usize>>,
    effects: BTreeMap<(&'a str, &'a str), Effect>,
    timeouts: BTreeMap<(&'a str, &'a str), SignedDuration>,
    /// Steps that journal their calls (`journal: {}`).
    journaled: BTreeSet<(&'a str, &'a str)>,
}

impl<'a> Facts<'a> {
    pub fn new(e: &'a Evidence<'a>) -> Facts<'a> {
        let finishes: HashMap<&str, _> = e.ledger.finishes().map(|f| (f.uid.as_str(), f)).collect();
        let mut executions: Vec<Execution<'a>> = e
            .ledger
            .entries
            .iter()
            .filter(|s| s.event == LedgerEvent::Started)
            .map(|s| {
                let finished = finishes.get(s.uid.as_str());
                Execution {
                    pod: &s.pod,
                    run: s.run.as_deref().unwrap_or(""),
                    step: s.step.as_deref().unwrap_or(""),
                    key: s.key(),
                    role: s.role.as_deref(),
                    started_at: s.started_at,
                    outcome: finished.and_then(|f| f.outcome),
                    finished_at: finished.and_then(|f| f.finished_at),
                    said_not_applied: finished.is_some_and(|f| f.said_not_applied()),
                    said_applied: finished
                        .is_some_and(|f| f.reported_effect == Some(EffectOutcome::Applied)),
                    acted: finished.and_then(|f| f.acted),
                    probed_not_applied: false,
                }
            })
            .collect();
        settled_by_probes(&mut executions);
        // Stable: executions that started at the same instant keep file order.
        executions.sort_by(|a, b| (a.key, a.started_at).cmp(&(b.key, b.started_at)));
        let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        let mut probes: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        let mut by_step: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
        for (i, x) in executions.iter().enumerate() {
            if x.is_probe() {
                probes.entry(x.key).or_default().push(i);
            } else {
                by_key.entry(x.key).or_default().push(i);
            }
            if x.is_step() && !x.run.is_empty() && !x.step.is_empty() {
                by_step.entry((x.run, x.step)).or_default().push(i);
            }
        }
        for xs in by_step.values_mut() {
            xs.sort_by_key(|&i| (executions[i].started_at, i));
        }
        let mut effects = BTreeMap::new();
        let mut timeouts = BTreeMap::new();
        let mut journaled = BTreeSet::new();
        for run in e.final_runs {
            let name = run.metadata.name.as_deref().unwrap_or("");
            let planned = run
                .status
                .as_ref()
                .and_then(|s| s.plan.as_ref())
                .map(|p| p.steps.as_slice())
                .unwrap_or_default();
            for s in run.spec.steps.iter().chain(planned) {
                effects.insert((name, s.name.as_str()), s.effect);
                if s.journal.is_some() {
                    journaled.insert((name, s.name.as_str()));
                }
                if let Some(t) = s.timeout.as_ref().and_then(|t| t.parse().ok()) {
                    timeouts.insert((name, s.name.as_str()), t);
                }
            }
        }
        Facts {
            e,
            executions,
            by_key,
            probes,
            by_step,
            effects,
            timeouts,
            journaled,
        }
    }

    /// Whether step `step` of run `run` journals its calls: its effects are
    /// its calls, judged one by one (`journal_calls`), and a new attempt
    /// after a lost one replays instead of acting again.
    pub fn journaled(&self, run: &str, step: &str) -> bool {
        self.journaled.contains(&(run, step))
    }

    /// The execution ran past its step's `timeout` (or never ended). The
    /// operator may then stop it and ask what it did, even if it went on to
    /// succeed: the kubelet may report the end only after the operator
    /// looked (an API server restarting in between, say).
    pub fn outlived_timeout(&self, x: &Execution<'_>) -> bool {
        let Some(t) = self.timeouts.get(&(x.run, x.step)) else {
            return false;
        };
        x.finished_at
            .is_none_or(|f| f.duration_since(x.started_at) > *t)
    }

    /// The probes of one key, in start order, with their indexes.
    pub fn probes_of(&self, key: &str) -> impl Iterator<Item = (usize, &Execution<'a>)> {
        self.probes
            .get(key)
            .into_iter()
            .flatten()
            .map(|&i| (i, &self.executions[i]))
    }

    /// A probe's `Applied` answer about `key` is true: a probe that started
    /// after an execution of the key ended said so, and the ledger says that
    /// execution acted (or, without the record, may have).
    pub fn verified(&self, key: &str) -> bool {
        self.of_key(key).any(|(_, x)| {
            x.acted.unwrap_or(!x.said_not_applied)
                && self
                    .probes_of(key)
                    .any(|(_, p)| p.succeeded() && p.said_applied && p.started_at >= x.live_until())
        })
    }

    /// The declared effect of step `step` of run `run` (`None`: the run is
    /// gone, or the step left its plan; rules judge it as `NonIdempotent`).
    pub fn effect(&self, run: &str, step: &str) -> Option<Effect> {
        self.effects.get(&(run, step)).copied()
    }

    /// The executions of one key, in start order, with their indexes.
    pub fn of_key(&self, key: &str) -> impl Iterator<Item = (usize, &Execution<'a>)> {
        self.by_key
            .get(key)
            .into_iter()
            .flatten()
            .map(|&i| (i, &self.executions[i]))
    }

    /// The answers that let step `step` of run `run` act again: `Retry`
    /// decisions on its Reconcile questions (any key) and approved repeats.
    /// A decision that came after an expiry was written is not one.
    pub fn leaves(&self, run: &str, step: &str) -> Vec<Leave<'a>> {
        self.e
            .approvals
            .iter()
            .filter(|a| a.spec.run_name == run && a.spec.step == step)
            .filter_map(leave)
            .collect()
    }

    /// The `Retry` decisions on Reconcile questions about `key`.
    pub fn retries(&self, key: &str) -> Vec<Leave<'a>> {
        self.e
            .approvals
            .iter()
            .filter_map(leave)
            .filter(|l| l.kind == LeaveKind::Retry && l.key == Some(key))
            .collect()
    }
}

/// Marks the executions a probe found not to have acted: a probe of the
/// same key that started once the execution had ended and answered
/// `NotApplied`. A probe that runs beside the execution proves nothing
/// (`early_probe`), and an answer the ledger contradicts is not believed.
fn settled_by_probes(executions: &mut [Execution<'_>]) {
    let answers: Vec<(String, Timestamp)> = executions
        .iter()
        .filter(|p| p.is_probe() && p.succeeded() && p.said_not_applied)
        .map(|p| (p.key.to_owned(), p.started_at))
        .collect();
    for x in executions.iter_mut().filter(|x| !x.is_probe()) {
        let until = x.live_until();
        x.probed_not_applied =
            x.acted != Some(true) && answers.iter().any(|(key, at)| key == x.key && *at >= until);
    }
}

/// The key an approval is about (`spec.context.idempotencyKey`).
pub(super) fn approval_key(a: &Approval) -> Option<&str> {
    a.spec.context.as_ref()?.idempotency_key.as_deref()
}

fn leave(a: &Approval) -> Option<Leave<'_>> {
    if a.status.as_ref().map(|s| s.phase) == Some(ApprovalPhase::Expired) {
        return None;
    }
    let repeats = a.spec.context.as_ref().is_some_and(|c| c.repeats.is_some());
    let kind = match (a.spec.kind, a.spec.decision) {
        (ApprovalKind::Reconcile, Some(Decision::Retry)) => LeaveKind::Retry,
        (ApprovalKind::Approve, Some(Decision::Approved)) if repeats => LeaveKind::Repeat,
        _ => return None,
    };
    Some(Leave {
        key: approval_key(a),
        at: decision_time(a),
        kind,
    })
}

/// When an approval was created (whole seconds).
pub(super) fn created(a: &Approval) -> Option<Timestamp> {
    a.creation_timestamp().map(|t| t.0)
}
