//! Forking a run from a checkpoint (`spec.forkOf`): which of the source run's
//! checkpoints the new run carries over, which steps run again in it, and
//! what it refuses. Pure: the source run, the fork's spec and `now` in.
//!
//! ```text
//!   source run (name, UID)     fork (a new UID, so new keys)
//!   s1 ✓ Applied  ──carried──▶ s1 Inherited (revision 0), never run again
//!   s2 ✓ None, stale ────────▶ s2 runs again (an expired read)
//!   s3 ✗ (fromStep) ─────────▶ s3 runs here, and every step after it
//! ```
//!
//! A step whose spec the fork changed is not the step that ran: it runs
//! again, like any step after `fromStep`.
//!
//! A step that acted in the source (effect Applied or Unknown) and would run
//! again in the fork acts a second time: the fork refuses unless
//! `rerunActed` is set, and then the step waits for an Approval that says
//! so (`repeats`). Approvals are never carried: a gated step asks again.

use jiff::Timestamp;

use agentrun_api::{
    AgentRun, AgentRunSpec, CheckpointState, EffectOutcome, PlanSource, PlanStatus, Provenance,
    StepCheckpoint, StepPhase, StepRole,
};

use super::plan::Plan;

/// What a fork starts with.
#[derive(Clone, Debug, PartialEq)]
pub struct ForkPlan {
    /// Carried over, at plan revision 0, provenance Inherited (and, for a
    /// step that acted and runs again, a superseded copy that makes its new
    /// attempt ask first).
    pub checkpoints: Vec<StepCheckpoint>,
    /// The steps carried over.
    pub inherited: Vec<String>,
    /// The steps that run in the fork, in the plan's order.
    pub runs: Vec<String>,
    /// Of those, the ones that acted in the source: each asks before it acts again.
    pub acts_again: Vec<String>,
    /// Of those, the gated ones: each asks again.
    pub gated: Vec<String>,
}

/// Why a fork cannot start.
#[derive(Clone, Debug, PartialEq)]
pub enum ForkRefused {
    /// The source run is gone (deleted by its TTL?) or is another run now.
    SourceGone(String),
    /// `fromStep` is not a step of the plan.
    NoSuchStep(String),
    /// A step that acted would act again, and `rerunActed` is not set.
    WouldActAgain(String),
    /// The spec's steps do not form a plan.
    Invalid(String),
}

impl ForkRefused {
    pub fn message(&self) -> &str {
        match self {
            ForkRefused::SourceGone(m)
            | ForkRefused::NoSuchStep(m)
            | ForkRefused::WouldActAgain(m)
            | ForkRefused::Invalid(m) => m,
        }
    }
}

