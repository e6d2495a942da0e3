//! The side-effect ledger: one JSON object per line, appended by `simkubelet --ledger FILE`
//! and read by the scenario tests to count, per idempotency key, how often a step really ran.
//!
//! ```text
//! Pod reaches Running  ──▶ {"event":"started",  "uid":…, "idempotencyKey":…, "startedAt":…}
//! journaled call made  ──▶ {"event":"callExecuted", "uid":…, "attempt":…,
//!                            "call":{"seq":…,"id":…,"kind":…,"key":…,"at":…}}
//! Pod's step ends      ──▶ {"event":"finished", "uid":…, "idempotencyKey":…, "exitCode":…,
//!                            "outcome":"Succeeded|Failed|Killed", "startedAt":…, "finishedAt":…,
//!                            "reportedEffect":"NotApplied",   (when the step said so)
//!                            "acted":true}                    (whether it performed its effect)
//! ```
//!
//! A `started` line is one execution (one side effect performed); a `finished` line with
//! outcome `Succeeded` is one successful execution. The unit the contract protects is the
//! step's effect, (run, step name), across plan revisions and keys:
//! [`Ledger::executions_of`] lists them. A journaled step's effects are its calls (D19): a
//! `callExecuted` line is one call really made (a model asked, a tool's side effect
//! performed), counted per (run, step, call id) by [`Ledger::calls`]. The format is
//! documented in e2e/README.md.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use agentrun_operator::api::EffectOutcome;
use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// Errors reading or appending the ledger.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("cannot open ledger {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read ledger {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot append to ledger {path}")]
    Append {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("ledger {path} line {line} is not a ledger entry")]
    Parse {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot encode a ledger entry")]
    Encode(#[source] serde_json::Error),
}

pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

/// Which moment of a Pod's life a line records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LedgerEvent {
    /// The Pod was reported Running: the step began performing its side effect.
    Started,
    /// The step ended (normally, or killed).
    Finished,
    /// A journaled step's attempt made one call (`call`): the model was
    /// asked, or the tool performed its effect.
    CallExecuted,
}

/// The call a `callExecuted` line records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CallExecution {
    /// Its position in the step's journal.
    pub seq: i64,
    /// Its call id.
    pub id: String,
    /// `Model` or `Tool`.
    pub kind: String,
    /// A tool call's key (`call_key(step key, id)`): what its verify probe asks about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// When it was made.
    pub at: Timestamp,
}

/// How a step execution ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Exit code 0: the step completed and reported its result.
    Succeeded,
    /// A non-zero exit code chosen by the step (`SIM_STEP.exitCode`).
    Failed,
    /// Terminated from outside while running: the Pod was deleted or evicted (exit 137),
    /// or vanished.
    Killed,
}

/// One line of the ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LedgerEntry {
    pub event: LedgerEvent,
    pub pod: String,
    pub namespace: String,
    /// The Pod's `metadata.uid`: pairs a `finished` line with its `started` line.
    pub uid: String,
    /// Label `agentrun.dev/run`.
    pub run: Option<String>,
    /// Label `agentrun.dev/step`.
    pub step: Option<String>,
    /// Annotation `agentrun.dev/idempotency-key`, else env `AGENTRUN_IDEMPOTENCY_KEY`.
    pub idempotency_key: Option<String>,
    /// Env `AGENTRUN_ATTEMPT`, else label `agentrun.dev/attempt`.
    pub attempt: Option<u32>,
    /// Label `agentrun.dev/role`.
    pub role: Option<String>,
    /// When the container started running.
    pub started_at: Timestamp,
    /// Only on `finished` lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Only on `finished` lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Only on `finished` lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Timestamp>,
    /// Only on `finished` lines of a step that exited: the `effect` its termination
    /// message reported (`NotApplied`: the attempt says it did not act).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_effect: Option<EffectOutcome>,
    /// Only on `finished` lines: whether the attempt performed its effect, as
    /// the simulated system it changes records it (a probe reads the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acted: Option<bool>,
    /// Only on `callExecuted` lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<CallExecution>,
}

