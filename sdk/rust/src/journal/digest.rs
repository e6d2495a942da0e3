//! What a call is, as digests: the canonical JSON of a request, its sha256,
//! and a tool call's own idempotency key.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// `value` as canonical JSON: compact, object keys sorted by their UTF-8
/// bytes at every depth, strings and numbers as serde_json writes them. The
/// keys are sorted here rather than trusting `serde_json::Map`'s order, which
/// is insertion order when any crate in the build turns on `preserve_order`.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&map[k], out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The digest of a model request: sha256 of its canonical JSON, in hex.
pub fn model_digest(request: &Value) -> String {
    sha256_hex(canonical_json(request).as_bytes())
}

/// The digest of a tool call: sha256 of the canonical JSON of
/// `{"arguments": args, "name": name}`, in hex.
pub fn tool_digest(name: &str, args: &Value) -> String {
    let call = serde_json::json!({"arguments": args, "name": name});
    sha256_hex(canonical_json(&call).as_bytes())
}

/// A tool call's idempotency key (docs/journal.md): the first 32 hex
/// characters of sha256(step key ‖ 0x00 ‖ call id). The same in every attempt
/// of the step, different for every call.
pub fn call_key(step_key: &str, call_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(step_key.as_bytes());
    h.update([0]);
    h.update(call_id.as_bytes());
    h.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// docs/journal.md's vectors, computed with `printf 'K\0id' | openssl dgst -sha256`.
    #[test]
    fn call_keys_match_the_documented_vectors() {
        let cases = [
            ("stepkey", "call_1", "0ed9ffc913f10948baf0d9ce47391e7f"),
            (
                "0123456789abcdef0123456789abcdef",
                "call_abc123",
                "3e3fe9b4ae2107749f6eac4ef0653153",
            ),
            (
                "k",
                "toolu_01A09q90qw90lq917835lq9",
                "114672f7ee8e42b9648ee81d11f0c179",
            ),
        ];
        for (key, id, want) in cases {
            assert_eq!(call_key(key, id), want, "call_key({key:?}, {id:?})");
        }
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_depth_and_is_compact() {
        let v = json!({"b": [1, {"z": null, "a": "é\n"}], "a": {"y": true, "x": 1.5}});
        assert_eq!(
            canonical_json(&v),
            r#"{"a":{"x":1.5,"y":true},"b":[1,{"a":"é\n","z":null}]}"#
        );
    }

    /// Known answers from `printf '%s' '<canonical JSON>' | sha256sum`, not from
    /// the code under test.
    #[test]
    fn digests_match_independent_sha256() {
        let req = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        // printf '%s' '{"messages":[{"content":"hi","role":"user"}],"model":"m"}' | sha256sum
        assert_eq!(
            model_digest(&req),
            "6d139f1403cd84518768857efed6c375c0e3fe1af3f250cd3a5c59ea87a0323c"
        );
        // printf '%s' '{"arguments":{"orderId":4711},"name":"refund"}' | sha256sum
        assert_eq!(
            tool_digest("refund", &json!({"orderId": 4711})),
            "2ac513fe0b4226bd579b38d091ff7b1242e803f02db57654d7d824d12474135e"
        );
    }
}
