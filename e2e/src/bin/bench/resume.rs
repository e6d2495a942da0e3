//! The resume measurement (`--resume-runs N`, the operator only): N runs in
//! flight, the operator SIGKILLed, their Pods succeeding while it is down,
//! then how long the restarted operator takes to give every run its next Pod,
//! and whether any step got a second Pod or ran twice.
//!
//! ```text
//!   operator up ─▶ N runs, first Pods seen ─▶ SIGKILL ─▶ simkubelet runs them ─▶ restart
//!     ─▶ ready (/readyz) ─▶ every run's second Pod seen  [─▶ every run finished: --resume-finish]
//! ```

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use agentrun_e2e::ledger::Ledger;

use crate::batch::percentile;
use crate::error::{BenchError, Res};
use crate::metrics::{apiserver_requests, controller_metrics, metric, writes};
use crate::peers::Controller;
use crate::peers::agentrun::{create_runs, start_operator, wait_ready};
use crate::plane::{
    Setup, cpu_now, namespace, processes, rss_kib, start_simkubelet, step_name, teardown,
};
use crate::watch::{Seen, Watch};

#[derive(Clone, Debug, Default)]
pub struct Resume {
    pub runs: usize,
    pub repeat: usize,
    pub ready_s: f64,
    pub all_next_s: f64,
    pub next_p50_s: f64,
    pub finished_s: f64,
    pub duplicate_pods: usize,
    pub duplicate_executions: usize,
    pub suppressed_creates: f64,
    /// Finalizer releases and routine Events the restarted operator held
    /// until every run it found had been reconciled once.
    pub held_releases: f64,
    pub held_events: f64,
    pub rss_idle_kib: u64,
    pub hwm_kib: u64,
    /// What the window from the restart to every run's next Pod cost: CPU
    /// seconds of each process (the operator's since it started) and the
    /// writes the API server served, by kind (every client's).
    pub window_cpu_s: BTreeMap<&'static str, f64>,
    pub window_writes: BTreeMap<String, f64>,
}

impl Resume {
    pub fn line(&self) -> String {
        format!(
            "resume runs={} repeat={}: operator ready {:.2} s after restart; every run has its next Pod after {:.2} s (p50 {:.2} s); \
             all finished after {:.1} s; duplicate Pods {}, steps executed more than once {}, creates suppressed {}; \
             held behind the starts: {} finalizer releases, {} Events; RSS idle {} KiB, peak after restart {} KiB",
            self.runs,
            self.repeat,
            self.ready_s,
            self.all_next_s,
            self.next_p50_s,
            self.finished_s,
            self.duplicate_pods,
            self.duplicate_executions,
            self.suppressed_creates,
            self.held_releases,
            self.held_events,
            self.rss_idle_kib,
            self.hwm_kib
        ) + &self.window_line()
    }

    /// Where the window went: each process's CPU, how many of the machine's
    /// cores they kept busy between them, and the writes served.
    fn window_line(&self) -> String {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let busy: f64 = self.window_cpu_s.values().sum();
        let cpu: Vec<String> = self
            .window_cpu_s
            .iter()
            .map(|(p, s)| format!("{p} {s:.2} s"))
            .collect();
        let writes: Vec<String> = self
            .window_writes
            .iter()
            .map(|(k, n)| format!("{k} {n:.0}"))
            .collect();
        format!(
            "\n  window {:.2} s: CPU {} = {:.2} of {cores} cores busy; writes served {}",
            self.all_next_s,
            cpu.join(", "),
            busy / self.all_next_s,
            writes.join(", ")
        )
    }
}

