//! What the operator tells people beyond a run's status, checked with the
//! tools that will read it: the chart's alerts with `promtool` (rules and
//! their unit tests in `e2e/alerts/`), the Grafana dashboard (the chart's
//! copy is the one in docs/), and the Argo CD health checks in
//! `docs/gitops/` with a Lua interpreter against status objects the engine
//! wrote (`docs/gitops/testdata/`).
//!
//! Needs `e2e/cluster tools promtool lua` (`make test` runs them); a missing
//! tool fails the test, it never skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use agentrun_e2e::support::chart::{CHART, documents, helm_binary, ok};
use agentrun_e2e::support::env::repo_root;
use serde_json::Value;

/// `$AGENTRUN_PROMTOOL` (set by `e2e/cluster env`), else `promtool` on PATH.
fn promtool_binary() -> PathBuf {
    std::env::var_os("AGENTRUN_PROMTOOL")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("promtool"))
}

/// The chart rendered as release `r` in `ops`. Not `support::chart::render`:
/// that one passes the plane's kubeconfig, and these tests need no plane.
fn render(args: &[&str]) -> Vec<Value> {
    documents(&ok(Command::new(helm_binary())
        .current_dir(repo_root())
        .args(["template", "r", CHART, "--namespace", "ops"])
        .args(args)))
}

fn scratch(name: &str) -> PathBuf {
    let dir = repo_root()
        .join("target/observability-tests")
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating a scratch directory");
    dir
}

// ---------------------------------------------------------------------------
// Alerts

#[test]
fn chart_alerts_pass_promtool_and_their_unit_tests() {
    let docs = render(&["--set", "prometheusRule.enabled=true"]);
    let rules: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "PrometheusRule")
        .collect();
    assert_eq!(rules.len(), 1, "one PrometheusRule when enabled");
    let spec = &rules[0]["spec"];
    let alerts: Vec<&str> = spec["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert_eq!(
        alerts,
        [
            "AgentRunApprovalExpiringSoon",
            "AgentRunNoProgress",
            "AgentRunStalled",
            "AgentRunReconcileErrorsHigh",
            "AgentRunOperatorNoLeader",
            "AgentRunStatusWritesFailing",
        ]
    );
    // Every alert has its runbook section in docs/operations.md.
    let operations = std::fs::read_to_string(repo_root().join("docs/operations.md")).unwrap();
    for alert in &alerts {
        assert!(
            operations.contains(&format!("\n### {alert}\n")),
            "docs/operations.md has no runbook section for {alert}"
        );
    }
    let dir = scratch("alerts");
    std::fs::write(dir.join("rules.yaml"), serde_yaml::to_string(spec).unwrap()).unwrap();
    std::fs::copy(
        repo_root().join("e2e/alerts/agentrun-operator.test.yaml"),
        dir.join("agentrun-operator.test.yaml"),
    )
    .unwrap();
    let checked = ok(Command::new(promtool_binary()).current_dir(&dir).args([
        "check",
        "rules",
        "rules.yaml",
    ]));
    assert!(checked.contains("SUCCESS: 6 rules found"), "{checked}");
    ok(Command::new(promtool_binary()).current_dir(&dir).args([
        "test",
        "rules",
        "agentrun-operator.test.yaml",
    ]));
    let _ = std::fs::remove_dir_all(&dir);

    // Off by default, like the dashboard.
    let default = render(&[]);
    assert!(
        !default.iter().any(|d| d["kind"] == "PrometheusRule"
            || d["metadata"]["name"] == "r-agentrun-operator-dashboard"),
        "the PrometheusRule and the dashboard are opt-in"
    );
}

