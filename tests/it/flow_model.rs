//! The route's rate and the per-key turns of `move_lane`, and a two-phase route's rate
//! (`take_flow`, shared by every spread shard), against a reference model, on
//! generated inputs: random rates (1/h to 100,000/s), bursts (1 to 10 × the rate), batch
//! sizes, arrival patterns and clock steps (forward, none, long jumps, a step back). The real
//! script runs on a real Redis, its clock driven through its "now" argument; the model is
//! written from the documented semantics (docs/concepts/flow-control.md): a token bucket
//! holding max(burst, 1 + 10 ms of the rate), refilled on the script's clock, never back;
//! per key, a bucket whose token is taken when a turn is given.
//!
//! What must hold: the jobs admitted in every window of calls within one of the model's;
//! never more than the bucket + rate × T in any window T; no stall (a call with due work and
//! a whole token moves); a held route names a wake-up when its bucket has a token again and
//! before it overflows; driven as the mover drives it, late by a few ms, it reaches its rate.

use crate::common::{RedisServer, SeededRng, runtime};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use zdelay::config::{Push, RouteFlow};
use zdelay::job::{Due, OnConflict};
use zdelay::lane::Lane;
use zdelay::store::Conn;
use zdelay::store::scripts::{self, Held, LaneItem, MoveLane, MoveReply};

/// The bucket's minimum beyond one job, and the room a held wake-up leaves (move_lane.lua).
const MIN_BUCKET_MS: f64 = 10.0;
const WAKE_SLACK_MS: f64 = 5.0;

/// One lane on a private Redis, driven with explicit clocks.
pub(crate) struct Rig {
    /// Kept running while the rig lives.
    _redis: RedisServer,
    rt: tokio::runtime::Runtime,
    con: Conn,
    pub lane: Lane,
    raw: redis::Connection,
}

impl Rig {
    pub fn start() -> Rig {
        let redis = RedisServer::start();
        let rt = runtime();
        let con = rt
            .block_on(Conn::connect(&crate::common::redis_config(&redis.url(), 1)))
            .expect("connect");
        let lane = Lane::new("zdelay", "fm", 3, "r", "q:r", Push::Lpush);
        let mut raw = redis.conn();
        let _: () = redis::cmd("SET")
            .arg(&lane.keys.marker)
            .arg(lane.marker())
            .query(&mut raw)
            .expect("SET marker");
        Rig {
            _redis: redis,
            rt,
            con,
            lane,
            raw,
        }
    }

    /// Enqueues jobs (id, due ms, meta); each job's payload is its id.
    pub fn enqueue(&mut self, jobs: &[(String, i64, Option<String>)]) {
        for chunk in jobs.chunks(500) {
            let items: Vec<LaneItem> = chunk
                .iter()
                .map(|(id, due, meta)| LaneItem {
                    id,
                    due: Due::At(*due),
                    payload: id.as_bytes(),
                    meta: meta.as_deref(),
                    max_lateness_ms: None,
                    unique_for_ms: None,
                })
                .collect();
            let done = self
                .rt
                .block_on(scripts::enqueue_lane(
                    &mut self.con,
                    &self.lane,
                    OnConflict::Replace,
                    "zdelay:wake",
                    &items,
                ))
                .expect("enqueue_lane");
            assert!(done.iter().all(Option::is_some));
        }
    }

    /// One `move_lane` call at `now` (ms; `None`: Redis TIME).
    pub fn call(
        &mut self,
        now: Option<i64>,
        batch: usize,
        flow: Option<&RouteFlow>,
    ) -> redis::RedisResult<MoveReply> {
        let args = MoveLane {
            batch,
            now_ms: now,
            max_payload: 1 << 20,
            batch_bytes: 4 << 20,
            bounds_ms: &[1, 10, 100, 1000],
            flow,
            trim: None,
        };
        self.rt
            .block_on(scripts::move_lane(&mut self.con, &self.lane, &args))
    }

    /// Takes every job off the list: the ids moved since the last take.
    pub fn take_moved(&mut self) -> Vec<String> {
        let (ids, ()): (Vec<String>, ()) = redis::pipe()
            .atomic()
            .lrange(&self.lane.list, 0, -1)
            .del(&self.lane.list)
            .query(&mut self.raw)
            .expect("take the list");
        ids
    }

