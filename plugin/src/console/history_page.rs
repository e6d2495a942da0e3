//! The history pages: `/history`, the records finished runs left (D18),
//! newest first, and `/ns/NS/history/RECORD`, one record laid out like a
//! run's page. Read-only in every mode: a record is history, so there is
//! no form but the filter's GET and no live stream (a record never
//! changes). Pure: records, the filter and `now` in, markup out.
//!
//! ```text
//!   history::Store (list / get, as the user) ──▶ RunRecordSpec ──▶ table │ detail
//!                                                      └─ as_run ──▶ timeline::build
//! ```

use agentrun_api::{
    AgentRun, AgentRunStatus, CompensationCheckpoint, RecordedStep, RunRecordSpec, StepCheckpoint,
    StepRole,
};
use agentrun_history::{self as history, record_name};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ObjectMeta;
use maud::{Markup, html};

use super::filter::{HistoryFilter, encode};
use super::pages::{Frame, layout, phase_badge};
use super::timeline;
use crate::render;

/// The suggestions of the time filter: `since` values `kubectl agentrun
/// history --since` takes too.
pub const SINCE: [(&str, &str); 4] = [
    ("1h", "last hour"),
    ("24h", "last 24 hours"),
    ("168h", "last 7 days"),
    ("720h", "last 30 days"),
];

/// The link to one record.
pub fn record_href(namespace: &str, record: &str) -> String {
    format!("/ns/{}/history/{}", encode(namespace), encode(record))
}

fn href_of(r: &RunRecordSpec) -> String {
    record_href(&r.run.namespace, &record_name(&r.run.name, &r.run.uid))
}

/// What the history page lists: the records, whether there were more than
/// the limit, or why none could be read.
pub enum Listed<'a> {
    Records {
        records: &'a [RunRecordSpec],
        /// More records matched than the limit let through.
        more: bool,
    },
    /// A filter the page cannot use, or the store's refusal, in words.
    Trouble(&'a str),
}

/// Why the history could not be read, for a person: the API server's own
/// words, with what to do about a refusal or a missing RunRecord CRD.
pub fn trouble(e: &history::Error) -> String {
    match e {
        history::Error::Api(kube::Error::Api(s)) if s.code == 403 => format!(
            "You may not read the run history here: {}. Reading it takes get and list on runrecords.agentrun.dev (the chart's viewer role has them).",
            s.message
        ),
        history::Error::Api(kube::Error::Api(s)) if s.code == 404 => format!(
            "The API server does not serve RunRecords ({}): the RunRecord CRD is not installed. Install the CRDs of an operator with the history (docs/install.md).",
            s.message
        ),
        other => format!("Reading the run history: {other}"),
    }
}

/// The history page: the filters and the table (or why there is none).
/// `all_namespaces`: the console's scope is every namespace the user may
/// list, so the namespace is a filter; `namespaces` are its suggestions.
pub fn history_page(
    frame: &Frame<'_>,
    listed: Listed<'_>,
    f: &HistoryFilter,
    all_namespaces: bool,
    namespaces: &[String],
    now: Timestamp,
) -> Markup {
    let body = html! {
        h1 { "History" }
        p class="meta" {
            "Runs that finished, from the records the operator kept (outcome, effects, keys, approvals): "
            "they stay after the runs are deleted, for the operator's retention window. "
            "The same as " code { "kubectl agentrun history" } "; a record never changes, so this page is not live."
        }
        form class="filters" method="get" action="/history" role="search" {
            label { "Outcome "
                select name="outcome" {
                    option value="" { "any" }
                    @for o in ["Succeeded", "Failed", "Cancelled"] {
                        option value=(o) selected[f.outcome == o] { (o) }
                    }
                }
            }
            @if all_namespaces {
                label { "Namespace "
                    input name="namespace" value=(f.namespace) list="history-namespaces" placeholder="any" size="14";
                }
                datalist id="history-namespaces" { @for n in namespaces { option value=(n) {} } }
            }
            label { "Run " input name="run" value=(f.run) placeholder="any" size="14"; }
            label { "Requested by " input name="requested_by" value=(f.requested_by) placeholder="anyone" size="14"; }
            label { "Finished since "
                input name="since" value=(f.since) list="history-since" placeholder="24h or 2026-12-01" size="18";
            }
            datalist id="history-since" { @for (v, label) in SINCE { option value=(v) { (label) } } }
            @if !f.limit.is_empty() { input type="hidden" name="limit" value=(f.limit); }
            button type="submit" { "Filter" }
        }
        div id="history" {
            @match listed {
                Listed::Trouble(why) => p class="warning" role="alert" { (why) },
                Listed::Records { records, more } => (history_table(records, more, now)),
            }
        }
    };
    layout("History", frame, "history", body)
}

