//! What a simulated step does: `SIM_STEP`, the camelCase JSON in env of the
//! step's container (documented in e2e/README.md), resolved per run and per
//! attempt into a [`Behaviour`], and the termination message it writes.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::journal_calls::JournalSim;
use crate::{MAX_TERMINATION_MESSAGE, SIM_STEP};

/// What the step does, from `SIM_STEP` (camelCase JSON). Unknown fields are an error so a
/// typo in a test fails loudly instead of silently running the default.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct SimStep {
    pending_ms: Option<u64>,
    run_ms: Option<u64>,
    #[serde(default)]
    exit_code: i32,
    result: Option<Value>,
    tokens: Option<Value>,
    plan: Option<Value>,
    summary: Option<Value>,
    /// The termination message's `effect` (`NotApplied`: the attempt says it did not act).
    effect: Option<Value>,
    raw_message: Option<String>,
    #[serde(default)]
    hang: bool,
    /// When the attempt performs its effect, in ms after it starts running
    /// (default: as it starts). Killed before then, it did not act.
    act_at_ms: Option<u64>,
    /// A verify probe: its termination message says whether an attempt under
    /// the Pod's idempotency key acted (the effects record), with this
    /// `result` when one did.
    probe: Option<Probe>,
    /// A journaled agent loop (journal.rs): its calls, made before the step
    /// exits (in place of `runMs`). The Pod must carry `AGENTRUN_JOURNAL`.
    journal: Option<JournalSim>,
    /// Per-attempt behaviour: attempt N uses entry N-1, the last entry repeats.
    attempts: Option<Vec<SimStep>>,
    /// Per-run behaviour: the entry for the Pod's run (label `agentrun.dev/run`)
    /// replaces the rest, so a retried run (`kubectl agentrun retry`, the same
    /// spec) can do what its source did not.
    runs: Option<std::collections::BTreeMap<String, SimStep>>,
}

/// What a probe reports when the effect it asks about happened.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct Probe {
    #[serde(default)]
    result: Value,
}

/// One attempt's behaviour, resolved.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Behaviour {
    pub(crate) pending: Duration,
    pub(crate) run: Duration,
    pub(crate) hang: bool,
    pub(crate) exit_code: i32,
    pub(crate) message: String,
    /// When it acts, after it starts running.
    pub(crate) act_at: Duration,
    /// A probe: the result it reports for an applied effect.
    pub(crate) probe: Option<Value>,
    /// A journaled loop, run in place of `run`.
    pub(crate) journal: Option<JournalSim>,
}

impl SimStep {
    pub(crate) fn parse(json: &str) -> std::result::Result<SimStep, String> {
        serde_json::from_str(json).map_err(|e| format!("invalid {SIM_STEP}: {e}"))
    }

    /// The entry for the run `run`, if `runs` has one; else this.
    pub(crate) fn for_run(self, run: Option<&str>) -> std::result::Result<SimStep, String> {
        let Some(runs) = &self.runs else {
            return Ok(self);
        };
        match run.and_then(|r| runs.get(r)) {
            Some(chosen) if chosen.runs.is_some() => {
                Err(format!("{SIM_STEP}.runs entries cannot nest runs"))
            }
            Some(chosen) => Ok(chosen.clone()),
            None => Ok(SimStep { runs: None, ..self }),
        }
    }

    /// The entry for `attempt` (from 1): `attempts[attempt-1]`, the last one repeating.
    pub(crate) fn for_attempt(self, attempt: u32) -> std::result::Result<SimStep, String> {
        let Some(attempts) = self.attempts else {
            return Ok(self);
        };
        let index = (attempt.max(1) - 1) as usize;
        let chosen = attempts
            .get(index)
            .or(attempts.last())
            .cloned()
            .ok_or_else(|| format!("{SIM_STEP}.attempts is empty"))?;
        if chosen.attempts.is_some() {
            return Err(format!("{SIM_STEP}.attempts entries cannot nest attempts"));
        }
        Ok(chosen)
    }

    pub(crate) fn behaviour(&self, default_run: Duration) -> Behaviour {
        Behaviour {
            pending: Duration::from_millis(self.pending_ms.unwrap_or(0)),
            run: self
                .run_ms
                .map(Duration::from_millis)
                .unwrap_or(default_run),
            hang: self.hang,
            exit_code: self.exit_code,
            message: truncate_message(self.message()),
            act_at: Duration::from_millis(self.act_at_ms.unwrap_or(0)),
            probe: self.probe.as_ref().map(|p| p.result.clone()),
            journal: self.journal.clone(),
        }
    }

    /// The termination message the step writes.
    fn message(&self) -> String {
        if let Some(raw) = &self.raw_message {
            return raw.clone();
        }
        let mut message = Map::new();
        message.insert(
            "result".into(),
            self.result.clone().unwrap_or_else(|| json!({})),
        );
        for (name, value) in [
            ("tokens", &self.tokens),
            ("plan", &self.plan),
            ("summary", &self.summary),
            ("effect", &self.effect),
        ] {
            if let Some(value) = value {
                message.insert(name.into(), value.clone());
            }
        }
        Value::Object(message).to_string()
    }
}

