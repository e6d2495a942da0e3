//! What only the PostgreSQL store has, against a real PostgreSQL server
//! (`e2e/cluster postgres up`): a connection the server ends is opened again
//! by the next call, TLS verifies the server against the CA given, errors
//! name the database and never the URL's password, the operator does not
//! start when its database cannot be reached, and, with the operator and the
//! simulated kubelet, a run created again after its TTL runs nothing; records
//! of a namespace that is gone are removed. What it shares with the
//! RunRecord store is in tests/history_stores.rs.
//!
//! Fails, never skips, without PostgreSQL (`AGENTRUN_TEST_DATABASE_URL` and
//! `AGENTRUN_TEST_DATABASE_CA`, from `eval "$(e2e/cluster env)"`).

use std::time::Duration;

use agentrun_e2e::ledger::LedgerEvent;
use agentrun_e2e::support::history::{database_url, pg_store, record, unique};
use agentrun_e2e::support::processes::{free_port, operator_binary};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, RunPhase, RunRecord};
use agentrun_operator::history::{self, PgStore, Store};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Api, ResourceExt};
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// `url` with one more `key=value` query parameter.
fn with_param(url: &str, key: &str, value: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{key}={value}")
}

/// A plain session on the test server, beside the store.
async fn admin() -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at AGENTRUN_TEST_DATABASE_URL: {e}"));
    tokio::spawn(conn);
    client
}

async fn sessions(admin: &tokio_postgres::Client, app: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&app],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn postgres_a_connection_the_server_ends_is_opened_again_by_the_next_call() {
    let ns = unique("reconnect");
    let app = unique("agentrun-e2e-reconnect");
    let url = with_param(&database_url(), "application_name", &app);
    let store = Store::Postgres(Box::new(pg_store(&url, &ns).await));
    let r = record(&ns, "refund", "a0000001", RunPhase::Succeeded, 10);
    store.put(&r).await.unwrap();
    let admin = admin().await;
    for wait_until_gone in [false, true] {
        let ended: i64 = admin
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
                &[&app],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(ended, 1, "the store's one session was ended");
        if wait_until_gone {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while sessions(&admin, &app).await > 0 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the session did not end"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(
            store.get(&ns, "refund-a0000001").await.unwrap(),
            Some(r.clone()),
            "the call after the session ended (waited: {wait_until_gone})"
        );
        assert_eq!(sessions(&admin, &app).await, 1, "one new session");
    }
}

const PASSWORD: &str = "s3cr3t-Pa55word";

#[tokio::test]
async fn postgres_errors_name_the_database_and_never_the_password() {
    let port = free_port();
    let cases = [
        (
            format!("postgres://agentrun:{PASSWORD}@127.0.0.1:{port}/history?sslmode=disable"),
            format!(
                "PostgreSQL: connecting to agentrun@127.0.0.1:{port}/history: error connecting to server"
            ),
        ),
        (
            format!("postgres://agentrun:{PASSWORD}@127.0.0.1:port/history"),
            "PostgreSQL: the database URL is not valid: invalid connection string".to_owned(),
        ),
        (
            format!("host=127.0.0.1 port={port} user=agentrun password={PASSWORD} sslmode=require"),
            format!(
                "PostgreSQL: connecting to agentrun@127.0.0.1:{port}/agentrun: error connecting to server"
            ),
        ),
    ];
    for (url, start) in cases {
        let err = PgStore::connect(&url, None, None).await.unwrap_err();
        let (shown, debug) = (err.to_string(), format!("{err:?}"));
        assert!(
            shown.starts_with(&start),
            "{shown}\ndoes not start with\n{start}"
        );
        assert!(
            !shown.contains(PASSWORD) && !debug.contains(PASSWORD),
            "{shown} / {debug}"
        );
    }
}

