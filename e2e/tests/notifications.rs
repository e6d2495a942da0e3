//! Approval notifications on the plane: a real operator (with
//! `--notify-secret` pointing at a Secret in the scenario's namespace) posts
//! to a real HTTP receiver on 127.0.0.1. Each test proves one promise of
//! docs/notifications.md: once each, signed; exactly the retries; nothing
//! lost or repeated across a crash except what the delivery id makes
//! harmless; a hung receiver cut off; internal addresses refused; a wrong
//! channel reported while the others deliver.
//!
//! One file per concern, under `notifications/`: `delivery.rs` (what arrives: the request,
//! reminder and decision once each and signed, exactly the retries, the expiry, the decision
//! of a run deleted at once), `crashes.rs` (a crash between send and record, a kill while a
//! retry waits), `safety.rs` (a hung receiver cut, no redirect followed, no internal address
//! called, no URL in any status, Event or log, HTTPS verified), `channels.rs` (wrong channels
//! reported while the others deliver). The channel setup and the delivery checks they share
//! are here.

#[path = "notifications/channels.rs"]
mod channels;
#[path = "notifications/crashes.rs"]
mod crashes;
#[path = "notifications/delivery.rs"]
mod delivery;
#[path = "notifications/safety.rs"]
mod safety;

use std::time::Duration;

use agentrun_e2e::support::receiver::{Received, Receiver};
use agentrun_e2e::support::scenario::{Scenario, sim_step};
use agentrun_operator::api::{Approval, Delivery, DeliveryState};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(60);
const HMAC_KEY: &str = "receiver-shared-secret";
const SECRET_NAME: &str = "agentrun-notifications";

/// A scenario whose operator reads its channels from `channels` (YAML, with
/// `{R}` standing for the receiver's base URL) and may call 127.0.0.1 when
/// `allow_loopback`.
async fn setup(
    test: &str,
    receiver: &Receiver,
    channels: &str,
    allow_loopback: bool,
    failpoint: Option<&str>,
) -> Scenario {
    setup_with(
        test,
        receiver,
        channels,
        json!({}),
        allow_loopback,
        failpoint,
    )
    .await
}

/// The same, with more keys in the channel Secret.
async fn setup_with(
    test: &str,
    receiver: &Receiver,
    channels: &str,
    extra: Value,
    allow_loopback: bool,
    failpoint: Option<&str>,
) -> Scenario {
    let mut s = Scenario::start_without_operator(test).await;
    let ns = s.namespace().to_owned();
    put_secret(&s, receiver, channels, true, extra).await;
    let cfg = &mut s.operator_config;
    cfg.extra_env.push((
        "AGENTRUN_NOTIFY_SECRET".into(),
        format!("{ns}/{SECRET_NAME}"),
    ));
    if allow_loopback {
        cfg.extra_env
            .push(("AGENTRUN_NOTIFY_ALLOW_CIDR".into(), "127.0.0.1/32".into()));
    }
    cfg.extra_env.push((
        "AGENTRUN_CONSOLE_URL".into(),
        "https://console.example".into(),
    ));
    s.start_operator(failpoint);
    s
}

/// Creates or replaces the channel Secret.
async fn put_channels(s: &Scenario, receiver: &Receiver, channels: &str, create: bool) {
    put_secret(s, receiver, channels, create, json!({})).await
}

/// The same, with more keys.
async fn put_secret(s: &Scenario, receiver: &Receiver, channels: &str, create: bool, extra: Value) {
    let file = channels.replace("{R}", &receiver.url(""));
    let mut data = json!({"channels.yaml": file, "hmac": HMAC_KEY});
    if let (Some(d), Some(e)) = (data.as_object_mut(), extra.as_object()) {
        d.extend(e.clone());
    }
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET_NAME},
        "stringData": data,
    }))
    .unwrap();
    let api: Api<Secret> = s.env().api();
    if create {
        api.create(&PostParams::default(), &secret)
            .await
            .expect("creating the channel Secret");
    } else {
        api.patch(
            SECRET_NAME,
            &PatchParams::apply("notifications-test").force(),
            &Patch::Apply(&secret),
        )
        .await
        .expect("replacing the channel Secret");
    }
}

/// A run of one gated step; returns the Approval's name once it exists.
async fn gated_run(s: &Scenario, run: &str, approval: Value) -> String {
    let mut step = sim_step("refund", "NonIdempotent", json!({}));
    step["approval"] = approval;
    s.create_run(run, json!({"steps": [step]})).await;
    s.approval_of(run, None, TIMEOUT).await
}

/// Waits until the Approval satisfies `check`.
async fn wait_approval(
    s: &Scenario,
    name: &str,
    what: &str,
    check: impl Fn(&Approval) -> bool,
) -> Approval {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let a = s.approvals().get(name).await.expect("reading the approval");
        if check(&a) {
            return a;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "timed out waiting for approval {name} to have {what}; status:\n{}",
                serde_json::to_string_pretty(&a.status).unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until delivery `id` of approval `name` is in `state`.
async fn wait_state(s: &Scenario, name: &str, id: &str, state: DeliveryState) -> Approval {
    wait_approval(s, name, &format!("delivery {id} {state:?}"), |a| {
        delivery(a, id).is_some_and(|d| d.state == state)
    })
    .await
}

fn deliveries(a: &Approval) -> Vec<Delivery> {
    a.status
        .as_ref()
        .map(|s| s.notifications.clone())
        .unwrap_or_default()
}

fn delivery(a: &Approval, id: &str) -> Option<Delivery> {
    deliveries(a).into_iter().find(|d| d.id == id)
}

fn notified(a: &Approval) -> Option<Condition> {
    a.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Notified")
        .cloned()
}

fn id(a: &Approval, event: &str, channel: &str) -> String {
    format!("{}.{event}.{channel}", a.uid().unwrap())
}

/// HMAC-SHA256 of `<timestamp>.<body>` under the shared key, computed by
/// openssl: an implementation that is not the operator's.
fn openssl_signature(ts: i64, body: &[u8]) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("openssl")
        .args(["dgst", "-sha256", "-hmac", HMAC_KEY])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("running openssl (the notification tests need it)");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(format!("{ts}.").as_bytes()).unwrap();
    stdin.write_all(body).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl dgst failed");
    let text = String::from_utf8(out.stdout).unwrap();
    let hex = text.trim().rsplit(' ').next().unwrap().to_owned();
    assert_eq!(hex.len(), 64, "openssl said {text:?}");
    format!("sha256={hex}")
}

/// The signature header matches the body and timestamp under the shared key.
fn assert_signed(r: &Received) {
    let ts: i64 = r
        .header("x-agentrun-timestamp")
        .expect("a timestamp header")
        .parse()
        .expect("unix seconds");
    let now = jiff::Timestamp::now().as_second();
    assert!((now - ts).abs() < 120, "timestamp {ts} is not recent");
    assert_eq!(
        r.header("x-agentrun-signature"),
        Some(openssl_signature(ts, &r.body).as_str()),
        "the signature is HMAC-SHA256 of <timestamp>.<body>"
    );
}

/// Lets any repeat arrive, then checks nothing more came.
async fn assert_no_more(r: &Receiver, path: &str, n: usize) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = r.received(path);
    assert_eq!(
        got.len(),
        n,
        "{path} got {} requests, expected exactly {n}: {:?}",
        got.len(),
        got.iter()
            .map(|g| g.header("x-agentrun-delivery"))
            .collect::<Vec<_>>()
    );
}
