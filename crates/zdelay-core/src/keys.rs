//! The one place Redis key names are built.
//!
//! Every key of shard `s` carries the hash tag `{<namespace>:<s>}`, so each script touches
//! a single slot and stays atomic under Redis Cluster. The shard of a job is
//! `crc16(tag(id)) % shards`, where `tag(id)` is the part inside the first `{…}` of the id
//! when there is one (the Redis Cluster hash-tag rule) and the whole id otherwise. Jobs whose
//! ids share a tag share a shard, and so keep their relative order at equal due times.

use crc::{CRC_16_XMODEM, Crc};

/// Storage layout 1: every job in one of the namespace's shards. Only `zdelay upgrade` reads
/// it, to move a namespace to [`LAYOUT`]; everything else refuses it.
pub const LEGACY_LAYOUT: u32 = 1;

/// The storage layout this build runs and creates: route lanes for local routes, spread
/// shards for two-phase ones.
pub const LAYOUT: u32 = 2;

const CRC16: Crc<u16> = Crc::<u16>::new(&CRC_16_XMODEM);

/// Builds key names for one namespace and shard count.
#[derive(Debug, Clone)]
pub struct Keys {
    namespace: String,
    shards: u16,
    /// The shards are *spread shards*, each at the middle slot of its share of the slot range
    /// ([`spread_slot`]), keyed `<ns>:{<tag>}:s<k>:<kind>`; they hold the two-phase jobs
    /// (local routes have route lanes). `false` only for a layout-1 namespace's shards
    /// ([`Keys::layout_1`]), which `zdelay upgrade` empties and the fences mark.
    spread: bool,
}

impl Keys {
    pub fn new(namespace: &str, shards: u16) -> Self {
        Keys {
            namespace: namespace.to_owned(),
            shards,
            spread: true,
        }
    }

    /// The same namespace and layout with another shard count.
    pub fn with_shards(&self, shards: u16) -> Self {
        Keys {
            shards,
            ..self.clone()
        }
    }

