//! `kubectl agentrun retry RUN [--from STEP]`: a new run that forks RUN at a
//! step (docs/recover.md); the fork itself is `fork`'s, shared with the
//! console.

use jiff::Timestamp;
use kube::Client;

use crate::client::Error;
use crate::fork::{Retry, create, created_line, preview, source};

/// What `retry` was asked.
#[derive(clap::Args, Debug, Clone)]
pub struct RetryArgs {
    /// The run to fork (Failed, Cancelled or Succeeded).
    pub run: String,
    /// The step the new run starts from; default: the first step that did
    /// not succeed.
    #[arg(long)]
    pub from: Option<String>,
    /// Run the step again even though it acted in RUN: it then acts a second
    /// time, after a person approves an Approval that says so.
    #[arg(long)]
    pub rerun_applied: bool,
    /// Print what the new run would keep, run and ask, and create nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// The new run's name (default: RUN-retry-<random>).
    #[arg(long)]
    pub name: Option<String>,
}

impl RetryArgs {
    pub fn request(&self) -> Retry {
        Retry {
            from: self.from.clone(),
            rerun_acted: self.rerun_applied,
            name: self.name.clone(),
        }
    }
}
/// Creates the fork (or prints its plan with `--dry-run`).
pub async fn retry(client: &Client, ns: &str, args: &RetryArgs) -> Result<(), Error> {
    let source = source(client, ns, &args.run).await?;
    let now = Timestamp::now();
    if args.dry_run {
        print!("{}", preview(&source, &args.request(), now)?);
        return Ok(());
    }
    let (created, plan) = create(client, &source, &args.request(), now).await?;
    println!("{}", created_line(&created, &plan));
    Ok(())
}
