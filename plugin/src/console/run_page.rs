//! The run page (`/ns/NS/runs/RUN`): the timeline, the step table with each
//! result as JSON, compensations, the retry form (`retry::section`), where a
//! fork came from, approvals, what a wait step waits for (a signal: the
//! command that sends it), plan revision history and the run's Events. Pure:
//! a function of the objects and `now`.

use agentrun_api::{
    AgentRun, AgentRunStatus, Approval, EffectOutcome, Signal, StepCheckpoint, StepPhase,
};
use agentrun_engine::reasons::Reason;
use jiff::Timestamp;
use k8s_openapi::api::events::v1::Event;
use maud::{Markup, html};

use super::history_page::record_href;
use super::pages::{Frame, json_view, layout, phase_badge};
use super::retry;
use super::timeline;
use crate::render;

pub fn run_page(
    frame: &Frame<'_>,
    run: &AgentRun,
    related: &render::Related<'_>,
    decide: bool,
    now: Timestamp,
) -> Markup {
    let name = run.metadata.name.clone().unwrap_or_default();
    let ns = run.metadata.namespace.clone().unwrap_or_default();
    let body = html! {
        nav class="crumbs" aria-label="Breadcrumb" {
            a href="/" { "Runs" } " / "
            a href=(format!("/?namespace={ns}")) { (ns) } " / "
            span aria-current="page" { (name) }
        }
        div id="run" hx-ext="sse" sse-connect=(format!("/events/ns/{ns}/runs/{name}")) sse-swap="run" {
            (run_detail(run, related, decide, now))
        }
    };
    layout(&name, frame, "run", body)
}

fn effect(e: Option<EffectOutcome>) -> &'static str {
    match e {
        Some(EffectOutcome::Applied) => "Applied",
        Some(EffectOutcome::NotApplied) => "NotApplied",
        Some(EffectOutcome::Unknown) => "Unknown",
        None => "-",
    }
}

fn took(cp: &StepCheckpoint, now: Timestamp) -> String {
    match (&cp.started_at, &cp.finished_at) {
        (Some(a), Some(b)) => render::short(b.0.duration_since(a.0)),
        (Some(a), None) if cp.phase == agentrun_api::StepPhase::Running => {
            format!("{} so far", render::short(now.duration_since(a.0)))
        }
        _ => "-".into(),
    }
}

fn event_time(e: &Event) -> Option<Timestamp> {
    e.event_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| e.deprecated_last_timestamp.as_ref().map(|t| t.0))
        .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// Where a fork came from, with a link to its source run: the operator's
/// record (`status.forkedFrom`), or what the spec asks until it is read.
fn lineage(run: &AgentRun, ns: &str) -> Option<Markup> {
    let from = |name: &str| {
        html! { a class="fork-source" href=(format!("/ns/{ns}/runs/{name}")) { (name) } }
    };
    let status = run.status.as_ref();
    if let Some(f) = status.and_then(|s| s.forked_from.as_ref()) {
        return Some(html! {
            p class="forked-from" {
                "Forked from " (from(&f.run_name)) " at " strong { (f.from_step) }
                @if let Some(by) = &f.requested_by { ", by " strong class="requester" { (by) } }
                " · kept: " @if f.inherited.is_empty() { "nothing" } @else { (f.inherited.join(", ")) }
            }
        });
    }
    let f = run.spec.fork_of.as_ref()?;
    Some(html! {
        p class="forked-from" {
            "Forked from " (from(&f.run_name)) " at " strong { (f.from_step) }
            " (not yet read by the operator)"
        }
    })
}

/// Everything below the breadcrumbs (the fragment the stream sends again).
/// `related`: the run's Approvals, Signals, journal chunks and Events where
/// they could be read; `decide`: the console offers writes (the retry form).
pub fn run_detail(
    run: &AgentRun,
    related: &render::Related<'_>,
    decide: bool,
    now: Timestamp,
) -> Markup {
    let render::Related {
        approvals,
        signals,
        journals,
        events,
    } = *related;
    let status = run.status.clone().unwrap_or_default();
    let tl = timeline::build(run, approvals, events, journals, now);
    let calls = tl.lanes.iter().any(|l| !l.calls.is_empty());
    html! {
        (run_head(run, &status, approvals, signals, now))
        section aria-labelledby="tl-h" {
            h2 id="tl-h" { "Timeline" }
            div class="timeline-wrap" { (tl.svg()) }
            @if calls {
                p class="call-legend" {
                    "Journaled calls inside a step's bar: "
                    span class="call-key call-model" {} " model (upper) "
                    span class="call-key call-tool" {} " tool (lower) "
                    span class="call-key call-tool call-nonidempotent" {} " NonIdempotent "
                    span class="call-key call-tool call-unknown" {} " may have acted, not settled"
                }
            }
        }
        (steps_section(run, &status, signals, now))
        (retry::section(run, decide))
        (approvals_section(approvals))
        (plan_section(&status, events))
        (events_section(events, now))
    }
}

