//! `kubectl agentrun signal RUN STEP --data JSON [--id ID]`: sends the event
//! a wait step waits on, as the current user.
//!
//! ```text
//!   run status.steps[STEP].signal ─┐ (else labels agentrun.dev/run, agentrun.dev/step)
//!                                  ▼
//!   merge patch spec {id, data, sentBy} ──▶ Signal ──▶ API server: CEL keeps id and data final,
//!                                                      the chart's policies check sentBy
//! ```
//!
//! The API server is the judge: a repeat with the same id and data is
//! admitted and changes nothing, another id is refused with its own message.
//! The plugin checks locally only what it can say better (the data is not a
//! JSON object, the step does not wait for a signal) before any request.

use std::io::Read;

use agentrun_api::labels;
use agentrun_api::{AgentRun, Signal, StepRole};
use clap::Args;
use jiff::Timestamp;
use kube::api::{ListParams, Patch};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use crate::client::{Error, api, patch_params, whoami};
use crate::render;

#[derive(Args, Debug, Clone)]
pub struct SignalArgs {
    pub run: String,
    /// The wait step whose signal this is.
    pub step: String,
    /// The event's data, a JSON object: inline, `@file.json`, or `-` for stdin.
    /// It becomes the step's result.
    #[arg(long)]
    pub data: String,
    /// Your id of the event (a payment id, a CI run id); by default a fresh
    /// one. Sending again with the same id and data changes nothing.
    #[arg(long)]
    pub id: Option<String>,
}

/// Sends the signal step `args.step` of run `args.run` waits on.
pub async fn signal(client: &Client, ns: &str, args: &SignalArgs) -> Result<(), Error> {
    let (run, step) = (args.run.as_str(), args.step.as_str());
    let data = read_data(&args.data)
        .and_then(|text| parse_data(&text))
        .map_err(|why| Error::Invalid(format!("run {run}, step {step}: --data {why}")))?;
    let id = match &args.id {
        Some(id) => {
            check_id(id).map_err(|why| Error::Invalid(format!("--id {id:?}: {why}")))?;
            id.clone()
        }
        None => fresh_id(Timestamp::now()),
    };
    let r = Api::<AgentRun>::namespaced(client.clone(), ns)
        .get_opt(run)
        .await
        .map_err(api(format!("reading AgentRun {run}")))?
        .ok_or_else(|| {
            Error::Refused(format!(
                "AgentRun {run} not found in namespace {ns}; list them with kubectl agentrun list"
            ))
        })?;
    let name = match signal_name(&r, step) {
        Some(n) => n,
        None => by_labels(client, ns, &r, step)
            .await?
            .ok_or_else(|| Error::Refused(not_waiting(&r, step)))?,
    };
    let sig = Api::<Signal>::namespaced(client.clone(), ns)
        .get_opt(&name)
        .await
        .map_err(api(format!(
            "reading Signal {name} (run {run}, step {step})"
        )))?
        .ok_or_else(|| {
            Error::Refused(format!(
                "run {run}, step {step}: Signal {name} is not there yet (the operator opens it \
                 as the step starts; try again in a moment) or no longer (the run is gone)"
            ))
        })?;
    let mut spec = json!({"id": id, "data": data});
    if sig.spec.id.is_none() {
        // Who sends, as the API server says the user is: the chart's
        // validating policy requires it where its mutating policy does not
        // stamp it. A repeat leaves the recorded sender alone.
        spec["sentBy"] = json!(whoami(client).await?.user);
    }
    Api::<Signal>::namespaced(client.clone(), ns)
        .patch(
            &name,
            &patch_params(),
            &Patch::Merge(&json!({"spec": spec})),
        )
        .await
        .map_err(api(format!(
            "sending signal {name} (run {run}, step {step})"
        )))?;
    if sig.spec.id.as_deref() == Some(id.as_str()) {
        println!("signal {name} was already received with id {id}; nothing changed");
    } else {
        println!("signal {name} sent (id {id})");
    }
    Ok(())
}

/// The text of `--data`: inline, `@path`, or `-` for stdin.
fn read_data(arg: &str) -> Result<String, String> {
    if arg == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("from stdin: {e}"))?;
        return Ok(text);
    }
    match arg.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("from {path}: {e}")),
        None => Ok(arg.to_owned()),
    }
}

