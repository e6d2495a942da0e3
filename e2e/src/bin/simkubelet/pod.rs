//! The life of one Pod: where its status says it stands, and the task that
//! drives it from Pending to terminated, writing its status and the ledger.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agentrun_e2e::ledger::Outcome;
use agentrun_operator::api::EffectOutcome;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ContainerStateRunning, Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use crate::argo::{ArgoTask, TaskResultWriter};
use crate::facts::{Ending, PodFacts};
use crate::journal;
use crate::sim_step::{Behaviour, reported_effect, truncate_message};
use crate::status::{running_status, terminated_status};
use crate::{BAD_SIM_STEP_EXIT, Context, FIELD_MANAGER, SIGKILL_EXIT};

/// How long a container that started at `from` ran until `to`.
fn ran(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(to.duration_since(from)).unwrap_or(Duration::ZERO)
}

/// Where a Pod's life stands, as its status shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Pending,
    Running { started_at: Timestamp },
    Terminated,
}

fn observe(pod: &Pod, step_container: usize) -> Stage {
    let status = pod.status.as_ref();
    let step = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.get(step_container))
        .map(|c| c.name.as_str());
    let state = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| Some(c.name.as_str()) == step))
        .and_then(|c| c.state.as_ref());
    if state.is_some_and(|s| s.terminated.is_some()) {
        return Stage::Terminated;
    }
    let terminal_phase = matches!(
        status.and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    // Failed by someone else and not being deleted: nothing left for a kubelet to do.
    if terminal_phase && pod.metadata.deletion_timestamp.is_none() {
        return Stage::Terminated;
    }
    match state.and_then(|s| s.running.as_ref()) {
        Some(ContainerStateRunning {
            started_at: Some(Time(started_at)),
        }) => Stage::Running {
            started_at: *started_at,
        },
        _ => Stage::Pending,
    }
}

/// What the Pod's channel said while we waited.
enum Wake {
    Elapsed,
    Deleting,
    Gone,
}

