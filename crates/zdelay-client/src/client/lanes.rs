//! `Client` on a namespace on storage layout 2 (a preview): every job is for a local route and
//! lives in that route's lane, in the hash slot of the route's list (see `lane`).
//!
//! Producers place a job by its destination through the lane registry (`<ns>:lanes`, written
//! by daemons at start), cached here and read again when a lane script refuses a call
//! (`ZDELAY_LANE_MOVED`, `ZDELAY_LANE_CHANGED`, `ZDELAY_NO_LANE`: nothing was written) or a
//! destination has no lane yet. A generated id (`~<lane>.<stored id>`) names its lane, so
//! `cancel`, `get` and `reschedule` of it are one call in one slot; a user-chosen id is found
//! by asking every lane (one `HEXISTS` each), and refused when two routes hold it.

use super::{Client, ClientError, ENQUEUE_CHUNK, JobView, NewJob, check_due};
use crate::envelope::{Envelope, Meta};
use crate::job::{Cancelled, Due, Enqueued, OnConflict};
use crate::keys::Keys;
use crate::lane::{Home, Lane, Registry};
use crate::lane_id::{LaneId, StoredId, StoredIdGenerator, is_reserved};
use crate::store::scripts::{self, LaneItem};
use crate::store::{self, Conn, StoreError};
use std::collections::BTreeMap;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

/// Tries of a generated id that another producer took in the same millisecond.
const ID_TRIES: u32 = 3;

/// What a client keeps for layout 2: the registry as last read and its id generator.
pub(crate) struct LaneBook {
    registry: RwLock<Registry>,
    ids: StoredIdGenerator,
    /// While `zdelay upgrade` runs: when the schema last said so. Jobs it has not moved yet
    /// are still in their layout-1 shards.
    upgrading: Mutex<Option<Instant>>,
    /// While `zdelay reshard` moves the spread shards: the old count, and when the schema
    /// last said so. Two-phase jobs it has not moved yet are still in the old shards.
    resharding: Mutex<Option<(u16, Instant)>>,
}

/// How often a client that knows an upgrade runs reads the schema to see it finished.
const UPGRADE_LOOK: Duration = Duration::from_secs(5);

/// How long a lookup by id waits for the upgrade to move the job it names.
const UPGRADE_WAIT: Duration = Duration::from_secs(3);

impl LaneBook {
    pub(crate) async fn read(con: &mut Conn, keys: &crate::keys::Keys) -> Result<Self, StoreError> {
        let schema = store::read_schema(con, keys).await?;
        Ok(LaneBook {
            registry: RwLock::new(store::lanes::read_registry(con, keys).await?),
            ids: StoredIdGenerator::new(),
            upgrading: Mutex::new(schema.upgrading.is_some().then(Instant::now)),
            resharding: Mutex::new(schema.resharding.map(|(from, _)| (from, Instant::now()))),
        })
    }

    /// Notes what the schema says of a reshard of the spread shards.
    pub(crate) fn reshard_seen(&self, resharding: Option<(u16, u16)>) {
        *self.resharding.lock().expect("resharding lock") =
            resharding.map(|(from, _)| (from, Instant::now()));
    }

    fn registry(&self) -> Registry {
        self.registry.read().expect("registry lock").clone()
    }
}

pub(crate) use crate::store::lanes::is_lane_refusal as lane_refusal;

impl ClientError {
    /// A lane script's refusal ([`lane_refusal`]): nothing was written; the registry is worth
    /// reading again.
    pub(crate) fn is_lane_refusal(&self) -> bool {
        matches!(self, ClientError::Store(StoreError::Redis(e)) if lane_refusal(e))
    }
}

/// The id a lane's stored id is known by: `~<lane>.<stored id>` for one in the generated form,
/// the stored id itself otherwise (a user's). A user-chosen id that happens to have the
/// generated form is shown as a generated one; both forms find it.
pub(crate) fn public_id(lane: u32, stored: &str) -> String {
    match StoredId::parse(stored) {
        Ok(stored) => LaneId { lane, stored }.to_string(),
        Err(_) => stored.to_owned(),
    }
}

