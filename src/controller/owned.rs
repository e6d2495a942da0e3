//! Objects a run owns besides its Pods — Approvals and Signals — as the
//! engine asks for them: created if absent, an existing one adopted only if
//! it is the run's own (a planted one stays in the way, visibly: D16), and
//! their status written under the resourceVersion the engine decided on, so
//! an expiry never overwrites a decision or a signal it did not see (D10).

use std::fmt::Debug;

use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tracing::warn;

use crate::engine::{Refusal, RefusalCause};
pub(super) use crate::engine::{held_by, not_this_runs_approval, not_this_runs_signal};
use crate::labels;

/// What became of a create-if-absent.
pub(super) enum Created {
    New,
    /// It existed and is the run's own (the operator made it before and
    /// did not see it yet).
    Adopted,
    /// The API server refused it, or another object holds the name.
    Refused(Refusal),
}

/// Creates `wanted` unless it exists; an existing object is adopted only
/// when `foreign` finds nothing that makes it another's.
pub(super) async fn create<K>(
    api: &Api<K>,
    wanted: &K,
    run_uid: &str,
    foreign: fn(&K, &K, &str) -> Option<String>,
) -> Result<Created, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    let name = wanted.name_any();
    let pp = PostParams {
        field_manager: Some(labels::FIELD_MANAGER.into()),
        ..Default::default()
    };
    match api.create(&pp, wanted).await {
        Ok(_) => Ok(Created::New),
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let existing = api.get(&name).await?;
            match foreign(&existing, wanted, run_uid) {
                None => Ok(Created::Adopted),
                Some(why) => {
                    warn!(kind = K::kind(&()).as_ref(), %name, %why, "an object the run did not open holds its name");
                    Ok(Created::Refused(Refusal {
                        message: why,
                        name,
                        cause: RefusalCause::NameTaken,
                    }))
                }
            }
        }
        Err(kube::Error::Api(status)) => Ok(Created::Refused(Refusal {
            name,
            cause: refusal_cause(&status),
            message: status.message,
        })),
        Err(err) => Err(err),
    }
}

/// Writes the status the engine decided, guarded by the resourceVersion it
/// decided on. Gone, or changed since: the next decision sees why.
pub(super) async fn set_status<K>(
    api: &Api<K>,
    name: &str,
    resource_version: Option<String>,
    status: &impl Serialize,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
{
    let patch = json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": {"name": name, "resourceVersion": resource_version},
        "status": status,
    });
    let params = PatchParams::apply(labels::FIELD_MANAGER).force();
    match api.patch_status(name, &params, &Patch::Apply(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(err) => Err(err),
    }
}

