//! `kubectl agentrun` (docs/cli.md). Exit codes: 0 success, 1 error, 2 usage.

use clap::Parser;
use kubectl_agentrun::cli::{Cli, run};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(e.exit_code())
        }
    }
}
