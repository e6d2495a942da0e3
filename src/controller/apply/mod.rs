//! Carrying out one engine decision, in two stages:
//!
//! ```text
//!   commit   record (D18) ─▶ guarded status write (D3) ─▶ fence: a quorum read when
//!            the decision acts on the world without a write
//!   effects  Pods first, each behind a proof the run is current ─▶ the rest in order
//!            (deletions, finalizer releases, Approvals and Signals, the run's deletion, Events)
//! ```
//!
//! Nothing is applied when the status write fails, so no effect ever runs
//! ahead of the checkpoint it depends on (D4).

mod commit;
mod effects;
mod journal;

use std::time::{Duration, Instant};

use kube::{Api, ResourceExt};

use super::Context;
use super::error::Error;
use super::world::World;
use crate::api::AgentRun;
use crate::engine::{Decision, Refusal};

pub(super) use effects::release_finalizer;

/// Why applying a decision stopped.
pub(super) enum Outcome {
    /// The status write hit a stale resourceVersion: re-read and re-decide.
    Conflict,
    /// The decision would create a Pod or an Approval, or change an
    /// Approval's status, without a status write, and a quorum read shows the
    /// run has moved on since: decide again on this copy.
    Stale(Box<AgentRun>),
    Failed(Error),
}

impl From<Error> for Outcome {
    fn from(e: Error) -> Self {
        Outcome::Failed(e)
    }
}

/// What applying a decision did.
pub(super) struct Applied {
    /// When to look at the run again.
    pub requeue: Option<Duration>,
    /// The run as the status write left it, when there was one.
    pub written: Option<AgentRun>,
    /// Creations the API server refused; the engine decides what they mean.
    pub refused: Vec<Refusal>,
}

/// The run a decision is applied to, as its writes and errors name it.
struct Target<'a> {
    run: &'a AgentRun,
    name: String,
    ns: String,
    uid: String,
    /// `namespace/name`.
    run_ref: String,
}

impl<'a> Target<'a> {
    fn of(run: &'a AgentRun) -> Result<Self, Error> {
        let name = run.name_any();
        let ns = run.namespace().ok_or(Error::MissingMetadata("namespace"))?;
        Ok(Target {
            run,
            run_ref: format!("{ns}/{name}"),
            uid: run.uid().unwrap_or_default(),
            name,
            ns,
        })
    }

    /// An action the API server failed, as the reconcile reports it.
    fn failed(&self, action: String, source: kube::Error) -> Outcome {
        Outcome::Failed(Error::Apply {
            run: self.run_ref.clone(),
            action,
            source,
        })
    }
}

/// Applies `decision` for `run`: commit, then effects.
pub(super) async fn apply(
    runs: &Api<AgentRun>,
    run: &AgentRun,
    world: &World,
    mut decision: Decision,
    ctx: &Context,
) -> Result<Applied, Outcome> {
    // D18: a finished run's record is stored before any status names it.
    super::history::record(run, &mut decision.status, world, ctx).await;
    let target = Target::of(run)?;
    // A proof is no fresher than the request that asked for it.
    let asked = Instant::now();
    let written = commit::write_status(runs, &target, &decision, ctx).await?;
    let mut proof =
        commit::fence(runs, &target, &decision.actions, written.as_ref(), asked).await?;
    let refused = effects::act(
        runs,
        &target,
        world,
        &decision.status,
        decision.actions,
        &mut proof,
        ctx,
    )
    .await?;
    Ok(Applied {
        requeue: decision.requeue_after.map(|d| d.unsigned_abs()),
        written,
        refused,
    })
}