/// Where an id is stored on layout 2: in a route lane (under this stored id), in its spread
/// shard (a two-phase job), or nowhere.
// A short-lived answer, never stored: boxing the lane would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Found {
    Lane(Lane, String),
    Shard,
    Nowhere,
}

/// What a lane is asked about an id when it is looked for by id.
#[derive(Clone, Copy)]
pub(crate) enum Held {
    /// Waiting or dead: its payload is in the lane's `jobs` hash.
    Stored,
    /// Dead: in the lane's `dead` set (an orphan has no payload).
    Dead,
    /// A schedule: in the lane's schedule definitions.
    Schedule,
}

impl Held {
    /// The command that answers whether `id` is held, in a lane's or a shard's keys: a `0` or
    /// a nil reply means no.
    fn ask(self, jobs: &str, dead: &str, schedules: &str, id: &str) -> redis::Cmd {
        match self {
            Held::Stored => redis::cmd("HEXISTS").arg(jobs).arg(id).clone(),
            Held::Dead => redis::cmd("ZSCORE").arg(dead).arg(id).clone(),
            Held::Schedule => redis::cmd("HEXISTS").arg(schedules).arg(id).clone(),
        }
    }
}

/// One job ready for its lane.
#[derive(Clone)]
struct Prepared {
    index: usize,
    dest: String,
    /// A generated id is drawn again if another producer took it.
    generated: Option<StoredId>,
    stored: String,
    due: Due,
    payload: Vec<u8>,
    meta: Option<String>,
    max_lateness_ms: Option<u64>,
    unique_for_ms: Option<u64>,
    tries: u32,
}

impl Prepared {
    /// The id `enqueue` returns: the user's, or `~<lane>.<stored id>`.
    fn public_id(&self, lane: &Lane) -> String {
        match self.generated {
            Some(stored) => LaneId {
                lane: lane.number,
                stored,
            }
            .to_string(),
            None => self.stored.clone(),
        }
    }
}

type Answer = Result<(String, Enqueued), ClientError>;

impl Client {
    /// The lane book, on a namespace on layout 2.
    pub(crate) fn lane_book(&self) -> Option<&LaneBook> {
        self.lanes.get().map(|book| &**book)
    }

    /// Reads the lane registry again (a daemon registered, moved or changed a lane).
    pub(crate) async fn refresh_lanes(&self, book: &LaneBook) -> Result<Registry, ClientError> {
        let registry = store::lanes::read_registry(&mut self.con.clone(), &self.keys()).await?;
        *book.registry.write().expect("registry lock") = registry.clone();
        Ok(registry)
    }

    fn prepare_for_lane(
        &self,
        book: &LaneBook,
        index: usize,
        job: NewJob,
    ) -> Result<Prepared, ClientError> {
        self.check_dest_and_payload(&job.dest, &job.payload)?;
        check_due(job.due)?;
        let (generated, stored) = match job.id {
            Some(id) if id.is_empty() || id.len() > 256 => return Err(ClientError::BadId(id)),
            Some(id) if is_reserved(&id) => return Err(ClientError::ReservedId(id)),
            Some(id) => (None, id),
            None => {
                let stored = book.ids.next_id()?;
                (Some(stored), stored.to_string())
            }
        };
        let mut meta = Meta {
            headers: job.headers,
            max_attempts: job.max_attempts,
            ..Meta::default()
        };
        crate::trace_context::normalize_header_names(&mut meta.headers);
        let meta = (meta != Meta::default())
            .then(|| serde_json::to_string(&meta).expect("a Meta of strings and numbers"));
        Ok(Prepared {
            index,
            dest: job.dest,
            generated,
            due: super::spread_due(job.due, &stored, job.spread),
            stored,
            payload: job.payload,
            meta,
            max_lateness_ms: job.max_lateness.map(|d| d.as_millis() as u64),
            unique_for_ms: job.unique_for.map(|d| d.as_millis() as u64),
            tries: 0,
        })
    }

