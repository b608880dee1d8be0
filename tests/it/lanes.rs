//! Route lanes (storage layout 2, being built): `enqueue_lane`, `move_lane` and the per-id
//! calls (`cancel_lane`, `reschedule_lane`, `lanes::get`) against a real Redis. What must
//! hold as on layout 1: pushed and removed in one call, in due order, never before due,
//! policies per id, the general path's dead letters (missing, oversize, expired, wrong type)
//! and a failed push leaving everything due; cancel and reschedule touch only a waiting job,
//! and a reschedule to a new head wakes the mover; and what is new: the marker fence, meta
//! kept beside the payload, the byte budget kept without reading a payload only to leave it.

use crate::common::{RedisServer, lrange, redis_now_ms, runtime};
use std::time::Duration;
use zdelay::config::Push;
use zdelay::job::JobState;
use zdelay::job::{Due, Enqueued, OnConflict};
use zdelay::lane::Lane;
use zdelay::store::Conn;
use zdelay::store::lanes::{self, LaneJob, LaneLookup};
use zdelay::store::scripts::{self, LaneItem, MoveLane, MoveReply};

const BOUNDS: &[u64] = &[1, 10, 100];

struct Setup {
    redis: RedisServer,
    rt: tokio::runtime::Runtime,
    con: Conn,
    lane: Lane,
}

fn setup() -> Setup {
    let redis = RedisServer::start();
    let rt = runtime();
    let con = rt
        .block_on(Conn::connect(&crate::common::redis_config(&redis.url(), 1)))
        .expect("connect");
    let lane = Lane::new("zdelay", "emj", 7, "emails", "q:emails", Push::Lpush);
    let mut s = Setup {
        redis,
        rt,
        con,
        lane,
    };
    s.set_marker(&s.lane.marker());
    s
}

impl Setup {
    fn set_marker(&mut self, marker: &str) {
        let _: () = redis::cmd("SET")
            .arg(&self.lane.keys.marker)
            .arg(marker)
            .query(&mut self.redis.conn())
            .expect("SET marker");
    }

    fn enqueue(
        &mut self,
        policy: OnConflict,
        items: &[LaneItem],
    ) -> redis::RedisResult<Vec<Option<Enqueued>>> {
        self.rt.block_on(scripts::enqueue_lane(
            &mut self.con,
            &self.lane,
            policy,
            "zdelay:wake",
            items,
        ))
    }

    fn move_at(
        &mut self,
        now_ms: Option<i64>,
        max_payload: usize,
        batch_bytes: usize,
    ) -> redis::RedisResult<MoveReply> {
        let args = MoveLane {
            batch: 1000,
            now_ms,
            max_payload,
            batch_bytes,
            bounds_ms: BOUNDS,
            flow: None,
            trim: None,
        };
        self.rt
            .block_on(scripts::move_lane(&mut self.con, &self.lane, &args))
    }

    fn cancel(&mut self, id: &str) -> redis::RedisResult<bool> {
        self.rt
            .block_on(scripts::cancel_lane(&mut self.con, &self.lane, id))
    }

    fn reschedule(&mut self, id: &str, due: Due) -> redis::RedisResult<Option<i64>> {
        self.rt.block_on(scripts::reschedule_lane(
            &mut self.con,
            &self.lane,
            "zdelay:wake",
            id,
            due,
        ))
    }

    fn get(&mut self, id: &str) -> Option<LaneJob> {
        self.rt
            .block_on(lanes::get(&mut self.con, &self.lane, id))
            .expect("get")
    }

    fn zscore(&mut self, key: &str, member: &str) -> Option<i64> {
        redis::cmd("ZSCORE")
            .arg(key)
            .arg(member)
            .query(&mut self.redis.conn())
            .expect("ZSCORE")
    }

    fn sismember(&mut self, key: &str, member: &str) -> bool {
        redis::cmd("SISMEMBER")
            .arg(key)
            .arg(member)
            .query(&mut self.redis.conn())
            .expect("SISMEMBER")
    }

    /// One call with the default limits and `batch` jobs at most.
    fn move_batch(&mut self, now_ms: i64, batch: usize) -> MoveReply {
        let args = MoveLane {
            batch,
            now_ms: Some(now_ms),
            max_payload: 1 << 20,
            batch_bytes: 4 << 20,
            bounds_ms: BOUNDS,
            flow: None,
            trim: None,
        };
        self.rt
            .block_on(scripts::move_lane(&mut self.con, &self.lane, &args))
            .expect("move")
    }

    fn hlen(&mut self, key: &str) -> usize {
        redis::cmd("HLEN")
            .arg(key)
            .query(&mut self.redis.conn())
            .expect("HLEN")
    }

    fn zcard(&mut self, key: &str) -> usize {
        redis::cmd("ZCARD")
            .arg(key)
            .query(&mut self.redis.conn())
            .expect("ZCARD")
    }

    fn hget(&mut self, key: &str, field: &str) -> Option<String> {
        redis::cmd("HGET")
            .arg(key)
            .arg(field)
            .query(&mut self.redis.conn())
            .expect("HGET")
    }
}

fn item<'a>(id: &'a str, due_ms: i64, payload: &'a [u8]) -> LaneItem<'a> {
    LaneItem {
        id,
        due: Due::At(due_ms),
        payload,
        meta: None,
        max_lateness_ms: None,
        unique_for_ms: None,
    }
}

