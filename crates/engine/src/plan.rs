//! The plan in force: validating steps (from the spec or from a planner's
//! result) and finding each step's effective checkpoint at a plan revision.
//! What slipped past admission is refused here with a message naming the
//! field (D13), never with a panic.

use std::collections::{HashMap, HashSet};

use jiff::SignedDuration;

use agentrun_api::{
    AgentRunSpec, Backoff, MAX_CONTEXT_BYTES, MAX_DEPENDS_ON, MAX_STEP_NAME, MAX_STEPS, PlanSource,
    PlanStatus, StepCheckpoint, StepPhase, StepRole, StepSpec, WaitSpec,
};

/// Checks a list of steps the way admission would. `at` names the list in messages.
pub fn validate_steps(steps: &[StepSpec], at: &str) -> Result<(), String> {
    if steps.len() > MAX_STEPS {
        return Err(format!(
            "{at}: {} steps, more than the {MAX_STEPS} a plan may have",
            steps.len()
        ));
    }
    let mut seen = HashSet::new();
    for (i, step) in steps.iter().enumerate() {
        let item = format!("{at}[{i}]");
        validate_step(step, &item)?;
        if !seen.insert(step.name.as_str()) {
            return Err(format!(
                "{item}.name: step name {:?} is used twice",
                step.name
            ));
        }
    }
    let refs: Vec<&StepSpec> = steps.iter().collect();
    let (deps, _) = graph_of(&refs, at)?;
    for (i, step) in steps.iter().enumerate() {
        if let Some(when) = &step.when {
            let known: Vec<&str> = deps[i].iter().map(|&j| steps[j].name.as_str()).collect();
            super::when::check(when, &known).map_err(|e| format!("{at}[{i}].when: {e}"))?;
        }
    }
    Ok(())
}

pub fn validate_step(step: &StepSpec, at: &str) -> Result<(), String> {
    if !is_dns_label(&step.name) || step.name.len() > MAX_STEP_NAME {
        return Err(format!(
            "{at}.name: {:?} must be a DNS label (lower-case letters, digits and '-') of at most {MAX_STEP_NAME} characters",
            step.name
        ));
    }
    match (&step.container, &step.wait) {
        (Some(c), None) if c.image.is_empty() => {
            return Err(format!("{at}.container.image: an image is required"));
        }
        (Some(_), None) => {}
        (None, Some(w)) => validate_wait(step, w, at)?,
        _ => {
            return Err(format!(
                "{at}: a step has a container or a wait, exactly one of them"
            ));
        }
    }
    let durations = [
        ("freshFor", step.fresh_for.as_ref()),
        ("timeout", step.timeout.as_ref()),
        (
            "approval.timeout",
            step.approval.as_ref().and_then(|a| a.timeout.as_ref()),
        ),
        (
            "retry.backoff.initial",
            step.retry
                .as_ref()
                .and_then(|r| r.backoff.as_ref())
                .map(|b| &b.initial),
        ),
        (
            "retry.backoff.max",
            step.retry
                .as_ref()
                .and_then(|r| r.backoff.as_ref())
                .map(|b| &b.max),
        ),
    ];
    for (field, d) in durations {
        if let Some(d) = d {
            d.parse().map_err(|e| format!("{at}.{field}: {e}"))?;
        }
    }
    if step
        .depends_on
        .as_ref()
        .is_some_and(|d| d.len() > MAX_DEPENDS_ON)
    {
        return Err(format!(
            "{at}.dependsOn: more than the {MAX_DEPENDS_ON} steps a step may depend on"
        ));
    }
    if let Some(r) = &step.retry
        && !(0..=100).contains(&r.limit)
    {
        return Err(format!("{at}.retry.limit: {} is outside 0–100", r.limit));
    }
    if let Some(c) = &step.compensate
        && c.image.is_empty()
    {
        return Err(format!("{at}.compensate.image: an image is required"));
    }
    if let Some(schema) = &step.result_schema {
        super::schema::check(schema).map_err(|e| format!("{at}.resultSchema: {e}"))?;
    }
    Ok(())
}

