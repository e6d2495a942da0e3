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

mod condition;
mod record;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;

use jiff::Timestamp;

use super::channels::{Channels, Problem};
use crate::api::{Approval, ApprovalPhase, Delivery, DeliveryState, NotificationEvent};

pub use condition::{CONDITION, condition};
pub use record::{backoff, record};

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
