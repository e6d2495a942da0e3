//! The commands, each a function of the parsed arguments and a client.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use agentrun_operator::api::{AgentRun, Approval, Decision, RunPhase, StepRole};
use agentrun_operator::labels;
use clap::{Args, Parser, Subcommand, ValueEnum};
use futures::{AsyncBufReadExt, TryStreamExt};
use jiff::Timestamp;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};
use serde_json::json;

use crate::identity::Identity;
use crate::render::{self, Style};

/// The writer the plugin's patches name in `managedFields`, as kubectl's own
/// commands name theirs (`kubectl-patch`, `kubectl-edit`).
const FIELD_MANAGER: &str = "kubectl-agentrun";

pub(crate) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// `kubectl agentrun`: inspect, answer and steer AgentRuns.
#[derive(Parser, Debug)]
#[command(name = "kubectl-agentrun", bin_name = "kubectl agentrun", version)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// The flags kubectl users expect on every command.
#[derive(Args, Debug, Clone, Default)]
pub struct Global {
    /// The namespace (default: the kubeconfig context's).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Path to the kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Act as this user (impersonation, like kubectl --as).
    #[arg(long = "as", global = true)]
    pub as_user: Option<String>,
    /// Act as a member of this group (repeatable, like kubectl --as-group).
    #[arg(long = "as-group", global = true)]
    pub as_group: Vec<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Output {
    Json,
    Yaml,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Runs with phase, current step, progress, tokens and what they wait for.
    #[command(visible_alias = "ls")]
    List {
        /// All namespaces.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        /// Only runs in this phase (e.g. WaitingForApproval).
        #[arg(long)]
        phase: Option<String>,
        /// Label selector.
        #[arg(short = 'l', long)]
        selector: Option<String>,
        #[arg(short = 'o', long, value_enum)]
        output: Option<Output>,
    },
    /// A readable tree of one run: plan, steps, compensations, approvals, Events.
    Describe {
        run: String,
        /// Whole results and messages, not truncated.
        #[arg(long)]
        full: bool,
        #[arg(short = 'o', long, value_enum)]
        output: Option<Output>,
    },
    /// Approvals that wait for a decision, and which the current user may decide.
    Pending {
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        #[arg(short = 'o', long, value_enum)]
        output: Option<Output>,
    },
    /// Approve the run's pending approval (or its vote, where a quorum is needed).
    Approve(DecideArgs),
    /// Reject the run's pending approval: the run fails and compensates.
    Reject(DecideArgs),
    /// Answer what an interrupted NonIdempotent step did.
    Reconcile {
        #[command(flatten)]
        target: DecideArgs,
        /// The step did not act: run it again with the same idempotency key.
        #[arg(long, group = "answer")]
        retry: bool,
        /// The step acted: record it as succeeded and go on.
        #[arg(long, group = "answer")]
        succeeded: bool,
        /// The step failed: fail the run and compensate.
        #[arg(long, group = "answer")]
        failed: bool,
    },
    /// Start no new step Pods until resumed.
    Suspend { run: String },
    /// Resume a suspended run.
    Resume { run: String },
    /// Cancel a run: stop its step and compensate what was applied.
    Cancel {
        run: String,
        #[arg(short = 'y', long)]
        yes: bool,
    },
    /// The logs of a run's step Pods, every attempt in order.
    Logs {
        run: String,
        step: Option<String>,
        /// Only this attempt.
        #[arg(long)]
        attempt: Option<i32>,
        /// Follow the last Pod's log.
        #[arg(short = 'f', long)]
        follow: bool,
    },
    /// Follow one run until it finishes.
    Watch { run: String },
    /// A new run that starts RUN again from a step, keeping what came before
    /// it (docs/recover.md); --dry-run shows what it would keep, run and ask.
    Retry(crate::retry::RetryArgs),
    /// A web console on 127.0.0.1, with your own credentials: runs, a
    /// timeline per run, an approvals inbox (docs/console.md).
    Console(crate::console::args::ConsoleArgs),
    /// The records finished runs left (kept after their TTL): a table, or
    /// RUN's records in full (docs/cli.md).
    History(crate::history::HistoryArgs),
    /// Send the event a wait step waits for (its Signal's id and data), as
    /// yourself; sending the same id and data again changes nothing.
    Signal(crate::signal::SignalArgs),
    /// Print the plugin's version and the API it speaks.
    Version,
    /// Shell completion script.
    Completion { shell: clap_complete::Shell },
}

#[derive(Args, Debug, Clone)]
pub struct DecideArgs {
    pub run: String,
    /// The step, when the run waits on more than one approval.
    pub step: Option<String>,
    /// Why: recorded with the decision.
    #[arg(long)]
    pub comment: Option<String>,
    /// Do not ask for confirmation.
    #[arg(short = 'y', long)]
    pub yes: bool,
}

/// What went wrong; every message names the object and the next step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Refused(String),
    /// Input the command cannot use (exit 1, checked before any request).
    #[error("{0}")]
    Invalid(String),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("kubeconfig: {0}")]
    Config(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// 2 for usage, 1 for everything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage(_) => 2,
            _ => 1,
        }
    }
}

