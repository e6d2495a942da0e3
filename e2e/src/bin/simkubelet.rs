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

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentrun_e2e::ledger::{LedgerEntry, LedgerError, LedgerEvent, LedgerWriter, Outcome};
use agentrun_operator::labels;
use clap::{Parser, ValueEnum};
use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, Pod,
    PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

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
    let ledger = args
        .ledger
        .as_ref()
        .map(LedgerWriter::open)
        .transpose()
        .map_err(Error::Ledger)?;
    let ctx = Arc::new(Context {
        client: client.clone(),
        ledger,
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

/// What the step does, from `SIM_STEP` (camelCase JSON). Unknown fields are an error so a
/// typo in a test fails loudly instead of silently running the default.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SimStep {
    pending_ms: Option<u64>,
    run_ms: Option<u64>,
    #[serde(default)]
    exit_code: i32,
    result: Option<Value>,
    tokens: Option<Value>,
    plan: Option<Value>,
    summary: Option<Value>,
    /// The termination message's `effect` (`NotApplied`: the attempt says it did not act).
    effect: Option<Value>,
    raw_message: Option<String>,
    #[serde(default)]
    hang: bool,
    /// Per-attempt behaviour: attempt N uses entry N-1, the last entry repeats.
    attempts: Option<Vec<SimStep>>,
    /// Per-run behaviour: the entry for the Pod's run (label `agentrun.dev/run`)
    /// replaces the rest, so a retried run (`kubectl agentrun retry`, the same
    /// spec) can do what its source did not.
    runs: Option<std::collections::BTreeMap<String, SimStep>>,
}

/// One attempt's behaviour, resolved.
#[derive(Clone, Debug, PartialEq)]
struct Behaviour {
    pending: Duration,
    run: Duration,
    hang: bool,
    exit_code: i32,
    message: String,
}

impl SimStep {
    fn parse(json: &str) -> std::result::Result<SimStep, String> {
        serde_json::from_str(json).map_err(|e| format!("invalid {SIM_STEP}: {e}"))
    }

    /// The entry for the run `run`, if `runs` has one; else this.
    fn for_run(self, run: Option<&str>) -> std::result::Result<SimStep, String> {
        let Some(runs) = &self.runs else {
            return Ok(self);
        };
        match run.and_then(|r| runs.get(r)) {
            Some(chosen) if chosen.runs.is_some() => {
                Err(format!("{SIM_STEP}.runs entries cannot nest runs"))
            }
            Some(chosen) => Ok(chosen.clone()),
            None => Ok(SimStep { runs: None, ..self }),
        }
    }

    /// The entry for `attempt` (from 1): `attempts[attempt-1]`, the last one repeating.
    fn for_attempt(self, attempt: u32) -> std::result::Result<SimStep, String> {
        let Some(attempts) = self.attempts else {
            return Ok(self);
        };
        let index = (attempt.max(1) - 1) as usize;
        let chosen = attempts
            .get(index)
            .or(attempts.last())
            .cloned()
            .ok_or_else(|| format!("{SIM_STEP}.attempts is empty"))?;
        if chosen.attempts.is_some() {
            return Err(format!("{SIM_STEP}.attempts entries cannot nest attempts"));
        }
        Ok(chosen)
    }

    fn behaviour(&self, default_run: Duration) -> Behaviour {
        Behaviour {
            pending: Duration::from_millis(self.pending_ms.unwrap_or(0)),
            run: self
                .run_ms
                .map(Duration::from_millis)
                .unwrap_or(default_run),
            hang: self.hang,
            exit_code: self.exit_code,
            message: truncate_message(self.message()),
        }
    }

    /// The termination message the step writes.
    fn message(&self) -> String {
        if let Some(raw) = &self.raw_message {
            return raw.clone();
        }
        let mut message = Map::new();
        message.insert(
            "result".into(),
            self.result.clone().unwrap_or_else(|| json!({})),
        );
        for (name, value) in [
            ("tokens", &self.tokens),
            ("plan", &self.plan),
            ("summary", &self.summary),
            ("effect", &self.effect),
        ] {
            if let Some(value) = value {
                message.insert(name.into(), value.clone());
            }
        }
        Value::Object(message).to_string()
    }
}

/// Keeps the last [`MAX_TERMINATION_MESSAGE`] bytes, as a kubelet reads the file's tail.
fn truncate_message(mut message: String) -> String {
    if message.len() <= MAX_TERMINATION_MESSAGE {
        return message;
    }
    let mut start = message.len() - MAX_TERMINATION_MESSAGE;
    while !message.is_char_boundary(start) {
        start += 1;
    }
    message.drain(..start);
    message
}

/// The facts of one Pod that do not change over its life (its spec and labels).
#[derive(Clone, Debug)]
struct PodFacts {
    name: String,
    namespace: String,
    uid: String,
    generation: Option<i64>,
    run: Option<String>,
    step: Option<String>,
    role: Option<String>,
    idempotency_key: Option<String>,
    attempt: Option<u32>,
    /// (name, image) of every regular container.
    containers: Vec<(String, String)>,
    /// Index in `containers` of the step: the first, or Argo's `main`.
    step_container: usize,
    /// Names of the init containers (they have run to completion once the Pod runs).
    init_containers: Vec<(String, String)>,
    /// The task result this Pod's Argo `wait` sidecar writes (`--argo-task-results`).
    argo: Option<ArgoTask>,
    behaviour: std::result::Result<Behaviour, String>,
}

impl PodFacts {
    fn of(pod: &Pod, default_run: Duration, argo_task_results: bool) -> Self {
        let labels = pod.labels();
        let containers: Vec<(String, String)> = pod
            .spec
            .as_ref()
            .map(|s| {
                s.containers
                    .iter()
                    .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let init_containers: Vec<(String, String)> = pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .map(|cs| {
                cs.iter()
                    .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let argo = argo_task_results.then(|| ArgoTask::of(pod)).flatten();
        let step_container = step_container(pod, argo.is_some());
        let env = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.get(step_container))
            .and_then(|c| c.env.as_ref());
        let env_value = |name: &str| {
            env.and_then(|env| env.iter().find(|e| e.name == name))
                .map(|e| e.value.clone())
        };
        let attempt = env_value(labels::env::ATTEMPT)
            .flatten()
            .or_else(|| labels.get(labels::ATTEMPT).cloned())
            .and_then(|a| a.trim().parse::<u32>().ok());
        let idempotency_key = pod
            .annotations()
            .get(labels::IDEMPOTENCY_KEY)
            .cloned()
            .or_else(|| env_value(labels::env::IDEMPOTENCY_KEY).flatten());
        let behaviour = match env_value(SIM_STEP) {
            None => Ok(SimStep::default()),
            Some(None) => Err(format!("{SIM_STEP} must be a literal value")),
            Some(Some(json)) => SimStep::parse(&json),
        }
        .and_then(|s| s.for_run(labels.get(labels::RUN).map(String::as_str)))
        .and_then(|s| s.for_attempt(attempt.unwrap_or(1)))
        .map(|s| s.behaviour(default_run));
        Self {
            name: pod.name_any(),
            namespace: pod.namespace().unwrap_or_default(),
            uid: pod.uid().unwrap_or_default(),
            generation: pod.metadata.generation,
            run: labels.get(labels::RUN).cloned(),
            step: labels.get(labels::STEP).cloned(),
            role: labels.get(labels::ROLE).cloned(),
            idempotency_key,
            attempt,
            containers,
            step_container,
            init_containers,
            argo,
            behaviour,
        }
    }

    fn ledger_entry(&self, started_at: Timestamp) -> LedgerEntry {
        LedgerEntry {
            event: LedgerEvent::Started,
            pod: self.name.clone(),
            namespace: self.namespace.clone(),
            uid: self.uid.clone(),
            run: self.run.clone(),
            step: self.step.clone(),
            idempotency_key: self.idempotency_key.clone(),
            attempt: self.attempt,
            role: self.role.clone(),
            started_at,
            exit_code: None,
            outcome: None,
            finished_at: None,
            reported_effect: None,
        }
    }
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

/// How a step ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// The step exited by itself with this code.
    Exited(i32),
    /// Killed (SIGKILL) because the Pod is being deleted.
    Killed,
}

impl Ending {
    fn exit_code(self) -> i32 {
        match self {
            Ending::Exited(code) => code,
            Ending::Killed => SIGKILL_EXIT,
        }
    }

    fn outcome(self) -> Outcome {
        match self {
            Ending::Exited(0) => Outcome::Succeeded,
            Ending::Exited(_) => Outcome::Failed,
            Ending::Killed => Outcome::Killed,
        }
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
async fn drive(ctx: Arc<Context>, pod: Pod, mut rx: watch::Receiver<bool>) {
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
    let ending = match wait(&mut rx, run_for).await {
        Wake::Elapsed => Ending::Exited(behaviour.exit_code),
        Wake::Deleting => Ending::Killed,
        Wake::Gone => {
            // Vanished while running (force-deleted): the process died with it.
            info!(pod = %facts.name, namespace = %facts.namespace, "gone while running");
            ctx.record(&facts.ledger_entry(started_at).finished(
                SIGKILL_EXIT,
                Outcome::Killed,
                Timestamp::now(),
            ));
            return;
        }
    };
    if let (Some(w), Ending::Exited(_)) = (&task_results, ending) {
        // argoexec wait, once main has exited: ReportOutputs, then FinalizeOutput.
        w.report_outputs(&mut rx).await;
    }
    let finished_at = Timestamp::now();
    let message = match ending {
        Ending::Exited(_) => Some(behaviour.message.clone()),
        Ending::Killed => None,
    };
    // What the step says it did, as the operator will read it from the message.
    let reported = message.as_deref().and_then(reported_effect);
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
                .reporting(reported),
        );
    }
}

/// The `effect` a termination message reports, if it is one the step contract knows.
fn reported_effect(message: &str) -> Option<agentrun_operator::api::EffectOutcome> {
    let value: Value = serde_json::from_str(message).ok()?;
    serde_json::from_value(value.get("effect")?.clone()).ok()
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

// ---------------------------------------------------------------------------
// Argo Workflows' wait sidecar (`--argo-task-results`)

/// Argo's container names (`workflow/common`): the step and its sidecar.
const ARGO_MAIN: &str = "main";
const ARGO_WAIT: &str = "wait";
/// Labels and the annotation argoexec and the controller use.
const ARGO_LABEL_WORKFLOW: &str = "workflows.argoproj.io/workflow";
const ARGO_LABEL_OUTPUTS_COMPLETED: &str = "workflows.argoproj.io/report-outputs-completed";
const ARGO_ANNOTATION_NODE_ID: &str = "workflows.argoproj.io/node-id";

/// Which container is the step: Argo's `main` when this Pod is an Argo step, else the first.
fn step_container(pod: &Pod, argo: bool) -> usize {
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice());
    argo.then(|| containers?.iter().position(|c| c.name == ARGO_MAIN))
        .flatten()
        .unwrap_or(0)
}

/// What the `wait` sidecar of an Argo step Pod knows: the controller hands it the node ID,
/// the Workflow's name and UID in its env (`ARGO_NODE_ID`, `ARGO_WORKFLOW_NAME`,
/// `ARGO_WORKFLOW_UID`); the node-id annotation, the workflow label and the Pod's owner are
/// the same facts on the Pod itself.
#[derive(Clone, Debug, PartialEq)]
struct ArgoTask {
    node_id: String,
    workflow: String,
    workflow_uid: String,
}

impl ArgoTask {
    /// `None` for a Pod without Argo's `wait` and `main` containers.
    fn of(pod: &Pod) -> Option<Self> {
        let spec = pod.spec.as_ref()?;
        let wait = spec.containers.iter().find(|c| c.name == ARGO_WAIT)?;
        spec.containers.iter().find(|c| c.name == ARGO_MAIN)?;
        let env = |name: &str| {
            wait.env
                .iter()
                .flatten()
                .find(|e| e.name == name)
                .and_then(|e| e.value.clone())
        };
        let owner = pod
            .owner_references()
            .iter()
            .find(|o| o.kind == "Workflow" && o.api_version.starts_with("argoproj.io/"));
        Some(Self {
            node_id: env("ARGO_NODE_ID")
                .or_else(|| pod.annotations().get(ARGO_ANNOTATION_NODE_ID).cloned())?,
            workflow: env("ARGO_WORKFLOW_NAME")
                .or_else(|| pod.labels().get(ARGO_LABEL_WORKFLOW).cloned())
                .or_else(|| owner.map(|o| o.name.clone()))?,
            workflow_uid: env("ARGO_WORKFLOW_UID").or_else(|| owner.map(|o| o.uid.clone()))?,
        })
    }

    fn api_resource() -> ApiResource {
        ApiResource {
            group: "argoproj.io".into(),
            version: "v1alpha1".into(),
            api_version: "argoproj.io/v1alpha1".into(),
            kind: "WorkflowTaskResult".into(),
            plural: "workflowtaskresults".into(),
        }
    }

    /// argoexec's `createTaskResult`: an empty `NodeResult`, not yet complete.
    fn placeholder(&self) -> Value {
        json!({
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "WorkflowTaskResult",
            "metadata": {
                "name": self.node_id,
                "labels": {
                    ARGO_LABEL_WORKFLOW: self.workflow,
                    ARGO_LABEL_OUTPUTS_COMPLETED: "false",
                },
                "ownerReferences": [{
                    "apiVersion": "argoproj.io/v1alpha1",
                    "kind": "Workflow",
                    "name": self.workflow,
                    "uid": self.workflow_uid,
                }],
            },
        })
    }
}

/// argoexec's `ReportOutputs` patch for a container template without outputs
/// (`json.Marshal(&WorkflowTaskResult{NodeResult: {Outputs: &{}}})`).
fn argo_outputs_patch() -> Value {
    json!({"metadata": {"creationTimestamp": null}, "outputs": {}})
}

/// argoexec's `FinalizeOutput` patch.
fn argo_completed_patch() -> Value {
    json!({
        "metadata": {
            "creationTimestamp": null,
            "labels": {ARGO_LABEL_OUTPUTS_COMPLETED: "true"},
        },
    })
}

/// Writes one Pod's task result, retrying transient errors as argoexec does (capped
/// backoff), for as long as the Pod exists.
struct TaskResultWriter<'a> {
    api: Api<DynamicObject>,
    task: &'a ArgoTask,
    pod: &'a str,
}

impl TaskResultWriter<'_> {
    /// argoexec `wait`'s `InitializeOutput`: create the placeholder (one that exists
    /// already is argoexec's `upsertTaskResult` finding it: left as it is).
    async fn create_placeholder(&self, rx: &mut watch::Receiver<bool>) {
        let obj: DynamicObject = serde_json::from_value(self.task.placeholder())
            .expect("the task result is a valid object");
        self.retry(rx, "create", || async {
            match self.api.create(&PostParams::default(), &obj).await {
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                other => other.map(|_| ()),
            }
        })
        .await;
    }

    /// `ReportOutputs` (the outputs; none here) then `FinalizeOutput` (complete).
    async fn report_outputs(&self, rx: &mut watch::Receiver<bool>) {
        for (what, patch) in [
            ("report outputs", argo_outputs_patch()),
            ("finalize", argo_completed_patch()),
        ] {
            self.retry(rx, what, || async {
                self.api
                    .patch(
                        &self.task.node_id,
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                    .map(|_| ())
            })
            .await;
        }
    }

    async fn retry<F, Fut>(&self, rx: &mut watch::Receiver<bool>, what: &str, write: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = kube::Result<()>>,
    {
        let mut backoff = Duration::from_millis(50);
        loop {
            match write().await {
                Ok(()) => return,
                Err(kube::Error::Api(s))
                    if (400..500).contains(&s.code) && s.code != 429 && s.code != 408 =>
                {
                    error!(pod = %self.pod, task_result = %self.task.node_id, what,
                        code = s.code, message = %s.message, "task result write rejected");
                    return;
                }
                Err(e) => {
                    warn!(pod = %self.pod, task_result = %self.task.node_id, what, error = %e,
                        ?backoff, "task result write failed; retrying");
                }
            }
            if rx.has_changed().is_err() {
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

fn condition(kind: &str, ready: bool, at: Timestamp, facts: &PodFacts) -> PodCondition {
    PodCondition {
        type_: kind.into(),
        status: if ready { "True" } else { "False" }.into(),
        last_transition_time: Some(Time(at)),
        observed_generation: facts.generation,
        ..PodCondition::default()
    }
}

fn container_id(facts: &PodFacts, name: &str) -> String {
    format!("sim://{}/{name}", facts.uid)
}

fn running_status(facts: &PodFacts, start_time: Timestamp, now: Timestamp) -> PodStatus {
    let conditions = [
        "PodScheduled",
        "PodReadyToStartContainers",
        "Initialized",
        "ContainersReady",
        "Ready",
    ]
    .into_iter()
    .map(|kind| condition(kind, true, now, facts))
    .collect();
    let container_statuses = facts
        .containers
        .iter()
        .map(|(name, image)| ContainerStatus {
            name: name.clone(),
            image: image.clone(),
            image_id: format!("sim://{image}"),
            container_id: Some(container_id(facts, name)),
            ready: true,
            started: Some(true),
            restart_count: 0,
            state: Some(ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(Time(now)),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        })
        .collect();
    PodStatus {
        phase: Some("Running".into()),
        start_time: Some(Time(start_time)),
        observed_generation: facts.generation,
        conditions: Some(conditions),
        container_statuses: Some(container_statuses),
        init_container_statuses: init_statuses(facts, now),
        ..PodStatus::default()
    }
}

/// The status after the step ended. Conditions are merged by type (strategic merge), so
/// those set by others — `DisruptionTarget` from the eviction API — are kept.
fn terminated_status(
    facts: &PodFacts,
    started_at: Option<Timestamp>,
    finished_at: Timestamp,
    ending: Ending,
    message: Option<String>,
) -> PodStatus {
    let succeeded = ending == Ending::Exited(0);
    let names: Vec<&str> = facts.containers.iter().map(|(n, _)| n.as_str()).collect();
    let not_ready = |kind: &str| {
        let mut c = condition(kind, false, finished_at, facts);
        if succeeded {
            c.reason = Some("PodCompleted".into());
        } else {
            c.reason = Some("ContainersNotReady".into());
            c.message = Some(format!(
                "containers with unready status: [{}]",
                names.join(" ")
            ));
        }
        c
    };
    let conditions = vec![
        not_ready("Ready"),
        not_ready("ContainersReady"),
        condition("PodReadyToStartContainers", false, finished_at, facts),
        condition("PodScheduled", true, finished_at, facts),
        condition("Initialized", true, finished_at, facts),
    ];
    let container_statuses = facts
        .containers
        .iter()
        .enumerate()
        .map(|(i, (name, image))| {
            // The step's container has the step's exit code; the others stop with it.
            let exit_code = match ending {
                Ending::Killed => SIGKILL_EXIT,
                e if i == facts.step_container => e.exit_code(),
                _ => 0,
            };
            ContainerStatus {
                name: name.clone(),
                image: image.clone(),
                image_id: format!("sim://{image}"),
                container_id: Some(container_id(facts, name)),
                ready: false,
                started: Some(false),
                restart_count: 0,
                state: Some(ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code,
                        reason: Some(if exit_code == 0 { "Completed" } else { "Error" }.into()),
                        message: if i == facts.step_container {
                            message.clone()
                        } else {
                            None
                        },
                        started_at: started_at.map(Time),
                        finished_at: Some(Time(finished_at)),
                        container_id: Some(container_id(facts, name)),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                }),
                ..ContainerStatus::default()
            }
        })
        .collect();
    PodStatus {
        phase: Some(if succeeded { "Succeeded" } else { "Failed" }.into()),
        start_time: Some(Time(started_at.unwrap_or(finished_at))),
        observed_generation: facts.generation,
        conditions: Some(conditions),
        container_statuses: Some(container_statuses),
        init_container_statuses: started_at.and_then(|at| init_statuses(facts, at)),
        ..PodStatus::default()
    }
}

/// Init containers have completed by the time the Pod runs (none: `None`).
fn init_statuses(facts: &PodFacts, at: Timestamp) -> Option<Vec<ContainerStatus>> {
    if facts.init_containers.is_empty() {
        return None;
    }
    let statuses = facts
        .init_containers
        .iter()
        .map(|(name, image)| ContainerStatus {
            name: name.clone(),
            image: image.clone(),
            image_id: format!("sim://{image}"),
            container_id: Some(container_id(facts, name)),
            ready: true,
            started: Some(false),
            restart_count: 0,
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 0,
                    reason: Some("Completed".into()),
                    started_at: Some(Time(at)),
                    finished_at: Some(Time(at)),
                    container_id: Some(container_id(facts, name)),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        })
        .collect();
    Some(statuses)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn behaviour(json: &str, attempt: u32) -> Behaviour {
        SimStep::parse(json)
            .and_then(|s| s.for_attempt(attempt))
            .map(|s| s.behaviour(Duration::from_millis(100)))
            .expect("valid SIM_STEP")
    }

    #[test]
    fn a_failed_attempt_that_did_not_act_says_so_and_the_ledger_reads_it() {
        let b = behaviour(
            r#"{"attempts":[{"exitCode":1,"effect":"NotApplied"},{"result":{"ok":true}}]}"#,
            1,
        );
        assert_eq!(b.exit_code, 1);
        let message: Value = serde_json::from_str(&b.message).unwrap();
        assert_eq!(message, json!({"result": {}, "effect": "NotApplied"}));
        assert_eq!(
            reported_effect(&b.message),
            Some(agentrun_operator::api::EffectOutcome::NotApplied)
        );
        let b = behaviour(r#"{"attempts":[{"exitCode":1},{"result":{"ok":true}}]}"#, 2);
        assert_eq!(reported_effect(&b.message), None);
        assert_eq!(reported_effect("not json"), None);
        assert_eq!(reported_effect(r#"{"effect":"Sideways"}"#), None);
    }

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

    fn argo_pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "r00000-s001-123", "uid": "pod-uid",
                "labels": {"workflows.argoproj.io/workflow": "r00000", "agentrun.dev/run": "r00000"},
                "annotations": {"workflows.argoproj.io/node-id": "r00000-456"},
                "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                                     "name": "r00000", "uid": "wf-uid", "controller": true}],
            },
            "spec": {
                "initContainers": [{"name": "init", "image": "argoexec"}],
                "containers": [
                    {"name": "wait", "image": "argoexec", "env": [
                        {"name": "ARGO_NODE_ID", "value": "r00000-456"},
                        {"name": "ARGO_WORKFLOW_NAME", "value": "r00000"},
                        {"name": "ARGO_WORKFLOW_UID", "value": "wf-uid"}]},
                    {"name": "main", "image": "step"},
                ],
            },
        }))
        .unwrap()
    }

    #[test]
    fn an_argo_pods_step_is_main_and_its_task_result_is_named_after_the_node() {
        let facts = PodFacts::of(&argo_pod(), Duration::ZERO, true);
        assert_eq!(facts.step_container, 1);
        assert_eq!(
            facts.argo,
            Some(ArgoTask {
                node_id: "r00000-456".into(),
                workflow: "r00000".into(),
                workflow_uid: "wf-uid".into(),
            })
        );
        assert_eq!(
            facts.argo.unwrap().placeholder(),
            json!({
                "apiVersion": "argoproj.io/v1alpha1",
                "kind": "WorkflowTaskResult",
                "metadata": {
                    "name": "r00000-456",
                    "labels": {
                        "workflows.argoproj.io/workflow": "r00000",
                        "workflows.argoproj.io/report-outputs-completed": "false",
                    },
                    "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                                         "name": "r00000", "uid": "wf-uid"}],
                },
            })
        );
        // Without the flag the same Pod is an ordinary one: the first container is the step.
        let plain = PodFacts::of(&argo_pod(), Duration::ZERO, false);
        assert_eq!((plain.step_container, plain.argo), (0, None));
    }

    #[test]
    fn an_argo_pod_ends_with_main_exit_code_wait_zero_and_init_completed() {
        let facts = PodFacts::of(&argo_pod(), Duration::ZERO, true);
        let at = Timestamp::UNIX_EPOCH;
        let status = terminated_status(&facts, Some(at), at, Ending::Exited(3), Some("m".into()));
        let codes: Vec<(String, i32, Option<String>)> = status
            .container_statuses
            .unwrap()
            .into_iter()
            .map(|c| {
                let t = c.state.unwrap().terminated.unwrap();
                (c.name, t.exit_code, t.message)
            })
            .collect();
        assert_eq!(
            codes,
            [
                ("wait".into(), 0, None),
                ("main".into(), 3, Some("m".into()))
            ]
        );
        let init = status.init_container_statuses.unwrap();
        assert_eq!(init.len(), 1);
        assert_eq!(
            init[0]
                .state
                .as_ref()
                .unwrap()
                .terminated
                .as_ref()
                .unwrap()
                .exit_code,
            0
        );
        assert_eq!(status.phase.as_deref(), Some("Failed"));
    }

    #[test]
    fn no_sim_step_succeeds_after_the_default_with_an_empty_result() {
        let b = SimStep::default().behaviour(Duration::from_millis(100));
        assert_eq!(b.run, Duration::from_millis(100));
        assert_eq!(b.exit_code, 0);
        assert_eq!(b.message, r#"{"result":{}}"#);
    }

    #[test]
    fn message_carries_result_tokens_plan_and_summary() {
        let b = behaviour(
            r#"{"runMs":5,"result":{"orderId":42},"tokens":{"input":1,"output":2},
                "plan":{"steps":[]},"summary":"s"}"#,
            1,
        );
        let message: Value = serde_json::from_str(&b.message).expect("json");
        assert_eq!(
            message,
            json!({"result":{"orderId":42},"tokens":{"input":1,"output":2},
                   "plan":{"steps":[]},"summary":"s"})
        );
        assert_eq!(b.run, Duration::from_millis(5));
    }

    #[test]
    fn raw_message_is_verbatim() {
        assert_eq!(
            behaviour(r#"{"rawMessage":"{not json"}"#, 1).message,
            "{not json"
        );
    }

    #[test]
    fn runs_pick_the_entry_of_the_pods_run() {
        let json = r#"{"exitCode":1,"runs":{"order-retry":{"exitCode":0,"result":{"ok":true}}}}"#;
        let s = SimStep::parse(json).unwrap();
        assert_eq!(s.clone().for_run(Some("order-retry")).unwrap().exit_code, 0);
        let own = s.for_run(Some("order")).unwrap();
        assert_eq!((own.exit_code, own.runs.is_none()), (1, true));
    }

    #[test]
    fn attempts_pick_entry_n_minus_one_and_the_last_repeats() {
        let json = r#"{"attempts":[{"exitCode":1},{"exitCode":2},{"exitCode":0}]}"#;
        let codes: Vec<i32> = (1..=5).map(|a| behaviour(json, a).exit_code).collect();
        assert_eq!(codes, [1, 2, 0, 0, 0]);
    }

    #[test]
    fn bad_sim_step_is_an_error() {
        assert!(
            SimStep::parse(r#"{"exitcode":1}"#).is_err(),
            "unknown field"
        );
        assert!(SimStep::parse("not json").is_err());
        assert!(
            SimStep::parse(r#"{"attempts":[]}"#)
                .and_then(|s| s.for_attempt(1))
                .is_err()
        );
    }

    #[test]
    fn long_messages_keep_their_last_4096_bytes() {
        let long = format!("é{}", "x".repeat(5000));
        let cut = truncate_message(long);
        assert_eq!(cut.len(), MAX_TERMINATION_MESSAGE);
        assert!(cut.chars().all(|c| c == 'x'));
        let long = format!("é{}", "x".repeat(4095));
        assert_eq!(
            truncate_message(long),
            "x".repeat(4095),
            "cut on a char boundary"
        );
    }
}
