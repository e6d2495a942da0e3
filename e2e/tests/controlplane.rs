//! Proofs that the local control plane is the real thing: CEL admission,
//! the status subresource, optimistic concurrency, garbage collection, RBAC
//! with impersonation, the version under test — and that the test-support
//! library (namespaces, pod status helpers) does what it says.

use std::collections::BTreeMap;
use std::time::Duration;

use agentrun_e2e::{
    TestEnv, apply_crd, client, client_as, set_pod_evicted, set_pod_running, set_pod_terminated,
    support::namespace::{NAMESPACE_LABEL, TEST_LABEL},
    wait_for, wait_for_deleted,
};
use agentrun_operator::api::{AgentRun, AgentRunSpec, RunPhase, StepContainer, StepSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Namespace, Pod, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, Patch,
    PatchParams, PostParams,
};
use kube::core::Status;
use kube::runtime::wait::conditions;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

fn api_error(result: kube::Result<impl std::fmt::Debug>) -> Box<Status> {
    match result {
        Err(kube::Error::Api(status)) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn one_step_run(name: &str) -> AgentRun {
    AgentRun::new(
        name,
        AgentRunSpec {
            steps: vec![StepSpec {
                name: "fetch".into(),
                container: Some(StepContainer {
                    image: "busybox:1.36".into(),
                    ..StepContainer::default()
                }),
                ..StepSpec::default()
            }],
            ..AgentRunSpec::default()
        },
    )
}

fn config_map(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([("k".to_owned(), "v".to_owned())])),
        ..ConfigMap::default()
    }
}

#[tokio::test]
async fn server_version_is_v1_36_3() {
    let client = client().await;
    let info = client.apiserver_version().await.expect("GET /version");
    assert_eq!(info.git_version, "v1.36.3");
    assert_eq!(info.major, "1");
    assert_eq!(info.minor, "36");
}

#[tokio::test]
async fn cel_rule_refuses_an_invalid_object_with_its_message() {
    let env = TestEnv::new("cel_rule_refuses_an_invalid_object").await;
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.e2e.agentrun.dev" },
        "spec": {
            "group": "e2e.agentrun.dev",
            "names": { "kind": "Widget", "plural": "widgets", "singular": "widget" },
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": { "spec": {
                        "type": "object",
                        "properties": {
                            "min": { "type": "integer" },
                            "max": { "type": "integer" },
                        },
                        "x-kubernetes-validations": [{
                            "rule": "self.min <= self.max",
                            "message": "min must not exceed max",
                        }],
                    }},
                }},
            }],
        },
    }))
    .expect("a valid CRD");
    apply_crd(&env.client(), &crd).await;

    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("e2e.agentrun.dev", "v1", "Widget"),
        "widgets",
    );
    let widgets: Api<DynamicObject> = Api::namespaced_with(env.client(), env.namespace(), &ar);
    let widget = |name: &str, min: i64, max: i64| {
        let mut obj = DynamicObject::new(name, &ar);
        obj.data = json!({ "spec": { "min": min, "max": max } });
        obj
    };

    let err = api_error(
        widgets
            .create(&PostParams::default(), &widget("inverted", 5, 1))
            .await,
    );
    assert_eq!(err.code, 422, "{err:?}");
    assert!(
        err.message.contains("min must not exceed max"),
        "{}",
        err.message
    );
    widgets
        .create(&PostParams::default(), &widget("ordered", 1, 5))
        .await
        .expect("a widget that satisfies the rule is accepted");
    env.cleanup().await;
}

