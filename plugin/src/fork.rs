//! The fork a retry makes of a finished run at a step (docs/recover.md), for
//! `kubectl agentrun retry` and the console's retry alike. The plan of what the fork keeps and runs is the
//! operator's own (`engine::fork::fork_plan`), so `--dry-run` shows exactly
//! what the operator will do with it.

use agentrun_api::{AgentRun, CheckpointState, ForkSource, RunPhase, StepPhase};
use agentrun_engine::fork::{ForkPlan, fork_plan};
use jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

use crate::client::{Error, api};

/// What a retry asks for, from the CLI's flags or the console's form.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Retry {
    /// The step the new run starts from; none: [`default_from`].
    pub from: Option<String>,
    /// `spec.forkOf.rerunActed`: steps that acted in the source run again.
    pub rerun_acted: bool,
    /// The new run's name; none: `RUN-retry-<random>`.
    pub name: Option<String>,
}

/// The step a retry starts from when none is named: the first step of the
/// plan whose newest checkpoint is not committed.
pub fn default_from(source: &AgentRun) -> Option<String> {
    let status = source.status.as_ref()?;
    source
        .spec
        .steps
        .iter()
        .find(|s| {
            !status.steps.iter().any(|c| {
                c.role.is_step()
                    && c.name == s.name
                    && c.phase == StepPhase::Succeeded
                    && c.checkpoint == CheckpointState::Committed
            })
        })
        .map(|s| s.name.clone())
}

/// Why `source` cannot be retried now, if it cannot: it has not ended, or it
/// ran nothing (an earlier run's re-creation, D18).
pub fn not_retryable(source: &AgentRun) -> Option<String> {
    let name = source.metadata.name.as_deref().unwrap_or_default();
    let phase = source.status.as_ref().and_then(|s| s.phase);
    if phase == Some(RunPhase::AlreadyRan) {
        let earlier = source
            .status
            .as_ref()
            .and_then(|s| s.already_ran.as_ref())
            .map_or_else(
                || "an earlier run".to_owned(),
                |a| format!("the earlier run recorded in {} ({})", a.record, a.outcome),
            );
        return Some(format!(
            "run {name} ran nothing: it is {earlier}, created again; to run it again, \
             create it with a new agentrun.dev/rerun annotation"
        ));
    }
    (!phase.is_some_and(RunPhase::is_terminal)).then(|| {
        format!(
            "run {name} is {}: only a Failed, Cancelled or Succeeded run can be retried; cancel it first",
            phase.map_or("not started".to_owned(), |p| format!("{p:?}"))
        )
    })
}

/// The fork of `source` that `retry` asks for, as the object to create.
pub fn fork_of(source: &AgentRun, retry: &Retry) -> Result<AgentRun, Error> {
    let name = source.metadata.name.clone().unwrap_or_default();
    if let Some(why) = not_retryable(source) {
        return Err(Error::Refused(why));
    }
    let from = match &retry.from {
        Some(f) => f.clone(),
        None => default_from(source).ok_or_else(|| {
            Error::Usage(format!(
                "every step of run {name} succeeded: say where to start with --from STEP"
            ))
        })?,
    };
    let mut spec = source.spec.clone();
    spec.cancel = false;
    spec.suspend = false;
    spec.fork_of = Some(Box::new(ForkSource {
        run_name: name.clone(),
        run_uid: source.metadata.uid.clone().unwrap_or_default(),
        from_step: from,
        rerun_acted: retry.rerun_acted,
    }));
    let metadata = ObjectMeta {
        name: retry.name.clone(),
        generate_name: retry.name.is_none().then(|| format!("{name}-retry-")),
        namespace: source.metadata.namespace.clone(),
        labels: source.metadata.labels.clone(),
        ..ObjectMeta::default()
    };
    Ok(AgentRun {
        metadata,
        spec,
        status: None,
    })
}

/// The fork and the operator's own plan for it as of `now`, or why the
/// operator would refuse it (the engine's reason, word for word).
pub fn plan(
    source: &AgentRun,
    retry: &Retry,
    now: Timestamp,
) -> Result<(AgentRun, ForkPlan), Error> {
    let fork = fork_of(source, retry)?;
    let plan = fork_plan(Some(source), &fork.spec, now)
        .map_err(|e| Error::Refused(e.message().to_owned()))?;
    Ok((fork, plan))
}

/// What `kubectl agentrun retry --dry-run` prints, and the console's
/// preview shows: the plan of the fork `retry` asks for, or why not.
pub fn preview(source: &AgentRun, retry: &Retry, now: Timestamp) -> Result<String, Error> {
    let (fork, plan) = plan(source, retry, now)?;
    Ok(render_plan(&fork, &plan))
}

/// What `--dry-run` prints: the operator's plan for the fork.
pub fn render_plan(fork: &AgentRun, plan: &ForkPlan) -> String {
    let f = fork.spec.fork_of.as_ref().expect("a fork");
    let mut out = format!(
        "Retry of run {} from step {} (dry run: nothing created)\n",
        f.run_name, f.from_step
    );
    let list = |v: &[String]| {
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.join(", ")
        }
    };
    out.push_str(&format!(
        "  Kept (carried over): {}\n",
        list(&plan.inherited)
    ));
    out.push_str(&format!("  Runs again:          {}\n", list(&plan.runs)));
    let mut asks: Vec<String> = plan.gated.iter().map(|s| format!("{s} (gate)")).collect();
    asks.extend(
        plan.acts_again
            .iter()
            .map(|s| format!("{s} (acted in {}: acts a second time)", f.run_name)),
    );
    out.push_str(&format!("  Asks a person:       {}\n", list(&asks)));
    let carried: i64 = plan
        .checkpoints
        .iter()
        .filter(|c| c.phase == StepPhase::Succeeded)
        .filter_map(|c| c.tokens.as_ref())
        .map(|t| t.total())
        .sum();
    let limit = fork.spec.budget.as_ref().and_then(|b| b.tokens);
    // The kept steps' tokens were spent (and counted) in the source run; the
    // new run's budget counts what the new run spends.
    out.push_str(&format!(
        "  Budget:              {} for the steps that run ({carried} tokens were spent on the kept steps in {})\n",
        limit.map_or("no token limit".to_owned(), |l| format!("{l} tokens")),
        f.run_name
    ));
    out
}

