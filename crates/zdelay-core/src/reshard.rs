//! What moving stored jobs between shards needs, shared by `zdelay reshard` (the spread
//! shards get another count online: [`crate::reshard_spread`], the command's entry) and
//! `zdelay upgrade` ([`crate::upgrade`]): the options, counts, progress and errors of a run,
//! the live daemons, the counts per shard, paging through a shard's ids, and taking a job's
//! whole state out of a shard (`reshard_take`) to write it elsewhere before it is dropped
//! there (copy before delete, so a crash leaves a job in both places, identical, and the next
//! run finishes the move). Nothing here prints: progress goes to a callback.

use crate::config::MAX_SHARDS;
use crate::keys::Keys;
use crate::store::scripts::{self, ScanKind, StoredJob};
use crate::store::{self, Conn, StoreError};
use futures::{StreamExt, TryStreamExt};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Ids per `reshard_take` / `reshard_drop` call.
pub const DEFAULT_BATCH: usize = 500;
/// The most ids per call (the scripts unpack a batch into one command per key).
pub const MAX_BATCH: usize = 1000;
/// Old shards moved at once.
pub const DEFAULT_CONCURRENCY: usize = 4;
/// Largest COUNT hint of a scan page.
pub(crate) const SCAN_COUNT: usize = 1000;
/// What one scan page of a hash may copy in values (Redis 7.0's `HSCAN` cannot leave them
/// out): pages shrink towards one field when the values are large envelopes.
const SCAN_BYTES: usize = 1 << 20;
/// Largest payload of one `reshard_put` call, bytes (at least one job per call): a
/// megabyte of small jobs (about a thousand) held Redis 20-60 ms per call.
pub(crate) const PUT_BYTES: usize = 256 << 10;
/// Most bytes of envelopes (and schedule envelopes, histories) one `reshard_take` call reads,
/// and so one `reshard_drop` call frees (at least one job per call): a batch of ids whose
/// payloads weigh a megabyte each would otherwise hold Redis for seconds.
const TAKE_BYTES: usize = 1 << 20;
/// Entries per scan page of a shard's unique windows: an id and a number each.
pub(crate) const WINDOW_PAGE: usize = 500;
/// A scan page of a window key: the next cursor, and (member, value or score) pairs.
pub(crate) type WindowPage = (u64, Vec<(Vec<u8>, Vec<u8>)>);

/// A shard key of unique windows, as a reshard moves it.
pub(crate) struct WindowKey {
    pub(crate) key: fn(&crate::keys::ShardKeys) -> &String,
    /// The same key of a route lane.
    pub(crate) lane_key: fn(&crate::keys::LaneKeys) -> &String,
    pub(crate) scan: &'static str,
    /// Writes one entry into a shard: `HSET key field value` or `ZADD key score member`.
    pub(crate) copy: &'static str,
    /// The same, leaving an entry the shard holds already: the command, and a flag after
    /// the key (`HSETNX`, `ZADD key NX`).
    pub(crate) copy_new: (&'static str, Option<&'static str>),
    pub(crate) score_first: bool,
    pub(crate) delete: &'static str,
    /// The job id an entry belongs to.
    pub(crate) id: fn(&[u8]) -> Option<&[u8]>,
}

pub(crate) const WINDOW_KEYS: [WindowKey; 2] = [
    // `unique`: id → its window, while the job waits.
    WindowKey {
        key: |k| &k.unique,
        lane_key: |k| &k.unique,
        scan: "HSCAN",
        copy: "HSET",
        copy_new: ("HSETNX", None),
        score_first: false,
        delete: "HDEL",
        id: |id| Some(id),
    },
    // `windows`: `u:<id>` scored by its window's end, `d:<id>` by its debounce deadline.
    WindowKey {
        key: |k| &k.windows,
        lane_key: |k| &k.windows,
        scan: "ZSCAN",
        copy: "ZADD",
        copy_new: ("ZADD", Some("NX")),
        score_first: true,
        delete: "ZREM",
        id: |member| match member {
            [b'u' | b'd', b':', id @ ..] => Some(id),
            _ => None,
        },
    },
];
/// Round trips run at once for per-shard commands (counts, markers).
pub(crate) const PARALLEL: usize = 16;

