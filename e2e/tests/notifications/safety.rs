//! What the operator will not do for a receiver: wait on one that hangs, follow a
//! redirect, call an internal address, show a channel's URL, or trust a certificate
//! outside the channel's roots.

use std::time::Duration;

use agentrun_e2e::support::receiver::{Receiver, Reply};
use agentrun_operator::api::DeliveryState;
use kube::Api;
use serde_json::json;

use super::{
    SECRET_NAME, TIMEOUT, assert_no_more, delivery, gated_run, id, notified, setup, setup_with,
    wait_approval, wait_state,
};

/// A receiver that never answers is cut by the channel's timeout and
/// given up after its attempts; a redirect is not followed.
#[tokio::test]
async fn a_hanging_receiver_is_cut_and_a_redirect_not_followed() {
    let r = Receiver::start().await;
    r.script("/slow", [Reply::Hang, Reply::Hang]);
    r.script(
        "/moved",
        [Reply::Redirect(
            "http://169.254.169.254/latest/meta-data/".into(),
        )],
    );
    let s = setup(
        "notify-hang",
        &r,
        "channels:\n\
         - {name: slow, url: '{R}/slow', timeout: 1s, maxAttempts: 2}\n\
         - {name: moved, url: '{R}/moved'}\n",
        true,
        None,
    )
    .await;
    let name = gated_run(
        &s,
        "refund",
        json!({"question": "ok?", "notify": ["slow", "moved"]}),
    )
    .await;
    let a = s.approvals().get(&name).await.unwrap();
    let (slow, moved) = (id(&a, "requested", "slow"), id(&a, "requested", "moved"));
    let a = wait_approval(&s, &name, "both deliveries given up", |a| {
        [&slow, &moved]
            .iter()
            .all(|id| delivery(a, id).is_some_and(|d| d.state == DeliveryState::Failed))
    })
    .await;
    let d = delivery(&a, &slow).unwrap();
    assert_eq!(d.attempts, 2);
    assert_eq!(d.reason.as_deref(), Some("GaveUp"));
    assert_eq!(
        d.last_error.as_deref(),
        Some("gave up after 2 attempts: no answer from 127.0.0.1 within 1s")
    );
    assert_eq!(r.received("/slow").len(), 2);
    let d = delivery(&a, &moved).unwrap();
    assert_eq!(d.reason.as_deref(), Some("ReceiverRefused"));
    let err = d.last_error.unwrap();
    assert!(
        err.starts_with(
            "HTTP 302 redirect to http://169.254.169.254 not followed (and the target is refused: address 169.254.169.254 is link-local"
        ),
        "{err}"
    );
    assert_no_more(&r, "/moved", 1).await;
    let c = notified(&a).unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "GaveUp"));
    s.finish().await;
}

