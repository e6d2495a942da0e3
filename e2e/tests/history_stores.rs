//! The run history's two stores answer the same (D18): one suite, the same
//! code, run against RunRecords on the real kube-apiserver (`api::…`) and
//! against a real PostgreSQL server (`postgres::…`). Each case expects fixed
//! record names, so a store that answers otherwise fails on its own.
//!
//! ```text
//!   case(&Subject) ──▶ Store::Api(ApiStore scoped to a fresh namespace)      e2e/cluster up
//!                 └──▶ Store::Postgres(PgStore scoped to a fresh namespace)   e2e/cluster postgres up
//! ```
//!
//! What only PostgreSQL has (its connection, TLS, its errors) is in
//! tests/history_postgres.rs. Needs the plane and PostgreSQL
//! (`AGENTRUN_TEST_DATABASE_URL`, from `eval "$(e2e/cluster env)"`); fails,
//! never skips, without them.

use std::collections::BTreeMap;

use agentrun_e2e::TestEnv;
use agentrun_e2e::support::history::{at, by, database_url, names, pg_store, record, unique};
use agentrun_e2e::support::namespace::TestNamespace;
use agentrun_operator::api::{RunPhase, RunRecordSpec};
use agentrun_operator::history::{ApiStore, Error, Pruned, Query, Retention, Store};
use jiff::SignedDuration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

// ---------------------------------------------------------------------------
// The subjects: one store of each kind, each scoped to namespaces of its own.
// ---------------------------------------------------------------------------

/// A store under test, the namespace it is scoped to and a second one.
struct Subject {
    store: Store,
    ns: String,
    other: String,
    /// The API store's namespaces, deleted when the case ends.
    _namespaces: Option<(TestEnv, TestNamespace)>,
}

async fn api(case: &str) -> Subject {
    let env = TestEnv::new(case).await;
    let other = TestNamespace::create(&env.client(), &format!("{case}-other")).await;
    let ns = env.namespace().to_owned();
    Subject {
        store: Store::Api(ApiStore::new(env.client(), Some(ns.clone()))),
        other: other.name().to_owned(),
        ns,
        _namespaces: Some((env, other)),
    }
}

async fn postgres(case: &str) -> Subject {
    let ns = unique(case);
    Subject {
        store: Store::Postgres(Box::new(pg_store(&database_url(), &ns).await)),
        other: format!("{ns}-other"),
        ns,
        _namespaces: None,
    }
}

/// Each case, once on each store.
macro_rules! on_both_stores {
    ($($case:ident),* $(,)?) => {
        mod api {
            $(#[tokio::test]
            async fn $case() {
                super::$case(&super::api(stringify!($case)).await).await;
            })*
        }
        mod postgres {
            $(#[tokio::test]
            async fn $case() {
                super::$case(&super::postgres(stringify!($case)).await).await;
            })*
        }
    };
}

on_both_stores!(
    a_record_put_twice_is_stored_once,
    a_record_put_again_with_other_content_replaces_it,
    a_name_held_by_another_runs_record_is_refused,
    every_filter_lists_the_same_records_newest_first,
    get_finds_a_record_by_namespace_and_name_only,
    pruning_removes_what_is_past_the_window_and_only_counts_what_is_past_the_cap,
    a_record_claiming_a_future_finish_expires_counted_from_when_it_was_stored,
    find_returns_the_records_of_that_run_name_only,
);

/// The API store prunes one page of records' metadata at a time: the same
/// case with two records a page reaches the records of every page (with the
/// first page only, it removes less than it must).
#[tokio::test]
async fn api_pruning_pages_through_the_records() {
    let mut s = api("api_pruning_pages_through_the_records").await;
    s.store = match s.store {
        Store::Api(store) => Store::Api(store.listing_pages_of(2)),
        other => other,
    };
    pruning_removes_what_is_past_the_window_and_only_counts_what_is_past_the_cap(&s).await;
}

// ---------------------------------------------------------------------------
// Helpers over the subject.
// ---------------------------------------------------------------------------

async fn put_all(s: &Subject, records: &[RunRecordSpec]) {
    for r in records {
        s.store
            .put(r)
            .await
            .unwrap_or_else(|e| panic!("{}: put {}: {e}", s.store.kind(), r.run.name));
    }
}

