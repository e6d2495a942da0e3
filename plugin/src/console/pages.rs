//! The console's pages as pure functions of what the watches hold (and of
//! `now`): the layout, the runs table and the approvals inbox. The run page
//! is in `run_page`. Live parts are fragments the SSE streams send again.

use agentrun_api::{AgentRun, Approval, ApprovalKind, Decision};
use jiff::Timestamp;
use maud::{DOCTYPE, Markup, html};

use super::filter::RunFilter;
use crate::identity::Identity;
use crate::render;

/// The phases a run can be in, for the filter.
pub const PHASES: [&str; 11] = [
    "Pending",
    "Queued",
    "Planning",
    "Running",
    "WaitingForApproval",
    "Waiting",
    "Compensating",
    "Succeeded",
    "Failed",
    "Cancelled",
    "AlreadyRan",
];

/// What every page shows around its content: who you are, and why what it
/// shows may be incomplete (a watch the API server refuses or lost).
pub struct Frame<'a> {
    pub me: &'a Identity,
    pub warnings: Vec<String>,
    /// Signed in with a token (in the cluster): offer to sign out.
    pub sign_out: bool,
    /// The namespace shown, when the user may not list every one and may
    /// choose another.
    pub namespace: Option<&'a str>,
}

/// The page around every view: navigation, who you are, the help overlay.
pub fn layout(title: &str, frame: &Frame<'_>, current: &str, body: Markup) -> Markup {
    let me = frame.me;
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="color-scheme" content="light dark";
                // The CSP allows no inline style: htmx's injected one is off.
                meta name="htmx-config" content=r#"{"includeIndicatorStyles":false,"allowEval":false}"#;
                title { (title) " · agentrun console" }
                link rel="stylesheet" href="/assets/console.css";
                script src="/assets/htmx.min.js" {}
                script src="/assets/htmx-ext-sse.min.js" {}
                script src="/assets/console.js" defer {}
            }
            body {
                a class="skip" href="#main" { "Skip to content" }
                header class="top" {
                    nav aria-label="Main" {
                        a class="brand" href="/" { "agentrun" }
                        a href="/" aria-current=[(current == "runs").then_some("page")] { "Runs" }
                        a href="/approvals" aria-current=[(current == "inbox").then_some("page")] { "Approvals" }
                        a href="/history" aria-current=[(current == "history").then_some("page")] { "History" }
                    }
                    span class="whoami" title="Who the API server says you are" {
                        "as " strong id="whoami" { (me.user) }
                    }
                    @if let Some(ns) = frame.namespace {
                        form class="namespace" method="get" action="/namespace" {
                            label { "Namespace "
                                input type="text" name="name" value=(ns) size="16" required
                                    pattern="[a-z0-9]([-a-z0-9]*[a-z0-9])?" maxlength="63";
                            }
                            button type="submit" { "Show" }
                        }
                    }
                    @if frame.sign_out { (super::auth::sign_out()) }
                    button type="button" class="help-button" aria-haspopup="dialog" aria-controls="help"
                        aria-keyshortcuts="?" { "?" }
                }
                main id="main" tabindex="-1" {
                    @for w in &frame.warnings { p class="warning" role="alert" { (w) } }
                    (body)
                }
                (help())
            }
        }
    }
}

fn help() -> Markup {
    html! {
        dialog id="help" aria-labelledby="help-title" {
            h2 id="help-title" { "Keyboard and help" }
            dl class="keys" {
                dt { kbd { "?" } } dd { "this help" }
                dt { kbd { "g" } " " kbd { "r" } } dd { "runs" }
                dt { kbd { "g" } " " kbd { "i" } } dd { "approvals inbox" }
                dt { kbd { "g" } " " kbd { "h" } } dd { "history of finished runs" }
                dt { kbd { "/" } } dd { "search runs" }
                dt { kbd { "Esc" } } dd { "close" }
            }
            p { "Everything here is read and written as you (your kubeconfig's user, or in the cluster the user you signed in as): "
                "what you see is what RBAC lets you list, and a decision is refused or accepted "
                "by the API server and its admission policies exactly as with "
                code { "kubectl agentrun approve" } "." }
            p { "Pages update live from watches; the timeline shows every attempt of every step: "
                span class="key bar-succeeded" {} " succeeded "
                span class="key bar-running" {} " running "
                span class="key bar-failed" {} " failed "
                span class="key bar-disrupted" {} " disrupted "
                span class="key bar-timedout" {} " timed out "
                span class="key bar-approval" {} " waiting for a decision "
                span class="key bar-signal" {} " waiting for a signal "
                span class="key bar-skipped" {} " skipped (its condition was false) "
                span class="key fresh" {} " fresh result." }
            form method="dialog" { button { "Close" } }
        }
    }
}