/// The table of records, each row linking to its record.
pub fn history_table(records: &[RunRecordSpec], more: bool, now: Timestamp) -> Markup {
    html! {
        table class="runs history" {
            caption {
                (records.len()) " records"
                @if more { ", the newest " (records.len()) "; more with a narrower filter or a larger " code { "limit" } }
            }
            thead { tr {
                th scope="col" { "Run" } th scope="col" { "Namespace" } th scope="col" { "Outcome" }
                th scope="col" { "Requested by" } th scope="col" { "Step Pods" } th scope="col" { "Tokens" }
                th scope="col" { "Duration" } th scope="col" { "Finished" }
            } }
            tbody {
                @if records.is_empty() {
                    tr { td colspan="8" class="empty" { "No records match." } }
                }
                @for r in records { (record_row(r, now)) }
            }
        }
    }
}

fn outcome_reason(r: &RunRecordSpec) -> Option<&str> {
    r.outcome
        .reason
        .as_deref()
        .filter(|x| *x != "RunSucceeded" && !x.is_empty())
}

fn record_row(r: &RunRecordSpec, now: Timestamp) -> Markup {
    let record = record_name(&r.run.name, &r.run.uid);
    let done = r.outcome.completed_at.0;
    html! {
        tr data-record=(record) data-run=(r.run.name) data-namespace=(r.run.namespace) {
            th scope="row" {
                a href=(href_of(r)) { (r.run.name) }
                br; small class="record" { (record) }
            }
            td data-label="Namespace" { (r.run.namespace) }
            td data-label="Outcome" {
                (phase_badge(&format!("{:?}", r.outcome.phase)))
                @if let Some(why) = outcome_reason(r) { " " small { (why) } }
            }
            td data-label="Requested by" { (r.run.requested_by.as_deref().unwrap_or("-")) }
            td data-label="Step Pods" { (r.outcome.step_executions) }
            td data-label="Tokens" { (r.outcome.tokens_used) }
            td data-label="Duration" { (r.outcome.duration.as_deref().unwrap_or("-")) }
            td data-label="Finished" {
                time datetime=(done.to_string()) title=(done.to_string()) { (render::age(done, now)) " ago" }
            }
        }
    }
}

/// A record as the run it was, for the timeline: its checkpoints with their
/// last attempt's times (the record keeps no Pods and no Events).
fn as_run(r: &RunRecordSpec) -> AgentRun {
    let step = |s: &RecordedStep| StepCheckpoint {
        name: s.name.clone(),
        role: s.role,
        plan_revision: s.plan_revision,
        attempt: s.attempt,
        idempotency_key: s.idempotency_key.clone(),
        phase: s.phase,
        effect: s.effect,
        provenance: s.provenance,
        started_at: s.started_at.clone(),
        finished_at: s.finished_at.clone(),
        decided_by: s.decided_by.clone(),
        ..StepCheckpoint::default()
    };
    let compensation = |s: &RecordedStep| CompensationCheckpoint {
        name: s.name.clone(),
        plan_revision: s.plan_revision,
        attempt: s.attempt,
        idempotency_key: s.idempotency_key.clone(),
        phase: s.phase,
        started_at: s.started_at.clone(),
        finished_at: s.finished_at.clone(),
        ..CompensationCheckpoint::default()
    };
    AgentRun {
        metadata: ObjectMeta {
            name: Some(r.run.name.clone()),
            namespace: Some(r.run.namespace.clone()),
            uid: Some(r.run.uid.clone()),
            creation_timestamp: Some(r.run.created_at.clone()),
            ..ObjectMeta::default()
        },
        status: Some(AgentRunStatus {
            phase: Some(r.outcome.phase),
            steps: r.steps.iter().map(step).collect(),
            compensations: r.compensations.iter().map(compensation).collect(),
            completed_at: Some(r.outcome.completed_at.clone()),
            ..AgentRunStatus::default()
        }),
        ..AgentRun::default()
    }
}

/// The timeline of a record: each checkpoint's last attempt, on the axis
/// from the run's creation to its end.
pub fn record_timeline(r: &RunRecordSpec) -> timeline::Timeline {
    timeline::build(&as_run(r), &[], &[], &[], r.outcome.completed_at.0)
}

/// One record's page. `live`: the run it records still exists (same UID),
/// so its page can be linked.
pub fn record_page(frame: &Frame<'_>, r: &RunRecordSpec, live: bool, now: Timestamp) -> Markup {
    let ns = &r.run.namespace;
    let record = record_name(&r.run.name, &r.run.uid);
    let body = html! {
        nav class="crumbs" aria-label="Breadcrumb" {
            a href="/history" { "History" } " / "
            a href=(format!("/history?namespace={}", encode(ns))) { (ns) } " / "
            span aria-current="page" { (record) }
        }
        div id="record" data-record=(record) { (record_detail(r, live, now)) }
    };
    layout(&format!("{} (record)", r.run.name), frame, "history", body)
}

