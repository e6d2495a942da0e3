//! The API proofs (D13): the AgentRun and Approval CRDs, generated from the
//! Rust types, install on the real apiserver and refuse every malformed object
//! at admission with a message that names the field and says what is wrong;
//! the printer columns and the samples work with the real kubectl.

use std::path::PathBuf;

use agentrun_e2e::{TestEnv, kubectl, kubectl_ok, repo_root};
use agentrun_operator::api::{AgentRun, Approval, ApprovalPhase, Decision};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, CustomResourceExt};
use serde_json::{Value, json};

#[path = "api_admission/cases.rs"]
mod cases;
#[path = "api_admission/step_names.rs"]
mod step_names;

use cases::{approval, cases, run, run_with_step, step};

fn dynamic_api(env: &TestEnv, kind: &str) -> Api<DynamicObject> {
    let resource = match kind {
        "AgentRun" => ApiResource::erase::<AgentRun>(&()),
        "Approval" => ApiResource::erase::<Approval>(&()),
        other => panic!("no API for kind {other}"),
    };
    Api::namespaced_with(env.client(), env.namespace(), &resource)
}

/// What is wrong with the refusal `result`, if anything.
fn check_refusal<T>(result: kube::Result<T>, expect: &[&str]) -> Result<String, String> {
    match result {
        Ok(_) => Err("accepted".to_owned()),
        Err(kube::Error::Api(status)) => {
            let missing: Vec<&&str> = expect
                .iter()
                .filter(|s| !status.message.contains(**s))
                .collect();
            if status.code != 422 {
                Err(format!(
                    "code {} (want 422): {}",
                    status.code, status.message
                ))
            } else if !missing.is_empty() {
                Err(format!("message lacks {missing:?}: {}", status.message))
            } else {
                Ok(status.message.clone())
            }
        }
        Err(e) => Err(format!("not an API refusal: {e}")),
    }
}

