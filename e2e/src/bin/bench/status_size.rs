//! The status-size measurement (`--status-steps N`, the operator only): one
//! run of N steps, each reporting `--status-result-bytes` of result; the size
//! of its status at the end, and what a step costs along the run, in windows
//! of `--long-window` steps ending at each of `--long-marks`.
//!
//! ```text
//!   sample (CPU, apiserver body sizes, etcd bytes put) ── steps m−window … m ── sample
//!     → LongWindow { status write body, writes/step, etcd bytes/step, CPU/step, hand-off p50 }
//! ```

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::batch::percentile;
use crate::error::{BenchError, Res, api};
use crate::metrics::{metric, scrape, update_body_bytes};
use crate::peers::Controller;
use crate::peers::agentrun::{Operator, create_runs};
use crate::plane::{Setup, cpu_now, namespace, processes, run_name, start_simkubelet, teardown};
use crate::watch::{Watch, handoffs, run_handoffs};

#[derive(Clone, Debug, Default)]
pub struct StatusSize {
    pub steps: usize,
    pub repeat: usize,
    pub status_bytes: usize,
    pub object_bytes: usize,
    pub wall_s: f64,
    pub handoff_p50_ms: f64,
    pub handoff_p99_ms: f64,
    pub first_handoffs_ms: f64,
    pub last_handoffs_ms: f64,
    pub windows: Vec<LongWindow>,
}

/// What the plane and the operator had done at one instant of a long run.
#[derive(Clone, Debug, Default)]
struct Sample {
    /// Step Pods seen Succeeded.
    done: usize,
    /// CPU ms per process, read before and after the scrapes.
    cpu_before: BTreeMap<&'static str, f64>,
    cpu_after: BTreeMap<&'static str, f64>,
    /// Request bodies of the writes to agentruns (the operator's status
    /// writes; the driver's create is excluded): (bytes, count).
    status_body: (f64, f64),
    /// etcd's total bytes put.
    etcd_put_bytes: f64,
}

