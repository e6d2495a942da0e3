//! What the plane's `/metrics` say: kube-apiserver's request counts and
//! durations (scraped with the admin client certificate) and etcd's, the
//! writes in a window attributed to a controller by (verb, resource,
//! subresource), and one value of a controller's own `/metrics`.
//!
//! ```text
//!   before = apiserver_requests() ── the batch ── after = apiserver_requests()
//!   writes(before, after, peer's attribution) → {"PATCH pods": 10, …}, 409s
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

use agentrun_e2e::http_get;
use tokio::process::Command;

use crate::error::{BenchError, Res, io};
use crate::plane::Setup;

/// `apiserver_request_total` by (verb, group, resource, subresource, code);
/// `apiserver_request_duration_seconds_{sum,count}` under code "sum"/"count".
pub type Requests = BTreeMap<(String, String, String, String, String), f64>;

/// Whether a write (verb, resource, subresource) in a window is the
/// controller's: each peer has one, beside its controller.
pub type Attribution = fn(verb: &str, resource: &str, subresource: &str) -> bool;

const WRITE_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

fn parse_labels(s: &str) -> HashMap<&str, &str> {
    let mut out = HashMap::new();
    let mut rest = s;
    while let Some((k, after)) = rest.split_once("=\"") {
        let Some(end) = after.find('"') else { break };
        out.insert(k.trim_start_matches(','), &after[..end]);
        rest = &after[end + 1..];
    }
    out
}

/// The labelled samples of the metrics `names` in a `/metrics` text: which
/// of the names, the labels, the value.
fn samples<'a>(
    text: &'a str,
    names: &'a [&str],
) -> impl Iterator<Item = (usize, HashMap<&'a str, &'a str>, f64)> {
    text.lines().filter_map(move |line| {
        let (which, rest) = names
            .iter()
            .enumerate()
            .find_map(|(i, name)| Some((i, line.strip_prefix(name)?.strip_prefix('{')?)))?;
        let (labels, value) = rest.rsplit_once("} ")?;
        Some((
            which,
            parse_labels(labels),
            value.trim().parse().unwrap_or(0.0),
        ))
    })
}