/// What a refused creation means for the run. Admission plugins answer 403
/// for objects that can never pass (Pod Security, a missing PriorityClass)
/// but also for an exhausted quota, which frees up, and RBAC answers 403 when
/// the operator itself lacks a verb, which is no fault of the step.
pub(super) fn refusal_cause(status: &kube::core::Status) -> RefusalCause {
    let message = status.message.as_str();
    match status.code {
        403 if message.contains("exceeded quota") || message.contains("cannot create resource") => {
            RefusalCause::Transient
        }
        400 | 403 | 422 => RefusalCause::Rejected,
        _ => RefusalCause::Transient,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    const RUN_UID: &str = "0b7c6a1e-0000-4000-8000-000000000001";

    /// The Approval run `refund` (uid RUN_UID) asks for at step `pay`.
    fn asked() -> crate::api::Approval {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
            "metadata": {
                "name": "refund-pay-r1-a1",
                "ownerReferences": [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                    "name": "refund", "uid": RUN_UID, "controller": true, "blockOwnerDeletion": true}],
            },
            "spec": {
                "runName": "refund", "runUid": RUN_UID, "step": "pay", "planRevision": 1,
                "kind": "Approve", "question": "Pay out?", "stepDigest": "ab12",
                "approvers": {"groups": ["payments-leads"]}, "quorum": 2,
                "separateFromRequester": true, "requestedBy": "dave",
                "expiresAt": "2030-01-01T00:00:00Z", "onTimeout": "Reject",
                "context": {"reason": "gate", "completedSteps": ["lookup: {}"]},
            },
        }))
        .unwrap()
    }

    /// The existing Approval is adopted only when it is the run's own: its
    /// controller is the run and it asks what the run asks. Every planted
    /// variant — another owner, no controller, a field that decides who may
    /// approve or what is released changed — is refused with a reason.
    #[test]
    fn only_the_runs_own_approval_is_adopted() {
        use super::not_this_runs_approval as foreign;
        let wanted = asked();
        assert_eq!(foreign(&asked(), &wanted, RUN_UID), None, "the same one");
        let mut decided = asked();
        decided.spec.decision = Some(crate::api::Decision::Approved);
        decided.spec.decided_by = Some("alice".into());
        decided.spec.context = None;
        assert_eq!(
            foreign(&decided, &wanted, RUN_UID),
            None,
            "decided meanwhile, with the context of its time: still the run's"
        );

        let mut other_owner = asked();
        other_owner.metadata.owner_references.as_mut().unwrap()[0].uid = "another".into();
        let why = foreign(&other_owner, &wanted, RUN_UID).expect("refused");
        assert!(
            why.contains("owned by AgentRun refund (uid another)"),
            "{why}"
        );
        let mut not_controller = asked();
        not_controller.metadata.owner_references.as_mut().unwrap()[0].controller = None;
        assert!(foreign(&not_controller, &wanted, RUN_UID).is_some());
        let mut orphan = asked();
        orphan.metadata.owner_references = None;
        assert_eq!(
            foreign(&orphan, &wanted, RUN_UID).as_deref(),
            Some("it has no owner")
        );

        type Plant = fn(&mut crate::api::ApprovalSpec);
        let planted: [(&str, Plant); 10] = [
            ("runUid", |s| s.run_uid = "another".into()),
            ("step", |s| s.step = "other".into()),
            ("planRevision", |s| s.plan_revision = 2),
            ("stepDigest", |s| s.step_digest = Some("cd34".into())),
            ("question", |s| s.question = "Pay 1 EUR?".into()),
            ("approvers", |s| s.approvers = None),
            ("quorum", |s| s.quorum = 1),
            ("separateFromRequester", |s| {
                s.separate_from_requester = false
            }),
            ("requestedBy", |s| s.requested_by = Some("mallory".into())),
            ("onTimeout", |s| {
                s.on_timeout = crate::api::OnTimeout::Approve
            }),
        ];
        for (field, plant) in planted {
            let mut existing = asked();
            plant(&mut existing.spec);
            let why = foreign(&existing, &wanted, RUN_UID)
                .unwrap_or_else(|| panic!("an Approval with another {field} was adopted"));
            assert_eq!(
                why,
                format!(
                    "it names this run as its controller, but its spec differs from what the run asks in {field}"
                )
            );
        }
    }

    /// A Signal is adopted on the same terms: the run's own, waiting for
    /// what the run waits for, from whom. One whose deadline, onTimeout,
    /// senders or separation differs (a planted one that never expires,
    /// skips, or takes a signal from anyone) is refused.
    #[test]
    fn only_the_runs_own_signal_is_adopted() {
        use super::not_this_runs_signal as foreign;
        let opened = || -> crate::api::Signal {
            serde_json::from_value(json!({
                "apiVersion": "agentrun.dev/v1alpha1", "kind": "Signal",
                "metadata": {
                    "name": "refund-settle-r1-signal",
                    "ownerReferences": [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                        "name": "refund", "uid": RUN_UID, "controller": true}],
                },
                "spec": {
                    "runName": "refund", "runUid": RUN_UID, "step": "settle", "planRevision": 1,
                    "expiresAt": "2030-01-01T00:00:00Z", "onTimeout": "Fail",
                },
            }))
            .unwrap()
        };
        let wanted = opened();
        let mut sent = opened();
        sent.spec.id = Some("pay-1".into());
        sent.spec.data = Some(json!({"amount": 12}));
        assert_eq!(
            foreign(&sent, &wanted, RUN_UID),
            None,
            "sent meanwhile: still the run's"
        );
        let mut other = opened();
        other.metadata.owner_references.as_mut().unwrap()[0].uid = "another".into();
        assert!(foreign(&other, &wanted, RUN_UID).is_some());
        let mut never = opened();
        never.spec.expires_at = None;
        assert_eq!(
            foreign(&never, &wanted, RUN_UID).as_deref(),
            Some(
                "it names this run as its controller, but its spec differs from what the run asks in expiresAt"
            )
        );
        let mut skips = opened();
        skips.spec.on_timeout = crate::api::SignalTimeout::Skip;
        assert!(foreign(&skips, &wanted, RUN_UID).is_some());

        // Who may send is part of what the run waits for: a Signal that lets
        // anyone send, or drops the separation, is not the run's.
        let mut guarded = wanted.clone();
        guarded.spec.senders = Some(crate::api::Senders {
            users: vec!["ci-bot".into()],
            ..Default::default()
        });
        guarded.spec.separate_from_requester = true;
        let mut open_to_all = guarded.clone();
        open_to_all.spec.senders = None;
        let mut unseparated = guarded.clone();
        unseparated.spec.separate_from_requester = false;
        for (planted, field) in [
            (open_to_all, "senders"),
            (unseparated, "separateFromRequester"),
        ] {
            assert_eq!(
                foreign(&planted, &guarded, RUN_UID),
                Some(format!(
                    "it names this run as its controller, but its spec differs from what the run asks in {field}"
                ))
            );
        }
    }
}
