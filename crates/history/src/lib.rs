//! History that outlives the TTL, and a re-sync that is not a re-run (D18).
//!
//! ```text
//!   run finishes ──▶ record stored ──▶ status.record set ──▶ TTL may delete the run
//!                    (before the status says so: a crash in between writes it again)
//!   run created  ──▶ records of (namespace, name) ──▶ same spec, same rerun token,
//!                    within the window?  yes: phase AlreadyRan, nothing runs
//!                                        no:  the run starts (its spec digest noted)
//! ```
//!
//! One interface, [`Store`], two stores: RunRecord objects through the API
//! server ([`api_store`], the default: nothing new to run), and PostgreSQL
//! for teams that keep months of history. Both answer the same questions
//! with the same filter ([`Query::admits`]), and the same tests run on both.
//! Only the operator writes records (the chart's admission policy, D22), each
//! under the name it gives it ([`record_name`]); a record under another name
//! is not read as history. What is kept, and for how long: [`retention`].

pub mod api_store;
pub mod postgres;
pub mod retention;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;

use agentrun_api::labels;
use agentrun_api::{
    AgentRun, AgentRunStatus, AlreadyRan, Approval, RecordedApproval, RecordedOutcome, RecordedRun,
    RecordedSignal, RecordedStep, RunPhase, RunRecordSpec, Signal,
};
use agentrun_engine::ConditionType;

pub use agentrun_api::{MAX_SPEC_DIGESTS, spec_digest};
pub use api_store::ApiStore;
pub use postgres::PgStore;
pub use retention::{Pruned, Retention, finished_for_retention, to_prune};

/// Most of each list a record keeps (steps, approvals, signals): a run's
/// status holds at most 520 checkpoints, so this bounds nothing a run can
/// reach, and keeps a record under 200 KiB.
const MAX_LISTED: usize = 600;

/// Why the history could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the API server: {0}")]
    Api(#[from] kube::Error),
    #[error("PostgreSQL: {0}")]
    Database(String),
    #[error("record {name} is held by another run's record (run UID {held_by})")]
    NameTaken { name: String, held_by: String },
    #[error("{0}")]
    Invalid(String),
}

/// Which records to list. Every store filters with [`Query::admits`] (the
/// database also in SQL), so both answer the same.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Query {
    /// `None`: every namespace.
    pub namespace: Option<String>,
    pub run: Option<String>,
    pub outcome: Option<RunPhase>,
    pub requested_by: Option<String>,
    /// Finished at or after.
    pub since: Option<Timestamp>,
    /// Finished before.
    pub until: Option<Timestamp>,
    /// Most records returned, newest first.
    pub limit: Option<usize>,
}

impl Query {
    pub fn admits(&self, r: &RunRecordSpec) -> bool {
        let done = r.outcome.completed_at.0;
        self.namespace
            .as_ref()
            .is_none_or(|n| *n == r.run.namespace)
            && self.run.as_ref().is_none_or(|n| *n == r.run.name)
            && self.outcome.is_none_or(|p| p == r.outcome.phase)
            && self
                .requested_by
                .as_ref()
                .is_none_or(|u| Some(u) == r.run.requested_by.as_ref())
            && self.since.is_none_or(|t| done >= t)
            && self.until.is_none_or(|t| done < t)
    }

    /// Newest first, at most `limit`.
    pub fn arrange(&self, mut records: Vec<RunRecordSpec>) -> Vec<RunRecordSpec> {
        records.retain(|r| self.admits(r));
        records.sort_by(|a, b| {
            b.outcome
                .completed_at
                .0
                .cmp(&a.outcome.completed_at.0)
                .then_with(|| a.run.name.cmp(&b.run.name))
        });
        if let Some(n) = self.limit {
            records.truncate(n);
        }
        records
    }
}

