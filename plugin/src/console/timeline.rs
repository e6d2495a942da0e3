//! The run's timeline: every attempt of every step and compensation on one
//! time axis, as server-drawn SVG. Pure: the run, its Approvals, its Events
//! and `now` in, lanes and markup out.
//!
//! A checkpoint holds only its current attempt's times; the earlier ones come
//! from the run's Events (`… attempt N as Pod P` when an attempt starts, and
//! the Event that ended it: disrupted, timed out, retrying).
//!
//! ```text
//!   lane "reserve r1"   [attempt 1 ▒disrupted▒][attempt 2 ████]░░fresh░░
//!   lane "charge r1"            ⟦approval: alice⟧[attempt 1 ██]
//!   lane "notify r1"            [attempt 1 ██]       (a branch beside charge)
//!   lane "spam r1"              ◇ skipped: when … is false
//!   lane "agent r1"     [attempt 1 █▮▮█▮▮!]     (journaled calls inside the bar)
//!                        |r2 re-plan
//! ```
//!
//! A journaled step's model and tool calls (its `StepJournal` chunks, D19)
//! are marks inside its bar, from when each call started to when its answer
//! was recorded: model and tool calls apart, a NonIdempotent call outlined,
//! a call that may have acted and nobody settled in the colour of failure.

use agentrun_api::{
    AgentRun, AgentRunStatus, Approval, CallKind, CompensationCheckpoint, StepCheckpoint,
    StepJournal, StepPhase,
};
use agentrun_engine::reasons::Reason;
use jiff::Timestamp;
use k8s_openapi::api::events::v1::Event;
use maud::{Markup, html};

use crate::render::journal::{self, Call, StepCalls};

/// How an attempt (or wait) went, each drawn in its own style.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    Running,
    Succeeded,
    Failed,
    Disrupted,
    TimedOut,
    /// Waiting for a person's decision.
    Approval,
    /// Waiting for a signal from outside (a wait step's `Signal`).
    Signal,
    /// Not run: its `when` was false (a mark at the time it was decided).
    Skipped,
}

impl BarKind {
    pub fn class(self) -> &'static str {
        match self {
            BarKind::Running => "bar-running",
            BarKind::Succeeded => "bar-succeeded",
            BarKind::Failed => "bar-failed",
            BarKind::Disrupted => "bar-disrupted",
            BarKind::TimedOut => "bar-timedout",
            BarKind::Approval => "bar-approval",
            BarKind::Signal => "bar-signal",
            BarKind::Skipped => "bar-skipped",
        }
    }
    pub fn word(self) -> &'static str {
        match self {
            BarKind::Running => "running",
            BarKind::Succeeded => "succeeded",
            BarKind::Failed => "failed",
            BarKind::Disrupted => "disrupted",
            BarKind::TimedOut => "timed out",
            BarKind::Approval => "approval",
            BarKind::Signal => "signal",
            BarKind::Skipped => "skipped",
        }
    }
}

/// One span on a lane.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    pub start: Timestamp,
    pub end: Timestamp,
    pub kind: BarKind,
    /// `attempt 2`, `approval: approved by alice`.
    pub label: String,
}

/// One step or compensation (at one plan revision).
#[derive(Clone, Debug, PartialEq)]
pub struct Lane {
    pub label: String,
    pub bars: Vec<Bar>,
    /// The freshness window: from when the result was recorded until `freshUntil`.
    pub fresh: Option<(Timestamp, Timestamp)>,
    /// The step's journaled calls that carry a time, in seq order.
    pub calls: Vec<CallMark>,
}

/// One journaled model or tool call on its step's lane.
#[derive(Clone, Debug, PartialEq)]
pub struct CallMark {
    pub seq: i64,
    pub start: Timestamp,
    /// When its answer was recorded; `start` for a call with none.
    pub end: Timestamp,
    pub kind: CallKind,
    pub non_idempotent: bool,
    /// An intent with no answer nobody has settled: it may have acted.
    pub unknown: bool,
    /// The tooltip: `#3 tool charge (call_x), NonIdempotent: Unknown …`.
    pub label: String,
}

impl CallMark {
    pub fn class(&self) -> String {
        let mut c = match self.kind {
            CallKind::Model => "call call-model".to_owned(),
            CallKind::Tool => "call call-tool".to_owned(),
        };
        if self.non_idempotent {
            c.push_str(" call-nonidempotent");
        }
        if self.unknown {
            c.push_str(" call-unknown");
        }
        c
    }
}

