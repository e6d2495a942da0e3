//! Waiting for an object to reach a condition, on a watch (kube-runtime's
//! `await_condition`), bounded by a timeout that fails the test loudly.

use std::fmt::Debug;
use std::time::Duration;

use kube::runtime::wait::{Condition, await_condition, conditions};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;

/// Waits until `condition` holds for the object `name`, at most `timeout`.
/// Returns the object as it was when the condition held (`None` if the
/// condition holds for an absent object, e.g. `conditions::is_deleted`).
/// Panics on timeout with the object's last state.
pub async fn wait_for<K, C>(api: &Api<K>, name: &str, condition: C, timeout: Duration) -> Option<K>
where
    K: Clone + Debug + Send + DeserializeOwned + Resource + 'static,
    K::DynamicType: Default,
    C: Condition<K>,
{
    match tokio::time::timeout(timeout, await_condition(api.clone(), name, condition)).await {
        Ok(Ok(obj)) => obj,
        Ok(Err(e)) => panic!("watching {} {name}: {e}", kind::<K>()),
        Err(_) => {
            let last = match api.get_opt(name).await {
                Ok(Some(mut obj)) => {
                    obj.managed_fields_mut().clear();
                    let mut s = format!("{obj:?}");
                    s.truncate(4000);
                    s
                }
                Ok(None) => "absent".to_owned(),
                Err(e) => format!("unknown ({e})"),
            };
            panic!(
                "timed out after {timeout:?} waiting for {} {name}; last seen: {last}",
                kind::<K>()
            )
        }
    }
}

/// Waits until the object `name` (as it exists now) is gone, at most `timeout`.
/// Returns at once if it does not exist.
pub async fn wait_for_deleted<K>(api: &Api<K>, name: &str, timeout: Duration)
where
    K: Clone + Debug + Send + DeserializeOwned + Resource + 'static,
    K::DynamicType: Default,
{
    let uid = match api.get_opt(name).await {
        Ok(Some(obj)) => obj.uid().unwrap_or_default(),
        Ok(None) => return,
        Err(e) => panic!("reading {} {name}: {e}", kind::<K>()),
    };
    wait_for(api, name, conditions::is_deleted(&uid), timeout).await;
}

fn kind<K: Resource>() -> String
where
    K::DynamicType: Default,
{
    K::kind(&K::DynamicType::default()).into_owned()
}