/// The history as the operator keeps it (`--history-store`, `--history-retention`,
/// `--history-max-per-namespace`).
#[derive(Clone)]
pub struct Settings {
    pub store: std::sync::Arc<Store>,
    pub retention: Retention,
    /// How often records past the retention are removed.
    pub prune_every: std::time::Duration,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("store", &self.store.kind())
            .field("retention", &self.retention)
            .field("prune_every", &self.prune_every)
            .finish()
    }
}

/// The namespaces that exist, as the operator listed them: each one's
/// creation time, and when the list was taken (the API server's clock).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveNamespaces {
    pub listed_at: Timestamp,
    pub created: std::collections::BTreeMap<String, Timestamp>,
}

/// Whether `r` is the record of a namespace that is gone: no namespace of
/// its name was listed and its run finished before the list was taken (a
/// namespace made after the list holds only runs that finish later), or the
/// namespace of that name was made after the run was (it is another
/// namespace, made again under the same name). Such a record is no run's
/// history any more: with RunRecords the namespace took it along.
pub fn of_a_gone_namespace(r: &RunRecordSpec, live: &LiveNamespaces) -> bool {
    match live.created.get(&r.run.namespace) {
        Some(created) => r.run.created_at.0 < *created,
        None => r.outcome.completed_at.0 < live.listed_at,
    }
}

/// Every namespace and when it was made, listed (metadata only) after
/// `listed_at`: a namespace made after that time holds no record the list
/// could call gone.
pub async fn live_namespaces(
    client: &kube::Client,
    listed_at: Timestamp,
) -> Result<LiveNamespaces, kube::Error> {
    let list = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .list_metadata(&kube::api::ListParams::default())
        .await?;
    let created = list
        .items
        .into_iter()
        .filter_map(|n| Some((n.metadata.name?, n.metadata.creation_timestamp?.0)))
        .collect();
    Ok(LiveNamespaces { listed_at, created })
}

/// Where records are kept.
pub enum Store {
    /// RunRecord objects through the API server.
    Api(ApiStore),
    /// Rows of one PostgreSQL table.
    Postgres(Box<PgStore>),
}

impl Store {
    /// What the store is, for logs and `status.record`'s readers.
    pub fn kind(&self) -> &'static str {
        match self {
            Store::Api(_) => "RunRecord",
            Store::Postgres(_) => "PostgreSQL",
        }
    }

    /// Stores `record` under [`record_name`], once: a record already there
    /// for the same run stands if it says the same, and is replaced if not
    /// (a decision made again after a conflict, before any status named it).
    pub async fn put(&self, record: &RunRecordSpec) -> Result<String, Error> {
        match self {
            Store::Api(s) => s.put(record).await,
            Store::Postgres(s) => s.put(record).await,
        }
    }

    /// The records of runs named `run` in `namespace`, newest first.
    pub async fn find(&self, namespace: &str, run: &str) -> Result<Vec<RunRecordSpec>, Error> {
        let q = Query {
            namespace: Some(namespace.to_owned()),
            run: Some(run.to_owned()),
            ..Query::default()
        };
        self.list(&q).await
    }

    pub async fn list(&self, q: &Query) -> Result<Vec<RunRecordSpec>, Error> {
        match self {
            Store::Api(s) => s.list(q).await,
            Store::Postgres(s) => s.list(q).await,
        }
    }

    pub async fn get(&self, namespace: &str, name: &str) -> Result<Option<RunRecordSpec>, Error> {
        match self {
            Store::Api(s) => s.get(namespace, name).await,
            Store::Postgres(s) => s.get(namespace, name).await,
        }
    }

    /// Whether records outlive their namespace here, so the operator must
    /// remove them ([`Store::forget_gone_namespaces`]); RunRecords go with it.
    pub fn outlives_namespaces(&self) -> bool {
        matches!(self, Store::Postgres(_))
    }

    /// Removes the records of namespaces that are gone
    /// ([`of_a_gone_namespace`]); how many.
    pub async fn forget_gone_namespaces(&self, live: &LiveNamespaces) -> Result<u64, Error> {
        match self {
            Store::Api(_) => Ok(0),
            Store::Postgres(s) => s.forget_gone_namespaces(live).await,
        }
    }

    /// Removes records past the window, and counts, per namespace, those
    /// inside it beyond the count a namespace is expected to hold (kept).
    pub async fn prune(&self, now: Timestamp, keep: &Retention) -> Result<Pruned, Error> {
        match self {
            Store::Api(s) => s.prune(now, keep).await,
            Store::Postgres(s) => s.prune(now, keep).await,
        }
    }
}

