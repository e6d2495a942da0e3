//! Retry or fork a finished run from the console: the form on its run page,
//! the preview (what `kubectl agentrun retry --dry-run` prints) and the
//! create, each through the plugin's own `crate::fork`, as the user.
//!
//! ```text
//!   run page ─ form (step, rerunActed, name)
//!      │ GET  /ns/NS/runs/RUN/retry/preview ─▶ retry::preview (the operator's fork plan)
//!      │        ◀─ the plan, and a "Create run" form holding exactly what was previewed
//!      │ POST /ns/NS/runs/RUN/retry ─────────▶ retry::create as the user ─▶ kube-apiserver
//!      ◀─ a link to the new run, or the API server's refusal verbatim
//! ```
//!
//! The section is part of the run page's live fragment (it appears when the
//! run ends) and is `hx-preserve`d, so a change streamed to the page keeps
//! the step chosen and the preview shown.

use agentrun_api::{AgentRun, RunPhase};
use agentrun_engine::fork::ForkPlan;
use axum::extract::{Form, Path, Query};
use axum::response::{IntoResponse, Response};
use jiff::Timestamp;
use kube::Client;
use maud::{Markup, html};
use serde::Deserialize;

use super::user::User;
use crate::client::Error;
use crate::fork::{Retry, default_from, not_retryable};

/// The form's fields (`rerunActed` is present only when checked).
#[derive(Deserialize, Debug, Default)]
pub struct RetryForm {
    #[serde(default)]
    pub from: String,
    #[serde(default, rename = "rerunActed")]
    pub rerun_acted: Option<String>,
    #[serde(default)]
    pub name: String,
}

impl RetryForm {
    pub fn request(&self) -> Retry {
        let given = |s: &str| Some(s.trim().to_owned()).filter(|s| !s.is_empty());
        Retry {
            from: given(&self.from),
            rerun_acted: self.rerun_acted.as_deref() == Some("true"),
            name: given(&self.name),
        }
    }
}

fn run_href(ns: &str, run: &str) -> String {
    format!("/ns/{ns}/runs/{run}")
}

/// The run page's retry section: the form for a run that ended, in a
/// console that decides; otherwise a line that says why there is none.
pub fn section(run: &AgentRun, decide: bool) -> Markup {
    let name = run.metadata.name.clone().unwrap_or_default();
    let ns = run.metadata.namespace.clone().unwrap_or_default();
    let phase = run
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .map_or("not started".to_owned(), |p| format!("{p:?}"));
    let ended = run
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .is_some_and(RunPhase::is_terminal);
    let from = default_from(run);
    html! {
        @if let Some(why) = not_retryable(run) {
            p class="retry-absent note" {
                @if ended {
                    (why)
                } @else {
                    "Retry is offered once the run has ended (it is " (phase) ")."
                }
            }
        } @else if !decide {
            p class="retry-absent read-only note" {
                "This console is read-only: retry with "
                code { "kubectl agentrun retry " (name) " -n " (ns) " --from STEP --dry-run" } "."
            }
        } @else {
            section id="retry" class="retry" hx-preserve="true" aria-labelledby="retry-h" {
                h2 id="retry-h" { "Retry" }
                form class="retry" hx-get=(format!("{}/retry/preview", run_href(&ns, &name)))
                    hx-target="#retry-preview" hx-trigger="submit, change" {
                    label { "Retry from step "
                        select name="from" {
                            @for s in &run.spec.steps {
                                option value=(s.name) selected[from.as_deref() == Some(s.name.as_str())] { (s.name) }
                            }
                        }
                    }
                    label { input type="checkbox" name="rerunActed" value="true"; " re-run steps that already acted" }
                    label { "Name "
                        input name="name" placeholder=(format!("{name}-retry-…")) size="24"
                            autocomplete="off" spellcheck="false";
                    }
                    button type="submit" { "Preview" }
                }
                p class="note" {
                    "The preview is what " code { "kubectl agentrun retry --dry-run" } " prints; "
                    "the new run is created with your own credentials."
                }
                div id="retry-preview" aria-live="polite" {}
                div id="retry-result" role="status" aria-live="polite" {}
            }
        }
    }
}

/// The preview of `retry`: the plan and a form that creates exactly that
/// fork, or why it cannot be.
pub fn preview_fragment(
    ns: &str,
    run: &str,
    retry: &Retry,
    outcome: &Result<String, String>,
) -> Markup {
    match outcome {
        Ok(plan) => html! {
            pre class="plan" { (plan) }
            form class="create" hx-post=(format!("{}/retry", run_href(ns, run)))
                hx-target="#retry-result" hx-disabled-elt="find button" {
                input type="hidden" name="from" value=(retry.from.clone().unwrap_or_default());
                @if retry.rerun_acted { input type="hidden" name="rerunActed" value="true"; }
                input type="hidden" name="name" value=(retry.name.clone().unwrap_or_default());
                button type="submit" { "Create run" }
            }
        },
        Err(why) => html! {
            p class="refused" role="alert" { strong { "Refused: " } span class="message" { (why) } }
        },
    }
}

/// What a create came to: a link to the new run (and the preview, spent,
/// cleared), or the refusal verbatim.
pub fn created_fragment(ns: &str, outcome: &Result<(AgentRun, ForkPlan), String>) -> Markup {
    match outcome {
        Ok((created, plan)) => {
            let name = created.metadata.name.clone().unwrap_or_default();
            html! {
                p class="ok" data-run=(name) {
                    (crate::fork::created_line(created, plan)) " · "
                    a class="new-run" href=(run_href(ns, &name)) { "open " (name) }
                }
                div id="retry-preview" hx-swap-oob="true" aria-live="polite" {}
            }
        }
        Err(refused) => html! {
            p class="refused" role="alert" { strong { "Refused: " } span class="message" { (refused) } }
        },
    }
}

/// `GET /ns/NS/runs/RUN/retry/preview`: the run read as the user, the
/// operator's plan for the fork asked for.
pub(super) async fn preview(
    User(c): User,
    Path((ns, run)): Path<(String, String)>,
    Query(form): Query<RetryForm>,
) -> Response {
    let retry = form.request();
    let outcome = async {
        let source = crate::fork::source(&c.client, &ns, &run).await?;
        crate::fork::preview(&source, &retry, Timestamp::now())
    }
    .await
    .map_err(|e| e.to_string());
    preview_fragment(&ns, &run, &retry, &outcome).into_response()
}

/// `POST /ns/NS/runs/RUN/retry`: creates the fork as the user.
pub(super) async fn create(
    User(c): User,
    Path((ns, run)): Path<(String, String)>,
    Form(form): Form<RetryForm>,
) -> Response {
    let outcome = create_as_user(&c.client, &ns, &run, &form.request())
        .await
        .map_err(|e| e.to_string());
    created_fragment(&ns, &outcome).into_response()
}

/// The console's one write of a run: the source read and the fork created
/// with `client`, the user's own, so RBAC and admission judge the user.
async fn create_as_user(
    client: &Client,
    ns: &str,
    run: &str,
    retry: &Retry,
) -> Result<(AgentRun, ForkPlan), Error> {
    let source = crate::fork::source(client, ns, run).await?;
    crate::fork::create(client, &source, retry, Timestamp::now()).await
}
