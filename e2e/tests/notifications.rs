//! Approval notifications on the plane: a real operator (with
//! `--notify-secret` pointing at a Secret in the scenario's namespace) posts
//! to a real HTTP receiver on 127.0.0.1. Each test proves one promise of
//! docs/notifications.md: once each, signed; exactly the retries; nothing
//! lost or repeated across a crash except what the delivery id makes
//! harmless; a hung receiver cut off; internal addresses refused; a wrong
//! channel reported while the others deliver.

use std::time::Duration;

use agentrun_e2e::support::receiver::{Received, Receiver, Reply};
use agentrun_e2e::support::scenario::{Scenario, sim_step, status};
use agentrun_operator::api::{Approval, Delivery, DeliveryState, RunPhase};
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

/// The request goes to the named and the default channels, the reminder to
/// the escalation channel after its delay, the decision to the first ones:
/// each exactly once, signed, with a stable delivery id, in its format.
#[tokio::test]
async fn request_escalation_and_decision_arrive_once_each_signed() {
    let r = Receiver::start().await;
    let s = setup(
        "notify-once-each",
        &r,
        "channels:\n\
         - {name: team, url: '{R}/team', hmacKeyRef: hmac, default: true}\n\
         - {name: boss, url: '{R}/boss', format: slack}\n\
         - {name: ops, url: '{R}/ops', format: msteams, headers: {X-Team: payments}}\n",
        true,
        None,
    )
    .await;
    let ns = s.namespace().to_owned();
    let name = gated_run(
        &s,
        "refund",
        json!({
            "question": "Refund order 4711?",
            "timeout": "10m",
            "notify": ["ops"],
            "escalate": {"after": "4s", "notify": ["boss"]},
        }),
    )
    .await;
    let a = s.approvals().get(&name).await.unwrap();

    let team = r.wait_for("/team", 1, TIMEOUT).await;
    let req = &team[0];
    assert_signed(req);
    assert_eq!(
        req.header("x-agentrun-delivery"),
        Some(id(&a, "requested", "team").as_str())
    );
    assert_eq!(req.header("x-agentrun-event"), Some("requested"));
    let body = req.json();
    assert_eq!(body["kind"], "ApprovalNotification");
    assert_eq!(body["event"], "requested");
    assert_eq!(body["namespace"], ns.as_str());
    assert_eq!(body["run"]["name"], "refund");
    assert_eq!(body["step"], "refund");
    assert_eq!(body["approval"]["question"], "Refund order 4711?");
    assert_eq!(body["approval"]["phase"], "Pending");
    assert!(body["approval"]["expiresAt"].is_string(), "{body}");
    assert_eq!(
        body["commands"]["approve"],
        format!("kubectl agentrun approve refund refund -n {ns}").as_str()
    );
    assert_eq!(
        body["consoleUrl"],
        format!("https://console.example/ns/{ns}/runs/refund").as_str()
    );
    assert_eq!(
        body["whoMayDecide"],
        format!("anyone allowed to update approvals in namespace {ns}").as_str()
    );
    let ops = r.wait_for("/ops", 1, TIMEOUT).await;
    assert_eq!(ops[0].header("x-team"), Some("payments"));
    assert!(
        ops[0].header("x-agentrun-signature").is_none(),
        "a channel without a key does not sign"
    );
    let card = ops[0].json();
    assert_eq!(
        card["attachments"][0]["contentType"],
        "application/vnd.microsoft.card.adaptive"
    );
    assert!(card.to_string().contains("Approval needed: run"), "{card}");

    // The reminder comes after its delay, in Slack's format.
    let boss = r.wait_for("/boss", 1, TIMEOUT).await;
    let slack = boss[0].json();
    // Not before the approval was 4 s old (its creation time is kept to the second).
    let created = a.metadata.creation_timestamp.clone().unwrap().0;
    let due = created
        .checked_add(jiff::SignedDuration::from_secs(4))
        .unwrap();
    assert!(
        boss[0].wall >= due,
        "the reminder came at {}, before it was due at {due}",
        boss[0].wall
    );
    let mut ids = Vec::new();
    for r in team.iter().chain(&ops).chain(&boss) {
        ids.push(r.header("x-agentrun-delivery").unwrap().to_owned());
    }
    assert_eq!(
        ids[2],
        id(&a, "escalated", "boss"),
        "the reminder has its own delivery id"
    );
    assert!(
        slack["text"]
            .as_str()
            .unwrap()
            .starts_with("Still waiting for approval: run"),
        "{slack}"
    );
    assert!(slack["blocks"].is_array());

    s.decide(&name, "Approved", "checked the order").await;
    let team = r.wait_for("/team", 2, TIMEOUT).await;
    assert_signed(&team[1]);
    assert_eq!(team[1].header("x-agentrun-event"), Some("decided"));
    let decided = team[1].json();
    assert_eq!(decided["approval"]["decision"], "Approved");
    assert_eq!(decided["approval"]["comment"], "checked the order");
    r.wait_for("/ops", 2, TIMEOUT).await;
    assert_no_more(&r, "/team", 2).await;
    assert_no_more(&r, "/ops", 2).await;
    assert_no_more(&r, "/boss", 1).await;

    let a = wait_approval(&s, &name, "5 delivered notifications", |a| {
        deliveries(a).len() == 5
            && deliveries(a)
                .iter()
                .all(|d| d.state == DeliveryState::Delivered)
    })
    .await;
    for d in deliveries(&a) {
        assert_eq!(d.attempts, 1, "{d:?}");
        assert!(d.delivered_at.is_some() && d.last_error.is_none(), "{d:?}");
    }
    let c = notified(&a).expect("a Notified condition");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "Delivered")
    );
    s.wait_run("refund", "Succeeded", TIMEOUT, |r| {
        status(r).phase == Some(RunPhase::Succeeded)
    })
    .await;
    s.finish().await;
}