/// Reads CPU, scrapes the apiserver and etcd, reads CPU again: a window
/// opened with the second reading and closed with the first leaves the
/// scrapes out.
async fn sample(setup: &Setup, watch: &Watch, pids: &[(&'static str, u32)]) -> Res<Sample> {
    let cpu_before = cpu_now(pids);
    let done = watch.seen().succeeded();
    let text = scrape(setup, "apiserver").await?;
    let status_body = update_body_bytes(&text, "agentruns");
    let etcd = scrape(setup, "etcd").await?;
    let etcd_put_bytes = metric(&etcd, "etcd_debugging_mvcc_total_put_size_in_bytes")?;
    Ok(Sample {
        done,
        cpu_before,
        cpu_after: cpu_now(pids),
        status_body,
        etcd_put_bytes,
    })
}

/// The cost of the steps of one window of a long run.
#[derive(Clone, Debug, Default)]
pub struct LongWindow {
    pub mark: usize,
    pub steps: usize,
    pub handoff_p50_ms: f64,
    /// Mean request body of a status write.
    pub status_write_bytes: f64,
    pub status_writes: f64,
    /// Bytes etcd stored per step (every object written, Pods included).
    pub etcd_bytes_per_step: f64,
    pub cpu_ms_per_step: BTreeMap<&'static str, f64>,
}

impl LongWindow {
    fn between(mark: usize, a: &Sample, b: &Sample) -> LongWindow {
        let steps = b.done.saturating_sub(a.done).max(1);
        let writes = b.status_body.1 - a.status_body.1;
        LongWindow {
            mark,
            steps,
            handoff_p50_ms: f64::NAN,
            status_write_bytes: if writes > 0.0 {
                (b.status_body.0 - a.status_body.0) / writes
            } else {
                f64::NAN
            },
            status_writes: writes,
            etcd_bytes_per_step: (b.etcd_put_bytes - a.etcd_put_bytes) / steps as f64,
            cpu_ms_per_step: b
                .cpu_before
                .iter()
                .map(|(k, v)| {
                    (
                        *k,
                        (v - a.cpu_after.get(k).copied().unwrap_or(0.0)) / steps as f64,
                    )
                })
                .collect(),
        }
    }

    pub fn row(&self) -> String {
        let cpu = |k: &str| self.cpu_ms_per_step.get(k).copied().unwrap_or(f64::NAN);
        format!(
            "| {} | {} | {:.1} | {:.0} | {:.2} | {:.0} | {:.1} | {:.1} | {:.1} |",
            self.mark,
            self.steps,
            self.handoff_p50_ms,
            self.status_write_bytes,
            self.status_writes / self.steps as f64,
            self.etcd_bytes_per_step,
            cpu("kube-apiserver"),
            cpu("etcd"),
            cpu("operator"),
        )
    }
}

impl StatusSize {
    pub fn line(&self) -> String {
        format!(
            "status steps={} repeat={}: status {} bytes ({:.1} KiB), object {} bytes; {:.1} s, \
             hand-off p50 {:.1} ms p99 {:.1} ms (median of the first 50: {:.1} ms, of the last 50: {:.1} ms)",
            self.steps,
            self.repeat,
            self.status_bytes,
            self.status_bytes as f64 / 1024.0,
            self.object_bytes,
            self.wall_s,
            self.handoff_p50_ms,
            self.handoff_p99_ms,
            self.first_handoffs_ms,
            self.last_handoffs_ms
        )
    }
}

pub async fn status_size(setup: &Setup, steps: usize, repeat: usize) -> Res<StatusSize> {
    let deadline = Duration::from_secs(setup.args.deadline_secs);
    let (ns, dir) = namespace(setup, &format!("bench-status-{steps}-r{repeat}")).await?;
    let nsname = ns.name().to_owned();
    eprintln!("[bench] status size of a {steps}-step run, repeat {repeat}: namespace {nsname}");
    let mut kubelet = start_simkubelet(setup, &nsname, &dir, &[])?;
    let op = Operator::start(setup, &nsname, &dir).await?;
    let mut watch = Watch::pods(&setup.client, &nsname);
    op.follow(&mut watch, steps);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pids = processes(setup, op.pid(), kubelet.pid().unwrap_or(0));
    let window = setup.args.long_window.max(1);
    // Windows of `window` steps ending at each mark: (start, end, mark).
    let mut marks: Vec<usize> = setup
        .args
        .long_marks
        .iter()
        .copied()
        .filter(|m| *m <= steps)
        .collect();
    marks.sort_unstable();
    marks.dedup();
    let mut starts: Vec<Option<Sample>> = vec![None; marks.len()];
    let mut measured = vec![false; marks.len()];
    let mut windows = Vec::new();
    let first = sample(setup, &watch, &pids).await?;
    for (i, m) in marks.iter().enumerate() {
        if *m <= window {
            starts[i] = Some(first.clone());
        }
    }
    let t0 = Instant::now();
    create_runs(
        setup,
        &op.runs,
        1,
        steps,
        setup.args.status_result_bytes,
        false,
    )
    .await?;
    let r = loop {
        let (done, finished) = {
            let g = watch.seen();
            (g.succeeded(), !g.finished.is_empty())
        };
        for i in 0..marks.len() {
            let m = marks[i];
            if measured[i] {
                continue;
            }
            if starts[i].is_none() && done >= m.saturating_sub(window) {
                starts[i] = Some(sample(setup, &watch, &pids).await?);
            } else if done >= m
                && let Some(start) = starts[i].take()
            {
                let end = sample(setup, &watch, &pids).await?;
                windows.push(LongWindow::between(m, &start, &end));
                measured[i] = true;
            }
        }
        if finished {
            break Ok(Instant::now());
        }
        if t0.elapsed() > deadline {
            break Err(BenchError::Stage(format!(
                "aborted: the run did not finish within {deadline:?} ({done} Pods succeeded)"
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let g = watch.stop();
    let runs = op.runs.clone();
    op.stop().await;
    kubelet.kill().await;
    let end = match r {
        Ok(t) => t,
        Err(e) => {
            teardown(setup, ns).await?;
            return Err(BenchError::Stage(format!(
                "status size: {e} (logs in {})",
                dir.display()
            )));
        }
    };
    let run = runs
        .get(&run_name(0))
        .await
        .map_err(api("reading the run"))?;
    let status_bytes = serde_json::to_vec(&run.status)
        .expect("a status serializes")
        .len();
    let object_bytes = serde_json::to_vec(&run).expect("a run serializes").len();
    let h = handoffs(&g, steps);
    // Hand-offs in step order, to see whether they grow with the status.
    let ordered = g
        .first_attempts()
        .get(run_name(0).as_str())
        .map_or_else(Vec::new, |steps_of| run_handoffs(steps_of, steps));
    let med = |s: &[f64]| {
        let mut s = s.to_vec();
        s.sort_by(f64::total_cmp);
        percentile(&s, 50.0)
    };
    let k = ordered.len().min(50);
    // ordered[j] is the hand-off into step j + 1.
    for w in &mut windows {
        let hi = w.mark.saturating_sub(1).min(ordered.len());
        let lo = w.mark.saturating_sub(window).min(hi);
        w.handoff_p50_ms = med(&ordered[lo..hi]);
    }
    let res = StatusSize {
        windows,
        steps,
        repeat,
        status_bytes,
        object_bytes,
        wall_s: end.duration_since(t0).as_secs_f64(),
        handoff_p50_ms: percentile(&h, 50.0),
        handoff_p99_ms: percentile(&h, 99.0),
        first_handoffs_ms: med(&ordered[..k]),
        last_handoffs_ms: med(&ordered[ordered.len() - k..]),
    };
    teardown(setup, ns).await?;
    Ok(res)
}