async fn listed(s: &Subject, q: Query) -> Vec<String> {
    let got = s
        .store
        .list(&q)
        .await
        .unwrap_or_else(|e| panic!("{}: list {q:?}: {e}", s.store.kind()));
    names(&got)
}

// ---------------------------------------------------------------------------
// The cases.
// ---------------------------------------------------------------------------

async fn a_record_put_twice_is_stored_once(s: &Subject) {
    let r = record(&s.ns, "refund", "a0000001", RunPhase::Succeeded, 10);
    assert_eq!(s.store.put(&r).await.unwrap(), "refund-a0000001");
    assert_eq!(s.store.put(&r).await.unwrap(), "refund-a0000001");
    let all = s.store.list(&Query::default()).await.unwrap();
    assert_eq!(all, vec![r.clone()], "{}", s.store.kind());
    assert_eq!(
        s.store.get(&s.ns, "refund-a0000001").await.unwrap(),
        Some(r)
    );
}

async fn a_record_put_again_with_other_content_replaces_it(s: &Subject) {
    let first = record(&s.ns, "refund", "a0000001", RunPhase::Succeeded, 10);
    s.store.put(&first).await.unwrap();
    let mut decided_again = first.clone();
    decided_again.outcome.phase = RunPhase::Failed;
    decided_again.outcome.message = Some("the refund step failed".into());
    decided_again.outcome.completed_at = Time(at(11));
    assert_eq!(
        s.store.put(&decided_again).await.unwrap(),
        "refund-a0000001"
    );
    assert_eq!(
        s.store.get(&s.ns, "refund-a0000001").await.unwrap(),
        Some(decided_again.clone())
    );
    assert_eq!(
        s.store.list(&Query::default()).await.unwrap(),
        vec![decided_again.clone()],
        "{}: one record, the second",
        s.store.kind()
    );
    // The filters read the replacement, not what it replaced.
    let failed = Query {
        outcome: Some(RunPhase::Failed),
        since: Some(at(11)),
        ..Query::default()
    };
    assert_eq!(listed(s, failed).await, ["refund-a0000001"]);
}

async fn a_name_held_by_another_runs_record_is_refused(s: &Subject) {
    let held = record(&s.ns, "refund", "abcdef12", RunPhase::Succeeded, 10);
    s.store.put(&held).await.unwrap();
    // Another run whose UID starts the same: the same record name.
    let mut other = record(&s.ns, "refund", "abcdef12", RunPhase::Failed, 20);
    other.run.uid = "abcdef12-9999-4000-8000-000000000000".into();
    match s.store.put(&other).await {
        Err(Error::NameTaken { name, held_by }) => {
            assert_eq!(name, "refund-abcdef12");
            assert_eq!(held_by, "abcdef12-0000-4000-8000-000000000000");
        }
        got => panic!("{}: expected NameTaken, got {got:?}", s.store.kind()),
    }
    assert_eq!(
        s.store.get(&s.ns, "refund-abcdef12").await.unwrap(),
        Some(held)
    );
}

