//! Property tests: random plans under random interleavings of Pod events,
//! operator crashes (in-memory state dropped, restart from the committed
//! status only), lost or late watch events (a lagging cache), failed status
//! writes, clock jumps and human answers. Invariants are checked at every
//! write and every applied action; at the end the world stops changing and
//! the run must reach a terminal phase or a durable wait.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::Pod;
use proptest::prelude::*;

use super::observe;
use super::testing::*;
use super::{Action, Decision, Observed, PodRole, decide, idempotency_key};
use crate::api::{
    AgentRun, AgentRunStatus, ApprovalKind, CheckpointState, Decision as Answer, Effect, OnTimeout,
    RunPhase, StepPhase, StepRole, StepSpec,
};
use crate::labels;

#[derive(Clone, Debug)]
struct StepGen {
    effect: u8,
    retries: i32,
    timeout: bool,
    approval: Option<bool>,
    fresh: bool,
    compensate: bool,
}

fn step_gen() -> impl Strategy<Value = StepGen> {
    (
        0u8..3,
        0i32..3,
        any::<bool>(),
        prop::option::weighted(0.2, any::<bool>()),
        prop::bool::weighted(0.2),
        any::<bool>(),
    )
        .prop_map(
            |(effect, retries, timeout, approval, fresh, compensate)| StepGen {
                effect,
                retries,
                timeout,
                approval,
                fresh,
                compensate,
            },
        )
}

fn build_run(steps: &[StepGen], tokens: Option<i64>) -> AgentRun {
    let specs: Vec<StepSpec> = steps
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let mut s = step(&format!("s{i}")).with_effect(
                [Effect::None, Effect::Idempotent, Effect::NonIdempotent][g.effect as usize],
            );
            if g.retries > 0 {
                s = s.with_retry(g.retries, "5s", "20s");
            }
            if g.timeout {
                s = s.with_timeout("2m");
            }
            if let Some(approve) = g.approval {
                s = s.with_approval(
                    Some("10m"),
                    if approve {
                        OnTimeout::Approve
                    } else {
                        OnTimeout::Reject
                    },
                );
            }
            if g.fresh {
                s = s.with_fresh_for("3m");
            }
            if g.compensate {
                s = s.with_compensate();
            }
            s
        })
        .collect();
    let mut run = AgentRun::test().with_steps(specs);
    if tokens.is_some() {
        run = run.with_budget(tokens, Some(40));
    }
    run
}

#[derive(Clone, Debug)]
enum Ev {
    /// The operator reconciles from its cache. The status write may fail; the
    /// operator may crash after applying only some actions.
    Reconcile {
        write_fails: bool,
        crash_after: Option<usize>,
    },
    /// The cache catches up with the cluster.
    SyncAll,
    /// One watch event arrives (others are late or lost until a relist).
    SyncOne(usize),
    /// The operator restarts: a fresh cache listed from the cluster.
    Crash,
    /// A kubelet reports on a Pod.
    Kubelet {
        which: usize,
        what: u8,
    },
    /// Someone force-removes a Pod (finalizer and all).
    Vanish(usize),
    ClockJump(i64),
    Human {
        which: usize,
        answer: bool,
        reconcile: u8,
    },
    Cancel,
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        6 => (prop::bool::weighted(0.15), prop::option::weighted(0.1, 0usize..4))
            .prop_map(|(write_fails, crash_after)| Ev::Reconcile { write_fails, crash_after }),
        3 => Just(Ev::SyncAll),
        2 => (0usize..8).prop_map(Ev::SyncOne),
        1 => Just(Ev::Crash),
        6 => (0usize..8, 0u8..10).prop_map(|(which, what)| Ev::Kubelet { which, what }),
        1 => (0usize..8).prop_map(Ev::Vanish),
        2 => (1i64..400).prop_map(Ev::ClockJump),
        2 => (0usize..4, any::<bool>(), 0u8..3).prop_map(|(which, answer, reconcile)| Ev::Human { which, answer, reconcile }),
    ]
}