#[test]
fn a_lane_moves_due_jobs_in_order_and_none_early() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let later = now + 3_600_000;
    let done = s
        .enqueue(
            OnConflict::Error,
            &[
                item("b", now - 5, b"second"),
                item("a", now - 50, b"first"),
                item("c", later, b"later"),
            ],
        )
        .expect("enqueue");
    assert_eq!(done, vec![Some(Enqueued::Added); 3]);
    let reply = s.move_at(None, 1 << 20, 4 << 20).expect("move");
    assert_eq!((reply.taken, reply.moved_total()), (2, 2));
    assert_eq!(reply.next_due, Some(later as f64), "the head left");
    assert!(reply.max_lateness_ms >= 50, "{reply:?}");
    assert_eq!(
        reply.buckets.iter().sum::<u64>(),
        2,
        "every moved job in a bucket"
    );
    // LPUSH: a consumer's BRPOP takes the earliest first.
    assert_eq!(
        lrange(&mut s.redis.conn(), "q:emails"),
        vec![b"second".to_vec(), b"first".to_vec()]
    );
    assert_eq!(s.zcard(&s.lane.keys.due.clone()), 1);
    // Never early: at one ms before its due the last job stays.
    let reply = s.move_at(Some(later - 1), 1 << 20, 4 << 20).expect("move");
    assert_eq!(reply.taken, 0);
    let reply = s.move_at(Some(later), 1 << 20, 4 << 20).expect("move");
    assert_eq!(reply.moved_total(), 1);
    let jobs: u64 = redis::cmd("HLEN")
        .arg(&s.lane.keys.jobs)
        .query(&mut s.redis.conn())
        .unwrap();
    assert_eq!(jobs, 0, "a delivered job's payload is gone");
}

#[test]
fn policies_apply_per_id_and_replace_clears_what_the_old_job_had() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let meta = r#"{"headers":{"k":"v"}}"#;
    let with_meta = LaneItem {
        meta: Some(meta),
        max_lateness_ms: Some(5),
        ..item("x", now + 60_000, b"v1")
    };
    s.enqueue(OnConflict::Error, &[with_meta]).expect("enqueue");
    let (meta_key, maxlate_key) = (s.lane.keys.meta.clone(), s.lane.keys.maxlate.clone());
    assert_eq!(s.hget(&meta_key, "x").as_deref(), Some(meta));
    assert_eq!(
        s.enqueue(OnConflict::Error, &[item("x", now, b"v2")])
            .unwrap(),
        vec![None],
        "error: exists"
    );
    assert_eq!(
        s.enqueue(OnConflict::Keep, &[item("x", now, b"v2")])
            .unwrap(),
        vec![Some(Enqueued::Kept)]
    );
    assert_eq!(
        s.hget(&s.lane.keys.jobs.clone(), "x").as_deref(),
        Some("v1")
    );
    assert_eq!(
        s.enqueue(OnConflict::Replace, &[item("x", now, b"v3")])
            .unwrap(),
        vec![Some(Enqueued::Replaced)]
    );
    assert_eq!(
        s.hget(&meta_key, "x"),
        None,
        "the old meta went with the old job"
    );
    assert_eq!(s.hget(&maxlate_key, "x"), None, "and its lateness bound");
    s.move_at(None, 1 << 20, 4 << 20).expect("move");
    assert_eq!(
        lrange(&mut s.redis.conn(), "q:emails"),
        vec![b"v3".to_vec()]
    );
}

#[test]
fn the_general_path_sends_what_cannot_go_to_dead_and_moves_the_rest() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let big = vec![b'x'; 200];
    let expired = LaneItem {
        max_lateness_ms: Some(10),
        ..item("expired", now - 1000, b"late")
    };
    s.enqueue(
        OnConflict::Error,
        &[
            item("ok", now - 100, b"fine"),
            item("big", now - 90, &big),
            expired,
        ],
    )
    .expect("enqueue");
    // A job whose payload vanished (written by hand without its payload).
    let _: () = redis::cmd("ZADD")
        .arg(&s.lane.keys.due)
        .arg(now - 80)
        .arg("ghost")
        .query(&mut s.redis.conn())
        .unwrap();
    let reply = s.move_at(None, 100, 4 << 20).expect("move");
    assert_eq!(reply.taken, 4);
    assert_eq!(reply.moved_total(), 1);
    // dead kinds: malformed, unknown, wrong_type, oversize, missing, expired
    assert_eq!(reply.dead, [0, 0, 0, 1, 1, 1]);
    assert_eq!(
        lrange(&mut s.redis.conn(), "q:emails"),
        vec![b"fine".to_vec()]
    );
    let reasons = s.lane.keys.reasons.clone();
    assert!(
        s.hget(&reasons, "big")
            .unwrap()
            .contains("exceeds max_payload 100")
    );
    assert!(s.hget(&reasons, "ghost").unwrap().contains("no payload"));
    assert!(
        s.hget(&reasons, "expired")
            .unwrap()
            .starts_with("expired: ")
    );
    assert_eq!(s.zcard(&s.lane.keys.dead.clone()), 3);
    assert_eq!(s.zcard(&s.lane.keys.due.clone()), 0);
    // A dead job keeps its payload, for replay.
    assert_eq!(
        s.hget(&s.lane.keys.jobs.clone(), "big").map(|p| p.len()),
        Some(200)
    );
}

