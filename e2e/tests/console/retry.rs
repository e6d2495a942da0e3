//! The run page's Retry in headless Chromium against the real plane: a run
//! that failed at its fourth step is forked from it in the browser (the
//! preview is what `kubectl agentrun retry --dry-run` prints; the new run
//! keeps the first three steps and the simulated kubelet's ledger shows only
//! the last two ran); a step whose effect was Applied is refused with the
//! engine's reason unless "re-run steps that already acted" is ticked; a user
//! without `create agentruns` is refused by the API server, word for word,
//! and nothing is created; a read-only console has neither the form nor
//! the routes.

use agentrun_e2e::kubeconfig;
use agentrun_e2e::support::policies::{Policies, wait_enforced};
use agentrun_e2e::support::processes::plugin_binary;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_operator::api::{AgentRun, RunPhase};
use agentrun_operator::labels::REQUESTED_BY;
use fantoccini::Locator;
use kube::api::{ListParams, PostParams};
use serde_json::{Value, json};

use super::{Browser, PAGE_TIMEOUT, RUN_TIMEOUT, browser, console, console_with, post};

/// fetch (a read) → charge (NonIdempotent) → reserve (Idempotent) → ship
/// (NonIdempotent: the carrier refuses it in `order`, NotApplied, and takes
/// it in `order-retry`) → notify.
fn order() -> Value {
    let mut ship = sim_step(
        "ship",
        "NonIdempotent",
        json!({
            "runMs": 50, "exitCode": 1,
            "rawMessage": "{\"result\": {\"error\": \"carrier down\"}, \"effect\": \"NotApplied\"}",
            "runs": {"order-retry": {"runMs": 50, "result": {"shipment": "s-1"}}},
        }),
    );
    ship["retry"] = json!({"limit": 0});
    json!({"steps": [
        sim_step("fetch", "None", json!({"runMs": 50, "result": {"order": 7}})),
        sim_step("charge", "NonIdempotent", json!({"runMs": 50, "result": {"charged": 30}})),
        sim_step("reserve", "Idempotent", json!({"runMs": 50})),
        ship,
        sim_step("notify", "Idempotent", json!({"runMs": 50})),
    ]})
}

/// Runs `order` to its failure at `ship`.
async fn failed_order(s: &Scenario) {
    s.create_run("order", order()).await;
    let run = s.wait_finished("order", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:#?}", run.status);
}

/// `kubectl agentrun -n NS retry ARGS --dry-run`: its exit code, stdout and stderr.
async fn cli_dry_run(ns: &str, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(plugin_binary())
        .arg("--kubeconfig")
        .arg(kubeconfig())
        .args(["-n", ns, "retry"])
        .args(args)
        .arg("--dry-run")
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("running kubectl-agentrun");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// How often `step` of `run` started (its own attempts).
fn executions(s: &Scenario, run: &str, step: &str) -> usize {
    s.ledger().starts(run, step, "step")
}

async fn run_names(s: &Scenario) -> Vec<String> {
    let mut names: Vec<String> = s
        .runs()
        .list(&ListParams::default())
        .await
        .expect("listing runs")
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .collect();
    names.sort();
    names
}

/// The chart's policies (the mutating one stamps who created a run) and
/// `user` holding the viewer role in the scenario's namespace.
async fn policies_with_viewer(ns: &str, user: &str) -> Policies {
    let p = Policies::install(ns, &[]).await;
    p.grant_role(ns, "viewer", &[user]).await;
    wait_enforced(ns, true).await;
    p
}

impl Browser {
    /// The text of the first element matching `css`, once there is one.
    async fn text_of(&self, what: &str, css: &str) -> String {
        let v = self
            .wait_js(
                what,
                PAGE_TIMEOUT,
                &format!("const e = document.querySelector('{css}'); return e && e.textContent"),
            )
            .await;
        v.as_str().unwrap_or_default().to_owned()
    }

    async fn click(&self, css: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css}: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("clicking {css}: {e}"));
    }
}

