//! The producer protocol's functions called as a stranger may call them: random argument
//! vectors (counts, types, sizes, encodings) to every function of the library, on a spread
//! shard's and a route lane's keys, on one Redis and on a cluster. After each call the reply is a documented one, and
//! the keyspace (every key's DUMP) is exactly as before — a refused call, a read, a call that
//! found nothing to do — or what a model of the call says a correct call leaves: never an
//! orphan frame, due entry or window. A model of the documented argument rules says which
//! calls are refused. No daemon runs: nothing else changes the keys.

use crate::common::{self, Daemon, RedisCluster, RedisServer, SeededRng, TestConfig, wait_for};
use redis::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use zdelay::keys::{Keys, LaneKeys, slot_of, slot_tag};

const SHARDS: u16 = 4;
const SHARD: u16 = 1;
const LANE_MARKER: &str = "2 1 LPUSH q:emails";
const CALLS: usize = 2000;
const SEED: u64 = 0x2907_f022;

type Bytes = Vec<u8>;
type Snapshot = BTreeMap<Bytes, Vec<Bytes>>;

/// Every key of the node with its DUMP.
/// Every key's value in a canonical form (DUMP is not one: a read may advance a big hash's
/// incremental rehash and so the order DUMP writes its fields in).
fn snapshot(con: &mut redis::Connection) -> Snapshot {
    let keys: Vec<Bytes> = redis::cmd("KEYS").arg("*").query(con).expect("KEYS");
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(con).expect("TYPE");
            let mut items: Vec<Bytes> = match kind.as_str() {
                "string" => vec![redis::cmd("GET").arg(&key).query(con).expect("GET")],
                "list" => redis::cmd("LRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .query(con)
                    .expect("LRANGE"),
                "zset" => redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(con)
                    .expect("ZRANGE"),
                "hash" => {
                    let pairs: Vec<(Bytes, Bytes)> =
                        redis::cmd("HGETALL").arg(&key).query(con).expect("HGETALL");
                    let sorted: BTreeMap<Bytes, Bytes> = pairs.into_iter().collect();
                    sorted.into_iter().flat_map(|(f, v)| [f, v]).collect()
                }
                "set" => {
                    let mut members: Vec<Bytes> = redis::cmd("SMEMBERS")
                        .arg(&key)
                        .query(con)
                        .expect("SMEMBERS");
                    members.sort();
                    members
                }
                other => panic!("{other} key in a producer's keyspace"),
            };
            items.insert(0, kind.into_bytes());
            (key, items)
        })
        .collect()
}

/// The keys whose value differs between two snapshots (for failure messages).
fn changed_keys(before: &Snapshot, after: &Snapshot) -> Vec<String> {
    before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn time_ms(con: &mut redis::Connection) -> i64 {
    common::redis_now_ms(con)
}

/// Which family of functions a target serves: its keys share one slot, so on a cluster one
/// node holds them all.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Family {
    Shard,
    Lane,
    Schedule,
}

/// The functions of a family and the keys each takes (the optional ones last).
struct Target {
    family: Family,
    con: redis::Connection,
    shard: Vec<String>,
    lane: Vec<String>,
    sched: Vec<String>,
    ids: Vec<String>,
}

impl Target {
    /// The node serving `family`: the only server, or the master of the family's slot.
    fn on(ports: &[u16], family: Family) -> Target {
        let keys = Keys::new("zdelay", SHARDS);
        let k = keys.shard(SHARD);
        let shard = [
            &k.due,
            &k.jobs,
            &k.inflight,
            &k.dead,
            &k.reasons,
            &k.scheduled,
            &k.ready,
            &k.ready_ids,
            &k.max_lateness,
            &k.layout,
            &k.unique,
            &k.windows,
        ]
        .map(|s| s.to_string())
        .to_vec();
        let l = LaneKeys::new("zdelay", slot_tag(4242), "emails");
        let lane = [
            &l.due, &l.jobs, &l.meta, &l.maxlate, &l.large, &l.dead, &l.reasons, &l.marker,
            &l.unique, &l.windows,
        ]
        .map(|s| s.to_string())
        .to_vec();
        let sched = vec![
            "{zdelay}:sched_requests".to_owned(),
            "{zdelay}:sched_results".to_owned(),
        ];
        let probe = match family {
            Family::Shard => &shard[0],
            Family::Lane => &lane[0],
            Family::Schedule => &sched[0],
        };
        let con = ports
            .iter()
            .find_map(|port| {
                let mut con = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                    .ok()?
                    .get_connection()
                    .ok()?;
                // A node that does not serve the slot answers MOVED.
                redis::cmd("EXISTS")
                    .arg(probe)
                    .query::<i64>(&mut con)
                    .ok()
                    .map(|_| con)
            })
            .unwrap_or_else(|| panic!("a node serves {probe} (slot {})", slot_of(probe)));
        // Ids of the shard the keys are of, as a client computes them.
        let ids = (0..200)
            .map(|i| format!("j{i}"))
            .filter(|id| keys.shard_of(id) == SHARD)
            .take(5)
            .chain(["{t}x".to_owned(), "é{t}".to_owned()])
            .filter(|id| family != Family::Shard || keys.shard_of(id) == SHARD)
            .collect();
        let mut target = Target {
            family,
            con,
            shard,
            lane,
            sched,
            ids,
        };
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(zdelay::store::functions::library())
            .query::<String>(&mut target.con)
            .expect("load the library");
        target
    }
}

/// One call: the function, its keys, its arguments.
#[derive(Debug)]
struct Call {
    function: &'static str,
    keys: Vec<String>,
    args: Vec<Bytes>,
}

