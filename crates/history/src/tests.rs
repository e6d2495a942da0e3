//! The history's pure parts: the spec digest (pinned), which records a run
//! created again matches, what the retention removes, the shared filter,
//! and what a record keeps of a finished run.

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use agentrun_api::{AgentRunSpec, RunPhase};
use agentrun_engine::testing::{World, step, t};

fn run(name: &str, uid: &str, spec: AgentRunSpec) -> AgentRun {
    let mut r = AgentRun::new(name, spec);
    r.metadata.namespace = Some("team-a".into());
    r.metadata.uid = Some(uid.into());
    r
}

fn spec() -> AgentRunSpec {
    AgentRunSpec {
        steps: vec![step("refund")],
        ..AgentRunSpec::default()
    }
}

fn record_of(r: &AgentRun, phase: RunPhase, done: Timestamp) -> RunRecordSpec {
    let status = AgentRunStatus {
        phase: Some(phase),
        completed_at: Some(Time(done)),
        ..AgentRunStatus::default()
    };
    build(r, &status, &[], &[])
}

const DAY: SignedDuration = SignedDuration::from_hours(24);

/// The digest a record is matched by must not change when the operator
/// does: a change here means runs recorded by the previous version would
/// run again when re-created. Computed outside the code under test:
/// `python3 -c "import hashlib,json; print(hashlib.sha256(json.dumps({'steps':[{'name':'refund','container':{'image':'tool:1'},'effect':'Idempotent'}]},separators=(',',':'),sort_keys=True).encode()).hexdigest()[:32])"`.
#[test]
fn the_spec_digest_is_pinned_and_leaves_out_the_controls() {
    let s = spec();
    assert_eq!(spec_digest(&s), "9e192b8624214fba49c6410dad95627b");
    let mut controlled = s.clone();
    controlled.suspend = true;
    controlled.cancel = true;
    assert_eq!(spec_digest(&controlled), spec_digest(&s));
    let mut edited = s.clone();
    edited.steps[0].container.as_mut().unwrap().image = "refund:2".into();
    assert_ne!(spec_digest(&edited), spec_digest(&s));
}

#[test]
fn a_run_created_again_is_recognised_by_namespace_name_spec_and_rerun_token() {
    let keep = Retention::default();
    let now = Timestamp::from_second(1_800_000_000).unwrap();
    let first = run("refund-4711", "uid-1", spec());
    let rec = record_of(&first, RunPhase::Succeeded, now - DAY);
    let again = run("refund-4711", "uid-2", spec());
    let found = recognise(std::slice::from_ref(&rec), &again, now, &keep).expect("recognised");
    assert_eq!(found.record, "refund-4711-uid1");
    assert_eq!(
        (found.run_uid.as_str(), found.outcome.as_str()),
        ("uid-1", "Succeeded")
    );

    // The same run (its own record) is not a re-creation.
    assert!(recognise(std::slice::from_ref(&rec), &first, now, &keep).is_none());
    // Another spec under the same name is a new run.
    let mut other = spec();
    other.steps[0].container.as_mut().unwrap().image = "refund:2".into();
    assert!(
        recognise(
            std::slice::from_ref(&rec),
            &run("refund-4711", "uid-3", other),
            now,
            &keep
        )
        .is_none()
    );
    // Another namespace, another name: new runs.
    let mut elsewhere = run("refund-4711", "uid-4", spec());
    elsewhere.metadata.namespace = Some("team-b".into());
    assert!(recognise(std::slice::from_ref(&rec), &elsewhere, now, &keep).is_none());
    assert!(
        recognise(
            std::slice::from_ref(&rec),
            &run("refund-4712", "uid-5", spec()),
            now,
            &keep
        )
        .is_none()
    );
    // Past the window it runs again.
    let later = now + SignedDuration::from_hours(31 * 24);
    assert!(recognise(std::slice::from_ref(&rec), &again, later, &keep).is_none());
    // A new rerun token is a deliberate new run; the same token again is not.
    let mut rerun = run("refund-4711", "uid-6", spec());
    rerun
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(labels::RERUN.into(), "2".into());
    assert!(recognise(std::slice::from_ref(&rec), &rerun, now, &keep).is_none());
    let rec2 = record_of(
        &rerun,
        RunPhase::Failed,
        now - SignedDuration::from_hours(1),
    );
    let mut rerun_again = rerun.clone();
    rerun_again.metadata.uid = Some("uid-7".into());
    let found = recognise(&[rec.clone(), rec2], &rerun_again, now, &keep).expect("recognised");
    assert_eq!(
        (found.run_uid.as_str(), found.outcome.as_str()),
        ("uid-6", "Failed")
    );
}