#[tokio::test]
async fn main_resource_write_ignores_status_and_status_write_ignores_spec() {
    let env = TestEnv::new("status_subresource_separates_spec_and_status").await;
    let runs = env.api::<AgentRun>();
    let created = runs
        .create(&PostParams::default(), &one_step_run("split"))
        .await
        .expect("create AgentRun");
    assert_eq!(created.status, None);

    // A write to the main resource carrying a status: spec changes, status does not.
    let patched = runs
        .patch(
            "split",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "spec": { "suspend": true },
                "status": { "phase": "Running", "tokensUsed": 7 },
            })),
        )
        .await
        .expect("merge-patch the main resource");
    assert!(patched.spec.suspend, "the spec part of the write applies");
    assert_eq!(
        patched.status, None,
        "status is ignored on the main resource"
    );

    let mut replaced = patched.clone();
    replaced.status = Some(Default::default());
    replaced.status.as_mut().unwrap().phase = Some(RunPhase::Failed);
    let replaced = runs
        .replace("split", &PostParams::default(), &replaced)
        .await
        .expect("replace the main resource");
    assert_eq!(replaced.status, None, "status is ignored by replace too");

    // A write to /status carrying a spec change: status changes, spec does not.
    let after = runs
        .patch_status(
            "split",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "spec": { "suspend": false, "cancel": true },
                "status": { "phase": "Running", "tokensUsed": 7 },
            })),
        )
        .await
        .expect("merge-patch /status");
    assert_eq!(after.spec, replaced.spec, "spec is ignored on /status");
    let status = after.status.expect("status written");
    assert_eq!(status.phase, Some(RunPhase::Running));
    assert_eq!(status.tokens_used, 7);
    assert_eq!(
        after.metadata.generation, replaced.metadata.generation,
        "a status write does not bump the generation"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn stale_resource_version_update_gets_409_conflict() {
    let env = TestEnv::new("stale_resource_version_gets_409").await;
    let cms = env.api::<ConfigMap>();
    let original = cms
        .create(&PostParams::default(), &config_map("cas"))
        .await
        .expect("create ConfigMap");

    let mut first = original.clone();
    first.data = Some(BTreeMap::from([("k".to_owned(), "first".to_owned())]));
    cms.replace("cas", &PostParams::default(), &first)
        .await
        .expect("an update at the current resourceVersion succeeds");

    let mut stale = original.clone();
    stale.data = Some(BTreeMap::from([("k".to_owned(), "stale".to_owned())]));
    let err = api_error(cms.replace("cas", &PostParams::default(), &stale).await);
    assert_eq!(err.code, 409, "{err:?}");
    assert_eq!(err.reason, "Conflict", "{err:?}");

    // The same holds on the status subresource the operator checkpoints into.
    let runs = env.api::<AgentRun>();
    let run = runs
        .create(&PostParams::default(), &one_step_run("cas-run"))
        .await
        .expect("create AgentRun");
    let mut fresh = run.clone();
    fresh.status = Some(Default::default());
    fresh.status.as_mut().unwrap().tokens_used = 1;
    runs.replace_status("cas-run", &PostParams::default(), &fresh)
        .await
        .expect("status write at the current resourceVersion succeeds");
    let mut stale = run;
    stale.status = Some(Default::default());
    stale.status.as_mut().unwrap().tokens_used = 2;
    let err = api_error(
        runs.replace_status("cas-run", &PostParams::default(), &stale)
            .await,
    );
    assert_eq!(err.code, 409, "{err:?}");
    assert_eq!(
        runs.get_status("cas-run")
            .await
            .unwrap()
            .status
            .unwrap()
            .tokens_used,
        1,
        "the stale write changed nothing"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn deleting_an_agentrun_garbage_collects_its_owned_configmap() {
    let env = TestEnv::new("gc_deletes_owned_configmap").await;
    let runs = env.api::<AgentRun>();
    let cms = env.api::<ConfigMap>();
    let owner = runs
        .create(&PostParams::default(), &one_step_run("owner"))
        .await
        .expect("create owner AgentRun");
    let mut child = config_map("owned");
    child.metadata.owner_references = Some(vec![
        owner
            .controller_owner_ref(&())
            .expect("a created object has a uid"),
    ]);
    cms.create(&PostParams::default(), &child)
        .await
        .expect("create owned ConfigMap");
    let bystander = cms
        .create(&PostParams::default(), &config_map("not-owned"))
        .await
        .expect("create unowned ConfigMap");

    runs.delete("owner", &DeleteParams::background())
        .await
        .expect("delete owner");
    wait_for_deleted(&runs, "owner", Duration::from_secs(10)).await;
    wait_for_deleted(&cms, "owned", Duration::from_secs(30)).await;
    assert_eq!(
        cms.get("not-owned")
            .await
            .expect("bystander survives")
            .uid(),
        bystander.uid()
    );
    env.cleanup().await;
}

#[tokio::test]
async fn impersonated_service_account_is_forbidden_until_bound() {
    let env = TestEnv::new("rbac_forbidden_until_bound").await;
    let ns = env.namespace().to_owned();
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("reader".into()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    env.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await
        .expect("create ServiceAccount");
    let as_sa = client_as(&format!("system:serviceaccount:{ns}:reader")).await;
    let their_cms: Api<ConfigMap> = Api::namespaced(as_sa, &ns);

    let err = api_error(their_cms.list(&ListParams::default()).await);
    assert_eq!(err.code, 403, "{err:?}");
    assert!(
        err.message
            .contains(&format!("system:serviceaccount:{ns}:reader")),
        "{}",
        err.message
    );

    let role = Role {
        metadata: ObjectMeta {
            name: Some("configmap-reader".into()),
            ..ObjectMeta::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec!["".into()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: vec!["get".into(), "list".into()],
            ..PolicyRule::default()
        }]),
    };
    env.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .expect("create Role");
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some("reader-reads-configmaps".into()),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "configmap-reader".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "reader".into(),
            namespace: Some(ns.clone()),
            ..Subject::default()
        }]),
    };
    env.api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await
        .expect("create RoleBinding");

    // The authorizer's informers catch up within moments.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        match their_cms.list(&ListParams::default()).await {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 403 && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("list as the bound ServiceAccount: {e}"),
        }
    }
    // Bound to get/list only: still no writes.
    let err = api_error(
        their_cms
            .create(&PostParams::default(), &config_map("nope"))
            .await,
    );
    assert_eq!(err.code, 403, "{err:?}");
    env.cleanup().await;
}