    /// The layout-1 shards of this namespace: what `zdelay upgrade` moves from, and what a
    /// layout-2 namespace marks so that an older build's layout-1 calls are refused there.
    pub fn layout_1(&self) -> Self {
        Keys {
            spread: false,
            ..self.clone()
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn shards(&self) -> u16 {
        self.shards
    }

    /// The shard a job id belongs to.
    pub fn shard_of(&self, id: &str) -> u16 {
        self.shard_of_bytes(id.as_bytes())
    }

    /// The shard of an id read back from Redis, which may hold any bytes.
    pub fn shard_of_bytes(&self, id: &[u8]) -> u16 {
        CRC16.checksum(hash_tag_bytes(id)) % self.shards
    }

    /// The cluster slot of shard `shard`'s keys.
    pub fn shard_slot(&self, shard: u16) -> u16 {
        slot_of(&self.due(shard))
    }

    /// Every key of one shard, for the scripts.
    pub fn shard(&self, shard: u16) -> ShardKeys {
        ShardKeys {
            shard,
            shards: self.shards,
            due: self.due(shard),
            jobs: self.jobs(shard),
            inflight: self.inflight(shard),
            dead: self.dead(shard),
            reasons: self.reasons(shard),
            scheduled: self.scheduled(shard),
            ready: self.ready(shard),
            ready_ids: self.ready_ids(shard),
            max_lateness: self.shard_key(shard, ShardKey::MaxLateness.name()),
            schedules: self.shard_key(shard, ShardKey::Schedules.name()),
            sched_env: self.shard_key(shard, ShardKey::SchedEnv.name()),
            sched_due: self.shard_key(shard, ShardKey::SchedDue.name()),
            sched_fired: self.shard_key(shard, ShardKey::SchedFired.name()),
            sched_quarantine: self.shard_key(shard, ShardKey::SchedQuarantine.name()),
            history: self.history(shard),
            lease_seq: self.shard_key(shard, ShardKey::LeaseSeq.name()),
            claims: self.shard_key(shard, ShardKey::Claims.name()),
            transit_in: self.shard_key(shard, "transit_in"),
            layout: self.layout(shard),
            unique: self.shard_key(shard, "unique"),
            sched_health: self.shard_key(shard, "sched_health"),
            windows: self.shard_key(shard, "windows"),
            wake_channel: self.wake_channel(),
        }
    }

    fn shard_key(&self, shard: u16, suffix: &str) -> String {
        if self.spread {
            let tag = slot_tag(spread_slot(shard, self.shards));
            format!("{}:{{{tag}}}:s{shard}:{suffix}", self.namespace)
        } else {
            format!("{{{}:{}}}:{}", self.namespace, shard, suffix)
        }
    }

    /// ZSET: member = job id, score = due ms.
    pub fn due(&self, shard: u16) -> String {
        self.shard_key(shard, "due")
    }

    /// HASH: job id → envelope.
    pub fn jobs(&self, shard: u16) -> String {
        self.shard_key(shard, "jobs")
    }

    /// ZSET: member = job id, score = lease deadline ms (two-phase sinks).
    pub fn inflight(&self, shard: u16) -> String {
        self.shard_key(shard, "inflight")
    }

    /// ZSET: member = job id, score = ms it died.
    pub fn dead(&self, shard: u16) -> String {
        self.shard_key(shard, "dead")
    }

    /// HASH: job id → why it died.
    pub fn reasons(&self, shard: u16) -> String {
        self.shard_key(shard, "reasons")
    }

    /// HASH: job id → `"<scheduled due ms> <fencing token>"`, written once zdelay itself moves
    /// a claimed two-phase job's score (retry, release, hand-over, lease expiry), so its
    /// idempotency key `<id>:<due>` stays the same on every redelivery; a claim of such a job
    /// writes its token there too. A job on its first claim has none: its claim's record in
    /// [`ShardKeys::claims`] holds its due. Entries written by older versions hold the due
    /// alone.
    pub fn scheduled(&self, shard: u16) -> String {
        self.shard_key(shard, "scheduled")
    }

    /// ZSET (lexicographic, all scores 0): two-phase jobs due and waiting for their sink,
    /// member `<sink>\n<due ms, 16 digits>\n<id>`, so one sink's jobs sort by due time and a
    /// sink's publisher claims them without looking at any other sink's.
    pub fn ready(&self, shard: u16) -> String {
        self.shard_key(shard, "ready")
    }

    /// HASH: job id → its member in `ready` (for cancel, reschedule, replace and get).
    pub fn ready_ids(&self, shard: u16) -> String {
        self.shard_key(shard, "ready_ids")
    }

    /// HASH: job id → its earlier deaths, one `<died ms> <reason>` a line, oldest first, at
    /// most [`crate::dead::HISTORY_CAP`] lines. Written by `dead replay` (the death a replay
    /// leaves), read by `dead show`, dropped by `dead purge` and, once the job is no longer
    /// stored (delivered, cancelled), by the next `dead replay` or `dead purge`; moved with
    /// its job by `zdelay reshard`.
    pub fn history(&self, shard: u16) -> String {
        self.shard_key(shard, "history")
    }

    /// STRING, the shard's layout marker: the namespace's shard count once it has been
    /// resharded (`"8"`), or `"migrating <from> <to>"` while `zdelay reshard` runs. Every
    /// script that takes a shard computed by its caller checks it against the caller's
    /// shard count and refuses a mismatch, so a process that still uses an old count never
    /// writes into a wrong shard. No marker: the namespace was never resharded.
    pub fn layout(&self, shard: u16) -> String {
        self.shard_key(shard, "shards")
    }

    /// HASH of the daemons running on this namespace: instance id → `<registration expiry ms>
    /// <last heartbeat ms>` (a hash, not a ZSET, so heartbeats never count as job writes in
    /// ZADD statistics). One hash tag with `poller_slots`.
    pub fn instances(&self) -> String {
        format!("{{{}}}:instances", self.namespace)
    }

    /// HASH of poller slots: `<target>#<k>` → the id of the instance polling it.
    pub fn poller_slots(&self) -> String {
        format!("{{{}}}:slots", self.namespace)
    }

    /// HASH: the last plan of who polls what (`claim_slots`): `sig` → SHA-1 of what it was
    /// made of, instance id → its targets, one a line. Deleted by a graceful stop.
    pub fn slot_plan(&self) -> String {
        format!("{{{}}}:plan", self.namespace)
    }

    /// HASH: instance id → the raw sources it is configured with (`source:<key>`, one a line).
    pub fn instance_sources(&self) -> String {
        format!("{{{}}}:instance_sources", self.namespace)
    }

    /// HASH with the layout version and shard count, shared by every client and daemon.
    pub fn schema(&self) -> String {
        format!("{}:schema", self.namespace)
    }

    /// HASH: the lane registry of storage layout 2: route → its lane (`r:<route>`), lane
    /// number → what it holds (`#<lane>`), and the last number given out (`next`).
    pub fn lanes(&self) -> String {
        format!("{}:lanes", self.namespace)
    }

    /// HASH: local route → when a running daemon last had it in its config (Redis ms),
    /// refreshed by every daemon at `poller.stats_interval`. A route's lane whose entry is
    /// stale is swept to dead by the daemons that do not have the route.
    pub fn routes_seen(&self) -> String {
        format!("{{{}}}:routes_seen", self.namespace)
    }

    /// HASH: sink name → its last health as JSON (`{"kind","up","error","at"}`), written by
    /// the daemons' sink checkers, read by `zdelay stats`. In the registry's slot, so on a
    /// cluster the daemons' own bookkeeping needs one node besides the schema's.
    pub fn sink_states(&self) -> String {
        format!("{{{}}}:sinks", self.namespace)
    }

    /// HASH: a two-phase route's rate bucket, shared by every spread shard and daemon
    /// (`take_flow.lua`): "tokens", "at", and "h<shard>" (since when) and "b<shard>" (by what)
    /// while its part in spread shard <shard> is held. In the registry's slot: one key per route, one call per claim.
    pub fn route_flow(&self, route: &str) -> String {
        format!("{{{}}}:flow:{route}", self.namespace)
    }

    /// ZSET: the turns a two-phase route's per-key rate gave its jobs (`take_keys.lua`),
    /// `"<spread shard> <id>"` → turn ms. In the registry's slot, beside [`Keys::route_flow`].
    pub fn route_turns(&self, route: &str) -> String {
        format!("{{{}}}:turns:{route}", self.namespace)
    }

    /// HASH of recent activity, per minute (`<epoch minute>`): `<minute>:delivered` → jobs
    /// delivered, `<minute>:late<k>` → deliveries in lateness bucket `k` (the bounds of
    /// `zdelay_lateness_seconds`). Written by every daemon (HINCRBY, so instances add up),
    /// pruned to the last two hours; read by `zdelay forecast` (the drain rate behind the
    /// spike warning) and the console (lateness p50/p99, throughput). In the registry's slot.
    pub fn activity(&self) -> String {
        format!("{{{}}}:activity", self.namespace)
    }

    /// HASH of schedule requests not applied yet (`zd2_schedule`): schedule id → what its
    /// producer asked, merged (`{"seq","delete","set","paused"}`). Applied by a daemon.
    /// In the registry's slot, with `schedule_results` and `schedule_requests_lock`.
    pub fn schedule_requests(&self) -> String {
        format!("{{{}}}:sched_requests", self.namespace)
    }

    /// HASH of the outcome of each schedule's last applied request: schedule id → JSON with
    /// its `seq`; field `""` is the request sequence. Entries are kept for an hour.
    pub fn schedule_results(&self) -> String {
        format!("{{{}}}:sched_results", self.namespace)
    }

    /// STRING: the daemon applying schedule requests now (`SET NX PX`), so requests of one
    /// schedule are applied one at a time, in order.
    pub fn schedule_requests_lock(&self) -> String {
        format!("{{{}}}:sched_requests_lock", self.namespace)
    }

    /// HASH of named calendars: name → JSON `{"name","days":{"weekend","dates"},"updated_ms"}`
    /// (`zdelay calendar set`). Read when a schedule naming one is set. In the registry's slot.
    pub fn calendars(&self) -> String {
        format!("{{{}}}:calendars", self.namespace)
    }

    /// Pub/sub channel on which enqueues announce a new head: message `"<shard> <due ms>"`.
    pub fn wake_channel(&self) -> String {
        format!("{}:wake", self.namespace)
    }
}

/// One kind of per-shard key. The declaration order is the order in which every script takes
/// the shard's keys in KEYS (each script a subsequence of it; see `store::scripts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKey {
    Due,
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
    /// Only the dead-letter scripts and zdelay reshard's take it.
    History,
    /// Only `claim_jobs` takes it.
    LeaseSeq,
    Claims,
    Layout,
}

impl ShardKey {
    /// Every shard key, in declaration order: the one order scripts take them (`History`,
    /// which only the dead-letter scripts and reshard's take, then the layout marker last).
    pub const ALL: &[ShardKey] = &[
        ShardKey::Due,
        ShardKey::Jobs,
        ShardKey::Inflight,
        ShardKey::Dead,
        ShardKey::Reasons,
        ShardKey::Scheduled,
        ShardKey::Ready,
        ShardKey::ReadyIds,
        ShardKey::MaxLateness,
        ShardKey::Schedules,
        ShardKey::SchedEnv,
        ShardKey::SchedDue,
        ShardKey::SchedFired,
        ShardKey::SchedQuarantine,
        ShardKey::History,
        ShardKey::LeaseSeq,
        ShardKey::Claims,
        ShardKey::Layout,
    ];