    /// `enqueue_batch` on layout 2: one `enqueue_lane` call per lane and chunk; jobs for
    /// two-phase destinations go to the spread shards, as layout 1 writes them.
    pub(super) async fn enqueue_lanes(
        &self,
        book: &LaneBook,
        jobs: Vec<NewJob>,
        policy: OnConflict,
    ) -> Result<Vec<Answer>, ClientError> {
        let mut results: Vec<Option<Answer>> = (0..jobs.len()).map(|_| None).collect();
        let mut registry = book.registry();
        let mut refreshed = false;
        let known =
            |r: &Registry, dest: &str| r.by_route.contains_key(dest) || r.is_two_phase(dest);
        if jobs.iter().any(|j| !known(&registry, &j.dest)) {
            registry = self.refresh_lanes(book).await?;
            refreshed = true;
        }
        let mut pending = Vec::new();
        let (mut two_phase, mut two_phase_at) = (Vec::new(), Vec::new());
        for (i, job) in jobs.into_iter().enumerate() {
            if !registry.by_route.contains_key(&job.dest) && registry.is_two_phase(&job.dest) {
                match &job.id {
                    Some(id) if is_reserved(id) => {
                        results[i] = Some(Err(ClientError::ReservedId(id.clone())));
                    }
                    _ => {
                        two_phase.push(job);
                        two_phase_at.push(i);
                    }
                }
                continue;
            }
            match self.prepare_for_lane(book, i, job) {
                Ok(p) => pending.push(p),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        if !two_phase.is_empty() {
            let answers = self.enqueue_in_shards(two_phase, policy).await?;
            for (i, answer) in two_phase_at.into_iter().zip(answers) {
                results[i] = Some(answer);
            }
        }
        if !refreshed
            && pending
                .iter()
                .any(|p| !registry.by_route.contains_key(&p.dest))
        {
            registry = self.refresh_lanes(book).await?;
            refreshed = true;
        }
        let wake = self.keys().wake_channel();
        while !pending.is_empty() {
            // Per lane and kind of id: generated ids are written with the policy `error`,
            // so a collision never replaces another producer's job.
            let mut groups: BTreeMap<(String, bool), Vec<Prepared>> = BTreeMap::new();
            for p in pending.drain(..) {
                if !registry.by_route.contains_key(&p.dest) {
                    results[p.index] = Some(Err(no_lane(&p.dest, &registry)));
                    continue;
                }
                groups
                    .entry((p.dest.clone(), p.generated.is_some()))
                    .or_default()
                    .push(p);
            }
            let mut again = false;
            for ((route, generated), group) in groups {
                let lane = &registry.by_route[&route];
                let policy = if generated { OnConflict::Error } else { policy };
                for chunk in group.chunks(ENQUEUE_CHUNK) {
                    let items: Vec<LaneItem> = chunk
                        .iter()
                        .map(|p| LaneItem {
                            id: &p.stored,
                            due: p.due,
                            payload: &p.payload,
                            meta: p.meta.as_deref(),
                            max_lateness_ms: p.max_lateness_ms,
                            unique_for_ms: p.unique_for_ms,
                        })
                        .collect();
                    let answers = match scripts::enqueue_lane(
                        &mut self.con.clone(),
                        lane,
                        policy,
                        &wake,
                        &items,
                    )
                    .await
                    {
                        Ok(answers) => answers,
                        Err(e) if lane_refusal(&e) && !refreshed => {
                            pending.extend(chunk.iter().cloned());
                            again = true;
                            continue;
                        }
                        Err(e) if lane_refusal(&e) => {
                            for p in chunk {
                                results[p.index] = Some(Err(lane_refused(&p.dest, &e)));
                            }
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    for (p, answer) in chunk.iter().zip(answers) {
                        match answer {
                            Some(done) => results[p.index] = Some(Ok((p.public_id(lane), done))),
                            None if generated && p.tries + 1 < ID_TRIES => {
                                let mut p = p.clone();
                                let stored = book.ids.next_id()?;
                                p.generated = Some(stored);
                                p.stored = stored.to_string();
                                p.tries += 1;
                                pending.push(p);
                            }
                            None => {
                                results[p.index] = Some(Err(ClientError::Exists(p.public_id(lane))))
                            }
                        }
                    }
                }
            }
            if again {
                registry = self.refresh_lanes(book).await?;
                refreshed = true;
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every job has a result"))
            .collect())
    }

    /// Every home of jobs, dead letters and schedules: the shards of `layout` (on layout 2
    /// the spread shards), then on layout 2 the route lanes as the registry names them now,
    /// in number order.
    pub(crate) async fn homes(&self, layout: &Keys) -> Result<Vec<Home>, ClientError> {
        let mut homes: Vec<Home> = (0..layout.shards())
            .map(|s| Home::Shard(layout.shard(s)))
            .collect();
        if let Some(book) = self.lane_book() {
            let mut lanes: Vec<Lane> = self
                .refresh_lanes(book)
                .await?
                .by_route
                .into_values()
                .collect();
            lanes.sort_by_key(|lane| lane.number);
            homes.extend(lanes.into_iter().map(Home::Lane));
        }
        Ok(homes)
    }

    /// The lane of destination `dest`, reading the registry again when the cached one has
    /// none; an unknown destination when it still has none.
    pub(crate) async fn lane_for(&self, book: &LaneBook, dest: &str) -> Result<Lane, ClientError> {
        if let Some(lane) = book.registry().by_route.get(dest) {
            return Ok(lane.clone());
        }
        let registry = self.refresh_lanes(book).await?;
        registry
            .by_route
            .get(dest)
            .cloned()
            .ok_or_else(|| no_lane(dest, &registry))
    }

    /// Runs `op` fenced like every call on layout 1 ([`Client::fenced`]); on layout 2 once
    /// more when a lane refused it (`op` reads the registry again; what the first run did is
    /// skipped or written again the same way, as every call here is safe to re-run). `what`
    /// names what was refused twice.
    pub(crate) async fn fenced_by_layout<T, F, Fut>(
        &self,
        what: &str,
        op: F,
    ) -> Result<T, ClientError>
    where
        F: Fn(Keys) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        if self.lane_book().is_none() {
            match self.fenced(&op).await {
                // Upgraded under this client, which now runs layout 2: `op` again there.
                Err(ClientError::Store(StoreError::Upgrading { .. }))
                    if self.lane_book().is_some() => {}
                other => return other,
            }
        }
        match op(self.keys()).await {
            Err(e) if e.is_lane_refusal() => {}
            other => return other,
        }
        match op(self.keys()).await {
            Err(ClientError::Store(StoreError::Redis(e))) if lane_refusal(&e) => {
                Err(lane_refused(what, &e))
            }
            other => other,
        }
    }

    /// Whether `ask` ([`Held::ask`]) answers yes.
    async fn holds(&self, ask: redis::Cmd) -> redis::RedisResult<bool> {
        let answer: redis::Value = ask.query_async(&mut self.con.clone()).await?;
        Ok(!matches!(answer, redis::Value::Nil | redis::Value::Int(0)))
    }

    /// The lanes that hold the user-chosen id `id` (unique per route only, so every lane is
    /// asked, one command each).
    async fn lanes_holding(
        &self,
        book: &LaneBook,
        id: &str,
        held: Held,
    ) -> Result<Vec<Lane>, ClientError> {
        let registry = self.refresh_lanes(book).await?;
        let asks = registry.by_route.values().map(|lane| async move {
            let k = &lane.keys;
            let ask = held.ask(&k.jobs, &k.dead, &k.schedules, id);
            Ok::<_, redis::RedisError>(self.holds(ask).await?.then(|| lane.clone()))
        });
        Ok(futures::future::try_join_all(asks)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// The lane a generated id names, and its stored id; `None` when no live lane has that
    /// number.
    async fn generated_lane(
        &self,
        book: &LaneBook,
        id: &str,
    ) -> Result<Option<(Lane, String)>, ClientError> {
        let parsed = LaneId::parse(id)?;
        let mut lane = book.registry().lane(parsed.lane).cloned();
        if lane.is_none() {
            lane = self.refresh_lanes(book).await?.lane(parsed.lane).cloned();
        }
        Ok(lane.map(|lane| (lane, parsed.stored.to_string())))
    }

    /// Where `id` is stored: a generated id names its lane; a user-chosen one is looked for
    /// in every lane and in its spread shard. Held in more than one place: `AmbiguousId`.
    pub(crate) async fn locate(
        &self,
        book: &LaneBook,
        id: &str,
        held: Held,
    ) -> Result<Found, ClientError> {
        if generated(id, held) {
            return Ok(match self.generated_lane(book, id).await? {
                Some((lane, stored)) => Found::Lane(lane, stored),
                None => Found::Nowhere,
            });
        }
        let keys = self.keys();
        let shard = keys.shard(keys.shard_of(id));
        let ask = held.ask(&shard.jobs, &shard.dead, &shard.schedules, id);
        let (mut lanes, in_shard) = tokio::try_join!(self.lanes_holding(book, id, held), async {
            Ok(self.holds(ask).await?)
        })?;
        match (lanes.len(), in_shard) {
            (0, false) => Ok(Found::Nowhere),
            (0, true) => Ok(Found::Shard),
            (1, false) => Ok(Found::Lane(lanes.remove(0), id.to_owned())),
            _ => Err(ClientError::AmbiguousId {
                id: id.to_owned(),
                routes: lanes
                    .into_iter()
                    .map(|l| l.route)
                    .chain(in_shard.then(|| "a two-phase destination".to_owned()))
                    .collect(),
            }),
        }
    }

    /// The lane of `id` and its stored id there: with `dest`, that destination's lane (one
    /// lookup of the registry, no search; a generated id naming another lane is in none);
    /// without, where [`Client::locate`] finds it.
    async fn lane_of(
        &self,
        book: &LaneBook,
        dest: Option<&str>,
        id: &str,
        held: Held,
    ) -> Result<Option<(Lane, String)>, ClientError> {
        let Some(dest) = dest else {
            return Ok(match self.locate(book, id, held).await? {
                Found::Lane(lane, stored) => Some((lane, stored)),
                Found::Shard | Found::Nowhere => None,
            });
        };
        let lane = self.lane_for(book, dest).await?;
        if !generated(id, held) {
            return Ok(Some((lane, id.to_owned())));
        }
        let parsed = LaneId::parse(id)?;
        Ok((parsed.lane == lane.number).then(|| (lane, parsed.stored.to_string())))
    }

    /// Where the job `id` is looked for: by `dest` when given (a local route's lane; a
    /// two-phase destination's spread shard; an unknown one is an error), else where it is
    /// stored ([`Client::locate`]).
    pub(crate) async fn place_of(
        &self,
        book: &LaneBook,
        dest: Option<&str>,
        id: &str,
        held: Held,
    ) -> Result<Found, ClientError> {
        self.wait_out_upgrade(book, id, held).await?;
        self.wait_out_reshard(&self.keys(), id, held).await?;
        let Some(dest) = dest else {
            return self.locate(book, id, held).await;
        };
        let mut registry = book.registry();
        if !registry.by_route.contains_key(dest) && !registry.is_two_phase(dest) {
            registry = self.refresh_lanes(book).await?;
        }
        if registry.by_route.contains_key(dest) {
            Ok(match self.lane_of(book, Some(dest), id, held).await? {
                Some((lane, stored)) => Found::Lane(lane, stored),
                None => Found::Nowhere,
            })
        } else if registry.is_two_phase(dest) {
            Ok(Found::Shard)
        } else {
            Err(no_lane(dest, &registry))
        }
    }

    /// While `zdelay upgrade` runs, waits until the layout-1 shard of `id` no longer holds
    /// it (the upgrade writes a job into layout 2 before it deletes it from layout 1, so
    /// looking there afterwards cannot miss it); `StoreError::Upgrading` (retryable) when
    /// that takes longer than [`UPGRADE_WAIT`].
    async fn wait_out_upgrade(
        &self,
        book: &LaneBook,
        id: &str,
        held: Held,
    ) -> Result<(), ClientError> {
        if generated(id, held) {
            // Layout 1 never gave out ids of that form.
            return Ok(());
        }
        let keys = self.keys();
        let legacy = Keys::new(keys.namespace(), keys.shards());
        let started = Instant::now();
        loop {
            let Some(since) = *book.upgrading.lock().expect("upgrading lock") else {
                return Ok(());
            };
            if since.elapsed() > UPGRADE_LOOK {
                let schema = store::read_schema(&mut self.con.clone(), &keys).await?;
                *book.upgrading.lock().expect("upgrading lock") =
                    schema.upgrading.is_some().then(Instant::now);
                continue;
            }
            let shard = legacy.shard(legacy.shard_of(id));
            if !self
                .holds(held.ask(&shard.jobs, &shard.dead, &shard.schedules, id))
                .await?
            {
                return Ok(());
            }
            if started.elapsed() > UPGRADE_WAIT {
                return Err(StoreError::Upgrading {
                    namespace: keys.namespace().to_owned(),
                    layout: 2,
                }
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// While `zdelay reshard` moves the spread shards, waits until the old shard of `id` (a
    /// two-phase job's id) no longer holds it, so a lookup in its new shard (`keys`) cannot
    /// miss it: the reshard writes a job into its new shard before it deletes it from the old
    /// one. `StoreError::Resharding` (retryable) when that takes longer than [`UPGRADE_WAIT`].
    pub(crate) async fn wait_out_reshard(
        &self,
        keys: &crate::keys::Keys,
        id: &str,
        held: Held,
    ) -> Result<(), ClientError> {
        let Some(book) = self.lane_book() else {
            return Ok(());
        };
        let started = Instant::now();
        loop {
            let Some((from, since)) = *book.resharding.lock().expect("resharding lock") else {
                return Ok(());
            };
            if since.elapsed() > UPGRADE_LOOK {
                let schema = store::read_schema(&mut self.con.clone(), keys).await?;
                book.reshard_seen(schema.resharding);
                continue;
            }
            if from == keys.shards() {
                // Still on the old count: its fence refuses the call, which then reads the
                // layout again.
                return Ok(());
            }
            let old = keys.with_shards(from);
            let shard = old.shard(old.shard_of(id));
            if !self
                .holds(held.ask(&shard.jobs, &shard.dead, &shard.schedules, id))
                .await?
            {
                return Ok(());
            }
            if started.elapsed() > UPGRADE_WAIT {
                return Err(StoreError::Resharding {
                    namespace: keys.namespace().to_owned(),
                    from,
                    to: keys.shards(),
                }
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs `op` on the lane holding `id`; once more after reading the registry again when
    /// the lane refused the call (it moved or changed since it was read).
    async fn on_lane<T, F, Fut>(
        &self,
        book: &LaneBook,
        dest: Option<&str>,
        id: &str,
        found: (Lane, String),
        op: F,
    ) -> Result<Option<T>, ClientError>
    where
        F: Fn(Lane, String) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let mut found = Some(found);
        for last in [false, true] {
            let place = match found.take() {
                Some(place) => Some(place),
                None => self.lane_of(book, dest, id, Held::Stored).await?,
            };
            let Some((lane, stored)) = place else {
                return Ok(None);
            };
            match op(lane, stored).await {
                Ok(out) => return Ok(Some(out)),
                Err(e) if lane_refusal(&e) && !last => {
                    self.refresh_lanes(book).await?;
                }
                Err(e) if lane_refusal(&e) => return Err(lane_refused(id, &e)),
                Err(e) => return Err(e.into()),
            }
        }
        unreachable!("the second try returns")
    }

    pub(super) async fn cancel_in_lane(
        &self,
        book: &LaneBook,
        dest: Option<&str>,
        id: &str,
        found: (Lane, String),
    ) -> Result<Cancelled, ClientError> {
        let cancelled = self
            .on_lane(book, dest, id, found, |lane, stored| async move {
                scripts::cancel_lane(&mut self.con.clone(), &lane, &stored).await
            })
            .await?;
        Ok(match cancelled {
            Some(true) => Cancelled::Cancelled,
            _ => Cancelled::NotPending,
        })
    }

    pub(super) async fn reschedule_in_lane(
        &self,
        book: &LaneBook,
        dest: Option<&str>,
        id: &str,
        found: (Lane, String),
        due: Due,
    ) -> Result<Option<i64>, ClientError> {
        let wake = self.keys().wake_channel();
        let wake = &wake;
        Ok(self
            .on_lane(book, dest, id, found, |lane, stored| async move {
                scripts::reschedule_lane(&mut self.con.clone(), &lane, wake, &stored, due).await
            })
            .await?
            .flatten())
    }

    pub(super) async fn get_in_lane(
        &self,
        book: &LaneBook,
        dest: Option<&str>,
        id: &str,
        found: (Lane, String),
        preview: Option<usize>,
    ) -> Result<Option<JobView>, ClientError> {
        let mut found = Some(found);
        for last in [false, true] {
            let place = match found.take() {
                Some(place) => Some(place),
                None => self.lane_of(book, dest, id, Held::Stored).await?,
            };
            let Some((lane, stored)) = place else {
                return Ok(None);
            };
            let mut con = self.con.clone();
            let job = match preview {
                None => store::lanes::get(&mut con, &lane, &stored).await?,
                Some(n) => store::lanes::get_preview(&mut con, &lane, &stored, n).await?,
            };
            let Some(job) = job else {
                return Ok(None);
            };
            if job.marker.as_deref() != Some(lane.marker().as_str()) {
                // The lane moved or changed since the registry was read.
                if last {
                    return Err(StoreError::Schema(format!(
                        "{} holds {:?}, not the lane the registry names for route {}",
                        lane.keys.marker, job.marker, lane.route
                    ))
                    .into());
                }
                self.refresh_lanes(book).await?;
                continue;
            }
            let payload_size = job.payload_size;
            let payload = job.payload;
            let mut meta: Meta = match job.meta.as_deref() {
                Some(text) => serde_json::from_str(text).map_err(|e| {
                    StoreError::Schema(format!(
                        "{} holds meta {text:?} for {stored}, not JSON zdelay writes ({e})",
                        lane.keys.meta
                    ))
                })?,
                None => Meta::default(),
            };
            meta.max_lateness_ms = job.max_lateness_ms;
            let envelope = Envelope {
                dest: lane.route.clone(),
                payload,
                meta,
            };
            return Ok(Some(JobView {
                id: id.to_owned(),
                shard: 0,
                lane: Some(lane.number),
                state: job.state,
                score: job.score,
                raw: Vec::new(),
                envelope: Ok(envelope),
                payload_size,
                reason: job.reason,
                sink: None,
            }));
        }
        unreachable!("the second try returns")
    }
}

/// Whether `id` is a generated job id (`~<lane>.<stored id>`), which names its lane. Schedule
/// ids are never generated: one starting with `~` is looked for like any other.
fn generated(id: &str, held: Held) -> bool {
    is_reserved(id) && !matches!(held, Held::Schedule)
}

/// A destination with no lane: on layout 2 only local routes have one, registered by a
/// daemon whose config has the route when it starts.
fn no_lane(dest: &str, registry: &Registry) -> ClientError {
    let known: Vec<&str> = registry.by_route.keys().map(String::as_str).collect();
    ClientError::UnknownDestination {
        dest: dest.to_owned(),
        detail: " (no route lane or two-phase route: on storage layout 2 a daemon whose config \
                 has the route registers it when it starts)"
            .to_owned(),
        known: if known.is_empty() {
            "none registered".to_owned()
        } else {
            known.join(", ")
        },
    }
}

/// A lane that kept refusing after the registry was read again (retryable: nothing was
/// written).
pub(crate) fn lane_refused(what: &str, e: &redis::RedisError) -> ClientError {
    ClientError::LaneRefused {
        what: what.to_owned(),
        detail: e.to_string(),
    }
}
