//! The console in the cluster, both ways, against the API server:
//!
//! ```text
//!   proxy:  127.0.0.1 (trusted) + X-Forwarded-User: alice ─▶ impersonates alice
//!           127.0.0.3 (untrusted) + the same header        ─▶ 401
//!   token:  a ServiceAccount's token pasted at /login ─▶ what that token may list
//! ```
//!
//! The console runs with the chart's ServiceAccount and role for the mode (a
//! token of it in a kubeconfig of its own), so it has no right to read runs
//! itself: whatever a user sees, the API server let that user list.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentrun_e2e::support::policies::Policies;
use agentrun_e2e::support::processes::{Process, log_dir, plugin_binary};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_e2e::{TestNamespace, client, client_as, kubeconfig, kubectl_ok};
use agentrun_operator::api::{AgentRun, Approval, RunPhase};
use serde_json::{Value, json};

use super::auth::{Answer, Stream, exchange, first_event, request};
use super::{PAGE_TIMEOUT, RUN_TIMEOUT, gated, started};

/// The chart's console objects for `mode` (ServiceAccount, and the role the
/// mode needs), applied to the plane; deleted when dropped. The console
/// then runs with a token of that ServiceAccount, nothing else.
pub(super) struct ChartConsole {
    file: String,
    pub(super) user: String,
    kubeconfig: PathBuf,
}

impl ChartConsole {
    pub(super) async fn install(ns: &str, values: &[&str]) -> ChartConsole {
        let suffix = ns.rsplit('-').next().expect("namespace suffix");
        let release = format!("agentrun-operator-{suffix}");
        let mut args = vec!["--set", "console.enabled=true"];
        args.extend_from_slice(values);
        let docs = agentrun_e2e::support::chart::render(&release, ns, &args);
        let kinds = [
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
        ];
        let items: Vec<Value> = docs
            .into_iter()
            .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "console")
            .filter(|d| kinds.iter().any(|k| d["kind"] == *k))
            .collect();
        let file = agentrun_e2e::support::policies::manifest(
            &format!("console-rbac-{suffix}"),
            &json!({"apiVersion": "v1", "kind": "List", "items": items}),
        );
        kubectl_ok(["apply", "--server-side", "-f", &file]).await;
        let sa = format!("{release}-console");
        let token = kubectl_ok(["-n", ns, "create", "token", &sa]).await;
        ChartConsole {
            file,
            user: format!("system:serviceaccount:{ns}:{sa}"),
            kubeconfig: token_kubeconfig(token.trim(), log_dir(ns).join("console-sa.kubeconfig")),
        }
    }

    /// `kubectl-agentrun console` as the ServiceAccount, on 127.0.0.1, with
    /// `args`: the process and its port.
    pub(super) async fn start(&self, ns: &str, args: &[&str]) -> (Process, u16) {
        let mut cmd = tokio::process::Command::new(plugin_binary());
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["console", "--listen", "127.0.0.1"])
            .args(args);
        let (process, url) = started(ns, "sa", cmd).await;
        let port = url
            .trim_start_matches("http://127.0.0.1:")
            .trim_end_matches('/')
            .parse()
            .unwrap_or_else(|_| panic!("the console printed no port: {url}"));
        (process, port)
    }
}

impl Drop for ChartConsole {
    fn drop(&mut self) {
        let _ = std::process::Command::new(agentrun_e2e::support::kubectl::kubectl_binary())
            .arg("--kubeconfig")
            .arg(kubeconfig())
            .args(["delete", "--ignore-not-found", "-f", &self.file])
            .output();
    }
}

/// A copy of the e2e kubeconfig whose user is `token` alone.
fn token_kubeconfig(token: &str, path: PathBuf) -> PathBuf {
    let admin = std::fs::read_to_string(kubeconfig()).expect("reading the e2e kubeconfig");
    let mut config: serde_yaml::Value = serde_yaml::from_str(&admin).expect("kubeconfig YAML");
    for entry in config["users"].as_sequence_mut().expect("kubeconfig users") {
        entry["user"] = serde_yaml::to_value(json!({"token": token})).unwrap();
    }
    std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).expect("writing the kubeconfig");
    path
}

