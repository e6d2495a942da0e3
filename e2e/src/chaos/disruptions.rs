//! Pod disruptions done by the driver: bulk evictions and deletes of random
//! step Pods, and the repeated evictions of the steps the workload marks
//! (`StepPlan::evictions`): each new Pod of such a step is evicted as soon as
//! it is seen, before it starts (its Pods stay Pending a second), until the
//! step has lost its share. The operator must back off and say `Stalled`,
//! and the run must still finish once the evictions stop. Every disrupted
//! Pod's key is recorded: a Reconcile question about it is expected (D6).
//!
//! ```text
//!   every 3–8 s   evict 1–6 / delete 1–3 random step Pods holding agentrun.dev/result
//!   every 250 ms  evict the newest Pod of each marked step that still owes evictions
//! ```

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, EvictParams, ListParams};
use kube::{Api, ResourceExt};
use tracing::info;

use super::rng::Rng;
use super::workload::RunPlan;
use super::{Shared, lock};

/// Evicts (or deletes) up to `max` random step Pods that still hold their
/// result finalizer, recording their keys. Returns how many were accepted.
pub(super) async fn disrupt(
    pods: &Api<Pod>,
    shared: &Shared,
    rng: &mut Rng,
    max: usize,
    evict: bool,
) -> u64 {
    let Ok(list) = pods.list(&ListParams::default().labels(labels::RUN)).await else {
        return 0;
    };
    let mut candidates: Vec<Pod> = list
        .items
        .into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER)
        })
        .collect();
    let mut done = 0;
    let n = rng.range(1, max as u64) as usize;
    let running = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    for _ in 0..n.min(candidates.len()) {
        // Mostly Pods whose step is running (where a disruption matters most),
        // sometimes a Pending one or one whose result is not yet committed.
        let running_ix: Vec<usize> = (0..candidates.len())
            .filter(|i| running(&candidates[*i]))
            .collect();
        let ix = if !running_ix.is_empty() && rng.chance(0.8) {
            *rng.pick(&running_ix)
        } else {
            rng.below(candidates.len() as u64) as usize
        };
        let pod = candidates.swap_remove(ix);
        let name = pod.name_any();
        let result = if evict {
            pods.evict(&name, &EvictParams::default()).await.map(|_| ())
        } else {
            pods.delete(&name, &DeleteParams::default())
                .await
                .map(|_| ())
        };
        match result {
            Ok(()) => {
                done += 1;
                if let Some(key) = pod.annotations().get(labels::IDEMPOTENCY_KEY) {
                    lock(&shared.disrupted_keys).insert(key.clone());
                }
                info!(pod = %name, evict, "disrupted step pod");
            }
            Err(err) => info!(pod = %name, error = %err, "disrupting a pod failed"),
        }
    }
    done
}

/// The steps whose Pods are evicted one after another.
pub(super) struct Hound {
    /// (run, step) → evictions still owed.
    owed: BTreeMap<(String, String), u32>,
    /// Pods already evicted (an evicted Pod lingers until its finalizer goes).
    evicted: Vec<String>,
    next: Instant,
}

impl Hound {
    pub fn new(plans: &[RunPlan]) -> Hound {
        let owed = plans
            .iter()
            .flat_map(|p| {
                p.steps
                    .iter()
                    .filter(|s| s.evictions > 0)
                    .map(|s| ((p.name.clone(), s.name.clone()), s.evictions))
            })
            .collect();
        Hound {
            owed,
            evicted: Vec::new(),
            next: Instant::now(),
        }
    }

    /// Evicts the Pods of marked steps that are due; returns how many the API
    /// server accepted.
    pub async fn tick(&mut self, pods: &Api<Pod>, shared: &Shared) -> u64 {
        if self.owed.is_empty() || Instant::now() < self.next {
            return 0;
        }
        self.next = Instant::now() + Duration::from_millis(250);
        let Ok(list) = pods.list(&ListParams::default().labels(labels::RUN)).await else {
            return 0;
        };
        let mut done = 0;
        for pod in list.items {
            let name = pod.name_any();
            let of = |l: &str| pod.labels().get(l).cloned().unwrap_or_default();
            let step = (of(labels::RUN), of(labels::STEP));
            let role = of(labels::ROLE);
            if pod.metadata.deletion_timestamp.is_some()
                || (!role.is_empty() && role != "step")
                || self.evicted.contains(&name)
            {
                continue;
            }
            let Some(owed) = self.owed.get_mut(&step) else {
                continue;
            };
            match pods.evict(&name, &EvictParams::default()).await {
                Ok(_) => {
                    done += 1;
                    *owed -= 1;
                    if *owed == 0 {
                        self.owed.remove(&step);
                    }
                    if let Some(key) = pod.annotations().get(labels::IDEMPOTENCY_KEY) {
                        lock(&shared.disrupted_keys).insert(key.clone());
                    }
                    info!(pod = %name, "evicted again (repeated evictions of one step)");
                    self.evicted.push(name);
                }
                Err(err) => info!(pod = %name, error = %err, "evicting a pod failed"),
            }
        }
        done
    }
}
