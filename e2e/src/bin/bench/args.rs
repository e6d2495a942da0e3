//! The driver's flags: what to measure, against which peer, with which binaries.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(name = "bench", about = "agentrun-operator cluster benchmark")]
pub struct Args {
    /// Concurrent runs per batch, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,50,200,1000")]
    pub concurrency: Vec<usize>,
    /// Steps per run.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// The batches' runs are a fan-out: every step after the first depends on
    /// the first only, and `spec.parallelism` lets them all run at once (the
    /// status-size run stays a sequence). Compare its steps/s with a run of
    /// the same steps without it.
    #[arg(long, default_value_t = false)]
    pub fan_out: bool,
    /// Repeats of every figure (the table shows medians).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Runs in flight for the resume figure (0 skips it).
    #[arg(long, default_value_t = 1000)]
    pub resume_runs: usize,
    /// Wait for the resumed runs to finish (and count duplicates over their
    /// whole lives) instead of stopping once every run has its next Pod.
    #[arg(long, default_value_t = false)]
    pub resume_finish: bool,
    /// Steps of the run whose status size is measured (0 skips it).
    #[arg(long, default_value_t = 500)]
    pub status_steps: usize,
    /// Bytes of result each step of the status-size run reports (the engine's
    /// unit test uses 1,000-byte results; 0 reports `{}`).
    #[arg(long, default_value_t = 1000)]
    pub status_result_bytes: usize,
    /// Repeats of the status-size run (its size is deterministic; its time is not).
    #[arg(long, default_value_t = 1)]
    pub status_repeats: usize,
    /// A batch that has not finished after this long is aborted.
    #[arg(long, default_value_t = 900)]
    pub deadline_secs: u64,
    /// Parallel creates when submitting runs.
    #[arg(long, default_value_t = 16)]
    pub create_parallelism: usize,
    /// The operator binary (default: target/release/agentrun-operator).
    #[arg(long)]
    pub operator_bin: Option<PathBuf>,
    /// The simkubelet binary (default: target/release/simkubelet).
    #[arg(long)]
    pub simkubelet_bin: Option<PathBuf>,
    /// The control plane's directory (default: $AGENTRUN_E2E_DIR, else target/e2e-bench).
    #[arg(long)]
    pub e2e_dir: Option<PathBuf>,
    /// Also write the summary table (markdown) to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// RUST_LOG for the operator.
    #[arg(long, default_value = "info")]
    pub operator_log: String,
    /// The operator's `--step-events` (an Event per step start and success).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub step_events: bool,
    /// Steps of the status-size run at which the cost of a step is sampled
    /// (the window of `--long-window` steps ending there), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10,100,500")]
    pub long_marks: Vec<usize>,
    /// Steps per sampled window of the status-size run.
    #[arg(long, default_value_t = 10)]
    pub long_window: usize,
    /// Also write every batch's figures as JSON to this file (for tests).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// What runs the batches: `agentrun` (the operator, one AgentRun per
    /// run), `jobs` (kube-controller-manager's Job controller, one chain of
    /// single-Pod Jobs per run, the driver creating Job i+1 once it sees Job i
    /// Complete; the plane's kcm must run `job-controller`, see
    /// `AGENTRUN_KCM_ARGS` in e2e/cluster) or `argo` (Argo Workflows'
    /// workflow-controller, one Workflow of sequential steps per run; built by
    /// `e2e/cluster argo`).
    #[arg(long, value_enum, default_value_t = Peer::Agentrun)]
    pub peer: Peer,
    /// Argo's directory: `workflow-controller` and `crds/` (default:
    /// $AGENTRUN_ARGO_DIR, else the cache's argo-v4.0.5, as `e2e/cluster argo` builds it).
    #[arg(long)]
    pub argo_dir: Option<PathBuf>,
    /// The workflow-controller's client rate limit (`--qps`; Argo's default 20).
    #[arg(long, default_value_t = 20.0)]
    pub argo_qps: f32,
    /// The workflow-controller's client burst (`--burst`; Argo's default 30).
    #[arg(long, default_value_t = 30)]
    pub argo_burst: u32,
    /// The workflow-controller's `DEFAULT_REQUEUE_TIME` (how long a Workflow waits in
    /// its queue after a Pod or task-result event); empty keeps Argo's default (10s).
    #[arg(long, default_value = "")]
    pub argo_requeue_time: String,
    /// A label for this invocation's rows (e.g. the kcm client QPS).
    #[arg(long, default_value = "")]
    pub label: String,
}

/// What runs the batches: one module under `peers/` each, dispatched in
/// `peers/mod.rs`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Agentrun,
    Jobs,
    Argo,
}