/// What to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// The new shard count.
    pub to: u16,
    /// Check and count what would move; change nothing.
    pub dry_run: bool,
    /// Ids per script call, 1..=[`MAX_BATCH`].
    pub batch: usize,
    /// Old shards moved at once.
    pub concurrency: usize,
}

impl Options {
    pub fn new(to: u16) -> Self {
        Options {
            to,
            dry_run: false,
            batch: DEFAULT_BATCH,
            concurrency: DEFAULT_CONCURRENCY,
        }
    }
}

/// How many entries each kind of shard key holds, over a set of shards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    /// Envelopes (`:jobs`): one per stored job.
    pub jobs: u64,
    /// Scheduled or due, not yet moved (`:due`).
    pub due: u64,
    /// Claimed by a two-phase sink (`:inflight`).
    pub inflight: u64,
    /// Due and waiting for their two-phase sink (`:ready`; `ready_ids` indexes them).
    pub ready: u64,
    pub ready_ids: u64,
    pub dead: u64,
    pub reasons: u64,
    /// Scheduled dues kept for idempotency keys (`:scheduled`).
    pub scheduled: u64,
    /// Jobs with a max lateness (`:max_lateness`).
    pub max_lateness: u64,
    /// Recurring schedules (`:schedules`, `:sched_env`), their pending occurrences
    /// (`:sched_due`), high-water marks (`:sched_fired`, deleted schedules' too until
    /// pruned) and quarantines (`:sched_quarantine`).
    pub schedules: u64,
    pub sched_env: u64,
    pub sched_due: u64,
    pub sched_fired: u64,
    pub sched_quarantine: u64,
    /// Jobs with a history of earlier deaths (`:history`, written by dead replay).
    pub history: u64,
}

impl Counts {
    const FIELDS: usize = 15;

    fn array(&self) -> [u64; Self::FIELDS] {
        [
            self.jobs,
            self.due,
            self.inflight,
            self.ready,
            self.ready_ids,
            self.dead,
            self.reasons,
            self.scheduled,
            self.max_lateness,
            self.schedules,
            self.sched_env,
            self.sched_due,
            self.sched_fired,
            self.sched_quarantine,
            self.history,
        ]
    }

    fn from_array(a: [u64; Self::FIELDS]) -> Self {
        Counts {
            jobs: a[0],
            due: a[1],
            inflight: a[2],
            ready: a[3],
            ready_ids: a[4],
            dead: a[5],
            reasons: a[6],
            scheduled: a[7],
            max_lateness: a[8],
            schedules: a[9],
            sched_env: a[10],
            sched_due: a[11],
            sched_fired: a[12],
            sched_quarantine: a[13],
            history: a[14],
        }
    }

    fn add(&mut self, other: &Counts) {
        let (a, b) = (self.array(), other.array());
        *self = Counts::from_array(std::array::from_fn(|i| a[i] + b[i]));
    }

    /// As stored in the schema's `migrating_counts`: the numbers in field order.
    pub fn encode(&self) -> String {
        self.array().map(|n| n.to_string()).join(" ")
    }

    pub fn decode(text: &str) -> Option<Counts> {
        let numbers: Vec<u64> = text
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        Some(Counts::from_array(numbers.try_into().ok()?))
    }
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} jobs (due or scheduled {}, in flight {}, waiting for a sink {}, dead {}; \
             reasons {}, scheduled dues {}, ready index {}, lateness limits {}, death \
             histories {}), {} recurring schedules ({} envelopes, {} pending occurrences, {} \
             marks, {} quarantined)",
            self.jobs,
            self.due,
            self.inflight,
            self.ready,
            self.dead,
            self.reasons,
            self.scheduled,
            self.ready_ids,
            self.max_lateness,
            self.history,
            self.schedules,
            self.sched_env,
            self.sched_due,
            self.sched_fired,
            self.sched_quarantine
        )
    }
}

/// A daemon registered on the namespace.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Daemon {
    pub id: String,
    /// Ms since its last heartbeat (Redis clock).
    pub last_seen_ms: i64,
    /// Ms until its registration lapses if it stops beating.
    pub expires_in_ms: i64,
    /// The zdelay version it registered (none for builds that predate the field).
    pub version: Option<String>,
}