/// The record of `run` in its namespace: `<run>-<first 8 of its UID>`, so
/// two runs of one name never share one.
pub fn record_name(run: &str, uid: &str) -> String {
    let tag: String = uid.chars().filter(|c| *c != '-').take(8).collect();
    format!("{run}-{tag}")
}

/// The record stored under `name`, if `name` is the one the operator gives
/// the record of the run it names ([`record_name`]). A record under another
/// name was not written by the operator (planted before the admission
/// policy kept records the operator's, copied by an administrator): it is
/// no run's history, and never makes a run `AlreadyRan`.
pub fn as_stored_by_the_operator(name: &str, record: RunRecordSpec) -> Option<RunRecordSpec> {
    if name == record_name(&record.run.name, &record.run.uid) {
        return Some(record);
    }
    tracing::warn!(
        record = name,
        run = %record.run.name,
        "ignoring a run record whose name is not the one the operator gives that run's record"
    );
    None
}

/// The run's `agentrun.dev/rerun` annotation: running a manifest again on
/// purpose names a new value.
pub fn rerun_of(run: &AgentRun) -> Option<String> {
    run.metadata
        .annotations
        .as_ref()?
        .get(labels::RERUN)
        .filter(|v| !v.is_empty())
        .cloned()
}

/// Whether `run` (created, not started) is the run `record` recorded,
/// created again: same namespace and name, another UID, a spec it ran (any
/// version of it), the same rerun token, finished within the window.
pub fn is_recreation(
    record: &RunRecordSpec,
    run: &AgentRun,
    digest: &str,
    now: Timestamp,
    keep: &Retention,
) -> bool {
    let horizon = keep.horizon(now);
    record.run.namespace == run.metadata.namespace.as_deref().unwrap_or_default()
        && record.run.name == run.metadata.name.as_deref().unwrap_or_default()
        && record.run.uid != run.metadata.uid.as_deref().unwrap_or_default()
        && record.run.spec_digests.iter().any(|d| d == digest)
        && record.run.rerun == rerun_of(run)
        && record.outcome.completed_at.0 >= horizon
}

/// The newest record `run` is a re-creation of, as the run's status names it.
pub fn recognise(
    records: &[RunRecordSpec],
    run: &AgentRun,
    now: Timestamp,
    keep: &Retention,
) -> Option<AlreadyRan> {
    let digest = spec_digest(&run.spec);
    records
        .iter()
        .filter(|r| is_recreation(r, run, &digest, now, keep))
        .max_by_key(|r| r.outcome.completed_at.0)
        .map(|r| AlreadyRan {
            record: record_name(&r.run.name, &r.run.uid),
            run_uid: r.run.uid.clone(),
            outcome: word(&r.outcome.phase),
            completed_at: r.outcome.completed_at.clone(),
        })
}

