//! Who may answer a run: the approvers of an approval gate and the senders
//! of a signal wait, each copied into the object the run opens (Approval,
//! Signal), where the chart's admission policies read it.

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

/// Who may send a signal: any listed user, any member of a listed group, any
/// listed ServiceAccount. The same shape as [`Approvers`], with messages that
/// name the field it sits in.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("size(self.users) + size(self.groups) + size(self.serviceAccounts) > 0").message("wait.signal.senders: name at least one user, group or serviceAccount (leave senders out to let RBAC alone decide)").reason(Reason::FieldValueRequired)
)]
pub struct Senders {
    /// User names, as the API server authenticates them.
    #[serde(default)]
    #[schemars(length(max = 32), inner(length(min = 1, max = 253)))]
    #[x_kube(validation = Rule::new("self.all(u, u.trim() != '')").message("wait.signal.senders.users: a user name cannot be blank"))]
    pub users: Vec<String>,
    /// Group names, as the API server authenticates them.
    #[serde(default)]
    #[schemars(length(max = 32), inner(length(min = 1, max = 253)))]
    #[x_kube(validation = Rule::new("self.all(g, g.trim() != '')").message("wait.signal.senders.groups: a group name cannot be blank"))]
    pub groups: Vec<String>,
    /// ServiceAccounts (a CI job, a webhook bridge).
    #[serde(default)]
    #[schemars(length(max = 32))]
    pub service_accounts: Vec<ServiceAccountRef>,
}

impl ServiceAccountRef {
    /// Resolves an empty namespace to the run's: what the Approval or Signal
    /// carries, where the policies compare it with the request's user.
    pub fn in_namespace(mut list: Vec<Self>, namespace: &str) -> Vec<Self> {
        for sa in list.iter_mut().filter(|s| s.namespace.is_empty()) {
            sa.namespace = namespace.to_owned();
        }
        list
    }
}

impl Approvers {
    /// `users alice, bob; group payments-leads`: who may decide, for messages.
    pub fn describe(&self) -> String {
        describe(&self.users, &self.groups, &self.service_accounts)
    }
}

impl Senders {
    /// `user ci-bot; serviceAccount payments/bridge`: who may send, for messages.
    pub fn describe(&self) -> String {
        describe(&self.users, &self.groups, &self.service_accounts)
    }
}

fn describe(users: &[String], groups: &[String], service_accounts: &[ServiceAccountRef]) -> String {
    let part = |one: &str, many: &str, names: Vec<String>| match names.len() {
        0 => None,
        1 => Some(format!("{one} {}", names[0])),
        _ => Some(format!("{many} {}", names.join(", "))),
    };
    [
        part("user", "users", users.to_vec()),
        part("group", "groups", groups.to_vec()),
        part(
            "serviceAccount",
            "serviceAccounts",
            service_accounts
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