/// Every key `function` may take, in order (the optional ones last).
fn all_keys(t: &Target, function: &str) -> Vec<String> {
    let of = |keys: &[String], at: &[usize]| at.iter().map(|&i| keys[i].clone()).collect();
    match function {
        "zd2_enqueue" => t.shard.clone(),
        "zd2_cancel" => of(&t.shard, &[0, 1, 2, 5, 6, 7, 8, 9, 10]),
        "zd2_reschedule" => of(&t.shard, &[0, 5, 6, 7, 9]),
        "zd2_get" => of(&t.shard, &[0, 1, 2, 3, 4, 7, 9]),
        "zd2_enqueue_lane" => t.lane.clone(),
        "zd2_cancel_lane" => of(&t.lane, &[0, 1, 2, 3, 4, 7, 8]),
        "zd2_reschedule_lane" => of(&t.lane, &[0, 7]),
        "zd2_get_lane" => of(&t.lane, &[0, 1, 2, 3, 5, 6, 7]),
        _ => t.sched.clone(),
    }
}

/// A job's meta: none, or some.
const METAS: &[&[u8]] = &[b"", br#"{"max_attempts":3}"#];

const BAD_VALUES: &[&[u8]] = &[
    b"",
    b"abc",
    b"-5",
    b"1.5",
    b"1700000000",
    b"1e12",
    b" 12",
    b"+",
    b"+-1",
    b"0x10",
    b"~x",
    b"\xff\xfe",
    b"99999999999999999999",
    b"12\n",
    b"replace junk",
    b"debounce",
    b"unique 5",
    b"zd1:",
    b"zd1:q\n5\n{}",
    b"zd1:q\n0",
    b"{",
    b"nan",
    b"inf",
    b"0",
    b"16385",
    b"l",
    b"lX",
    b"set",
];

fn pick<'a, T>(rng: &mut SeededRng, items: &'a [T]) -> &'a T {
    &items[rng.range(0, items.len() as i64) as usize]
}

fn good_due(rng: &mut SeededRng, now: i64) -> Bytes {
    if rng.range(0, 2) == 0 {
        format!("+{}", rng.range(0, 100_000)).into_bytes()
    } else {
        (now + rng.range(-10_000, 3_600_000))
            .to_string()
            .into_bytes()
    }
}

fn payload(rng: &mut SeededRng) -> Bytes {
    let len = if rng.range(0, 20) == 0 {
        rng.range(4090, 4200)
    } else {
        rng.range(0, 24)
    };
    (0..len).map(|_| rng.range(0, 256) as u8).collect()
}

fn lateness(rng: &mut SeededRng) -> Bytes {
    if rng.range(0, 2) == 0 {
        Bytes::new()
    } else {
        rng.range(0, 100_000).to_string().into_bytes()
    }
}

fn policy(rng: &mut SeededRng, windows: bool) -> Bytes {
    let base = match rng.range(0, if windows { 4 } else { 3 }) {
        0 => "replace".to_owned(),
        1 => "keep".to_owned(),
        2 => "error".to_owned(),
        _ => format!("debounce {}", rng.range(0, 100_000)),
    };
    if windows && rng.range(0, 2) == 0 {
        format!("{base} unique {}", rng.range(0, 100_000)).into_bytes()
    } else {
        base.into_bytes()
    }
}

/// A well-formed call of one of the family's functions.
fn good_call(rng: &mut SeededRng, t: &Target, now: i64) -> Call {
    let id = pick(rng, &t.ids).clone().into_bytes();
    let shards = SHARDS.to_string().into_bytes();
    let shard = SHARD.to_string().into_bytes();
    let wake = b"zdelay:wake".to_vec();
    let optional = rng.range(0, 2) == 0;
    let (function, keys, args): (&'static str, Vec<String>, Vec<Bytes>) =
        match (t.family, rng.range(0, 4)) {
            (Family::Shard, 0) => {
                let mut args = vec![shards, policy(rng, optional), wake, shard];
                for _ in 0..rng.range(0, 4) {
                    let meta = pick(rng, METAS).to_vec();
                    let mut frame = format!("zd1:emails\n{}\n", meta.len()).into_bytes();
                    frame.extend_from_slice(&meta);
                    frame.extend(payload(rng));
                    args.extend([
                        pick(rng, &t.ids).clone().into_bytes(),
                        good_due(rng, now),
                        frame,
                        lateness(rng),
                    ]);
                }
                (
                    "zd2_enqueue",
                    all_keys(t, "zd2_enqueue")[..if optional { 12 } else { 10 }].to_vec(),
                    args,
                )
            }
            (Family::Shard, 1) => (
                "zd2_cancel",
                all_keys(t, "zd2_cancel")[..if optional { 9 } else { 8 }].to_vec(),
                vec![shards, id],
            ),
            (Family::Shard, 2) => (
                "zd2_reschedule",
                all_keys(t, "zd2_reschedule"),
                vec![shards, id, good_due(rng, now), wake, shard],
            ),
            (Family::Shard, _) => ("zd2_get", all_keys(t, "zd2_get"), vec![shards, id]),
            (Family::Lane, 0) => {
                let mut args = vec![
                    LANE_MARKER.into(),
                    policy(rng, optional),
                    wake,
                    b"l1".to_vec(),
                ];
                for _ in 0..rng.range(0, 4) {
                    let meta = pick(rng, METAS).to_vec();
                    args.extend([
                        pick(rng, &t.ids).clone().into_bytes(),
                        good_due(rng, now),
                        payload(rng),
                        meta,
                        lateness(rng),
                    ]);
                }
                (
                    "zd2_enqueue_lane",
                    t.lane[..if optional { 10 } else { 8 }].to_vec(),
                    args,
                )
            }
            (Family::Lane, 1) => (
                "zd2_cancel_lane",
                all_keys(t, "zd2_cancel_lane")[..if optional { 7 } else { 6 }].to_vec(),
                vec![LANE_MARKER.into(), id],
            ),
            (Family::Lane, 2) => (
                "zd2_reschedule_lane",
                all_keys(t, "zd2_reschedule_lane"),
                vec![
                    LANE_MARKER.into(),
                    id,
                    good_due(rng, now),
                    wake,
                    b"l1".to_vec(),
                ],
            ),
            (Family::Lane, _) => (
                "zd2_get_lane",
                all_keys(t, "zd2_get_lane"),
                vec![LANE_MARKER.into(), id],
            ),
            (Family::Schedule, n) => {
                let op = ["set", "pause", "resume", "delete"][n as usize];
                let mut args = vec![format!("s{}", rng.range(0, 3)).into_bytes(), op.into()];
                if op == "set" {
                    args.push(
                        br#"{"id":"s1","dest":"emails","every":"5m","payload":"x"}"#.to_vec(),
                    );
                }
                ("zd2_schedule", t.sched.clone(), args)
            }
        };
    Call {
        function,
        keys,
        args,
    }
}

/// One to three changes a stranger might make: an argument of another kind, one missing or
/// one too many, a key missing or one too many. The keys keep their documented order (a
/// function cannot tell one key name from another): only their count changes.
fn mutate(rng: &mut SeededRng, call: &mut Call, t: &Target) {
    for _ in 0..rng.range(1, 4) {
        match rng.range(0, 6) {
            0 | 1 if !call.args.is_empty() => {
                let i = rng.range(0, call.args.len() as i64) as usize;
                call.args[i] = if rng.range(0, 8) == 0 {
                    let long = rng.range(255, 300) as usize;
                    vec![b'x'; long]
                } else {
                    pick(rng, BAD_VALUES).to_vec()
                };
            }
            2 if !call.args.is_empty() => {
                let i = rng.range(0, call.args.len() as i64) as usize;
                call.args.remove(i);
            }
            3 => {
                let value = pick(rng, BAD_VALUES).to_vec();
                call.args.push(value);
            }
            4 if !call.keys.is_empty() => {
                call.keys.pop();
            }
            _ => {
                // The next key of the function's list, or one past its end (of the same slot,
                // so the call stays on one node).
                let all = all_keys(t, call.function);
                let next = all
                    .get(call.keys.len())
                    .cloned()
                    .unwrap_or_else(|| format!("{}:extra", all[0]));
                call.keys.push(next);
            }
        }
    }
}

fn fcall(call: &Call) -> redis::Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(call.function).arg(call.keys.len());
    for key in &call.keys {
        cmd.arg(key);
    }
    for arg in &call.args {
        cmd.arg(arg.as_slice());
    }
    cmd
}

