//! The PostgreSQL store, for teams that keep months of history: one row per
//! finished run in one table, the record as JSONB beside the columns the
//! filters and the retention read.
//!
//! ```text
//!   agentrun_run_records
//!   (namespace, name) ─ primary key: name = record_name(run, uid), as a RunRecord's
//!   run_name, run_uid, outcome, requested_by, completed_at ─ what Query and prune read
//!   recorded_at ─ when the row was written (the database's clock): bounds completed_at
//!   record jsonb ─ the RunRecordSpec, as the API server would store it
//! ```
//!
//! It answers exactly as [`super::ApiStore`] does: the same put (create if
//! absent; the same run's record stands if equal and is replaced if not;
//! another run's is `NameTaken`), the same list ([`Query::arrange`] over
//! rows SQL has filtered, a row whose name is not the record's own left
//! out), the same pruning (by the run's completion, never later than when the
//! row was written; past the count a namespace is expected to hold, only
//! counted). One connection, shared by every caller; one that drops is
//! opened again by the next call. TLS unless the URL says otherwise
//! (`sslmode=require` by default). Messages never carry the URL's password.

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio::sync::Mutex;
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, NoTls, Socket};
use tracing::{debug, info, warn};

use super::{Error, Pruned, Query, Retention, as_stored_by_the_operator, record_name, word};
use agentrun_api::RunRecordSpec;

/// The table, and what it takes to have it: created if absent at every
/// connect, under an advisory lock so two replicas starting together do not
/// race on the catalog.
const SCHEMA: &str = r#"
BEGIN;
SELECT pg_advisory_xact_lock(7310154512883155218);
CREATE TABLE IF NOT EXISTS agentrun_run_records (
    namespace    text        NOT NULL,
    name         text        NOT NULL,
    run_name     text        NOT NULL,
    run_uid      text        NOT NULL,
    outcome      text        NOT NULL,
    requested_by text,
    completed_at timestamptz NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    record       jsonb       NOT NULL,
    PRIMARY KEY (namespace, name)
);
CREATE INDEX IF NOT EXISTS agentrun_run_records_run
    ON agentrun_run_records (namespace, run_name);
CREATE INDEX IF NOT EXISTS agentrun_run_records_completed
    ON agentrun_run_records (completed_at);
COMMIT;
"#;

/// Stores `$1..$8`, or replaces the same run's record when it differs. No
/// row back: the name is held, by this run with the same record or by
/// another run (the caller tells which).
const PUT: &str = "
INSERT INTO agentrun_run_records AS r
    (namespace, name, run_name, run_uid, outcome, requested_by, completed_at, record)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (namespace, name) DO UPDATE SET
    run_name = EXCLUDED.run_name, outcome = EXCLUDED.outcome,
    requested_by = EXCLUDED.requested_by, completed_at = EXCLUDED.completed_at,
    recorded_at = now(), record = EXCLUDED.record
WHERE r.run_uid = EXCLUDED.run_uid AND r.record IS DISTINCT FROM EXCLUDED.record
RETURNING (xmax = 0) AS inserted";

/// Every filter of [`Query`]; a `NULL` parameter admits all. Ordered as
/// [`Query::arrange`] orders (newest first, then the run's name), then by
/// namespace and name as the API server lists (byte order: `COLLATE "C"`),
/// so a limit cuts where it would.
const LIST: &str = r#"
SELECT name, record FROM agentrun_run_records
WHERE ($1::text IS NULL OR namespace = $1)
  AND ($2::text IS NULL OR run_name = $2)
  AND ($3::text IS NULL OR outcome = $3)
  AND ($4::text IS NULL OR requested_by = $4)
  AND ($5::timestamptz IS NULL OR completed_at >= $5)
  AND ($6::timestamptz IS NULL OR completed_at < $6)
ORDER BY completed_at DESC, run_name COLLATE "C", namespace COLLATE "C", name COLLATE "C"
LIMIT $7"#;

/// The records finished before `$2`, as [`super::finished_for_retention`]
/// counts: the finish recorded, never later than when the row was written.
const EXPIRED: &str = "
DELETE FROM agentrun_run_records
WHERE ($1::text IS NULL OR namespace = $1) AND LEAST(completed_at, recorded_at) < $2";

/// Per namespace holding more than `$2` records (after the expired went):
/// how many more. They stay (super::retention).
const OVER_CAP: &str = "
SELECT namespace, count(*) - $2 FROM agentrun_run_records
WHERE ($1::text IS NULL OR namespace = $1)
GROUP BY namespace HAVING count(*) > $2";

