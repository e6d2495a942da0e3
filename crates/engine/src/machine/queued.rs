//! A run that has not started waits while the operator's caps on active
//! runs are reached (the controller says where, `Observed::queued`): phase
//! `Queued`, its place in the queue, no Pod, no Approval, no `startedAt`.
//! `startedAt` is what admits it, and it is written once: a run that started
//! is never queued again, whatever the caps become.

use crate::Queued;
use crate::conditions::{self as cond, FALSE, UNKNOWN};
use crate::reasons::{ConditionType, Reason};
use agentrun_api::RunPhase;

use super::Machine;

impl<'a> Machine<'_, 'a> {
    pub(super) fn wait_in_queue(&mut self, q: &Queued) {
        self.draft.status.phase = Some(RunPhase::Queued);
        self.draft.status.queue_position = Some(q.position.try_into().unwrap_or(i32::MAX));
        let (g, now) = (self.view.run.metadata.generation, self.view.now);
        let message = format!("queued at position {}: {}", q.position, q.why);
        let conds = &mut self.draft.status.conditions;
        cond::set(
            conds,
            ConditionType::Succeeded,
            UNKNOWN,
            Reason::Queued,
            message.clone(),
            g,
            now,
        );
        cond::set(
            conds,
            ConditionType::Progressing,
            FALSE,
            Reason::Queued,
            message,
            g,
            now,
        );
        // Another run's end wakes it; this is the fallback.
        self.draft.deadlines.push(
            self.view
                .now
                .checked_add(crate::QUEUE_RECHECK)
                .unwrap_or(jiff::Timestamp::MAX),
        );
    }
}
