//! `kubectl agentrun list`: runs with phase, current step, progress, tokens
//! and what they wait for.

use agentrun_api::{AgentRun, Approval};
use jiff::Timestamp;
use kube::api::ListParams;
use kube::{Api, Client};

use super::{Output, print_as, style};
use crate::client::{Error, api};
use crate::render;

/// `list`: the runs, filtered by phase, with what they wait for.
pub async fn list(
    client: &Client,
    ns: &str,
    all_namespaces: bool,
    phase: Option<&str>,
    selector: Option<&str>,
    output: Option<Output>,
) -> Result<(), Error> {
    let now = Timestamp::now();
    let lp = selector.map_or_else(ListParams::default, |s| ListParams::default().labels(s));
    let (runs_api, apv_api): (Api<AgentRun>, Api<Approval>) = if all_namespaces {
        (Api::all(client.clone()), Api::all(client.clone()))
    } else {
        (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        )
    };
    let mut runs = runs_api
        .list(&lp)
        .await
        .map_err(api("listing AgentRuns"))?
        .items;
    if let Some(p) = phase {
        runs.retain(|r| {
            r.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|x| format!("{x:?}").eq_ignore_ascii_case(p))
        });
    }
    if let Some(o) = output {
        return print_as(o, &runs);
    }
    let approvals = apv_api
        .list(&ListParams::default())
        .await
        .map_err(api("listing Approvals"))?
        .items;
    if runs.is_empty() {
        let scope = if all_namespaces {
            "any namespace".to_owned()
        } else {
            format!("namespace {ns}")
        };
        println!("No AgentRuns in {scope}.");
        return Ok(());
    }
    print!(
        "{}",
        render::list(&runs, &approvals, all_namespaces, now, style())
    );
    Ok(())
}