/// The unit tests above can fail: a rule that never fires is caught.
#[test]
fn promtool_unit_tests_catch_a_broken_alert() {
    let docs = render(&["--set", "prometheusRule.enabled=true"]);
    let mut spec = docs.iter().find(|d| d["kind"] == "PrometheusRule").unwrap()["spec"].clone();
    // Break one: the stuck-run alert now looks for runs stuck a week.
    for rule in spec["groups"][0]["rules"].as_array_mut().unwrap() {
        if rule["alert"] == "AgentRunNoProgress" {
            rule["expr"] =
                Value::from("max by (namespace) (agentrun_run_progress_age_seconds_max) > 604800");
        }
    }
    let dir = scratch("broken-alerts");
    std::fs::write(
        dir.join("rules.yaml"),
        serde_yaml::to_string(&spec).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        repo_root().join("e2e/alerts/agentrun-operator.test.yaml"),
        dir.join("agentrun-operator.test.yaml"),
    )
    .unwrap();
    let out = Command::new(promtool_binary())
        .current_dir(&dir)
        .args(["test", "rules", "agentrun-operator.test.yaml"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run promtool: {e} (run `e2e/cluster promtool`)"));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success(), "promtool passed a broken alert");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("AgentRunNoProgress")
            || String::from_utf8_lossy(&out.stderr).contains("AgentRunNoProgress"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

// ---------------------------------------------------------------------------
// Dashboard

#[test]
fn dashboard_in_the_chart_is_the_one_in_docs_and_uses_exported_metrics() {
    let root = repo_root();
    let docs_copy =
        std::fs::read_to_string(root.join("docs/dashboards/agentrun-operator.json")).unwrap();
    let chart_copy = std::fs::read_to_string(
        root.join("charts/agentrun-operator/dashboards/agentrun-operator.json"),
    )
    .unwrap();
    assert!(
        docs_copy == chart_copy,
        "docs/dashboards/agentrun-operator.json and the chart's copy differ: copy one onto the other"
    );
    let dashboard: Value = serde_json::from_str(&docs_copy).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "agentrun-operator");
    // Every metric a panel queries is one the operator documents (and so exports).
    let operations = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let mut queried = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(i) = rest.find("agentrun_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                let base = ["_bucket", "_count", "_sum"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(&name)
                    .to_owned();
                queried.insert(base);
            }
        }
    }
    assert!(queried.len() >= 15, "{queried:?}");
    for metric in &queried {
        assert!(
            operations.contains(&format!("| `{metric}`")),
            "the dashboard queries {metric}, which docs/operations.md does not list"
        );
    }
    // The chart ships it as a sidecar ConfigMap when asked.
    let docs = render(&["--set", "grafanaDashboard.enabled=true"]);
    let cm = docs
        .iter()
        .find(|d| {
            d["kind"] == "ConfigMap" && d["metadata"]["name"] == "r-agentrun-operator-dashboard"
        })
        .expect("the dashboard ConfigMap");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped: Value =
        serde_json::from_str(cm["data"]["agentrun-operator.json"].as_str().unwrap()).unwrap();
    assert_eq!(shipped, dashboard);
}

// ---------------------------------------------------------------------------
// GitOps health

fn lua_literal(v: &Value) -> String {
    match v {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("{s:?}").replace("\\u{", "\\u{"),
        Value::Array(items) => format!(
            "{{{}}}",
            items.iter().map(lua_literal).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("[{k:?}] = {}", lua_literal(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Runs an Argo CD health script on `obj` the way Argo CD does (the object
/// as global `obj`, the chunk returns `{status, message}`).
fn health(script: &Path, obj: &Value) -> (String, String) {
    let driver = format!(
        "obj = {}\nlocal hs = assert(loadfile({:?}))()\nio.write(hs.status, \"\\n\", hs.message or \"\")\n",
        lua_literal(obj),
        script.display().to_string()
    );
    let out = ok(Command::new("lua5.4").args(["-e", &driver]));
    let (status, message) = out.split_once('\n').unwrap_or((&out, ""));
    (status.to_owned(), message.to_owned())
}

fn fixture(name: &str) -> Value {
    let path = repo_root().join("docs/gitops/testdata").join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

#[test]
fn argo_cd_health_of_runs_and_approvals_from_real_status() {
    let dir = repo_root().join("docs/gitops/argocd/agentrun.dev");
    let run = dir.join("AgentRun/health.lua");
    let approval = dir.join("Approval/health.lua");
    let cases = [
        (
            &run,
            "agentrun-running.json",
            "Progressing",
            "Running, 0/2 steps done",
        ),
        (
            &run,
            "agentrun-spec-changed.json",
            "Progressing",
            "observe generation 2",
        ),
        (
            &run,
            "agentrun-succeeded.json",
            "Healthy",
            "2 steps succeeded",
        ),
        (
            &run,
            "agentrun-failed.json",
            "Degraded",
            "Failed (StepFailed)",
        ),
        (&run, "agentrun-stalled.json", "Degraded", "exceeded quota"),
        (
            &run,
            "agentrun-already-ran.json",
            "Healthy",
            "already ran: Succeeded",
        ),
        (
            &run,
            "agentrun-waiting-for-approval.json",
            "Suspended",
            "waits for Approval",
        ),
        (&run, "agentrun-suspended.json", "Suspended", "spec.suspend"),
        (
            &approval,
            "approval-pending.json",
            "Suspended",
            "run deploy?",
        ),
        (
            &approval,
            "approval-approved.json",
            "Healthy",
            "Approved by kubectl-patch",
        ),
        (
            &approval,
            "approval-rejected.json",
            "Degraded",
            "Rejected by kubectl-patch",
        ),
        (&approval, "approval-expired.json", "Degraded", "Expired"),
    ];
    let mut wrong = Vec::new();
    for (script, file, status, message) in cases {
        let (got, said) = health(script, &fixture(file));
        if got != status || !said.contains(message) {
            wrong.push(format!(
                "{file}: got {got} {said:?}, want {status} containing {message:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // No status at all: the operator has not seen the run yet.
    let (got, _) = health(
        &run,
        &serde_json::json!({"metadata": {"generation": 1}, "spec": {}}),
    );
    assert_eq!(got, "Progressing");
}

/// kstatus (Flux health checks, `kubectl wait`): the status says which
/// generation it is about, and every condition carries it too.
#[test]
fn run_status_is_kstatus_compatible() {
    for file in [
        "agentrun-running.json",
        "agentrun-succeeded.json",
        "agentrun-failed.json",
        "agentrun-stalled.json",
        "agentrun-waiting-for-approval.json",
        "agentrun-already-ran.json",
    ] {
        let run = fixture(file);
        let generation = &run["metadata"]["generation"];
        assert_eq!(&run["status"]["observedGeneration"], generation, "{file}");
        let conditions = run["status"]["conditions"].as_array().unwrap();
        for c in conditions {
            assert_eq!(&c["observedGeneration"], generation, "{file}: {c}");
            assert!(["True", "False", "Unknown"].contains(&c["status"].as_str().unwrap()));
        }
        let ready = conditions
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap_or_else(|| panic!("{file}: no Ready condition"));
        // A run created again that already ran is done as intended: Ready,
        // so a Flux Kustomization settles instead of waiting on it.
        let want = if file == "agentrun-succeeded.json" || file == "agentrun-already-ran.json" {
            "True"
        } else {
            "False"
        };
        assert_eq!(ready["status"], want, "{file}: {ready}");
        // kstatus reads Stalled=True as Failed and Reconciling=True as in progress.
        let is = |t: &str| {
            conditions
                .iter()
                .any(|c| c["type"] == t && c["status"] == "True")
        };
        assert_eq!(is("Stalled"), file == "agentrun-stalled.json", "{file}");
        assert_eq!(
            is("Reconciling"),
            file == "agentrun-running.json" || file == "agentrun-waiting-for-approval.json",
            "{file}"
        );
    }
}
