//! One fresh namespace per test: random-suffixed from the test name,
//! labelled so leftovers can be found
//! (`kubectl get ns -l e2e.agentrun.dev/namespace=true`), and deleted at the
//! end of the test, explicitly ([`TestNamespace::cleanup`]) or by its drop guard.

use std::collections::BTreeMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::{Api, Client};

use super::env::load_config;

/// Label on every test namespace.
pub const NAMESPACE_LABEL: &str = "e2e.agentrun.dev/namespace";
/// Label holding the (sanitised) name of the test that created the namespace.
pub const TEST_LABEL: &str = "e2e.agentrun.dev/test";
/// Set to keep test namespaces after the test, for debugging.
pub const KEEP_ENV: &str = "AGENTRUN_E2E_KEEP_NAMESPACES";

/// A namespace owned by one test. Dropping it deletes the namespace
/// (best-effort, from a separate thread with its own runtime, so it never
/// blocks on the test's runtime).
pub struct TestNamespace {
    name: String,
    armed: bool,
}

impl TestNamespace {
    /// Creates `<test-name>-<suffix>` (a DNS label) with the e2e labels.
    pub async fn create(client: &Client, test_name: &str) -> TestNamespace {
        let name = namespace_name(test_name);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([
                    (NAMESPACE_LABEL.to_owned(), "true".to_owned()),
                    (TEST_LABEL.to_owned(), label_value(test_name)),
                ])),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("creating test namespace {name}: {e}"));
        TestNamespace { name, armed: true }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Deletes the namespace now and disarms the drop guard.
    pub async fn cleanup(mut self, client: &Client) {
        self.armed = false;
        if keep() {
            return;
        }
        delete(client, &self.name).await;
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if !self.armed || keep() {
            return;
        }
        let name = std::mem::take(&mut self.name);
        // The test's runtime may be a current-thread one that is blocked right
        // here, so the deletion gets its own thread, runtime and client.
        let worker = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                if let Ok(config) = load_config().await
                    && let Ok(client) = Client::try_from(config)
                {
                    let _ = tokio::time::timeout(
                        std::time::Duration::from_secs(10),
                        delete(&client, &name),
                    )
                    .await;
                }
            });
        });
        let _ = worker.join();
    }
}

fn keep() -> bool {
    std::env::var_os(KEEP_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

async fn delete(client: &Client, name: &str) {
    match Api::<Namespace>::all(client.clone())
        .delete(name, &DeleteParams::background())
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_not_found() => {}
        Err(e) => eprintln!("warning: deleting test namespace {name}: {e}"),
    }
}

/// `<sanitised test name, at most 56 chars>-<6 random base-36 chars>`.
fn namespace_name(test_name: &str) -> String {
    let mut base = label_value(test_name);
    base.truncate(56);
    let base = base.trim_end_matches('-');
    let base = if base.is_empty() { "e2e" } else { base };
    format!("{base}-{}", suffix())
}

/// The test name as a DNS label / label value: lowercase, `[a-z0-9-]`, at most 63.
fn label_value(test_name: &str) -> String {
    let mut out = String::with_capacity(test_name.len());
    for c in test_name.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    out.truncate(63);
    out.trim_end_matches('-').to_owned()
}

/// Six base-36 characters from a randomly keyed hash of the clock, the
/// process and a counter: unique across concurrent tests and processes.
fn suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = (
        jiff::Timestamp::now().as_nanosecond(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
    );
    let mut n = RandomState::new().hash_one(seed);
    let mut out = String::with_capacity(6);
    for _ in 0..6 {
        out.push(char::from_digit((n % 36) as u32, 36).expect("digit < 36"));
        n /= 36;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels_derived_from_the_test_name() {
        let name = namespace_name("controlplane::Stale_ResourceVersion gets 409!");
        assert!(
            name.starts_with("controlplane-stale-resourceversion-gets-409-"),
            "{name}"
        );
        assert!(name.len() <= 63);
        let long = namespace_name(&"x".repeat(200));
        assert!(long.len() <= 63, "{long}");
        assert_ne!(namespace_name("a"), namespace_name("a"));
        assert!(namespace_name("___").starts_with("e2e-"));
    }
}