/// Without --notify-allow-cidr the operator calls no internal address:
/// loopback (by address, by name and in every IPv6 form that reaches it)
/// and the cloud metadata address are refused, each with the reason on the
/// Approval, and nothing arrives.
#[tokio::test]
async fn internal_addresses_are_refused_without_the_allow_flag() {
    let r = Receiver::start().await;
    let port = r.addr.port();
    // Plain http is exempt only for loopback hosts (::ffff:127.0.0.1 is one, ::127.0.0.1
    // is not), so the others opt in: each must then be refused by the address guard.
    // Paths look like webhook secrets: a channel's path is redacted from every message,
    // so a path that is an ordinary word ("compat") would blank that word out.
    let s = setup(
        "notify-guard",
        &r,
        &format!(
            "channels:\n\
             - {{name: local, url: '{{R}}/local'}}\n\
             - {{name: named, url: 'http://localhost:{port}/named'}}\n\
             - {{name: metadata, url: 'http://169.254.169.254/latest/meta-data/', allowHttp: true}}\n\
             - {{name: compat, url: 'http://[::127.0.0.1]:{port}/hook/v4c-7f3a9c', allowHttp: true}}\n\
             - {{name: mapped, url: 'http://[::ffff:127.0.0.1]:{port}/hook/map-7f3a9c'}}\n\
             - {{name: nat64, url: 'http://[64:ff9b::127.0.0.1]:{port}/hook/n64-7f3a9c', allowHttp: true}}\n\
             - {{name: sixtofour, url: 'http://[2002:7f00:1::1]:{port}/hook/s2f-7f3a9c', allowHttp: true}}\n\
             - {{name: teredo, url: 'http://[2001:0:4136:e378:8000:63bf:80ff:fffe]:{port}/hook/trd-7f3a9c', allowHttp: true}}\n"
        ),
        false,
        None,
    )
    .await;
    const CHANNELS: [&str; 8] = [
        "local",
        "named",
        "metadata",
        "compat",
        "mapped",
        "nat64",
        "sixtofour",
        "teredo",
    ];
    let name = gated_run(&s, "refund", json!({"question": "ok?", "notify": CHANNELS})).await;
    let a = s.approvals().get(&name).await.unwrap();
    let ids = CHANNELS.map(|c| id(&a, "requested", c));
    let a = wait_approval(&s, &name, "eight refusals", |a| {
        ids.iter().all(|id| {
            delivery(a, id).is_some_and(|d| d.reason.as_deref() == Some("AddressRefused"))
        })
    })
    .await;
    let err = |i: usize| delivery(&a, &ids[i]).unwrap().last_error.unwrap();
    assert_eq!(
        err(0),
        "address 127.0.0.1 is loopback; the operator does not call it unless --notify-allow-cidr allows it"
    );
    assert!(
        err(1).starts_with("localhost: address ") && err(1).contains("is loopback"),
        "{}",
        err(1)
    );
    assert!(
        err(2).starts_with("address 169.254.169.254 is link-local"),
        "{}",
        err(2)
    );
    for (i, want) in [
        (3, "address ::7f00:1 is IPv4-compatible (::/96, deprecated)"),
        (4, "address ::ffff:127.0.0.1 is loopback (IPv4 127.0.0.1)"),
        (5, "address 64:ff9b::7f00:1 is loopback (IPv4 127.0.0.1)"),
        (6, "address 2002:7f00:1::1 is 6to4 (2002::/16)"),
        (
            7,
            "address 2001:0:4136:e378:8000:63bf:80ff:fffe is Teredo (2001::/32)",
        ),
    ] {
        assert!(err(i).starts_with(want), "{}: {}", CHANNELS[i], err(i));
    }
    for id in &ids {
        let d = delivery(&a, id).unwrap();
        assert_eq!((d.state, d.attempts), (DeliveryState::Failed, 1), "{d:?}");
    }
    let c = notified(&a).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "AddressRefused")
    );
    assert!(
        c.message.contains("(7 more not delivered)"),
        "{}",
        c.message
    );
    assert!(r.all().is_empty(), "nothing reached the receiver");
    s.finish().await;
}