#[test]
fn a_run_edited_while_it_ran_is_recognised_from_its_first_manifest() {
    let keep = Retention::default();
    let now = Timestamp::from_second(1_800_000_000).unwrap();
    let mut w = World::new(run("refund-4711", "uid-1", spec()));
    w.run.metadata.generation = Some(1);
    w.history = agentrun_engine::History::On;
    w.settle();
    w.run.spec.steps[0].container.as_mut().unwrap().image = "refund:2".into();
    w.run.metadata.generation = Some(2);
    w.settle();
    let rec = build(&w.run, &w.status(), &[], &[]);
    assert_eq!(rec.run.spec_digests.len(), 2);
    let mut rec = rec;
    rec.outcome.completed_at = Time(now - DAY);
    // Git still holds the first manifest: a re-sync creates that one.
    let again = run("refund-4711", "uid-2", spec());
    assert!(recognise(&[rec], &again, now, &keep).is_some());
}

/// D22: the count a namespace is expected to hold never pushes a record
/// out inside its retention (a flood of cheap runs would otherwise make an
/// old run execute again on its next re-sync); it is only counted.
#[test]
fn retention_removes_records_past_the_window_and_only_counts_those_past_the_cap() {
    let now = t(100 * 86_400);
    let keep = Retention {
        max_age: SignedDuration::from_hours(10 * 24),
        max_per_namespace: 2,
    };
    let records = vec![
        ("new".to_owned(), now - DAY),
        ("old".to_owned(), now - SignedDuration::from_hours(11 * 24)),
        ("mid".to_owned(), now - DAY * 2),
        ("older".to_owned(), now - DAY * 3),
        ("oldest-kept".to_owned(), now - DAY * 9),
        ("edge".to_owned(), now - DAY * 10),
        (
            "past-edge".to_owned(),
            now - DAY * 10 - SignedDuration::from_secs(1),
        ),
    ];
    let (expired, over) = to_prune(records, now, &keep);
    assert_eq!(expired, ["old", "past-edge"]);
    assert_eq!(over, 3, "5 inside the window, 2 expected: 3 more, all kept");
    let (expired, over) = to_prune(vec![("one".to_owned(), now)], now, &keep);
    assert!(expired.is_empty());
    assert_eq!(over, 0);
}

/// A record counts from the finish it records, but never from later than
/// when its store took it, nor than now: one claiming a finish in the future
/// (written before the policy kept records the operator's) still expires.
#[test]
fn a_record_counts_from_its_own_finish_bounded_by_when_it_was_stored() {
    let now = t(1000);
    let cases = [
        (
            "its own finish, stored after",
            Some(t(100)),
            Some(t(105)),
            t(100),
        ),
        (
            "a finish after it was stored",
            Some(t(5000)),
            Some(t(200)),
            t(200),
        ),
        (
            "a finish in the future, no store time",
            Some(t(5000)),
            None,
            now,
        ),
        ("a store time in the future", None, Some(t(5000)), now),
        ("no finish recorded", None, Some(t(300)), t(300)),
        ("nothing known", None, None, now),
    ];
    for (what, recorded, stored, want) in cases {
        assert_eq!(
            finished_for_retention(recorded, stored, now),
            want,
            "{what}"
        );
    }
    // Planted at t(200), claiming to finish at t(5000): expired once the
    // window counted from t(200) has passed.
    let keep = Retention {
        max_age: SignedDuration::from_secs(500),
        max_per_namespace: 10,
    };
    let later = t(701);
    let finished = finished_for_retention(Some(t(5000)), Some(t(200)), later);
    let (expired, _) = to_prune(vec![("planted".to_owned(), finished)], later, &keep);
    assert_eq!(expired, ["planted"]);
}

/// A record is the operator's only under the name the operator gives it:
/// one under another name (a copy, or planted before the policy) is not
/// history, and the run it names runs when created again.
#[test]
fn a_record_under_another_name_is_not_history() {
    let keep = Retention::default();
    let now = Timestamp::from_second(1_800_000_000).unwrap();
    let first = run(
        "refund-4711",
        "0a1b2c3d-0000-4000-8000-000000000000",
        spec(),
    );
    let rec = record_of(&first, RunPhase::Succeeded, now - DAY);
    let again = run("refund-4711", "uid-2", spec());
    let kept = as_stored_by_the_operator("refund-4711-0a1b2c3d", rec.clone());
    assert_eq!(kept.as_ref(), Some(&rec));
    assert!(recognise(&Vec::from_iter(kept), &again, now, &keep).is_some());
    for other in [
        "refund-4711-planted",
        "refund-4711",
        "refund-4711-0a1b2c3e",
        "x",
    ] {
        let kept = as_stored_by_the_operator(other, rec.clone());
        assert_eq!(kept, None, "{other}");
        assert!(recognise(&Vec::from_iter(kept), &again, now, &keep).is_none());
    }
}

