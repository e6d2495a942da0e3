//! The driver's own watches on a batch's namespace: when it first saw each
//! step Pod, saw it Succeeded, and saw each run finish; and the hand-offs
//! those instants give.
//!
//! ```text
//!   Pods (label agentrun.dev/run) ──watch──▶ Seen.pods     (every peer)
//!   a peer's runs (AgentRun, Workflow, …) ──▶ Seen.finished (Watch::finish_on, or the peer's own task)
//! ```

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use agentrun_operator::api::RunPhase;
use agentrun_operator::labels;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::error::{BenchError, Res};
use crate::plane::step_name;

#[derive(Clone, Debug, Default)]
pub struct PodSeen {
    pub run: String,
    pub step: String,
    pub attempt: String,
    pub first_seen: Option<Instant>,
    pub succeeded_seen: Option<Instant>,
}

#[derive(Default)]
pub struct Seen {
    pub pods: HashMap<String, PodSeen>,
    /// Run name → when it was first seen terminal, and its phase.
    pub finished: HashMap<String, (Instant, RunPhase)>,
}

pub type Shared = Arc<Mutex<Seen>>;

fn lock(s: &Shared) -> MutexGuard<'_, Seen> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// The watch tasks of one batch and what they have seen so far.
pub struct Watch {
    seen: Shared,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Watch {
    /// Watches the namespace's step Pods, recording when this driver first
    /// saw each Pod and saw it Succeeded.
    pub fn pods(client: &Client, ns: &str) -> Watch {
        let seen: Shared = Arc::default();
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let s = seen.clone();
        let task = tokio::spawn(async move {
            let stream = watcher(pods, watcher::Config::default().labels(labels::RUN))
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                let Ok(pod) = ev else { continue };
                let now = Instant::now();
                let succeeded =
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded");
                let mut g = lock(&s);
                let e = g.pods.entry(pod.name_any()).or_insert_with(|| {
                    let l = pod.labels();
                    let get = |k: &str| l.get(k).cloned().unwrap_or_default();
                    PodSeen {
                        run: get(labels::RUN),
                        step: get(labels::STEP),
                        attempt: get(labels::ATTEMPT),
                        first_seen: Some(now),
                        succeeded_seen: None,
                    }
                });
                if succeeded && e.succeeded_seen.is_none() {
                    e.succeeded_seen = Some(now);
                }
            }
        });
        Watch {
            seen,
            tasks: vec![task],
        }
    }

    /// Also watches a peer's runs: one is finished, under its name, the first
    /// time `outcome` gives its terminal phase.
    pub fn finish_on<K>(
        &mut self,
        api: Api<K>,
        outcome: impl Fn(&K) -> Option<RunPhase> + Send + 'static,
    ) where
        K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    {
        let seen = self.seen.clone();
        self.spawn(async move {
            let stream = watcher(api, watcher::Config::default())
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                let Ok(obj) = ev else { continue };
                if let Some(p) = outcome(&obj) {
                    finish(&seen, &obj.name_any(), p);
                }
            }
        });
    }

    /// Runs a peer's own task (a chain driver) with the watch, stopped with it.
    pub fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.push(tokio::spawn(task));
    }

    /// A handle for a peer's task to record finished runs with ([`finish`]).
    pub fn shared(&self) -> Shared {
        self.seen.clone()
    }

    /// What has been seen so far.
    pub fn seen(&self) -> MutexGuard<'_, Seen> {
        lock(&self.seen)
    }

    /// Polls `cond` on the observations every 20 ms until it holds or `deadline` passes.
    pub async fn wait(
        &self,
        what: &str,
        deadline: Duration,
        cond: impl Fn(&Seen) -> Option<String>,
    ) -> Res<Instant> {
        let start = Instant::now();
        loop {
            let progress = cond(&self.seen());
            match progress {
                None => return Ok(Instant::now()),
                Some(p) if start.elapsed() > deadline => {
                    return Err(BenchError::Stage(format!(
                        "aborted: {what} not reached within {deadline:?} ({p})"
                    )));
                }
                Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Stops the watch tasks and takes what they saw.
    pub fn stop(self) -> Seen {
        for t in &self.tasks {
            t.abort();
        }
        std::mem::take(&mut *lock(&self.seen))
    }
}

/// Records run `name` finished with phase `p`, unless it already was.
pub fn finish(seen: &Shared, name: &str, p: RunPhase) {
    lock(seen)
        .finished
        .entry(name.to_owned())
        .or_insert((Instant::now(), p));
}

impl Seen {
    /// Step Pods seen Succeeded.
    pub fn succeeded(&self) -> usize {
        self.pods
            .values()
            .filter(|p| p.succeeded_seen.is_some())
            .count()
    }

    /// Seconds from `t0` until the last run was seen finished (0 when none was).
    pub fn last_finished_after(&self, t0: Instant) -> f64 {
        let last = self.finished.values().map(|(t, _)| *t).max().unwrap_or(t0);
        last.saturating_duration_since(t0).as_secs_f64()
    }

    /// The first attempt of each step (a retry would have attempt > 1), by run and step.
    pub fn first_attempts(&self) -> HashMap<&str, HashMap<&str, &PodSeen>> {
        let mut by_run: HashMap<&str, HashMap<&str, &PodSeen>> = HashMap::new();
        for p in self.pods.values() {
            let slot = by_run
                .entry(p.run.as_str())
                .or_default()
                .entry(p.step.as_str())
                .or_insert(p);
            if p.first_seen < slot.first_seen {
                *slot = p;
            }
        }
        by_run
    }
}

/// One run's hand-offs in step order: for each step i ≥ 1, (first sight of
/// step i's Pod) − (sight of step i−1's Pod Succeeded), in ms.
pub fn run_handoffs(steps_of: &HashMap<&str, &PodSeen>, steps: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for i in 1..steps {
        let (Some(prev), Some(next)) = (
            steps_of.get(step_name(i - 1).as_str()),
            steps_of.get(step_name(i).as_str()),
        ) else {
            continue;
        };
        if let (Some(done), Some(created)) = (prev.succeeded_seen, next.first_seen) {
            out.push(created.saturating_duration_since(done).as_secs_f64() * 1000.0);
        }
    }
    out
}

/// Every run's hand-offs, sorted.
pub fn handoffs(seen: &Seen, steps: usize) -> Vec<f64> {
    let mut out: Vec<f64> = seen
        .first_attempts()
        .values()
        .flat_map(|steps_of| run_handoffs(steps_of, steps))
        .collect();
    out.sort_by(f64::total_cmp);
    out
}
