//! What the journal refuses, and why.

use std::fmt;

use super::wire::CallKind;

pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a call was, as far as replay compares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallSig {
    pub call_id: String,
    pub kind: CallKind,
    pub request_digest: String,
}

impl fmt::Display for CallSig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} call {:?} with request digest {}",
            self.kind, self.call_id, self.request_digest
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The loop asked something else at a recorded position: a changed prompt
    /// or code. Never a silent mix of old answers and new questions.
    #[error(
        "journal mismatch at call {seq}: recorded {recorded}, asked {asked}; \
         the step's code or input changed since the journal was written"
    )]
    JournalMismatch {
        seq: i64,
        recorded: CallSig,
        asked: CallSig,
    },
    /// A NonIdempotent call was started and never answered, and the operator
    /// has not settled it yet.
    #[error(
        "call {seq} ({call_id:?}, tool {name:?}, key {key}) was started by attempt \
         {attempt} and may have acted; it is settled by the step's verify probe or \
         a Reconcile approval before the step runs again"
    )]
    JournalUnknown {
        seq: i64,
        call_id: String,
        name: String,
        key: String,
        attempt: i32,
    },
    /// A newer attempt has written this journal: this one stops.
    #[error("attempt {by} has taken this step's journal over; attempt {attempt} stops")]
    JournalTakenOver { attempt: i32, by: i32 },
    /// Recording the call would pass the step's `journal.maxBytes`.
    #[error(
        "call {seq} would bring the journal to {would} bytes, over its maxBytes of {max} \
         (steps[].journal.maxBytes)"
    )]
    JournalFull { seq: i64, would: i64, max: i64 },
    /// One answer is over the 128 KiB a call may record.
    #[error(
        "the answer of call {seq} is {size} bytes, over the {max} bytes one call may \
         record: return a reference (an object key) instead of the data"
    )]
    EntryTooLarge { seq: i64, size: usize, max: usize },
    /// The tool said it did not act (recorded; the loop may go on).
    #[error("tool call {seq} ({call_id:?}) did not act: {reason}")]
    NotApplied {
        seq: i64,
        call_id: String,
        reason: String,
    },
    /// The model or tool failed, and nothing says it did not act: nothing
    /// after its intent is recorded, and the step should stop.
    #[error("call {seq} ({call_id:?}) failed: {source}")]
    Call {
        seq: i64,
        call_id: String,
        #[source]
        source: BoxError,
    },
    /// A variable or file the journal needs is missing or malformed.
    #[error("{name} {problem}")]
    Env { name: String, problem: String },
    /// The API server refused or failed a request.
    #[error("{verb} journal chunk {chunk}: the API server answered {status}: {message}")]
    Api {
        verb: &'static str,
        chunk: String,
        status: u16,
        message: String,
    },
    /// The API server could not be reached or its answer not read.
    #[error("{verb} journal chunk {chunk}: {source}")]
    Transport {
        verb: &'static str,
        chunk: String,
        #[source]
        source: BoxError,
    },
    /// A chunk does not hold what the protocol says it holds.
    #[error("journal chunk {chunk} is malformed: {problem}")]
    Corrupt { chunk: String, problem: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
