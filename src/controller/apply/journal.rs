//! The journal's two writes (D19): the RoleBinding that lets a journaled
//! step's ServiceAccount write its journal, made before its Pod, and the
//! settlement of a call that may have acted, in the status of the chunk
//! that holds it.
//!
//! ```text
//!   RoleBinding agentrun-journal-writer-<sa> (run's namespace) ──▶ ClusterRole <journal-writer-role>
//!   StepJournal <prefix><n> /status ◀── settlements[] += {seq, outcome, response, by, at}
//! ```

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::info;

use crate::api::{Settlement, StepJournal};
use crate::controller::Context;
use crate::labels;

/// The RoleBinding's name for a ServiceAccount.
fn binding_name(service_account: &str) -> String {
    format!("agentrun-journal-writer-{service_account}")
}

/// Whether `pod` is a journaled step's (it mounts the journal token).
pub(super) fn is_journaled(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.env.as_ref())
        .is_some_and(|env| env.iter().any(|e| e.name == labels::env::JOURNAL))
}

/// Binds the journaled Pod's ServiceAccount to the journal-writer role in
/// its namespace (server-side apply: the same binding every time), once
/// per ServiceAccount and process.
pub(super) async fn bind_writer(ctx: &Context, ns: &str, pod: &Pod) -> Result<(), kube::Error> {
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".to_owned());
    let key = (ns.to_owned(), sa.clone());
    if ctx
        .journal_writers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&key)
    {
        return Ok(());
    }
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some(binding_name(&sa)),
            namespace: Some(ns.to_owned()),
            labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "agentrun-operator".to_owned(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "ClusterRole".to_owned(),
            name: ctx.journal_writer_role.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: sa.clone(),
            namespace: Some(ns.to_owned()),
            api_group: None,
        }]),
    };
    let api: Api<RoleBinding> = Api::namespaced(ctx.client.clone(), ns);
    let pp = PatchParams::apply(labels::FIELD_MANAGER).force();
    api.patch(&binding_name(&sa), &pp, &Patch::Apply(&binding))
        .await?;
    info!(namespace = %ns, service_account = %sa, role = %ctx.journal_writer_role, "bound a journaled step's ServiceAccount to the journal-writer role");
    ctx.journal_writers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key);
    Ok(())
}

/// Adds `settlement` to the chunk's status unless a settlement of its call
/// is there already, under the chunk's resourceVersion: a concurrent write
/// makes it fail, and the next decision tries again.
pub(super) async fn settle(
    api: &Api<StepJournal>,
    chunk: &str,
    settlement: &Settlement,
) -> Result<(), kube::Error> {
    // The chunk itself (its status comes with it): the chart grants the
    // operator `get` on stepjournals, and `patch` on their status only.
    let current = api.get(chunk).await?;
    let mut settlements = current
        .status
        .as_ref()
        .map(|s| s.settlements.clone())
        .unwrap_or_default();
    if settlements
        .iter()
        .any(|s| (s.seq, s.attempt) == (settlement.seq, settlement.attempt))
    {
        return Ok(());
    }
    settlements.push(settlement.clone());
    let patch = json!({
        "metadata": {"resourceVersion": current.resource_version()},
        "status": {"settlements": settlements},
    });
    api.patch_status(chunk, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    info!(chunk = %chunk, seq = settlement.seq, outcome = ?settlement.outcome, by = %settlement.by, "settled a journaled call");
    Ok(())
}