#[test]
fn a_list_of_another_type_sends_the_batch_to_dead_and_a_refused_push_keeps_it_due() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let _: () = redis::cmd("SET")
        .arg("q:emails")
        .arg("oops")
        .query(&mut s.redis.conn())
        .unwrap();
    s.enqueue(OnConflict::Error, &[item("a", now - 10, b"p")])
        .expect("enqueue");
    let reply = s.move_at(None, 1 << 20, 4 << 20).expect("move");
    assert_eq!((reply.moved_total(), reply.dead[2]), (0, 1), "{reply:?}");
    assert!(
        s.hget(&s.lane.keys.reasons.clone(), "a")
            .unwrap()
            .contains("holds a string")
    );

    // Out of memory: the push fails, nothing is removed, the error is reported.
    let _: () = redis::cmd("DEL")
        .arg("q:emails")
        .query(&mut s.redis.conn())
        .unwrap();
    s.enqueue(OnConflict::Error, &[item("b", now - 10, b"p")])
        .expect("enqueue");
    let mut admin = s.redis.conn();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(1)
        .query(&mut admin)
        .unwrap();
    let reply = s.move_at(None, 1 << 20, 4 << 20);
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(0)
        .query(&mut admin)
        .unwrap();
    let reply = reply.expect("move");
    assert_eq!((reply.moved_total(), reply.kept), (0, 1), "{reply:?}");
    assert!(reply.kept_error.contains("OOM"), "{}", reply.kept_error);
    assert_eq!(s.zcard(&s.lane.keys.due.clone()), 1, "still due");
    let reply = s.move_at(None, 1 << 20, 4 << 20).expect("move");
    assert_eq!(reply.moved_total(), 1);
}

#[test]
fn the_marker_fences_every_call() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    s.enqueue(OnConflict::Error, &[item("a", now - 10, b"p")])
        .expect("enqueue");
    for (marker, code) in [
        ("retired 9", "ZDELAY_LANE_MOVED"),
        ("2 7 RPUSH q:other", "ZDELAY_LANE_CHANGED"),
    ] {
        s.set_marker(marker);
        let e = s.move_at(None, 1 << 20, 4 << 20).expect_err("fenced");
        assert_eq!(e.code(), Some(code), "{e}");
        let e = s
            .enqueue(OnConflict::Error, &[item("b", now, b"q")])
            .expect_err("fenced");
        assert_eq!(e.code(), Some(code), "{e}");
    }
    let _: () = redis::cmd("DEL")
        .arg(&s.lane.keys.marker)
        .query(&mut s.redis.conn())
        .unwrap();
    let e = s.move_at(None, 1 << 20, 4 << 20).expect_err("fenced");
    assert_eq!(e.code(), Some("ZDELAY_NO_LANE"));
    assert_eq!(
        s.zcard(&s.lane.keys.due.clone()),
        1,
        "nothing moved or added while fenced"
    );
    assert_eq!(crate::common::llen(&mut s.redis.conn(), "q:emails"), 0);
}

#[test]
fn the_byte_budget_holds_with_large_payloads_waiting() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let small = b"s".to_vec();
    let large = vec![b'L'; 10_000];
    let ids: Vec<String> = (0..20).map(|i| format!("j{i:02}")).collect();
    let items: Vec<LaneItem> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            item(
                id,
                now - 100 + i as i64,
                if i % 2 == 0 { &small } else { &large },
            )
        })
        .collect();
    s.enqueue(OnConflict::Error, &items).expect("enqueue");
    let large_key = s.lane.keys.large.clone();
    let listed: usize = redis::cmd("SCARD")
        .arg(&large_key)
        .query(&mut s.redis.conn())
        .unwrap();
    assert_eq!(listed, 10, "every payload over 4 KiB is listed");
    // 25,000 bytes a call: j00 (1) + j01 (10,000) + j02 + j03 + j04 = 20,003; j05 would pass it.
    let reply = s.move_at(None, 1 << 20, 25_000).expect("move");
    assert_eq!(reply.moved_total(), 5, "{reply:?}");
    let mut calls = 1;
    while s.zcard(&s.lane.keys.due.clone()) > 0 {
        s.move_at(None, 1 << 20, 25_000).expect("move");
        calls += 1;
        assert!(calls < 10);
    }
    assert_eq!(crate::common::llen(&mut s.redis.conn(), "q:emails"), 20);
    let left: usize = redis::cmd("EXISTS")
        .arg(&large_key)
        .query(&mut s.redis.conn())
        .unwrap();
    assert_eq!(left, 0, "delivered payloads leave the large set");
}

