//! A journaled step (D19): its journal, not only its declared effect, says
//! whether a lost attempt may have acted, and a call that may have acted is
//! settled per call before the next attempt replays past it.
//!
//! ```text
//!   attempt lost/failed ──▶ journal has an open intent?
//!        no  ─▶ runs again, same key (a disruption costs no retry); it replays
//!        yes ─▶ call Unknown ─▶ verify probe (AGENTRUN_CALL_*) or Reconcile Approval
//!                 Applied / MarkSucceeded ─▶ settled Applied  ┐ written to the chunk's
//!                 NotApplied / Retry      ─▶ settled NotApplied┘ status, then attempt n+1
//!   journal past journal.maxBytes ─▶ the step fails (JournalOverCap)
//!   journal's model tokens ─▶ the step's tokens, each call once (D9)
//! ```

use agentrun_api::{
    EffectOutcome, JournalCall, JournalSpec, JournalSummary, StepPhase, StepRole, TokenUsage,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::journal::{self, Journal};
use crate::names;
use crate::plan::Plan;
use crate::reasons::Reason;
use crate::{Action, EventType};

use super::Machine;
use super::slot::Slot;

impl<'a> Machine<'_, 'a> {
    /// The journaling of the plan step named `name`, if it journals.
    pub(super) fn journal_spec(&self, plan: &Plan<'_>, name: &str) -> Option<JournalSpec> {
        match plan.step(name) {
            Some(s) => s.journal.as_deref().cloned(),
            None => self.step_spec(plan, name)?.journal.map(|j| *j),
        }
    }

    /// What the cache shows of a step's journal at a plan revision.
    pub(super) fn journal(&self, step: &str, rev: i64) -> Journal {
        let prefix = names::journal_prefix(self.view.name, self.view.uid, step, rev);
        journal::read(&self.view.journals, self.view.uid, &prefix)
    }

    /// Whether plan step checkpoint `i`'s last attempt may have acted beyond
    /// what is recorded: for a journaled step, only when its journal holds a
    /// call that started and was never answered; for any other, always.
    pub(super) fn unrecorded_call_may_have_acted(&self, plan: &Plan<'_>, i: usize) -> bool {
        let cp = &self.draft.status.steps[i];
        if cp.role != StepRole::Step || self.journal_spec(plan, &cp.name).is_none() {
            return true;
        }
        self.journal(&cp.name, cp.plan_revision).open.is_some()
    }

    /// What a step's journal at revision `rev` says its effect was: a tool
    /// call with an effect answered or settled `Applied` (Applied), else a
    /// call that started and was never answered nor settled (Unknown).
    pub(super) fn journal_effect(&self, step: &str, rev: i64) -> Option<EffectOutcome> {
        if self.view.journals.is_empty() {
            return None;
        }
        let j = self.journal(step, rev);
        if j.applied {
            Some(EffectOutcome::Applied)
        } else {
            j.open.map(|_| EffectOutcome::Unknown)
        }
    }

    /// Before a journaled step's question is asked: note which call may have
    /// acted, so the probe and the person are asked about that call; returns
    /// how to say so.
    pub(super) fn note_open_call(&mut self, plan: &Plan<'_>, c: usize) -> Option<String> {
        let cp = &self.draft.status.steps[c];
        self.journal_spec(plan, &cp.name)?;
        let open = self.journal(&cp.name, cp.plan_revision).open?;
        let text = format!(
            "its call {} ({}{}, key {}) started and was never answered",
            open.seq,
            open.name
                .as_deref()
                .map(|n| format!("{n} "))
                .unwrap_or_default(),
            open.call_id,
            open.key
        );
        self.draft.tally.calls_unknown += 1;
        let summary = self.draft.status.steps[c]
            .journal
            .get_or_insert_with(Default::default);
        summary.unknown = Some(JournalCall {
            seq: open.seq,
            call_id: open.call_id,
            key: open.key,
            name: open.name,
            request_digest: open.request_digest,
            chunk: open.chunk,
            attempt: open.attempt,
            ..JournalCall::default()
        });
        Some(text)
    }

    /// The call checkpoint `c` asked about, if its question is about a call.
    pub(super) fn unknown_call(&self, c: usize) -> Option<&JournalCall> {
        self.draft.status.steps[c]
            .journal
            .as_ref()?
            .unknown
            .as_ref()
    }

    /// The call checkpoint `c` asked about is settled: recorded here, written
    /// to its chunk, and the step runs again (same key) once that write is
    /// seen; the new attempt replays past the call.
    pub(super) fn settle_call(
        &mut self,
        c: usize,
        outcome: EffectOutcome,
        response: Option<String>,
        by: &str,
    ) {
        let now = self.view.now;
        let (name, rev) = (
            &self.draft.status.steps[c].name,
            self.draft.status.steps[c].plan_revision,
        );
        // The calls before this one that acted still did.
        let applied = self.journal(name, rev).applied;
        let cp = &mut self.draft.status.steps[c];
        let Some(call) = cp.journal.as_mut().and_then(|j| j.unknown.as_mut()) else {
            return;
        };
        call.outcome = Some(outcome);
        call.response = response.clone();
        call.settled_by = Some(by.to_owned());
        let (seq, attempt, chunk) = (call.seq, call.attempt, call.chunk.clone());
        let text = format!(
            "call {seq} ({}) settled {outcome:?} by {by}; attempt {} replays past it with the same key",
            call.call_id,
            cp.attempt + 1
        );
        cp.phase = StepPhase::Pending;
        cp.next_attempt_at = None;
        cp.effect = match outcome {
            EffectOutcome::Applied => Some(EffectOutcome::Applied),
            _ if applied => Some(EffectOutcome::Applied),
            _ => cp.effect.filter(|e| *e == EffectOutcome::Applied),
        };
        cp.message = Some(text.clone());
        let name = cp.name.clone();
        self.draft.recorded = true;
        self.draft.tally.calls_settled += 1;
        self.draft.actions.push(Action::SettleCall {
            chunk,
            settlement: journal::settlement(seq, attempt, outcome, response, by, now),
        });
        self.event(
            EventType::Normal,
            Reason::CallSettled,
            format!("step {name}: {text}"),
        );
    }

    /// Whether step checkpoint `c` waits for a call's settlement to be
    /// written before its next attempt (the gate holds it).
    pub(super) fn settling(&self, c: usize) -> bool {
        self.unknown_call(c).is_some()
    }

    /// Each decision: what the journals of the plan's steps show. Counts
    /// their tokens (D9), sees a settlement written (and writes it again
    /// until it is), and fails a step whose journal passed its cap.
    pub(super) fn observe_journals(&mut self, plan: &Plan<'_>) {
        // A run with no journal chunk has nothing to count, settle or cap:
        // every decision of a run without journaled steps stops here.
        if self.view.journals.is_empty() {
            return;
        }
        let budgeted = self
            .view
            .run
            .spec
            .budget
            .as_ref()
            .is_some_and(|b| b.tokens.is_some());
        for i in 0..self.draft.status.steps.len() {
            let cp = &self.draft.status.steps[i];
            if cp.role != StepRole::Step || cp.phase.is_terminal() {
                continue;
            }
            let Some(spec) = self.journal_spec(plan, &cp.name) else {
                continue;
            };
            let j = self.journal(&cp.name, cp.plan_revision);
            if j.calls == 0 && cp.journal.is_none() {
                continue;
            }
            if j.bytes > spec.max_bytes() {
                self.journal_over_cap(plan, i, &j, spec.max_bytes());
                continue;
            }
            self.see_settlement(i, &j);
            // Counted while the attempt runs only where a budget needs it:
            // otherwise every call would cost a status write.
            if budgeted || self.draft.status.steps[i].phase != StepPhase::Running {
                self.count_journal(i, &j);
            }
        }
    }

    fn see_settlement(&mut self, i: usize, j: &Journal) {
        let Some(call) = self.unknown_call(i).cloned() else {
            return;
        };
        let Some(outcome) = call.outcome else {
            return; // not decided yet: the probe or a person is asked
        };
        if j.settled.contains_key(&(call.seq, call.attempt)) {
            if let Some(s) = self.draft.status.steps[i].journal.as_mut() {
                s.unknown = None;
                s.settled = j.settled.len() as i64;
            }
            return;
        }
        // The API server refused the settlement in this reconcile (a
        // policy, the operator's RBAC, the chunk gone): the step waits for
        // it, and the run says why (D16); it is tried again with backoff.
        if let Some(r) = self.view.refused.iter().find(|r| r.name == call.chunk) {
            let what = format!(
                "step {}: the settlement of call {} ({}) as {:?}",
                self.draft.status.steps[i].name, call.seq, call.call_id, outcome
            );
            return self.stall(&what, "StepJournal", r);
        }
        self.draft.actions.push(Action::SettleCall {
            chunk: call.chunk.clone(),
            settlement: journal::settlement(
                call.seq,
                call.attempt,
                outcome,
                call.response.clone(),
                call.settled_by.as_deref().unwrap_or("verify"),
                self.view.now,
            ),
        });
    }

    fn count_journal(&mut self, i: usize, j: &Journal) {
        self.count_journal_tokens(i, j.tokens);
        let summary = self.draft.status.steps[i]
            .journal
            .get_or_insert_with(Box::<JournalSummary>::default);
        summary.calls = summary.calls.max(j.calls);
        summary.bytes = summary.bytes.max(j.bytes);
        summary.settled = j.settled.len() as i64;
    }

    /// Counts a journal's tokens into its step's once: what `total` holds
    /// beyond what was counted before.
    fn count_journal_tokens(&mut self, i: usize, total: TokenUsage) {
        let counted = self.draft.status.steps[i]
            .journal
            .as_ref()
            .and_then(|s| s.tokens)
            .unwrap_or_default();
        let more = TokenUsage {
            input: (total.input - counted.input).max(0),
            output: (total.output - counted.output).max(0),
        };
        if more.total() == 0 {
            return;
        }
        self.add_tokens(Slot::Step(i), more);
        self.draft.status.steps[i]
            .journal
            .get_or_insert_with(Box::<JournalSummary>::default)
            .tokens = Some(TokenUsage {
            input: counted.input + more.input,
            output: counted.output + more.output,
        });
    }

    /// A journaled step's attempt ended with a report: its journal is
    /// counted now, whole — as the cache shows it, or as the attempt saw it
    /// at its end when the cache has not caught up (the run may finish in
    /// this decision and never look again).
    pub(super) fn count_journal_at_end(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        reported: Option<TokenUsage>,
    ) {
        let cp = &self.draft.status.steps[i];
        if cp.role != StepRole::Step || self.journal_spec(plan, &cp.name).is_none() {
            return;
        }
        let j = self.journal(&cp.name, cp.plan_revision);
        self.count_journal(i, &j);
        if let Some(r) = reported {
            self.count_journal_tokens(
                i,
                TokenUsage {
                    input: r.input.max(j.tokens.input),
                    output: r.output.max(j.tokens.output),
                },
            );
        }
    }

    /// The journal of checkpoint `i` holds more than its cap: the step
    /// fails for good (a retry would replay the same calls past it).
    fn journal_over_cap(&mut self, plan: &Plan<'_>, i: usize, j: &Journal, max: i64) {
        self.count_journal(i, j);
        let cp = &self.draft.status.steps[i];
        let why = format!(
            "its journal holds {} bytes in {} calls, past its journal.maxBytes {max}",
            j.bytes, j.calls
        );
        if cp.phase == StepPhase::Running
            && let Some(pod) = cp.pod.clone()
        {
            self.draft.actions.push(Action::DeletePod {
                name: pod,
                reason: why.clone(),
            });
            self.draft.status.steps[i].stopping = true;
        }
        if j.tool_calls > 0 {
            self.record_effect(plan, i, EffectOutcome::Unknown);
        }
        let name = self.draft.status.steps[i].name.clone();
        self.draft.tally.journals_over_cap += 1;
        self.event(
            EventType::Warning,
            Reason::JournalOverCap,
            format!("step {name}: {why}"),
        );
        let now = Time(self.view.now);
        let cp = &mut self.draft.status.steps[i];
        cp.phase = StepPhase::Failed;
        cp.finished_at = Some(now);
        cp.next_attempt_at = None;
        cp.message = Some(why.clone());
        self.draft.recorded = true;
        self.step_exhausted(i, why);
    }
}