pub(crate) fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| match &source {
        kube::Error::Api(s) => Error::Refused(format!("{what}: {}", s.message)),
        _ => Error::Api { what, source },
    }
}

/// The client, and the namespace the command works in.
pub async fn connect(g: &Global) -> Result<(Client, String), Error> {
    let (config, namespace) = config(g).await?;
    let client = Client::try_from(config).map_err(|e| Error::Config(e.to_string()))?;
    Ok((client, namespace))
}

/// The configuration `connect` makes its client from (the console makes
/// more: one per signed-in user).
pub async fn config(g: &Global) -> Result<(Config, String), Error> {
    let opts = KubeConfigOptions {
        context: g.context.clone(),
        ..KubeConfigOptions::default()
    };
    let mut config = match &g.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|e| Error::Config(e.to_string()))?;
            Config::from_custom_kubeconfig(file, &opts)
                .await
                .map_err(|e| Error::Config(e.to_string()))
        }
        None => match Config::from_kubeconfig(&opts).await {
            // In a Pod without a kubeconfig (the chart's console), its
            // ServiceAccount, as kubectl does.
            Err(e)
                if g.context.is_none() && std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() =>
            {
                Config::incluster().map_err(|ie| Error::Config(format!("{e}; in-cluster: {ie}")))
            }
            other => other.map_err(|e| Error::Config(e.to_string())),
        },
    }?;
    if let Some(user) = &g.as_user {
        config.auth_info.impersonate = Some(user.clone());
    }
    if !g.as_group.is_empty() {
        config.auth_info.impersonate_groups = Some(g.as_group.clone());
    }
    let namespace = g
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    Ok((config, namespace))
}

pub(crate) fn style() -> Style {
    Style {
        color: std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
    }
}

pub(crate) fn print_as<T: serde::Serialize>(o: Output, v: &T) -> Result<(), Error> {
    let text = match o {
        Output::Json => serde_json::to_string_pretty(v).map_err(|e| Error::Usage(e.to_string()))?,
        Output::Yaml => serde_yaml::to_string(v).map_err(|e| Error::Usage(e.to_string()))?,
    };
    println!("{}", text.trim_end());
    Ok(())
}

/// Who the API server says the user is.
pub async fn whoami(client: &Client) -> Result<Identity, Error> {
    let review = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .map_err(api("asking the API server who you are (SelfSubjectReview)"))?;
    let info = review.status.and_then(|s| s.user_info).unwrap_or_default();
    Ok(Identity {
        user: info.username.unwrap_or_default(),
        groups: info.groups.unwrap_or_default(),
    })
}

