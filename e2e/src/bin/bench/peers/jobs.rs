//! `--peer jobs`: kube-controller-manager's Job controller (the plane's own;
//! its kcm must run `job-controller`, see `AGENTRUN_KCM_ARGS` in e2e/cluster),
//! one chain of single-Pod Jobs per run.
//!
//! ```text
//!   driver ──POST job r-s000──▶ kube-apiserver ◀──watch/write── kube-controller-manager (the plane's)
//!     ▲ watch jobs: r-s<i> Complete ──▶ POST job r-s<i+1>     ◀── simkubelet runs the Pods
//! ```

use std::collections::HashSet;
use std::path::Path;

use agentrun_operator::api::RunPhase;
use agentrun_operator::labels;
use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use serde_json::json;

use super::{Controller, Names};
use crate::error::{BenchError, Res};
use crate::plane::{Setup, create_all, plane_pid, run_name, step_name};
use crate::watch::{Shared, Watch, finish};

fn job_name(run: usize, step: usize) -> String {
    format!("{}-{}", run_name(run), step_name(step))
}

/// One single-Pod Job: step `step` of chain `run`. Its Pod carries the labels
/// simkubelet and this driver's watch look for.
fn job_manifest(run: usize, step: usize) -> Job {
    serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(run, step)},
        "spec": {
            "backoffLimit": 0,
            "completions": 1,
            "parallelism": 1,
            "template": {
                "metadata": {"labels": {
                    labels::RUN: run_name(run),
                    labels::STEP: step_name(step),
                    labels::ATTEMPT: "1",
                }},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "step", "image": "registry.example/agent-step:1"}],
                },
            },
        },
    }))
    .expect("the Job manifest matches the Job type")
}

/// The plane's kube-controller-manager, and the namespace's Jobs.
pub struct JobChains {
    kcm: u32,
    jobs: Api<Job>,
}

impl Controller for JobChains {
    const NAMES: Names = Names {
        namespace: "bench-jobs-",
        run: "Job chain",
        runs: "Job chains",
        steps: "Jobs",
        batch: "Job batch",
    };
    const DESCRIPTION: &'static str = "chains of single-Pod Jobs (controller: kube-controller-manager; \"operator\" columns are its figures, RSS peak sampled every 100 ms; the driver's POST jobs are not counted as the controller's)";
    const OUTLIVES_BATCH: bool = true;

    async fn start(setup: &Setup, ns: &str, _dir: &Path) -> Res<JobChains> {
        let kcm = plane_pid(setup, "kube-controller-manager").ok_or_else(|| {
            BenchError::Stage("no kube-controller-manager pid in the plane's state".into())
        })?;
        Ok(JobChains {
            kcm,
            jobs: Api::namespaced(setup.client.clone(), ns),
        })
    }

    fn pid(&self) -> u32 {
        self.kcm
    }

    /// The chain driver: Job i Complete → create Job i+1; the last one
    /// Complete (or any Failed) → the chain is finished.
    fn follow(&self, watch: &mut Watch, steps: usize) {
        watch.spawn(drive_chains(self.jobs.clone(), watch.shared(), steps));
    }

    /// The first Job of every chain.
    async fn submit(&self, setup: &Setup, n: usize, _steps: usize) -> Res<()> {
        let manifest = |r: usize| job_manifest(r, 0);
        create_all(setup, &self.jobs, n, manifest, |r| {
            format!("Job {}", job_name(r, 0))
        })
        .await
    }

    /// Every write verb on pods (not pods/status, simkubelet's), jobs/status
    /// and events; jobs themselves only for PUT/PATCH (the driver POSTs them).
    fn writes(verb: &str, resource: &str, sub: &str) -> bool {
        match (resource, sub) {
            ("pods", "") | ("jobs", "status") | ("events", "") => true,
            ("jobs", "") => verb != "POST",
            _ => false,
        }
    }
}

async fn drive_chains(jobs: Api<Job>, seen: Shared, steps: usize) {
    let stream = watcher(jobs.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects();
    futures::pin_mut!(stream);
    let mut created: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        let Ok(job) = ev else { continue };
        let cond = |t: &str| {
            job.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == t && c.status == "True"))
        };
        let name = job.name_any();
        let Some((run, step)) = name.rsplit_once("-s") else {
            continue;
        };
        let (Some(r), Ok(i)) = (
            run.strip_prefix('r').and_then(|r| r.parse::<usize>().ok()),
            step.parse::<usize>(),
        ) else {
            continue;
        };
        if cond("Failed") {
            finish(&seen, run, RunPhase::Failed);
        } else if cond("Complete") {
            if i + 1 >= steps {
                finish(&seen, run, RunPhase::Succeeded);
            } else if created.insert(job_name(r, i + 1)) {
                let jobs = jobs.clone();
                tokio::spawn(async move {
                    if let Err(e) = jobs
                        .create(&PostParams::default(), &job_manifest(r, i + 1))
                        .await
                    {
                        eprintln!("[bench] creating Job {}: {e}", job_name(r, i + 1));
                    }
                });
            }
        }
    }
}