    /// The lane's due set: id -> score.
    pub fn due(&mut self) -> HashMap<String, f64> {
        let page: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(&self.lane.keys.due)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(&mut self.raw)
            .expect("ZRANGE due");
        page.into_iter().collect()
    }

    pub fn flow_field(&mut self, field: &str) -> Option<String> {
        redis::cmd("HGET")
            .arg(&self.lane.keys.flow)
            .arg(field)
            .query(&mut self.raw)
            .expect("HGET flow")
    }

    pub fn raw(&mut self) -> &mut redis::Connection {
        &mut self.raw
    }
}

pub(crate) fn rate_flow(rate: f64, burst: u32) -> RouteFlow {
    RouteFlow {
        rate_per_s: Some(rate),
        burst,
        max_length: None,
        per_key: None,
    }
}

/// The route's bucket, as the docs define it.
struct Bucket {
    rate: f64,
    capacity: f64,
    /// (tokens, refilled at ms) once a call has seen it.
    state: Option<(f64, i64)>,
}

impl Bucket {
    fn new(rate: f64, burst: u32) -> Bucket {
        Bucket {
            rate,
            capacity: f64::from(burst).max(1.0 + rate * MIN_BUCKET_MS / 1000.0),
            state: None,
        }
    }

    /// Tokens at `now`, refilled (never for a clock that stepped back), capped.
    fn refill(&mut self, now: i64) -> f64 {
        let (mut tokens, mut at) = self.state.unwrap_or((self.capacity, now));
        if now > at {
            tokens += (now - at) as f64 * self.rate / 1000.0;
            at = now;
        }
        tokens = tokens.min(self.capacity);
        self.state = Some((tokens, at));
        tokens
    }

    fn whole(tokens: f64) -> usize {
        (tokens + 1e-9).floor().max(0.0) as usize
    }

    fn take(&mut self, n: usize) {
        if let Some((tokens, _)) = &mut self.state {
            *tokens -= n as f64;
        }
    }

    /// Tokens a claim did not use, back (never over the bucket).
    fn give_back(&mut self, n: usize) {
        if let Some((tokens, _)) = &mut self.state {
            *tokens = (*tokens + n as f64).min(self.capacity);
        }
    }

    /// Tokens the bucket would have at `then` with no cap (what a sleeper would find).
    fn uncapped_at(&self, then: i64) -> f64 {
        let (tokens, at) = self.state.expect("seen");
        tokens + (then - at).max(0) as f64 * self.rate / 1000.0
    }
}

/// Log-uniform in [lo, hi].
fn log_uniform(rng: &mut SeededRng, lo: f64, hi: f64) -> f64 {
    let u = rng.next_u64() as f64 / u64::MAX as f64;
    (lo.ln() + u * (hi.ln() - lo.ln())).exp()
}

/// Due times of `n` jobs from `base`, spread over `span` ms in one of a few patterns.
fn arrivals(rng: &mut SeededRng, n: usize, base: i64, span: i64) -> Vec<i64> {
    let span = span.max(1);
    match rng.range(0, 4) {
        // All due at one moment.
        0 => vec![base; n],
        // Evenly over the span.
        1 => (0..n).map(|i| base + span * i as i64 / n as i64).collect(),
        // Random over the span.
        2 => (0..n).map(|_| base + rng.range(0, span)).collect(),
        // A few clusters.
        _ => {
            let centres: Vec<i64> = (0..3).map(|_| base + rng.range(0, span)).collect();
            (0..n)
                .map(|i| centres[i % 3] + rng.range(0, 1 + span / 100))
                .collect()
        }
    }
}

/// The next clock value: forward by a little, by nothing, by about a token or many, rarely
/// back.
fn step(rng: &mut SeededRng, now: i64, token_ms: f64) -> i64 {
    let token_ms = token_ms.clamp(0.01, 3_600_000.0);
    match rng.range(0, 10) {
        0 => now,
        1 => now + rng.range(1, 3),
        2 => now - rng.range(1, 20),
        3 => now + (token_ms * log_uniform(rng, 10.0, 200.0)) as i64 + 1,
        _ => now + (token_ms * log_uniform(rng, 0.05, 5.0)).round() as i64,
    }
}

