//! The operators of a chaos run: one, or two with leader election, each
//! behind the fault proxy, and the faults done to them as processes.
//!
//! ```text
//!   slot 0 ─ agentrun-operator --leader-elect --identity <ns>-op0 ┐
//!   slot 1 ─ agentrun-operator --leader-elect --identity <ns>-op1 ┴─ Lease agentrun-operator (in <ns>)
//!            AGENTRUN_CLOCK_SKEW=<skew>: its clock runs that far off (failpoints builds)
//!
//!   kill      SIGKILL (mostly the leader), restarted 0–1.5 s later
//!   pause     SIGSTOP the lease holder past its lease duration; once the standby
//!             holds the lease, SIGCONT: the old leader must act on nothing from its
//!             stale cache and step down (it exits; it is restarted as a standby)
//!   failpoint some starts get AGENTRUN_FAILPOINT=after-status-write:<n>: the process
//!             aborts right after its n-th status write (counted when it does); every
//!             restart is armed until one has aborted there, then a share of them
//! ```

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tracing::{info, warn};

use super::rng::Rng;
use crate::support::processes::{OperatorConfig, Process, free_port, start_operator};

/// The Lease the operator elects its leader with (`--lease-name` default).
pub const LEASE_NAME: &str = "agentrun-operator";

/// How far off a failpoints build of the operator runs its clock.
pub const CLOCK_SKEW_ENV: &str = "AGENTRUN_CLOCK_SKEW";

/// What happened to the operators, counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OperatorCounts {
    /// SIGKILLs sent by the driver.
    pub kills: u64,
    /// Lease holders paused past their lease.
    pub paused_leaders: u64,
    /// Pauses during which the lease went to the other operator.
    pub takeovers: u64,
    /// Processes that aborted at `after-status-write:<n>`.
    pub failpoint_crashes: u64,
    /// Starts armed with that failpoint.
    pub failpoints_armed: u64,
    /// Processes that exited by themselves otherwise (a deposed leader steps down).
    pub self_exits: u64,
}

struct Slot {
    cfg: OperatorConfig,
    process: Option<Process>,
    restart_at: Option<Instant>,
    armed: bool,
}

/// A paused lease holder.
struct Pause {
    slot: usize,
    resume_at: Instant,
}

/// The operator processes of one chaos run.
pub struct Operators {
    slots: Vec<Slot>,
    leader_elect: bool,
    leases: Api<Lease>,
    failpoint_rate: f64,
    failpoint_writes: (u64, u64),
    pause: Option<Pause>,
    pub counts: OperatorCounts,
}

impl Operators {
    /// `count` operators (two or more elect a leader) configured from `base`,
    /// all started; with two or more, the second runs its clock `clock_skew`
    /// off (`AGENTRUN_CLOCK_SKEW`, e.g. `+20s`), every time it is started.
    pub fn start(
        base: &OperatorConfig,
        count: usize,
        leases: Api<Lease>,
        failpoint_rate: f64,
        failpoint_writes: (u64, u64),
        clock_skew: Option<&str>,
    ) -> Operators {
        let leader_elect = count > 1;
        let slots = (0..count)
            .map(|i| {
                let mut cfg = base.clone();
                cfg.leader_elect = leader_elect;
                if leader_elect {
                    cfg.identity = format!("{}-op{i}", base.namespace);
                    cfg.metrics_port = free_port();
                    cfg.health_port = free_port();
                }
                if let Some(skew) = clock_skew.filter(|_| leader_elect && i == 1) {
                    cfg.extra_env
                        .push((CLOCK_SKEW_ENV.to_owned(), skew.to_owned()));
                }
                Slot {
                    cfg,
                    process: None,
                    restart_at: None,
                    armed: false,
                }
            })
            .collect();
        let mut ops = Operators {
            slots,
            leader_elect,
            leases,
            failpoint_rate,
            failpoint_writes,
            pause: None,
            counts: OperatorCounts::default(),
        };
        for i in 0..count {
            // The first start of each is plain, so the run begins with a leader.
            ops.launch(i, None);
        }
        ops
    }

    fn launch(&mut self, i: usize, failpoint: Option<String>) {
        let slot = &mut self.slots[i];
        let mut cfg = slot.cfg.clone();
        slot.armed = failpoint.is_some();
        if failpoint.is_some() {
            self.counts.failpoints_armed += 1;
        }
        cfg.failpoint = failpoint;
        info!(identity = %cfg.identity, failpoint = ?cfg.failpoint, "starting operator");
        slot.process = Some(start_operator(&cfg));
        slot.restart_at = None;
    }

