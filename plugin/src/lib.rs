//! `kubectl agentrun`: inspect, answer and steer AgentRuns. The commands are
//! in `commands`; what they print is in `render` (pure, tested on real
//! status objects); who the user is and what they may decide in `identity`;
//! sending a wait step's signal in `signal`; the web console
//! (`kubectl agentrun console`) in `console`.
#![forbid(unsafe_code)]

pub mod commands;
pub mod console;
pub mod decide;
pub mod history;
pub mod identity;
pub mod render;
pub mod retry;
pub mod signal;
