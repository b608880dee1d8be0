//! `zdelay::Client`: the thin enqueue library.
//!
//! Enqueue at a time or after a delay (measured on the Redis clock), with an id, headers and
//! a policy for an id that exists; batch enqueue pipelines one `enqueue_jobs` call per shard
//! chunk; cancel, reschedule and get by id are O(log N) in the job's own shard. Dead-letter
//! listing, replay and purge live here too, for the CLI and for operators' own tools.
//!
//! Scripts: `enqueue_jobs`, `cancel_job`, `reschedule_job`, `replay_dead`, `purge_dead`.

use crate::config::RedisConfig;
use crate::envelope::{Envelope, EnvelopeError, validate_dest};
use crate::keys::{Keys, LAYOUT_VERSION};
use crate::scripts;
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Jobs per `enqueue_jobs` call: small enough to keep one script call short.
const ENQUEUE_CHUNK: usize = 500;
/// Script calls per pipeline round trip in a batch enqueue.
const CALLS_PER_PIPELINE: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("job {0} exists (policy: error)")]
    Exists(String),
    #[error("unknown destination {dest:?}; configured routes: {known}")]
    UnknownDestination { dest: String, known: String },
    #[error("payload of {size} bytes exceeds max_payload {max}")]
    Oversize { size: usize, max: usize },
    #[error("invalid job id {0:?}: it must be non-empty, at most 256 bytes")]
    BadId(String),
    #[error("{0}")]
    Schema(String),
}

impl ClientError {
    /// A bounded label for the `error_type` metric.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Redis(_) => "redis",
            ClientError::Envelope(_) => "envelope",
            ClientError::Exists(_) => "exists",
            ClientError::UnknownDestination { .. } => "unknown_destination",
            ClientError::Oversize { .. } => "oversize",
            ClientError::BadId(_) => "bad_id",
            ClientError::Schema(_) => "schema",
        }
    }
}

/// What to do when the id being enqueued exists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnConflict {
    /// Overwrite the job, whatever state it is in.
    #[default]
    Replace,
    /// Leave the existing job as it is and report `Kept`.
    Keep,
    /// Fail with `ClientError::Exists`.
    Error,
}

impl OnConflict {
    fn as_arg(self) -> &'static str {
        match self {
            OnConflict::Replace => "replace",
            OnConflict::Keep => "keep",
            OnConflict::Error => "error",
        }
    }
}

/// When a job becomes due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Epoch milliseconds (UTC).
    At(i64),
    /// After this delay, measured from Redis's clock when the enqueue runs.
    In(Duration),
}

impl Due {
    fn as_arg(self) -> String {
        match self {
            Due::At(ms) => ms.to_string(),
            Due::In(d) => format!("+{}", d.as_millis()),
        }
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
        }
    }
    pub fn at(mut self, epoch_ms: i64) -> Self {
        self.due = Due::At(epoch_ms);
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
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    Added,
    Replaced,
    /// The id existed and the policy was `Keep`: nothing changed.
    Kept,
}

/// Outcome of `cancel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    Cancelled,
    /// Delivered, dead, or never enqueued.
    NotPending,
    /// Claimed by a two-phase sink: being delivered now.
    InFlight,
}

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Due,
    InFlight,
    Dead,
    /// Stored but in no ZSET: an inconsistency an operator should look at.
    Orphan,
}

/// A job as `get` sees it.
#[derive(Debug, Clone)]
pub struct JobView {
    pub id: String,
    pub shard: u16,
    pub state: JobState,
    /// Due ms (state Due), lease deadline (InFlight) or time of death (Dead).
    pub score: Option<f64>,
    /// The stored bytes, and their decoding.
    pub raw: Vec<u8>,
    pub envelope: Result<Envelope, EnvelopeError>,
    pub reason: Option<String>,
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
        obj.insert("shard".into(), self.shard.into());
        obj.insert("state".into(), serde_json::to_value(self.state).unwrap());
        let field = match self.state {
            JobState::Due => "due",
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
        serde_json::Value::Object(obj)
    }
}

/// A dead envelope job.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadJob {
    pub id: String,
    pub shard: u16,
    pub died_ms: i64,
    pub reason: String,
}

/// Builds a redis-rs client from `[redis]`, applying a password override.
pub fn redis_client(cfg: &RedisConfig) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    let mut info = cfg.url.as_str().into_connection_info()?;
    if let Some(password) = &cfg.password {
        let settings = info
            .redis_settings()
            .clone()
            .set_password(password.expose());
        info = info.set_redis_settings(settings);
    }
    redis::Client::open(info)
}

