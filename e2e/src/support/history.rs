//! The run history's test fixtures, shared by the store conformance suite
//! (tests/history_stores.rs) and the PostgreSQL store's own tests
//! (tests/history_postgres.rs): records at fixed times, and the test
//! PostgreSQL (`e2e/cluster postgres up`), which a test that needs it
//! requires, panicking without it.

use agentrun_operator::api::{RecordedOutcome, RecordedRun, RunPhase, RunRecordSpec};
use agentrun_operator::history::{PgStore, record_name};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// The PostgreSQL the tests use; panics, saying how to start one, without it.
pub fn database_url() -> String {
    std::env::var("AGENTRUN_TEST_DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| {
            panic!(
                "AGENTRUN_TEST_DATABASE_URL is not set: start PostgreSQL with `e2e/cluster postgres up` \
                 and eval \"$(e2e/cluster env)\" (make test does)"
            )
        })
}

/// A name no other case and no earlier run of the suite uses: rows stay
/// in the throwaway database, so namespaces must not repeat.
pub fn unique(case: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut name: String = case.replace('_', "-").chars().take(40).collect();
    name.push_str(&format!("-{:x}", nanos & 0xffff_ffff_ffff));
    name
}

pub async fn pg_store(url: &str, ns: &str) -> PgStore {
    PgStore::connect(url, None, Some(ns.to_owned()))
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at AGENTRUN_TEST_DATABASE_URL is not reachable: {e}: start it with `e2e/cluster postgres up`"))
}

pub fn t0() -> Timestamp {
    "2026-11-01T00:00:00Z".parse().unwrap()
}

pub fn at(hours: i64) -> Timestamp {
    t0() + SignedDuration::from_hours(hours)
}

/// A record of run `run` (UID `<tag>-0000-4000-8000-000000000000`), in
/// `ns`, finished `hours` after t0.
pub fn record(ns: &str, run: &str, tag: &str, phase: RunPhase, hours: i64) -> RunRecordSpec {
    RunRecordSpec {
        run: RecordedRun {
            namespace: ns.to_owned(),
            name: run.to_owned(),
            uid: format!("{tag}-0000-4000-8000-000000000000"),
            spec_digests: vec!["9e192b8624214fba49c6410dad95627b".into()],
            rerun: None,
            requested_by: None,
            forked_from: None,
            created_at: Time(at(hours - 1)),
        },
        outcome: RecordedOutcome {
            phase,
            reason: None,
            message: None,
            started_at: Some(Time(at(hours - 1))),
            completed_at: Time(at(hours)),
            duration: Some("1h".into()),
            tokens_used: 1200,
            step_executions: 2,
            plan_revision: 1,
        },
        steps: vec![],
        compensations: vec![],
        approvals: vec![],
        signals: vec![],
    }
}

pub fn by(mut r: RunRecordSpec, user: &str) -> RunRecordSpec {
    r.run.requested_by = Some(user.to_owned());
    r
}

pub fn names(records: &[RunRecordSpec]) -> Vec<String> {
    records
        .iter()
        .map(|r| record_name(&r.run.name, &r.run.uid))
        .collect()
}
