//! Which notifications an approval calls for, which of them are due now,
//! and what an attempt's outcome does to the record. Pure: the notifier's
//! reconcile reads the approval and the channels, asks [`plan`], sends what
//! is due and writes back what [`record`] says.
//!
//! ```text
//!   asked ─────────────▶ Requested  → spec.notify + default channels
//!   asked + after ─────▶ Escalated  → escalate.notify       (only while Pending)
//!   Approved/Rejected/
//!   Resolved ──────────▶ Decided    → spec.notify + default channels
//!   Expired ───────────▶ Expired    → spec.notify + default channels
//! ```
//!
//! A request or reminder not yet delivered when the approval is decided is
//! abandoned (nobody needs to be asked any more); one never sent is not
//! started. Each delivery is retried with backoff until delivered, refused
//! for good, or out of attempts.
//!
//! The decision (or expiry) goes to the channels the approval names and to
//! the default channels that were asked: a default channel added later is
//! not told about decisions it never heard the question of, so adding one
//! does not replay history. An approval being deleted is withdrawn: its
//! questions are abandoned, and what it still owes (its decision) is
//! delivered or given up before the notifier's finalizer lets it go.

use std::collections::BTreeSet;
use std::time::Duration as StdDuration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use sha2::{Digest, Sha256};

use super::channels::{Channels, Problem};
use super::send::Outcome;
use crate::api::{Approval, ApprovalPhase, Delivery, DeliveryState, NotificationEvent};

/// The first retry waits about this long; each next one twice as long.
const BACKOFF_BASE: StdDuration = StdDuration::from_secs(1);
/// No retry waits longer than this.
const BACKOFF_MAX: StdDuration = StdDuration::from_secs(300);
/// The approval's condition about its notifications.
pub const CONDITION: &str = "Notified";

/// A notification the approval calls for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub id: String,
    pub event: NotificationEvent,
    pub channel: String,
    /// When its event happened.
    pub occurred_at: Timestamp,
}

/// What to do now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Deliveries to attempt now, as recorded so far (new ones with 0 attempts).
    pub due: Vec<(Wanted, Delivery)>,
    /// Records to write without sending: a channel that cannot be used, an
    /// abandoned request.
    pub settle: Vec<Delivery>,
    /// When to look again (a retry, a reminder).
    pub wake: Option<Timestamp>,
}

/// The delivery id: `<approval uid>.<event>.<channel>`.
pub fn delivery_id(a: &Approval, event: NotificationEvent, channel: &str) -> String {
    format!(
        "{}.{}.{}",
        a.metadata.uid.as_deref().unwrap_or_default(),
        event.as_str(),
        channel
    )
}

fn phase(a: &Approval) -> ApprovalPhase {
    a.status.as_ref().map(|s| s.phase).unwrap_or_default()
}

/// Still waiting for a person, and not being deleted.
fn open(a: &Approval) -> bool {
    phase(a) == ApprovalPhase::Pending && a.metadata.deletion_timestamp.is_none()
}

fn recorded(a: &Approval) -> &[Delivery] {
    a.status
        .as_ref()
        .map(|s| s.notifications.as_slice())
        .unwrap_or_default()
}

/// Who is asked: the channels the approval names, then the default ones.
fn asked(a: &Approval, channels: &Channels) -> Vec<String> {
    let mut asked: Vec<String> = Vec::new();
    for ch in a
        .spec
        .notify
        .iter()
        .map(String::as_str)
        .chain(channels.defaults())
    {
        if !asked.iter().any(|c| c == ch) {
            asked.push(ch.to_owned());
        }
    }
    asked
}

/// Who is told the outcome: the channels the approval names, then those
/// that have a record of its request (the default channels of the day it
/// asked, whatever the defaults are now).
fn told(a: &Approval) -> Vec<String> {
    let mut told: Vec<String> = a.spec.notify.clone();
    for d in recorded(a) {
        if d.event == NotificationEvent::Requested && !told.contains(&d.channel) {
            told.push(d.channel.clone());
        }
    }
    told
}

/// Whether the approval still owes a notification, so the notifier's
/// finalizer keeps it until then: while it is open, the outcome it will
/// tell; after, any delivery due or under way.
pub fn owes(a: &Approval, channels: &Channels, now: Timestamp) -> bool {
    if open(a) {
        return !asked(a, channels).is_empty();
    }
    !plan(a, channels, now).due.is_empty()
        || recorded(a)
            .iter()
            .any(|d| d.state == DeliveryState::Pending)
}

fn created(a: &Approval) -> Timestamp {
    a.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// When the reminder is due, if the approval has one.
pub fn escalation_due(a: &Approval) -> Option<Timestamp> {
    let after = a.spec.escalate.as_ref()?.after.parse().ok()?;
    created(a).checked_add(after).ok()
}

/// Every notification the approval calls for at `now`.
pub fn wanted(a: &Approval, channels: &Channels, now: Timestamp) -> Vec<Wanted> {
    let asked = asked(a, channels);
    let mut out = Vec::new();
    let mut push = |event, channels: &[String], at| {
        for ch in channels {
            out.push(Wanted {
                id: delivery_id(a, event, ch),
                event,
                channel: ch.clone(),
                occurred_at: at,
            });
        }
    };
    push(NotificationEvent::Requested, &asked, created(a));
    if let (Some(esc), Some(at)) = (&a.spec.escalate, escalation_due(a))
        && now >= at
    {
        push(NotificationEvent::Escalated, &esc.notify, at);
    }
    let decided_at = a
        .status
        .as_ref()
        .and_then(|s| s.decided_at.as_ref())
        .map_or(now, |t| t.0);
    match phase(a) {
        ApprovalPhase::Approved | ApprovalPhase::Rejected | ApprovalPhase::Resolved => {
            push(NotificationEvent::Decided, &told(a), decided_at)
        }
        ApprovalPhase::Expired => push(NotificationEvent::Expired, &told(a), decided_at),
        ApprovalPhase::Pending | ApprovalPhase::Superseded => {}
    }
    out
}

fn is_question(e: NotificationEvent) -> bool {
    matches!(
        e,
        NotificationEvent::Requested | NotificationEvent::Escalated
    )
}

fn problem_reason(p: &Problem) -> &'static str {
    match p {
        Problem::Unreadable(_) => "ChannelsUnreadable",
        Problem::Invalid(_) => "ChannelInvalid",
        Problem::Unknown(_) => "ChannelUnknown",
    }
}

