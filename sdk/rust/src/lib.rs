//! The step side of agentrun-operator's step contract (docs/step-contract.md).
//!
//! A step reads who it is from `AGENTRUN_*` environment variables and what came before from
//! the context file, does its work, and writes one JSON object to its termination message:
//!
//! ```text
//!  env AGENTRUN_* ─┐                                   ┌─▶ /dev/termination-log
//!  context.json ───┴─▶ Step::load() ─▶ your work ─▶ succeed(result, tokens)   (≤ 4096 bytes)
//! ```
//!
//! ```no_run
//! use agentrun_step::{Step, Tokens};
//!
//! let step = Step::load()?;
//! let order = step.result_of("lookup-order")?;
//! // ... call the payments API with step.headers() (Idempotency-Key, traceparent) ...
//! step.succeed(&serde_json::json!({"refundId": "re_0001", "orderId": order["orderId"]}),
//!              Some(Tokens { input: 820, output: 140 }))?;
//! # Ok::<(), agentrun_step::Error>(())
//! ```
//!
//! The kubelet keeps at most 4096 bytes of a termination message and cuts the rest, which
//! the operator then cannot parse: [`Step::succeed`] refuses a larger message with
//! [`Error::MessageTooLarge`] before anything is written.

#![forbid(unsafe_code)]

#[cfg(feature = "journal")]
pub mod journal;

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What the kubelet keeps of a termination message.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// The Pod's default `terminationMessagePath`.
pub const DEFAULT_MESSAGE_PATH: &str = "/dev/termination-log";
pub const DEFAULT_CONTEXT_FILE: &str = "/agentrun/context.json";

pub const ENV_IDEMPOTENCY_KEY: &str = "AGENTRUN_IDEMPOTENCY_KEY";
pub const ENV_RUN: &str = "AGENTRUN_RUN";
pub const ENV_STEP: &str = "AGENTRUN_STEP";
pub const ENV_ATTEMPT: &str = "AGENTRUN_ATTEMPT";
pub const ENV_PLAN_REVISION: &str = "AGENTRUN_PLAN_REVISION";
pub const ENV_CONTEXT_FILE: &str = "AGENTRUN_CONTEXT_FILE";
/// Not set by the operator: lets tests and local runs write the message elsewhere.
pub const ENV_MESSAGE_PATH: &str = "AGENTRUN_TERMINATION_MESSAGE_PATH";
/// W3C trace context of the run, when the operator or the platform sets one.
pub const ENV_TRACEPARENT: &str = "TRACEPARENT";
pub const ENV_TRACESTATE: &str = "TRACESTATE";

#[derive(Debug)]
pub enum Error {
    /// A variable of the contract is missing or malformed.
    Env { name: &'static str, problem: String },
    /// The context file cannot be read or is not a JSON object.
    Context { path: PathBuf, problem: String },
    /// No earlier step of that name in the context.
    NoResult { name: String, have: Vec<String> },
    /// The message would be cut by the kubelet.
    MessageTooLarge { size: usize },
    /// The message was already written (write it once, at the end).
    AlreadyWritten,
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Env { name, problem } => write!(f, "{name} {problem}"),
            Error::Context { path, problem } => {
                write!(f, "the context file {}: {problem}", path.display())
            }
            Error::NoResult { name, have } => write!(
                f,
                "no result of step {name:?} in the context (has: {})",
                if have.is_empty() {
                    "none".to_owned()
                } else {
                    have.join(", ")
                }
            ),
            Error::MessageTooLarge { size } => write!(
                f,
                "termination message is {size} bytes, over the {MAX_MESSAGE_BYTES}-byte limit: \
                 return a reference (e.g. an object key derived from the idempotency key) \
                 instead of the data"
            ),
            Error::AlreadyWritten => write!(f, "the termination message was already written"),
            Error::Write { path, source } => write!(f, "writing {}: {source}", path.display()),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Write { source, .. } => Some(source),
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Tokens one attempt used; they count against the run's budget, failed attempts included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
}

/// One earlier step's committed result in the context (`results[]`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct PriorResult {
    pub step: String,
    #[serde(default)]
    pub result: Value,
}

