//! `kubectl agentrun logs RUN [STEP]`: the logs of a run's step Pods, every
//! attempt in order, each followed by the model and tool calls it replayed
//! and recorded in its step's journal (D19).

use agentrun_api::labels;
use agentrun_api::{AgentRun, StepJournal, StepRole};
use futures::{AsyncBufReadExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, LogParams};
use kube::{Api, Client, ResourceExt};

use super::style;
use crate::client::{Error, api, journals_of};
use crate::render::journal::{self, attempt_calls};

/// What `logs` shows besides the Pods' logs.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogOptions {
    /// Follow the last Pod's log.
    pub follow: bool,
    /// The journal's responses and errors in full under each call.
    pub responses: bool,
}

pub async fn logs(
    client: &Client,
    ns: &str,
    run: &str,
    step: Option<&str>,
    attempt: Option<i32>,
    opts: LogOptions,
) -> Result<(), Error> {
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods = step_pods(&pods_api, run, step, attempt).await?;
    let r = Api::<AgentRun>::namespaced(client.clone(), ns)
        .get_opt(run)
        .await
        .map_err(api(format!("reading AgentRun {run}")))?;
    let gone = gone_attempts(r.as_ref(), step, attempt, &pods);
    if pods.is_empty() && gone.is_empty() {
        return Err(Error::Refused(format!(
            "run {run} has no step Pods{}; finished runs' Pods go with their TTL",
            step.map(|s| format!(" for step {s}")).unwrap_or_default()
        )));
    }
    let mut calls = Calls {
        run: r,
        chunks: Vec::new(),
        responses: opts.responses,
    };
    calls.read(client, ns).await;
    for g in &gone {
        // Before the Pods of the same step, so attempts read in order.
        println!(
            "==> step {}, attempt {}: its Pod is gone (an evicted or deleted Pod takes its logs with it) <==",
            g.step, g.attempt
        );
        print!("{}", calls.of(&g.step, g.plan_revision, g.attempt));
    }
    if pods.is_empty() {
        return Ok(());
    }
    print_logs(client, ns, &pods, opts.follow, &mut calls).await
}

/// The journal calls of one attempt, printed after its log.
struct Calls {
    run: Option<AgentRun>,
    chunks: Vec<StepJournal>,
    responses: bool,
}

impl Calls {
    /// (Again, after following a log: the step went on recording.)
    async fn read(&mut self, client: &Client, ns: &str) {
        let Some(r) = &self.run else {
            return;
        };
        self.chunks = journals_of(client, ns, r).await.unwrap_or_else(|e| {
            if journal::journaled(r) {
                eprintln!("logs: the steps' journals are not shown: {e}");
            }
            Vec::new()
        });
    }

    fn of(&self, step: &str, plan_revision: i64, attempt: i32) -> String {
        let Some(run) = &self.run else {
            return String::new();
        };
        journal::journals_of(run, &self.chunks)
            .iter()
            .find(|j| j.step == step && j.plan_revision == plan_revision)
            .map(|j| attempt_calls(j, attempt, self.responses, style()))
            .unwrap_or_default()
    }

    /// A step Pod's attempt (verify probes and compensations journal nothing).
    fn of_pod(&self, p: &Pod) -> String {
        let (Ok(rev), Ok(n)) = (
            label(p, labels::PLAN_REVISION).parse::<i64>(),
            label(p, labels::ATTEMPT).parse::<i32>(),
        ) else {
            return String::new();
        };
        if label(p, labels::ROLE) != "step" {
            return String::new();
        }
        self.of(&label(p, labels::STEP), rev, n)
    }
}

/// An attempt whose Pod is gone.
struct Gone {
    step: String,
    plan_revision: i64,
    attempt: i32,
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
fn gone_attempts(
    r: Option<&AgentRun>,
    step: Option<&str>,
    attempt: Option<i32>,
    pods: &[Pod],
) -> Vec<Gone> {
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
                gone.push(Gone {
                    step: cp.name.clone(),
                    plan_revision: cp.plan_revision,
                    attempt: n,
                });
            }
        }
    }
    gone
}

/// Each Pod's log under a header naming it, then its attempt's journal
/// calls; the last one followed if asked.
async fn print_logs(
    client: &Client,
    ns: &str,
    pods: &[Pod],
    follow: bool,
    calls: &mut Calls,
) -> Result<(), Error> {
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
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
            calls.read(client, ns).await;
        } else {
            match pods_api.logs(&name, &LogParams::default()).await {
                Ok(text) => print!("{text}"),
                Err(e) => println!("(no logs: {e})"),
            }
        }
        print!("{}", calls.of_pod(p));
    }
    Ok(())
}
