//! Which run is reconciled next, and when: one first-come-first-served line
//! of runs, a fixed number of reconciles at once, never two of one run.
//!
//! Everything that asks for a reconcile names a run: the run's own watch
//! event, one of its step Pods' or Approvals', a reconcile asking to be
//! looked at again after a while. A named run joins the back of the [`Line`]
//! unless it is in it already (one entry stands for every trigger it
//! collected while it waited). A trigger for a run being reconciled marks it,
//! and it joins the back of the line when that reconcile ends, so every
//! change is looked at, and looked at by one reconcile at a time. Requests
//! to be looked at again later wait in kube-runtime's scheduler (earliest
//! wins per run) and join the line when due.
//!
//! kube-runtime's `Controller` does the same bookkeeping, but its runner, on
//! every wake-up, polls each reconcile it holds and scans the triggers held
//! back for runs being reconciled. With its own limit on reconciles it takes
//! the next run from that held set in hash order, and some runs waited for
//! minutes while others went round many times; without a limit (the runs
//! then queued in a fair semaphore) every wake-up cost time in proportion to
//! the runs in flight: at 1,000 runs the operator's CPU per step was 2.3
//! times that at 50, a third of it in those scans and polls (docs/performance-history.md,
//! "Operator CPU per step with the number of runs").
//! Here a wake-up costs the same whatever the number of runs.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::scheduler::{ScheduleRequest, scheduler};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::error;

/// What a reconcile asks for next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Action {
    requeue_after: Option<Duration>,
}

impl Action {
    /// Look at the run again after `after`, or sooner on a change.
    pub const fn requeue(after: Duration) -> Action {
        Action {
            requeue_after: Some(after),
        }
    }

    /// Look at the run again only when something about it changes.
    pub const fn await_change() -> Action {
        Action {
            requeue_after: None,
        }
    }
}

/// The runs waiting for a reconcile, in the order they asked, and the runs
/// being reconciled.
pub struct Line<T> {
    state: Mutex<State<T>>,
    /// One permit per run in `order`.
    waiting: Semaphore,
}

struct State<T> {
    order: VecDeque<T>,
    /// The runs in `order`.
    queued: HashSet<T>,
    /// The runs being reconciled.
    running: HashSet<T>,
    /// Runs being reconciled that were named again meanwhile.
    again: HashSet<T>,
}

impl<T: Hash + Eq + Clone> Default for Line<T> {
    fn default() -> Self {
        Line {
            state: Mutex::new(State {
                order: VecDeque::new(),
                queued: HashSet::new(),
                running: HashSet::new(),
                again: HashSet::new(),
            }),
            waiting: Semaphore::new(0),
        }
    }
}

impl<T: Hash + Eq + Clone> Line<T> {
    /// `run` asks for a reconcile.
    pub fn push(&self, run: T) {
        let mut s = self.lock();
        if s.running.contains(&run) {
            s.again.insert(run);
        } else if s.queued.insert(run.clone()) {
            s.order.push_back(run);
            self.waiting.add_permits(1);
        }
    }

    /// The run first in line, now being reconciled; waits for one.
    pub async fn next(&self) -> T {
        self.waiting
            .acquire()
            .await
            .expect("the semaphore is never closed")
            .forget();
        let mut s = self.lock();
        let run = s
            .order
            .pop_front()
            .expect("a permit stands for a run in line");
        s.queued.remove(&run);
        s.running.insert(run.clone());
        run
    }

    /// The reconcile of `run` ended; if it was named meanwhile, it joins the
    /// back of the line.
    pub fn done(&self, run: &T) {
        let again = {
            let mut s = self.lock();
            s.running.remove(run);
            s.again.remove(run)
        };
        if again {
            self.push(run.clone());
        }
    }

