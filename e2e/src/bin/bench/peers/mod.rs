//! The controllers a batch can measure (`--peer`), one module each, and the
//! one batch they all run, so that their figures are taken the same way:
//!
//! ```text
//!   namespace ─▶ simkubelet, Controller::start ─▶ Watch::pods + Controller::follow
//!     ─▶ window opens: apiserver_request_total, CPU of the processes, controller RSS
//!     ─▶ Controller::submit (n runs) … every run seen finished
//!     ─▶ window closes (+1 s for the last writes) ─▶ Controller::stop ─▶ Batch ─▶ teardown
//! ```
//!
//! A peer provides its controller (started per batch, or found on the plane),
//! its runs' manifests and how it sees them finish, and which writes in the
//! window are its controller's ([`Controller::writes`]).

use std::path::Path;
use std::time::{Duration, Instant};

use crate::args::Peer;
use crate::batch::{Batch, Window};
use crate::error::{BenchError, Res, io};
use crate::metrics::{apiserver_requests, writes};
use crate::plane::{
    RssPeak, Setup, cpu_now, cpu_per_step, namespace, processes, rss_kib, start_simkubelet,
    teardown,
};
use crate::watch::Watch;

pub mod agentrun;
pub mod argo;
pub mod jobs;

/// How a peer's batches are named in their namespaces and the driver's messages.
pub struct Names {
    /// The prefix of its batch namespaces (`bench-jobs-` → `bench-jobs-50x10-r1-…`).
    pub namespace: &'static str,
    /// One run and several, as the messages say them ("Job chain", "Job chains").
    pub run: &'static str,
    pub runs: &'static str,
    /// Its steps ("steps", "Jobs").
    pub steps: &'static str,
    /// A batch, in an abort message ("batch", "Job batch").
    pub batch: &'static str,
}

/// What runs a batch's runs: one implementation per module of `peers/`.
pub trait Controller: Sized {
    const NAMES: Names;
    /// The summary's "Peer:" line: the runs, the controller, and how its
    /// figures differ from the operator's.
    const DESCRIPTION: &'static str;
    /// simkubelet's extra flags for this peer's Pods.
    const SIMKUBELET_ARGS: &'static [&'static str] = &[];
    /// The controller outlives the batch (the plane's own), so its VmHWM is
    /// not the batch's: its VmRSS is sampled instead.
    const OUTLIVES_BATCH: bool = false;
    /// Where the controller's `/metrics` of the batch are kept, in the batch's directory.
    const METRICS_FILE: Option<&'static str> = None;

    /// Once before the batches, on the plane (CRDs, binaries).
    async fn prepare(_setup: &Setup) -> Res<()> {
        Ok(())
    }
    /// Starts the controller of namespace `ns` (logs in `dir`) and waits
    /// until it is ready.
    async fn start(setup: &Setup, ns: &str, dir: &Path) -> Res<Self>;
    /// Its process: the "operator" figures of the tables.
    fn pid(&self) -> u32;
    /// Records its runs finished in `watch`: [`Watch::finish_on`] its run
    /// objects, or a task of its own ([`Watch::spawn`]).
    fn follow(&self, watch: &mut Watch, steps: usize);
    /// Creates `n` runs of `steps` steps (the window's clock is running).
    async fn submit(&self, setup: &Setup, n: usize, steps: usize) -> Res<()>;
    /// Whether a write (verb, resource, subresource) in the window is the
    /// controller's; the driver's own creates are not.
    fn writes(verb: &str, resource: &str, sub: &str) -> bool;
    /// Its `/metrics` at the end of the window ("" when it has none to read).
    async fn metrics(&self) -> String {
        String::new()
    }
    /// Stops it (a controller of the plane is left running).
    async fn stop(self) {}
    /// Its own figures of the batch, from its `/metrics`; `created` is how
    /// long the creates took.
    fn figures(_batch: &mut Batch, _metrics: &str, _created: Duration) -> Res<()> {
        Ok(())
    }
}