#[test]
fn the_registry_gives_each_route_a_lane_and_a_new_one_when_its_list_changes_slot() {
    use zdelay::keys::{Keys, slot_of, slot_tag};
    use zdelay::store::lanes::{read_registry, register};
    use zdelay::store::scripts::LaneChange;
    let mut s = setup();
    let keys = Keys::new("zdelay", 16);
    let mut reg = |list: &str, push: Push| {
        s.rt.block_on(register(&mut s.con, &keys, "emails", list, push))
    };
    let (lane, change) = reg("{q}emails", Push::Lpush).expect("register");
    assert_eq!((lane.number, change), (1, LaneChange::New));
    assert!(
        lane.keys
            .due
            .starts_with(&format!("zdelay:{{{}}}:", slot_tag(slot_of("{q}emails"))))
    );
    let (again, change) = reg("{q}emails", Push::Lpush).expect("register");
    assert_eq!((again, change), (lane.clone(), LaneChange::Same));
    // Another list in the same slot: the lane stays, its marker follows.
    let (same_slot, change) = reg("{q}mails", Push::Rpush).expect("register");
    assert_eq!((same_slot.number, change), (1, LaneChange::Updated));
    let mut con = s.redis.conn();
    let marker: String = redis::cmd("GET")
        .arg(&lane.keys.marker)
        .query(&mut con)
        .unwrap();
    assert_eq!(marker, "2 1 RPUSH {q}mails");
    // Another slot: a new lane, the old one retired (its marker sends callers on).
    let (moved, change) = reg("other-list", Push::Lpush).expect("register");
    assert_eq!(
        (moved.number, change),
        (2, LaneChange::Moved { from: "1".into() })
    );
    let marker: String = redis::cmd("GET")
        .arg(&lane.keys.marker)
        .query(&mut con)
        .unwrap();
    assert_eq!(marker, "retired 2");
    let registry =
        s.rt.block_on(read_registry(&mut s.con, &keys))
            .expect("read");
    assert_eq!(registry.by_route.get("emails"), Some(&moved));
    assert_eq!(registry.lane(2), Some(&moved));
    assert_eq!(registry.lane(1), None, "a retired lane is not live");

    // A move while the lane holds a job: the lane is retired holding it (the registry names
    // the successor at once) and the relocation moves it there, under the same stored id
    // and due. The route moved back to the first list's slot: lane 3 has lane 1's keys.
    let now = redis_now_ms(&mut con);
    s.rt.block_on(scripts::enqueue_lane(
        &mut s.con,
        &moved,
        OnConflict::Error,
        "zdelay:wake",
        &[item("waiting", now + 60_000, b"p")],
    ))
    .expect("enqueue");
    // And a dead letter with its reason, and the window of a job delivered earlier.
    let k = &moved.keys;
    let _: () = redis::pipe()
        .zadd(&k.dead, "died", now - 5_000)
        .hset(&k.reasons, "died", "why")
        .hset(&k.jobs, "died", "d")
        .zadd(&k.windows, "u:gone", now + 600_000)
        .query(&mut con)
        .unwrap();
    let (back, change) =
        s.rt.block_on(register(
            &mut s.con,
            &keys,
            "emails",
            "{q}emails",
            Push::Lpush,
        ))
        .expect("register");
    assert_eq!(
        (back.number, change),
        (3, LaneChange::Moved { from: "2".into() })
    );
    let registry =
        s.rt.block_on(read_registry(&mut s.con, &keys))
            .expect("read");
    assert_eq!(registry.successor(2), Some(&back));
    assert_eq!(registry.successor(1), Some(&back));
    // Lane 1's keys are live again as lane 3's: only lane 2 is relocated from.
    let retired: Vec<_> = registry.retired_of("emails").collect();
    assert_eq!(retired.len(), 1);
    let done =
        s.rt.block_on(zdelay::store::relocate::relocate(
            &mut s.con, &keys, &back, &retired,
        ))
        .expect("relocate");
    assert_eq!((done.moved, done.windows), (2, 1), "{done:?}");
    let job =
        s.rt.block_on(lanes::get(&mut s.con, &back, "waiting"))
            .expect("get")
            .expect("relocated");
    assert_eq!(job.score, Some((now + 60_000) as f64));
    let dead =
        s.rt.block_on(lanes::get(&mut s.con, &back, "died"))
            .expect("get")
            .expect("relocated");
    assert_eq!(
        (dead.state, dead.score, dead.reason.as_deref()),
        (JobState::Dead, Some((now - 5_000) as f64), Some("why"))
    );
    let window: Option<f64> = redis::cmd("ZSCORE")
        .arg(&back.keys.windows)
        .arg("u:gone")
        .query(&mut con)
        .unwrap();
    assert_eq!(window, Some((now + 600_000) as f64));
    let left: u64 = redis::cmd("EXISTS")
        .arg(&moved.keys.due)
        .arg(&moved.keys.jobs)
        .arg(&moved.keys.dead)
        .arg(&moved.keys.windows)
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 0, "the retired lane is empty");
}

/// A route moved to another slot and back before the relocation out of its first lane ended
/// (the daemon that ran it died after writing a job into the second lane, which delivered it):
/// registering the first slot again finishes that relocation first, so the job is not live
/// again in the first lane's keys, which the route uses once more.
#[test]
fn a_route_moved_back_before_its_relocation_ended_delivers_nothing_twice() {
    use zdelay::keys::Keys;
    use zdelay::store::lanes::register;
    let mut s = setup();
    let keys = Keys::new("zdelay", 16);
    let reg = |s: &mut Setup, list: &str| {
        s.rt.block_on(register(&mut s.con, &keys, "back", list, Push::Rpush))
            .expect("register")
            .0
    };
    let first = reg(&mut s, "{p}back");
    let now = redis_now_ms(&mut s.redis.conn());
    s.rt.block_on(scripts::enqueue_lane(
        &mut s.con,
        &first,
        OnConflict::Error,
        "zdelay:wake",
        &[item("x", now + 60_000, b"p")],
    ))
    .expect("enqueue");
    let second = reg(&mut s, "other-back");
    // Half a relocation: x put into the second lane (its id recorded there), then delivered
    // from it; the first lane still holds it.
    let record = scripts::LaneRecord {
        id: b"x".to_vec(),
        due: Some((now + 60_000).to_string().into_bytes()),
        payload: Some(b"p".to_vec()),
        ..Default::default()
    };
    s.rt.block_on(scripts::upgrade_put_lane(
        &mut s.con,
        &second,
        None,
        &[record],
    ))
    .expect("put");
    let mut con = s.redis.conn();
    let _: () = redis::pipe()
        .zrem(&second.keys.due, "x")
        .hdel(&second.keys.jobs, "x")
        .query(&mut con)
        .unwrap();
    let third = reg(&mut s, "{p}back");
    assert_eq!(
        third.keys, first.keys,
        "the first lane's keys are live again"
    );
    let held: bool = redis::cmd("HEXISTS")
        .arg(&third.keys.jobs)
        .arg("x")
        .query(&mut con)
        .unwrap();
    assert!(!held, "x, delivered already, is waiting again");
}

#[test]
fn a_missing_payload_on_the_fast_path_dies_alone() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    s.enqueue(
        OnConflict::Error,
        &[item("a", now - 30, b"first"), item("c", now - 10, b"third")],
    )
    .expect("enqueue");
    // Between them, a job whose payload vanished; payloads are small, so the mover reads
    // without checking each one and finds out from the push.
    let _: () = redis::cmd("ZADD")
        .arg(&s.lane.keys.due)
        .arg(now - 20)
        .arg("ghost")
        .query(&mut s.redis.conn())
        .unwrap();
    let reply = s.move_at(None, 1 << 20, 4 << 20).expect("move");
    assert_eq!((reply.taken, reply.moved_total()), (3, 2), "{reply:?}");
    assert_eq!(reply.dead, [0, 0, 0, 0, 1, 0]);
    assert_eq!(
        lrange(&mut s.redis.conn(), "q:emails"),
        vec![b"third".to_vec(), b"first".to_vec()]
    );
}