    /// The key's suffix, which is also its name in the scripts' headers.
    pub fn name(self) -> &'static str {
        match self {
            ShardKey::Due => "due",
            ShardKey::Jobs => "jobs",
            ShardKey::Inflight => "inflight",
            ShardKey::Dead => "dead",
            ShardKey::Reasons => "reasons",
            ShardKey::Scheduled => "scheduled",
            ShardKey::Ready => "ready",
            ShardKey::ReadyIds => "ready_ids",
            ShardKey::MaxLateness => "max_lateness",
            ShardKey::Schedules => "schedules",
            ShardKey::SchedEnv => "sched_env",
            ShardKey::SchedDue => "sched_due",
            ShardKey::SchedFired => "sched_fired",
            ShardKey::SchedQuarantine => "sched_quarantine",
            ShardKey::History => "history",
            ShardKey::LeaseSeq => "lease_seq",
            ShardKey::Claims => "claims",
            ShardKey::Layout => "shards",
        }
    }
}

/// The keys of one shard, all sharing its hash tag, and what the scripts announce wake-ups on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardKeys {
    pub shard: u16,
    /// The shard count `shard` was computed with: what the scripts' layout fence checks.
    pub shards: u16,
    pub due: String,
    pub jobs: String,
    pub inflight: String,
    pub dead: String,
    pub reasons: String,
    pub scheduled: String,
    pub ready: String,
    pub ready_ids: String,
    pub max_lateness: String,
    pub schedules: String,
    pub sched_env: String,
    pub sched_due: String,
    /// HASH: schedule id → its high-water mark, ms: every occurrence at or before it was
    /// decided (written as a job, expired, or passed over by the misfire policy), so none is
    /// ever written again. Set at creation (to the creation time) and by each firing; deleted
    /// with the schedule.
    pub sched_fired: String,
    /// HASH: schedule id → `"<ms> <reason>"`: a schedule a firing could not read, taken off
    /// its timeline until `schedule set` writes it again.
    pub sched_quarantine: String,
    pub history: String,
    /// STRING: a counter of the shard's claims (each claim INCRs it once). Its value mod
    /// 1024 names the claim in its token `"<lease deadline ms>:<n>"` and in its jobs'
    /// `inflight` score (`deadline + n/1024`), so two claims of one job in one millisecond
    /// with the same lease deadline never share a token. Not per job: nothing deletes it, and
    /// `zdelay reshard` need not move it (a reshard refuses every older claim's settle by
    /// the layout fence).
    pub lease_seq: String,
    /// HASH: a claim's token → its ids and the due each was scheduled for (MessagePack),
    /// one field per claim instead of one per job; read only when a job's lease ends without
    /// an ack (its due is then kept in `scheduled`), deleted with the claim's last job in
    /// flight.
    pub claims: String,
    /// SET: ids `zdelay upgrade` put into this spread shard (deleted when it finishes).
    pub transit_in: String,
    /// The layout marker (see [`Keys::layout`]).
    pub layout: String,
    /// HASH: id → its unique_for window, ms, while the job waits (`NewJob::unique_for`).
    /// Scripts take it after the layout marker: producers that never ask for a window may
    /// leave it out.
    pub unique: String,
    /// ZSET: `u:<id>` → ms until which an enqueue of the id, delivered or dead, is answered
    /// as a duplicate; `d:<id>` → the latest due a debounced job may be pushed to. Entries
    /// whose time has passed are dropped by the next enqueue into the shard.
    pub windows: String,
    /// HASH: schedule id → its health record (`schedules::ScheduleHealth`): occurrences
    /// fired, missed, expired and skipped by calendar, when it last fired and that firing's
    /// occurrence. Written by the firing script, deleted with the schedule. Scripts take it
    /// after the layout marker.
    pub sched_health: String,
    /// Pub/sub channel for `"<shard> <due ms>"` wake-ups.
    pub wake_channel: String,
}

