//! One typed function per Lua script in `lua/`, sharing its name, and the only place that
//! loads them. Each function takes the keys it touches ([`ShardKeys`], [`RawKeys`], the route
//! table's lists) and typed arguments, builds KEYS and ARGV in the order the script's header
//! documents, and returns a typed reply.
//!
//! Invocations use EVALSHA with a NOSCRIPT reload (redis-rs `Script`); pipelines, which
//! redis-rs does not reload (redis-rs #1394), reload and resend once. Every script is safe to
//! re-run, because after an I/O error we cannot know whether it ran.

use super::Conn;
use crate::config::{Push, ScoreUnit};
use crate::job::{Cancelled, Due, Enqueued, OnConflict};
use crate::keys::{Keys, RawKeys, ShardKey, ShardKeys};
use crate::lane::Lane;
use crate::routes::Routes;
use futures::StreamExt as _;
use redis::{Cmd, FromRedisValue, Script, ToRedisArgs, Value};
use std::sync::LazyLock;

macro_rules! scripts {
    ($($name:ident),* $(,)?) => {
        /// Every script: (name, source). Used by tests and by `load_all`.
        pub const ALL: &[(&str, &str)] = &[
            $((stringify!($name), include_str!(concat!(env!("OUT_DIR"), "/lua/", stringify!($name), ".lua")))),*
        ];
        mod compiled {
            use super::*;
            $(
                #[allow(non_upper_case_globals)]
                pub static $name: LazyLock<Compiled> = LazyLock::new(|| {
                    let source = include_str!(concat!(env!("OUT_DIR"), "/lua/", stringify!($name), ".lua"));
                    Compiled { script: Script::new(source), source }
                });
            )*
        }
        /// Loads every script on one Redis, so EVALSHA rarely meets NOSCRIPT. Not on a
        /// cluster: a start-up that waited for every master would wait for a hung one; there
        /// a script is loaded where NOSCRIPT says it is missing.
        pub async fn load_all(con: &mut Conn) -> redis::RedisResult<()> {
            if con.is_cluster() {
                return Ok(());
            }
            $( load(con, &compiled::$name, b"").await?; )*
            Ok(())
        }

        /// Loads every script on the node serving `key` (a pipeline met NOSCRIPT there;
        /// redis-rs does not reload in pipelines: #1394).
        async fn load_all_on(con: &mut Conn, key: &[u8]) -> redis::RedisResult<()> {
            $( load(con, &compiled::$name, key).await?; )*
            Ok(())
        }
    };
}

scripts!(
    enqueue_jobs,
    move_due,
    claim_jobs,
    move_raw,
    claim_raw,
    settle_raw,
    cancel_job,
    reschedule_job,
    replay_dead,
    purge_dead,
    peek_dead,
    prune_history,
    walk_raw_dead,
    settle_jobs,
    bench_bare_move_raw,
    bench_bare_move_raw_checked,
    bench_bare_move_hash,
    bench_bare_move_stream,
    enqueue_lane,
    move_lane,
    take_flow,
    take_keys,
    register_lane,
    register_two_phase,
    retire_lane,
    cancel_lane,
    reschedule_lane,
    peek_dead_lane,
    replay_dead_lane,
    purge_dead_lane,
    prune_history_lane,
    upsert_schedule_lane,
    delete_schedule_lane,
    due_schedules_lane,
    fire_schedules_lane,
    upgrade_put_lane,
    relocate_drop_lane,
    route_gone_lane,
    claim_slots,
    release_slots,
    upsert_schedule,
    delete_schedule,
    due_schedules,
    fire_schedules,
    reshard_scan,
    reshard_take,
    reshard_put,
    reshard_drop,
    ready_sinks,
    get_job,
    get_lane,
    schedule_request,
    schedule_request_done,
    unlock,
    drop_ended_windows,
    advance_clock,
);

use ShardKey::{
    Claims, Dead, Due as DueKey, History, Inflight, Jobs, Layout, LeaseSeq, MaxLateness, Ready,
    ReadyIds, Reasons, SchedDue, SchedEnv, SchedFired, SchedQuarantine, Scheduled, Schedules,
};

/// Every key that holds something per job or schedule, which `zdelay reshard` moves (all but
/// the claim counter `lease_seq` and the claims' records `claims`, which only jobs in flight
/// need: a reshard moves a job once it is settled), and the layout marker.
const RESHARD_KEYS: &[ShardKey] = &[
    DueKey,
    Jobs,
    Inflight,
    Dead,
    Reasons,
    Scheduled,
    Ready,
    ReadyIds,
    MaxLateness,
    Schedules,
    SchedEnv,
    SchedDue,
    SchedFired,
    SchedQuarantine,
    History,
    Layout,
];

/// The shard keys each script takes first in KEYS, in this order (checked against the
/// headers by a test): each list is a subsequence of `ShardKey::ALL`. Every script that
/// takes a shard computed by its caller ends with the layout marker and checks it (the
/// layout fence, [`FENCED`]).
const SHARD_KEYS: &[(&str, &[ShardKey])] = &[
    (
        "enqueue_jobs",
        &[
            DueKey,
            Jobs,
            Inflight,
            Dead,
            Reasons,
            Scheduled,
            Ready,
            ReadyIds,
            MaxLateness,
            Layout,
        ],
    ),
    (
        "move_due",
        &[
            DueKey,
            Jobs,
            Inflight,
            Dead,
            Reasons,
            Scheduled,
            Ready,
            ReadyIds,
            MaxLateness,
            SchedDue,
            LeaseSeq,
            Claims,
            Layout,
        ],
    ),
    (
        "settle_jobs",
        &[
            DueKey, Jobs, Inflight, Dead, Reasons, Scheduled, Ready, ReadyIds, Claims, Layout,
        ],
    ),
    (
        "claim_jobs",
        &[
            Jobs, Inflight, Scheduled, Ready, ReadyIds, LeaseSeq, Claims, Layout,
        ],
    ),
    ("ready_sinks", &[Ready, Layout]),
    (
        "cancel_job",
        &[
            DueKey,
            Jobs,
            Inflight,
            Scheduled,
            Ready,
            ReadyIds,
            MaxLateness,
            Layout,
        ],
    ),
    (
        "reschedule_job",
        &[DueKey, Scheduled, Ready, ReadyIds, Layout],
    ),
    (
        "replay_dead",
        &[DueKey, Jobs, Dead, Reasons, History, Layout],
    ),
    ("purge_dead", &[Jobs, Dead, Reasons, History, Layout]),
    ("peek_dead", &[Jobs, Dead, Reasons, History, Layout]),
    ("prune_history", &[Jobs, History, Layout]),
    (
        "upsert_schedule",
        &[
            Schedules,
            SchedEnv,
            SchedDue,
            SchedFired,
            SchedQuarantine,
            Layout,
        ],
    ),
    (
        "delete_schedule",
        &[
            Schedules,
            SchedEnv,
            SchedDue,
            SchedFired,
            SchedQuarantine,
            Layout,
        ],
    ),
    ("due_schedules", &[Schedules, SchedDue, Layout]),
    (
        "fire_schedules",
        &[
            DueKey,
            Jobs,
            Dead,
            Reasons,
            MaxLateness,
            Schedules,
            SchedEnv,
            SchedDue,
            SchedFired,
            SchedQuarantine,
            Layout,
        ],
    ),
    (
        "reshard_take",
        &[
            DueKey,
            Jobs,
            Inflight,
            Dead,
            Reasons,
            Scheduled,
            ReadyIds,
            MaxLateness,
            Schedules,
            SchedEnv,
            SchedDue,
            SchedFired,
            SchedQuarantine,
            History,
            Layout,
        ],
    ),
    ("reshard_put", RESHARD_KEYS),
    ("reshard_drop", RESHARD_KEYS),
];

/// The scripts with the layout fence: ARGV[1] is the caller's shard count, checked against
/// the shard's layout marker (its last key) before anything is written.
const FENCED: &[&str] = &[
    "enqueue_jobs",
    "move_due",
    "settle_jobs",
    "claim_jobs",
    "cancel_job",
    "reschedule_job",
    "replay_dead",
    "purge_dead",
    "peek_dead",
    "prune_history",
    "upsert_schedule",
    "delete_schedule",
    "due_schedules",
    "fire_schedules",
    "ready_sinks",
];

/// A script with its source, for `SCRIPT LOAD`.
pub struct Compiled {
    script: Script,
    source: &'static str,
}

/// One script call being built: its KEYS and ARGV, sent as EVALSHA.
pub struct Call {
    script: &'static Compiled,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    fn new(script: &'static Compiled) -> Self {
        Call {
            script,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.script.get_hash())
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }

    /// Runs the script; a server that lost it (restarted, flushed, a replica promoted on a
    /// cluster) gets it again on every primary, then the call once more (scripts are safe
    /// to re-run).
    async fn invoke<T: FromRedisValue>(&self, con: &mut Conn) -> redis::RedisResult<T> {
        match self.cmd().query_async(con).await {
            Err(e) if is_noscript(&e) => {
                load(con, self.script, self.first_key()).await?;
                self.cmd().query_async(con).await
            }
            other => other,
        }
    }

    /// The key that routes this call on a cluster (every key is in its slot).
    fn first_key(&self) -> &[u8] {
        self.keys.first().map_or(&[], Vec::as_slice)
    }
}

/// `SCRIPT LOAD` on the node serving `key`'s slot (the one server on one Redis).
async fn load(con: &mut Conn, script: &Compiled, key: &[u8]) -> redis::RedisResult<()> {
    let mut cmd = redis::cmd("SCRIPT");
    cmd.arg("LOAD").arg(script.source);
    con.on_node_of(key, cmd).await.map(|_| ())
}

/// A fenced script's invocation: `name`'s shard keys in KEYS and, as ARGV[1], the shard
/// count `keys` were computed with (the script refuses it if the shard's layout marker
/// disagrees: [`super::Layout::of_error`]).
fn fenced_invocation(script: &'static Compiled, name: &str, keys: &ShardKeys) -> Call {
    debug_assert!(FENCED.contains(&name), "{name} is not fenced");
    let mut inv = shard_invocation(script, name, keys);
    inv.arg(keys.shards);
    inv
}

/// A script invocation with `name`'s shard keys already in KEYS.
fn shard_invocation(script: &'static Compiled, name: &str, keys: &ShardKeys) -> Call {
    let mut inv = Call::new(script);
    let (_, wanted) = SHARD_KEYS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("every shard script lists its keys in SHARD_KEYS");
    for key in *wanted {
        inv.key(keys.get(*key));
    }
    inv
}

fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// Sends calls pipelined, answers in input order, one per call (a call's error reply, such
/// as a layout fence, fails that call alone): on one server in pipelines of
/// [`CALLS_PER_PIPELINE`]; on a cluster one pipeline per shard (a pipeline must stay in one
/// slot), all at once. `shard_of(i)` is the shard of call `i`. The outer error is a
/// connection's: some calls may have run.
async fn pipelined_by_shard<T: redis::FromRedisValue>(
    con: &mut Conn,
    calls: &[Call],
    shard_of: impl Fn(usize) -> u16,
) -> redis::RedisResult<Vec<redis::RedisResult<T>>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    if con.is_cluster() {
        let mut by_shard: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
        for i in 0..calls.len() {
            by_shard.entry(shard_of(i)).or_default().push(i);
        }
        for indices in by_shard.into_values() {
            groups.extend(indices.chunks(CALLS_PER_PIPELINE).map(<[usize]>::to_vec));
        }
    } else {
        let all: Vec<usize> = (0..calls.len()).collect();
        groups.extend(all.chunks(CALLS_PER_PIPELINE).map(<[usize]>::to_vec));
    }
    // A few pipelines in flight, not all: each waits for its answer behind the ones sent
    // before it, and a large batch sent at once would make the last wait past the response
    // timeout on a busy Redis (and be reported as failed although it ran). By hand rather
    // than `stream::iter(..).map(..).buffered(..)`: that closure's borrow of `calls` makes
    // the callers' futures fail axum's `Send` bound.
    let mut to_send = groups.iter();
    let mut in_flight = futures::stream::FuturesOrdered::new();
    let mut answered = Vec::with_capacity(groups.len());
    loop {
        while in_flight.len() < PIPELINES_IN_FLIGHT {
            let Some(group) = to_send.next() else { break };
            in_flight.push_back(send_group::<T>(con.clone(), calls, group));
        }
        match in_flight.next().await {
            Some(replies) => answered.push(replies),
            None => break,
        }
    }
    let mut out: Vec<Option<redis::RedisResult<T>>> = (0..calls.len()).map(|_| None).collect();
    for (group, replies) in groups.iter().zip(answered) {
        for (&i, reply) in group.iter().zip(replies?) {
            out[i] = Some(reply);
        }
    }
    Ok(out
        .into_iter()
        .map(|r| r.expect("every call answered"))
        .collect())
}

/// One group of `pipelined_by_shard`, in one pipeline.
async fn send_group<T: redis::FromRedisValue>(
    mut con: Conn,
    calls: &[Call],
    group: &[usize],
) -> redis::RedisResult<Vec<redis::RedisResult<T>>> {
    let batch: Vec<&Call> = group.iter().map(|&i| &calls[i]).collect();
    pipelined::<T>(&mut con, &batch).await
}

/// Sends invocations in one pipeline, one answer per invocation. Scripts are loaded at
/// connect; a Redis that restarted or flushed them answers NOSCRIPT, which pipelines do not
/// handle: load them and send the calls that met it once more.
async fn pipelined<T: redis::FromRedisValue>(
    con: &mut Conn,
    invocations: &[&Call],
) -> redis::RedisResult<Vec<redis::RedisResult<T>>> {
    let base = con.clone();
    let send = |calls: Vec<&Call>| {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for inv in calls {
            pipe.add_command(inv.cmd());
        }
        let mut con = base.clone();
        async move {
            pipe.query_async::<Vec<redis::RedisResult<T>>>(&mut con)
                .await
        }
    };
    let mut replies = send(invocations.to_vec()).await?;
    let missing: Vec<usize> = (0..replies.len())
        .filter(|&i| matches!(&replies[i], Err(e) if is_noscript(e)))
        .collect();
    if !missing.is_empty() {
        // A pipeline stays in one slot: load where it was sent.
        load_all_on(con, invocations[missing[0]].first_key()).await?;
        let again = send(missing.iter().map(|&i| invocations[i]).collect()).await?;
        for (i, reply) in missing.into_iter().zip(again) {
            replies[i] = reply;
        }
    }
    Ok(replies)
}

// ---------------------------------------------------------------------------------------
// Producer scripts

/// One job for `enqueue_jobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct EnqueueItem {
    pub id: String,
    pub due: Due,
    pub envelope: Vec<u8>,
    /// Not delivered later than this after its due (dead, `expired`); ms.
    pub max_lateness_ms: Option<u64>,
    /// Remembered this long once delivered or dead (`NewJob::unique_for`); ms.
    pub unique_for_ms: Option<u64>,
}

/// One `enqueue_jobs` call: jobs of one shard.
pub struct EnqueueCall<'a> {
    pub keys: ShardKeys,
    pub items: &'a [EnqueueItem],
}

/// Script calls per pipeline round trip.
const CALLS_PER_PIPELINE: usize = 64;

/// Pipelines awaiting their answers at once: enough to keep Redis busy between round trips.
const PIPELINES_IN_FLIGHT: usize = 2;

