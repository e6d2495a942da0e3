//! [`TestEnv`], the per-test bundle: a client of the plane, the CRDs installed
//! (once per process) and a fresh namespace deleted at the end.

use k8s_openapi::NamespaceResourceScope;
use kube::{Api, Client, Resource};

use super::crds::install_crds;
use super::env::client;
use super::namespace::TestNamespace;

/// Everything one test needs: a client, the CRDs installed (once per
/// process), and a fresh namespace that is deleted at the end.
///
/// ```no_run
/// # async fn t() {
/// let env = agentrun_e2e::TestEnv::new("evicted_step_resumes_with_same_key").await;
/// let runs = env.api::<agentrun_operator::api::AgentRun>();
/// // ...
/// env.cleanup().await; // or let it drop
/// # }
/// ```
pub struct TestEnv {
    client: Client,
    namespace: TestNamespace,
}

impl TestEnv {
    /// Connects (panicking if the plane is down), installs the CRDs and
    /// creates a namespace named after `test_name` with a random suffix.
    pub async fn new(test_name: &str) -> TestEnv {
        let client = client().await;
        install_crds(&client).await;
        let namespace = TestNamespace::create(&client, test_name).await;
        TestEnv { client, namespace }
    }

    /// A handle on the client (cheap to clone).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The test's namespace.
    pub fn namespace(&self) -> &str {
        self.namespace.name()
    }

    /// An `Api` for a namespaced kind in the test's namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), self.namespace())
    }

    /// Deletes the namespace now (the drop guard does the same, best-effort).
    pub async fn cleanup(self) {
        self.namespace.cleanup(&self.client).await;
    }
}
