//! The API of agentrun-operator: the `AgentRun`, `Approval`, `Signal` and
//! `RunRecord` custom resources (`agentrun.dev/v1alpha1`).
//!
//! ```text
//!   AgentRun ──owns──▶ step Pod (one per attempt, finalizer agentrun.dev/result)
//!      │  ├──owns──▶ Approval (Approve before a gated step, Reconcile after a lost NonIdempotent one)
//!      │  └──owns──▶ Signal (a wait step's event from outside: id + data, sent once)
//!      └─ status: plan, one StepCheckpoint per (step, plan revision), tokens, conditions
//!   RunRecord (not owned: outlives the run) — what a finished run did (D18)
//! ```
//!
//! The CRDs in `crds/` are generated from these types (`agentrun-operator crd`).
//! This crate holds the types, the names put on owned objects ([`labels`])
//! and the spec digest; it has no client, so whatever reads or writes these
//! resources (the operator, the kubectl plugin, the tests) shares one
//! definition of them.
#![forbid(unsafe_code)]

mod agentrun;
mod answer;
mod approval;
mod approvers;
pub mod archive;
mod digest;
mod duration;
mod journal;
pub mod labels;
mod notify;
mod record;
mod run_status;
mod signal;
mod template;
mod template_render;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use agentrun::*;
pub use answer::{DurableAnswer, Opened};
pub use approval::*;
pub use approvers::*;
pub use archive::ArchivedSteps;
pub use digest::{MAX_SPEC_DIGESTS, spec_digest};
pub use duration::{DURATION_PATTERN, Duration, DurationError};
pub use journal::*;
pub use notify::*;
pub use record::*;
pub use run_status::*;
pub use signal::*;
pub use template::*;
pub use template_render::{RenderError, parse_param, render};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use schemars::{Schema, SchemaGenerator, json_schema};

/// The API group of the resources.
pub const GROUP: &str = "agentrun.dev";

/// The CRDs, in the order they are installed.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        AgentRun::crd(),
        Approval::crd(),
        Signal::crd(),
        RunRecord::crd(),
        StepJournal::crd(),
        AgentRunTemplate::guarded_crd(),
    ]
}

/// The CRDs as one multi-document YAML stream, as checked in under `crds/`.
pub fn crds_yaml() -> String {
    crds()
        .iter()
        .map(|crd| serde_yaml::to_string(crd).expect("a CRD always serializes"))
        .collect::<Vec<_>>()
        .join("---\n")
}

/// Free-form JSON kept as written (a step's result).
fn any_json(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// A list of up to 64 JSON values kept as written (a parameter's `enum`).
fn any_json_list(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "minItems": 1,
        "maxItems": 64,
        "items": {"x-kubernetes-preserve-unknown-fields": true},
    })
}

/// A JSON object kept as written (a step's `resultSchema`).
fn json_schema_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

/// Conditions as a map keyed by `type`, the standard `metav1.Condition` list.
fn conditions_schema(generator: &mut SchemaGenerator) -> Schema {
    let item =
        generator.subschema_for::<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>();
    json_schema!({
        "type": "array",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    })
}

/// Deliveries as a map keyed by `id`, so the notifier's server-side apply of
/// one delivery leaves the others (and the engine's fields) alone.
fn deliveries_schema(generator: &mut SchemaGenerator) -> Schema {
    let item = generator.subschema_for::<Delivery>();
    json_schema!({
        "type": "array",
        "maxItems": 64,
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["id"],
    })
}

#[cfg(test)]
mod tests;
