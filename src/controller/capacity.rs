//! How many runs may be active at once, and which queued run starts next.
//!
//! A platform team caps the runs in flight: per namespace
//! (`--max-active-runs-per-namespace`) and in all namespaces the operator
//! watches (`--max-active-runs`). A run is active from its `startedAt` (the
//! engine writes it when the run may start) until it finishes; one that has
//! not started waits in `Queued`, and starts when a place frees. The queue's
//! order is the platform team's priority first — the run's
//! `podTemplate.priorityClassName`, ranked by `--queue-priority-classes`
//! (first listed first; a class not listed, or none, after every listed one)
//! — then namespaces take turns ([`turns`]: the namespace with the fewest
//! active runs first, so one namespace's burst cannot hold every place of
//! the total), then creation time, namespace and name. Run authors choose a
//! class only if they may use it (the chart's runs policy, D17); they cannot
//! rank it. A started run is never queued again — one that waits for an
//! approval, a signal or a timer keeps its place until it finishes — so
//! raising or lowering a cap, or restarting the operator, never stops what
//! runs and never starts anything twice.
//!
//! The run cache may lag this process's own status writes: a run admitted a
//! moment ago may not show its `startedAt` yet. Each admission is held here
//! (the Job controller's expectations) until the cache shows it or
//! [`HOLD`] passes, and counted as active meanwhile, so two reconciles never
//! give the same place to two runs. The check and the hold are made under
//! one lock.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::api::AgentRun;
use crate::engine::Queued;

/// How long an admission this process made counts without the cache showing it.
pub const HOLD: Duration = Duration::from_secs(30);

/// The caps; `None` is no cap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    pub per_namespace: Option<u32>,
    pub total: Option<u32>,
    /// PriorityClass names, the first queued first (`--queue-priority-classes`).
    pub priority_classes: Vec<String>,
}

impl Caps {
    pub fn any(&self) -> bool {
        self.per_namespace.is_some() || self.total.is_some()
    }

    /// Where a run with this PriorityClass stands in the queue: its place in
    /// the list, or after every listed class.
    pub fn rank(&self, class: Option<&str>) -> usize {
        class
            .and_then(|c| self.priority_classes.iter().position(|p| p == c))
            .unwrap_or(self.priority_classes.len())
    }
}

type Key = (String, String);

/// What the queue needs of a run.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Seat {
    /// The rank of its PriorityClass (`Caps::rank`), then creation time in
    /// seconds, namespace and name: the queue's order.
    pub rank: usize,
    pub created: i64,
    pub namespace: String,
    pub name: String,
    pub started: bool,
    /// Finished, being deleted, or cancelled before it started: holds no
    /// place and waits for none.
    pub gone: bool,
}

impl Seat {
    pub fn of(run: &AgentRun, caps: &Caps) -> Seat {
        let status = run.status.as_ref();
        let class = run
            .spec
            .pod_template
            .as_ref()
            .and_then(|p| p.priority_class_name.as_deref());
        Seat {
            rank: caps.rank(class),
            created: run
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(0, |t| t.0.as_second()),
            namespace: run.metadata.namespace.clone().unwrap_or_default(),
            name: run.metadata.name.clone().unwrap_or_default(),
            started: status.is_some_and(|s| s.started_at.is_some()),
            gone: run.metadata.deletion_timestamp.is_some()
                || status
                    .and_then(|s| s.phase)
                    .is_some_and(|p| p.is_terminal())
                || (run.spec.cancel && status.is_none_or(|s| s.started_at.is_none())),
        }
    }

    fn key(&self) -> Key {
        (self.namespace.clone(), self.name.clone())
    }
}

/// The caps and the admissions this process made that the cache may not show.
#[derive(Default)]
pub struct Capacity {
    caps: Caps,
    held: Mutex<HashMap<Key, Instant>>,
}

impl Capacity {
    pub fn new(caps: Caps) -> Capacity {
        Capacity {
            caps,
            held: Mutex::new(HashMap::new()),
        }
    }

    pub fn caps(&self) -> &Caps {
        &self.caps
    }

