//! `zdelay upgrade`: moves a live namespace from storage layout 1 to layout 2 while producers
//! enqueue and daemons deliver.
//!
//! 1. Checks: the schema says layout 1 (or an unfinished upgrade, which is resumed), no
//!    reshard is unfinished, and every daemon registered live runs a build that follows the
//!    upgrade (its registration names [`store::LAYOUT_SINCE`] or later); others are named.
//! 2. Announce: `<ns>:schema` gets `upgrading = 2` and `min_version` = [`store::LAYOUT_SINCE`].
//!    Producers and daemons of the older release that connect from now on use layout 2; older
//!    builds refuse, and so does this one until the upgrade has finished.
//! 3. Fence: every spread shard's marker is set to the shard count, then every layout-1
//!    shard's marker becomes `upgrading 2 <version>`. From then on every layout-1 script
//!    refuses the shard before writing anything: a producer or daemon of the older release
//!    switches to layout 2 at that refusal (a producer's refused call wrote nothing and is
//!    retried), an older one stops with a message naming the version to run. A layout-1
//!    shard is inert.
//! 4. Move, in rounds over the shards (a few at once): each round takes the earliest due
//!    batch of every shard, so what falls due soonest moves first; then the rest (dead jobs,
//!    schedules, jobs in flight, histories) by scanning, once every job a live publisher
//!    holds (claimed for a two-phase delivery before the fence) is settled or its lease ran
//!    out: the last lease, not the first, ends the wait. A batch is read (`reshard_take`),
//!    written to its new home, then deleted from the layout-1 shard (`reshard_drop`). A job
//!    for a local route goes to the route's lane, its frame split into payload and meta
//!    (`upgrade_put_lane`); anything else (two-phase routes, destinations no route names)
//!    goes as it is to the spread shard of its id (`reshard_put` in transit mode). Each put
//!    records its ids in the target's `transit_in` set and skips ids already there, so a
//!    re-run after a crash between the put and the delete never writes a job twice (the
//!    target's mover may have delivered it meanwhile). An id the target already holds (a
//!    producer enqueued the same id in layout 2 meanwhile) keeps the newer job.
//! 5. Each layout-1 shard found empty gets the marker `layout 2 <version>`; then the schema
//!    says `layout = 2` and loses `upgrading`, and the `transit_in` sets are deleted.
//!
//! Running it again after a crash anywhere resumes. Nothing here prints: progress goes to a
//! callback.

use crate::envelope::{Envelope, Meta};
use crate::keys::{Keys, ShardKeys};
use crate::lane::{Lane, Registry};
use crate::reshard::{self, Counts, Daemon, IdPages, sized_calls};
use crate::store::scripts::{self, LaneRecord, Put, PutMode, StoredJob};
use crate::store::{self, Conn, Layout, StoreError};
use futures::{StreamExt, TryStreamExt};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub const DEFAULT_BATCH: usize = 500;
pub const DEFAULT_CONCURRENCY: usize = 4;

/// The layout this module upgrades to.
const TO_LAYOUT: u32 = 2;

#[derive(Debug, Clone)]
pub struct Options {
    pub batch: usize,
    pub concurrency: usize,
    pub dry_run: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            batch: DEFAULT_BATCH,
            concurrency: DEFAULT_CONCURRENCY,
            dry_run: false,
        }
    }
}

/// What happens as an upgrade runs, in this order.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    Start {
        shards: u16,
        resumed: bool,
    },
    /// The schema says `upgrading`: new work goes to layout 2.
    Announced,
    /// Every layout-1 shard is fenced.
    Fenced,
    /// Jobs moved so far, over every shard.
    Moved {
        total: u64,
    },
    /// Jobs of layout-1 shard `shard` are held by live publishers (two-phase deliveries
    /// claimed before the fence): the shard's move waits until they are settled or their
    /// leases run out, the last in `lease_left_ms`.
    Settling {
        shard: u16,
        jobs: u64,
        lease_left_ms: i64,
    },
    /// Layout-1 shard `shard` is empty and retired.
    ShardDone {
        shard: u16,
    },
    /// Every shard is retired; the schema is next.
    Finishing,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The namespace is on layout 2 already.
    AlreadyDone {
        namespace: String,
    },
    DryRun(Plan),
    Done(Report),
}

/// What an upgrade would do.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    pub namespace: String,
    pub shards: u16,
    pub resume: bool,
    /// What the layout-1 shards hold now.
    pub counts: Counts,
    /// The local routes whose jobs would go to route lanes.
    pub lanes: Vec<String>,
    pub daemons: Vec<Daemon>,
    /// Daemons that cannot follow: the upgrade would refuse while any is registered.
    pub outdated: Vec<Daemon>,
}

