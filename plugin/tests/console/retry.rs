//! The run page's retry section and the fragments of its preview and create
//! (`console/retry.rs`), rendered from the captured fixtures; expected
//! markup is literal.

use agentrun_api::{AgentRun, ForkSource, ForkedFrom};
use agentrun_engine::fork::ForkPlan;
use kubectl_agentrun::console::retry::{self, RetryForm};
use kubectl_agentrun::console::run_page;
use kubectl_agentrun::fork::Retry;

use super::{at, fixture};

fn detail(run: &AgentRun, decide: bool) -> String {
    let (_, approvals) = fixture("charge-rejected");
    run_page::run_detail(
        run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        decide,
        at(60),
    )
    .into_string()
}

#[test]
fn a_failed_run_offers_a_retry_from_each_step_starting_at_the_one_that_failed() {
    let (run, _) = fixture("charge-rejected");
    let html = detail(&run, true);
    for want in [
        r#"<section id="retry" class="retry" hx-preserve="true" aria-labelledby="retry-h">"#,
        r##"<form class="retry" hx-get="/ns/plugin-approve-uyx3za/runs/charge/retry/preview" hx-target="#retry-preview" hx-trigger="submit, change">"##,
        r#"<select name="from"><option value="reserve">reserve</option><option value="charge" selected>charge</option></select>"#,
        r#"<input type="checkbox" name="rerunActed" value="true"> re-run steps that already acted"#,
        r#"placeholder="charge-retry-…""#,
        r#"<div id="retry-preview" aria-live="polite"></div>"#,
    ] {
        assert!(
            html.contains(want),
            "the retry section lacks {want}:\n{html}"
        );
    }
    assert!(!html.contains("Retry is offered once"), "{html}");
}