#[tokio::test]
async fn postgres_tls_verifies_the_server_against_the_ca_given() {
    let ca_path = std::env::var("AGENTRUN_TEST_DATABASE_CA").unwrap_or_else(|_| {
        panic!("AGENTRUN_TEST_DATABASE_CA is not set: eval \"$(e2e/cluster env)\" after `e2e/cluster postgres up`")
    });
    let ca = std::fs::read(&ca_path).unwrap_or_else(|e| panic!("{ca_path}: {e}"));
    let app = unique("agentrun-e2e-tls");
    let url = with_param(
        &database_url().replace("sslmode=disable", "sslmode=require"),
        "application_name",
        &app,
    );
    let ns = unique("tls");
    let store = PgStore::connect(&url, Some(&ca), Some(ns.clone()))
        .await
        .unwrap_or_else(|e| panic!("TLS with the test CA: {e}"));
    let r = record(&ns, "refund", "a0000001", RunPhase::Succeeded, 10);
    let store = Store::Postgres(Box::new(store));
    store.put(&r).await.unwrap();
    let ssl: Option<bool> = admin()
        .await
        .query_one(
            "SELECT bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1",
            &[&app],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ssl, Some(true), "the store's session is encrypted");
    assert_eq!(store.get(&ns, "refund-a0000001").await.unwrap(), Some(r));

    // The system's roots do not include the test CA: the server is refused.
    let err = PgStore::connect(&url, None, None)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("error performing TLS handshake") && err.contains("UnknownIssuer"),
        "{err}"
    );
    // A CA that did not sign the server's certificate: refused too.
    let other_ca = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args([
            "-nodes",
            "-keyout",
            "/dev/null",
            "-days",
            "1",
            "-subj",
            "/CN=another-ca",
        ])
        .output()
        .expect("openssl");
    assert!(
        other_ca.status.success(),
        "{}",
        String::from_utf8_lossy(&other_ca.stderr)
    );
    let err = PgStore::connect(&url, Some(&other_ca.stdout), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");
    // A file that holds no certificate is said to be one.
    let err = PgStore::connect(&url, Some(b"not a certificate"), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the database CA file holds no certificate"),
        "{err}"
    );
}

/// A man in the middle who says the server offers no TLS: it answers a
/// client's SSLRequest with `N` and relays everything else to the test
/// server (port `server`) in the clear. Its port.
async fn tls_stripper(server: u16) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Length 8, code 80877103: PostgreSQL's SSLRequest.
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut first = [0u8; 8];
                if client.read_exact(&mut first).await.is_err() {
                    return;
                }
                let Ok(mut upstream) = tokio::net::TcpStream::connect(("127.0.0.1", server)).await
                else {
                    return;
                };
                let sent = if first == SSL_REQUEST {
                    client.write_all(b"N").await
                } else {
                    upstream.write_all(&first).await
                };
                if sent.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    });
    port
}

/// TLS is required unless the URL says otherwise: through a man in the
/// middle who says the server has no TLS, a URL that names no `sslmode`
/// (either form) is refused, where libpq's default `prefer` would go on in
/// the clear; `sslmode=disable` (the opt-out for a local socket) and an
/// explicit `prefer` still connect.
#[tokio::test]
async fn postgres_without_an_sslmode_refuses_a_server_that_offers_no_tls() {
    let url = database_url();
    let server = url.parse::<tokio_postgres::Config>().unwrap().get_ports()[0];
    let stripper = tls_stripper(server).await;
    let through = url.replace(&format!(":{server}/"), &format!(":{stripper}/"));
    let bare = through.replace("?sslmode=disable", "");
    assert!(
        through != url && !bare.contains("sslmode"),
        "AGENTRUN_TEST_DATABASE_URL is not postgres://…:{server}/…?sslmode=disable: {url}"
    );
    let pairs = format!("host=127.0.0.1 port={stripper} user=postgres dbname=agentrun");
    for refused in [bare.clone(), pairs] {
        let err = PgStore::connect(&refused, None, None)
            .await
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("server does not support TLS"),
            "{refused}: {err}"
        );
    }
    for mode in ["disable", "prefer"] {
        let ns = unique(&format!("no-tls-{mode}"));
        let store = PgStore::connect(&format!("{bare}?sslmode={mode}"), None, Some(ns.clone()))
            .await
            .unwrap_or_else(|e| panic!("sslmode={mode} through the stripper: {e}"));
        let store = Store::Postgres(Box::new(store));
        let r = record(&ns, "refund", "a0000001", RunPhase::Succeeded, 10);
        store.put(&r).await.unwrap();
        assert_eq!(store.get(&ns, "refund-a0000001").await.unwrap(), Some(r));
    }
}