impl LedgerEntry {
    /// The key this entry is counted under; entries of Pods without one count under `""`.
    pub fn key(&self) -> &str {
        self.idempotency_key.as_deref().unwrap_or("")
    }

    /// The `finished` line for this `started` line.
    pub fn finished(&self, exit_code: i32, outcome: Outcome, finished_at: Timestamp) -> Self {
        Self {
            event: LedgerEvent::Finished,
            exit_code: Some(exit_code),
            outcome: Some(outcome),
            finished_at: Some(finished_at),
            ..self.clone()
        }
    }

    /// The `callExecuted` line of this Pod's call `call`.
    pub fn executed(&self, call: CallExecution) -> Self {
        Self {
            event: LedgerEvent::CallExecuted,
            call: Some(call),
            ..self.clone()
        }
    }

    /// This `finished` line, with the effect the step's termination message reported.
    pub fn reporting(self, effect: Option<EffectOutcome>) -> Self {
        Self {
            reported_effect: effect,
            ..self
        }
    }

    /// This `finished` line, with whether the attempt acted.
    pub fn acting(self, acted: bool) -> Self {
        Self {
            acted: Some(acted),
            ..self
        }
    }

    /// Whether the line is about a step of the plan (not a planner, compactor,
    /// verify probe or compensation). Lines without a role count as steps.
    pub fn is_step(&self) -> bool {
        self.role.as_deref().is_none_or(|r| r == "step")
    }

    /// Whether the execution said it did not act (a `finished` line whose
    /// termination message reported `NotApplied`).
    pub fn said_not_applied(&self) -> bool {
        self.reported_effect == Some(EffectOutcome::NotApplied)
    }
}

/// The ledger as read back from its file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    pub entries: Vec<LedgerEntry>,
}

impl Ledger {
    /// Reads every complete line of `path`. A last line without its newline is still being
    /// written and is left out. A missing file is an error, not an empty ledger: simkubelet
    /// creates its ledger when it starts, so a missing one is a wrong path or no simkubelet,
    /// and read as empty it would make every "nothing ran" pass.
    pub fn read(path: impl AsRef<Path>) -> Result<Ledger> {
        let path = path.as_ref();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(source) => {
                return Err(LedgerError::Read {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        Self::parse(&text).map_err(|(line, source)| LedgerError::Parse {
            path: path.to_owned(),
            line,
            source,
        })
    }

    /// Parses ledger text; the error names the 1-based line that is not an entry.
    pub fn parse(text: &str) -> Result<Ledger, (usize, serde_json::Error)> {
        let complete = match text.rfind('\n') {
            Some(end) => &text[..end],
            None => "",
        };
        let entries = complete
            .lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(i, line)| serde_json::from_str(line).map_err(|e| (i + 1, e)))
            .collect::<Result<_, _>>()?;
        Ok(Ledger { entries })
    }

    /// The `started` lines: one per execution.
    pub fn executions(&self) -> impl Iterator<Item = &LedgerEntry> {
        self.entries
            .iter()
            .filter(|e| e.event == LedgerEvent::Started)
    }

    /// The `finished` lines.
    pub fn finishes(&self) -> impl Iterator<Item = &LedgerEntry> {
        self.entries
            .iter()
            .filter(|e| e.event == LedgerEvent::Finished)
    }

    /// The `callExecuted` lines: one per call really made.
    pub fn calls(&self) -> impl Iterator<Item = (&LedgerEntry, &CallExecution)> {
        self.entries
            .iter()
            .filter(|e| e.event == LedgerEvent::CallExecuted)
            .filter_map(|e| e.call.as_ref().map(|c| (e, c)))
    }

    /// How many times `role`'s Pods (`step`, `compensate`, `verify`, …) of
    /// step `step` of run `run` started running, under any key.
    pub fn starts(&self, run: &str, step: &str, role: &str) -> usize {
        self.executions()
            .filter(|e| {
                e.run.as_deref() == Some(run)
                    && e.step.as_deref() == Some(step)
                    && e.role.as_deref() == Some(role)
            })
            .count()
    }

    /// Per idempotency key, how many times a step with that key started running.
    pub fn executions_by_key(&self) -> BTreeMap<String, usize> {
        count_by_key(self.executions())
    }

    /// Per idempotency key, how many executions finished with outcome `Succeeded`.
    pub fn successes_by_key(&self) -> BTreeMap<String, usize> {
        count_by_key(
            self.finishes()
                .filter(|e| e.outcome == Some(Outcome::Succeeded)),
        )
    }

    /// The lines of one Pod, by UID, in file order.
    pub fn for_pod<'a>(&'a self, uid: &'a str) -> impl Iterator<Item = &'a LedgerEntry> {
        self.entries.iter().filter(move |e| e.uid == uid)
    }

    /// The `finished` line of an execution (its `started` line), if it ended.
    pub fn finish_of(&self, started: &LedgerEntry) -> Option<&LedgerEntry> {
        self.entries
            .iter()
            .find(|e| e.uid == started.uid && e.event == LedgerEvent::Finished)
    }

    /// The executions (`started` lines) of step `step` of run `run`, under every key and
    /// plan revision, in file order: what the contract counts a step's effect by. Planner,
    /// compactor, verify and compensation Pods are not executions of the step.
    pub fn executions_of<'a>(
        &'a self,
        run: &'a str,
        step: &'a str,
    ) -> impl Iterator<Item = &'a LedgerEntry> {
        self.executions().filter(move |e| {
            e.is_step() && e.run.as_deref() == Some(run) && e.step.as_deref() == Some(step)
        })
    }
}