    /// Whether `run` may start now, given every run the cache shows; `None`
    /// admits it (and holds its place until the cache shows it started).
    pub fn admit(&self, run: &Seat, all: &[Seat]) -> Option<Queued> {
        if run.started || run.gone || !self.caps.any() {
            return None;
        }
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // A run's own hold (its last admission's write did not land) is
        // its place, not one taken from it.
        held.retain(|k, at| {
            now.duration_since(*at) < HOLD
                && *k != run.key()
                && all
                    .iter()
                    .find(|s| s.namespace == k.0 && s.name == k.1)
                    .is_some_and(|s| !s.started && !s.gone)
        });
        let verdict = place(&self.caps, run, all, &held);
        if verdict.is_none() {
            held.insert(run.key(), now);
        }
        verdict
    }
}

/// Where `run` stands: every run that has not started, in [`turns`] order,
/// is given a place while one is free (its namespace's and the total); `run`
/// starts if it is given one.
fn place(caps: &Caps, run: &Seat, all: &[Seat], held: &HashMap<Key, Instant>) -> Option<Queued> {
    let mut active: BTreeMap<&str, u32> = BTreeMap::new();
    let mut total = 0u32;
    for s in all.iter().filter(|s| !s.gone) {
        if s.started || held.contains_key(&s.key()) {
            *active.entry(s.namespace.as_str()).or_default() += 1;
            total += 1;
        }
    }
    let mut waiting: Vec<&Seat> = all
        .iter()
        .filter(|s| !s.gone && !s.started && !held.contains_key(&s.key()))
        .collect();
    if !waiting.iter().any(|s| s.key() == run.key()) {
        waiting.push(run);
    }
    let waiting = turns(waiting, &active);
    // Places given in order; a run its namespace's cap holds back does not
    // hold back the runs of other namespaces behind it.
    let mut ahead_in_namespace = 0u32;
    for s in waiting {
        let in_ns = active.get(s.namespace.as_str()).copied().unwrap_or(0);
        let ns_full = caps.per_namespace.is_some_and(|c| in_ns >= c);
        let all_full = caps.total.is_some_and(|c| total >= c);
        if s.key() == run.key() {
            if !ns_full && !all_full {
                return None;
            }
            let why = if ns_full {
                format!(
                    "{in_ns} of {} runs active in namespace {} (maxActiveRunsPerNamespace)",
                    caps.per_namespace.unwrap_or_default(),
                    run.namespace
                )
            } else {
                format!(
                    "{total} of {} runs active in all namespaces (maxActiveRuns)",
                    caps.total.unwrap_or_default()
                )
            };
            return Some(Queued {
                position: ahead_in_namespace + 1,
                why,
            });
        }
        if !ns_full && !all_full {
            *active.entry(s.namespace.as_str()).or_default() += 1;
            total += 1;
        } else if s.namespace == run.namespace {
            ahead_in_namespace += 1;
        }
    }
    None
}