impl Peer {
    pub async fn prepare(self, setup: &Setup) -> Res<()> {
        match self {
            Peer::Agentrun => agentrun::Operator::prepare(setup).await,
            Peer::Jobs => jobs::JobChains::prepare(setup).await,
            Peer::Argo => argo::WorkflowController::prepare(setup).await,
        }
    }

    pub async fn batch(self, setup: &Setup, n: usize, steps: usize, repeat: usize) -> Res<Batch> {
        match self {
            Peer::Agentrun => batch::<agentrun::Operator>(setup, n, steps, repeat).await,
            Peer::Jobs => batch::<jobs::JobChains>(setup, n, steps, repeat).await,
            Peer::Argo => batch::<argo::WorkflowController>(setup, n, steps, repeat).await,
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Peer::Agentrun => agentrun::Operator::DESCRIPTION,
            Peer::Jobs => jobs::JobChains::DESCRIPTION,
            Peer::Argo => argo::WorkflowController::DESCRIPTION,
        }
    }
}

/// One measured batch: `n` runs of `steps` steps in a fresh namespace, run
/// by controller `C` with simkubelet running the step Pods at 0 ms.
async fn batch<C: Controller>(setup: &Setup, n: usize, steps: usize, repeat: usize) -> Res<Batch> {
    let names = &C::NAMES;
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let (ns, dir) = namespace(setup, &format!("{}{n}x{steps}-r{repeat}", names.namespace)).await?;
    let nsname = ns.name().to_owned();
    eprintln!(
        "[bench] batch {n} {} x {steps} {}, repeat {repeat}: namespace {nsname}",
        names.runs, names.steps
    );
    let mut kubelet = start_simkubelet(setup, &nsname, &dir, C::SIMKUBELET_ARGS)?;
    let controller = match C::start(setup, &nsname, &dir).await {
        Ok(c) => c,
        Err(e) => {
            kubelet.kill().await;
            teardown(setup, ns).await?;
            return Err(e);
        }
    };
    let mut watch = Watch::pods(&setup.client, &nsname);
    controller.follow(&mut watch, steps);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = controller.pid();
    let (rss_idle, _) = rss_kib(pid);

    let before = apiserver_requests(setup).await?;
    let pids = processes(setup, pid, kubelet.pid().unwrap_or(0));
    let cpu_before = cpu_now(&pids);
    let peak = C::OUTLIVES_BATCH.then(|| RssPeak::sample(pid, rss_idle));
    let t0 = Instant::now();
    controller.submit(setup, n, steps).await?;
    let created = t0.elapsed();
    let finished = watch
        .wait(&format!("every {} finished", names.run), deadline, |s| {
            let k = s.finished.len();
            (k < n).then(|| format!("{k}/{n} {} finished", names.runs))
        })
        .await;
    let (rss_end, hwm) = rss_kib(pid);
    let hwm = peak.map_or(hwm, RssPeak::stop);
    let cpu = cpu_per_step(&cpu_before, &pids, n * steps);
    // Let in-flight writes of the last runs (finalizer releases, task-result deletes) land.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = apiserver_requests(setup).await?;
    let metrics = controller.metrics().await;
    let seen = watch.stop();
    controller.stop().await;
    kubelet.kill().await;
    if let Some(file) = C::METRICS_FILE {
        std::fs::write(dir.join(file), &metrics).map_err(io(format!("writing {file}")))?;
    }
    if let Err(e) = finished {
        teardown(setup, ns).await?;
        return Err(BenchError::Stage(format!(
            "{} {n}x{steps} repeat {repeat}: {e} (logs in {})",
            names.batch,
            dir.display()
        )));
    }
    let mut batch = Batch::from(Window {
        runs: n,
        steps,
        repeat,
        wall_s: seen.last_finished_after(t0),
        writes: writes(&before, &after, C::writes),
        before: &before,
        after: &after,
        seen: &seen,
        cpu_ms_per_step: cpu,
        rss_idle_kib: rss_idle,
        rss_end_kib: rss_end,
        hwm_kib: hwm,
    });
    C::figures(&mut batch, &metrics, created)?;
    // The runs, their Pods and whatever else the controller made go with the namespace.
    teardown(setup, ns).await?;
    Ok(batch)
}