/// Runs `enqueue_jobs` for each call, pipelined. One answer per call, and in it one per item,
/// in order: what the enqueue did, or `None` when the id exists and the policy is `Error`
/// (nothing written). A call refused (its layout fence, see [`super::Layout::of_error`])
/// wrote nothing.
pub async fn enqueue_jobs(
    con: &mut Conn,
    policy: OnConflict,
    calls: &[EnqueueCall<'_>],
) -> redis::RedisResult<Vec<redis::RedisResult<Vec<Option<Enqueued>>>>> {
    // A test clock's offset (no I/O without one), read once for the whole call.
    let clock = match con.clock().is_test() {
        true => Some(con.clock_offset_ms().await?),
        false => None,
    };
    // The unique window is one per invocation: a call's items go in runs of one window each.
    let mut invocations: Vec<Call> = Vec::new();
    let mut owner: Vec<usize> = Vec::new();
    for (c, call) in calls.iter().enumerate() {
        for run in call
            .items
            .chunk_by(|a, b| a.unique_for_ms == b.unique_for_ms)
        {
            let mut inv = fenced_invocation(&compiled::enqueue_jobs, "enqueue_jobs", &call.keys);
            if needs_windows(policy, run[0].unique_for_ms) {
                inv.key(&call.keys.unique).key(&call.keys.windows);
            }
            inv.arg(policy.as_arg(run[0].unique_for_ms, clock))
                .arg(&call.keys.wake_channel)
                .arg(call.keys.shard);
            for item in run {
                inv.arg(&item.id)
                    .arg(item.due.as_arg())
                    .arg(&item.envelope)
                    .arg(
                        item.max_lateness_ms
                            .map(|ms| ms.to_string())
                            .unwrap_or_default(),
                    );
            }
            invocations.push(inv);
            owner.push(c);
        }
    }
    let replies: Vec<redis::RedisResult<Vec<i64>>> =
        pipelined_by_shard(con, &invocations, |i| calls[owner[i]].keys.shard).await?;
    let mut answers: Vec<redis::RedisResult<Vec<Option<Enqueued>>>> =
        calls.iter().map(|_| Ok(Vec::new())).collect();
    for (reply, c) in replies.into_iter().zip(owner) {
        // A call's runs share its shard, so a fence refuses them all alike.
        match (&mut answers[c], reply) {
            (Ok(codes), Ok(more)) => codes.extend(more.into_iter().map(enqueued_of)),
            (Ok(_), Err(e)) => answers[c] = Err(e),
            (Err(_), _) => {}
        }
    }
    Ok(answers)
}

/// Whether an enqueue call takes the unique-window keys: only when it uses them, so that a
/// producer whose ACL predates them (docs/guides/security.md) still enqueues.
fn needs_windows(policy: OnConflict, unique_for_ms: Option<u64>) -> bool {
    unique_for_ms.is_some() || matches!(policy, OnConflict::Debounce { .. })
}

/// What an enqueue script did with one job (`enqueue_jobs`, `enqueue_lane`): `None` when
/// the id exists and the policy is `Error`.
fn enqueued_of(code: i64) -> Option<Enqueued> {
    match code {
        1 => Some(Enqueued::Added),
        2 => Some(Enqueued::Replaced),
        0 => Some(Enqueued::Kept),
        3 => Some(Enqueued::Duplicate),
        _ => None,
    }
}

pub async fn cancel_job(
    con: &mut Conn,
    keys: &ShardKeys,
    id: &str,
) -> redis::RedisResult<Cancelled> {
    // The unique-window key is always sent: a cancelled job's window goes with it.
    let mut inv = fenced_invocation(&compiled::cancel_job, "cancel_job", keys);
    let code: i64 = inv.key(&keys.unique).arg(id).invoke(con).await?;
    Ok(match code {
        1 => Cancelled::Cancelled,
        -1 => Cancelled::InFlight,
        _ => Cancelled::NotPending,
    })
}

/// The new due ms, or `None` when the job is not pending.
pub async fn reschedule_job(
    con: &mut Conn,
    keys: &ShardKeys,
    id: &str,
    due: Due,
) -> redis::RedisResult<Option<i64>> {
    let due = clock_due_arg(con, due).await?;
    let mut inv = fenced_invocation(&compiled::reschedule_job, "reschedule_job", keys);
    let new_due: i64 = inv
        .arg(id)
        .arg(due)
        .arg(&keys.wake_channel)
        .arg(keys.shard)
        .invoke(con)
        .await?;
    Ok((new_due >= 0).then_some(new_due))
}

/// What `replay_dead` (or `walk_raw_dead` replaying) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Replayed {
    pub replayed: u64,
    /// Dead ids without an envelope: nothing to deliver, so they stay dead.
    pub orphans: u64,
    /// Ids no longer dead, or dead again since they were selected (their dead score moved):
    /// left as they are.
    pub skipped: u64,
    /// The due time (epoch ms) the replayed jobs got, when any was replayed.
    pub due_ms: Option<i64>,
    /// History entries of jobs no longer stored, dropped on the way (set by `dead`).
    pub history_pruned: u64,
}

impl Replayed {
    /// Adds another call's counts.
    pub fn add(&mut self, other: Replayed) {
        self.replayed += other.replayed;
        self.orphans += other.orphans;
        self.skipped += other.skipped;
        self.due_ms = self.due_ms.or(other.due_ms);
        self.history_pruned += other.history_pruned;
    }
}

/// The scripts' form of the dead score an id was selected with, or "" (none: act whatever
/// its score).
fn selected_score_arg(score: Option<f64>) -> String {
    score.map(|s| s.to_string()).unwrap_or_default()
}

/// Adds the ARGV pairs of a selection: id, the dead score it was selected with.
fn add_selected(inv: &mut Call, ids: &[(String, Option<f64>)]) {
    for (id, selected) in ids {
        inv.arg(id).arg(selected_score_arg(*selected));
    }
}

/// Runs a replay script (`replay_dead`, `replay_dead_lane`) on the selection `ids`.
async fn invoke_replay(
    con: &mut Conn,
    inv: &mut Call,
    ids: &[(String, Option<f64>)],
) -> redis::RedisResult<Replayed> {
    add_selected(inv, ids);
    let (replayed, orphans, skipped, due_ms): (u64, u64, u64, i64) = inv.invoke(con).await?;
    Ok(Replayed {
        replayed,
        orphans,
        skipped,
        due_ms: (replayed > 0).then_some(due_ms),
        history_pruned: 0,
    })
}

/// Makes dead jobs due at `due` (Redis `TIME` based for `Due::In`), each only if its dead
/// score is still the one it was selected with (`None`: whatever it is). `reset_attempts`
/// drops the envelope's attempt count; `history_cap` bounds each id's history.
pub async fn replay_dead(
    con: &mut Conn,
    keys: &ShardKeys,
    due: Due,
    reset_attempts: bool,
    history_cap: usize,
    ids: &[(String, Option<f64>)],
) -> redis::RedisResult<Replayed> {
    let due = clock_due_arg(con, due).await?;
    let mut inv = fenced_invocation(&compiled::replay_dead, "replay_dead", keys);
    inv.arg(due)
        .arg(&keys.wake_channel)
        .arg(keys.shard)
        .arg(if reset_attempts { "reset" } else { "keep" })
        .arg(history_cap);
    invoke_replay(con, &mut inv, ids).await
}

/// Deletes dead jobs (envelope, reason, history), each only if its dead score is still the
/// one it was selected with. Returns (purged, skipped).
pub async fn purge_dead(
    con: &mut Conn,
    keys: &ShardKeys,
    ids: &[(String, Option<f64>)],
) -> redis::RedisResult<(u64, u64)> {
    let mut inv = fenced_invocation(&compiled::purge_dead, "purge_dead", keys);
    add_selected(&mut inv, ids);
    inv.invoke(con).await
}

/// The stored envelope of a job, as far as `peek_dead` reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvelopeHead {
    /// A `zd1` frame up to the end of its meta (the payload cut off), the payload's size and
    /// its first bytes (as many as asked for).
    Frame {
        head: Vec<u8>,
        payload_size: u64,
        payload_start: Vec<u8>,
    },
    /// A JSON envelope or a malformed value: its first [`PEEK_HEAD_MAX`] bytes, and its size.
    Other { head: Vec<u8>, size: u64 },
    /// A value over [`PEEK_READ_MAX`] bytes, not read (only its size).
    Large { size: u64 },
    /// No envelope stored (an orphan).
    Missing,
}

/// Bytes of a value `peek_dead` returns at most when it is not a frame (and of a frame's
/// meta); `peek_dead.lua`'s `HEAD_MAX`.
pub const PEEK_HEAD_MAX: usize = 65536;

/// Envelope bytes `peek_dead` reads of one value at most (`peek_dead.lua`'s `READ_MAX`):
/// Redis cannot read part of a hash field, and a larger copy would hold it for too long.
pub const PEEK_READ_MAX: usize = 4 << 20;

/// Envelope bytes one `peek_dead` call reads at most (the first id's whatever its size);
/// the wrapper sends the ids it did not reach again.
pub const PEEK_BUDGET: usize = 1 << 20;

/// One id as `peek_dead` saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadPeek {
    pub id: String,
    /// Its dead score; `None` when it is not dead.
    pub died: Option<f64>,
    /// Its reason's first 4096 bytes.
    pub reason: String,
    /// Its history text (`""` when none).
    pub history: String,
    pub envelope: EnvelopeHead,
}

/// Reads what listing, filtering and showing needs about ids of one shard: dead score,
/// reason, history, the envelope's head and size, and the first `preview` bytes of a
/// frame's payload — never more of a payload. Each call reads at most [`PEEK_BUDGET`] of
/// envelopes (one at least); the ids it did not reach go in the next call.
pub async fn peek_dead(
    con: &mut Conn,
    keys: &ShardKeys,
    ids: &[String],
    preview: usize,
) -> redis::RedisResult<Vec<DeadPeek>> {
    let con = con.clone();
    peek_in_budget(ids, |rest| {
        let mut con = con.clone();
        async move {
            let mut inv = fenced_invocation(&compiled::peek_dead, "peek_dead", keys);
            inv.arg(PEEK_BUDGET).arg(preview).arg(rest);
            inv.invoke(&mut con).await
        }
    })
    .await
}

/// [`peek_dead`] for the stored ids of a route lane (storage layout 2): the lane's meta comes
/// back as a frame head with the route as `dest` (`peek_dead_lane.lua`). A lane whose marker
/// is not `lane`'s refuses the call.
pub async fn peek_dead_lane(
    con: &mut Conn,
    lane: &Lane,
    ids: &[String],
    preview: usize,
) -> redis::RedisResult<Vec<DeadPeek>> {
    let (k, con) = (&lane.keys, con.clone());
    peek_in_budget(ids, |rest| {
        let mut con = con.clone();
        async move {
            Call::new(&compiled::peek_dead_lane)
                .key(&k.jobs)
                .key(&k.meta)
                .key(&k.dead)
                .key(&k.reasons)
                .key(&k.history)
                .key(&k.marker)
                .arg(lane.marker())
                .arg(PEEK_BUDGET)
                .arg(preview)
                .arg(&lane.route)
                .arg(rest)
                .invoke(&mut con)
                .await
        }
    })
    .await
}

/// Calls `peek` with the ids it has not reached yet until every id is read, decoding its
/// seven values per id (each call reads a prefix within its byte budget).
async fn peek_in_budget<'a, F, Fut>(ids: &'a [String], peek: F) -> redis::RedisResult<Vec<DeadPeek>>
where
    F: Fn(&'a [String]) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<Vec<Value>>>,
{
    let mut out = Vec::with_capacity(ids.len());
    while out.len() < ids.len() {
        let rest = &ids[out.len()..];
        let values = peek(rest).await?;
        if values.is_empty() || !values.len().is_multiple_of(7) || values.len() / 7 > rest.len() {
            return Err(protocol_error(
                "peek_dead",
                &Value::Int(values.len() as i64),
            ));
        }
        let mut it = values.into_iter();
        for id in &rest[..it.len() / 7] {
            let mut next = || it.next().expect("length checked above");
            let died = match as_string(next())? {
                s if s.is_empty() => None,
                s => Some(s.parse::<f64>().map_err(|_| {
                    redis::RedisError::from((redis::ErrorKind::Parse, "dead score is not a number"))
                })?),
            };
            let reason = as_string(next())?;
            let history = as_string(next())?;
            let kind = as_string(next())?;
            let head = as_bytes(next())?;
            let size = as_int(next())?.max(0) as u64;
            let start = as_bytes(next())?;
            let envelope = match kind.as_str() {
                "frame" => EnvelopeHead::Frame {
                    head,
                    payload_size: size,
                    payload_start: start,
                },
                "other" => EnvelopeHead::Other { head, size },
                "large" => EnvelopeHead::Large { size },
                _ => EnvelopeHead::Missing,
            };
            out.push(DeadPeek {
                id: id.clone(),
                died,
                reason,
                history,
                envelope,
            });
        }
    }
    Ok(out)
}

/// Deletes the history of those `ids` that have no envelope any more; returns how many.
pub async fn prune_history(
    con: &mut Conn,
    keys: &ShardKeys,
    ids: &[String],
) -> redis::RedisResult<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let mut inv = fenced_invocation(&compiled::prune_history, "prune_history", keys);
    inv.arg(ids).invoke(con).await
}

/// [`replay_dead`] for the stored ids of a route lane (storage layout 2): local routes count
/// no attempts, so there is nothing to reset. A lane whose marker is not `lane`'s refuses the
/// call, writing nothing.
pub async fn replay_dead_lane(
    con: &mut Conn,
    lane: &Lane,
    wake_channel: &str,
    due: Due,
    history_cap: usize,
    ids: &[(String, Option<f64>)],
) -> redis::RedisResult<Replayed> {
    let due = clock_due_arg(con, due).await?;
    let k = &lane.keys;
    let mut inv = Call::new(&compiled::replay_dead_lane);
    inv.key(&k.due)
        .key(&k.jobs)
        .key(&k.large)
        .key(&k.dead)
        .key(&k.reasons)
        .key(&k.history)
        .key(&k.marker)
        .arg(lane.marker())
        .arg(due)
        .arg(wake_channel)
        .arg(lane.wake_name())
        .arg(history_cap);
    invoke_replay(con, &mut inv, ids).await
}

/// [`purge_dead`] for the stored ids of a route lane (its meta goes too). Returns (purged,
/// skipped).
pub async fn purge_dead_lane(
    con: &mut Conn,
    lane: &Lane,
    ids: &[(String, Option<f64>)],
) -> redis::RedisResult<(u64, u64)> {
    let k = &lane.keys;
    let mut inv = Call::new(&compiled::purge_dead_lane);
    inv.key(&k.jobs)
        .key(&k.meta)
        .key(&k.dead)
        .key(&k.reasons)
        .key(&k.history)
        .key(&k.marker)
        .arg(lane.marker());
    add_selected(&mut inv, ids);
    inv.invoke(con).await
}

/// [`prune_history`] for the stored ids of a route lane.
pub async fn prune_history_lane(
    con: &mut Conn,
    lane: &Lane,
    ids: &[String],
) -> redis::RedisResult<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let k = &lane.keys;
    Call::new(&compiled::prune_history_lane)
        .key(&k.jobs)
        .key(&k.history)
        .key(&k.marker)
        .arg(lane.marker())
        .arg(ids)
        .invoke(con)
        .await
}

/// What one `walk_raw_dead` call does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RawDeadWalk<'a> {
    /// Lists the members taken, each with the first `preview` bytes.
    List { preview: usize },
    /// Puts the members taken back into the source with this score (in the source's unit).
    Replay { score: &'a str },
    /// Deletes the members taken.
    Purge,
}

