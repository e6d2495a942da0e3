//! `approve`, `reject` and `reconcile`: find the run's pending approval,
//! check the user may decide it, confirm, and send the decision (or vote) —
//! the same write the console makes.

use agentrun_operator::api::{Approval, ApprovalKind, Decision};
use kube::api::Patch;
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use crate::commands::{DecideArgs, Error, api, confirm, patch_params, run_and_approvals, whoami};
use crate::identity::Identity;
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

/// The API write of a decision on `target` as `me`: `spec.decision` with who
/// decided, or one vote more where a quorum is needed. The one place both
/// `approve`/`reject`/`reconcile` and the console decide; the API server's
/// refusal comes back with its own message. Returns what was recorded.
pub async fn send_decision(
    client: &Client,
    target: &Approval,
    me: &Identity,
    d: Decision,
    comment: Option<&str>,
) -> Result<String, Error> {
    let name = target.name_any();
    let ns = target.metadata.namespace.clone().unwrap_or_default();
    let api_: Api<Approval> = Api::namespaced(client.clone(), &ns);
    let by_votes = target.spec.kind == ApprovalKind::Approve && target.spec.quorum > 1;
    if by_votes {
        // The whole list with one vote more, under the resourceVersion read:
        // a vote that lands meanwhile makes this a conflict, never a loss.
        let mut votes = serde_json::to_value(&target.spec.votes).unwrap_or_else(|_| json!([]));
        if let Some(list) = votes.as_array_mut() {
            let mut vote = json!({"user": me.user, "decision": d});
            if let Some(c) = comment {
                vote["comment"] = json!(c);
            }
            list.push(vote);
        }
        let patch = json!({
            "metadata": {"resourceVersion": target.metadata.resource_version},
            "spec": {"votes": votes},
        });
        api_.patch(&name, &patch_params(), &Patch::Merge(&patch))
            .await
            .map_err(api(format!("voting on approval {name}")))?;
        let have = target
            .spec
            .votes
            .iter()
            .filter(|v| v.decision == Decision::Approved)
            .count()
            + usize::from(d == Decision::Approved);
        Ok(format!(
            "approval {name}: {:?} vote by {} recorded ({have}/{} approvals)",
            d, me.user, target.spec.quorum
        ))
    } else {
        let mut spec = json!({"decision": d, "decidedBy": me.user, "decidedByGroups": me.groups});
        if let Some(c) = comment {
            spec["comment"] = json!(c);
        }
        api_.patch(
            &name,
            &patch_params(),
            &Patch::Merge(&json!({"spec": spec})),
        )
        .await
        .map_err(api(format!("deciding approval {name}")))?;
        Ok(format!("approval {name}: {d:?} by {}", me.user))
    }
}
