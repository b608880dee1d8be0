//! `zdelay_core::Client`: the thin enqueue library.
//!
//! Enqueue at a time or after a delay (measured on the Redis clock), with an id, headers and
//! a policy for an id that exists; batch enqueue pipelines one `enqueue_jobs` call per shard
//! chunk; cancel, reschedule and get by id are O(log N) in the job's own shard. Dead-letter
//! listing, replay and purge live in `dead`, for the CLI and for operators' own tools.
//!
//! The shard count is read at connect and checked on every write: each script refuses a shard
//! computed with a count the namespace no longer has (its layout fence). Refused because the
//! namespace was resharded, the client reads `<ns>:schema` again and retries once with the new
//! count; refused because a reshard is running, the call fails with
//! [`StoreError::Resharding`] ([`ClientError::is_retryable`]), having written nothing.

use crate::config::RedisConfig;
use crate::envelope::{Envelope, EnvelopeError, validate_dest};
pub use crate::job::{Cancelled, Due, Enqueued, JobState, OnConflict};
use crate::keys::Keys;
use crate::routes::{Refused, Routes};
use crate::store::scripts::{self, EnqueueCall, EnqueueItem, EnvelopeHead, PEEK_HEAD_MAX};
use crate::store::{self, Conn, Layout, StoreError};
use lanes::{Found, Held, LaneBook};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

pub(crate) mod json_job;
pub(crate) mod lanes;
pub use json_job::JobLine;
#[cfg(test)]
mod vectors;

/// Jobs per `enqueue_jobs` call: small enough to keep one script call short.
const ENQUEUE_CHUNK: usize = 500;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("job {0} exists (policy: error)")]
    Exists(String),
    #[error("unknown destination {dest:?}{detail}; configured routes: {known}")]
    UnknownDestination {
        dest: String,
        /// Why a `<sink>/<target>` was refused, when it names a two-phase sink.
        detail: String,
        known: String,
    },
    /// On storage layout 2, a destination the lane registry does not name yet: no daemon
    /// whose config has the route has started, and no producer given that config registered
    /// it (or this one may not: `detail` says so). Nothing was written; retryable.
    #[error(
        "destination {dest:?} has no route lane yet{detail}: on storage layout 2 a daemon whose \
         config has the route registers it when it starts, and so does a producer given that \
         config; nothing was written, try again once one has (registered: {known})"
    )]
    NoLane {
        dest: String,
        detail: String,
        known: String,
    },
    /// On storage layout 2, a producer's config says otherwise of a route than the lane
    /// registry (another list or push side, local against two-phase): a producer never
    /// changes a registration. Nothing was written.
    #[error(
        "route {route:?} is registered as {registered}, but this config says {config}: a \
         producer never changes a route's registration, so nothing was written; start a daemon \
         with this config to register the change, or give the producer the config the daemons \
         run"
    )]
    RouteDiffers {
        route: String,
        registered: String,
        config: String,
    },
    #[error("payload of {size} bytes exceeds max_payload {max}")]
    Oversize { size: usize, max: usize },
    #[error("invalid job id {0:?}: it must be non-empty, at most 256 bytes")]
    BadId(String),
    /// A user-chosen id in the form of the ids storage layout 2 generates (it starts with
    /// `~`): [`refuse_reserved_id`].
    #[error(
        "job id {0:?} starts with ~, which is reserved for the ids zdelay generates: choose an \
         id that does not"
    )]
    ReservedId(String),
    /// A generated id (`~<lane>.<stored id>`) that is not one.
    #[error(transparent)]
    Id(#[from] crate::lane_id::IdError),
    /// On storage layout 2, a user-chosen id held by more than one route's lane.
    #[error(
        "job id {id:?} is stored for routes {}: on storage layout 2 a user-chosen id is unique \
         per route only, so it cannot be found by id alone; give its destination (--dest, \
         Client::cancel_in and its siblings), or use ids unique across routes",
        routes.join(" and ")
    )]
    AmbiguousId { id: String, routes: Vec<String> },
    /// On storage layout 2, `schedule_set` of an id kept for another route: a schedule lives
    /// in its destination's lane, and moving it to another is not one atomic write.
    #[error(
        "schedule {id:?} exists for route {route}, so it cannot be set for {dest}: on storage \
         layout 2 a schedule lives with its destination; delete it and set it again"
    )]
    ScheduleElsewhere {
        id: String,
        route: String,
        dest: String,
    },
    /// A dead-letter selection that cannot be served: a filter that does not apply to raw
    /// members, an empty time window, a raw member id that is not one.
    #[error("{0}")]
    InvalidSelection(String),
    /// A schedule in its JSON form that cannot be read, or a schedule request that does not
    /// fit (`schedule_requests`): the text names the field.
    #[error("{0}")]
    InvalidSchedule(String),
    #[error("invalid schedule id {id:?}: {why}")]
    BadScheduleId { id: String, why: String },
    #[error(transparent)]
    Schedule(#[from] crate::schedule::ScheduleError),
    #[error("schedule {0} kept changing while it was being updated; try again")]
    Contended(String),
    #[error(
        "schedule {id} cannot be read ({why}): write it again with `schedule set`, or delete it"
    )]
    UnreadableSchedule { id: String, why: String },
    /// A due time in epoch ms that reads as epoch seconds (`job::check_epoch_ms`).
    #[error("{0}")]
    SecondsLikeDue(String),
    /// On storage layout 2, a route lane kept refusing the call after the lane registry was
    /// read again: its route is moving to a new lane (the old one is retired a moment before
    /// the registry names the new one), or daemons with different routes are starting.
    /// Nothing was written; retryable.
    #[error(
        "the route lane of {what} refused the call after the lane registry was read again \
         ({detail}): its route may be moving to a new lane, or daemons with different routes \
         are starting; nothing was written, try again"
    )]
    LaneRefused { what: String, detail: String },
}

