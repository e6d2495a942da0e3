//! A channel configuration that is wrong is reported, and the good channels deliver
//! meanwhile.

use std::time::Duration;

use agentrun_e2e::support::receiver::Receiver;
use agentrun_operator::api::DeliveryState;
use kube::Api;
use serde_json::json;

use super::{
    SECRET_NAME, TIMEOUT, assert_no_more, assert_signed, delivery, gated_run, id, notified,
    put_channels, setup, wait_approval,
};

/// A channel name nobody configured, a channel whose key is missing and a
/// Secret that is not YAML are each reported — on the Approval and, for the
/// unknown name, in an Event on the run — while the good channel delivers;
/// the deliveries held back go out once the Secret is fixed.
#[tokio::test]
async fn wrong_channels_are_reported_and_the_others_deliver() {
    let r = Receiver::start().await;
    let s = setup(
        "notify-bad-config",
        &r,
        "channels:\n\
         - {name: good, url: '{R}/good'}\n\
         - {name: nokey, url: '{R}/nokey', hmacKeyRef: missing}\n",
        true,
        None,
    )
    .await;
    let ns = s.namespace().to_owned();
    let name = gated_run(
        &s,
        "refund",
        json!({"question": "ok?", "notify": ["good", "nokey", "nope"]}),
    )
    .await;
    let a = s.approvals().get(&name).await.unwrap();
    let [good, nokey, nope] = ["good", "nokey", "nope"].map(|c| id(&a, "requested", c));
    r.wait_for("/good", 1, TIMEOUT).await;
    let a = wait_approval(&s, &name, "the problems recorded", |a| {
        delivery(a, &nokey).is_some_and(|d| d.reason.is_some())
            && delivery(a, &nope).is_some_and(|d| d.reason.is_some())
    })
    .await;
    let d = delivery(&a, &nokey).unwrap();
    assert_eq!(
        (d.reason.as_deref(), d.last_error.as_deref()),
        (
            Some("ChannelInvalid"),
            Some(
                format!(
                    "channel nokey in Secret {ns}/{SECRET_NAME}: hmacKeyRef missing: the Secret has no such key"
                )
                .as_str()
            )
        )
    );
    let d = delivery(&a, &nope).unwrap();
    assert_eq!(d.reason.as_deref(), Some("ChannelUnknown"));
    assert_eq!(
        d.last_error.as_deref(),
        Some(
            format!(
                "channel nope is not configured in Secret {ns}/{SECRET_NAME} (channels: good, nokey)"
            )
            .as_str()
        )
    );
    let c = notified(&a).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "ChannelUnknown")
    );
    // The run's author sees it on the run too.
    let events: Api<k8s_openapi::api::events::v1::Event> = s.env().api();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let list = events.list(&Default::default()).await.unwrap();
        let on_run = list.items.iter().any(|e| {
            e.reason.as_deref() == Some("ChannelUnknown")
                && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("AgentRun")
                && e.note
                    .as_deref()
                    .is_some_and(|n| n.contains("channel nope"))
        });
        if on_run {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no ChannelUnknown Event on the run"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A Secret that is not YAML: said on the approval, nothing crashes.
    put_channels(&s, &r, "channels: [unterminated", false).await;
    let a = wait_approval(&s, &name, "the unreadable Secret reported", |a| {
        notified(a).is_some_and(|c| c.reason == "ChannelsUnreadable")
    })
    .await;
    let c = notified(&a).unwrap();
    assert!(
        c.message
            .contains(&format!("channels.yaml in Secret {ns}/{SECRET_NAME}:")),
        "{}",
        c.message
    );
    // The operator runs on (its liveness endpoint answers).
    agentrun_e2e::get_ok(s.operator_config.health_port, "/healthz").await;

    // Fixed: what was held back goes out, what was delivered does not.
    put_channels(
        &s,
        &r,
        "channels:\n\
         - {name: good, url: '{R}/good'}\n\
         - {name: nokey, url: '{R}/nokey', hmacKeyRef: hmac}\n\
         - {name: nope, url: '{R}/nope'}\n",
        false,
    )
    .await;
    let signed = r.wait_for("/nokey", 1, TIMEOUT).await;
    assert_signed(&signed[0]);
    r.wait_for("/nope", 1, TIMEOUT).await;
    assert_no_more(&r, "/good", 1).await;
    let a = wait_approval(&s, &name, "everything delivered", |a| {
        [&good, &nokey, &nope]
            .iter()
            .all(|id| delivery(a, id).is_some_and(|d| d.state == DeliveryState::Delivered))
    })
    .await;
    let c = notified(&a).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "Delivered")
    );
    s.finish().await;
}