/// What happens as a reshard runs, for the caller to show. The order is the order below.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    /// Starting (or resuming an unfinished reshard).
    Start { from: u16, to: u16, resumed: bool },
    /// Something the operator should know; the reshard goes on.
    Warning(String),
    /// The namespace is frozen; these are its counts.
    Frozen { counts: Counts },
    /// Layout 2: producers and daemons use the new count from now on; the old spread shards
    /// are fenced and hold these counts, to be moved.
    Fenced { counts: Counts },
    /// `jobs` jobs of `shard` were written into their new shards, not yet deleted from it.
    Copied { shard: u16, jobs: usize },
    /// Jobs moved so far, over every shard.
    Moved { total: u64 },
    /// Nothing of `shard` is left to move; `moved` jobs left it (layout 2: 0, not counted
    /// per shard).
    ShardDone { shard: u16, moved: u64 },
    /// The counts over the new shards equal the frozen ones.
    Verified { counts: Counts },
    /// Every marker says the new count; the schema is next.
    Finishing,
}

/// What a run did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The namespace already has that many shards and no reshard is unfinished.
    AlreadyDone {
        namespace: String,
        shards: u16,
    },
    /// `--dry-run`: nothing changed.
    DryRun(Plan),
    Done(Report),
}

/// What a reshard would do.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    pub namespace: String,
    pub from: u16,
    pub to: u16,
    /// An unfinished reshard to the same count would be resumed.
    pub resume: bool,
    pub counts: Counts,
    /// Distinct ids whose shard changes.
    pub to_move: u64,
    /// Daemons registered now: the reshard would refuse while any is (layout 1).
    pub daemons: Vec<Daemon>,
    /// Layout 2: the spread shards move while producers and daemons run.
    pub online: bool,
}

/// What a finished reshard did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    pub namespace: String,
    pub from: u16,
    pub to: u16,
    pub resumed: bool,
    /// Counted when the namespace was frozen (by the first run, when resumed)…
    pub before: Counts,
    /// …and over the new shards at the end: equal.
    pub after: Counts,
    /// Ids moved by this run.
    pub moved: u64,
    /// Layout 2: ids a producer enqueued again into their new shard while the old one still
    /// held them (the newer job stays, the older is dropped).
    pub superseded: u64,
    /// Layout 2: ids an interrupted earlier run had written into their new shard already
    /// (not written again: the daemons may have delivered them since).
    pub put_before: u64,
    /// Layout 2: moved online.
    pub online: bool,
    pub elapsed_ms: u64,
}

/// Why a reshard refused or stopped. Every refusal leaves the namespace as it was; a stop
/// after the freeze leaves it frozen, and running the command again finishes it.
#[derive(Debug, thiserror::Error)]
pub enum ReshardError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("--to {0} is out of range: a namespace has 1..={MAX_SHARDS} shards")]
    OutOfRange(u32),
    #[error("namespace {0} has no schema ({0}:schema): nothing to reshard")]
    NoSchema(String),
    #[error("{}", daemons_text(.namespace, .daemons))]
    DaemonsRunning {
        namespace: String,
        daemons: Vec<Daemon>,
    },
    #[error(
        "a reshard of namespace {namespace} from {from} to {to} shards is unfinished: run \
         `zdelay reshard --to {to}` to finish it first"
    )]
    OtherReshard {
        namespace: String,
        from: u16,
        to: u16,
    },
    #[error(
        "shard {shard} is beyond namespace {namespace}'s {shards} shards but holds data ({}): \
         inspect and remove it before resharding", keys.join(", ")
    )]
    StrayData {
        namespace: String,
        shards: u16,
        shard: u16,
        keys: Vec<String>,
    },
    #[error(
        "spread shard {shard} has the same keys with {from} and with {to} shards (both counts \
         place it in slot {slot}), so its jobs cannot move online: choose another count"
    )]
    SameKeys {
        from: u16,
        to: u16,
        shard: u16,
        slot: u16,
    },
    #[error(
        "the layout marker of a shard changed under this reshard ({0}): another `zdelay \
         reshard` ran at the same time or finished it; run it again to see where it stands"
    )]
    MarkerChanged(String),
    #[error(
        "counts differ after moving every job (nothing is lost from Redis: the namespace stays \
         frozen; run `zdelay reshard --to {to}` again, and if it persists inspect the shards): \
         before {before}; after {after}"
    )]
    CountMismatch {
        to: u16,
        before: Counts,
        after: Counts,
    },
    #[error(
        "shard {shard} still holds data after the move ({}); the namespace stays frozen: run \
         `zdelay reshard --to {to}` again", keys.join(", ")
    )]
    RetiredNotEmpty {
        to: u16,
        shard: u16,
        keys: Vec<String>,
    },
}

