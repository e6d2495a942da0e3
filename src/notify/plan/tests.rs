//! What an approval is owed and when: requests, reminders, decisions,
//! withdrawal, and channels that cannot be used.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::testing::{approval, channels, t, two, with};
use super::*;
use crate::api::Escalation;

fn ids(p: &Plan) -> Vec<&str> {
    p.due.iter().map(|(w, _)| w.id.as_str()).collect()
}

#[test]
fn a_request_goes_to_the_named_and_the_default_channels_once_each() {
    let a = approval(&["pay", "oncall"]);
    let p = plan(&a, &two(), t(1));
    assert_eq!(ids(&p), vec!["u1.requested.pay", "u1.requested.oncall"]);
    assert!(
        p.due
            .iter()
            .all(|(w, d)| w.occurred_at == t(0) && d.attempts == 0)
    );
    assert_eq!(p.wake, None);
}

#[test]
fn a_delivered_notification_is_never_due_again_and_a_retry_waits_its_turn() {
    let delivered = Delivery {
        id: "u1.requested.oncall".into(),
        channel: "oncall".into(),
        state: DeliveryState::Delivered,
        attempts: 1,
        ..Delivery::default()
    };
    let waiting = Delivery {
        id: "u1.requested.pay".into(),
        channel: "pay".into(),
        state: DeliveryState::Pending,
        attempts: 1,
        next_attempt_at: Some(Time(t(5))),
        ..Delivery::default()
    };
    let a = with(
        approval(&["pay"]),
        ApprovalPhase::Pending,
        vec![delivered, waiting],
    );
    let p = plan(&a, &two(), t(2));
    assert!(p.due.is_empty(), "{p:?}");
    assert_eq!(p.wake, Some(t(5)));
    let p = plan(&a, &two(), t(5));
    assert_eq!(ids(&p), vec!["u1.requested.pay"]);
    assert_eq!(p.due[0].1.attempts, 1, "the record carries its attempts on");
}

#[test]
fn a_decision_is_told_and_an_undelivered_request_is_abandoned() {
    let waiting = Delivery {
        id: "u1.requested.pay".into(),
        channel: "pay".into(),
        attempts: 2,
        next_attempt_at: Some(Time(t(100))),
        ..Delivery::default()
    };
    let asked_oncall = Delivery {
        id: "u1.requested.oncall".into(),
        channel: "oncall".into(),
        state: DeliveryState::Delivered,
        attempts: 1,
        ..Delivery::default()
    };
    let a = with(
        approval(&["pay"]),
        ApprovalPhase::Approved,
        vec![waiting, asked_oncall.clone()],
    );
    let p = plan(&a, &two(), t(60));
    assert_eq!(ids(&p), vec!["u1.decided.pay", "u1.decided.oncall"]);
    assert!(p.due.iter().all(|(w, _)| w.occurred_at == t(50)));
    assert_eq!(p.settle.len(), 1);
    assert_eq!(p.settle[0].state, DeliveryState::Abandoned);
    let expired = with(approval(&[]), ApprovalPhase::Expired, vec![asked_oncall]);
    assert_eq!(
        ids(&plan(&expired, &two(), t(60))),
        vec!["u1.expired.oncall"]
    );
    let superseded = with(approval(&["pay"]), ApprovalPhase::Superseded, vec![]);
    assert!(plan(&superseded, &two(), t(60)).due.is_empty());
}

#[test]
fn a_new_default_channel_is_not_told_decisions_it_was_never_asked() {
    // Decided long ago; told to the channels of the day (pay, named).
    let history = |event: &str, ch: &str| Delivery {
        id: format!("u1.{event}.{ch}"),
        channel: ch.into(),
        event: match event {
            "requested" => NotificationEvent::Requested,
            _ => NotificationEvent::Decided,
        },
        state: DeliveryState::Delivered,
        attempts: 1,
        ..Delivery::default()
    };
    let old = with(
        approval(&["pay"]),
        ApprovalPhase::Approved,
        vec![history("requested", "pay"), history("decided", "pay")],
    );
    // Now oncall is a default channel (two()): nothing is due.
    let p = plan(&old, &two(), t(9_000));
    assert!(p.due.is_empty() && p.settle.is_empty(), "{p:?}");
    // An old approval that named no channel and was asked nobody: silence too.
    let unnamed = with(approval(&[]), ApprovalPhase::Rejected, vec![]);
    assert!(plan(&unnamed, &two(), t(9_000)).due.is_empty());
    // A pending approval asks the new default channel, and tells it the outcome.
    let pending = with(
        approval(&["pay"]),
        ApprovalPhase::Pending,
        vec![history("requested", "pay")],
    );
    assert_eq!(
        ids(&plan(&pending, &two(), t(9_000))),
        vec!["u1.requested.oncall"]
    );
}