/// Checks a case's admissions against the bound: in every window of calls (by the clock the
/// bucket keeps, which never steps back), at most capacity + rate × T.
fn assert_within_bucket(what: &str, times: &[i64], counts: &[usize], capacity: f64, rate: f64) {
    for i in 0..times.len() {
        let mut sum = 0usize;
        for j in i..times.len() {
            sum += counts[j];
            let allowed = capacity + rate * (times[j] - times[i]) as f64 / 1000.0 + 1e-6;
            assert!(
                sum as f64 <= allowed,
                "{what}: {sum} admitted in calls {i}..={j} ({} ms), more than the bucket \
                 ({capacity:.3}) + rate × T ({allowed:.3})",
                times[j] - times[i]
            );
        }
    }
}

#[test]
fn a_route_s_rate_matches_its_reference_bucket_on_generated_inputs() {
    let mut rig = Rig::start();
    let mut rng = SeededRng::new(0x5eed_2902);
    for case in 0..40 {
        let rate = log_uniform(&mut rng, 1.0 / 3600.0, 100_000.0);
        let burst = log_uniform(&mut rng, 1.0, (10.0 * rate).max(1.0))
            .round()
            .max(1.0) as u32;
        let batch = [1, 7, 100, 1000][rng.range(0, 4) as usize];
        let flow = rate_flow(rate, burst);
        let token_ms = 1000.0 / rate;
        let base = 1_700_000_000_000 + case * 100_000_000_000;
        let n = rng.range(1, 1500) as usize;
        let span = (token_ms * n as f64 * log_uniform(&mut rng, 0.1, 3.0)) as i64;
        let dues = arrivals(&mut rng, n, base, span.min(100_000_000_000));
        let jobs: Vec<(String, i64, Option<String>)> = dues
            .iter()
            .enumerate()
            .map(|(i, d)| (format!("c{case}-{i:05}"), *d, None))
            .collect();
        // The model's due set, in the script's order (score, then id).
        let mut due: BTreeSet<(i64, String)> =
            jobs.iter().map(|(id, d, _)| (*d, id.clone())).collect();
        let _: () = redis::cmd("DEL")
            .arg(&rig.lane.keys.flow)
            .query(rig.raw())
            .unwrap();
        rig.enqueue(&jobs);
        let what = format!(
            "case {case}: rate {rate:.6}/s, burst {burst}, batch {batch}, {n} jobs over {span} ms"
        );
        let mut model = Bucket::new(rate, burst);
        let (mut now, mut clock) = (base - 1, base - 1);
        let (mut times, mut script, mut expected) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..250 {
            now = step(&mut rng, now, token_ms);
            clock = clock.max(now);
            let reply = rig.call(Some(now), batch, Some(&flow)).expect(&what);
            let moved = rig.take_moved();
            let tokens = model.refill(now);
            let due_now = due.range(..(now + 1, String::new())).count();
            let want = batch.min(Bucket::whole(tokens)).min(due_now);
            let firsts: Vec<(i64, String)> = due.iter().take(moved.len()).cloned().collect();
            // The jobs moved are the earliest due, and none early.
            let got: BTreeSet<&String> = moved.iter().collect();
            assert!(
                firsts.iter().all(|(d, id)| *d <= now && got.contains(id)),
                "{what}: at {now} moved {moved:?}, the earliest due are {firsts:?}"
            );
            for f in &firsts {
                due.remove(f);
            }
            model.take(moved.len());
            assert_eq!(reply.moved_total() as usize, moved.len(), "{what}");
            // No stall: due work and a whole token move something.
            if want > 0 {
                assert!(
                    !moved.is_empty(),
                    "{what}: at {now} nothing moved, {want} were due"
                );
            }
            // A held route wakes when its bucket has a token again, before it overflows.
            if reply.held == Held::Rate
                && let Some(next) = reply.next_due.filter(|n| *n as i64 > now)
            {
                let at_wake = model.uncapped_at(next as i64);
                // A token is in by then, and a wake-up up to 4 ms late still loses none.
                let late = rate * (WAKE_SLACK_MS - 1.0) / 1000.0;
                assert!(
                    at_wake >= 1.0 - 1e-9 && at_wake + late <= model.capacity + 1e-9,
                    "{what}: held at {now}, wakes at {next} with {at_wake:.9} tokens \
                     (bucket {:.9})",
                    model.capacity
                );
            }
            times.push(clock);
            script.push(moved.len());
            expected.push(want);
        }
        // Within one token of the model in every window of calls.
        for i in 0..times.len() {
            let (mut s, mut m) = (0i64, 0i64);
            for j in i..times.len() {
                s += script[j] as i64;
                m += expected[j] as i64;
                assert!(
                    (s - m).abs() <= 1,
                    "{what}: calls {i}..={j} admitted {s}, the model {m}"
                );
            }
        }
        assert_within_bucket(&what, &times, &script, model.capacity, rate);
        // Clean for the next case (its ids are its own; its bucket is reset above).
        let _: () = redis::cmd("DEL")
            .arg(&rig.lane.keys.due)
            .arg(&rig.lane.keys.jobs)
            .query(rig.raw())
            .unwrap();
    }
}

