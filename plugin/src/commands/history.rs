//! `kubectl agentrun history [RUN]`: the records finished runs left (D18),
//! read through the same store interface the operator writes them with, so
//! the filters mean the same as the operator's (`history::Query`).
//!
//! ```text
//!   history                 records in the namespace, newest first (a table)
//!   history -A --outcome Failed --since 24h
//!   history refund-4711     each record of that run name, in full
//! ```

use agentrun_history::{ApiStore, PgStore, Query, Store};
use clap::Args;
use jiff::Timestamp;
use kube::Client;

use super::{Output, print_as, style};
use crate::client::Error;
use crate::history_filter::{outcome, since};
use crate::render;

#[derive(Args, Debug, Clone)]
pub struct HistoryArgs {
    /// Only the records of runs of this name, shown in full.
    pub run: Option<String>,
    /// All namespaces.
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,
    /// Only runs that ended so: Succeeded, Failed or Cancelled.
    #[arg(long)]
    pub outcome: Option<String>,
    /// Only runs this user created (as the API server recorded it).
    #[arg(long)]
    pub requested_by: Option<String>,
    /// Only runs that finished within this long (e.g. 24h, 30m), or since
    /// this time (2026-12-01T08:00:00Z) or day (2026-12-01, UTC).
    #[arg(long)]
    pub since: Option<String>,
    /// At most this many records.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Output>,
    /// Read the records from the operator's PostgreSQL store (its
    /// `--history-store postgres`) instead of RunRecords.
    #[arg(long, env = "AGENTRUN_HISTORY_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// The CA that signed the database server's certificate (PEM).
    #[arg(long, requires = "database_url")]
    pub database_ca_file: Option<std::path::PathBuf>,
}

/// The query the arguments ask for, checked before any request. The
/// console's history filters come here too (`console::filter::HistoryFilter`).
pub fn query(args: &HistoryArgs, ns: &str, now: Timestamp) -> Result<Query, Error> {
    let outcome = match args.outcome.as_deref() {
        None => None,
        Some(o) => Some(outcome(o).map_err(|e| Error::Invalid(format!("--outcome {o}: {e}")))?),
    };
    let since = match args.since.as_deref() {
        None => None,
        Some(d) => Some(since(d, now).map_err(|e| Error::Invalid(format!("--since {d}: {e}")))?),
    };
    Ok(Query {
        namespace: (!args.all_namespaces).then(|| ns.to_owned()),
        run: args.run.clone(),
        outcome,
        requested_by: args.requested_by.clone(),
        since,
        until: None,
        limit: args.limit,
    })
}

pub async fn history(client: &Client, ns: &str, args: &HistoryArgs) -> Result<(), Error> {
    let now = Timestamp::now();
    let q = query(args, ns, now)?;
    let store = match &args.database_url {
        None => Store::Api(ApiStore::new(client.clone(), None)),
        Some(url) => {
            let ca = match &args.database_ca_file {
                Some(path) => Some(std::fs::read(path).map_err(|e| {
                    Error::Invalid(format!("--database-ca-file {}: {e}", path.display()))
                })?),
                None => None,
            };
            Store::Postgres(Box::new(
                PgStore::connect(url, ca.as_deref(), None)
                    .await
                    .map_err(|e| Error::Refused(format!("the run history in PostgreSQL: {e}")))?,
            ))
        }
    };
    let records = store.list(&q).await.map_err(|e| {
        Error::Refused(format!(
            "reading the run history ({}{}): {e}",
            store.kind(),
            q.namespace
                .as_deref()
                .map(|n| format!(" in namespace {n}"))
                .unwrap_or_default()
        ))
    })?;
    if let Some(o) = args.output {
        return print_as(o, &records);
    }
    if records.is_empty() {
        let what = match &args.run {
            Some(r) => format!("no record of a run named {r}"),
            None => "no run records".into(),
        };
        let whence = if args.all_namespaces {
            "in any namespace".to_owned()
        } else {
            format!("in namespace {ns}")
        };
        eprintln!(
            "{what} {whence} (a run is recorded when it finishes; records are kept for the operator's --history-retention)"
        );
        return Ok(());
    }
    let style = style();
    match &args.run {
        Some(_) => {
            let text: Vec<String> = records
                .iter()
                .map(|r| render::record_detail(r, now, style))
                .collect();
            print!("{}", text.join("\n"));
        }
        None => print!(
            "{}",
            render::history_table(&records, args.all_namespaces, now)
        ),
    }
    Ok(())
}
