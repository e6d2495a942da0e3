//! The journal's chunks as this attempt knows them, and the writes that keep
//! them: take the journal over, record a call at a position (append to the
//! last chunk, seal a full one and open the next, or rewrite an entry).
//!
//! ```text
//!   chunk 0 (sealed, 32) ─ chunk 1 (sealed, 32) ─ chunk k (open): every write is one
//!   PUT of chunk k guarded by its resourceVersion, or one POST of chunk k+1
//! ```
//!
//! A write refused because a newer attempt wrote the chunk (its `spec.attempt`
//! is higher: the admission policy answers 403, the CRD's rule 422, a stale
//! resourceVersion 409) stops this attempt with `JournalTakenOver`.

use serde_json::{Map, Value, json};

use super::api::{Api, Refusal};
use super::error::{Error, Result};
use super::wire::{
    CHUNK_MAX_BYTES, CHUNK_MAX_ENTRIES, CallState, Chunk, ChunkSpec, Entry, GROUP_VERSION, KIND,
    Outcome, RUN_LABEL, Settlement,
};

/// Whose journal this is.
#[derive(Clone, Debug, PartialEq)]
pub struct Identity {
    /// `AGENTRUN_JOURNAL`: chunk k is named `<prefix><k>`.
    pub prefix: String,
    pub run: String,
    pub run_uid: String,
    pub step: String,
    pub plan_revision: i64,
    pub attempt: i32,
}

/// How often a write is tried again after the operator wrote a chunk's
/// status (settlements) between this attempt's read and its write.
const STATUS_RACE_RETRIES: usize = 5;

pub(crate) struct Store {
    api: Api,
    id: Identity,
    chunks: Vec<Chunk>,
}

impl Store {
    /// Reads every chunk, in order, until the first that does not exist.
    pub fn load(api: Api, id: Identity) -> Result<Store> {
        let mut chunks: Vec<Chunk> = Vec::new();
        loop {
            let k = chunks.len() as i32;
            let name = format!("{}{k}", id.prefix);
            let Some(c) = api.get(&name)? else { break };
            let first_seq = chunks.last().map_or(0, Chunk::end);
            check_chunk(&c, &id, &name, k, first_seq)?;
            chunks.push(c);
        }
        Ok(Store { api, id, chunks })
    }

    pub fn attempt(&self) -> i32 {
        self.id.attempt
    }

    /// How many calls are recorded.
    pub fn len(&self) -> i64 {
        self.chunks.last().map_or(0, Chunk::end)
    }

    pub fn bytes(&self) -> i64 {
        self.chunks.iter().map(Chunk::bytes).sum()
    }

    fn locate(&self, seq: i64) -> Option<(usize, usize)> {
        let c = self
            .chunks
            .iter()
            .position(|c| c.spec.first_seq <= seq && seq < c.end())?;
        Some((c, (seq - self.chunks[c].spec.first_seq) as usize))
    }

    pub fn entry(&self, seq: i64) -> Option<&Entry> {
        self.locate(seq)
            .map(|(c, i)| &self.chunks[c].spec.entries[i])
    }

    /// The operator's settlement of the call at `seq`, when it has one.
    pub fn settlement(&self, seq: i64) -> Option<&Settlement> {
        let (c, i) = self.locate(seq)?;
        let attempt = self.chunks[c].spec.entries[i].attempt;
        self.chunks[c]
            .status
            .as_ref()?
            .settlements
            .iter()
            .find(|s| s.seq == seq && s.attempt == attempt && s.outcome != Outcome::Unknown)
    }

    /// Writes this attempt's number into the last chunk (or opens the next
    /// one when the last is sealed, or the first when there is none), so an
    /// older attempt still running is refused from then on.
    pub fn take_over(&mut self) -> Result<()> {
        let Some(tail) = self.chunks.last() else {
            return self.open_chunk(Vec::new());
        };
        if tail.spec.attempt > self.id.attempt {
            return Err(self.taken_over(tail.spec.attempt));
        }
        if tail.spec.attempt == self.id.attempt {
            return Ok(());
        }
        if tail.spec.sealed {
            self.open_chunk(Vec::new())
        } else {
            self.update(self.chunks.len() - 1, |_| {})
        }
    }

    /// Records `entry` at its seq: rewrites the entry there, or appends it
    /// when seq is the end of the journal.
    pub fn record(&mut self, entry: Entry) -> Result<()> {
        let seq = entry.seq;
        if let Some((c, i)) = self.locate(seq) {
            if self.chunks[c].spec.sealed {
                return Err(Error::Corrupt {
                    chunk: self.name(c),
                    problem: format!("call {seq} must be rewritten but its chunk is sealed"),
                });
            }
            return self.update(c, move |spec| spec.entries[i] = entry.clone());
        }
        assert_eq!(seq, self.len(), "calls are recorded in order");
        let tail = self.chunks.len() - 1;
        let t = &self.chunks[tail];
        let full = t.spec.entries.len() >= CHUNK_MAX_ENTRIES
            || t.bytes() + entry.bytes() > CHUNK_MAX_BYTES;
        if t.spec.sealed || full {
            if !t.spec.sealed {
                self.update(tail, |spec| spec.sealed = true)?;
            }
            return self.open_chunk(vec![entry]);
        }
        self.update(tail, move |spec| spec.entries.push(entry.clone()))
    }