async fn every_filter_lists_the_same_records_newest_first(s: &Subject) {
    let ns = s.ns.as_str();
    put_all(
        s,
        &[
            by(
                record(ns, "refund", "a0000001", RunPhase::Succeeded, 10),
                "alice",
            ),
            by(
                record(ns, "refund", "b0000002", RunPhase::Failed, 20),
                "bob",
            ),
            // Finished in the same second as refund-b0000002: the run's name orders them.
            by(
                record(ns, "report", "c0000003", RunPhase::Succeeded, 20),
                "alice",
            ),
            record(ns, "audit", "d0000004", RunPhase::Cancelled, 30),
            by(
                record(&s.other, "refund", "e0000005", RunPhase::Succeeded, 40),
                "alice",
            ),
        ],
    )
    .await;
    let everything = [
        "audit-d0000004",
        "refund-b0000002",
        "report-c0000003",
        "refund-a0000001",
    ];
    let q = |f: fn(&mut Query)| {
        let mut q = Query::default();
        f(&mut q);
        q
    };
    let cases: Vec<(&str, Query, Vec<&str>)> = vec![
        (
            "no filter: the store's namespace",
            Query::default(),
            everything.to_vec(),
        ),
        (
            "its namespace, named",
            Query {
                namespace: Some(s.ns.clone()),
                ..Query::default()
            },
            everything.to_vec(),
        ),
        (
            "the other namespace",
            Query {
                namespace: Some(s.other.clone()),
                ..Query::default()
            },
            vec!["refund-e0000005"],
        ),
        (
            "run",
            q(|q| q.run = Some("refund".into())),
            vec!["refund-b0000002", "refund-a0000001"],
        ),
        ("run, none", q(|q| q.run = Some("refun".into())), vec![]),
        (
            "outcome",
            q(|q| q.outcome = Some(RunPhase::Succeeded)),
            vec!["report-c0000003", "refund-a0000001"],
        ),
        (
            "outcome Cancelled",
            q(|q| q.outcome = Some(RunPhase::Cancelled)),
            vec!["audit-d0000004"],
        ),
        (
            "requested by",
            q(|q| q.requested_by = Some("alice".into())),
            vec!["report-c0000003", "refund-a0000001"],
        ),
        (
            "requested by bob",
            q(|q| q.requested_by = Some("bob".into())),
            vec!["refund-b0000002"],
        ),
        (
            "since (inclusive)",
            q(|q| q.since = Some(at(20))),
            vec!["audit-d0000004", "refund-b0000002", "report-c0000003"],
        ),
        (
            "until (exclusive)",
            q(|q| q.until = Some(at(20))),
            vec!["refund-a0000001"],
        ),
        (
            "since and until",
            q(|q| {
                q.since = Some(at(15));
                q.until = Some(at(30))
            }),
            vec!["refund-b0000002", "report-c0000003"],
        ),
        // Bounds finer than the microsecond a database keeps.
        (
            "since, half a second after",
            q(|q| q.since = Some(at(20) + SignedDuration::from_millis(500))),
            vec!["audit-d0000004"],
        ),
        (
            "until, a nanosecond after",
            q(|q| q.until = Some(at(20) + SignedDuration::from_nanos(1))),
            vec!["refund-b0000002", "report-c0000003", "refund-a0000001"],
        ),
        (
            "limit",
            q(|q| q.limit = Some(2)),
            vec!["audit-d0000004", "refund-b0000002"],
        ),
        ("limit 0", q(|q| q.limit = Some(0)), vec![]),
        (
            "limit and outcome",
            q(|q| {
                q.limit = Some(1);
                q.outcome = Some(RunPhase::Succeeded)
            }),
            vec!["report-c0000003"],
        ),
        (
            "run and requested by",
            q(|q| {
                q.run = Some("refund".into());
                q.requested_by = Some("alice".into())
            }),
            vec!["refund-a0000001"],
        ),
    ];
    for (what, query, want) in cases {
        assert_eq!(listed(s, query).await, want, "{}: {what}", s.store.kind());
    }
}

async fn get_finds_a_record_by_namespace_and_name_only(s: &Subject) {
    let r = record(&s.ns, "refund", "a0000001", RunPhase::Succeeded, 10);
    s.store.put(&r).await.unwrap();
    assert_eq!(
        s.store.get(&s.ns, "refund-a0000001").await.unwrap(),
        Some(r)
    );
    assert_eq!(s.store.get(&s.ns, "refund-b0000002").await.unwrap(), None);
    assert_eq!(s.store.get(&s.ns, "refund").await.unwrap(), None);
    assert_eq!(
        s.store.get(&s.other, "refund-a0000001").await.unwrap(),
        None
    );
}

/// Per namespace, the records past the cap, as a pruning reports them.
fn over_cap(ns: &str, more: u64) -> BTreeMap<String, u64> {
    BTreeMap::from([(ns.to_owned(), more)])
}