/// The records of namespaces that are gone, as [`super::of_a_gone_namespace`]
/// says: `$2` when the list of live namespaces `$3` (created at `$4`) was taken.
const GONE_NAMESPACES: &str = "
DELETE FROM agentrun_run_records AS r
WHERE ($1::text IS NULL OR r.namespace = $1)
  AND COALESCE(
    (SELECT (r.record #>> '{run,createdAt}')::timestamptz < live.created
       FROM unnest($3::text[], $4::timestamptz[]) AS live(namespace, created)
      WHERE live.namespace = r.namespace),
    r.completed_at < $2)";

/// How long a connection may take to open when the URL does not say.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How the connection is made: in the clear (`sslmode=disable`), or with
/// rustls (`require`, the default, insists; `prefer` falls back to the
/// clear when the server offers no TLS), verifying the server's certificate
/// and name against the trusted roots.
#[derive(Clone)]
enum Tls {
    Off,
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

/// Run records in a PostgreSQL table.
pub struct PgStore {
    config: Config,
    tls: Tls,
    /// The one namespace the operator watches, if it watches one: what an
    /// unscoped list shows and what the pruning touches, so releases that
    /// share a database leave each other's records alone.
    namespace: Option<String>,
    /// `None` until the first call, and after a connection closed.
    client: Mutex<Option<Arc<Client>>>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("at", &self.location())
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl PgStore {
    /// Opens the store at `url` (a `postgres://` URL or `key=value` string)
    /// and makes the table if it is not there. `ca_pem`: the only roots
    /// trusted for TLS (the system's otherwise). Fails, saying why, when the
    /// URL is not valid or the database cannot be reached.
    pub async fn connect(
        url: &str,
        ca_pem: Option<&[u8]>,
        namespace: Option<String>,
    ) -> Result<PgStore, Error> {
        let mut config = config_of(url)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("agentrun-operator");
        }
        let tls = match config.get_ssl_mode() {
            SslMode::Disable => Tls::Off,
            _ => Tls::Rustls(tokio_postgres_rustls::MakeRustlsConnect::new(tls_config(
                ca_pem,
            )?)),
        };
        let store = PgStore {
            config,
            tls,
            namespace,
            client: Mutex::new(None),
        };
        store.client().await?;
        Ok(store)
    }

    /// Where the store is, for messages: `user@host:port/dbname`, no password.
    fn location(&self) -> String {
        let host = match self.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            #[cfg(unix)]
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        };
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        format!(
            "{}@{host}:{port}/{}",
            self.config.get_user().unwrap_or_default(),
            self.config
                .get_dbname()
                .or(self.config.get_user())
                .unwrap_or_default()
        )
    }

    /// A database error as a message that names what failed and leaves
    /// out the password, should any part of the chain repeat it.
    fn error(&self, what: &str, e: &tokio_postgres::Error) -> Error {
        let mut message = format!("{what}: {}", chain(e));
        if let Some(pw) = self
            .config
            .get_password()
            .and_then(|p| std::str::from_utf8(p).ok())
            .filter(|p| !p.is_empty())
        {
            message = message.replace(pw, "***");
        }
        Error::Database(message)
    }

    /// The open connection, or a new one (with the table made sure of).
    async fn client(&self) -> Result<Arc<Client>, Error> {
        let mut slot = self.client.lock().await;
        if let Some(client) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(client.clone());
        }
        *slot = None;
        let client = match &self.tls {
            Tls::Off => open(&self.config, NoTls).await,
            Tls::Rustls(tls) => open(&self.config, tls.clone()).await,
        }
        .map_err(|e| self.error(&format!("connecting to {}", self.location()), &e))?;
        client
            .batch_execute(SCHEMA)
            .await
            .map_err(|e| self.error("creating the table agentrun_run_records", &e))?;
        debug!(at = %self.location(), "connected to the run history");
        let client = Arc::new(client);
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Runs `op` on the connection; once more on a new connection when the
    /// one it had turned out closed (a server restart, an idle connection cut
    /// by a proxy). Every operation may run twice: each is idempotent.
    async fn with_client<T, F, Fut>(&self, what: &str, op: F) -> Result<T, Error>
    where
        F: Fn(Arc<Client>) -> Fut,
        Fut: Future<Output = Result<T, tokio_postgres::Error>>,
    {
        let client = self.client().await?;
        match op(client.clone()).await {
            Ok(v) => Ok(v),
            Err(e) if client.is_closed() || connection_lost(&e) => {
                warn!(error = %chain(&e), "the run history's connection closed; opening a new one");
                self.forget(&client).await;
                let client = self.client().await?;
                op(client).await.map_err(|e| self.error(what, &e))
            }
            Err(e) => Err(self.error(what, &e)),
        }
    }

    /// Drops `dead` (if it is still the connection in use), so the next
    /// call opens a new one even before the old one has noticed it closed.
    async fn forget(&self, dead: &Arc<Client>) {
        let mut slot = self.client.lock().await;
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, dead)) {
            *slot = None;
        }
    }

    pub(super) async fn put(&self, record: &RunRecordSpec) -> Result<String, Error> {
        let name = record_name(&record.run.name, &record.run.uid);
        // The record as the API server would keep it (times to the second),
        // so equal means what it means there and the columns say what the
        // stored record says.
        let value =
            serde_json::to_value(record).map_err(|e| Error::Invalid(format!("record: {e}")))?;
        let stored: RunRecordSpec = serde_json::from_value(value.clone())
            .map_err(|e| Error::Invalid(format!("record: {e}")))?;
        let outcome = word(&stored.outcome.phase);
        let completed = stored.outcome.completed_at.0;
        let ns = &stored.run.namespace;
        // A record pruned between the insert that found it and the look that
        // follows: insert again.
        for _ in 0..3 {
            let params: [&(dyn ToSql + Sync); 8] = [
                ns,
                &name,
                &stored.run.name,
                &stored.run.uid,
                &outcome,
                &stored.run.requested_by,
                &completed,
                &value,
            ];
            let written = self
                .with_client("storing a record", |c| async move {
                    c.query_opt(PUT, &params).await
                })
                .await?;
            if let Some(row) = written {
                if !row.get::<_, bool>(0) {
                    // Written by a decision that met a conflict before its
                    // status named the record: what the status is about to
                    // say replaces it.
                    debug!(record = %name, "replaced a record no status named yet");
                }
                return Ok(name);
            }
            let key: [&(dyn ToSql + Sync); 2] = [ns, &name];
            let held = self
                .with_client("reading a record", |c| async move {
                    c.query_opt(
                        "SELECT run_uid FROM agentrun_run_records WHERE namespace = $1 AND name = $2",
                        &key,
                    )
                    .await
                })
                .await?;
            match held {
                Some(row) => {
                    let held_by: String = row.get(0);
                    if held_by == stored.run.uid {
                        return Ok(name);
                    }
                    return Err(Error::NameTaken { name, held_by });
                }
                None => continue,
            }
        }
        Err(Error::Database(format!(
            "record {ns}/{name} was removed each time it was stored"
        )))
    }

    pub(super) async fn list(&self, q: &Query) -> Result<Vec<RunRecordSpec>, Error> {
        let ns = q.namespace.as_ref().or(self.namespace.as_ref());
        let outcome = q.outcome.as_ref().map(word);
        let limit = q.limit.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        let (since, until) = (q.since.map(micros_up), q.until.map(micros_up));
        let params: [&(dyn ToSql + Sync); 7] = [
            &ns,
            &q.run,
            &outcome,
            &q.requested_by,
            &since,
            &until,
            &limit,
        ];
        let rows = self
            .with_client("listing records", |c| async move {
                c.query(LIST, &params).await
            })
            .await?;
        let mut records = Vec::with_capacity(rows.len());
        for row in &rows {
            let name: String = row.get(0);
            records.extend(as_stored_by_the_operator(&name, decode(row.get(1))?));
        }
        Ok(q.arrange(records))
    }

    pub(super) async fn get(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<RunRecordSpec>, Error> {
        let row = self
            .with_client("reading a record", |c| async move {
                c.query_opt(
                    "SELECT record FROM agentrun_run_records WHERE namespace = $1 AND name = $2",
                    &[&namespace, &name],
                )
                .await
            })
            .await?;
        let record = row.map(|r| decode(r.get(0))).transpose()?;
        Ok(record.and_then(|r| as_stored_by_the_operator(name, r)))
    }

    pub(super) async fn forget_gone_namespaces(
        &self,
        live: &super::LiveNamespaces,
    ) -> Result<u64, Error> {
        let ns = self.namespace.as_ref();
        let listed_at = live.listed_at;
        let names: Vec<&str> = live.created.keys().map(String::as_str).collect();
        let created: Vec<Timestamp> = live.created.values().copied().collect();
        let gone = self
            .with_client("removing the records of deleted namespaces", |c| {
                let (names, created) = (&names, &created);
                async move {
                    c.execute(GONE_NAMESPACES, &[&ns, &listed_at, names, created])
                        .await
                }
            })
            .await?;
        if gone > 0 {
            info!(
                records = gone,
                "removed the run records of deleted namespaces"
            );
        }
        Ok(gone)
    }

    pub(super) async fn prune(&self, now: Timestamp, keep: &Retention) -> Result<Pruned, Error> {
        let ns = self.namespace.as_ref();
        let mut pruned = Pruned::default();
        // A window reaching past the first timestamp expires nothing.
        if let Ok(horizon) = now.checked_sub(keep.max_age).map(micros_up) {
            pruned.expired = self
                .with_client("removing expired records", |c| async move {
                    c.execute(EXPIRED, &[&ns, &horizon]).await
                })
                .await?;
        }
        let max = i64::try_from(keep.max_per_namespace).unwrap_or(i64::MAX);
        let over = self
            .with_client("counting records past the cap", |c| async move {
                c.query(OVER_CAP, &[&ns, &max]).await
            })
            .await?;
        for row in over {
            let (namespace, more): (String, i64) = (row.get(0), row.get(1));
            pruned.note_over_cap(&namespace, u64::try_from(more).unwrap_or(0));
        }
        if pruned.expired > 0 {
            info!(
                expired = pruned.expired,
                "removed run records past their retention"
            );
        }
        Ok(pruned)
    }
}

