//! The fault-injecting proxy as a standalone process: put it between any
//! client and the e2e control plane.
//!
//! ```sh
//! faultproxy --listen 127.0.0.1:18080 --kubeconfig-out /tmp/proxied.kubeconfig
//! KUBECONFIG=/tmp/proxied.kubeconfig target/debug/agentrun-operator run
//! ```
//!
//! It forwards to the cluster of `KUBECONFIG` (or `$AGENTRUN_E2E_DIR/kubeconfig`)
//! with that kubeconfig's credentials, injects the faults described in
//! `agentrun_e2e::chaos::proxy`, prints its counters every `--report-every`
//! seconds and once more on SIGINT/SIGTERM.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use agentrun_e2e::chaos::proxy::{FaultProxy, ProxyConfig};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "faultproxy",
    about = "A fault-injecting proxy in front of the kube-apiserver"
)]
struct Args {
    /// Where to listen (loopback only).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
    /// Write a kubeconfig pointing at the proxy here.
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// Default namespace of that kubeconfig.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Fraction of writes (POST/PUT/PATCH/DELETE, not Events) that get a fault.
    #[arg(long, default_value_t = 0.15)]
    write_fault_rate: f64,
    /// Fraction of non-watch responses held back.
    #[arg(long, default_value_t = 0.05)]
    delay_rate: f64,
    /// Longest hold-back, in milliseconds.
    #[arg(long, default_value_t = 800)]
    max_delay_ms: u64,
    /// Watch streams are cut after a time uniform between these (seconds).
    #[arg(long, default_value_t = 2)]
    watch_cut_min_s: u64,
    #[arg(long, default_value_t = 15)]
    watch_cut_max_s: u64,
    /// Fraction of watches from a resourceVersion answered at once with an
    /// ERROR event `410 Gone`.
    #[arg(long, default_value_t = 0.1)]
    watch_gone_rate: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds between counter reports on stderr.
    #[arg(long, default_value_t = 10)]
    report_every: u64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if !args.listen.ip().is_loopback() {
        eprintln!("faultproxy: --listen must be a loopback address");
        return std::process::ExitCode::FAILURE;
    }
    let upstream = match agentrun_e2e::chaos::proxy::upstream_client().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("faultproxy: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let cfg = ProxyConfig {
        write_fault_rate: args.write_fault_rate,
        delay_rate: args.delay_rate,
        max_delay: Duration::from_millis(args.max_delay_ms),
        watch_cut_after: (
            Duration::from_secs(args.watch_cut_min_s),
            Duration::from_secs(args.watch_cut_max_s.max(args.watch_cut_min_s)),
        ),
        watch_gone_rate: args.watch_gone_rate,
        seed: args.seed,
    };
    let proxy = match FaultProxy::start(upstream, args.listen, cfg).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!("faultproxy: listening on {}: {e}", args.listen);
            return std::process::ExitCode::FAILURE;
        }
    };
    println!("faultproxy listening on http://{}", proxy.addr());
    if let Some(path) = &args.kubeconfig_out
        && let Err(e) = proxy.write_kubeconfig(path, &args.namespace)
    {
        eprintln!("faultproxy: writing {}: {e}", path.display());
        return std::process::ExitCode::FAILURE;
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    let mut tick = tokio::time::interval(Duration::from_secs(args.report_every.max(1)));
    loop {
        tokio::select! {
            _ = tick.tick() => eprintln!("faultproxy: faults={} {}", proxy.counts().total(), proxy.counts()),
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        }
    }
    eprintln!(
        "faultproxy: faults={} {}",
        proxy.counts().total(),
        proxy.counts()
    );
    std::process::ExitCode::SUCCESS
}