/// What to send, settle and when to look again.
pub fn plan(a: &Approval, channels: &Channels, now: Timestamp) -> Plan {
    let recorded = recorded(a);
    let deleting = a.metadata.deletion_timestamp.is_some();
    let open = open(a);
    let mut p = Plan::default();
    let wake = |at: Timestamp, p: &mut Plan| {
        p.wake = Some(p.wake.map_or(at, |w| w.min(at)));
    };
    if open
        && let Some(at) = escalation_due(a)
        && at > now
    {
        wake(at, &mut p);
    }
    for w in wanted(a, channels, now) {
        let existing = recorded.iter().find(|d| d.id == w.id);
        if existing.is_some_and(|d| d.state != DeliveryState::Pending) {
            continue; // delivered, failed or abandoned: final
        }
        if !open && is_question(w.event) {
            // Decided (or withdrawn) first: nobody needs asking any more.
            if let Some(d) = existing {
                p.settle.push(Delivery {
                    state: DeliveryState::Abandoned,
                    reason: Some("Abandoned".into()),
                    next_attempt_at: None,
                    ..d.clone()
                });
            }
            continue;
        }
        let d = existing.cloned().unwrap_or_else(|| Delivery {
            id: w.id.clone(),
            channel: w.channel.clone(),
            event: w.event,
            ..Delivery::default()
        });
        if let Some(next) = d.next_attempt_at.as_ref().map(|t| t.0)
            && next > now
        {
            wake(next, &mut p);
            continue;
        }
        match channels.get(&w.channel) {
            Err(problem) => {
                // Waits for the channel Secret to change (which looks
                // again); an approval being deleted cannot wait.
                let settled = Delivery {
                    state: if deleting {
                        DeliveryState::Failed
                    } else {
                        DeliveryState::Pending
                    },
                    reason: Some(problem_reason(&problem).into()),
                    last_error: Some(problem.message().to_owned()),
                    next_attempt_at: None,
                    ..d.clone()
                };
                if existing != Some(&settled) {
                    p.settle.push(settled);
                }
            }
            Ok(_) => p.due.push((w, d)),
        }
    }
    p
}

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

/// The channels named by the approval that the configuration does not
/// know (for the Warning Event on the run).
pub fn unknown_channels(a: &Approval, channels: &Channels) -> BTreeSet<String> {
    a.spec
        .notify
        .iter()
        .chain(a.spec.escalate.iter().flat_map(|e| e.notify.iter()))
        .filter(|c| matches!(channels.get(c), Err(Problem::Unknown(_))))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::api::{ApprovalKind, ApprovalSpec, ApprovalStatus, Escalation};

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_750_000_000 + secs).unwrap()
    }

    fn channels(yaml: &str) -> Channels {
        Channels::parse(
            "ops/chan",
            &BTreeMap::from([(
                super::super::channels::KEY.to_owned(),
                yaml.as_bytes().to_vec(),
            )]),
        )
    }

    fn two() -> Channels {
        channels(
            "channels:\n- {name: oncall, url: 'https://a.example/', default: true}\n- {name: pay, url: 'https://b.example/'}\n- {name: boss, url: 'https://c.example/'}\n",
        )
    }

    fn approval(notify: &[&str]) -> Approval {
        Approval {
            metadata: ObjectMeta {
                name: Some("r-s-approve".into()),
                namespace: Some("ns".into()),
                uid: Some("u1".into()),
                creation_timestamp: Some(Time(t(0))),
                ..ObjectMeta::default()
            },
            spec: ApprovalSpec {
                run_name: "r".into(),
                run_uid: "ru".into(),
                step: "s".into(),
                plan_revision: 1,
                kind: ApprovalKind::Approve,
                question: "May s run?".into(),
                context: None,
                expires_at: None,
                step_digest: None,
                on_timeout: Default::default(),
                decision: None,
                comment: None,
                approvers: None,
                quorum: 1,
                separate_from_requester: false,
                requested_by: None,
                decided_by: None,
                decided_by_groups: vec![],
                votes: vec![],
                notify: notify.iter().map(|s| s.to_string()).collect(),
                escalate: None,
            },
            status: None,
        }
    }

    fn with(mut a: Approval, phase: ApprovalPhase, deliveries: Vec<Delivery>) -> Approval {
        a.status = Some(ApprovalStatus {
            phase,
            decided_at: (phase != ApprovalPhase::Pending).then(|| Time(t(50))),
            notifications: deliveries,
            ..ApprovalStatus::default()
        });
        a
    }

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