/// Which dead members of a raw source one `walk_raw_dead` call walks and takes.
#[derive(Debug, Clone, PartialEq)]
pub struct RawDeadRange<'a> {
    /// Dead scores as `ZRANGEBYSCORE` bounds.
    pub min: &'a str,
    pub max: &'a str,
    /// Members at the start of the window to pass over (left there by earlier calls).
    pub offset: u64,
    /// Members taken at most.
    pub take: usize,
    /// Members walked at most.
    pub walk: usize,
    /// Only members whose reason contains this (ASCII case ignored); "" = any.
    pub reason: &'a str,
    /// Only members with one of these hashes ([`RawDeadEntry::hash`]); empty = any.
    pub hashes: &'a [String],
}

/// Member bytes one `walk_raw_dead` call reads at most (the first member's whatever its
/// size).
pub const RAW_WALK_BUDGET: usize = 1 << 20;

/// A dead raw member as `walk_raw_dead` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct RawDeadEntry {
    pub score: f64,
    /// 16 hex digits of SHA-1: of the member up to 1 MiB, else of its size and first and
    /// last 64 KiB.
    pub hash: String,
    pub size: u64,
    /// Its first bytes (as many as asked for).
    pub start: Vec<u8>,
    /// Its reason's first 4096 bytes.
    pub reason: String,
}

/// What one `walk_raw_dead` call did.
#[derive(Debug, Clone, PartialEq)]
pub struct RawDeadWalked {
    pub walked: u64,
    pub taken: u64,
    /// Where the next call starts in the window; `None` once its end was reached.
    pub next_offset: Option<u64>,
    /// Listing: the members taken, in death order.
    pub listed: Vec<RawDeadEntry>,
}

/// Walks a raw source's dead members in a score window by rank, reading at most
/// [`RAW_WALK_BUDGET`] of members, and lists, replays or purges those the range takes.
pub async fn walk_raw_dead(
    con: &mut Conn,
    keys: &RawKeys,
    mode: RawDeadWalk<'_>,
    range: &RawDeadRange<'_>,
) -> redis::RedisResult<RawDeadWalked> {
    let (name, extra) = match mode {
        RawDeadWalk::List { preview } => ("list", preview.to_string()),
        RawDeadWalk::Replay { score } => ("replay", score.to_owned()),
        RawDeadWalk::Purge => ("purge", String::new()),
    };
    let mut call = Call::new(&compiled::walk_raw_dead);
    call.key(&keys.source)
        .key(&keys.dead)
        .key(&keys.reasons)
        .arg(name)
        .arg(range.min)
        .arg(range.max)
        .arg(range.offset)
        .arg(range.take)
        .arg(range.walk)
        .arg(RAW_WALK_BUDGET)
        .arg(range.reason)
        .arg(range.hashes.join(" "))
        .arg(extra);
    let values: Vec<Value> = call.invoke(con).await?;
    let len = values.len();
    let bad = || protocol_error("walk_raw_dead", &Value::Int(len as i64));
    if len < 3 || !(len - 3).is_multiple_of(5) {
        return Err(bad());
    }
    let mut it = values.into_iter();
    let mut next = || it.next().expect("length checked above");
    let walked = as_int(next())?.max(0) as u64;
    let taken = as_int(next())?.max(0) as u64;
    let next_offset = u64::try_from(as_int(next())?).ok();
    let mut listed = Vec::with_capacity((len - 3) / 5);
    for _ in 0..(len - 3) / 5 {
        let score = as_string(next())?.parse::<f64>().map_err(|_| bad())?;
        listed.push(RawDeadEntry {
            score,
            hash: as_string(next())?,
            size: as_int(next())?.max(0) as u64,
            start: as_bytes(next())?,
            reason: as_string(next())?,
        });
    }
    Ok(RawDeadWalked {
        walked,
        taken,
        next_offset,
        listed,
    })
}

// ---------------------------------------------------------------------------------------
// Daemon scripts

/// Arguments of one `move_due` call.
pub struct MoveDue<'a> {
    pub batch: usize,
    /// Overrides Redis `TIME` (tests drive time with it).
    pub now_ms: Option<i64>,
    pub max_payload: usize,
    /// Envelope bytes the call reads at most (a single larger envelope moves alone).
    pub batch_bytes: usize,
    /// The two-phase routes and sinks the jobs are queued for (local routes have lanes).
    pub routes: &'a Routes,
    /// Walk this sink's part of the ready set from this member on (exclusive; "" = its
    /// start), refiling its jobs by their route now (see `move_due.lua`).
    pub walk: Option<(&'a str, &'a str)>,
    /// What the caller's publishers take at once, per part of the ready set in
    /// `Routes::ready_parts` order (missing parts queue their jobs in the ready set).
    pub takes: &'a [Take],
    /// The lease of the jobs it claims.
    pub lease_ms: u64,
}

/// What the caller's publishers of one part of the ready set take in a `move_due` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Take {
    /// Queue its jobs in the ready set (no publisher here, or it is paused or rate-limited).
    #[default]
    Queue,
    /// Claim up to `jobs` jobs and `bytes` bytes of envelopes (a single larger one alone).
    Claim { jobs: usize, bytes: usize },
    /// No room now: leave its jobs due (cutting the batch) unless a job after them is taken.
    Wait,
    /// As `Wait`, but read on past up to `depth` of its jobs in a row (instead of 64) to see
    /// whether another part's jobs wait behind them: a look that queues nothing when none do.
    Look { depth: usize },
}

/// The jobs one `move_due` call claimed for one part of the ready set.
#[derive(Debug, Clone, PartialEq)]
pub struct PartClaim {
    /// The part's index in `Routes::ready_parts` order.
    pub part: usize,
    pub claim: Claim,
}

pub async fn move_due(
    con: &mut Conn,
    keys: &ShardKeys,
    args: &MoveDue<'_>,
) -> redis::RedisResult<MoveReply> {
    let now_ms = con.script_now_ms(args.now_ms).await?;
    let mut inv = fenced_invocation(&compiled::move_due, "move_due", keys);
    inv.key(&keys.unique).key(&keys.windows);
    let routes = args.routes;
    inv.arg(args.batch)
        .arg(now_arg(now_ms))
        .arg(args.max_payload)
        .arg(args.batch_bytes);
    // A route with a rate is queued in its own part of the ready set (`Routes::flow_part`).
    let two_phase: Vec<(&str, &str)> = routes.two_phase_parts().collect();
    inv.arg(two_phase.len());
    for (route, part) in two_phase {
        inv.arg(route).arg(part);
    }
    let sinks: Vec<&str> = routes.ready_parts().collect();
    inv.arg(sinks.len()).arg(&sinks);
    let (walk_sink, walk_from) = args.walk.unwrap_or(("", ""));
    inv.arg(walk_sink).arg(walk_from).arg(args.lease_ms);
    for i in 0..sinks.len() {
        match args.takes.get(i).copied().unwrap_or_default() {
            Take::Queue => inv.arg("q").arg(0).arg(0),
            Take::Claim { jobs, bytes } => inv.arg("c").arg(jobs).arg(bytes),
            Take::Wait => inv.arg("w").arg(0).arg(0),
            Take::Look { depth } => inv.arg("w").arg(depth).arg(0),
        };
    }
    let mut items = match inv.invoke(con).await? {
        Value::Array(items) => items,
        other => return Err(protocol_error("move_due reply", &other)),
    };
    let claims = match items.pop() {
        Some(Value::Array(claims)) => claims,
        other => {
            return Err(protocol_error(
                "move_due claims",
                &other.unwrap_or_default(),
            ));
        }
    };
    // No list pushes and no lateness buckets: one (empty) bucket.
    let mut reply = MoveReply::parse(Value::Array(items), 0, 0)?;
    let (claimed, waits_for) = parse_move_claims(claims, sinks.len(), &reply)?;
    reply.claimed = claimed;
    reply.waits_for = waits_for;
    Ok(reply)
}

/// The claims at the end of a `move_due` reply: per part with claimed jobs, its claim; and the
/// part whose lack of room cut the batch.
fn parse_move_claims(
    claims: Vec<Value>,
    parts: usize,
    reply: &MoveReply,
) -> redis::RedisResult<(Vec<PartClaim>, Option<usize>)> {
    if claims.len() < 3 + parts {
        return Err(protocol_error("move_due claims", &Value::Array(claims)));
    }
    let mut it = claims.into_iter();
    let mut next = || it.next().unwrap_or_default();
    let token = as_string(next())?;
    let deadline_ms = as_int(next())?;
    let waits_for = match as_int(next())? {
        0 => None,
        n => Some(n as usize - 1),
    };
    let counts = (0..parts)
        .map(|_| as_int(next()).map(|n| n as usize))
        .collect::<Result<Vec<_>, _>>()?;
    let rest: Vec<Value> = it.collect();
    let total: usize = counts.iter().sum();
    if rest.len() != 3 * total || (total > 0 && token.is_empty()) {
        return Err(protocol_error(
            "move_due claimed jobs",
            &Value::Int(total as i64),
        ));
    }
    let mut jobs = rest.chunks(3);
    let mut claimed = Vec::new();
    for (part, count) in counts.into_iter().enumerate() {
        if count == 0 {
            continue;
        }
        let jobs = jobs
            .by_ref()
            .take(count)
            .map(claimed_job)
            .collect::<Result<Vec<_>, _>>()?;
        claimed.push(PartClaim {
            part,
            claim: Claim {
                now_us: reply.now_us,
                deadline_ms,
                token: token.clone(),
                more: false,
                next_lease_ms: reply.next_lease_ms,
                jobs,
            },
        });
    }
    Ok((claimed, waits_for))
}

/// One claimed job's triple: id, scheduled due, envelope.
fn claimed_job(job: &[Value]) -> redis::RedisResult<Claimed> {
    Ok(Claimed {
        id: as_string(job[0].clone())?,
        due_ms: as_string(job[1].clone())?
            .parse::<f64>()
            .map(|d| d as i64)
            .map_err(|_| protocol_error("claimed due", &job[1]))?,
        envelope: as_bytes(job[2].clone())?,
    })
}

/// A job claimed for a two-phase sink: in inflight until `Claim::deadline_ms`.
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    pub id: String,
    /// The due time it was scheduled for: stable across redeliveries.
    pub due_ms: i64,
    /// The stored envelope; empty when none is stored.
    pub envelope: Vec<u8>,
}

/// What `claim_jobs` took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claim {
    /// Redis TIME at the claim, µs.
    pub now_us: i64,
    /// Lease deadline of every claimed job (when its lease runs out).
    pub deadline_ms: i64,
    /// The fencing token for `settle_jobs`: unique among the shard's claims.
    pub token: String,
    /// The byte budget cut the batch: more jobs wait (claim again at once).
    pub more: bool,
    /// The earliest lease deadline in the shard's inflight after the claim (any sink): when a
    /// job may next come back to a ready set without a wake-up to its publisher. `None`:
    /// nothing in flight.
    pub next_lease_ms: Option<i64>,
    pub jobs: Vec<Claimed>,
}

impl Claim {
    /// Envelope bytes claimed.
    pub fn bytes(&self) -> usize {
        self.jobs.iter().map(|j| j.envelope.len()).sum()
    }
}

/// Claims up to `batch` jobs waiting for `sink` in a shard, oldest due first, and at most
/// `max_bytes` of envelopes (a single larger one alone).
pub async fn claim_jobs(
    con: &mut Conn,
    keys: &ShardKeys,
    sink: &str,
    batch: usize,
    lease_ms: u64,
    max_bytes: usize,
) -> redis::RedisResult<Claim> {
    let now_ms = con.script_now_ms(None).await?;
    let mut inv = fenced_invocation(&compiled::claim_jobs, "claim_jobs", keys);
    let value: Value = inv
        .arg(sink)
        .arg(batch)
        .arg(lease_ms)
        .arg(max_bytes)
        .arg(now_arg(now_ms))
        .invoke(con)
        .await?;
    let items = match value {
        Value::Array(items) if items.len() >= 6 => items,
        other => return Err(protocol_error("claim reply", &other)),
    };
    let mut it = items.into_iter();
    let mut next = || it.next().unwrap_or_default();
    let now_us = as_int(next())?;
    let deadline_ms = as_int(next())?;
    let token = as_string(next())?;
    let more = as_int(next())? == 1;
    let next_lease_ms = optional_ms(next())?;
    let count = as_int(next())? as usize;
    let rest: Vec<Value> = it.collect();
    if rest.len() != 3 * count || (count > 0 && token.is_empty()) {
        return Err(protocol_error("claimed jobs", &Value::Int(count as i64)));
    }
    let jobs = rest
        .chunks(3)
        .map(claimed_job)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Claim {
        now_us,
        deadline_ms,
        token,
        more,
        next_lease_ms,
        jobs,
    })
}

/// A time in ms that a script returns as a number, or "" for none.
fn optional_ms(v: Value) -> redis::RedisResult<Option<i64>> {
    let text = as_string(v)?;
    if text.is_empty() {
        return Ok(None);
    }
    text.parse::<f64>()
        .map(|ms| Some(ms.ceil() as i64))
        .map_err(|_| protocol_error("a time in ms", &Value::BulkString(text.into_bytes())))
}

/// The jobs waiting for one sink in a shard's ready set, as `ready_sinks` found them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadySink {
    pub sink: String,
    pub jobs: u64,
    /// The due time of the oldest of them, ms (`None` when its member is unreadable).
    pub oldest_due_ms: Option<i64>,
}

/// The most sinks `ready_sinks` reports per shard.
pub const READY_SINKS_MAX: usize = 256;

/// Every sink jobs wait for in a shard's ready set, configured or not, in name order.
pub async fn ready_sinks(con: &mut Conn, keys: &ShardKeys) -> redis::RedisResult<Vec<ReadySink>> {
    let mut inv = fenced_invocation(&compiled::ready_sinks, "ready_sinks", keys);
    let values: Vec<Value> = inv.arg(READY_SINKS_MAX).invoke(con).await?;
    let mut it = values.into_iter();
    let count = as_int(it.next().unwrap_or_default())? as usize;
    let rest: Vec<Value> = it.collect();
    if rest.len() != 3 * count {
        return Err(protocol_error("ready sinks", &Value::Int(count as i64)));
    }
    rest.chunks(3)
        .map(|c| {
            Ok(ReadySink {
                sink: as_string(c[0].clone())?,
                jobs: as_int(c[1].clone())? as u64,
                oldest_due_ms: as_string(c[2].clone())?.parse().ok(),
            })
        })
        .collect()
}

/// Arguments of one `move_raw` call.
pub struct MoveRaw<'a> {
    pub batch: usize,
    pub now_ms: Option<i64>,
    pub unit: ScoreUnit,
    pub max_payload: usize,
    /// Member bytes the call reads at most (a single larger member moves alone).
    pub batch_bytes: usize,
    /// The route's list and how to push onto it.
    pub list: &'a str,
    pub push: Push,
    pub bounds_ms: &'a [u64],
}

pub async fn move_raw(
    con: &mut Conn,
    keys: &RawKeys,
    args: &MoveRaw<'_>,
) -> redis::RedisResult<MoveReply> {
    let now_ms = con.script_now_ms(args.now_ms).await?;
    let value = Call::new(&compiled::move_raw)
        .key(&keys.source)
        .key(args.list)
        .key(&keys.dead)
        .key(&keys.reasons)
        .arg(args.batch)
        .arg(now_arg(now_ms))
        .arg(args.unit.as_arg())
        .arg(args.max_payload)
        .arg(args.push.command())
        .arg(args.batch_bytes)
        .arg(args.bounds_ms.len())
        .arg(args.bounds_ms)
        .invoke(con)
        .await?;
    MoveReply::parse(value, 1, args.bounds_ms.len())
}

