//! The summary tables printed at the end (and written by `--report`): the
//! batches' medians over the repeats, the write and latency breakdowns, CPU
//! per step, the resume line and the long-run windows.

use std::collections::BTreeMap;

use crate::batch::Batch;
use crate::plane::{Setup, machine_line};
use crate::resume::Resume;
use crate::status_size::StatusSize;

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| !x.is_nan());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// "median (min–max)" of one figure over the repeats.
fn spread(v: Vec<f64>, digits: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let m = median(v.clone());
    if v.len() > 1 {
        format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
    } else {
        format!("{m:.digits$}")
    }
}

/// A table of one figure per request kind (columns) and concurrency (rows),
/// medians over the repeats; nothing when no batch has a kind.
fn by_kind(
    t: &mut String,
    batches: &BTreeMap<usize, Vec<Batch>>,
    title: &str,
    kinds_of: fn(&Batch) -> &BTreeMap<String, f64>,
    cell: fn(&Batch, &str) -> Option<f64>,
    digits: usize,
) {
    let mut kinds: Vec<&str> = batches
        .values()
        .flatten()
        .flat_map(|b| kinds_of(b).keys().map(String::as_str))
        .collect();
    kinds.sort();
    kinds.dedup();
    if kinds.is_empty() {
        return;
    }
    t.push_str(title);
    t.push_str(&format!("| runs | {} |\n", kinds.join(" | ")));
    t.push_str(&format!("|---:|{}\n", "---:|".repeat(kinds.len())));
    for (n, bs) in batches {
        let cells: Vec<String> = kinds
            .iter()
            .map(|k| {
                let v = bs.iter().filter_map(|b| cell(b, k)).collect();
                format!("{:.digits$}", median(v))
            })
            .collect();
        t.push_str(&format!("| {n} | {} |\n", cells.join(" | ")));
    }
}

