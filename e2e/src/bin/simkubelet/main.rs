//! `simkubelet`: a simulated kubelet for the test control plane, where nothing runs Pods.
//!
//! It watches Pods labelled `agentrun.dev/run` and reports each as a node would, writing
//! only the `status` subresource (strategic merge patch, field manager `simkubelet`):
//!
//! ```text
//!  Pending ──(pendingMs)──▶ Running ──(runMs)──▶ terminated(exitCode, message) ─▶ Succeeded | Failed
//!     │                        │  (hang: stays Running)
//!     └── deletionTimestamp ───┴──────────────▶ terminated(137, Error)          ─▶ Failed
//! ```
//!
//! What a step does comes from the JSON in env `SIM_STEP` of its first container (see
//! e2e/README.md). Each Pod's life is one task keyed by UID; its starting point is derived
//! from the Pod's status, so a restarted simkubelet resumes rather than re-runs. It never
//! deletes Pods and never touches finalizers.
//!
//! With `--argo-task-results` it also plays the `wait` sidecar of an Argo Workflows step
//! Pod (containers `wait` and `main`, for the benchmark's Argo peer): it writes that Pod's
//! `WorkflowTaskResult` as argoexec v4.0.5 does (`workflow/executor/taskresult.go`): created
//! with `report-outputs-completed: "false"` once the Pod runs, then, after `main` exits, a
//! merge patch with the outputs and one setting the label to `"true"`, before the Pod is
//! reported terminated. The step is `main`, not the first container.

#![forbid(unsafe_code)]

mod argo;
mod effects;
mod facts;
mod journal;
mod journal_calls;
mod journal_store;
mod pod;
mod sim_step;
mod status;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentrun_e2e::ledger::{Ledger, LedgerEntry, LedgerError, LedgerWriter};
use agentrun_operator::labels;
use clap::{Parser, ValueEnum};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tracing::{error, info, warn};

use effects::Effects;
use pod::drive;

const FIELD_MANAGER: &str = "simkubelet";
/// Env var (on the first container) describing what the step does.
const SIM_STEP: &str = "SIM_STEP";
/// A kubelet keeps at most this many bytes of a termination message (the file's tail).
const MAX_TERMINATION_MESSAGE: usize = 4096;
/// Exit code of a container killed with SIGKILL.
const SIGKILL_EXIT: i32 = 137;
/// Exit code of a step whose SIM_STEP cannot be understood.
const BAD_SIM_STEP_EXIT: i32 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "simkubelet",
    about = "Drives agentrun step Pods through their lifecycle"
)]
struct Args {
    /// Kubeconfig to use; without it KUBECONFIG, ~/.kube/config or the in-cluster config.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Only drive Pods in this namespace (default: all namespaces).
    #[arg(long)]
    namespace: Option<String>,
    /// Append one JSON line per Pod that reaches Running, and one when it ends.
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// How long a step without `runMs` runs.
    #[arg(long, default_value_t = 100)]
    default_run_ms: u64,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Act as Argo Workflows' `wait` sidecar for Pods that have one: write their
    /// `WorkflowTaskResult` (argoproj.io/v1alpha1) as argoexec does.
    #[arg(long, default_value_t = false)]
    argo_task_results: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("cannot read kubeconfig {path}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("cannot build a client configuration")]
    ClientConfig(#[source] kube::config::KubeconfigError),
    #[error("cannot create the Kubernetes client")]
    Client(#[source] kube::Error),
    #[error("cannot open the ledger")]
    Ledger(#[source] LedgerError),
    #[error("cannot install the log subscriber: {0}")]
    Logging(String),
    #[error("cannot listen for shutdown signals")]
    Signal(#[source] std::io::Error),
}

type Result<T, E = Error> = std::result::Result<T, E>;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Err(e) = init_logging(args.log_format) {
        eprintln!("simkubelet: {e}");
        return std::process::ExitCode::FAILURE;
    }
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let mut chain = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                chain.push_str(": ");
                chain.push_str(&s.to_string());
                source = s.source();
            }
            error!(error = %chain, "simkubelet failed");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    }
    .map_err(|e| Error::Logging(e.to_string()))
}

async fn client(kubeconfig: Option<&PathBuf>) -> Result<Client> {
    let Some(path) = kubeconfig else {
        return Client::try_default().await.map_err(Error::Client);
    };
    let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| Error::Kubeconfig {
        path: path.clone(),
        source,
    })?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(Error::ClientConfig)?;
    Client::try_from(config).map_err(Error::Client)
}

async fn run(args: Args) -> Result<()> {
    let client = client(args.kubeconfig.as_ref()).await?;
    // The ledger exists from the start, empty or not: a reader that finds
    // none has the wrong path, never "nothing ran".
    let ledger = args
        .ledger
        .as_ref()
        .map(LedgerWriter::open)
        .transpose()
        .map_err(Error::Ledger)?;
    // What earlier attempts did, as a restarted simkubelet finds it.
    let effects = match &args.ledger {
        Some(path) => Effects::from_ledger(&Ledger::read(path).map_err(Error::Ledger)?),
        None => Effects::default(),
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        ledger,
        effects,
        default_run: Duration::from_millis(args.default_run_ms),
        argo_task_results: args.argo_task_results,
    });
    let pods: Api<Pod> = match &args.namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    info!(
        namespace = args.namespace.as_deref().unwrap_or("<all>"),
        ledger = ?args.ledger,
        "simkubelet watching Pods labelled {}",
        labels::RUN
    );