impl ShardKeys {
    pub fn get(&self, key: ShardKey) -> &str {
        match key {
            ShardKey::Due => &self.due,
            ShardKey::Jobs => &self.jobs,
            ShardKey::Inflight => &self.inflight,
            ShardKey::Dead => &self.dead,
            ShardKey::Reasons => &self.reasons,
            ShardKey::Scheduled => &self.scheduled,
            ShardKey::Ready => &self.ready,
            ShardKey::ReadyIds => &self.ready_ids,
            ShardKey::MaxLateness => &self.max_lateness,
            ShardKey::Schedules => &self.schedules,
            ShardKey::SchedEnv => &self.sched_env,
            ShardKey::SchedDue => &self.sched_due,
            ShardKey::SchedFired => &self.sched_fired,
            ShardKey::SchedQuarantine => &self.sched_quarantine,
            ShardKey::History => &self.history,
            ShardKey::LeaseSeq => &self.lease_seq,
            ShardKey::Claims => &self.claims,
            ShardKey::Layout => &self.layout,
        }
    }
}

/// The keys of one raw source: the ZSET producers `ZADD` into, its dead ZSET (default
/// `<source>:dead`), the reasons HASH beside it (`<dead>:reasons`), and, for a source that
/// delivers to a two-phase sink, what zdelay remembers about members in flight
/// (`<source>:claims`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawKeys {
    pub source: String,
    pub dead: String,
    pub reasons: String,
    pub claims: String,
}