/// A record that could not be read: the store's refusal, in words.
pub fn record_unreadable(frame: &Frame<'_>, ns: &str, record: &str, why: &str) -> Markup {
    let body = html! {
        nav class="crumbs" aria-label="Breadcrumb" {
            a href="/history" { "History" } " / " (ns) " / "
            span aria-current="page" { (record) }
        }
        h1 { "RunRecord " (record) }
        p class="warning" role="alert" { (why) }
    };
    layout(record, frame, "history", body)
}

fn time(t: Option<&Time>) -> Markup {
    match t {
        Some(t) => html! { time datetime=(t.0.to_string()) { (t.0) } },
        None => html! { "-" },
    }
}

fn took(s: &RecordedStep) -> String {
    match (&s.started_at, &s.finished_at) {
        (Some(a), Some(b)) => render::short(b.0.duration_since(a.0)),
        _ => "-".into(),
    }
}

/// How a step's outcome was established: a probe, a person, a fork, a sender.
fn how(s: &RecordedStep) -> Markup {
    html! {
        @match (s.provenance, &s.decided_by) {
            (Some(p), Some(by)) => { (format!("{p:?}")) " by " strong class="decider" { (by) } }
            (Some(p), None) => { (format!("{p:?}")) }
            (None, Some(by)) => { "by " strong class="decider" { (by) } }
            (None, None) => { "-" }
        }
    }
}

/// Everything below the breadcrumbs.
pub fn record_detail(r: &RunRecordSpec, live: bool, now: Timestamp) -> Markup {
    let phase = format!("{:?}", r.outcome.phase);
    let tl = record_timeline(r);
    html! {
        (record_head(r, now))
        (record_run(r, live))
        section aria-labelledby="outcome-h" {
            h2 id="outcome-h" { "Outcome" }
            dl class="facts outcome" {
                dt { "Outcome" } dd { (phase_badge(&phase)) }
                @if let Some(why) = &r.outcome.reason { dt { "Reason" } dd class="reason" { (why) } }
                @if let Some(m) = &r.outcome.message { dt { "Message" } dd class="message" { (m) } }
            }
        }
        section aria-labelledby="tl-h" {
            h2 id="tl-h" { "Timeline" }
            p class="meta" { "Each step's last attempt: the earlier ones were drawn from the run's Events, which a record does not keep." }
            div class="timeline-wrap" { (tl.svg()) }
        }
        (record_steps(r))
        (record_approvals(r))
        (record_signals(r))
    }
}

/// The run's name and outcome, what it cost, and what a record keeps.
fn record_head(r: &RunRecordSpec, now: Timestamp) -> Markup {
    let name = &r.run.name;
    let record = record_name(name, &r.run.uid);
    let phase = format!("{:?}", r.outcome.phase);
    let done = r.outcome.completed_at.0;
    html! {
        header class="run-head" {
            h1 { (name) " " (phase_badge(&phase)) }
            p class="meta" {
                "record " code { (record) }
                " · finished " time datetime=(done.to_string()) title=(done.to_string()) { (render::age(done, now)) " ago" }
                " · took " (r.outcome.duration.as_deref().unwrap_or("-"))
                " · tokens " (r.outcome.tokens_used)
                " · step Pods " (r.outcome.step_executions)
                " · plan revision " (r.outcome.plan_revision)
            }
            p class="note" {
                "The record of a finished run, as the operator wrote it when the run ended; it does not change. "
                "It keeps no Pods, logs, step results or Events: those went with the run."
            }
        }
    }
}

/// Who the run was, whether it is still there, and when it ran.
fn record_run(r: &RunRecordSpec, live: bool) -> Markup {
    let ns = &r.run.namespace;
    let name = &r.run.name;
    html! {
        section aria-labelledby="run-h" {
            h2 id="run-h" { "Run" }
            dl class="facts" {
                dt { "Run" }
                dd class="run" {
                    @if live {
                        a href=(format!("/ns/{}/runs/{}", encode(ns), encode(name))) { (name) } " (still there)"
                    } @else {
                        (name) " " small { "(deleted; a run of this name now, if any, is another run)" }
                    }
                }
                dt { "Namespace" } dd { (ns) }
                dt { "UID" } dd { code { (r.run.uid) } }
                dt { "Requested by" } dd class="requested-by" { (r.run.requested_by.as_deref().unwrap_or("-")) }
                @if let Some(t) = &r.run.rerun {
                    dt { "Rerun" } dd { code { (t) } " " small { "(agentrun.dev/rerun)" } }
                }
                @if let Some(f) = &r.run.forked_from {
                    dt { "Forked from" }
                    dd { "run " a href=(format!("/history?namespace={}&run={}", encode(ns), encode(f))) { (f) } }
                }
                dt { "Created" } dd { (time(Some(&r.run.created_at))) }
                dt { "Started" } dd { (time(r.outcome.started_at.as_ref())) }
                dt { "Finished" } dd { (time(Some(&r.outcome.completed_at))) }
                dt { "Spec digests" } dd { @for (i, d) in r.run.spec_digests.iter().enumerate() { @if i > 0 { ", " } code { (d) } } }
            }
        }
    }
}

