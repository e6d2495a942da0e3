//! Drives one random history: the events, then a world that stops changing
//! but for Pods finishing and time passing, until the run is at rest.

use super::*;

pub(super) fn drive(
    steps: Vec<StepGen>,
    tokens: Option<i64>,
    mut events: Vec<Ev>,
    cancel_at: Option<usize>,
    queued: Option<u32>,
) -> Reach {
    if let Some(at) = cancel_at {
        events.insert(at.min(events.len()), Ev::Cancel);
    }
    let mut sim = Sim::new(build_run(&steps, tokens));
    sim.hold(queued);
    run_events(sim, events)
}

/// Plays `events`, then lets the world come to rest, checking the
/// invariants all along; says which paths the history reached.
pub(super) fn run_events(mut sim: Sim, events: Vec<Ev>) -> Reach {
    for e in events {
        let changes_children = matches!(
            e,
            Ev::Reconcile { .. }
                | Ev::Kubelet { .. }
                | Ev::UserDelete(_)
                | Ev::Vanish(_)
                | Ev::Human { .. }
                | Ev::Send { .. }
        );
        match e {
            Ev::Reconcile { fault, crash } => {
                sim.reconcile(fault, crash);
            }
            Ev::SyncAll => sim.sync_all(),
            Ev::SyncOne(which) => {
                if let Some(name) = sim
                    .pod_name(which)
                    .or_else(|| sim.cache.keys().next().cloned())
                {
                    sim.sync_pod(&name);
                }
                // Pods gone from the cluster also leave the cache on their delete event.
                let gone = sim
                    .cache
                    .keys()
                    .find(|n| !sim.w.pods.contains_key(*n))
                    .cloned();
                if let Some(n) = gone {
                    sim.sync_pod(&n);
                }
            }
            Ev::SyncRun => sim.run_cache = sim.w.run.clone(),
            Ev::SyncApprovals => sim.approval_cache = sim.w.approvals.clone(),
            Ev::SyncSignals => sim.signal_cache = sim.w.signals.clone(),
            Ev::Crash(lags) => sim.restart(lags),
            Ev::Kubelet { which, what } => sim.kubelet(which, what),
            Ev::UserDelete(which) => sim.user_delete(which),
            Ev::Vanish(which) => sim.vanish(which),
            Ev::ClockJump(secs) => sim.advance(secs),
            Ev::Human {
                which,
                answer,
                reconcile,
            } => sim.human(which, answer, reconcile),
            Ev::Send {
                which,
                id,
                data,
                by,
            } => sim.send(which, id, data, by),
            Ev::Capacity(position) => sim.hold(position),
            Ev::Cancel => {
                sim.w.run.spec.cancel = true;
                sim.w.run.metadata.generation = sim.w.run.metadata.generation.map(|g| g + 1);
                sim.bump_resource_version();
            }
        }
        if changes_children {
            sim.remember();
        }
    }
    // The world stops changing except that Pods finish and time passes (and
    // a place under the caps frees at last): the run must reach a terminal
    // phase or a durable wait.
    sim.hold(None);
    for turn in 0..400usize {
        sim.sync_all();
        let before = sim.w.status();
        let r = sim.reconcile(None, None);
        let names: Vec<String> = sim.w.pods.keys().cloned().collect();
        let mut moved = false;
        for n in names {
            let p = sim.w.pod(&n);
            if observe::is_live(&p) {
                let deleting = p.metadata.deletion_timestamp.is_some();
                let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                let (next, ran) = match (deleting, running) {
                    (true, false) => (never_started(p), false),
                    // What a deleted container does, in turn: trap SIGTERM
                    // and exit non-zero, finish and report, or be killed.
                    (true, true) => match turn % 3 {
                        0 => (p.exited(1, ""), true),
                        1 => (p.succeeded(&ok_message(serde_json::json!("done"), 1)), true),
                        _ => (p.exited(137, ""), true),
                    },
                    // A step with a resultSchema reports a result that fits it.
                    (false, _) if sim.has_schema(&p) => (
                        p.succeeded(&ok_message(serde_json::json!({"n": 1}), 0)),
                        true,
                    ),
                    (false, _) => (p.succeeded(""), true),
                };
                let interrupted =
                    next.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed");
                sim.kubelet_sets(&n, next, ran, interrupted);
                moved = true;
            }
        }
        if sim.w.status() == before && !moved && !r.acted {
            match r.last.requeue_after {
                Some(after) if after > SignedDuration::ZERO => sim.advance(after.as_secs().max(1)),
                Some(_) => {}
                None => break,
            }
        }
    }
    sim.sync_all();
    let s = sim.w.status();
    let phase = s.phase.expect("a phase");
    // A durable wait: on a person with no deadline, or on a signal with none.
    let on_person = sim
        .w
        .approvals
        .values()
        .any(|a| a.spec.decision.is_none() && a.spec.expires_at.is_none());
    let on_signal = s.steps.iter().any(|c| {
        c.phase == StepPhase::Waiting
            && c.wake_at.is_none()
            && c.signal
                .as_ref()
                .and_then(|n| sim.w.signals.get(n))
                .is_some_and(|sig| sig.spec.id.is_none())
    });
    let waiting = (phase == RunPhase::WaitingForApproval && on_person)
        || (matches!(phase, RunPhase::Waiting | RunPhase::WaitingForApproval)
            && (on_person || on_signal));
    assert!(
        phase.is_terminal() || waiting,
        "no terminal phase or durable wait: {phase:?}\n{s:#?}"
    );
    let again = sim.decide_on(&sim.w.run);
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
    Reach::of(&sim)
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
        steps in steps_gen(),
        tokens in prop::option::weighted(0.3, 20i64..200),
        events in prop::collection::vec(ev(), 0..EVENTS),
        cancel_at in prop::option::weighted(0.15, 0usize..EVENTS),
        queued in prop::option::weighted(QUEUED, 1u32..4),
    ) {
        drive(steps, tokens, events, cancel_at, queued);
    }
}

/// Proptest reads saved failures only from the file named after the source
/// file that holds the `proptest!` (`src/a/b.rs` → `proptest-regressions/a/b.txt`):
/// a file left behind when a test moves is never read again, and its cases
/// stop being replayed without a word.
#[test]
fn every_saved_failure_file_belongs_to_a_property_test() {
    fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("reading proptest-regressions") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                files(&path, out);
            } else {
                out.push(path);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let saved = root.join("proptest-regressions");
    let mut found = Vec::new();
    files(&saved, &mut found);
    assert!(!found.is_empty(), "no saved failures under {saved:?}");
    for file in found {
        let rel = file.strip_prefix(&saved).expect("under the folder");
        let source = root.join("src").join(rel).with_extension("rs");
        let text = std::fs::read_to_string(&source).unwrap_or_else(|_| {
            panic!("{rel:?} names no source file ({source:?}): move it beside the property test it belongs to")
        });
        assert!(
            text.contains("proptest! {"),
            "{source:?} holds no property test, so {rel:?} is never read"
        );
    }
}