#[tokio::test]
async fn every_admission_rule_refuses_its_invalid_object_with_a_clear_message() {
    let env = TestEnv::new("admission_rules").await;
    let cases = cases();
    let mut mismatches = Vec::new();
    let mut refusals = Vec::new();
    for (i, case) in cases.into_iter().enumerate() {
        let mut object = case.object;
        if object["metadata"].get("name").is_none() {
            object["metadata"]["name"] = json!(format!("case-{i:02}"));
        }
        let kind = object["kind"].as_str().expect("kind").to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("name")
            .to_owned();
        let api = dynamic_api(&env, &kind);
        let obj: DynamicObject = serde_json::from_value(object).expect("a DynamicObject");
        let created = api.create(&PostParams::default(), &obj).await;
        let outcome = match case.update {
            None => check_refusal(created, case.expect),
            Some(update) => match created {
                Err(e) => Err(format!("the object to update was refused: {e}")),
                Ok(_) if case.status.is_some() => {
                    let status = case.status.expect("checked");
                    match api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                        .await
                    {
                        Err(e) => Err(format!("writing the status failed: {e}")),
                        Ok(_) => check_refusal(
                            api.patch(&name, &PatchParams::default(), &Patch::Merge(update))
                                .await,
                            case.expect,
                        ),
                    }
                }
                Ok(_) => check_refusal(
                    api.patch(&name, &PatchParams::default(), &Patch::Merge(update))
                        .await,
                    case.expect,
                ),
            },
        };
        match outcome {
            Ok(message) => {
                eprintln!("ok   {:<48} {message}", case.name);
                refusals.push(message);
            }
            Err(why) => {
                eprintln!("FAIL {:<48} {why}", case.name);
                mismatches.push(format!("{}: {why}", case.name));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} admission case(s) did not behave:\n  {}",
        mismatches.len(),
        mismatches.join("\n  ")
    );
    // Every CEL rule of both CRDs was seen refusing something, here or in
    // the test named for it.
    let unseen: Vec<String> = rule_texts()
        .into_iter()
        .filter(|text| !refusals.iter().any(|m| m.contains(text.as_str())))
        .filter(|text| !PROVEN_ELSEWHERE.iter().any(|(t, _)| t == text))
        .collect();
    assert!(
        unseen.is_empty(),
        "{} rule(s) refused nothing in this table and name no other test:\n  {}",
        unseen.len(),
        unseen.join("\n  ")
    );
    env.cleanup().await;
}

/// Rules whose refusal another test receives from the API server, as a
/// user who may send it: (the rule's text, the test).
const PROVEN_ELSEWHERE: &[(&str, &str)] = &[
    (
        "spec.template is immutable: it records what the run was created from",
        "templates.rs: a_run_submitted_from_a_template_runs_with_its_parameters",
    ),
    (
        agentrun_operator::api::PARAM_FORBIDDEN,
        "templates.rs: a_template_that_puts_a_parameter_where_it_changes_who_runs_what_is_refused",
    ),
    (
        "spec.params: parameter names must be unique",
        "templates.rs: a_template_that_puts_a_parameter_where_it_changes_who_runs_what_is_refused",
    ),
    (
        "approval.approvers.users: a user name cannot be blank",
        "approvers.rs: malformed_approver_policies_are_refused_with_clear_messages",
    ),
    (
        "approval.approvers: name at least one user, group or serviceAccount (leave approvers out to let RBAC alone decide)",
        "approvers.rs: malformed_approver_policies_are_refused_with_clear_messages",
    ),
    (
        "approval.quorum: more distinct approvers are needed than the users and serviceAccounts listed, and no group is listed",
        "approvers.rs: malformed_approver_policies_are_refused_with_clear_messages",
    ),
    (
        " and can no longer be decided",
        "scenarios/approvals.rs: an_approval_releases_only_the_step_it_was_asked_about",
    ),
    (
        "spec.votes: each user votes once",
        "approvers.rs: a_quorum_of_two_releases_once_and_one_rejection_compensates",
    ),
    (
        "spec.approvers is immutable: who may decide was set when the approval was requested",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.decidedBy: who decided is final once recorded",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.quorum is immutable",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.requestedBy is immutable",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.separateFromRequester is immutable: separation of duties was set when the approval was requested and cannot be changed or removed",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.stepDigest is immutable: the approval is bound to the step as it was when asked",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.votes: votes are append-only; a vote cannot be changed or removed",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
];

/// Every CEL rule of the AgentRun, Approval and AgentRunTemplate CRDs, as the fixed text its
/// refusal carries: its message, or the longest literal of its
/// messageExpression.
fn rule_texts() -> std::collections::BTreeSet<String> {
    fn walk(v: &Value, out: &mut std::collections::BTreeSet<String>) {
        match v {
            Value::Object(m) => {
                for rule in m
                    .get("x-kubernetes-validations")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let text = match (rule["message"].as_str(), rule["messageExpression"].as_str())
                    {
                        (Some(message), _) => message.to_owned(),
                        (None, Some(expr)) => expr
                            .split('\'')
                            .skip(1)
                            .step_by(2)
                            .max_by_key(|lit| lit.len())
                            .unwrap_or(expr)
                            .to_owned(),
                        (None, None) => panic!("a rule without a message: {rule}"),
                    };
                    out.insert(text);
                }
                m.values().for_each(|v| walk(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeSet::new();
    for crd in [
        AgentRun::crd(),
        Approval::crd(),
        agentrun_operator::api::AgentRunTemplate::guarded_crd(),
    ] {
        walk(
            &serde_json::to_value(crd).expect("the CRD as JSON"),
            &mut out,
        );
    }
    out
}

#[tokio::test]
async fn valid_objects_are_accepted_and_a_decision_can_be_made_once() {
    let env = TestEnv::new("admission_accepts_valid").await;
    let runs = dynamic_api(&env, "AgentRun");
    let approvals = dynamic_api(&env, "Approval");
    let create = |mut object: Value, name: &str| {
        object["metadata"]["name"] = json!(name);
        serde_json::from_value::<DynamicObject>(object).expect("a DynamicObject")
    };

    runs.create(
        &PostParams::default(),
        &create(run(json!({ "steps": [step("fetch")] })), "minimal"),
    )
    .await
    .expect("a minimal AgentRun is accepted");
    runs.create(
        &PostParams::default(),
        &create(run(json!({ "planner": step("plan") })), "planned"),
    )
    .await
    .expect("a planner without steps is accepted");
    let full = run_with_step(json!({
        "effect": "Idempotent", "freshFor": "10m", "timeout": "1h30m",
        "retry": { "limit": 100, "backoff": { "initial": "250ms", "max": "5m" } },
        "approval": { "question": "ok?", "timeout": "72h", "onTimeout": "Approve",
                      "notify": ["payments-oncall", "audit"],
                      "escalate": { "after": "71h59m", "notify": ["payments-leads"] } },
    }));
    runs.create(&PostParams::default(), &create(full, "bounds"))
        .await
        .expect("an AgentRun at the edges of every bound is accepted");
    runs.create(
        &PostParams::default(),
        &create(
            run(json!({ "steps": [step(&"a".repeat(48))] })),
            &"r".repeat(63),
        ),
    )
    .await
    .expect("a 63-character run name and a 48-character step name are accepted");

    // Typed, so the generated types and the schema agree both ways.
    let typed: Api<Approval> = env.api();
    approvals
        .create(
            &PostParams::default(),
            &create(approval("Approve", json!({})), "gate"),
        )
        .await
        .expect("a minimal Approval is accepted");
    let pending = typed.get("gate").await.expect("read the Approval");
    assert_eq!(pending.spec.decision, None);
    let decided = typed
        .patch(
            "gate",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "decision": "Approved", "comment": "fine" } })),
        )
        .await
        .expect("Pending -> Approved is accepted");
    assert_eq!(decided.spec.decision, Some(Decision::Approved));
    typed
        .patch(
            "gate",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "decision": "Approved" }, "metadata": { "labels": { "seen": "yes" } } })),
        )
        .await
        .expect("restating the same decision is accepted");
    let status = typed
        .patch_status(
            "gate",
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "status": { "phase": "Approved", "decidedBy": "kubectl-patch" } }),
            ),
        )
        .await
        .expect("the operator records the outcome in status");
    assert_eq!(status.status.unwrap().phase, ApprovalPhase::Approved);

    approvals
        .create(
            &PostParams::default(),
            &create(
                approval("Reconcile", json!({ "decision": "MarkSucceeded" })),
                "reconcile",
            ),
        )
        .await
        .expect("a Reconcile approval with a Reconcile decision is accepted");
    env.cleanup().await;
}