    let mut events = watcher::watcher(pods, watcher::Config::default().labels(labels::RUN))
        .default_backoff()
        .boxed();
    let mut dispatcher = Dispatcher::new(ctx);
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(Error::Signal)?;
    loop {
        tokio::select! {
            event = events.next() => match event {
                Some(Ok(event)) => dispatcher.handle(event),
                Some(Err(e)) => warn!(error = %e, "pod watch failed; retrying"),
                None => return Ok(()),
            },
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
        }
    }
    info!("simkubelet stopping; a restart resumes from the Pods' status");
    Ok(())
}

struct Context {
    client: Client,
    ledger: Option<LedgerWriter>,
    /// What the steps changed, for the probes that ask.
    effects: Effects,
    default_run: Duration,
    argo_task_results: bool,
}

impl Context {
    fn record(&self, entry: &LedgerEntry) {
        if let Some(ledger) = &self.ledger
            && let Err(e) = ledger.append(entry)
        {
            // The ledger is the tests' evidence; losing a line must not go unnoticed.
            error!(error = %e, pod = %entry.pod, "cannot append to the ledger");
        }
    }
}

/// Routes watch events to one task per Pod UID. The task learns only whether its Pod is
/// being deleted (a `watch` channel) and, by the channel closing, that the Pod is gone.
struct Dispatcher {
    ctx: Arc<Context>,
    pods: HashMap<String, watch::Sender<bool>>,
    /// UIDs listed since the last `Init`, to drop Pods deleted while the watch was down.
    relisted: Option<HashSet<String>>,
}

impl Dispatcher {
    fn new(ctx: Arc<Context>) -> Self {
        Self {
            ctx,
            pods: HashMap::new(),
            relisted: None,
        }
    }

    fn handle(&mut self, event: Event<Pod>) {
        match event {
            Event::Init => self.relisted = Some(HashSet::new()),
            Event::InitApply(pod) => {
                if let (Some(seen), Some(uid)) = (&mut self.relisted, pod.uid()) {
                    seen.insert(uid);
                }
                self.apply(pod);
            }
            Event::InitDone => {
                if let Some(seen) = self.relisted.take() {
                    self.pods.retain(|uid, _| seen.contains(uid));
                }
            }
            Event::Apply(pod) => self.apply(pod),
            Event::Delete(pod) => {
                if let Some(uid) = pod.uid() {
                    // Dropping the sender tells the task its Pod is gone.
                    self.pods.remove(&uid);
                }
            }
        }
    }

    fn apply(&mut self, mut pod: Pod) {
        let Some(uid) = pod.uid() else {
            warn!(pod = %pod.name_any(), "pod without a uid; ignored");
            return;
        };
        if for_a_real_node(&pod) {
            return;
        }
        let deleting = pod.metadata.deletion_timestamp.is_some();
        if let Some(tx) = self.pods.get(&uid) {
            // Errors only mean the task has finished its work.
            tx.send_if_modified(|d| std::mem::replace(d, deleting) != deleting);
            return;
        }
        pod.metadata.managed_fields = None;
        let (tx, rx) = watch::channel(deleting);
        self.pods.insert(uid, tx);
        tokio::spawn(drive(self.ctx.clone(), pod, rx));
    }
}

/// The taint of the local real node (`e2e/cluster node up`); Pods that tolerate it, or
/// that a scheduler has bound to any node, are a kubelet's, never ours.
const REAL_NODE_TAINT: &str = "agentrun.dev/node";

fn for_a_real_node(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    spec.node_name.as_deref().is_some_and(|n| !n.is_empty())
        || spec
            .tolerations
            .iter()
            .flatten()
            .any(|t| t.key.as_deref() == Some(REAL_NODE_TAINT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn pods_for_the_real_node_are_left_to_its_kubelet() {
        let pod = |spec: Value| -> Pod {
            serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
        };
        let containers = json!([{"name": "step", "image": "i"}]);
        assert!(!for_a_real_node(&pod(json!({"containers": containers}))));
        assert!(!for_a_real_node(&pod(json!({
            "containers": containers,
            "tolerations": [{"key": "other", "operator": "Exists"}],
        }))));
        assert!(for_a_real_node(&pod(json!({
            "containers": containers,
            "tolerations": [{"key": "agentrun.dev/node", "operator": "Exists", "effect": "NoSchedule"}],
        }))));
        assert!(for_a_real_node(&pod(json!({
            "containers": containers, "nodeName": "agentrun-node",
        }))));
    }
}