#[test]
fn a_large_payload_that_dies_leaves_the_large_set() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let large = vec![b'L'; 10_000];
    let expired = LaneItem {
        max_lateness_ms: Some(1),
        ..item("big", now - 1000, &large)
    };
    s.enqueue(OnConflict::Error, &[expired]).expect("enqueue");
    let reply = s.move_at(None, 1 << 20, 4 << 20).expect("move");
    assert_eq!(reply.dead[5], 1, "{reply:?}");
    let left: usize = redis::cmd("EXISTS")
        .arg(&s.lane.keys.large)
        .query(&mut s.redis.conn())
        .unwrap();
    assert_eq!(left, 0, "the move reads whole batches again");
}

/// A job for the per-id calls: a payload over 4 KiB (listed in `large`), meta and a max
/// lateness, so a cancel has every entry to remove.
fn full_item<'a>(id: &'a str, due_ms: i64, payload: &'a [u8]) -> LaneItem<'a> {
    LaneItem {
        meta: Some(r#"{"headers":{"k":"v"}}"#),
        max_lateness_ms: Some(60_000),
        ..item(id, due_ms, payload)
    }
}

#[test]
fn cancel_removes_a_waiting_job_with_everything_it_had() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let large = vec![b'L'; 5_000];
    s.enqueue(
        OnConflict::Error,
        &[
            full_item("gone", now + 60_000, &large),
            full_item("stays", now + 60_000, &large),
        ],
    )
    .expect("enqueue");
    let k = s.lane.keys.clone();
    assert!(s.sismember(&k.large, "gone"), "listed as large");
    assert!(
        s.cancel("gone").expect("cancel"),
        "a waiting job is cancelled"
    );
    assert_eq!(s.zscore(&k.due, "gone"), None);
    assert_eq!(s.hget(&k.jobs, "gone"), None, "its payload");
    assert_eq!(s.hget(&k.meta, "gone"), None, "its meta");
    assert_eq!(s.hget(&k.maxlate, "gone"), None, "its lateness bound");
    assert!(!s.sismember(&k.large, "gone"), "its large-set entry");
    // The other job keeps all of its own.
    assert!(s.zscore(&k.due, "stays").is_some());
    assert!(s.hget(&k.meta, "stays").is_some());
    assert_eq!(s.hget(&k.maxlate, "stays").as_deref(), Some("60000"));
    assert!(s.sismember(&k.large, "stays"));
    assert!(
        !s.cancel("gone").expect("cancel"),
        "a second cancel finds nothing"
    );
    assert_eq!(s.get("gone"), None);
}

#[test]
fn cancel_leaves_dead_delivered_and_unknown_jobs_alone() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let dies = LaneItem {
        max_lateness_ms: Some(10),
        ..item("dead", now - 1_000, b"late")
    };
    s.enqueue(
        OnConflict::Error,
        &[dies, item("delivered", now - 1_000, b"sent")],
    )
    .expect("enqueue");
    let reply = s.move_at(Some(now), 1 << 20, 4 << 20).expect("move");
    assert_eq!((reply.moved_total(), reply.dead[5]), (1, 1), "{reply:?}");
    let k = s.lane.keys.clone();
    for id in ["dead", "delivered", "never-enqueued"] {
        assert!(!s.cancel(id).expect("cancel"), "{id}: not waiting");
    }
    assert_eq!(
        s.zscore(&k.dead, "dead"),
        Some(now),
        "still dead, as it died"
    );
    assert_eq!(
        s.hget(&k.jobs, "dead").as_deref(),
        Some("late"),
        "payload kept"
    );
    assert!(s.hget(&k.reasons, "dead").is_some(), "reason kept");
    assert_eq!(
        lrange(&mut s.redis.conn(), "q:emails"),
        vec![b"sent".to_vec()]
    );
}

#[test]
fn reschedule_moves_only_a_waiting_job_and_keeps_its_lateness_bound() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let large = vec![b'L'; 5_000];
    let dies = LaneItem {
        max_lateness_ms: Some(10),
        ..item("dead", now - 1_000, b"late")
    };
    s.enqueue(OnConflict::Error, &[dies]).expect("enqueue");
    s.move_at(Some(now), 1 << 20, 4 << 20).expect("move");
    s.enqueue(OnConflict::Error, &[full_item("w", now + 60_000, &large)])
        .expect("enqueue");
    let k = s.lane.keys.clone();

    let at = now + 120_000;
    assert_eq!(
        s.reschedule("w", Due::At(at)).expect("reschedule"),
        Some(at)
    );
    assert_eq!(s.zscore(&k.due, "w"), Some(at));
    assert_eq!(s.hget(&k.maxlate, "w").as_deref(), Some("60000"), "kept");
    assert!(s.hget(&k.meta, "w").is_some(), "meta kept");
    assert_eq!(s.hget(&k.jobs, "w").map(|p| p.len()), Some(5_000));

    // Relative to Redis's clock, read around the call.
    let before = redis_now_ms(&mut s.redis.conn());
    let due = s
        .reschedule("w", Due::In(Duration::from_secs(30)))
        .expect("reschedule")
        .expect("waiting");
    let after = redis_now_ms(&mut s.redis.conn());
    assert!(
        (before + 30_000..=after + 30_000).contains(&due),
        "{before} + 30 s <= {due} <= {after} + 30 s"
    );
    assert_eq!(s.zscore(&k.due, "w"), Some(due));

    for id in ["dead", "never-enqueued"] {
        assert_eq!(
            s.reschedule(id, Due::At(now + 5_000)).expect("reschedule"),
            None,
            "{id}: not waiting"
        );
    }
    assert_eq!(s.zscore(&k.dead, "dead"), Some(now), "still dead");
    assert_eq!(s.zscore(&k.due, "dead"), None, "not made waiting");
    assert_eq!(s.zscore(&k.due, "never-enqueued"), None, "nothing added");
    assert_eq!(s.zcard(&k.due), 1);
}

