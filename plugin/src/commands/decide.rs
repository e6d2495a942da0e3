//! `approve`, `reject` and `reconcile`: find the run's pending approval,
//! check the user may decide it, confirm, and send the decision (or vote) —
//! the same write the console makes.

use agentrun_api::{Approval, ApprovalKind, Decision};
use clap::Args;
use kube::{Client, ResourceExt};

use super::confirm;
use crate::client::{Error, run_and_approvals, whoami};
use crate::decision::send_decision;
use crate::render;

/// Finds the run's pending approval of `kind` (the only one, or the one for
/// `step`), checks the user may decide it, confirms, and decides or votes.
pub(crate) async fn decide(
    client: &Client,
    ns: &str,
    a: &DecideArgs,
    d: Decision,
) -> Result<(), Error> {
    let kind = match d {
        Decision::Approved | Decision::Rejected => ApprovalKind::Approve,
        _ => ApprovalKind::Reconcile,
    };
    let (_, approvals) = run_and_approvals(client, ns, &a.run).await?;
    let of_kind: Vec<&Approval> = approvals
        .iter()
        .filter(|x| x.spec.kind == kind)
        .filter(|x| a.step.as_deref().is_none_or(|s| x.spec.step == s))
        .collect();
    let pending: Vec<&Approval> = of_kind
        .iter()
        .copied()
        .filter(|x| render::is_pending(x))
        .collect();
    let target = match pending.as_slice() {
        [one] => *one,
        [] => {
            let me = whoami(client).await?;
            let why = of_kind.iter().rev().find_map(|x| {
                me.may_decide_as(x, false)
                    .err()
                    .map(|r| r.explain(&me, x.metadata.name.as_deref().unwrap_or("")))
            });
            let what = match kind {
                ApprovalKind::Approve => "approval",
                ApprovalKind::Reconcile => "Reconcile question",
            };
            let step = a
                .step
                .as_deref()
                .map(|s| format!(" for step {s}"))
                .unwrap_or_default();
            return Err(Error::Refused(match why {
                Some(w) => format!("run {} has no pending {what}{step}: {w}", a.run),
                None => format!(
                    "run {} has no pending {what}{step}; see kubectl agentrun describe {}",
                    a.run, a.run
                ),
            }));
        }
        several => {
            let names: Vec<String> = several
                .iter()
                .map(|x| format!("{} (step {})", x.name_any(), x.spec.step))
                .collect();
            return Err(Error::Usage(format!(
                "run {} waits on several approvals: {}; name the step: kubectl agentrun {} {} STEP",
                a.run,
                names.join(", "),
                if kind == ApprovalKind::Approve {
                    "approve"
                } else {
                    "reconcile"
                },
                a.run
            )));
        }
    };
    let name = target.name_any();
    let me = whoami(client).await?;
    let approving = matches!(
        d,
        Decision::Approved | Decision::Retry | Decision::MarkSucceeded
    );
    me.may_decide_as(target, approving && kind == ApprovalKind::Approve)
        .map_err(|r| Error::Refused(r.explain(&me, &name)))?;
    print!("{}", render::question(target));
    confirm(a.yes, &format!("Answer {d:?} as {}?", me.user))?;
    println!(
        "{}",
        send_decision(client, target, &me, d, a.comment.as_deref()).await?
    );
    Ok(())
}

#[derive(Args, Debug, Clone)]
pub struct DecideArgs {
    pub run: String,
    /// The step, when the run waits on more than one approval.
    pub step: Option<String>,
    /// Why: recorded with the decision.
    #[arg(long)]
    pub comment: Option<String>,
    /// Do not ask for confirmation.
    #[arg(short = 'y', long)]
    pub yes: bool,
}

/// The decision `reconcile`'s flags say (clap lets at most one through).
pub fn reconcile_answer(retry: bool, succeeded: bool, failed: bool) -> Result<Decision, Error> {
    match (retry, succeeded, failed) {
        (true, _, _) => Ok(Decision::Retry),
        (_, true, _) => Ok(Decision::MarkSucceeded),
        (_, _, true) => Ok(Decision::MarkFailed),
        _ => Err(Error::Usage(
            "say what the step did: --retry, --succeeded or --failed".into(),
        )),
    }
}