pub fn summary(
    setup: &Setup,
    batches: &BTreeMap<usize, Vec<Batch>>,
    resumes: &[Resume],
    sizes: &[StatusSize],
) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "{}\n\nPeer: {}{}. Medians of {} repeats (min–max in brackets); {} steps per run, simkubelet steps of 0 ms.\n\n",
        machine_line(setup),
        setup.args.peer.description(),
        if setup.args.label.is_empty() { String::new() } else { format!(", {}", setup.args.label) },
        setup.args.repeats,
        setup.args.steps
    ));
    t.push_str("| runs | operator writes / step | hand-off p50 (ms) | hand-off p99 (ms) | steps / s | wall (s) | status 409s / step | reconciles / step | RSS idle (MiB) | RSS peak VmHWM (MiB) | failed runs |\n");
    t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let mib = |k: u64| k as f64 / 1024.0;
    for (n, bs) in batches {
        let per = |f: &dyn Fn(&Batch) -> f64| bs.iter().map(f).collect::<Vec<f64>>();
        let steps = |b: &Batch| (b.runs * b.steps) as f64;
        t.push_str(&format!(
            "| {n} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            spread(per(&|b| b.writes_per_step), 2),
            spread(per(&|b| b.handoff_p50_ms), 1),
            spread(per(&|b| b.handoff_p99_ms), 1),
            spread(per(&|b| b.steps_per_s), 1),
            spread(per(&|b| b.wall_s), 1),
            spread(per(&|b| b.conflicts_409 / steps(b)), 2),
            spread(per(&|b| b.reconciles / steps(b)), 2),
            spread(per(&|b| mib(b.rss_idle_kib)), 1),
            spread(per(&|b| mib(b.hwm_kib)), 1),
            bs.iter().map(|b| b.failed_runs).sum::<usize>(),
        ));
    }
    by_kind(
        &mut t,
        batches,
        "\nOperator writes per step by (verb, resource), from `apiserver_request_total` deltas (all response codes):\n\n",
        |b| &b.writes,
        // A kind a repeat did not write counts as 0 there.
        |b, k| Some(b.writes.get(k).copied().unwrap_or(0.0) / (b.runs * b.steps) as f64),
        2,
    );
    by_kind(
        &mut t,
        batches,
        "\nMean apiserver latency (ms) per request kind, from `apiserver_request_duration_seconds` deltas (PATCH pods/status is simkubelet's):\n\n",
        |b| &b.server_ms,
        |b, k| b.server_ms.get(k).copied(),
        1,
    );
    t.push_str("\nCPU time per step (ms; user + system from /proc/<pid>/stat over the measured window):\n\n");
    t.push_str(
        "| runs | operator | simkubelet | kube-apiserver | etcd |\n|---:|---:|---:|---:|---:|\n",
    );
    for (n, bs) in batches {
        let cell = |k: &str| {
            let v = bs
                .iter()
                .filter_map(|b| b.cpu_ms_per_step.get(k).copied())
                .collect();
            format!("{:.2}", median(v))
        };
        t.push_str(&format!(
            "| {n} | {} | {} | {} | {} |\n",
            cell("operator"),
            cell("simkubelet"),
            cell("kube-apiserver"),
            cell("etcd")
        ));
    }
    // RSS growth per run, from the largest batch against its idle RSS.
    if let Some((n, bs)) = batches.iter().next_back()
        && *n > 1
    {
        let growth: Vec<f64> = bs
            .iter()
            .map(|b| (b.hwm_kib as f64 - b.rss_idle_kib as f64) / *n as f64)
            .collect();
        t.push_str(&format!(
            "\nOperator RSS growth per run at {n} runs ((VmHWM − idle VmRSS) / runs): {} KiB\n",
            spread(growth, 1)
        ));
    }
    if !resumes.is_empty() {
        let per = |f: &dyn Fn(&Resume) -> f64| resumes.iter().map(f).collect::<Vec<f64>>();
        t.push_str(&format!(
            "\nResume, {} runs in flight, operator SIGKILLed and restarted: ready (caches listed) after {} s; \
             every run has its next Pod after {} s (p50 {} s); all runs finished after {} s; \
             duplicate Pods {} (total over repeats), steps executed more than once {}; creates suppressed {}; \
             held behind the starts until every run was reconciled once: {} finalizer releases, {} Events; \
             operator RSS idle {} MiB, peak after the restart (VmHWM, {} runs and their Pods in cache) {} MiB, i.e. {} KiB per run\n",
            resumes[0].runs,
            spread(per(&|r| r.ready_s), 2),
            spread(per(&|r| r.all_next_s), 2),
            spread(per(&|r| r.next_p50_s), 2),
            if setup.args.resume_finish {
                spread(per(&|r| r.finished_s), 1)
            } else {
                "(not awaited: --resume-finish)".into()
            },
            resumes.iter().map(|r| r.duplicate_pods).sum::<usize>(),
            resumes.iter().map(|r| r.duplicate_executions).sum::<usize>(),
            spread(per(&|r| r.suppressed_creates), 0),
            spread(per(&|r| r.held_releases), 0),
            spread(per(&|r| r.held_events), 0),
            spread(per(&|r| mib(r.rss_idle_kib)), 1),
            resumes[0].runs,
            spread(per(&|r| mib(r.hwm_kib)), 1),
            spread(
                per(&|r| (r.hwm_kib as f64 - r.rss_idle_kib as f64) / r.runs as f64),
                1
            ),
        ));
    }
    for s in sizes {
        t.push_str(&format!("\n{}\n", s.line()));
        if !s.windows.is_empty() {
            t.push_str(&format!(
                "\nCost of a step along that run (windows of {} steps ending at the step shown):\n\n",
                setup.args.long_window
            ));
            t.push_str("| step | steps in window | hand-off p50 (ms) | status write body (bytes) | status writes / step | etcd bytes put / step | kube-apiserver CPU ms / step | etcd CPU ms / step | operator CPU ms / step |\n");
            t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
            for w in &s.windows {
                t.push_str(&w.row());
                t.push('\n');
            }
        }
    }
    t
}
