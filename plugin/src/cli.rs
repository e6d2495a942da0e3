//! The command line: clap's types and the dispatch, the one place that
//! knows every command (each is in `commands`).

use agentrun_api::Decision;
use clap::{Parser, Subcommand};
use kube::Client;
use serde_json::json;

use crate::client::{Error, Global, config};
use crate::commands::console::ConsoleArgs;
use crate::commands::decide::{DecideArgs, decide, reconcile_answer};
use crate::commands::steer::set_spec;
use crate::commands::{
    Output, confirm, describe, history, list, logs, pending, retry, signal, submit, watch,
};

/// `kubectl agentrun`: inspect, answer and steer AgentRuns.
#[derive(Parser, Debug)]
#[command(name = "kubectl-agentrun", bin_name = "kubectl agentrun", version)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
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
    /// The logs of a run's step Pods, every attempt in order, each with the
    /// model and tool calls it replayed and recorded in its journal.
    Logs {
        run: String,
        step: Option<String>,
        /// Only this attempt.
        #[arg(long)]
        attempt: Option<i32>,
        /// Follow the last Pod's log.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Each journaled call's recorded response and error, whole.
        #[arg(long)]
        journal: bool,
    },
    /// Follow one run until it finishes.
    Watch { run: String },
    /// A new run that starts RUN again from a step, keeping what came before
    /// it (docs/recover.md); --dry-run shows what it would keep, run and ask.
    Retry(retry::RetryArgs),
    /// A new run from an AgentRunTemplate, with its parameters filled in
    /// (docs/templates.md); created as you, so it may use only what you may.
    Submit(submit::SubmitArgs),
    /// A web console on 127.0.0.1, with your own credentials: runs, a
    /// timeline per run, an approvals inbox (docs/console.md).
    Console(ConsoleArgs),
    /// The records finished runs left (kept after their TTL): a table, or
    /// RUN's records in full (docs/cli.md).
    History(history::HistoryArgs),
    /// Send the event a wait step waits for (its Signal's id and data), as
    /// yourself; sending the same id and data again changes nothing.
    Signal(signal::SignalArgs),
    /// Print the plugin's version and the API it speaks.
    Version,
    /// Shell completion script.
    Completion { shell: clap_complete::Shell },
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
            list::list(
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
            describe::describe(&client, &ns, &run, full, output).await?
        }
        Command::Pending {
            all_namespaces,
            output,
        } => pending::pending(&client, &ns, all_namespaces, output).await?,
        Command::Approve(a) => decide(&client, &ns, &a, Decision::Approved).await?,
        Command::Reject(a) => decide(&client, &ns, &a, Decision::Rejected).await?,
        Command::Reconcile {
            target,
            retry,
            succeeded,
            failed,
        } => {
            let d = reconcile_answer(retry, succeeded, failed)?;
            decide(&client, &ns, &target, d).await?;
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
            journal,
        } => {
            let opts = logs::LogOptions {
                follow,
                responses: journal,
            };
            logs::logs(&client, &ns, &run, step.as_deref(), attempt, opts).await?
        }
        Command::Watch { run } => watch::watch(&client, &ns, &run).await?,
        Command::Retry(args) => retry::retry(&client, &ns, &args).await?,
        Command::Submit(args) => submit::submit(&client, &ns, &args).await?,
        Command::Signal(args) => signal::signal(&client, &ns, &args).await?,
        Command::History(args) => history::history(&client, &ns, &args).await?,
        Command::Console(args) => {
            let opts = args.options(cli.global.namespace.clone());
            crate::console::serve(config, ns, opts).await?
        }
        Command::Version | Command::Completion { .. } => unreachable!("handled above"),
    }
    Ok(())
}