/// The order in which the waiting runs are given places: namespaces take
/// turns. Each namespace's own queue is in [`Seat`] order (class rank, then
/// creation); its k-th waiting run (from 0) is in round `active + k`, where
/// `active` is how many of its runs hold places now. Places go by class rank
/// first, then round, then the seat's own order. So under the total cap the
/// namespace with the fewest active runs gets the next place, and a burst in
/// one namespace waits behind a single run of another instead of ahead of it.
/// Everything here is read from the runs (their `startedAt`, phase, creation
/// time and names) and this process's holds on admissions it just wrote, so
/// an operator that restarts derives the same order.
fn turns<'s>(mut waiting: Vec<&'s Seat>, active: &BTreeMap<&str, u32>) -> Vec<&'s Seat> {
    waiting.sort();
    let mut next: BTreeMap<&str, u32> = BTreeMap::new();
    let mut ranked: Vec<(usize, u32, &Seat)> = waiting
        .into_iter()
        .map(|s| {
            let ns = s.namespace.as_str();
            let k = next
                .entry(ns)
                .or_insert_with(|| active.get(ns).copied().unwrap_or(0));
            let round = *k;
            *k += 1;
            (s.rank, round, s)
        })
        .collect();
    ranked.sort();
    ranked.into_iter().map(|(_, _, s)| s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat(ns: &str, name: &str, created: i64, started: bool) -> Seat {
        Seat {
            rank: 0,
            created,
            namespace: ns.into(),
            name: name.into(),
            started,
            gone: false,
        }
    }

    fn cap(per_namespace: Option<u32>, total: Option<u32>) -> Capacity {
        Capacity::new(Caps {
            per_namespace,
            total,
            priority_classes: Vec::new(),
        })
    }

    #[test]
    fn runs_start_in_creation_order_up_to_the_cap() {
        let c = cap(Some(2), None);
        let all = vec![
            seat("a", "r3", 3, false),
            seat("a", "r1", 1, true),
            seat("a", "r2", 2, false),
            seat("a", "r4", 4, false),
        ];
        // r2 is first in line: it takes the one free place.
        assert_eq!(c.admit(&all[2], &all), None);
        // r3 waits: r1 and r2 (held, the cache does not show it yet) are active.
        let q = c.admit(&all[0], &all).unwrap();
        assert_eq!(q.position, 1);
        assert_eq!(
            q.why,
            "2 of 2 runs active in namespace a (maxActiveRunsPerNamespace)"
        );
        assert_eq!(c.admit(&all[3], &all).unwrap().position, 2);
    }

    #[test]
    fn a_later_run_does_not_jump_the_queue() {
        let c = cap(Some(1), None);
        // One place free; r2 was created first, so r3 asking first waits.
        let all = vec![seat("a", "r2", 2, false), seat("a", "r3", 3, false)];
        assert_eq!(c.admit(&all[1], &all).map(|q| q.position), Some(1));
        assert_eq!(c.admit(&all[0], &all), None);
    }

    /// The platform team's classes go first, in the order listed; within a
    /// class, and for every run without a listed class, creation order.
    #[test]
    fn a_listed_priority_class_goes_first_then_creation_order() {
        let caps = Caps {
            per_namespace: Some(1),
            total: None,
            priority_classes: vec!["critical".into(), "high".into()],
        };
        assert_eq!(caps.rank(Some("critical")), 0);
        assert_eq!(caps.rank(Some("high")), 1);
        assert_eq!(caps.rank(Some("unlisted")), 2);
        assert_eq!(caps.rank(None), 2);
        let c = Capacity::new(caps);
        let ranked = |name: &str, created: i64, rank: usize| Seat {
            rank,
            ..seat("a", name, created, false)
        };
        let all = vec![
            seat("a", "r1", 1, true),
            ranked("plain", 2, 2),
            ranked("high", 3, 1),
            ranked("critical", 4, 0),
            ranked("critical-later", 5, 0),
        ];
        let position = |i: usize| c.admit(&all[i], &all).map(|q| q.position);
        assert_eq!(
            position(3),
            Some(1),
            "critical is first though created last but one"
        );
        assert_eq!(position(4), Some(2));
        assert_eq!(position(2), Some(3));
        assert_eq!(position(1), Some(4), "the oldest run, unranked, is last");
    }

    #[test]
    fn a_finished_or_cancelled_run_frees_its_place() {
        let c = cap(Some(1), None);
        let mut all = vec![seat("a", "r1", 1, true), seat("a", "r2", 2, false)];
        assert!(c.admit(&all[1], &all).is_some());
        all[0].gone = true;
        assert_eq!(c.admit(&all[1], &all), None);
    }

    #[test]
    fn namespaces_queue_apart_under_their_own_cap_and_share_the_total() {
        let c = cap(Some(1), Some(2));
        let all = vec![
            seat("a", "a1", 1, true),
            seat("a", "a2", 2, false),
            seat("b", "b1", 3, false),
            seat("c", "c1", 4, false),
        ];
        // a2 is held back by a's cap, not by the total: b1 behind it starts.
        assert!(c.admit(&all[1], &all).is_some());
        assert_eq!(c.admit(&all[2], &all), None);
        // Now a1 and b1 hold both places of the total.
        let q = c.admit(&all[3], &all).unwrap();
        assert_eq!(
            (q.position, q.why.as_str()),
            (1, "2 of 2 runs active in all namespaces (maxActiveRuns)")
        );
    }

    /// Under the total cap alone, namespace a's five runs came first and took
    /// both places; b's one run, created last, gets the next place a frees,
    /// not the place after a's three others.
    #[test]
    fn the_next_place_goes_to_the_namespace_with_fewest_active_runs() {
        let c = cap(None, Some(2));
        let mut all = vec![
            seat("a", "a1", 1, true),
            seat("a", "a2", 2, true),
            seat("a", "a3", 3, false),
            seat("a", "a4", 4, false),
            seat("a", "a5", 5, false),
            seat("b", "b1", 6, false),
        ];
        assert_eq!(c.admit(&all[5], &all).map(|q| q.position), Some(1));
        all[0].gone = true;
        assert_eq!(c.admit(&all[2], &all).map(|q| q.position), Some(1));
        assert_eq!(c.admit(&all[5], &all), None, "b1 takes a1's place");
        // a2 ends: b holds one place, a none, so a's oldest is next.
        all[1].gone = true;
        assert_eq!(
            c.admit(&all[3], &all).map(|q| q.position),
            Some(1),
            "a3 is given the place, a4 is first behind it"
        );
        assert_eq!(c.admit(&all[2], &all), None);
    }

    /// With nothing active, places alternate between the namespaces, each in
    /// its own creation order; ties in a round go to the older run.
    #[test]
    fn namespaces_take_turns_each_in_its_own_order() {
        let waiting = [
            seat("a", "a1", 1, false),
            seat("a", "a2", 2, false),
            seat("a", "a3", 3, false),
            seat("b", "b1", 4, false),
            seat("b", "b2", 5, false),
            seat("c", "c1", 6, false),
        ];
        let active = BTreeMap::from([("c", 2u32)]);
        let order: Vec<&str> = turns(waiting.iter().collect(), &active)
            .into_iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(order, ["a1", "b1", "a2", "b2", "a3", "c1"]);
    }

    /// The platform team's class still goes first: a ranked run of the
    /// busiest namespace starts before an unranked run of an idle one.
    #[test]
    fn a_listed_class_goes_before_the_turns_of_namespaces() {
        let c = Capacity::new(Caps {
            per_namespace: None,
            total: Some(2),
            priority_classes: vec!["critical".into()],
        });
        let all = vec![
            seat("a", "a1", 1, true),
            Seat {
                rank: 0,
                ..seat("a", "urgent", 3, false)
            },
            Seat {
                rank: 1,
                ..seat("b", "b1", 2, false)
            },
        ];
        assert_eq!(c.admit(&all[2], &all).map(|q| q.position), Some(1));
        assert_eq!(c.admit(&all[1], &all), None);
    }

    /// An operator started again has no holds and no memory of who went last:
    /// the same runs, in any order, give the same verdicts.
    #[test]
    fn the_order_comes_from_the_runs_alone() {
        let all = vec![
            seat("a", "a1", 1, true),
            seat("a", "a2", 2, false),
            seat("a", "a3", 3, false),
            seat("b", "b1", 4, false),
            seat("c", "c1", 5, true),
            seat("c", "c2", 6, false),
        ];
        let verdicts = |seats: &[Seat]| {
            let mut v: Vec<(String, Option<u32>)> = seats
                .iter()
                .map(|s| {
                    let fresh = cap(None, Some(3));
                    (s.name.clone(), fresh.admit(s, seats).map(|q| q.position))
                })
                .collect();
            v.sort();
            v
        };
        let mut shuffled = all.clone();
        shuffled.reverse();
        shuffled.swap(1, 4);
        let want = vec![
            ("a1".to_owned(), None),
            ("a2".to_owned(), Some(1)),
            ("a3".to_owned(), Some(2)),
            ("b1".to_owned(), None),
            ("c1".to_owned(), None),
            ("c2".to_owned(), Some(1)),
        ];
        assert_eq!(verdicts(&all), want);
        assert_eq!(verdicts(&shuffled), want);
    }

    #[test]
    fn without_caps_or_once_started_nothing_waits() {
        let all = vec![seat("a", "r1", 1, true), seat("a", "r2", 2, false)];
        assert_eq!(cap(None, None).admit(&all[1], &all), None);
        // A run that started is never queued again, whatever the cap.
        let c = cap(Some(1), None);
        let mut started = all.clone();
        started[1].started = true;
        assert_eq!(c.admit(&started[1], &started), None);
    }

    #[test]
    fn a_hold_ends_once_the_cache_shows_the_run_started_or_gone() {
        let c = cap(Some(1), None);
        let all = vec![seat("a", "r1", 1, false), seat("a", "r2", 2, false)];
        assert_eq!(c.admit(&all[0], &all), None);
        assert!(c.admit(&all[1], &all).is_some(), "r1's place is held");
        // The cache shows r1 gone (deleted before its write landed): r2 starts.
        let mut later = all.clone();
        later[0].gone = true;
        assert_eq!(c.admit(&later[1], &later), None);
    }
}