/// A wait step: exactly one of `for` (longer than 0s) and `until`, and none
/// of what only a container's attempts use.
fn validate_wait(step: &StepSpec, w: &WaitSpec, at: &str) -> Result<(), String> {
    match (&w.for_, &w.until, &w.signal) {
        (Some(d), None, None) => {
            let d = d.parse().map_err(|e| format!("{at}.wait.for: {e}"))?;
            if d <= SignedDuration::ZERO {
                return Err(format!("{at}.wait.for: must be longer than 0s"));
            }
        }
        (None, Some(_), None) => {}
        (None, None, Some(s)) => {
            if let Some(t) = &s.timeout {
                let t = t
                    .parse()
                    .map_err(|e| format!("{at}.wait.signal.timeout: {e}"))?;
                if t <= SignedDuration::ZERO {
                    return Err(format!("{at}.wait.signal.timeout: must be longer than 0s"));
                }
            }
            if s.description.as_ref().is_some_and(|d| d.len() > 256) {
                return Err(format!(
                    "{at}.wait.signal.description: at most 256 characters"
                ));
            }
        }
        _ => {
            return Err(format!(
                "{at}.wait: set exactly one of for, until and signal"
            ));
        }
    }
    let container_only = [
        ("retry", step.retry.is_some()),
        ("timeout", step.timeout.is_some()),
        ("approval", step.approval.is_some()),
        ("compensate", step.compensate.is_some()),
        ("verify", step.verify.is_some()),
        (
            "resultSchema",
            step.result_schema.is_some() && w.signal.is_none(),
        ),
        ("freshFor", step.fresh_for.is_some()),
    ];
    if let Some((field, _)) = container_only.iter().find(|(_, set)| *set) {
        return Err(format!(
            "{at}.{field}: a wait step runs no container: retry, timeout, approval, compensate, verify and freshFor do not apply to it, and resultSchema only to a wait for a signal"
        ));
    }
    Ok(())
}

/// Checks the whole spec once the run starts.
pub fn validate_spec(spec: &AgentRunSpec) -> Result<(), String> {
    if spec.steps.is_empty() && spec.planner.is_none() {
        return Err("spec.steps: at least one step is required unless spec.planner is set".into());
    }
    validate_steps(&spec.steps, "spec.steps")?;
    if let Some(p) = &spec.planner {
        validate_step(p, "spec.planner")?;
        if p.wait.is_some() {
            return Err("spec.planner.wait: a planner runs a container; it cannot wait".into());
        }
    }
    if let Some(ctx) = &spec.context
        && let Some(max) = ctx.max_bytes
        && !(1024..=MAX_CONTEXT_BYTES).contains(&max)
    {
        return Err(format!(
            "spec.context.maxBytes: {max} is outside 1024–{MAX_CONTEXT_BYTES}"
        ));
    }
    if let Some(a) = spec.active_deadline_seconds
        && a < 1
    {
        return Err(format!(
            "spec.activeDeadlineSeconds: {a} must be at least 1"
        ));
    }
    Ok(())
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A duration already validated; a bad one counts as unset rather than panicking.
pub fn duration(d: Option<&agentrun_api::Duration>) -> Option<SignedDuration> {
    d.and_then(|d| d.parse().ok())
}

/// Backoff before attempt `failures + 1`: `initial`, doubling, capped at `max`.
pub fn backoff(policy: Option<&Backoff>, failures: i32) -> SignedDuration {
    let default = Backoff::default();
    let b = policy.unwrap_or(&default);
    let initial = b.initial.parse().unwrap_or(SignedDuration::from_secs(10));
    let max = b
        .max
        .parse()
        .unwrap_or(SignedDuration::from_secs(300))
        .max(initial);
    let doublings = failures.saturating_sub(1).clamp(0, 30) as u32;
    initial.checked_mul(1 << doublings).unwrap_or(max).min(max)
}

/// Which steps of a plan run at its revision; the rest keep a checkpoint from
/// an earlier revision (D8).
#[derive(Clone, Debug, PartialEq)]
pub enum Rerun {
    /// Every step runs at this revision (the first plan, a planner's plan).
    All,
    /// Status written by earlier versions: from this index on, in order.
    From(usize),
    /// Only these steps (by index).
    Only(HashSet<usize>),
}

/// The steps of the plan in force, resolved against the spec or the planner's
/// steps, with the graph they form: a sequence unless a step names
/// `dependsOn`.
pub struct Plan<'a> {
    pub revision: i64,
    pub steps: Vec<&'a StepSpec>,
    /// `deps[i]`: the indices of the steps step `i` depends on.
    pub deps: Vec<Vec<usize>>,
    /// Every step after the steps it depends on; list order for a sequence.
    pub order: Vec<usize>,
    pub rerun: Rerun,
}

