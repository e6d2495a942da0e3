//! What the property test draws: random plans (sequences and graphs, with
//! every kind of step), and random events against them.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct StepGen {
    pub(super) effect: u8,
    pub(super) retries: i32,
    pub(super) timeout: bool,
    pub(super) approval: Option<bool>,
    pub(super) fresh: bool,
    pub(super) compensate: bool,
    /// In a graph: a bit per earlier step this one depends on. `None` for
    /// every step of a run: a sequence.
    pub(super) deps: Option<u8>,
    /// The step has a verify probe.
    pub(super) verify: bool,
    /// The step is a wait (90 s, no Pod) instead.
    pub(super) wait: bool,
    /// The step waits for a signal instead (no Pod; takes precedence over
    /// `wait`).
    pub(super) signal: Option<SignalGen>,
    /// The step's result (or its signal's data) must match [`SCHEMA`].
    pub(super) schema: bool,
}

/// A wait for a signal.
#[derive(Clone, Copy, Debug)]
pub(super) struct SignalGen {
    /// A deadline ([`SIGNAL_TIMEOUT`] after the wait starts); none waits
    /// for ever.
    pub(super) deadline: bool,
    /// `onTimeout: Skip` instead of `Fail`.
    pub(super) skip: bool,
    /// Only [`SENDER`] may send it.
    pub(super) senders: bool,
}

/// The `timeout` of a signal wait that has one (`5m`), in seconds.
pub(super) const SIGNAL_TIMEOUT: i64 = 300;
/// The one user a signal wait with senders names; [`INTRUDER`] is not.
pub(super) const SENDER: &str = "alice";
pub(super) const INTRUDER: &str = "mallory";

/// The `resultSchema` of the steps that have one: an object whose `n` is an
/// integer of at most 1. [`fits_schema`] says the same, written apart.
pub(super) fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "required": ["n"],
        "properties": {"n": {"type": "integer", "maximum": 1}},
    })
}

/// Whether `v` matches [`schema`], decided without a JSON Schema validator.
pub(super) fn fits_schema(v: &serde_json::Value) -> bool {
    v.as_object()
        .and_then(|o| o.get("n"))
        .and_then(serde_json::Value::as_i64)
        .is_some_and(|n| n <= 1)
}

fn signal_gen() -> impl Strategy<Value = SignalGen> {
    (
        prop::bool::weighted(0.6),
        any::<bool>(),
        prop::bool::weighted(0.3),
    )
        .prop_map(|(deadline, skip, senders)| SignalGen {
            deadline,
            skip,
            senders,
        })
}

pub(super) fn step_gen() -> impl Strategy<Value = StepGen> {
    (
        0u8..3,
        0i32..3,
        any::<bool>(),
        prop::option::weighted(0.2, any::<bool>()),
        // A freshness budget on one step in three: re-plans need one to
        // expire while a later step waits (reach.rs counts how often).
        prop::bool::weighted(0.35),
        any::<bool>(),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.12),
        prop::option::weighted(0.15, signal_gen()),
        prop::bool::weighted(0.3),
    )
        .prop_map(
            |(
                effect,
                retries,
                timeout,
                approval,
                fresh,
                compensate,
                verify,
                wait,
                signal,
                schema,
            )| StepGen {
                effect,
                retries,
                timeout,
                approval,
                fresh,
                compensate,
                deps: None,
                verify,
                wait,
                signal,
                schema,
            },
        )
}

/// Steps of a sequence, or (one time in three) of a random graph: each
/// step depends on a random subset of the steps before it.
pub(super) fn steps_gen() -> impl Strategy<Value = Vec<StepGen>> {
    (
        prop::collection::vec((step_gen(), any::<u8>()), 1..5),
        prop::bool::weighted(0.35),
    )
        .prop_map(|(steps, graph)| {
            steps
                .into_iter()
                .enumerate()
                .map(|(i, (mut s, bits))| {
                    if graph {
                        s.deps = Some(bits & ((1u8 << i) - 1));
                    }
                    s
                })
                .collect()
        })
}

