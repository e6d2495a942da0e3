//! Operator kills aimed at verify probes: while a probe's Pod runs, the
//! operator that launched it (mostly the leader) is SIGKILLed for about half
//! the probes. The restarted or standby operator must take the probe's
//! answer once — never launch a second probe beside it, never lose the
//! answer, never run the step again on an `Applied`.
//!
//! ```text
//!   every 250 ms   list Pods agentrun.dev/role=verify; for each newly Running one,
//!                  kill an operator: surely until the run's minimum of such kills is
//!                  reached, then with chance ½ (its own generator)
//! ```

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use tracing::info;

use super::operators::Operators;
use super::rng::Rng;

/// Aims operator kills at running probes.
pub(super) struct ProbeKiller {
    rng: Rng,
    /// Probe Pods already considered.
    seen: BTreeSet<String>,
    next: Instant,
    /// Kills that landed while a probe ran.
    pub kills: u64,
    /// The kills the run must see (`probe_kills_min`): a draw that skips
    /// every probe would leave the fault unproven.
    wanted: u64,
}

impl ProbeKiller {
    pub fn new(rng: Rng, wanted: u64) -> ProbeKiller {
        ProbeKiller {
            rng,
            seen: BTreeSet::new(),
            next: Instant::now(),
            kills: 0,
            wanted,
        }
    }

    /// Kills an operator if a probe Pod it has not yet considered runs and
    /// the minimum is not reached yet or its draw says so; nothing while `busy` (a pause or an apiserver
    /// restart is under way).
    pub async fn tick(&mut self, pods: &Api<Pod>, operators: &mut Operators, busy: bool) {
        if busy || Instant::now() < self.next {
            return;
        }
        self.next = Instant::now() + Duration::from_millis(250);
        let selector = format!("{}=verify", labels::ROLE);
        let Ok(list) = pods.list(&ListParams::default().labels(&selector)).await else {
            return;
        };
        for pod in list.items {
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            if !running || pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let name = pod.name_any();
            let owed = self.kills < self.wanted;
            if !self.seen.insert(name.clone()) || !(owed || self.rng.chance(0.5)) {
                continue;
            }
            if operators.kill_one(&mut self.rng).await {
                self.kills += 1;
                info!(probe = %name, kills = self.kills, "operator killed while a probe runs");
            }
            return; // one kill per tick: let the operators come back
        }
    }
}