#[test]
fn a_held_route_driven_as_the_mover_drives_it_reaches_its_rate() {
    let mut rig = Rig::start();
    let mut rng = SeededRng::new(0x5eed_2903);
    for case in 0..30 {
        let rate = log_uniform(&mut rng, 1.0 / 3600.0, 100_000.0);
        let burst = log_uniform(&mut rng, 1.0, (10.0 * rate).max(1.0))
            .round()
            .max(1.0) as u32;
        let batch = [100, 1000][rng.range(0, 2) as usize];
        let flow = rate_flow(rate, burst);
        let capacity = Bucket::new(rate, burst).capacity;
        // Long enough for a few hundred jobs past the first burst, with a backlog to spare.
        let span_ms = ((300.0 + capacity) * 1000.0 / rate).max(50.0) as i64;
        let backlog = (capacity + rate * span_ms as f64 / 1000.0) as usize + 200;
        if backlog > 40_000 {
            continue;
        }
        let base = 1_700_000_000_000 + case * 100_000_000_000;
        let jobs: Vec<(String, i64, Option<String>)> = (0..backlog)
            .map(|i| (format!("m{case}-{i:06}"), base, None))
            .collect();
        let _: () = redis::cmd("DEL")
            .arg(&rig.lane.keys.flow)
            .query(rig.raw())
            .unwrap();
        rig.enqueue(&jobs);
        let what = format!("case {case}: rate {rate:.6}/s, burst {burst}, batch {batch}");
        // As the mover: again at once after a full batch, else at the time the call named,
        // late by up to 4 ms (a timer's wake-up); never earlier than a ms after the last.
        let (mut now, mut moved, mut calls) = (base, 0usize, 0usize);
        while now < base + span_ms {
            let reply = rig.call(Some(now), batch, Some(&flow)).expect(&what);
            moved += rig.take_moved().len();
            calls += 1;
            assert!(calls < 1_000_000, "{what}: the mover spins");
            if reply.taken >= batch {
                continue;
            }
            let next = reply.next_due.expect("a backlog is left") as i64;
            assert!(next > now, "{what}: held at {now} with nothing to wait for");
            now = next + rng.range(0, 5);
        }
        let reached = rate * (now - base) as f64 / 1000.0;
        assert!(
            moved as f64 + 1.0 >= reached,
            "{what}: {moved} moved in {} ms, the rate allows {reached:.1} after its burst",
            now - base
        );
        assert!(
            moved as f64 <= capacity + reached + 1e-6,
            "{what}: {moved} moved in {} ms, over the bucket {capacity:.2} + {reached:.1}",
            now - base
        );
        let _: () = redis::cmd("DEL")
            .arg(&rig.lane.keys.due)
            .arg(&rig.lane.keys.jobs)
            .query(rig.raw())
            .unwrap();
    }
}

/// A key's bucket as the docs define it: refilled on the script's clock (never back), a
/// token taken when a job moves at once or is given a turn; "free" is when it next has a
/// whole token, kept beside it in the state.
struct KeyBucket {
    tokens: f64,
    at: i64,
    free: f64,
}

/// Every key's bucket of one route's per-key rate, as one script call uses them: each key
/// seen in the call is refilled to its `now` at its first job ([`KeyModel::take`]), and its
/// "free" written at the end ([`KeyModel::end_call`]).
struct KeyModel {
    rate: f64,
    burst: u32,
    step_ms: f64,
    buckets: HashMap<String, KeyBucket>,
    seen: Vec<String>,
}

