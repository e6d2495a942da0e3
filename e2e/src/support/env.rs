//! Where the control plane is and how to reach it: the kubeconfig and clients
//! (plain and impersonating). `TestEnv` (test_env.rs) bundles one for a test.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// How long the first request may take before the plane counts as unreachable.
const REACHABLE_TIMEOUT: Duration = Duration::from_secs(15);

/// The repository root (the parent of the `e2e` crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the e2e crate lives inside the repository")
        .to_path_buf()
}

/// The kubeconfig the tests use: the first path of `KUBECONFIG` when set,
/// else `$AGENTRUN_E2E_DIR/kubeconfig` when that is set (where `e2e/cluster up`
/// writes it), else `<repo>/target/e2e/kubeconfig`.
pub fn kubeconfig() -> PathBuf {
    if let Some(paths) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty())
        && let Some(first) = std::env::split_paths(&paths).find(|p| !p.as_os_str().is_empty())
    {
        return first;
    }
    if let Some(dir) = std::env::var_os("AGENTRUN_E2E_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir).join("kubeconfig");
    }
    repo_root().join("target/e2e/kubeconfig")
}

/// The client configuration from [`kubeconfig()`], without contacting the server.
pub(crate) async fn load_config() -> Result<Config, String> {
    let path = kubeconfig();
    if !path.exists() {
        return Err(format!("no kubeconfig at {}", path.display()));
    }
    let file = Kubeconfig::read_from(&path)
        .map_err(|e| format!("cannot read kubeconfig {}: {e}", path.display()))?;
    Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("cannot load kubeconfig {}: {e}", path.display()))
}

fn unreachable(at: &str, why: &str) -> ! {
    panic!(
        "control plane not reachable at {at}: {why}: run `make cluster-up` (or `e2e/cluster up`)"
    )
}

/// A client for the test control plane, checked to answer (`/version`).
///
/// Panics when the kubeconfig is missing or the server does not answer: a
/// test must fail, not skip, when its plane is down.
pub async fn client() -> Client {
    let config = load_config()
        .await
        .unwrap_or_else(|why| unreachable(&kubeconfig().display().to_string(), &why));
    let url = config.cluster_url.to_string();
    let client = Client::try_from(config).unwrap_or_else(|e| unreachable(&url, &e.to_string()));
    match tokio::time::timeout(REACHABLE_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(_)) => client,
        Ok(Err(e)) => unreachable(&url, &e.to_string()),
        Err(_) => unreachable(&url, &format!("no answer within {REACHABLE_TIMEOUT:?}")),
    }
}

/// A client that acts as `user` (impersonation, e.g.
/// `"system:serviceaccount:<ns>:<name>"`), built from the same kubeconfig.
/// The admin user of the e2e plane is in `system:masters`, so it may impersonate.
pub async fn client_as(user: &str) -> Client {
    let mut config = load_config()
        .await
        .unwrap_or_else(|why| unreachable(&kubeconfig().display().to_string(), &why));
    config.auth_info.impersonate = Some(user.to_owned());
    let url = config.cluster_url.to_string();
    Client::try_from(config).unwrap_or_else(|e| unreachable(&url, &e.to_string()))
}

/// A client that authenticates with `token` alone (a ServiceAccount token,
/// e.g. one bound to a Pod), against the plane of the kubeconfig: the API
/// server sees exactly that token's identity, extra fields included.
pub async fn client_with_token(token: &str) -> Client {
    let mut config = load_config()
        .await
        .unwrap_or_else(|why| unreachable(&kubeconfig().display().to_string(), &why));
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.to_owned().into()),
        ..kube::config::AuthInfo::default()
    };
    let url = config.cluster_url.to_string();
    Client::try_from(config).unwrap_or_else(|e| unreachable(&url, &e.to_string()))
}