/// A raw member claimed for a two-phase sink: its score is the lease deadline until settled.
#[derive(Debug, Clone, PartialEq)]
pub struct RawClaimed {
    pub member: Vec<u8>,
    /// The due time it was scheduled for, ms: stable across retries, releases and lease
    /// expiry, and new when a producer schedules the member again.
    pub due_ms: i64,
    /// Failed attempts before this one.
    pub attempts: u32,
    /// SHA-1 of the member, hex.
    pub sha1: String,
}

/// What `claim_raw` took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RawClaim {
    pub now_us: i64,
    /// The lease deadline as stored in the source (ms, or s with 3 decimals): the fencing
    /// token for `settle_raw`.
    pub deadline: String,
    /// Members sent to dead: implausible scores, oversize.
    pub dead_implausible: u64,
    pub dead_oversize: u64,
    /// The byte budget cut the batch: more members are due (claim again at once).
    pub more: bool,
    /// The source's lowest score after the claim, in ms: when a member next becomes due or a
    /// lease runs out, unless a producer adds an earlier one. `None`: the source is empty.
    pub next_due_ms: Option<i64>,
    pub members: Vec<RawClaimed>,
}

impl RawClaim {
    /// Member bytes claimed.
    pub fn bytes(&self) -> usize {
        self.members.iter().map(|m| m.member.len()).sum()
    }
}

/// Claims up to `batch` due members of a raw source for its two-phase sink, and at most
/// `max_bytes` of them (a single larger member alone).
pub async fn claim_raw(
    con: &mut Conn,
    keys: &RawKeys,
    unit: ScoreUnit,
    batch: usize,
    lease_ms: u64,
    max_payload: usize,
    max_bytes: usize,
) -> redis::RedisResult<RawClaim> {
    let now_ms = con.script_now_ms(None).await?;
    let value: Value = Call::new(&compiled::claim_raw)
        .key(&keys.source)
        .key(&keys.dead)
        .key(&keys.reasons)
        .key(&keys.claims)
        .arg(batch)
        .arg(unit.as_arg())
        .arg(lease_ms)
        .arg(max_payload)
        .arg(max_bytes)
        .arg(now_arg(now_ms))
        .invoke(con)
        .await?;
    let items = match value {
        Value::Array(items) if items.len() >= 7 => items,
        other => return Err(protocol_error("raw claim reply", &other)),
    };
    let mut it = items.into_iter();
    let mut next = || it.next().unwrap_or_default();
    let now_us = as_int(next())?;
    let deadline = as_string(next())?;
    let dead_implausible = as_int(next())? as u64;
    let dead_oversize = as_int(next())? as u64;
    let more = as_int(next())? == 1;
    let next_due_ms = optional_ms(next())?;
    let count = as_int(next())? as usize;
    let mut members = Vec::with_capacity(count);
    for _ in 0..count {
        members.push(RawClaimed {
            member: as_bytes(next())?,
            due_ms: as_int(next())?,
            attempts: as_int(next())? as u32,
            sha1: as_string(next())?,
        });
    }
    if members.iter().any(|m| m.sha1.is_empty()) {
        return Err(protocol_error("raw claim reply", &Value::Int(count as i64)));
    }
    Ok(RawClaim {
        now_us,
        deadline,
        dead_implausible,
        dead_oversize,
        more,
        next_due_ms,
        members,
    })
}

/// Settles raw members a sink claimed, fenced by the lease deadline they were claimed with.
/// The ops are those of `settle_jobs`; `Retry` and `Dead` ignore their envelope, and a
/// source has one route, so `Release` and `Due` both put a member back at its due.
pub async fn settle_raw(
    con: &mut Conn,
    keys: &RawKeys,
    unit: ScoreUnit,
    deadline: &str,
    ops: &[(&[u8], SettleOp<'_>)],
) -> redis::RedisResult<Settled> {
    let mut inv = Call::new(&compiled::settle_raw);
    inv.key(&keys.source)
        .key(&keys.dead)
        .key(&keys.reasons)
        .key(&keys.claims)
        .arg(deadline)
        .arg(unit.as_arg());
    for (member, op) in ops {
        match op {
            SettleOp::Ack => inv.arg("ack").arg(*member).arg("").arg(""),
            SettleOp::Retry { due_ms, .. } => inv.arg("retry").arg(*member).arg(*due_ms).arg(""),
            SettleOp::Release { due_ms, .. } | SettleOp::Due { due_ms } => {
                inv.arg("release").arg(*member).arg(*due_ms).arg("")
            }
            SettleOp::Dead { reason, .. } => inv.arg("dead").arg(*member).arg(*reason).arg(""),
        };
    }
    let (settled, fenced): (u64, u64) = inv.invoke(con).await?;
    Ok(Settled { settled, fenced })
}

/// What to do with one claimed job.
#[derive(Debug, Clone, PartialEq)]
pub enum SettleOp<'a> {
    /// Delivered: remove it.
    Ack,
    /// Back to due at `due_ms` with the envelope rewritten (attempt + 1, last error).
    Retry { due_ms: i64, envelope: &'a [u8] },
    /// Back to the ready set (`due_ms` = its scheduled due) in `sink`'s part, no attempt
    /// counted: its sink is unavailable and it waits for it there, or its route now names
    /// another sink (a hand-over).
    Release { due_ms: i64, sink: &'a str },
    /// Back to due at `due_ms` with its envelope unchanged, no attempt counted: its route is
    /// now a local list, which `move_due` pushes.
    Due { due_ms: i64 },
    /// To dead with `reason`; `envelope` replaces the stored one unless empty.
    Dead { reason: &'a str, envelope: &'a [u8] },
}

/// What `settle_jobs` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    pub settled: u64,
    /// Jobs whose lease was no longer the one they were claimed with: not touched.
    pub fenced: u64,
}

/// Settles jobs a sink's publisher claimed, fenced by the claim's token.
pub async fn settle_jobs(
    con: &mut Conn,
    keys: &ShardKeys,
    token: &str,
    ops: &[(&str, SettleOp<'_>)],
) -> redis::RedisResult<Settled> {
    let now_ms = con.script_now_ms(None).await?;
    let mut inv = fenced_invocation(&compiled::settle_jobs, "settle_jobs", keys);
    inv.key(&keys.unique).key(&keys.windows);
    inv.arg(token)
        .arg(&keys.wake_channel)
        .arg(keys.shard)
        .arg(now_arg(now_ms));
    // The acks first, by id alone: most of a batch, one argument each.
    let acked: Vec<&str> = ops
        .iter()
        .filter(|(_, op)| *op == SettleOp::Ack)
        .map(|(id, _)| *id)
        .collect();
    inv.arg(acked.len()).arg(acked);
    for (id, op) in ops {
        match op {
            SettleOp::Ack => continue,
            SettleOp::Retry { due_ms, envelope } => {
                inv.arg("retry").arg(*id).arg(*due_ms).arg(*envelope)
            }
            SettleOp::Release { due_ms, sink } => {
                inv.arg("release").arg(*id).arg(*due_ms).arg(*sink)
            }
            SettleOp::Due { due_ms } => inv.arg("due").arg(*id).arg(*due_ms).arg(""),
            SettleOp::Dead { reason, envelope } => {
                inv.arg("dead").arg(*id).arg(*reason).arg(*envelope)
            }
        };
    }
    let (settled, fenced): (u64, u64) = inv.invoke(con).await?;
    Ok(Settled { settled, fenced })
}

// ---------------------------------------------------------------------------------------
// Recurring schedules

/// What `upsert_schedule` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upserted {
    /// Written: the schedule's new version and its pending occurrence now (none: paused,
    /// ended).
    Written {
        version: u64,
        pending_ms: Option<i64>,
    },
    /// The schedule or its mark changed since it was read (now at this version): read again.
    Stale(u64),
}

/// What a schedule write does to its pending occurrence (`upsert_schedule.lua`, ARGV[7]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PendingWrite {
    /// The timing did not change: the pending occurrence stays as it is (the grid, and an
    /// occurrence already due, are kept).
    Keep,
    /// Like `Keep`, and nothing but the update time changed: when the stored envelope is the
    /// one sent too, nothing is written (the version stays, so re-applying unchanged
    /// schedules in a loop never fences a firing).
    Unchanged,
    /// Paused: no pending occurrence.
    Pause,
    /// Planned again: the next occurrence after the later of now and the mark (`None`: the
    /// definition has none). A pending occurrence already due stays, for the mover's plan.
    Next(Option<i64>),
}

/// One compare-and-set write of a schedule: definition, envelope and pending occurrence.
pub struct ScheduleWrite<'a> {
    pub id: &'a str,
    /// The version read (0: no schedule, or a definition without a readable version).
    pub expected_version: u64,
    /// The high-water mark read, as Redis printed it (`None`: none).
    pub read_mark: Option<&'a str>,
    pub definition: &'a str,
    /// Empty: keep the stored envelope.
    pub envelope: &'a [u8],
    pub pending: PendingWrite,
    /// Redis's clock as the writer read it: a new schedule's mark.
    pub now_ms: i64,
    /// Occurrences a firing wrote ahead of their time, read waiting, to take back (their job
    /// ids, and the mark to set: just before the earliest). Empty: none.
    pub withdraw: Withdraw<'a>,
}

/// Occurrences a firing wrote ahead of their time that a schedule write takes back: their
/// job ids, and the mark that goes with them (just before the earliest).
#[derive(Debug, Clone, Copy, Default)]
pub struct Withdraw<'a> {
    pub jobs: &'a [String],
    pub mark_ms: i64,
}

/// Creates or updates a schedule where `at` says, compare-and-set on the version and mark
/// `write` read (see `upsert_schedule.lua`).
pub async fn upsert_schedule(
    con: &mut Conn,
    at: SchedAt<'_>,
    write: &ScheduleWrite<'_>,
) -> redis::RedisResult<Upserted> {
    let mut inv = at.schedule_call(
        &compiled::upsert_schedule,
        "upsert_schedule",
        &compiled::upsert_schedule_lane,
    );
    inv.key(at.health_key());
    at.job_keys(&mut inv);
    let (wake_channel, wake_name) = at.wake();
    let pending = match write.pending {
        PendingWrite::Keep => "keep".to_owned(),
        PendingWrite::Unchanged => "same".to_owned(),
        PendingWrite::Pause => "pause".to_owned(),
        PendingWrite::Next(None) => "none".to_owned(),
        PendingWrite::Next(Some(ms)) => ms.to_string(),
    };
    inv.arg(write.id)
        .arg(write.expected_version)
        .arg(write.read_mark.unwrap_or_default())
        .arg(write.definition)
        .arg(write.envelope)
        .arg(pending)
        .arg(write.now_ms)
        .arg(wake_channel)
        .arg(wake_name);
    if !write.withdraw.jobs.is_empty() {
        inv.arg(write.withdraw.mark_ms);
        for job in write.withdraw.jobs {
            inv.arg(job);
        }
    }
    let reply: Vec<Value> = inv.invoke(con).await?;
    match <[Value; 2]>::try_from(reply) {
        Ok([Value::Int(-1), current]) => Ok(Upserted::Stale(as_int(current)? as u64)),
        Ok([Value::Int(version), pending]) if version > 0 => Ok(Upserted::Written {
            version: version as u64,
            pending_ms: score_ms(&as_string(pending)?),
        }),
        _ => Err(protocol_error("upsert_schedule reply", &Value::Nil)),
    }
}

/// Where a schedule is kept: in its id's shard (layout 1), or in its destination's route lane
/// (layout 2; `wake_channel` is the namespace's). The schedule scripts have a lane variant
/// (`*_lane.lua`) with the same body behind the lane's fence; this picks the call.
#[derive(Debug, Clone, Copy)]
pub enum SchedAt<'a> {
    Shard(&'a ShardKeys),
    Lane {
        lane: &'a Lane,
        wake_channel: &'a str,
    },
}

impl SchedAt<'_> {
    /// A call of `script` (its name `name`) on a shard, or of `lane_script` on a lane with
    /// the lane keys `lane_keys` picks, then the marker, and the expected marker as ARGV[1].
    fn call(
        &self,
        script: &'static Compiled,
        name: &str,
        lane_script: &'static Compiled,
        lane_keys: impl Fn(&crate::keys::LaneKeys) -> Vec<&String>,
    ) -> Call {
        match self {
            SchedAt::Shard(keys) => fenced_invocation(script, name, keys),
            SchedAt::Lane { lane, .. } => {
                let mut inv = Call::new(lane_script);
                for key in lane_keys(&lane.keys) {
                    inv.key(key);
                }
                inv.key(&lane.keys.marker).arg(lane.marker());
                inv
            }
        }
    }

    /// The wake channel, and the name a wake message gives this place.
    fn wake(&self) -> (&str, String) {
        match self {
            SchedAt::Shard(keys) => (&keys.wake_channel, keys.shard.to_string()),
            SchedAt::Lane { lane, wake_channel } => (wake_channel, lane.wake_name()),
        }
    }

    /// Where its schedules' health records are kept (taken after the marker).
    fn health_key(&self) -> &str {
        match self {
            SchedAt::Shard(keys) => &keys.sched_health,
            SchedAt::Lane { lane, .. } => &lane.keys.sched_health,
        }
    }

    /// Adds the keys an occurrence written ahead waits in as a job (upsert and delete withdraw
    /// it): a shard's due, jobs and max_lateness; a lane's due, jobs, meta, maxlate, large.
    fn job_keys(&self, inv: &mut Call) {
        let keys: [&String; 3];
        let lane_keys: [&String; 5];
        let list: &[&String] = match self {
            SchedAt::Shard(k) => {
                keys = [&k.due, &k.jobs, &k.max_lateness];
                &keys
            }
            SchedAt::Lane { lane, .. } => {
                let k = &lane.keys;
                lane_keys = [&k.due, &k.jobs, &k.meta, &k.maxlate, &k.large];
                &lane_keys
            }
        };
        for key in list {
            inv.key(*key);
        }
    }

    /// The call of a script on a schedule's own keys (upsert, delete).
    fn schedule_call(
        &self,
        script: &'static Compiled,
        name: &str,
        lane: &'static Compiled,
    ) -> Call {
        self.call(script, name, lane, |k| {
            vec![
                &k.schedules,
                &k.sched_env,
                &k.sched_due,
                &k.sched_fired,
                &k.sched_quarantine,
            ]
        })
    }
}

/// Deletes a schedule, its pending occurrence and any quarantine (its mark stays until it is
/// older than `mark_retention_ms`, as every mark pruned here), and withdraws the occurrences
/// `withdraw` names that still wait; whether it existed, or `None` when its mark is no longer
/// `read_mark` (a firing since: read again).
pub async fn delete_schedule(
    con: &mut Conn,
    at: SchedAt<'_>,
    id: &str,
    mark_retention_ms: u64,
    read_mark: Option<&str>,
    withdraw: &[String],
) -> redis::RedisResult<Option<bool>> {
    let mut inv = at.schedule_call(
        &compiled::delete_schedule,
        "delete_schedule",
        &compiled::delete_schedule_lane,
    );
    inv.key(at.health_key());
    at.job_keys(&mut inv);
    inv.arg(id)
        .arg(mark_retention_ms)
        .arg(read_mark.unwrap_or_default());
    for job in withdraw {
        inv.arg(job);
    }
    let deleted: i64 = inv.invoke(con).await?;
    Ok((deleted >= 0).then_some(deleted == 1))
}