fn count_by_key<'a>(entries: impl Iterator<Item = &'a LedgerEntry>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for entry in entries {
        *counts.entry(entry.key().to_owned()).or_insert(0) += 1;
    }
    counts
}

/// Appends entries to the ledger file, one `write` of one whole line each, so a reader
/// never sees half a line from two writers interleaved.
#[derive(Debug)]
pub struct LedgerWriter {
    path: PathBuf,
    file: Mutex<File>,
}

impl LedgerWriter {
    /// Opens `path` for appending (O_APPEND), creating it if needed.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| LedgerError::Open {
                path: path.clone(),
                source,
            })?;
        Ok(Self {
            path,
            file: Mutex::new(file),
        })
    }

    /// Appends one line and flushes it.
    pub fn append(&self, entry: &LedgerEntry) -> Result<()> {
        let mut line = serde_json::to_vec(entry).map_err(LedgerError::Encode)?;
        line.push(b'\n');
        // A poisoned lock only means another append panicked; the file itself is fine.
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        file.write_all(&line)
            .and_then(|()| file.flush())
            .map_err(|source| LedgerError::Append {
                path: self.path.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(uid: &str, key: &str) -> LedgerEntry {
        LedgerEntry {
            event: LedgerEvent::Started,
            pod: format!("pod-{uid}"),
            namespace: "ns".into(),
            uid: uid.into(),
            run: Some("r".into()),
            step: Some("s".into()),
            idempotency_key: Some(key.into()),
            attempt: Some(1),
            role: Some("step".into()),
            started_at: Timestamp::UNIX_EPOCH,
            exit_code: None,
            outcome: None,
            finished_at: None,
            reported_effect: None,
            acted: None,
            call: None,
        }
    }

    #[test]
    fn a_call_line_names_its_pod_and_call_and_is_no_execution_of_the_step() {
        let s = started("1", "a");
        let call = CallExecution {
            seq: 2,
            id: "call_2".into(),
            kind: "Tool".into(),
            key: Some("0ed9ffc913f10948baf0d9ce47391e7f".into()),
            at: Timestamp::UNIX_EPOCH,
        };
        let line = serde_json::to_value(s.executed(call.clone())).expect("encodes");
        assert_eq!(line["event"], "callExecuted");
        assert_eq!(line["call"]["id"], "call_2");
        assert_eq!(line["call"]["key"], "0ed9ffc913f10948baf0d9ce47391e7f");
        let ledger = Ledger {
            entries: vec![s.clone(), s.executed(call.clone())],
        };
        assert_eq!(ledger.executions().count(), 1);
        let calls: Vec<_> = ledger.calls().map(|(e, c)| (e.uid.as_str(), c)).collect();
        assert_eq!(calls, [("1", &call)]);
    }

    #[test]
    fn counts_executions_and_successes_per_key() {
        let a1 = started("1", "a");
        let a2 = started("2", "a");
        let b1 = started("3", "b");
        let lines = [
            a1.clone(),
            a1.finished(137, Outcome::Killed, Timestamp::UNIX_EPOCH),
            a2.clone(),
            b1.clone(),
            a2.finished(0, Outcome::Succeeded, Timestamp::UNIX_EPOCH),
            b1.finished(3, Outcome::Failed, Timestamp::UNIX_EPOCH),
        ];
        let text: String = lines
            .iter()
            .map(|l| format!("{}\n", serde_json::to_string(l).expect("encodes")))
            .collect();
        let ledger = Ledger::parse(&text).expect("parses");
        assert_eq!(ledger.entries, lines);
        assert_eq!(
            ledger.executions_by_key(),
            BTreeMap::from([("a".into(), 2), ("b".into(), 1)])
        );
        assert_eq!(ledger.successes_by_key(), BTreeMap::from([("a".into(), 1)]));
    }

    #[test]
    fn executions_of_a_step_span_its_keys_and_leave_out_other_roles() {
        let mut other_run = started("4", "c");
        other_run.run = Some("r2".into());
        let mut compensation = started("5", "d");
        compensation.role = Some("compensate".into());
        let mut other_step = started("6", "e");
        other_step.step = Some("t".into());
        let mut no_role = started("7", "f");
        no_role.role = None;
        let r1 = started("1", "a");
        let ledger = Ledger {
            entries: vec![
                r1.clone(),
                r1.finished(3, Outcome::Failed, Timestamp::UNIX_EPOCH)
                    .reporting(Some(EffectOutcome::NotApplied)),
                started("2", "a"),
                started("3", "b"),
                other_run,
                compensation,
                other_step,
                no_role,
            ],
        };
        let uids: Vec<&str> = ledger
            .executions_of("r", "s")
            .map(|e| e.uid.as_str())
            .collect();
        assert_eq!(uids, ["1", "2", "3", "7"]);
        let first = ledger.executions_of("r", "s").next().unwrap();
        let finish = ledger.finish_of(first).expect("finished");
        assert!(finish.said_not_applied());
        assert_eq!(finish.exit_code, Some(3));
        assert!(ledger.finish_of(&ledger.entries[2]).is_none());
    }

    #[test]
    fn a_line_still_being_written_is_left_out() {
        let line = serde_json::to_string(&started("1", "a")).expect("encodes");
        let text = format!("{line}\n{}", &line[..10]);
        assert_eq!(Ledger::parse(&text).expect("parses").entries.len(), 1);
    }

    /// Read as empty, a ledger at the wrong path would make every
    /// "nothing ran" assertion pass.
    #[test]
    fn a_missing_ledger_is_an_error_not_an_empty_one() {
        let dir = std::env::temp_dir().join(format!("ledger-missing-{}", std::process::id()));
        let err = Ledger::read(dir.join("ledger.jsonl")).unwrap_err();
        assert!(
            matches!(err, LedgerError::Read { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound),
            "{err:?}"
        );
    }

    #[test]
    fn a_malformed_line_is_an_error() {
        let err = Ledger::parse("{}\n").expect_err("not an entry");
        assert_eq!(err.0, 1);
    }

    #[test]
    fn wire_format_is_camel_case() {
        let v = serde_json::to_value(started("1", "a")).expect("encodes");
        assert_eq!(v["event"], "started");
        assert_eq!(v["idempotencyKey"], "a");
        assert_eq!(v["startedAt"], "1970-01-01T00:00:00Z");
        assert!(v.get("outcome").is_none());
        assert!(v.get("reportedEffect").is_none());
        let f = started("1", "a")
            .finished(1, Outcome::Failed, Timestamp::UNIX_EPOCH)
            .reporting(Some(EffectOutcome::NotApplied));
        let v = serde_json::to_value(f).expect("encodes");
        assert_eq!(v["reportedEffect"], "NotApplied");
        assert_eq!(v["outcome"], "Failed");
    }
}
