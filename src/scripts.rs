//! The only place that loads `lua/`: one typed wrapper per script, sharing its name.
//!
//! Invocations use EVALSHA with a NOSCRIPT reload (redis-rs `Script`). Every script is safe
//! to re-run, because after an I/O error we cannot know whether it ran.

use redis::{Script, Value};
use std::sync::LazyLock;

macro_rules! scripts {
    ($($name:ident),* $(,)?) => {
        /// Every script: (name, source). Used by tests and by `load_all`.
        pub const ALL: &[(&str, &str)] = &[
            $((stringify!($name), include_str!(concat!("../lua/", stringify!($name), ".lua")))),*
        ];
        $(
            #[allow(non_upper_case_globals)]
            pub static $name: LazyLock<Script> = LazyLock::new(|| {
                Script::new(include_str!(concat!("../lua/", stringify!($name), ".lua")))
            });
        )*
        /// Loads every script, so EVALSHA in pipelines never meets NOSCRIPT (redis-rs #1394).
        pub async fn load_all<C: redis::aio::ConnectionLike>(con: &mut C) -> redis::RedisResult<()> {
            $( $name.prepare_invoke().load_async(con).await?; )*
            Ok(())
        }
    };
}

scripts!(
    enqueue_jobs,
    move_due,
    move_raw,
    cancel_job,
    reschedule_job,
    replay_dead,
    purge_dead,
    replay_raw_dead,
    purge_raw_dead,
    settle_jobs,
    bench_bare_move_raw,
    bench_bare_move_hash,
);

/// Dead-letter kinds counted by `move_due`, in reply order.
pub const DUE_DEAD_KINDS: [&str; 5] = [
    "malformed",
    "unknown_destination",
    "wrong_type",
    "oversize",
    "missing_envelope",
];
/// Dead-letter kinds counted by `move_raw`, in reply order (last two unused).
pub const RAW_DEAD_KINDS: [&str; 5] = ["implausible_score", "wrong_type", "oversize", "", ""];

/// The reply of `move_due` and `move_raw` (see their headers).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoveReply {
    /// Jobs taken off the ZSET: moved plus sent to dead. A full batch means "go again".
    pub taken: usize,
    /// Redis TIME at the call, µs.
    pub now_us: i64,
    /// Score of the new head, in the source's unit.
    pub next_due: Option<f64>,
    pub max_lateness_ms: i64,
    /// Jobs left due because their push failed (OOM and the like).
    pub kept: usize,
    pub kept_error: String,
    /// Jobs moved, one count per route (raw sources: one count).
    pub moved: Vec<u64>,
    /// Dead letters per kind.
    pub dead: [u64; 5],
    /// Moved jobs per lateness bucket; one more than the bounds given.
    pub buckets: Vec<u64>,
    /// Expired leases returned to due by this call (`move_due` only).
    pub reaped: u64,
    /// Jobs of paused sinks pushed back (`move_due` only).
    pub postponed: u64,
    /// Lease deadline of the claimed jobs: the fencing token for `settle_jobs`.
    pub deadline_ms: i64,
    /// Jobs claimed for two-phase sinks (`move_due` only).
    pub claimed: Vec<Claimed>,
}

/// A job claimed for a two-phase sink: now in inflight until `MoveReply::deadline_ms`.
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    pub id: String,
    pub due_ms: i64,
    pub envelope: Vec<u8>,
}

impl MoveReply {
    pub fn moved_total(&self) -> u64 {
        self.moved.iter().sum()
    }

    /// Parses the reply with `moved_len` per-route counts and `bounds` lateness bounds.
    pub fn parse(value: Value, moved_len: usize, bounds: usize) -> redis::RedisResult<Self> {
        let fixed = 6 + moved_len + 5 + bounds + 1;
        let items = match value {
            Value::Array(items) if items.len() == fixed || items.len() >= fixed + 4 => items,
            other => return Err(protocol_error("move reply", &other)),
        };
        let mut it = items.into_iter();
        let mut next = || it.next().expect("length checked above");
        let taken = as_int(next())? as usize;
        let now_us = as_int(next())?;
        let next_due = match as_string(next())? {
            s if s.is_empty() => None,
            s => Some(s.parse::<f64>().map_err(|_| {
                redis::RedisError::from((redis::ErrorKind::Parse, "next_due is not a number"))
            })?),
        };
        let max_lateness_ms = as_int(next())?;
        let kept = as_int(next())? as usize;
        let kept_error = as_string(next())?;
        let moved = (0..moved_len)
            .map(|_| as_int(next()).map(|n| n as u64))
            .collect::<Result<_, _>>()?;
        let mut dead = [0u64; 5];
        for slot in &mut dead {
            *slot = as_int(next())? as u64;
        }
        let buckets = (0..=bounds)
            .map(|_| as_int(next()).map(|n| n as u64))
            .collect::<Result<_, _>>()?;
        let mut reply = MoveReply {
            taken,
            now_us,
            next_due,
            max_lateness_ms,
            kept,
            kept_error,
            moved,
            dead,
            buckets,
            ..MoveReply::default()
        };
        let rest: Vec<Value> = it.collect();
        if let [reaped, postponed, deadline, count, claimed @ ..] = rest.as_slice() {
            reply.reaped = as_int(reaped.clone())? as u64;
            reply.postponed = as_int(postponed.clone())? as u64;
            reply.deadline_ms = as_int(deadline.clone())?;
            let count = as_int(count.clone())? as usize;
            if claimed.len() != 3 * count {
                return Err(protocol_error("claimed jobs", &Value::Int(count as i64)));
            }
            for job in claimed.chunks(3) {
                reply.claimed.push(Claimed {
                    id: as_string(job[0].clone())?,
                    due_ms: as_string(job[1].clone())?
                        .parse::<f64>()
                        .map(|d| d as i64)
                        .map_err(|_| protocol_error("claimed due", &job[1]))?,
                    envelope: as_bytes(job[2].clone())?,
                });
            }
        }
        Ok(reply)
    }
}

