//! The engine's decision, taken off the async workers (D22).
//!
//! A decision evaluates what the run's author wrote (a step's `when`, a
//! result schema): bounded in cost by the engine, it still may take longer
//! than a reconcile should hold one of the few threads every other run's
//! reconcile shares. So it runs on the blocking pool, and once
//! [`DEADLINE`] has passed the controller raises the interrupt the engine's
//! CEL evaluation checks: the expression stops, the step fails with that
//! reason, and the decision that says so is applied like any other.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use jiff::Timestamp;

use super::error::{Error, Result};
use super::world::World;
use crate::api::AgentRun;
use crate::engine::{self, Observed};

/// How long a decision may evaluate the author's CEL before it is stopped.
/// The cost budget (`engine::cel::COST_LIMIT`) ends an expression well
/// before this on an idle machine; the deadline holds on a starved one.
pub const DEADLINE: Duration = Duration::from_secs(2);

/// What one decision is taken on, owned so it can move to another thread.
pub(super) struct Facts {
    pub run: Arc<AgentRun>,
    pub world: World,
    pub refused: Vec<engine::Refusal>,
    pub source: Option<AgentRun>,
    pub queued: Option<engine::Queued>,
    pub history: engine::History,
    pub now: Timestamp,
}

/// Decides on `facts` on the blocking pool; hands the world back with the
/// decision, for the stages that apply it.
pub(super) async fn decide(facts: Facts) -> Result<(engine::Decision, World)> {
    let interrupt = Arc::new(AtomicBool::new(false));
    let raised = interrupt.clone();
    let run = format!(
        "{}/{}",
        facts.run.metadata.namespace.as_deref().unwrap_or_default(),
        facts.run.metadata.name.as_deref().unwrap_or_default()
    );
    let mut task = tokio::task::spawn_blocking(move || {
        let decision = engine::decide(&Observed {
            run: &facts.run,
            pods: &facts.world.pods,
            approvals: &facts.world.approvals,
            signals: &facts.world.signals,
            journals: &facts.world.journals,
            refused: &facts.refused,
            source: facts.source.as_ref(),
            queued: facts.queued,
            history: facts.history,
            now: facts.now,
            cel: engine::cel::Limits {
                cost: engine::cel::COST_LIMIT,
                interrupt: Some(interrupt),
            },
        });
        (decision, facts.world)
    });
    let joined = match tokio::time::timeout(DEADLINE, &mut task).await {
        Ok(joined) => joined,
        Err(_) => {
            raised.store(true, Ordering::Relaxed);
            task.await
        }
    };
    joined.map_err(|e| Error::Decide {
        run,
        message: e.to_string(),
    })
}