#[test]
fn reschedule_wakes_the_mover_only_for_a_new_head() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let (a, b) = (now + 100_000, now + 200_000);
    s.enqueue(
        OnConflict::Error,
        &[item("a", a, b"pa"), item("b", b, b"pb")],
    )
    .expect("enqueue");
    let mut sub_con = s.redis.conn();
    let mut sub = sub_con.as_pubsub();
    sub.subscribe("zdelay:wake").expect("SUBSCRIBE");
    sub.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut next_wake = || -> Option<String> {
        sub.get_message()
            .ok()
            .map(|m| m.get_payload::<String>().expect("text"))
    };
    let wake = |due: i64| format!("l7 {due}");

    // Later than the head: the mover finds it when it wakes for the head anyway.
    s.reschedule("b", Due::At(b + 1)).expect("reschedule");
    // The head itself moved later: the mover wakes too early, harmlessly, and reads the next.
    s.reschedule("a", Due::At(a + 1)).expect("reschedule");
    // As early as the head, not before it.
    s.reschedule("b", Due::At(a + 1)).expect("reschedule");
    // Before the head: the mover must wake sooner than it planned.
    s.reschedule("b", Due::At(now + 50_000))
        .expect("reschedule");
    assert_eq!(
        next_wake(),
        Some(wake(now + 50_000)),
        "the first wake is the new head's"
    );
    // The head moved earlier still.
    s.reschedule("b", Due::At(now + 40_000))
        .expect("reschedule");
    assert_eq!(next_wake(), Some(wake(now + 40_000)));
    // A job that is not waiting wakes no one.
    s.reschedule("ghost", Due::At(now)).expect("reschedule");
    sub.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let mut next_wake = || sub.get_message().ok().map(|m| m.get_payload::<String>());
    assert!(next_wake().is_none(), "no other wake");
}

#[test]
fn get_reads_a_job_in_each_state_with_the_lane_marker() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let meta = r#"{"headers":{"k":"v"}}"#;
    let dies = LaneItem {
        max_lateness_ms: Some(10),
        meta: Some(meta),
        ..item("dead", now - 1_000, b"late")
    };
    s.enqueue(OnConflict::Error, &[dies]).expect("enqueue");
    s.move_at(Some(now), 1 << 20, 4 << 20).expect("move");
    let later = now + 60_000;
    s.enqueue(
        OnConflict::Error,
        &[
            LaneItem {
                meta: Some(meta),
                max_lateness_ms: Some(5_000),
                ..item("scheduled", later, b"p1")
            },
            item("due", now - 5, b"p2"),
        ],
    )
    .expect("enqueue");
    let _: () = redis::cmd("HSET")
        .arg(&s.lane.keys.jobs)
        .arg("orphan")
        .arg("p3")
        .query(&mut s.redis.conn())
        .unwrap();
    let marker = Some(s.lane.marker());

    assert_eq!(
        s.get("scheduled"),
        Some(LaneJob {
            state: JobState::Scheduled,
            score: Some(later as f64),
            payload: b"p1".to_vec(),
            payload_size: 2,
            meta: Some(meta.to_owned()),
            max_lateness_ms: Some(5_000),
            reason: None,
            marker: marker.clone(),
        })
    );
    // With a preview the payload is cut inside Redis; its size is the whole one's.
    let cut =
        s.rt.block_on(lanes::get_preview(&mut s.con, &s.lane, "scheduled", 1))
            .expect("get_preview")
            .expect("stored");
    assert_eq!((cut.payload, cut.payload_size), (b"p".to_vec(), 2));
    let due = s.get("due").expect("stored");
    assert_eq!(
        (
            due.state,
            due.score,
            due.payload,
            due.meta,
            due.max_lateness_ms
        ),
        (
            JobState::Due,
            Some((now - 5) as f64),
            b"p2".to_vec(),
            None,
            None
        )
    );
    let dead = s.get("dead").expect("stored");
    assert_eq!(
        (dead.state, dead.score, dead.payload, dead.meta),
        (
            JobState::Dead,
            Some(now as f64),
            b"late".to_vec(),
            Some(meta.to_owned())
        )
    );
    assert!(
        dead.reason
            .as_deref()
            .is_some_and(|r| r.starts_with("expired: ")),
        "{:?}",
        dead.reason
    );
    assert_eq!(dead.max_lateness_ms, None, "the bound left with the job");
    let orphan = s.get("orphan").expect("stored");
    assert_eq!(
        (orphan.state, orphan.score, orphan.payload),
        (JobState::Orphan, None, b"p3".to_vec())
    );
    assert_eq!(s.get("never-enqueued"), None);

    // Not fenced: the marker comes back for the caller to check, with or without a job.
    s.set_marker("retired 9");
    let moved = s.get("scheduled").expect("still there");
    assert_eq!(moved.marker.as_deref(), Some("retired 9"));
    let found =
        s.rt.block_on(lanes::lookup(&mut s.con, &s.lane, "never-enqueued"))
            .expect("lookup");
    assert_eq!(
        found,
        LaneLookup {
            marker: Some("retired 9".into()),
            job: None
        }
    );

    // A lateness bound zdelay would not write is an error naming it, not a panic.
    let _: () = redis::cmd("HSET")
        .arg(&s.lane.keys.maxlate)
        .arg("scheduled")
        .arg("soon")
        .query(&mut s.redis.conn())
        .unwrap();
    let e =
        s.rt.block_on(lanes::get(&mut s.con, &s.lane, "scheduled"))
            .expect_err("not a number");
    assert!(e.to_string().contains("\"soon\""), "{e}");
}

