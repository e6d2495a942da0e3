//! `spec.steps` is an atomic list (one owner for the whole plan under
//! server-side apply), so the uniqueness of step names is a CEL rule on the
//! list rather than the list-map's own check: proven here on the real
//! apiserver, at the largest plan its cost budget must admit, on create, on
//! update and on the status writes that evaluate it again; and what a second
//! field manager meets when it applies one step of a plan it does not own.

use kube::Api;
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::{TestEnv, check_refusal, dynamic_api, run, step};

/// The fixed text of the rule's refusal (on the field `spec.steps`).
const NOT_UNIQUE: &[&str] = &["spec.steps", "step names must be unique"];

fn object(mut run: Value, name: &str) -> DynamicObject {
    run["metadata"]["name"] = json!(name);
    serde_json::from_value(run).expect("a DynamicObject")
}

/// `n` steps named with the longest names a step may have (48 characters),
/// the worst case for the rule's cost.
fn longest_named_steps(n: usize) -> Vec<Value> {
    (0..n).map(|i| step(&format!("s{i:047}"))).collect()
}

async fn refused(runs: &Api<DynamicObject>, name: &str, spec: Value, expect: &[&str]) {
    let created = runs
        .create(&PostParams::default(), &object(run(spec), name))
        .await;
    if let Err(why) = check_refusal(created, expect) {
        panic!("{name}: {why}");
    }
}

#[tokio::test]
async fn steps_of_one_name_are_refused_on_create_and_on_update() {
    let env = TestEnv::new("step_names_unique").await;
    let runs = dynamic_api(&env, "AgentRun");

    refused(
        &runs,
        "twice",
        json!({ "steps": [step("fetch"), step("summarize"), step("fetch")] }),
        NOT_UNIQUE,
    )
    .await;
    // A wait step and a container step of one name are one name twice.
    refused(
        &runs,
        "wait-and-container",
        json!({ "steps": [step("pause"), { "name": "pause", "wait": { "for": "1m" } }] }),
        NOT_UNIQUE,
    )
    .await;

    runs.create(
        &PostParams::default(),
        &object(
            run(json!({ "steps": [step("fetch"), step("summarize")] })),
            "edited",
        ),
    )
    .await
    .expect("unique names are accepted");
    let edit = json!({ "spec": { "steps": [step("fetch"), step("fetch")] } });
    if let Err(why) = check_refusal(
        runs.patch("edited", &PatchParams::default(), &Patch::Merge(&edit))
            .await,
        NOT_UNIQUE,
    ) {
        panic!("update: {why}");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn a_plan_of_500_steps_with_the_longest_names_is_accepted_and_its_status_written() {
    let env = TestEnv::new("step_names_budget").await;
    let runs = dynamic_api(&env, "AgentRun");

    let steps = longest_named_steps(500);
    runs.create(
        &PostParams::default(),
        &object(run(json!({ "steps": steps })), "five-hundred"),
    )
    .await
    .expect("500 uniquely named steps are within the rule's cost budget");
    // Every status write evaluates the spec's rules again.
    let status = json!({ "status": { "progress": "0/500" } });
    runs.patch_status(
        "five-hundred",
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .expect("a status write of a 500-step run is within the budget");

    // The rule refuses at that size too, within the budget.
    let mut repeated = longest_named_steps(500);
    repeated[499] = step(&format!("s{:047}", 0));
    refused(
        &runs,
        "five-hundred-repeated",
        json!({ "steps": repeated }),
        NOT_UNIQUE,
    )
    .await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_second_field_manager_conflicts_on_the_whole_plan() {
    let env = TestEnv::new("step_names_apply").await;
    let runs = dynamic_api(&env, "AgentRun");
    let image = |tag: &str| json!({ "image": format!("ghcr.io/example/agent:{tag}") });
    let manifest = |steps: Value| {
        let mut m = run(json!({ "steps": steps }));
        m["metadata"]["name"] = json!("synced");
        m
    };
    let argo = PatchParams::apply("argocd-controller");
    let first = manifest(json!([
        { "name": "fetch", "container": image("1") },
        { "name": "refund", "container": image("1") },
    ]));
    runs.patch("synced", &argo, &Patch::Apply(&first))
        .await
        .expect("the GitOps controller applies the run");

    // Another manager applies one step: the plan has one owner, so this is a
    // conflict on the whole list, not on that step's image.
    let one = manifest(json!([{ "name": "refund", "container": image("2") }]));
    match runs
        .patch(
            "synced",
            &PatchParams::apply("platform-team"),
            &Patch::Apply(&one),
        )
        .await
    {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409, "{}", s.message);
            assert!(
                s.message
                    .contains("conflict with \"argocd-controller\": .spec.steps")
                    && !s.message.contains(".spec.steps["),
                "a conflict on .spec.steps as a whole: {}",
                s.message
            );
        }
        other => panic!("a conflict was expected: {other:?}"),
    }
    // Forced, the partial list is the whole plan now.
    let forced = runs
        .patch(
            "synced",
            &PatchParams::apply("platform-team").force(),
            &Patch::Apply(&one),
        )
        .await
        .expect("a forced apply takes the plan over");
    let names: Vec<&str> = forced.data["spec"]["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, ["refund"], "the applied list replaced the plan");
    env.cleanup().await;
}