/// Records that the schedule requests of `id` up to `seq` were applied, with their outcome
/// (`schedule_request_done.lua`); whether the request was removed (`false`: a newer one waits).
pub async fn schedule_request_done(
    con: &mut Conn,
    keys: &Keys,
    id: &str,
    seq: u64,
    outcome: &str,
) -> redis::RedisResult<bool> {
    let removed: i64 = Call::new(&compiled::schedule_request_done)
        .key(keys.schedule_requests())
        .key(keys.schedule_results())
        .arg(id)
        .arg(seq)
        .arg(outcome)
        .invoke(con)
        .await?;
    Ok(removed == 1)
}

/// Releases a lock taken with `SET NX PX` if `token` still holds it (`unlock.lua`).
pub async fn unlock(con: &mut Conn, lock: &str, token: &str) -> redis::RedisResult<bool> {
    let released: i64 = Call::new(&compiled::unlock)
        .key(lock)
        .arg(token)
        .invoke(con)
        .await?;
    Ok(released == 1)
}

/// A script's "now" argument: ms, or "" for Redis TIME.
fn now_arg(now_ms: Option<i64>) -> String {
    now_ms.map(|n| n.to_string()).unwrap_or_default()
}

/// `due` as the scripts take it, measured on the namespace's clock: a `+N` due gets a test
/// clock's offset added (the scripts add N to Redis TIME), with no I/O without one.
async fn clock_due_arg(con: &mut Conn, due: Due) -> redis::RedisResult<String> {
    Ok(match due {
        Due::In(d) if con.clock().is_test() => {
            let offset = u64::try_from(con.clock_offset_ms().await?).unwrap_or(0);
            Due::In(d + std::time::Duration::from_millis(offset)).as_arg()
        }
        other => other.as_arg(),
    })
}

/// Moves the namespace's test clock forward by `ms` (above 0) and wakes every daemon
/// (`advance_clock.lua`): answers the new offset, ms. A namespace without a test clock answers
/// the error `ZDELAY_NO_TEST_CLOCK`.
pub async fn advance_clock(con: &mut Conn, keys: &Keys, ms: u64) -> redis::RedisResult<i64> {
    Call::new(&compiled::advance_clock)
        .key(keys.schema())
        .arg(ms)
        .arg(keys.wake_channel())
        .invoke(con)
        .await
}

/// The most ended windows one `drop_ended_windows` call drops (about 0.3 ms of Redis).
pub const ENDED_WINDOWS_PER_CALL: u64 = 1_000;

/// Drops the unique windows and debounce deadlines that ended from the windows set `key`,
/// a bounded number per call, until none that ended is left; answers how many it dropped.
pub async fn drop_ended_windows(con: &mut Conn, key: &str) -> redis::RedisResult<u64> {
    let mut dropped = 0;
    loop {
        let (n, left): (u64, u64) = Call::new(&compiled::drop_ended_windows)
            .key(key)
            .arg(ENDED_WINDOWS_PER_CALL)
            .invoke(con)
            .await?;
        dropped += n;
        if left == 0 || n == 0 {
            return Ok(dropped);
        }
    }
}

/// A score as a time in ms: `None` unless it is a whole number of ms (a score written by
/// hand may be `1.5` or `-inf`).
pub fn score_ms(text: &str) -> Option<i64> {
    let score: f64 = text.parse().ok()?;
    let whole = score.is_finite() && score.fract() == 0.0 && score.abs() < 2f64.powi(63);
    whole.then_some(score as i64)
}

/// A schedule whose occurrence is due, as `due_schedules` read it.
#[derive(Debug, Clone, PartialEq)]
pub struct DueSchedule {
    pub id: String,
    /// Its pending occurrence as Redis printed the score: what `fire_schedules` fences on.
    pub score: String,
    /// `"<version>\n<definition JSON>"`; empty when missing.
    pub record: String,
}

/// Up to `batch` schedules of a shard due at `now_ms` (Redis TIME when `None`), and that now.
pub async fn due_schedules(
    con: &mut Conn,
    at: SchedAt<'_>,
    now_ms: Option<i64>,
    ahead_ms: u64,
    batch: usize,
) -> redis::RedisResult<(i64, Vec<DueSchedule>)> {
    let now_ms = con.script_now_ms(now_ms).await?;
    let mut inv = at.call(
        &compiled::due_schedules,
        "due_schedules",
        &compiled::due_schedules_lane,
        |k| vec![&k.schedules, &k.sched_due],
    );
    inv.arg(now_arg(now_ms)).arg(batch).arg(ahead_ms);
    let values: Vec<Value> = inv.invoke(con).await?;
    let mut it = values.into_iter();
    let now = as_int(it.next().unwrap_or_default())?;
    let mut due = Vec::new();
    while let (Some(id), Some(score), Some(record)) = (it.next(), it.next(), it.next()) {
        due.push(DueSchedule {
            id: as_string(id)?,
            score: as_string(score)?,
            record: as_string(record)?,
        });
    }
    Ok((now, due))
}

/// What to do with one due schedule (see `fire_schedules.lua`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Firing {
    pub id: String,
    /// The fence: its pending occurrence as read ([`DueSchedule::score`]) and its version
    /// as the script reads it (the digits before the first newline; empty when none).
    pub read_score: String,
    pub read_version: String,
    /// Raise its high-water mark to this (every occurrence up to it is decided).
    pub mark_ms: Option<i64>,
    /// The pending occurrence after this call (`None`: ended).
    pub next_ms: Option<i64>,
    pub max_lateness_ms: Option<u64>,
    /// Set: take it off its timeline with this reason instead (nothing else applies).
    pub quarantine: Option<String>,
    /// (job id, occurrence ms, due ms) to deliver: due later than the occurrence by the
    /// schedule's jitter.
    pub deliver: Vec<(String, i64, i64)>,
    /// (job id, occurrence ms) past their max lateness.
    pub expired: Vec<(String, i64)>,
    /// Occurrences this firing passes over by the misfire policy (neither delivered nor
    /// expired), added to the schedule's health record.
    pub missed: u64,
    /// Occurrences this firing passes over because the schedule's calendar excludes their
    /// date, added to the health record's `skipped_by_calendar` (the planner that applies a
    /// calendar sets it; 0 otherwise).
    pub skipped_by_calendar: u64,
}

/// Where a route lane's occurrences that are due go at once: straight onto its list, in the
/// firing script (`fire_schedules_lane`), instead of being written as jobs for its move.
#[derive(Debug, Clone, Copy)]
pub struct DirectPush<'a> {
    /// The lane's push: `LPUSH` or `RPUSH`.
    pub push: Push,
    /// The push's now, ms (a test clock's time, or a test's); `None` = Redis TIME.
    pub now_ms: Option<i64>,
    /// A larger payload waits as a job (its move sends it to dead).
    pub max_payload: usize,
    /// The lateness bucket bounds the pushed occurrences are counted in, ms, ascending.
    pub bounds_ms: &'a [u64],
}

/// What `fire_schedules` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fired {
    /// Occurrences written as jobs, due (the move delivers them).
    pub created: u64,
    /// Occurrences pushed straight onto the lane's list ([`DirectPush`]).
    pub pushed: u64,
    /// When they were pushed (the script's now, ms), their largest lateness, ms, and their
    /// count per lateness bucket (one more than the bounds; empty when none was pushed).
    pub pushed_now_ms: i64,
    pub pushed_max_lateness_ms: i64,
    pub pushed_buckets: Vec<u64>,
    pub expired: u64,
    pub fenced: u64,
    /// Occurrences passed over by a misfire policy, and skipped by calendar (as the firings
    /// said, for the schedules not fenced).
    pub missed: u64,
    pub skipped_by_calendar: u64,
    /// The schedules it quarantined, with why.
    pub quarantined: Vec<(String, String)>,
}

/// Runs `fire_schedules`: at most [`FIRE_MAX_OCCURRENCES`] occurrences over `firings` (the
/// script refuses more).
pub async fn fire_schedules(
    con: &mut Conn,
    at: SchedAt<'_>,
    now_ms: i64,
    mark_retention_ms: u64,
    firings: &[Firing],
    direct: Option<DirectPush<'_>>,
) -> redis::RedisResult<Fired> {
    let mut inv = at.call(
        &compiled::fire_schedules,
        "fire_schedules",
        &compiled::fire_schedules_lane,
        |k| {
            vec![
                &k.due,
                &k.jobs,
                &k.meta,
                &k.large,
                &k.dead,
                &k.reasons,
                &k.maxlate,
                &k.schedules,
                &k.sched_env,
                &k.sched_due,
                &k.sched_fired,
                &k.sched_quarantine,
            ]
        },
    );
    inv.key(at.health_key()).arg(now_ms).arg(mark_retention_ms);
    let text = |n: Option<i64>| n.map(|n| n.to_string()).unwrap_or_default();
    if let SchedAt::Lane { lane, .. } = at {
        inv.key(&lane.list);
        // A stream's entries carry the job's headers: its move writes them, never a push here.
        match direct.filter(|d| d.push != Push::Xadd) {
            Some(d) => {
                inv.arg(d.push.command())
                    .arg(text(d.now_ms))
                    .arg(d.max_payload)
                    .arg(d.bounds_ms.len());
                for b in d.bounds_ms {
                    inv.arg(b);
                }
            }
            None => {
                inv.arg("").arg("").arg(0).arg(0);
            }
        }
    }
    for f in firings {
        inv.arg(&f.id)
            .arg(&f.read_score)
            .arg(&f.read_version)
            .arg(text(f.mark_ms))
            .arg(text(f.next_ms))
            .arg(f.max_lateness_ms.map(|n| n.to_string()).unwrap_or_default())
            .arg(f.quarantine.as_deref().unwrap_or_default())
            .arg(f.missed)
            .arg(f.skipped_by_calendar)
            .arg(f.deliver.len());
        for (job, at, due) in &f.deliver {
            inv.arg(job).arg(at).arg(due);
        }
        inv.arg(f.expired.len());
        for (job, at) in &f.expired {
            inv.arg(job).arg(at);
        }
    }
    let reply: Vec<Value> = inv.invoke(con).await?;
    let mut it = reply.into_iter();
    let mut count = || -> redis::RedisResult<u64> {
        let v = it.next().unwrap_or_default();
        Ok(as_int(v)? as u64)
    };
    let (created, expired, fenced) = (count()?, count()?, count()?);
    let (missed, skipped_by_calendar) = (count()?, count()?);
    let (pushed, pushed_now_ms) = (count()?, count()? as i64);
    let pushed_max_lateness_ms = count()? as i64;
    let pushed_buckets = (0..count()?).map(|_| count()).collect::<Result<_, _>>()?;
    let mut quarantined = Vec::new();
    while let (Some(id), Some(reason)) = (it.next(), it.next()) {
        quarantined.push((as_string(id)?, as_string(reason)?));
    }
    Ok(Fired {
        created,
        pushed,
        pushed_now_ms,
        pushed_max_lateness_ms,
        pushed_buckets,
        expired,
        fenced,
        missed,
        skipped_by_calendar,
        quarantined,
    })
}

/// The most occurrences (delivered and expired) one `fire_schedules` call writes: a call
/// with 1000 occurrences runs a few milliseconds in Redis. Also in the script, which refuses
/// more.
pub const FIRE_MAX_OCCURRENCES: usize = 1000;

// ---------------------------------------------------------------------------------------
// Poller slots

/// How a process stands with its instance id's registration, as its heartbeat tells
/// `claim_slots`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// No heartbeat of this process has registered yet.
    New,
    /// Its last renewal is less than a lease old.
    Held,
    /// It registered once but could not renew for a whole lease.
    Lost,
}

impl Standing {
    fn as_arg(self) -> &'static str {
        match self {
            Standing::New => "new",
            Standing::Held => "held",
            Standing::Lost => "lost",
        }
    }
}

/// What a heartbeat did with the instance id's registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Registration {
    /// Registered, or renewed.
    #[default]
    Renewed,
    /// Took over a live registration of this id from another process (a previous life that
    /// could not hand back, or a duplicate, which then takes it back).
    TookOver,
    /// Took back the registration a newer process with this id had taken; that one refuses.
    TookBack,
    /// Another live process holds this id and did not give it up: this one must not run.
    InUse,
}

/// What an instance's heartbeat found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotClaim {
    pub registration: Registration,
    pub live_instances: u64,
    /// The targets this instance polls now, each once.
    pub targets: Vec<String>,
}

/// The times of a registration in the instances HASH (written by `claim_slots`):
/// (expiry ms, last heartbeat ms), by the Redis clock. Later fields (nonces) are the
/// scripts' own.
pub fn registration_times(value: &str) -> Option<(i64, i64)> {
    let mut fields = value.split(' ');
    let expiry = fields.next()?.parse().ok()?;
    let last = fields.next().and_then(|f| f.parse().ok()).unwrap_or(expiry);
    Some((expiry, last))
}

/// The zdelay version a registration (`{ns}:instances`) names: its fifth field, written
/// since this field exists (`None` for a daemon of an older build).
pub fn registration_version(value: &str) -> Option<&str> {
    value.split(' ').nth(4).filter(|v| !v.is_empty())
}

/// This process's registration: its instance id and the nonce it registers with.
#[derive(Debug, Clone, Copy)]
pub struct Registrant<'a> {
    pub instance: &'a str,
    pub nonce: &'a str,
}

/// What a daemon polls, as `claim_slots` plans it.
#[derive(Debug, Clone, Copy)]
pub struct PolledTargets<'a> {
    /// Shards `0..shards`, polled by every daemon (layout 2's spread shards on layout 2).
    pub shards: u16,
    /// This daemon's raw sources and route lanes, by slot name (`source:<key>`, `lane:<n>`).
    pub named: &'a [String],
}

/// Registers `me` (with the raw sources it is configured with) and plans who polls what
/// for every live instance; returns this instance's part (none when its id is in use).
pub async fn claim_slots(
    con: &mut Conn,
    keys: &Keys,
    me: Registrant<'_>,
    standing: Standing,
    lease_ms: u64,
    per_target: u8,
    targets: PolledTargets<'_>,
) -> redis::RedisResult<SlotClaim> {
    let values: Vec<Value> = Call::new(&compiled::claim_slots)
        .key(keys.instances())
        .key(keys.poller_slots())
        .key(keys.instance_sources())
        .key(keys.slot_plan())
        .arg(me.instance)
        .arg(lease_ms)
        .arg(per_target)
        .arg(targets.shards)
        .arg(me.nonce)
        .arg(standing.as_arg())
        .arg(super::VERSION)
        .arg(targets.named.join("\n"))
        .invoke(con)
        .await?;
    let mut it = values.into_iter();
    let registration = match as_int(it.next().unwrap_or_default())? {
        0 => Registration::Renewed,
        1 => Registration::TookOver,
        2 => Registration::TookBack,
        -1 => {
            return Ok(SlotClaim {
                registration: Registration::InUse,
                ..SlotClaim::default()
            });
        }
        other => {
            return Err(protocol_error(
                "claim_slots registration",
                &Value::Int(other),
            ));
        }
    };
    let live_instances = as_int(it.next().unwrap_or_default())? as u64;
    let targets = match it.next() {
        Some(joined) => as_string(joined)?
            .split('\n')
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect(),
        None => Vec::new(),
    };
    Ok(SlotClaim {
        registration,
        live_instances,
        targets,
    })
}

/// Hands back every slot `me` holds and unregisters it; returns how many it held, or `None`
/// when another process holds the registration (left alone).
pub async fn release_slots(
    con: &mut Conn,
    keys: &Keys,
    me: Registrant<'_>,
) -> redis::RedisResult<Option<u64>> {
    let released: i64 = Call::new(&compiled::release_slots)
        .key(keys.instances())
        .key(keys.poller_slots())
        .key(keys.instance_sources())
        .key(keys.slot_plan())
        .arg(me.instance)
        .arg(me.nonce)
        .invoke(con)
        .await?;
    Ok(u64::try_from(released).ok())
}

