//! The scripted sender: sends every open Signal as the system that saw the
//! event would, after 0–800 ms, with the data every step of the workload
//! reports (`{"run", "step"}`), and sends it again 0–1.5 s later, as a
//! sender that retries does. The repeat must be admitted and change nothing;
//! the verdict checks the step committed that data once and nothing after it
//! started before it was received.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrun_operator::api::{Signal, SignalPhase};
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use super::{Shared, lock};

fn hash_of(seed: u64, s: &str) -> u64 {
    let mut h = DefaultHasher::new();
    (seed, s).hash(&mut h);
    h.finish()
}

/// Whether the API server answered the request with a refusal (a 4xx
/// other than 408 and 429), rather than failing to answer it.
fn decided(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if (400..500).contains(&s.code) && s.code != 408 && s.code != 429)
}

/// Sends the namespace's open Signals, each twice, until aborted.
pub(super) async fn send(signals: Api<Signal>, shared: Arc<Shared>, seed: u64) {
    let mut first_seen: BTreeMap<String, Instant> = BTreeMap::new();
    let mut repeated: BTreeSet<String> = BTreeSet::new();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let Ok(list) = signals.list(&ListParams::default()).await else {
            continue;
        };
        for s in list.items {
            let name = s.name_any();
            let waiting = s
                .status
                .as_ref()
                .is_none_or(|st| st.phase == SignalPhase::Waiting);
            let sent = s.spec.id.is_some();
            if (sent && repeated.contains(&name)) || (!sent && !waiting) {
                continue;
            }
            let seen = *first_seen.entry(name.clone()).or_insert_with(Instant::now);
            let delay = if sent {
                800 + hash_of(seed ^ 0x5A, &name) % 1500
            } else {
                hash_of(seed, &name) % 800
            };
            if seen.elapsed() < Duration::from_millis(delay) {
                continue;
            }
            let body = json!({"spec": {
                "id": format!("evt-{:x}", hash_of(seed, &name)),
                "data": {"run": s.spec.run_name, "step": s.spec.step},
            }});
            match signals
                .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(_) if sent => {
                    repeated.insert(name.clone());
                    *lock(&shared.signals_repeated) += 1;
                    info!(signal = %name, "sent again");
                }
                Ok(_) => {
                    *lock(&shared.signals_sent) += 1;
                    info!(signal = %name, "sent");
                }
                // No answer (the API server restarting, a connection cut) or
                // one that asks to come back (429, 5xx): nothing was decided,
                // so it is sent again on the next round, as a sender retries.
                Err(err) if !decided(&err) => {
                    warn!(signal = %name, error = %err, "sending failed without an answer; sending again");
                }
                // Expired or superseded meanwhile (the run failed): the API
                // server refuses, rightly. A repeat refused while the Signal
                // waits or was received is a finding: it must be admitted.
                Err(err) => {
                    let phase = signals
                        .get(&name)
                        .await
                        .ok()
                        .and_then(|s| s.status)
                        .map(|st| st.phase);
                    let closed =
                        matches!(phase, Some(SignalPhase::Expired | SignalPhase::Superseded));
                    if sent && !closed {
                        *lock(&shared.signal_repeats_refused) += 1;
                        warn!(signal = %name, error = %err, "a repeat of the same signal was refused");
                    } else {
                        info!(signal = %name, error = %err, "not sent: the run no longer waits");
                    }
                    repeated.insert(name);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::decided;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("x", "y")
                .with_code(code)
                .boxed(),
        )
    }

    /// A repeat counts as refused only when the API server said no: a 5xx,
    /// a 429 or no answer at all (the API server restarting during the
    /// chaos run) is sent again, not judged.
    #[test]
    fn only_an_answer_of_no_counts_as_a_refusal() {
        assert!(decided(&api(422)) && decided(&api(403)) && decided(&api(409)));
        assert!(!decided(&api(500)) && !decided(&api(503)) && !decided(&api(429)));
        assert!(!decided(&kube::Error::LinesCodecMaxLineLengthExceeded));
    }
}
