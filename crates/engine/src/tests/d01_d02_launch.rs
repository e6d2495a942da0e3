//! Launching: D1 stable keys, D2 one live attempt and its name, the Pod object.

use super::*;

#[test]
fn first_decision_records_the_plan_and_launches_the_first_step() {
    let mut w = World::new(two_steps());
    let d = w.step();
    let s = w.status();
    assert_eq!(
        s.plan.as_ref().map(|p| (p.revision, p.source)),
        Some((1, PlanSource::Spec))
    );
    assert_eq!(s.phase, Some(RunPhase::Running));
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.attempt, a.phase, a.pod.as_deref()),
        (1, StepPhase::Running, Some("run-a-2b8d3c-r1-a1"))
    );
    assert_eq!(a.idempotency_key, KEY_A_R1);
    assert_eq!(s.step_executions, 1);
    assert_eq!(s.progress.as_deref(), Some("0/2"));
    assert_eq!(s.current_step.as_deref(), Some("a"));
    assert_eq!(
        d.requeue_after,
        secs(0),
        "status changed: continue after the write"
    );
}

#[test]
fn step_pods_carry_identity_context_finalizer_and_a_restricted_security_context() {
    let mut w = World::new(two_steps());
    w.step();
    let pod = w.pod("run-a-2b8d3c-r1-a1");
    let key = KEY_A_R1.to_owned();
    let l = pod.metadata.labels.clone().unwrap();
    for (k, v) in [
        (labels::RUN, "run"),
        (labels::STEP, "a"),
        (labels::PLAN_REVISION, "1"),
        (labels::ATTEMPT, "1"),
        (labels::ROLE, "step"),
        (labels::IDEMPOTENCY_KEY, key.as_str()),
    ] {
        assert_eq!(l.get(k).map(String::as_str), Some(v), "label {k}");
    }
    let ann = pod.metadata.annotations.clone().unwrap();
    assert_eq!(ann.get(labels::IDEMPOTENCY_KEY), Some(&key));
    let ctx: serde_json::Value = serde_json::from_str(&ann[labels::CONTEXT]).unwrap();
    assert_eq!(
        (ctx["step"].as_str(), ctx["attempt"].as_i64()),
        (Some("a"), Some(1))
    );
    assert_eq!(
        pod.metadata.finalizers,
        Some(vec![labels::RESULT_FINALIZER.to_owned()])
    );
    let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.uid.as_str(), owner.controller), (UID, Some(true)));
    let spec = pod.spec.unwrap();
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let c = &spec.containers[0];
    let env: Vec<(String, String)> = c
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    for (k, v) in [
        (labels::env::IDEMPOTENCY_KEY, key.as_str()),
        (labels::env::RUN, "run"),
        (labels::env::STEP, "a"),
        (labels::env::ATTEMPT, "1"),
        (labels::env::PLAN_REVISION, "1"),
        (labels::env::CONTEXT_FILE, labels::CONTEXT_PATH),
    ] {
        assert!(env.contains(&(k.to_owned(), v.to_owned())), "env {k}");
    }
    let sc = c.security_context.clone().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_owned()]));
    assert_eq!(sc.seccomp_profile.unwrap().type_, "RuntimeDefault");
    let mount = &c.volume_mounts.as_ref().unwrap()[0];
    assert_eq!(mount.mount_path, "/agentrun");
    let vol = &spec.volumes.unwrap()[0];
    let item = &vol.downward_api.as_ref().unwrap().items.as_ref().unwrap()[0];
    assert_eq!(item.path, "context.json");
    assert_eq!(
        item.field_ref.as_ref().unwrap().field_path,
        "metadata.annotations['agentrun.dev/context']"
    );
}

#[test]
fn a_pod_missing_from_the_cache_is_created_again_under_the_same_name() {
    let mut w = World::new(two_steps());
    w.step();
    // The Pod is not there (the controller reads a Pod the run names from
    // the API server when its cache lacks it): the same create is repeated,
    // and the Pod's UID will be recorded once seen.
    let d = w.decide_with(&[]);
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    let mut want = w.status();
    want.steps[0].pod_recreated = true;
    assert_eq!(d.status, want, "no new attempt");
    w.commit(&d);
    let seen = w.decide();
    assert!(
        seen.status.steps[0].pod_uid.is_some(),
        "the UID of the Pod created again is recorded"
    );
}

#[test]
fn an_unchanged_world_gives_back_the_same_status() {
    struct Case {
        name: &'static str,
        world: fn() -> World,
    }
    let cases = [
        Case {
            name: "step running",
            world: || {
                let mut w = World::new(two_steps());
                w.settle();
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
                w.settle();
                w
            },
        },
        Case {
            name: "backoff wait",
            world: || {
                let mut w =
                    World::new(AgentRun::test().with_steps([step("a").with_retry(2, "10s", "1m")]));
                w.settle();
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
                w.settle();
                w
            },
        },
        Case {
            name: "approval wait",
            world: || {
                let mut w = World::new(
                    AgentRun::test()
                        .with_steps([step("a").with_approval(Some("1h"), OnTimeout::Reject)]),
                );
                w.settle();
                w
            },
        },
        Case {
            name: "succeeded with TTL",
            world: || {
                let mut w = World::new(AgentRun::test().with_steps([step("a")]).with_ttl(60));
                w.settle();
                w.succeed("run-a-2b8d3c-r1-a1", "");
                w
            },
        },
    ];
    for c in cases {
        let w = (c.world)();
        let d = w.decide();
        assert_eq!(d.status, w.status(), "{}", c.name);
        assert_ne!(d.requeue_after, secs(0), "{}: no hot loop", c.name);
        assert!(creates(&d).is_empty(), "{}", c.name);
    }
}