/// The marks of a step's journaled calls; a call with no time (an SDK that
/// records none) has no place on the axis and is left to the step table.
fn call_marks(j: &StepCalls<'_>) -> Vec<CallMark> {
    j.calls
        .iter()
        .filter_map(|c| {
            let e = c.entry;
            let start = e.started_at.as_ref().or(e.finished_at.as_ref())?.0;
            let end = e.finished_at.as_ref().map_or(start, |t| t.0).max(start);
            Some(CallMark {
                seq: e.seq,
                start,
                end,
                kind: e.kind,
                non_idempotent: c.non_idempotent(),
                unknown: c.standing() == journal::Standing::Unknown,
                label: call_label(c),
            })
        })
        .collect()
}

fn call_label(c: &Call<'_>) -> String {
    let e = c.entry;
    let mut s = format!(
        "#{} {} {} ({})",
        e.seq,
        c.kind_word(),
        e.name.as_deref().unwrap_or("-"),
        e.call_id
    );
    if e.kind == CallKind::Tool {
        s.push_str(&format!(", {}", c.effect_word()));
    }
    s.push_str(&format!(": {}", c.state_word()));
    match c.standing() {
        journal::Standing::Unknown => s.push_str(" (may have acted; nobody has settled it)"),
        journal::Standing::Settled { by, .. } => s.push_str(&format!(" (settled by {by})")),
        _ => {}
    }
    if let Some(t) = c.tokens() {
        s.push_str(&format!(", {t} tokens"));
    }
    if let Some(k) = &e.key {
        s.push_str(&format!(", key {k}"));
    }
    s.push_str(&format!("; recorded by attempt {}", e.attempt));
    s
}

/// The whole picture: lanes, re-plan marks, and the axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub lanes: Vec<Lane>,
    /// `(when, "r2")`: a new plan revision was adopted.
    pub replans: Vec<(Timestamp, String)>,
    pub from: Timestamp,
    pub to: Timestamp,
}

fn event_time(e: &Event) -> Option<Timestamp> {
    e.event_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| e.deprecated_last_timestamp.as_ref().map(|t| t.0))
        .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

fn reason(e: &Event) -> &str {
    e.reason.as_deref().unwrap_or("")
}

/// The Pod name of attempt `n`, from the current attempt's (`…-aN`).
fn pod_of(current: Option<&str>, current_attempt: i32, n: i32) -> Option<String> {
    let pod = current?;
    let stem = pod.strip_suffix(&format!("-a{current_attempt}"))?;
    Some(format!("{stem}-a{n}"))
}

/// What the record of one attempt says, whichever kind of checkpoint.
struct Record<'a> {
    label: String,
    /// `step NAME` / `compensation of step NAME`: how its Events begin.
    subject: String,
    attempt: i32,
    pod: Option<&'a str>,
    phase: StepPhase,
    started: Option<Timestamp>,
    finished: Option<Timestamp>,
    fresh_until: Option<Timestamp>,
}

fn attempts(r: &Record<'_>, events: &[Event], now: Timestamp) -> Vec<Bar> {
    let mut bars = Vec::new();
    for n in 1..=r.attempt {
        let current = n == r.attempt;
        let pod = pod_of(r.pod, r.attempt, n);
        let started_event = pod.as_ref().and_then(|p| {
            events
                .iter()
                .filter(|e| {
                    e.note
                        .as_deref()
                        .is_some_and(|m| m.ends_with(&format!("as Pod {p}")))
                })
                .find_map(event_time)
        });
        // The Event's time has microseconds, status only seconds; an
        // attempt never starts before the one it follows ended.
        let start = match (started_event, current.then_some(r.started).flatten()) {
            (Some(s), _) | (None, Some(s)) => s,
            (None, None) => continue,
        };
        let start = bars.last().map_or(start, |b: &Bar| start.max(b.end));
        // The Event that ended this attempt, if one did.
        let tag = format!("{}: attempt {n} ", r.subject);
        let ended = events
            .iter()
            .filter(|e| e.note.as_deref().is_some_and(|m| m.starts_with(&tag)))
            .filter(|e| !reason(e).ends_with("Started"))
            .filter_map(|e| Some((event_time(e)?, reason(e))))
            .filter(|(t, _)| *t >= start)
            .min_by_key(|(t, _)| *t);
        let from_event = |(t, why): (Timestamp, &str)| {
            let kind = if why == Reason::StepTimedOut.as_str() {
                BarKind::TimedOut
            } else if why == Reason::StepDisrupted.as_str()
                || why == Reason::StepOutcomeUnknown.as_str()
            {
                BarKind::Disrupted
            } else {
                BarKind::Failed
            };
            (t, kind)
        };
        let (end, kind) = if current {
            match (r.phase, r.finished) {
                (StepPhase::Running, _) => (now, BarKind::Running),
                (StepPhase::Succeeded, Some(f)) => (f, BarKind::Succeeded),
                (StepPhase::Failed, Some(f)) => {
                    (f, ended.map_or(BarKind::Failed, |e| from_event(e).1))
                }
                _ => match ended {
                    Some(e) => from_event(e),
                    None => (r.finished.unwrap_or(now), BarKind::Running),
                },
            }
        } else {
            match ended {
                Some(e) => from_event(e),
                None => (start, BarKind::Failed),
            }
        };
        bars.push(Bar {
            start,
            end: end.max(start),
            kind,
            label: format!("attempt {n} {}", kind.word()),
        });
    }
    bars
}