/// A multiplexed, self-reconnecting connection.
pub async fn connect(client: redis::Client) -> redis::RedisResult<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(10)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(1));
    ConnectionManager::new_with_config(client, config).await
}

/// Creates `<ns>:schema` if missing and checks it matches this build and config.
pub async fn ensure_schema(con: &mut ConnectionManager, keys: &Keys) -> Result<(), ClientError> {
    let key = keys.schema();
    let (_, _, layout, shards): ((), (), Option<String>, Option<String>) = redis::pipe()
        .hset_nx(&key, "layout", LAYOUT_VERSION)
        .hset_nx(&key, "shards", keys.shards())
        .hget(&key, "layout")
        .hget(&key, "shards")
        .query_async(con)
        .await?;
    if layout.as_deref() != Some(&LAYOUT_VERSION.to_string()) {
        return Err(ClientError::Schema(format!(
            "{key} says layout {}; this build knows layout {LAYOUT_VERSION} only",
            layout.unwrap_or_default()
        )));
    }
    if shards.as_deref() != Some(&keys.shards().to_string()) {
        return Err(ClientError::Schema(format!(
            "namespace {} has {} shards (in {key}); the config says {}: set redis.shards to match",
            keys.namespace(),
            shards.unwrap_or_default(),
            keys.shards()
        )));
    }
    Ok(())
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

/// A validated job ready for `enqueue_jobs`: (input index, id, due arg, envelope bytes).
type Prepared = (usize, String, String, Vec<u8>);

/// Handle for producers and operators. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    con: ConnectionManager,
    keys: Keys,
    destinations: Option<Arc<BTreeSet<String>>>,
    remote: Option<Arc<crate::sinks::RemoteRoutes>>,
    max_payload: Option<usize>,
    ids: Arc<IdGenerator>,
}

impl Client {
    /// Connects and checks the namespace's schema against `cfg.shards`.
    pub async fn connect(cfg: &RedisConfig) -> Result<Self, ClientError> {
        let mut con = connect(redis_client(cfg)?).await?;
        let keys = Keys::new(&cfg.namespace, cfg.shards);
        ensure_schema(&mut con, &keys).await?;
        scripts::load_all(&mut con).await?;
        Ok(Client {
            con,
            keys,
            destinations: None,
            remote: None,
            max_payload: None,
            ids: Arc::new(IdGenerator::default()),
        })
    }

    /// Connects to a URL with the default namespace and shard count.
    pub async fn open(url: &str) -> Result<Self, ClientError> {
        Self::connect(&RedisConfig {
            url: url.to_owned(),
            ..RedisConfig::default()
        })
        .await
    }

    /// Rejects enqueues to destinations outside `names` (otherwise they die at delivery).
    pub fn with_destinations(mut self, names: impl IntoIterator<Item = String>) -> Self {
        self.destinations = Some(Arc::new(names.into_iter().collect()));
        self
    }

    /// With `with_destinations`: also accepts `<sink>/<target>` admitted by a sink's `allow`.
    pub fn with_remote_routes(mut self, remote: crate::sinks::RemoteRoutes) -> Self {
        self.remote = Some(Arc::new(remote));
        self
    }