// ---- The model of the documented argument rules (docs/reference/protocol.md, "Bad requests").

fn digits(s: &[u8], max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.iter().all(u8::is_ascii_digit)
}

fn number(s: &[u8]) -> i64 {
    std::str::from_utf8(s).unwrap().parse().unwrap()
}

fn due_ok(s: &[u8]) -> bool {
    match s.strip_prefix(b"+") {
        Some(ms) => digits(ms, 15),
        None => digits(s, 15) && !(1_000_000_000..100_000_000_000).contains(&number(s)),
    }
}

fn id_ok(s: &[u8], stored: bool) -> bool {
    !s.is_empty() && s.len() <= 256 && !(stored && s[0] == b'~')
}

fn lateness_ok(s: &[u8]) -> bool {
    s.is_empty() || digits(s, 15)
}

/// (whether the policy is well formed, whether it needs the window keys)
fn policy_ok(s: &[u8]) -> (bool, bool) {
    let Ok(s) = std::str::from_utf8(s) else {
        return (false, false);
    };
    let (base, unique) = match s.rsplit_once(" unique ") {
        Some((base, ms)) => (base, Some(ms)),
        None => (s, None),
    };
    let unique_ok = unique.is_none_or(|ms| digits(ms.as_bytes(), 15));
    let wait = base.strip_prefix("debounce ");
    let base_ok = matches!(base, "replace" | "keep" | "error")
        || wait.is_some_and(|ms| digits(ms.as_bytes(), 15));
    (base_ok && unique_ok, wait.is_some() || unique.is_some())
}

fn shards_ok(s: &[u8]) -> bool {
    digits(s, 5) && s[0] != b'0' && number(s) <= 16384
}

fn shard_ok(s: &[u8], shards: &[u8]) -> bool {
    digits(s, 5) && number(s) < number(shards)
}

fn wake_name_ok(s: &[u8]) -> bool {
    s.len() > 1
        && s[0] == b'l'
        && s[1..]
            .iter()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
}

fn frame_ok(f: &[u8]) -> bool {
    let Some(rest) = f.strip_prefix(b"zd1:") else {
        return false;
    };
    let Some(dest_end) = rest.iter().position(|&b| b == b'\n') else {
        return false;
    };
    if dest_end == 0 {
        return false;
    }
    let rest = &rest[dest_end + 1..];
    let Some(len_end) = rest.iter().position(|&b| b == b'\n') else {
        return false;
    };
    if !digits(&rest[..len_end], 9) {
        return false;
    }
    let meta_len = number(&rest[..len_end]) as usize;
    let body = &rest[len_end + 1..];
    meta_len <= body.len() && (meta_len == 0 || (body[0] == b'{' && body[meta_len - 1] == b'}'))
}

fn meta_ok(m: &[u8]) -> bool {
    m.is_empty() || (m[0] == b'{' && m[m.len() - 1] == b'}')
}