/// A receiver failing three times gets exactly three retries, spaced by
/// the backoff, all with the same delivery id.
#[tokio::test]
async fn a_failing_receiver_gets_exactly_the_retries() {
    let r = Receiver::start().await;
    r.script(
        "/team",
        [Reply::Status(500), Reply::Status(502), Reply::Status(429)],
    );
    let s = setup(
        "notify-retries",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n",
        true,
        None,
    )
    .await;
    let name = gated_run(&s, "refund", json!({"question": "ok?"})).await;
    let got = r.wait_for("/team", 4, TIMEOUT).await;
    assert_no_more(&r, "/team", 4).await;
    let a = s.approvals().get(&name).await.unwrap();
    let want = id(&a, "requested", "team");
    for g in &got {
        assert_eq!(g.header("x-agentrun-delivery"), Some(want.as_str()));
    }
    assert_eq!(
        got[0].body, got[3].body,
        "a retry sends the same body as the first attempt"
    );
    // Backoff 1 s, 2 s, 4 s, each ±20%.
    for (i, pair) in got.windows(2).enumerate() {
        let gap = pair[1].at.duration_since(pair[0].at).as_secs_f64();
        let exp = f64::from(1u32 << i);
        assert!(
            gap >= 0.75 * exp && gap <= 1.2 * exp + 1.5,
            "retry {} came {gap:.2} s after the previous attempt (expected about {exp} s)",
            i + 1
        );
    }
    let a = wait_state(&s, &name, &want, DeliveryState::Delivered).await;
    let d = delivery(&a, &want).unwrap();
    assert_eq!(d.attempts, 4, "{d:?}");
    assert_eq!(d.last_error, None);
    // And the operator counts them so.
    let metrics = agentrun_e2e::get_ok(s.operator_config.metrics_port, "/metrics").await;
    for line in [
        r#"agentrun_notifications_total{channel="team",outcome="retry"} 3"#,
        r#"agentrun_notifications_total{channel="team",outcome="delivered"} 1"#,
        r#"agentrun_notification_latency_seconds_count{channel="team"} 1"#,
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no {line} in:\n{metrics}"
        );
    }
    s.finish().await;
}

/// Nobody decides in time: the expiry is told to the request's channels,
/// and the request is not sent again.
#[tokio::test]
async fn an_expiry_is_told() {
    let r = Receiver::start().await;
    let s = setup(
        "notify-expiry",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n",
        true,
        None,
    )
    .await;
    let name = gated_run(
        &s,
        "refund",
        json!({"question": "ok?", "timeout": "3s", "onTimeout": "Reject"}),
    )
    .await;
    let got = r.wait_for("/team", 2, TIMEOUT).await;
    assert_eq!(got[0].header("x-agentrun-event"), Some("requested"));
    assert_eq!(got[1].header("x-agentrun-event"), Some("expired"));
    let body = got[1].json();
    assert_eq!(body["event"], "expired");
    assert_eq!(body["approval"]["phase"], "Expired");
    assert_eq!(body["approval"]["decidedBy"], "agentrun-operator");
    assert_no_more(&r, "/team", 2).await;
    let a = s.approvals().get(&name).await.unwrap();
    assert_eq!(
        delivery(&a, &id(&a, "expired", "team")).map(|d| d.state),
        Some(DeliveryState::Delivered)
    );
    s.wait_run("refund", "Failed", TIMEOUT, |r| {
        status(r).phase == Some(RunPhase::Failed)
    })
    .await;
    s.finish().await;
}

/// The operator dies right after a send, before recording it: the restarted
/// operator sends again with the same delivery id (the one repeat the
/// contract allows), and records one delivered attempt.
#[tokio::test]
async fn a_crash_between_send_and_record_repeats_it_with_the_same_id() {
    let r = Receiver::start().await;
    let mut s = setup(
        "notify-crash-send",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true, hmacKeyRef: hmac}\n",
        true,
        Some("after-notify-send:1"),
    )
    .await;
    let name = gated_run(&s, "refund", json!({"question": "ok?"})).await;
    s.wait_operator_crash(TIMEOUT).await;
    let first = r.wait_for("/team", 1, TIMEOUT).await;
    let a = s.approvals().get(&name).await.unwrap();
    assert!(
        deliveries(&a).iter().all(|d| d.attempts == 0),
        "the send was not recorded before the crash: {:?}",
        deliveries(&a)
    );
    s.start_operator(None);
    let got = r.wait_for("/team", 2, TIMEOUT).await;
    assert_no_more(&r, "/team", 2).await;
    assert_eq!(
        got[1].header("x-agentrun-delivery"),
        first[0].header("x-agentrun-delivery"),
        "the repeat carries the same delivery id"
    );
    assert_eq!(got[0].body, got[1].body);
    assert_signed(&got[1]);
    let want = id(&a, "requested", "team");
    let a = wait_state(&s, &name, &want, DeliveryState::Delivered).await;
    assert_eq!(delivery(&a, &want).unwrap().attempts, 1);
    s.finish().await;
}