/// D22: the count a namespace is expected to hold never removes a record
/// inside its retention (a flood of cheap runs would otherwise make an old
/// run execute again on its next re-sync); the pruning says how far past it
/// the namespace is.
async fn pruning_removes_what_is_past_the_window_and_only_counts_what_is_past_the_cap(s: &Subject) {
    let ns = s.ns.as_str();
    put_all(
        s,
        &[
            record(ns, "nightly", "10000001", RunPhase::Succeeded, 10),
            record(ns, "nightly", "20000002", RunPhase::Failed, 50),
            // Exactly at the window's edge: kept by age.
            record(ns, "nightly", "30000003", RunPhase::Succeeded, 52),
            record(ns, "nightly", "40000004", RunPhase::Succeeded, 60),
            record(ns, "weekly", "50000005", RunPhase::Succeeded, 90),
            record(ns, "weekly", "60000006", RunPhase::Succeeded, 90),
            // Another namespace: not this store's to prune or count.
            record(&s.other, "nightly", "70000007", RunPhase::Succeeded, 10),
        ],
    )
    .await;
    let now = at(100);
    let keep = Retention {
        max_age: SignedDuration::from_hours(48),
        max_per_namespace: 2,
    };
    let inside = [
        "weekly-50000005",
        "weekly-60000006",
        "nightly-40000004",
        "nightly-30000003",
    ];
    assert_eq!(
        s.store.prune(now, &keep).await.unwrap(),
        Pruned {
            expired: 2,
            over_cap: over_cap(ns, 2),
        },
        "{}",
        s.store.kind()
    );
    assert_eq!(listed(s, Query::default()).await, inside);
    assert_eq!(
        s.store.prune(now, &keep).await.unwrap(),
        Pruned {
            expired: 0,
            over_cap: over_cap(ns, 2),
        },
        "{}: nothing more to remove, the same count past the cap",
        s.store.kind()
    );
    let one = Retention {
        max_per_namespace: 1,
        ..keep
    };
    assert_eq!(
        s.store.prune(now, &one).await.unwrap(),
        Pruned {
            expired: 0,
            over_cap: over_cap(ns, 3),
        }
    );
    assert_eq!(listed(s, Query::default()).await, inside);
    let roomy = Retention {
        max_per_namespace: 4,
        ..keep
    };
    assert_eq!(s.store.prune(now, &roomy).await.unwrap(), Pruned::default());
    let other = Query {
        namespace: Some(s.other.clone()),
        ..Query::default()
    };
    assert_eq!(listed(s, other).await, ["nightly-70000007"]);
}

/// A record that claims to finish in ten years (one written before only the
/// operator could write records) still expires: it counts from when the
/// store took it at the latest, not from the time it claims.
async fn a_record_claiming_a_future_finish_expires_counted_from_when_it_was_stored(s: &Subject) {
    let now = jiff::Timestamp::now();
    let mut future = record(&s.ns, "refund", "f0000001", RunPhase::Succeeded, 0);
    future.outcome.completed_at = Time(now + SignedDuration::from_hours(24 * 3650));
    let mut recent = record(&s.ns, "refund", "f0000002", RunPhase::Succeeded, 0);
    recent.outcome.completed_at = Time(now - SignedDuration::from_hours(1));
    put_all(s, &[future, recent]).await;
    let keep = Retention {
        max_age: SignedDuration::from_hours(48),
        max_per_namespace: 10,
    };
    // Within 48 hours of being stored: kept.
    assert_eq!(
        s.store.prune(now, &keep).await.unwrap(),
        Pruned::default(),
        "{}",
        s.store.kind()
    );
    // 49 hours after it was stored, both are past the window.
    let later = now + SignedDuration::from_hours(49);
    let pruned = s.store.prune(later, &keep).await.unwrap();
    assert_eq!(pruned.expired, 2, "{}: {pruned:?}", s.store.kind());
    assert_eq!(listed(s, Query::default()).await, Vec::<String>::new());
}

async fn find_returns_the_records_of_that_run_name_only(s: &Subject) {
    let ns = s.ns.as_str();
    put_all(
        s,
        &[
            record(ns, "refund", "f1000001", RunPhase::Succeeded, 10),
            record(ns, "refund", "f2000002", RunPhase::Failed, 20),
            record(ns, "refund-x", "f3000003", RunPhase::Succeeded, 30),
            record(ns, "refun", "f4000004", RunPhase::Succeeded, 40),
            record(&s.other, "refund", "f5000005", RunPhase::Succeeded, 50),
        ],
    )
    .await;
    let found = s.store.find(ns, "refund").await.unwrap();
    assert_eq!(names(&found), ["refund-f2000002", "refund-f1000001"]);
    let found = s.store.find(&s.other, "refund").await.unwrap();
    assert_eq!(names(&found), ["refund-f5000005"]);
    assert!(s.store.find(ns, "nothing").await.unwrap().is_empty());
}