    /// Rejects payloads over `max` bytes at enqueue (otherwise they die at delivery).
    pub fn with_max_payload(mut self, max: usize) -> Self {
        self.max_payload = Some(max);
        self
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    pub fn connection(&self) -> ConnectionManager {
        self.con.clone()
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
    /// fail alone; a Redis error fails the whole call (some chunks may have been written:
    /// re-running with the same ids and `Replace` is safe).
    pub async fn enqueue_batch(
        &self,
        jobs: Vec<NewJob>,
        policy: OnConflict,
    ) -> Result<Vec<Result<(String, Enqueued), ClientError>>, ClientError> {
        let mut results: Vec<Option<Result<(String, Enqueued), ClientError>>> =
            (0..jobs.len()).map(|_| None).collect();
        let mut by_shard: BTreeMap<u16, Vec<Prepared>> = BTreeMap::new();
        for (i, job) in jobs.into_iter().enumerate() {
            match self.prepare(job) {
                Ok((id, due, bytes)) => by_shard
                    .entry(self.keys.shard_of(&id))
                    .or_default()
                    .push((i, id, due, bytes)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let mut calls = Vec::new();
        for (shard, items) in &by_shard {
            let shard = *shard;
            for chunk in items.chunks(ENQUEUE_CHUNK) {
                calls.push((shard, chunk));
            }
        }
        let mut con = self.con.clone();
        let channel = self.keys.wake_channel();
        for group in calls.chunks(CALLS_PER_PIPELINE) {
            let mut invocations = Vec::with_capacity(group.len());
            for (shard, chunk) in group {
                let mut inv = scripts::enqueue_jobs.prepare_invoke();
                inv.key(self.keys.due(*shard))
                    .key(self.keys.jobs(*shard))
                    .key(self.keys.dead(*shard))
                    .key(self.keys.reasons(*shard))
                    .key(self.keys.inflight(*shard))
                    .key(self.keys.scheduled(*shard))
                    .arg(policy.as_arg())
                    .arg(&channel)
                    .arg(*shard);
                for (_, id, due, bytes) in chunk.iter() {
                    inv.arg(id).arg(due).arg(bytes);
                }
                invocations.push(inv);
            }
            let mut pipe = redis::pipe();
            for inv in &invocations {
                pipe.invoke_script(inv);
            }
            // Scripts are loaded at connect; a Redis that restarted or flushed them answers
            // NOSCRIPT (redis-rs does not reload inside pipelines): load and send once more.
            // Safe to repeat: enqueue_jobs is re-runnable.
            let replies: Vec<Vec<i64>> = match pipe.query_async(&mut con).await {
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    scripts::load_all(&mut con).await?;
                    pipe.query_async(&mut con).await?
                }
                other => other?,
            };
            for ((_, chunk), codes) in group.iter().zip(replies) {
                for ((index, id, _, _), code) in chunk.iter().zip(codes) {
                    results[*index] = Some(match code {
                        1 => Ok((id.clone(), Enqueued::Added)),
                        2 => Ok((id.clone(), Enqueued::Replaced)),
                        0 => Ok((id.clone(), Enqueued::Kept)),
                        _ => Err(ClientError::Exists(id.clone())),
                    });
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every job has a result"))
            .collect())
    }

    fn prepare(&self, job: NewJob) -> Result<(String, String, Vec<u8>), ClientError> {
        validate_dest(&job.dest)?;
        if let Some(known) = &self.destinations
            && !known.contains(&job.dest)
            && self
                .remote
                .as_ref()
                .is_none_or(|r| r.resolve(&job.dest).is_err())
        {
            return Err(ClientError::UnknownDestination {
                dest: job.dest,
                known: known.iter().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        if let Some(max) = self.max_payload
            && job.payload.len() > max
        {
            return Err(ClientError::Oversize {
                size: job.payload.len(),
                max,
            });
        }
        let id = match job.id {
            Some(id) if id.is_empty() || id.len() > 256 => return Err(ClientError::BadId(id)),
            Some(id) => id,
            None => self.new_id(),
        };
        let mut env = Envelope::new(job.dest, job.payload);
        env.meta.headers = job.headers;
        env.meta.max_attempts = job.max_attempts;
        Ok((id, job.due.as_arg(), env.encode()?))
    }

    /// Cancels a pending job.
    pub async fn cancel(&self, id: &str) -> Result<Cancelled, ClientError> {
        let shard = self.keys.shard_of(id);
        let code: i64 = scripts::cancel_job
            .key(self.keys.due(shard))
            .key(self.keys.jobs(shard))
            .key(self.keys.inflight(shard))
            .key(self.keys.scheduled(shard))
            .arg(id)
            .invoke_async(&mut self.con.clone())
            .await?;
        Ok(match code {
            1 => Cancelled::Cancelled,
            -1 => Cancelled::InFlight,
            _ => Cancelled::NotPending,
        })
    }

    /// Moves a pending job to a new due time; `None` when it is not pending.
    pub async fn reschedule(&self, id: &str, due: Due) -> Result<Option<i64>, ClientError> {
        let shard = self.keys.shard_of(id);
        let new_due: i64 = scripts::reschedule_job
            .key(self.keys.due(shard))
            .key(self.keys.scheduled(shard))
            .arg(id)
            .arg(due.as_arg())
            .arg(self.keys.wake_channel())
            .arg(shard)
            .invoke_async(&mut self.con.clone())
            .await?;
        Ok((new_due >= 0).then_some(new_due))
    }

    /// Looks a job up by id in its shard.
    pub async fn get(&self, id: &str) -> Result<Option<JobView>, ClientError> {
        let shard = self.keys.shard_of(id);
        type Reply = (
            Option<f64>,
            Option<f64>,
            Option<f64>,
            Option<Vec<u8>>,
            Option<String>,
        );
        let (due, inflight, dead, raw, reason): Reply = redis::pipe()
            .zscore(self.keys.due(shard), id)
            .zscore(self.keys.inflight(shard), id)
            .zscore(self.keys.dead(shard), id)
            .hget(self.keys.jobs(shard), id)
            .hget(self.keys.reasons(shard), id)
            .query_async(&mut self.con.clone())
            .await?;
        let (state, score) = match (due, inflight, dead) {
            (Some(s), _, _) => (JobState::Due, Some(s)),
            (_, Some(s), _) => (JobState::InFlight, Some(s)),
            (_, _, Some(s)) => (JobState::Dead, Some(s)),
            _ if raw.is_some() => (JobState::Orphan, None),
            _ => return Ok(None),
        };
        let raw = raw.unwrap_or_default();
        Ok(Some(JobView {
            id: id.to_owned(),
            shard,
            state,
            score,
            envelope: Envelope::decode(&raw),
            raw,
            reason,
        }))
    }

    /// The oldest dead jobs, at most `limit` per shard.
    pub async fn dead_list(&self, limit: usize) -> Result<Vec<DeadJob>, ClientError> {
        let mut con = self.con.clone();
        let mut out = Vec::new();
        for shard in 0..self.keys.shards() {
            let entries = oldest_dead(
                &mut con,
                &self.keys.dead(shard),
                &self.keys.reasons(shard),
                limit,
            )
            .await?;
            out.extend(entries.into_iter().map(|(id, died_ms, reason)| DeadJob {
                id: String::from_utf8_lossy(&id).into_owned(),
                shard,
                died_ms,
                reason,
            }));
        }
        Ok(out)
    }

    /// Makes dead jobs due now: the given ids, or, when `ids` is empty, every job that was
    /// dead when the call started (one that dies again meanwhile is not replayed twice).
    pub async fn dead_replay(&self, ids: &[String]) -> Result<Replayed, ClientError> {
        let mut con = self.con.clone();
        let mut total = Replayed::default();
        for (shard, ids) in self.dead_ids_by_shard(ids).await? {
            for chunk in ids.chunks(DEAD_CHUNK) {
                let (replayed, orphans): (u64, u64) = scripts::replay_dead
                    .key(self.keys.due(shard))
                    .key(self.keys.jobs(shard))
                    .key(self.keys.dead(shard))
                    .key(self.keys.reasons(shard))
                    .arg("")
                    .arg(self.keys.wake_channel())
                    .arg(shard)
                    .arg(chunk)
                    .invoke_async(&mut con)
                    .await?;
                total.replayed += replayed;
                total.orphans += orphans;
            }
        }
        Ok(total)
    }

    /// Deletes dead jobs: the given ids, or every job that was dead when the call started.
    pub async fn dead_purge(&self, ids: &[String]) -> Result<u64, ClientError> {
        let mut con = self.con.clone();
        let mut total = 0;
        for (shard, ids) in self.dead_ids_by_shard(ids).await? {
            for chunk in ids.chunks(DEAD_CHUNK) {
                let n: u64 = scripts::purge_dead
                    .key(self.keys.jobs(shard))
                    .key(self.keys.dead(shard))
                    .key(self.keys.reasons(shard))
                    .arg(chunk)
                    .invoke_async(&mut con)
                    .await?;
                total += n;
            }
        }
        Ok(total)
    }

    /// The given ids grouped by shard, or every id dead before now when `ids` is empty.
    async fn dead_ids_by_shard(
        &self,
        ids: &[String],
    ) -> Result<BTreeMap<u16, Vec<String>>, ClientError> {
        let mut by_shard: BTreeMap<u16, Vec<String>> = BTreeMap::new();
        if ids.is_empty() {
            let mut con = self.con.clone();
            let cutoff = redis_now_ms(&mut con).await?;
            for shard in 0..self.keys.shards() {
                let dead = dead_before(&mut con, &self.keys.dead(shard), cutoff).await?;
                if !dead.is_empty() {
                    by_shard.insert(
                        shard,
                        dead.into_iter()
                            .map(|m| String::from_utf8_lossy(&m).into_owned())
                            .collect(),
                    );
                }
            }
        } else {
            for id in ids {
                by_shard
                    .entry(self.keys.shard_of(id))
                    .or_default()
                    .push(id.clone());
            }
        }
        Ok(by_shard)
    }
}

/// What `dead_replay` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    pub replayed: u64,
    /// Dead ids without an envelope: nothing to deliver, so they stay dead.
    pub orphans: u64,
}

/// Ids (or members) per dead-letter script call.
const DEAD_CHUNK: usize = 1000;

/// The oldest `limit` members of a dead ZSET with their death time and reason:
/// (member, died ms, reason), in death order.
async fn oldest_dead(
    con: &mut ConnectionManager,
    dead_key: &str,
    reasons_key: &str,
    limit: usize,
) -> redis::RedisResult<Vec<(Vec<u8>, i64, String)>> {
    let entries: Vec<(Vec<u8>, f64)> = con
        .zrange_withscores(dead_key, 0, limit as isize - 1)
        .await?;
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let members: Vec<&Vec<u8>> = entries.iter().map(|(m, _)| m).collect();
    let reasons: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(reasons_key)
        .arg(&members)
        .query_async(con)
        .await?;
    Ok(entries
        .into_iter()
        .zip(reasons)
        .map(|((m, died), r)| (m, died as i64, r.unwrap_or_default()))
        .collect())
}

/// Redis TIME in ms.
pub(crate) async fn redis_now_ms(con: &mut ConnectionManager) -> redis::RedisResult<i64> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(con).await?;
    Ok(secs * 1000 + micros / 1000)
}

/// Members of a dead ZSET that died strictly before `cutoff_ms`, read in pages before
/// anything is changed, so the set can be acted on without meeting its own re-deaths.
async fn dead_before(
    con: &mut ConnectionManager,
    key: &str,
    cutoff_ms: i64,
) -> redis::RedisResult<Vec<Vec<u8>>> {
    const PAGE: usize = 10_000;
    let mut out: Vec<Vec<u8>> = Vec::new();
    loop {
        let page: Vec<Vec<u8>> = redis::cmd("ZRANGEBYSCORE")
            .arg(key)
            .arg("-inf")
            .arg(format!("({cutoff_ms}"))
            .arg("LIMIT")
            .arg(out.len())
            .arg(PAGE)
            .query_async(con)
            .await?;
        let full = page.len() == PAGE;
        out.extend(page);
        if !full {
            return Ok(out);
        }
    }
}

/// Dead members of raw sources.
impl Client {
    /// The oldest dead members of a raw source: (member, died ms, reason).
    pub async fn raw_dead_list(
        &self,
        source: &crate::config::SourceConfig,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, i64, String)>, ClientError> {
        let dead = source.dead_key();
        let reasons = crate::keys::raw_dead_reasons(&dead);
        Ok(oldest_dead(&mut self.con.clone(), &dead, &reasons, limit).await?)
    }

    /// Puts every member that was dead when the call started back into its source, due now.
    pub async fn raw_dead_replay(
        &self,
        source: &crate::config::SourceConfig,
    ) -> Result<u64, ClientError> {
        let mut con = self.con.clone();
        let dead = source.dead_key();
        let now_ms = redis_now_ms(&mut con).await?;
        let score = match source.score_unit {
            crate::config::ScoreUnit::Millis => now_ms.to_string(),
            crate::config::ScoreUnit::Seconds => format!("{:.3}", now_ms as f64 / 1000.0),
        };
        let mut total = 0;
        for chunk in dead_before(&mut con, &dead, now_ms)
            .await?
            .chunks(DEAD_CHUNK)
        {
            let n: u64 = scripts::replay_raw_dead
                .key(&source.key)
                .key(&dead)
                .key(crate::keys::raw_dead_reasons(&dead))
                .arg(&score)
                .arg(chunk)
                .invoke_async(&mut con)
                .await?;
            total += n;
        }
        Ok(total)
    }

    /// Deletes every member of a raw source that was dead when the call started.
    pub async fn raw_dead_purge(
        &self,
        source: &crate::config::SourceConfig,
    ) -> Result<u64, ClientError> {
        let mut con = self.con.clone();
        let dead = source.dead_key();
        let now_ms = redis_now_ms(&mut con).await?;
        let mut total = 0;
        for chunk in dead_before(&mut con, &dead, now_ms)
            .await?
            .chunks(DEAD_CHUNK)
        {
            let n: u64 = scripts::purge_raw_dead
                .key(&dead)
                .key(crate::keys::raw_dead_reasons(&dead))
                .arg(chunk)
                .invoke_async(&mut con)
                .await?;
            total += n;
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn due_args() {
        assert_eq!(Due::At(1_700_000_000_000).as_arg(), "1700000000000");
        assert_eq!(Due::In(Duration::from_millis(250)).as_arg(), "+250");
    }

    #[test]
    fn error_kinds_are_bounded_labels() {
        let e = ClientError::Exists("x".into());
        assert_eq!(e.kind(), "exists");
        assert_eq!(e.to_string(), "job x exists (policy: error)");
    }
}
