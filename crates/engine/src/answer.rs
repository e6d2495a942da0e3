//! One durable answer (D10, D15): the rules every object a run waits on for
//! an outside party's answer shares — an Approval's decision, a Signal's id
//! and data. Each kind adds only its own rules on top (votes and quorum; id
//! and data); what is written here holds for all of them:
//!
//! - **The API server's order** ([`standing`]): an answer counts if the API
//!   server stored it before the deadline (the time of the managedFields
//!   entry that owns the answer field); where that record says nothing, only
//!   while the deadline has not passed (fail closed). An expiry takes effect
//!   once written to the object's status under its resourceVersion, after
//!   which the API server refuses an answer.
//! - **Who answered** ([`answered_by`]): the user the admission policy
//!   recorded, or on a cluster without it the answer field's writer.
//! - **Whose it is** ([`not_this_runs`]): an object found under the name the
//!   run asks for is the run's only if the run is its controller and it was
//!   opened for what the run waits on now; the controller adopts nothing else.
//! - **How it is opened** ([`owned_meta`]): labelled with its run and step,
//!   owned by the run.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    ManagedFieldsEntry, ObjectMeta, OwnerReference,
};

use agentrun_api::labels;
use agentrun_api::{DurableAnswer, Opened};

use super::observe::not_the_runs;

/// Where an answer stands, in the API server's order.
#[derive(Clone, Debug, PartialEq)]
pub enum Standing<A> {
    /// Not answered, and the deadline (if any) not passed.
    Pending { expires_at: Option<Timestamp> },
    /// Answered in time.
    Answered(A),
    /// The deadline passed without an answer in time: `late` is one the API
    /// server stored after it, and when (or `now`, where its time is unknown).
    Expiring { late: Option<(A, Timestamp)> },
}

/// The API server's order of an answer and a deadline. `answer`: the answer,
/// if any, and when the API server stored it, if its record says.
pub fn standing<A>(
    deadline: Option<Timestamp>,
    answer: Option<(A, Option<Timestamp>)>,
    now: Timestamp,
) -> Standing<A> {
    if let Some((answer, at)) = answer {
        // Where the API server's record of when says nothing (a client
        // cleared managedFields), an answer is known to be in time only if
        // the deadline has not passed yet: past it, it counts as late.
        return match (deadline, at) {
            (Some(deadline), Some(at)) if at > deadline => Standing::Expiring {
                late: Some((answer, at)),
            },
            (Some(deadline), None) if now > deadline => Standing::Expiring {
                late: Some((answer, now)),
            },
            _ => Standing::Answered(answer),
        };
    }
    match deadline {
        Some(at) if at <= now => Standing::Expiring { late: None },
        expires_at => Standing::Pending { expires_at },
    }
}

/// The managedFields entries that own `spec.<field>` (`f:decision`): who
/// wrote it, and when the API server stored it.
pub fn field_owners<'m>(
    meta: &'m ObjectMeta,
    field: &'m str,
) -> impl Iterator<Item = &'m ManagedFieldsEntry> + 'm {
    meta.managed_fields.iter().flatten().filter(move |m| {
        m.fields_v1
            .as_ref()
            .and_then(|f| f.0.get("f:spec")?.get(field))
            .is_some()
    })
}

/// When the API server stored the answer: the time of the managedFields
/// entry that owns its field. A later write by the same manager moves that
/// time later, never earlier, so an answer is never taken for earlier than
/// it was.
pub fn answered_at<K: DurableAnswer>(object: &K) -> Option<Timestamp> {
    field_owners(object.meta(), K::ANSWER_FIELD)
        .next()?
        .time
        .as_ref()
        .map(|t| t.0)
}

/// Who answered: `recorded` (the user the API server recorded through the
/// admission policy), or on a cluster without the policies the field
/// manager that wrote the answer field.
pub fn answered_by<K: DurableAnswer>(object: &K, recorded: Option<&String>) -> Option<String> {
    recorded.cloned().or_else(|| {
        field_owners(object.meta(), K::ANSWER_FIELD)
            .next()?
            .manager
            .clone()
    })
}

/// The deadline that orders `object`'s answer.
pub fn deadline<K: DurableAnswer>(object: &K) -> Option<Timestamp> {
    object.deadline().map(|t| t.0)
}

/// The metadata of a durable answer the run opens: its name, labelled with
/// the run and the step, controlled by the run.
pub fn owned_meta(
    name: String,
    namespace: Option<String>,
    owner: OwnerReference,
    run_name: &str,
    step: &str,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace,
        labels: Some(
            [
                (labels::RUN.to_owned(), run_name.to_owned()),
                (labels::STEP.to_owned(), step.to_owned()),
            ]
            .into(),
        ),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    }
}

/// Why `existing`, found under the name of the object `wanted` that the run
/// asks for, is not that object; `None` when it is (the operator opened it
/// before and did not see it yet). Its controller must be this run, its
/// header ([`Opened`]) what the run asks now, and each of the kind's own
/// fields (`own`: name, differs) the same. Anything else stays in the way,
/// visibly (D16), and is never adopted.
pub fn not_this_runs<K: DurableAnswer>(
    existing: &K,
    wanted: &K,
    run_uid: &str,
    own: impl IntoIterator<Item = (&'static str, bool)>,
) -> Option<String> {
    let (e, w): (Opened, Opened) = (existing.opened(), wanted.opened());
    let header = [
        ("runUid", e.run_uid != w.run_uid),
        ("runName", e.run_name != w.run_name),
        ("step", e.step != w.step),
        ("planRevision", e.plan_revision != w.plan_revision),
        ("expiresAt", e.expires_at != w.expires_at),
        ("requestedBy", e.requested_by != w.requested_by),
        (
            "separateFromRequester",
            e.separate_from_requester != w.separate_from_requester,
        ),
    ];
    not_the_runs(
        existing
            .meta()
            .owner_references
            .as_deref()
            .unwrap_or_default(),
        run_uid,
        header.into_iter().chain(own),
    )
}