pub(crate) fn as_bytes(v: Value) -> redis::RedisResult<Vec<u8>> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::Nil => Ok(Vec::new()),
        other => Err(protocol_error("bytes", &other)),
    }
}

fn protocol_error(what: &str, got: &Value) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Parse,
        "unexpected script reply",
        format!("{what}: {got:?}"),
    ))
}

pub(crate) fn as_int(v: Value) -> redis::RedisResult<i64> {
    match v {
        Value::Int(n) => Ok(n),
        Value::BulkString(b) => std::str::from_utf8(&b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| protocol_error("integer", &Value::BulkString(b))),
        other => Err(protocol_error("integer", &other)),
    }
}

pub(crate) fn as_string(v: Value) -> redis::RedisResult<String> {
    match v {
        Value::BulkString(b) => Ok(String::from_utf8_lossy(&b).into_owned()),
        Value::SimpleString(s) => Ok(s),
        Value::Nil => Ok(String::new()),
        Value::Int(n) => Ok(n.to_string()),
        other => Err(protocol_error("string", &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Literal `KEYS[n]` indices in `text`, and whether a variadic `KEYS[n..]` appears.
    fn key_refs(text: &str) -> (BTreeSet<usize>, bool) {
        let mut found = BTreeSet::new();
        let mut variadic = false;
        for (i, _) in text.match_indices("KEYS[") {
            let rest = &text[i + 5..];
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if let Ok(n) = digits.parse() {
                if rest[digits.len()..].starts_with("..") {
                    variadic = true;
                } else {
                    found.insert(n);
                }
            }
        }
        (found, variadic)
    }

    #[test]
    fn every_header_declares_exactly_the_keys_the_body_uses() {
        for (name, source) in ALL {
            let header: String = source
                .lines()
                .take_while(|l| l.starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n");
            let body: String = source
                .lines()
                .skip_while(|l| l.starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n");
            assert!(
                header.starts_with(&format!("-- {name}:")),
                "{name}: header names it"
            );
            assert!(
                header.contains("Returns"),
                "{name}: header documents the reply"
            );
            assert!(
                header.contains("Re-run safety"),
                "{name}: header says if re-runnable"
            );
            let (declared, variadic) = key_refs(&header);
            let (used, _) = key_refs(&body);
            for k in &used {
                assert!(
                    declared.contains(k),
                    "{name}: body uses KEYS[{k}] not in the header"
                );
            }
            for k in &declared {
                assert!(
                    used.contains(k),
                    "{name}: header declares KEYS[{k}] the body never uses"
                );
            }
            if body.contains("KEYS[tonumber") {
                assert!(
                    variadic,
                    "{name}: dynamic KEYS index needs a KEYS[n..] header line"
                );
            }
            // Every key must arrive in KEYS: no key names built from strings inside Lua.
            for call in ["redis.call('", "redis.pcall("] {
                for (i, _) in body.match_indices(call) {
                    let line = body[i..].lines().next().unwrap_or("");
                    assert!(
                        !line.contains(".. ':'"),
                        "{name}: builds a key in Lua: {line}"
                    );
                }
            }
        }
    }

    #[test]
    fn parses_a_move_reply() {
        let v = Value::Array(vec![
            Value::Int(3),
            Value::Int(1_700_000_000_000_123),
            Value::BulkString(b"1700000000005".to_vec()),
            Value::Int(4),
            Value::Int(0),
            Value::BulkString(vec![]),
            Value::Int(2),
            Value::Int(0),
            Value::Int(1),
            Value::Int(0),
            Value::Int(0),
            Value::Int(0),
            Value::Int(0),
            Value::Int(1),
            Value::Int(1),
        ]);
        let r = MoveReply::parse(v, 2, 1).unwrap();
        assert_eq!(r.taken, 3);
        assert_eq!(r.next_due, Some(1_700_000_000_005.0));
        assert_eq!(r.moved, vec![2, 0]);
        assert_eq!(r.dead, [1, 0, 0, 0, 0]);
        assert_eq!(r.buckets, vec![1, 1]);
        assert!(MoveReply::parse(Value::Array(vec![]), 2, 1).is_err());
    }
}
