//! Who may decide an approval: the approver policy of a gate, copied into
//! the Approval it asks, where the chart's admission policies read it.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Who may decide an approval: any listed user, any member of a listed
/// group, any listed ServiceAccount.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("size(self.users) + size(self.groups) + size(self.serviceAccounts) > 0").message("approval.approvers: name at least one user, group or serviceAccount (leave approvers out to let RBAC alone decide)").reason(Reason::FieldValueRequired)
)]
pub struct Approvers {
    /// User names, as the API server authenticates them.
    #[serde(default)]
    #[schemars(length(max = 32), inner(length(min = 1, max = 253)))]
    #[x_kube(validation = Rule::new("self.all(u, u.trim() != '')").message("approval.approvers.users: a user name cannot be blank"))]
    pub users: Vec<String>,
    /// Group names, as the API server authenticates them.
    #[serde(default)]
    #[schemars(length(max = 32), inner(length(min = 1, max = 253)))]
    #[x_kube(validation = Rule::new("self.all(g, g.trim() != '')").message("approval.approvers.groups: a group name cannot be blank"))]
    pub groups: Vec<String>,
    /// ServiceAccounts (an approving bot, or a UI acting as itself).
    #[serde(default)]
    #[schemars(length(max = 32))]
    pub service_accounts: Vec<ServiceAccountRef>,
}

/// A ServiceAccount by namespace and name.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountRef {
    /// Its namespace; empty: the run's namespace.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 63))]
    pub namespace: String,
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
}

impl Approvers {
    /// `users alice, bob; group payments-leads`: who may decide, for messages.
    pub fn describe(&self) -> String {
        let part = |one: &str, many: &str, names: Vec<String>| match names.len() {
            0 => None,
            1 => Some(format!("{one} {}", names[0])),
            _ => Some(format!("{many} {}", names.join(", "))),
        };
        [
            part("user", "users", self.users.clone()),
            part("group", "groups", self.groups.clone()),
            part(
                "serviceAccount",
                "serviceAccounts",
                self.service_accounts
                    .iter()
                    .map(|s| format!("{}/{}", s.namespace, s.name))
                    .collect(),
            ),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("; ")
    }
}
