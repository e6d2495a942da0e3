//! The plan of a run as `describe` shows it: the graph its steps form, and
//! for a fork, the run it came from.

use agentrun_api::{AgentRun, AgentRunStatus, StepPhase, StepRole};

use super::text::{mark, table, truncate};

/// Where a fork came from: `Forked from: run R (UID …) at step S, by U; kept: a, b`.
/// Before the operator has read the source, what the spec asks for.
pub fn lineage_line(run: &AgentRun, status: &AgentRunStatus) -> String {
    if let Some(f) = &status.forked_from {
        let by = f
            .requested_by
            .as_deref()
            .map(|u| format!(", by {u}"))
            .unwrap_or_default();
        let kept = if f.inherited.is_empty() {
            "nothing".to_owned()
        } else {
            f.inherited.join(", ")
        };
        return format!(
            "Forked from: run {} (UID {}) at step {}{by}; kept: {kept}\n",
            f.run_name, f.run_uid, f.from_step
        );
    }
    match &run.spec.fork_of {
        Some(f) => format!(
            "Forked from: run {} (UID {}) at step {} (not yet read by the operator)\n",
            f.run_name, f.run_uid, f.from_step
        ),
        None => String::new(),
    }
}

/// For a plan whose steps form a graph (`dependsOn`): each step of the plan
/// in force, what it comes after, and where it stands — done, running,
/// waiting on a person, skipped, or waiting on the steps it depends on.
pub fn graph_lines(run: &AgentRun, status: &AgentRunStatus) -> String {
    let plan = status.plan.clone().unwrap_or_default();
    let specs: Vec<&agentrun_api::StepSpec> = if plan.steps.is_empty() {
        plan.step_names
            .iter()
            .filter_map(|n| run.spec.steps.iter().find(|s| &s.name == n))
            .collect()
    } else {
        plan.steps.iter().collect()
    };
    if !specs.iter().any(|s| s.depends_on.is_some()) {
        return String::new();
    }
    let latest = |name: &str| {
        status
            .steps
            .iter()
            .filter(|c| c.name == name && c.role == StepRole::Step)
            .filter(|c| c.phase != StepPhase::Superseded)
            .max_by_key(|c| c.plan_revision)
    };
    let done = |name: &str| {
        latest(name)
            .is_some_and(|c| c.phase == StepPhase::Succeeded || c.phase == StepPhase::Skipped)
    };
    let mut rows = Vec::new();
    for spec in &specs {
        let deps: Vec<&str> = spec
            .depends_on
            .iter()
            .flat_map(|d| d.iter().map(String::as_str))
            .collect();
        let after = if deps.is_empty() {
            "-".to_owned()
        } else {
            deps.join(", ")
        };
        let state = match latest(&spec.name) {
            Some(c) => format!("{} {:?}", mark(c.phase), c.phase),
            None => {
                let waiting: Vec<&str> = deps.iter().copied().filter(|d| !done(d)).collect();
                if waiting.is_empty() {
                    "· ready".to_owned()
                } else {
                    format!("· waits for {}", waiting.join(", "))
                }
            }
        };
        let when = spec
            .when
            .as_deref()
            .map(|w| format!("when {}", truncate(w, 30)))
            .unwrap_or_default();
        rows.push(vec![
            format!("  {}", spec.name),
            format!("after {after}"),
            state,
            when,
        ]);
    }
    format!("Graph:\n{}", table(&rows))
}

#[cfg(test)]
mod graph_tests {
    use agentrun_api::{
        AgentRun, AgentRunSpec, AgentRunStatus, PlanStatus, StepCheckpoint, StepContainer,
        StepPhase, StepSpec,
    };

    fn step(name: &str, deps: &[&str], when: Option<&str>) -> StepSpec {
        StepSpec {
            name: name.into(),
            depends_on: (!deps.is_empty()).then(|| deps.iter().map(|d| d.to_string()).collect()),
            when: when.map(Into::into),
            container: Some(StepContainer {
                image: "x".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn cp(name: &str, phase: StepPhase) -> StepCheckpoint {
        StepCheckpoint {
            name: name.into(),
            plan_revision: 1,
            phase,
            ..Default::default()
        }
    }

    #[test]
    fn a_graph_shows_what_each_step_waits_on() {
        let mut parse = step("parse", &[], None);
        parse.depends_on = Some(Box::new([]));
        let run = AgentRun::new(
            "q",
            AgentRunSpec {
                steps: vec![
                    parse,
                    step("physicist", &["parse"], None),
                    step("chemist", &["parse"], Some("steps.parse.result.science")),
                    step("aggregate", &["physicist", "chemist"], None),
                ],
                ..Default::default()
            },
        );
        let status = AgentRunStatus {
            plan: Some(PlanStatus {
                revision: 1,
                step_names: ["parse", "physicist", "chemist", "aggregate"]
                    .map(String::from)
                    .to_vec(),
                ..Default::default()
            }),
            steps: vec![
                cp("parse", StepPhase::Succeeded),
                cp("physicist", StepPhase::Running),
                cp("chemist", StepPhase::Skipped),
            ],
            ..Default::default()
        };
        let want = "Graph:
  parse       after -                    ✓ Succeeded
  physicist   after parse                ▶ Running
  chemist     after parse                - Skipped               when steps.parse.result.science
  aggregate   after physicist, chemist   · waits for physicist
";
        assert_eq!(super::graph_lines(&run, &status), want);
        // A sequence has no graph to show.
        let seq = AgentRun::new(
            "s",
            AgentRunSpec {
                steps: vec![step("a", &[], None), step("b", &[], None)],
                ..Default::default()
            },
        );
        assert_eq!(super::graph_lines(&seq, &status), "");
    }
}

#[cfg(test)]
mod lineage_tests {
    use agentrun_api::{AgentRun, AgentRunSpec, AgentRunStatus, ForkSource, ForkedFrom};

    #[test]
    fn a_fork_names_its_source_the_step_and_what_it_kept() {
        let mut run = AgentRun::new("r2", AgentRunSpec::default());
        run.spec.fork_of = Some(Box::new(ForkSource {
            run_name: "r1".into(),
            run_uid: "u-1".into(),
            from_step: "ship".into(),
            rerun_acted: false,
        }));
        assert_eq!(
            super::lineage_line(&run, &AgentRunStatus::default()),
            "Forked from: run r1 (UID u-1) at step ship (not yet read by the operator)\n"
        );
        let status = AgentRunStatus {
            forked_from: Some(Box::new(ForkedFrom {
                run_name: "r1".into(),
                run_uid: "u-1".into(),
                from_step: "ship".into(),
                requested_by: Some("alice".into()),
                inherited: vec!["quote".into(), "charge".into()],
            })),
            ..Default::default()
        };
        assert_eq!(
            super::lineage_line(&run, &status),
            "Forked from: run r1 (UID u-1) at step ship, by alice; kept: quote, charge\n"
        );
        let plain = AgentRun::new("r3", AgentRunSpec::default());
        assert_eq!(super::lineage_line(&plain, &AgentRunStatus::default()), "");
    }
}
