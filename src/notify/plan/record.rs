//! What an attempt's outcome does to a delivery's record, and how long the
//! next attempt waits.

use std::time::Duration as StdDuration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use sha2::{Digest, Sha256};

use crate::api::{Delivery, DeliveryState};
use crate::notify::send::Outcome;

/// The first retry waits about this long; each next one twice as long.
const BACKOFF_BASE: StdDuration = StdDuration::from_secs(1);
/// No retry waits longer than this.
const BACKOFF_MAX: StdDuration = StdDuration::from_secs(300);

/// The wait before attempt `attempts + 1`: exponential from 1 s, capped at
/// 5 min, with ±20% jitter derived from the delivery id (so replicas and
/// restarts agree, and receivers are not hit in lockstep).
pub fn backoff(id: &str, attempts: u32) -> StdDuration {
    let exp = BACKOFF_BASE
        .saturating_mul(1u32 << attempts.saturating_sub(1).min(16))
        .min(BACKOFF_MAX);
    let h = Sha256::digest(format!("{id}/{attempts}").as_bytes());
    let unit = f64::from(u16::from_be_bytes([h[0], h[1]])) / f64::from(u16::MAX);
    exp.mul_f64(0.8 + 0.4 * unit)
}

/// The record after an attempt with `outcome`.
pub fn record(mut d: Delivery, outcome: &Outcome, max_attempts: u32, now: Timestamp) -> Delivery {
    d.attempts += 1;
    d.next_attempt_at = None;
    match outcome {
        Outcome::Delivered => {
            d.state = DeliveryState::Delivered;
            d.reason = Some("Delivered".into());
            d.delivered_at = Some(Time(now));
            d.last_error = None;
        }
        Outcome::Retry { error, after } if d.attempts < max_attempts => {
            let wait = backoff(&d.id, d.attempts).max(after.unwrap_or_default());
            let wait = SignedDuration::try_from(wait).unwrap_or(SignedDuration::MAX);
            d.state = DeliveryState::Pending;
            d.reason = Some("Retrying".into());
            // Whole seconds, rounded up: the API keeps times to the second,
            // and a record read back must not make the retry early.
            d.next_attempt_at = now
                .checked_add(wait)
                .ok()
                .and_then(|t| {
                    t.round(
                        jiff::TimestampRound::new()
                            .smallest(jiff::Unit::Second)
                            .mode(jiff::RoundMode::Ceil),
                    )
                    .ok()
                })
                .map(Time);
            d.last_error = Some(error.clone());
        }
        Outcome::Retry { error, .. } => {
            d.state = DeliveryState::Failed;
            d.reason = Some("GaveUp".into());
            d.last_error = Some(format!("gave up after {} attempts: {error}", d.attempts));
        }
        Outcome::Failed(error) => {
            d.state = DeliveryState::Failed;
            d.reason = Some("ReceiverRefused".into());
            d.last_error = Some(error.clone());
        }
        Outcome::Refused(error) => {
            d.state = DeliveryState::Failed;
            d.reason = Some("AddressRefused".into());
            d.last_error = Some(error.clone());
        }
    }
    if let Some(e) = &mut d.last_error
        && e.len() > 1000
    {
        let mut cut = 1000;
        while !e.is_char_boundary(cut) {
            cut -= 1;
        }
        e.truncate(cut);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::plan::testing::t;

    #[test]
    fn retries_back_off_exponentially_with_jitter_and_give_up() {
        let d = Delivery {
            id: "u1.requested.pay".into(),
            ..Delivery::default()
        };
        let retry = Outcome::Retry {
            error: "HTTP 500: boom".into(),
            after: None,
        };
        let mut waits = Vec::new();
        let mut cur = d.clone();
        for _ in 0..3 {
            cur = record(cur, &retry, 4, t(0));
            assert_eq!(cur.state, DeliveryState::Pending);
            assert_eq!(cur.last_error.as_deref(), Some("HTTP 500: boom"));
            let next = cur.next_attempt_at.clone().unwrap().0;
            waits.push(next.duration_since(t(0)).as_secs_f64());
        }
        for (i, w) in waits.iter().enumerate() {
            let exp = f64::from(1u32 << i);
            // Rounded up to the second the API keeps.
            assert!((0.8 * exp..=1.2 * exp + 1.0).contains(w), "wait {i}: {w} s");
            assert_eq!(w.fract(), 0.0, "wait {i}: {w} s is not whole seconds");
        }
        let gave_up = record(cur, &retry, 4, t(0));
        assert_eq!(gave_up.state, DeliveryState::Failed);
        assert_eq!(gave_up.attempts, 4);
        assert_eq!(
            gave_up.last_error.as_deref(),
            Some("gave up after 4 attempts: HTTP 500: boom")
        );
        let refused = record(d.clone(), &Outcome::Failed("HTTP 404: no".into()), 4, t(0));
        assert_eq!(
            (refused.state, refused.reason.as_deref()),
            (DeliveryState::Failed, Some("ReceiverRefused"))
        );
        let ok = record(d, &Outcome::Delivered, 4, t(9));
        assert_eq!(ok.delivered_at, Some(Time(t(9))));
        assert_eq!(backoff("x", 30), backoff("x", 30), "deterministic");
        assert!(backoff("x", 30) <= BACKOFF_MAX.mul_f64(1.2));
    }
}