impl From<redis::RedisError> for ClientError {
    fn from(e: redis::RedisError) -> Self {
        ClientError::Store(StoreError::Redis(e))
    }
}

impl ClientError {
    /// A bounded label for the `error_type` metric.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Store(StoreError::Schema(_)) => "schema",
            ClientError::Store(StoreError::Unsupported(_)) => "unsupported",
            ClientError::Store(StoreError::Resharding { .. }) => "resharding",
            ClientError::Store(StoreError::Resharded { .. }) => "resharded",
            ClientError::Store(StoreError::LayoutTooNew { .. }) => "layout_too_new",
            ClientError::Store(StoreError::NoNamespace { .. }) => "no_namespace",
            ClientError::Store(_) => "redis",
            ClientError::Envelope(_) => "envelope",
            ClientError::Exists(_) => "exists",
            ClientError::UnknownDestination { .. } => "unknown_destination",
            ClientError::NoLane { .. } => "no_lane",
            ClientError::RouteDiffers { .. } => "route_differs",
            ClientError::Oversize { .. } => "oversize",
            ClientError::BadId(_) => "bad_id",
            ClientError::ReservedId(_) => "reserved_id",
            ClientError::Id(_) => "bad_id",
            ClientError::AmbiguousId { .. } => "ambiguous_id",
            ClientError::ScheduleElsewhere { .. } => "schedule_elsewhere",
            ClientError::InvalidSelection(_) => "invalid_selection",
            ClientError::BadScheduleId { .. } => "bad_schedule_id",
            ClientError::Schedule(_) | ClientError::InvalidSchedule(_) => "invalid_schedule",
            ClientError::Contended(_) => "contended",
            ClientError::UnreadableSchedule { .. } => "unreadable_schedule",
            ClientError::SecondsLikeDue(_) => "seconds_like_due",
            ClientError::LaneRefused { .. } => "lane_refused",
        }
    }

    /// Whether the same call may succeed later unchanged ([`StoreError::is_retryable`]): the
    /// connection or the server failed for a moment, a reshard or an upgrade runs, the
    /// namespace waits for its first daemon, a route lane is being moved or not registered yet.
    /// A call refused by a fence wrote nothing; after a
    /// dropped connection the call may have run, so send an enqueue again with the same id
    /// (a generated id is new each time: the job could then be stored twice).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Store(e) => e.is_retryable(),
            ClientError::LaneRefused { .. } | ClientError::NoLane { .. } => true,
            _ => false,
        }
    }

    /// The layout a shard's marker refused the call with (the namespace was resharded, or is
    /// being resharded).
    fn refused_by(&self) -> Option<Layout> {
        match self {
            ClientError::Store(StoreError::Redis(e)) => Layout::of_error(e),
            ClientError::Store(StoreError::Resharded { shards, .. }) => {
                Some(Layout::Shards(*shards))
            }
            ClientError::Store(StoreError::Resharding { from, to, .. }) => {
                Some(Layout::Migrating {
                    from: *from,
                    to: *to,
                })
            }
            _ => None,
        }
    }
}

/// A moment a job is due at, for [`NewJob::at`]: epoch milliseconds, or a `SystemTime`.
pub trait DueMoment {
    fn epoch_ms(self) -> i64;
}

impl DueMoment for i64 {
    fn epoch_ms(self) -> i64 {
        self
    }
}

impl DueMoment for std::time::SystemTime {
    fn epoch_ms(self) -> i64 {
        // Rounded up to the millisecond, so a job is never due before the moment given.
        self.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| {
            let ms = d.as_millis() + u128::from(d.subsec_nanos() % 1_000_000 != 0);
            i64::try_from(ms).unwrap_or(i64::MAX)
        })
    }
}

/// A job to enqueue. `NewJob::new(dest, payload).after(…)` / `.at(…)`.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    pub id: Option<String>,
    pub dest: String,
    pub payload: Vec<u8>,
    pub due: Due,
    pub headers: BTreeMap<String, String>,
    pub max_attempts: Option<u32>,
    /// Delivered no later than this after its due time, else dead with reason `expired`.
    pub max_lateness: Option<Duration>,
    /// Spread over this window after `due`: the job is due at a point in it derived from its
    /// id ([`spread_offset_ms`]), the same point every time that id is enqueued.
    pub spread: Option<Duration>,
    /// Once delivered or dead, its id is remembered this long: an enqueue of the id meanwhile
    /// is answered [`Enqueued::Duplicate`] and writes nothing.
    pub unique_for: Option<Duration>,
}

/// Where in a spread window of `window_ms` the job with stored id `id` falls: FNV-1a (64
/// bits) of the id's bytes modulo the window, in ms from its start. The producer protocol's
/// rule (`docs/reference/protocol.md`), so every client spreads a job alike.
pub fn spread_offset_ms(id: &str, window_ms: u64) -> u64 {
    if window_ms == 0 {
        return 0;
    }
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    hash % window_ms
}

/// `due` moved to the point of `window` that `id` falls on.
pub(crate) fn spread_due(due: Due, id: &str, window: Option<Duration>) -> Due {
    let Some(window) = window else { return due };
    let offset = spread_offset_ms(id, window.as_millis() as u64);
    match due {
        Due::At(ms) => Due::At(ms.saturating_add(offset as i64)),
        Due::In(delay) => Due::In(delay + Duration::from_millis(offset)),
    }
}

