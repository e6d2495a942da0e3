//! The chunks of one step's journal as a simulated attempt keeps them, and
//! the writes the SDKs make (sdk/rust/src/journal/store.rs): take the journal
//! over, then record each call at its position — append to the last chunk
//! (opening the next one when it is full), or rewrite the entry there.
//!
//! Every write is guarded by the chunk's resourceVersion. Transient errors
//! (an API server restarting) are retried for as long as the Pod lives (its
//! task drops the loop when it does not); a write refused because a newer
//! attempt wrote the chunk stops the attempt (`TakenOver`); a 409 whose
//! chunk holds what this write meant to write (an earlier try landed, or
//! only the operator's settlements moved) is taken as it is.

use std::time::Duration;

use agentrun_operator::api::{EffectOutcome, JournalEntry, StepJournal, StepJournalSpec};
use agentrun_operator::labels;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Client;
use kube::api::{Api, PostParams};
use tracing::warn;

/// At most this many entries in one chunk (docs/journal.md).
const CHUNK_MAX_ENTRIES: usize = 32;

/// Whose journal this is: from the Pod's env and labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JournalId {
    /// `AGENTRUN_JOURNAL`: chunk k is `<prefix><k>`.
    pub(crate) prefix: String,
    pub(crate) run: String,
    pub(crate) run_uid: String,
    pub(crate) step: String,
    pub(crate) plan_revision: i64,
    pub(crate) attempt: i32,
    /// `AGENTRUN_IDEMPOTENCY_KEY`: each call's key derives from it.
    pub(crate) step_key: String,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    #[error(
        "the journal was taken over by attempt {by} (this is attempt {attempt}): JournalTakenOver"
    )]
    TakenOver { attempt: i32, by: i32 },
    #[error("{verb} journal chunk {chunk} refused: {code} {message}")]
    Refused {
        verb: &'static str,
        chunk: String,
        code: u16,
        message: String,
    },
    #[error("journal chunk {chunk}: {problem}")]
    Corrupt { chunk: String, problem: String },
}

pub(crate) struct Store {
    api: Api<StepJournal>,
    id: JournalId,
    chunks: Vec<StepJournal>,
}

/// Whether an API error is worth trying again.
fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code >= 500 || s.code == 429 || s.code == 408,
        _ => true,
    }
}

async fn backoff(delay: &mut Duration) {
    tokio::time::sleep(*delay).await;
    *delay = (*delay * 2).min(Duration::from_secs(2));
}

impl Store {
    /// Reads every chunk, in order, until the first that does not exist.
    pub(crate) async fn load(client: Client, ns: &str, id: JournalId) -> Result<Store, StoreError> {
        let mut store = Store {
            api: Api::namespaced(client, ns),
            id,
            chunks: Vec::new(),
        };
        loop {
            let name = store.name(store.chunks.len());
            let Some(c) = store.get(&name).await? else {
                return Ok(store);
            };
            if c.spec.run_uid != store.id.run_uid || c.spec.chunk as usize != store.chunks.len() {
                return Err(StoreError::Corrupt {
                    chunk: name,
                    problem: format!("it is chunk {} of run uid {}", c.spec.chunk, c.spec.run_uid),
                });
            }
            store.chunks.push(c);
        }
    }

    fn name(&self, k: usize) -> String {
        format!("{}{k}", self.id.prefix)
    }

    async fn get(&self, name: &str) -> Result<Option<StepJournal>, StoreError> {
        let mut delay = Duration::from_millis(50);
        loop {
            match self.api.get_opt(name).await {
                Ok(c) => return Ok(c),
                Err(e) if transient(&e) => {
                    warn!(chunk = name, error = %e, "reading a journal chunk; retrying")
                }
                Err(e) => return Err(refused("get", name, e)),
            }
            backoff(&mut delay).await;
        }
    }

    /// How many calls are recorded.
    pub(crate) fn len(&self) -> i64 {
        self.chunks
            .last()
            .map_or(0, |c| c.spec.first_seq + c.spec.entries.len() as i64)
    }

    fn locate(&self, seq: i64) -> Option<(usize, usize)> {
        let c = self.chunks.iter().position(|c| {
            c.spec.first_seq <= seq && seq < c.spec.first_seq + c.spec.entries.len() as i64
        })?;
        Some((c, (seq - self.chunks[c].spec.first_seq) as usize))
    }

    pub(crate) fn entry(&self, seq: i64) -> Option<&JournalEntry> {
        self.locate(seq)
            .map(|(c, i)| &self.chunks[c].spec.entries[i])
    }

    /// The operator's settlement of the intent `attempt` recorded at `seq`.
    pub(crate) fn settlement(&self, seq: i64, attempt: i32) -> Option<EffectOutcome> {
        let (c, _) = self.locate(seq)?;
        self.chunks[c]
            .status
            .iter()
            .flat_map(|s| s.settlements.iter())
            .find(|s| s.seq == seq && s.attempt == attempt)
            .map(|s| s.outcome)
    }