#[test]
fn cancel_and_reschedule_refuse_another_marker_writing_nothing() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    let large = vec![b'L'; 5_000];
    s.enqueue(OnConflict::Error, &[full_item("w", now + 60_000, &large)])
        .expect("enqueue");
    let k = s.lane.keys.clone();
    let mut sub_con = s.redis.conn();
    let mut sub = sub_con.as_pubsub();
    sub.subscribe("zdelay:wake").expect("SUBSCRIBE");
    sub.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    for marker in [Some("retired 9"), Some("2 7 RPUSH q:other"), None] {
        let code = match marker {
            Some(m) => {
                s.set_marker(m);
                if m.starts_with("retired ") {
                    "ZDELAY_LANE_MOVED"
                } else {
                    "ZDELAY_LANE_CHANGED"
                }
            }
            None => {
                let _: () = redis::cmd("DEL")
                    .arg(&k.marker)
                    .query(&mut s.redis.conn())
                    .unwrap();
                "ZDELAY_NO_LANE"
            }
        };
        let e = s.cancel("w").expect_err("fenced");
        assert_eq!(e.code(), Some(code), "{e}");
        let e = s.reschedule("w", Due::At(now)).expect_err("fenced");
        assert_eq!(e.code(), Some(code), "{e}");
        if code == "ZDELAY_LANE_MOVED" {
            assert_eq!(e.detail(), Some("9"), "names the successor: {e}");
        }
        // Everything as it was.
        assert_eq!(s.zscore(&k.due, "w"), Some(now + 60_000), "{code}");
        assert_eq!(s.hget(&k.jobs, "w").map(|p| p.len()), Some(5_000));
        assert!(s.hget(&k.meta, "w").is_some());
        assert!(s.hget(&k.maxlate, "w").is_some());
        assert!(s.sismember(&k.large, "w"));
    }
    assert!(sub.get_message().is_err(), "no wake from a refused call");
}

/// On a Redis Cluster the per-id calls reach the lane's one slot: each script's keys, and
/// `get`'s one pipeline (its keys all in the lane's slot, TIME routed with them).
#[test]
fn the_per_id_calls_work_on_a_cluster() {
    use zdelay::keys::Keys;
    let cluster = crate::common::RedisCluster::start();
    let rt = runtime();
    let mut con = rt
        .block_on(Conn::connect(&cluster.redis_config(4)))
        .expect("connect");
    let keys = Keys::new("zdelay", 4);
    let (lane, _) = rt
        .block_on(lanes::register(
            &mut con,
            &keys,
            "emails",
            "q:emails",
            Push::Lpush,
        ))
        .expect("register");
    let mut check = cluster.conn();
    let (secs, _): (i64, i64) = redis::cmd("TIME").query(&mut check).expect("TIME");
    let later = secs * 1000 + 3_600_000;
    rt.block_on(scripts::enqueue_lane(
        &mut con,
        &lane,
        OnConflict::Error,
        "zdelay:wake",
        &[full_item("w", later, b"p"), item("x", later, b"q")],
    ))
    .expect("enqueue");
    let got = rt
        .block_on(lanes::get(&mut con, &lane, "w"))
        .expect("get")
        .expect("stored");
    assert_eq!(
        (got.state, got.score, got.marker),
        (JobState::Scheduled, Some(later as f64), Some(lane.marker()))
    );
    let due = rt
        .block_on(scripts::reschedule_lane(
            &mut con,
            &lane,
            "zdelay:wake",
            "w",
            Due::At(later + 1),
        ))
        .expect("reschedule");
    assert_eq!(due, Some(later + 1));
    assert!(
        rt.block_on(scripts::cancel_lane(&mut con, &lane, "x"))
            .expect("cancel")
    );
    let left: Vec<String> = redis::cmd("ZRANGE")
        .arg(&lane.keys.due)
        .arg(0)
        .arg(-1)
        .query(&mut check)
        .expect("ZRANGE");
    assert_eq!(left, vec!["w".to_owned()]);
}