    /// Restarts what is due, and notices operators that exited by themselves.
    pub fn tick(&mut self, rng: &mut Rng, faults_on: bool) {
        let now = Instant::now();
        for i in 0..self.slots.len() {
            let exited = self.slots[i].process.as_mut().and_then(Process::try_exited);
            if let Some(status) = exited {
                let slot = &mut self.slots[i];
                slot.process = None;
                if status.signal() == Some(6) && slot.armed {
                    self.counts.failpoint_crashes += 1;
                    info!(identity = %slot.cfg.identity, "operator aborted at its failpoint");
                } else {
                    self.counts.self_exits += 1;
                    info!(identity = %slot.cfg.identity, %status, "operator exited by itself");
                }
                slot.restart_at =
                    Some(now + rng.duration(Duration::ZERO, Duration::from_millis(1500)));
            }
            let slot = &self.slots[i];
            if slot.process.is_none() && slot.restart_at.is_some_and(|at| now >= at) {
                // Every start is armed until one process has aborted at its
                // failpoint, so a run whose work ends early still has one.
                let rate = if self.counts.failpoint_crashes == 0 {
                    1.0
                } else {
                    self.failpoint_rate
                };
                let failpoint = (faults_on && rng.chance(rate)).then(|| {
                    format!(
                        "after-status-write:{}",
                        rng.range(self.failpoint_writes.0, self.failpoint_writes.1)
                    )
                });
                self.launch(i, failpoint);
            }
        }
    }

    /// No operator is down: start every missing one now, without failpoints
    /// (the settle phase).
    pub fn start_missing(&mut self) {
        for i in 0..self.slots.len() {
            if self.slots[i].process.is_none() {
                self.launch(i, None);
            }
        }
    }

    /// The slot whose process holds the Lease, if it is running (not paused).
    async fn leader(&self) -> Option<usize> {
        if !self.leader_elect {
            return self.slots[0].process.as_ref().map(|_| 0);
        }
        let holder = self.holder().await?;
        self.slots
            .iter()
            .position(|s| s.cfg.identity == holder && s.process.is_some())
    }

    async fn holder(&self) -> Option<String> {
        let lease = self.leases.get_opt(LEASE_NAME).await.ok().flatten()?;
        lease.spec?.holder_identity
    }

    /// Whether a leader is paused right now.
    pub fn pausing(&self) -> bool {
        self.pause.is_some()
    }

    /// SIGKILLs an operator: the leader when it can be told (four times in
    /// five), else any running one. Not while a leader is paused.
    pub async fn kill_one(&mut self, rng: &mut Rng) -> bool {
        if self.pause.is_some() {
            return false;
        }
        let running: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].process.is_some())
            .collect();
        if running.is_empty() {
            return false;
        }
        let leader = self.leader().await;
        let i = match leader {
            Some(l) if rng.chance(0.8) => l,
            _ => *rng.pick(&running),
        };
        let slot = &mut self.slots[i];
        if let Some(mut p) = slot.process.take() {
            p.kill().await;
        }
        slot.restart_at =
            Some(Instant::now() + rng.duration(Duration::ZERO, Duration::from_millis(1500)));
        self.counts.kills += 1;
        info!(identity = %slot.cfg.identity, kills = self.counts.kills, "operator killed");
        true
    }

    /// SIGSTOPs the lease holder for `hold` (more than its lease duration);
    /// only with leader election and a standby running.
    pub async fn pause_leader(&mut self, hold: Duration) -> bool {
        if !self.leader_elect || self.pause.is_some() {
            return false;
        }
        let standby_up = self.slots.iter().filter(|s| s.process.is_some()).count() >= 2;
        let Some(i) = self.leader().await.filter(|_| standby_up) else {
            return false;
        };
        let slot = &self.slots[i];
        let Some(p) = slot.process.as_ref() else {
            return false;
        };
        if !p.pause() {
            warn!(identity = %slot.cfg.identity, "SIGSTOP failed");
            return false;
        }
        self.counts.paused_leaders += 1;
        info!(identity = %slot.cfg.identity, ?hold, "leader paused (SIGSTOP)");
        self.pause = Some(Pause {
            slot: i,
            resume_at: Instant::now() + hold,
        });
        true
    }

    /// SIGCONTs a paused leader once its time is up (or at once with `now`),
    /// noting whether the standby took the lease meanwhile.
    pub async fn resume_due(&mut self, force: bool) {
        let Some(pause) = self.pause.as_ref() else {
            return;
        };
        if !force && Instant::now() < pause.resume_at {
            return;
        }
        let i = pause.slot;
        self.pause = None;
        let holder = self.holder().await;
        let slot = &self.slots[i];
        if holder.as_deref().is_some_and(|h| h != slot.cfg.identity) {
            self.counts.takeovers += 1;
        }
        if let Some(p) = slot.process.as_ref() {
            p.resume();
        }
        info!(identity = %slot.cfg.identity, new_holder = ?holder, "paused leader resumed (SIGCONT)");
    }

    /// Stops every operator (SIGKILL; a paused one is resumed first).
    pub async fn stop(&mut self) {
        self.resume_due(true).await;
        for slot in &mut self.slots {
            if let Some(mut p) = slot.process.take() {
                p.kill().await;
            }
        }
    }
}
