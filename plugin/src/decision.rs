//! The API write of a decision: the one place both `approve`/`reject`/
//! `reconcile` and the console decide.

use agentrun_api::{Approval, ApprovalKind, Decision};
use kube::api::Patch;
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use crate::client::{Error, api, patch_params};
use crate::identity::Identity;

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
