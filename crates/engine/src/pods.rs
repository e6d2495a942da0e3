//! Building step Pods (pure): deterministic name per attempt, controller
//! ownerReference to the run, the well-known labels, the idempotency key as
//! label, annotation and env (D1), the context in an annotation mounted by the
//! downward API, the result finalizer (D5) and a restricted security context.
//!
//! ```text
//!   AgentRun ──owns──▶ Pod <run>-<step>-r<rev>-a<n>  (step)      finalizer agentrun.dev/result
//!                      Pod <run>-<step>-r<rev>-c<n>  (compensate)
//!                      Pod <run>-<planner>-r1-p<n>   (planner)
//!                      Pod <run>-<step>-r<rev>-s<n>  (compactor, before <step>)
//! ```

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapProjection, Container, DownwardAPIVolumeFile, DownwardAPIVolumeSource,
    EnvVar, KeyToPath, ObjectFieldSelector, Pod, PodSecurityContext, PodSpec,
    ProjectedVolumeSource, SeccompProfile, SecurityContext, ServiceAccountTokenProjection, Volume,
    VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::names::PodRole;
use agentrun_api::labels;
use agentrun_api::{JournalCall, PodDefaults, StepContainer};

const CONTEXT_VOLUME: &str = "agentrun-context";
/// Set by the operator for every attempt; a step's own values are dropped.
const TRACE_ENV: [&str; 2] = ["TRACEPARENT", "OTEL_RESOURCE_ATTRIBUTES"];

/// Everything that makes one attempt's Pod.
pub struct PodRequest<'a> {
    pub name: String,
    pub namespace: Option<String>,
    pub owner: OwnerReference,
    pub run: &'a str,
    pub step: &'a str,
    pub role: PodRole,
    pub plan_revision: i64,
    pub attempt: i32,
    pub idempotency_key: &'a str,
    pub container: &'a StepContainer,
    pub defaults: Option<&'a PodDefaults>,
    pub context_json: String,
    /// For a plan step: the digest of what it runs (D14), as an annotation,
    /// so what ran can be held against what was approved.
    pub step_digest: Option<String>,
    /// For a journaled step's attempt: where its journal is and a token to
    /// write it (D19, docs/journal.md).
    pub journal: Option<JournalPod>,
    /// For a verify probe asked about one journaled call: that call.
    pub call: Option<JournalCall>,
}

/// What a journaled step's Pod is told of its journal.
pub struct JournalPod {
    /// `<run>-<step>-<tag>-r<rev>-journal-`: chunk n is `<prefix><n>`.
    pub prefix: String,
    pub max_bytes: i64,
}

/// Where a journaled step's Pod finds the token bound to it and the API
/// server's CA.
pub const JOURNAL_DIR: &str = "/var/run/agentrun/journal";
const JOURNAL_VOLUME: &str = "agentrun-journal";
/// A journal token lives an hour; the kubelet renews it at 80%.
const JOURNAL_TOKEN_SECONDS: i64 = 3600;