    fn name(&self, c: usize) -> String {
        format!("{}{c}", self.id.prefix)
    }

    fn taken_over(&self, by: i32) -> Error {
        Error::JournalTakenOver {
            attempt: self.id.attempt,
            by,
        }
    }

    /// Updates chunk `c` with `change` applied and this attempt's number. The
    /// write that fills a chunk seals it, unless its last call is an intent
    /// still to be answered in place.
    fn update(&mut self, c: usize, change: impl Fn(&mut ChunkSpec)) -> Result<()> {
        for _ in 0..STATUS_RACE_RETRIES {
            let mut next = self.chunks[c].clone();
            change(&mut next.spec);
            next.spec.attempt = self.id.attempt;
            let full = next.spec.entries.len() >= CHUNK_MAX_ENTRIES;
            let answered = next
                .spec
                .entries
                .last()
                .is_some_and(|e| e.state != CallState::Intent);
            next.spec.sealed |= full && answered;
            next.api_version = GROUP_VERSION.into();
            next.kind = KIND.into();
            let refusal = match self.api.update(&next)? {
                Ok(saved) => {
                    self.chunks[c] = saved;
                    return Ok(());
                }
                Err(r) => r,
            };
            let name = self.name(c);
            let fresh = self.refetch(&name, &refusal)?;
            if refusal.status == 409 && fresh.spec == self.chunks[c].spec {
                // Only the status moved (the operator settled a call): write again.
                self.chunks[c] = fresh;
                continue;
            }
            return Err(refused("update", name, refusal));
        }
        Err(Error::Api {
            verb: "update",
            chunk: self.name(c),
            status: 409,
            message: "the chunk kept changing under this attempt's writes".into(),
        })
    }

    /// Creates the next chunk, holding `entries`.
    fn open_chunk(&mut self, entries: Vec<Entry>) -> Result<()> {
        let k = self.chunks.len();
        let name = self.name(k);
        let mut metadata = Map::new();
        metadata.insert("name".into(), json!(name));
        metadata.insert("labels".into(), json!({RUN_LABEL: self.id.run}));
        metadata.insert(
            "ownerReferences".into(),
            json!([{"apiVersion": GROUP_VERSION, "kind": "AgentRun",
                    "name": self.id.run, "uid": self.id.run_uid}]),
        );
        let chunk = Chunk {
            api_version: GROUP_VERSION.into(),
            kind: KIND.into(),
            metadata,
            spec: ChunkSpec {
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
            status: None,
        };
        match self.api.create(&chunk)? {
            Ok(saved) => {
                self.chunks.push(saved);
                Ok(())
            }
            Err(refusal) => {
                self.refetch(&name, &refusal)?;
                Err(refused("create", name, refusal))
            }
        }
    }

    /// After a refused write: the chunk as it is now, or `JournalTakenOver`
    /// when a newer attempt has written it.
    fn refetch(&self, name: &str, refusal: &Refusal) -> Result<Chunk> {
        match self.api.get(name)? {
            Some(fresh) if fresh.spec.attempt > self.id.attempt => {
                Err(self.taken_over(fresh.spec.attempt))
            }
            Some(fresh) => Ok(fresh),
            None => Err(Error::Api {
                verb: "get",
                chunk: name.to_owned(),
                status: refusal.status,
                message: format!("{} (and the chunk is gone)", refusal.message),
            }),
        }
    }
}

fn refused(verb: &'static str, chunk: String, r: Refusal) -> Error {
    Error::Api {
        verb,
        chunk,
        status: r.status,
        message: r.message,
    }
}

/// A chunk read back must be this step's, in its place, with its entries
/// numbered from its firstSeq: a journal left by another run of the same
/// name (not yet collected) is refused, never replayed.
fn check_chunk(c: &Chunk, id: &Identity, name: &str, k: i32, first_seq: i64) -> Result<()> {
    let s = &c.spec;
    let problem = if s.run_uid != id.run_uid {
        format!("it belongs to run uid {}, not {}", s.run_uid, id.run_uid)
    } else if s.run_name != id.run || s.step != id.step || s.plan_revision != id.plan_revision {
        format!(
            "it is run {} step {} revision {}, not run {} step {} revision {}",
            s.run_name, s.step, s.plan_revision, id.run, id.step, id.plan_revision
        )
    } else if s.chunk != k || s.first_seq != first_seq {
        format!(
            "it says chunk {} from seq {}, expected chunk {k} from seq {first_seq}",
            s.chunk, s.first_seq
        )
    } else if let Some((i, e)) = s
        .entries
        .iter()
        .enumerate()
        .find(|(i, e)| e.seq != first_seq + *i as i64)
    {
        format!(
            "entry {i} has seq {}, expected {}",
            e.seq,
            first_seq + i as i64
        )
    } else {
        return Ok(());
    };
    Err(Error::Corrupt {
        chunk: name.to_owned(),
        problem,
    })
}

/// What a replay returns for an applied settlement that carries no response.
pub(crate) fn settled_applied(by: &str) -> Value {
    json!({"settled": "Applied", "by": by})
}