/// Keeps the last [`MAX_TERMINATION_MESSAGE`] bytes, as a kubelet reads the file's tail.
pub(crate) fn truncate_message(mut message: String) -> String {
    if message.len() <= MAX_TERMINATION_MESSAGE {
        return message;
    }
    let mut start = message.len() - MAX_TERMINATION_MESSAGE;
    while !message.is_char_boundary(start) {
        start += 1;
    }
    message.drain(..start);
    message
}

/// The `effect` a termination message reports, if it is one the step contract knows.
pub(crate) fn reported_effect(message: &str) -> Option<agentrun_operator::api::EffectOutcome> {
    let value: Value = serde_json::from_str(message).ok()?;
    serde_json::from_value(value.get("effect")?.clone()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};
    use std::time::Duration;

    fn behaviour(json: &str, attempt: u32) -> Behaviour {
        SimStep::parse(json)
            .and_then(|s| s.for_attempt(attempt))
            .map(|s| s.behaviour(Duration::from_millis(100)))
            .expect("valid SIM_STEP")
    }

    #[test]
    fn a_failed_attempt_that_did_not_act_says_so_and_the_ledger_reads_it() {
        let b = behaviour(
            r#"{"attempts":[{"exitCode":1,"effect":"NotApplied"},{"result":{"ok":true}}]}"#,
            1,
        );
        assert_eq!(b.exit_code, 1);
        let message: Value = serde_json::from_str(&b.message).unwrap();
        assert_eq!(message, json!({"result": {}, "effect": "NotApplied"}));
        assert_eq!(
            reported_effect(&b.message),
            Some(agentrun_operator::api::EffectOutcome::NotApplied)
        );
        let b = behaviour(r#"{"attempts":[{"exitCode":1},{"result":{"ok":true}}]}"#, 2);
        assert_eq!(reported_effect(&b.message), None);
        assert_eq!(reported_effect("not json"), None);
        assert_eq!(reported_effect(r#"{"effect":"Sideways"}"#), None);
    }

    #[test]
    fn no_sim_step_succeeds_after_the_default_with_an_empty_result() {
        let b = SimStep::default().behaviour(Duration::from_millis(100));
        assert_eq!(b.run, Duration::from_millis(100));
        assert_eq!(b.exit_code, 0);
        assert_eq!(b.message, r#"{"result":{}}"#);
    }

    #[test]
    fn message_carries_result_tokens_plan_and_summary() {
        let b = behaviour(
            r#"{"runMs":5,"result":{"orderId":42},"tokens":{"input":1,"output":2},
                "plan":{"steps":[]},"summary":"s"}"#,
            1,
        );
        let message: Value = serde_json::from_str(&b.message).expect("json");
        assert_eq!(
            message,
            json!({"result":{"orderId":42},"tokens":{"input":1,"output":2},
                   "plan":{"steps":[]},"summary":"s"})
        );
        assert_eq!(b.run, Duration::from_millis(5));
    }

    #[test]
    fn raw_message_is_verbatim() {
        assert_eq!(
            behaviour(r#"{"rawMessage":"{not json"}"#, 1).message,
            "{not json"
        );
    }

    #[test]
    fn runs_pick_the_entry_of_the_pods_run() {
        let json = r#"{"exitCode":1,"runs":{"order-retry":{"exitCode":0,"result":{"ok":true}}}}"#;
        let s = SimStep::parse(json).unwrap();
        assert_eq!(s.clone().for_run(Some("order-retry")).unwrap().exit_code, 0);
        let own = s.for_run(Some("order")).unwrap();
        assert_eq!((own.exit_code, own.runs.is_none()), (1, true));
    }

    #[test]
    fn attempts_pick_entry_n_minus_one_and_the_last_repeats() {
        let json = r#"{"attempts":[{"exitCode":1},{"exitCode":2},{"exitCode":0}]}"#;
        let codes: Vec<i32> = (1..=5).map(|a| behaviour(json, a).exit_code).collect();
        assert_eq!(codes, [1, 2, 0, 0, 0]);
    }

    #[test]
    fn bad_sim_step_is_an_error() {
        assert!(
            SimStep::parse(r#"{"exitcode":1}"#).is_err(),
            "unknown field"
        );
        assert!(SimStep::parse("not json").is_err());
        assert!(
            SimStep::parse(r#"{"attempts":[]}"#)
                .and_then(|s| s.for_attempt(1))
                .is_err()
        );
    }

    #[test]
    fn long_messages_keep_their_last_4096_bytes() {
        let long = format!("é{}", "x".repeat(5000));
        let cut = truncate_message(long);
        assert_eq!(cut.len(), MAX_TERMINATION_MESSAGE);
        assert!(cut.chars().all(|c| c == 'x'));
        let long = format!("é{}", "x".repeat(4095));
        assert_eq!(
            truncate_message(long),
            "x".repeat(4095),
            "cut on a char boundary"
        );
    }
}
