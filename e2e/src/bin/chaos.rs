//! The chaos suite's driver: `make chaos` (long) or `chaos --short`.
//!
//! Runs the workload against the control plane of `KUBECONFIG` (or
//! `$AGENTRUN_E2E_DIR/kubeconfig`) with the operator behind the fault proxy,
//! prints one summary line on stdout and the breakdown on stderr, and exits
//! non-zero when a step ran again after its success was committed, a run or a
//! checkpoint was lost, a run got stuck, or fewer faults than `--faults-min`
//! were injected.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use agentrun_e2e::chaos::{self, ChaosConfig};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "chaos", about = "agentrun-operator under injected faults")]
struct Args {
    /// Runs to create (default: 200, or 40 with --short).
    #[arg(long)]
    runs: Option<usize>,
    /// Faults to inject before the faults may stop (default: 1000, or 300 with --short).
    #[arg(long)]
    faults_min: Option<u64>,
    /// Longest fault phase in seconds (default: 900, or 120 with --short).
    #[arg(long)]
    duration_limit: Option<u64>,
    /// Seconds the runs get to finish after the faults stop (default: 180, or 60 with --short).
    #[arg(long)]
    settle: Option<u64>,
    /// Seed of the workload and of every fault decision.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The bounded short version (the one inside `make test`).
    #[arg(long)]
    short: bool,
    /// Fraction of the operator's writes that get a fault.
    #[arg(long)]
    write_fault_rate: Option<f64>,
    /// Runs in flight at once.
    #[arg(long)]
    max_active: Option<usize>,
    /// Operator kill -9 every MIN..MAX milliseconds (default 4000..12000, or 4000..9000 with --short).
    #[arg(long, value_name = "MIN..MAX", value_parser = parse_range)]
    kill_every_ms: Option<(u64, u64)>,
    /// Operator processes: 2 (default) elect a leader and get paused past their
    /// lease; 1 runs without leader election and without pauses.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    operators: Option<u8>,
    /// Do not restart kube-apiserver (e.g. on a plane that `e2e/cluster` did not start).
    #[arg(long)]
    no_apiserver_restarts: bool,
    /// How far off the second operator runs its clock (`AGENTRUN_CLOCK_SKEW`, a
    /// signed duration such as +20s or -20s; `none`: both agree).
    #[arg(long, default_value = "+20s", value_parser = parse_skew)]
    clock_skew: String,
}

fn parse_skew(s: &str) -> Result<String, String> {
    if s != "none" {
        s.parse::<jiff::SignedDuration>()
            .map_err(|e| format!("{s:?}: {e}"))?;
    }
    Ok(s.to_owned())
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?}: write MIN..MAX"))?;
    let a: u64 = a.parse().map_err(|e| format!("{a:?}: {e}"))?;
    let b: u64 = b.parse().map_err(|e| format!("{b:?}: {e}"))?;
    if a > b || b == 0 {
        return Err(format!("{s:?}: MIN must not exceed MAX, MAX above 0"));
    }
    Ok((a, b))
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,agentrun_e2e=info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut cfg = if args.short {
        ChaosConfig::short(args.seed)
    } else {
        ChaosConfig::long(args.seed)
    };
    if let Some(n) = args.runs {
        cfg.runs = n;
    }
    if let Some(n) = args.faults_min {
        cfg.faults_min = n;
    }
    if let Some(s) = args.duration_limit {
        cfg.duration_limit = Duration::from_secs(s);
    }
    if let Some(s) = args.settle {
        cfg.settle = Duration::from_secs(s);
    }
    if let Some(r) = args.write_fault_rate {
        cfg.proxy.write_fault_rate = r;
    }
    if let Some(n) = args.max_active {
        cfg.max_active = n;
    }
    if let Some((a, b)) = args.kill_every_ms {
        cfg.kill_every = (Duration::from_millis(a), Duration::from_millis(b));
    }
    if let Some(n) = args.operators {
        cfg.operators = n.into();
        if n == 1 {
            cfg.pause_every = None;
            cfg.paused_leaders_min = 0;
        }
    }
    cfg.clock_skew = Some(args.clock_skew).filter(|s| s != "none");
    if args.no_apiserver_restarts {
        cfg.apiserver_restart_every = None;
        cfg.apiserver_restarts_min = 0;
    }
    let report = chaos::run(cfg).await;
    eprintln!("{}", report.details());
    println!("{}", report.summary());
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