/// The context file as the operator writes it (crates/engine/src/context.rs); unknown fields are
/// ignored, as the contract asks. Its identity fields repeat the environment's.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Context {
    #[serde(default)]
    pub run: Option<String>,
    #[serde(default)]
    pub run_uid: Option<String>,
    #[serde(default)]
    pub step: Option<String>,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub summary: Option<String>,
    /// Earlier steps' results, oldest first.
    #[serde(default)]
    pub results: Vec<PriorResult>,
    /// How many older results were left out to stay within `spec.context.maxBytes`.
    #[serde(default)]
    pub omitted_results: usize,
}

/// What an attempt says it did to the outside world (`effect` in the message).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Effect {
    /// It changed the world (the default for a success of a step that acts).
    Applied,
    /// Nothing changed: a failed attempt that says so is retried by the
    /// step's retry policy, with the same key.
    NotApplied,
    /// It cannot tell.
    Unknown,
}

#[derive(Serialize)]
struct Message<'a> {
    result: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens: Option<Tokens>,
    #[serde(skip_serializing_if = "Option::is_none")]
    effect: Option<Effect>,
    #[serde(rename = "journalTokens", skip_serializing_if = "Option::is_none")]
    journal_tokens: Option<Tokens>,
}

/// The termination message as bytes, checked against the 4096-byte limit.
pub fn encode_message(result: &Value, tokens: Option<Tokens>) -> Result<Vec<u8>> {
    encode_report(result, tokens, None)
}

/// The termination message with what the attempt says of its effect.
pub fn encode_report(
    result: &Value,
    tokens: Option<Tokens>,
    effect: Option<Effect>,
) -> Result<Vec<u8>> {
    encode_full(result, tokens, effect, None)
}

/// The termination message of a journaled step: `journal_tokens` are its
/// journal's (every model call once), `tokens` only those spent outside it.
pub fn encode_full(
    result: &Value,
    tokens: Option<Tokens>,
    effect: Option<Effect>,
    journal_tokens: Option<Tokens>,
) -> Result<Vec<u8>> {
    let data = serde_json::to_vec(&Message {
        result,
        tokens,
        effect,
        journal_tokens,
    })
    .expect("JSON values serialize");
    if data.len() > MAX_MESSAGE_BYTES {
        return Err(Error::MessageTooLarge { size: data.len() });
    }
    Ok(data)
}

/// Who this attempt is (from the environment) and what it may use (the context file).
#[derive(Debug)]
pub struct Step {
    pub idempotency_key: String,
    pub run: String,
    pub step: String,
    pub attempt: u32,
    pub plan_revision: i64,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    pub context: Context,
    pub message_path: PathBuf,
    written: std::cell::Cell<bool>,
}

impl Step {
    /// Reads the process environment and the context file it names.
    pub fn load() -> Result<Step> {
        Step::from_env(&std::env::vars().collect())
    }