impl RawKeys {
    pub fn new(source: &str, dead: Option<&str>) -> Self {
        let dead = dead.map_or_else(|| format!("{source}:dead"), str::to_owned);
        RawKeys {
            source: source.to_owned(),
            reasons: format!("{dead}:reasons"),
            claims: format!("{source}:claims"),
            dead,
        }
    }
}

/// The keys of one route lane (storage layout 2): a local route's jobs, stored in the hash
/// slot of the route's list so one script pushes onto the list and removes the jobs, on a
/// cluster too. `tag` is the slot's tag (`slot_tag`), so every key is
/// `<namespace>:{<tag>}:<kind>:<route>`; kinds hold no colon, so no two routes' keys collide
/// whatever their names hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneKeys {
    /// ZSET: stored id → due ms.
    pub due: String,
    /// HASH: stored id → payload, raw bytes.
    pub jobs: String,
    /// HASH: stored id → meta JSON, only for jobs that have meta.
    pub meta: String,
    /// HASH: stored id → max lateness ms, only for jobs enqueued with one.
    pub maxlate: String,
    /// SET: stored ids whose payload is over 4 KiB (the mover reads smaller chunks then).
    pub large: String,
    /// ZSET: stored id → ms it died.
    pub dead: String,
    /// HASH: stored id → why it died.
    pub reasons: String,
    /// HASH: stored id → its earlier deaths (replayed jobs only).
    pub history: String,
    /// HASH: schedule id → `"<version>\n<definition JSON>"` (the route's schedules).
    pub schedules: String,
    /// HASH: schedule id → the `zd1` frame its occurrences carry.
    pub sched_env: String,
    /// ZSET: schedule id → its next occurrence.
    pub sched_due: String,
    /// ZSET: schedule id → its high-water mark.
    pub sched_fired: String,
    /// HASH: schedule id → why it is quarantined.
    pub sched_quarantine: String,
    /// SET: ids `zdelay upgrade` or a relocation put here (deleted when it finishes).
    pub transit_in: String,
    /// STRING: the lock of a relocation into this lane (its holder's token, expiring), so one
    /// run at a time moves a retired lane's jobs here.
    pub relocating: String,
    /// HASH: the route's flow control state (`move_lane`): its rate's bucket (`tokens`, `at`)
    /// and since when it is held (`held_since`). Only for routes with a `rate` or a
    /// `max_length`.
    pub flow: String,
    /// STRING: the lane marker, `2 <lane> <LPUSH|RPUSH|XADD> <list key>` while live.
    pub marker: String,
    /// HASH and ZSET: unique windows and debounce deadlines, as [`ShardKeys::unique`] and
    /// [`ShardKeys::windows`]; taken after the marker.
    pub unique: String,
    pub windows: String,
    /// HASH: schedule id → its health record, as [`ShardKeys::sched_health`]; taken after
    /// the marker.
    pub sched_health: String,
}

impl LaneKeys {
    /// The keys that hold a lane's jobs, dead letters and schedules, in the order the scripts
    /// that move a lane's content (`upgrade_put_lane`, `relocate_drop_lane`) take them first.
    pub fn held(&self) -> [&String; 13] {
        [
            &self.due,
            &self.jobs,
            &self.meta,
            &self.maxlate,
            &self.large,
            &self.dead,
            &self.reasons,
            &self.history,
            &self.schedules,
            &self.sched_env,
            &self.sched_due,
            &self.sched_fired,
            &self.sched_quarantine,
        ]
    }

    pub fn new(namespace: &str, tag: &str, route: &str) -> Self {
        let key = |kind: &str| format!("{namespace}:{{{tag}}}:{kind}:{route}");
        LaneKeys {
            due: key("due"),
            jobs: key("jobs"),
            meta: key("meta"),
            maxlate: key("maxlate"),
            large: key("large"),
            dead: key("dead"),
            reasons: key("reasons"),
            history: key("history"),
            schedules: key("sched"),
            sched_env: key("sched_env"),
            sched_due: key("sched_due"),
            sched_fired: key("sched_fired"),
            sched_quarantine: key("sched_quarantine"),
            transit_in: key("transit_in"),
            relocating: key("relocating"),
            flow: key("flow"),
            marker: key("lane"),
            unique: key("unique"),
            windows: key("windows"),
            sched_health: key("sched_health"),
        }
    }
}

/// The slot of spread shard `shard` of `shards` (storage layout 2): the middle slot of the
/// shard's equal share of the 16,384 slots, so a cluster whose slots are split evenly holds
/// an even share of the shards on each master.
pub fn spread_slot(shard: u16, shards: u16) -> u16 {
    ((2 * u32::from(shard) + 1) * 16384 / (2 * u32::from(shards.max(1)))) as u16
}