    /// Writes this attempt's number into the last chunk (or opens the next
    /// one), so an older attempt still running is refused from then on.
    pub(crate) async fn take_over(&mut self) -> Result<(), StoreError> {
        let Some(tail) = self.chunks.last() else {
            return self.open_chunk(Vec::new()).await;
        };
        if tail.spec.attempt > self.id.attempt {
            return Err(self.taken_over(tail.spec.attempt));
        }
        if tail.spec.attempt == self.id.attempt {
            return Ok(());
        }
        if tail.spec.sealed {
            self.open_chunk(Vec::new()).await
        } else {
            self.update(self.chunks.len() - 1, |_| {}).await
        }
    }

    /// Records `entry` at its seq: rewrites the entry there, or appends it.
    pub(crate) async fn record(&mut self, entry: JournalEntry) -> Result<(), StoreError> {
        if let Some((c, i)) = self.locate(entry.seq) {
            return self
                .update(c, move |spec| spec.entries[i] = entry.clone())
                .await;
        }
        let tail = self.chunks.len() - 1;
        let t = &self.chunks[tail].spec;
        if t.sealed || t.entries.len() >= CHUNK_MAX_ENTRIES {
            if !t.sealed {
                self.update(tail, |spec| spec.sealed = true).await?;
            }
            return self.open_chunk(vec![entry]).await;
        }
        self.update(tail, move |spec| spec.entries.push(entry.clone()))
            .await
    }

    fn taken_over(&self, by: i32) -> StoreError {
        StoreError::TakenOver {
            attempt: self.id.attempt,
            by,
        }
    }

    /// Replaces chunk `c` with `change` applied and this attempt's number.
    async fn update(
        &mut self,
        c: usize,
        change: impl Fn(&mut StepJournalSpec),
    ) -> Result<(), StoreError> {
        let name = self.name(c);
        let mut delay = Duration::from_millis(50);
        loop {
            let mut next = self.chunks[c].clone();
            change(&mut next.spec);
            next.spec.attempt = self.id.attempt;
            next.metadata.managed_fields = None;
            match self.api.replace(&name, &PostParams::default(), &next).await {
                Ok(saved) => {
                    self.chunks[c] = saved;
                    return Ok(());
                }
                Err(e) if transient(&e) => {
                    warn!(chunk = %name, error = %e, "writing a journal chunk; retrying");
                    backoff(&mut delay).await;
                }
                Err(e) => {
                    // Refused: what does the chunk hold now?
                    let fresh = self
                        .get(&name)
                        .await?
                        .ok_or_else(|| refused("update", &name, e))?;
                    if fresh.spec.attempt > self.id.attempt {
                        return Err(self.taken_over(fresh.spec.attempt));
                    }
                    if fresh.spec == next.spec {
                        self.chunks[c] = fresh; // an earlier try landed
                        return Ok(());
                    }
                    if fresh.spec == self.chunks[c].spec {
                        self.chunks[c] = fresh; // only the status moved
                        continue;
                    }
                    return Err(StoreError::Corrupt {
                        chunk: name,
                        problem: "it changed under this attempt's writes".into(),
                    });
                }
            }
        }
    }

    /// Creates the next chunk, holding `entries`, owned by the run.
    async fn open_chunk(&mut self, entries: Vec<JournalEntry>) -> Result<(), StoreError> {
        let k = self.chunks.len();
        let name = self.name(k);
        let mut chunk = StepJournal::new(
            &name,
            StepJournalSpec {
                run_name: self.id.run.clone(),
                run_uid: self.id.run_uid.clone(),
                step: self.id.step.clone(),
                plan_revision: self.id.plan_revision,
                chunk: k as i32,
                first_seq: self.len(),
                attempt: self.id.attempt,
                sealed: false,
                entries,
            },
        );
        chunk.metadata.labels = Some([(labels::RUN.to_owned(), self.id.run.clone())].into());
        chunk.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "agentrun.dev/v1alpha1".into(),
            kind: "AgentRun".into(),
            name: self.id.run.clone(),
            uid: self.id.run_uid.clone(),
            ..OwnerReference::default()
        }]);
        let mut delay = Duration::from_millis(50);
        loop {
            match self.api.create(&PostParams::default(), &chunk).await {
                Ok(saved) => {
                    self.chunks.push(saved);
                    return Ok(());
                }
                Err(e) if transient(&e) => {
                    warn!(chunk = %name, error = %e, "creating a journal chunk; retrying");
                    backoff(&mut delay).await;
                }
                Err(e) => {
                    let fresh = self
                        .get(&name)
                        .await?
                        .ok_or_else(|| refused("create", &name, e))?;
                    if fresh.spec.attempt > self.id.attempt {
                        return Err(self.taken_over(fresh.spec.attempt));
                    }
                    if fresh.spec == chunk.spec {
                        self.chunks.push(fresh); // an earlier try landed
                        return Ok(());
                    }
                    return Err(StoreError::Corrupt {
                        chunk: name,
                        problem: "another attempt created it".into(),
                    });
                }
            }
        }
    }
}

fn refused(verb: &'static str, chunk: &str, e: kube::Error) -> StoreError {
    let (code, message) = match e {
        kube::Error::Api(s) => (s.code, s.message),
        other => (0, other.to_string()),
    };
    StoreError::Refused {
        verb,
        chunk: chunk.to_owned(),
        code,
        message,
    }
}
