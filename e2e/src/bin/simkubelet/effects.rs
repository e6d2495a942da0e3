//! The system the simulated steps change, so that a verify probe has
//! something true to ask: per idempotency key, whether an attempt under it
//! performed its effect.
//!
//! ```text
//!   attempt (key K) runs ──(actAtMs)──▶ acts ──▶ ends     K applied
//!   attempt (key K) killed before actAtMs, or says NotApplied    K not applied (yet)
//!   probe (role verify, key K) exits 0 ──▶ {"effect":"Applied","result":…} | {"effect":"NotApplied"}
//! ```
//!
//! An attempt's effect is recorded when the attempt ends, before its end is
//! reported, so a probe started after the operator saw the attempt end reads
//! the truth. The ledger's `finished` lines carry it (`acted`), and a
//! restarted simkubelet reads them back.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use agentrun_e2e::ledger::Ledger;
use serde_json::{Value, json};

/// Keys under which an attempt acted.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    applied: Mutex<HashSet<String>>,
    /// Keys of the journaled calls made (docs/journal.md's call keys).
    calls: Mutex<HashSet<String>>,
}

impl Effects {
    /// The effects a ledger records (`acted: true` on a `finished` line).
    pub(crate) fn from_ledger(ledger: &Ledger) -> Self {
        let applied = ledger
            .finishes()
            .filter(|f| f.acted == Some(true))
            .map(|f| f.key().to_owned())
            .collect();
        let calls = ledger.calls().filter_map(|(_, c)| c.key.clone()).collect();
        Self {
            applied: Mutex::new(applied),
            calls: Mutex::new(calls),
        }
    }

    fn applied(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An attempt under `key` ended having acted or not.
    pub(crate) fn record(&self, key: Option<&str>, acted: bool) {
        if let (Some(key), true) = (key, acted) {
            self.applied().insert(key.to_owned());
        }
    }

    /// A journaled call under `call_key` was made.
    pub(crate) fn record_call(&self, call_key: &str) {
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(call_key.to_owned());
    }

    /// The termination message of a probe asking about `key`: `Applied` with
    /// `result` if an attempt under it acted, else `NotApplied`. A probe
    /// asked about one journaled call (`call_key`) answers about that call.
    pub(crate) fn answer(
        &self,
        key: Option<&str>,
        call_key: Option<&str>,
        result: &Value,
    ) -> String {
        let applied = match call_key {
            Some(c) => self
                .calls
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(c),
            None => key.is_some_and(|k| self.applied().contains(k)),
        };
        if applied {
            json!({"effect": "Applied", "result": result}).to_string()
        } else {
            json!({"effect": "NotApplied", "result": {}}).to_string()
        }
    }
}

/// Whether an attempt that ran for `ran` acted: it reached the moment it
/// acts, and did not say it did not.
pub(crate) fn acted(ran: Duration, act_at: Duration, said_not_applied: bool) -> bool {
    ran >= act_at && !said_not_applied
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_answers_applied_only_for_a_key_whose_attempt_acted() {
        let effects = Effects::default();
        let result = json!({"paid": 1});
        effects.record(Some("k1"), false);
        assert_eq!(
            effects.answer(Some("k1"), None, &result),
            r#"{"effect":"NotApplied","result":{}}"#
        );
        effects.record(Some("k1"), true);
        let applied: Value =
            serde_json::from_str(&effects.answer(Some("k1"), None, &result)).unwrap();
        assert_eq!(applied, json!({"effect": "Applied", "result": {"paid": 1}}));
        assert!(
            effects
                .answer(Some("k2"), None, &result)
                .contains("NotApplied")
        );
        assert!(effects.answer(None, None, &result).contains("NotApplied"));
    }

    #[test]
    fn a_probe_asked_about_a_journaled_call_answers_from_the_calls_made() {
        let effects = Effects::default();
        let r = json!({"call": "call_1"});
        // The step's own key acted, but the call asked about was not made.
        effects.record(Some("k1"), true);
        assert!(
            effects
                .answer(Some("k1"), Some("c1"), &r)
                .contains("NotApplied")
        );
        effects.record_call("c1");
        let applied: Value =
            serde_json::from_str(&effects.answer(Some("k1"), Some("c1"), &r)).unwrap();
        assert_eq!(
            applied,
            json!({"effect": "Applied", "result": {"call": "call_1"}})
        );
        assert!(
            effects
                .answer(Some("k1"), Some("c2"), &r)
                .contains("NotApplied")
        );
    }

    #[test]
    fn an_attempt_acts_once_it_ran_past_its_moment_unless_it_says_it_did_not() {
        let ms = Duration::from_millis;
        assert!(
            acted(ms(0), ms(0), false),
            "by default it acts as it starts"
        );
        assert!(!acted(ms(299), ms(300), false), "killed before the moment");
        assert!(acted(ms(300), ms(300), false));
        assert!(!acted(ms(500), ms(300), true), "it said NotApplied");
    }

    #[test]
    fn a_restarted_simkubelet_reads_the_effects_back_from_the_ledger() {
        let text = concat!(
            r#"{"event":"finished","pod":"p1","namespace":"n","uid":"u1","run":"r","step":"s","idempotencyKey":"k1","attempt":1,"role":"step","startedAt":"2026-01-01T00:00:00Z","exitCode":137,"outcome":"Killed","finishedAt":"2026-01-01T00:00:01Z","acted":true}"#,
            "\n",
            r#"{"event":"finished","pod":"p2","namespace":"n","uid":"u2","run":"r","step":"t","idempotencyKey":"k2","attempt":1,"role":"step","startedAt":"2026-01-01T00:00:00Z","exitCode":137,"outcome":"Killed","finishedAt":"2026-01-01T00:00:01Z","acted":false}"#,
            "\n",
            r#"{"event":"callExecuted","pod":"p3","namespace":"n","uid":"u3","run":"r","step":"j","idempotencyKey":"k3","attempt":1,"role":"step","startedAt":"2026-01-01T00:00:00Z","call":{"seq":1,"id":"call_1","kind":"Tool","key":"c1","at":"2026-01-01T00:00:01Z"}}"#,
            "\n",
        );
        let effects = Effects::from_ledger(&Ledger::parse(text).unwrap());
        assert!(
            effects
                .answer(Some("k3"), Some("c1"), &json!({}))
                .contains("\"Applied\"")
        );
        let r = json!({});
        assert!(effects.answer(Some("k1"), None, &r).contains("\"Applied\""));
        assert!(effects.answer(Some("k2"), None, &r).contains("NotApplied"));
    }
}
