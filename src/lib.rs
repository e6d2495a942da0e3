//! agentrun-operator makes AI-agent runs durable on Kubernetes.
//!
//! - [`api`]: the `AgentRun`, `Approval`, `Signal` and `RunRecord` resources.
//! - [`engine`]: the durable run state machine, pure and clock-free.
//! - [`controller`]: the kube-runtime wiring: observe, decide, apply.
//! - [`history`]: the records finished runs leave, and re-creations recognised (D18).
//! - [`notify`]: approval notifications to the platform team's channels.
//! - [`lease`]: leader election, where a leader that cannot renew steps down.
//! - [`labels`]: the names put on the objects the operator creates.
//! - [`metrics`]: `/metrics`, `/healthz` and `/readyz`.
//! - [`telemetry`]: what each committed write changed, and the run's trace.
#![forbid(unsafe_code)]

pub mod api;
pub mod controller;
pub mod engine;
pub mod history;
pub mod labels;
pub mod lease;
pub mod metrics;
pub mod notify;
pub mod telemetry;