/// PostgreSQL: TLS is required unless the URL names an `sslmode` of its own
/// (`disable` for a local socket), in both forms of the URL; the URL's other
/// parts (a password with `?` or `@` in it) read as before.
#[test]
fn a_database_url_requires_tls_unless_it_says_otherwise() {
    use tokio_postgres::config::SslMode;
    let cases = [
        ("postgres://u:pw@db.example:5432/history", SslMode::Require),
        ("postgresql://u:pw@db.example/history", SslMode::Require),
        (
            "postgres://db.example/history?application_name=x",
            SslMode::Require,
        ),
        ("postgres://u:pw@db.example/history?", SslMode::Require),
        (
            "postgres://u:pw@db.example/history?sslmode=disable",
            SslMode::Disable,
        ),
        (
            "postgres://u:pw@db.example/history?connect_timeout=3&sslmode=prefer",
            SslMode::Prefer,
        ),
        (
            "postgres://u:pw@db.example/history?sslmode=require",
            SslMode::Require,
        ),
        (
            "postgres://u:p%3Fw%40x@db.example/history?sslmode=disable",
            SslMode::Disable,
        ),
        ("postgres://u:pa?ss@db.example/history", SslMode::Require),
        (
            "host=db.example user=u password=pw dbname=history",
            SslMode::Require,
        ),
        ("host=db.example user=u sslmode=disable", SslMode::Disable),
        ("host=db.example user=u sslmode = prefer", SslMode::Prefer),
        (
            "host=/var/run/postgresql user=u sslmode=disable",
            SslMode::Disable,
        ),
        (
            "host=db.example password='a sslmode=disable' user=u",
            SslMode::Require,
        ),
    ];
    for (url, want) in cases {
        let config = super::postgres::config_of(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(config.get_ssl_mode(), want, "{url}");
    }
    let password = |url: &str| {
        super::postgres::config_of(url)
            .unwrap()
            .get_password()
            .map(<[u8]>::to_vec)
    };
    assert_eq!(
        password("postgres://u:p%3Fw%40x@db.example/h").as_deref(),
        Some(&b"p?w@x"[..])
    );
    assert_eq!(
        password("postgres://u:pa?ss@db.example/h").as_deref(),
        Some(&b"pa?ss"[..])
    );
    assert_eq!(
        password("host=h password='a sslmode=disable'").as_deref(),
        Some(&b"a sslmode=disable"[..])
    );
    let bad = super::postgres::config_of("postgres://db.example/h?sslmode=bogus").unwrap_err();
    assert!(
        bad.to_string().contains("the database URL is not valid"),
        "{bad}"
    );
}

#[test]
fn the_query_filters_and_orders_the_same_for_every_store() {
    let now = Timestamp::from_second(1_800_000_000).unwrap();
    let mut a = record_of(&run("a", "u-a", spec()), RunPhase::Succeeded, now - DAY * 2);
    a.run.requested_by = Some("alice".into());
    let b = record_of(&run("b", "u-b", spec()), RunPhase::Failed, now - DAY);
    let mut c = record_of(&run("c", "u-c", spec()), RunPhase::Succeeded, now);
    c.run.namespace = "team-b".into();
    let all = vec![a.clone(), b.clone(), c.clone()];
    let names = |q: &Query| -> Vec<String> {
        q.arrange(all.clone())
            .into_iter()
            .map(|r| r.run.name)
            .collect()
    };
    assert_eq!(names(&Query::default()), ["c", "b", "a"], "newest first");
    let ns = Query {
        namespace: Some("team-a".into()),
        ..Query::default()
    };
    assert_eq!(names(&ns), ["b", "a"]);
    let ok = Query {
        outcome: Some(RunPhase::Succeeded),
        ..Query::default()
    };
    assert_eq!(names(&ok), ["c", "a"]);
    let alice = Query {
        requested_by: Some("alice".into()),
        ..Query::default()
    };
    assert_eq!(names(&alice), ["a"]);
    let window = Query {
        since: Some(now - DAY),
        until: Some(now),
        ..Query::default()
    };
    assert_eq!(names(&window), ["b"]);
    let one = Query {
        limit: Some(1),
        ..Query::default()
    };
    assert_eq!(names(&one), ["c"]);
}

#[test]
fn a_record_keeps_each_step_s_effect_key_and_provenance_and_who_decided() {
    use agentrun_engine::testing::ok_message;
    let mut w = World::new(run("refund-4711", "uid-1", spec()));
    w.run.metadata.generation = Some(1);
    w.run
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(labels::REQUESTED_BY.into(), "alice".into());
    w.run.spec.steps[0] = step("refund").with_approval(None, agentrun_api::OnTimeout::Reject);
    w.history = agentrun_engine::History::On;
    w.settle();
    let approval = w.approvals.keys().next().cloned().expect("asked");
    assert!(w.decide_approval(&approval, agentrun_api::Decision::Approved, "bob"));
    w.settle();
    let pod = w.created[0].clone();
    w.succeed(&pod, &ok_message(serde_json::json!({"refund": "r-1"}), 42));
    w.settle();
    let status = w.status();
    assert_eq!(status.phase, Some(RunPhase::Succeeded));
    let approvals: Vec<_> = w.approvals.values().cloned().collect();
    let rec = build(&w.run, &status, &approvals, &[]);
    assert_eq!(rec.run.requested_by.as_deref(), Some("alice"));
    assert_eq!(rec.outcome.phase, RunPhase::Succeeded);
    assert_eq!(rec.outcome.tokens_used, 42);
    let s = &rec.steps[0];
    assert_eq!(s.name, "refund");
    assert_eq!(s.idempotency_key, status.steps[0].idempotency_key);
    assert_eq!(s.effect, status.steps[0].effect);
    assert_eq!(s.tokens, 42);
    let a = &rec.approvals[0];
    assert_eq!(a.phase, "Approved");
    assert_eq!(a.decided_by.as_deref(), Some("bob"));
    assert!(a.step_digest.is_some());
    let bytes = serde_json::to_vec(&rec).unwrap().len();
    assert!(bytes < 2048, "a one-step record is small: {bytes} bytes");
}

/// D11 for records: the largest run a status can hold (520 checkpoints with
/// names of the longest length) makes a record well under etcd's object
/// limit; what one costs is in docs/operations.md.
#[test]
fn a_record_of_the_largest_run_stays_bounded() {
    use agentrun_api::{CheckpointState, EffectOutcome, StepCheckpoint, StepPhase, TokenUsage};
    let long = |i: usize| format!("{i:0>48}");
    let mut r = run(
        &"r".repeat(63),
        "0123456789abcdef-0123-4567-89ab-cdef01234567",
        spec(),
    );
    r.spec.steps = (0..500).map(|i| step(&long(i))).collect();
    let done = Time(Timestamp::from_second(1_800_000_000).unwrap());
    let status = AgentRunStatus {
        phase: Some(RunPhase::Succeeded),
        completed_at: Some(done.clone()),
        spec_digests: vec![spec_digest(&r.spec); 16],
        steps: (0..520)
            .map(|i| StepCheckpoint {
                name: long(i % 500),
                plan_revision: 1 + (i / 500) as i64,
                attempt: 3,
                idempotency_key: "f".repeat(32),
                phase: StepPhase::Succeeded,
                checkpoint: CheckpointState::Committed,
                effect: Some(EffectOutcome::Applied),
                tokens: Some(TokenUsage {
                    input: 123_456,
                    output: 654_321,
                }),
                started_at: Some(done.clone()),
                finished_at: Some(done.clone()),
                decided_by: Some("system:serviceaccount:payments:refund-bot".into()),
                ..StepCheckpoint::default()
            })
            .collect(),
        ..AgentRunStatus::default()
    };
    let rec = build(&r, &status, &[], &[]);
    let bytes = serde_json::to_vec(&rec).unwrap().len();
    println!("record of 520 checkpoints: {bytes} bytes");
    assert!(bytes < 256 * 1024, "{bytes} bytes");
    let small = build(
        &run("refund-4711", "uid-1", spec()),
        &AgentRunStatus {
            phase: Some(RunPhase::Succeeded),
            completed_at: Some(done.clone()),
            steps: status.steps[..10].to_vec(),
            ..AgentRunStatus::default()
        },
        &[],
        &[],
    );
    println!(
        "record of 10 checkpoints: {} bytes",
        serde_json::to_vec(&small).unwrap().len()
    );
}

#[test]
fn a_record_outlives_its_namespace_only_until_the_namespace_is_seen_gone_or_made_again() {
    let listed_at = t(1000);
    let mut r = record_of(&run("refund", "u-1", spec()), RunPhase::Succeeded, t(100));
    r.run.created_at = Time(t(50));
    let live = |created: Option<Timestamp>| LiveNamespaces {
        listed_at,
        created: created
            .map(|c| ("team-a".to_owned(), c))
            .into_iter()
            .collect(),
    };
    // The namespace the run ran in, still there.
    assert!(!of_a_gone_namespace(&r, &live(Some(t(10)))));
    // Made in the same second as the run: still the run's namespace.
    assert!(!of_a_gone_namespace(&r, &live(Some(t(50)))));
    // Made again after the run was created: another namespace of that name.
    assert!(of_a_gone_namespace(&r, &live(Some(t(51)))));
    // Not listed, and the run finished before the list: gone.
    assert!(of_a_gone_namespace(&r, &live(None)));
    // Not listed, but the run finished after the list was taken: a namespace
    // made since, not gone.
    r.outcome.completed_at = Time(t(1001));
    assert!(!of_a_gone_namespace(&r, &live(None)));
}