/// Waits for `delay` (forever if `None`), or until the Pod is being deleted or gone.
async fn wait(rx: &mut watch::Receiver<bool>, delay: Option<Duration>) -> Wake {
    let sleep = async {
        match delay {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleep);
    loop {
        if *rx.borrow_and_update() {
            return Wake::Deleting;
        }
        tokio::select! {
            () = &mut sleep => return Wake::Elapsed,
            changed = rx.changed() => if changed.is_err() { return Wake::Gone },
        }
    }
}

/// The life of one Pod, from wherever its status says it is.
pub(crate) async fn drive(ctx: Arc<Context>, pod: Pod, mut rx: watch::Receiver<bool>) {
    let facts = PodFacts::of(&pod, ctx.default_run, ctx.argo_task_results);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &facts.namespace);
    let task_results = facts.argo.as_ref().map(|task| TaskResultWriter {
        api: Api::namespaced_with(
            ctx.client.clone(),
            &facts.namespace,
            &ArgoTask::api_resource(),
        ),
        task,
        pod: &facts.name,
    });
    let pods = PodWriter {
        api: &api,
        facts: &facts,
    };
    let behaviour = match &facts.behaviour {
        Ok(b) => b.clone(),
        Err(problem) => {
            warn!(pod = %facts.name, namespace = %facts.namespace, %problem, "step fails");
            Behaviour {
                pending: Duration::ZERO,
                run: Duration::ZERO,
                hang: false,
                exit_code: BAD_SIM_STEP_EXIT,
                message: truncate_message(format!("simkubelet: {problem}")),
                act_at: Duration::ZERO,
                probe: None,
                journal: None,
            }
        }
    };
    let had_start_time = pod.status.as_ref().and_then(|s| s.start_time.as_ref());

    let started_at = match observe(&pod, facts.step_container) {
        Stage::Terminated => return,
        Stage::Running { started_at } => {
            debug!(pod = %facts.name, "resuming a running pod");
            started_at
        }
        Stage::Pending => {
            match wait(&mut rx, Some(behaviour.pending)).await {
                Wake::Gone => return,
                Wake::Deleting => {
                    // Deleted before it ever ran: no side effect, no ledger line.
                    let now = Timestamp::now();
                    let status = terminated_status(&facts, None, now, Ending::Killed, None);
                    pods.write(&mut rx, status).await;
                    return;
                }
                Wake::Elapsed => {}
            }
            let now = Timestamp::now();
            let start_time = had_start_time.map(|t| t.0).unwrap_or(now);
            match pods
                .write(&mut rx, running_status(&facts, start_time, now))
                .await
            {
                Written::Yes => {}
                Written::Gone | Written::Rejected => return,
            }
            info!(pod = %facts.name, namespace = %facts.namespace, "running");
            ctx.record(&facts.ledger_entry(now));
            if let Some(w) = &task_results {
                // argoexec wait's InitializeOutput, as the sidecar starts.
                w.create_placeholder(&mut rx).await;
            }
            now
        }
    };

    let run_for = (!behaviour.hang).then(|| {
        let ends = started_at + behaviour.run;
        std::time::Duration::try_from(ends.duration_since(Timestamp::now()))
            .unwrap_or(Duration::ZERO)
    });
    // A journaled loop runs until its last call, and stops where it stands
    // when the Pod is being deleted (the loop's future is dropped).
    let calls_made = AtomicU32::new(0);
    let mut loop_failed = None;
    let wake = match (&behaviour.journal, &facts.journal) {
        (Some(sim), Some(id)) => tokio::select! {
            ran = journal::run(&ctx, &facts, id, sim, &calls_made) => {
                match ran {
                    Ok(ran) => info!(pod = %facts.name, made = calls_made.load(Ordering::SeqCst),
                        replayed = ran.replayed, "journaled loop done"),
                    Err(e) => {
                        warn!(pod = %facts.name, error = %e, "journaled loop stopped");
                        loop_failed = Some(e.to_string());
                    }
                }
                Wake::Elapsed
            }
            wake = wait(&mut rx, None) => wake,
        },
        _ => wait(&mut rx, run_for).await,
    };
    // A journaled attempt acted if it made a call; any other as `facts.acts` says.
    let acts = |ran: Duration, said_not_applied: bool| match &behaviour.journal {
        Some(_) => calls_made.load(Ordering::SeqCst) > 0,
        None => facts.acts(&behaviour, ran, said_not_applied),
    };
    let ending = match wake {
        Wake::Elapsed if loop_failed.is_some() => Ending::Exited(1),
        Wake::Elapsed => Ending::Exited(behaviour.exit_code),
        Wake::Deleting => Ending::Killed,
        Wake::Gone => {
            // Vanished while running (force-deleted): the process died with it.
            info!(pod = %facts.name, namespace = %facts.namespace, "gone while running");
            let now = Timestamp::now();
            let acted = acts(ran(started_at, now), false);
            ctx.effects.record(facts.idempotency_key.as_deref(), acted);
            ctx.record(
                &facts
                    .ledger_entry(started_at)
                    .finished(SIGKILL_EXIT, Outcome::Killed, now)
                    .acting(acted),
            );
            return;
        }
    };
    if let (Some(w), Ending::Exited(_)) = (&task_results, ending) {
        // argoexec wait, once main has exited: ReportOutputs, then FinalizeOutput.
        w.report_outputs(&mut rx).await;
    }
    let finished_at = Timestamp::now();
    let message = match (ending, &behaviour.probe) {
        // A probe reads the effects record as it answers.
        (Ending::Exited(0), Some(result)) => Some(ctx.effects.answer(
            facts.idempotency_key.as_deref(),
            facts.call_key.as_deref(),
            result,
        )),
        // The loop stopped as the SDK stops it: the step fails and says why.
        (Ending::Exited(_), _) if loop_failed.is_some() => Some(truncate_message(
            json!({"result": {}, "error": loop_failed}).to_string(),
        )),
        (Ending::Exited(_), _) => Some(behaviour.message.clone()),
        (Ending::Killed, _) => None,
    };
    // What the step says it did, as the operator will read it from the message.
    let reported = message.as_deref().and_then(reported_effect);
    // The effect happened (or not) before anyone can see the attempt ended.
    let said_not_applied = reported == Some(EffectOutcome::NotApplied);
    let acted = acts(ran(started_at, finished_at), said_not_applied);
    ctx.effects.record(facts.idempotency_key.as_deref(), acted);
    let status = terminated_status(&facts, Some(started_at), finished_at, ending, message);
    let written = pods.write(&mut rx, status).await;
    info!(
        pod = %facts.name,
        namespace = %facts.namespace,
        exit_code = ending.exit_code(),
        ?written,
        "terminated"
    );
    // Gone or not, the step has ended; a rejected write means the Pod is not as we think.
    if written != Written::Rejected {
        let outcome = if written == Written::Gone {
            Outcome::Killed
        } else {
            ending.outcome()
        };
        let exit_code = if written == Written::Gone {
            SIGKILL_EXIT
        } else {
            ending.exit_code()
        };
        let reported = reported.filter(|_| written == Written::Yes);
        ctx.record(
            &facts
                .ledger_entry(started_at)
                .finished(exit_code, outcome, finished_at)
                .reporting(reported)
                .acting(acted),
        );
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Written {
    Yes,
    /// 404, or 409 on the UID precondition: this Pod no longer exists.
    Gone,
    /// The apiserver refused the status (a bug here or an unexpected Pod); logged.
    Rejected,
}

struct PodWriter<'a> {
    api: &'a Api<Pod>,
    facts: &'a PodFacts,
}

impl PodWriter<'_> {
    /// Patches the status, retrying transient errors with a capped backoff for as long as
    /// the Pod exists. The UID in the patch is a precondition: a new Pod of the same name
    /// is not ours.
    async fn write(&self, rx: &mut watch::Receiver<bool>, status: PodStatus) -> Written {
        let patch = json!({
            "metadata": { "uid": self.facts.uid },
            "status": status,
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let mut backoff = Duration::from_millis(50);
        loop {
            match self
                .api
                .patch_status(&self.facts.name, &params, &Patch::Strategic(&patch))
                .await
            {
                Ok(_) => return Written::Yes,
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                    debug!(pod = %self.facts.name, code = s.code, "pod gone");
                    return Written::Gone;
                }
                Err(kube::Error::Api(s))
                    if (400..500).contains(&s.code) && s.code != 429 && s.code != 408 =>
                {
                    error!(pod = %self.facts.name, namespace = %self.facts.namespace,
                        code = s.code, message = %s.message, "status rejected");
                    return Written::Rejected;
                }
                Err(e) => {
                    warn!(pod = %self.facts.name, error = %e, ?backoff, "status write failed; retrying");
                }
            }
            if rx.has_changed().is_err() {
                return Written::Gone;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}