impl From<redis::RedisError> for ReshardError {
    fn from(e: redis::RedisError) -> Self {
        if e.code() == Some("ZDELAY_NOT_MIGRATING") {
            return ReshardError::MarkerChanged(e.detail().unwrap_or_default().to_owned());
        }
        ReshardError::Store(StoreError::Redis(e))
    }
}

fn daemons_text(namespace: &str, daemons: &[Daemon]) -> String {
    let list: Vec<String> = daemons
        .iter()
        .map(|d| {
            format!(
                "{} (last heartbeat {:.1} s ago, registration lapses in {:.1} s)",
                d.id,
                d.last_seen_ms as f64 / 1000.0,
                d.expires_in_ms as f64 / 1000.0
            )
        })
        .collect();
    format!(
        "{} daemon{} registered on namespace {namespace}: {}. Stop every daemon first \
         (SIGTERM hands its registration back at once; a killed one stays registered until \
         its registration lapses), reshard, then start them with the new redis.shards",
        daemons.len(),
        if daemons.len() == 1 { " is" } else { "s are" },
        list.join(", ")
    )
}

/// A spread shard number whose keys are the same under both counts (both place it in one
/// slot), which an online reshard cannot move.
pub(crate) fn shared_shard(old: &Keys, new: &Keys) -> Option<u16> {
    (0..old.shards().min(new.shards())).find(|&k| old.due(k) == new.due(k))
}

/// The daemons registered live on the namespace (`{ns}:instances`, by the Redis clock).
pub async fn live_daemons(con: &mut Conn, keys: &Keys) -> Result<Vec<Daemon>, ReshardError> {
    let now = store::server_time_ms(con).await?;
    let registered: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.instances())
        .query_async(con)
        .await?;
    Ok(live_from(&registered, now))
}

/// Parses the instances hash (`id → "<expiry ms> <last heartbeat ms> …"`) at `now`.
fn live_from(registered: &BTreeMap<String, String>, now: i64) -> Vec<Daemon> {
    registered
        .iter()
        .filter_map(|(id, value)| {
            let (expiry, last) = scripts::registration_times(value)?;
            (expiry > now).then(|| Daemon {
                id: id.clone(),
                last_seen_ms: (now - last).max(0),
                expires_in_ms: expiry - now,
                version: scripts::registration_version(value).map(str::to_owned),
            })
        })
        .collect()
}

/// The data keys of `shard` that exist.
pub(crate) async fn stored_keys(
    con: &Conn,
    keys: &Keys,
    shard: u16,
) -> Result<Vec<String>, ReshardError> {
    existing(con, data_keys(keys, shard)).await
}

/// The keys of a shard that hold jobs or their unique windows, of those that exist.
pub(crate) async fn held_keys(
    con: &Conn,
    keys: &Keys,
    shard: u16,
) -> Result<Vec<String>, ReshardError> {
    let mut names = data_keys(keys, shard);
    let k = keys.shard(shard);
    names.extend([k.unique, k.windows]);
    existing(con, names).await
}

/// Those of `names` (keys of one shard) that exist.
async fn existing(con: &Conn, names: Vec<String>) -> Result<Vec<String>, ReshardError> {
    let mut pipe = redis::pipe();
    for name in &names {
        pipe.exists(name);
    }
    let exists: Vec<bool> = pipe.query_async(&mut con.clone()).await?;
    Ok(names
        .into_iter()
        .zip(exists)
        .filter_map(|(name, e)| e.then_some(name))
        .collect())
}