/// A row whose name is not the one the operator gives that run's record
/// (written by hand, or by anyone else holding the database's credentials)
/// is not history: neither found for its run nor got by its name.
#[tokio::test]
async fn postgres_a_row_under_another_name_is_not_history() {
    let ns = unique("renamed");
    let store = Store::Postgres(Box::new(pg_store(&database_url(), &ns).await));
    let r = record(&ns, "refund", "a0000001", RunPhase::Succeeded, 10);
    store.put(&r).await.unwrap();
    assert_eq!(store.find(&ns, "refund").await.unwrap(), vec![r.clone()]);
    let renamed = admin()
        .await
        .execute(
            "UPDATE agentrun_run_records SET name = 'refund-planted' WHERE namespace = $1",
            &[&ns],
        )
        .await
        .unwrap();
    assert_eq!(renamed, 1);
    assert_eq!(store.find(&ns, "refund").await.unwrap(), vec![]);
    assert_eq!(store.get(&ns, "refund-planted").await.unwrap(), None);
}

#[tokio::test]
async fn the_operator_does_not_start_without_its_database() {
    let kubeconfig = agentrun_e2e::kubeconfig();
    let run = |extra: &[&str], env: Option<(&str, String)>| {
        let mut cmd = tokio::process::Command::new(operator_binary());
        cmd.args([
            "run",
            "--history-store",
            "postgres",
            "--metrics-addr",
            "127.0.0.1:0",
            "--health-addr",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("AGENTRUN_HISTORY_DATABASE_URL")
        .env_remove("AGENTRUN_HISTORY_STORE")
        .kill_on_drop(true);
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        async move {
            let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
                .await
                .expect("the operator neither started nor stopped within 60s")
                .expect("running the operator");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out.status, text)
        }
    };
    let (status, out) = run(&[], None).await;
    assert!(!status.success(), "{out}");
    assert!(out.contains("--history-database-url"), "{out}");

    let port = free_port();
    let url = format!("postgres://agentrun:{PASSWORD}@127.0.0.1:{port}/history?sslmode=disable");
    let (status, out) = run(&[], Some(("AGENTRUN_HISTORY_DATABASE_URL", url))).await;
    assert!(!status.success(), "{out}");
    assert!(
        out.contains(&format!(
            "the run history: PostgreSQL: connecting to agentrun@127.0.0.1:{port}/history"
        )),
        "{out}"
    );
    assert!(!out.contains(PASSWORD), "{out}");
}

/// The operator on the PostgreSQL store, end to end: the finished run's
/// record is a row (no RunRecord object), its TTL deletes it, and the same
/// manifest created again runs nothing.
#[tokio::test]
async fn the_operator_on_postgres_recognises_a_run_created_again() {
    let url = database_url();
    let mut s = Scenario::start_without_operator("history-on-postgres").await;
    s.operator_config.extra_env = vec![
        ("AGENTRUN_HISTORY_STORE".into(), "postgres".into()),
        ("AGENTRUN_HISTORY_DATABASE_URL".into(), url.clone()),
    ];
    s.start_operator(None);
    let name = "refund-order-4711";
    let spec = json!({
        "ttlSecondsAfterFinished": 2,
        "steps": [sim_step("refund", "NonIdempotent", json!({"runMs": 50, "result": {"refund": "r-1"}}))],
    });
    let terminal = |r: &AgentRun| phase(r).is_some_and(RunPhase::is_terminal);
    s.create_run(name, spec.clone()).await;
    let first = s.wait_run(name, "finished", RUN_TIMEOUT, terminal).await;
    assert_eq!(
        phase(&first),
        Some(RunPhase::Succeeded),
        "{:#?}",
        first.status
    );
    let first_uid = first.uid().unwrap();
    let record = format!("{name}-{}", &first_uid.replace('-', "")[..8]);
    assert_eq!(status(&first).record.as_deref(), Some(record.as_str()));

    let store = Store::Postgres(Box::new(pg_store(&url, s.namespace()).await));
    let rows = store.find(s.namespace(), name).await.unwrap();
    assert_eq!(rows.len(), 1, "one row for the finished run");
    assert_eq!(rows[0].run.uid, first_uid);
    assert_eq!(rows[0].outcome.phase, RunPhase::Succeeded);
    let objects: Api<RunRecord> = s.env().api();
    assert!(
        objects
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "no RunRecord object"
    );

    // The TTL deletes the run; the same manifest again runs nothing.
    let deadline = tokio::time::Instant::now() + RUN_TIMEOUT;
    while s.runs().get_opt(name).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the TTL did not delete the run"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.create_run(name, spec).await;
    let again = s.wait_run(name, "already ran", RUN_TIMEOUT, terminal).await;
    assert_eq!(
        phase(&again),
        Some(RunPhase::AlreadyRan),
        "{:#?}",
        again.status
    );
    let prior = status(&again).already_ran.expect("names the earlier run");
    assert_eq!(
        (prior.run_uid.as_str(), prior.record.as_str()),
        (first_uid.as_str(), record.as_str())
    );
    let started: Vec<_> = s
        .ledger()
        .entries
        .into_iter()
        .filter(|e| e.event == LedgerEvent::Started)
        .filter_map(|e| e.step)
        .collect();
    assert_eq!(started, ["refund"], "the refund was issued once");
    s.finish().await;
}

/// Records outlive their namespace in PostgreSQL; the operator's sweep
/// (`history::live_namespaces`, then `forget_gone_namespaces`) removes
/// those of a namespace that is gone, or made again under the same name,
/// and keeps those of namespaces that are there or made after the list.
/// Against the real API server's namespaces; each store scoped to one
/// namespace, so the records of tests running beside it are not touched.
#[tokio::test]
async fn postgres_forgets_the_records_of_a_namespace_deleted_or_made_again() {
    let env = agentrun_e2e::TestEnv::new("history-gone-namespace").await;
    let here = env.namespace().to_owned();
    let gone = unique("history-never-made");
    let made = Api::<Namespace>::all(env.client())
        .get_metadata(&here)
        .await
        .unwrap()
        .metadata
        .creation_timestamp
        .expect("a namespace has a creation time")
        .0;
    let now = Timestamp::now();
    let after = |t: Timestamp, secs: i64| Time(t + SignedDuration::from_secs(secs));

    // In the namespace that is here: a run of it, and a run of an earlier
    // namespace of the same name (created before this one was).
    let mut of_this = record(&here, "refund", "b0000001", RunPhase::Succeeded, 10);
    of_this.run.created_at = after(made, 1);
    of_this.outcome.completed_at = after(made, 2);
    let of_an_earlier = record(&here, "refund", "b0000002", RunPhase::Succeeded, 10);
    // In a namespace the list does not show: finished before the list, and
    // finished after it (a namespace made since the list was taken).
    let before_the_list = record(&gone, "refund", "b0000003", RunPhase::Failed, 10);
    let mut after_the_list = record(&gone, "refund", "b0000004", RunPhase::Failed, 10);
    after_the_list.run.created_at = after(now, 3600);
    after_the_list.outcome.completed_at = after(now, 3601);
    let all = [&of_this, &of_an_earlier, &before_the_list, &after_the_list];

    let url = database_url();
    let stores = [
        Store::Postgres(Box::new(pg_store(&url, &here).await)),
        Store::Postgres(Box::new(pg_store(&url, &gone).await)),
    ];
    let store_of = |ns: &str| &stores[usize::from(ns == gone)];
    for r in all {
        store_of(&r.run.namespace).put(r).await.unwrap();
    }

    let live = history::live_namespaces(&env.client(), now).await.unwrap();
    assert_eq!(
        live.created.get(&here),
        Some(&made),
        "the list has this namespace"
    );
    assert!(!live.created.contains_key(&gone));
    let mut removed = 0;
    for store in &stores {
        removed += store.forget_gone_namespaces(&live).await.unwrap();
    }
    assert_eq!(
        removed, 2,
        "the earlier namespace's record and the gone one's"
    );

    for r in all {
        let kept = store_of(&r.run.namespace)
            .get(
                &r.run.namespace,
                &history::record_name(&r.run.name, &r.run.uid),
            )
            .await
            .unwrap()
            .is_some();
        assert_eq!(
            kept,
            !history::of_a_gone_namespace(r, &live),
            "{} in {}: the database and the rule agree",
            r.run.uid,
            r.run.namespace
        );
    }
    let kept_tags: Vec<_> = all
        .iter()
        .filter(|r| !history::of_a_gone_namespace(r, &live))
        .map(|r| &r.run.uid[..8])
        .collect();
    assert_eq!(kept_tags, ["b0000001", "b0000004"]);
    // Again: nothing more to remove.
    let mut again = 0;
    for store in &stores {
        again += store.forget_gone_namespaces(&live).await.unwrap();
    }
    assert_eq!(again, 0);
    env.cleanup().await;
}