fn ts(t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> Option<Timestamp> {
    t.map(|t| t.0)
}

/// `1/3` into a fraction for the progress bar.
pub fn progress(p: Option<&str>) -> Option<(u32, u32)> {
    let (a, b) = p?.split_once('/')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
}

pub fn phase_badge(phase: &str) -> Markup {
    html! { span class=(format!("phase phase-{}", phase.to_lowercase())) { (phase) } }
}

/// The runs page: the filter form and the live table.
pub fn runs_page(
    frame: &Frame<'_>,
    runs: &[AgentRun],
    approvals: &[Approval],
    namespaces: &[String],
    f: &RunFilter,
    now: Timestamp,
) -> Markup {
    let body = html! {
        h1 { "Runs" }
        form class="filters" method="get" action="/" role="search" {
            label { "Phase "
                select name="phase" {
                    option value="" { "any" }
                    @for p in PHASES { option value=(p) selected[f.phase == p] { (p) } }
                }
            }
            @if namespaces.len() > 1 || !f.namespace.is_empty() {
                label { "Namespace "
                    select name="namespace" {
                        option value="" { "any" }
                        @for n in namespaces { option value=(n) selected[&f.namespace == n] { (n) } }
                    }
                }
            }
            label { "Label " input name="label" value=(f.label) placeholder="team=payments" size="14"; }
            label { "Search " input id="search" type="search" name="q" value=(f.q) placeholder="name, step, message" size="16"; }
            label { "Sort "
                select name="sort" {
                    option value="" { "newest first" }
                    option value="oldest" selected[f.sort == "oldest"] { "oldest first" }
                }
            }
            button type="submit" { "Filter" }
        }
        div id="runs" hx-ext="sse" sse-connect=(format!("/events/runs?{}", f.query())) sse-swap="runs" aria-live="polite" {
            (runs_table(runs, approvals, f, now))
        }
    };
    layout("Runs", frame, "runs", body)
}

/// The table of runs (the fragment the stream sends again on each change).
pub fn runs_table(
    runs: &[AgentRun],
    approvals: &[Approval],
    f: &RunFilter,
    now: Timestamp,
) -> Markup {
    let shown = f.apply(runs);
    html! {
        table class="runs" {
            caption { (shown.len()) " of " (runs.len()) " runs" }
            thead { tr {
                th scope="col" { "Name" } th scope="col" { "Phase" } th scope="col" { "Step" }
                th scope="col" { "Progress" } th scope="col" { "Tokens" } th scope="col" { "Waiting for" }
                th scope="col" { "Age" }
            } }
            tbody {
                @if shown.is_empty() {
                    tr { td colspan="7" class="empty" { "No runs match." } }
                }
                @for r in shown {
                    (run_row(r, approvals, now))
                }
            }
        }
    }
}

fn run_row(r: &AgentRun, approvals: &[Approval], now: Timestamp) -> Markup {
    let status = r.status.clone().unwrap_or_default();
    let name = r.metadata.name.clone().unwrap_or_default();
    let ns = r.metadata.namespace.clone().unwrap_or_default();
    let phase = status
        .phase
        .map(|p| format!("{p:?}"))
        .unwrap_or_else(|| "-".into());
    let budget = r.spec.budget.as_ref().and_then(|b| b.tokens);
    let created = ts(r.metadata.creation_timestamp.as_ref());
    html! {
        tr data-run=(name) data-namespace=(ns) {
            th scope="row" {
                a href=(format!("/ns/{ns}/runs/{name}")) { (name) }
                br; small class="ns" { (ns) }
            }
            td data-label="Phase" {
                (phase_badge(&phase))
                @if let Some(q) = status.queue_position { " " small class="queue" { "#" (q) " in queue" } }
            }
            td data-label="Step" { (status.current_step.clone().unwrap_or_else(|| "-".into())) }
            td data-label="Progress" {
                @if let Some((a, b)) = progress(status.progress.as_deref()) {
                    progress value=(a) max=(b.max(1)) aria-label=(format!("{a} of {b} steps")) {}
                    " " small { (a) "/" (b) }
                } @else { "-" }
            }
            td data-label="Tokens" {
                @match budget {
                    Some(b) => {
                        meter value=(status.tokens_used) max=(b.max(1)) high=((b * 8 / 10).max(1)) aria-label="tokens of budget" {}
                        " " small { (status.tokens_used) "/" (b) }
                    }
                    None => { (status.tokens_used) }
                }
            }
            td data-label="Waiting for" { (render::waiting_who(r, approvals).unwrap_or_else(|| "-".into())) }
            td data-label="Age" {
                @if let Some(c) = created {
                    time datetime=(c.to_string()) title=(c.to_string()) { (render::age(c, now)) }
                }
            }
        }
    }
}

/// The inbox page: pending approvals, those the user may decide first.
pub fn inbox_page(
    frame: &Frame<'_>,
    approvals: &[Approval],
    now: Timestamp,
    decide: bool,
) -> Markup {
    let body = html! {
        h1 { "Approvals inbox" }
        div id="decisions" class="decisions" role="status" aria-live="polite" {}
        div id="inbox" hx-ext="sse" sse-connect="/events/approvals" sse-swap="inbox" {
            (inbox(frame.me, approvals, now, decide))
        }
    };
    layout("Approvals", frame, "inbox", body)
}

/// The list of pending approvals (the fragment the stream sends again);
/// with the decision forms unless `decide` is false (the read-only view).
pub fn inbox(me: &Identity, approvals: &[Approval], now: Timestamp, decide: bool) -> Markup {
    let mut pending: Vec<&Approval> = approvals.iter().filter(|a| render::is_pending(a)).collect();
    pending.sort_by_key(|a| {
        (
            me.may_decide(a).is_err(),
            a.spec
                .expires_at
                .as_ref()
                .map(|t| t.0)
                .unwrap_or(Timestamp::MAX),
            a.metadata.name.clone(),
        )
    });
    html! {
        @if pending.is_empty() {
            p class="empty" { "No approvals wait for a decision." }
        }
        @for a in pending { (approval_card(me, a, now, decide)) }
    }
}

fn approval_card(me: &Identity, a: &Approval, now: Timestamp, decide: bool) -> Markup {
    let name = a.metadata.name.clone().unwrap_or_default();
    let ns = a.metadata.namespace.clone().unwrap_or_default();
    let may = me.may_decide(a);
    let buttons: &[(Decision, &str)] = match a.spec.kind {
        ApprovalKind::Approve => &[
            (Decision::Approved, "Approve"),
            (Decision::Rejected, "Reject"),
        ],
        ApprovalKind::Reconcile => &[
            (Decision::Retry, "Retry"),
            (Decision::MarkSucceeded, "Mark succeeded"),
            (Decision::MarkFailed, "Mark failed"),
        ],
    };
    let approvers = a
        .spec
        .approvers
        .as_ref()
        .map(|x| x.describe())
        .unwrap_or_else(|| "anyone allowed by RBAC".into());
    let votes = a
        .spec
        .votes
        .iter()
        .filter(|v| v.decision == Decision::Approved)
        .count();
    let id = format!("approval-{name}");
    html! {
        article class=(if may.is_ok() { "approval may" } else { "approval" }) id=(id) aria-labelledby=(format!("{id}-q")) data-approval=(name) {
            header {
                h2 id=(format!("{id}-q")) { (a.spec.question) }
                p class="meta" {
                    (format!("{:?}", a.spec.kind)) " · run "
                    a href=(format!("/ns/{ns}/runs/{}", a.spec.run_name)) { (a.spec.run_name) }
                    " · step " (a.spec.step) " · " small { (ns) "/" (name) }
                }
            }
            dl class="facts" {
                @if let Some(c) = &a.spec.context {
                    dt { "Why" } dd { (c.reason) }
                    @if let Some(e) = c.effect { dt { "Effect" } dd { (format!("{e:?}")) } }
                    @if let Some(k) = &c.idempotency_key { dt { "Idempotency key" } dd { code { (k) } } }
                    @if let Some(p) = &c.pod { dt { "Interrupted Pod" } dd { code { (p) } } }
                    @if !c.completed_steps.is_empty() { dt { "Done so far" } dd { (c.completed_steps.join(", ")) } }
                }
                dt { "Deadline" }
                dd {
                    @match a.spec.expires_at.as_ref().map(|t| t.0) {
                        Some(at) => time class="countdown" datetime=(at.to_string()) title=(at.to_string()) {
                            "in " (render::short(at.duration_since(now)))
                        },
                        None => "none",
                    }
                }
                dt { "May decide" } dd { (approvers) }
                @if let Some(told) = notified(a) {
                    dt { "Told" } dd class="notified" { (told) }
                }
                @if a.spec.quorum > 1 {
                    dt { "Votes" }
                    dd {
                        (votes) " of " (a.spec.quorum) " approvals"
                        @for v in &a.spec.votes { br; (v.user) ": " (format!("{:?}", v.decision)) }
                    }
                }
                dt { "You" }
                dd class="you" { @match &may { Ok(()) => "may decide", Err(r) => (r.explain(me, &name)) } }
            }
            @if !decide {
                p class="read-only" { "This console is read-only: decide with "
                    code { "kubectl agentrun approve " (a.spec.run_name) } " or in your own "
                    code { "kubectl agentrun console" } "." }
            } @else {
            form class="decide" hx-post=(format!("/ns/{ns}/approvals/{name}/decide"))
                hx-target="#decisions" hx-swap="afterbegin" {
                label for=(format!("{id}-comment")) { "Comment" }
                textarea id=(format!("{id}-comment")) name="comment" rows="2" placeholder="why (recorded with the decision)" {}
                div class="buttons" {
                    @for (d, label) in buttons {
                        button type="submit" name="decision" value=(format!("{d:?}"))
                            class=(if matches!(d, Decision::Rejected | Decision::MarkFailed) { "danger" } else { "" }) { (label) }
                    }
                }
            }
            }
        }
    }
}

/// What a decision came to: what was recorded, or the API server's refusal verbatim.
pub fn decision_result(approval: &str, outcome: &Result<String, String>) -> Markup {
    match outcome {
        Ok(done) => html! { p class="ok" data-approval=(approval) { (done) } },
        Err(refused) => html! {
            p class="refused" role="alert" data-approval=(approval) {
                strong { "Refused: " } span class="message" { (refused) }
            }
        },
    }
}

pub fn not_found(frame: &Frame<'_>, what: &str) -> Markup {
    layout(
        "Not found",
        frame,
        "",
        html! { h1 { "Not found" } p { (what) } p { a href="/" { "All runs" } " · " a href="/history" { "History" } } },
    )
}

/// Pretty JSON, escaped, for `<pre>`.
pub fn json_view(v: &serde_json::Value) -> Markup {
    let text = serde_json::to_string_pretty(v).unwrap_or_default();
    html! { pre class="json" tabindex="0" { (text) } }
}

/// Whether the approval's people were told (its `Notified` condition).
fn notified(a: &Approval) -> Option<String> {
    let st = a.status.as_ref()?;
    let c = st.conditions.iter().find(|c| c.type_ == "Notified")?;
    let delivered: Vec<&str> = st
        .notifications
        .iter()
        .filter(|d| d.state == agentrun_api::DeliveryState::Delivered)
        .map(|d| d.channel.as_str())
        .collect();
    Some(if c.status == "True" {
        format!("notified on {}", delivered.join(", "))
    } else {
        format!("not yet ({}): {}", c.reason, c.message)
    })
}
