//! The job envelope and its stored form.
//!
//! Stored form (layout 1), the value in `{ns:s}:jobs`:
//!
//! ```text
//! zd1:<dest>\n<meta length>\n<meta JSON><payload bytes>
//! ```
//!
//! The route and the payload — all the mover needs — are reached with three string
//! searches and no JSON decoding, and the payload stays raw bytes (binary-safe). `meta` is a
//! JSON object with the optional DESIGN §3 fields (headers, attempt, max_attempts, cron, tz,
//! every_ms, created, last_error, and any unknown fields, which are kept); it is empty when
//! every field has its default. `redis-cli HGET` shows it readably; the one documented step
//! is "payload starts after the meta length's bytes of JSON".
//!
//! A plain JSON envelope (`{"v":1,"dest":…,"payload":…,"payload_encoding":…}`), as DESIGN
//! §3 describes it, is accepted too, for producers that write the hash themselves.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

const FRAME_PREFIX: &[u8] = b"zd1:";

/// Why bytes are not an envelope.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EnvelopeError {
    #[error("malformed envelope: {0}")]
    Malformed(String),
    #[error("unsupported envelope version {0}")]
    Version(u64),
    /// Too large to be read by a console or dead-letter read (`peek_dead`).
    #[error(
        "an envelope of {0} bytes, not read: over the 4 MiB a console or dead-letter read \
         copies inside Redis, so its meta and payload are not shown (`zdelay get` reads it whole)"
    )]
    NotRead(u64),
    #[error("invalid destination {0:?}: it must be non-empty, at most 512 bytes, without newlines")]
    BadDest(String),
}

/// Optional envelope fields, all defaulted. Unknown fields are kept in `extra`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tz: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// An occurrence of this recurring schedule: its idempotency key is
    /// `<schedule>:<occurrence due>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// Not delivered later than this after its due time (dead, reason `expired`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lateness_ms: Option<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// One job's envelope: where it goes, what it carries, and its optional fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub dest: String,
    pub payload: Vec<u8>,
    pub meta: Meta,
}

/// Checks a destination can be framed: non-empty, bounded, no newline.
pub fn validate_dest(dest: &str) -> Result<(), EnvelopeError> {
    if dest.is_empty() || dest.len() > 512 || dest.contains('\n') {
        return Err(EnvelopeError::BadDest(dest.to_owned()));
    }
    Ok(())
}

impl Envelope {
    pub fn new(dest: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Envelope {
            dest: dest.into(),
            payload: payload.into(),
            meta: Meta::default(),
        }
    }

    /// The stored form. Fails only on a destination that cannot be framed.
    pub fn encode(&self) -> Result<Vec<u8>, EnvelopeError> {
        validate_dest(&self.dest)?;
        let meta = if self.meta == Meta::default() {
            Vec::new()
        } else {
            serde_json::to_vec(&self.meta).expect("serializing a Meta of strings and numbers")
        };
        let mut out = Vec::with_capacity(16 + self.dest.len() + meta.len() + self.payload.len());
        out.extend_from_slice(FRAME_PREFIX);
        out.extend_from_slice(self.dest.as_bytes());
        out.push(b'\n');
        out.extend_from_slice(meta.len().to_string().as_bytes());
        out.push(b'\n');
        out.extend_from_slice(&meta);
        out.extend_from_slice(&self.payload);
        Ok(out)
    }

    /// Reads either stored form: a `zd1:` frame or a JSON object.
    pub fn decode(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        if let Some(rest) = bytes.strip_prefix(FRAME_PREFIX) {
            return decode_frame(rest);
        }
        if bytes.first() == Some(&b'{') {
            return decode_json(bytes);
        }
        Err(EnvelopeError::Malformed(
            "neither a zd1 frame nor a JSON object".into(),
        ))
    }

    /// The readable JSON view (DESIGN §3 shape), with `id` and `due` added by the caller.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut out = Map::new();
        out.insert("v".into(), 1.into());
        out.insert("dest".into(), self.dest.clone().into());
        match std::str::from_utf8(&self.payload) {
            Ok(text) => {
                out.insert("payload".into(), text.into());
                out.insert("payload_encoding".into(), "utf8".into());
            }
            Err(_) => {
                out.insert("payload".into(), BASE64.encode(&self.payload).into());
                out.insert("payload_encoding".into(), "base64".into());
            }
        }
        if let Ok(Value::Object(meta)) = serde_json::to_value(&self.meta) {
            out.extend(meta);
        }
        out
    }
}

/// A payload as JSON carries it: `payload_encoding` `utf8` (the default) or `base64`. Shared
/// by JSON envelopes and the CLI's `--batch` lines.
pub fn payload_from_json(payload: String, encoding: Option<&str>) -> Result<Vec<u8>, String> {
    match encoding {
        None | Some("utf8") => Ok(payload.into_bytes()),
        Some("base64") => BASE64
            .decode(payload.as_bytes())
            .map_err(|e| format!("invalid base64 payload: {e}")),
        Some(other) => Err(format!("unknown payload_encoding {other:?}")),
    }
}