/// Scrapes `/metrics` of the plane's kube-apiserver (with the admin client
/// certificate) or etcd (plain HTTP on loopback).
pub async fn scrape(setup: &Setup, which: &str) -> Res<String> {
    let port_file = if which == "etcd" {
        "etcd.port"
    } else {
        "apiserver.port"
    };
    let port = std::fs::read_to_string(setup.e2e_dir.join("state").join(port_file))
        .map_err(io(format!("reading the {which} port")))?;
    let pki = setup.e2e_dir.join("pki");
    let mut cmd = Command::new("curl");
    cmd.arg("-sf").arg("--max-time").arg("30");
    if which == "etcd" {
        cmd.arg(format!("http://127.0.0.1:{}/metrics", port.trim()));
    } else {
        cmd.arg("--cacert")
            .arg(pki.join("ca.crt"))
            .arg("--cert")
            .arg(pki.join("admin.crt"))
            .arg("--key")
            .arg(pki.join("admin.key"))
            .arg(format!("https://127.0.0.1:{}/metrics", port.trim()));
    }
    let out = cmd.output().await.map_err(io("running curl"))?;
    if !out.status.success() {
        return Err(BenchError::Stage(format!(
            "scraping {which} /metrics failed: {}",
            out.status
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `apiserver_request_total` and request durations, from the apiserver's `/metrics`.
pub async fn apiserver_requests(setup: &Setup) -> Res<Requests> {
    let text = scrape(setup, "apiserver").await?;
    let names = [
        "apiserver_request_total",
        "apiserver_request_duration_seconds_sum",
        "apiserver_request_duration_seconds_count",
    ];
    let mut m = Requests::new();
    for (which, l, v) in samples(&text, &names) {
        let get = |k: &str| l.get(k).copied().unwrap_or("").to_owned();
        let code = match which {
            0 => get("code"),
            1 => "sum".to_owned(),
            _ => "count".to_owned(),
        };
        *m.entry((
            get("verb"),
            get("group"),
            get("resource"),
            get("subresource"),
            code,
        ))
        .or_default() += v;
    }
    Ok(m)
}

/// The request bodies the apiserver received for writes to `resource` other
/// than creates, from its `/metrics` text: (bytes, count).
pub fn update_body_bytes(apiserver_metrics: &str, resource: &str) -> (f64, f64) {
    let names = [
        "apiserver_request_body_size_bytes_sum",
        "apiserver_request_body_size_bytes_count",
    ];
    let mut body = (0.0, 0.0);
    for (which, l, v) in samples(apiserver_metrics, &names) {
        if l.get("resource") != Some(&resource) || l.get("verb") == Some(&"create") {
            continue;
        }
        if which == 0 {
            body.0 += v;
        } else {
            body.1 += v;
        }
    }
    body
}

/// "verb resource[/sub]": how the tables name a kind of request.
fn kind_name(verb: &str, resource: &str, sub: &str) -> String {
    if sub.is_empty() {
        format!("{verb} {resource}")
    } else {
        format!("{verb} {resource}/{sub}")
    }
}

/// A controller's writes in a window, by kind, every response code counted
/// (a 409 is a request the apiserver served), and the 409s among them.
pub fn writes(
    before: &Requests,
    after: &Requests,
    ours: Attribution,
) -> (BTreeMap<String, f64>, f64) {
    let mut by = BTreeMap::new();
    let mut conflicts = 0.0;
    for (k, v) in after {
        let d = v - before.get(k).copied().unwrap_or(0.0);
        let (verb, _group, resource, sub, code) = k;
        if d <= 0.0 || !WRITE_VERBS.contains(&verb.as_str()) || code == "sum" || code == "count" {
            continue;
        }
        if !ours(verb, resource, sub) {
            continue;
        }
        if code == "409" {
            conflicts += d;
        }
        *by.entry(kind_name(verb, resource, sub)).or_default() += d;
    }
    (by, conflicts)
}

/// Mean server-side latency (ms) of the operator's write kinds in a window,
/// from `apiserver_request_duration_seconds` (all callers of that kind).
pub fn server_latency(before: &Requests, after: &Requests) -> BTreeMap<String, f64> {
    let delta = |k: &(String, String, String, String, String)| {
        after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0)
    };
    let mut out = BTreeMap::new();
    for k in after.keys().filter(|k| k.4 == "count") {
        let (verb, group, resource, sub, _) = k;
        let interesting = matches!(
            (verb.as_str(), resource.as_str(), sub.as_str()),
            ("APPLY", "agentruns", "status")
                | ("POST", "pods", "")
                | ("PATCH", "pods", "")
                | ("PATCH", "pods", "status")
                | ("POST", "events", "")
        );
        let n = delta(k);
        if !interesting || n <= 0.0 {
            continue;
        }
        let sum_key = (
            verb.clone(),
            group.clone(),
            resource.clone(),
            sub.clone(),
            "sum".into(),
        );
        out.insert(kind_name(verb, resource, sub), delta(&sum_key) / n * 1000.0);
    }
    out
}

/// A controller's own `/metrics` (plain HTTP on loopback); "" when it does not answer.
pub async fn controller_metrics(addr: SocketAddr) -> String {
    http_get(addr, "/metrics")
        .await
        .map(|r| r.1)
        .unwrap_or_default()
}

/// One metric value (sum over label sets) from a `/metrics` text. A metric
/// the text does not expose at all is an error, never 0: an empty scrape (a
/// process that did not answer) or a renamed metric would read as "nothing
/// happened". A family that is exposed but has no sample of this label set
/// yet (a labelled counter never incremented) is 0.
pub fn metric(text: &str, name: &str) -> Res<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for l in text.lines() {
        if l.strip_prefix(name)
            .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        {
            found = true;
            sum += l
                .rsplit_once(' ')
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .unwrap_or(0.0);
        }
    }
    let family = name.split('{').next().unwrap_or(name);
    let family = family.strip_suffix("_total").unwrap_or(family);
    let declared = text.lines().any(|l| {
        l.strip_prefix("# TYPE ")
            .and_then(|r| r.strip_prefix(family))
            .is_some_and(|r| r.starts_with(' '))
    });
    if found || declared {
        Ok(sum)
    } else {
        Err(BenchError::Stage(format!(
            "metric {name} is not in the scrape ({} bytes): the process did not answer, or the metric was renamed",
            text.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::metric;

    const TEXT: &str = "# TYPE agentrun_held_behind_starts counter\n\
        agentrun_held_behind_starts_total{kind=\"event\"} 3\n\
        # TYPE agentrun_duplicate_creates_suppressed counter\n\
        agentrun_duplicate_creates_suppressed_total 2\n";

    #[test]
    fn a_metric_missing_from_the_scrape_is_an_error_not_zero() {
        assert_eq!(
            metric(TEXT, "agentrun_duplicate_creates_suppressed_total").unwrap(),
            2.0
        );
        assert_eq!(
            metric(TEXT, "agentrun_held_behind_starts_total{kind=\"event\"}").unwrap(),
            3.0
        );
        // Declared, never incremented for this label set: 0.
        assert_eq!(
            metric(TEXT, "agentrun_held_behind_starts_total{kind=\"release\"}").unwrap(),
            0.0
        );
        // Not exposed at all, or an empty scrape: an error.
        assert!(metric(TEXT, "agentrun_renamed_total").is_err());
        assert!(metric("", "agentrun_duplicate_creates_suppressed_total").is_err());
    }
}