pub fn build(r: PodRequest) -> Pod {
    let defaults = r.defaults.cloned().unwrap_or_default();
    let journal = r.journal.is_some();
    let journal_env = journal_env(&r);
    let mut pod_labels: BTreeMap<String, String> = defaults.labels.clone();
    for (k, v) in [
        (labels::RUN, r.run.to_owned()),
        (labels::STEP, r.step.to_owned()),
        (labels::PLAN_REVISION, r.plan_revision.to_string()),
        (labels::ATTEMPT, r.attempt.to_string()),
        (labels::ROLE, r.role.label().to_owned()),
        (labels::IDEMPOTENCY_KEY, r.idempotency_key.to_owned()),
    ] {
        pod_labels.insert(k.to_owned(), v);
    }
    let mut annotations = defaults.annotations.clone();
    annotations.insert(
        labels::IDEMPOTENCY_KEY.to_owned(),
        r.idempotency_key.to_owned(),
    );
    annotations.insert(labels::CONTEXT.to_owned(), r.context_json);
    if let Some(d) = r.step_digest {
        annotations.insert(labels::STEP_DIGEST.to_owned(), d);
    }

    // The step's own env first, ours last: a step cannot override its identity.
    let mut env: Vec<EnvVar> = r
        .container
        .env
        .iter()
        .filter(|e| !e.name.starts_with("AGENTRUN_") && !TRACE_ENV.contains(&e.name.as_str()))
        .cloned()
        .collect();
    // The attempt's span in the run's trace (docs/step-contract.md, "Traces").
    let role = r.role.label();
    let trace = [
        (
            "TRACEPARENT",
            crate::trace_ids::attempt_traceparent(
                &r.owner.uid,
                role,
                r.step,
                r.plan_revision,
                r.attempt,
            ),
        ),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            format!(
                "agentrun.run={},agentrun.step={},agentrun.role={role},agentrun.plan_revision={},agentrun.attempt={},agentrun.idempotency_key={}",
                r.run, r.step, r.plan_revision, r.attempt, r.idempotency_key
            ),
        ),
    ];
    for (name, value) in [
        (labels::env::IDEMPOTENCY_KEY, r.idempotency_key.to_owned()),
        (labels::env::RUN, r.run.to_owned()),
        (labels::env::STEP, r.step.to_owned()),
        (labels::env::ATTEMPT, r.attempt.to_string()),
        (labels::env::PLAN_REVISION, r.plan_revision.to_string()),
        (labels::env::CONTEXT_FILE, labels::CONTEXT_PATH.to_owned()),
    ]
    .into_iter()
    .chain(trace)
    .chain(journal_env)
    {
        env.push(EnvVar {
            name: name.to_owned(),
            value: Some(value),
            value_from: None,
        });
    }
    let (mount_dir, file) = labels::CONTEXT_PATH
        .rsplit_once('/')
        .unwrap_or(("/agentrun", "context.json"));

    let container = Container {
        name: r.role.label().to_owned(),
        image: Some(r.container.image.clone()),
        command: non_empty(&r.container.command),
        args: non_empty(&r.container.args),
        env: Some(env),
        env_from: non_empty(&r.container.env_from),
        resources: r
            .container
            .resources
            .as_deref()
            .or(defaults.resources.as_ref())
            .cloned(),
        working_dir: r.container.working_dir.clone(),
        image_pull_policy: r.container.image_pull_policy.clone(),
        volume_mounts: Some(
            std::iter::once(VolumeMount {
                name: CONTEXT_VOLUME.to_owned(),
                mount_path: mount_dir.to_owned(),
                read_only: Some(true),
                ..VolumeMount::default()
            })
            .chain(r.journal.as_ref().map(|_| VolumeMount {
                name: JOURNAL_VOLUME.to_owned(),
                mount_path: JOURNAL_DIR.to_owned(),
                read_only: Some(true),
                ..VolumeMount::default()
            }))
            .collect(),
        ),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                add: None,
            }),
            seccomp_profile: Some(runtime_default()),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };

    Pod {
        metadata: ObjectMeta {
            name: Some(r.name),
            namespace: r.namespace,
            labels: Some(pod_labels),
            annotations: Some(annotations),
            owner_references: Some(vec![r.owner]),
            finalizers: Some(vec![labels::RESULT_FINALIZER.to_owned()]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".to_owned()),
            containers: vec![container],
            volumes: Some(
                std::iter::once(Volume {
                    name: CONTEXT_VOLUME.to_owned(),
                    downward_api: Some(DownwardAPIVolumeSource {
                        items: Some(vec![DownwardAPIVolumeFile {
                            path: file.to_owned(),
                            field_ref: Some(ObjectFieldSelector {
                                field_path: format!("metadata.annotations['{}']", labels::CONTEXT),
                                api_version: None,
                            }),
                            ..DownwardAPIVolumeFile::default()
                        }]),
                        ..DownwardAPIVolumeSource::default()
                    }),
                    ..Volume::default()
                })
                .chain(journal.then(journal_volume))
                .collect(),
            ),
            automount_service_account_token: Some(
                defaults.automount_service_account_token.unwrap_or(false),
            ),
            // A projected token names its ServiceAccount: the namespace's
            // `default` unless the run names one.
            service_account_name: defaults
                .service_account_name
                .clone()
                .or_else(|| journal.then(|| "default".to_owned())),
            node_selector: (!defaults.node_selector.is_empty())
                .then(|| defaults.node_selector.clone()),
            tolerations: non_empty(&defaults.tolerations),
            image_pull_secrets: non_empty(&defaults.image_pull_secrets),
            priority_class_name: defaults.priority_class_name.clone(),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                seccomp_profile: Some(runtime_default()),
                ..PodSecurityContext::default()
            }),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// A journaled step's journal, and a verify probe's call (docs/journal.md).
fn journal_env(r: &PodRequest) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if let Some(j) = &r.journal {
        env.extend([
            (labels::env::JOURNAL, j.prefix.clone()),
            (labels::env::JOURNAL_MAX_BYTES, j.max_bytes.to_string()),
            (labels::env::RUN_UID, r.owner.uid.clone()),
            (
                labels::env::NAMESPACE,
                r.namespace.clone().unwrap_or_default(),
            ),
            (
                labels::env::JOURNAL_TOKEN_FILE,
                format!("{JOURNAL_DIR}/token"),
            ),
            (
                labels::env::JOURNAL_CA_FILE,
                format!("{JOURNAL_DIR}/ca.crt"),
            ),
        ]);
    }
    if let Some(c) = &r.call {
        env.extend([
            (labels::env::CALL_SEQ, c.seq.to_string()),
            (labels::env::CALL_ID, c.call_id.clone()),
            (labels::env::CALL_KEY, c.key.clone()),
        ]);
    }
    env
}

/// A token bound to this Pod (the API server puts the Pod in it, which the
/// journals admission policy reads) and the API server's CA.
fn journal_volume() -> Volume {
    Volume {
        name: JOURNAL_VOLUME.to_owned(),
        projected: Some(ProjectedVolumeSource {
            default_mode: Some(0o444),
            sources: Some(vec![
                VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        path: "token".to_owned(),
                        expiration_seconds: Some(JOURNAL_TOKEN_SECONDS),
                        audience: None,
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    config_map: Some(ConfigMapProjection {
                        name: "kube-root-ca.crt".to_owned(),
                        items: Some(vec![KeyToPath {
                            key: "ca.crt".to_owned(),
                            path: "ca.crt".to_owned(),
                            mode: None,
                        }]),
                        optional: None,
                    }),
                    ..VolumeProjection::default()
                },
            ]),
        }),
        ..Volume::default()
    }
}

fn runtime_default() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".to_owned(),
        localhost_profile: None,
    }
}

fn non_empty<T: Clone>(v: &[T]) -> Option<Vec<T>> {
    (!v.is_empty()).then(|| v.to_vec())
}