#[test]
fn the_fast_path_counts_lateness_buckets_and_reads_the_next_head() {
    let mut s = setup();
    let now = redis_now_ms(&mut s.redis.conn());
    // Ten jobs at each lateness (ms at `now`), the latest first; every one with meta, so a
    // batch of 40 deletes more ids than one delete call takes (32).
    let lateness = [1000, 100, 50, 10, 5, 1, 0];
    let ids: Vec<String> = (0..70).map(|i| format!("j{i:02}")).collect();
    let payloads: Vec<Vec<u8>> = (0..70).map(|i| format!("p{i:02}").into_bytes()).collect();
    let mut items: Vec<LaneItem> = ids
        .iter()
        .zip(&payloads)
        .enumerate()
        .map(|(i, (id, payload))| LaneItem {
            meta: Some(r#"{"headers":{"k":"v"}}"#),
            ..item(id, now - lateness[i / 10], payload)
        })
        .collect();
    let later = now + 60_000;
    items.push(item("later", later, b"later"));
    s.enqueue(OnConflict::Error, &items).expect("enqueue");

    // Bounds 1, 10, 100: buckets (.., 1], (1, 10], (10, 100], over 100.
    let reply = s.move_batch(now, 40);
    assert_eq!((reply.taken, reply.moved_total()), (40, 40), "{reply:?}");
    assert_eq!(reply.buckets, vec![0, 10, 20, 10]);
    assert_eq!(reply.max_lateness_ms, 1000);
    assert_eq!(
        reply.next_due,
        Some((now - 5) as f64),
        "a full batch: the head is the next job due"
    );
    let reply = s.move_batch(now, 1000);
    assert_eq!((reply.taken, reply.moved_total()), (30, 30), "{reply:?}");
    assert_eq!(reply.buckets, vec![20, 10, 0, 0]);
    assert_eq!(reply.max_lateness_ms, 5);
    assert_eq!(reply.next_due, Some(later as f64));

    let listed = lrange(&mut s.redis.conn(), "q:emails");
    let expected: Vec<Vec<u8>> = payloads.iter().rev().cloned().collect();
    assert_eq!(listed, expected, "every job once, in due order");
    let (jobs_key, meta_key) = (s.lane.keys.jobs.clone(), s.lane.keys.meta.clone());
    assert_eq!(s.hlen(&jobs_key), 1, "only the later job's payload is left");
    assert_eq!(s.hlen(&meta_key), 0, "no moved job's meta is left");

    // A single job: its lateness is the batch's least and greatest, and the lane is empty.
    let reply = s.move_batch(later + 7, 1000);
    assert_eq!(reply.moved_total(), 1);
    assert_eq!(reply.buckets, vec![0, 1, 0, 0]);
    assert_eq!(reply.max_lateness_ms, 7);
    assert_eq!(reply.next_due, None);
}

/// Generated backlogs with payloads gone missing at random places (so a chunk's push fails
/// mid-batch, after chunks that moved), meta on some jobs and lateness across the bounds,
/// moved in batches of random size, against a model: every job with a payload pushed once in
/// due order, each missing one dead alone, the lateness buckets and max lateness of exactly
/// the moved jobs, and nothing left behind in due, jobs or meta.
#[test]
fn a_failed_push_mid_batch_moves_the_chunks_before_it_once_and_the_rest_as_the_model_says() {
    let mut s = setup();
    for seed in 0..16u64 {
        let mut rng = crate::common::SeededRng::new(seed);
        let _: () = redis::cmd("FLUSHALL")
            .query(&mut s.redis.conn())
            .expect("FLUSHALL");
        s.set_marker(&s.lane.marker());
        let now = 1_700_000_000_000i64;
        let n = rng.range(1, 200) as usize;
        // Job i is due 300 - 1.5 i ms before now (rounded): lateness from 300 down to 2,
        // across every bound.
        let ids: Vec<String> = (0..n).map(|i| format!("j{i:03}")).collect();
        let payloads: Vec<Vec<u8>> = (0..n)
            .map(|i| format!("payload {i}").into_bytes())
            .collect();
        let due = |i: usize| now - 300 + 3 * i as i64 / 2;
        let items: Vec<LaneItem> = (0..n)
            .map(|i| LaneItem {
                meta: (i % 3 == 0).then_some(r#"{"headers":{"k":"v"}}"#),
                ..item(&ids[i], due(i), &payloads[i])
            })
            .collect();
        s.enqueue(OnConflict::Error, &items).expect("enqueue");
        let missing: Vec<usize> = (0..rng.range(0, 3))
            .map(|_| rng.range(0, n as i64) as usize)
            .collect();
        for &m in &missing {
            let _: () = redis::cmd("HDEL")
                .arg(&s.lane.keys.jobs)
                .arg(&ids[m])
                .query(&mut s.redis.conn())
                .unwrap();
        }
        let batch = rng.range(1, 250) as usize;
        let (mut pushed, mut dead) = (Vec::new(), Vec::new());
        let mut buckets = [0u64; 4];
        let mut start = 0;
        while start < n {
            let reply = s.move_batch(now, batch);
            let taken = (n - start).min(batch);
            let (moved, died): (Vec<usize>, Vec<usize>) =
                (start..start + taken).partition(|i| !missing.contains(i));
            let mut want = [0u64; 4];
            for &i in &moved {
                let late = (now - due(i)) as u64;
                want[BOUNDS
                    .iter()
                    .position(|&b| late <= b)
                    .unwrap_or(BOUNDS.len())] += 1;
            }
            let context = format!(
                "seed {seed}: n {n}, batch {batch}, missing {missing:?}, from {start}: {reply:?}"
            );
            assert_eq!(reply.taken, taken, "{context}");
            assert_eq!(reply.moved_total(), moved.len() as u64, "{context}");
            assert_eq!(reply.dead, [0, 0, 0, 0, died.len() as u64, 0], "{context}");
            assert_eq!(reply.buckets, want.to_vec(), "{context}");
            let late_max = moved.first().map_or(0, |&i| now - due(i));
            assert_eq!(reply.max_lateness_ms, late_max, "{context}");
            for (k, w) in want.iter().enumerate() {
                buckets[k] += w;
            }
            pushed.extend(moved);
            dead.extend(died);
            start += taken;
        }
        let expect: Vec<Vec<u8>> = pushed.iter().rev().map(|&i| payloads[i].clone()).collect();
        assert_eq!(
            lrange(&mut s.redis.conn(), "q:emails"),
            expect,
            "seed {seed}"
        );
        let mut gone: Vec<usize> = missing.clone();
        gone.sort_unstable();
        gone.dedup();
        assert_eq!(dead, gone, "seed {seed}");
        assert_eq!(s.zcard(&s.lane.keys.due.clone()), 0, "seed {seed}");
        assert_eq!(
            s.zcard(&s.lane.keys.dead.clone()),
            gone.len(),
            "seed {seed}"
        );
        assert_eq!(s.hlen(&s.lane.keys.jobs.clone()), 0, "seed {seed}");
        // Meta stays only with the dead, for a replay.
        let meta_left = gone.iter().filter(|&&i| i % 3 == 0).count();
        assert_eq!(s.hlen(&s.lane.keys.meta.clone()), meta_left, "seed {seed}");
    }
}
