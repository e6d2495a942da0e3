//! The `AgentRunTemplate` resource (D21): a reviewed run spec with typed
//! parameters, from which people, CI and schedules start runs. A run from a
//! template is a run: it is created with the whole spec rendered in, by
//! whoever starts it, so admission checks the starter's rights as for any run
//! (D17), whoever wrote the template; `spec.template` records where it came
//! from.
//!
//! ```text
//!   AgentRunTemplate refund (params: orderId integer, tier enum)
//!      │  kubectl agentrun submit refund -p orderId=4711      (template_render)
//!      ▼
//!   AgentRun refund-x7k2p  spec: the template's run, {{ params.* }} filled in
//!                          spec.template: {name: refund, generation: 3, params: {orderId: 4711, tier: silver}}
//! ```
//!
//! Parameters fill only what cannot change who runs what: a container's
//! `args` and `env` values, a step's `when` and its approval `question`.
//! Admission refuses a template that puts one in an image, a ServiceAccount,
//! a Secret reference, a priority class or an approval gate ([`guard_crd`]:
//! the API server prices every rule, and a ConfigMap reference's too would
//! pass its budget); the renderer refuses one anywhere else outside those
//! four, ConfigMap references included.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, ValidationRule,
};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::AgentRunSpec;

/// Most parameters one template declares.
pub const MAX_PARAMS: usize = 64;
/// Longest parameter name.
pub const MAX_PARAM_NAME: usize = 63;
/// Bounds the template schema puts on unbounded lists and strings it
/// guards, so the API server can price the rules (a CEL rule's cost grows
/// with both).
const GUARDED_LIST_MAX: i64 = 32;
const GUARDED_STRING_MAX: i64 = 1024;

/// The refusal of a parameter where it could change who runs what.
pub const PARAM_FORBIDDEN: &str = "a parameter ({{ params.<name> }}) may not be used here: parameters fill only args, env values, when and approval questions, never an image, a ServiceAccount, a Secret or ConfigMap reference, a priority class or an approval gate";

/// A reviewed run spec with typed parameters; `kubectl agentrun submit`
/// (and a schedule) creates runs from it.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "AgentRunTemplate",
    plural = "agentruntemplates",
    singular = "agentruntemplate",
    shortname = "art",
    category = "agentrun-all",
    namespaced,
    derive = "PartialEq",
    derive = "Default",
    doc = "A reviewed AgentRun spec with typed parameters. `kubectl agentrun submit TEMPLATE -p name=value` creates a run from it, with the parameters filled into args, env values, when and approval questions, and records the template's name, generation and the parameters in the run's spec.template.",
    printcolumn(
        name = "Params",
        type_ = "string",
        json_path = ".spec.params[*].name",
        description = "The parameters a run from this template takes"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp",
        description = "Time since the template was created"
    )
)]
#[x_kube(
    validation = Rule::new("!has(self.params) || self.params.all(p, self.params.exists_one(q, q.name == p.name))").message("spec.params: parameter names must be unique").field_path(".params"),
)]
#[serde(rename_all = "camelCase")]
pub struct AgentRunTemplateSpec {
    /// The parameters a run from this template takes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub params: Vec<TemplateParam>,
    /// The run's spec. `{{ params.<name> }}` in a container's args or env
    /// values, a step's `when` or its approval question is replaced by the
    /// parameter's value when a run is created from the template.
    pub run: AgentRunSpec,
}

/// One parameter of a template.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TemplateParam {
    /// The name `{{ params.<name> }}` refers to.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[A-Za-z_][A-Za-z0-9_]*$")
    )]
    pub name: String,
    #[serde(rename = "type", default)]
    pub type_: ParamType,
    /// The only values allowed, when set.
    #[serde(rename = "enum", default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::any_json_list")]
    pub enum_: Option<Vec<serde_json::Value>>,
    /// The value when none is given (never for a `required` one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::any_json")]
    pub default: Option<serde_json::Value>,
    /// A run cannot be created from the template without it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub required: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub description: Option<String>,
}

/// A parameter's type.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ParamType {
    #[default]
    #[serde(rename = "string")]
    String,
    #[serde(rename = "integer")]
    Integer,
    #[serde(rename = "boolean")]
    Boolean,
    /// Any JSON value (an object, a list); filled in as compact JSON.
    #[serde(rename = "object")]
    Object,
}

/// Where a run came from: the template, its generation when the run was
/// created, and the parameters it was given (defaults filled in).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TemplateRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    #[serde(default)]
    pub generation: i64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "crate::json_schema_object")]
    pub params: BTreeMap<String, serde_json::Value>,
}

impl AgentRunTemplate {
    /// The CRD, with the admission guard on the fields a parameter may never fill.
    pub fn guarded_crd() -> CustomResourceDefinition {
        let mut crd = AgentRunTemplate::crd();
        for v in &mut crd.spec.versions {
            let run = v
                .schema
                .as_mut()
                .and_then(|s| s.open_api_v3_schema.as_mut())
                .and_then(|s| s.properties.as_mut())
                .and_then(|p| p.get_mut("spec"))
                .and_then(|s| s.properties.as_mut())
                .and_then(|p| p.get_mut("run"));
            if let Some(run) = run {
                guard_crd(run, &mut Vec::new());
            }
        }
        crd
    }
}

/// Whether the string property at `path` (property names from `spec.run`)
/// is one a parameter may never fill.
fn guarded(path: &[String]) -> bool {
    let Some(last) = path.last().map(String::as_str) else {
        return false;
    };
    let under = |p: &str| path.iter().any(|x| x == p);
    last == "image"
        || (under("podTemplate") && matches!(last, "serviceAccountName" | "priorityClassName"))
        || (under("imagePullSecrets") && last == "name")
        || ((under("secretKeyRef") || under("secretRef")) && last == "name")
        || (under("approval") && last != "question" && last != "timeout")
}

/// Adds the guard rule to every string [`guarded`] names under `schema`,
/// bounding the lists and strings on the way so the API server can price it.
fn guard_crd(schema: &mut JSONSchemaProps, path: &mut Vec<String>) {
    if schema.type_.as_deref() == Some("string") && guarded(path) {
        schema.max_length.get_or_insert(GUARDED_STRING_MAX);
        schema
            .x_kubernetes_validations
            .get_or_insert_with(Vec::new)
            .push(ValidationRule {
                rule: "!self.contains('{{')".into(),
                message: Some(PARAM_FORBIDDEN.into()),
                reason: Some("FieldValueForbidden".into()),
                ..ValidationRule::default()
            });
        return;
    }
    if let Some(props) = schema.properties.as_mut() {
        for (name, p) in props.iter_mut() {
            path.push(name.clone());
            guard_crd(p, path);
            path.pop();
        }
    }
    if let Some(JSONSchemaPropsOrArray::Schema(items)) = schema.items.as_mut() {
        if guarded_below(items, path) {
            schema.max_items.get_or_insert(GUARDED_LIST_MAX);
        }
        guard_crd(items, path);
    }
}

/// Whether a guarded string lies somewhere below `schema` (at `path`).
fn guarded_below(schema: &JSONSchemaProps, path: &mut Vec<String>) -> bool {
    if schema.type_.as_deref() == Some("string") {
        return guarded(path);
    }
    let in_props = schema.properties.as_ref().is_some_and(|props| {
        props.iter().any(|(name, p)| {
            path.push(name.clone());
            let found = guarded_below(p, path);
            path.pop();
            found
        })
    });
    in_props
        || matches!(schema.items.as_ref(), Some(JSONSchemaPropsOrArray::Schema(items)) if guarded_below(items, path))
}