/// A run in a namespace of its own (no operator: it just sits there), which
/// only cluster-wide readers see.
async fn elsewhere(name: &str) -> TestNamespace {
    let admin = client().await;
    let other = TestNamespace::create(&admin, "console-elsewhere").await;
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": name},
        "spec": {"steps": [sim_step("fetch", "Idempotent", json!({}))]},
    }))
    .unwrap();
    kube::Api::<AgentRun>::namespaced(admin, other.name())
        .create(&Default::default(), &run)
        .await
        .expect("creating the run elsewhere");
    other
}

/// Headers a proxy sends for `user`, with the namespace cookie.
fn as_user(user: &str, ns: &str) -> String {
    format!(
        "X-Forwarded-User: {user}\r\nX-Forwarded-Groups: staff\r\nCookie: agentrun_namespace={ns}\r\n"
    )
}

/// Proxy mode, with the chart's ServiceAccount (it may only impersonate):
/// alice, named by the trusted proxy, sees her namespace's runs only, live,
/// and her decision is recorded as hers by the API server; bob sees none and
/// his decision is refused in the API server's words; the same header from
/// an untrusted peer, a `system:` name or no header at all is refused.
#[tokio::test]
async fn the_proxy_mode_console_acts_as_the_user_the_trusted_proxy_names() {
    let s = Scenario::start("console-proxy").await;
    let ns = s.namespace().to_owned();
    let _policies = Policies::with_approvers(&ns, &["alice"]).await;
    s.create_run("refund", json!({"steps": [gated("refund")]}))
        .await;
    let apv = s.approval_of("refund", None, RUN_TIMEOUT).await;
    let other = elsewhere("hidden").await;
    let chart = ChartConsole::install(
        &ns,
        &[
            "--set",
            "console.auth.mode=proxy",
            "--set",
            "console.auth.proxy.trustedCIDRs={127.0.0.1/32}",
        ],
    )
    .await;
    // The console's own identity lists nothing: what a user sees is theirs.
    let own = kube::Api::<AgentRun>::namespaced(client_as(&chart.user).await, &ns)
        .list(&Default::default())
        .await;
    assert!(
        matches!(&own, Err(kube::Error::Api(e)) if e.code == 403),
        "the console's ServiceAccount may not list runs: {own:?}"
    );
    let (_process, port) = chart
        .start(&ns, &["--auth", "proxy", "--trusted-proxy", "127.0.0.1/32"])
        .await;
    let lo = [127, 0, 0, 1];

    // Alice chooses her namespace (she may not list every one) and sees its
    // runs, not the other namespace's. RBAC takes a moment to reach the
    // authorizer's cache.
    let deadline = Instant::now() + PAGE_TIMEOUT;
    let runs = loop {
        let a = request(lo, port, "GET", "/", &as_user("alice", &ns)).await;
        if a.code == 200 && a.body.contains(r#"data-run="refund""#) {
            break a.body;
        }
        assert!(
            Instant::now() < deadline,
            "alice's runs through the proxy: HTTP {}\n{}",
            a.code,
            a.body
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        runs.contains(r#"<strong id="whoami">alice</strong>"#),
        "{runs}"
    );
    assert!(
        !runs.contains("hidden"),
        "alice sees another namespace: {runs}"
    );
    let chosen = request(
        lo,
        port,
        "GET",
        &format!("/namespace?name={ns}"),
        "X-Forwarded-User: alice\r\n",
    )
    .await;
    assert_eq!(chosen.code, 303, "{}", chosen.head);
    assert!(
        chosen.head.contains(&format!(
            "set-cookie: agentrun_namespace={ns}; httponly; samesite=strict; path=/"
        )),
        "{}",
        chosen.head
    );
    // Without a choice she sees the console's namespace, which she may not
    // list: the API server's refusal, and the namespace form.
    let unchosen = request(lo, port, "GET", "/", "X-Forwarded-User: alice\r\n").await;
    assert!(
        unchosen.code == 200
            && unchosen
                .body
                .contains("User &quot;alice&quot; cannot list resource &quot;agentruns&quot;")
            && unchosen.body.contains(r#"action="/namespace""#)
            && !unchosen.body.contains(r#"data-run="refund""#),
        "{}",
        unchosen.body
    );
    // Her inbox, live: a new run in her namespace reaches her stream.
    let inbox = request(lo, port, "GET", "/approvals", &as_user("alice", &ns)).await;
    assert!(
        inbox.code == 200 && inbox.body.contains(&apv),
        "{}",
        inbox.body
    );
    let mut live = Stream::open(port, "/events/runs", &as_user("alice", &ns)).await;
    live.until("event: runs", PAGE_TIMEOUT).await;
    s.create_run(
        "later",
        json!({"steps": [sim_step("fetch", "Idempotent", json!({}))]}),
    )
    .await;
    live.until(r#"data-run="later""#, Duration::from_secs(5))
        .await;
    assert!(!live.text.contains("hidden"), "{}", live.text);

    // Bob (no rights) sees nothing, and his decision is the API server's to refuse.
    let bob = request(lo, port, "GET", "/", &as_user("bob", &ns)).await;
    assert!(
        bob.code == 200
            && bob.body.contains(r#"<strong id="whoami">bob</strong>"#)
            && !bob.body.contains("data-run=")
            && bob
                .body
                .contains("User &quot;bob&quot; cannot list resource &quot;agentruns&quot;"),
        "{}",
        bob.body
    );
    let said = match kube::Api::<Approval>::namespaced(client_as("bob").await, &ns)
        .get(&apv)
        .await
    {
        Err(kube::Error::Api(e)) => e.message,
        other => panic!("the API server should refuse bob: {other:?}"),
    };
    let decide = format!("/ns/{ns}/approvals/{apv}/decide");
    let refused = request(
        lo,
        port,
        "POST",
        &decide,
        &format!("HX-Request: true\r\n{}", as_user("bob", &ns)),
    )
    .await;
    assert!(
        refused.code == 200
            && refused.body.contains("Refused")
            && refused
                .body
                .contains(&format!("reading approval {apv}: {said}").replace('"', "&quot;")),
        "bob's refusal, in the API server's words ({said}): {}",
        refused.body
    );

    // Not from the trusted proxy, a system: name, or no name: refused.
    for (case, from, headers) in [
        ("an untrusted peer", [127, 0, 0, 3], as_user("alice", &ns)),
        ("a system: user", lo, as_user("system:admin", &ns)),
        (
            "a system: group",
            lo,
            "X-Forwarded-User: alice\r\nX-Forwarded-Groups: system:masters\r\n".into(),
        ),
        (
            "no user header",
            lo,
            format!("Cookie: agentrun_namespace={ns}\r\n"),
        ),
        (
            "two user headers",
            lo,
            format!("X-Forwarded-User: alice\r\n{}", as_user("bob", &ns)),
        ),
    ] {
        for (method, path) in [
            ("GET", "/"),
            ("GET", "/events/runs"),
            ("POST", decide.as_str()),
        ] {
            let h = format!("HX-Request: true\r\n{headers}");
            let a = request(from, port, method, path, &h).await;
            assert_eq!(a.code, 401, "{case}: {method} {path}: {}", a.body);
        }
    }
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(a.spec.decision, None, "nobody but alice decided");

    // Alice decides; the API server records her as the decider.
    let done = request(
        lo,
        port,
        "POST",
        &decide,
        &format!("HX-Request: true\r\n{}", as_user("alice", &ns)),
    )
    .await;
    assert!(
        done.code == 200
            && done
                .body
                .contains(&format!("approval {apv}: Approved by alice")),
        "{}",
        done.body
    );
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(a.spec.decided_by.as_deref(), Some("alice"));
    let finished = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&finished), Some(RunPhase::Succeeded));
    other.cleanup(&client().await).await;
    s.finish().await;
}

/// Token mode, with the chart's ServiceAccount (no role at all): a page
/// without a session goes to the login page; a token the API server does
/// not accept is refused; a ServiceAccount's token with rights in one
/// namespace sees that namespace's runs only, as itself; signing out ends
/// the session.
#[tokio::test]
async fn the_token_mode_console_serves_each_token_what_it_may_list() {
    let s = Scenario::start("console-login").await;
    let ns = s.namespace().to_owned();
    s.create_run(
        "report",
        json!({"steps": [sim_step("fetch", "Idempotent", json!({}))]}),
    )
    .await;
    let other = elsewhere("hidden").await;
    let chart = ChartConsole::install(&ns, &["--set", "console.auth.mode=token"]).await;
    kubectl_ok(["-n", &ns, "create", "serviceaccount", "reader"]).await;
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "role",
        "reader",
        "--verb=get,list,watch",
        "--resource=agentruns.agentrun.dev,approvals.agentrun.dev",
    ])
    .await;
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "reader",
        "--role=reader",
        &format!("--serviceaccount={ns}:reader"),
    ])
    .await;
    let token = kubectl_ok(["-n", &ns, "create", "token", "reader"]).await;
    let token = token.trim();
    let (_process, port) = chart.start(&ns, &["--auth", "token"]).await;
    let lo = [127, 0, 0, 1];
    let origin = format!("Origin: http://127.0.0.1:{port}\r\n");

    // A page without a session (a notification's link, say) goes to the
    // login page, and back to that page after signing in.
    let a = request(lo, port, "GET", &format!("/ns/{ns}/runs/report"), "").await;
    assert_eq!(a.code, 303, "{}", a.head);
    let next = format!("/ns/{ns}/runs/report");
    assert!(
        a.head
            .contains(&format!("\r\nlocation: /login?next={next}\r\n")),
        "{}",
        a.head
    );
    for (method, path) in [
        ("GET", "/events/runs"),
        ("POST", "/ns/x/approvals/y/decide"),
    ] {
        let a = request(lo, port, method, path, "HX-Request: true\r\n").await;
        assert_eq!(a.code, 401, "{method} {path}: {}", a.body);
    }
    let login = request(lo, port, "GET", &format!("/login?next={next}"), "").await;
    assert!(
        login.code == 200
            && login.body.contains(r#"type="password" name="token""#)
            && login
                .body
                .contains(&format!(r#"name="next" value="{next}""#)),
        "{}",
        login.body
    );
    let bad = login_with(port, "not-a-token", &origin).await;
    assert!(
        bad.code == 401
            && bad
                .body
                .contains("The API server did not accept this token")
            && !bad.head.contains("set-cookie"),
        "{}\n{}",
        bad.head,
        bad.body
    );
    // A sign-in from another site's page (no Origin of ours) is refused.
    let forged = login_with(port, token, "Origin: http://evil.example\r\n").await;
    assert_eq!(forged.code, 403, "{}", forged.body);

    let ok = login_with(port, &format!("{token}&next={next}"), &origin).await;
    assert_eq!(ok.code, 303, "{}\n{}", ok.head, ok.body);
    assert!(
        ok.head.contains(&format!("\r\nlocation: {next}\r\n")),
        "{}",
        ok.head
    );
    let session = ok
        .head
        .split("set-cookie: agentrun_session=")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap_or_else(|| panic!("no session cookie: {}", ok.head))
        .to_owned();
    assert_eq!(session.len(), 64, "{session}");
    assert_ne!(session, token);
    assert!(
        ok.head.contains(&format!(
            "agentrun_session={session}; httponly; samesite=strict; path=/; max-age=28800"
        )),
        "{}",
        ok.head
    );
    let cookie = format!("Cookie: agentrun_session={session}\r\n");
    let reader = format!("system:serviceaccount:{ns}:reader");
    let runs = request(lo, port, "GET", "/", &cookie).await;
    assert!(
        runs.code == 200
            && runs
                .body
                .contains(&format!(r#"<strong id="whoami">{reader}</strong>"#))
            && runs.body.contains(r#"data-run="report""#)
            && !runs.body.contains("hidden")
            && runs.body.contains(r#"action="/logout""#),
        "{}",
        runs.body
    );
    let event = first_event(port, "/events/runs", &cookie).await;
    assert!(event.contains(r#"data-run="report""#), "{event}");
    // A wrong session id is no session.
    let a = request(
        lo,
        port,
        "GET",
        "/events/runs",
        &format!("Cookie: agentrun_session={}\r\n", "0".repeat(64)),
    )
    .await;
    assert_eq!(a.code, 401);

    let out = request(lo, port, "POST", "/logout", &format!("{origin}{cookie}")).await;
    assert_eq!(out.code, 303, "{}", out.head);
    assert!(
        out.head
            .contains("agentrun_session=; httponly; samesite=strict; path=/; max-age=0"),
        "{}",
        out.head
    );
    let after = request(lo, port, "GET", "/", &cookie).await;
    assert_eq!(after.code, 303, "signed out: {}", after.head);
    other.cleanup(&client().await).await;
    s.finish().await;
}

/// POST /login with `token`.
pub(super) async fn login_with(port: u16, token: &str, headers: &str) -> Answer {
    let form = format!("token={token}");
    exchange([127, 0, 0, 1], port, "POST", "/login", headers, Some(&form)).await
}
