//! Telling people that an approval waits for them: which channels a gate
//! names, when it escalates, and what became of each delivery (recorded on
//! the Approval, so a restarted operator resumes where it left off).
//!
//! The channels themselves (URLs, formats, signing keys) are configured by
//! the platform team in a Secret the operator reads (`--notify-secret`); a
//! run names channels only, so a run author can never make the operator
//! call an address of their choosing.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Duration;

/// A reminder sent to other channels while an approval still waits.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Escalation {
    /// How long after the request the reminder goes out, if nobody decided
    /// by then. Must be shorter than the gate's `timeout`.
    #[x_kube(validation = Rule::new(concat!("!self.matches(r'", crate::duration_pattern!(), "') || duration(self) > duration('0s')")).message("approval.escalate.after must be longer than 0s"))]
    pub after: Duration,
    /// The channels the reminder goes to (names from the operator's channel
    /// configuration).
    #[schemars(
        length(min = 1, max = 8),
        inner(
            length(min = 1, max = 63),
            regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
        )
    )]
    pub notify: Vec<String>,
}

/// Why a message is sent.
#[derive(
    JsonSchema,
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
)]
pub enum NotificationEvent {
    /// The approval was asked.
    #[default]
    Requested,
    /// Nobody decided within `escalate.after`.
    Escalated,
    /// Someone decided (approved, rejected or, for Reconcile, resolved it).
    Decided,
    /// Nobody decided in time; `onTimeout` applied.
    Expired,
}

impl NotificationEvent {
    /// The lower-case name used in delivery ids and payloads.
    pub fn as_str(self) -> &'static str {
        match self {
            NotificationEvent::Requested => "requested",
            NotificationEvent::Escalated => "escalated",
            NotificationEvent::Decided => "decided",
            NotificationEvent::Expired => "expired",
        }
    }
}

/// What became of a delivery.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeliveryState {
    /// Not delivered yet; tried again at `nextAttemptAt`.
    #[default]
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Given up: a permanent refusal (4xx, an address the operator may not
    /// call, a channel that is not configured) or the attempts ran out.
    Failed,
    /// No longer worth sending: the approval was decided before a request
    /// or reminder got through.
    Abandoned,
}

/// One message to one channel, and what became of it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Delivery {
    /// Stable across retries and restarts: `<approval uid>.<event>.<channel>`,
    /// sent as `X-AgentRun-Delivery`, so a receiver can drop a repeat.
    pub id: String,
    pub channel: String,
    pub event: NotificationEvent,
    #[serde(default)]
    pub state: DeliveryState,
    /// Requests sent so far.
    // An int32 with a minimum of 0 in the schema: the API server knows no
    // `uint32` format and warns about it on every apply.
    #[serde(default)]
    #[schemars(with = "i32", range(min = 0))]
    pub attempts: u32,
    /// When the receiver accepted the notification.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_at: Option<Time>,
    /// Earliest time of the next request (backoff), to the whole second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<Time>,
    /// Why it is in its state, in one word: `Delivered`, `Retrying`,
    /// `ReceiverRefused` (a 4xx or a redirect), `GaveUp` (attempts ran
    /// out), `AddressRefused`, `ChannelUnknown`, `ChannelInvalid`,
    /// `ChannelsUnreadable` (the channel Secret), `Abandoned`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What the last failed attempt met (status code and body, timeout,
    /// refused address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub last_error: Option<String>,
}
