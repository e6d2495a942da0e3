//! The digest of what a run runs (D18): how a re-created run is recognised
//! as the one a record holds, and which spec an engine decision ran under.

use sha2::{Digest, Sha256};

use crate::AgentRunSpec;

/// Hex characters of a spec digest: 128 bits.
const DIGEST_LEN: usize = 32;
/// Most spec digests a run (and its record) keeps: the first and the latest.
pub const MAX_SPEC_DIGESTS: usize = 16;

/// The digest of what a run runs: its spec without `suspend` and `cancel`
/// (controls, which a person toggles while it runs), serialized as the
/// operator reads it. Fields the API adds later serialize only when set, so a
/// digest stays the same across operator versions (a test pins one).
pub fn spec_digest(spec: &AgentRunSpec) -> String {
    let mut spec = spec.clone();
    spec.suspend = false;
    spec.cancel = false;
    // serde_json's maps are ordered by key: the same spec, the same bytes.
    let value = serde_json::to_value(&spec).unwrap_or_default();
    let bytes = serde_json::to_vec(&value).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    digest
        .iter()
        .take(DIGEST_LEN / 2)
        .map(|b| format!("{b:02x}"))
        .collect()
}