// ---------------------------------------------------------------------------------------
// Resharding (`crate::reshard`)

/// What a shard key holds per id: `Hash` fields or `Zset` members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanKind {
    Hash,
    Zset,
}

/// One page of the fields (hash) or members (zset) of `key`, from `cursor` ("0" to start):
/// the next cursor ("0" when complete), what the page held, values left out, and how many
/// bytes those values weighed (a hash's; Redis copied them to answer the scan).
pub async fn reshard_scan(
    con: &mut Conn,
    key: &str,
    kind: ScanKind,
    cursor: &str,
    count: usize,
) -> redis::RedisResult<(String, Vec<Vec<u8>>, usize)> {
    let kind = match kind {
        ScanKind::Hash => "hash",
        ScanKind::Zset => "zset",
    };
    let values: Vec<Value> = Call::new(&compiled::reshard_scan)
        .key(key)
        .arg(kind)
        .arg(cursor)
        .arg(count)
        .invoke(con)
        .await?;
    let mut it = values.into_iter();
    let cursor = as_string(it.next().unwrap_or_default())?;
    let bytes = as_int(it.next().unwrap_or_default())?;
    let items = it.map(as_bytes).collect::<Result<_, _>>()?;
    Ok((cursor, items, bytes.max(0) as usize))
}

/// Everything one shard stores about a job id, as `reshard_take` read it (scores as Redis
/// printed them). `ready` holds more members of the ready set found for the id besides
/// `ready_member`, which only a damaged shard has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredJob {
    pub id: Vec<u8>,
    pub due: Option<Vec<u8>>,
    pub envelope: Option<Vec<u8>>,
    pub inflight: Option<Vec<u8>>,
    pub dead: Option<Vec<u8>>,
    pub reason: Option<Vec<u8>>,
    pub scheduled: Option<Vec<u8>>,
    /// Its member in the ready set, from `ready_ids`.
    pub ready_member: Option<Vec<u8>>,
    pub max_lateness: Option<Vec<u8>>,
    /// For a schedule id: its definition, envelope and next occurrence.
    pub schedule: Option<Vec<u8>>,
    pub schedule_envelope: Option<Vec<u8>>,
    pub next_occurrence: Option<Vec<u8>>,
    /// For a schedule id: its high-water mark (also after a delete, until pruned) and why it
    /// is quarantined.
    pub sched_fired: Option<Vec<u8>>,
    pub sched_quarantine: Option<Vec<u8>>,
    /// Its earlier deaths (`history`), kept after a replay until the job is gone.
    pub history: Option<Vec<u8>>,
    pub ready: Vec<Vec<u8>>,
}

impl StoredJob {
    /// Values per id in `reshard_take`'s reply and `reshard_put`'s records.
    const VALUES: usize = 14;

    fn values(&self) -> [&Option<Vec<u8>>; Self::VALUES] {
        [
            &self.due,
            &self.envelope,
            &self.inflight,
            &self.dead,
            &self.reason,
            &self.scheduled,
            &self.ready_member,
            &self.max_lateness,
            &self.schedule,
            &self.schedule_envelope,
            &self.next_occurrence,
            &self.sched_fired,
            &self.sched_quarantine,
            &self.history,
        ]
    }

    /// Whether the shard holds nothing for this id.
    pub fn is_empty(&self) -> bool {
        self.values().iter().all(|v| v.is_none()) && self.ready.is_empty()
    }

    /// Bytes it carries (for sizing script calls).
    pub fn size(&self) -> usize {
        record_size(&self.id, &self.values()) + self.ready.iter().map(Vec::len).sum::<usize>()
    }
}

/// What `shard` stores about a prefix of `ids` (at most 1000), read while the reshard whose
/// marker is `marker` runs: the longest prefix whose envelopes, schedule envelopes and
/// histories weigh at most `max_bytes` together, and at least one id. The caller takes the
/// rest in further calls.
pub async fn reshard_take(
    con: &mut Conn,
    keys: &ShardKeys,
    marker: &str,
    max_bytes: usize,
    ids: &[Vec<u8>],
) -> redis::RedisResult<Vec<StoredJob>> {
    let mut inv = shard_invocation(&compiled::reshard_take, "reshard_take", keys);
    let values: Vec<Option<Vec<u8>>> = inv.arg(marker).arg(max_bytes).arg(ids).invoke(con).await?;
    let taken = values.len() / StoredJob::VALUES;
    if !values.len().is_multiple_of(StoredJob::VALUES)
        || taken > ids.len()
        || (taken == 0) != ids.is_empty()
    {
        return Err(protocol_error(
            "reshard_take",
            &Value::Int(values.len() as i64),
        ));
    }
    Ok(ids
        .iter()
        .zip(values.chunks(StoredJob::VALUES))
        .map(|(id, v)| StoredJob {
            id: id.clone(),
            due: v[0].clone(),
            envelope: v[1].clone(),
            inflight: v[2].clone(),
            dead: v[3].clone(),
            reason: v[4].clone(),
            scheduled: v[5].clone(),
            ready_member: v[6].clone(),
            max_lateness: v[7].clone(),
            schedule: v[8].clone(),
            schedule_envelope: v[9].clone(),
            next_occurrence: v[10].clone(),
            sched_fired: v[11].clone(),
            sched_quarantine: v[12].clone(),
            history: v[13].clone(),
            ready: Vec::new(),
        })
        .collect())
}

/// How `reshard_put` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    /// Every record, overwriting (a reshard: the namespace is frozen, a re-run writes the
    /// same values).
    Copy,
    /// Each id at most once, ever, recorded in the target's `transit_in` (an upgrade: the
    /// target's movers run, so a job written twice could be delivered twice); an id the
    /// target already holds stays as it is.
    Transit,
}

/// What a put wrote and skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Put {
    pub written: u64,
    /// Ids an earlier run put (transit only).
    pub put_before: u64,
    /// Ids the target already held as another job or schedule (transit only).
    pub held: u64,
}

impl redis::FromRedisValue for Put {
    fn from_redis_value(v: Value) -> Result<Self, redis::ParsingError> {
        let (written, put_before, held) = <(u64, u64, u64)>::from_redis_value(v)?;
        Ok(Put {
            written,
            put_before,
            held,
        })
    }
}

/// Writes `jobs` into the shard of `keys` (see [`PutMode`]).
pub async fn reshard_put(
    con: &mut Conn,
    keys: &ShardKeys,
    marker: &str,
    mode: PutMode,
    jobs: &[StoredJob],
) -> redis::RedisResult<Put> {
    let mut inv = shard_invocation(&compiled::reshard_put, "reshard_put", keys);
    inv.key(&keys.transit_in).arg(marker).arg(match mode {
        PutMode::Copy => "copy",
        PutMode::Transit => "transit",
    });
    for job in jobs {
        add_record(&mut inv, &job.id, &job.values());
        inv.arg(job.ready.len()).arg(&job.ready);
    }
    inv.invoke(con).await
}

/// One job, dead job or schedule of a local route as a lane keeps it, for `upgrade_put_lane`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaneRecord {
    pub id: Vec<u8>,
    pub due: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub meta: Option<Vec<u8>>,
    pub max_lateness: Option<Vec<u8>>,
    pub dead: Option<Vec<u8>>,
    pub reason: Option<Vec<u8>>,
    pub history: Option<Vec<u8>>,
    pub schedule: Option<Vec<u8>>,
    pub schedule_envelope: Option<Vec<u8>>,
    pub next_occurrence: Option<Vec<u8>>,
    pub sched_fired: Option<Vec<u8>>,
    pub sched_quarantine: Option<Vec<u8>>,
    /// A waiting job's unique_for window, ms (its `unique` entry).
    pub unique_for: Option<Vec<u8>>,
}

impl LaneRecord {
    fn values(&self) -> [&Option<Vec<u8>>; 13] {
        [
            &self.due,
            &self.payload,
            &self.meta,
            &self.max_lateness,
            &self.dead,
            &self.reason,
            &self.history,
            &self.schedule,
            &self.schedule_envelope,
            &self.next_occurrence,
            &self.sched_fired,
            &self.sched_quarantine,
            &self.unique_for,
        ]
    }

    /// Bytes it carries (for sizing script calls).
    pub fn size(&self) -> usize {
        record_size(&self.id, &self.values())
    }
}

/// Writes `records` into `lane`, each id at most once, ever (see [`PutMode::Transit`]).
/// `lock`: a relocation's lock token (refused with `ZDELAY_RELOCATING` unless it still holds
/// the lane's relocation lock, which is extended); `None` for the upgrade.
pub async fn upgrade_put_lane(
    con: &mut Conn,
    lane: &Lane,
    lock: Option<&str>,
    records: &[LaneRecord],
) -> redis::RedisResult<Put> {
    let k = &lane.keys;
    let mut inv = Call::new(&compiled::upgrade_put_lane);
    for key in k
        .held()
        .into_iter()
        .chain([&k.transit_in, &k.relocating, &k.marker, &k.unique])
    {
        inv.key(key);
    }
    inv.arg(lane.marker()).arg(lock.unwrap_or(""));
    for record in records {
        add_record(&mut inv, &record.id, &record.values());
    }
    inv.invoke(con).await
}

/// The bytes a record's id and values carry.
fn record_size(id: &[u8], values: &[&Option<Vec<u8>>]) -> usize {
    id.len()
        + values
            .iter()
            .map(|v| v.as_ref().map_or(0, Vec::len))
            .sum::<usize>()
}

/// A record's arguments: its id, a mask with "1" where a value is present, then the values
/// ("" where absent).
fn add_record(inv: &mut Call, id: &[u8], values: &[&Option<Vec<u8>>]) {
    let mask: String = values
        .iter()
        .map(|v| if v.is_some() { '1' } else { '0' })
        .collect();
    inv.arg(id).arg(mask);
    for v in values {
        inv.arg(v.as_deref().unwrap_or_default());
    }
}

/// Deletes every trace of `jobs`' ids from the shard of `keys`; returns how many entries it
/// deleted, over every key.
pub async fn reshard_drop(
    con: &mut Conn,
    keys: &ShardKeys,
    marker: &str,
    jobs: &[StoredJob],
) -> redis::RedisResult<u64> {
    let mut inv = shard_invocation(&compiled::reshard_drop, "reshard_drop", keys);
    inv.arg(marker);
    for job in jobs {
        inv.arg(&job.id).arg(job.ready.len()).arg(&job.ready);
    }
    inv.invoke(con).await
}

// ---------------------------------------------------------------------------------------
// Benchmark baselines

/// The least a ZSET → LIST move can do: up to `batch` members scored ≤ `max_score`.
pub async fn bench_bare_move_raw(
    con: &mut Conn,
    source: &str,
    list: &str,
    batch: usize,
    max_score: i64,
) -> redis::RedisResult<u64> {
    Call::new(&compiled::bench_bare_move_raw)
        .key(source)
        .key(list)
        .arg(batch)
        .arg(max_score)
        .invoke(con)
        .await
}

/// The bare raw move plus the checks a raw source cannot skip: up to `batch` members scored
/// ≤ `max_score`, each within `max_payload` bytes, read in chunks within `batch_bytes`.
pub async fn bench_bare_move_raw_checked(
    con: &mut Conn,
    source: &str,
    list: &str,
    (batch, max_score): (usize, i64),
    (max_payload, batch_bytes): (usize, usize),
) -> redis::RedisResult<u64> {
    Call::new(&compiled::bench_bare_move_raw_checked)
        .key(source)
        .key(list)
        .arg(batch)
        .arg(max_score)
        .arg(max_payload)
        .arg(batch_bytes)
        .invoke(con)
        .await
}

/// What `register_lane` did with a route's registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaneChange {
    /// First registration: a new lane.
    New,
    /// Registered as it was.
    Same,
    /// Same slot, another list key or push command: the lane stays, its marker changes.
    Updated,
    /// Its list moved to another slot: a new lane; the old one (this number) is retired.
    Moved { from: String },
    /// A producer's registration ([`Registering::Missing`]) of a route registered otherwise:
    /// nothing was written. `registered`: the registry's entry (`<lane> local <slot> <push>
    /// <list>`, or `sink <sink>` for a two-phase route).
    Differs { registered: String },
}

/// Who registers, and so what a registration may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registering {
    /// A daemon (or `zdelay upgrade`): the registry follows its config.
    Daemon,
    /// A producer given the config: it registers what the registry lacks and changes nothing.
    Missing,
}

impl Registering {
    fn mode(self) -> &'static str {
        match self {
            Registering::Daemon => "",
            Registering::Missing => "missing",
        }
    }
}

/// Registers a local route's lane in `registry` (see `register_lane.lua`): its lane number
/// in base 36 and what changed. `successor`: the number taken for the new lane when the
/// route's list moved to another slot (the old lane was retired naming it).
#[allow(clippy::too_many_arguments)]
pub async fn register_lane(
    con: &mut Conn,
    registry: &str,
    route: &str,
    slot: u16,
    push: Push,
    list: &str,
    successor: Option<&str>,
    who: Registering,
) -> redis::RedisResult<(String, LaneChange)> {
    let (lane, change, from): (String, String, String) = Call::new(&compiled::register_lane)
        .key(registry)
        .arg(route)
        .arg(slot)
        .arg(push.command())
        .arg(list)
        .arg(successor.unwrap_or(""))
        .arg(who.mode())
        .invoke(con)
        .await?;
    let change = match change.as_str() {
        "new" => LaneChange::New,
        "same" => LaneChange::Same,
        "updated" => LaneChange::Updated,
        "moved" => LaneChange::Moved { from },
        "differs" => LaneChange::Differs { registered: from },
        other => {
            return Err(protocol_error(
                "register_lane reply",
                &Value::SimpleString(other.to_owned()),
            ));
        }
    };
    Ok((lane, change))
}

/// Registers two-phase routes (route, sink) and two-phase sinks in `registry` (see
/// `register_two_phase.lua`). `Some((route, registered entry))`: a producer's registration
/// ([`Registering::Missing`]) met a route registered otherwise, and wrote nothing.
pub async fn register_two_phase(
    con: &mut Conn,
    registry: &str,
    routes: &[(String, String)],
    sinks: &[String],
    who: Registering,
) -> redis::RedisResult<Option<(String, String)>> {
    let mut call = Call::new(&compiled::register_two_phase);
    call.key(registry).arg(who.mode()).arg(routes.len());
    for (route, sink) in routes {
        call.arg(route).arg(sink);
    }
    for sink in sinks {
        call.arg(sink);
    }
    let reply: Vec<String> = call.invoke(con).await?;
    match <[String; 2]>::try_from(reply) {
        Ok([route, registered]) => Ok(Some((route, registered))),
        Err(reply) if reply.is_empty() => Ok(None),
        Err(reply) => Err(protocol_error(
            "register_two_phase reply",
            &Value::SimpleString(reply.join(" ")),
        )),
    }
}

/// What a lane held when [`retire_lane`] retired it: what the relocation moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneHolds {
    pub waiting: u64,
    pub dead: u64,
    pub schedules: u64,
    /// Payloads stored (waiting and dead jobs' alike).
    pub stored: u64,
}