/// Whether the documented rules refuse the call (ZDELAY_BAD_REQUEST).
fn refused(call: &Call) -> bool {
    let a = &call.args;
    let n = call.keys.len();
    let arg = |i: usize| a.get(i).map(Vec::as_slice);
    match call.function {
        "zd2_enqueue" => {
            let (policy_ok, needs_windows) = arg(1).map_or((false, false), policy_ok);
            (n != 10 && n != 12)
                || !arg(0).is_some_and(shards_ok)
                || !policy_ok
                || arg(2).is_none_or(|w| w.is_empty())
                || !arg(3).is_some_and(|s| shard_ok(s, &a[0]))
                || !(a.len() - 4).is_multiple_of(4)
                || a[4..].chunks(4).any(|j| {
                    !(id_ok(&j[0], true) && due_ok(&j[1]) && frame_ok(&j[2]) && lateness_ok(&j[3]))
                })
                || (needs_windows && n == 10)
        }
        "zd2_enqueue_lane" => {
            let (policy_ok, needs_windows) = arg(1).map_or((false, false), policy_ok);
            (n != 8 && n != 10)
                || a.is_empty()
                || !policy_ok
                || arg(2).is_none_or(|w| w.is_empty())
                || !arg(3).is_some_and(wake_name_ok)
                || !(a.len() - 4).is_multiple_of(5)
                || a[4..].chunks(5).any(|j| {
                    !(id_ok(&j[0], true) && due_ok(&j[1]) && meta_ok(&j[3]) && lateness_ok(&j[4]))
                })
                || (needs_windows && n == 8)
        }
        "zd2_cancel" => n != 9 || a.len() != 2 || !shards_ok(&a[0]) || !id_ok(&a[1], false),
        "zd2_get" => n != 7 || a.len() != 2 || !shards_ok(&a[0]) || !id_ok(&a[1], false),
        "zd2_reschedule" => {
            n != 5
                || a.len() != 5
                || !shards_ok(&a[0])
                || !id_ok(&a[1], false)
                || !due_ok(&a[2])
                || a[3].is_empty()
                || !shard_ok(&a[4], &a[0])
        }
        "zd2_cancel_lane" => n != 7 || a.len() != 2 || !id_ok(&a[1], false),
        "zd2_get_lane" => n != 7 || a.len() != 2 || !id_ok(&a[1], false),
        "zd2_reschedule_lane" => {
            n != 2
                || a.len() != 5
                || !id_ok(&a[1], false)
                || !due_ok(&a[2])
                || a[3].is_empty()
                || !wake_name_ok(&a[4])
        }
        "zd2_schedule" => {
            let id_ok = arg(0).is_some_and(|id| {
                let tag_ok = match id.iter().position(|&b| b == b'{') {
                    Some(open) => id[open + 1..]
                        .iter()
                        .position(|&b| b == b'}')
                        .is_some_and(|len| len > 0),
                    None => !id.contains(&b'}'),
                };
                !id.is_empty() && id.len() <= 512 && !id.contains(&b'\n') && tag_ok
            });
            let op = arg(1).unwrap_or_default();
            n != 2
                || !id_ok
                || !matches!(op, b"set" | b"pause" | b"resume" | b"delete")
                || a.len() != if op == b"set" { 3 } else { 2 }
                || (op == b"set" && a[2].first() != Some(&b'{'))
        }
        other => panic!("no model for {other}"),
    }
}

// ---- What a correct call leaves.

fn hget(con: &mut redis::Connection, key: &str, field: &[u8]) -> Option<Bytes> {
    redis::cmd("HGET").arg(key).arg(field).query(con).unwrap()
}

fn zscore(con: &mut redis::Connection, key: &str, member: &[u8]) -> Option<i64> {
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(key)
        .arg(member)
        .query(con)
        .unwrap();
    score.map(|s| s as i64)
}

fn fields(con: &mut redis::Connection, key: &str) -> BTreeSet<Bytes> {
    let kind: String = redis::cmd("TYPE").arg(key).query(con).unwrap();
    let cmd = match kind.as_str() {
        "hash" => "HKEYS",
        "zset" => {
            return redis::cmd("ZRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .query(con)
                .unwrap();
        }
        "set" => "SMEMBERS",
        _ => return BTreeSet::new(),
    };
    redis::cmd(cmd).arg(key).query(con).unwrap()
}

/// No orphan: every frame has a state, every state its frame.
fn check_no_orphan(t: &mut Target, context: &str) {
    let (jobs, with_state, owned_by_jobs) = match t.family {
        Family::Shard => (1, vec![0, 2, 3], vec![0, 8]),
        Family::Lane => (1, vec![0, 5], vec![0, 2, 3, 4]),
        Family::Schedule => return,
    };
    let keys = if t.family == Family::Shard {
        t.shard.clone()
    } else {
        t.lane.clone()
    };
    let frames = fields(&mut t.con, &keys[jobs]);
    let mut stated: BTreeSet<Bytes> = with_state
        .iter()
        .flat_map(|&i| fields(&mut t.con, &keys[i]))
        .collect();
    if t.family == Family::Shard {
        stated.extend(fields(&mut t.con, &keys[7]));
    }
    for frame in &frames {
        assert!(
            stated.contains(frame),
            "{context}: an orphan frame {:?}",
            String::from_utf8_lossy(frame)
        );
    }
    for &i in &owned_by_jobs {
        for id in fields(&mut t.con, &keys[i]) {
            assert!(
                frames.contains(&id),
                "{context}: {} holds {:?} without its frame",
                keys[i],
                String::from_utf8_lossy(&id)
            );
        }
    }
}

/// An id's whole state, to compare before and after.
fn id_state(t: &mut Target, id: &[u8]) -> Vec<Option<Bytes>> {
    let keys = if t.family == Family::Shard {
        t.shard.clone()
    } else {
        t.lane.clone()
    };
    keys.iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(key).query(&mut t.con).unwrap();
            match kind.as_str() {
                "hash" => hget(&mut t.con, key, id),
                "zset" => zscore(&mut t.con, key, id).map(|s| s.to_string().into_bytes()),
                "set" => redis::cmd("SISMEMBER")
                    .arg(key)
                    .arg(id)
                    .query::<i64>(&mut t.con)
                    .ok()
                    .map(|b| vec![b as u8]),
                _ => None,
            }
        })
        .collect()
}