/// Reads the run to retry, as the caller.
pub async fn source(client: &Client, ns: &str, run: &str) -> Result<AgentRun, Error> {
    Api::<AgentRun>::namespaced(client.clone(), ns)
        .get(run)
        .await
        .map_err(api(format!("reading AgentRun {run}")))
}

/// Creates the fork `retry` asks for as the caller, once the operator's
/// plan for it holds: the new run and that plan.
pub async fn create(
    client: &Client,
    source: &AgentRun,
    retry: &Retry,
    now: Timestamp,
) -> Result<(AgentRun, ForkPlan), Error> {
    let (fork, plan) = plan(source, retry, now)?;
    let ns = source.metadata.namespace.clone().unwrap_or_default();
    let created = Api::<AgentRun>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &fork)
        .await
        .map_err(api(format!(
            "creating the retry of AgentRun {}",
            source.metadata.name.as_deref().unwrap_or_default()
        )))?;
    Ok((created, plan))
}

/// What `retry` says of the run it created.
pub fn created_line(created: &AgentRun, plan: &ForkPlan) -> String {
    let f = created.spec.fork_of.as_ref();
    format!(
        "agentrun {} created: a retry of {} from step {} (kept: {}; runs: {})",
        created.metadata.name.as_deref().unwrap_or_default(),
        f.map_or("", |f| f.run_name.as_str()),
        f.map_or("", |f| f.from_step.as_str()),
        if plan.inherited.is_empty() {
            "nothing".to_owned()
        } else {
            plan.inherited.join(", ")
        },
        plan.runs.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use agentrun_api::{AgentRunSpec, AgentRunStatus, StepCheckpoint, StepContainer, StepSpec};

    use super::*;

    fn source(phase: RunPhase, done: &[&str]) -> AgentRun {
        let step = |n: &str| StepSpec {
            name: n.into(),
            container: Some(StepContainer {
                image: "x".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut run = AgentRun::new(
            "order",
            AgentRunSpec {
                steps: vec![step("quote"), step("charge"), step("ship")],
                cancel: true,
                ..Default::default()
            },
        );
        run.metadata.uid = Some("u-1".into());
        run.status = Some(AgentRunStatus {
            phase: Some(phase),
            steps: done
                .iter()
                .map(|n| StepCheckpoint {
                    name: (*n).into(),
                    plan_revision: 1,
                    phase: StepPhase::Succeeded,
                    checkpoint: CheckpointState::Committed,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        });
        run
    }

    fn args(from: Option<&str>) -> Retry {
        Retry {
            from: from.map(Into::into),
            ..Retry::default()
        }
    }

    /// A run recognised as one that already ran (D18) ran nothing: a fork of
    /// it would carry nothing and run every step again under new keys. The
    /// refusal names the earlier run's record and how to run it again.
    #[test]
    fn a_run_that_already_ran_is_not_retried() {
        let mut run = source(RunPhase::AlreadyRan, &[]);
        if let Some(st) = run.status.as_mut() {
            st.already_ran = Some(Box::new(agentrun_api::AlreadyRan {
                record: "order-1a2b3c4d".into(),
                run_uid: "1a2b3c4d-0000".into(),
                outcome: "Succeeded".into(),
                completed_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    "2026-12-01T00:00:00Z".parse().unwrap(),
                ),
            }));
        }
        let why = not_retryable(&run).expect("refused");
        assert_eq!(
            why,
            "run order ran nothing: it is the earlier run recorded in order-1a2b3c4d (Succeeded), \
             created again; to run it again, create it with a new agentrun.dev/rerun annotation"
        );
        assert!(matches!(fork_of(&run, &args(None)), Err(Error::Refused(_))));
    }

    #[test]
    fn a_retry_starts_from_the_first_step_that_did_not_succeed() {
        let fork = fork_of(&source(RunPhase::Failed, &["quote"]), &args(None)).unwrap();
        let f = fork.spec.fork_of.unwrap();
        assert_eq!(
            (
                f.run_name.as_str(),
                f.run_uid.as_str(),
                f.from_step.as_str()
            ),
            ("order", "u-1", "charge")
        );
        assert!(
            !fork.spec.cancel,
            "a cancelled run's retry is not cancelled"
        );
        assert_eq!(fork.metadata.generate_name.as_deref(), Some("order-retry-"));
    }

    #[test]
    fn only_a_finished_run_is_retried_and_a_succeeded_one_needs_from() {
        let e = fork_of(&source(RunPhase::Running, &[]), &args(None)).unwrap_err();
        assert!(
            e.to_string()
                .contains("only a Failed, Cancelled or Succeeded run"),
            "{e}"
        );
        let all = source(RunPhase::Succeeded, &["quote", "charge", "ship"]);
        let e = fork_of(&all, &args(None)).unwrap_err();
        assert!(e.to_string().contains("--from STEP"), "{e}");
        assert!(fork_of(&all, &args(Some("ship"))).is_ok());
    }
}
