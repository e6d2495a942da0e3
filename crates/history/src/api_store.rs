//! The default store: one `RunRecord` per finished run, in the run's
//! namespace, through the API server. Nothing new to run; the namespace's
//! deletion takes its records along; RBAC decides who reads them.
//!
//! Records are labelled with the run's name (`agentrun.dev/run`, a run name
//! is at most 63 characters), so the records of one name are one indexed
//! list, and annotated with when the run finished
//! (`agentrun.dev/completed-at`), so pruning lists metadata only and counts
//! from what the PostgreSQL store counts from: that time, but never later
//! than the record's `creationTimestamp` (the API server's clock when it was
//! stored). Only the operator writes records (the chart's admission policy);
//! one whose name is not [`record_name`] of the run it names is not listed.

use jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use std::collections::BTreeMap;
use tracing::{debug, info};

use super::{
    Error, Pruned, Query, Retention, as_stored_by_the_operator, finished_for_retention,
    record_name, to_prune,
};
use agentrun_api::labels;
use agentrun_api::{RunRecord, RunRecordSpec};

/// Records whose metadata one list request of the pruning asks for. A
/// record's metadata is mostly its managedFields, ~8 KB for a run of 10
/// steps, so listing a thousand records in one response held ~8 MiB at once
/// (docs/performance-history.md, "Where the memory goes").
const PRUNE_PAGE: u32 = 100;

/// RunRecords through the API server.
#[derive(Clone)]
pub struct ApiStore {
    client: Client,
    /// The one namespace the operator watches, if it watches one.
    namespace: Option<String>,
    /// Records listed per request when pruning.
    page: u32,
}

impl ApiStore {
    /// Records in every namespace, or in `namespace` only (an operator
    /// scoped to one namespace has no rights elsewhere).
    pub fn new(client: Client, namespace: Option<String>) -> Self {
        ApiStore {
            client,
            namespace,
            page: PRUNE_PAGE,
        }
    }

    /// Lists `page` records per request when pruning (100 unless set), so
    /// the pruning holds one page of metadata at a time.
    pub fn listing_pages_of(self, page: u32) -> Self {
        ApiStore {
            page: page.max(1),
            ..self
        }
    }

    /// Every record this store may see.
    fn all(&self) -> Api<RunRecord> {
        match &self.namespace {
            Some(ns) => self.api(ns),
            None => Api::all(self.client.clone()),
        }
    }

    fn api(&self, namespace: &str) -> Api<RunRecord> {
        Api::namespaced(self.client.clone(), namespace)
    }

    pub(super) async fn put(&self, record: &RunRecordSpec) -> Result<String, Error> {
        let name = record_name(&record.run.name, &record.run.uid);
        let api = self.api(&record.run.namespace);
        let object = RunRecord {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(record.run.namespace.clone()),
                labels: Some(BTreeMap::from([(
                    labels::RUN.to_owned(),
                    record.run.name.clone(),
                )])),
                annotations: Some(BTreeMap::from([(
                    labels::COMPLETED_AT.to_owned(),
                    record
                        .outcome
                        .completed_at
                        .0
                        .strftime("%Y-%m-%dT%H:%M:%SZ")
                        .to_string(),
                )])),
                ..ObjectMeta::default()
            },
            spec: record.clone(),
        };
        let pp = PostParams {
            field_manager: Some(labels::FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        match api.create(&pp, &object).await {
            Ok(_) => return Ok(name),
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(err) => return Err(err.into()),
        }
        let existing = api.get(&name).await?;
        if existing.spec.run.uid != record.run.uid {
            return Err(Error::NameTaken {
                name,
                held_by: existing.spec.run.uid,
            });
        }
        if existing.spec == *record {
            return Ok(name);
        }
        // Written by a decision that met a conflict before its status named
        // the record: what the status is about to say replaces it.
        debug!(record = %name, "replacing a record no status named yet");
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: existing.uid(),
                resource_version: existing.resource_version(),
            }),
            ..DeleteParams::default()
        };
        api.delete(&name, &dp).await?;
        api.create(&pp, &object).await?;
        Ok(name)
    }

    pub(super) async fn list(&self, q: &Query) -> Result<Vec<RunRecordSpec>, Error> {
        let api: Api<RunRecord> = match &q.namespace {
            Some(ns) => self.api(ns),
            None => self.all(),
        };
        let lp = match &q.run {
            Some(run) => ListParams::default().labels(&format!("{}={run}", labels::RUN)),
            None => ListParams::default(),
        };
        let records = api
            .list(&lp)
            .await?
            .items
            .into_iter()
            .filter_map(|r| as_stored_by_the_operator(&r.name_any(), r.spec))
            .collect();
        Ok(q.arrange(records))
    }

    pub(super) async fn get(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<RunRecordSpec>, Error> {
        let found = self.api(namespace).get_opt(name).await?;
        Ok(found.and_then(|r| as_stored_by_the_operator(name, r.spec)))
    }

    pub(super) async fn prune(&self, now: Timestamp, keep: &Retention) -> Result<Pruned, Error> {
        let mut by_namespace: BTreeMap<String, Vec<(String, Timestamp, Option<String>)>> =
            BTreeMap::new();
        // One page at a time: only what pruning reads of each record is kept.
        let mut lp = ListParams::default().limit(self.page);
        loop {
            let listed = self.all().list_metadata(&lp).await?;
            for m in listed.items {
                let (Some(ns), Some(name)) = (m.metadata.namespace, m.metadata.name) else {
                    continue;
                };
                // When the run finished, as the operator annotated it; a
                // record written before the annotation was: when it was
                // written. Never later than that: a record claiming a future
                // finish still leaves when its window, counted from then, ends.
                let recorded = m
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(labels::COMPLETED_AT))
                    .and_then(|t| t.parse::<Timestamp>().ok());
                let stored = m.metadata.creation_timestamp.as_ref().map(|t| t.0);
                let finished = finished_for_retention(recorded, stored, now);
                by_namespace
                    .entry(ns)
                    .or_default()
                    .push((name, finished, m.metadata.uid));
            }
            match listed.metadata.continue_ {
                Some(token) if !token.is_empty() => lp = lp.continue_token(&token),
                _ => break,
            }
        }
        let mut pruned = Pruned::default();
        for (ns, records) in by_namespace {
            let uids: BTreeMap<String, Option<String>> = records
                .iter()
                .map(|(n, _, u)| (n.clone(), u.clone()))
                .collect();
            let (expired, over) = to_prune(
                records.into_iter().map(|(n, t, _)| (n, t)).collect(),
                now,
                keep,
            );
            pruned.note_over_cap(&ns, over);
            let api = self.api(&ns);
            for name in expired {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: uids.get(&name).cloned().flatten(),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                match api.delete(&name, &dp).await {
                    Ok(_) => pruned.expired += 1,
                    Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                    Err(err) => return Err(err.into()),
                }
            }
        }
        if pruned.expired > 0 {
            info!(
                expired = pruned.expired,
                "removed run records past their retention"
            );
        }
        Ok(pruned)
    }
}