impl KeyModel {
    fn new(rate: f64, burst: u32) -> Self {
        KeyModel {
            rate,
            burst,
            step_ms: 1000.0 / rate,
            buckets: HashMap::new(),
            seen: Vec::new(),
        }
    }

    /// One job of `key` in a call at `now`: `None` when it goes at once (at the key's own
    /// clock, `.1`), else its turn (ms), whose token it takes now.
    fn take(&mut self, key: &str, now: i64) -> (Option<i64>, i64) {
        let (rate, burst, step_ms) = (self.rate, f64::from(self.burst), self.step_ms);
        if !self.seen.iter().any(|k| k == key) {
            self.seen.push(key.to_owned());
            let b = self.buckets.entry(key.to_owned()).or_insert(KeyBucket {
                tokens: burst,
                at: now,
                free: now as f64,
            });
            if now > b.at {
                b.tokens = (b.tokens + (now - b.at) as f64 * rate / 1000.0).min(burst);
                b.at = now;
            }
            if b.free > b.at as f64 {
                b.tokens = b.tokens.min(1.0 - (b.free - b.at as f64) / step_ms);
            }
        }
        let b = self.buckets.get_mut(key).expect("refilled above");
        if b.tokens >= 1.0 - 1e-9 {
            b.tokens -= 1.0;
            return (None, b.at);
        }
        let turn = b.at + ((1.0 - b.tokens) * step_ms - 1e-9).ceil() as i64;
        let over = b.tokens + (turn - b.at) as f64 * rate / 1000.0 - burst;
        b.tokens -= 1.0;
        if over > 0.0 {
            b.tokens -= over;
        }
        (Some(turn), turn)
    }

    /// The call ends: each key it saw records when it next has a whole token.
    fn end_call(&mut self) {
        for key in std::mem::take(&mut self.seen) {
            let b = self.buckets.get_mut(&key).expect("seen");
            b.free = b.at as f64 + (1.0 - b.tokens).max(0.0) * self.step_ms;
        }
    }
}