impl NewJob {
    /// Due now unless `at` or `after` says otherwise.
    pub fn new(dest: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        NewJob {
            id: None,
            dest: dest.into(),
            payload: payload.into(),
            due: Due::In(Duration::ZERO),
            headers: BTreeMap::new(),
            max_attempts: None,
            max_lateness: None,
            spread: None,
            unique_for: None,
        }
    }
    /// Due at a moment: epoch milliseconds (`i64`) or a [`std::time::SystemTime`]
    /// (`SystemTime::now() + Duration::from_secs(60)`; a time before 1970 means now).
    pub fn at(mut self, when: impl DueMoment) -> Self {
        self.due = Due::At(when.epoch_ms());
        self
    }
    pub fn after(mut self, delay: Duration) -> Self {
        self.due = Due::In(delay);
        self
    }
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }
    pub fn header(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(key.into(), value.into());
        self
    }
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// Stale after this: a job that cannot be delivered within `limit` of its due time goes
    /// to dead (`expired`) instead (local routes: checked when it is moved; two-phase sinks:
    /// when it is published).
    pub fn max_lateness(mut self, limit: Duration) -> Self {
        self.max_lateness = Some(limit);
        self
    }
    /// Due at a point of the `window` after its due time derived from its id: a burst of
    /// jobs spread evenly over it, each never before the window starts.
    pub fn spread(mut self, window: Duration) -> Self {
        self.spread = Some(window);
        self
    }
    /// Unique for a window after it leaves: once delivered or dead, an enqueue of its id within
    /// `window` is answered [`Enqueued::Duplicate`] instead of scheduling it again. Costs one
    /// sorted-set entry per id for the window (see the flow control page).
    pub fn unique_for(mut self, window: Duration) -> Self {
        self.unique_for = Some(window);
        self
    }
}

/// A job as `get` sees it.
#[derive(Debug, Clone)]
pub struct JobView {
    pub id: String,
    /// The shard that holds it (storage layout 1).
    pub shard: u16,
    /// The route lane that holds it (storage layout 2; `shard` is then 0).
    pub lane: Option<u32>,
    pub state: JobState,
    /// Due ms (Scheduled, Due), lease deadline (InFlight) or time of death (Dead).
    pub score: Option<f64>,
    /// The stored bytes, and their decoding.
    pub raw: Vec<u8>,
    pub envelope: Result<Envelope, EnvelopeError>,
    /// The payload's size in bytes (of a value that is not an envelope: its size); with
    /// [`Client::get_preview`], `envelope` holds only the payload's first bytes.
    pub payload_size: u64,
    pub reason: Option<String>,
    /// For a due job waiting for its two-phase sink: the sink's name.
    pub sink: Option<String>,
}

impl JobView {
    /// The readable JSON form printed by `zdelay get`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut obj = match &self.envelope {
            Ok(env) => env.to_json(),
            Err(e) => {
                let mut m = serde_json::Map::new();
                m.insert("malformed".into(), e.to_string().into());
                m.insert(
                    "raw".into(),
                    String::from_utf8_lossy(&self.raw).into_owned().into(),
                );
                m
            }
        };
        obj.insert("id".into(), self.id.clone().into());
        match self.lane {
            Some(lane) => obj.insert("lane".into(), crate::lane_id::base36(lane).into()),
            None => obj.insert("shard".into(), self.shard.into()),
        };
        obj.insert("state".into(), serde_json::to_value(self.state).unwrap());
        let field = match self.state {
            JobState::Scheduled | JobState::Due => "due",
            JobState::InFlight => "lease_deadline",
            JobState::Dead => "died",
            JobState::Orphan => "score",
        };
        if let Some(score) = self.score {
            obj.insert(field.into(), (score as i64).into());
        }
        if let Some(reason) = &self.reason {
            obj.insert("reason".into(), reason.clone().into());
        }
        if let Some(sink) = &self.sink {
            obj.insert("waiting_for_sink".into(), sink.clone().into());
        }
        serde_json::Value::Object(obj)
    }
}

/// Handle for producers and operators. Cheap to clone; clones share the key layout, so one
/// that learns of a reshard teaches the others.
#[derive(Clone)]
pub struct Client {
    pub(crate) con: Conn,
    layout: Arc<RwLock<Keys>>,
    routes: Option<Arc<Routes>>,
    max_payload: Option<usize>,
    ids: Arc<IdGenerator>,
    /// The namespace's lane registry and stored-id generator.
    lanes: Arc<LaneBook>,
}

impl Client {
    /// Connects with a config's view of the namespace: creates it when missing (with
    /// `cfg.shards`), checks it otherwise, and loads the scripts.
    /// For daemons and tools that own the config; a producer uses [`Client::attach`].
    pub async fn connect(cfg: &RedisConfig) -> Result<Self, ClientError> {
        Self::connect_testing(cfg, None).await
    }

    /// [`Client::connect`] for a tool that has a whole config: a namespace it creates gets a
    /// test clock when `test_clock` (`[testing] clock`) says so, and an existing one whose
    /// clock disagrees is refused ([`StoreError::ClockMismatch`]), as the daemon does.
    pub async fn connect_testing(
        cfg: &RedisConfig,
        test_clock: Option<bool>,
    ) -> Result<Self, ClientError> {
        let mut con = Conn::connect(cfg).await?;
        store::check_server(&mut con).await?;
        let shards =
            store::ensure_schema(&mut con, &Keys::new(&cfg.namespace, cfg.shards), test_clock)
                .await?;
        Self::connected(con, &cfg.namespace, shards).await
    }