/// An enum as the word it serializes to.
fn word<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The record of `run`, finished with `status` (the status about to be
/// written), with the decisions on its Approvals and the Signals it got.
pub fn build(
    run: &AgentRun,
    status: &AgentRunStatus,
    approvals: &[Approval],
    signals: &[Signal],
) -> RunRecordSpec {
    let meta = &run.metadata;
    let mut digests = status.spec_digests.clone();
    let now = spec_digest(&run.spec);
    if !digests.contains(&now) {
        digests.push(now);
    }
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Succeeded.as_str());
    let completed_at = status
        .completed_at
        .clone()
        .unwrap_or_else(|| Time(Timestamp::now()));
    let step = |c: &agentrun_api::StepCheckpoint| RecordedStep {
        name: c.name.clone(),
        role: c.role,
        plan_revision: c.plan_revision,
        attempt: c.attempt,
        phase: c.phase,
        effect: c.effect,
        idempotency_key: c.idempotency_key.clone(),
        provenance: c.provenance,
        tokens: c.tokens.map_or(0, |t| t.total()),
        started_at: c.started_at.clone(),
        finished_at: c.finished_at.clone(),
        decided_by: c.decided_by.clone(),
        journal: c.journal.as_deref().map(|j| agentrun_api::RecordedJournal {
            calls: j.calls,
            settled: j.settled,
        }),
    };
    let mut approvals: Vec<&Approval> = approvals.iter().collect();
    approvals.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut signals: Vec<&Signal> = signals.iter().collect();
    signals.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    RunRecordSpec {
        run: RecordedRun {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            spec_digests: digests,
            rerun: rerun_of(run),
            requested_by: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(labels::REQUESTED_BY))
                .cloned(),
            forked_from: run.spec.fork_of.as_ref().map(|f| f.run_name.clone()),
            created_at: meta
                .creation_timestamp
                .clone()
                .unwrap_or_else(|| completed_at.clone()),
        },
        outcome: RecordedOutcome {
            phase: status.phase.unwrap_or(RunPhase::Failed),
            reason: ready.map(|c| c.reason.clone()).filter(|r| !r.is_empty()),
            message: ready
                .map(|c| cut(&c.message, 1024))
                .filter(|m| !m.is_empty()),
            started_at: status.started_at.clone(),
            completed_at,
            duration: status.duration.clone(),
            tokens_used: status.tokens_used,
            step_executions: status.step_executions,
            plan_revision: status.plan.as_ref().map_or(0, |p| p.revision),
        },
        steps: status.steps.iter().take(MAX_LISTED).map(step).collect(),
        compensations: status
            .compensations
            .iter()
            .take(MAX_LISTED)
            .map(|c| RecordedStep {
                name: c.name.clone(),
                role: agentrun_api::StepRole::Step,
                plan_revision: c.plan_revision,
                attempt: c.attempt,
                phase: c.phase,
                effect: None,
                idempotency_key: c.idempotency_key.clone(),
                provenance: None,
                tokens: 0,
                started_at: c.started_at.clone(),
                finished_at: c.finished_at.clone(),
                decided_by: None,
                journal: None,
            })
            .collect(),
        approvals: approvals
            .into_iter()
            .take(MAX_LISTED)
            .map(|a| {
                let st = a.status.as_ref();
                RecordedApproval {
                    name: a.metadata.name.clone().unwrap_or_default(),
                    step: a.spec.step.clone(),
                    plan_revision: a.spec.plan_revision,
                    kind: word(&a.spec.kind),
                    phase: st.map_or_else(|| "Pending".to_owned(), |s| word(&s.phase)),
                    decision: a.spec.decision.as_ref().map(word),
                    decided_by: st
                        .and_then(|s| s.decided_by.clone())
                        .or_else(|| a.spec.decided_by.clone()),
                    decided_at: st.and_then(|s| s.decided_at.clone()),
                    comment: a.spec.comment.as_deref().map(|c| cut(c, 1024)),
                    votes: a
                        .spec
                        .votes
                        .iter()
                        .map(|v| format!("{}={}", v.user, word(&v.decision)))
                        .collect(),
                    step_digest: a.spec.step_digest.clone(),
                }
            })
            .collect(),
        signals: signals
            .into_iter()
            .take(MAX_LISTED)
            .map(|s| RecordedSignal {
                name: s.metadata.name.clone().unwrap_or_default(),
                step: s.spec.step.clone(),
                phase: s
                    .status
                    .as_ref()
                    .map_or_else(|| "Waiting".to_owned(), |st| word(&st.phase)),
                id: s.spec.id.clone(),
                sent_by: s.spec.sent_by.clone(),
                recorded_at: s.status.as_ref().and_then(|st| st.recorded_at.clone()),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests;