#[test]
fn per_key_turns_match_their_reference_model_on_generated_inputs() {
    let mut rig = Rig::start();
    let mut rng = SeededRng::new(0x5eed_2904);
    for case in 0..25 {
        let key_rate = log_uniform(&mut rng, 1.0 / 3600.0, 100_000.0);
        let key_burst = log_uniform(&mut rng, 1.0, (10.0 * key_rate).max(1.0))
            .round()
            .max(1.0) as u32;
        let batch = [3, 50, 1000][rng.range(0, 3) as usize];
        let flow = RouteFlow {
            rate_per_s: None,
            burst: 1,
            max_length: None,
            per_key: Some(("tenant".to_owned(), key_rate, key_burst)),
        };
        let step_ms = 1000.0 / key_rate;
        let keys = rng.range(1, 5) as usize;
        let base = 1_700_000_000_000 + case * 100_000_000_000;
        let n = rng.range(1, 600) as usize;
        let span = (step_ms * n as f64 * log_uniform(&mut rng, 0.05, 2.0)) as i64;
        let dues = arrivals(&mut rng, n, base, span.min(100_000_000_000));
        // Key "" for jobs without the header (no meta), like any other key.
        let key_of = |i: usize| -> String {
            match i % (keys + 1) {
                0 => String::new(),
                k => format!("t{k}"),
            }
        };
        let jobs: Vec<(String, i64, Option<String>)> = dues
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let key = key_of(i);
                let meta =
                    (!key.is_empty()).then(|| format!(r#"{{"headers":{{"tenant":"{key}"}}}}"#));
                (format!("k{case}-{i:05}"), *d, meta)
            })
            .collect();
        let key_by_id: HashMap<String, String> = jobs
            .iter()
            .enumerate()
            .map(|(i, (id, _, _))| (id.clone(), key_of(i)))
            .collect();
        // The model's due set by (score in half ms, id): an odd score is a granted turn.
        let mut due: BTreeSet<(i64, String)> =
            jobs.iter().map(|(id, d, _)| (d * 2, id.clone())).collect();
        let _: () = redis::cmd("DEL")
            .arg(&rig.lane.keys.flow)
            .query(rig.raw())
            .unwrap();
        rig.enqueue(&jobs);
        let what = format!(
            "case {case}: {keys} keys at {key_rate:.6}/s, burst {key_burst}, batch {batch}, \
             {n} jobs over {span} ms"
        );
        let mut model = KeyModel::new(key_rate, key_burst);
        // Per key, when each job was admitted: at the call that moved it at once, or at its turn.
        let mut admitted: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let mut turns: HashMap<String, i64> = HashMap::new();
        let (mut now, mut clock) = (base - 1, base - 1);
        let mut calls = 0;
        while !due.is_empty() {
            calls += 1;
            assert!(calls < 5_000, "{what}: {} jobs never moved", due.len());
            now = if calls > 300 {
                // Then on to the end: always forward, to the next turn or due time.
                let head = due.iter().next().map(|(s, _)| s / 2 + 1).unwrap();
                now.max(head) + rng.range(0, 3)
            } else {
                step(&mut rng, now, step_ms)
            };
            clock = clock.max(now);
            let reply = rig.call(Some(now), batch, Some(&flow)).expect(&what);
            let moved: BTreeSet<String> = rig.take_moved().into_iter().collect();
            // The model's call.
            let taken: Vec<(i64, String)> = due
                .range(..(now * 2 + 1, String::new()))
                .take(batch)
                .cloned()
                .collect();
            let mut expect_moved = BTreeSet::new();
            for (score, id) in &taken {
                due.remove(&(*score, id.clone()));
                if score % 2 == 1 {
                    expect_moved.insert(id.clone());
                    continue;
                }
                let key = &key_by_id[id];
                let (turn, at) = model.take(key, now);
                admitted.entry(key.clone()).or_default().push(at);
                match turn {
                    None => {
                        expect_moved.insert(id.clone());
                    }
                    Some(turn) => {
                        due.insert((turn * 2 + 1, id.clone()));
                        turns.insert(id.clone(), turn);
                    }
                }
            }
            model.end_call();
            assert_eq!(
                moved,
                expect_moved,
                "{what}: at {now} the script moved {} jobs, the model {}",
                moved.len(),
                expect_moved.len()
            );
            assert_eq!(reply.moved_total() as usize, moved.len(), "{what}");
            // A granted job moves at its turn, never before.
            for id in &moved {
                if let Some(turn) = turns.get(id) {
                    assert!(
                        *turn < now,
                        "{what}: {id} moved at {now}, its turn is {turn}"
                    );
                }
            }
        }
        // Each key's admissions stay within its bucket in every window (burst + rate × T):
        // a turn's token was taken when it was given.
        for (key, times) in &mut admitted {
            times.sort_unstable();
            let ones = vec![1; times.len()];
            assert_within_bucket(
                &format!("{what}, key {key:?}"),
                times,
                &ones,
                f64::from(key_burst),
                key_rate,
            );
        }
    }
}

