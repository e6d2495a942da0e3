//! The first round after a start (or a take-over): every run the operator
//! found gets its next step before the work that starts nothing.
//!
//! ```text
//!   start ─▶ caches synced ─▶ round 1: each run of the initial list reconciled once
//!                               │  status write, next Pod        ── now
//!                               │  release of the ended Pod's finalizer, StepStarted /
//!                               │  StepSucceeded Events           ── held (Lane)
//!                               ▼
//!            every run reconciled once (or ROUND_LIMIT) ─▶ the held work, 8 at a time
//! ```
//!
//! Nothing is dropped and nothing is added: a release held here is sent once
//! the round ends, and one lost with the process is derived again by the
//! next decision of its run (the engine releases every Pod its status
//! accounts for, D5); the Events are the ones `--step-events` publishes,
//! shed like any other when the API server cannot keep up. What moves is
//! when: 1,000 resumed runs share two cores with their own releases and
//! Events otherwise (docs/performance-history.md, "Resume after a SIGKILL").

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::runtime::events::Event;
use kube::runtime::reflector::ObjectRef;
use tracing::{debug, info};

use super::Context;
use super::RunRef;

/// The round ends after this long whatever is left of it (a run that fails
/// every reconcile, a run deleted before its turn).
const ROUND_LIMIT: Duration = Duration::from_secs(60);
/// Held releases sent at once after the round.
const CONCURRENT: usize = 8;

/// The first round and the work held behind it.
#[derive(Default)]
pub(super) struct Lane {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Before the first reconcile of this process: not known yet.
    began: Option<Instant>,
    /// Runs of the initial list not reconciled yet; empty once the round is over.
    waiting: HashSet<RunRef>,
    over: bool,
    /// Finalizer releases held, by (namespace, Pod), with the cached Pod.
    releases: BTreeMap<(String, String), Option<Pod>>,
    events: Vec<(Event, ObjectReference)>,
}

/// What the release of a held Pod reads of it (its finalizers, whether it
/// ended: `apply::release_finalizer`), and nothing else: a thousand resumed
/// runs hold a thousand of these.
fn sketch(pod: &Pod) -> Pod {
    Pod {
        metadata: ObjectMeta {
            finalizers: pod.metadata.finalizers.clone(),
            ..ObjectMeta::default()
        },
        status: pod.status.as_ref().map(|s| PodStatus {
            phase: s.phase.clone(),
            ..PodStatus::default()
        }),
        ..Pod::default()
    }
}

/// What the round held, sent when it ends.
struct Held {
    runs: usize,
    took: Duration,
    releases: BTreeMap<(String, String), Option<Pod>>,
    events: Vec<(Event, ObjectReference)>,
}

impl Lane {
    /// The round begins with the runs in the cache once it is synced; the
    /// first reconcile calls this, the others find it begun.
    pub(super) fn begin(self: &Arc<Self>, ctx: &Arc<Context>) {
        let mut state = self.lock();
        if state.began.is_some() {
            return;
        }
        state.began = Some(Instant::now());
        state.waiting = ctx
            .runs
            .state()
            .iter()
            .map(|r| ObjectRef::from_obj(&**r))
            .collect();
        state.over = state.waiting.is_empty();
        let runs = state.waiting.len();
        drop(state);
        debug!(runs, "first round begins");
        let (lane, ctx) = (self.clone(), ctx.clone());
        tokio::spawn(async move {
            tokio::time::sleep(ROUND_LIMIT).await;
            lane.end(&ctx, "its time limit");
        });
    }

    /// `run` was reconciled (whatever came of it).
    pub(super) fn reconciled(&self, ctx: &Arc<Context>, run: &RunRef) {
        let mut state = self.lock();
        if state.over || !state.waiting.remove(run) || !state.waiting.is_empty() {
            return;
        }
        drop(state);
        self.end(ctx, "every run it found reconciled once");
    }

    /// Holds the release of `pod`'s result finalizer while the round is on;
    /// false when it is over (release now).
    pub(super) fn hold_release(&self, namespace: &str, pod: &str, cached: Option<&Pod>) -> bool {
        let mut state = self.lock();
        if !Self::on(&state) {
            return false;
        }
        state
            .releases
            .insert((namespace.to_owned(), pod.to_owned()), cached.map(sketch));
        true
    }

    /// Holds a routine Event while the round is on; gives it back when the
    /// round is over (publish it now).
    pub(super) fn hold_event(
        &self,
        event: Event,
        regarding: ObjectReference,
    ) -> Option<(Event, ObjectReference)> {
        let mut state = self.lock();
        if !Self::on(&state) {
            return Some((event, regarding));
        }
        state.events.push((event, regarding));
        None
    }

    fn on(state: &State) -> bool {
        state.began.is_some() && !state.over
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the round (once) and sends what it held.
    fn end(&self, ctx: &Arc<Context>, why: &str) {
        let held = {
            let mut state = self.lock();
            if state.over {
                return;
            }
            state.over = true;
            let left = state.waiting.len();
            state.waiting.clear();
            Held {
                runs: left,
                took: state.began.map_or(Duration::ZERO, |t| t.elapsed()),
                releases: std::mem::take(&mut state.releases),
                events: std::mem::take(&mut state.events),
            }
        };
        info!(
            after = ?held.took,
            runs_not_reached = held.runs,
            releases = held.releases.len(),
            events = held.events.len(),
            "first round over ({why}): sending the finalizer releases and Events held behind it"
        );
        ctx.metrics
            .held_behind_starts("release", held.releases.len());
        ctx.metrics.held_behind_starts("event", held.events.len());
        for (event, regarding) in held.events {
            ctx.events.publish(event, regarding);
        }
        let ctx = ctx.clone();
        tokio::spawn(async move {
            futures::stream::iter(held.releases)
                .for_each_concurrent(CONCURRENT, |((ns, pod), cached)| {
                    let ctx = ctx.clone();
                    async move {
                        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
                        match super::apply::release_finalizer(&pods, cached.as_ref(), &pod).await {
                            Ok(Some(released)) => ctx.expectations.released(released, &ctx.pods),
                            Ok(None) => {}
                            // The next decision of its run releases it again (D5).
                            Err(err) => debug!(%pod, error = %err, "a held release failed"),
                        }
                    }
                })
                .await;
        });
    }
}