/// What a finished upgrade did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Report {
    pub namespace: String,
    pub shards: u16,
    pub resumed: bool,
    /// Ids written into route lanes (jobs, dead jobs and schedules of local routes).
    pub to_lanes: u64,
    /// Ids written into spread shards (two-phase routes, unknown destinations).
    pub to_spread_shards: u64,
    /// Ids an earlier, interrupted run had written already.
    pub put_before: u64,
    /// Ids whose new home already held a job or schedule under the same id, enqueued there
    /// during the upgrade: the newer one stays, the layout-1 one is dropped.
    pub superseded: u64,
    /// Local-route jobs still held by a publisher whose lease ran out (its daemon died
    /// mid-delivery; on a cluster layout 1 delivers local routes in two phases): made due
    /// again at their scheduled due in their lane, so each may be delivered twice.
    pub redelivered: u64,
    pub elapsed_ms: u64,
}

/// Why an upgrade refused or stopped. A refusal changes nothing; a stop after the announce
/// leaves the namespace upgrading (every job still delivered), and running the command
/// again finishes it.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("namespace {0} has no schema ({0}:schema): nothing to upgrade")]
    NoSchema(String),
    #[error("namespace {namespace} says layout {layout}: zdelay upgrade moves layout 1 to 2")]
    UnknownLayout { namespace: String, layout: String },
    #[error(
        "a reshard of namespace {namespace} from {from} to {to} shards is unfinished: run \
         `zdelay reshard --to {to}` to finish it first"
    )]
    Resharding {
        namespace: String,
        from: u16,
        to: u16,
    },
    #[error("{}", outdated_text(.namespace, .daemons))]
    OutdatedDaemons {
        namespace: String,
        daemons: Vec<Daemon>,
    },
    #[error(
        "a marker changed under this upgrade ({0}): another `zdelay upgrade` or `zdelay \
         reshard` ran at the same time; run it again to see where it stands"
    )]
    MarkerChanged(String),
    #[error(
        "layout-1 shard {shard} still holds data after the move ({}): run zdelay upgrade \
         again, and if it persists inspect those keys", keys.join(", ")
    )]
    NotEmpty { shard: u16, keys: Vec<String> },
}

impl From<redis::RedisError> for UpgradeError {
    fn from(e: redis::RedisError) -> Self {
        if e.code() == Some("ZDELAY_NOT_MIGRATING") {
            return UpgradeError::MarkerChanged(e.detail().unwrap_or_default().to_owned());
        }
        UpgradeError::Store(StoreError::Redis(e))
    }
}

impl From<reshard::ReshardError> for UpgradeError {
    fn from(e: reshard::ReshardError) -> Self {
        match e {
            reshard::ReshardError::Store(s) => UpgradeError::Store(s),
            reshard::ReshardError::MarkerChanged(m) => UpgradeError::MarkerChanged(m),
            other => UpgradeError::Store(StoreError::Schema(other.to_string())),
        }
    }
}

fn outdated_text(namespace: &str, daemons: &[Daemon]) -> String {
    let list: Vec<String> = daemons
        .iter()
        .map(|d| match &d.version {
            Some(v) => format!("{} (zdelay {v})", d.id),
            None => format!("{} (a build that registers no version)", d.id),
        })
        .collect();
    format!(
        "{} daemon{} registered on namespace {namespace} cannot follow the upgrade: {}. Roll \
         every daemon to zdelay {} or later first (they keep serving layout 1 until the \
         upgrade), then run zdelay upgrade",
        daemons.len(),
        if daemons.len() == 1 { " is" } else { "s are" },
        list.join(", "),
        store::LAYOUT_SINCE
    )
}

/// The marker of a layout-1 shard while the upgrade moves it, and once it is empty.
fn fence_marker() -> String {
    format!("upgrading {TO_LAYOUT} {}", store::LAYOUT_SINCE)
}

fn retired_marker() -> String {
    Layout::Newer {
        layout: TO_LAYOUT,
        min_version: store::layout_since().clone(),
    }
    .marker()
}