    /// Connects as a producer: the namespace's shard count is read from Redis (`cfg.shards`
    /// is not used), so a producer cannot disagree with
    /// the daemons, and it never creates the namespace: until a daemon has, this fails with
    /// [`StoreError::NoNamespace`] (retryable), having written nothing.
    pub async fn attach(cfg: &RedisConfig) -> Result<Self, ClientError> {
        let mut con = Conn::connect(cfg).await?;
        store::check_server(&mut con).await?;
        let schema = store::read_schema(&mut con, &Keys::new(&cfg.namespace, cfg.shards)).await?;
        let Some(shards) = schema.shards else {
            return Err(StoreError::NoNamespace {
                namespace: cfg.namespace.clone(),
            }
            .into());
        };
        Self::connected(con, &cfg.namespace, shards).await
    }

    async fn connected(mut con: Conn, namespace: &str, shards: u16) -> Result<Self, ClientError> {
        let shards = store::ensure_schema(&mut con, &Keys::new(namespace, shards), None).await?;
        let keys = Keys::new(namespace, shards);
        scripts::load_all(&mut con).await?;
        let lanes = Arc::new(LaneBook::read(&mut con, &keys).await?);
        Ok(Client {
            con,
            layout: Arc::new(RwLock::new(keys)),
            routes: None,
            max_payload: None,
            ids: Arc::new(IdGenerator::default()),
            lanes,
        })
    }

    /// Connects a producer to the default namespace (`zdelay`) at a URL: [`Client::attach`].
    pub async fn open(url: &str) -> Result<Self, ClientError> {
        Self::attach(&RedisConfig {
            url: url.to_owned(),
            ..RedisConfig::default()
        })
        .await
    }

    /// Refuses enqueues to destinations the route table does not admit (otherwise they die
    /// at delivery). `Routes::from_config` admits exactly what the daemon delivers.
    pub fn with_routes(mut self, routes: Routes) -> Self {
        self.routes = Some(Arc::new(routes));
        self
    }

    /// Refuses enqueues to destinations outside `names`: for producers that know the route
    /// names but not the daemon's config.
    pub fn with_destinations(self, names: impl IntoIterator<Item = String>) -> Self {
        self.with_routes(Routes::names(names))
    }

    /// What the config these routes came from registers on layout 2 (`None` without one).
    pub(crate) fn lane_routes(&self) -> Option<&crate::routes::LaneRoutes> {
        self.routes.as_deref().and_then(Routes::lane_routes)
    }

    /// Rejects payloads over `max` bytes at enqueue (otherwise they die at delivery).
    pub fn with_max_payload(mut self, max: usize) -> Self {
        self.max_payload = Some(max);
        self
    }

    /// The key layout in use: the namespace and the shard count last read from it.
    pub fn keys(&self) -> Keys {
        self.layout.read().expect("layout lock").clone()
    }

    /// Reads the namespace's shard count from `<ns>:schema` again and uses it from now on.
    /// Fails while a reshard runs ([`StoreError::Resharding`]).
    pub async fn refresh_layout(&self) -> Result<Keys, ClientError> {
        let current = self.keys();
        let schema = store::read_schema(&mut self.con.clone(), &current).await?;
        if let Some((from, to)) = schema.migrating {
            return Err(Layout::Migrating { from, to }.error(&current).into());
        }
        let key = current.schema();
        store::check_layout_field(
            &current,
            schema.layout.as_deref(),
            schema.upgrading.is_some(),
        )?;
        let shards = schema
            .shards
            .ok_or_else(|| StoreError::Schema(format!("{key} has no shard count")))?;
        self.lane_book().reshard_seen(schema.resharding);
        let keys = current.with_shards(shards);
        *self.layout.write().expect("layout lock") = keys.clone();
        Ok(keys)
    }