/// The data, which must be a JSON object (it becomes the step's result).
pub fn parse_data(text: &str) -> Result<Value, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(other) => Err(format!(
            "must be a JSON object, like '{{\"amount\": 12}}'; got {}",
            kind(&other)
        )),
        Err(e) => Err(format!("is not JSON: {e}")),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The Signal's own rule for `spec.id`, said before anything is sent.
pub fn check_id(id: &str) -> Result<(), String> {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let inner = |c: char| c.is_ascii_alphanumeric() || "-_.:/".contains(c);
    if id.is_empty() || id.len() > 253 {
        return Err("an id has 1 to 253 characters".into());
    }
    if !edge(id.chars().next()) || !edge(id.chars().last()) || !id.chars().all(inner) {
        return Err(
            "an id is letters, digits and - _ . : /, and begins and ends with a letter or digit"
                .into(),
        );
    }
    Ok(())
}

/// A fresh id: the time to the second and 32 random bits, e.g.
/// `20261204T061200Z-3fa9c2d1`.
pub fn fresh_id(now: Timestamp) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_i128(now.as_nanosecond());
    h.write_u32(std::process::id());
    format!(
        "{}-{:08x}",
        now.strftime("%Y%m%dT%H%M%SZ"),
        h.finish() as u32
    )
}

/// The Signal step `step` waits (or waited) on at the run's latest plan
/// revision, from the run's status.
pub fn signal_name(run: &AgentRun, step: &str) -> Option<String> {
    let status = run.status.as_ref()?;
    status
        .steps
        .iter()
        .filter(|c| c.name == step && c.role == StepRole::Step && c.signal.is_some())
        .max_by_key(|c| c.plan_revision)
        .and_then(|c| c.signal.clone())
}

/// The newest Signal of this run (by UID) for `step`, by its labels: for a
/// status that does not name it.
async fn by_labels(
    client: &Client,
    ns: &str,
    run: &AgentRun,
    step: &str,
) -> Result<Option<String>, Error> {
    let selector = format!("{}={},{}={step}", labels::RUN, run.name_any(), labels::STEP);
    let uid = run.metadata.uid.clone().unwrap_or_default();
    let found = Api::<Signal>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(api(format!(
            "listing the Signals of run {}, step {step}",
            run.name_any()
        )))?
        .items
        .into_iter()
        .filter(|s| s.spec.run_uid == uid)
        .max_by_key(|s| s.spec.plan_revision)
        .map(|s| s.name_any());
    Ok(found)
}