#[test]
fn a_run_that_has_not_ended_says_when_retry_is_offered() {
    let (run, approvals) = fixture("refund-waiting");
    let html = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        at(60),
    )
    .into_string();
    assert!(
        html.contains(r#"<p class="retry-absent note">Retry is offered once the run has ended (it is WaitingForApproval).</p>"#),
        "{html}"
    );
    assert!(!html.contains(r#"id="retry""#), "{html}");
    assert!(!html.contains("retry/preview"), "{html}");
}

#[test]
fn a_run_that_already_ran_says_why_it_is_not_retried() {
    let (mut run, _) = fixture("charge-rejected");
    if let Some(st) = run.status.as_mut() {
        st.phase = Some(agentrun_api::RunPhase::AlreadyRan);
        st.already_ran = None;
    }
    let html = detail(&run, true);
    assert!(
        html.contains(r#"<p class="retry-absent note">run charge ran nothing: it is an earlier run, created again; to run it again, create it with a new agentrun.dev/rerun annotation</p>"#),
        "{html}"
    );
    assert!(!html.contains(r#"id="retry""#), "{html}");
}

#[test]
fn a_read_only_console_offers_the_command_not_the_form() {
    let (run, _) = fixture("charge-rejected");
    let html = detail(&run, false);
    assert!(
        html.contains("This console is read-only: retry with <code>kubectl agentrun retry charge -n plugin-approve-uyx3za --from STEP --dry-run</code>."),
        "{html}"
    );
    for absent in [r#"id="retry""#, "retry/preview", "hx-post", "<select"] {
        assert!(
            !html.contains(absent),
            "{absent} in the read-only page:\n{html}"
        );
    }
}

#[test]
fn the_preview_holds_exactly_what_it_previewed_and_a_refusal_has_no_create() {
    let asked = Retry {
        from: Some("charge".into()),
        rerun_acted: true,
        name: Some("charge-again".into()),
    };
    let html = retry::preview_fragment(
        "shop",
        "charge",
        &asked,
        &Ok("Retry of run charge from step charge (dry run: nothing created)\n".into()),
    )
    .into_string();
    assert_eq!(
        html,
        r##"<pre class="plan">Retry of run charge from step charge (dry run: nothing created)
</pre><form class="create" hx-post="/ns/shop/runs/charge/retry" hx-target="#retry-result" hx-disabled-elt="find button"><input type="hidden" name="from" value="charge"><input type="hidden" name="rerunActed" value="true"><input type="hidden" name="name" value="charge-again"><button type="submit">Create run</button></form>"##
    );
    let plain = Retry {
        from: Some("charge".into()),
        ..Retry::default()
    };
    let html = retry::preview_fragment("shop", "charge", &plain, &Ok(String::new())).into_string();
    assert!(!html.contains("rerunActed"), "{html}");
    let html = retry::preview_fragment(
        "shop",
        "charge",
        &plain,
        &Err("spec.forkOf: <b>charge</b> acted & would act again".into()),
    )
    .into_string();
    assert_eq!(
        html,
        r#"<p class="refused" role="alert"><strong>Refused: </strong><span class="message">spec.forkOf: &lt;b&gt;charge&lt;/b&gt; acted &amp; would act again</span></p>"#
    );
}

#[test]
fn a_created_fork_links_its_page_and_clears_the_spent_preview() {
    let (mut created, _) = fixture("charge-rejected");
    created.metadata.name = Some("charge-retry-x7k2p".into());
    created.spec.fork_of = Some(Box::new(ForkSource {
        run_name: "charge".into(),
        run_uid: "u-1".into(),
        from_step: "charge".into(),
        rerun_acted: false,
    }));
    let plan = ForkPlan {
        checkpoints: vec![],
        inherited: vec!["reserve".into()],
        runs: vec!["charge".into()],
        acts_again: vec![],
        gated: vec![],
    };
    let html = retry::created_fragment("shop", &Ok((created, plan))).into_string();
    assert_eq!(
        html,
        r#"<p class="ok" data-run="charge-retry-x7k2p">agentrun charge-retry-x7k2p created: a retry of charge from step charge (kept: reserve; runs: charge) · <a class="new-run" href="/ns/shop/runs/charge-retry-x7k2p">open charge-retry-x7k2p</a></p><div id="retry-preview" hx-swap-oob="true" aria-live="polite"></div>"#
    );
}

#[test]
fn a_fork_names_its_source_with_a_link_and_who_asked() {
    let (mut run, _) = fixture("charge-rejected");
    run.spec.fork_of = Some(Box::new(ForkSource {
        run_name: "order".into(),
        run_uid: "u-1".into(),
        from_step: "ship".into(),
        rerun_acted: false,
    }));
    let html = detail(&run, true);
    assert!(
        html.contains(r#"<p class="forked-from">Forked from <a class="fork-source" href="/ns/plugin-approve-uyx3za/runs/order">order</a> at <strong>ship</strong> (not yet read by the operator)</p>"#),
        "{html}"
    );
    run.status.as_mut().unwrap().forked_from = Some(Box::new(ForkedFrom {
        run_name: "order".into(),
        run_uid: "u-1".into(),
        from_step: "ship".into(),
        requested_by: Some("alice".into()),
        inherited: vec!["fetch".into(), "charge".into()],
    }));
    let html = detail(&run, true);
    assert!(
        html.contains(r#"<p class="forked-from">Forked from <a class="fork-source" href="/ns/plugin-approve-uyx3za/runs/order">order</a> at <strong>ship</strong>, by <strong class="requester">alice</strong> · kept: fetch, charge</p>"#),
        "{html}"
    );
}

#[test]
fn the_form_reads_a_blank_name_as_none_and_the_checkbox_as_rerun_acted() {
    let form = RetryForm {
        from: " ship ".into(),
        rerun_acted: Some("true".into()),
        name: "  ".into(),
    };
    assert_eq!(
        form.request(),
        Retry {
            from: Some("ship".into()),
            rerun_acted: true,
            name: None,
        }
    );
    assert_eq!(RetryForm::default().request(), Retry::default());
}
