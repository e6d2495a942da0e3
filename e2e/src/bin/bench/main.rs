//! The cluster benchmark (`make bench`): agentrun-operator on the local control
//! plane with simkubelet steps of 0 ms, at several concurrency levels.
//!
//! ```text
//!   bench ──creates N AgentRuns──▶ kube-apiserver ◀──watch/write── agentrun-operator (child, --namespace NS)
//!     │  watches Pods + AgentRuns          ▲  /metrics (admin cert)  ◀──watch/patch status── simkubelet (child)
//!     └─ scrapes apiserver_request_total ──┘  before/after; the operator's /metrics; /proc/<pid>/status
//! ```
//!
//! Figures per batch (one fresh namespace, operator and simkubelet each):
//! operator API writes per step, step hand-off latency (Pod seen Succeeded →
//! the next step's Pod seen, both by this driver's watch), steps per second,
//! operator RSS; then a resume batch (operator SIGKILLed with N runs in
//! flight) and the status size of one long run. It prints its figures; it is
//! not a test and asserts no target.
//!
//! `--peer jobs` and `--peer argo` run the same batches with another controller
//! instead of the operator: chains of Jobs (kube-controller-manager) or Argo
//! Workflows (a workflow-controller started per batch, simkubelet playing Argo's
//! `wait` sidecar); see docs/performance-history.md, "Side by side".
//!
//! The modules, each depending only on those above it:
//!
//! | module | owns |
//! |---|---|
//! | `args`, `error` | the flags; why the benchmark stopped |
//! | `plane` | the plane (client, PID files), simkubelet, a namespace per batch, CPU and RSS of the processes, parallel creates |
//! | `metrics` | kube-apiserver and etcd `/metrics`: request counts, writes attributed to a controller, latencies |
//! | `watch` | the driver's watches: Pods seen, runs seen finished, hand-offs |
//! | `batch` | the figures of one batch ([`batch::Batch`]) |
//! | `peers` | the one batch every peer runs ([`peers::Controller`]), and a module per `--peer` |
//! | `resume`, `status_size` | the operator's resume and long-run measurements |
//! | `report` | the summary tables |
//!
//! # Adding a peer
//!
//! 1. A module `peers/<name>.rs` with a type implementing [`peers::Controller`]:
//!    its names (namespace prefix, what a run and a step are called), the
//!    summary's description of it, how it starts (and is ready) in a batch's
//!    namespace, how the driver sees its runs finish (`Watch::finish_on` its
//!    run objects, or a task of its own), how it creates `n` runs (their Pods
//!    labelled `agentrun.dev/run`, `agentrun.dev/step` `sNNN` and
//!    `agentrun.dev/attempt`, so simkubelet runs them and hand-offs are
//!    measured), and which writes (verb, resource, subresource) are its
//!    controller's and not the driver's own creates.
//! 2. A variant of [`args::Peer`] (its `--peer` value) and its arms in
//!    `impl Peer` in `peers/mod.rs` (the compiler lists them).
//! 3. Anything it needs once per invocation (CRDs, a binary's check) in
//!    `Controller::prepare`, and its flags in `args.rs`.
//! 4. A smoke run on a plane of your own, its section in docs/performance-history.md
//!    and its rows in docs/performance.md.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use agentrun_e2e::{install_crds, repo_root};
use clap::Parser;
use serde_json::json;

mod args;
mod batch;
mod error;
mod metrics;
mod peers;
mod plane;
mod report;
mod resume;
mod status_size;
mod watch;

use args::{Args, Peer};
use batch::Batch;
use error::{BenchError, Res, io};
use plane::{Setup, connect, machine_line};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match bench(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn bench(args: Args) -> Res<()> {
    let e2e_dir = args
        .e2e_dir
        .clone()
        .or_else(|| std::env::var_os("AGENTRUN_E2E_DIR").map(PathBuf::from))
        .unwrap_or_else(|| repo_root().join("target/e2e-bench"));
    let kubeconfig = e2e_dir.join("kubeconfig");
    let bin = |given: &Option<PathBuf>, name: &str| -> Res<PathBuf> {
        let p = given
            .clone()
            .unwrap_or_else(|| repo_root().join("target/release").join(name));
        if p.exists() {
            Ok(p)
        } else {
            Err(BenchError::NotBuilt(p))
        }
    };
    let operator_bin = bin(&args.operator_bin, "agentrun-operator")?;
    let simkubelet_bin = bin(&args.simkubelet_bin, "simkubelet")?;
    let client = connect(&kubeconfig).await?;
    install_crds(&client).await;
    let out_dir = e2e_dir.join("bench");
    std::fs::create_dir_all(&out_dir).map_err(io(format!("creating {}", out_dir.display())))?;
    let setup = Setup {
        args: args.clone(),
        client,
        e2e_dir,
        kubeconfig,
        operator_bin,
        simkubelet_bin,
        argo_dir: peers::argo::dir(&args),
        out_dir,
    };
    args.peer.prepare(&setup).await?;
    println!("{}", machine_line(&setup));

    let mut batches: BTreeMap<usize, Vec<Batch>> = BTreeMap::new();
    for &n in &args.concurrency {
        for r in 1..=args.repeats {
            let b = args.peer.batch(&setup, n, args.steps, r).await?;
            println!("{}", b.line());
            batches.entry(n).or_default().push(b);
        }
    }
    let mut resumes = Vec::new();
    if args.resume_runs > 0 && args.peer == Peer::Agentrun {
        for r in 1..=args.repeats {
            let res = resume::resume_batch(&setup, args.resume_runs, r).await?;
            println!("{}", res.line());
            resumes.push(res);
        }
    }
    let mut sizes = Vec::new();
    if args.status_steps > 0 && args.peer == Peer::Agentrun {
        for r in 1..=args.status_repeats {
            let s = status_size::status_size(&setup, args.status_steps, r).await?;
            println!("{}", s.line());
            sizes.push(s);
        }
    }
    let table = report::summary(&setup, &batches, &resumes, &sizes);
    println!("\n{table}");
    if let Some(path) = &args.report {
        std::fs::write(path, &table).map_err(io(format!("writing {}", path.display())))?;
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "batches": batches.values().flatten().map(Batch::json).collect::<Vec<_>>(),
            "resumes": resumes.iter().map(|r| json!({
                "runs": r.runs,
                "duplicatePods": r.duplicate_pods,
                "duplicateExecutions": r.duplicate_executions,
                "readyS": r.ready_s,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, doc.to_string()).map_err(io(format!("writing {}", path.display())))?;
    }
    // Figures of runs that did not succeed describe no working operator.
    let failed: usize = batches.values().flatten().map(|b| b.failed_runs).sum();
    if failed > 0 {
        return Err(BenchError::Stage(format!(
            "{failed} runs did not succeed; logs in {}",
            setup.out_dir.display()
        )));
    }
    Ok(())
}
