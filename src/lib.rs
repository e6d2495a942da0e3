//! agentrun-operator makes AI-agent runs durable on Kubernetes.
//!
//! - [`api`]: the `AgentRun` and `Approval` resources.
#![forbid(unsafe_code)]

pub mod api;