/// Retires `lane` (its route's list moved to another slot) naming `successor`
/// (`retire_lane.lua`): every lane script refuses it from then on, so what it holds stays
/// put for the relocation. Returns what it holds.
pub async fn retire_lane(
    con: &mut Conn,
    lane: &Lane,
    successor: &str,
) -> redis::RedisResult<LaneHolds> {
    let k = &lane.keys;
    let reply: Vec<u64> = Call::new(&compiled::retire_lane)
        .key(&k.due)
        .key(&k.jobs)
        .key(&k.dead)
        .key(&k.schedules)
        .key(&k.marker)
        .arg(lane.marker())
        .arg(successor)
        .invoke(con)
        .await?;
    match reply[..] {
        [waiting, dead, schedules, stored] => Ok(LaneHolds {
            waiting,
            dead,
            schedules,
            stored,
        }),
        _ => Err(protocol_error(
            "retire_lane reply",
            &Value::Array(reply.into_iter().map(|n| Value::Int(n as i64)).collect()),
        )),
    }
}

/// Forgets `ids` (stored ids) from the retired lane with keys `k` and marker `marker`, or,
/// with no ids, ends it once it holds nothing (`relocate_drop_lane.lua`): the number of ids
/// forgotten; ending, 1 when ended, 2 when leftovers remain (call again), 0 when it still
/// holds something.
pub async fn relocate_drop_lane(
    con: &mut Conn,
    k: &crate::keys::LaneKeys,
    marker: &str,
    ids: &[Vec<u8>],
) -> redis::RedisResult<u64> {
    let mut inv = Call::new(&compiled::relocate_drop_lane);
    for key in
        k.held()
            .into_iter()
            .chain([&k.windows, &k.transit_in, &k.flow, &k.marker, &k.unique])
    {
        inv.key(key);
    }
    inv.arg(marker);
    for id in ids {
        inv.arg(id);
    }
    inv.invoke(con).await
}

/// Sends up to `batch` due jobs of `lane` to dead with `reason` (`route_gone_lane.lua`): its
/// route is in no running daemon's config. Returns how many, and whether more are due.
pub async fn route_gone_lane(
    con: &mut Conn,
    lane: &Lane,
    batch: usize,
    now_ms: Option<i64>,
    reason: &str,
) -> redis::RedisResult<(u64, bool)> {
    let k = &lane.keys;
    let (dead, more): (u64, u8) = Call::new(&compiled::route_gone_lane)
        .key(&k.due)
        .key(&k.maxlate)
        .key(&k.large)
        .key(&k.dead)
        .key(&k.reasons)
        .key(&k.marker)
        .key(&k.unique)
        .key(&k.windows)
        .arg(lane.marker())
        .arg(batch)
        .arg(now_ms.map(|n| n.to_string()).unwrap_or_default())
        .arg(reason)
        .invoke(con)
        .await?;
    Ok((dead, more == 1))
}

/// One job for a route lane (`enqueue_lane`).
pub struct LaneItem<'a> {
    /// The stored id (the lane is in the keys).
    pub id: &'a str,
    pub due: Due,
    pub payload: &'a [u8],
    /// Meta JSON, for a job whose meta is not all defaults.
    pub meta: Option<&'a str>,
    pub max_lateness_ms: Option<u64>,
    /// Remembered this long once delivered or dead; ms.
    pub unique_for_ms: Option<u64>,
}

/// Adds jobs to `lane` (see `enqueue_lane.lua`): one answer per item, `None` when the id
/// exists and the policy is `Error` (nothing written for it). A lane whose marker is not
/// `lane`'s refuses the whole call, writing nothing.
pub async fn enqueue_lane(
    con: &mut Conn,
    lane: &Lane,
    policy: OnConflict,
    wake_channel: &str,
    items: &[LaneItem<'_>],
) -> redis::RedisResult<Vec<Option<Enqueued>>> {
    // A test clock's offset (no I/O without one), read once for the whole call.
    let clock = match con.clock().is_test() {
        true => Some(con.clock_offset_ms().await?),
        false => None,
    };
    let k = &lane.keys;
    let mut answers = Vec::with_capacity(items.len());
    // The unique window is one per call: the items go in runs of one window each.
    for run in items.chunk_by(|a, b| a.unique_for_ms == b.unique_for_ms) {
        let mut inv = Call::new(&compiled::enqueue_lane);
        inv.key(&k.due)
            .key(&k.jobs)
            .key(&k.meta)
            .key(&k.maxlate)
            .key(&k.large)
            .key(&k.dead)
            .key(&k.reasons)
            .key(&k.marker);
        if needs_windows(policy, run[0].unique_for_ms) {
            inv.key(&k.unique).key(&k.windows);
        }
        inv.arg(lane.marker())
            .arg(policy.as_arg(run[0].unique_for_ms, clock))
            .arg(wake_channel)
            .arg(lane.wake_name());
        for item in run {
            inv.arg(item.id)
                .arg(item.due.as_arg())
                .arg(item.payload)
                .arg(item.meta.unwrap_or_default())
                .arg(
                    item.max_lateness_ms
                        .map(|ms| ms.to_string())
                        .unwrap_or_default(),
                );
        }
        let codes: Vec<i64> = inv.invoke(con).await?;
        answers.extend(codes.into_iter().map(enqueued_of));
    }
    Ok(answers)
}

/// One `move_lane` call's limits.
pub struct MoveLane<'a> {
    pub batch: usize,
    /// Overrides Redis `TIME` (tests drive time with it).
    pub now_ms: Option<i64>,
    pub max_payload: usize,
    /// Payload bytes the call reads at most (a single larger payload moves alone).
    pub batch_bytes: usize,
    /// Lateness bucket bounds, ms ascending.
    pub bounds_ms: &'a [u64],
    /// The route's flow control, when it has any.
    pub flow: Option<&'a crate::config::RouteFlow>,
    /// A stream route's trimming, when it has any.
    pub trim: Option<&'a crate::config::StreamTrim>,
}

/// How long a route held by its list's bound waits before it looks at the list again.
pub const HOLD_RECHECK_MS: u64 = 50;

/// Pushes a batch of `lane`'s due jobs onto its list (see `move_lane.lua`). The reply has
/// `move_due`'s shape for one route and no two-phase sink, then the flow control's counts.
pub async fn move_lane(
    con: &mut Conn,
    lane: &Lane,
    args: &MoveLane<'_>,
) -> redis::RedisResult<MoveReply> {
    let now_ms = con.script_now_ms(args.now_ms).await?;
    let k = &lane.keys;
    let mut inv = Call::new(&compiled::move_lane);
    inv.key(&k.due)
        .key(&k.jobs)
        .key(&k.meta)
        .key(&k.maxlate)
        .key(&k.large)
        .key(&k.dead)
        .key(&k.reasons)
        .key(&k.sched_due)
        .key(&lane.list)
        .key(&k.flow)
        .key(&k.marker)
        .key(&k.unique)
        .key(&k.windows);
    let flow = args.flow;
    inv.arg(lane.marker())
        .arg(args.batch)
        .arg(now_arg(now_ms))
        .arg(args.max_payload)
        .arg(args.batch_bytes)
        .arg(lane.push.command())
        .arg(args.bounds_ms.len())
        .arg(args.bounds_ms)
        .arg(
            flow.and_then(|f| f.rate_per_s)
                .map(|r| r.to_string())
                .unwrap_or_default(),
        )
        .arg(flow.map_or(0, |f| f.burst))
        .arg(
            flow.and_then(|f| f.max_length)
                .map(|n| n.to_string())
                .unwrap_or_default(),
        )
        .arg(HOLD_RECHECK_MS);
    match flow.and_then(|f| f.per_key.as_ref()) {
        Some((header, rate, burst)) => inv.arg(header).arg(rate.to_string()).arg(burst),
        None => inv.arg("").arg("").arg(""),
    };
    let optional = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
    inv.arg(optional(args.trim.and_then(|t| t.max_len)))
        .arg(optional(args.trim.and_then(|t| t.max_age_ms)));
    let value: Value = inv.invoke(con).await?;
    MoveReply::parse(value, 1, args.bounds_ms.len())
}

/// A job's answer from `take_keys`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyTurn {
    /// Its key had a token: it goes now.
    Now,
    /// Its key had none: it goes at this turn (ms), whose token it took.
    Later(i64),
    /// It goes now, at the turn it was given earlier (ms): its wait since its due is deferral.
    Granted(i64),
}

/// Admits the jobs a publisher claimed from spread shard `shard` for two-phase route `route`
/// with a per-key rate, each by its key's bucket (`take_keys.lua`): `jobs` are (id, key)
/// pairs; the answers are in their order. `now_ms` overrides Redis `TIME` (tests).
pub async fn take_keys(
    con: &mut Conn,
    keys: &Keys,
    route: &str,
    shard: u16,
    per_key: (f64, u32),
    now_ms: Option<i64>,
    jobs: &[(&str, &str)],
) -> redis::RedisResult<Vec<KeyTurn>> {
    let now_ms = con.script_now_ms(now_ms).await?;
    let mut inv = Call::new(&compiled::take_keys);
    inv.key(keys.route_flow(route))
        .key(keys.route_turns(route))
        .arg(shard)
        .arg(now_arg(now_ms))
        .arg(per_key.0.to_string())
        .arg(per_key.1);
    for (id, key) in jobs {
        inv.arg(*id).arg(*key);
    }
    let reply: Vec<i64> = inv.invoke(con).await?;
    if reply.len() != jobs.len() + 1 {
        return Err(protocol_error(
            "take_keys reply",
            &Value::Array(reply.into_iter().map(Value::Int).collect()),
        ));
    }
    Ok(reply[1..]
        .iter()
        .map(|&t| match t {
            0 => KeyTurn::Now,
            t if t > 0 => KeyTurn::Later(t),
            t => KeyTurn::Granted(-t),
        })
        .collect())
}

/// One `take_flow` call: a spread shard's publisher asks a two-phase route's flow hash for
/// leave to claim from the route's part of the shard's ready set.
#[derive(Debug, Clone, Copy)]
pub struct TakeFlow<'a> {
    pub shard: u16,
    /// Jobs the caller would claim now (0: only give back).
    pub want: usize,
    /// Tokens an earlier grant to this caller that its claim did not use.
    pub give_back: usize,
    /// What that claim found.
    pub found: Found,
    /// Overrides Redis `TIME` (tests drive time with it).
    pub now_ms: Option<i64>,
    /// The route's rate and burst, if it has a rate.
    pub rate: Option<(f64, u32)>,
    /// A bounded route's admission lock: the caller's token and how long a grant holds it.
    pub lock: Option<(&'a str, u64)>,
    /// Release the lock (after the claim's jobs were published).
    pub release: bool,
}

/// What a claim found in a flow part, reported with its give back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Nothing,
    /// Nothing more waits in the shard's part: its hold ends.
    CaughtUp,
    /// The destination had no room: the part is held.
    Held,
}

/// What `take_flow` granted.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowTaken {
    pub granted: usize,
    pub now_ms: i64,
    /// When less than asked was granted: when to ask again (ms).
    pub wake_ms: Option<i64>,
    /// Since when (ms) the route's part in this shard is held, if it is.
    pub held_since_ms: Option<i64>,
}

/// Asks the flow hash `flow_key` of a two-phase route for leave to claim (see
/// `take_flow.lua`).
pub async fn take_flow(
    con: &mut Conn,
    flow_key: &str,
    take: &TakeFlow<'_>,
) -> redis::RedisResult<FlowTaken> {
    let now_ms = con.script_now_ms(take.now_ms).await?;
    let mut inv = Call::new(&compiled::take_flow);
    let found = match take.found {
        Found::Nothing => "",
        Found::CaughtUp => "caught_up",
        Found::Held => "held",
    };
    let (rate, burst) = take
        .rate
        .map_or((String::new(), 0), |(r, b)| (r.to_string(), b));
    let (token, lock_ms) = take.lock.unwrap_or(("", 0));
    inv.key(flow_key)
        .arg(take.shard)
        .arg(take.want)
        .arg(take.give_back)
        .arg(found)
        .arg(now_arg(now_ms))
        .arg(rate)
        .arg(burst)
        .arg(token)
        .arg(lock_ms)
        .arg(if take.release { "1" } else { "" });
    let (granted, now_ms, wake, held): (usize, i64, String, String) = inv.invoke(con).await?;
    Ok(FlowTaken {
        granted,
        now_ms,
        wake_ms: wake.parse().ok(),
        held_since_ms: held.parse().ok(),
    })
}

/// Cancels the job `id` waiting in `lane` (see `cancel_lane.lua`): its payload, meta, max
/// lateness and large-set entry go with it. `false` when it is not waiting (delivered, dead,
/// cancelled or never enqueued): nothing changed, and a dead job stays dead. A lane whose
/// marker is not `lane`'s refuses the call, writing nothing.
pub async fn cancel_lane(con: &mut Conn, lane: &Lane, id: &str) -> redis::RedisResult<bool> {
    let k = &lane.keys;
    let cancelled: i64 = Call::new(&compiled::cancel_lane)
        .key(&k.due)
        .key(&k.jobs)
        .key(&k.meta)
        .key(&k.maxlate)
        .key(&k.large)
        .key(&k.marker)
        .key(&k.unique)
        .arg(lane.marker())
        .arg(id)
        .invoke(con)
        .await?;
    Ok(cancelled == 1)
}

/// Moves the job `id` waiting in `lane` to `due` (see `reschedule_lane.lua`), publishing
/// `<wake name> <due>` on `wake_channel` when that puts it before the lane's head. Its max
/// lateness stays. The new due ms, or `None` when the job is not waiting (nothing changed).
/// A lane whose marker is not `lane`'s refuses the call, writing nothing.
pub async fn reschedule_lane(
    con: &mut Conn,
    lane: &Lane,
    wake_channel: &str,
    id: &str,
    due: Due,
) -> redis::RedisResult<Option<i64>> {
    let due = clock_due_arg(con, due).await?;
    let k = &lane.keys;
    Call::new(&compiled::reschedule_lane)
        .key(&k.due)
        .key(&k.marker)
        .arg(lane.marker())
        .arg(id)
        .arg(due)
        .arg(wake_channel)
        .arg(lane.wake_name())
        .invoke(con)
        .await
}

/// The same for an id ZSET plus a payload HASH.
pub async fn bench_bare_move_hash(
    con: &mut Conn,
    due: &str,
    jobs: &str,
    list: &str,
    batch: usize,
    max_score: i64,
) -> redis::RedisResult<u64> {
    Call::new(&compiled::bench_bare_move_hash)
        .key(due)
        .key(jobs)
        .key(list)
        .arg(batch)
        .arg(max_score)
        .invoke(con)
        .await
}

/// The same onto a stream: one `XADD` per job with its payload and `<id>:<due>`.
pub async fn bench_bare_move_stream(
    con: &mut Conn,
    due: &str,
    jobs: &str,
    stream: &str,
    batch: usize,
    max_score: i64,
) -> redis::RedisResult<u64> {
    Call::new(&compiled::bench_bare_move_stream)
        .key(due)
        .key(jobs)
        .key(stream)
        .arg(batch)
        .arg(max_score)
        .invoke(con)
        .await
}

// ---------------------------------------------------------------------------------------
// Replies

/// Dead-letter kinds counted by `move_due`, in reply order.
pub const DUE_DEAD_KINDS: [&str; DEAD_KINDS] = [
    "malformed",
    "unknown_destination",
    "wrong_type",
    "oversize",
    "missing_envelope",
    "expired",
];
/// Dead-letter kinds counted by `move_raw`, in reply order (the last ones unused).
pub const RAW_DEAD_KINDS: [&str; DEAD_KINDS] =
    ["implausible_score", "wrong_type", "oversize", "", "", ""];
