//! The CRDs on the plane: `AgentRun` and `Approval` generated from the Rust
//! types (`agentrun_operator::api::crds()`), installed by server-side apply
//! and awaited until `Established`.

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client, ResourceExt};
use tokio::sync::OnceCell;

/// The field manager of every write the test support makes.
pub const FIELD_MANAGER: &str = "agentrun-e2e";

const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(60);

/// Installs the AgentRun and Approval CRDs once per test process; later and
/// concurrent callers wait for that first install. Panics if it fails.
pub async fn install_crds(client: &Client) {
    static INSTALLED: OnceCell<()> = OnceCell::const_new();
    INSTALLED
        .get_or_init(|| async {
            for crd in agentrun_operator::api::crds() {
                apply_crd(client, &crd).await;
            }
        })
        .await;
}

/// Server-side applies `crd` (manager [`FIELD_MANAGER`], forced), waits until
/// it is `Established`, and checks the apiserver found its schema structural.
/// Returns the CRD as the server has it. Panics on any failure.
pub async fn apply_crd(
    client: &Client,
    crd: &CustomResourceDefinition,
) -> CustomResourceDefinition {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.name_any();
    let mut crd = crd.clone();
    crd.metadata.managed_fields = None;
    crd.metadata.resource_version = None;
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap_or_else(|e| panic!("applying CRD {name}: {e}"));
    let established = tokio::time::timeout(
        ESTABLISH_TIMEOUT,
        await_condition(api.clone(), &name, conditions::is_crd_established()),
    )
    .await
    .unwrap_or_else(|_| panic!("CRD {name} not Established within {ESTABLISH_TIMEOUT:?}"))
    .unwrap_or_else(|e| panic!("watching CRD {name}: {e}"))
    .unwrap_or_else(|| panic!("CRD {name} was deleted while being installed"));
    if let Some(c) = established
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.type_ == "NonStructuralSchema" && c.status == "True")
        })
    {
        panic!(
            "CRD {name} has a non-structural schema: {}",
            c.message.as_deref().unwrap_or("")
        );
    }
    established
}