/// A fence the marker raises for a well-formed call, if any.
fn fenced(t: &mut Target, call: &Call) -> bool {
    match t.family {
        Family::Shard => {
            let marker: Option<Bytes> = redis::cmd("GET")
                .arg(&t.shard[9])
                .query(&mut t.con)
                .unwrap();
            marker.is_some_and(|m| m != call.args[0])
        }
        Family::Lane => {
            let marker: Option<Bytes> =
                redis::cmd("GET").arg(&t.lane[7]).query(&mut t.con).unwrap();
            marker.is_none_or(|m| m != call.args[0])
        }
        Family::Schedule => false,
    }
}

fn run_call(t: &mut Target, call: &Call, n: usize) {
    let context = format!(
        "call {n} {} {:?} {:?}",
        call.function,
        call.keys,
        call.args
            .iter()
            .map(|a| String::from_utf8_lossy(&a[..a.len().min(60)]).into_owned())
            .collect::<Vec<_>>()
    );
    let before = snapshot(&mut t.con);
    let refuse = refused(call);
    let fence = !refuse && fenced(t, call);
    // The jobs an enqueue names, each id's last place in the call and its state before.
    let (arity, first) = match call.function {
        "zd2_enqueue" => (4, 4),
        "zd2_enqueue_lane" => (5, 4),
        _ => (0, 0),
    };
    let mut last: BTreeMap<Bytes, usize> = BTreeMap::new();
    let mut count: BTreeMap<Bytes, usize> = BTreeMap::new();
    let mut states = BTreeMap::new();
    if arity > 0 && !refuse && !fence {
        for (j, job) in call.args[first..].chunks(arity).enumerate() {
            last.insert(job[0].clone(), j);
            *count.entry(job[0].clone()).or_default() += 1;
            if !states.contains_key(&job[0]) {
                let state = id_state(t, &job[0]);
                states.insert(job[0].clone(), state);
            }
        }
    }
    let t0 = time_ms(&mut t.con);
    let reply = fcall(call).query::<Value>(&mut t.con);
    let t1 = time_ms(&mut t.con);
    let after = snapshot(&mut t.con);

    if refuse || fence {
        let err = reply.expect_err(&context);
        let code = err.code().unwrap_or_default().to_owned();
        if refuse {
            assert_eq!(code, "ZDELAY_BAD_REQUEST", "{context}: {err}");
        } else {
            assert!(
                matches!(
                    code.as_str(),
                    "ZDELAY_RESHARDED"
                        | "ZDELAY_MIGRATING"
                        | "ZDELAY_LAYOUT"
                        | "ZDELAY_LANE_MOVED"
                        | "ZDELAY_LANE_CHANGED"
                        | "ZDELAY_NO_LANE"
                ),
                "{context}: {err}"
            );
        }
        assert!(before == after, "{context}: a refused call wrote");
        return;
    }
    let reply = reply.unwrap_or_else(|e| panic!("{context}: {e}"));
    match (call.function, &reply) {
        ("zd2_enqueue" | "zd2_enqueue_lane", Value::Array(codes)) => {
            let jobs: Vec<&[Bytes]> = call.args[first..].chunks(arity).collect();
            assert_eq!(codes.len(), jobs.len(), "{context}: one reply per job");
            let debounce = call.args[1].starts_with(b"debounce");
            for (j, (code, job)) in codes.iter().zip(&jobs).enumerate() {
                let Value::Int(code) = code else {
                    panic!("{context}: reply {code:?}")
                };
                assert!([-1, 0, 1, 2, 3].contains(code), "{context}: reply {code}");
                let id = &job[0];
                if last[id] != j {
                    continue;
                }
                let keys = if t.family == Family::Shard {
                    t.shard.clone()
                } else {
                    t.lane.clone()
                };
                if matches!(code, 1 | 2) {
                    // The frame (a shard) or the payload (a lane) is the third of a job's arguments.
                    let stored = &job[2];
                    assert_eq!(
                        hget(&mut t.con, &keys[1], id).as_ref(),
                        Some(stored),
                        "{context}: the frame of job {}",
                        j + 1
                    );
                    let due = zscore(&mut t.con, &keys[0], id)
                        .unwrap_or_else(|| panic!("{context}: job {} has no due", j + 1));
                    let (lo, hi) = match job[1].strip_prefix(b"+") {
                        Some(ms) => (t0 + number(ms), t1 + number(ms)),
                        None => (number(&job[1]), number(&job[1])),
                    };
                    assert!(
                        due <= hi && (debounce || due >= lo),
                        "{context}: job {} due {due}, asked {lo}..={hi}",
                        j + 1
                    );
                    let late_key = if t.family == Family::Shard {
                        &keys[8]
                    } else {
                        &keys[3]
                    };
                    let lateness = &job[arity - 1];
                    let expected = (!lateness.is_empty()).then(|| lateness.clone());
                    assert_eq!(
                        hget(&mut t.con, late_key, id),
                        expected,
                        "{context}: max lateness of job {}",
                        j + 1
                    );
                    if t.family == Family::Lane {
                        let meta = &job[3];
                        let expected = (!meta.is_empty()).then(|| meta.clone());
                        assert_eq!(
                            hget(&mut t.con, &keys[2], id),
                            expected,
                            "{context}: meta of job {}",
                            j + 1
                        );
                    }
                } else if count[id] == 1 {
                    assert_eq!(
                        id_state(t, id),
                        states[id],
                        "{context}: job {} ({code}) changed its id's state",
                        j + 1
                    );
                }
            }
        }
        ("zd2_cancel" | "zd2_cancel_lane", Value::Int(code)) => {
            let keys = if t.family == Family::Shard {
                t.shard.clone()
            } else {
                t.lane.clone()
            };
            let id = &call.args[1];
            match code {
                1 => {
                    assert_eq!(zscore(&mut t.con, &keys[0], id), None, "{context}");
                    assert_eq!(hget(&mut t.con, &keys[1], id), None, "{context}");
                    let with_unique =
                        call.keys.len() == if t.family == Family::Shard { 9 } else { 7 };
                    if with_unique {
                        let unique = if t.family == Family::Shard {
                            &keys[10]
                        } else {
                            &keys[8]
                        };
                        assert_eq!(
                            hget(&mut t.con, unique, id),
                            None,
                            "{context}: the cancelled job's unique entry"
                        );
                    }
                }
                0 | -1 if *code == 0 || t.family == Family::Shard => {
                    assert!(
                        before == after,
                        "{context}: cancel answered {code} and wrote"
                    );
                }
                other => panic!("{context}: reply {other}"),
            }
        }
        ("zd2_reschedule" | "zd2_reschedule_lane", Value::Int(due)) if *due >= 0 => {
            let due_key = if t.family == Family::Shard {
                &t.shard[0]
            } else {
                &t.lane[0]
            };
            assert_eq!(
                zscore(&mut t.con, &due_key.clone(), &call.args[1]),
                Some(*due),
                "{context}"
            );
        }
        ("zd2_reschedule", Value::Int(-1)) | ("zd2_reschedule_lane", Value::Nil) => {
            assert!(before == after, "{context}: a reschedule of nothing wrote");
        }
        ("zd2_get" | "zd2_get_lane", Value::Array(fields)) => {
            assert_eq!(fields.len(), 8, "{context}");
            assert!(
                before == after,
                "{context}: a read wrote {:?}",
                changed_keys(&before, &after)
            );
        }
        ("zd2_schedule", Value::Int(seq)) => {
            assert!(*seq >= 1, "{context}");
            assert!(
                hget(&mut t.con, &t.sched[0].clone(), &call.args[0]).is_some(),
                "{context}: the request is recorded"
            );
        }
        _ => panic!("{context}: undocumented reply {reply:?}"),
    }
    check_no_orphan(t, &context);
}