/// The connection `url` describes, with TLS required unless it names an
/// `sslmode` of its own (libpq's default, `prefer`, would fall back to the
/// clear when someone in between says the server has no TLS). The URL is
/// read by tokio-postgres twice: as given, for its errors, and with
/// `sslmode=require` put before its own parameters, where a later `sslmode`
/// of the URL's wins, for the mode.
pub(super) fn config_of(url: &str) -> Result<Config, Error> {
    let invalid = |e: tokio_postgres::Error| {
        Error::Database(format!("the database URL is not valid: {}", chain(&e)))
    };
    let mut config: Config = url.parse().map_err(invalid)?;
    let mode = with_tls_first(url)
        .parse::<Config>()
        .map_or(SslMode::Require, |c| c.get_ssl_mode());
    config.ssl_mode(mode);
    Ok(config)
}

/// `url` with `sslmode=require` as its first parameter: after the `?` of a
/// `postgres://` URL (whose query starts at the first `?` after the
/// credentials, as tokio-postgres reads it), or first of `key=value` pairs.
fn with_tls_first(url: &str) -> String {
    const FIRST: &str = "sslmode=require";
    let Some(prefix) = ["postgres://", "postgresql://"]
        .into_iter()
        .find(|p| url.starts_with(p))
    else {
        return format!("{FIRST} {url}");
    };
    let rest = &url[prefix.len()..];
    let host_at = rest.find('@').map_or(0, |i| i + 1);
    match rest[host_at..].find('?') {
        Some(q) => {
            let at = prefix.len() + host_at + q + 1;
            format!("{}{FIRST}&{}", &url[..at], &url[at..])
        }
        None => format!("{url}?{FIRST}"),
    }
}