pub async fn run(cli: Cli) -> Result<(), Error> {
    if let Command::Version = cli.command {
        println!(
            "kubectl-agentrun {} (API agentrun.dev/v1alpha1)",
            env!("CARGO_PKG_VERSION")
        );
        return Ok(());
    }
    if let Command::Completion { shell } = cli.command {
        let mut cmd = <Cli as clap::CommandFactory>::command();
        clap_complete::generate(shell, &mut cmd, "kubectl-agentrun", &mut std::io::stdout());
        return Ok(());
    }
    let (config, ns) = config(&cli.global).await?;
    let client = Client::try_from(config.clone()).map_err(|e| Error::Config(e.to_string()))?;
    match cli.command {
        Command::List {
            all_namespaces,
            phase,
            selector,
            output,
        } => {
            list(
                &client,
                &ns,
                all_namespaces,
                phase.as_deref(),
                selector.as_deref(),
                output,
            )
            .await?
        }
        Command::Describe { run, full, output } => {
            describe(&client, &ns, &run, full, output).await?
        }
        Command::Pending {
            all_namespaces,
            output,
        } => pending(&client, &ns, all_namespaces, output).await?,
        Command::Approve(a) => crate::decide::decide(&client, &ns, &a, Decision::Approved).await?,
        Command::Reject(a) => crate::decide::decide(&client, &ns, &a, Decision::Rejected).await?,
        Command::Reconcile {
            target,
            retry,
            succeeded,
            failed,
        } => {
            let d = reconcile_answer(retry, succeeded, failed)?;
            crate::decide::decide(&client, &ns, &target, d).await?;
        }
        Command::Suspend { run } => {
            set_spec(&client, &ns, &run, json!({"suspend": true}), "suspended").await?
        }
        Command::Resume { run } => {
            set_spec(&client, &ns, &run, json!({"suspend": false}), "resumed").await?
        }
        Command::Cancel { run, yes } => {
            confirm(
                yes,
                &format!("Cancel run {run} and compensate what it applied?"),
            )?;
            set_spec(&client, &ns, &run, json!({"cancel": true}), "cancelled").await?
        }
        Command::Logs {
            run,
            step,
            attempt,
            follow,
        } => logs(&client, &ns, &run, step.as_deref(), attempt, follow).await?,
        Command::Watch { run } => watch(&client, &ns, &run).await?,
        Command::Retry(args) => crate::retry::retry(&client, &ns, &args).await?,
        Command::Signal(args) => crate::signal::signal(&client, &ns, &args).await?,
        Command::History(args) => crate::history::history(&client, &ns, &args).await?,
        Command::Console(args) => {
            let opts = args.options(cli.global.namespace.clone());
            crate::console::serve(config, ns, opts).await?
        }
        Command::Version | Command::Completion { .. } => unreachable!("handled above"),
    }
    Ok(())
}

/// `list`: the runs, filtered by phase, with what they wait for.
async fn list(
    client: &Client,
    ns: &str,
    all_namespaces: bool,
    phase: Option<&str>,
    selector: Option<&str>,
    output: Option<Output>,
) -> Result<(), Error> {
    let now = Timestamp::now();
    let lp = selector.map_or_else(ListParams::default, |s| ListParams::default().labels(s));
    let (runs_api, apv_api): (Api<AgentRun>, Api<Approval>) = if all_namespaces {
        (Api::all(client.clone()), Api::all(client.clone()))
    } else {
        (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        )
    };
    let mut runs = runs_api
        .list(&lp)
        .await
        .map_err(api("listing AgentRuns"))?
        .items;
    if let Some(p) = phase {
        runs.retain(|r| {
            r.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|x| format!("{x:?}").eq_ignore_ascii_case(p))
        });
    }
    if let Some(o) = output {
        return print_as(o, &runs);
    }
    let approvals = apv_api
        .list(&ListParams::default())
        .await
        .map_err(api("listing Approvals"))?
        .items;
    if runs.is_empty() {
        let scope = if all_namespaces {
            "any namespace".to_owned()
        } else {
            format!("namespace {ns}")
        };
        println!("No AgentRuns in {scope}.");
        return Ok(());
    }
    print!(
        "{}",
        render::list(&runs, &approvals, all_namespaces, now, style())
    );
    Ok(())
}

/// `describe`: one run as a tree, or as JSON/YAML with its approvals and
/// signals.
async fn describe(
    client: &Client,
    ns: &str,
    run: &str,
    full: bool,
    output: Option<Output>,
) -> Result<(), Error> {
    let now = Timestamp::now();
    let (r, approvals) = run_and_approvals(client, ns, run).await?;
    let signals = crate::signal::signals_of(client, ns, &r).await;
    if let Some(o) = output {
        return print_as(
            o,
            &json!({"run": r, "approvals": approvals, "signals": signals}),
        );
    }
    let events = events_of(client, ns, run).await?;
    print!(
        "{}",
        render::describe(&r, &approvals, &signals, &events, now, full, style())
    );
    Ok(())
}