/// `CALLS` calls, most of them malformed, against one target; the markers change now and then
/// so fences answer too.
fn fuzz(t: &mut Target, seed: u64) {
    let mut rng = SeededRng::new(seed);
    // A dead job (a replace takes it out of dead) and the lane's marker.
    let now = time_ms(&mut t.con);
    let dead_id = t.ids[0].clone();
    match t.family {
        Family::Shard => {
            let mut pipe = redis::pipe();
            pipe.hset(&t.shard[1], &dead_id, "zd1:emails\n0\nold")
                .zadd(&t.shard[3], &dead_id, now)
                .hset(&t.shard[4], &dead_id, "expired");
            pipe.query::<()>(&mut t.con).unwrap();
        }
        Family::Lane => {
            let mut pipe = redis::pipe();
            pipe.set(&t.lane[7], LANE_MARKER)
                .hset(&t.lane[1], &dead_id, "old")
                .zadd(&t.lane[5], &dead_id, now)
                .hset(&t.lane[6], &dead_id, "expired");
            pipe.query::<()>(&mut t.con).unwrap();
        }
        Family::Schedule => {}
    }
    let (mut refused_calls, mut ok_calls) = (0, 0);
    for n in 0..CALLS {
        if n % 100 == 50 {
            // A fence for a while: another shard count, a reshard running, a newer storage
            // layout, a changed lane.
            let (key, value) = match t.family {
                Family::Shard => (
                    &t.shard[9],
                    *pick(&mut rng, &["4", "8", "migrating 4 8", "layout 3 0.9.0"]),
                ),
                Family::Lane => (
                    &t.lane[7],
                    *pick(&mut rng, &[LANE_MARKER, "retired 9", "2 1 RPUSH q:emails"]),
                ),
                Family::Schedule => continue,
            };
            redis::cmd("SET")
                .arg(key)
                .arg(value)
                .query::<()>(&mut t.con)
                .unwrap();
        } else if n % 100 == 80 {
            match t.family {
                Family::Shard => redis::cmd("DEL")
                    .arg(&t.shard[9])
                    .query::<()>(&mut t.con)
                    .unwrap(),
                Family::Lane => redis::cmd("SET")
                    .arg(&t.lane[7])
                    .arg(LANE_MARKER)
                    .query::<()>(&mut t.con)
                    .unwrap(),
                Family::Schedule => {}
            }
        }
        let now = time_ms(&mut t.con);
        let mut call = good_call(&mut rng, t, now);
        if rng.range(0, 10) < 6 {
            mutate(&mut rng, &mut call, t);
        }
        if refused(&call) {
            refused_calls += 1;
        } else {
            ok_calls += 1;
        }
        run_call(t, &call, n);
    }
    // The run is worth something only if both kinds of call were many.
    assert!(
        refused_calls > CALLS / 4 && ok_calls > CALLS / 4,
        "{refused_calls} refused, {ok_calls} run"
    );
}

fn fuzz_every_family(ports: &[u16]) {
    for (i, family) in [Family::Shard, Family::Lane, Family::Schedule]
        .into_iter()
        .enumerate()
    {
        let mut target = Target::on(ports, family);
        fuzz(&mut target, SEED + i as u64);
    }
}

#[test]
fn fuzzed_producer_calls_answer_as_documented_and_never_write_part_of_a_call() {
    let redis = RedisServer::start();
    fuzz_every_family(&[redis.port]);
}

#[test]
fn fuzzed_producer_calls_on_a_cluster_answer_as_documented_and_never_write_part_of_a_call() {
    let cluster = RedisCluster::start();
    fuzz_every_family(&cluster.ports);
}