    /// Reads the given environment (tests, or a wrapper that sets it up) and its context file.
    pub fn from_env(env: &HashMap<String, String>) -> Result<Step> {
        let get = |name: &'static str| -> Result<String> {
            env.get(name)
                .filter(|v| !v.is_empty())
                .cloned()
                .ok_or_else(|| Error::Env {
                    name,
                    problem: "is not set: is this running as an agentrun step?".into(),
                })
        };
        let int = |name: &'static str| -> Result<i64> {
            let v = get(name)?;
            v.parse().map_err(|_| Error::Env {
                name,
                problem: format!("must be an integer, got {v:?}"),
            })
        };
        let path = PathBuf::from(
            env.get(ENV_CONTEXT_FILE)
                .map(String::as_str)
                .unwrap_or(DEFAULT_CONTEXT_FILE),
        );
        let text = std::fs::read_to_string(&path).map_err(|e| Error::Context {
            path: path.clone(),
            problem: e.to_string(),
        })?;
        let context = if text.trim().is_empty() {
            Context::default()
        } else {
            serde_json::from_str(&text).map_err(|e| Error::Context {
                path: path.clone(),
                problem: format!("not a JSON object of the contract's shape: {e}"),
            })?
        };
        let attempt = int(ENV_ATTEMPT)?;
        Ok(Step {
            idempotency_key: get(ENV_IDEMPOTENCY_KEY)?,
            run: get(ENV_RUN)?,
            step: get(ENV_STEP)?,
            attempt: u32::try_from(attempt).map_err(|_| Error::Env {
                name: ENV_ATTEMPT,
                problem: format!("must be a positive integer, got {attempt}"),
            })?,
            plan_revision: int(ENV_PLAN_REVISION)?,
            traceparent: env.get(ENV_TRACEPARENT).filter(|v| !v.is_empty()).cloned(),
            tracestate: env.get(ENV_TRACESTATE).filter(|v| !v.is_empty()).cloned(),
            context,
            message_path: PathBuf::from(
                env.get(ENV_MESSAGE_PATH)
                    .map(String::as_str)
                    .unwrap_or(DEFAULT_MESSAGE_PATH),
            ),
            written: std::cell::Cell::new(false),
        })
    }

    /// The committed result of an earlier step, by name (the newest one listed).
    pub fn result_of(&self, name: &str) -> Result<&Value> {
        self.context
            .results
            .iter()
            .rev()
            .find(|r| r.step == name)
            .map(|r| &r.result)
            .ok_or_else(|| Error::NoResult {
                name: name.to_owned(),
                have: self
                    .context
                    .results
                    .iter()
                    .map(|r| r.step.clone())
                    .collect(),
            })
    }

    /// Headers for a request that changes an external system: the idempotency key, and the
    /// trace context when there is one.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![("Idempotency-Key", self.idempotency_key.clone())];
        if let Some(tp) = &self.traceparent {
            h.push(("traceparent", tp.clone()));
            if let Some(ts) = &self.tracestate {
                h.push(("tracestate", ts.clone()));
            }
        }
        h
    }

    /// Writes the result and token usage, once; exit 0 after it.
    pub fn succeed(&self, result: &Value, tokens: Option<Tokens>) -> Result<()> {
        let data = encode_message(result, tokens)?;
        self.write(&data)
    }

    /// A journaled step's result: `tokens` are those spent outside the
    /// journal; the journal's own are reported whole (`journalTokens`), and
    /// the operator counts each model call once.
    #[cfg(feature = "journal")]
    pub fn succeed_journaled(
        &self,
        result: &Value,
        tokens: Option<Tokens>,
        journal: &journal::Journal,
    ) -> Result<()> {
        let t = journal.tokens_total();
        let data = encode_full(
            result,
            tokens,
            None,
            Some(Tokens {
                input: t.input.max(0) as u64,
                output: t.output.max(0) as u64,
            }),
        )?;
        self.write(&data)
    }

    /// Whether this attempt is a step's verify probe (`steps[].verify`): it runs with the
    /// step's idempotency key and asks the system the step changed what happened.
    pub fn is_verify(&self) -> bool {
        self.context.role.as_deref() == Some("verify")
    }

    /// A verify probe's answer, once; exit 0 after it. [`Effect::Applied`]: the step's
    /// attempt with this key acted, and `result` becomes the step's result;
    /// [`Effect::NotApplied`]: it did not, and the step may retry with the same key;
    /// [`Effect::Unknown`]: a person is asked, and shown `result`.
    pub fn answer(&self, effect: Effect, result: &Value, tokens: Option<Tokens>) -> Result<()> {
        let data = encode_report(result, tokens, Some(effect))?;
        self.write(&data)
    }

    /// Writes what is known of a failed attempt (`{"error": reason, ...partial}` and the
    /// tokens, which still count); the caller then exits non-zero. Such an attempt may
    /// have acted: the operator records its effect as Unknown, and a NonIdempotent step
    /// runs again only once a person answers a Reconcile question. Use
    /// [`Step::report_not_applied`] when the step knows nothing changed.
    pub fn report_failure(
        &self,
        reason: &str,
        partial: Option<&Value>,
        tokens: Option<Tokens>,
    ) -> Result<()> {
        self.report(reason, partial, tokens, None)
    }

    /// Writes a failed attempt that did not act — the request was refused before it was
    /// sent, or the system it calls said it did not apply it (`"effect": "NotApplied"`);
    /// the caller then exits non-zero, and the step's retry policy runs it again with the
    /// same key.
    pub fn report_not_applied(
        &self,
        reason: &str,
        partial: Option<&Value>,
        tokens: Option<Tokens>,
    ) -> Result<()> {
        self.report(reason, partial, tokens, Some(Effect::NotApplied))
    }

    fn report(
        &self,
        reason: &str,
        partial: Option<&Value>,
        tokens: Option<Tokens>,
        effect: Option<Effect>,
    ) -> Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("error".into(), Value::String(reason.to_owned()));
        match partial {
            Some(Value::Object(m)) => obj.extend(m.clone()),
            Some(v) => {
                obj.insert("partial".into(), v.clone());
            }
            None => {}
        }
        let data = match encode_report(&Value::Object(obj), tokens, effect) {
            Ok(d) => d,
            Err(Error::MessageTooLarge { .. }) => {
                let cut: String = reason.chars().take(1024).collect();
                encode_report(&serde_json::json!({"error": cut}), tokens, effect)?
            }
            Err(e) => return Err(e),
        };
        self.write(&data)
    }

    fn write(&self, data: &[u8]) -> Result<()> {
        if self.written.get() {
            return Err(Error::AlreadyWritten);
        }
        std::fs::write(&self.message_path, data).map_err(|source| Error::Write {
            path: self.message_path.clone(),
            source,
        })?;
        self.written.set(true);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    struct Fixture {
        dir: PathBuf,
        env: HashMap<String, String>,
    }

    impl Fixture {
        fn new(name: &str) -> Fixture {
            let dir =
                std::env::temp_dir().join(format!("agentrun-step-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("context.json"),
                json!({
                    "run": "refund-order-4711", "runUid": "6f1c", "step": "issue-refund",
                    "role": "step", "attempt": 2, "planRevision": 1,
                    "idempotencyKey": "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2",
                    "results": [
                        {"step": "lookup-order", "result": {"orderId": 4711}},
                        {"step": "draft-refund", "result": {"amount": "23.90 EUR"}}
                    ],
                    "someFutureField": true
                })
                .to_string(),
            )
            .unwrap();
            let env = [
                (ENV_IDEMPOTENCY_KEY, "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2"),
                (ENV_RUN, "refund-order-4711"),
                (ENV_STEP, "issue-refund"),
                (ENV_ATTEMPT, "2"),
                (ENV_PLAN_REVISION, "1"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .chain([
                (
                    ENV_CONTEXT_FILE.to_owned(),
                    dir.join("context.json").display().to_string(),
                ),
                (
                    ENV_MESSAGE_PATH.to_owned(),
                    dir.join("termination-log").display().to_string(),
                ),
            ])
            .collect();
            Fixture { dir, env }
        }

        fn message(&self) -> Value {
            serde_json::from_slice(&std::fs::read(self.dir.join("termination-log")).unwrap())
                .unwrap()
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn identity_comes_from_the_environment_and_the_context() {
        let f = Fixture::new("identity");
        let s = Step::from_env(&f.env).unwrap();
        assert_eq!(s.idempotency_key, "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2");
        assert_eq!(
            (s.run.as_str(), s.step.as_str(), s.attempt, s.plan_revision),
            ("refund-order-4711", "issue-refund", 2, 1)
        );
        assert_eq!(s.context.run_uid.as_deref(), Some("6f1c"));
        assert_eq!(
            s.result_of("draft-refund").unwrap(),
            &json!({"amount": "23.90 EUR"})
        );
        let err = s.result_of("notify").unwrap_err().to_string();
        assert_eq!(
            err,
            "no result of step \"notify\" in the context (has: lookup-order, draft-refund)"
        );
    }

    #[test]
    fn a_missing_key_is_refused_by_name() {
        let mut f = Fixture::new("missing");
        f.env.remove(ENV_IDEMPOTENCY_KEY);
        let err = Step::from_env(&f.env).unwrap_err().to_string();
        assert!(
            err.starts_with("AGENTRUN_IDEMPOTENCY_KEY is not set"),
            "{err}"
        );
    }

    #[test]
    fn succeed_writes_result_and_tokens_once() {
        let f = Fixture::new("succeed");
        let s = Step::from_env(&f.env).unwrap();
        s.succeed(
            &json!({"refundId": "re_0001"}),
            Some(Tokens {
                input: 820,
                output: 140,
            }),
        )
        .unwrap();
        assert_eq!(
            f.message(),
            json!({"result": {"refundId": "re_0001"}, "tokens": {"input": 820, "output": 140}})
        );
        assert!(matches!(
            s.succeed(&json!(1), None),
            Err(Error::AlreadyWritten)
        ));
    }

    #[test]
    fn the_limit_is_exactly_4096_bytes() {
        let overhead = encode_message(&json!(""), None).unwrap().len();
        let fits = "x".repeat(MAX_MESSAGE_BYTES - overhead);
        assert_eq!(encode_message(&json!(fits), None).unwrap().len(), 4096);
        let over = "x".repeat(MAX_MESSAGE_BYTES - overhead + 1);
        assert!(matches!(
            encode_message(&json!(over), None),
            Err(Error::MessageTooLarge { size: 4097 })
        ));
    }

    #[test]
    fn an_oversized_result_is_refused_before_anything_is_written() {
        let f = Fixture::new("oversized");
        let s = Step::from_env(&f.env).unwrap();
        let err = s
            .succeed(&json!({"blob": "x".repeat(5000)}), None)
            .unwrap_err();
        assert!(
            err.to_string().contains("over the 4096-byte limit"),
            "{err}"
        );
        assert!(!f.dir.join("termination-log").exists());
    }

    #[test]
    fn a_failure_reports_what_is_known() {
        let f = Fixture::new("failure");
        let s = Step::from_env(&f.env).unwrap();
        s.report_failure(
            "upstream 503",
            Some(&json!({"pagesDone": 2})),
            Some(Tokens {
                input: 12,
                output: 3,
            }),
        )
        .unwrap();
        assert_eq!(
            f.message(),
            json!({"result": {"error": "upstream 503", "pagesDone": 2}, "tokens": {"input": 12, "output": 3}})
        );
    }

    #[test]
    fn a_verify_probe_answers_with_an_effect_and_what_it_saw() {
        let f = Fixture::new("answer");
        let s = Step::from_env(&f.env).unwrap();
        s.answer(Effect::Applied, &json!({"refundId": "re_0001"}), None)
            .unwrap();
        assert_eq!(
            f.message(),
            json!({"result": {"refundId": "re_0001"}, "effect": "Applied"})
        );
    }

    #[test]
    fn a_failure_says_it_did_not_act_only_when_told() {
        let f = Fixture::new("not-applied");
        let s = Step::from_env(&f.env).unwrap();
        s.report_not_applied("card declined", None, None).unwrap();
        assert_eq!(
            f.message(),
            json!({"result": {"error": "card declined"}, "effect": "NotApplied"})
        );
        let f = Fixture::new("may-have-acted");
        let s = Step::from_env(&f.env).unwrap();
        s.report_failure("gateway timeout", None, None).unwrap();
        assert_eq!(f.message(), json!({"result": {"error": "gateway timeout"}}));
    }

    #[test]
    fn headers_carry_the_key_and_the_trace_context() {
        let mut f = Fixture::new("headers");
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            Step::from_env(&f.env).unwrap().headers(),
            vec![(
                "Idempotency-Key",
                "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2".to_owned()
            )]
        );
        f.env.insert(ENV_TRACEPARENT.to_owned(), tp.to_owned());
        assert_eq!(
            Step::from_env(&f.env).unwrap().headers(),
            vec![
                (
                    "Idempotency-Key",
                    "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2".to_owned()
                ),
                ("traceparent", tp.to_owned())
            ]
        );
    }
}