/// `pending`: the approvals that wait, and whether the user may decide each.
async fn pending(
    client: &Client,
    ns: &str,
    all_namespaces: bool,
    output: Option<Output>,
) -> Result<(), Error> {
    let now = Timestamp::now();
    let me = whoami(client).await?;
    let apv_api: Api<Approval> = if all_namespaces {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), ns)
    };
    let approvals = apv_api
        .list(&ListParams::default())
        .await
        .map_err(api("listing Approvals"))?
        .items;
    if let Some(o) = output {
        let pending: Vec<&Approval> = approvals.iter().filter(|a| render::is_pending(a)).collect();
        return print_as(o, &pending);
    }
    if !approvals.iter().any(render::is_pending) {
        println!("No Approvals wait for a decision.");
        return Ok(());
    }
    print!("{}", render::pending(&approvals, &me, now, all_namespaces));
    Ok(())
}

/// The decision `reconcile`'s flags say (clap lets at most one through).
fn reconcile_answer(retry: bool, succeeded: bool, failed: bool) -> Result<Decision, Error> {
    match (retry, succeeded, failed) {
        (true, _, _) => Ok(Decision::Retry),
        (_, true, _) => Ok(Decision::MarkSucceeded),
        (_, _, true) => Ok(Decision::MarkFailed),
        _ => Err(Error::Usage(
            "say what the step did: --retry, --succeeded or --failed".into(),
        )),
    }
}

pub(crate) async fn run_and_approvals(
    client: &Client,
    ns: &str,
    run: &str,
) -> Result<(AgentRun, Vec<Approval>), Error> {
    let r = Api::<AgentRun>::namespaced(client.clone(), ns)
        .get_opt(run)
        .await
        .map_err(api(format!("reading AgentRun {run}")))?
        .ok_or_else(|| {
            Error::Refused(format!(
                "AgentRun {run} not found in namespace {ns}; list them with kubectl agentrun list"
            ))
        })?;
    let uid = r.metadata.uid.clone().unwrap_or_default();
    let approvals = Api::<Approval>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map_err(api("listing Approvals"))?
        .items
        .into_iter()
        .filter(|a| a.spec.run_uid == uid)
        .collect();
    Ok((r, approvals))
}

pub(crate) async fn events_of(client: &Client, ns: &str, run: &str) -> Result<Vec<Event>, Error> {
    let mut events: Vec<Event> = Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map_err(api("listing Events"))?
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("AgentRun") && r.name.as_deref() == Some(run)
            })
        })
        .collect();
    events.sort_by_key(|e| {
        e.event_time
            .as_ref()
            .map(|t| t.0)
            .or_else(|| e.deprecated_last_timestamp.as_ref().map(|t| t.0))
    });
    Ok(events)
}

pub(crate) fn confirm(yes: bool, prompt: &str) -> Result<(), Error> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Error::Usage(format!(
            "{prompt} Not a terminal: confirm with --yes"
        )));
    }
    print!("{prompt} [y/N] ");
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    if matches!(line.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Error::Refused("not confirmed; nothing was changed".into()))
    }
}

async fn set_spec(
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

async fn logs(
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

async fn watch(client: &Client, ns: &str, run: &str) -> Result<(), Error> {
    let tty = std::io::stdout().is_terminal();
    let mut last = String::new();
    loop {
        let (r, approvals) = run_and_approvals(client, ns, run).await?;
        let now = Timestamp::now();
        let terminal = r
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(RunPhase::is_terminal);
        if tty {
            let signals = crate::signal::signals_of(client, ns, &r).await;
            let view = render::describe(&r, &approvals, &signals, &[], now, false, style());
            print!("\x1b[2J\x1b[H{view}");
            std::io::stdout().flush()?;
        } else {
            let s = r.status.clone().unwrap_or_default();
            let line = format!(
                "{} {} step {} progress {}",
                run,
                s.phase.map(|p| format!("{p:?}")).unwrap_or_default(),
                s.current_step.unwrap_or_else(|| "-".into()),
                s.progress.unwrap_or_else(|| "-".into())
            );
            if line != last {
                println!("{line}");
                last = line;
            }
        }
        if terminal {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
