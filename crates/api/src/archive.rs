//! A long run's status stays as cheap to write at its 500th checkpoint as at
//! its 10th: the oldest finished checkpoints are stored together, compressed,
//! in `status.archivedSteps`, and `status.steps` holds the rest.
//!
//! ```text
//!   in memory   steps: [c0 c1 … c474 | c475 … c499 c500]      every checkpoint, in start order
//!   stored      archivedSteps: {count: 475, data: gzip(JSON [c0 … c474])}
//!               steps: [c475 … c500]
//! ```
//!
//! The split is a pure function of the checkpoints (whole batches of the
//! longest prefix that is finished and committed, leaving the newest in
//! `steps`), made when the status is serialized and undone when it is read:
//! everything that reads `AgentRunStatus::steps` (the engine, the plugin, the
//! console, the record of a finished run) sees every checkpoint, and a status
//! write that moves checkpoints into the archive is one write, fenced by the
//! resourceVersion like any other (D3, D4): the checkpoints are never in
//! neither place, and a checkpoint is archived only once it can no longer
//! change.
//!
//! Why it matters: the apiserver decodes, validates, converts and encodes the
//! whole object on every status write, per field of every checkpoint; one
//! compressed string costs it a fraction of the structured checkpoints it
//! holds (docs/performance-history.md, "Long runs").

use std::cell::Cell;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{CheckpointState, StepCheckpoint};

/// Checkpoints are moved into the archive this many at a time, so the
/// archive changes once per batch, not on every write.
pub const ARCHIVE_BATCH: usize = 25;
/// At least this many of the newest checkpoints stay in `status.steps`
/// (readable with `kubectl get -o yaml`); a run of fewer than
/// `ARCHIVE_BATCH + KEEP_INLINE` checkpoints has no archive.
pub const KEEP_INLINE: usize = 25;

/// Whether statuses are serialized with an archive. The controller turns it
/// off when the API server does not keep `status.archivedSteps` (an AgentRun
/// CRD older than the operator prunes it): every checkpoint then stays in
/// `status.steps`, as before the archive existed.
static ENABLED: AtomicBool = AtomicBool::new(true);

/// See [`ENABLED`].
pub fn set_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// See [`ENABLED`].
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed) && !INLINE.get()
}

thread_local! {
    /// Set within [`inline`].
    static INLINE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with statuses serialized as if there were no archive (on this
/// thread only): what the status would weigh with every checkpoint in
/// `status.steps`. D11's compaction measures that, so what a long run keeps
/// of each checkpoint does not depend on how well its checkpoints compress.
pub fn inline<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            INLINE.set(self.0);
        }
    }
    let _reset = Reset(INLINE.replace(true));
    f()
}

/// The oldest checkpoints of a long run, compressed.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ArchivedSteps {
    /// How many checkpoints `data` holds: the run's first, in start order.
    /// `status.steps` continues where they end.
    pub count: i32,
    /// The checkpoints as a JSON array, gzip-compressed, base64-encoded
    /// (`kubectl agentrun get` shows them with the others; by hand:
    /// `base64 -d | gunzip`).
    pub data: String,
}

/// `status.steps` and `status.archivedSteps` as the API server stores them.
#[derive(JsonSchema, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct StoredSteps {
    /// One checkpoint per (step, plan revision) that has started, in start
    /// order; in a long run, the ones after `archivedSteps`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub steps: Vec<StepCheckpoint>,
    /// A long run's oldest finished checkpoints, compressed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archived_steps: Option<ArchivedSteps>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StoredStepsRef<'a> {
    #[serde(skip_serializing_if = "<[StepCheckpoint]>::is_empty")]
    steps: &'a [StepCheckpoint],
    #[serde(skip_serializing_if = "Option::is_none")]
    archived_steps: Option<ArchivedSteps>,
}

/// A checkpoint that can no longer change: finished, committed, its Pod not
/// being stopped.
fn settled(c: &StepCheckpoint) -> bool {
    c.phase.is_terminal() && c.checkpoint == CheckpointState::Committed && !c.stopping
}

/// How many of `steps` go into the archive: whole batches of the settled
/// prefix, leaving at least [`KEEP_INLINE`] in `status.steps`.
pub fn archived_len(steps: &[StepCheckpoint]) -> usize {
    if !enabled() {
        return 0;
    }
    let settled = steps.iter().take_while(|c| settled(c)).count();
    let n = settled.min(steps.len().saturating_sub(KEEP_INLINE));
    n - n % ARCHIVE_BATCH
}

