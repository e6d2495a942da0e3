//! The run history around a decision (D18): what the history says of a run
//! not yet started, the record of a run that finished, stored before the
//! status names it, and the pruning of records past their retention.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Client, Resource};
use std::collections::BTreeSet;
use std::sync::Arc;
use tracing::{debug, warn};

use super::Context;
use super::clock::Clock;
use super::world::World;
use crate::api::{AgentRun, AgentRunStatus};
use crate::engine::{self, Reason};
use crate::history::{self, Pruned, Retention, Settings};
use crate::metrics::{Metrics, NamespaceLabel};

/// What the history says of `run` before its decision: a run not started is
/// looked up (by namespace and name: one indexed list); any other is `On`.
pub(super) async fn look_up(run: &AgentRun, now: Timestamp, ctx: &Context) -> engine::History {
    let Some(settings) = &ctx.history else {
        return engine::History::Off;
    };
    if !engine::needs_lookup(run) {
        return engine::History::On;
    }
    let (Some(ns), Some(name)) = (
        run.metadata.namespace.as_deref(),
        run.metadata.name.as_deref(),
    ) else {
        return engine::History::On;
    };
    match settings.store.find(ns, name).await {
        Ok(mut records) => {
            let mut prior = history::recognise(&records, run, now, &settings.retention);
            if prior.is_some() && settings.store.outlives_namespaces() {
                // Records kept outside the cluster may be of an earlier
                // namespace of this name, not yet removed: they are not this
                // run's history. Asked only when a record matched.
                if let Some(live) = this_namespace(ns, now, ctx).await {
                    records.retain(|r| !history::of_a_gone_namespace(r, &live));
                    prior = history::recognise(&records, run, now, &settings.retention);
                }
            }
            match prior {
                Some(prior) => engine::History::AlreadyRan(prior),
                None => engine::History::On,
            }
        }
        Err(err) => {
            warn!(run = name, error = %err, "the run history cannot be read");
            ctx.metrics.history_errors.inc();
            engine::History::Unavailable(err.to_string())
        }
    }
}

/// `ns` as the API server has it now, when the operator may read namespaces
/// (it watches all of them); `None` otherwise.
async fn this_namespace(
    ns: &str,
    now: Timestamp,
    ctx: &Context,
) -> Option<history::LiveNamespaces> {
    if !ctx.all_namespaces {
        return None;
    }
    let api = Api::<Namespace>::all(ctx.client.clone());
    match api.get_metadata(ns).await {
        Ok(meta) => {
            let created = meta.metadata.creation_timestamp?.0;
            Some(history::LiveNamespaces {
                listed_at: now,
                created: [(ns.to_owned(), created)].into(),
            })
        }
        Err(err) => {
            warn!(namespace = ns, error = %err, "cannot read the run's namespace to check its history");
            None
        }
    }
}

/// Before the status write that says `status` (or after one that said it
/// finished without a record): stores the run's record and names it in the
/// status, so no status names a record that is not stored and the TTL
/// (which waits for `status.record`) never deletes an unrecorded run. A
/// store that fails leaves the status without it; the engine looks again.
pub(super) async fn record(
    run: &AgentRun,
    status: &mut AgentRunStatus,
    world: &World,
    ctx: &Context,
) {
    let Some(settings) = &ctx.history else {
        return;
    };
    if status.record.is_some() || !status.phase.is_some_and(|p| p.is_finished()) {
        return;
    }
    let record = history::build(run, status, &world.approvals, &world.signals);
    match settings.store.put(&record).await {
        Ok(name) => {
            debug!(record = %name, store = settings.store.kind(), "recorded the finished run");
            super::failpoints::hit("after-record");
            ctx.metrics.history_records.inc();
            status.record = Some(name);
        }
        Err(err) => {
            warn!(error = %err, "could not store the finished run's record");
            ctx.metrics.history_errors.inc();
            ctx.events.publish(
                Event {
                    type_: EventType::Warning,
                    reason: Reason::RecordFailed.into(),
                    note: Some(format!(
                        "the run's record could not be stored ({err}); its TTL waits until it is"
                    )),
                    action: "Record".into(),
                    secondary: None,
                },
                run.object_ref(&()),
            );
        }
    }
}

