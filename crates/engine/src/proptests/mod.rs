//! Property tests: random plans under random interleavings of Pod events,
//! operator crashes, lagging caches, failed status writes, clock jumps and
//! human answers, against a simulated API server that guards status writes by
//! resourceVersion the way the real one does.
//!
//! ```text
//!   API server (World, + resourceVersion)      one operator process
//!   ┌──────────────────────────────┐   watch   ┌─────────────────────────────┐
//!   │ run (spec, status, rv)       │ ───lag──▶ │ run cache   (may be stale)   │
//!   │ Pods (finalizer, deletion)   │ ───lag──▶ │ Pod cache + own stand-ins    │──decide
//!   │ Approvals (rv-guarded status)│ ───lag──▶ │ Approval cache               │
//!   └──────────────────────────────┘           └─────────────────────────────┘
//!        ▲ status write (409 on a stale rv), quorum read before unfenced creates
//! ```
//!
//! The operator side follows `controller::reconcile` and `controller::apply`:
//! decide on the cached run; write the status under the resourceVersion that
//! decision was made on (a 409 re-reads the run and decides again); create
//! Pods or Approvals, or change an Approval's status, without a status write
//! only after a quorum read shows the run unchanged; apply creations first, then the rest; follow up on the written
//! object. A crash drops the process, and the one that starts may list runs,
//! Pods and Approvals as they were some time ago.
//!
//! Invariants are checked at every write and every applied action, against
//! what the API server holds and a ledger of what each Pod did (kept from the
//! cluster's side, not from the status the operator wrote); at the end the
//! world stops changing and the run must reach a terminal phase or a durable
//! wait.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateWaiting, ContainerStatus, Pod, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use proptest::prelude::*;

use super::observe;
use super::testing::*;
use super::{Action, Decision, Observed, PodRole, decide, idempotency_key};
use agentrun_api::labels;
use agentrun_api::{
    AgentRun, AgentRunStatus, Approval, ApprovalKind, CheckpointState, Decision as Answer, Effect,
    EffectOutcome, OnTimeout, RunPhase, Signal, StepCheckpoint, StepPhase, StepRole, StepSpec,
};

mod boundary;
mod checks;
mod cluster;
mod drive;
mod gaps;
mod plans;
mod reach;

use checks::check_status_transition;
use cluster::never_started;
use drive::run_events;
use plans::*;
use reach::Reach;

/// As in `controller::reconcile`.
const MAX_CONFLICTS: u32 = 5;
const MAX_FOLLOW_UPS: u32 = 3;
/// How long a stand-in for an own write is trusted (`Expectations::TTL`).
const STAND_IN_TTL: i64 = 30;
/// How far back a restarted operator's lists may reach, in versions.
const HISTORY: usize = 8;
/// The grace period of a user's `kubectl delete pod`.
const GRACE: i64 = 30;
/// `freshFor` of the steps that have one (`3m`), in seconds.
const FRESH_FOR: i64 = 180;

/// What one Pod (one incarnation, by UID) did, as the cluster saw it.
struct Execution {
    name: String,
    role: PodRole,
    key: String,
    step: String,
    plan_revision: i64,
    attempt: i32,
    /// A step Pod of a NonIdempotent step.
    non_idempotent: bool,
    /// Its container ran (or runs).
    started: bool,
    /// Which Pod creation this was (later incarnations of a name count up).
    seq: usize,
    /// Evicted, deleted by a user or force-removed while the API server held
    /// its attempt open: a disruption, not a failure (D6).
    interrupted: bool,
    /// Interrupted after it started, of a NonIdempotent step: it may have
    /// acted.
    disrupted: bool,
    /// Force-removed (finalizer and all).
    vanished: bool,
    /// A status the API server held recorded its UID.
    uid_recorded: bool,
    /// A decision that stood saw it as its attempt's Pod.
    seen_by_operator: bool,
    /// A committed decision closed its attempt and deleted its Pod (a
    /// timeout, a cancel): once started, it may have acted.
    closed_by_operator: bool,
    /// A step Pod of a step that acts (effect Idempotent or NonIdempotent).
    acts: bool,
    /// It ended on its own without saying it did not act: a non-zero exit
    /// without `"effect": "NotApplied"`, or an unreadable result.
    unreported_failure: bool,
    /// It succeeded with a readable result: it acted.
    succeeded: bool,
    /// Its message said `"effect": "NotApplied"` (a verify probe's answer too).
    said_not_applied: bool,
}