/// Why a stored archive could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("status.archivedSteps.data is not base64: {0}")]
    Base64(#[from] base64::DecodeError),
    #[error("status.archivedSteps.data is not gzip: {0}")]
    Gzip(#[from] std::io::Error),
    #[error("status.archivedSteps.data is not a JSON array of checkpoints: {0}")]
    Json(#[from] serde_json::Error),
    #[error("status.archivedSteps holds {found} checkpoints, its count says {count}")]
    Count { count: i32, found: usize },
}

/// Recently made and read archives, by their input (compared whole, not by
/// a hash alone): a status is serialized twice per write (the diff's old and
/// new) and read on every watch event, and the archive changes once per batch.
struct Memo<V> {
    entries: Vec<(u64, Box<[u8]>, V)>,
}

const MEMO_ENTRIES: usize = 16;

impl<V: Clone> Memo<V> {
    const fn new() -> Self {
        Memo {
            entries: Vec::new(),
        }
    }

    fn get(&self, input: &[u8]) -> Option<V> {
        let h = hash_of(input);
        self.entries
            .iter()
            .find(|(k, i, _)| *k == h && **i == *input)
            .map(|(_, _, v)| v.clone())
    }

    fn put(&mut self, input: &[u8], v: V) {
        if self.entries.len() == MEMO_ENTRIES {
            self.entries.remove(0);
        }
        self.entries.push((hash_of(input), input.into(), v));
    }
}

static ENCODED: Mutex<Memo<String>> = Mutex::new(Memo::new());
static DECODED: Mutex<Memo<Vec<StepCheckpoint>>> = Mutex::new(Memo::new());

fn hash_of(bytes: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// The archive of `steps`: gzip (no name, no time: the same checkpoints give
/// the same bytes, whichever replica writes them) of their JSON, base64.
pub fn encode(steps: &[StepCheckpoint]) -> Result<ArchivedSteps, ArchiveError> {
    let json = serde_json::to_vec(steps)?;
    let compress = || -> Result<String, std::io::Error> {
        let mut gz = flate2::GzBuilder::new().write(Vec::new(), flate2::Compression::default());
        gz.write_all(&json)?;
        Ok(BASE64.encode(gz.finish()?))
    };
    let data = match ENCODED.lock().ok().and_then(|m| m.get(&json)) {
        Some(data) => data,
        None => {
            let data = compress()?;
            if let Ok(mut memo) = ENCODED.lock() {
                memo.put(&json, data.clone());
            }
            data
        }
    };
    Ok(ArchivedSteps {
        count: i32::try_from(steps.len()).unwrap_or(i32::MAX),
        data,
    })
}

/// The checkpoints an archive holds.
pub fn decode(archive: &ArchivedSteps) -> Result<Vec<StepCheckpoint>, ArchiveError> {
    if let Some(steps) = DECODED
        .lock()
        .ok()
        .and_then(|m| m.get(archive.data.as_bytes()))
    {
        return Ok(steps);
    }
    let gz = BASE64.decode(archive.data.as_bytes())?;
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(gz.as_slice()).read_to_end(&mut json)?;
    let steps: Vec<StepCheckpoint> = serde_json::from_slice(&json)?;
    if i32::try_from(steps.len()).ok() != Some(archive.count) {
        return Err(ArchiveError::Count {
            count: archive.count,
            found: steps.len(),
        });
    }
    if let Ok(mut memo) = DECODED.lock() {
        memo.put(archive.data.as_bytes(), steps.clone());
    }
    Ok(steps)
}

/// `#[serde(flatten, with = "archive")]` on `AgentRunStatus::steps`: writes
/// `steps` and `archivedSteps`.
pub fn serialize<S: Serializer>(steps: &[StepCheckpoint], s: S) -> Result<S::Ok, S::Error> {
    let n = archived_len(steps);
    let archived_steps = if n == 0 {
        None
    } else {
        Some(encode(&steps[..n]).map_err(serde::ser::Error::custom)?)
    };
    StoredStepsRef {
        steps: &steps[n..],
        archived_steps,
    }
    .serialize(s)
}

/// Reads `steps` and `archivedSteps` back into every checkpoint, in order.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<StepCheckpoint>, D::Error> {
    let stored = StoredSteps::deserialize(d)?;
    match stored.archived_steps {
        None => Ok(stored.steps),
        Some(archive) => {
            let mut steps = decode(&archive).map_err(serde::de::Error::custom)?;
            steps.extend(stored.steps);
            Ok(steps)
        }
    }
}

#[cfg(test)]
mod tests;
