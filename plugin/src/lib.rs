//! `kubectl agentrun`: inspect, answer and steer AgentRuns.
//!
//! ```text
//!   cli                       clap and the dispatch: the only file that knows every command
//!    ├─▶ commands/*           one file per command (list, describe, logs, decide, signal, …)
//!    └─▶ console/*            the web console (`kubectl agentrun console`)
//!          │ both use, never the other way round:
//!          ├─▶ decision, fork, history_filter   what a command and a console page share
//!          ├─▶ render                           what they print (pure, tested on real status objects)
//!          └─▶ client, identity                 the client, the error, whoami, a run's approvals,
//!                                               Events and Signals; what a user may decide
//! ```
//!
//! Files import downward only; `tests/layers.rs` fails on a circle.
#![forbid(unsafe_code)]

pub mod cli;
pub mod client;
pub mod commands;
pub mod console;
pub mod decision;
pub mod fork;
pub mod history_filter;
pub mod identity;
pub mod render;