/// The issue's cases, one by one: a malformed job after a good one, and a job missing an
/// argument, refuse the whole call in a spread shard and in a lane; nothing of the good job is
/// written.
#[test]
fn a_malformed_job_refuses_the_whole_enqueue_and_writes_nothing_in_a_shard_and_a_lane() {
    let redis = RedisServer::start();
    let mut shard = Target::on(&[redis.port], Family::Shard);
    let mut lane = Target::on(&[redis.port], Family::Lane);
    redis::cmd("SET")
        .arg(&lane.lane[7])
        .arg(LANE_MARKER)
        .query::<()>(&mut lane.con)
        .unwrap();
    let head: Vec<Bytes> = vec![
        "4".into(),
        "replace".into(),
        "zdelay:wake".into(),
        "1".into(),
    ];
    let good: Vec<Bytes> = vec![
        "j1".into(),
        "+1000".into(),
        b"zd1:emails\n0\nhello".to_vec(),
        "".into(),
    ];
    let cases: Vec<(&str, Vec<Bytes>, &str)> = vec![
        (
            "due abc",
            [
                &good[..],
                &["j2".into(), "abc".into(), good[2].clone(), "".into()],
            ]
            .concat(),
            "job 2 due",
        ),
        (
            "a missing argument",
            [&good[..], &["j2".into(), "+5".into(), good[2].clone()]].concat(),
            "job 2:",
        ),
        (
            "an empty id",
            [
                &good[..],
                &["".into(), "+5".into(), good[2].clone(), "".into()],
            ]
            .concat(),
            "job 2 id",
        ),
        (
            "a 300-byte id",
            [
                &good[..],
                &[vec![b'x'; 300], "+5".into(), good[2].clone(), "".into()],
            ]
            .concat(),
            "job 2 id",
        ),
        (
            "a ~ id",
            [
                &good[..],
                &["~x".into(), "+5".into(), good[2].clone(), "".into()],
            ]
            .concat(),
            "job 2 id",
        ),
        (
            "max lateness soon",
            [
                &good[..],
                &["j2".into(), "+5".into(), good[2].clone(), "soon".into()],
            ]
            .concat(),
            "job 2 max lateness",
        ),
        (
            "a negative due",
            [
                &good[..],
                &["j2".into(), "-5".into(), good[2].clone(), "".into()],
            ]
            .concat(),
            "job 2 due",
        ),
        (
            "a fractional due",
            [
                &good[..],
                &["j2".into(), "1.5".into(), good[2].clone(), "".into()],
            ]
            .concat(),
            "job 2 due",
        ),
        (
            "a due in seconds",
            [
                &good[..],
                &["j2".into(), "1764662400".into(), good[2].clone(), "".into()],
            ]
            .concat(),
            "job 2 due",
        ),
        (
            "a frame that is not one",
            [
                &good[..],
                &["j2".into(), "+5".into(), b"hello".to_vec(), "".into()],
            ]
            .concat(),
            "job 2 frame",
        ),
    ];
    for (what, jobs, field) in cases {
        let before = snapshot(&mut shard.con);
        let call = Call {
            function: "zd2_enqueue",
            keys: shard.shard[..10].to_vec(),
            args: [&head[..], &jobs[..]].concat(),
        };
        let err = fcall(&call).query::<Value>(&mut shard.con).expect_err(what);
        assert_eq!(err.code(), Some("ZDELAY_BAD_REQUEST"), "{what}: {err}");
        assert!(
            err.detail().unwrap_or_default().starts_with(field),
            "{what}: {err} names {field}"
        );
        assert!(
            snapshot(&mut shard.con) == before,
            "a spread shard, {what}: nothing written"
        );

        // The same jobs on a lane: payload, meta and max lateness in place of frame and max lateness.
        let lane_jobs: Vec<Bytes> = jobs
            .chunks(4)
            .flat_map(|j| {
                let mut j = j.to_vec();
                if j.len() == 4 {
                    j.insert(3, Bytes::new());
                }
                j
            })
            .collect();
        if field == "job 2 frame" {
            continue;
        }
        let lane_head: Vec<Bytes> = vec![
            LANE_MARKER.into(),
            "replace".into(),
            "zdelay:wake".into(),
            "l1".into(),
        ];
        let before = snapshot(&mut lane.con);
        let call = Call {
            function: "zd2_enqueue_lane",
            keys: lane.lane[..8].to_vec(),
            args: [&lane_head[..], &lane_jobs[..]].concat(),
        };
        let err = fcall(&call).query::<Value>(&mut lane.con).expect_err(what);
        assert_eq!(err.code(), Some("ZDELAY_BAD_REQUEST"), "{what}: {err}");
        assert!(
            snapshot(&mut lane.con) == before,
            "a lane, {what}: nothing written"
        );
    }
    // A marker absent (never resharded) no longer lets any shard count through.
    let before = snapshot(&mut shard.con);
    let call = Call {
        function: "zd2_enqueue",
        keys: shard.shard[..10].to_vec(),
        args: [
            &[
                "0".into(),
                "replace".into(),
                "zdelay:wake".into(),
                "1".into(),
            ][..],
            &good[..],
        ]
        .concat(),
    };
    let err = fcall(&call)
        .query::<Value>(&mut shard.con)
        .expect_err("shards 0");
    assert!(
        err.detail().unwrap_or_default().starts_with("shards:"),
        "{err}"
    );
    assert!(snapshot(&mut shard.con) == before);
}

const ROUTES: &str = r#"
[[routes]]
name = "emails"
sink = "local"
target = "q:emails"
"#;

