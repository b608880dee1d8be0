//! Route lanes (storage layout 2, being built): `enqueue_lane` and `move_lane` against a
//! real Redis. What must hold as on layout 1: pushed and removed in one call, in due order,
//! never before due, policies per id, the general path's dead letters (missing, oversize,
//! expired, wrong type) and a failed push leaving everything due; and what is new: the
//! marker fence, meta kept beside the payload, the byte budget kept without reading a
//! payload only to leave it.

use crate::common::{RedisServer, lrange, redis_now_ms, runtime};
use zdelay::config::Push;
use zdelay::job::{Due, Enqueued, OnConflict};
use zdelay::lane::Lane;
use zdelay::store::Conn;
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
        };
        self.rt
            .block_on(scripts::move_lane(&mut self.con, &self.lane, &args))
    }

    /// One call with the default limits and `batch` jobs at most.
    fn move_batch(&mut self, now_ms: i64, batch: usize) -> MoveReply {
        let args = MoveLane {
            batch,
            now_ms: Some(now_ms),
            max_payload: 1 << 20,
            batch_bytes: 4 << 20,
            bounds_ms: BOUNDS,
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

    // A move while the lane holds jobs is refused, changing nothing.
    let now = redis_now_ms(&mut con);
    s.rt.block_on(scripts::enqueue_lane(
        &mut s.con,
        &moved,
        OnConflict::Error,
        "zdelay:wake",
        &[item("waiting", now + 60_000, b"p")],
    ))
    .expect("enqueue");
    let e =
        s.rt.block_on(register(
            &mut s.con,
            &keys,
            "emails",
            "{q}emails",
            Push::Lpush,
        ))
        .expect_err("refused");
    assert!(e.to_string().contains("still holds 1 waiting jobs"), "{e}");
    let registry =
        s.rt.block_on(read_registry(&mut s.con, &keys))
            .expect("read");
    assert_eq!(registry.by_route.get("emails"), Some(&moved));
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