fn decode_frame(rest: &[u8]) -> Result<Envelope, EnvelopeError> {
    let malformed = |why: &str| EnvelopeError::Malformed(format!("bad zd1 frame: {why}"));
    let dest_end = rest
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| malformed("no destination line"))?;
    let dest = std::str::from_utf8(&rest[..dest_end])
        .map_err(|_| malformed("destination is not UTF-8"))?;
    let after_dest = &rest[dest_end + 1..];
    let len_end = after_dest
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| malformed("no meta length line"))?;
    let meta_len: usize = std::str::from_utf8(&after_dest[..len_end])
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| malformed("meta length is not a number"))?;
    let body = &after_dest[len_end + 1..];
    if body.len() < meta_len {
        return Err(malformed("meta length exceeds the record"));
    }
    let meta = if meta_len == 0 {
        Meta::default()
    } else {
        serde_json::from_slice(&body[..meta_len])
            .map_err(|e| malformed(&format!("meta is not a JSON object: {e}")))?
    };
    Ok(Envelope {
        dest: dest.to_owned(),
        payload: body[meta_len..].to_vec(),
        meta,
    })
}

fn decode_json(bytes: &[u8]) -> Result<Envelope, EnvelopeError> {
    let mut obj: Map<String, Value> = serde_json::from_slice(bytes)
        .map_err(|e| EnvelopeError::Malformed(format!("invalid JSON: {e}")))?;
    if let Some(v) = obj.remove("v") {
        match v.as_u64() {
            Some(1) => {}
            Some(other) => return Err(EnvelopeError::Version(other)),
            None => return Err(EnvelopeError::Malformed("v is not a number".into())),
        }
    }
    let dest = match obj.remove("dest") {
        Some(Value::String(d)) => d,
        _ => return Err(EnvelopeError::Malformed("missing dest".into())),
    };
    let payload = match obj.remove("payload") {
        Some(Value::String(p)) => p,
        _ => return Err(EnvelopeError::Malformed("missing payload".into())),
    };
    let payload = match obj.remove("payload_encoding") {
        None | Some(Value::Null) => payload_from_json(payload, None),
        Some(Value::String(e)) => payload_from_json(payload, Some(&e)),
        Some(other) => Err(format!("unknown payload_encoding {other}")),
    }
    .map_err(EnvelopeError::Malformed)?;
    // The due time lives in the ZSET score; a copy in the envelope is informational.
    obj.remove("due");
    let meta: Meta = serde_json::from_value(Value::Object(obj))
        .map_err(|e| EnvelopeError::Malformed(format!("bad field: {e}")))?;
    Ok(Envelope {
        dest,
        payload,
        meta,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip_keeps_binary_payload_and_meta() {
        let mut env = Envelope::new("emails", vec![0u8, 255, b'\n', 10, 13]);
        env.meta.headers.insert("trace".into(), "abc".into());
        env.meta.max_attempts = Some(3);
        env.meta.extra.insert("custom".into(), Value::from(7));
        let bytes = env.encode().unwrap();
        assert_eq!(Envelope::decode(&bytes).unwrap(), env);
    }

    #[test]
    fn default_meta_is_not_stored() {
        let env = Envelope::new("emails", b"hi".to_vec());
        assert_eq!(env.encode().unwrap(), b"zd1:emails\n0\nhi");
    }

    #[test]
    fn json_envelope_is_read() {
        let json = br#"{"v":1,"dest":"kafka/orders","payload":"aGk=","payload_encoding":"base64","due":5,"attempt":2,"x":true}"#;
        let env = Envelope::decode(json).unwrap();
        assert_eq!(env.dest, "kafka/orders");
        assert_eq!(env.payload, b"hi");
        assert_eq!(env.meta.attempt, 2);
        assert_eq!(env.meta.extra.get("x"), Some(&Value::Bool(true)));
    }

    #[test]
    fn bad_envelopes_are_named() {
        let cases: &[(&[u8], &str)] = &[
            (b"zd1:emails", "no destination line"),
            (b"zd1:emails\nx\n", "meta length is not a number"),
            (b"zd1:emails\n99\n{}", "meta length exceeds"),
            (b"zd1:emails\n2\n[]", "meta is not a JSON object"),
            (b"{\"payload\":\"x\"}", "missing dest"),
            (b"{\"dest\":\"a\"}", "missing payload"),
            (b"{not json", "invalid JSON"),
            (b"plain text", "neither a zd1 frame"),
        ];
        for (bytes, want) in cases {
            let err = Envelope::decode(bytes).unwrap_err().to_string();
            assert!(
                err.contains(want),
                "{:?}: {err}",
                String::from_utf8_lossy(bytes)
            );
        }
        assert_eq!(
            Envelope::decode(br#"{"v":2,"dest":"a","payload":"b"}"#),
            Err(EnvelopeError::Version(2))
        );
    }

    #[test]
    fn schedule_is_read_from_meta() {
        let env = Envelope::decode(b"zd1:q\n22\n{\"schedule\":\"nightly\"}x").unwrap();
        assert_eq!(env.meta.schedule.as_deref(), Some("nightly"));
        assert_eq!(Envelope::new("q", b"x".to_vec()).meta.schedule, None);
    }

    #[test]
    fn dest_must_frame() {
        assert!(Envelope::new("a\nb", b"x".to_vec()).encode().is_err());
        assert!(Envelope::new("", b"x".to_vec()).encode().is_err());
    }

    #[test]
    fn json_view_base64_for_binary() {
        let view = Envelope::new("q", vec![0xff]).to_json();
        assert_eq!(view["payload_encoding"], "base64");
        assert_eq!(view["payload"], "/w==");
    }
}