/// A two-phase route's rate: its jobs wait in its part of several spread shards, whose
/// publishers take tokens from the route's one bucket (`take_flow`) and give back what their
/// claim did not use. Driven with generated rates, bursts, clocks and parts of random sizes,
/// the grants equal the reference bucket's (the local route's, `Bucket`) at every call; the
/// jobs claimed across all shards stay within the bucket + rate × T in every window; a take
/// with tokens and jobs waiting is never refused; a cut take names a wake-up when a token is
/// in and before the bucket overflows; and a shard is held from a cut take until it catches up.
#[test]
fn a_two_phase_route_s_rate_over_its_spread_shards_matches_the_reference_bucket() {
    use zdelay::store::scripts::{Found, TakeFlow, take_flow};
    let redis = RedisServer::start();
    let rt = runtime();
    let mut con = rt
        .block_on(Conn::connect(&crate::common::redis_config(&redis.url(), 1)))
        .expect("connect");
    let mut raw = redis.conn();
    let mut rng = SeededRng::new(0x5eed_2905);
    for case in 0..40 {
        let rate = log_uniform(&mut rng, 1.0 / 3600.0, 100_000.0);
        let burst = log_uniform(&mut rng, 1.0, (10.0 * rate).max(1.0))
            .round()
            .max(1.0) as u32;
        let batch = [1, 7, 100, 1000][rng.range(0, 4) as usize];
        let shards = rng.range(1, 9) as u16;
        let key = format!("{{zdelay}}:flow:case{case}");
        let what =
            format!("case {case}: rate {rate:.6}/s, burst {burst}, batch {batch}, {shards} shards");
        let token_ms = 1000.0 / rate;
        let mut model = Bucket::new(rate, burst);
        // Jobs waiting in each shard's part.
        let mut waiting = vec![0usize; usize::from(shards)];
        let mut held = vec![false; usize::from(shards)];
        let mut now = 1_700_000_000_000 + case * 100_000_000_000;
        // The bucket's own clock, from its first call on: it never steps back.
        let mut clock = i64::MIN;
        let (mut times, mut claimed) = (Vec::new(), Vec::new());
        let call = |con: &mut Conn, take: TakeFlow| {
            rt.block_on(take_flow(con, &key, &take)).expect("take_flow")
        };
        for _ in 0..300 {
            now = step(&mut rng, now, token_ms);
            clock = clock.max(now);
            // Jobs arrive in a few parts; one shard's publisher takes and claims.
            for _ in 0..rng.range(0, 3) {
                let s = rng.range(0, i64::from(shards)) as usize;
                waiting[s] += rng.range(0, 2 * batch as i64 + 1) as usize;
            }
            let shard = rng.range(0, i64::from(shards)) as u16;
            let s = usize::from(shard);
            let take = TakeFlow {
                shard,
                want: batch,
                give_back: 0,
                found: Found::Nothing,
                now_ms: Some(now),
                rate: Some((rate, burst)),
                lock: None,
                release: false,
            };
            let got = call(&mut con, take);
            let tokens = model.refill(now);
            let want = batch.min(Bucket::whole(tokens));
            assert_eq!(
                got.granted, want,
                "{what}: at {now} granted {}, the model {want}",
                got.granted
            );
            model.take(got.granted);
            let used = got.granted.min(waiting[s]);
            waiting[s] -= used;
            if got.granted < batch {
                held[s] = true;
                // A cut take names when a token is in, before a late wake-up could overflow.
                let next = got.wake_ms.expect("a cut take names its wake-up");
                let at_wake = model.uncapped_at(next);
                let late = rate * (WAKE_SLACK_MS - 1.0) / 1000.0;
                assert!(
                    at_wake >= 1.0 - 1e-9 && at_wake + late <= model.capacity + 1e-9,
                    "{what}: cut at {now}, wakes at {next} with {at_wake:.9} tokens (bucket {:.9})",
                    model.capacity
                );
            } else {
                assert_eq!(got.wake_ms, None, "{what}: a take not cut names no wake-up");
            }
            assert_eq!(
                got.held_since_ms.is_some(),
                held[s],
                "{what}: shard {shard} held?"
            );
            if used < got.granted {
                // The claim found fewer: the rest goes back, and the shard has caught up.
                let back = TakeFlow {
                    want: 0,
                    give_back: got.granted - used,
                    found: Found::CaughtUp,
                    ..take
                };
                let after = call(&mut con, back);
                assert_eq!(after.granted, 0, "{what}");
                assert_eq!(after.held_since_ms, None, "{what}: caught up, not held");
                held[s] = false;
                model.give_back(got.granted - used);
            }
            times.push(clock);
            claimed.push(used);
        }
        assert_within_bucket(&what, &times, &claimed, model.capacity, rate);
        let _: () = redis::cmd("DEL").arg(&key).query(&mut raw).unwrap();
    }
}

