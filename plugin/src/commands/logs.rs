//! `kubectl agentrun logs RUN [STEP]`: the logs of a run's step Pods, every
//! attempt in order.

use agentrun_api::labels;
use agentrun_api::{AgentRun, StepRole};
use futures::{AsyncBufReadExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, LogParams};
use kube::{Api, Client, ResourceExt};

use crate::client::{Error, api};

pub async fn logs(
    client: &Client,
    ns: &str,
    run: &str,
    step: Option<&str>,
    attempt: Option<i32>,
    follow: bool,
) -> Result<(), Error> {
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods = step_pods(&pods_api, run, step, attempt).await?;
    let gone = gone_attempts(client, ns, run, step, attempt, &pods).await?;
    if pods.is_empty() && gone.is_empty() {
        return Err(Error::Refused(format!(
            "run {run} has no step Pods{}; finished runs' Pods go with their TTL",
            step.map(|s| format!(" for step {s}")).unwrap_or_default()
        )));
    }
    for (s, n) in &gone {
        // Before the Pods of the same step, so attempts read in order.
        println!(
            "==> step {s}, attempt {n}: its Pod is gone (an evicted or deleted Pod takes its logs with it) <=="
        );
    }
    if pods.is_empty() {
        return Ok(());
    }
    print_logs(&pods_api, &pods, follow).await
}

fn label(p: &Pod, k: &str) -> String {
    p.labels().get(k).cloned().unwrap_or_default()
}

/// The run's step Pods (of `step`, of `attempt`), oldest first.
async fn step_pods(
    pods_api: &Api<Pod>,
    run: &str,
    step: Option<&str>,
    attempt: Option<i32>,
) -> Result<Vec<Pod>, Error> {
    let mut selector = format!("{}={run}", labels::RUN);
    if let Some(s) = step {
        selector.push_str(&format!(",{}={s}", labels::STEP));
    }
    let mut pods = pods_api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(api("listing step Pods"))?
        .items;
    pods.retain(|p| attempt.is_none_or(|a| label(p, labels::ATTEMPT) == a.to_string()));
    pods.sort_by_key(|p| {
        (
            p.metadata.creation_timestamp.as_ref().map(|t| t.0),
            label(p, labels::ATTEMPT).parse::<i32>().unwrap_or(0),
        )
    });
    Ok(pods)
}

/// Every attempt the run recorded, in the order of its checkpoints, whose
/// Pod is not among `pods` (evicted and deleted once its outcome was
/// recorded): named, so the sequence has no silent hole.
async fn gone_attempts(
    client: &Client,
    ns: &str,
    run: &str,
    step: Option<&str>,
    attempt: Option<i32>,
    pods: &[Pod],
) -> Result<Vec<(String, i32)>, Error> {
    let r = Api::<AgentRun>::namespaced(client.clone(), ns)
        .get_opt(run)
        .await
        .map_err(api(format!("reading AgentRun {run}")))?;
    let mut gone = Vec::new();
    for cp in r
        .iter()
        .flat_map(|r| r.status.iter().flat_map(|s| s.steps.iter()))
        .filter(|c| step.is_none_or(|s| c.name == s))
    {
        // The `agentrun.dev/role` label of the attempt's Pods.
        let role = match cp.role {
            StepRole::Step => "step",
            StepRole::Planner => "planner",
            StepRole::Compactor => "compactor",
            StepRole::Verify => "verify",
        };
        for n in (1..=cp.attempt).filter(|n| attempt.is_none_or(|a| a == *n)) {
            let has = pods.iter().any(|p| {
                label(p, labels::STEP) == cp.name
                    && label(p, labels::ATTEMPT) == n.to_string()
                    && label(p, labels::PLAN_REVISION) == cp.plan_revision.to_string()
                    && label(p, labels::ROLE) == role
            });
            if !has {
                gone.push((cp.name.clone(), n));
            }
        }
    }
    Ok(gone)
}

/// Each Pod's log under a header naming it; the last one followed if asked.
async fn print_logs(pods_api: &Api<Pod>, pods: &[Pod], follow: bool) -> Result<(), Error> {
    let last = pods.len() - 1;
    for (i, p) in pods.iter().enumerate() {
        let name = p.name_any();
        println!(
            "==> {name} (step {}, attempt {}, {}) <==",
            label(p, labels::STEP),
            label(p, labels::ATTEMPT),
            label(p, labels::ROLE)
        );
        if follow && i == last {
            let stream = pods_api
                .log_stream(
                    &name,
                    &LogParams {
                        follow: true,
                        ..LogParams::default()
                    },
                )
                .await
                .map_err(api(format!("following the logs of Pod {name}")))?;
            let mut lines = stream.lines();
            while let Some(line) = lines.try_next().await? {
                println!("{line}");
            }
        } else {
            match pods_api.logs(&name, &LogParams::default()).await {
                Ok(text) => print!("{text}"),
                Err(e) => println!("(no logs: {e})"),
            }
        }
    }
    Ok(())
}
