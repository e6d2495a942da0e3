//! The controller's clock: the API server's time, as near as this process can
//! tell, and never ahead of it.
//!
//! Deadlines the run depends on are written by the API server (a Pod's
//! `deletionTimestamp`, an Approval's decision time) or by the operator from
//! its own clock (`nextAttemptAt`, `expiresAt`). A replica whose clock runs
//! ahead of the server's would act on them early — call a Pod that is still
//! in its grace period lost, or a decision late — and two replicas with
//! different clocks would disagree. So every decision takes its `now` from
//! one place: the local clock, moved back by how far it is seen to run ahead
//! of the API server.
//!
//! ```text
//!   every API response ──Date: (server, 1 s resolution)──▶ sample = local − Date
//!   offset = the smallest recent sample (≥ the true skew: Date is truncated, and
//!            the response took time to arrive)
//!   now()  = local − max(offset, 0)   never ahead of the server's clock
//! ```
//!
//! A clock that runs behind is left as it is: it acts late, never early.
//! Builds with the `failpoints` feature read `AGENTRUN_CLOCK_SKEW` (a signed
//! duration such as `+20s`) and run that far off, so the chaos suite can give
//! two replicas different clocks.

use std::sync::{Arc, Mutex};

use jiff::{SignedDuration, Timestamp};

/// How many recent samples the offset is the minimum of: enough to ride out
/// a slow response, few enough to follow a clock that was stepped.
const SAMPLES: usize = 32;

/// The controller's clock; clones share the samples.
#[derive(Clone, Debug, Default)]
pub struct Clock {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Added to the local clock (`AGENTRUN_CLOCK_SKEW`, failpoints builds only).
    skew: SignedDuration,
    samples: Mutex<Samples>,
}

#[derive(Debug, Default)]
struct Samples {
    ring: Vec<SignedDuration>,
    next: usize,
}

impl Clock {
    /// A clock that runs `skew` off the local one (tests, chaos).
    pub fn skewed(skew: SignedDuration) -> Clock {
        Clock {
            inner: Arc::new(Inner {
                skew,
                samples: Mutex::default(),
            }),
        }
    }

    /// The process's clock: `AGENTRUN_CLOCK_SKEW` in failpoints builds, else
    /// the local clock.
    pub fn from_env() -> Clock {
        #[cfg(feature = "failpoints")]
        if let Ok(s) = std::env::var("AGENTRUN_CLOCK_SKEW") {
            match s.trim().parse::<SignedDuration>() {
                Ok(skew) => {
                    tracing::warn!(%skew, "AGENTRUN_CLOCK_SKEW: this process's clock runs off");
                    return Clock::skewed(skew);
                }
                Err(err) => {
                    tracing::warn!(%err, value = %s, "AGENTRUN_CLOCK_SKEW is not a duration; ignored")
                }
            }
        }
        Clock::default()
    }

    /// The local clock, as this process reads it (with its skew).
    pub fn local(&self) -> Timestamp {
        Timestamp::now()
            .checked_add(self.inner.skew)
            .unwrap_or_else(|_| Timestamp::now())
    }

    /// How far the local clock is seen to run ahead of the API server's (0
    /// before any response, or when it runs behind).
    pub fn ahead(&self) -> SignedDuration {
        let s = self.inner.samples.lock().unwrap_or_else(|e| e.into_inner());
        s.ring
            .iter()
            .copied()
            .min()
            .unwrap_or(SignedDuration::ZERO)
            .max(SignedDuration::ZERO)
    }

    /// Now, never ahead of the API server's clock.
    pub fn now(&self) -> Timestamp {
        let local = self.local();
        local.checked_sub(self.ahead()).unwrap_or(local)
    }

    /// Records one response's `Date` header, read at local time `at`.
    pub fn observe(&self, server: Timestamp, at: Timestamp) {
        let sample = at.duration_since(server);
        let mut s = self.inner.samples.lock().unwrap_or_else(|e| e.into_inner());
        if s.ring.len() < SAMPLES {
            s.ring.push(sample);
        } else {
            let i = s.next;
            s.ring[i] = sample;
        }
        s.next = (s.next + 1) % SAMPLES;
    }

    /// Records a response's `Date` header (RFC 2822/HTTP-date), if it has one.
    pub fn observe_header(&self, date: Option<&http::HeaderValue>) {
        let Some(text) = date.and_then(|d| d.to_str().ok()) else {
            return;
        };
        if let Ok(server) = jiff::fmt::rfc2822::DateTimeParser::new().parse_timestamp(text) {
            self.observe(server, self.local());
        }
    }

    /// The layer that feeds every API response's `Date` to this clock.
    pub fn layer<B>(
        &self,
    ) -> tower::util::MapResponseLayer<
        impl Fn(http::Response<B>) -> http::Response<B> + Clone + use<B>,
    > {
        let clock = self.clone();
        tower::util::MapResponseLayer::new(move |resp: http::Response<B>| {
            clock.observe_header(resp.headers().get(http::header::DATE));
            resp
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn a_clock_ahead_of_the_server_is_moved_back_by_the_smallest_sample() {
        let c = Clock::default();
        assert_eq!(c.ahead(), SignedDuration::ZERO, "no response yet");
        // 20 s ahead; a slow response says 21 s, a fast one 20.2 s.
        c.observe(ts("2026-12-03T10:00:00Z"), ts("2026-12-03T10:00:21Z"));
        c.observe(ts("2026-12-03T10:00:05Z"), ts("2026-12-03T10:00:25.2Z"));
        assert_eq!(c.ahead(), SignedDuration::from_millis(20_200));
    }

    #[test]
    fn a_clock_behind_the_server_is_left_as_it_is() {
        let c = Clock::default();
        c.observe(ts("2026-12-03T10:00:30Z"), ts("2026-12-03T10:00:00Z"));
        assert_eq!(c.ahead(), SignedDuration::ZERO);
    }

    #[test]
    fn old_samples_leave_the_window() {
        let c = Clock::default();
        c.observe(ts("2026-12-03T10:00:00Z"), ts("2026-12-03T10:00:00Z"));
        for _ in 0..SAMPLES {
            c.observe(ts("2026-12-03T10:00:00Z"), ts("2026-12-03T10:00:09Z"));
        }
        assert_eq!(
            c.ahead(),
            SignedDuration::from_secs(9),
            "a stepped clock is followed"
        );
    }

    #[test]
    fn a_skewed_clock_reads_the_date_header_and_corrects_itself() {
        let c = Clock::skewed(SignedDuration::from_secs(20));
        assert!(c.local().duration_since(Timestamp::now()) >= SignedDuration::from_secs(19));
        let date = jiff::fmt::rfc2822::DateTimePrinter::new()
            .timestamp_to_rfc9110_string(&Timestamp::now())
            .unwrap();
        c.observe_header(Some(&http::HeaderValue::from_str(&date).unwrap()));
        let off = c.now().duration_since(Timestamp::now());
        assert!(
            off <= SignedDuration::ZERO && off > SignedDuration::from_secs(-2),
            "now() is within the Date header's resolution of the server's time, never ahead: {off}"
        );
    }
}