/// Says which namespaces hold more records inside the retention than
/// `--history-max-per-namespace`: a warning each pruning, and the gauge
/// `agentrun_history_records_over_cap`. Nothing is removed for it (D22).
/// `reported`: the namespaces the gauge has a series for; one no longer
/// past the cap loses its series (the others are set in place, never
/// cleared first, so no scrape finds them missing).
fn report_over_cap(
    pruned: &Pruned,
    keep: &Retention,
    metrics: &Metrics,
    reported: &mut BTreeSet<String>,
) {
    for gone in reported
        .iter()
        .filter(|ns| !pruned.over_cap.contains_key(*ns))
    {
        metrics.history_over_cap.remove(&NamespaceLabel {
            namespace: gone.clone(),
        });
    }
    *reported = pruned.over_cap.keys().cloned().collect();
    for (namespace, over) in &pruned.over_cap {
        warn!(
            namespace = %namespace,
            over = over,
            max_per_namespace = keep.max_per_namespace,
            "the namespace holds more run records inside the retention than --history-max-per-namespace; \
             none is removed before its retention ends"
        );
        let label = NamespaceLabel {
            namespace: namespace.clone(),
        };
        metrics
            .history_over_cap
            .get_or_create(&label)
            .set(i64::try_from(*over).unwrap_or(i64::MAX));
    }
}

/// Removes records past the retention once the caches are synced, then
/// every `prune_every`, and, from a store that outlives namespaces, the
/// records of namespaces that are gone (`namespaces`: the client that may
/// list them, when the operator watches all namespaces). Runs where the
/// controller runs: on the leader.
pub(super) async fn prune_now_and_then(
    settings: Settings,
    clock: Clock,
    namespaces: Option<Client>,
    metrics: Arc<Metrics>,
    mut synced: tokio::sync::watch::Receiver<u8>,
) {
    if synced.wait_for(|m| *m == super::SYNCED_ALL).await.is_err() {
        return;
    }
    let namespaces = namespaces.filter(|_| settings.store.outlives_namespaces());
    let mut refused = false;
    let mut reported = BTreeSet::new();
    loop {
        match settings.store.prune(clock.now(), &settings.retention).await {
            Ok(pruned) => report_over_cap(&pruned, &settings.retention, &metrics, &mut reported),
            Err(err) => {
                warn!(error = %err, "pruning the run history failed; trying again later");
            }
        }
        if let Some(client) = &namespaces {
            match history::live_namespaces(client, clock.now()).await {
                Ok(live) => {
                    if let Err(err) = settings.store.forget_gone_namespaces(&live).await {
                        warn!(error = %err, "removing the records of deleted namespaces failed; trying again later");
                    }
                }
                Err(kube::Error::Api(s)) if s.code == 403 && !refused => {
                    refused = true;
                    warn!(
                        error = %s.message,
                        "cannot list namespaces: records of deleted namespaces stay until the retention removes them"
                    );
                }
                Err(err) => {
                    debug!(error = %err, "listing namespaces for the run history failed");
                }
            }
        }
        tokio::time::sleep(settings.prune_every).await;
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;

    /// The gauge's series, sorted (a family keeps no order).
    fn scrape(registry: &Registry) -> Vec<String> {
        let mut body = String::new();
        prometheus_client::encoding::text::encode(&mut body, registry).unwrap();
        let mut series: Vec<String> = body
            .lines()
            .filter(|l| l.starts_with("agentrun_history_records_over_cap{"))
            .map(str::to_owned)
            .collect();
        series.sort();
        series
    }

    /// The gauge follows each pruning: a namespace past the cap has its
    /// count, one back under it loses its series, and one still past it
    /// keeps its series throughout (it is set in place, never cleared).
    #[test]
    fn the_over_cap_gauge_follows_each_pruning() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let keep = Retention::default();
        let mut reported = BTreeSet::new();
        let mut pruned = Pruned::default();
        pruned.note_over_cap("team-a", 3);
        pruned.note_over_cap("team-b", 1);
        pruned.note_over_cap("team-c", 0);
        report_over_cap(&pruned, &keep, &metrics, &mut reported);
        assert_eq!(
            scrape(&registry),
            [
                r#"agentrun_history_records_over_cap{namespace="team-a"} 3"#,
                r#"agentrun_history_records_over_cap{namespace="team-b"} 1"#,
            ]
        );
        let mut next = Pruned::default();
        next.note_over_cap("team-a", 5);
        report_over_cap(&next, &keep, &metrics, &mut reported);
        assert_eq!(
            scrape(&registry),
            [r#"agentrun_history_records_over_cap{namespace="team-a"} 5"#]
        );
        report_over_cap(&Pruned::default(), &keep, &metrics, &mut reported);
        assert!(scrape(&registry).is_empty());
    }
}