#[tokio::test]
async fn pod_status_helpers_drive_pods_like_a_kubelet() {
    let env = TestEnv::new("pod_status_helpers").await;
    let pods = env.api::<Pod>();
    let pod = |name: &str| Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            containers: vec![Container {
                name: "step".into(),
                image: Some("busybox:1.36".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    for name in ["ok", "fails", "evicted"] {
        pods.create(&PostParams::default(), &pod(name))
            .await
            .expect("create Pod");
        let running = set_pod_running(&pods, name).await.expect("set Running");
        let status = running.status.expect("status");
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert!(status.start_time.is_some());
        let cs = &status.container_statuses.expect("container statuses")[0];
        assert!(cs.ready && cs.state.as_ref().unwrap().running.is_some());
    }
    wait_for(
        &pods,
        "ok",
        conditions::is_pod_running(),
        Duration::from_secs(5),
    )
    .await;

    let done = set_pod_terminated(&pods, "ok", 0, r#"{"result":"ok"}"#)
        .await
        .expect("terminate 0");
    let status = done.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Succeeded"));
    let term = status.container_statuses.unwrap()[0]
        .state
        .clone()
        .unwrap()
        .terminated
        .expect("terminated state");
    assert_eq!(term.exit_code, 0);
    assert_eq!(term.message.as_deref(), Some(r#"{"result":"ok"}"#));

    let failed = set_pod_terminated(&pods, "fails", 3, "boom")
        .await
        .expect("terminate 3");
    let status = failed.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Failed"));
    let term = status.container_statuses.unwrap()[0]
        .state
        .clone()
        .unwrap()
        .terminated
        .unwrap();
    assert_eq!((term.exit_code, term.message.as_deref()), (3, Some("boom")));

    let evicted = set_pod_evicted(&pods, "evicted", "node pressure")
        .await
        .expect("evict");
    let status = evicted.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Failed"));
    assert_eq!(status.reason.as_deref(), Some("Evicted"));
    let disruption = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "DisruptionTarget")
        .expect("DisruptionTarget condition");
    assert_eq!(disruption.status, "True");
    assert_eq!(disruption.reason.as_deref(), Some("TerminationByKubelet"));

    // A terminal Pod cannot be made to run again: the plane enforces it.
    let err = api_error(set_pod_running(&pods, "ok").await);
    assert_eq!(err.code, 422, "{err:?}");
    env.cleanup().await;
}

#[tokio::test]
async fn test_namespace_is_labelled_and_deleted_on_cleanup_and_drop() {
    let client = client().await;
    let namespaces: Api<Namespace> = Api::all(client.clone());

    let env = TestEnv::new("Namespace_Guard::cleanup").await;
    let name = env.namespace().to_owned();
    assert!(name.starts_with("namespace-guard-cleanup-"), "{name}");
    let ns = namespaces.get(&name).await.expect("namespace exists");
    assert_eq!(
        ns.labels().get(NAMESPACE_LABEL).map(String::as_str),
        Some("true")
    );
    assert_eq!(
        ns.labels().get(TEST_LABEL).map(String::as_str),
        Some("namespace-guard-cleanup")
    );
    env.cleanup().await;
    assert_deleting(&namespaces, &name).await;

    let dropped = {
        let env = TestEnv::new("namespace_guard_drop").await;
        env.namespace().to_owned()
    };
    assert_deleting(&namespaces, &dropped).await;
}

/// Gone, or Terminating (the namespace controller finishes it in the background).
async fn assert_deleting(namespaces: &Api<Namespace>, name: &str) {
    match namespaces.get_opt(name).await.expect("read namespace") {
        None => {}
        Some(ns) => assert!(
            ns.meta().deletion_timestamp.is_some(),
            "namespace {name} was not deleted"
        ),
    }
}

/// A scenario's operator, killed and started again, comes up even when the
/// loopback ports it had were taken meanwhile (by any test's connection: an
/// outgoing connection's local port comes from the same range); its config
/// then names the ports it has now.
#[tokio::test]
async fn a_restarted_scenario_operator_comes_up_though_its_old_ports_were_taken() {
    let mut s = agentrun_e2e::support::scenario::Scenario::start("restart-ports").await;
    let old = s.operator_config.clone();
    s.kill_operator().await;
    let _taken = [
        std::net::TcpListener::bind(("127.0.0.1", old.metrics_port)).expect("the old port is free"),
        std::net::TcpListener::bind(("127.0.0.1", old.health_port)).expect("the old port is free"),
    ];
    s.start_operator(None);
    let port = s.operator_config.health_port;
    assert_ne!(port, old.health_port, "a restart takes new ports");
    let addr = ([127, 0, 0, 1], port).into();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _)) = agentrun_e2e::support::http::http_get(addr, "/readyz").await {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the restarted operator is not ready on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.finish().await;
}
