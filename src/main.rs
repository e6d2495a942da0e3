//! The operator binary: `run`, `crd`, `version`.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "agentrun-operator", version, about = "Durable AI-agent runs on Kubernetes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the AgentRun and Approval CRDs as YAML.
    Crd,
    /// Print the version.
    Version,
}

fn main() {
    match Cli::parse().command {
        Command::Crd => print!("{}", agentrun_operator::api::crds_yaml()),
        Command::Version => println!("agentrun-operator {}", env!("CARGO_PKG_VERSION")),
    }
}