/// A two-phase route's per-key rate: a publisher claims a batch of its jobs (any keys, in due
/// order) from a spread shard and asks `take_keys` for each; a job without a token is put
/// back due at its turn, where its next claim goes without asking again. Driven with
/// generated rates, bursts, batches, keys and clocks, each answer equals the reference
/// model's (the local route's per-key bucket), a job never goes before its turn, and each
/// key's admissions stay within its bucket + rate × T in every window.
#[test]
fn a_two_phase_route_s_per_key_turns_match_their_reference_model() {
    use zdelay::keys::Keys;
    use zdelay::store::scripts::{KeyTurn, take_keys};
    let redis = RedisServer::start();
    let rt = runtime();
    let mut con = rt
        .block_on(Conn::connect(&crate::common::redis_config(&redis.url(), 1)))
        .expect("connect");
    let keys = Keys::new("zdelay", 4);
    let mut rng = SeededRng::new(0x5eed_2906);
    for case in 0..25 {
        let key_rate = log_uniform(&mut rng, 1.0 / 3600.0, 100_000.0);
        let key_burst = log_uniform(&mut rng, 1.0, (10.0 * key_rate).max(1.0))
            .round()
            .max(1.0) as u32;
        let batch = [1, 7, 100][rng.range(0, 3) as usize];
        let route = format!("case{case}");
        let step_ms = 1000.0 / key_rate;
        let tenants = rng.range(1, 5) as usize;
        let base = 1_700_000_000_000 + case * 100_000_000_000;
        let n = rng.range(1, 400) as usize;
        let span = (step_ms * n as f64 * log_uniform(&mut rng, 0.05, 2.0)) as i64;
        let dues = arrivals(&mut rng, n, base, span.min(100_000_000_000));
        let key_of = |i: usize| match i % (tenants + 1) {
            0 => String::new(),
            k => format!("t{k}"),
        };
        let what = format!(
            "case {case}: {tenants} keys at {key_rate:.6}/s, burst {key_burst}, batch {batch}, \
             {n} jobs over {span} ms"
        );
        // Jobs waiting in the shard by (due, id), as a claim takes them; the turns given.
        let mut waiting: BTreeSet<(i64, usize)> =
            dues.iter().enumerate().map(|(i, d)| (*d, i)).collect();
        let mut turns: HashMap<usize, i64> = HashMap::new();
        let mut model = KeyModel::new(key_rate, key_burst);
        let mut admitted: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let mut now = base - 1;
        let mut calls = 0;
        while !waiting.is_empty() {
            calls += 1;
            assert!(calls < 5_000, "{what}: {} jobs never went", waiting.len());
            now = if calls > 300 {
                let head = waiting.iter().next().map(|(d, _)| *d).unwrap();
                now.max(head) + rng.range(0, 3)
            } else {
                step(&mut rng, now, step_ms)
            };
            let claimed: Vec<(i64, usize)> =
                waiting.range(..(now + 1, 0)).take(batch).copied().collect();
            if claimed.is_empty() {
                continue;
            }
            let ids: Vec<String> = claimed.iter().map(|(_, i)| format!("j{i}")).collect();
            let job_keys: Vec<String> = claimed.iter().map(|(_, i)| key_of(*i)).collect();
            let asked: Vec<(&str, &str)> = ids
                .iter()
                .zip(&job_keys)
                .map(|(id, key)| (id.as_str(), key.as_str()))
                .collect();
            let answers = rt
                .block_on(take_keys(
                    &mut con,
                    &keys,
                    &route,
                    2,
                    (key_rate, key_burst),
                    Some(now),
                    &asked,
                ))
                .expect(&what);
            for (((due, i), key), answer) in claimed.iter().zip(&job_keys).zip(&answers) {
                waiting.remove(&(*due, *i));
                // A turn an hour past is forgotten: the job asks again.
                let expected = match turns.remove(i).filter(|t| *t > now - 3_600_000) {
                    Some(turn) => {
                        assert!(
                            turn <= now,
                            "{what}: j{i} claimed at {now}, its turn {turn}"
                        );
                        KeyTurn::Granted(turn)
                    }
                    None => {
                        let (turn, at) = model.take(key, now);
                        admitted.entry(key.clone()).or_default().push(at);
                        match turn {
                            None => KeyTurn::Now,
                            Some(turn) => {
                                turns.insert(*i, turn);
                                waiting.insert((turn, *i));
                                KeyTurn::Later(turn)
                            }
                        }
                    }
                };
                assert_eq!(*answer, expected, "{what}: j{i} (key {key:?}) at {now}");
            }
            model.end_call();
        }
        for (key, times) in &mut admitted {
            times.sort_unstable();
            let ones = vec![1; times.len()];
            assert_within_bucket(
                &format!("{what}, key {key:?}"),
                times,
                &ones,
                f64::from(key_burst),
                key_rate,
            );
        }
        let left: usize = redis::cmd("ZCOUNT")
            .arg(keys.route_turns(&route))
            .arg(now - 3_600_000 + 1)
            .arg("+inf")
            .query(&mut redis.conn())
            .unwrap();
        assert_eq!(left, 0, "{what}: every turn given was used or dropped");
    }
}