/// Which run a reshard to `to` is, from the unfinished one the schema records (`(from, to)`):
/// `(from, resumed)`, or the outcome when there is nothing to do. Another unfinished target
/// is refused.
// Called once per command: the error's size costs nothing here.
#[allow(clippy::result_large_err)]
pub(crate) fn run_of(
    namespace: &str,
    shards: u16,
    to: u16,
    unfinished: Option<(u16, u16)>,
) -> Result<Result<(u16, bool), Outcome>, ReshardError> {
    match unfinished {
        Some((from, target)) if target == to => Ok(Ok((from, true))),
        Some((from, target)) => Err(ReshardError::OtherReshard {
            namespace: namespace.to_owned(),
            from,
            to: target,
        }),
        None if shards == to => Ok(Err(Outcome::AlreadyDone {
            namespace: namespace.to_owned(),
            shards,
        })),
        None => Ok(Ok((shards, false))),
    }
}

/// Every key of a shard that holds jobs, in [`Counts`] order.
fn data_keys(keys: &Keys, shard: u16) -> Vec<String> {
    let k = keys.shard(shard);
    vec![
        k.jobs,
        k.due,
        k.inflight,
        k.ready,
        k.ready_ids,
        k.dead,
        k.reasons,
        k.scheduled,
        k.max_lateness,
        k.schedules,
        k.sched_env,
        k.sched_due,
        k.sched_fired,
        k.sched_quarantine,
        k.history,
    ]
}

/// The counts over `shards` (one pipeline per shard, so one slot each).
pub(crate) async fn count(
    con: &Conn,
    keys: &Keys,
    shards: std::ops::Range<u16>,
) -> Result<Counts, ReshardError> {
    let per_shard = futures::stream::iter(shards)
        .map(|shard| {
            let mut con = con.clone();
            let k = keys.shard(shard);
            async move {
                let sizes: [u64; Counts::FIELDS] = redis::pipe()
                    .hlen(&k.jobs)
                    .zcard(&k.due)
                    .zcard(&k.inflight)
                    .zcard(&k.ready)
                    .hlen(&k.ready_ids)
                    .zcard(&k.dead)
                    .hlen(&k.reasons)
                    .hlen(&k.scheduled)
                    .hlen(&k.max_lateness)
                    .hlen(&k.schedules)
                    .hlen(&k.sched_env)
                    .zcard(&k.sched_due)
                    .zcard(&k.sched_fired)
                    .hlen(&k.sched_quarantine)
                    .hlen(&k.history)
                    .query_async(&mut con)
                    .await?;
                Ok::<_, ReshardError>(Counts::from_array(sizes))
            }
        })
        .buffer_unordered(PARALLEL);
    per_shard
        .try_fold(Counts::default(), |mut total, counts| async move {
            total.add(&counts);
            Ok(total)
        })
        .await
}

