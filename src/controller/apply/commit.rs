//! The commit stage: the guarded status write (D3) and, for a decision that
//! acts on the world without one, the fence: a quorum read that proves the
//! run is as it was decided on. Its [`Proof`] is renewed before each Pod
//! creation that comes too long after it.

use std::time::{Duration, Instant, SystemTime};

use kube::{Api, ResourceExt};
use tracing::debug;

use super::{Outcome, Target};
use crate::api::{AgentRun, AgentRunStatus, CheckpointState};
use crate::controller::error::Error;
use crate::controller::patch::is_status;
use crate::controller::{Context, failpoints, status_write};
use crate::engine::{Action, Decision};
use crate::telemetry::{trace, transitions};

/// How long a proof that the run is current (the status write, or the
/// fence's quorum read) stands for the Pod creations that follow it.
const PROOF_GOOD_FOR: Duration = Duration::from_secs(1);

/// Writes the decided status when it differs from the committed one: a JSON
/// patch of what changed, guarded by the resourceVersion decided on, so a
/// stale or deposed operator gets 409 (D3). Returns the run as written.
pub(super) async fn write_status(
    runs: &Api<AgentRun>,
    target: &Target<'_>,
    decision: &Decision,
    ctx: &Context,
) -> Result<Option<AgentRun>, Outcome> {
    let run = target.run;
    let current_status = run.status.clone().unwrap_or_default();
    if decision.status == current_status {
        return Ok(None);
    }
    let started = Instant::now();
    let started_at = SystemTime::now();
    let written = status_write::write_status(runs, run, &decision.status).await;
    ctx.metrics
        .checkpoint_write_duration
        .observe(started.elapsed().as_secs_f64());
    let write_span = |result: &str| {
        let committed = decision
            .status
            .steps
            .iter()
            .filter(|c| c.checkpoint == CheckpointState::Committed)
            .count();
        trace::status_write(run, started_at, SystemTime::now(), result, committed);
    };
    match written {
        Ok(written) => {
            debug!("status committed");
            ctx.metrics.status_write("ok");
            ctx.metrics.count(&target.ns, &decision.tally);
            let facts = transitions::between(&current_status, &decision.status, ctx.clock.now());
            ctx.metrics.observe(&facts);
            write_span("ok");
            let journals: Vec<_> = if facts
                .iter()
                .any(|f| matches!(f, transitions::Transition::AttemptEnded(_)))
            {
                ctx.journal_index
                    .read(&ctx.journals, &target.ns, &target.uid)
                    .collect()
            } else {
                Vec::new()
            };
            let journals: Vec<&crate::api::StepJournal> = journals.iter().map(|j| &**j).collect();
            trace::record(run, &decision.status, &facts, &journals);
            failpoints::hit("after-status-write");
            if commits_an_outcome(&current_status, &decision.status) {
                failpoints::hit("after-checkpoint");
            }
            Ok(Some(written))
        }
        Err(err) if is_status(&err, 409) => {
            ctx.metrics.status_write("conflict");
            write_span("conflict");
            Err(Outcome::Conflict)
        }
        Err(source) => {
            ctx.metrics.status_write("error");
            write_span("error");
            Err(Error::WriteStatus {
                run: target.run_ref.clone(),
                source,
            }
            .into())
        }
    }
}

/// That the run was current when last proven, and as of which resourceVersion.
pub(super) struct Proof {
    at: Instant,
    resource_version: Option<String>,
}

/// The fence. Effects a decision may ask for without a status write: a Pod
/// whose attempt it did not record (one missing from the cache), an
/// Approval or Signal never seen, their status (superseded, expired). Their
/// intent was committed earlier, and a paused or deposed operator, or a
/// cache behind the run, may be deciding on a status that has moved on (the
/// attempt closed, the run asked a person something else). A quorum read
/// proves the decision was made on the run as it stands. `asked`: when the
/// status write (if any) was asked for.
pub(super) async fn fence(
    runs: &Api<AgentRun>,
    target: &Target<'_>,
    actions: &[Action],
    written: Option<&AgentRun>,
    asked: Instant,
) -> Result<Proof, Outcome> {
    let mut at = asked;
    if acts_on_the_world(actions) && written.is_none() {
        at = Instant::now();
        let fresh = reread(runs, target).await?;
        failpoints::hit("after-proof-read");
        if fresh.resource_version() != target.run.resource_version() {
            debug!("the run moved on since the decision; deciding again before acting");
            return Err(Outcome::Stale(Box::new(fresh)));
        }
    }
    Ok(Proof {
        at,
        // The run as the write (or the fence) proved it current.
        resource_version: written
            .map_or_else(|| target.run.resource_version(), |w| w.resource_version()),
    })
}

impl Proof {
    /// Before a Pod creation. A process paused (or starved) between the
    /// proof and this create — a leader stopped past its lease, resumed —
    /// may be about to start an attempt the run has closed since: prove the
    /// run current again when the last proof is older than [`PROOF_GOOD_FOR`].
    pub(super) async fn renew(
        &mut self,
        runs: &Api<AgentRun>,
        target: &Target<'_>,
    ) -> Result<(), Outcome> {
        if self.at.elapsed() <= PROOF_GOOD_FOR {
            return Ok(());
        }
        self.at = Instant::now();
        let fresh = reread(runs, target).await?;
        failpoints::hit("after-proof-read");
        if fresh.resource_version() != self.resource_version {
            debug!("the run moved on while this decision was applied; deciding again");
            return Err(Outcome::Stale(Box::new(fresh)));
        }
        // The proof is only as fresh as the request it was asked in: an
        // answer that took longer than PROOF_GOOD_FOR to arrive (a process
        // stopped while it waited in the socket) proves nothing about now.
        // Decide again; what that decision does is proven again in turn.
        if self.at.elapsed() > PROOF_GOOD_FOR {
            debug!("the proof that the run is current came too late; deciding again");
            return Err(Outcome::Stale(Box::new(fresh)));
        }
        Ok(())
    }
}

/// The run from the API server (a quorum read, not the cache).
async fn reread(runs: &Api<AgentRun>, target: &Target<'_>) -> Result<AgentRun, Error> {
    runs.get(&target.name)
        .await
        .map_err(|source| Error::Reread {
            run: target.run_ref.clone(),
            source,
        })
}

/// Whether `actions` create or change anything but the run itself.
fn acts_on_the_world(actions: &[Action]) -> bool {
    actions.iter().any(|a| {
        matches!(
            a,
            Action::CreatePod(_)
                | Action::CreateApproval(_)
                | Action::SetApprovalStatus { .. }
                | Action::CreateSignal(_)
                | Action::SetSignalStatus { .. }
        )
    })
}

/// Whether `new` commits a step outcome that `old` did not have.
fn commits_an_outcome(old: &AgentRunStatus, new: &AgentRunStatus) -> bool {
    let committed = |s: &AgentRunStatus| {
        s.steps
            .iter()
            .filter(|c| c.checkpoint == CheckpointState::Committed)
            .count()
    };
    committed(new) > committed(old)
}