#[tokio::test]
async fn generated_crds_are_structural_and_established() {
    let env = TestEnv::new("crds_structural").await;
    let crds: Api<CustomResourceDefinition> = Api::all(env.client());
    for name in [AgentRun::crd_name(), Approval::crd_name()] {
        let crd = crds.get(name).await.expect("the CRD is installed");
        let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        let status_of = |t: &str| {
            conditions
                .iter()
                .find(|c| c.type_ == t)
                .map(|c| c.status.clone())
        };
        assert_eq!(
            status_of("Established").as_deref(),
            Some("True"),
            "{name}: {conditions:?}"
        );
        assert_eq!(
            status_of("NamesAccepted").as_deref(),
            Some("True"),
            "{name}: {conditions:?}"
        );
        assert_eq!(
            status_of("NonStructuralSchema"),
            None,
            "{name}: {conditions:?}"
        );
    }
    env.cleanup().await;
}

/// `kubectl get` output as rows of whitespace-separated cells.
fn table(output: &str) -> Vec<Vec<String>> {
    output
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

#[tokio::test]
async fn kubectl_get_ar_shows_phase_step_progress_and_tokens() {
    let env = TestEnv::new("kubectl_get_ar_columns").await;
    let runs: Api<AgentRun> = env.api();
    let object: AgentRun = serde_json::from_value({
        let mut r =
            run(json!({ "steps": [step("lookup-order"), step("draft-refund"), step("notify")] }));
        r["metadata"]["name"] = json!("refund-4711");
        r
    })
    .unwrap();
    runs.create(&PostParams::default(), &object)
        .await
        .expect("create AgentRun");
    runs.patch_status(
        "refund-4711",
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": {
            "phase": "Running", "currentStep": "draft-refund", "progress": "1/3", "tokensUsed": 1234,
            "conditions": [{"type": "Succeeded", "status": "Unknown", "reason": "Running",
                "message": "1/3 steps done", "lastTransitionTime": "2026-12-01T00:00:00Z"}],
        }})),
    )
    .await
    .expect("write status");

    let out = kubectl_ok(["get", "ar", "-n", env.namespace()]).await;
    let rows = table(&out);
    assert_eq!(
        rows[0],
        [
            "NAME", "PHASE", "REASON", "STEP", "PROGRESS", "TOKENS", "DURATION", "AGE"
        ],
        "{out}"
    );
    assert_eq!(rows.len(), 2, "{out}");
    assert_eq!(
        rows[1][..6],
        [
            "refund-4711",
            "Running",
            "Running",
            "draft-refund",
            "1/3",
            "1234"
        ],
        "{out}"
    );
    assert_eq!(rows[1].len(), 7, "no Duration while it runs: {out}");
    // Once finished, how long it took (what the operator records).
    runs.patch_status(
        "refund-4711",
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": {
            "phase": "Succeeded", "currentStep": "notify", "progress": "3/3", "duration": "3m12s",
        }})),
    )
    .await
    .expect("write status");
    let out = kubectl_ok(["get", "ar", "-n", env.namespace()]).await;
    let rows = table(&out);
    assert_eq!(rows[1][6], "3m12s", "{out}");
    for args in [&["get", "ar"][..], &["get", "ar", "-o", "wide"][..]] {
        let mut a = args.to_vec();
        a.extend(["-n", env.namespace()]);
        let out = kubectl_ok(a).await;
        for line in out.lines() {
            assert!(
                line.len() <= 100,
                "{args:?}: wider than 100 columns: {line:?}"
            );
        }
    }
    env.cleanup().await;
}