/// SIGKILLed while a retry waits: the restarted operator reads the record,
/// waits out the recorded time and delivers with the same id; nothing
/// delivered is sent again.
#[tokio::test]
async fn a_killed_operator_resumes_a_pending_delivery_after_restart() {
    let r = Receiver::start().await;
    r.script("/team", [Reply::RetryAfter(503, 6)]);
    let mut s = setup(
        "notify-kill-resume",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n- {name: audit, url: '{R}/audit', default: true}\n",
        true,
        None,
    )
    .await;
    let name = gated_run(&s, "refund", json!({"question": "ok?"})).await;
    let a = s.approvals().get(&name).await.unwrap();
    let (team, audit) = (id(&a, "requested", "team"), id(&a, "requested", "audit"));
    let recorded = wait_approval(&s, &name, "attempt 1 recorded", |a| {
        delivery(a, &team).is_some_and(|d| d.attempts == 1)
            && delivery(a, &audit).is_some_and(|d| d.state == DeliveryState::Delivered)
    })
    .await;
    let d = delivery(&recorded, &team).unwrap();
    assert_eq!(d.state, DeliveryState::Pending);
    assert!(
        d.last_error.as_deref().unwrap().starts_with("HTTP 503"),
        "{d:?}"
    );
    assert!(d.next_attempt_at.is_some());
    s.kill_operator().await;
    let killed = std::time::Instant::now();
    assert_eq!(r.received("/team").len(), 1, "no retry before the kill");
    s.start_operator(None);
    let got = r.wait_for("/team", 2, TIMEOUT).await;
    assert_eq!(got[1].header("x-agentrun-delivery"), Some(team.as_str()));
    let gap = got[1].at.duration_since(got[0].at);
    assert!(
        gap >= Duration::from_secs(5),
        "the retry came {gap:?} after the first attempt; Retry-After asked for 6 s"
    );
    assert!(got[1].at > killed);
    assert_no_more(&r, "/team", 2).await;
    assert_no_more(&r, "/audit", 1).await;
    let a = wait_state(&s, &name, &team, DeliveryState::Delivered).await;
    assert_eq!(delivery(&a, &team).unwrap().attempts, 2);
    s.finish().await;
}

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

/// A run deleted as soon as it finishes (`ttlSecondsAfterFinished: 0`)
/// still has its decision told, even when the first attempt fails: the
/// notifier's finalizer keeps the Approval until the retry delivers, then
/// lets it go.
#[tokio::test]
async fn a_run_deleted_at_once_still_has_its_decision_told() {
    let r = Receiver::start().await;
    // The request, then the decision's first attempt fails.
    r.script("/team", [Reply::Status(200), Reply::Status(503)]);
    let s = setup(
        "notify-ttl-zero",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n",
        true,
        None,
    )
    .await;
    let mut step = sim_step("refund", "NonIdempotent", json!({}));
    step["approval"] = json!({"question": "ok?"});
    s.create_run(
        "refund",
        json!({"ttlSecondsAfterFinished": 0, "steps": [step]}),
    )
    .await;
    let name = s.approval_of("refund", None, TIMEOUT).await;
    r.wait_for("/team", 1, TIMEOUT).await;
    let a = wait_approval(&s, &name, "the notifier's finalizer", |a| {
        a.finalizers()
            .iter()
            .any(|f| f == "agentrun.dev/notifications")
    })
    .await;
    s.decide(&name, "Approved", "ok").await;
    // The run finishes and is deleted; the decision arrives on the retry.
    let got = r.wait_for("/team", 3, TIMEOUT).await;
    assert_eq!(got[1].header("x-agentrun-event"), Some("decided"));
    assert_eq!(got[2].header("x-agentrun-event"), Some("decided"));
    assert_eq!(
        got[2].header("x-agentrun-delivery"),
        Some(id(&a, "decided", "team").as_str())
    );
    assert_eq!(got[2].json()["approval"]["decision"], "Approved");
    // Then nothing holds the Approval or the run any more.
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let run_gone = s.runs().get_opt("refund").await.unwrap().is_none();
        let apv_gone = s.approvals().get_opt(&name).await.unwrap().is_none();
        if run_gone && apv_gone {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run gone: {run_gone}, approval gone: {apv_gone}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_no_more(&r, "/team", 3).await;
    s.finish().await;
}

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