/// The cluster plus one operator process's cache.
struct Sim {
    w: World,
    cache: BTreeMap<String, Pod>,
    keys: HashMap<(String, String, i64), String>,
}

impl Sim {
    fn decide_from_cache(&self) -> Decision {
        let pods: Vec<Pod> = self.cache.values().cloned().collect();
        let approvals: Vec<_> = self.w.approvals.values().cloned().collect();
        decide(&Observed {
            run: &self.w.run,
            pods: &pods,
            approvals: &approvals,
            refused: &[],
            now: self.w.now,
        })
    }

    fn reconcile(&mut self, write_fails: bool, crash_after: Option<usize>) -> Decision {
        let before = self.w.status();
        let d = self.decide_from_cache();
        if write_fails {
            return d; // 409 or timeout: nothing is applied
        }
        check_status_transition(&before, &d.status);
        self.w.run.status = Some(d.status.clone());
        let n = crash_after.unwrap_or(usize::MAX);
        for a in d.actions.iter().take(n) {
            self.check_action(&before, &d.status, a);
            self.w.apply(a);
            self.check_world();
        }
        if crash_after.is_some() {
            self.cache = self.w.pods.clone();
        }
        d
    }

    /// Checks an action against the status that was committed before the decision.
    fn check_action(&mut self, committed: &AgentRunStatus, decided: &AgentRunStatus, a: &Action) {
        match a {
            Action::CreatePod(pod) => {
                let l = pod.metadata.labels.clone().unwrap();
                let (role, step, rev) = (
                    l[labels::ROLE].clone(),
                    l[labels::STEP].clone(),
                    l[labels::PLAN_REVISION].parse::<i64>().unwrap(),
                );
                let key = l[labels::IDEMPOTENCY_KEY].clone();
                let pod_role = super::names::PodRole::from_label(&role).unwrap();
                assert_eq!(
                    key,
                    idempotency_key(UID, pod_role, &step, rev),
                    "D1: key derived from (uid, step, revision)"
                );
                let prev = self
                    .keys
                    .insert((role.clone(), step.clone(), rev), key.clone());
                assert!(
                    prev.is_none_or(|p| p == key),
                    "D1: the key is stable across attempts"
                );
                let name = pod.metadata.name.clone().unwrap();
                if !self.w.pods.contains_key(&name) {
                    let live_same_key =
                        self.w
                            .pods
                            .values()
                            .filter(|p| observe::is_live(p))
                            .any(|p| {
                                p.metadata.labels.as_ref().unwrap()[labels::IDEMPOTENCY_KEY] == key
                            });
                    assert!(
                        !live_same_key,
                        "D2: {name} created while an attempt with key {key} is live"
                    );
                }
                if pod_role == PodRole::Step {
                    // Actions are applied only once the decided status is
                    // acknowledged, so the checkpoints a launch depends on must
                    // be committed in it (D4): recorded earlier, or in that write.
                    let plan = decided.plan.clone().expect("a plan with any step Pod");
                    let i = plan
                        .step_names
                        .iter()
                        .position(|n| *n == step)
                        .expect("step in the committed plan");
                    for earlier in &plan.step_names[..i] {
                        let ok = decided.steps.iter().any(|c| {
                            c.role == StepRole::Step
                                && &c.name == earlier
                                && c.plan_revision <= rev
                                && c.phase == StepPhase::Succeeded
                                && c.checkpoint == CheckpointState::Committed
                        });
                        assert!(
                            ok,
                            "D4: {name} created before step {earlier}'s checkpoint was committed"
                        );
                    }
                }
            }
            Action::ReleaseFinalizer { pod } => {
                let Some(p) = self.w.pods.get(pod) else {
                    return;
                };
                if committed.phase.is_some_and(RunPhase::is_terminal) {
                    return;
                }
                let c = observe::coords(p).unwrap();
                let (attempt, phase) = if c.role == PodRole::Compensate {
                    let x = committed
                        .compensations
                        .iter()
                        .find(|x| x.name == c.step && x.plan_revision == c.plan_revision);
                    let x = x.expect("D5: released a compensation Pod the status does not know");
                    (x.attempt, x.phase)
                } else {
                    let x = committed.steps.iter().find(|x| {
                        x.name == c.step
                            && x.plan_revision == c.plan_revision
                            && PodRole::from(x.role) == c.role
                    });
                    let x = x.expect("D5: released a Pod the status does not know");
                    (x.attempt, x.phase)
                };
                assert!(
                    c.attempt < attempt || phase != StepPhase::Running,
                    "D5: finalizer of {pod} released before its outcome was committed"
                );
            }
            _ => {}
        }
    }