/// Upgrades `namespace` to layout 2 (see the module's documentation), or with
/// `opts.dry_run` says what it would do. `registry` is the lane registry with every local
/// route of the config registered.
pub async fn upgrade(
    con: &Conn,
    namespace: &str,
    registry: &Registry,
    opts: &Options,
    progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<Outcome, UpgradeError> {
    let started = Instant::now();
    let mut con = con.clone();
    let probe = Keys::new(namespace, 1);
    let schema = store::read_schema(&mut con, &probe).await?;
    let (Some(layout), Some(shards)) = (&schema.layout, schema.shards) else {
        return Err(UpgradeError::NoSchema(namespace.to_owned()));
    };
    match layout.as_str() {
        "1" => {}
        "2" => {
            return Ok(Outcome::AlreadyDone {
                namespace: namespace.to_owned(),
            });
        }
        other => {
            return Err(UpgradeError::UnknownLayout {
                namespace: namespace.to_owned(),
                layout: other.to_owned(),
            });
        }
    }
    if let Some((from, to)) = schema.migrating {
        return Err(UpgradeError::Resharding {
            namespace: namespace.to_owned(),
            from,
            to,
        });
    }
    let resumed = schema.upgrading == Some(TO_LAYOUT);
    let legacy = Keys::new(namespace, shards).layout_1();
    let spread = Keys::new(namespace, shards);
    let daemons = reshard::live_daemons(&mut con, &legacy).await?;
    let outdated: Vec<Daemon> = daemons.iter().filter(|d| !follows(d)).cloned().collect();
    if opts.dry_run {
        return Ok(Outcome::DryRun(Plan {
            namespace: namespace.to_owned(),
            shards,
            resume: resumed,
            counts: reshard::count(&con, &legacy, 0..shards).await?,
            lanes: registry.by_route.keys().cloned().collect(),
            daemons,
            outdated,
        }));
    }
    if !outdated.is_empty() {
        return Err(UpgradeError::OutdatedDaemons {
            namespace: namespace.to_owned(),
            daemons: outdated,
        });
    }
    progress(Progress::Start { shards, resumed });
    let _: () = redis::pipe()
        .hset(legacy.schema(), "upgrading", TO_LAYOUT)
        .hset(legacy.schema(), "min_version", store::LAYOUT_SINCE)
        .query_async(&mut con)
        .await?;
    progress(Progress::Announced);
    crate::failpoint::hold("upgrade_after_announce").await;
    fence(&con, &legacy, &spread).await?;
    progress(Progress::Fenced);
    crate::failpoint::hold("upgrade_after_fence").await;

    let mover = Mover {
        con: &con,
        legacy: &legacy,
        spread: &spread,
        registry,
        batch: opts.batch.clamp(1, reshard::MAX_BATCH),
        progress,
        moved: AtomicU64::new(0),
        tally: std::sync::Mutex::new(Report::default()),
        channel: legacy.wake_channel(),
        fence: fence_marker(),
        retired: retired_marker(),
        carry_windows: false,
    };
    mover.run(opts.concurrency).await?;

    progress(Progress::Finishing);
    let mut con = con.clone();
    let _: () = redis::pipe()
        .hset(legacy.schema(), "layout", TO_LAYOUT)
        .hdel(legacy.schema(), "upgrading")
        .query_async(&mut con)
        .await?;
    delete_transit_sets(&con, &spread, registry).await?;
    let mut report = mover.tally.into_inner().expect("tally lock");
    report.namespace = namespace.to_owned();
    report.shards = shards;
    report.resumed = resumed;
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(Outcome::Done(report))
}

/// Whether a daemon runs a build that follows the upgrade ([`store::LAYOUT_SINCE`] or later).
pub(crate) fn follows(daemon: &Daemon) -> bool {
    daemon
        .version
        .as_deref()
        .and_then(|v| semver::Version::parse(v).ok())
        .is_some_and(|v| v.cmp_precedence(store::layout_since()).is_ge())
}

/// Sets the spread shards' markers to the shard count (what their scripts expect) and
/// fences every layout-1 shard not retired yet.
async fn fence(con: &Conn, legacy: &Keys, spread: &Keys) -> Result<(), UpgradeError> {
    let shards = legacy.shards();
    let fence = fence_marker();
    futures::stream::iter(0..shards)
        .map(|shard| {
            let mut con = con.clone();
            let fence = fence.clone();
            async move {
                let _: () = redis::cmd("SET")
                    .arg(spread.layout(shard))
                    .arg(shards)
                    .query_async(&mut con)
                    .await?;
                let marker: Option<String> = redis::cmd("GET")
                    .arg(legacy.layout(shard))
                    .query_async(&mut con)
                    .await?;
                if !marker.is_some_and(|m| m.starts_with("layout ")) {
                    let _: () = redis::cmd("SET")
                        .arg(legacy.layout(shard))
                        .arg(&fence)
                        .query_async(&mut con)
                        .await?;
                    // An idle daemon polling the shard meets the fence now, not at its next
                    // idle poll, and starts its layout-2 pollers.
                    let _: i64 = redis::cmd("PUBLISH")
                        .arg(legacy.wake_channel())
                        .arg(format!("{shard} 0"))
                        .query_async(&mut con)
                        .await?;
                }
                Ok::<_, UpgradeError>(())
            }
        })
        .buffer_unordered(reshard::PARALLEL)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Deletes the `transit_in` sets once every layout-1 shard is retired (UNLINK: Redis frees
/// them in the background).
pub(crate) async fn delete_transit_sets(
    con: &Conn,
    spread: &Keys,
    registry: &Registry,
) -> Result<(), UpgradeError> {
    let keys: Vec<String> = (0..spread.shards())
        .map(|s| spread.shard(s).transit_in)
        .chain(
            registry
                .by_route
                .values()
                .map(|l| l.keys.transit_in.clone()),
        )
        .collect();
    futures::stream::iter(keys)
        .map(|key| {
            let mut con = con.clone();
            async move {
                redis::cmd("UNLINK")
                    .arg(key)
                    .query_async::<u64>(&mut con)
                    .await
            }
        })
        .buffer_unordered(reshard::PARALLEL)
        .try_collect::<Vec<u64>>()
        .await?;
    Ok(())
}

/// Where one layout-1 record goes.
enum Home<'a> {
    Lane(&'a Lane),
    Spread(u16),
}

/// Moves every job, dead job and schedule of the shards of `legacy` into their homes under
/// `spread` (and the lanes of `registry`) while producers and daemons run: `zdelay upgrade`
/// (layout-1 shards into layout 2) and `zdelay reshard` on layout 2 (spread shards into the
/// spread shards of another count, `registry` empty). The source shards are fenced with
/// `fence` before, and get `retired` once empty.
pub(crate) struct Mover<'a> {
    pub(crate) con: &'a Conn,
    pub(crate) legacy: &'a Keys,
    pub(crate) spread: &'a Keys,
    pub(crate) registry: &'a Registry,
    pub(crate) batch: usize,
    pub(crate) progress: &'a (dyn Fn(Progress) + Send + Sync),
    pub(crate) moved: AtomicU64,
    pub(crate) tally: std::sync::Mutex<Report>,
    pub(crate) channel: String,
    /// The source shards' marker while they move (what `reshard_take` and `reshard_drop`
    /// expect), and once they are empty.
    pub(crate) fence: String,
    pub(crate) retired: String,
    /// Carry the unique windows and debounce deadlines into the target shards (a reshard);
    /// otherwise they are dropped with the source shard (the upgrade: lanes start theirs
    /// afresh).
    pub(crate) carry_windows: bool,
}

impl Mover<'_> {
    /// Moves everything: rounds of each source shard's earliest due batch, so what falls due
    /// soonest moves first everywhere; then the rest of each shard, which is then retired.
    pub(crate) async fn run(&self, concurrency: usize) -> Result<(), UpgradeError> {
        let concurrency = concurrency.max(1);
        let shards = self.legacy.shards();
        // Before any job moves, so a producer enqueuing into a target meets the windows of
        // ids that were waiting (or, in a reshard, delivered) before the fence.
        futures::stream::iter(0..shards)
            .map(|shard| async move {
                let mut con = self.con.clone();
                if self.carry_windows {
                    reshard::carry_windows(&mut con, self.legacy, shard, self.spread, true).await
                } else {
                    self.carry_windows_home(&mut con, shard).await
                }
            })
            .buffer_unordered(concurrency)
            .try_collect::<Vec<()>>()
            .await?;
        let mut pending: Vec<u16> = (0..shards).collect();
        while !pending.is_empty() {
            let left: Vec<Option<u16>> = futures::stream::iter(pending.iter().copied())
                .map(|shard| async move {
                    Ok::<_, UpgradeError>(self.earliest(shard).await?.then_some(shard))
                })
                .buffer_unordered(concurrency)
                .try_collect()
                .await?;
            pending = left.into_iter().flatten().collect();
        }
        futures::stream::iter(0..shards)
            .map(|shard| self.rest(shard))
            .buffer_unordered(concurrency)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    /// Moves the earliest due batch of `shard`; whether it had one.
    async fn earliest(&self, shard: u16) -> Result<bool, UpgradeError> {
        let mut con = self.con.clone();
        let ids: Vec<Vec<u8>> = redis::cmd("ZRANGE")
            .arg(self.legacy.due(shard))
            .arg(0)
            .arg(self.batch - 1)
            .query_async(&mut con)
            .await?;
        if ids.is_empty() {
            return Ok(false);
        }
        self.move_ids(&mut con, shard, &ids, &HashMap::new())
            .await?;
        Ok(true)
    }

    /// Moves whatever else `shard` holds (dead jobs, schedules, jobs in flight, histories),
    /// pass after pass until one finds nothing, then retires the shard.
    async fn rest(&self, shard: u16) -> Result<(), UpgradeError> {
        let mut con = self.con.clone();
        let keys = self.legacy.shard(shard);
        self.wait_for_settles(&mut con, shard, &keys).await?;
        loop {
            let mut moved_in_pass = 0;
            let mut pages = IdPages::new(&keys);
            while let Some((ids, members)) = pages.next(&mut con).await? {
                for chunk in ids.chunks(self.batch) {
                    moved_in_pass += self.move_ids(&mut con, shard, chunk, &members).await?;
                }
            }
            if moved_in_pass == 0 {
                break;
            }
        }
        let left = reshard::stored_keys(self.con, self.legacy, shard).await?;
        if !left.is_empty() {
            return Err(UpgradeError::NotEmpty { shard, keys: left });
        }
        if self.carry_windows {
            // Again: settles through the fence wrote windows of the jobs they delivered.
            reshard::carry_windows(&mut con, self.legacy, shard, self.spread, true).await?;
        }
        // The claim counter holds no job, and nothing claims from a fenced shard again. Its
        // unique windows go too: nothing reads a retired shard's, and the lanes the jobs moved
        // to start theirs afresh.
        let _: () = redis::pipe()
            .del(&keys.lease_seq)
            .ignore()
            .del(&keys.unique)
            .ignore()
            .del(&keys.windows)
            .ignore()
            .set(&keys.layout, &self.retired)
            .ignore()
            .query_async(&mut con)
            .await?;
        (self.progress)(Progress::ShardDone { shard });
        Ok(())
    }

    /// Waits until the jobs in flight from the shard (claimed for a two-phase delivery
    /// before the fence) are settled: their publishers settle them through the fence, so
    /// none is moved after it was delivered. Every live lease is waited for, the last one
    /// too: a lease that ran out (its daemon died) does not end the wait for the others.
    /// Once no lease is live, the jobs left in flight move and may be delivered twice, as
    /// layout 1 would redeliver them.
    async fn wait_for_settles(
        &self,
        con: &mut Conn,
        shard: u16,
        keys: &ShardKeys,
    ) -> Result<(), UpgradeError> {
        let mut announced = false;
        loop {
            let now = store::server_time_ms(con).await?;
            // Leases still live (their deadline is after now), and the last deadline.
            let (live, last): (u64, Vec<(String, f64)>) = redis::pipe()
                .cmd("ZCOUNT")
                .arg(&keys.inflight)
                .arg(format!("({now}"))
                .arg("+inf")
                .cmd("ZRANGE")
                .arg(&keys.inflight)
                .arg(-1)
                .arg(-1)
                .arg("WITHSCORES")
                .query_async(con)
                .await?;
            let Some((_, last)) = last.first().filter(|_| live > 0) else {
                return Ok(());
            };
            if !announced {
                announced = true;
                (self.progress)(Progress::Settling {
                    shard,
                    jobs: live,
                    lease_left_ms: *last as i64 - now,
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Moves `ids` of layout-1 shard `shard`, as many a call as the take's byte budget allows.
    async fn move_ids(
        &self,
        con: &mut Conn,
        shard: u16,
        mut ids: &[Vec<u8>],
        members: &HashMap<Vec<u8>, Vec<Vec<u8>>>,
    ) -> Result<u64, UpgradeError> {
        let source = self.legacy.shard(shard);
        let mut moved = 0;
        while !ids.is_empty() {
            let (taken, jobs) = reshard::take(con, &source, &self.fence, ids, members).await?;
            ids = &ids[taken..];
            if jobs.is_empty() {
                continue;
            }
            self.put(&jobs).await?;
            crate::failpoint::hold("upgrade_after_put").await;
            scripts::reshard_drop(con, &source, &self.fence, &jobs).await?;
            let n = jobs.len() as u64;
            moved += n;
            let total = self.moved.fetch_add(n, Ordering::Relaxed) + n;
            (self.progress)(Progress::Moved { total });
        }
        Ok(moved)
    }

    /// Writes `jobs` into their new homes, then wakes their movers.
    async fn put(&self, jobs: &[StoredJob]) -> Result<(), UpgradeError> {
        let mut to_lanes: BTreeMap<u32, (&Lane, Vec<LaneRecord>)> = BTreeMap::new();
        let mut to_spread: BTreeMap<u16, Vec<&StoredJob>> = BTreeMap::new();
        let mut redelivered = 0;
        for job in jobs {
            match self.home_of(job) {
                Home::Lane(lane) => {
                    let (record, in_flight) = lane_record(job);
                    redelivered += u64::from(in_flight);
                    to_lanes
                        .entry(lane.number)
                        .or_insert_with(|| (lane, Vec::new()))
                        .1
                        .push(record);
                }
                Home::Spread(shard) => to_spread.entry(shard).or_default().push(job),
            }
        }
        let lane_puts = to_lanes.values().flat_map(|(lane, records)| {
            let refs: Vec<&LaneRecord> = records.iter().collect();
            sized_calls(&refs, LaneRecord::size)
                .into_iter()
                .map(move |call| async move {
                    let mut con = self.con.clone();
                    let put = scripts::upgrade_put_lane(&mut con, lane, None, &call).await?;
                    let dues = call.iter().map(|r| &r.due);
                    wake(&mut con, &self.channel, &lane.wake_name(), dues).await?;
                    Ok::<_, UpgradeError>((true, put))
                })
        });
        let spread_puts = to_spread.iter().flat_map(|(shard, group)| {
            sized_calls(group, StoredJob::size)
                .into_iter()
                .map(move |call| async move {
                    let mut con = self.con.clone();
                    let keys: ShardKeys = self.spread.shard(*shard);
                    let put = scripts::reshard_put(
                        &mut con,
                        &keys,
                        &self.spread.shards().to_string(),
                        PutMode::Transit,
                        &call,
                    )
                    .await?;
                    let dues = call.iter().map(|j| &j.due);
                    wake(&mut con, &self.channel, &shard.to_string(), dues).await?;
                    Ok::<_, UpgradeError>((false, put))
                })
        });
        let lane_puts: Vec<_> = lane_puts.collect();
        let spread_puts: Vec<_> = spread_puts.collect();
        let (lanes, spreads) = futures::future::try_join(
            futures::future::try_join_all(lane_puts),
            futures::future::try_join_all(spread_puts),
        )
        .await?;
        let mut tally = self.tally.lock().expect("tally lock");
        for (to_lane, put) in lanes.into_iter().chain(spreads) {
            let Put {
                written,
                put_before,
                held,
            } = put;
            if to_lane {
                tally.to_lanes += written;
            } else {
                tally.to_spread_shards += written;
            }
            tally.put_before += put_before;
            tally.superseded += held;
        }
        tally.redelivered += redelivered;
        Ok(())
    }

    /// A local route's record goes to its lane; anything else to the spread shard of its id.
    /// A job whose envelope is not one (malformed) keeps it, in its spread shard, where the
    /// mover sends it to dead as layout 1's would.
    /// The upgrade's carry of unique windows and debounce deadlines: those of the jobs layout-1
    /// shard `shard` still stores (waiting, or dead) are copied to where each job goes, its
    /// route's lane or its spread shard, leaving any entry there already (a producer's on
    /// layout 2 is newer). Those of ids no longer stored (delivered before the upgrade) name no
    /// route, and start afresh. The source keys go with the retired shard.
    async fn carry_windows_home(
        &self,
        con: &mut Conn,
        shard: u16,
    ) -> Result<(), reshard::ReshardError> {
        let from = self.legacy.shard(shard);
        for kind in &reshard::WINDOW_KEYS {
            let mut cursor = 0u64;
            loop {
                let (next, page): reshard::WindowPage = redis::cmd(kind.scan)
                    .arg((kind.key)(&from))
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(reshard::WINDOW_PAGE)
                    .query_async(con)
                    .await?;
                let entries: Vec<(&[u8], &Vec<u8>, &Vec<u8>)> = page
                    .iter()
                    .filter_map(|(member, value)| Some(((kind.id)(member)?, member, value)))
                    .collect();
                if !entries.is_empty() {
                    let envelopes: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
                        .arg(&from.jobs)
                        .arg(entries.iter().map(|(id, _, _)| *id).collect::<Vec<_>>())
                        .query_async(con)
                        .await?;
                    // One pipeline per target key: a key's slot is its own on a cluster.
                    let mut copies: BTreeMap<String, redis::Pipeline> = BTreeMap::new();
                    for ((id, member, value), envelope) in entries.iter().zip(envelopes) {
                        let Some(dest) = envelope
                            .as_deref()
                            .and_then(|e| Envelope::decode(e).ok())
                            .map(|e| e.dest)
                        else {
                            continue;
                        };
                        let target = match self.registry.by_route.get(&dest) {
                            Some(lane) => (kind.lane_key)(&lane.keys).clone(),
                            None => (kind.key)(&self.spread.shard(self.spread.shard_of_bytes(id)))
                                .clone(),
                        };
                        let pipe = copies.entry(target.clone()).or_default();
                        let (command, flag) = kind.copy_new;
                        let copy = pipe.cmd(command).arg(target);
                        if let Some(flag) = flag {
                            copy.arg(flag);
                        }
                        if kind.score_first {
                            copy.arg(*value).arg(*member).ignore();
                        } else {
                            copy.arg(*member).arg(*value).ignore();
                        }
                    }
                    for pipe in copies.values() {
                        pipe.query_async::<()>(con).await?;
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(())
    }

    fn home_of(&self, job: &StoredJob) -> Home<'_> {
        let frame = job.envelope.as_ref().or(job.schedule_envelope.as_ref());
        let dest = frame.and_then(|f| Envelope::decode(f).ok()).map(|e| e.dest);
        match dest.and_then(|d| self.registry.by_route.get(&d)) {
            Some(lane) => Home::Lane(lane),
            None => Home::Spread(self.spread.shard_of_bytes(&job.id)),
        }
    }
}

/// A local route's job as its lane keeps it: the payload and meta apart (the max lateness in
/// its own hash), dead score, reason and history, and a schedule's definition, frame, next
/// occurrence, mark and quarantine as they are. A job claimed for a two-phase delivery (only
/// on a cluster) is made due again at its scheduled due: `true` then.
fn lane_record(job: &StoredJob) -> (LaneRecord, bool) {
    let mut record = LaneRecord {
        id: job.id.clone(),
        due: job.due.clone(),
        dead: job.dead.clone(),
        reason: job.reason.clone(),
        history: job.history.clone(),
        max_lateness: job.max_lateness.clone(),
        schedule: job.schedule.clone(),
        schedule_envelope: job.schedule_envelope.clone(),
        next_occurrence: job.next_occurrence.clone(),
        sched_fired: job.sched_fired.clone(),
        sched_quarantine: job.sched_quarantine.clone(),
        ..LaneRecord::default()
    };
    if let Some(envelope) = job
        .envelope
        .as_deref()
        .and_then(|e| Envelope::decode(e).ok())
    {
        let mut meta = envelope.meta;
        if record.max_lateness.is_none() {
            record.max_lateness = meta.max_lateness_ms.map(|ms| ms.to_string().into_bytes());
        }
        meta.max_lateness_ms = None;
        if meta != Meta::default() {
            record.meta = Some(serde_json::to_vec(&meta).expect("a Meta of strings and numbers"));
        }
        record.payload = Some(envelope.payload);
    }
    if record.payload.is_some() && record.due.is_none() && record.dead.is_none() {
        // Claimed for a two-phase delivery: its scheduled due is `"<due ms> <token>"` once
        // a publisher took it, its ready member `<sink>\n<due ms>\n<id>` before.
        let scheduled = job
            .scheduled
            .as_deref()
            .and_then(|s| s.split(|&b| b == b' ').next())
            .or_else(|| job.ready_member.as_deref()?.split(|&b| b == b'\n').nth(1));
        let due = scheduled
            .and_then(|d| {
                std::str::from_utf8(d)
                    .ok()?
                    .trim_start_matches('0')
                    .parse::<i64>()
                    .ok()
            })
            .unwrap_or(0);
        record.due = Some(due.to_string().into_bytes());
    }
    // Only a job a publisher held may have reached its list already.
    (record, job.inflight.is_some())
}

/// Announces the earliest of `dues` on the namespace's wake channel as `"<name> <due ms>"`,
/// so the target's mover need not wait for its idle poll.
async fn wake<'d>(
    con: &mut Conn,
    channel: &str,
    name: &str,
    dues: impl Iterator<Item = &'d Option<Vec<u8>>>,
) -> redis::RedisResult<()> {
    let earliest = dues
        .flatten()
        .filter_map(|d| std::str::from_utf8(d).ok()?.parse::<f64>().ok())
        .reduce(f64::min);
    let Some(earliest) = earliest else {
        return Ok(());
    };
    let _: i64 = redis::cmd("PUBLISH")
        .arg(channel)
        .arg(format!("{name} {}", earliest as i64))
        .query_async(con)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(dest: &str, payload: &str, meta: Meta) -> Vec<u8> {
        let mut env = Envelope::new(dest, payload.as_bytes().to_vec());
        env.meta = meta;
        env.encode().unwrap()
    }

    #[test]
    fn a_local_job_becomes_its_payload_and_meta_with_the_max_lateness_apart() {
        let mut meta = Meta::default();
        meta.headers
            .insert("traceparent".into(), "00-ab-cd-01".into());
        meta.max_lateness_ms = Some(250);
        let job = StoredJob {
            id: b"j1".to_vec(),
            due: Some(b"1764150000000".to_vec()),
            envelope: Some(frame("a", "hello", meta)),
            ..StoredJob::default()
        };
        let (record, in_flight) = lane_record(&job);
        assert!(!in_flight);
        assert_eq!(record.payload.as_deref(), Some(&b"hello"[..]));
        assert_eq!(record.due.as_deref(), Some(&b"1764150000000"[..]));
        assert_eq!(record.max_lateness.as_deref(), Some(&b"250"[..]));
        let meta: serde_json::Value =
            serde_json::from_slice(record.meta.as_ref().unwrap()).unwrap();
        assert_eq!(
            meta,
            serde_json::json!({"headers": {"traceparent": "00-ab-cd-01"}})
        );
        // Without meta, none is written; the lateness hash wins over the frame's copy.
        let job = StoredJob {
            id: b"j2".to_vec(),
            due: Some(b"5".to_vec()),
            envelope: Some(frame("a", "x", Meta::default())),
            max_lateness: Some(b"9".to_vec()),
            ..StoredJob::default()
        };
        let (record, _) = lane_record(&job);
        assert_eq!(record.meta, None);
        assert_eq!(record.max_lateness.as_deref(), Some(&b"9"[..]));
    }

    #[test]
    fn a_claimed_local_job_is_due_again_at_its_scheduled_due() {
        let job = StoredJob {
            id: b"j".to_vec(),
            envelope: Some(frame("a", "x", Meta::default())),
            inflight: Some(b"1764150005000".to_vec()),
            scheduled: Some(b"1764150000000 17".to_vec()),
            ..StoredJob::default()
        };
        let (record, in_flight) = lane_record(&job);
        assert!(in_flight);
        assert_eq!(record.due.as_deref(), Some(&b"1764150000000"[..]));
        // Waiting for a publisher, not yet held by one: nothing can have reached the list.
        let ready = StoredJob {
            id: b"r".to_vec(),
            envelope: Some(frame("a", "x", Meta::default())),
            ready_member: Some(b"local\n0001764150000001\nr".to_vec()),
            ..StoredJob::default()
        };
        let (record, in_flight) = lane_record(&ready);
        assert!(!in_flight);
        assert_eq!(record.due.as_deref(), Some(&b"1764150000001"[..]));
        // A dead job stays dead, a schedule keeps its frame whole.
        let dead = StoredJob {
            id: b"d".to_vec(),
            envelope: Some(frame("a", "x", Meta::default())),
            dead: Some(b"7".to_vec()),
            reason: Some(b"expired".to_vec()),
            ..StoredJob::default()
        };
        let (record, in_flight) = lane_record(&dead);
        assert!(!in_flight && record.due.is_none());
        assert_eq!(record.dead.as_deref(), Some(&b"7"[..]));
        let sched_frame = frame("a", "tick", Meta::default());
        let schedule = StoredJob {
            id: b"s".to_vec(),
            schedule: Some(b"1\n{}".to_vec()),
            schedule_envelope: Some(sched_frame.clone()),
            next_occurrence: Some(b"100".to_vec()),
            ..StoredJob::default()
        };
        let (record, in_flight) = lane_record(&schedule);
        assert!(!in_flight && record.payload.is_none() && record.due.is_none());
        assert_eq!(record.schedule_envelope, Some(sched_frame));
    }

    #[test]
    fn daemons_follow_when_they_run_this_version_or_a_later_one() {
        let daemon = |version: Option<&str>| Daemon {
            id: "d".into(),
            last_seen_ms: 0,
            expires_in_ms: 1,
            version: version.map(str::to_owned),
        };
        assert!(follows(&daemon(Some(crate::store::LAYOUT_SINCE))));
        assert!(follows(&daemon(Some("99.0.0"))));
        assert!(!follows(&daemon(Some("0.0.1"))));
        assert!(!follows(&daemon(None)));
        assert!(!follows(&daemon(Some("not a version"))));
    }

    #[test]
    fn the_markers_name_the_layout_and_the_oldest_release_that_follows() {
        for marker in [fence_marker(), retired_marker()] {
            let layout = Layout::parse(&marker).expect("a marker");
            assert!(
                matches!(&layout, Layout::Newer { layout: 2, min_version } if min_version == crate::store::layout_since()),
                "{marker}"
            );
        }
        assert!(fence_marker().starts_with("upgrading 2 "));
        assert!(retired_marker().starts_with("layout 2 "));
    }
}