#[tokio::test]
async fn kubectl_get_apv_shows_run_step_kind_decision_and_expiry() {
    let env = TestEnv::new("kubectl_get_apv_columns").await;
    let approvals = dynamic_api(&env, "Approval");
    let mut object = approval(
        "Approve",
        json!({ "expiresAt": "2030-01-02T03:04:05Z", "decision": "Approved" }),
    );
    object["metadata"]["name"] = json!("refund-4711-issue-refund-r1-approve");
    approvals
        .create(
            &PostParams::default(),
            &serde_json::from_value(object).unwrap(),
        )
        .await
        .expect("create Approval");

    let out = kubectl_ok(["get", "apv", "-n", env.namespace()]).await;
    let rows = table(&out);
    assert_eq!(
        rows[0],
        [
            "NAME",
            "RUN",
            "STEP",
            "KIND",
            "PHASE",
            "DECISION",
            "EXPIRES",
            "VOTES",
            "DECIDED-BY",
            "AGE"
        ],
        "{out}"
    );
    assert_eq!(rows.len(), 2, "{out}");
    assert_eq!(
        rows[1][..6],
        [
            "refund-4711-issue-refund-r1-approve",
            "refund-4711",
            "issue-refund",
            "Approve",
            "Approved",
            "2030-01-02T03:04:05Z",
        ],
        "{out}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn every_sample_applies_with_server_side_dry_run() {
    let env = TestEnv::new("samples_dry_run").await;
    let dir = repo_root().join("config/samples");
    // The example Approval in docs/examples validates too, and so do the
    // samples `make demo` applies.
    let examples = repo_root().join("docs/examples");
    let demo = repo_root().join("e2e/demo-samples");
    let mut samples: Vec<PathBuf> = [&dir, &examples, &demo]
        .into_iter()
        .flat_map(|d| {
            std::fs::read_dir(d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display()))
        })
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        // The kustomization lists the samples; it is not an object to apply.
        .filter(|p| p.file_stem().and_then(|s| s.to_str()) != Some("kustomization"))
        .collect();
    samples.sort();
    assert!(!samples.is_empty(), "no sample under {}", dir.display());

    let mut failures = Vec::new();
    for sample in &samples {
        let out = kubectl([
            "apply".as_ref(),
            "--dry-run=server".as_ref(),
            "-n".as_ref(),
            env.namespace().as_ref(),
            "-f".as_ref(),
            sample.as_os_str(),
        ])
        .await;
        if out.success() {
            eprintln!("ok   {}: {}", sample.display(), out.stdout.trim());
        } else {
            failures.push(format!(
                "{}: {}{}",
                sample.display(),
                out.stderr.trim(),
                out.stdout.trim()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "samples refused:\n  {}",
        failures.join("\n  ")
    );
    env.cleanup().await;
}

/// `kubectl explain` opens with what the resource is, not a generated stub.
#[tokio::test]
async fn kubectl_explain_describes_both_resources() {
    let env = TestEnv::new("kubectl_explain").await;
    let run = kubectl_ok(["explain", "agentrun"]).await;
    assert!(
        run.contains("A durable AI-agent run: a plan of steps"),
        "{run}"
    );
    let approval = kubectl_ok(["explain", "approval"]).await;
    assert!(
        approval.contains("A decision a person owes an AgentRun"),
        "{approval}"
    );
    for out in [&run, &approval] {
        assert!(!out.contains("Auto-generated"), "{out}");
    }
    env.cleanup().await;
}