    fn check_world(&self) {
        let mut live: HashMap<String, usize> = HashMap::new();
        for p in self.w.pods.values().filter(|p| observe::is_live(p)) {
            *live
                .entry(p.metadata.labels.as_ref().unwrap()[labels::IDEMPOTENCY_KEY].clone())
                .or_default() += 1;
        }
        assert!(
            live.values().all(|n| *n <= 1),
            "D2: two live attempts for one key: {live:?}"
        );
    }

    fn pod_name(&self, which: usize) -> Option<String> {
        let names: Vec<&String> = self.w.pods.keys().collect();
        (!names.is_empty()).then(|| names[which % names.len()].clone())
    }

    fn kubelet(&mut self, which: usize, what: u8) {
        let Some(name) = self.pod_name(which) else {
            return;
        };
        let pod = self.w.pod(&name);
        if !observe::is_live(&pod) {
            return;
        }
        let deleting = pod.metadata.deletion_timestamp.is_some();
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let next = if deleting {
            pod.exited(137, "")
        } else {
            match what {
                0 | 1 if !running => pod.running(),
                0..=3 => pod.succeeded(&ok_message(
                    serde_json::json!({"n": what}),
                    i64::from(what) * 7,
                )),
                4 => pod.succeeded(""),
                5 => pod.exited(1, &ok_message(serde_json::Value::Null, 3)),
                6 => pod.evicted(running),
                7 => pod.succeeded("not json"),
                _ => pod.running(),
            }
        };
        self.w.update_pod(&name, |_| next);
        self.check_world();
    }

    fn human(&mut self, which: usize, answer: bool, reconcile: u8) {
        let pending: Vec<String> = self
            .w
            .approvals
            .iter()
            .filter(|(_, a)| a.spec.decision.is_none())
            .map(|(n, _)| n.clone())
            .collect();
        if pending.is_empty() {
            return;
        }
        let name = pending[which % pending.len()].clone();
        let decision = match self.w.approvals[&name].spec.kind {
            ApprovalKind::Approve if answer => Answer::Approved,
            ApprovalKind::Approve => Answer::Rejected,
            ApprovalKind::Reconcile => {
                [Answer::Retry, Answer::MarkSucceeded, Answer::MarkFailed][reconcile as usize % 3]
            }
        };
        self.w.decide_approval(&name, decision, "someone");
    }
}

/// D3 and D9 across one committed write.
fn check_status_transition(before: &AgentRunStatus, after: &AgentRunStatus) {
    assert!(
        after.tokens_used >= before.tokens_used,
        "D9: tokens never decrease"
    );
    assert!(after.step_executions >= before.step_executions);
    if before.phase.is_some_and(RunPhase::is_terminal) {
        assert_eq!(before.phase, after.phase, "terminal phases are sticky");
    }
    for old in before.steps.iter().filter(|c| c.phase.is_terminal()) {
        let new = after
            .steps
            .iter()
            .find(|c| {
                c.role == old.role && c.name == old.name && c.plan_revision == old.plan_revision
            })
            .expect("D3: a recorded checkpoint is never lost");
        assert_eq!(new, old, "D3: a recorded checkpoint never changes");
    }
    for c in &after.steps {
        assert_eq!(
            c.idempotency_key,
            idempotency_key(UID, c.role.into(), &c.name, c.plan_revision),
            "D1"
        );
    }
}