impl Execution {
    /// It may have acted (D6): it started and ended any way but a failure
    /// that said it did not act.
    fn may_have_acted(&self) -> bool {
        self.started
            && (self.succeeded
                || self.unreported_failure
                || self.interrupted
                || self.closed_by_operator
                || self.disrupted)
    }
}

/// An own Pod write standing in for the cache (`controller::expectations`).
struct StandIn {
    pod: Pod,
    at: Timestamp,
}

/// What one reconcile did.
struct Reconciled {
    /// The last decision made.
    last: Decision,
    /// Whether anything but Events was applied.
    acted: bool,
}

/// The API server, the history a lagging list can show, and one operator
/// process with its caches.
struct Sim {
    w: World,
    /// Every version of the run the API server held, newest last.
    run_versions: VecDeque<AgentRun>,
    /// The Pods and Approvals at the end of each of the last events.
    pod_lists: VecDeque<BTreeMap<String, Pod>>,
    approval_lists: VecDeque<BTreeMap<String, Approval>>,
    signal_lists: VecDeque<BTreeMap<String, Signal>>,
    run_cache: AgentRun,
    cache: BTreeMap<String, Pod>,
    approval_cache: BTreeMap<String, Approval>,
    signal_cache: BTreeMap<String, Signal>,
    stand_ins: BTreeMap<String, StandIn>,
    keys: HashMap<(String, String, i64), String>,
    /// By Pod UID.
    ledger: HashMap<String, Execution>,
    resource_version: u64,
    /// The process listed its Pods before the last changes to them and has
    /// not caught up since (a deposed leader resuming, a stale list).
    pods_behind: bool,
    /// The signal the API server took on each Signal, by name: the first
    /// sender's, as it stored it.
    sends: BTreeMap<String, Sent>,
    /// The Signals a committed write took as its step's result.
    consumed: BTreeSet<String>,
    /// A committed write held the run `Queued`.
    was_queued: bool,
    /// A committed write refused a result under its step's `resultSchema`.
    schema_refused: bool,
}

/// A signal the API server took.
#[derive(Clone, Debug)]
struct Sent {
    id: String,
    data: serde_json::Value,
    by: String,
    /// The API server's time when it stored it.
    at: Timestamp,
}

fn push_bounded<T>(q: &mut VecDeque<T>, v: T) {
    q.push_back(v);
    if q.len() > HISTORY {
        q.pop_front();
    }
}

/// The entry `lag` places from the back (0: `current`; the oldest kept
/// when `lag` reaches further).
fn lagging<T: Clone>(q: &VecDeque<T>, lag: usize, current: &T) -> T {
    match lag {
        0 => current.clone(),
        n => q[q.len().saturating_sub(n)].clone(),
    }
}

/// The steps `step` comes after, directly or not: the spec's `dependsOn`,
/// or every step before it when none names any (computed here, apart from
/// the engine's own graph).
fn ancestors(steps: &[StepSpec], step: &str) -> Vec<String> {
    let graph = steps.iter().any(|s| s.depends_on.is_some());
    let deps = |name: &str| -> Vec<String> {
        let i = steps.iter().position(|s| s.name == name).unwrap();
        if graph {
            steps[i]
                .depends_on
                .iter()
                .flat_map(|d| d.iter().cloned())
                .collect()
        } else {
            steps[..i]
                .last()
                .map(|s| vec![s.name.clone()])
                .unwrap_or_default()
        }
    };
    let mut out: Vec<String> = Vec::new();
    let mut stack = deps(step);
    while let Some(d) = stack.pop() {
        if !out.contains(&d) {
            stack.extend(deps(&d));
            out.push(d);
        }
    }
    out
}

