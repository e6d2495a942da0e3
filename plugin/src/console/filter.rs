//! The runs page's filters: phase, namespace, label selector and free text,
//! from the query string (so a filtered view is a link), and the sort; and
//! the history page's, which become the store's `history::Query` exactly as
//! `kubectl agentrun history`'s flags do.

use agentrun_api::AgentRun;
use agentrun_history::Query;
use jiff::Timestamp;
use serde::Deserialize;

use super::namespace::Scope;

/// `?phase=…&namespace=…&label=…&q=…&sort=oldest`; empty fields match all.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct RunFilter {
    pub phase: String,
    pub namespace: String,
    /// A label selector of equalities and existence: `team=payments,urgent`,
    /// `tier!=gold`.
    pub label: String,
    /// Matched against the name, current step, summary and message.
    pub q: String,
    /// `oldest` for oldest first; newest first otherwise.
    pub sort: String,
}

impl RunFilter {
    pub fn matches(&self, run: &AgentRun) -> bool {
        let status = run.status.clone().unwrap_or_default();
        let phase = status.phase.map(|p| format!("{p:?}")).unwrap_or_default();
        if !self.phase.is_empty() && !phase.eq_ignore_ascii_case(&self.phase) {
            return false;
        }
        if !self.namespace.is_empty()
            && run.metadata.namespace.as_deref() != Some(self.namespace.as_str())
        {
            return false;
        }
        let labels = run.metadata.labels.clone().unwrap_or_default();
        for term in self
            .label
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
        {
            let ok = if let Some((k, v)) = term.split_once("!=") {
                labels.get(k.trim()).map(String::as_str) != Some(v.trim())
            } else if let Some((k, v)) = term.split_once('=') {
                let v = v.trim_start_matches('=');
                labels.get(k.trim()).map(String::as_str) == Some(v.trim())
            } else if let Some(k) = term.strip_prefix('!') {
                !labels.contains_key(k)
            } else {
                labels.contains_key(term)
            };
            if !ok {
                return false;
            }
        }
        if !self.q.is_empty() {
            let q = self.q.to_lowercase();
            let hay = [
                run.metadata.name.clone().unwrap_or_default(),
                status.current_step.clone().unwrap_or_default(),
                status.summary.clone().unwrap_or_default(),
            ];
            let messages = status.steps.iter().filter_map(|c| c.message.clone());
            if !hay
                .into_iter()
                .chain(messages)
                .any(|h| h.to_lowercase().contains(&q))
            {
                return false;
            }
        }
        true
    }

    /// The runs that match, sorted by age (newest first unless `oldest`).
    pub fn apply<'a>(&self, runs: &'a [AgentRun]) -> Vec<&'a AgentRun> {
        let mut out: Vec<&AgentRun> = runs.iter().filter(|r| self.matches(r)).collect();
        let key = |r: &&AgentRun| {
            (
                r.metadata.creation_timestamp.as_ref().map(|t| t.0),
                r.metadata.name.clone(),
            )
        };
        out.sort_by_key(key);
        if self.sort != "oldest" {
            out.reverse();
        }
        out
    }

    /// The query string for this filter (for the live-update stream).
    pub fn query(&self) -> String {
        let pairs = [
            ("phase", &self.phase),
            ("namespace", &self.namespace),
            ("label", &self.label),
            ("q", &self.q),
            ("sort", &self.sort),
        ];
        pairs
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// Most records the history page shows unless `limit` says otherwise.
pub const HISTORY_LIMIT: usize = 500;

/// `?outcome=Failed&namespace=shop&requested_by=alice&since=24h&run=refund&limit=50`;
/// empty fields match all. Strings, so a bad value is a message on the page
/// rather than the extractor's bare 400.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct HistoryFilter {
    /// `Succeeded`, `Failed` or `Cancelled` (`--outcome`).
    pub outcome: String,
    pub namespace: String,
    /// Who created the run, as the API server recorded it (`--requested-by`).
    pub requested_by: String,
    /// A duration back from now (`24h`), a time or a day (`--since`).
    pub since: String,
    /// Runs of this name (`history RUN`).
    pub run: String,
    /// At most this many records, newest first (`--limit`); [`HISTORY_LIMIT`] when empty.
    pub limit: String,
}