/// Dead-letter counts in a move reply.
pub const DEAD_KINDS: usize = 6;

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
    pub dead: [u64; DEAD_KINDS],
    /// Moved jobs per lateness bucket; one more than the bounds given.
    pub buckets: Vec<u64>,
    /// Expired leases returned to due by this call (`move_due` only).
    pub reaped: u64,
    /// Jobs queued in the ready set per two-phase sink, in the route table's sink order
    /// (`move_due` only).
    pub queued: Vec<u64>,
    /// When the shard's earliest schedule occurrence is due, ms (`move_due` only).
    pub next_schedule_ms: Option<i64>,
    /// What the walk of a sink's part of the ready set refiled (`move_due` only).
    pub refiled: Refiled,
    /// Where the walk resumes; `None` once the sink's part was walked to its end.
    pub walk_next: Option<String>,
    /// The earliest lease deadline of the shard's claimed jobs, ms (`move_due` only).
    pub next_lease_ms: Option<i64>,
    /// Jobs moved after waiting while their route was held (`move_lane` only).
    pub deferred: u64,
    /// The time those jobs waited while the route was held, ms summed.
    pub deferral_ms: u64,
    /// Why the route is held after this call (`move_lane` only).
    pub held: Held,
    /// The jobs claimed for the caller's publishers, per part (`move_due` only).
    pub claimed: Vec<PartClaim>,
    /// The part (index in `Routes::ready_parts` order) whose lack of room cut the batch: its
    /// jobs wait due until a publisher of it has room (`move_due` only).
    pub waits_for: Option<usize>,
}

/// Whether a route's flow control holds back due work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Held {
    #[default]
    Flowing,
    /// By its rate: the bucket has no whole token.
    Rate,
    /// By its list's bound (`max_length`).
    MaxLength,
}

/// Jobs a walk of the ready set refiled by their route now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Refiled {
    /// Handed over to another sink's part (no attempt counted).
    pub to_sink: u64,
    /// Back to due (none since local routes keep their jobs in lanes: `move_due` answers 0).
    pub to_due: u64,
    /// To dead: nothing resolves their dest any more ("route gone: …"), or unreadable.
    pub dead: u64,
}

impl Refiled {
    pub fn total(&self) -> u64 {
        self.to_sink + self.to_due + self.dead
    }
}

impl MoveReply {
    pub fn moved_total(&self) -> u64 {
        self.moved.iter().sum()
    }

    /// Parses the reply with `moved_len` per-route counts and `bounds` lateness bounds.
    pub fn parse(value: Value, moved_len: usize, bounds: usize) -> redis::RedisResult<Self> {
        let fixed = 6 + moved_len + DEAD_KINDS + bounds + 1;
        // move_raw ends there; move_due adds the expired leases and the per-sink counts.
        let items = match value {
            Value::Array(items) if items.len() == fixed || items.len() >= fixed + 2 => items,
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
        let mut dead = [0u64; DEAD_KINDS];
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
        if let [reaped, sinks, tail @ ..] = rest.as_slice() {
            reply.reaped = as_int(reaped.clone())? as u64;
            let sinks = as_int(sinks.clone())? as usize;
            // Per sink, the schedules' head, the walk's three counts and where it resumes,
            // then the earliest lease deadline; a lane adds its flow control's counts.
            let (tail, flow) = match tail.len().checked_sub(sinks + 6) {
                Some(3) => tail.split_at(sinks + 6),
                _ => (tail, &[][..]),
            };
            if let [deferred, deferral_ms, held] = flow {
                reply.deferred = as_int(deferred.clone())? as u64;
                reply.deferral_ms = as_int(deferral_ms.clone())? as u64;
                reply.held = match as_int(held.clone())? {
                    1 => Held::Rate,
                    2 => Held::MaxLength,
                    _ => Held::Flowing,
                };
            }
            if tail.len() != sinks + 6 {
                return Err(protocol_error(
                    "move_due reply tail",
                    &Value::Int(sinks as i64),
                ));
            }
            let (queued, tail) = tail.split_at(sinks);
            reply.queued = queued
                .iter()
                .map(|v| as_int(v.clone()).map(|n| n as u64))
                .collect::<Result<_, _>>()?;
            // A score written by hand may be fractional or infinite: still a time, so the
            // mover fires it and firing quarantines it.
            reply.next_schedule_ms = as_string(tail[0].clone())?
                .parse::<f64>()
                .ok()
                .map(|ms| ms.floor() as i64);
            reply.refiled = Refiled {
                to_sink: as_int(tail[1].clone())? as u64,
                to_due: as_int(tail[2].clone())? as u64,
                dead: as_int(tail[3].clone())? as u64,
            };
            reply.walk_next = Some(as_string(tail[4].clone())?).filter(|s| !s.is_empty());
            reply.next_lease_ms = as_string(tail[5].clone())?
                .parse::<f64>()
                .ok()
                .map(|ms| ms.ceil() as i64);
        }
        Ok(reply)
    }
}

fn as_bytes(v: Value) -> redis::RedisResult<Vec<u8>> {
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

fn as_int(v: Value) -> redis::RedisResult<i64> {
    match v {
        Value::Int(n) => Ok(n),
        Value::BulkString(b) => std::str::from_utf8(&b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| protocol_error("integer", &Value::BulkString(b))),
        other => Err(protocol_error("integer", &other)),
    }
}

fn as_string(v: Value) -> redis::RedisResult<String> {
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

    /// (index, name) of each `-- KEYS[i] <name> …` header line.
    fn header_keys(source: &str) -> Vec<(usize, String)> {
        source
            .lines()
            .take_while(|l| l.starts_with("--"))
            .filter_map(|l| {
                let rest = l.strip_prefix("-- KEYS[")?;
                let (index, rest) = rest.split_once(']')?;
                let name = rest.split_whitespace().next()?;
                Some((index.parse().ok()?, name.to_owned()))
            })
            .collect()
    }

    #[test]
    fn every_script_takes_shard_keys_in_the_one_order() {
        for (name, keys) in SHARD_KEYS {
            let mut all = ShardKey::ALL.iter();
            assert!(
                keys.iter().all(|k| all.any(|a| a == k)),
                "{name}: {keys:?} is not in the order of ShardKey::ALL"
            );
        }
    }

    #[test]
    fn shard_scripts_take_their_keys_in_the_declared_order() {
        for (name, keys) in SHARD_KEYS {
            let (_, source) = ALL.iter().find(|(n, _)| n == name).expect("script exists");
            let header = header_keys(source);
            for (i, key) in keys.iter().enumerate() {
                assert!(
                    header.contains(&(i + 1, key.name().to_owned())),
                    "{name}: KEYS[{}] should be {} (header: {header:?})",
                    i + 1,
                    key.name()
                );
            }
        }
    }

    #[test]
    fn registrations_name_their_version_from_the_fifth_field() {
        assert_eq!(registration_version("20 10 n1 - 0.1.0"), Some("0.1.0"));
        assert_eq!(registration_version("20 10 n1 -"), None, "an older build's");
        assert_eq!(registration_times("20 10 n1 - 0.1.0"), Some((20, 10)));
    }

    #[test]
    fn the_lane_schedule_scripts_share_the_shard_ones_bodies() {
        // What follows the fence: everything after its closing `end`, the first line that is
        // only `end`.
        let body = |name: &str| {
            let (_, source) = ALL.iter().find(|(n, _)| *n == name).expect("script exists");
            let lines: Vec<&str> = source.lines().collect();
            let end = lines.iter().position(|l| *l == "end").expect("a fence");
            lines[end + 1..].join("\n")
        };
        for name in ["upsert_schedule", "delete_schedule", "due_schedules"] {
            assert_eq!(body(name), body(&format!("{name}_lane")), "{name}");
        }
    }

    #[test]
    fn lane_scripts_check_their_lane_marker_first() {
        let fenced = [
            ("enqueue_lane", 8),
            ("move_lane", 11),
            ("cancel_lane", 6),
            ("reschedule_lane", 2),
            ("peek_dead_lane", 6),
            ("replay_dead_lane", 7),
            ("purge_dead_lane", 6),
            ("prune_history_lane", 3),
            ("upsert_schedule_lane", 6),
            ("delete_schedule_lane", 6),
            ("due_schedules_lane", 3),
            ("fire_schedules_lane", 13),
            ("upgrade_put_lane", 16),
            ("relocate_drop_lane", 17),
            ("route_gone_lane", 6),
            ("get_lane", 7),
        ];
        // Every script on a lane's keys is fenced; the registry's own script takes none, and
        // retiring a lane accepts a retired marker too (a re-run).
        for (name, _) in ALL.iter().filter(|(n, _)| n.ends_with("_lane")) {
            assert!(
                *name == "register_lane"
                    || *name == "retire_lane"
                    || fenced.iter().any(|(f, _)| f == name),
                "{name}: a lane script missing from this test"
            );
        }
        for (name, marker_key) in fenced {
            let (_, source) = ALL.iter().find(|(n, _)| *n == name).expect("script exists");
            // The one fence (include lane_fence) in every lane script, on its last key: the
            // first thing that touches Redis (checks of the arguments alone may come before).
            assert!(
                source.contains(&format!(
                    "local lane_marker = KEYS[{marker_key}]\nlocal marker = redis.call('GET', lane_marker)"
                )),
                "{name}: the fence on KEYS[{marker_key}]"
            );
            let body = from_first_call(source);
            let fence = "local marker = redis.call('GET', lane_marker)
if marker ~= ARGV[1] then
  if not marker then return redis.error_reply('ZDELAY_NO_LANE no daemon registered this lane') end
  if string.sub(marker, 1, 8) == 'retired ' then
    return redis.error_reply('ZDELAY_LANE_MOVED ' .. string.sub(marker, 9))
  end
  return redis.error_reply('ZDELAY_LANE_CHANGED ' .. marker)
end";
            let fence: Vec<&str> = fence.lines().collect();
            assert_eq!(body.get(..fence.len()), Some(&fence[..]), "{name}");
            // After the marker, only the unique-window keys, which a producer may leave out.
            let after_marker = format!("-- KEYS[{}]", marker_key + 1);
            assert!(
                source.contains(&format!("-- KEYS[{marker_key}] marker"))
                    && source
                        .lines()
                        .filter(|l| l.starts_with(&after_marker))
                        .all(|l| {
                            matches!(l.split_whitespace().nth(2), Some("unique" | "sched_health"))
                        }),
                "{name}: the marker is its last key but the unique window's or health's"
            );
        }
    }

    /// A script's lines from the one holding its first Redis call (the fence's `local … =
    /// redis.call('GET', …)`) on: what comes before only checks the arguments.
    fn from_first_call(source: &str) -> Vec<&str> {
        source
            .lines()
            .skip_while(|l| !l.contains("redis.call("))
            .collect()
    }

    #[test]
    fn fenced_scripts_check_their_layout_marker_first() {
        for name in FENCED {
            let (_, keys) = SHARD_KEYS.iter().find(|(n, _)| n == name).expect("listed");
            assert_eq!(
                keys.last(),
                Some(&Layout),
                "{name}: the marker is its last shard key"
            );
            let (_, source) = ALL.iter().find(|(n, _)| n == name).expect("script exists");
            let body = from_first_call(source);
            // A newer layout's marker (`layout …`, `upgrading …`) is refused as such in every
            // script, before anything is read or written; only a settle lands while `zdelay
            // upgrade` or an online reshard moves the shard (both wait for them), so it has a
            // fence of its own. Every other script opens with the shard_fence include.
            let fence = if *name == "settle_jobs" {
                format!(
                    "local layout = redis.call('GET', KEYS[{}])
if layout and layout ~= ARGV[1] and string.sub(layout, 1, 10) ~= 'upgrading ' and not string.find(layout, '^%d+$') then
  local newer = string.match(layout, '^layout (.+)') or string.match(layout, '^upgrading (.+)')
  if newer then
    return redis.error_reply('ZDELAY_LAYOUT ' .. newer)
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end",
                    keys.len()
                )
            } else {
                assert!(
                    source.contains(&format!(
                        "local shard_marker = KEYS[{}]\nlocal shard_marker_now = \
                         redis.call('GET', shard_marker)",
                        keys.len()
                    )),
                    "{name}: names its marker, then includes shard_fence"
                );
                "local shard_marker_now = redis.call('GET', shard_marker)
if shard_marker_now and shard_marker_now ~= ARGV[1] then
  local newer = string.match(shard_marker_now, '^layout (.+)')
    or string.match(shard_marker_now, '^upgrading (.+)')
  if newer then return redis.error_reply('ZDELAY_LAYOUT ' .. newer) end
  return redis.error_reply('ZDELAY_RESHARDED ' .. shard_marker_now)
end"
                .to_owned()
            };
            let fence: Vec<&str> = fence.lines().collect();
            assert!(
                body.get(..fence.len()) == Some(&fence[..]),
                "{name}: the body opens with the layout fence on KEYS[{}]: {:?}",
                keys.len(),
                body.get(..fence.len())
            );
            assert!(
                source.contains("-- ARGV[1] the caller's shard count"),
                "{name}"
            );
        }
        // Every other shard script is zdelay reshard's own, checking the migration's marker.
        for (name, _) in SHARD_KEYS.iter().filter(|(n, _)| !FENCED.contains(n)) {
            let (_, source) = ALL.iter().find(|(n, _)| n == name).expect("script exists");
            assert!(source.contains("ZDELAY_NOT_MIGRATING"), "{name}");
        }
    }

    #[test]
    fn fire_schedules_refuses_more_occurrences_than_its_caller_sends() {
        let (_, source) = ALL.iter().find(|(n, _)| *n == "fire_schedules").unwrap();
        let bound = format!("local MAX_OCCURRENCES = {FIRE_MAX_OCCURRENCES}\n");
        assert!(
            source.contains(&bound),
            "the script's bound is the caller's"
        );
    }

    #[test]
    fn scores_are_times_only_when_whole_milliseconds() {
        assert_eq!(score_ms("1700000000000"), Some(1_700_000_000_000));
        assert_eq!(score_ms("-5"), Some(-5));
        for bad in ["1.5", "inf", "-inf", "nan", "", "x", "1e300"] {
            assert_eq!(score_ms(bad), None, "{bad}");
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
            Value::Int(1),
        ]);
        let mut due = match v.clone() {
            Value::Array(items) => items,
            _ => unreachable!(),
        };
        let r = MoveReply::parse(v, 2, 1).unwrap();
        assert_eq!(r.taken, 3);
        assert_eq!(r.next_due, Some(1_700_000_000_005.0));
        assert_eq!(r.moved, vec![2, 0]);
        assert_eq!(r.dead, [1, 0, 0, 0, 0, 1]);
        assert_eq!(r.buckets, vec![1, 1]);
        // move_due's tail: reaped leases, one sink's queued count, the schedules' head, the
        // walk's counts and where it resumes, the earliest lease deadline.
        due.extend([
            Value::Int(0),
            Value::Int(1),
            Value::Int(7),
            Value::BulkString(b"1700000000900".to_vec()),
            Value::Int(3),
            Value::Int(2),
            Value::Int(1),
            Value::BulkString(b"gone\n0000000000000001\na".to_vec()),
            Value::BulkString(b"1700000030000".to_vec()),
        ]);
        let mut short = due.clone();
        let r = MoveReply::parse(Value::Array(due), 2, 1).unwrap();
        assert_eq!(r.queued, vec![7]);
        assert_eq!(r.next_schedule_ms, Some(1_700_000_000_900));
        assert_eq!(
            r.refiled,
            Refiled {
                to_sink: 3,
                to_due: 2,
                dead: 1
            }
        );
        assert_eq!(r.walk_next.as_deref(), Some("gone\n0000000000000001\na"));
        assert_eq!(r.next_lease_ms, Some(1_700_000_030_000));
        short.pop();
        assert!(MoveReply::parse(Value::Array(short), 2, 1).is_err());
        assert!(MoveReply::parse(Value::Array(vec![]), 2, 1).is_err());
    }
}
