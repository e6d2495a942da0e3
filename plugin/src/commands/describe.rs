//! `kubectl agentrun describe RUN`: a readable tree of one run.

use jiff::Timestamp;
use kube::Client;
use serde_json::json;

use super::{Output, print_as, style};
use crate::client::{Error, events_of, journals_of, run_and_approvals, signals_of};
use crate::render;

/// `describe`: one run as a tree, or as JSON/YAML with its approvals,
/// signals and step journals.
pub async fn describe(
    client: &Client,
    ns: &str,
    run: &str,
    full: bool,
    output: Option<Output>,
) -> Result<(), Error> {
    let now = Timestamp::now();
    let (r, approvals) = run_and_approvals(client, ns, run).await?;
    let signals = signals_of(client, ns, &r).await;
    let journals = journals_of(client, ns, &r).await.unwrap_or_else(|e| {
        if render::journal::journaled(&r) {
            eprintln!("describe: the steps' journals are not shown: {e}");
        }
        Vec::new()
    });
    if let Some(o) = output {
        return print_as(
            o,
            &json!({"run": r, "approvals": approvals, "signals": signals, "journals": journals}),
        );
    }
    let events = events_of(client, ns, run).await?;
    let related = render::Related {
        approvals: &approvals,
        signals: &signals,
        journals: &journals,
        events: &events,
    };
    print!("{}", render::describe(&r, &related, now, full, style()));
    Ok(())
}