fn drive(steps: Vec<StepGen>, tokens: Option<i64>, mut events: Vec<Ev>, cancel_at: Option<usize>) {
    if let Some(at) = cancel_at {
        events.insert(at.min(events.len()), Ev::Cancel);
    }
    let mut sim = Sim {
        w: World::new(build_run(&steps, tokens)),
        cache: BTreeMap::new(),
        keys: HashMap::new(),
    };
    for e in events {
        match e {
            Ev::Reconcile {
                write_fails,
                crash_after,
            } => {
                sim.reconcile(write_fails, crash_after);
            }
            Ev::SyncAll => sim.cache = sim.w.pods.clone(),
            Ev::SyncOne(which) => {
                if let Some(name) = sim
                    .pod_name(which)
                    .or_else(|| sim.cache.keys().next().cloned())
                {
                    match sim.w.pods.get(&name) {
                        Some(p) => sim.cache.insert(name, p.clone()),
                        None => sim.cache.remove(&name),
                    };
                }
                // Pods gone from the cluster also leave the cache on their delete event.
                let gone: Vec<String> = sim
                    .cache
                    .keys()
                    .filter(|n| !sim.w.pods.contains_key(*n))
                    .take(1)
                    .cloned()
                    .collect();
                for n in gone {
                    sim.cache.remove(&n);
                }
            }
            Ev::Crash => sim.cache = sim.w.pods.clone(),
            Ev::Kubelet { which, what } => sim.kubelet(which, what),
            Ev::Vanish(which) => {
                if let Some(name) = sim.pod_name(which) {
                    sim.w.pods.remove(&name);
                }
            }
            Ev::ClockJump(secs) => sim.w.advance(secs),
            Ev::Human {
                which,
                answer,
                reconcile,
            } => sim.human(which, answer, reconcile),
            Ev::Cancel => sim.w.run.spec.cancel = true,
        }
    }
    // The world stops changing except that Pods finish and time passes: the
    // run must reach a terminal phase or a durable wait.
    for _ in 0..400 {
        sim.cache = sim.w.pods.clone();
        let before = sim.w.status();
        let d = sim.reconcile(false, None);
        let acted = d.actions.iter().any(|a| !matches!(a, Action::Event { .. }));
        let names: Vec<String> = sim.w.pods.keys().cloned().collect();
        let mut moved = false;
        for n in names {
            let p = sim.w.pod(&n);
            if observe::is_live(&p) {
                let next = if p.metadata.deletion_timestamp.is_some() {
                    p.exited(137, "")
                } else {
                    p.succeeded("")
                };
                sim.w.update_pod(&n, |_| next);
                moved = true;
            }
        }
        if d.status == before && !moved && !acted {
            match d.requeue_after {
                Some(after) if after > jiff::SignedDuration::ZERO => {
                    sim.w.advance(after.as_secs().max(1))
                }
                Some(_) => {}
                None => break,
            }
        }
    }
    let s = sim.w.status();
    let phase = s.phase.expect("a phase");
    let waiting = phase == RunPhase::WaitingForApproval
        && sim
            .w
            .approvals
            .values()
            .any(|a| a.spec.decision.is_none() && a.spec.expires_at.is_none());
    assert!(
        phase.is_terminal() || waiting,
        "no terminal phase or durable wait: {phase:?}\n{s:#?}"
    );
    let again = sim.decide_from_cache();
    assert_eq!(again.status, s, "at rest, a decision changes nothing");
    assert!(
        sim.w.live_pods().is_empty(),
        "nothing runs at rest: {:?}",
        sim.w.live_pods()
    );
    if phase.is_terminal() {
        assert!(
            sim.w
                .pods
                .values()
                .all(|p| !observe::has_result_finalizer(p)),
            "a finished run releases every finalizer"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        // 256 cases, the default (`PROPTEST_CASES` changes it). The default
        // generator, ChaCha, took a quarter of the time in a debug build.
        rng_algorithm: prop::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    })]

    #[test]
    fn invariants_hold_under_random_interleavings(
        steps in prop::collection::vec(step_gen(), 1..5),
        tokens in prop::option::weighted(0.3, 20i64..200),
        events in prop::collection::vec(ev(), 0..80),
        cancel_at in prop::option::weighted(0.15, 0usize..80),
    ) {
        drive(steps, tokens, events, cancel_at);
    }
}