/// The steps' table and the compensations.
fn record_steps(r: &RunRecordSpec) -> Markup {
    html! {
        section aria-labelledby="steps-h" {
            h2 id="steps-h" { "Steps" }
            @if r.steps.is_empty() { p class="empty" { "No step ran." } }
            @else {
                div class="scroll" {
                    table class="steps" {
                        thead { tr {
                            th scope="col" { "Step" } th scope="col" { "Phase" } th scope="col" { "Attempt" }
                            th scope="col" { "Effect" } th scope="col" { "Key" } th scope="col" { "How" }
                            th scope="col" { "Tokens" } th scope="col" { "Took" }
                        } }
                        tbody {
                            @for s in &r.steps {
                                tr data-step=(s.name) {
                                    th scope="row" {
                                        (s.name) " " small { "r" (s.plan_revision) }
                                        @if s.role != StepRole::Step { " " small { (format!("{:?}", s.role)) } }
                                    }
                                    td data-label="Phase" { (phase_badge(&format!("{:?}", s.phase))) }
                                    td data-label="Attempt" { (s.attempt) }
                                    td data-label="Effect" { (s.effect.map_or_else(|| "-".to_owned(), |e| format!("{e:?}"))) }
                                    td data-label="Key" { code class="key" { (s.idempotency_key) } }
                                    td data-label="How" { (how(s)) }
                                    td data-label="Tokens" { (s.tokens) }
                                    td data-label="Took" { (took(s)) }
                                }
                            }
                        }
                    }
                }
            }
            @if !r.compensations.is_empty() {
                h3 { "Compensations" }
                ul class="compensations" {
                    @for c in &r.compensations {
                        li { "undo " (c.name) " r" (c.plan_revision) " · attempt " (c.attempt) " · "
                            (phase_badge(&format!("{:?}", c.phase))) " · key " code class="key" { (c.idempotency_key) } }
                    }
                }
            }
        }
    }
}

/// Each approval with its decision, decider, comment and votes.
fn record_approvals(r: &RunRecordSpec) -> Markup {
    html! {
        section aria-labelledby="apv-h" {
            h2 id="apv-h" { "Approvals" }
            @if r.approvals.is_empty() { p class="empty" { "No Approval was asked." } }
            ul class="approvals" {
                @for a in &r.approvals {
                    li data-approval=(a.name) {
                        code { (a.name) } " " (a.kind) " · step " (a.step) " r" (a.plan_revision) " · "
                        (phase_badge(&a.phase))
                        @if let Some(d) = &a.decision { " · " (d) }
                        @if let Some(by) = &a.decided_by { " by " strong class="decider" { (by) } }
                        @if let Some(at) = &a.decided_at { " at " (time(Some(at))) }
                        @if let Some(c) = &a.comment { " · " span class="comment" { "“" (c) "”" } }
                        @if !a.votes.is_empty() {
                            div class="votes" { "votes: " @for (i, v) in a.votes.iter().enumerate() { @if i > 0 { ", " } span class="vote" { (v) } } }
                        }
                        @if let Some(d) = &a.step_digest { div class="decided" { "released step digest " code { (d) } } }
                    }
                }
            }
        }
    }
}

/// Each signal with its id and sender.
fn record_signals(r: &RunRecordSpec) -> Markup {
    html! {
        @if !r.signals.is_empty() {
            section aria-labelledby="sig-h" {
                h2 id="sig-h" { "Signals" }
                ul class="signals" {
                    @for g in &r.signals {
                        li data-signal=(g.name) {
                            code { (g.name) } " · step " (g.step) " · " (phase_badge(&g.phase))
                            @if let Some(id) = &g.id { " · id " code { (id) } }
                            @if let Some(by) = &g.sent_by { " · from " strong class="sender" { (by) } }
                            @if let Some(at) = &g.recorded_at { " at " (time(Some(at))) }
                        }
                    }
                }
            }
        }
    }
}
