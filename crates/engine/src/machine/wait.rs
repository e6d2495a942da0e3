//! Wait steps, durable timers: a step with `wait` instead of a container runs
//! no Pod. When it starts, the time it wakes is fixed in its checkpoint
//! (`wakeAt`) and the run is requeued for it (D10), so an operator restart, a
//! spec edit or a long downtime never moves it; a wake that came while the
//! operator was down is taken at the next decision. It counts against no
//! budget and holds no place in `parallelism`. A run that fails or is
//! cancelled ends its waits at once (`fail_run`). A wait for a signal from
//! outside is in `signals`.

use jiff::SignedDuration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::EventType;
use crate::names::PodRole;
use crate::plan::Plan;
use crate::reasons::Reason;
use agentrun_api::{CheckpointState, EffectOutcome, StepCheckpoint, StepPhase, StepRole};

use super::{Machine, whole_seconds};

impl<'a> Machine<'_, 'a> {
    /// Starts wait step `i` of the plan: its checkpoint, with when it wakes.
    pub(super) fn start_wait(&mut self, plan: &Plan<'_>, i: usize) {
        let step = plan.steps[i];
        let Some(wait) = step.wait.as_deref() else {
            return;
        };
        if wait.signal.is_some() {
            return self.start_signal(plan, i);
        }
        let now = whole_seconds(self.view.now);
        // Both were checked with the plan (`validate_wait`).
        let wake = match (&wait.for_, &wait.until) {
            (Some(d), _) => now
                .checked_add(d.parse().unwrap_or(SignedDuration::ZERO))
                .unwrap_or(jiff::Timestamp::MAX),
            // Status keeps whole seconds: a fraction rounds up, never early.
            (None, Some(t)) if t.0.subsec_nanosecond() != 0 => {
                jiff::Timestamp::from_second(t.0.as_second() + 1).unwrap_or(t.0)
            }
            (None, Some(t)) => t.0,
            (None, None) => now,
        };
        self.open_wait(
            plan,
            i,
            now,
            Some(wake),
            None,
            format!("waits until {wake}"),
        );
    }

    /// Records that wait step `i` started at `now`: its checkpoint
    /// (`Waiting`, until `wake`, on `signal` if it waits for one) and a
    /// `StepWaiting` Event saying `message`; the run is requeued for `wake`.
    pub(super) fn open_wait(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        now: jiff::Timestamp,
        wake: Option<jiff::Timestamp>,
        signal: Option<String>,
        message: String,
    ) {
        let name = plan.steps[i].name.clone();
        self.event(
            EventType::Normal,
            Reason::StepWaiting,
            format!("step {name} {message}"),
        );
        self.draft.status.steps.push(StepCheckpoint {
            idempotency_key: self.key(PodRole::Step, &name, plan.revision),
            name,
            role: StepRole::Step,
            plan_revision: plan.revision,
            phase: StepPhase::Waiting,
            started_at: Some(Time(now)),
            wake_at: wake.map(Time),
            signal,
            message: Some(message),
            ..StepCheckpoint::default()
        });
        self.draft.deadlines.extend(wake);
    }

    /// Ends the waits whose time came (a failing run ended its waits when
    /// it began to fail, see `fail_run`).
    pub(super) fn observe_waits(&mut self, plan: &Plan<'_>) {
        for i in 0..self.draft.status.steps.len() {
            if self.draft.status.steps[i].phase != StepPhase::Waiting {
                continue;
            }
            if self.draft.status.steps[i].signal.is_some() {
                self.observe_signal(plan, i);
                continue;
            }
            let now = self.view.now;
            let cp = &mut self.draft.status.steps[i];
            let wake = cp.wake_at.as_ref().map_or(now, |t| t.0);
            if wake > now {
                self.draft.deadlines.push(wake);
                continue;
            }
            // The wait is as old as its wake, not as the moment the
            // operator noticed (it may have been down meanwhile).
            cp.phase = StepPhase::Succeeded;
            cp.checkpoint = CheckpointState::Committed;
            cp.effect = Some(EffectOutcome::NotApplied);
            cp.finished_at = Some(Time(wake));
            cp.message = None;
            let name = cp.name.clone();
            self.draft.tally.succeeded += 1;
            self.event(
                EventType::Normal,
                Reason::StepWoke,
                format!("step {name} woke at {wake}"),
            );
        }
    }
}