/// The run's name, phase and counts; its lineage, its record (or the run
/// it already ran as); and what it waits for.
fn run_head(
    run: &AgentRun,
    status: &AgentRunStatus,
    approvals: &[Approval],
    signals: &[Signal],
    now: Timestamp,
) -> Markup {
    let name = run.metadata.name.clone().unwrap_or_default();
    let ns = run.metadata.namespace.clone().unwrap_or_default();
    let phase = status
        .phase
        .map(|p| format!("{p:?}"))
        .unwrap_or_else(|| "-".into());
    let budget = run.spec.budget.as_ref().and_then(|b| b.tokens);
    html! {
        header class="run-head" {
            h1 { (name) " " (phase_badge(&phase)) }
            p class="meta" {
                "step " (status.current_step.clone().unwrap_or_else(|| "-".into()))
                " · progress " (status.progress.clone().unwrap_or_else(|| "-".into()))
                " · tokens " (status.tokens_used) @if let Some(b) = budget { " of " (b) }
                " · step Pods " (status.step_executions)
                @if let Some(c) = &run.metadata.creation_timestamp { " · created " (render::age(c.0, now)) " ago" }
            }
            @if let Some(l) = lineage(run, &ns) { (l) }
            @if let Some(prior) = &status.already_ran {
                div class="notice already-ran" role="status" {
                    p {
                        strong { "This run ran nothing." }
                        " A run " (name) " with the same spec already ran in " (ns)
                        " (UID " code { (prior.run_uid) } ") and ended "
                        (phase_badge(&prior.outcome)) " at "
                        time datetime=(prior.completed_at.0.to_string()) { (prior.completed_at.0) } ". "
                        "Its record: " a class="record-link" href=(record_href(&ns, &prior.record)) { (prior.record) } "."
                    }
                    p class="note" {
                        "A re-sync is not a re-run: to run it again on purpose, create it with the annotation "
                        code { "agentrun.dev/rerun" } " set to a new value."
                    }
                }
            } @else if let Some(record) = &status.record {
                p class="recorded" {
                    "Recorded: " a class="record-link" href=(record_href(&ns, record)) { (record) }
                    " " small { "(kept after the run is deleted)" }
                }
            }
            @if let Some(w) = render::waiting_for(run, approvals) {
                p class="waiting" { "Waiting for " a href="/approvals" { (w) } }
            }
            @if status.queue_position.is_some() {
                p class="waiting queued" {
                    "Waiting for a place to start: "
                    (status.conditions.iter().find(|c| c.type_ == "Succeeded").map(|c| c.message.clone()).unwrap_or_default())
                }
            }
            @for cp in status.steps.iter().filter(|c| c.phase == StepPhase::Waiting) {
                @if let Some(g) = render::signal_step(run, cp, signals) {
                    div class="waiting signal" data-signal=(g.name) {
                        p {
                            "Step " strong { (cp.name) } " waits for a signal"
                            @if let Some(d) = &g.description { ": " span class="signal-what" { (d) } }
                            " · Signal " code { (g.name) } " · "
                            @if let Some(t) = g.expires {
                                "expires at " time datetime=(t.to_string()) { (t) }
                                " (" @if t > now { "in " (render::short(t.duration_since(now))) } @else { "now" } ")"
                            } @else { "no deadline" }
                        }
                        p { "Send it with: " code class="send" { (g.command(Some(&ns))) } }
                    }
                } @else if let Some(t) = &cp.wake_at {
                    p class="waiting wait" {
                        "Step " strong { (cp.name) } " wakes at "
                        time datetime=(t.0.to_string()) { (t.0) }
                        " (in " (render::short(t.0.duration_since(now))) ")"
                    }
                }
            }
        }
    }
}

/// The steps' table and the compensations.
fn steps_section(
    run: &AgentRun,
    status: &AgentRunStatus,
    signals: &[Signal],
    now: Timestamp,
) -> Markup {
    html! {
        section aria-labelledby="steps-h" {
            h2 id="steps-h" { "Steps" }
            div class="scroll" {
                table class="steps" {
                    thead { tr {
                        th scope="col" { "Step" } th scope="col" { "Phase" } th scope="col" { "Attempt" }
                        th scope="col" { "Effect" } th scope="col" { "Key" } th scope="col" { "Tokens" }
                        th scope="col" { "Took" } th scope="col" { "Result" }
                    } }
                    tbody {
                        @for cp in &status.steps {
                            (step_row(run, cp, signals, now))
                        }
                    }
                }
            }
            @if !status.compensations.is_empty() {
                h3 { "Compensations" }
                ul {
                    @for c in &status.compensations {
                        li { "undo " (c.name) " r" (c.plan_revision) " · attempt " (c.attempt) " · " (phase_badge(&format!("{:?}", c.phase)))
                            @if let Some(m) = &c.message { " · " (m) } }
                    }
                }
            }
        }
    }
}

