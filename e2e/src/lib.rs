//! Test support for agentrun-operator on a real control plane (kube-apiserver,
//! etcd and kube-controller-manager started by `e2e/cluster up`).
//!
//! ```text
//!   TestEnv::new("my_test") ──▶ Client (from the e2e kubeconfig; panics if the plane is down)
//!        │                      ├─ CRDs installed once per process (server-side apply, Established)
//!        │                      └─ TestNamespace "my-test-x7k2q9" (labelled; deleted on cleanup/drop)
//!        ├─ pods::{set_pod_running, set_pod_terminated, set_pod_evicted}  (what a kubelet reports)
//!        ├─ wait::{wait_for, wait_for_deleted}                               (kube-runtime await_condition)
//!        └─ kubectl::{kubectl, kubectl_ok}                                   (the real CLI against the plane)
//! ```
//!
//! Tests never pass by skipping: without a reachable control plane every
//! helper that needs one panics and says how to start it.
#![forbid(unsafe_code)]

pub mod chaos;
pub mod ledger;

pub mod support {
    pub mod chart;
    pub mod crds;
    pub mod env;
    pub mod history;
    pub mod http;
    pub mod incluster;
    pub mod jaeger;
    pub mod journal;
    pub mod kubectl;
    pub mod namespace;
    pub mod node;
    pub mod pods;
    pub mod policies;
    pub mod processes;
    pub mod receiver;
    pub mod scenario;
    pub mod test_env;
    pub mod wait;
}

pub use support::crds::{FIELD_MANAGER, apply_crd, install_crds};
pub use support::env::{client, client_as, kubeconfig, repo_root};
pub use support::http::{get_ok, http_get};
pub use support::kubectl::{KubectlOutput, kubectl, kubectl_ok};
pub use support::namespace::TestNamespace;
pub use support::pods::{set_pod_evicted, set_pod_running, set_pod_terminated};
pub use support::test_env::TestEnv;
pub use support::wait::{wait_for, wait_for_deleted};