pub(super) fn build_run(steps: &[StepGen], tokens: Option<i64>) -> AgentRun {
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
                s = s.with_fresh_for("60s");
            }
            if g.compensate {
                s = s.with_compensate();
            }
            if g.verify {
                s.verify = Some(Box::new(container("verify:1")));
            }
            if g.schema {
                s.result_schema = Some(Box::new(schema()));
            }
            if let Some(sg) = g.signal {
                s = StepSpec {
                    name: s.name,
                    wait: Some(Box::new(agentrun_api::WaitSpec {
                        for_: None,
                        until: None,
                        signal: Some(agentrun_api::SignalWait {
                            timeout: sg.deadline.then(|| {
                                agentrun_api::Duration::from(format!("{SIGNAL_TIMEOUT}s").as_str())
                            }),
                            on_timeout: if sg.skip {
                                agentrun_api::SignalTimeout::Skip
                            } else {
                                agentrun_api::SignalTimeout::Fail
                            },
                            senders: sg.senders.then(|| agentrun_api::Senders {
                                users: vec![SENDER.into()],
                                ..agentrun_api::Senders::default()
                            }),
                            ..agentrun_api::SignalWait::default()
                        }),
                    })),
                    effect: Effect::None,
                    result_schema: s.result_schema,
                    ..StepSpec::default()
                };
            } else if g.wait {
                s = StepSpec {
                    name: s.name,
                    wait: Some(Box::new(agentrun_api::WaitSpec {
                        for_: Some("90s".into()),
                        until: None,
                        signal: None,
                    })),
                    effect: Effect::None,
                    ..StepSpec::default()
                };
            }
            if let Some(bits) = g.deps {
                s.depends_on = Some(
                    (0..i)
                        .filter(|j| bits & (1 << j) != 0)
                        .map(|j| format!("s{j}"))
                        .collect(),
                );
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

/// At most how many events a history has.
pub(super) const EVENTS: usize = 90;
/// The share of runs that start queued under the caps on active runs.
pub(super) const QUEUED: f64 = 0.15;

/// How many versions behind the API server a restarted operator's first
/// lists are (0: current).
#[derive(Clone, Copy, Debug)]
pub(super) struct Lags {
    pub(super) run: usize,
    pub(super) pods: usize,
    pub(super) approvals: usize,
    pub(super) signals: usize,
}

pub(super) fn lags() -> impl Strategy<Value = Lags> {
    let lag = || prop_oneof![2 => Just(0usize), 3 => 1..HISTORY];
    (lag(), lag(), lag(), lag()).prop_map(|(run, pods, approvals, signals)| Lags {
        run,
        pods,
        approvals,
        signals,
    })
}

/// A status write that does not come back as a success.
#[derive(Clone, Copy, Debug)]
pub(super) enum WriteFault {
    /// It never reached storage (a 5xx, a timeout before the commit).
    Lost,
    /// It was committed, but the answer was lost: the operator sees an error.
    Unacknowledged,
}

#[derive(Clone, Debug)]
pub(super) enum Ev {
    /// The operator reconciles from its caches. The first status write may
    /// fail; the process may crash after applying `crash.0` actions (0: right
    /// after the status write) and restart with lists that lag by `crash.1`.
    Reconcile {
        fault: Option<WriteFault>,
        crash: Option<(usize, Lags)>,
    },
    /// Every cache catches up with the cluster.
    SyncAll,
    /// One Pod watch event arrives (others are late or lost until a relist).
    SyncOne(usize),
    /// The run watch catches up.
    SyncRun,
    /// The Approval watch catches up.
    SyncApprovals,
    /// The Signal watch catches up.
    SyncSignals,
    /// The operator restarts; its first lists may be older than the last commit.
    Crash(Lags),
    /// A kubelet reports on a Pod.
    Kubelet {
        which: usize,
        what: u8,
    },
    /// A user deletes a Pod gracefully: it keeps running through its grace
    /// period; the finalizer keeps it visible until released.
    UserDelete(usize),
    /// Someone force-removes a Pod (finalizer and all).
    Vanish(usize),
    ClockJump(i64),
    Human {
        which: usize,
        answer: bool,
        reconcile: u8,
    },
    Cancel,
    /// Someone sends signal `sig-<id>` with data `{"n": data}` on one of the
    /// run's Signals, as user `by` (0: [`SENDER`], else [`INTRUDER`]): the
    /// API server takes it or refuses it as its admission policies would.
    Send {
        which: usize,
        id: u8,
        data: u8,
        by: u8,
    },
    /// The controller's word on the caps on active runs changes: the run
    /// waits at this position, or (`None`) may start.
    Capacity(Option<u32>),
}

pub(super) fn ev() -> impl Strategy<Value = Ev> {
    let fault = prop::option::weighted(
        0.15,
        prop_oneof![Just(WriteFault::Lost), Just(WriteFault::Unacknowledged)],
    );
    let crash = prop::option::weighted(0.1, (0usize..4, lags()));
    prop_oneof![
        6 => (fault, crash).prop_map(|(fault, crash)| Ev::Reconcile { fault, crash }),
        3 => Just(Ev::SyncAll),
        2 => (0usize..8).prop_map(Ev::SyncOne),
        2 => Just(Ev::SyncRun),
        1 => Just(Ev::SyncApprovals),
        1 => lags().prop_map(Ev::Crash),
        6 => (0usize..8, 0u8..10).prop_map(|(which, what)| Ev::Kubelet { which, what }),
        2 => (0usize..8).prop_map(Ev::UserDelete),
        1 => (0usize..8).prop_map(Ev::Vanish),
        3 => (1i64..400).prop_map(Ev::ClockJump),
        2 => (0usize..4, any::<bool>(), 0u8..3).prop_map(|(which, answer, reconcile)| Ev::Human { which, answer, reconcile }),
        1 => Just(Ev::SyncSignals),
        3 => (0usize..4, 0u8..2, 0u8..4, prop::bool::weighted(0.2))
            .prop_map(|(which, id, data, intruder)| Ev::Send { which, id, data, by: u8::from(intruder) }),
        3 => prop::option::weighted(0.3, 1u32..4).prop_map(Ev::Capacity),
    ]
}
