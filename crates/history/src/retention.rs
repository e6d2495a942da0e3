//! How long records are kept, and what the count per namespace does (D18, D22).
//!
//! ```text
//!   record ──▶ finished = min(the finish it records, when the store took it, now)
//!          ──▶ finished before now − max_age?  removed (expired)
//!          ──▶ otherwise kept, whatever the count: past max_per_namespace the
//!              namespace is reported (log, metric), never pruned early
//! ```
//!
//! A record inside its retention is what keeps a GitOps re-creation from
//! running again. Were the count to remove the oldest first, anyone who may
//! create runs could flush a namespace's history with cheap runs and have an
//! old run execute again on its next re-sync; so the count only alerts.
//! A record's own time is bounded by when the store took it (the API server's
//! `creationTimestamp`, PostgreSQL's `recorded_at`), so one claiming a finish
//! in the future still leaves when its window, counted from then, ends.

use std::collections::BTreeMap;

use jiff::{SignedDuration, Timestamp};

/// How long records are kept, and how many per namespace are expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Records of runs that finished longer ago than this are removed; a
    /// run created again after it runs again.
    pub max_age: SignedDuration,
    /// Most records a namespace is expected to hold within `max_age`: more
    /// are reported ([`Pruned::over_cap`]) and kept.
    pub max_per_namespace: usize,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            max_age: SignedDuration::from_hours(30 * 24),
            max_per_namespace: 1000,
        }
    }
}

impl Retention {
    /// The first finish time still inside the window at `now`.
    pub fn horizon(&self, now: Timestamp) -> Timestamp {
        now.checked_sub(self.max_age).unwrap_or(Timestamp::MIN)
    }
}

/// What one pruning did, and what it saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Records removed: past the retention window.
    pub expired: u64,
    /// Per namespace holding more records inside the window than
    /// `max_per_namespace`: how many more. Those records stay.
    pub over_cap: BTreeMap<String, u64>,
}

impl Pruned {
    /// Adds one namespace's count past the cap, if it has one.
    pub fn note_over_cap(&mut self, namespace: &str, over: u64) {
        if over > 0 {
            self.over_cap.insert(namespace.to_owned(), over);
        }
    }
}

/// When a record counts as finished for its retention: the finish it
/// records, but never later than when its store took it, nor than `now`.
/// Without a recorded finish, when it was stored; without either, `now`.
pub fn finished_for_retention(
    recorded: Option<Timestamp>,
    stored: Option<Timestamp>,
    now: Timestamp,
) -> Timestamp {
    [recorded, stored]
        .into_iter()
        .flatten()
        .fold(now, Timestamp::min)
}

/// Of one namespace's records, `(name, finished)` (finished as
/// [`finished_for_retention`] says): the names past the window, to remove,
/// and how many of the others the namespace holds beyond
/// `max_per_namespace`, which are kept.
pub fn to_prune(
    records: Vec<(String, Timestamp)>,
    now: Timestamp,
    keep: &Retention,
) -> (Vec<String>, u64) {
    let horizon = keep.horizon(now);
    let (expired, kept): (Vec<_>, Vec<_>) =
        records.into_iter().partition(|(_, done)| *done < horizon);
    let mut expired: Vec<String> = expired.into_iter().map(|(name, _)| name).collect();
    expired.sort();
    let over = kept.len().saturating_sub(keep.max_per_namespace);
    (expired, u64::try_from(over).unwrap_or(u64::MAX))
}
