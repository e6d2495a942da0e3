//! Builders for runs and steps in tests: a run named `run`, steps with the
//! fields a test sets, a fixed clock. For this crate's tests and, with the
//! `testing` feature, for the crates that test against these types.

use jiff::Timestamp;

use crate::{
    AgentRun, AgentRunSpec, ApprovalGate, Backoff, Budget, ContextSpec, Duration, Effect,
    OnTimeout, RetryPolicy, StepContainer, StepSpec,
};

pub const RUN: &str = "run";
pub const UID: &str = "run-uid";

/// A fixed instant plus `secs`.
pub fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_750_000_000 + secs).unwrap()
}

pub fn container(image: &str) -> StepContainer {
    StepContainer {
        image: image.into(),
        ..StepContainer::default()
    }
}

/// An Idempotent step with no retries.
pub fn step(name: &str) -> StepSpec {
    StepSpec {
        name: name.into(),
        container: Some(container("tool:1")),
        effect: Effect::Idempotent,
        ..StepSpec::default()
    }
}

impl StepSpec {
    pub fn with_effect(mut self, effect: Effect) -> Self {
        self.effect = effect;
        self
    }
    pub fn with_timeout(mut self, d: &str) -> Self {
        self.timeout = Some(Duration::from(d));
        self
    }
    pub fn with_retry(mut self, limit: i32, initial: &str, max: &str) -> Self {
        self.retry = Some(Box::new(RetryPolicy {
            limit,
            backoff: Some(Backoff {
                initial: Duration::from(initial),
                max: Duration::from(max),
            }),
        }));
        self
    }
    pub fn with_fresh_for(mut self, d: &str) -> Self {
        self.fresh_for = Some(Duration::from(d));
        self
    }
    pub fn with_approval(mut self, timeout: Option<&str>, on_timeout: OnTimeout) -> Self {
        self.approval = Some(Box::new(ApprovalGate {
            required: true,
            question: Some(format!("run {}?", self.name)),
            timeout: timeout.map(Duration::from),
            on_timeout,
            ..ApprovalGate::default()
        }));
        self
    }
    /// The approval gate asks these approvers for `quorum` votes.
    pub fn with_approvers(mut self, approvers: crate::Approvers, quorum: i32) -> Self {
        let gate = self.approval.get_or_insert_with(|| {
            Box::new(ApprovalGate {
                required: true,
                ..ApprovalGate::default()
            })
        });
        gate.approvers = Some(approvers);
        gate.quorum = Some(quorum);
        self
    }
    pub fn with_compensate(mut self) -> Self {
        self.compensate = Some(Box::new(container("undo:1")));
        self
    }
}

impl AgentRun {
    /// A run named `run` with UID `run-uid`, generation 1, no steps.
    pub fn test() -> AgentRun {
        let mut run = AgentRun::new(RUN, AgentRunSpec::default());
        run.metadata.namespace = Some("default".into());
        run.metadata.uid = Some(UID.into());
        run.metadata.generation = Some(1);
        run
    }
    pub fn with_steps(mut self, steps: impl IntoIterator<Item = StepSpec>) -> Self {
        self.spec.steps = steps.into_iter().collect();
        self
    }
    pub fn with_planner(mut self, planner: StepSpec) -> Self {
        self.spec.planner = Some(Box::new(planner));
        self
    }
    pub fn with_budget(mut self, tokens: Option<i64>, step_executions: Option<i32>) -> Self {
        self.spec.budget = Some(Budget {
            tokens,
            step_executions,
            replans: None,
        });
        self
    }
    pub fn with_context(mut self, max_bytes: i32, compactor: bool) -> Self {
        self.spec.context = Some(Box::new(ContextSpec {
            max_bytes: Some(max_bytes),
            compactor: compactor.then(|| container("compact:1")),
        }));
        self
    }
    pub fn with_deadline(mut self, secs: i64) -> Self {
        self.spec.active_deadline_seconds = Some(secs);
        self
    }
    pub fn with_ttl(mut self, secs: i32) -> Self {
        self.spec.ttl_seconds_after_finished = Some(secs);
        self
    }
}
