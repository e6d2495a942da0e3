//! What the operator tells about each run beyond its status: the facts of
//! each committed write ([`transitions`]), timed from status, that feed the
//! metrics' histograms and the run's trace; the trace and span ids derived
//! from the run UID ([`ids`]).

pub mod gauges;
pub use agentrun_engine::trace_ids as ids;
pub mod trace;
pub mod transitions;

#[cfg(test)]
mod gitops_fixtures;