/// Why there is no signal to send for `step`: what the step does instead.
pub fn not_waiting(run: &AgentRun, step: &str) -> String {
    let name = run.name_any();
    let status = run.status.clone().unwrap_or_default();
    let steps: Vec<String> = match status.plan.as_ref() {
        Some(p) if !p.step_names.is_empty() => p.step_names.clone(),
        _ => run.spec.steps.iter().map(|s| s.name.clone()).collect(),
    };
    if !steps.iter().any(|s| s == step) {
        return format!(
            "run {name} has no step {step}; its steps: {}",
            steps.join(", ")
        );
    }
    let cp = status
        .steps
        .iter()
        .filter(|c| c.name == step && c.role == StepRole::Step)
        .max_by_key(|c| c.plan_revision);
    if !render::waits_for_signal(run, step) {
        let doing = cp
            .map(|c| format!(" (it is {:?})", c.phase))
            .unwrap_or_default();
        return format!("run {name}, step {step}: the step does not wait for a signal{doing}");
    }
    let phase = status
        .phase
        .map(|p| format!("{p:?}"))
        .unwrap_or_else(|| "Pending".into());
    match cp.map(|c| c.phase) {
        Some(p) => format!("run {name}, step {step}: the step is {p:?} and opened no signal"),
        None if status.phase.is_some_and(|p| p.is_terminal()) => {
            format!("run {name} is {phase}; step {step} never started, and takes no signal")
        }
        None => {
            let at = status
                .current_step
                .map(|c| format!(", at step {c}"))
                .unwrap_or_default();
            format!(
                "run {name}, step {step}: the step has not started (the run is {phase}{at}); \
                 it opens its signal when it starts"
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(status: Value) -> AgentRun {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": "order", "namespace": "shop", "uid": "u1"},
            "spec": {"steps": [
                {"name": "settle", "wait": {"signal": {"description": "payment settled"}}},
                {"name": "pause", "wait": {"for": "1m"}},
                {"name": "ship", "image": "ship:1"},
            ]},
            "status": status,
        }))
        .unwrap()
    }

    fn cp(name: &str, rev: i64, phase: &str, signal: Option<&str>) -> Value {
        let mut c = json!({"name": name, "planRevision": rev, "attempt": 0,
            "idempotencyKey": "k", "phase": phase});
        if let Some(s) = signal {
            c["signal"] = json!(s);
        }
        c
    }

    #[test]
    fn the_data_is_a_json_object() {
        assert_eq!(parse_data(r#"{"amount":12}"#), Ok(json!({"amount": 12})));
        let cases = [
            (
                "[1]",
                "must be a JSON object, like '{\"amount\": 12}'; got an array",
            ),
            (
                "12",
                "must be a JSON object, like '{\"amount\": 12}'; got a number",
            ),
            (
                "null",
                "must be a JSON object, like '{\"amount\": 12}'; got null",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_data(text), Err(want.to_owned()), "{text}");
        }
        let err = parse_data("{amount: 12}").unwrap_err();
        assert!(
            err.starts_with("is not JSON: key must be a string"),
            "{err}"
        );
    }

    #[test]
    fn ids_follow_the_signals_pattern() {
        for ok in ["pay-1", "a", "ci/run:42.b_c", "20261204T061200Z-3fa9c2d1"] {
            assert_eq!(check_id(ok), Ok(()), "{ok}");
        }
        for bad in ["", "-pay", "pay-", "pay 1", "päy", &"x".repeat(254)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_fresh_id_is_valid_and_new_each_time() {
        let now: Timestamp = "2026-12-04T06:12:00.5Z".parse().unwrap();
        let (a, b) = (fresh_id(now), fresh_id(now));
        assert!(a.starts_with("20261204T061200Z-"), "{a}");
        assert_eq!(a.len(), "20261204T061200Z-".len() + 8, "{a}");
        assert_eq!(check_id(&a), Ok(()));
        assert_ne!(a, b, "random per call");
    }

    #[test]
    fn the_signal_is_the_one_of_the_latest_revision() {
        let r = run(json!({"steps": [
            cp("settle", 1, "Superseded", Some("order-settle-aaaaaa-r1-signal")),
            cp("settle", 2, "Waiting", Some("order-settle-aaaaaa-r2-signal")),
            cp("pause", 2, "Waiting", None),
        ]}));
        assert_eq!(
            signal_name(&r, "settle").as_deref(),
            Some("order-settle-aaaaaa-r2-signal")
        );
        assert_eq!(signal_name(&r, "pause"), None);
        assert_eq!(signal_name(&r, "ship"), None);
    }

    #[test]
    fn without_a_signal_the_error_says_what_the_step_does() {
        let cases = [
            (
                "a step that is not in the plan",
                json!({}),
                "nope",
                "run order has no step nope; its steps: settle, pause, ship",
            ),
            (
                "a wait without a signal",
                json!({"steps": [cp("pause", 1, "Waiting", None)]}),
                "pause",
                "run order, step pause: the step does not wait for a signal (it is Waiting)",
            ),
            (
                "a step that runs a Pod, not started",
                json!({}),
                "ship",
                "run order, step ship: the step does not wait for a signal",
            ),
            (
                "not started",
                json!({"phase": "Running", "currentStep": "prepare"}),
                "settle",
                "run order, step settle: the step has not started (the run is Running, at step \
                 prepare); it opens its signal when it starts",
            ),
            (
                "a finished run",
                json!({"phase": "Cancelled"}),
                "settle",
                "run order is Cancelled; step settle never started, and takes no signal",
            ),
        ];
        for (case, status, step, want) in cases {
            assert_eq!(not_waiting(&run(status), step), want, "{case}");
        }
    }
}
