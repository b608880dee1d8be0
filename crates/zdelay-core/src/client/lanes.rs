//! `Client` on a namespace on storage layout 2 (every new namespace's): every job is for a local
//! route and lives in that route's lane, in the hash slot of the route's list (see `lane`).
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
use crate::routes::LaneRoute;
use crate::store::scripts::{self, LaneItem};
use crate::store::{self, Conn, StoreError};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

/// Tries of a generated id that another producer took in the same millisecond.
const ID_TRIES: u32 = 3;

/// What a client keeps of the lanes: the registry as last read and its id generator.
pub(crate) struct LaneBook {
    registry: RwLock<Registry>,
    ids: StoredIdGenerator,
    /// While `zdelay reshard` moves the spread shards: the old count, and when the schema
    /// last said so. Two-phase jobs it has not moved yet are still in the old shards.
    resharding: Mutex<Option<(u16, Instant)>>,
}

/// How often a client that knows a reshard of the spread shards runs reads the schema to
/// see it finished.
const RESHARD_LOOK: Duration = Duration::from_secs(5);

/// How long a lookup by id waits for a relocation or a reshard to move the job it names.
const MOVE_WAIT: Duration = Duration::from_secs(3);

impl LaneBook {
    pub(crate) async fn read(con: &mut Conn, keys: &crate::keys::Keys) -> Result<Self, StoreError> {
        let schema = store::read_schema(con, keys).await?;
        Ok(LaneBook {
            registry: RwLock::new(store::lanes::read_registry(con, keys).await?),
            ids: StoredIdGenerator::new(),
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
    pub(crate) fn lane_book(&self) -> &LaneBook {
        &self.lanes
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
        self.check_lane_job(&job)?;
        let (generated, stored) = match job.id {
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

    /// What a lane refuses of `job` before writing anything: its destination, payload, due
    /// time and id.
    fn check_lane_job(&self, job: &NewJob) -> Result<(), ClientError> {
        self.check_dest_and_payload(&job.dest, &job.payload)?;
        check_due(job.due)?;
        match &job.id {
            Some(id) if id.is_empty() || id.len() > 256 => Err(ClientError::BadId(id.clone())),
            Some(id) if is_reserved(id) => Err(ClientError::ReservedId(id.clone())),
            _ => Ok(()),
        }
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
        let mut marked = false;
        let known =
            |r: &Registry, dest: &str| r.by_route.contains_key(dest) || r.is_two_phase(dest);
        if jobs.iter().any(|j| !known(&registry, &j.dest)) {
            registry = self.refresh_lanes(book).await?;
            refreshed = true;
        }
        // A refused job writes nothing, not even its route's lane.
        let dests: BTreeSet<&str> = jobs
            .iter()
            .filter(|j| self.check_lane_job(j).is_ok())
            .map(|j| j.dest.as_str())
            .collect();
        let (mut refusals, registered) = self.register_destinations(&registry, dests).await?;
        if registered {
            registry = self.refresh_lanes(book).await?;
        }
        let mut pending = Vec::new();
        let (mut two_phase, mut two_phase_at) = (Vec::new(), Vec::new());
        for (i, job) in jobs.into_iter().enumerate() {
            if let Some(refusal) = refusals.get(&job.dest) {
                results[i] = Some(Err(refusal.error(&job.dest, &registry)));
                continue;
            }
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
                if let Some(refusal) = refusals.get(&p.dest) {
                    results[p.index] = Some(Err(refusal.error(&p.dest, &registry)));
                    continue;
                }
                if !registry.by_route.contains_key(&p.dest) {
                    results[p.index] = Some(Err(no_lane(&p.dest, "", &registry)));
                    continue;
                }
                groups
                    .entry((p.dest.clone(), p.generated.is_some()))
                    .or_default()
                    .push(p);
            }
            let mut again = false;
            let mut refused_routes = BTreeSet::new();
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
                        // Once after reading the registry again; and once after writing the
                        // marker of a lane this client's config has (registered a moment ago
                        // by another, its marker may not be written yet).
                        Err(e)
                            if lane_refusal(&e)
                                && (!refreshed || (!marked && self.has_route(&route))) =>
                        {
                            pending.extend(chunk.iter().cloned());
                            again = true;
                            refused_routes.insert(route.clone());
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
                // A lane registered a moment ago may not have its marker yet (it is written
                // after the registry names the lane): a producer given the config writes it.
                marked |= refused_routes.iter().any(|r| self.has_route(r));
                let (more, _) = self
                    .register_destinations(
                        &Registry::default(),
                        refused_routes.iter().map(String::as_str),
                    )
                    .await?;
                refusals.extend(more);
                registry = self.refresh_lanes(book).await?;
                refreshed = true;
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every job has a result"))
            .collect())
    }

    /// On a client given its config's routes ([`Client::with_routes`] with
    /// `Routes::from_config`): registers each destination of `dests` that the config has and
    /// `registry` lacks, as a daemon with that config would at start, and checks the others
    /// against the config. Returns the destinations refused (registered otherwise, or this
    /// user may not register them), and whether anything was registered (read the registry
    /// again). Without a config, nothing.
    pub(crate) async fn register_destinations<'d>(
        &self,
        registry: &Registry,
        dests: impl IntoIterator<Item = &'d str>,
    ) -> Result<(BTreeMap<String, Refusal>, bool), ClientError> {
        let mut refusals = BTreeMap::new();
        let mut registered = false;
        let Some(config) = self.lane_routes() else {
            return Ok((refusals, registered));
        };
        let keys = self.keys();
        for dest in dests {
            let Some(route) = config.find(dest) else {
                continue;
            };
            match registration(registry, route) {
                Registration::Agrees => continue,
                Registration::Differs(registered) => {
                    refusals.insert(dest.to_owned(), differs(route, registered));
                    continue;
                }
                Registration::Missing => {}
            }
            match store::lanes::register_missing(&mut self.con.clone(), &keys, route).await {
                Ok(None) => registered = true,
                Ok(Some(entry)) => {
                    refusals.insert(dest.to_owned(), differs(route, describe_entry(&entry)));
                }
                Err(StoreError::Redis(e)) if is_no_permission(&e) => {
                    let why = e.detail().map_or_else(|| e.to_string(), str::to_owned);
                    let ns = keys.namespace();
                    refusals.insert(
                        dest.to_owned(),
                        Refusal::NoRights(format!(
                            "NOPERM {why}): grant it write access to the lane registry \
                             {ns}:lanes and the lane markers {ns}:{{*}}:lane:* with +hincrby and \
                             +set (the security guide's producer user on storage layout 2"
                        )),
                    );
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok((refusals, registered))
    }

    /// Whether this client was given a config that has route `route`.
    fn has_route(&self, route: &str) -> bool {
        self.lane_routes().is_some_and(|c| c.find(route).is_some())
    }

    /// Every home of jobs, dead letters and schedules: the shards of `layout` (on layout 2
    /// the spread shards), then on layout 2 the route lanes as the registry names them now,
    /// in number order.
    pub(crate) async fn homes(&self, layout: &Keys) -> Result<Vec<Home>, ClientError> {
        let mut homes: Vec<Home> = (0..layout.shards())
            .map(|s| Home::Shard(layout.shard(s)))
            .collect();
        let mut lanes: Vec<Lane> = self
            .refresh_lanes(self.lane_book())
            .await?
            .by_route
            .into_values()
            .collect();
        lanes.sort_by_key(|lane| lane.number);
        homes.extend(lanes.into_iter().map(Home::Lane));
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
            .ok_or_else(|| no_lane(dest, "", &registry))
    }

    /// Runs `op`, and once more when a lane refused it (`op` reads the registry again; what the first run did is
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

    /// The lane a generated id names (or, once that lane is retired, its route's live lane,
    /// where the relocation put its jobs), and its stored id; `None` when there is none.
    async fn generated_lane(
        &self,
        book: &LaneBook,
        id: &str,
    ) -> Result<Option<(Lane, String)>, ClientError> {
        let parsed = LaneId::parse(id)?;
        let mut lane = book.registry().successor(parsed.lane).cloned();
        if lane.is_none() {
            lane = self
                .refresh_lanes(book)
                .await?
                .successor(parsed.lane)
                .cloned();
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
        let registry = book.registry();
        let names_it = parsed.lane == lane.number
            || registry
                .retired
                .get(&parsed.lane)
                .is_some_and(|r| r.route == lane.route);
        Ok(names_it.then(|| (lane, parsed.stored.to_string())))
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
        self.wait_out_reshard(&self.keys(), id, held).await?;
        let Some(dest) = dest else {
            // The search of a user-chosen id reads the registry, so retired lanes are known
            // after it: a job still in one is waited for, then looked for again. A generated
            // id names its lane (or the successor of its retired lane).
            let found = self.locate(book, id, held).await?;
            if self.wait_out_relocation(book, None, id, held).await? && !generated(id, held) {
                return self.locate(book, id, held).await;
            }
            return Ok(found);
        };
        self.wait_out_relocation(book, Some(dest), id, held).await?;
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
            Err(no_lane(dest, "", &registry))
        }
    }

    /// While a relocation moves a retired lane's jobs into its route's live lane (the route's
    /// list moved to another hash slot), waits until the retired lanes where `id` may still be
    /// (the one a generated id names; `dest`'s; without `dest`, every one) no longer hold it.
    /// The relocation writes a job into the live lane before it forgets it in the retired
    /// one, and nothing else changes a retired lane, so looking in the live lane afterwards
    /// cannot miss it, and a cancel there cannot be undone by the move. Whether a retired lane
    /// held it; `LaneRefused` (retryable) when it still does after [`MOVE_WAIT`] (no
    /// daemon is relocating).
    async fn wait_out_relocation(
        &self,
        book: &LaneBook,
        dest: Option<&str>,
        id: &str,
        held: Held,
    ) -> Result<bool, ClientError> {
        let registry = book.registry();
        if registry.retired.is_empty() {
            return Ok(false);
        }
        let namespace = self.keys().namespace().to_owned();
        let live_keys = |route: &str| registry.by_route.get(route).map(|l| l.keys.marker.clone());
        let mut places: Vec<(crate::keys::LaneKeys, String)> = Vec::new();
        if generated(id, held) {
            let parsed = LaneId::parse(id)?;
            if let Some(retired) = registry.retired.get(&parsed.lane) {
                let keys = retired.keys(&namespace);
                if live_keys(&retired.route) != Some(keys.marker.clone()) {
                    places.push((keys, parsed.stored.to_string()));
                }
            }
        } else if let Some(dest) = dest {
            places.extend(
                registry
                    .retired_of(dest)
                    .map(|r| (r.keys(&namespace), id.to_owned())),
            );
        } else {
            places.extend(
                registry
                    .retired
                    .values()
                    .map(|r| r.keys(&namespace))
                    .filter(|k| {
                        !registry
                            .by_route
                            .values()
                            .any(|l| l.keys.marker == k.marker)
                    })
                    .map(|k| (k, id.to_owned())),
            );
        }
        let started = Instant::now();
        let mut waited = false;
        while !places.is_empty() {
            let asks = places.iter().map(|(k, stored)| async move {
                self.holds(held.ask(&k.jobs, &k.dead, &k.schedules, stored))
                    .await
            });
            let holding = futures::future::try_join_all(asks).await?;
            let mut holding = holding.into_iter();
            places.retain(|_| holding.next().unwrap_or(false));
            if places.is_empty() {
                break;
            }
            waited = true;
            if started.elapsed() > MOVE_WAIT {
                return Err(ClientError::LaneRefused {
                    what: id.to_owned(),
                    detail:
                        "its route's list moved to another hash slot and the job is still in the \
                             route's old lane: a daemon with the new config moves it when it \
                             starts"
                            .to_owned(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(waited)
    }

    /// While `zdelay reshard` moves the spread shards, waits until the old shard of `id` (a
    /// two-phase job's id) no longer holds it, so a lookup in its new shard (`keys`) cannot
    /// miss it: the reshard writes a job into its new shard before it deletes it from the old
    /// one. `StoreError::Resharding` (retryable) when that takes longer than [`MOVE_WAIT`].
    pub(crate) async fn wait_out_reshard(
        &self,
        keys: &crate::keys::Keys,
        id: &str,
        held: Held,
    ) -> Result<(), ClientError> {
        let book = self.lane_book();
        let started = Instant::now();
        loop {
            let Some((from, since)) = *book.resharding.lock().expect("resharding lock") else {
                return Ok(());
            };
            if since.elapsed() > RESHARD_LOOK {
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
            if started.elapsed() > MOVE_WAIT {
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
                    self.wait_out_relocation(book, dest, id, Held::Stored)
                        .await?;
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
            let read = store::lanes::read(&mut self.con.clone(), &lane, &stored, preview).await?;
            if read.marker.as_deref() != Some(lane.marker().as_str()) {
                // The lane moved or changed since the registry was read (a job not found in
                // a retired lane may have been relocated to its successor).
                if last {
                    return Err(StoreError::Schema(format!(
                        "{} holds {:?}, not the lane the registry names for route {}",
                        lane.keys.marker, read.marker, lane.route
                    ))
                    .into());
                }
                self.refresh_lanes(book).await?;
                self.wait_out_relocation(book, dest, id, Held::Stored)
                    .await?;
                continue;
            }
            let Some(job) = read.job else {
                return Ok(None);
            };
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

/// A destination the lane registry does not name (retryable: a daemon or a producer with the
/// route's config registers it). `detail` says why this producer did not.
fn no_lane(dest: &str, detail: &str, registry: &Registry) -> ClientError {
    let known: Vec<&str> = registry
        .by_route
        .keys()
        .chain(registry.two_phase.keys())
        .map(String::as_str)
        .collect();
    ClientError::NoLane {
        dest: dest.to_owned(),
        detail: detail.to_owned(),
        known: if known.is_empty() {
            "none".to_owned()
        } else {
            known.join(", ")
        },
    }
}

/// Why a producer given the config did not enqueue to a destination of it.
#[derive(Debug, Clone)]
pub(crate) enum Refusal {
    /// Registered otherwise than the config says: (route, registered, the config's).
    Differs(String, String, String),
    /// The ACL refused the registration: why, and what to grant.
    NoRights(String),
}

impl Refusal {
    pub(crate) fn error(&self, dest: &str, registry: &Registry) -> ClientError {
        match self {
            Refusal::Differs(route, registered, config) => ClientError::RouteDiffers {
                route: route.clone(),
                registered: registered.clone(),
                config: config.clone(),
            },
            Refusal::NoRights(why) => no_lane(
                dest,
                &format!(
                    " and this producer's Redis user may not register it ({why}), or start a \
                     daemon whose config has the route first"
                ),
                registry,
            ),
        }
    }
}

/// How the registry holds what a config says of one destination.
enum Registration {
    Agrees,
    /// Registered otherwise: the registered form, in words.
    Differs(String),
    Missing,
}

fn registration(registry: &Registry, route: LaneRoute<'_>) -> Registration {
    match route {
        LaneRoute::Local(local) => match registry.by_route.get(&local.name) {
            Some(lane) if lane.list == local.list && lane.push == local.push => {
                Registration::Agrees
            }
            Some(lane) => Registration::Differs(local_words(&lane.list, lane.push.command())),
            None => match registry.two_phase.get(&local.name) {
                Some(sink) => Registration::Differs(two_phase_words(sink)),
                None => Registration::Missing,
            },
        },
        LaneRoute::TwoPhase { route, sink } => {
            match (registry.by_route.get(route), registry.two_phase.get(route)) {
                (Some(lane), _) => {
                    Registration::Differs(local_words(&lane.list, lane.push.command()))
                }
                (None, Some(registered)) if registered == sink => Registration::Agrees,
                (None, Some(registered)) => Registration::Differs(two_phase_words(registered)),
                (None, None) => Registration::Missing,
            }
        }
        LaneRoute::Sink(sink) if registry.sinks.contains(sink) => Registration::Agrees,
        LaneRoute::Sink(_) => Registration::Missing,
    }
}

fn differs(route: LaneRoute<'_>, registered: String) -> Refusal {
    let (name, config) = match route {
        LaneRoute::Local(local) => (
            local.name.clone(),
            local_words(&local.list, local.push.command()),
        ),
        LaneRoute::TwoPhase { route, sink } => (route.to_owned(), two_phase_words(sink)),
        LaneRoute::Sink(sink) => (sink.to_owned(), format!("sink {sink}")),
    };
    Refusal::Differs(name, registered, config)
}

fn local_words(list: &str, push: &str) -> String {
    format!("a local route to list {list:?} ({push})")
}

fn two_phase_words(sink: &str) -> String {
    format!("a two-phase route to sink {sink}")
}

/// A registry entry as the registration scripts answer it (`<lane> local <slot> <push>
/// <list>`, or `sink <sink>`), in words.
fn describe_entry(entry: &str) -> String {
    if let Some(sink) = entry.strip_prefix("sink ") {
        return two_phase_words(sink);
    }
    let mut parts = entry.splitn(5, ' ');
    match (parts.nth(3), parts.next()) {
        (Some(push), Some(list)) => local_words(list, push),
        _ => format!("{entry:?}"),
    }
}

/// Whether Redis refused a call for the user's ACL.
fn is_no_permission(e: &redis::RedisError) -> bool {
    e.code() == Some("NOPERM") || e.to_string().contains("NOPERM")
}

/// A lane that kept refusing after the registry was read again (retryable: nothing was
/// written).
pub(crate) fn lane_refused(what: &str, e: &redis::RedisError) -> ClientError {
    ClientError::LaneRefused {
        what: what.to_owned(),
        detail: e.to_string(),
    }
}