/// A cancel must take the `<unique>` key, so a cancelled job's window always goes with it: a
/// cancel without it is refused and changes nothing, and a later job of the id enqueued by a
/// call without the unique keys is not remembered once delivered (an enqueue with `unique`
/// adds it). In a route's lane (`zd2_*_lane`), or in a spread shard (`zd2_enqueue`,
/// `zd2_cancel`: a two-phase route, here to another Redis).
fn a_cancelled_window_is_not_inherited(lane: bool) {
    let redis = RedisServer::start();
    let remote = (!lane).then(RedisServer::start);
    let config = match &remote {
        None => TestConfig::new(&redis.url(), SHARDS, ROUTES),
        Some(remote) => TestConfig::new(
            &redis.url(),
            SHARDS,
            &format!(
                "[sinks.remote]\nkind = \"redis\"\nurl = \"{}\"\n\n{}",
                remote.url(),
                ROUTES.replace("sink = \"local\"", "sink = \"remote\"")
            ),
        ),
    };
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let mut delivered_to = remote.as_ref().unwrap_or(&redis).conn();
    let id = "u1";
    let frame = b"zd1:emails\n0\nhello".to_vec();
    type Enqueue = Box<dyn Fn(&str, &str, bool) -> Call>;
    let (enqueue, cancel_short, cancel): (Enqueue, Call, Call) = if lane {
        let entry: String = redis::cmd("HGET")
            .arg("zdelay:lanes")
            .arg("r:emails")
            .query(&mut con)
            .expect("the lane");
        let f: Vec<&str> = entry.split(' ').collect();
        let (lane, slot, push, list) = (f[0].to_owned(), f[2].parse::<u16>().unwrap(), f[3], f[4]);
        let k = LaneKeys::new("zdelay", slot_tag(slot), "emails");
        let marker = format!("2 {lane} {push} {list}");
        let keys = vec![
            k.due, k.jobs, k.meta, k.maxlate, k.large, k.dead, k.reasons, k.marker, k.unique,
            k.windows,
        ];
        let cancel_with = |with: &[usize]| Call {
            function: "zd2_cancel_lane",
            keys: with.iter().map(|&i| keys[i].clone()).collect(),
            args: vec![marker.clone().into(), id.into()],
        };
        let (cancel_short, cancel) = (
            cancel_with(&[0, 1, 2, 3, 4, 7]),
            cancel_with(&[0, 1, 2, 3, 4, 7, 8]),
        );
        let enqueue = move |policy: &str, due: &str, windows: bool| Call {
            function: "zd2_enqueue_lane",
            keys: keys[..if windows { 10 } else { 8 }].to_vec(),
            args: vec![
                marker.clone().into(),
                policy.into(),
                "zdelay:wake".into(),
                format!("l{lane}").into(),
                id.into(),
                due.into(),
                "hello".into(),
                "".into(),
                "".into(),
            ],
        };
        (Box::new(enqueue), cancel_short, cancel)
    } else {
        let keys = Keys::new("zdelay", SHARDS);
        let shard = keys.shard_of(id);
        let k = keys.shard(shard);
        let all = vec![
            k.due,
            k.jobs,
            k.inflight,
            k.dead,
            k.reasons,
            k.scheduled,
            k.ready,
            k.ready_ids,
            k.max_lateness,
            k.layout,
            k.unique,
            k.windows,
        ];
        let cancel_with = |with: &[usize]| Call {
            function: "zd2_cancel",
            keys: with.iter().map(|&i| all[i].clone()).collect(),
            args: vec![SHARDS.to_string().into(), id.into()],
        };
        let (cancel_short, cancel) = (
            cancel_with(&[0, 1, 2, 5, 6, 7, 8, 9]),
            cancel_with(&[0, 1, 2, 5, 6, 7, 8, 9, 10]),
        );
        let enqueue = move |policy: &str, due: &str, windows: bool| Call {
            function: "zd2_enqueue",
            keys: all[..if windows { 12 } else { 10 }].to_vec(),
            args: vec![
                SHARDS.to_string().into(),
                policy.into(),
                "zdelay:wake".into(),
                shard.to_string().into(),
                id.into(),
                due.into(),
                frame.clone(),
                "".into(),
            ],
        };
        (Box::new(enqueue), cancel_short, cancel)
    };
    let codes = |call: Call, con: &mut redis::Connection| -> Vec<i64> {
        fcall(&call).query(con).expect("enqueue")
    };
    assert_eq!(
        codes(
            enqueue("replace unique 3600000", "+3600000", true),
            &mut con
        ),
        [1]
    );
    let refused = fcall(&cancel_short)
        .query::<i64>(&mut con)
        .expect_err("a cancel without <unique> is refused");
    assert_eq!(refused.code(), Some("ZDELAY_BAD_REQUEST"), "{refused}");
    assert!(
        refused.detail().unwrap_or_default().starts_with("keys"),
        "{refused}"
    );
    let due_key = &cancel.keys[0];
    let waiting: Option<f64> = redis::cmd("ZSCORE")
        .arg(due_key)
        .arg(id)
        .query(&mut con)
        .expect("zscore");
    assert!(waiting.is_some(), "the refused cancel changed nothing");
    let cancelled: i64 = fcall(&cancel).query(&mut con).expect("cancel");
    assert_eq!(cancelled, 1);
    // A new job of the id, enqueued by a call without the unique keys: delivered at once.
    assert_eq!(codes(enqueue("replace", "+0", false), &mut con), [1]);
    // Delivered and, through a remote sink, acknowledged: until its ack the job is still
    // the scheduling Redis's, and an enqueue of its id would replace it.
    let jobs_key = cancel.keys[1].clone();
    wait_for("the job delivered", Duration::from_secs(10), || {
        common::lrange(&mut delivered_to, "q:emails").len() == 1
            && !redis::cmd("HEXISTS")
                .arg(&jobs_key)
                .arg(id)
                .query::<bool>(&mut con)
                .expect("HEXISTS")
    });
    // Not remembered: an enqueue with a window of its own is added, not a duplicate.
    assert_eq!(
        codes(
            enqueue("replace unique 3600000", "+3600000", true),
            &mut con
        ),
        [1],
        "the cancelled job's window was inherited"
    );
}

#[test]
fn a_cancel_without_the_unique_key_is_refused_and_no_later_job_inherits_a_window() {
    a_cancelled_window_is_not_inherited(false);
}

#[test]
fn a_lane_cancel_without_the_unique_key_is_refused_and_no_later_job_inherits_a_window() {
    a_cancelled_window_is_not_inherited(true);
}