/// One step's row: phase, attempt, effect, key, tokens, time, and its
/// result with who released it or which signal it took.
fn step_row(run: &AgentRun, cp: &StepCheckpoint, signals: &[Signal], now: Timestamp) -> Markup {
    html! {
        tr data-step=(cp.name) {
            th scope="row" { (cp.name) " " small { "r" (cp.plan_revision) } }
            td data-label="Phase" { (phase_badge(&format!("{:?}", cp.phase))) }
            td data-label="Attempt" { (cp.attempt) @if cp.disruptions > 0 { " " small { "(" (cp.disruptions) " disrupted)" } } }
            td data-label="Effect" { (effect(cp.effect)) }
            td data-label="Key" { code class="key" { (cp.idempotency_key) } }
            td data-label="Tokens" { (cp.tokens.map(|t| t.total().to_string()).unwrap_or_else(|| "-".into())) }
            td data-label="Took" { (took(cp, now)) }
            td data-label="Result" {
                @if let Some(r) = &cp.result {
                    details { summary { (render::truncate(&r.to_string(), 40)) } (json_view(r)) }
                } @else if cp.result_truncated { "not kept in status" } @else { "-" }
                @match (render::signal_step(run, cp, signals), &cp.decided_by) {
                    (Some(g), _) if cp.phase == StepPhase::Succeeded => {
                        div class="decided signal-received" {
                            "signal " @if let Some(id) = &g.id { code { (id) } " " }
                            @if let Some(by) = &g.sender { "from " strong { (by) } }
                        }
                    }
                    (_, Some(by)) => { div class="decided" { "released by " strong { (by) } } }
                    _ => {}
                }
                @if let Some(u) = &cp.fresh_until {
                    div class="fresh-note" { "fresh until " time datetime=(u.0.to_string()) { (u.0) } @if u.0 <= now { " (stale)" } }
                }
                @if let Some(m) = &cp.message { div class="message" { (m) } }
            }
        }
    }
}

/// The run's Approvals, with who decided each.
fn approvals_section(approvals: &[Approval]) -> Markup {
    html! {
        @if !approvals.is_empty() {
            section aria-labelledby="apv-h" {
                h2 id="apv-h" { "Approvals" }
                ul class="approvals" {
                    @for a in approvals {
                        @let st = a.status.clone().unwrap_or_default();
                        li data-approval=(a.metadata.name.clone().unwrap_or_default()) {
                            code { (a.metadata.name.clone().unwrap_or_default()) } " " (format!("{:?}", a.spec.kind)) " · "
                            (phase_badge(&format!("{:?}", st.phase)))
                            @if let Some(by) = a.spec.decided_by.clone().or(st.decided_by.clone()) {
                                " · decided by " strong class="decider" { (by) }
                                @if let Some(at) = &st.decided_at { " at " (at.0) }
                            }
                            @if let Some(c) = &a.spec.comment { " · “" (c) "”" }
                        }
                    }
                }
            }
        }
    }
}

/// The current plan and the Events that adopted or changed it.
fn plan_section(status: &AgentRunStatus, events: &[Event]) -> Markup {
    let plan_events: Vec<&Event> = events
        .iter()
        .filter(|e| {
            let r = e.reason.as_deref().unwrap_or("");
            r == Reason::PlanAdopted.as_str() || r == Reason::Replanned.as_str()
        })
        .collect();
    html! {
        section aria-labelledby="plan-h" {
            h2 id="plan-h" { "Plan" }
            @if let Some(p) = &status.plan {
                p { "Revision " (p.revision) " from " (format!("{:?}", p.source)) " (" (p.reason) "): " (p.step_names.join(" → ")) }
            }
            @if !plan_events.is_empty() {
                ol class="plan-history" {
                    @for e in &plan_events {
                        li { @if let Some(t) = event_time(e) { time datetime=(t.to_string()) { (t) } " " } (e.note.clone().unwrap_or_default()) }
                    }
                }
            }
        }
    }
}

/// The run's Events, newest first.
fn events_section(events: &[Event], now: Timestamp) -> Markup {
    html! {
        section aria-labelledby="ev-h" {
            h2 id="ev-h" { "Events" }
            @if events.is_empty() { p class="empty" { "No Events (they expire after an hour)." } }
            @else {
                div class="scroll" {
                    table class="events" {
                        thead { tr { th scope="col" { "Age" } th scope="col" { "Type" } th scope="col" { "Reason" } th scope="col" { "Message" } } }
                        tbody {
                            @for e in events.iter().rev() {
                                tr class=(format!("ev-{}", e.type_.clone().unwrap_or_default().to_lowercase())) {
                                    td { @if let Some(t) = event_time(e) { time datetime=(t.to_string()) title=(t.to_string()) { (render::age(t, now)) } } }
                                    td { (e.type_.clone().unwrap_or_default()) }
                                    td { (e.reason.clone().unwrap_or_default()) }
                                    td { (e.note.clone().unwrap_or_default()) }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