/// `n` runs of 3 steps wait on their first step's Pod; the operator is
/// SIGKILLed; the Pods succeed while it is down; it restarts. Measures the
/// time from the restart until every run's second step has its Pod, and
/// counts duplicate Pods and executions over the runs' whole lives.
pub async fn resume_batch(setup: &Setup, n: usize, repeat: usize) -> Res<Resume> {
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let steps = 3;
    let (ns, dir) = namespace(setup, &format!("bench-resume-{n}-r{repeat}")).await?;
    let nsname = ns.name().to_owned();
    eprintln!("[bench] resume {n} runs, repeat {repeat}: namespace {nsname}");
    let mut op = start_operator(setup, &nsname, &dir)?;
    wait_ready(&op, Duration::from_secs(60)).await?;
    let mut watch = Watch::pods(&setup.client, &nsname);
    op.follow(&mut watch, steps);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss_idle, _) = rss_kib(op.proc.pid().unwrap_or(0));
    create_runs(setup, &op.runs, n, steps, 0, false).await?;
    let first = step_name(0);
    let second = step_name(1);
    let has = |s: &Seen, step: &str| s.pods.values().filter(|p| p.step == step).count();
    let r = watch
        .wait("every run has its first Pod", deadline, |s| {
            let k = has(s, &first);
            (k < n).then(|| format!("{k}/{n}"))
        })
        .await;
    if let Err(e) = r {
        op.proc.kill().await;
        teardown(setup, ns).await?;
        return Err(e);
    }
    // Settle so the kill lands with no write in flight, then SIGKILL.
    tokio::time::sleep(Duration::from_millis(500)).await;
    op.proc.kill().await;
    let mut kubelet = start_simkubelet(setup, &nsname, &dir, &[])?;
    let r = watch
        .wait("every first Pod succeeded (operator down)", deadline, |s| {
            let k = s
                .pods
                .values()
                .filter(|p| p.step == first && p.succeeded_seen.is_some())
                .count();
            (k < n).then(|| format!("{k}/{n}"))
        })
        .await;
    if let Err(e) = r {
        kubelet.kill().await;
        teardown(setup, ns).await?;
        return Err(e);
    }
    let requests_before = apiserver_requests(setup).await?;
    let kubelet_pid = kubelet.pid().unwrap_or(0);
    let cpu_before = cpu_now(&processes(setup, 0, kubelet_pid));
    let restart = Instant::now();
    let mut op = start_operator(setup, &nsname, &dir)?;
    let pids = processes(setup, op.proc.pid().unwrap_or(0), kubelet_pid);
    let ready = wait_ready(&op, Duration::from_secs(120)).await?;
    let all_next = watch
        .wait(
            "every run has its next Pod after the restart",
            deadline,
            |s| {
                let k = has(s, &second);
                (k < n).then(|| format!("{k}/{n}"))
            },
        )
        .await;
    // The window's cost, read as soon as the last run has its next Pod (the
    // operator's CPU is all its own since the restart: it is a new process).
    let cpu_after = cpu_now(&pids);
    let window_cpu_s: BTreeMap<&'static str, f64> = cpu_after
        .iter()
        .map(|(p, now)| {
            let was = if *p == "operator" {
                0.0
            } else {
                cpu_before.get(p).copied().unwrap_or(0.0)
            };
            (*p, (now - was) / 1000.0)
        })
        .collect();
    let requests_after = apiserver_requests(setup).await?;
    let (window_writes, _) = writes(&requests_before, &requests_after, |_, _, _| true);
    let finished = match all_next {
        Ok(t) if !setup.args.resume_finish => Ok(t),
        Ok(_) => {
            watch
                .wait("every run finished", deadline, |s| {
                    (s.finished.len() < n).then(|| format!("{}/{n}", s.finished.len()))
                })
                .await
        }
        Err(e) => Err(e),
    };
    let (_, hwm) = rss_kib(op.proc.pid().unwrap_or(0));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let op_metrics = controller_metrics(op.metrics).await;
    let g = watch.stop();
    op.proc.kill().await;
    kubelet.kill().await;
    if let Err(e) = finished {
        teardown(setup, ns).await?;
        return Err(BenchError::Stage(format!(
            "resume {n} repeat {repeat}: {e} (logs in {})",
            dir.display()
        )));
    }
    let mut next: Vec<f64> = g
        .pods
        .values()
        .filter(|p| p.step == second)
        .filter_map(|p| p.first_seen)
        .map(|t| t.saturating_duration_since(restart).as_secs_f64())
        .collect();
    next.sort_by(f64::total_cmp);
    // Pods per (run, step): more than one, or an attempt other than 1, is a duplicate.
    let mut per_step: HashMap<(&str, &str), usize> = HashMap::new();
    for p in g.pods.values() {
        *per_step.entry((&p.run, &p.step)).or_default() += 1;
    }
    let duplicate_pods = per_step.values().map(|k| k - 1).sum::<usize>()
        + g.pods.values().filter(|p| p.attempt != "1").count();
    let ledger = Ledger::read(dir.join("ledger.jsonl"))
        .map_err(|e| BenchError::Stage(format!("reading the ledger: {e}")))?;
    // Per logical step (run, step name), not per key: a step that ran again
    // under another key is a duplicate too. Each step of these runs runs once.
    let mut per_logical_step: HashMap<(&str, &str), usize> = HashMap::new();
    for e in ledger.executions().filter(|e| e.is_step()) {
        let key = (
            e.run.as_deref().unwrap_or_default(),
            e.step.as_deref().unwrap_or_default(),
        );
        *per_logical_step.entry(key).or_default() += 1;
    }
    let duplicate_executions = per_logical_step.values().map(|k| k - 1).sum::<usize>();
    let res = Resume {
        runs: n,
        repeat,
        ready_s: ready.as_secs_f64(),
        all_next_s: next.last().copied().unwrap_or(f64::NAN),
        next_p50_s: percentile(&next, 50.0),
        finished_s: g.last_finished_after(restart),
        duplicate_pods,
        duplicate_executions,
        suppressed_creates: metric(&op_metrics, "agentrun_duplicate_creates_suppressed_total")?,
        held_releases: metric(
            &op_metrics,
            "agentrun_held_behind_starts_total{kind=\"release\"}",
        )?,
        held_events: metric(
            &op_metrics,
            "agentrun_held_behind_starts_total{kind=\"event\"}",
        )?,
        rss_idle_kib: rss_idle,
        hwm_kib: hwm,
        window_cpu_s,
        window_writes,
    };
    teardown(setup, ns).await?;
    Ok(res)
}