impl HistoryFilter {
    /// The store query, built as `kubectl agentrun history` builds it from
    /// the same words (`crate::history_filter`), within the console's scope:
    /// a console of one namespace reads only that one.
    pub fn to_query(&self, scope: &Scope, now: Timestamp) -> Result<Query, String> {
        let given = |s: &str| Some(s.trim().to_owned()).filter(|s| !s.is_empty());
        let limit = match given(&self.limit) {
            None => HISTORY_LIMIT,
            Some(l) => l
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("limit {l}: a number of records, at least 1"))?,
        };
        let (namespace, all_namespaces) = match (scope, given(&self.namespace)) {
            (Scope::All, Some(ns)) => (ns, false),
            (Scope::All, None) => (String::new(), true),
            (Scope::Namespace(ns), Some(asked)) if asked != *ns => {
                return Err(format!(
                    "namespace {asked}: this console shows namespace {ns} only"
                ));
            }
            (Scope::Namespace(ns), _) => (ns.clone(), false),
        };
        let mut q = Query {
            namespace: (!all_namespaces).then_some(namespace),
            run: given(&self.run),
            requested_by: given(&self.requested_by),
            limit: Some(limit),
            ..Query::default()
        };
        if let Some(o) = given(&self.outcome) {
            q.outcome =
                Some(crate::history_filter::outcome(&o).map_err(|e| format!("outcome {o}: {e}"))?);
        }
        if let Some(t) = given(&self.since) {
            q.since =
                Some(crate::history_filter::since(&t, now).map_err(|e| format!("since {t}: {e}"))?);
        }
        Ok(q)
    }

    /// The query string for this filter (links that keep it).
    pub fn query(&self) -> String {
        let pairs = [
            ("outcome", &self.outcome),
            ("namespace", &self.namespace),
            ("requested_by", &self.requested_by),
            ("since", &self.since),
            ("run", &self.run),
            ("limit", &self.limit),
        ];
        pairs
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// Percent-encoding for a query value or a path segment.
pub fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(
        name: &str,
        ns: &str,
        phase: &str,
        labels: serde_json::Value,
        created: &str,
    ) -> AgentRun {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "creationTimestamp": created},
            "spec": {"steps": []},
            "status": {"phase": phase, "currentStep": "charge"},
        }))
        .unwrap()
    }

    fn names(f: &RunFilter, runs: &[AgentRun]) -> Vec<String> {
        f.apply(runs)
            .iter()
            .map(|r| r.metadata.name.clone().unwrap())
            .collect()
    }

    #[test]
    fn filters_by_phase_namespace_label_and_text_and_sorts_by_age() {
        let runs = [
            run(
                "a",
                "shop",
                "Running",
                json!({"team": "pay"}),
                "2026-12-02T01:00:00Z",
            ),
            run(
                "b",
                "shop",
                "Succeeded",
                json!({"team": "ops", "urgent": "y"}),
                "2026-12-02T02:00:00Z",
            ),
            run("c", "lab", "Running", json!({}), "2026-12-02T03:00:00Z"),
        ];
        let cases: [(&str, RunFilter, &[&str]); 8] = [
            (
                "everything, newest first",
                RunFilter::default(),
                &["c", "b", "a"],
            ),
            (
                "oldest first",
                RunFilter {
                    sort: "oldest".into(),
                    ..Default::default()
                },
                &["a", "b", "c"],
            ),
            (
                "phase, any case",
                RunFilter {
                    phase: "running".into(),
                    ..Default::default()
                },
                &["c", "a"],
            ),
            (
                "namespace",
                RunFilter {
                    namespace: "shop".into(),
                    ..Default::default()
                },
                &["b", "a"],
            ),
            (
                "label equality",
                RunFilter {
                    label: "team=pay".into(),
                    ..Default::default()
                },
                &["a"],
            ),
            (
                "label inequality",
                RunFilter {
                    label: "team!=pay".into(),
                    ..Default::default()
                },
                &["c", "b"],
            ),
            (
                "label existence",
                RunFilter {
                    label: "urgent".into(),
                    ..Default::default()
                },
                &["b"],
            ),
            (
                "text in the name",
                RunFilter {
                    q: "B".into(),
                    ..Default::default()
                },
                &["b"],
            ),
        ];
        for (case, f, want) in cases {
            assert_eq!(names(&f, &runs), want, "{case}");
        }
    }

    #[test]
    fn the_query_string_round_trips_through_the_url() {
        let f = RunFilter {
            phase: "Running".into(),
            label: "team=pay,x".into(),
            ..Default::default()
        };
        assert_eq!(f.query(), "phase=Running&label=team%3Dpay%2Cx");
    }
}
