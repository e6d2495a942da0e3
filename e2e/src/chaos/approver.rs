//! The scripted approver: answers every open Approval as a person would,
//! after 0–800 ms of thought.
//!
//! - `Approve` (a gate, a step asked about again after it changed, or a
//!   repeat of a step that acted at an earlier plan revision): `Approved`, or
//!   `Rejected` for about one in ten (by a hash of the name).
//! - `Reconcile` (a NonIdempotent attempt may have acted): once no execution
//!   of the key is still running in the ledger, `MarkSucceeded` if one
//!   succeeded, else `Retry` — what a person checking the external system
//!   with the idempotency key would answer.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrun_operator::api::{Approval, ApprovalKind};
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use super::{Shared, lock};
use crate::ledger::Ledger;

fn hash_of(seed: u64, s: &str) -> u64 {
    let mut h = DefaultHasher::new();
    (seed, s).hash(&mut h);
    h.finish()
}

/// Answers the namespace's open Approvals until aborted.
pub(super) async fn approve(
    approvals: Api<Approval>,
    ledger_path: std::path::PathBuf,
    shared: Arc<Shared>,
    seed: u64,
) {
    let mut first_seen: BTreeMap<String, Instant> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let Ok(list) = approvals.list(&ListParams::default()).await else {
            continue;
        };
        let mut ledger: Option<Ledger> = None;
        for a in list.items {
            if a.spec.decision.is_some() {
                continue;
            }
            let name = a.name_any();
            let seen = *first_seen.entry(name.clone()).or_insert_with(Instant::now);
            let think = Duration::from_millis(hash_of(seed, &name) % 800);
            if seen.elapsed() < think {
                continue;
            }
            let (decision, comment) = match a.spec.kind {
                ApprovalKind::Approve => {
                    if hash_of(seed ^ 0xA5, &name).is_multiple_of(10) {
                        ("Rejected", "chaos approver: rejected".to_owned())
                    } else {
                        ("Approved", "chaos approver: approved".to_owned())
                    }
                }
                ApprovalKind::Reconcile => {
                    let key = a
                        .spec
                        .context
                        .as_ref()
                        .and_then(|c| c.idempotency_key.clone())
                        .unwrap_or_default();
                    let l = ledger
                        .get_or_insert_with(|| Ledger::read(&ledger_path).unwrap_or_default());
                    let started = l.executions().filter(|e| e.key() == key).count();
                    let finished = l.finishes().filter(|e| e.key() == key).count();
                    if started > finished && seen.elapsed() < Duration::from_secs(10) {
                        continue; // an execution is still running: look again later
                    }
                    if l.successes_by_key().get(&key).copied().unwrap_or(0) > 0 {
                        (
                            "MarkSucceeded",
                            format!("chaos approver: the ledger shows key {key} succeeded"),
                        )
                    } else {
                        (
                            "Retry",
                            format!("chaos approver: the ledger shows no success for key {key}"),
                        )
                    }
                }
            };
            let patch = json!({"spec": {"decision": decision, "comment": comment}});
            match approvals
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    *lock(&shared.approvals_answered) += 1;
                    info!(approval = %name, decision, "answered");
                }
                Err(err) => warn!(approval = %name, error = %err, "answering failed"),
            }
        }
    }
}