    /// Runs `op` with the current layout. Refused by a layout fence because the namespace
    /// was resharded, it reads the layout again and runs `op` once more; refused because a
    /// reshard is running, it fails with [`StoreError::Resharding`], and because a newer
    /// storage layout owns the shard, with [`StoreError::LayoutTooNew`]. `op` must be safe to
    /// run again after a refusal (a refused script wrote nothing).
    pub(crate) async fn fenced<T, F, Fut>(&self, op: F) -> Result<T, ClientError>
    where
        F: Fn(Keys) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let keys = self.keys();
        let refused = match op(keys.clone()).await {
            Err(e) => match e.refused_by() {
                Some(layout) => layout,
                None => return Err(e),
            },
            ok => return ok,
        };
        // Only a new shard count is worth another try; a reshard running or a newer layout
        // refuses the next call the same way.
        if !matches!(refused, Layout::Shards(_)) {
            return Err(refused.error(&keys).into());
        }
        let keys = self.refresh_layout().await?;
        match op(keys.clone()).await {
            Err(e) => match e.refused_by() {
                Some(layout) => Err(layout.error(&keys).into()),
                None => Err(e),
            },
            ok => ok,
        }
    }

    /// A clone of the connection, for plain commands.
    pub fn connection(&self) -> Conn {
        self.con.clone()
    }

    /// The namespace's clock: Redis TIME and, on a namespace with a test clock, its offset.
    /// Refused on a namespace without one ([`StoreError::NoTestClock`]).
    pub async fn clock(&self) -> Result<store::clock::Reading, ClientError> {
        Ok(store::clock::show(&mut self.con.clone(), &self.keys()).await?)
    }

    /// Moves the namespace's test clock forward by `by` (at least 1 ms) and wakes every daemon
    /// of the namespace: jobs, schedule occurrences, leases and windows that fall due in the
    /// time skipped are handled at once. Answers the new reading. Refused, writing nothing, on
    /// a namespace without a test clock ([`StoreError::NoTestClock`]).
    pub async fn advance_clock(&self, by: Duration) -> Result<store::clock::Reading, ClientError> {
        Ok(store::clock::advance(&mut self.con.clone(), &self.keys(), by).await?)
    }

    /// A new time-ordered id (ULID, monotonic within this process).
    pub fn new_id(&self) -> String {
        self.ids.next()
    }

    /// Enqueues one job and returns its id.
    pub async fn enqueue(
        &self,
        job: NewJob,
        policy: OnConflict,
    ) -> Result<(String, Enqueued), ClientError> {
        self.enqueue_batch(vec![job], policy)
            .await?
            .pop()
            .expect("one result per job")
    }

    /// Enqueues many jobs; one result per job, in input order. Jobs that fail validation
    /// fail alone, and so do jobs refused while a reshard runs ([`StoreError::Resharding`]:
    /// not written, retry them later). A Redis error fails the whole call (some chunks may
    /// have been written: re-running with the same ids and `Replace` is safe).
    pub async fn enqueue_batch(
        &self,
        jobs: Vec<NewJob>,
        policy: OnConflict,
    ) -> Result<Vec<Result<(String, Enqueued), ClientError>>, ClientError> {
        self.enqueue_lanes(self.lane_book(), jobs, policy).await
    }

    /// `enqueue_batch` into the spread shards (two-phase routes' jobs).
    pub(super) async fn enqueue_in_shards(
        &self,
        jobs: Vec<NewJob>,
        policy: OnConflict,
    ) -> Result<Vec<Result<(String, Enqueued), ClientError>>, ClientError> {
        let mut results: Vec<Option<Result<(String, Enqueued), ClientError>>> =
            (0..jobs.len()).map(|_| None).collect();
        // The jobs to write, with their input positions.
        let mut pending: Vec<(usize, EnqueueItem)> = Vec::new();
        for (i, job) in jobs.into_iter().enumerate() {
            match self.prepare(job) {
                Ok(item) => pending.push((i, item)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let mut keys = self.keys();
        let mut refreshed = false;
        while !pending.is_empty() {
            // Per shard: the jobs and their input positions.
            let mut by_shard: BTreeMap<u16, (Vec<EnqueueItem>, Vec<usize>)> = BTreeMap::new();
            for (i, item) in pending.drain(..) {
                let entry = by_shard.entry(keys.shard_of(&item.id)).or_default();
                entry.0.push(item);
                entry.1.push(i);
            }
            let mut calls = Vec::new();
            let mut positions = Vec::new();
            for (shard, (items, index)) in &by_shard {
                for (chunk, index) in items.chunks(ENQUEUE_CHUNK).zip(index.chunks(ENQUEUE_CHUNK)) {
                    calls.push(EnqueueCall {
                        keys: keys.shard(*shard),
                        items: chunk,
                    });
                    positions.push(index);
                }
            }
            let answers = scripts::enqueue_jobs(&mut self.con.clone(), policy, &calls).await?;
            for ((call, index), answer) in calls.iter().zip(positions).zip(answers) {
                let codes = match answer {
                    Ok(codes) => codes,
                    Err(e) => match Layout::of_error(&e) {
                        // Resharded since this client read the layout: again with the new one.
                        Some(Layout::Shards(_)) if !refreshed => {
                            pending.extend(index.iter().copied().zip(call.items.iter().cloned()));
                            continue;
                        }
                        Some(layout) => {
                            for &i in index {
                                results[i] = Some(Err(layout.error(&keys).into()));
                            }
                            continue;
                        }
                        None => return Err(e.into()),
                    },
                };
                for ((item, &i), answer) in call.items.iter().zip(index).zip(codes) {
                    results[i] = Some(match answer {
                        Some(done) => Ok((item.id.clone(), done)),
                        None => Err(ClientError::Exists(item.id.clone())),
                    });
                }
            }
            if !pending.is_empty() {
                refreshed = true;
                match self.refresh_layout().await {
                    Ok(new) => keys = new,
                    Err(e) => match e.refused_by() {
                        // A reshard started meanwhile: these jobs were not written.
                        Some(layout) => {
                            for (i, _) in pending.drain(..) {
                                results[i] = Some(Err(layout.error(&keys).into()));
                            }
                        }
                        None => return Err(e),
                    },
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every job has a result"))
            .collect())
    }

    /// Checks a destination (against the routes when known) and a payload's size.
    pub(crate) fn check_dest_and_payload(
        &self,
        dest: &str,
        payload: &[u8],
    ) -> Result<(), ClientError> {
        validate_dest(dest)?;
        if let Some(routes) = &self.routes
            && let Err(refused) = routes.resolve(dest)
        {
            let detail = match refused {
                Refused::NotAdmitted { sink, allow, .. } => {
                    format!(" (not admitted by sinks.{sink}.allow {allow:?})")
                }
                Refused::Unknown { .. } => String::new(),
            };
            return Err(ClientError::UnknownDestination {
                dest: dest.to_owned(),
                detail,
                known: routes.names_list().join(", "),
            });
        }
        if let Some(max) = self.max_payload
            && payload.len() > max
        {
            return Err(ClientError::Oversize {
                size: payload.len(),
                max,
            });
        }
        Ok(())
    }

    fn prepare(&self, mut job: NewJob) -> Result<EnqueueItem, ClientError> {
        self.check_dest_and_payload(&job.dest, &job.payload)?;
        check_due(job.due)?;
        let id = match job.id.take() {
            Some(id) if id.is_empty() || id.len() > 256 => return Err(ClientError::BadId(id)),
            // Refused on layout 1 too (the functions refuse it), so a namespace upgraded to
            // layout 2 never holds a user id in the generated form.
            Some(id) if crate::lane_id::is_reserved(&id) => {
                return Err(ClientError::ReservedId(id));
            }
            Some(id) => id,
            None => self.new_id(),
        };
        let max_lateness_ms = job.max_lateness.map(|d| d.as_millis() as u64);
        let unique_for_ms = job.unique_for.map(|d| d.as_millis() as u64);
        let due = spread_due(job.due, &id, job.spread);
        Ok(EnqueueItem {
            id,
            due,
            envelope: envelope_of(job).encode()?,
            max_lateness_ms,
            unique_for_ms,
        })
    }
}

/// The envelope a job is stored as: its headers (trace context names lowercased), max
/// attempts and max lateness in the meta. The bytes are the producer protocol's
/// (`docs/reference/protocol-vectors.json`).
fn envelope_of(job: NewJob) -> Envelope {
    let mut env = Envelope::new(job.dest, job.payload);
    env.meta.headers = job.headers;
    crate::trace_context::normalize_header_names(&mut env.meta.headers);
    env.meta.max_attempts = job.max_attempts;
    env.meta.max_lateness_ms = job.max_lateness.map(|d| d.as_millis() as u64);
    env
}

impl Client {
    /// Cancels a pending job.
    pub async fn cancel(&self, id: &str) -> Result<Cancelled, ClientError> {
        self.cancel_at(None, id).await
    }

    /// [`Client::cancel`] of the job `id` of destination `dest`. On storage layout 2 a
    /// user-chosen id is unique per route only: with its destination the job is found in one
    /// call, also when other routes hold the same id (without, that is `AmbiguousId`). On
    /// layout 1 ids are unique per namespace and `dest` changes nothing.
    pub async fn cancel_in(&self, dest: &str, id: &str) -> Result<Cancelled, ClientError> {
        self.cancel_at(Some(dest), id).await
    }

    /// [`Client::cancel`], or [`Client::cancel_in`] when `dest` is given.
    pub async fn cancel_at(&self, dest: Option<&str>, id: &str) -> Result<Cancelled, ClientError> {
        self.cancel_once(dest, id).await
    }

    async fn cancel_once(&self, dest: Option<&str>, id: &str) -> Result<Cancelled, ClientError> {
        let book = self.lane_book();
        match self.place_of(book, dest, id, Held::Stored).await? {
            Found::Lane(lane, stored) => {
                return self.cancel_in_lane(book, dest, id, (lane, stored)).await;
            }
            Found::Nowhere => return Ok(Cancelled::NotPending),
            Found::Shard => {}
        }
        self.fenced(|keys| async move {
            self.wait_out_reshard(&keys, id, Held::Stored).await?;
            let keys = keys.shard(keys.shard_of(id));
            Ok(scripts::cancel_job(&mut self.con.clone(), &keys, id).await?)
        })
        .await
    }

    /// Moves a pending job to a new due time; `None` when it is not pending.
    pub async fn reschedule(&self, id: &str, due: Due) -> Result<Option<i64>, ClientError> {
        self.reschedule_at(None, id, due).await
    }

    /// [`Client::reschedule`] of the job `id` of destination `dest` (see
    /// [`Client::cancel_in`]).
    pub async fn reschedule_in(
        &self,
        dest: &str,
        id: &str,
        due: Due,
    ) -> Result<Option<i64>, ClientError> {
        self.reschedule_at(Some(dest), id, due).await
    }

    /// [`Client::reschedule`], or [`Client::reschedule_in`] when `dest` is given.
    pub async fn reschedule_at(
        &self,
        dest: Option<&str>,
        id: &str,
        due: Due,
    ) -> Result<Option<i64>, ClientError> {
        check_due(due)?;
        self.reschedule_once(dest, id, due).await
    }

    async fn reschedule_once(
        &self,
        dest: Option<&str>,
        id: &str,
        due: Due,
    ) -> Result<Option<i64>, ClientError> {
        let book = self.lane_book();
        match self.place_of(book, dest, id, Held::Stored).await? {
            Found::Lane(lane, stored) => {
                return self
                    .reschedule_in_lane(book, dest, id, (lane, stored), due)
                    .await;
            }
            Found::Nowhere => return Ok(None),
            Found::Shard => {}
        }
        self.fenced(|keys| async move {
            self.wait_out_reshard(&keys, id, Held::Stored).await?;
            let keys = keys.shard(keys.shard_of(id));
            Ok(scripts::reschedule_job(&mut self.con.clone(), &keys, id, due).await?)
        })
        .await
    }

    /// Looks a job up by id in its shard; `None` when it is not stored (delivered,
    /// cancelled, purged, or never enqueued).
    pub async fn get(&self, id: &str) -> Result<Option<JobView>, ClientError> {
        self.get_at(None, id, None).await
    }

    /// [`Client::get`] of the job `id` of destination `dest` (see [`Client::cancel_in`]).
    pub async fn get_in(&self, dest: &str, id: &str) -> Result<Option<JobView>, ClientError> {
        self.get_at(Some(dest), id, None).await
    }

    /// Like [`Client::get`], with at most the first `preview` bytes of the payload: they are
    /// cut inside Redis (`peek_dead`), so a large payload is never sent whole.
    /// `payload_size` says how large it is.
    pub async fn get_preview(
        &self,
        id: &str,
        preview: usize,
    ) -> Result<Option<JobView>, ClientError> {
        self.get_at(None, id, Some(preview)).await
    }

    /// [`Client::get`] (or [`Client::get_preview`] with `preview`), in `dest` when given
    /// ([`Client::get_in`]).
    pub async fn get_at(
        &self,
        dest: Option<&str>,
        id: &str,
        preview: Option<usize>,
    ) -> Result<Option<JobView>, ClientError> {
        self.get_once(dest, id, preview).await
    }

    async fn get_once(
        &self,
        dest: Option<&str>,
        id: &str,
        preview: Option<usize>,
    ) -> Result<Option<JobView>, ClientError> {
        let book = self.lane_book();
        match self.place_of(book, dest, id, Held::Stored).await? {
            Found::Lane(lane, stored) => {
                return self
                    .get_in_lane(book, dest, id, (lane, stored), preview)
                    .await;
            }
            Found::Nowhere => return Ok(None),
            Found::Shard => {}
        }
        self.fenced(|keys| async move {
            self.wait_out_reshard(&keys, id, Held::Stored).await?;
            self.get_in_shard(keys, id, preview).await
        })
        .await
    }

    async fn get_in_shard(
        &self,
        keys: Keys,
        id: &str,
        preview: Option<usize>,
    ) -> Result<Option<JobView>, ClientError> {
        let shard = keys.shard_of(id);
        let layout = keys.clone();
        let keys = keys.shard(shard);
        type Reply = (
            (i64, i64),
            Option<f64>,
            Option<String>,
            Option<f64>,
            Option<f64>,
            redis::Value,
            Option<String>,
            Option<String>,
        );
        let mut pipe = redis::pipe();
        pipe.cmd("TIME")
            .zscore(&keys.due, id)
            .hget(&keys.ready_ids, id)
            .zscore(&keys.inflight, id)
            .zscore(&keys.dead, id);
        match preview {
            None => pipe.hget(&keys.jobs, id),
            // Whether one is stored; its head and preview come from `peek_dead`.
            Some(_) => pipe.hexists(&keys.jobs, id),
        };
        let ((secs, micros), due, ready, inflight, dead, stored, reason, marker): Reply = pipe
            .hget(&keys.reasons, id)
            .get(&keys.layout)
            .query_async(&mut self.con.clone())
            .await?;
        read_fence(marker, &layout, &keys.layout)?;
        let (raw, envelope, payload_size) = match preview {
            None => {
                let raw: Option<Vec<u8>> =
                    redis::from_redis_value(stored).map_err(redis::RedisError::from)?;
                let bytes = raw.as_deref().unwrap_or_default();
                let envelope = Envelope::decode(bytes);
                let size = envelope.as_ref().map_or(bytes.len(), |e| e.payload.len());
                (raw, envelope, size as u64)
            }
            Some(preview) => {
                let peeked =
                    if redis::from_redis_value::<bool>(stored).map_err(redis::RedisError::from)? {
                        let ids = [id.to_owned()];
                        scripts::peek_dead(&mut self.con.clone(), &keys, &ids, preview)
                            .await?
                            .pop()
                            .map(|p| p.envelope)
                    } else {
                        None
                    };
                preview_envelope(peeked, preview)
            }
        };
        // In the namespace's time: a test clock's offset added (no I/O without one).
        let offset_ms = self.con.clone().clock_offset_ms().await? as f64;
        let now_ms = (secs * 1_000_000 + micros) as f64 / 1000.0 + offset_ms;
        // A job waiting in the ready set: "<sink>\n<due>\n<id>".
        let waiting = ready.as_deref().and_then(|m| {
            let mut parts = m.splitn(3, '\n');
            Some((parts.next()?.to_owned(), parts.next()?.parse::<f64>().ok()?))
        });
        let mut sink = None;
        let (state, score) = match (due, waiting, inflight, dead) {
            (Some(s), _, _, _) if s > now_ms => (JobState::Scheduled, Some(s)),
            (Some(s), _, _, _) => (JobState::Due, Some(s)),
            (_, Some((name, s)), _, _) => {
                sink = Some(name);
                (JobState::Due, Some(s))
            }
            (_, _, Some(s), _) => (JobState::InFlight, Some(s)),
            (_, _, _, Some(s)) => (JobState::Dead, Some(s)),
            _ if raw.is_some() => (JobState::Orphan, None),
            _ => return Ok(None),
        };
        Ok(Some(JobView {
            id: id.to_owned(),
            shard,
            lane: None,
            state,
            score,
            raw: raw.unwrap_or_default(),
            envelope,
            payload_size,
            reason,
            sink,
        }))
    }
}

/// Refuses an epoch-ms due time that reads as epoch seconds.
fn check_due(due: Due) -> Result<(), ClientError> {
    match due {
        Due::At(ms) => crate::job::check_epoch_ms(ms)
            .map(drop)
            .map_err(ClientError::SecondsLikeDue),
        Due::In(_) => Ok(()),
    }
}

/// What `get_preview` shows of an envelope `peek_dead` read: the bytes read (a frame's head
/// and payload start, or the first `preview` bytes of another value), their decoding with
/// the payload cut to `preview` bytes, and the whole payload's size (of a value that is not
/// a frame and does not decode: the value's size).
fn preview_envelope(
    peeked: Option<EnvelopeHead>,
    preview: usize,
) -> (Option<Vec<u8>>, Result<Envelope, EnvelopeError>, u64) {
    let missing = || Err(EnvelopeError::Malformed("no envelope stored".into()));
    let Some(head) = peeked.filter(|h| !matches!(h, EnvelopeHead::Missing)) else {
        return (None, missing(), 0);
    };
    let (raw, value_size) = match &head {
        EnvelopeHead::Frame {
            head,
            payload_start,
            payload_size,
        } => ([head.as_slice(), payload_start].concat(), *payload_size),
        EnvelopeHead::Other { head, size } => (head[..head.len().min(preview)].to_vec(), *size),
        EnvelopeHead::Large { size } => (Vec::new(), *size),
        EnvelopeHead::Missing => (Vec::new(), 0),
    };
    let (envelope, payload_size) = read_envelope(head);
    let mut envelope = envelope.unwrap_or_else(missing);
    if let Ok(env) = &mut envelope {
        env.payload.truncate(preview);
    }
    (Some(raw), envelope, payload_size.unwrap_or(value_size))
}

/// The envelope `peek_dead` read (a frame's payload: the first bytes it returned) and the
/// payload's whole size; `None` when none is stored.
pub(crate) fn read_envelope(
    head: EnvelopeHead,
) -> (Option<Result<Envelope, EnvelopeError>>, Option<u64>) {
    match head {
        EnvelopeHead::Frame {
            mut head,
            payload_size,
            payload_start,
        } => {
            head.extend_from_slice(&payload_start);
            (Some(Envelope::decode(&head)), Some(payload_size))
        }
        EnvelopeHead::Other { size, .. } if size as usize > PEEK_HEAD_MAX => (
            Some(Err(EnvelopeError::Malformed(format!(
                "{size} bytes that are not a zd1 frame: only frames are read beyond \
                 {PEEK_HEAD_MAX} bytes"
            )))),
            None,
        ),
        EnvelopeHead::Other { head, .. } => {
            let env = Envelope::decode(&head);
            let size = env.as_ref().ok().map(|e| e.payload.len() as u64);
            (Some(env), size)
        }
        EnvelopeHead::Large { size } => (Some(Err(EnvelopeError::NotRead(size))), None),
        EnvelopeHead::Missing => (None, None),
    }
}

/// Time-ordered ids: ULIDs, strictly increasing within one process even inside one
/// millisecond, so jobs due at the same ms leave in enqueue order (ZSET ties sort by member).
#[derive(Default)]
pub struct IdGenerator(Mutex<ulid::Generator>);

impl IdGenerator {
    pub fn next(&self) -> String {
        let mut generator = self.0.lock().expect("id generator lock is never poisoned");
        loop {
            // The random part overflows within one ms only after 2^80 ids; wait for the next ms.
            if let Ok(id) = generator.generate() {
                return id.to_string();
            }
            std::thread::yield_now();
        }
    }
}

/// Refuses a user-chosen id that reads as one zdelay generates in storage layout 2
/// (`~<lane>.<stored id>`, [`crate::lane_id`]), so a user's id can never be taken for a
/// generated one and looked for in the wrong lane.
/// Both layouts' enqueues apply it, as the producer protocol's functions do: a layout-1 id in
/// that form would be taken for a generated one once the namespace is upgraded to layout 2.
pub fn refuse_reserved_id(id: &str) -> Result<(), ClientError> {
    if crate::lane_id::is_reserved(id) {
        return Err(ClientError::ReservedId(id.to_owned()));
    }
    Ok(())
}

/// The layout fence, for a read: a shard of another layout may not hold what is asked for.
/// `marker` is the shard's layout marker (`marker_key`), read with the data.
pub(crate) fn read_fence(
    marker: Option<String>,
    layout: &Keys,
    marker_key: &str,
) -> Result<(), ClientError> {
    match marker.as_deref().map(Layout::parse) {
        Some(Some(Layout::Shards(n))) if n == layout.shards() => Ok(()),
        Some(Some(other)) => Err(other.error(layout).into()),
        Some(None) => Err(StoreError::Schema(format!("{marker_key} holds {marker:?}")).into()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_is_due_at_epoch_ms_or_at_a_system_time() {
        use std::time::{SystemTime, UNIX_EPOCH};
        let at = |job: NewJob| job.due;
        assert_eq!(
            at(NewJob::new("d", "p").at(1_700_000_000_123)),
            Due::At(1_700_000_000_123)
        );
        let t = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        assert_eq!(at(NewJob::new("d", "p").at(t)), Due::At(1_700_000_000_123));
        // A part of a millisecond rounds up: never due before the moment given.
        let t = t + Duration::from_nanos(1);
        assert_eq!(at(NewJob::new("d", "p").at(t)), Due::At(1_700_000_000_124));
        let before_1970 = UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(at(NewJob::new("d", "p").at(before_1970)), Due::At(0));
        let soon = SystemTime::now() + Duration::from_secs(60);
        assert!(
            matches!(at(NewJob::new("d", "p").at(soon)), Due::At(ms) if ms > 1_700_000_000_000)
        );
    }

    #[test]
    fn ids_sort_in_generation_order() {
        let ids = IdGenerator::default();
        let generated: Vec<String> = (0..10_000).map(|_| ids.next()).collect();
        assert!(
            generated.windows(2).all(|w| w[0] < w[1]),
            "ids must strictly increase"
        );
        assert!(generated.iter().all(|id| id.len() == 26));
    }

    #[test]
    fn ids_in_the_generated_form_are_reserved() {
        let e = refuse_reserved_id("~1k.0PQ3aZr-x_9F").unwrap_err();
        assert_eq!(e.kind(), "reserved_id");
        assert_eq!(
            e.to_string(),
            "job id \"~1k.0PQ3aZr-x_9F\" starts with ~, which is reserved for the ids zdelay \
             generates: choose an id that does not"
        );
        assert!(matches!(refuse_reserved_id("~x"), Err(ClientError::ReservedId(id)) if id == "~x"));
        for fine in ["order-42", "a~b", "01M8AQ2BB5009Z927DJJFDY8MY"] {
            assert!(refuse_reserved_id(fine).is_ok(), "{fine}");
        }
    }

    #[test]
    fn error_kinds_are_bounded_labels() {
        let e = ClientError::Exists("x".into());
        assert_eq!(e.kind(), "exists");
        assert_eq!(e.to_string(), "job x exists (policy: error)");
        let e = ClientError::UnknownDestination {
            dest: "bus/x".into(),
            detail: " (not admitted by sinks.bus.allow [\"a.*\"])".into(),
            known: "default".into(),
        };
        assert!(
            e.to_string()
                .starts_with("unknown destination \"bus/x\" (not admitted")
        );
    }
}
