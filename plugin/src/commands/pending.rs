//! `kubectl agentrun pending`: Approvals that wait for a decision, and which
//! the current user may decide.

use agentrun_api::Approval;
use jiff::Timestamp;
use kube::api::ListParams;
use kube::{Api, Client};

use super::{Output, print_as};
use crate::client::{Error, api, whoami};
use crate::render;

/// `pending`: the approvals that wait, and whether the user may decide each.
pub async fn pending(
    client: &Client,
    ns: &str,
    all_namespaces: bool,
    output: Option<Output>,
) -> Result<(), Error> {
    let now = Timestamp::now();
    let me = whoami(client).await?;
    let apv_api: Api<Approval> = if all_namespaces {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), ns)
    };
    let approvals = apv_api
        .list(&ListParams::default())
        .await
        .map_err(api("listing Approvals"))?
        .items;
    if let Some(o) = output {
        let pending: Vec<&Approval> = approvals.iter().filter(|a| render::is_pending(a)).collect();
        return print_as(o, &pending);
    }
    if !approvals.iter().any(render::is_pending) {
        println!("No Approvals wait for a decision.");
        return Ok(());
    }
    print!("{}", render::pending(&approvals, &me, now, all_namespaces));
    Ok(())
}