/// The job id of a schedule's occurrence due at `due_ms`: `<schedule>:<due>`, with the
/// schedule id as its hash tag (`{<schedule>}:<due>`) unless it has one, so the occurrence
/// lives in its schedule's shard. Schedule ids with a brace must therefore carry a tag
/// ([`valid_schedule_id`]).
pub fn occurrence_id(schedule: &str, due_ms: i64) -> String {
    if has_hash_tag(schedule) {
        format!("{schedule}:{due_ms}")
    } else {
        format!("{{{schedule}}}:{due_ms}")
    }
}

/// The job id of a schedule run now, off its grid, at `now_ms` ([`occurrence_id`] then
/// `:run`). It ends with a word, where an occurrence's id ends with digits, so a run now is
/// never taken for the occurrence of the same millisecond (each written once): both are
/// delivered.
pub fn run_now_id(schedule: &str, now_ms: i64) -> String {
    format!("{}:run", occurrence_id(schedule, now_ms))
}

/// Whether `id` can name a schedule: non-empty, at most 512 bytes, no newline, and braces
/// only as a hash tag (`user{42}:daily`), so its occurrences land in its shard.
pub fn valid_schedule_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 512 || id.contains('\n') {
        return Err("must be non-empty, at most 512 bytes, without newlines".into());
    }
    if id.contains(['{', '}']) && !has_hash_tag(id) {
        return Err("braces are only allowed as a hash tag, e.g. user{42}:daily".into());
    }
    Ok(())
}

/// The number of Redis Cluster hash slots.
pub const SLOTS: u16 = 16384;

/// The Redis Cluster hash slot of a key (CRC16 of its hash tag, mod 16384).
pub fn slot_of(key: &str) -> u16 {
    slot_of_bytes(key.as_bytes())
}

/// [`slot_of`] for a key that need not be UTF-8.
pub fn slot_of_bytes(key: &[u8]) -> u16 {
    CRC16.checksum(hash_tag_bytes(key)) % SLOTS
}

/// The characters a slot's tag is made of, in ASCII order.
const TAG_ALPHABET: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";

/// The hash tag of slot `slot` (storage layout 2): the shortest string over `0-9a-z` whose
/// CRC-16/XMODEM modulo 16384 is `slot`, and among equally short ones the first in ASCII
/// order. So a key that carries `{<tag>}` lives in that slot, and keys can be put beside any
/// other key (a route's list) without the user writing hash tags.
///
/// The tags are part of the storage layout: data stored under them is found again only if
/// they never change, so the rule, not a stored table, defines them (a producer in another
/// language rebuilds the same table from it), and a test pins the table's SHA-256. Built once
/// per process, on first use: 36 one-character tags, 1,104 of two characters, 15,159 of three
/// and 85 of four.
///
/// # Panics
/// When `slot` is not below [`SLOTS`] (there is no such slot).
pub fn slot_tag(slot: u16) -> &'static str {
    assert!(slot < SLOTS, "slot {slot} is out of range 0..{SLOTS}");
    &SLOT_TAGS[usize::from(slot)]
}

static SLOT_TAGS: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(slot_tags);

/// Every slot's tag: candidates by length, then in ASCII order, until each slot has its first.
fn slot_tags() -> Vec<String> {
    let mut tags: Vec<Option<String>> = vec![None; usize::from(SLOTS)];
    let mut missing = usize::from(SLOTS);
    let mut candidate = Vec::with_capacity(4);
    for len in 1.. {
        // `digits` counts in base 36, most significant first: ASCII order within a length.
        let mut digits = vec![0usize; len];
        loop {
            candidate.clear();
            candidate.extend(digits.iter().map(|&d| TAG_ALPHABET[d]));
            let slot = usize::from(CRC16.checksum(&candidate) % SLOTS);
            if tags[slot].is_none() {
                tags[slot] = Some(String::from_utf8(candidate.clone()).expect("ASCII"));
                missing -= 1;
                if missing == 0 {
                    return tags.into_iter().map(|t| t.expect("every slot")).collect();
                }
            }
            // The next string of this length, or the next length once all were tried.
            let Some(last) = digits.iter().rposition(|&d| d + 1 < TAG_ALPHABET.len()) else {
                break;
            };
            digits[last] += 1;
            digits[last + 1..].fill(0);
        }
    }
    unreachable!("the lengths go on until every slot has a tag")
}