/// Sets the layout marker of shards `0..span` to `value`.
pub(crate) async fn set_markers(
    con: &Conn,
    keys: &Keys,
    span: u16,
    value: &str,
) -> Result<(), ReshardError> {
    futures::stream::iter(0..span)
        .map(|shard| {
            let mut con = con.clone();
            let key = keys.layout(shard);
            async move {
                redis::cmd("SET")
                    .arg(key)
                    .arg(value)
                    .query_async::<()>(&mut con)
                    .await
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// The keys a pass scans for ids, with what each holds per id. The envelopes come last: by
/// then they are mostly the ids that stay.
fn scanned(keys: &crate::keys::ShardKeys) -> [(&str, ScanKind, bool); 15] {
    [
        (&keys.history, ScanKind::Hash, false),
        (&keys.sched_quarantine, ScanKind::Hash, false),
        (&keys.sched_fired, ScanKind::Zset, false),
        (&keys.schedules, ScanKind::Hash, false),
        (&keys.sched_env, ScanKind::Hash, false),
        (&keys.sched_due, ScanKind::Zset, false),
        (&keys.max_lateness, ScanKind::Hash, false),
        (&keys.due, ScanKind::Zset, false),
        (&keys.inflight, ScanKind::Zset, false),
        (&keys.dead, ScanKind::Zset, false),
        (&keys.ready, ScanKind::Zset, true),
        (&keys.ready_ids, ScanKind::Hash, false),
        (&keys.scheduled, ScanKind::Hash, false),
        (&keys.reasons, ScanKind::Hash, false),
        (&keys.jobs, ScanKind::Hash, false),
    ]
}

/// The id inside a ready-set member `<sink>\n<due>\n<id>`.
pub fn ready_member_id(member: &[u8]) -> Option<&[u8]> {
    let mut parts = member.splitn(3, |&b| b == b'\n');
    parts.next()?;
    parts.next()?;
    parts.next()
}

/// The ids a shard holds, a scan page at a time over every key [`scanned`] lists, each id
/// once a page, with the ready-set members found for it (a member names its id; one that does
/// not is left alone).
pub(crate) struct IdPages<'a> {
    keys: [(&'a str, ScanKind, bool); 15],
    key: usize,
    cursor: String,
    count: ScanCount,
}

/// A page of [`IdPages`]: ids, and the ready members found per id.
pub(crate) type IdPage = (Vec<Vec<u8>>, HashMap<Vec<u8>, Vec<Vec<u8>>>);

impl<'a> IdPages<'a> {
    pub(crate) fn new(keys: &'a crate::keys::ShardKeys) -> Self {
        IdPages {
            keys: scanned(keys),
            key: 0,
            cursor: "0".to_owned(),
            count: ScanCount::new(),
        }
    }

    /// The next page; `None` once every key was scanned through.
    pub(crate) async fn next(&mut self, con: &mut Conn) -> redis::RedisResult<Option<IdPage>> {
        let Some(&(key, kind, ready)) = self.keys.get(self.key) else {
            return Ok(None);
        };
        let (next, items, bytes) =
            scripts::reshard_scan(con, key, kind, &self.cursor, self.count.get()).await?;
        self.count.after(bytes);
        if next == "0" {
            self.key += 1;
            self.cursor = "0".to_owned();
            self.count = ScanCount::new();
        } else {
            self.cursor = next;
        }
        let mut ids: Vec<Vec<u8>> = Vec::new();
        let mut seen: HashSet<Vec<u8>> = HashSet::new();
        let mut members: HashMap<Vec<u8>, Vec<Vec<u8>>> = HashMap::new();
        for item in items {
            let id = if ready {
                match ready_member_id(&item) {
                    Some(id) => id.to_vec(),
                    None => continue,
                }
            } else {
                item.clone()
            };
            if ready {
                members.entry(id.clone()).or_default().push(item);
            }
            if seen.insert(id.clone()) {
                ids.push(id);
            }
        }
        Ok(Some((ids, members)))
    }
}

/// The COUNT of a key's next scan page: it starts at one (a page of hash fields brings their
/// values along, and one envelope may weigh megabytes), doubles while pages come back light
/// and shrinks when one weighs more than [`SCAN_BYTES`], so a page copies about that much
/// at most, or one value when a single one weighs more.
pub(crate) struct ScanCount(usize);

impl ScanCount {
    pub(crate) fn new() -> Self {
        ScanCount(1)
    }

    pub(crate) fn get(&self) -> usize {
        self.0
    }

    /// Adjusts to what the last page's values weighed.
    pub(crate) fn after(&mut self, bytes: usize) {
        self.0 = if bytes > SCAN_BYTES {
            (self.0 / 4).max(1)
        } else if bytes <= SCAN_BYTES / 4 {
            (self.0 * 2).min(SCAN_COUNT)
        } else {
            self.0
        };
    }
}

/// Moves the unique windows and debounce deadlines of shard `shard` of `source` whose ids
/// `target` keeps in other keys: each page is copied into the target shards, then deleted
/// here (a resumed run copies again what a crash left in both). They are not jobs, so they
/// are not counted. `keep_newer`: an entry a target shard holds already stays (a producer or
/// a delivery wrote it there while the reshard ran, online).
pub(crate) async fn carry_windows(
    con: &mut Conn,
    source: &Keys,
    shard: u16,
    target: &Keys,
    keep_newer: bool,
) -> Result<(), ReshardError> {
    let from = source.shard(shard);
    for kind in WINDOW_KEYS {
        let mut cursor = 0u64;
        loop {
            let (next, page): WindowPage = redis::cmd(kind.scan)
                .arg((kind.key)(&from))
                .arg(cursor)
                .arg("COUNT")
                .arg(WINDOW_PAGE)
                .query_async(con)
                .await?;
            let mut copies: BTreeMap<u16, redis::Pipeline> = BTreeMap::new();
            // The target shards' keys of this kind, built once a page.
            let mut names: BTreeMap<u16, String> = BTreeMap::new();
            let mut misplaced = Vec::new();
            for (member, value) in &page {
                let Some(id) = (kind.id)(member) else {
                    continue;
                };
                let to = target.shard_of_bytes(id);
                let key = names
                    .entry(to)
                    .or_insert_with(|| (kind.key)(&target.shard(to)).clone())
                    .clone();
                if key == *(kind.key)(&from) {
                    continue;
                }
                let copy = if keep_newer {
                    let (command, flag) = kind.copy_new;
                    let copy = copies.entry(to).or_default().cmd(command).arg(key);
                    if let Some(flag) = flag {
                        copy.arg(flag);
                    }
                    copy
                } else {
                    copies.entry(to).or_default().cmd(kind.copy).arg(key)
                };
                if kind.score_first {
                    copy.arg(value).arg(member).ignore();
                } else {
                    copy.arg(member).arg(value).ignore();
                }
                misplaced.push(member);
            }
            if !misplaced.is_empty() {
                for pipe in copies.values() {
                    pipe.query_async::<()>(con).await?;
                }
                redis::cmd(kind.delete)
                    .arg((kind.key)(&from))
                    .arg(&misplaced)
                    .query_async::<()>(con)
                    .await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(())
}

/// What `source` holds of the longest prefix of `ids` one `reshard_take` call reads: (ids
/// taken, the jobs among them with anything stored), each with the ready members found for it
/// by the scan besides the one `ready_ids` names.
pub(crate) async fn take(
    con: &mut Conn,
    source: &crate::keys::ShardKeys,
    marker: &str,
    ids: &[Vec<u8>],
    members: &HashMap<Vec<u8>, Vec<Vec<u8>>>,
) -> redis::RedisResult<(usize, Vec<StoredJob>)> {
    let mut jobs = scripts::reshard_take(con, source, marker, TAKE_BYTES, ids).await?;
    let taken = jobs.len();
    for job in &mut jobs {
        if let Some(found) = members.get(&job.id) {
            job.ready = found
                .iter()
                .filter(|m| job.ready_member.as_ref() != Some(*m))
                .cloned()
                .collect();
        }
    }
    jobs.retain(|job| !job.is_empty());
    Ok((taken, jobs))
}

/// Splits records into script calls of at most [`PUT_BYTES`] by `size` (at least one record
/// each).
pub(crate) fn sized_calls<T: Clone>(records: &[&T], size: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut calls: Vec<Vec<T>> = Vec::new();
    let mut bytes = 0;
    for record in records {
        let weight = size(record);
        if calls.is_empty() || bytes + weight > PUT_BYTES {
            calls.push(Vec::new());
            bytes = 0;
        }
        bytes += weight;
        calls
            .last_mut()
            .expect("pushed above")
            .push((*record).clone());
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_and_add() {
        let c = Counts {
            jobs: 10,
            due: 7,
            inflight: 1,
            ready: 2,
            ready_ids: 2,
            dead: 3,
            reasons: 3,
            scheduled: 1,
            max_lateness: 1,
            schedules: 2,
            sched_env: 2,
            sched_due: 1,
            sched_fired: 2,
            sched_quarantine: 1,
            history: 1,
        };
        assert_eq!(Counts::decode(&c.encode()), Some(c));
        assert_eq!(Counts::decode("1 2 3"), None);
        assert_eq!(Counts::decode("a b c d e f g h"), None);
        let mut sum = c;
        sum.add(&c);
        assert_eq!(sum.jobs, 20);
        assert_eq!(sum.scheduled, 2);
        assert!(
            c.to_string()
                .starts_with("10 jobs (due or scheduled 7, in flight 1")
        );
    }

    #[test]
    fn live_daemons_are_those_whose_registration_has_not_lapsed() {
        let registered: BTreeMap<String, String> = [
            ("a", "2000 1500 n0 - 0.3.0"),
            ("b", "999 500"),
            ("c", "garbage"),
            ("d", "1001"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let live = live_from(&registered, 1000);
        assert_eq!(
            live,
            vec![
                Daemon {
                    id: "a".into(),
                    last_seen_ms: 0,
                    expires_in_ms: 1000,
                    version: Some("0.3.0".into()),
                },
                Daemon {
                    id: "d".into(),
                    last_seen_ms: 0,
                    expires_in_ms: 1,
                    version: None,
                }
            ]
        );
        let text = daemons_text("zdelay", &live);
        assert!(text.starts_with("2 daemons are registered on namespace zdelay: a (last"));
    }

    #[test]
    fn ready_members_name_their_id() {
        assert_eq!(
            ready_member_id(b"bus\n0001700000000000\n{u}:x\ny"),
            Some(&b"{u}:x\ny"[..])
        );
        assert_eq!(ready_member_id(b"bus\n0001700000000000"), None);
    }

    #[test]
    fn scan_pages_grow_while_light_and_shrink_when_heavy() {
        let mut count = ScanCount::new();
        assert_eq!(count.get(), 1, "the first page of a key is one field");
        for _ in 0..20 {
            count.after(100);
        }
        assert_eq!(count.get(), SCAN_COUNT, "small values: full pages");
        count.after(SCAN_COUNT * (1 << 20));
        assert_eq!(count.get(), SCAN_COUNT / 4);
        for _ in 0..10 {
            count.after(count.get() * (1 << 20));
        }
        assert!(
            count.get() * (1 << 20) <= SCAN_BYTES,
            "1 MB values: pages near SCAN_BYTES, {} fields",
            count.get()
        );
        count.after(64 << 20);
        count.after(64 << 20);
        assert_eq!(count.get(), 1, "never below one");
    }

    #[test]
    fn puts_are_split_by_size() {
        let job = |n: usize| StoredJob {
            id: b"x".to_vec(),
            envelope: Some(vec![0; n]),
            ..StoredJob::default()
        };
        let (small, big) = (job(10), job(PUT_BYTES));
        let calls = sized_calls(&[&small, &small, &big, &small], StoredJob::size);
        assert_eq!(
            calls.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![2, 1, 1]
        );
        assert!(sized_calls(&[], StoredJob::size).is_empty());
    }

    #[test]
    fn spread_shards_keep_their_keys_under_another_count_only_for_large_close_counts() {
        // The model: shard k of n sits at slot ⌊(2k + 1) · 16384 / (2n)⌋; its keys are the
        // same under two counts exactly when that slot is.
        let model = |from: u16, to: u16| {
            (0..from.min(to)).find(|&k| {
                (2 * u32::from(k) + 1) * 8192 / u32::from(from)
                    == (2 * u32::from(k) + 1) * 8192 / u32::from(to)
            })
        };
        let spread = |n| Keys::new("zdelay", n);
        for from in 1..=64 {
            for to in 1..=64 {
                let found = shared_shard(&spread(from), &spread(to));
                assert_eq!(found, model(from, to), "{from} → {to}");
                // Counts up to 64 never share (the slots differ by at least 2).
                assert_eq!(found.is_some(), from == to, "{from} → {to}");
            }
        }
        let mut rng = 0x5eed_u64;
        let mut shared = 0;
        for _ in 0..2000 {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let from = (rng >> 33) as u16 % 16384 + 1;
            let to = (from + (rng >> 17) as u16 % 8).min(16384);
            let found = shared_shard(&spread(from), &spread(to));
            assert_eq!(found, model(from, to), "{from} → {to}");
            shared += usize::from(found.is_some() && from != to);
        }
        assert!(shared > 0, "large close counts do share a shard's keys");
        assert_eq!(shared_shard(&spread(1000), &spread(1001)), Some(0));
    }

    #[test]
    fn a_reshard_moves_what_the_new_count_places_elsewhere() {
        // The pure rule behind a reshard: ids stay exactly when both counts agree.
        let (old, new) = (Keys::new("zdelay", 4), Keys::new("zdelay", 8));
        let mut stay = 0;
        for i in 0..8000 {
            let id = format!("job-{i}");
            let (o, n) = (old.shard_of(&id), new.shard_of(&id));
            assert!(
                n == o || n == o + 4,
                "4 → 8 splits shard s into s and s + 4"
            );
            stay += usize::from(n == o);
        }
        assert!((3000..5000).contains(&stay), "about half stay: {stay}");
    }
}
