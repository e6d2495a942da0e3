//! How a wait step on a signal reads, in `describe`, `list` and the console:
//! what it waits for, until when, the command that sends it, and once it
//! came, its id and sender.
//!
//! ```text
//!   AgentRun status.steps[settle] ──signal──▶ Signal <run>-settle-…-signal
//!     phase Waiting, wakeAt = deadline         spec.id, spec.data, spec.sentBy (once sent)
//! ```
//!
//! The run's status alone says what the step waits for and until when; the
//! id comes from the Signal, so where the Signal cannot be read (gone with
//! the run's TTL, or no RBAC to read it) the step's own message says it.

use agentrun_api::{AgentRun, Signal, StepCheckpoint, StepPhase, StepSpec};
use jiff::Timestamp;

/// One step's signal, as the plugin shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct SignalStep {
    /// The Signal's name.
    pub name: String,
    /// The step's `wait.signal.description`.
    pub description: Option<String>,
    /// When `onTimeout` applies; none: it waits indefinitely.
    pub expires: Option<Timestamp>,
    /// Once sent: the sender's id, when the Signal could be read.
    pub id: Option<String>,
    /// Who sent it, as the API server recorded it.
    pub sender: Option<String>,
    /// The run and step, for the command that sends it.
    pub run: String,
    pub step: String,
}

impl SignalStep {
    /// `signal (payment settled)`, or `signal` without a description.
    pub fn what(&self) -> String {
        match &self.description {
            Some(d) => format!("signal ({d})"),
            None => "signal".into(),
        }
    }

    /// `signal pay-1 from ci-bot` once it came (id and sender where known).
    pub fn received(&self) -> String {
        let id = self
            .id
            .as_deref()
            .map(|i| format!(" {i}"))
            .unwrap_or_default();
        let from = self
            .sender
            .as_deref()
            .map(|s| format!(" from {s}"))
            .unwrap_or_default();
        format!("signal{id}{from}")
    }

    /// The command that sends it; with `-n NS` for a reader with no
    /// namespace of their own in mind (the console).
    pub fn command(&self, namespace: Option<&str>) -> String {
        let ns = namespace.map(|n| format!(" -n {n}")).unwrap_or_default();
        format!(
            "kubectl agentrun signal {} {}{ns} --data '{{…}}'",
            self.run, self.step
        )
    }
}

/// The definition of step `name` in the plan in force: the planner's steps
/// where it wrote them, else `spec.steps`.
fn step_spec<'a>(run: &'a AgentRun, name: &str) -> Option<&'a StepSpec> {
    let planned = run
        .status
        .as_ref()
        .and_then(|s| s.plan.as_ref())
        .map(|p| p.steps.as_slice())
        .unwrap_or_default();
    planned
        .iter()
        .chain(run.spec.steps.iter())
        .find(|s| s.name == name)
}

/// Whether step `name` of the plan in force waits for a signal.
pub fn waits_for_signal(run: &AgentRun, name: &str) -> bool {
    step_spec(run, name)
        .and_then(|s| s.wait.as_deref())
        .is_some_and(|w| w.signal.is_some())
}

/// The signal checkpoint `cp` waits (or waited) on, with what `signals` (the
/// run's Signals, possibly none) add to it; none for any other step.
pub fn signal_step(run: &AgentRun, cp: &StepCheckpoint, signals: &[Signal]) -> Option<SignalStep> {
    let name = cp.signal.clone()?;
    let uid = run.metadata.uid.as_deref();
    let sig = signals.iter().find(|s| {
        s.metadata.name.as_deref() == Some(&name) && Some(s.spec.run_uid.as_str()) == uid
    });
    let description = sig.and_then(|s| s.spec.description.clone()).or_else(|| {
        step_spec(run, &cp.name)
            .and_then(|s| s.wait.as_deref())
            .and_then(|w| w.signal.as_ref())
            .and_then(|w| w.description.clone())
    });
    Some(SignalStep {
        name,
        run: run.metadata.name.clone().unwrap_or_default(),
        step: cp.name.clone(),
        description,
        expires: cp.wake_at.as_ref().map(|t| t.0),
        id: sig.and_then(|s| s.spec.id.clone()),
        sender: sig
            .and_then(|s| s.spec.sent_by.clone())
            .or_else(|| cp.decided_by.clone()),
    })
}

/// The first step of `run` that waits for a signal now.
pub fn waiting_signal(run: &AgentRun) -> Option<(&StepCheckpoint, SignalStep)> {
    let status = run.status.as_ref()?;
    status
        .steps
        .iter()
        .filter(|c| c.phase == StepPhase::Waiting)
        .find_map(|c| Some((c, signal_step(run, c, &[])?)))
}

/// `2026-… (in 9m)`, or `(now)` once the deadline passed.
pub fn deadline(at: Timestamp, now: Timestamp) -> String {
    if at > now {
        format!("{at} (in {})", super::text::short(at.duration_since(now)))
    } else {
        format!("{at} (now)")
    }
}