    /// How many runs wait.
    pub fn len(&self) -> usize {
        self.lock().order.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Reconciles every run `triggers` names, `slots` at a time in the order
/// they were named, until `shutdown` resolves; reconciles under way then
/// finish. `depth` is told how many runs wait after each change.
pub async fn run<T, F, Fut>(
    triggers: impl Stream<Item = T> + Send + 'static,
    slots: usize,
    reconcile: F,
    depth: impl Fn(usize) + Send + Sync + 'static,
    shutdown: impl Future<Output = ()> + Send + 'static,
) where
    T: Hash + Eq + Clone + std::fmt::Debug + Send + Sync + 'static,
    F: Fn(T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Action> + Send + 'static,
{
    let line = Arc::new(Line::<T>::default());
    let depth = Arc::new(depth);
    let (later, due) = futures::channel::mpsc::unbounded::<ScheduleRequest<T>>();
    let feeder = tokio::spawn({
        let (line, depth) = (line.clone(), depth.clone());
        futures::stream::select(triggers, scheduler(due)).for_each(move |run| {
            line.push(run);
            depth(line.len());
            futures::future::ready(())
        })
    });

    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let reconcile = Arc::new(reconcile);
    let workers: Vec<_> = (0..slots)
        .map(|_| {
            let (line, depth, reconcile, later) = (
                line.clone(),
                depth.clone(),
                reconcile.clone(),
                later.clone(),
            );
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                loop {
                    let run = tokio::select! {
                        biased;
                        _ = stopped.wait_for(|s| *s) => break,
                        run = line.next() => run,
                    };
                    depth(line.len());
                    // A reconcile of its own task: one that panics ends
                    // there, and the run is tried again.
                    let action = match tokio::spawn(reconcile(run.clone())).await {
                        Ok(action) => action,
                        Err(err) => {
                            error!(?run, error = %err, "reconcile panicked; trying again");
                            Action::requeue(Duration::from_secs(5))
                        }
                    };
                    line.done(&run);
                    depth(line.len());
                    if let Some(after) = action.requeue_after {
                        let _ = later.unbounded_send(ScheduleRequest {
                            message: run,
                            run_at: Instant::now() + after,
                        });
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.await;
    }
    feeder.abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_served_in_the_order_they_asked_once_each() {
        let line = Line::default();
        for run in ["a", "b", "a", "c", "b"] {
            line.push(run);
        }
        assert_eq!(line.len(), 3);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let order: Vec<_> = rt.block_on(async {
            let mut v = Vec::new();
            for _ in 0..3 {
                v.push(line.next().await);
            }
            v
        });
        assert_eq!(order, ["a", "b", "c"]);
        assert_eq!(line.len(), 0);
    }

    #[tokio::test]
    async fn a_run_named_while_reconciled_goes_to_the_back_once_it_is_done() {
        let line = Line::default();
        line.push("a");
        line.push("b");
        let a = line.next().await;
        // Named twice while reconciled: not in line beside itself.
        line.push("a");
        line.push("a");
        line.push("c");
        assert_eq!(line.len(), 2, "b and c wait; a is being reconciled");
        line.done(&a);
        assert_eq!(line.next().await, "b");
        assert_eq!(line.next().await, "c");
        assert_eq!(line.next().await, "a");
        assert_eq!(line.len(), 0);
    }

    #[tokio::test]
    async fn a_run_not_named_while_reconciled_does_not_come_back() {
        let line = Line::default();
        line.push("a");
        let a = line.next().await;
        line.done(&a);
        assert_eq!(line.len(), 0);
    }

    /// Two reconciles at once, never two of one run, and a run asking to be
    /// looked at again later is.
    #[tokio::test]
    async fn reconciles_run_slots_at_a_time_and_requeues_come_back() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
        let now = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let (stop_tx, stop) = tokio::sync::oneshot::channel::<()>();
        let looped = {
            let (now, most) = (now.clone(), most.clone());
            tokio::spawn(run(
                rx,
                2,
                move |run: u32| {
                    let (now, most, seen_tx) = (now.clone(), most.clone(), seen_tx.clone());
                    async move {
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        now.fetch_sub(1, Ordering::SeqCst);
                        let _ = seen_tx.send(run);
                        // Run 0 asks to be looked at again once.
                        if run == 0 {
                            Action::requeue(Duration::from_millis(10))
                        } else {
                            Action::await_change()
                        }
                    }
                },
                |_| {},
                async move {
                    let _ = stop.await;
                },
            ))
        };
        for run in 0..6 {
            tx.unbounded_send(run).unwrap();
        }
        let mut got = Vec::new();
        for _ in 0..7 {
            got.push(
                tokio::time::timeout(Duration::from_secs(5), seen.recv())
                    .await
                    .expect("a reconcile ends")
                    .unwrap(),
            );
        }
        got.sort_unstable();
        assert_eq!(got, [0, 0, 1, 2, 3, 4, 5], "every run once, run 0 twice");
        assert_eq!(most.load(Ordering::SeqCst), 2, "two at a time");
        stop_tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), looped)
            .await
            .expect("the loop stops on shutdown")
            .unwrap();
    }
}