#[tokio::test]
async fn the_retry_button_forks_a_failed_run_from_the_chosen_step() {
    let s = Scenario::start("console-retry").await;
    let ns = s.namespace().to_owned();
    let policies = policies_with_viewer(&ns, "alice").await;
    policies.grant_authors(&ns, &["alice"]).await;
    failed_order(&s).await;
    let source_uid = s.runs().get("order").await.unwrap().metadata.uid.unwrap();

    let c = console(&ns, Some("alice")).await;
    let b = browser(&ns).await;
    b.goto(&c.at(&format!("ns/{ns}/runs/order"))).await;
    let steps = b
        .wait_js(
            "the retry form",
            PAGE_TIMEOUT,
            "const s = document.querySelector('#retry select[name=from]'); return s && [[...s.options].map(o => o.value), s.value]",
        )
        .await;
    assert_eq!(
        steps,
        json!([["fetch", "charge", "reserve", "ship", "notify"], "ship"]),
        "every step is offered, the one that failed first"
    );
    // From here on every change the stream brings is counted: the form and
    // what it shows must survive them.
    b.client
        .execute(
            "window.__swaps = 0; document.body.addEventListener('htmx:sseMessage', () => window.__swaps++); return true",
            vec![],
        )
        .await
        .unwrap();

    // Name it, pick the failed step, preview: the CLI's dry run, exactly.
    b.client
        .find(Locator::Css("#retry input[name=name]"))
        .await
        .unwrap()
        .send_keys("order-retry")
        .await
        .unwrap();
    b.client
        .find(Locator::Css("#retry select[name=from]"))
        .await
        .unwrap()
        .select_by_value("ship")
        .await
        .unwrap();
    b.click("#retry form.retry button[type=submit]").await;
    let preview = b.text_of("the preview", "#retry-preview pre.plan").await;
    let (code, cli, err) = cli_dry_run(&ns, &["order", "--from", "ship"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(preview, cli, "the preview is what --dry-run prints");
    for want in [
        "Retry of run order from step ship (dry run: nothing created)",
        "Kept (carried over): fetch, charge, reserve",
        "Runs again:          ship, notify",
        "Asks a person:       none",
    ] {
        assert!(preview.contains(want), "{want} in:\n{preview}");
    }
    assert_eq!(run_names(&s).await, ["order"], "a preview creates nothing");
    b.screenshot("console-retry.png").await;

    // Another page in the browser cannot create a run as alice: a write is
    // the console's own htmx request, to the console's own address.
    let create = format!("/ns/{ns}/runs/order/retry");
    let host = format!("Host: 127.0.0.1:{}\r\n{}", c.port, c.cookie());
    for (case, headers, want) in [
        (
            "a plain cross-site form post",
            format!("{host}Origin: http://evil.example\r\n"),
            403,
        ),
        ("no htmx header", host.clone(), 403),
        (
            "htmx, but from another origin",
            format!("{host}HX-Request: true\r\nOrigin: http://evil.example\r\n"),
            403,
        ),
    ] {
        assert_eq!(post(c.port, &create, &headers).await, want, "{case}");
    }
    assert_eq!(
        run_names(&s).await,
        ["order"],
        "a refused post creates nothing"
    );

    b.click("#retry-preview form.create button").await;
    let href = b
        .wait_js(
            "the link to the new run",
            PAGE_TIMEOUT,
            "const a = document.querySelector('#retry-result .ok a.new-run'); return a && a.getAttribute('href')",
        )
        .await;
    assert_eq!(href, format!("/ns/{ns}/runs/order-retry"));
    let spent = b
        .client
        .execute(
            "return document.getElementById('retry-preview').children.length",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(spent, json!(0), "the spent preview and its button are gone");

    // The API server's object: the fork the preview showed, created as alice.
    let fork = s.runs().get("order-retry").await.unwrap();
    assert_eq!(
        serde_json::to_value(&fork.spec.fork_of).unwrap(),
        json!({"runName": "order", "runUid": source_uid, "fromStep": "ship"})
    );
    assert_eq!(
        fork.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(REQUESTED_BY))
            .map(String::as_str),
        Some("alice"),
        "created as the user, stamped by the API server"
    );
    let done = s.wait_finished("order-retry", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&done),
        Some(RunPhase::Succeeded),
        "{:#?}",
        done.status
    );
    // The ledger: fetch, charge and reserve ran once, in order; ship and
    // notify in the retry.
    for step in ["fetch", "charge", "reserve"] {
        assert_eq!(executions(&s, "order", step), 1, "{step} in order");
        assert_eq!(executions(&s, "order-retry", step), 0, "{step} was kept");
    }
    assert_eq!(executions(&s, "order-retry", "ship"), 1);
    assert_eq!(executions(&s, "order-retry", "notify"), 1);

    // The streamed changes (the retry ran) kept the form and its answer.
    let kept = b
        .wait_js(
            "streamed changes with the form kept",
            PAGE_TIMEOUT,
            "return window.__swaps > 0 && [window.__swaps, document.querySelector('#retry select[name=from]').value, document.querySelector('#retry-result a.new-run') !== null]",
        )
        .await;
    assert_eq!(
        (&kept[1], &kept[2]),
        (&json!("ship"), &json!(true)),
        "{kept}"
    );

    // The new run's page names its source, the step and who asked.
    b.click("#retry-result a.new-run").await;
    let lineage = b.text_of("the lineage", ".forked-from").await;
    assert_eq!(
        lineage,
        "Forked from order at ship, by alice · kept: fetch, charge, reserve"
    );
    let source = b
        .wait_js(
            "the link to the source",
            PAGE_TIMEOUT,
            "const a = document.querySelector('.forked-from a.fork-source'); return a && a.getAttribute('href')",
        )
        .await;
    assert_eq!(source, format!("/ns/{ns}/runs/order"));

    // From charge, which acted (Applied), the engine refuses without the
    // checkbox, and the preview says why in its words; no Create button.
    b.goto(&c.at(&format!("ns/{ns}/runs/order"))).await;
    b.wait_js(
        "the retry form",
        PAGE_TIMEOUT,
        "return document.querySelector('#retry select[name=from]') !== null",
    )
    .await;
    b.client
        .find(Locator::Css("#retry select[name=from]"))
        .await
        .unwrap()
        .select_by_value("charge")
        .await
        .unwrap();
    let refused = b
        .text_of("the refusal", "#retry-preview .refused .message")
        .await;
    assert_eq!(
        refused,
        "spec.forkOf: charge, reserve acted in run order and would act a second time in this fork; set rerunActed (kubectl agentrun retry --rerun-applied) to run it again after a person approves"
    );
    let (code, _, err) = cli_dry_run(&ns, &["order", "--from", "charge"]).await;
    assert_eq!(
        (code, err.trim()),
        (1, format!("error: {refused}").as_str())
    );
    let create_offered = b
        .client
        .execute(
            "return document.querySelector('#retry-preview form.create') !== null",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(create_offered, json!(false));
    // Ticked, the preview says who acts a second time, after a person.
    b.click("#retry input[name=rerunActed]").await;
    let again = b
        .wait_js(
            "the preview with the checkbox",
            PAGE_TIMEOUT,
            "const p = document.querySelector('#retry-preview pre.plan'); return p && document.querySelector('#retry-preview form.create input[name=rerunActed]') !== null && p.textContent",
        )
        .await;
    let again = again.as_str().unwrap();
    assert!(
        again.contains("Asks a person:       charge (acted in order: acts a second time), reserve (acted in order: acts a second time)"),
        "{again}"
    );
    assert_eq!(run_names(&s).await, ["order", "order-retry"]);
    b.close().await;
    s.finish().await;
}

#[tokio::test]
async fn a_user_who_may_not_create_runs_is_refused_by_the_api_server_verbatim() {
    let s = Scenario::start("console-retry-refused").await;
    let ns = s.namespace().to_owned();
    let _policies = policies_with_viewer(&ns, "mallory").await;
    failed_order(&s).await;
    // What the API server says to mallory, asked directly (a dry run).
    let as_mallory: kube::Api<AgentRun> =
        kube::Api::namespaced(agentrun_e2e::client_as("mallory").await, &ns);
    let probe: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "probe"}, "spec": order(),
    }))
    .unwrap();
    let refusal = match as_mallory
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &probe,
        )
        .await
    {
        Err(kube::Error::Api(s)) => s.message,
        other => panic!("the API server should refuse mallory: {other:?}"),
    };
    assert!(
        refusal.contains(r#"User "mallory" cannot create resource "agentruns""#),
        "{refusal}"
    );

    let c = console(&ns, Some("mallory")).await;
    let b = browser(&ns).await;
    b.goto(&c.at(&format!("ns/{ns}/runs/order"))).await;
    b.click("#retry form.retry button[type=submit]").await;
    let preview = b
        .text_of(
            "the preview (reading is allowed)",
            "#retry-preview pre.plan",
        )
        .await;
    assert!(
        preview.contains("Runs again:          ship, notify"),
        "{preview}"
    );
    b.click("#retry-preview form.create button").await;
    let shown = b
        .text_of("the refusal", "#retry-result .refused .message")
        .await;
    assert_eq!(
        shown,
        format!("creating the retry of AgentRun order: {refusal}"),
        "the API server's words, unchanged"
    );
    assert_eq!(run_names(&s).await, ["order"], "nothing was created");

    // The read-only view (as the plane's admin, who could create) offers no
    // retry and has no route for one.
    let ro = console_with(&ns, None, &["-n", &ns, "--read-only"]).await;
    let page = ro.get_ok(&format!("/ns/{ns}/runs/order")).await;
    assert!(
        page.contains("This console is read-only: retry with")
            && !page.contains(r#"id="retry""#)
            && !page.contains("retry/preview"),
        "{page}"
    );
    let host = format!(
        "Host: 127.0.0.1:{}\r\nHX-Request: true\r\n{}",
        ro.port,
        ro.cookie()
    );
    assert_eq!(
        post(ro.port, &format!("/ns/{ns}/runs/order/retry"), &host).await,
        404,
        "the read-only console has no retry route"
    );
    let (code, _) = ro
        .get(&format!("/ns/{ns}/runs/order/retry/preview?from=ship"))
        .await;
    assert_eq!(code, 404, "nor a preview route");
    b.goto(&ro.at(&format!("ns/{ns}/runs/order"))).await;
    let offered = b
        .wait_js(
            "the read-only run page",
            PAGE_TIMEOUT,
            "return document.querySelector('.retry-absent') !== null && [...document.querySelectorAll('button')].map(b => b.textContent)",
        )
        .await;
    assert_eq!(offered, json!(["?", "Close"]), "no Preview, no Create run");
    assert_eq!(run_names(&s).await, ["order"]);
    b.close().await;
    s.finish().await;
}