fn uid(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

impl Sim {
    fn new(run: AgentRun) -> Sim {
        let mut w = World::new(run);
        w.run.metadata.resource_version = Some("1".into());
        Sim {
            run_versions: VecDeque::from([w.run.clone()]),
            pod_lists: VecDeque::from([BTreeMap::new()]),
            approval_lists: VecDeque::from([BTreeMap::new()]),
            signal_lists: VecDeque::from([BTreeMap::new()]),
            run_cache: w.run.clone(),
            cache: BTreeMap::new(),
            approval_cache: BTreeMap::new(),
            signal_cache: BTreeMap::new(),
            stand_ins: BTreeMap::new(),
            keys: HashMap::new(),
            ledger: HashMap::new(),
            resource_version: 1,
            pods_behind: false,
            sends: BTreeMap::new(),
            consumed: BTreeSet::new(),
            was_queued: false,
            schema_refused: false,
            w,
        }
    }

    /// The API server stores a change to the run: a new resourceVersion.
    fn bump_resource_version(&mut self) {
        self.resource_version += 1;
        self.w.run.metadata.resource_version = Some(self.resource_version.to_string());
        push_bounded(&mut self.run_versions, self.w.run.clone());
    }

    /// Remembers the Pods, Approvals and Signals as an event left them.
    fn remember(&mut self) {
        push_bounded(&mut self.pod_lists, self.w.pods.clone());
        push_bounded(&mut self.approval_lists, self.w.approvals.clone());
        push_bounded(&mut self.signal_lists, self.w.signals.clone());
    }

    /// A new process: caches listed with these lags, no stand-ins.
    fn restart(&mut self, lags: Lags) {
        // The newest of `run_versions` is the current run.
        self.run_cache = lagging(&self.run_versions, lags.run + 1, &self.w.run);
        self.cache = lagging(&self.pod_lists, lags.pods, &self.w.pods);
        self.approval_cache = lagging(&self.approval_lists, lags.approvals, &self.w.approvals);
        self.signal_cache = lagging(&self.signal_lists, lags.signals, &self.w.signals);
        self.stand_ins.clear();
        self.pods_behind = self.cache != self.w.pods;
    }

    fn sync_all(&mut self) {
        self.pods_behind = false;
        self.run_cache = self.w.run.clone();
        self.cache = self.w.pods.clone();
        self.approval_cache = self.w.approvals.clone();
        self.signal_cache = self.w.signals.clone();
        // Every event settles the stand-in of its Pod.
        self.stand_ins.clear();
    }

    fn sync_pod(&mut self, name: &str) {
        match self.w.pods.get(name) {
            Some(p) => self.cache.insert(name.to_owned(), p.clone()),
            None => self.cache.remove(name),
        };
        self.stand_ins.remove(name);
    }

    /// Time passes. The watch delivers a Pod within the time its stand-in
    /// is trusted: `Expectations::TTL` is chosen on that assumption, and a
    /// watch outage longer than that is outside this model.
    fn advance(&mut self, secs: i64) {
        self.w.advance(secs);
        let ttl = SignedDuration::from_secs(STAND_IN_TTL);
        let due: Vec<String> = self
            .stand_ins
            .iter()
            .filter(|(_, s)| self.w.now.duration_since(s.at) >= ttl)
            .map(|(n, _)| n.clone())
            .collect();
        for name in due {
            self.sync_pod(&name);
        }
    }

    fn decide_on(&self, run: &AgentRun) -> Decision {
        let mut pods: Vec<Pod> = self
            .cache
            .iter()
            .filter(|(name, _)| !self.stand_ins.contains_key(*name))
            .map(|(_, p)| p.clone())
            .collect();
        pods.extend(self.stand_ins.values().map(|s| s.pod.clone()));
        // A Pod the run names as running or stopping that this process's
        // view lacks is read from the API server (`reconcile::read_recorded_pods`).
        for (name, recorded) in super::referenced_pods(run, self.w.now) {
            if super::must_read(&pods, name, recorded) {
                pods.retain(|p| p.metadata.name.as_deref() != Some(name));
                pods.extend(self.w.pods.get(name).cloned());
            }
        }
        let approvals: Vec<Approval> = self.approval_cache.values().cloned().collect();
        let signals: Vec<Signal> = self.signal_cache.values().cloned().collect();
        decide(&Observed {
            run,
            pods: &pods,
            approvals: &approvals,
            signals: &signals,
            journals: &[],
            refused: &[],
            source: None,
            // The controller's word, even for a run that has started: the
            // engine never queues one again.
            queued: self.w.queued.clone(),
            history: crate::History::Off,
            now: self.w.now,
            cel: Default::default(),
        })
    }

    /// One reconcile, as `controller::reconcile` and `controller::apply` make it.
    fn reconcile(&mut self, fault: Option<WriteFault>, crash: Option<(usize, Lags)>) -> Reconciled {
        let mut fault = fault;
        let mut crash = crash;
        let mut current = self.run_cache.clone();
        let (mut conflicts, mut follow_ups) = (0, 0);
        let mut acted = false;
        loop {
            let d = self.decide_on(&current);
            let before = self.w.status();
            let mut written = false;
            if !current
                .status
                .as_ref()
                .map_or(d.status == AgentRunStatus::default(), |s| *s == d.status)
            {
                let fault = fault.take();
                if let Some(WriteFault::Lost) = fault {
                    return self.end(d, acted, crash);
                }
                if current.metadata.resource_version != self.w.run.metadata.resource_version {
                    // 409: re-read the run and decide again.
                    conflicts += 1;
                    if conflicts >= MAX_CONFLICTS {
                        return self.end(d, acted, crash);
                    }
                    current = self.w.run.clone();
                    continue;
                }
                check_status_transition(&before, &d.status);
                self.check_boundary(&before, &d.status);
                self.w.run.status = Some(d.status.clone());
                self.bump_resource_version();
                self.ledger_write(&before, &d);
                self.note_seen(&current);
                if let Some(WriteFault::Unacknowledged) = fault {
                    return self.end(d, acted, crash); // committed, but not acknowledged
                }
                current = self.w.run.clone();
                written = true;
            }
            if !written {
                self.note_seen(&current);
            }
            // As in `controller::apply`: effects on the world without a
            // status write are fenced by a quorum read of the run.
            let acts = d.actions.iter().any(|a| {
                matches!(
                    a,
                    Action::CreatePod(_)
                        | Action::CreateApproval(_)
                        | Action::SetApprovalStatus { .. }
                        | Action::CreateSignal(_)
                        | Action::SetSignalStatus { .. }
                )
            });
            if acts
                && !written
                && current.metadata.resource_version != self.w.run.metadata.resource_version
            {
                // The fence: a quorum read shows the run moved on; decide again.
                conflicts += 1;
                if conflicts >= MAX_CONFLICTS {
                    return self.end(d, acted, crash);
                }
                current = self.w.run.clone();
                continue;
            }
            let (creates, rest): (Vec<&Action>, Vec<&Action>) = d
                .actions
                .iter()
                .partition(|a| matches!(a, Action::CreatePod(_)));
            for a in creates.into_iter().chain(rest) {
                if let Some((n, lags)) = crash.as_mut() {
                    if *n == 0 {
                        let lags = *lags;
                        self.restart(lags);
                        return Reconciled { last: d, acted };
                    }
                    *n -= 1;
                }
                self.check_action(&before, a);
                self.apply(a);
                acted |= !matches!(a, Action::Event { .. });
                self.check_world();
            }
            let creates = d.actions.iter().any(|a| matches!(a, Action::CreatePod(_)));
            if (written || creates)
                && d.requeue_after == Some(SignedDuration::ZERO)
                && follow_ups < MAX_FOLLOW_UPS
            {
                follow_ups += 1;
                continue;
            }
            return self.end(d, acted, crash);
        }
    }

    /// What a committed write tells the ledger: Pods whose UID it records,
    /// and attempts it closes while deleting their Pods.
    fn ledger_write(&mut self, before: &AgentRunStatus, d: &Decision) {
        for c in &d.status.steps {
            if let Some(e) = c.pod_uid.as_ref().and_then(|u| self.ledger.get_mut(u)) {
                e.uid_recorded = true;
            }
        }
        for old in before
            .steps
            .iter()
            .filter(|c| c.phase == StepPhase::Running)
        {
            let still_open = d.status.steps.iter().any(|c| {
                c.idempotency_key == old.idempotency_key
                    && c.role == old.role
                    && c.attempt == old.attempt
                    && c.phase == StepPhase::Running
            });
            let deletes = d.actions.iter().any(
                |a| matches!(a, Action::DeletePod { name, .. } if Some(name) == old.pod.as_ref()),
            );
            if !still_open && deletes {
                for e in self.ledger.values_mut().filter(|e| {
                    e.key == old.idempotency_key
                        && e.attempt == old.attempt
                        && e.role == PodRole::from(old.role)
                }) {
                    e.closed_by_operator = true;
                }
            }
            // D6: a disruption does not consume the retry budget.
            let latest = self
                .ledger
                .values()
                .filter(|e| {
                    e.key == old.idempotency_key
                        && e.attempt == old.attempt
                        && e.role == PodRole::from(old.role)
                })
                .max_by_key(|e| e.seq);
            if let Some(e) = latest.filter(|e| !still_open && !deletes && e.interrupted) {
                let new = d
                    .status
                    .steps
                    .iter()
                    .find(|c| c.idempotency_key == old.idempotency_key && c.role == old.role);
                let failures = new.map_or(old.failures, |c| c.failures);
                assert_eq!(
                    failures,
                    old.failures,
                    "D6: Pod {} was disrupted (evicted, deleted or removed while attempt {} ran), yet the write counts a failure: {:?}",
                    e.name,
                    old.attempt,
                    new.and_then(|c| c.message.as_ref())
                );
            }
        }
    }

    /// A decision on `run` that stands (written, or nothing to write) saw
    /// the Pods its view holds of the attempts `run` has running.
    fn note_seen(&mut self, run: &AgentRun) {
        for c in run.status.iter().flat_map(|s| &s.steps) {
            let Some(name) = c.pod.as_ref().filter(|_| c.phase == StepPhase::Running) else {
                continue;
            };
            let seen = self
                .stand_ins
                .get(name)
                .map(|s| &s.pod)
                .or(self.cache.get(name))
                .map(uid);
            if let Some(e) = seen.and_then(|u| self.ledger.get_mut(&u)) {
                e.seen_by_operator = true;
            }
        }
    }

    /// A reconcile ends; a process bound to crash in it crashes now.
    fn end(&mut self, last: Decision, acted: bool, crash: Option<(usize, Lags)>) -> Reconciled {
        if let Some((_, lags)) = crash {
            self.restart(lags);
        }
        Reconciled { last, acted }
    }

    /// Applies one action to the API server, keeping the process's stand-ins
    /// and the ledger the way `controller::apply` and the cluster would.
    fn apply(&mut self, a: &Action) {
        match a {
            Action::CreatePod(pod) => {
                let name = pod.metadata.name.clone().unwrap();
                let existed = self.w.pods.contains_key(&name);
                self.w.apply(a);
                let created = self.w.pod(&name);
                if !existed {
                    let l = created.metadata.labels.as_ref().unwrap();
                    let role = PodRole::from_label(&l[labels::ROLE]).unwrap();
                    let step = l[labels::STEP].clone();
                    let effect = (role == PodRole::Step)
                        .then(|| {
                            self.w
                                .run
                                .spec
                                .steps
                                .iter()
                                .find(|s| s.name == step)
                                .map(|s| s.effect)
                        })
                        .flatten();
                    let non_idempotent = effect == Some(Effect::NonIdempotent);
                    let acts = effect.is_some_and(|e| e != Effect::None);
                    self.ledger.insert(
                        uid(&created),
                        Execution {
                            name: name.clone(),
                            role,
                            key: l[labels::IDEMPOTENCY_KEY].clone(),
                            step,
                            plan_revision: l[labels::PLAN_REVISION].parse().unwrap(),
                            attempt: l[labels::ATTEMPT].parse().unwrap(),
                            non_idempotent,
                            started: false,
                            seq: self.w.created.len(),
                            interrupted: false,
                            disrupted: false,
                            vanished: false,
                            uid_recorded: false,
                            seen_by_operator: false,
                            closed_by_operator: false,
                            acts,
                            unreported_failure: false,
                            succeeded: false,
                            said_not_applied: false,
                        },
                    );
                }
                if self.cache.get(&name).map(uid) != Some(uid(&created)) {
                    self.stand_ins.insert(
                        name,
                        StandIn {
                            pod: created,
                            at: self.w.now,
                        },
                    );
                }
            }
            Action::ReleaseFinalizer { pod } => {
                let seen = self
                    .stand_ins
                    .get(pod)
                    .map(|s| &s.pod)
                    .or(self.cache.get(pod));
                if seen.is_some_and(|p| !observe::has_result_finalizer(p)) {
                    return; // the controller sends no patch
                }
                if let Some(p) = self.w.pods.get(pod) {
                    let mut released = p.clone();
                    released.metadata.finalizers = None;
                    // Recorded while the cache still shows the finalizer
                    // (`Expectations::record`).
                    if self
                        .cache
                        .get(pod)
                        .is_some_and(|c| uid(c) == uid(p) && observe::has_result_finalizer(c))
                    {
                        self.stand_ins.insert(
                            pod.clone(),
                            StandIn {
                                pod: released,
                                at: self.w.now,
                            },
                        );
                    }
                }
                self.w.apply(a);
            }
            _ => self.w.apply(a),
        }
    }
}