/// The timeline of `run`, as of `now`, with its steps' journaled calls
/// (`journals`: the run's `StepJournal` chunks).
pub fn build(
    run: &AgentRun,
    approvals: &[Approval],
    events: &[Event],
    journals: &[StepJournal],
    now: Timestamp,
) -> Timeline {
    let status = run.status.clone().unwrap_or_default();
    let journals = journal::journals_of(run, journals);
    let mut lanes: Vec<Lane> = status
        .steps
        .iter()
        .map(|cp| {
            let mut lane = step_lane(cp, approvals, events, now);
            if cp.role == agentrun_api::StepRole::Step
                && let Some(j) = journals
                    .iter()
                    .find(|j| j.step == cp.name && j.plan_revision == cp.plan_revision)
            {
                lane.calls = call_marks(j);
            }
            lane
        })
        .collect();
    lanes.extend(
        status
            .compensations
            .iter()
            .map(|c| compensation_lane(c, events, now)),
    );
    let replans = replans(events);
    let (from, to) = axis(run, &status, &lanes, &replans, now);
    Timeline {
        lanes,
        replans,
        from,
        to,
    }
}

/// A status time as a timestamp.
fn time_of(x: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> Option<Timestamp> {
    x.as_ref().map(|t| t.0)
}

/// A step's lane: its attempts, the Approvals that held it, the signal it
/// waited for, a skip, and how long its result stays fresh.
fn step_lane(
    cp: &StepCheckpoint,
    approvals: &[Approval],
    events: &[Event],
    now: Timestamp,
) -> Lane {
    let role = match cp.role {
        agentrun_api::StepRole::Step => "step",
        agentrun_api::StepRole::Planner => "planner",
        agentrun_api::StepRole::Compactor => "compactor before step",
        agentrun_api::StepRole::Verify => "verify probe of step",
    };
    let rec = Record {
        label: format!("{} r{}", cp.name, cp.plan_revision),
        subject: format!("{role} {}", cp.name),
        attempt: cp.attempt,
        pod: cp.pod.as_deref(),
        phase: cp.phase,
        started: time_of(&cp.started_at),
        finished: time_of(&cp.finished_at),
        fresh_until: time_of(&cp.fresh_until),
    };
    let mut bars = attempts(&rec, events, now);
    bars.extend(approval_bars(cp, approvals, now));
    if cp.signal.is_some()
        && let Some(start) = rec.started
    {
        // From when the step began to wait until the signal came (or
        // its deadline passed); the step's message says which.
        let end = rec.finished.unwrap_or(now);
        let what = match cp.phase {
            StepPhase::Waiting => "waiting".to_owned(),
            _ => cp
                .message
                .clone()
                .unwrap_or_else(|| format!("{:?}", cp.phase)),
        };
        bars.push(Bar {
            start,
            end: end.max(start),
            kind: BarKind::Signal,
            label: format!("signal: {what}"),
        });
    } else if bars.iter().all(|b| b.kind == BarKind::Approval)
        && let (Some(by), Some(f)) = (&cp.decided_by, rec.finished)
    {
        // Released by a person without an Approval object left.
        bars.push(Bar {
            start: f,
            end: f,
            kind: BarKind::Approval,
            label: format!("approval: released by {by}"),
        });
    }
    if cp.phase == StepPhase::Skipped
        && let Some(f) = rec.finished
    {
        bars.push(Bar {
            start: f,
            end: f,
            kind: BarKind::Skipped,
            label: cp.message.clone().unwrap_or_else(|| "skipped".into()),
        });
    }
    // A wait comes before the attempt it released, also within one second.
    bars.sort_by_key(|b| (b.start, b.kind != BarKind::Approval));
    let fresh = match (rec.fresh_until, rec.finished) {
        (Some(u), Some(f)) if cp.phase == StepPhase::Succeeded => Some((f, u)),
        _ => None,
    };
    Lane {
        label: rec.label.clone(),
        bars,
        fresh,
        calls: Vec::new(),
    }
}

/// The Approvals of the step at its plan revision, from their creation to
/// their decision (or now).
fn approval_bars(cp: &StepCheckpoint, approvals: &[Approval], now: Timestamp) -> Vec<Bar> {
    let mut bars = Vec::new();
    for a in approvals
        .iter()
        .filter(|a| a.spec.step == cp.name && a.spec.plan_revision == cp.plan_revision)
    {
        let Some(start) = a.metadata.creation_timestamp.as_ref().map(|t| t.0) else {
            continue;
        };
        let st = a.status.clone().unwrap_or_default();
        let end = st.decided_at.map_or(now, |d| d.0);
        let who = a.spec.decided_by.clone().or(st.decided_by.clone());
        let label = match (a.spec.decision, who) {
            (Some(d), Some(by)) => format!("{d:?} by {by}"),
            (Some(d), None) => format!("{d:?}"),
            _ => format!("waiting ({:?})", st.phase),
        };
        bars.push(Bar {
            start,
            end: end.max(start),
            kind: BarKind::Approval,
            label: format!("approval: {label}"),
        });
    }
    bars
}

/// A compensation's lane: its attempts.
fn compensation_lane(c: &CompensationCheckpoint, events: &[Event], now: Timestamp) -> Lane {
    let rec = Record {
        label: format!("undo {} r{}", c.name, c.plan_revision),
        subject: format!("compensation of step {}", c.name),
        attempt: c.attempt,
        pod: c.pod.as_deref(),
        phase: c.phase,
        started: time_of(&c.started_at),
        finished: time_of(&c.finished_at),
        fresh_until: None,
    };
    Lane {
        label: rec.label.clone(),
        bars: attempts(&rec, events, now),
        fresh: None,
        calls: Vec::new(),
    }
}

/// When the plan was adopted or changed, and the revision it became.
fn replans(events: &[Event]) -> Vec<(Timestamp, String)> {
    let mut replans: Vec<(Timestamp, String)> = events
        .iter()
        .filter(|e| {
            reason(e) == Reason::Replanned.as_str() || reason(e) == Reason::PlanAdopted.as_str()
        })
        .filter_map(|e| {
            let when = event_time(e)?;
            let note = e.note.clone().unwrap_or_default();
            let rev = note
                .split_whitespace()
                .skip_while(|w| *w != "revision")
                .nth(1)
                .map(|r| format!("r{}", r.trim_end_matches(|c: char| !c.is_ascii_digit())))
                .unwrap_or_else(|| "re-plan".into());
            Some((when, rev))
        })
        .collect();
    replans.sort();
    replans
}

/// Where the axis starts and ends: from the run's creation or first bar to
/// its last bar, re-plan or completion (now, while it runs).
fn axis(
    run: &AgentRun,
    status: &AgentRunStatus,
    lanes: &[Lane],
    replans: &[(Timestamp, String)],
    now: Timestamp,
) -> (Timestamp, Timestamp) {
    let created = run.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let starts = lanes.iter().flat_map(|l| l.bars.iter().map(|b| b.start));
    let from = created.into_iter().chain(starts).min().unwrap_or(now);
    let terminal = status.phase.is_some_and(|p| p.is_terminal());
    let ends = lanes.iter().flat_map(|l| l.bars.iter().map(|b| b.end));
    let last = ends
        .chain(replans.iter().map(|r| r.0))
        .chain(time_of(&status.completed_at))
        .max()
        .unwrap_or(now);
    let to = if terminal { last } else { last.max(now) };
    // At least a second of axis, so a run that took no time still has width.
    let to = to.max(from + jiff::SignedDuration::from_secs(1));
    // A freshness window that outlasts the run shows a quarter more axis
    // (its end is in the bar's title), not hours that squash the attempts.
    let span = to.duration_since(from);
    let fresh_end = lanes.iter().filter_map(|l| l.fresh.map(|f| f.1)).max();
    let to = match fresh_end {
        Some(end) if end > to => end.min(to + span / 4),
        _ => to,
    };
    (from, to)
}

/// The SVG's geometry, in viewBox units.
pub const WIDTH: f64 = 1000.0;
pub const LABEL: f64 = 170.0;
pub const LANE: f64 = 30.0;
pub const TOP: f64 = 24.0;

impl Timeline {
    /// The x of `at` on the axis.
    pub fn x(&self, at: Timestamp) -> f64 {
        let span = self.to.duration_since(self.from).as_secs_f64().max(0.001);
        let off = at.duration_since(self.from).as_secs_f64().clamp(0.0, span);
        LABEL + (WIDTH - LABEL - 10.0) * off / span
    }

    pub fn height(&self) -> f64 {
        TOP + LANE * self.lanes.len().max(1) as f64 + 8.0
    }

    /// The markup: an `<svg role="img">` with a title per bar.
    pub fn svg(&self) -> Markup {
        let h = self.height();
        let span = self.to.duration_since(self.from);
        let ticks: Vec<(f64, String)> = (0..=4)
            .map(|i| {
                let at = self.from + span * i / 4;
                (self.x(at), tick(at.duration_since(self.from), span))
            })
            .collect();
        html! {
            svg class="timeline" viewBox=(format!("0 0 {WIDTH} {h}")) role="img"
                aria-label=(format!("Timeline of {} lanes from {} to {}", self.lanes.len(), self.from, self.to))
                xmlns="http://www.w3.org/2000/svg" {
                defs {
                    pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)" {
                        rect class="hatch-bg" width="6" height="6" {}
                        line class="hatch-line" x1="0" y1="0" x2="0" y2="6" {}
                    }
                }
                @for (x, label) in &ticks {
                    line class="tick" x1=(fmt(*x)) y1="16" x2=(fmt(*x)) y2=(fmt(h)) {}
                    text class="tick-label" x=(fmt(*x)) y="12" text-anchor=(if *x >= WIDTH - 20.0 { "end" } else { "middle" }) { "+" (label) }
                }
                @for (i, lane) in self.lanes.iter().enumerate() {
                    @let y = TOP + LANE * i as f64;
                    g class="lane" {
                        text class="lane-label" x="4" y=(fmt(y + 19.0)) { (crate::render::truncate(&lane.label, 22)) }
                        @if let Some((a, b)) = lane.fresh {
                            @let (x0, x1) = (self.x(a), self.x(b));
                            rect class="fresh" x=(fmt(x0)) y=(fmt(y + 2.0)) width=(fmt((x1 - x0).max(1.0))) height=(fmt(LANE - 4.0)) {
                                title { (lane.label) ": result fresh until " (b) }
                            }
                            @if b > self.to {
                                text class="fresh-label" x=(fmt(x1 - 4.0)) y=(fmt(y + 19.0)) text-anchor="end" { "fresh →" }
                            }
                        }
                        @for bar in &lane.bars {
                            @let (x0, x1) = (self.x(bar.start), self.x(bar.end));
                            @let inset = if matches!(bar.kind, BarKind::Approval | BarKind::Signal) { 9.0 } else { 5.0 };
                            rect class=(format!("bar {}", bar.kind.class())) x=(fmt(x0)) y=(fmt(y + inset))
                                width=(fmt((x1 - x0).max(3.0))) height=(fmt(LANE - 2.0 * inset)) rx="2"
                                data-kind=(bar.kind.word()) {
                                title { (lane.label) ": " (bar.label) " (" (bar.start) " – " (bar.end) ")" }
                            }
                        }
                        @for call in &lane.calls {
                            @let (x0, x1) = (self.x(call.start), self.x(call.end));
                            // Model calls in the bar's upper half, tool calls in its lower.
                            @let top = match call.kind { CallKind::Model => y + 8.0, CallKind::Tool => y + LANE - 14.0 };
                            rect class=(call.class()) x=(fmt(x0)) y=(fmt(top))
                                width=(fmt((x1 - x0).max(2.0))) height="6" rx="1"
                                data-seq=(call.seq) data-call=(if call.kind == CallKind::Model { "model" } else { "tool" }) {
                                title { (lane.label) ": " (call.label) " (" (call.start) " – " (call.end) ")" }
                            }
                        }
                    }
                }
                @for (at, rev) in &self.replans {
                    @let x = self.x(*at);
                    line class="replan" x1=(fmt(x)) y1="16" x2=(fmt(x)) y2=(fmt(h)) {}
                    text class="replan-label" x=(fmt(x + 3.0)) y=(fmt(h - 2.0)) { (rev) }
                }
            }
        }
    }
}

/// `+1.5s` on a short axis, `+3m` on a long one.
fn tick(d: jiff::SignedDuration, span: jiff::SignedDuration) -> String {
    if span.as_secs() < 20 {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        crate::render::short(d)
    }
}

fn fmt(v: f64) -> String {
    format!("{v:.1}")
}