#[test]
fn an_approval_being_deleted_owes_its_outcome_and_nothing_else() {
    let asked = |ch: &str, state| Delivery {
        id: format!("u1.requested.{ch}"),
        channel: ch.into(),
        state,
        attempts: 1,
        next_attempt_at: (state == DeliveryState::Pending).then(|| Time(t(5))),
        ..Delivery::default()
    };
    let deleting = |mut a: Approval| {
        a.metadata.deletion_timestamp = Some(Time(t(55)));
        a
    };
    // Open: owes its outcome to the channels asked.
    let open = with(approval(&["pay"]), ApprovalPhase::Pending, vec![]);
    assert!(owes(&open, &two(), t(1)));
    assert!(!owes(
        &with(approval(&[]), ApprovalPhase::Pending, vec![]),
        &channels("channels: []\n"),
        t(1)
    ));
    // Decided, then deleted (a run with ttlSecondsAfterFinished: 0): the
    // decision is still due and owed; the request under way is abandoned.
    let gone = deleting(with(
        approval(&["pay"]),
        ApprovalPhase::Approved,
        vec![
            asked("pay", DeliveryState::Pending),
            asked("oncall", DeliveryState::Delivered),
        ],
    ));
    let p = plan(&gone, &two(), t(60));
    assert_eq!(ids(&p), vec!["u1.decided.pay", "u1.decided.oncall"]);
    assert_eq!(p.settle.len(), 1);
    assert_eq!(p.settle[0].state, DeliveryState::Abandoned);
    // Withdrawn while pending: no question goes out, nothing is owed.
    let withdrawn = deleting(with(
        approval(&["pay"]),
        ApprovalPhase::Pending,
        vec![asked("pay", DeliveryState::Delivered)],
    ));
    let p = plan(&withdrawn, &two(), t(60));
    assert!(p.due.is_empty(), "{p:?}");
    assert!(!owes(&withdrawn, &two(), t(60)));
    // A channel that cannot be used is given up rather than waited for.
    let broken = deleting(with(
        approval(&["nope"]),
        ApprovalPhase::Approved,
        vec![asked("nope", DeliveryState::Failed)],
    ));
    let p = plan(&broken, &two(), t(60));
    assert_eq!(
        p.settle
            .iter()
            .map(|d| (d.id.as_str(), d.state))
            .collect::<Vec<_>>(),
        vec![("u1.decided.nope", DeliveryState::Failed)]
    );
    assert!(owes(&gone, &two(), t(60)));
    // Delivered: owes nothing more.
    let done = deleting(with(
        approval(&["pay"]),
        ApprovalPhase::Approved,
        vec![asked("pay", DeliveryState::Delivered)],
    ));
    assert!(owes(&done, &two(), t(60)), "its decision is not told yet");
    let mut told = done.clone();
    told.status.as_mut().unwrap().notifications.push(Delivery {
        id: "u1.decided.pay".into(),
        channel: "pay".into(),
        event: NotificationEvent::Decided,
        state: DeliveryState::Delivered,
        attempts: 1,
        ..Delivery::default()
    });
    assert!(!owes(&told, &two(), t(60)));
}

#[test]
fn the_reminder_goes_out_after_its_delay_and_only_while_nobody_decided() {
    let mut a = approval(&[]);
    a.spec.escalate = Some(Escalation {
        after: crate::api::Duration::from_secs(30),
        notify: vec!["boss".into()],
    });
    let requested = Delivery {
        id: "u1.requested.oncall".into(),
        channel: "oncall".into(),
        state: DeliveryState::Delivered,
        attempts: 1,
        ..Delivery::default()
    };
    let a = with(a, ApprovalPhase::Pending, vec![requested]);
    let p = plan(&a, &two(), t(10));
    assert!(p.due.is_empty());
    assert_eq!(p.wake, Some(t(30)));
    let p = plan(&a, &two(), t(30));
    assert_eq!(ids(&p), vec!["u1.escalated.boss"]);
    assert_eq!(p.due[0].0.occurred_at, t(30));
    let mut decided = a.clone();
    decided.status.as_mut().unwrap().phase = ApprovalPhase::Rejected;
    let p = plan(&decided, &two(), t(40));
    assert_eq!(
        ids(&p),
        vec!["u1.decided.oncall"],
        "no reminder once decided"
    );
}

#[test]
fn a_channel_that_cannot_be_used_is_recorded_and_the_others_still_go() {
    let a = approval(&["nope", "pay"]);
    let p = plan(&a, &two(), t(1));
    assert_eq!(ids(&p), vec!["u1.requested.pay", "u1.requested.oncall"]);
    assert_eq!(p.settle.len(), 1);
    let s = &p.settle[0];
    assert_eq!(
        (s.id.as_str(), s.reason.as_deref()),
        ("u1.requested.nope", Some("ChannelUnknown"))
    );
    assert_eq!(
        s.state,
        DeliveryState::Pending,
        "waits for the Secret to change"
    );
    assert_eq!(
        s.last_error.as_deref(),
        Some("channel nope is not configured in Secret ops/chan (channels: boss, oncall, pay)")
    );
    // Recorded as such, it is not written again.
    let recorded = with(approval(&["nope"]), ApprovalPhase::Pending, vec![s.clone()]);
    let p = plan(&recorded, &two(), t(2));
    assert!(p.settle.is_empty(), "{p:?}");
    // Once the Secret names it, it is due.
    let fixed = channels("channels:\n- {name: nope, url: 'https://d.example/'}\n");
    assert_eq!(
        ids(&plan(&recorded, &fixed, t(3))),
        vec!["u1.requested.nope"]
    );
}
