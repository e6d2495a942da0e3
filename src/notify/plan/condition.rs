//! The approval's `Notified` condition.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::api::{Delivery, DeliveryState};

/// The approval's condition about its notifications.
pub const CONDITION: &str = "Notified";

/// The `Notified` condition for `deliveries` (all of the approval's, as
/// they stand after this pass); `None` when nothing was ever due.
pub fn condition(
    deliveries: &[Delivery],
    previous: Option<&Condition>,
    generation: Option<i64>,
    now: Timestamp,
) -> Option<Condition> {
    if deliveries.is_empty() {
        return None;
    }
    // The worst problem decides the reason; the message names each delivery it holds back.
    const ORDER: &[&str] = &[
        "ChannelsUnreadable",
        "ChannelUnknown",
        "ChannelInvalid",
        "AddressRefused",
        "GaveUp",
        "ReceiverRefused",
        "Retrying",
    ];
    let troubled = |d: &&Delivery| {
        matches!(d.state, DeliveryState::Pending | DeliveryState::Failed)
            && d.reason.as_deref().is_some_and(|r| ORDER.contains(&r))
    };
    let worst = deliveries
        .iter()
        .filter(troubled)
        .min_by_key(|d| ORDER.iter().position(|r| Some(*r) == d.reason.as_deref()));
    let (status, reason, message) = match worst {
        Some(w) => {
            let reason = w.reason.clone().unwrap_or_default();
            let others = deliveries.iter().filter(troubled).count() - 1;
            let more = if others > 0 {
                format!(" ({others} more not delivered)")
            } else {
                String::new()
            };
            (
                "False",
                reason,
                format!(
                    "{} notification to channel {}: {}{more}",
                    w.event.as_str(),
                    w.channel,
                    w.last_error.as_deref().unwrap_or("not delivered yet")
                ),
            )
        }
        None => {
            let delivered = deliveries
                .iter()
                .filter(|d| d.state == DeliveryState::Delivered)
                .count();
            let pending = deliveries
                .iter()
                .filter(|d| d.state == DeliveryState::Pending)
                .count();
            if pending > 0 {
                (
                    "False",
                    "Delivering".to_owned(),
                    format!("{pending} notification(s) being delivered, {delivered} delivered"),
                )
            } else {
                (
                    "True",
                    "Delivered".to_owned(),
                    format!("{delivered} notification(s) delivered"),
                )
            }
        }
    };
    let since = previous
        .filter(|c| c.status == status && c.reason == reason)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Some(Condition {
        type_: CONDITION.into(),
        status: status.into(),
        reason,
        message,
        observed_generation: generation,
        last_transition_time: since,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::plan::testing::t;

    #[test]
    fn the_condition_names_the_worst_problem() {
        let ok = Delivery {
            id: "a".into(),
            channel: "oncall".into(),
            state: DeliveryState::Delivered,
            ..Delivery::default()
        };
        let retrying = Delivery {
            id: "b".into(),
            channel: "pay".into(),
            reason: Some("Retrying".into()),
            last_error: Some("HTTP 503: later".into()),
            ..Delivery::default()
        };
        let unknown = Delivery {
            id: "c".into(),
            channel: "nope".into(),
            reason: Some("ChannelUnknown".into()),
            last_error: Some("channel nope is not configured".into()),
            ..Delivery::default()
        };
        let c = condition(std::slice::from_ref(&ok), None, Some(1), t(0)).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "Delivered")
        );
        let c = condition(
            &[ok.clone(), retrying.clone(), unknown],
            None,
            Some(1),
            t(0),
        )
        .unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "ChannelUnknown")
        );
        assert_eq!(
            c.message,
            "requested notification to channel nope: channel nope is not configured (1 more not delivered)"
        );
        let c2 = condition(&[ok, retrying], Some(&c), Some(1), t(9)).unwrap();
        assert_eq!(c2.reason, "Retrying");
        assert_eq!(c2.last_transition_time, Time(t(9)));
        assert_eq!(condition(&[], None, None, t(0)), None);
    }
}
