//! agentrun-operator makes AI-agent runs durable on Kubernetes.
//!
//! - [`api`]: the `AgentRun` and `Approval` resources.
//! - [`engine`]: the durable run state machine, pure and clock-free.
//! - [`labels`]: the names put on the objects the operator creates.
#![forbid(unsafe_code)]

pub mod api;
pub mod engine;
pub mod labels;
