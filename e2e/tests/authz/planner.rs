//! D17, the planner's half: a planner is a proposal, not an author. On the
//! real plane, with the operator and the simulated kubelet: a plan step the
//! author's catalog (`spec.steps`) does not hold — a new image with a Secret
//! in its env — is refused with the reason and starts nothing; a plan that
//! draws from the catalog runs, with the arguments the planner filled and
//! the image, Secret reference and gate the author wrote.

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_operator::api::RunPhase;
use serde_json::json;

use super::RUN_TIMEOUT;

#[tokio::test]
async fn a_plan_outside_the_authors_catalog_is_refused_and_starts_nothing() {
    let s = Scenario::start("authz-planner-catalog").await;
    let steal = json!({
        "name": "steal",
        "effect": "NonIdempotent",
        "container": {"image": "registry.example/evil:1",
                      "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "k"}}}]},
    });
    let catalog = [sim_step("lookup", "None", json!({"runMs": 20}))];
    s.create_run(
        "outside",
        json!({"steps": catalog, "planner": sim_step("plan", "None", json!({"plan": [steal]}))}),
    )
    .await;
    let run = s.wait_finished("outside", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:#?}", run.status);
    let st = run.status.clone().unwrap();
    let c = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Succeeded")
        .unwrap();
    assert_eq!(c.reason, "InvalidPlan");
    assert!(
        c.message.contains(
            "plan[0].uses: \"steal\" is not a step of spec.steps, the catalog a planner draws from (lookup)"
        ),
        "{}",
        c.message
    );
    let images: Vec<String> = s
        .list_pods()
        .await
        .iter()
        .filter_map(|p| p.spec.as_ref()?.containers.first()?.image.clone())
        .collect();
    assert!(
        images.iter().all(|i| !i.contains("evil")),
        "nothing outside the catalog ran: {images:?}"
    );

    // From the catalog, the planner fills the arguments only.
    s.create_run(
        "inside",
        json!({"steps": catalog, "planner": sim_step("plan", "None",
            json!({"plan": [{"name": "lookup-1", "uses": "lookup", "args": ["--order", "4711"]}]}))}),
    )
    .await;
    let run = s.wait_finished("inside", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let plan = run.status.unwrap().plan.unwrap();
    let step = &plan.steps[0];
    assert_eq!(step.name, "lookup-1");
    let c = step.container.as_ref().unwrap();
    assert_eq!(c.args, ["--order", "4711"]);
    assert_eq!(
        c.image, "registry.example/agent-step:1",
        "the author's image"
    );
    s.finish().await;
}
