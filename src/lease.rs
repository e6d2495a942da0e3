//! Leader election on a coordination.k8s.io Lease, with the rule that keeps
//! one leader: **a leader that fails to renew steps down at once.**
//!
//! The Lease manager renews `grace` seconds before the Lease runs out; a
//! renewal that fails leaves at most that long before another replica may
//! take it. Trying again with a backoff could outlast it (a backoff that
//! grows over several API server blips, never reset while the lease is held,
//! eventually sleeps longer than the Lease lives), and the old leader would
//! go on acting beside the new one. So the first failed renewal ends this
//! replica's leadership; the process then exits and starts again as a
//! standby. A standby's own retries are capped at `grace`, so it stands
//! ready to take over as soon as the Lease is free.
//!
//! ```text
//!   changed() ─Ok(state)──▶ publish it; failures = 0
//!             ─Err, leading──▶ publish false (step down), retry as a standby
//!             ─Err, standby──▶ retry after 250 ms · 2^failures, at most `grace`
//! ```

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::warn;

/// The Lease as the election loop sees it (the real one is
/// `kube_lease_manager::LeaseManager`).
pub trait Lease: Send + Sync + 'static {
    /// Waits until this replica's leadership changes and returns it; an
    /// error when the API server could not be read or written.
    fn changed(&self) -> impl Future<Output = Result<bool, String>> + Send;
    /// Gives the Lease up, if held.
    fn release(&self) -> impl Future<Output = ()> + Send;
}

impl Lease for kube_lease_manager::LeaseManager {
    async fn changed(&self) -> Result<bool, String> {
        kube_lease_manager::LeaseManager::changed(self)
            .await
            .map_err(|e| e.to_string())
    }

    async fn release(&self) {
        if let Err(err) = kube_lease_manager::LeaseManager::release(self).await {
            warn!(error = %err, "releasing the leader lease failed; it expires on its own");
        }
    }
}

/// The delay before a standby's `failures`-th retry: 250 ms doubling, at most `cap`.
pub fn retry_delay(failures: u32, cap: Duration) -> Duration {
    Duration::from_millis(250)
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(cap)
}

/// Runs the election loop: the receiver says whether this replica leads.
/// Dropping every receiver releases the Lease and ends the loop.
pub fn elect<L: Lease>(lease: L, grace: Duration) -> (watch::Receiver<bool>, JoinHandle<()>) {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut leading = false;
        let mut failures = 0u32;
        loop {
            let result = tokio::select! {
                biased;
                _ = tx.closed() => {
                    lease.release().await;
                    return;
                }
                r = lease.changed() => r,
            };
            match result {
                Ok(state) => {
                    failures = 0;
                    leading = state;
                    if tx.send(state).is_err() {
                        lease.release().await;
                        return;
                    }
                }
                Err(err) => {
                    failures = failures.saturating_add(1);
                    if leading {
                        warn!(error = %err, "renewing the leader lease failed: stepping down before it can run out");
                        leading = false;
                        if tx.send(false).is_err() {
                            lease.release().await;
                            return;
                        }
                    } else {
                        warn!(error = %err, failures, "leader election failed; trying again");
                    }
                    tokio::select! {
                        biased;
                        _ = tx.closed() => {
                            lease.release().await;
                            return;
                        }
                        _ = tokio::time::sleep(retry_delay(failures, grace)) => {}
                    }
                }
            }
        }
    });
    (rx, task)
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use tokio::time::Instant;

    use super::*;

    /// A Lease that answers from a script, each answer a second after it is
    /// asked (as a renewal comes some time after the last), then waits forever.
    struct Scripted {
        answers: Mutex<VecDeque<Result<bool, String>>>,
        released: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl Scripted {
        fn new(answers: impl IntoIterator<Item = Result<bool, String>>) -> Self {
            Scripted {
                answers: Mutex::new(answers.into_iter().collect()),
                released: Default::default(),
            }
        }
    }

    impl Lease for Scripted {
        async fn changed(&self) -> Result<bool, String> {
            let next = self.answers.lock().unwrap().pop_front();
            match next {
                Some(a) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    a
                }
                None => std::future::pending().await,
            }
        }
        async fn release(&self) {
            self.released
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn a_standby_retries_no_slower_than_the_grace() {
        let cap = Duration::from_secs(5);
        assert_eq!(retry_delay(1, cap), Duration::from_millis(250));
        assert_eq!(retry_delay(3, cap), Duration::from_secs(1));
        assert_eq!(
            retry_delay(40, cap),
            cap,
            "never past the grace, however many failures"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_renewal_fails_steps_down_at_once() {
        let lease = Scripted::new([Ok(true), Err("connection refused".into())]);
        let (mut rx, _task) = elect(lease, Duration::from_secs(5));
        rx.changed().await.unwrap();
        assert!(*rx.borrow_and_update(), "leading");
        let t = Instant::now();
        rx.changed().await.unwrap();
        assert!(!*rx.borrow_and_update(), "stepped down");
        assert_eq!(
            t.elapsed(),
            Duration::from_secs(1),
            "as the renewal failed, before any retry sleep"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_backoff_starts_over_after_the_lease_answers() {
        // Ten failures as a standby, then the Lease is won, lost by a failed
        // renewal, and won again: the second run of failures starts at 250 ms.
        let mut script: Vec<Result<bool, String>> = (0..10).map(|_| Err("down".into())).collect();
        script.push(Ok(true));
        script.push(Err("blip".into()));
        script.push(Ok(true));
        let lease = Scripted::new(script);
        let t = Instant::now();
        let (mut rx, _task) = elect(lease, Duration::from_secs(5));
        rx.changed().await.unwrap();
        assert!(*rx.borrow_and_update());
        let won = t.elapsed();
        // 11 answers of 1 s, and between the failures 0.25 + 0.5 + 1 + 2 + 4
        // + 5·5 = 32.75 s: each wait at most the grace.
        assert_eq!(won, Duration::from_millis(11_000 + 32_750));
        rx.changed().await.unwrap();
        assert!(!*rx.borrow_and_update());
        rx.changed().await.unwrap();
        assert!(*rx.borrow_and_update());
        // The blip (1 s), one retry after 250 ms, the answer (1 s).
        assert_eq!(
            t.elapsed() - won,
            Duration::from_millis(2_250),
            "the count started over"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_receiver_releases_the_lease() {
        let lease = Scripted::new([Ok(true)]);
        let released = lease.released.clone();
        let (mut rx, task) = elect(lease, Duration::from_secs(5));
        rx.changed().await.unwrap();
        drop(rx);
        task.await.unwrap();
        assert!(released.load(std::sync::atomic::Ordering::SeqCst));
    }
}
