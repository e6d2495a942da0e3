//! The real `kubectl` against the test plane, for what only the CLI shows
//! (printer columns, `apply --dry-run=server` of manifests).

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::ExitStatus;

use super::env::kubeconfig;

/// What one kubectl invocation produced.
#[derive(Debug)]
pub struct KubectlOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl KubectlOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }
}

/// The kubectl binary: `$AGENTRUN_KUBECTL`, else the one `e2e/cluster tools`
/// installs into the cache, else `kubectl` on `PATH`.
pub fn kubectl_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("AGENTRUN_KUBECTL").filter(|v| !v.is_empty()) {
        return PathBuf::from(path);
    }
    match cache_dir().map(|c| c.join("tools/kubectl")) {
        Some(path) if path.is_file() => path,
        _ => PathBuf::from("kubectl"),
    }
}

/// The cache `e2e/cluster` builds and installs into, as it finds it:
/// `AGENTRUN_CACHE`, else `$XDG_CACHE_HOME/agentrun-operator`, else
/// `~/.cache/agentrun-operator`.
pub fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("AGENTRUN_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .filter(|v| !v.is_empty())
                .map(|d| PathBuf::from(d).join("agentrun-operator"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/agentrun-operator"))
        })
}

/// Runs `kubectl --kubeconfig <the e2e kubeconfig> <args>` and returns its
/// output whatever the exit status. Panics only if kubectl cannot be started.
pub async fn kubectl<I, S>(args: I) -> KubectlOutput
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let binary = kubectl_binary();
    let output = tokio::process::Command::new(&binary)
        .arg("--kubeconfig")
        .arg(kubeconfig())
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {}: {e} (run `e2e/cluster tools`, or `eval $(e2e/cluster env)`)",
                binary.display()
            )
        });
    KubectlOutput {
        status: output.status,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Like [`kubectl`], but panics (with stderr) unless it succeeds; returns stdout.
pub async fn kubectl_ok<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let out = kubectl(&args).await;
    assert!(
        out.success(),
        "kubectl {:?} failed ({}):\n{}{}",
        args,
        out.status,
        out.stderr,
        out.stdout
    );
    out.stdout
}