impl<'a> Plan<'a> {
    pub fn resolve(spec: &'a AgentRunSpec, status: &'a PlanStatus) -> Result<Plan<'a>, String> {
        let steps: Vec<&StepSpec> = match status.source {
            PlanSource::Planner => status.steps.iter().collect(),
            PlanSource::Spec => {
                let by_name: HashMap<&str, &StepSpec> =
                    spec.steps.iter().map(|s| (s.name.as_str(), s)).collect();
                status
                    .step_names
                    .iter()
                    .map(|n| {
                        by_name.get(n.as_str()).copied().ok_or_else(|| {
                            format!("spec.steps: step {n:?} of plan revision {} was removed while the run was in progress", status.revision)
                        })
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let (deps, order) = graph_of(&steps, "spec.steps")?;
        let index = |n: &str| steps.iter().position(|s| s.name == n);
        let rerun = if !status.rerun.is_empty() {
            Rerun::Only(status.rerun.iter().filter_map(|n| index(n)).collect())
        } else if let Some(from) = status.rerun_from.as_deref().and_then(index) {
            Rerun::From(from)
        } else {
            Rerun::All
        };
        Ok(Plan {
            revision: status.revision,
            steps,
            deps,
            order,
            rerun,
        })
    }

    pub fn step(&self, name: &str) -> Option<&'a StepSpec> {
        self.steps.iter().copied().find(|s| s.name == name)
    }

    pub fn index(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.name == name)
    }

    /// Whether step `i` runs at this revision rather than keeping an earlier
    /// checkpoint.
    pub fn runs_at_revision(&self, i: usize) -> bool {
        match &self.rerun {
            Rerun::All => true,
            Rerun::From(k) => i >= *k,
            Rerun::Only(set) => set.contains(&i),
        }
    }

    /// Every step `i` comes after, directly or not, in the plan's order: the
    /// inputs it consumes (its context, and the freshness it is judged on).
    pub fn ancestors(&self, i: usize) -> Vec<usize> {
        let mut seen = vec![false; self.steps.len()];
        let mut stack: Vec<usize> = self.deps.get(i).cloned().unwrap_or_default();
        while let Some(j) = stack.pop() {
            if !std::mem::replace(&mut seen[j], true) {
                stack.extend(self.deps[j].iter().copied());
            }
        }
        self.order.iter().copied().filter(|&j| seen[j]).collect()
    }

    /// The steps that come after any of `from`, directly or not.
    pub fn descendants(&self, from: &HashSet<usize>) -> HashSet<usize> {
        let mut out = HashSet::new();
        for &i in &self.order {
            if self.deps[i]
                .iter()
                .any(|d| from.contains(d) || out.contains(d))
            {
                out.insert(i);
            }
        }
        out
    }
}

/// The dependencies of each step, and a topological order of the steps.
type Graph = (Vec<Vec<usize>>, Vec<usize>);

/// The graph a list of steps forms. A list without `dependsOn` is a
/// sequence; with it, an unknown name, a step depending on itself or a
/// cycle is refused (D13).
pub fn graph_of(steps: &[&StepSpec], at: &str) -> Result<Graph, String> {
    let n = steps.len();
    let graph = steps.iter().any(|s| s.depends_on.is_some());
    if !graph {
        let deps = (0..n)
            .map(|i| if i == 0 { Vec::new() } else { vec![i - 1] })
            .collect();
        return Ok((deps, (0..n).collect()));
    }
    let index: HashMap<&str, usize> = steps
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    let mut deps = Vec::with_capacity(n);
    for (i, s) in steps.iter().enumerate() {
        let mut mine: Vec<usize> = Vec::new();
        for d in s.depends_on.iter().flat_map(|d| d.iter()) {
            let Some(&j) = index.get(d.as_str()) else {
                return Err(format!(
                    "{at}[{i}].dependsOn: step {d:?} is not a step of the plan"
                ));
            };
            if j == i {
                return Err(format!(
                    "{at}[{i}].dependsOn: step {:?} depends on itself",
                    s.name
                ));
            }
            if !mine.contains(&j) {
                mine.push(j);
            }
        }
        deps.push(mine);
    }
    // Kahn's algorithm, taking ready steps in list order.
    let mut remaining: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, ds) in deps.iter().enumerate() {
        for &d in ds {
            dependents[d].push(i);
        }
    }
    let mut ready: std::collections::BTreeSet<usize> =
        (0..n).filter(|&i| remaining[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop_first() {
        order.push(i);
        for &k in &dependents[i] {
            remaining[k] -= 1;
            if remaining[k] == 0 {
                ready.insert(k);
            }
        }
    }
    if order.len() < n {
        let cycle: Vec<&str> = (0..n)
            .filter(|&i| remaining[i] > 0)
            .map(|i| steps[i].name.as_str())
            .collect();
        return Err(format!(
            "{at}: the dependsOn of steps {} form a cycle, so none of them could ever start",
            cycle.join(", ")
        ));
    }
    Ok((deps, order))
}

/// Index over `status.steps` by (role, name) for quick effective-checkpoint lookups.
pub struct CheckpointIndex<'s> {
    by_name: HashMap<(StepRole, &'s str), Vec<usize>>,
}

impl<'s> CheckpointIndex<'s> {
    pub fn new(checkpoints: &'s [StepCheckpoint]) -> Self {
        let mut by_name: HashMap<(StepRole, &'s str), Vec<usize>> =
            HashMap::with_capacity(checkpoints.len());
        for (i, c) in checkpoints.iter().enumerate() {
            by_name
                .entry((c.role, c.name.as_str()))
                .or_default()
                .push(i);
        }
        CheckpointIndex { by_name }
    }

    /// The checkpoint at exactly this revision.
    pub fn at(
        &self,
        checkpoints: &[StepCheckpoint],
        role: StepRole,
        name: &str,
        revision: i64,
    ) -> Option<usize> {
        self.by_name
            .get(&(role, name))?
            .iter()
            .copied()
            .find(|&i| checkpoints[i].plan_revision == revision)
    }

    /// The checkpoint that counts for plan step `index` at `plan.revision`:
    /// for a step that runs at this revision, only one made at it; for a step
    /// that keeps an earlier checkpoint, the newest one not superseded.
    pub fn effective(
        &self,
        checkpoints: &[StepCheckpoint],
        plan: &Plan,
        index: usize,
    ) -> Option<usize> {
        let name = plan.steps[index].name.as_str();
        let list = self.by_name.get(&(StepRole::Step, name))?;
        if plan.runs_at_revision(index) {
            return list
                .iter()
                .copied()
                .find(|&i| checkpoints[i].plan_revision == plan.revision);
        }
        list.iter()
            .copied()
            .filter(|&i| {
                let c = &checkpoints[i];
                c.plan_revision <= plan.revision && c.phase != StepPhase::Superseded
            })
            .max_by_key(|&i| checkpoints[i].plan_revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentrun_api::Duration;

    fn b(initial: &str, max: &str) -> Backoff {
        Backoff {
            initial: Duration::from(initial),
            max: Duration::from(max),
        }
    }

    #[test]
    fn backoff_doubles_from_initial_and_caps_at_max() {
        let cases = [
            ("first retry waits initial", 1, 10),
            ("second doubles", 2, 20),
            ("third doubles again", 3, 40),
            ("capped at max", 6, 300),
            ("huge counts do not overflow", 1000, 300),
        ];
        for (name, failures, secs) in cases {
            assert_eq!(
                backoff(Some(&b("10s", "5m")), failures),
                SignedDuration::from_secs(secs),
                "{name}"
            );
        }
        assert_eq!(
            backoff(None, 1),
            SignedDuration::from_secs(10),
            "default policy"
        );
    }
}