/// A webhook URL is a credential: with a secret path and query, refused
/// by its receiver, unreachable, and redirected, it appears in no status,
/// Event or log line of the operator; the messages name the channel.
#[tokio::test]
async fn a_channels_url_appears_in_no_status_event_or_log() {
    const SECRET: &str = "T0AB12/B0CD34/zQx9-webhook-secret";
    let r = Receiver::start().await;
    r.script(
        "/services/refused/T0AB12/B0CD34/zQx9-webhook-secret",
        [Reply::Status(403)],
    );
    r.script(
        "/services/moved/T0AB12/B0CD34/zQx9-webhook-secret",
        [Reply::Redirect(format!(
            "https://hooks.example/services/{SECRET}-2"
        ))],
    );
    let closed = agentrun_e2e::support::processes::free_port();
    let s = setup(
        "notify-secret-url",
        &r,
        &format!(
            "channels:\n\
             - {{name: refused, url: '{{R}}/services/refused/{SECRET}?token=zQx9-query'}}\n\
             - {{name: moved, url: '{{R}}/services/moved/{SECRET}'}}\n\
             - {{name: down, url: 'http://127.0.0.1:{closed}/services/{SECRET}', maxAttempts: 1}}\n\
             - {{name: typo, url: 'htps://hooks.example/services/{SECRET}'}}\n"
        ),
        true,
        None,
    )
    .await;
    let ns = s.namespace().to_owned();
    const CHANNELS: [&str; 4] = ["refused", "moved", "down", "typo"];
    let name = gated_run(&s, "refund", json!({"question": "ok?", "notify": CHANNELS})).await;
    let a = s.approvals().get(&name).await.unwrap();
    let ids = CHANNELS.map(|c| id(&a, "requested", c));
    let a = wait_approval(&s, &name, "every channel's problem recorded", |a| {
        ids.iter()
            .all(|id| delivery(a, id).is_some_and(|d| d.last_error.is_some()))
    })
    .await;
    let status = serde_json::to_string(&a.status).unwrap();
    assert!(
        !status.contains("zQx9"),
        "the URL is in the status: {status}"
    );
    let d = |i: usize| delivery(&a, &ids[i]).unwrap();
    assert_eq!(
        d(0).last_error.as_deref(),
        Some("HTTP 403: receiver says 403")
    );
    assert!(
        d(1).last_error.as_deref().is_some_and(
            |e| e.starts_with("HTTP 302 redirect to https://hooks.example not followed")
        ),
        "{:?}",
        d(1)
    );
    assert!(
        d(2).last_error
            .as_deref()
            .is_some_and(|e| e.contains("127.0.0.1: error sending request")),
        "{:?}",
        d(2)
    );
    assert_eq!(
        d(3).last_error.as_deref(),
        Some(format!("channel typo in Secret {ns}/{SECRET_NAME}: url: the scheme must be https (or http), not htps").as_str())
    );
    // Events on the approval and the run, and the operator's log.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let events: Api<k8s_openapi::api::events::v1::Event> = s.env().api();
    let list = events.list(&Default::default()).await.unwrap();
    let notes: Vec<String> = list.items.iter().filter_map(|e| e.note.clone()).collect();
    assert!(
        notes.iter().any(|n| n.contains("to channel refused")),
        "the Events name the channel: {notes:#?}"
    );
    for n in &notes {
        assert!(!n.contains("zQx9"), "the URL is in an Event: {n}");
    }
    let log = std::fs::read_to_string(s.operator_log()).expect("reading the operator's log");
    assert!(log.contains("channel refused"), "the log names the channel");
    assert!(!log.contains("zQx9"), "the URL is in the operator's log");
    s.finish().await;
}

/// HTTPS is verified: a receiver whose certificate comes from a private CA
/// is reached with that CA (`caRef`) and refused without it.
#[tokio::test]
async fn https_is_verified_against_the_channels_roots() {
    let dir = agentrun_e2e::support::processes::log_dir("notify-tls-pki");
    let (r, ca) = Receiver::start_tls(&dir).await;
    let s = setup_with(
        "notify-tls",
        &r,
        "channels:\n\
         - {name: private, url: '{R}/private', caRef: ca.pem}\n\
         - {name: system, url: '{R}/system', maxAttempts: 1}\n",
        json!({"ca.pem": ca}),
        true,
        None,
    )
    .await;
    let name = gated_run(
        &s,
        "refund",
        json!({"question": "ok?", "notify": ["private", "system"]}),
    )
    .await;
    let got = r.wait_for("/private", 1, TIMEOUT).await;
    assert_eq!(got[0].header("x-agentrun-event"), Some("requested"));
    let a = s.approvals().get(&name).await.unwrap();
    let system = id(&a, "requested", "system");
    let a = wait_state(&s, &name, &system, DeliveryState::Failed).await;
    let err = delivery(&a, &system).unwrap().last_error.unwrap();
    assert!(
        err.contains("certificate") && err.contains("UnknownIssuer"),
        "{err}"
    );
    assert!(
        r.received("/system").is_empty(),
        "no request got past the handshake"
    );
    s.finish().await;
}