/// The fork of `source` that `spec` asks for, as of `now`.
pub fn fork_plan(
    source: Option<&AgentRun>,
    spec: &AgentRunSpec,
    now: Timestamp,
) -> Result<ForkPlan, ForkRefused> {
    let Some(fork) = spec.fork_of.as_ref() else {
        return Err(ForkRefused::Invalid("spec.forkOf is not set".into()));
    };
    let source = source
        .filter(|s| s.metadata.uid.as_deref() == Some(fork.run_uid.as_str()))
        .ok_or_else(|| {
            ForkRefused::SourceGone(format!(
                "spec.forkOf: run {} (UID {}) no longer exists — deleted by its ttlSecondsAfterFinished, or replaced by another run of that name — so there is nothing to fork from",
                fork.run_name, fork.run_uid
            ))
        })?;
    if spec.planner.is_some() {
        return Err(ForkRefused::Invalid(
            "spec.planner is set: a planned run's steps are the planner's, and a fork starts from spec.steps; retry such a run with its plan written out as spec.steps".into(),
        ));
    }
    let names: Vec<String> = spec.steps.iter().map(|s| s.name.clone()).collect();
    let status = PlanStatus {
        revision: 1,
        source: PlanSource::Spec,
        step_names: names.clone(),
        ..PlanStatus::default()
    };
    let plan = Plan::resolve(spec, &status).map_err(ForkRefused::Invalid)?;
    let from = plan.index(&fork.from_step).ok_or_else(|| {
        ForkRefused::NoSuchStep(format!(
            "spec.forkOf.fromStep: {:?} is not a step of the plan ({})",
            fork.from_step,
            names.join(", ")
        ))
    })?;
    let empty = agentrun_api::AgentRunStatus::default();
    let src = source.status.as_ref().unwrap_or(&empty);
    // The source's checkpoint of a step: the newest not superseded.
    let latest = |name: &str| -> Option<&StepCheckpoint> {
        src.steps
            .iter()
            .filter(|c| c.role == StepRole::Step && c.name == name)
            .filter(|c| c.phase != StepPhase::Superseded)
            .max_by_key(|c| c.plan_revision)
    };
    let compensated = |c: &StepCheckpoint| {
        src.compensations
            .iter()
            .any(|k| k.name == c.name && k.plan_revision == c.plan_revision)
    };
    let mut runs: std::collections::HashSet<usize> =
        plan.descendants(&[from].into_iter().collect());
    runs.insert(from);
    let mut out = ForkPlan {
        checkpoints: Vec::new(),
        inherited: Vec::new(),
        runs: Vec::new(),
        acts_again: Vec::new(),
        gated: Vec::new(),
    };
    let carry = |c: &StepCheckpoint, phase: StepPhase| StepCheckpoint {
        plan_revision: 0,
        phase,
        pod: None,
        pod_uid: None,
        pod_recreated: false,
        stopping: false,
        approval: None,
        step_digest: None,
        next_attempt_at: None,
        provenance: Some(Provenance::Inherited),
        message: Some(format!(
            "inherited from run {} (plan revision {}, key {})",
            fork.run_name, c.plan_revision, c.idempotency_key
        )),
        ..c.clone()
    };
    for &i in &plan.order {
        let name = &plan.steps[i].name;
        let c = latest(name);
        let acted = c.is_some_and(|c| c.effect.is_some_and(EffectOutcome::acted));
        // A step the fork's spec changed is another step: it runs again.
        let same = source
            .spec
            .steps
            .iter()
            .any(|s| s.name == *name && s == plan.steps[i]);
        let keep = !runs.contains(&i)
            && same
            && c.is_some_and(|c| {
                c.phase == StepPhase::Succeeded
                    && c.checkpoint == CheckpointState::Committed
                    && !compensated(c)
                    // An expired read runs again; a step that acted is kept
                    // even when stale: running it again is a person's call,
                    // which the fork's first re-plan asks (D8).
                    && (acted || c.fresh_until.as_ref().is_none_or(|t| t.0 > now))
            });
        match (keep, c) {
            (true, Some(c)) => {
                out.checkpoints.push(carry(c, StepPhase::Succeeded));
                out.inherited.push(name.clone());
            }
            _ => {
                runs.insert(i);
                if acted && let Some(c) = c {
                    // Seen by `repeated_effect`: acting again asks first.
                    out.checkpoints.push(carry(c, StepPhase::Superseded));
                    out.acts_again.push(name.clone());
                }
            }
        }
    }
    out.runs = plan
        .order
        .iter()
        .filter(|i| runs.contains(i))
        .map(|&i| plan.steps[i].name.clone())
        .collect();
    out.gated = plan
        .order
        .iter()
        .filter(|i| runs.contains(i))
        .filter(|&&i| plan.steps[i].approval.as_ref().is_some_and(|g| g.required))
        .map(|&i| plan.steps[i].name.clone())
        .collect();
    if !out.acts_again.is_empty() && !fork.rerun_acted {
        return Err(ForkRefused::WouldActAgain(format!(
            "spec.forkOf: {} acted in run {} and would act a second time in this fork; set rerunActed (kubectl agentrun retry --rerun-applied) to run it again after a person approves",
            out.acts_again.join(", "),
            fork.run_name
        )));
    }
    Ok(out)
}
