//! agentrun-operator makes AI-agent runs durable on Kubernetes.
//!
//! The resources, the engine and the history are crates of their own
//! (`crates/`), re-exported here under the names the operator uses.
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

pub use agentrun_api as api;
pub use agentrun_api::labels;
pub use agentrun_engine as engine;
pub use agentrun_history as history;
pub mod controller;
pub mod lease;
pub mod metrics;
pub mod notify;
pub mod telemetry;