fn hash_tag_bytes(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{')
        && let Some(len) = key[open + 1..].iter().position(|&b| b == b'}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// Whether a key names a hash tag, so keys built around it share its slot.
pub fn has_hash_tag(key: &str) -> bool {
    hash_tag(key) != key
}

/// The part of a key or id that Redis Cluster hashes.
fn hash_tag(id: &str) -> &str {
    // The tag is cut at ASCII braces, so it is a valid UTF-8 slice of the id.
    std::str::from_utf8(hash_tag_bytes(id.as_bytes())).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_shards_sit_mid_share_in_their_tagged_slot() {
        assert_eq!(spread_slot(0, 16), 512);
        assert_eq!(spread_slot(15, 16), 15872);
        assert_eq!(spread_slot(0, 1), 8192);
        let k = Keys::new("zdelay", 16);
        assert_eq!(k.layout_1().due(3), "{zdelay:3}:due");
        for shard in 0..16 {
            let due = k.due(shard);
            assert_eq!(slot_of(&due), spread_slot(shard, 16), "{due}");
            assert!(due.starts_with("zdelay:{") && due.ends_with(&format!(":s{shard}:due")));
            assert_eq!(k.shard_slot(shard), spread_slot(shard, 16));
        }
        // Three masters splitting the slots evenly (0-5460, 5461-10922, 10923-16383) get
        // 5, 6 and 5 of 16 shards (layout 1's tags give 4, 8 and 4).
        let per_master = (0..16).fold([0; 3], |mut n, s| {
            n[usize::from(spread_slot(s, 16) / 5461).min(2)] += 1;
            n
        });
        assert_eq!(per_master, [5, 6, 5]);
        assert_eq!(Keys::new("zdelay", 16).layout_1().due(3), "{zdelay:3}:due");
    }

    #[test]
    fn all_lists_every_shard_key_once_in_declaration_order() {
        let order: Vec<usize> = ShardKey::ALL.iter().map(|&k| k as usize).collect();
        assert_eq!(order, (0..=ShardKey::Layout as usize).collect::<Vec<_>>());
    }

    #[test]
    fn occurrences_live_in_their_schedules_shard() {
        let k = Keys::new("zdelay", 16);
        for schedule in ["daily-report", "user{42}:daily", "{x}", "a:b"] {
            let id = occurrence_id(schedule, 1_700_000_000_000);
            assert_eq!(k.shard_of(&id), k.shard_of(schedule), "{schedule} → {id}");
            assert!(id.ends_with(":1700000000000"));
        }
        assert_eq!(occurrence_id("daily", 5), "{daily}:5");
        assert_eq!(occurrence_id("u{1}:d", 5), "u{1}:d:5");
        assert_eq!(run_now_id("daily", 5), "{daily}:5:run");
        assert_eq!(k.shard_of(&run_now_id("daily", 5)), k.shard_of("daily"));
        assert!(valid_schedule_id("u{1}:d").is_ok());
        assert!(valid_schedule_id("a}b").is_err());
        assert!(valid_schedule_id("{}").is_err());
        assert!(valid_schedule_id("").is_err());
        assert!(valid_schedule_id("a\nb").is_err());
    }

    #[test]
    fn layout_1_keys_share_the_shard_hash_tag() {
        let k = Keys::new("zdelay", 16).layout_1();
        assert_eq!(k.due(3), "{zdelay:3}:due");
        assert_eq!(k.jobs(3), "{zdelay:3}:jobs");
        assert_eq!(k.inflight(3), "{zdelay:3}:inflight");
        assert_eq!(k.dead(3), "{zdelay:3}:dead");
        assert_eq!(k.reasons(3), "{zdelay:3}:reasons");
        assert_eq!(k.schema(), "zdelay:schema");
        let shard = k.shard(3);
        for key in [
            ShardKey::Due,
            ShardKey::Jobs,
            ShardKey::Inflight,
            ShardKey::Dead,
        ] {
            assert_eq!(shard.get(key), format!("{{zdelay:3}}:{}", key.name()));
        }
        assert_eq!(shard.scheduled, "{zdelay:3}:scheduled");
        assert_eq!(shard.get(ShardKey::History), "{zdelay:3}:history");
        assert_eq!(shard.get(ShardKey::Layout), "{zdelay:3}:shards");
        assert_eq!(shard.shards, 16);
    }

    #[test]
    fn shard_of_bytes_agrees_with_shard_of() {
        let k = Keys::new("zdelay", 7);
        for id in [
            "foo",
            "{user1000}.following",
            "{}x",
            "x{a}b{c}",
            "{open",
            "é{ü}",
        ] {
            assert_eq!(k.shard_of(id), k.shard_of_bytes(id.as_bytes()), "{id}");
        }
        // Not UTF-8: still hashed by its tag.
        assert_eq!(k.shard_of_bytes(b"\xff{a}\xfe"), k.shard_of("a"));
    }

    #[test]
    fn shard_follows_redis_cluster_crc16() {
        // Redis Cluster: CLUSTER KEYSLOT foo = 12182 = crc16("foo") % 16384.
        let k = Keys::new("zdelay", 16384);
        assert_eq!(k.shard_of("foo"), 12182);
        assert_eq!(k.shard_of("{user1000}.following"), k.shard_of("user1000"));
        assert_eq!(k.shard_of("{}x"), k.shard_of("{}x"));
    }

    #[test]
    fn slots_follow_the_cluster_rule() {
        // CLUSTER KEYSLOT foo = 12182; {user1000}.following shares user1000's slot.
        assert_eq!(slot_of("foo"), 12182);
        assert_eq!(slot_of("{user1000}.following"), slot_of("user1000"));
        let k = Keys::new("zdelay", 16);
        assert_eq!(k.shard_slot(3), slot_of(&k.due(3)));
        assert_eq!(k.layout_1().shard_slot(3), slot_of("{zdelay:3}:anything"));
        assert!(has_hash_tag("{q}:emails") && !has_hash_tag("queue:emails"));
    }

    #[test]
    fn hash_tag_rules() {
        assert_eq!(hash_tag("{a}b"), "a");
        assert_eq!(hash_tag("x{a}b{c}"), "a");
        assert_eq!(hash_tag("{}a"), "{}a");
        assert_eq!(hash_tag("no-tag"), "no-tag");
        assert_eq!(hash_tag("{open"), "{open");
    }

    /// SHA-256 of the slot tag table: the 16,384 tags in slot order, each followed by `\n`.
    /// Also in docs/internals/layout-2.md.
    const SLOT_TAGS_SHA256: &str =
        "07c98064fa6df084a4c6a93b57e731c7af34debbd1a8ba4f9cfef1fc7b25511f";

    #[test]
    fn slot_tags_are_the_documented_table() {
        use sha2::{Digest, Sha256};
        let mut table = String::new();
        for slot in 0..SLOTS {
            table.push_str(slot_tag(slot));
            table.push('\n');
        }
        let digest: String = Sha256::digest(table.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(digest, SLOT_TAGS_SHA256);
        assert_eq!(
            [slot_tag(0), slot_tag(1), slot_tag(2)],
            ["1bz", "emj", "7lw"]
        );
        // The design's counts: tags by length.
        let mut by_len = [0usize; 5];
        for slot in 0..SLOTS {
            by_len[slot_tag(slot).len()] += 1;
        }
        assert_eq!(by_len, [0, 36, 1104, 15159, 85]);
    }

    #[test]
    fn every_slots_tag_hashes_to_it_as_a_hash_tag() {
        for slot in 0..SLOTS {
            let tag = slot_tag(slot);
            assert!(tag.bytes().all(|b| TAG_ALPHABET.contains(&b)), "{tag}");
            assert_eq!(slot_of(&format!("{{{tag}}}")), slot, "{tag}");
            assert_eq!(slot_of(&format!("zdelay:{{{tag}}}:due:emails")), slot);
        }
    }

    #[test]
    fn no_earlier_string_maps_to_a_slot_than_its_tag() {
        // Every string of up to 3 characters, and of 4 up to the last 4-character tag, in the
        // rule's order (by length, then ASCII): each slot's tag is the first that maps to it.
        let last_four = (0..SLOTS)
            .map(slot_tag)
            .filter(|t| t.len() == 4)
            .max()
            .expect("85 tags of four characters");
        let order = |t: &str| (t.len(), t.to_owned());
        let mut first_seen: Vec<Option<String>> = vec![None; usize::from(SLOTS)];
        let alphabet: Vec<char> = TAG_ALPHABET.iter().map(|&b| char::from(b)).collect();
        let mut strings: Vec<String> = vec![String::new()];
        for _ in 1..=4 {
            strings = strings
                .iter()
                .flat_map(|prefix| alphabet.iter().map(move |c| format!("{prefix}{c}")))
                .take_while(|s| s.len() < 4 || s.as_str() <= last_four)
                .collect();
            for s in &strings {
                let slot = usize::from(slot_of(s));
                if first_seen[slot].is_none() {
                    first_seen[slot] = Some(s.clone());
                }
                assert!(
                    order(slot_tag(slot as u16)) <= order(s),
                    "{s} maps to slot {slot} and comes before its tag {}",
                    slot_tag(slot as u16)
                );
            }
        }
        for slot in 0..SLOTS {
            assert_eq!(
                first_seen[usize::from(slot)].as_deref(),
                Some(slot_tag(slot))
            );
        }
    }

    #[test]
    #[should_panic(expected = "slot 16384 is out of range")]
    fn there_is_no_tag_beyond_the_last_slot() {
        slot_tag(SLOTS);
    }

    #[test]
    fn shards_spread() {
        let k = Keys::new("zdelay", 16);
        let mut seen = [0u32; 16];
        for i in 0..16_000 {
            seen[k.shard_of(&format!("job-{i}")) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| (700..1300).contains(&c)), "{seen:?}");
    }
}
