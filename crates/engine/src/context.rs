//! The materialised input of a step (D11): who it is (run, step, attempt, key)
//! and what came before (the summary and fresh prior results), kept within
//! `context.maxBytes`. When prior results do not fit, a compactor (if any)
//! turns them into a summary at the checkpoint boundary; without one the
//! oldest results are left out of the context (they stay in status).

use serde::Serialize;
use serde_json::Value;

/// Who the step is: the fixed part of the context.
#[derive(Serialize, Clone, Debug)]
#[serde(rename_all = "camelCase")]
pub struct Identity<'a> {
    pub run: &'a str,
    pub run_uid: &'a str,
    pub step: &'a str,
    pub role: &'static str,
    pub attempt: i32,
    pub idempotency_key: &'a str,
    pub plan_revision: i64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Document<'a> {
    #[serde(flatten)]
    identity: &'a Identity<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    summary: Option<&'a str>,
    results: &'a [PriorResult<'a>],
    #[serde(skip_serializing_if = "is_zero")]
    omitted_results: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// One earlier step's result as the step sees it.
#[derive(Serialize, Clone, Debug)]
pub struct PriorResult<'a> {
    pub step: &'a str,
    pub result: &'a Value,
}

/// The context JSON as the step receives it.
pub struct Materialised {
    pub json: String,
}

/// Size of the context with nothing left out.
pub fn full_size(identity: &Identity, summary: Option<&str>, results: &[PriorResult]) -> usize {
    render(identity, summary, results, 0).len()
}

/// The context within `max_bytes`: oldest results go first, then the summary is cut.
pub fn materialise(
    identity: &Identity,
    summary: Option<&str>,
    results: &[PriorResult],
    max_bytes: usize,
) -> Materialised {
    let json = render(identity, summary, results, 0);
    if json.len() <= max_bytes {
        return Materialised { json };
    }
    // Drop the oldest results: find the shortest suffix-removal that fits.
    for skip in 1..=results.len() {
        let json = render(identity, summary, &results[skip..], skip);
        if json.len() <= max_bytes {
            return Materialised { json };
        }
    }
    // Then cut the summary, keeping its end (the most recent facts).
    let base = render(identity, Some(""), &[], results.len()).len();
    let room = max_bytes.saturating_sub(base + 16);
    let summary = summary.unwrap_or("");
    let mut cut = summary.len().saturating_sub(room / 2); // escapes may double the size
    while !summary.is_char_boundary(cut) {
        cut += 1;
    }
    let json = render(identity, Some(&summary[cut..]), &[], results.len());
    if json.len() <= max_bytes {
        return Materialised { json };
    }
    Materialised {
        json: render(identity, None, &[], results.len()),
    }
}

fn render(
    identity: &Identity,
    summary: Option<&str>,
    results: &[PriorResult],
    omitted: usize,
) -> String {
    serde_json::to_string(&Document {
        identity,
        summary,
        results,
        omitted_results: omitted,
    })
    .unwrap_or_else(|_| "{}".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn id() -> Identity<'static> {
        Identity {
            run: "r",
            run_uid: "u",
            step: "s",
            role: "step",
            attempt: 1,
            idempotency_key: "k",
            plan_revision: 1,
        }
    }

    #[test]
    fn context_stays_within_max_bytes() {
        let big = json!("x".repeat(900));
        let names: Vec<String> = (0..40).map(|i| format!("step-{i}")).collect();
        let results: Vec<PriorResult> = names
            .iter()
            .map(|n| PriorResult {
                step: n,
                result: &big,
            })
            .collect();
        let long_summary = "é".repeat(5000);
        for (name, summary, max) in [
            ("results only", None, 4096),
            ("with a summary", Some("earlier facts"), 2048),
            ("summary alone too large", Some(long_summary.as_str()), 1024),
        ] {
            let m = materialise(&id(), summary, &results, max);
            assert!(m.json.len() <= max, "{name}: {} > {max}", m.json.len());
            assert!(
                m.json.len() < full_size(&id(), summary, &results),
                "{name}: something was left out"
            );
            let v: Value = serde_json::from_str(&m.json).unwrap();
            assert_eq!(
                v["idempotencyKey"], "k",
                "{name}: identity is never dropped"
            );
        }
        let small = materialise(&id(), None, &results[..1], 4096);
        assert_eq!(
            small.json.len(),
            full_size(&id(), None, &results[..1]),
            "what fits is kept whole"
        );
        assert!(full_size(&id(), None, &results) > 4096);
    }
}
