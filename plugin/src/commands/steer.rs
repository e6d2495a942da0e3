//! `kubectl agentrun suspend`, `resume` and `cancel`: one merge patch of the
//! run's spec.

use agentrun_api::AgentRun;
use kube::api::Patch;
use kube::{Api, Client};
use serde_json::json;

use crate::client::{Error, api, patch_params};

pub async fn set_spec(
    client: &Client,
    ns: &str,
    run: &str,
    spec: serde_json::Value,
    done: &str,
) -> Result<(), Error> {
    Api::<AgentRun>::namespaced(client.clone(), ns)
        .patch(run, &patch_params(), &Patch::Merge(&json!({"spec": spec})))
        .await
        .map_err(api(format!("updating AgentRun {run}")))?;
    println!("agentrun {run} {done}");
    Ok(())
}
