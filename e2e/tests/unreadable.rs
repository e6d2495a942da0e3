//! D13 and D16: a run the operator cannot read says so and holds up no other
//! run. The test replaces the cluster-wide AgentRun CRD for a moment, so it
//! is a test binary of its own: nothing else runs beside it while the API
//! server rebuilds the CRD's storage (an operator started beside such a
//! replace has gone blind to its runs before; see `long_runs.rs`).
//!
//! Fails (never skips) without the plane.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, event_counts, phase, sim_step};
use agentrun_operator::api::{AgentRun, RunPhase};
use kube::ResourceExt;
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// D13 and D16: a run the operator cannot read — here a spec written for a
/// newer API whose schema allows an effect this operator does not know —
/// says so on the run (`Stalled`, reason `Unreadable`, and a Warning Event),
/// and the runs beside it go on. Without the guard, the one object failed the
/// list of every run and nothing was reconciled at all.
#[tokio::test]
async fn a_run_the_operator_cannot_read_says_so_and_holds_up_no_other_run() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let mut s = Scenario::start_without_operator("unreadable").await;
    let client = s.env().client();
    let original = agentrun_operator::api::crds()
        .into_iter()
        .find(|c| c.name_any() == "agentruns.agentrun.dev")
        .expect("the AgentRun CRD");
    let mut newer = serde_json::to_value(&original).unwrap();
    let effect = &mut newer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["steps"]["items"]["properties"]["effect"];
    assert!(effect["enum"].is_array(), "the effect schema: {effect}");
    effect.as_object_mut().unwrap().remove("enum");
    let newer: CustomResourceDefinition = serde_json::from_value(newer).unwrap();
    agentrun_e2e::support::crds::apply_crd(&client, &newer).await;
    let created = {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            // The schema change reaches the API server's handlers shortly
            // after the CRD is Established.
            let run: AgentRun = serde_json::from_value(json!({
                "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                "metadata": {"name": "from-the-future"},
                "spec": {"steps": [{"name": "a", "container": {"image": "tool:1"}}]},
            }))
            .unwrap();
            let mut raw = serde_json::to_value(&run).unwrap();
            raw["spec"]["steps"][0]["effect"] = json!("Sometimes");
            let api: kube::Api<kube::core::DynamicObject> = kube::Api::namespaced_with(
                client.clone(),
                s.namespace(),
                &kube::discovery::ApiResource::erase::<AgentRun>(&()),
            );
            let obj: kube::core::DynamicObject = serde_json::from_value(raw).unwrap();
            match api.create(&Default::default(), &obj).await {
                Ok(o) => break o,
                Err(e) if std::time::Instant::now() < deadline => {
                    eprintln!("not accepted yet: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("creating the run from the newer API: {e}"),
            }
        }
    };
    agentrun_e2e::support::crds::apply_crd(&client, &original).await;
    // The operator starts once the original schema is served again: an
    // operator started within a second of a CRD change has been seen to go
    // blind to its runs (the watch of the replaced storage expired, and no run
    // was seen after the relist; a rare case, not what this test is about).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let api: kube::Api<kube::core::DynamicObject> = kube::Api::namespaced_with(
            client.clone(),
            s.namespace(),
            &kube::discovery::ApiResource::erase::<AgentRun>(&()),
        );
        let mut probe = serde_json::to_value(&created).unwrap();
        probe["metadata"] = json!({"name": "probe"});
        let probe: kube::core::DynamicObject = serde_json::from_value(probe).unwrap();
        let dry_run = kube::api::PostParams {
            dry_run: true,
            ..Default::default()
        };
        match api.create(&dry_run, &probe).await {
            Err(kube::Error::Api(e)) if e.code == 422 => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "the original AgentRun CRD is not served 30 s after it was applied: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.start_operator(None);
    s.create_run(
        "beside-it",
        json!({"steps": [sim_step("a", "Idempotent", json!({"runMs": 100}))]}),
    )
    .await;
    let done = s.wait_finished("beside-it", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    // The typed Api cannot read it either: look at it untyped.
    let api: kube::Api<kube::core::DynamicObject> = kube::Api::namespaced_with(
        client.clone(),
        s.namespace(),
        &kube::discovery::ApiResource::erase::<AgentRun>(&()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let condition = loop {
        let obj = api
            .get("from-the-future")
            .await
            .expect("the unreadable run");
        let found = obj.data["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Stalled").cloned());
        if let Some(c) = found {
            break c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no Stalled condition: {:?}",
            obj.data["status"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(condition["status"], "True", "{condition}");
    assert_eq!(condition["reason"], "Unreadable", "{condition}");
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(message.contains("Sometimes"), "{message}");
    assert!(
        created.data["status"].is_null(),
        "the operator never wrote a phase for it"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !event_counts(&s, "from-the-future")
        .await
        .contains_key("Unreadable")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no Unreadable Event: {:?}",
            event_counts(&s, "from-the-future").await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        s.ledger()
            .entries
            .iter()
            .all(|e| e.run.as_deref() != Some("from-the-future")),
        "nothing ran for it"
    );
    s.finish().await;
}