/// Connects and hands the connection to a task of its own, which ends when
/// it closes (the client then says `is_closed`).
async fn open<T>(config: &Config, tls: T) -> Result<Client, tokio_postgres::Error>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let (client, connection) = config.connect(tls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            warn!(error = %chain(&e), "the run history's connection ended");
        }
    });
    Ok(client)
}

/// `t` to the microsecond PostgreSQL keeps, rounded up: for a stored time
/// (whole microseconds) `done < t` and `done >= t` then mean in SQL what
/// they mean in [`Query::admits`] and [`super::to_prune`].
fn micros_up(t: Timestamp) -> Timestamp {
    let round = jiff::TimestampRound::new()
        .smallest(jiff::Unit::Microsecond)
        .mode(jiff::RoundMode::Ceil);
    t.round(round).unwrap_or(t)
}

/// Whether `e` says the connection is gone (closed, cut, or ended by the
/// server: a restart, an administrator's pg_terminate_backend) rather than
/// that the statement failed.
fn connection_lost(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    if e.is_closed() {
        return true;
    }
    if let Some(code) = e.code() {
        return [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
        ]
        .contains(code);
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

fn decode(value: serde_json::Value) -> Result<RunRecordSpec, Error> {
    serde_json::from_value(value)
        .map_err(|e| Error::Database(format!("a stored record is not a RunRecord: {e}")))
}

/// The error and what caused it: tokio-postgres says only the kind at the
/// top (`db error`), the server's message below.
fn chain(e: &tokio_postgres::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// rustls with the ring provider (the one the process installs), trusting
/// `ca_pem` only, or the system's roots.
fn tls_config(ca_pem: Option<&[u8]>) -> Result<rustls::ClientConfig, Error> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| {
                    Error::Database(format!("the database CA file is not PEM: {e}"))
                })?;
                roots.add(cert).map_err(|e| {
                    Error::Database(format!("the database CA file holds a bad certificate: {e}"))
                })?;
            }
            if roots.is_empty() {
                return Err(Error::Database(
                    "the database CA file holds no certificate".into(),
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for err in &found.errors {
                debug!(error = %err, "a system root certificate could not be loaded");
            }
            let (added, _) = roots.add_parsable_certificates(found.certs);
            debug!(
                roots = added,
                "trusting the system's roots for the run history"
            );
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Database(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
