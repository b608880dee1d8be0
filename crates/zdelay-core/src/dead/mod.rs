//! Dead letters: list, show, replay and purge dead envelope jobs and dead raw members, by id
//! or by filters ([`DeadFilter`]: route, reason, age, schedule).
//!
//! Bulk operations act on what matched when they started: the dead set is read in pages
//! first, each selected job with the dead score it had, and the scripts act on a job only if
//! its score is still that one — so a job that dies again meanwhile is left alone, never
//! replayed or purged twice. Progress is reported through a callback; nothing here prints.
//!
//! **Bounds.** No call reads a payload whole: `peek_dead` returns envelope heads and the first
//! bytes of a payload, at most [`scripts::PEEK_BUDGET`] of envelopes per call. Raw members,
//! which are their own payloads (an oversize one up to Redis's 512 MB), never leave Redis:
//! `walk_raw_dead` walks the dead ZSET by rank inside the script, at most
//! [`scripts::RAW_WALK_BUDGET`] of members per call (or one larger member), and lists each
//! with its first bytes, or replays or purges it there. A member's id is `<died ms>-<hash>`
//! ([`DeadMember::id`]): its death time finds it without a scan; the hash alone (the form
//! before) is looked for among the oldest [`OLD_ID_SCAN`] members. An operation by ids
//! touches their shards only.
//!
//! **History.** The scripts that kill jobs write the current reason to `{ns:s}:reasons`
//! (overwriting). A replay appends the death it leaves — `<died ms> <reason>` — to the job's
//! entry in `{ns:s}:history` (one entry a line, oldest first, the last [`HISTORY_CAP`] kept,
//! reasons cut to 500 bytes with newlines turned to spaces), so `dead show` prints every
//! death the job went through. Purging a job deletes its history. A job delivered (or
//! cancelled) after a replay has no envelope any more; its history is dropped by the next
//! bulk `dead replay` or `dead purge` (by filter), which prune the history of every id no
//! longer stored (by ids they touch the ids' shards only). So history holds at most
//! [`HISTORY_CAP`] lines per id, for ids still stored plus those replayed since the last bulk
//! replay or purge.
//!
//! **Layout.** Every call runs with the client's shard count and is refused when the
//! namespace no longer has it: the scripts check the shard's layout marker, and the reads
//! that no script makes check shard 0's marker first (or read each shard's with the data).
//! Refused because the namespace was resharded, the call reads the new count and runs once
//! more (what it already did is skipped: replayed or purged ids are no longer dead); refused
//! while a reshard runs, it fails, retryable, having written nothing in the refused shard.
//!
//! **Attempts.** A replay resets the envelope's attempt count (the meta loses `attempt`;
//! `last_error` and everything else stay) unless [`ReplayOptions::keep_attempts`]: inside
//! the script, so it is atomic and safe to re-run. Raw members keep no attempt count while
//! dead (their `<source>:claims` entry goes when they die): a replayed member starts at 0.

mod home;

use crate::client::lanes::{Found, Held};
use crate::client::{ClientError, read_envelope};
use crate::config::{ScoreUnit, SourceConfig};
use crate::envelope::{Envelope, EnvelopeError};
use crate::job::Due;
use crate::keys::Keys;
use crate::lane::Home;
use crate::operator::Operator;
use crate::store::Conn;
use crate::store::scripts::{self, DeadPeek, RawDeadRange, RawDeadWalk, Replayed};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// History entries kept per job: its last deaths before the current one.
pub const HISTORY_CAP: usize = 5;

/// Ids (or members) per dead-letter script call.
const DEAD_CHUNK: usize = 250;

/// Dead entries read per page while selecting.
const PAGE: usize = 500;

/// Raw dead members one walk call reads (hashing each to find an id).
const RAW_WALK: usize = 1000;

/// One death: when (epoch ms) and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Death {
    pub died_ms: i64,
    pub reason: String,
}

/// Reads a job's history text: one `<died ms> <reason>` a line, oldest first. A line that
/// does not start with a number is kept whole as the reason, with `died_ms` 0.
pub fn parse_history(text: &str) -> Vec<Death> {
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|line| {
            let (ms, reason) = line.split_once(' ').unwrap_or((line, ""));
            match ms.parse::<i64>() {
                Ok(died_ms) => Death {
                    died_ms,
                    reason: reason.to_owned(),
                },
                Err(_) => Death {
                    died_ms: 0,
                    reason: line.to_owned(),
                },
            }
        })
        .collect()
}

/// The history text of `deaths` as `replay_dead` writes it: the last [`HISTORY_CAP`], one
/// `<died ms> <reason>` a line, newlines in reasons turned to spaces, reasons cut to 500
/// bytes.
pub fn format_history(deaths: &[Death]) -> String {
    let skip = deaths.len().saturating_sub(HISTORY_CAP);
    deaths[skip..]
        .iter()
        .map(|d| {
            let mut reason = d.reason.replace(['\r', '\n'], " ").into_bytes();
            reason.truncate(500);
            format!("{} {}", d.died_ms, String::from_utf8_lossy(&reason))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Which dead jobs a listing or a bulk operation takes. Every field narrows; the empty
/// filter takes every dead job. Ages are measured on Redis's clock when the call starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadFilter {
    /// The envelope's `dest`, exactly (a route name or `<sink>/<target>`).
    pub route: Option<String>,
    /// A part of the reason it died with (ASCII case ignored).
    pub reason: Option<String>,
    /// Died at least this long ago.
    pub older_than: Option<Duration>,
    /// Died less than this long ago.
    pub newer_than: Option<Duration>,
    /// The envelope meta's `schedule` (recurring schedules set it on their occurrences);
    /// jobs without one never match.
    pub schedule: Option<String>,
}

impl DeadFilter {
    pub fn is_empty(&self) -> bool {
        *self == DeadFilter::default()
    }

    /// The filters set that read the envelope (route, schedule), by their CLI names: raw
    /// members have none.
    pub fn envelope_only(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.route.is_some() {
            out.push("--route");
        }
        if self.schedule.is_some() {
            out.push("--schedule");
        }
        out
    }

    /// Refuses a filter that can match nothing: an age window that is empty.
    pub fn check(&self) -> Result<(), ClientError> {
        if let (Some(older), Some(newer)) = (self.older_than, self.newer_than)
            && newer <= older
        {
            return Err(ClientError::InvalidSelection(format!(
                "--older-than {} and --newer-than {} leave no time window: a job cannot have \
                 died at least {0} ago and less than {1} ago",
                humantime::format_duration(older),
                humantime::format_duration(newer),
            )));
        }
        Ok(())
    }

    /// A filter from its fields as text — the console API's query parameters, by the CLI's
    /// flag names with `_` — empty text meaning "not set"; ages as [`parse_age`] reads them.
    /// Checked ([`DeadFilter::check`]).
    pub fn from_text(
        route: Option<&str>,
        reason: Option<&str>,
        older_than: Option<&str>,
        newer_than: Option<&str>,
        schedule: Option<&str>,
    ) -> Result<DeadFilter, ClientError> {
        fn set(v: Option<&str>) -> Option<&str> {
            v.map(str::trim).filter(|v| !v.is_empty())
        }
        let age = |name: &str, v: Option<&str>| {
            set(v)
                .map(parse_age)
                .transpose()
                .map_err(|e| ClientError::InvalidSelection(format!("{name}: {e}")))
        };
        let filter = DeadFilter {
            route: set(route).map(str::to_owned),
            reason: set(reason).map(str::to_owned),
            older_than: age("older_than", older_than)?,
            newer_than: age("newer_than", newer_than)?,
            schedule: set(schedule).map(str::to_owned),
        };
        filter.check()?;
        Ok(filter)
    }

    /// Whether the filter reads the reason or the envelope (not only the dead score).
    /// Whether `home` may hold jobs the filter admits (a route filter skips other lanes).
    fn may_be_in(&self, home: &Home) -> bool {
        self.route.as_deref().is_none_or(|r| home.may_hold_route(r))
    }

    fn reads_content(&self) -> bool {
        self.reason.is_some() || self.route.is_some() || self.schedule.is_some()
    }

    /// How many dead entries to read per round for `limit` results: a filter on content
    /// may reject most of a page, so it reads full pages.
    fn page_size(&self, limit: usize) -> usize {
        if self.reads_content() {
            PAGE
        } else {
            limit.clamp(1, PAGE)
        }
    }

    /// The dead scores the age filters admit, as `ZRANGEBYSCORE` bounds: always before
    /// `now_ms` (what was dead when the call started).
    fn score_range(&self, now_ms: i64) -> (String, String) {
        let min = match self.newer_than {
            Some(d) => format!("({}", now_ms - d.as_millis() as i64),
            None => "-inf".to_owned(),
        };
        let max = match self.older_than {
            Some(d) if !d.is_zero() => (now_ms - d.as_millis() as i64).to_string(),
            _ => format!("({now_ms}"),
        };
        (min, max)
    }

    /// Whether a job that died at `died_ms` is in the age window at `now_ms`.
    pub fn admits_age(&self, now_ms: i64, died_ms: i64) -> bool {
        let age = now_ms - died_ms;
        age > 0
            && self.older_than.is_none_or(|d| age >= d.as_millis() as i64)
            && self.newer_than.is_none_or(|d| age < d.as_millis() as i64)
    }

    /// Whether a dead job matches: age at `now_ms`, reason, route and schedule.
    pub fn matches(&self, now_ms: i64, job: &DeadJob) -> bool {
        self.admits_age(now_ms, job.died_ms)
            && self.reason_matches(&job.reason)
            && self
                .route
                .as_ref()
                .is_none_or(|r| job.route.as_ref() == Some(r))
            && self
                .schedule
                .as_ref()
                .is_none_or(|s| job.schedule.as_ref() == Some(s))
    }

    fn reason_matches(&self, reason: &str) -> bool {
        self.reason
            .as_ref()
            .is_none_or(|part| reason.to_lowercase().contains(&part.to_lowercase()))
    }
}

/// An age as the dead-letter filters take it (`--older-than`, `older_than=`): a duration
/// such as `30s`, `15m`, `2h`, `7days` (humantime).
pub fn parse_age(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not an age: {e} (expected e.g. 30s, 15m, 2h, 7days)"))
}

/// Which dead jobs a replay or purge takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadSelection {
    /// These ids (for a raw source: member ids as [`DeadMember::id`] gives them), whatever
    /// their score.
    Ids(Vec<String>),
    /// Every job the filter admits among those dead when the call starts (the empty filter:
    /// every one).
    Matching(DeadFilter),
    /// At most this many of the jobs `Matching` would take, the oldest of each shard first
    /// (a bounded request; call again for more).
    AtMost(DeadFilter, usize),
}

impl DeadSelection {
    /// The filter and the most to take, for a selection by filter.
    fn by_filter(&self) -> Option<(&DeadFilter, usize)> {
        match self {
            DeadSelection::Ids(_) => None,
            DeadSelection::Matching(filter) => Some((filter, usize::MAX)),
            DeadSelection::AtMost(filter, n) => Some((filter, *n)),
        }
    }
}

/// How a replay makes jobs due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayOptions {
    /// When they are due again; `Due::In` is measured from Redis's clock when the call
    /// starts, and every replayed job gets the same due time.
    pub due: Due,
    /// Keep the envelope's attempt count instead of resetting it to 0 (a job that gave up
    /// then gets a single try before it dies again).
    pub keep_attempts: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            due: Due::In(Duration::ZERO),
            keep_attempts: false,
        }
    }
}

/// Where a bulk operation is, for a progress display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadProgress {
    /// Reading the dead set: `scanned` entries looked at, `selected` of them taken.
    Selecting { scanned: u64, selected: u64 },
    /// Acting on the selection: `done` of `total`.
    Acting { done: u64, total: u64 },
}

/// What a purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Purged {
    pub purged: u64,
    /// Ids no longer dead, or dead again since they were selected: left as they are.
    pub skipped: u64,
    /// History entries of jobs no longer stored, dropped on the way.
    pub history_pruned: u64,
}

/// What a bounded listing found: at most its limit, and whether it read every candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Bounded<T> {
    pub items: Vec<T>,
    /// False when the scan bound stopped the reading before the limit was reached: more may
    /// match.
    pub complete: bool,
}

/// A dead envelope job, as `dead list` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadJob {
    pub id: String,
    pub shard: u16,
    /// The route lane that holds it (storage layout 2; `shard` is then 0, and the JSON form
    /// has `lane` instead of `shard`).
    pub lane: Option<u32>,
    pub died_ms: i64,
    pub reason: String,
    /// The envelope's `dest`; `None` when the envelope is missing or malformed.
    pub route: Option<String>,
    /// Failed delivery attempts recorded in the envelope.
    pub attempt: u32,
    pub max_attempts: Option<u32>,
    pub last_error: Option<String>,
    /// The envelope meta's `schedule`.
    pub schedule: Option<String>,
    /// Payload bytes; `None` when the envelope is missing or malformed.
    pub payload_size: Option<u64>,
    /// Deaths before the current one that history keeps (it was replayed and died again).
    pub earlier_deaths: usize,
    /// Why the envelope cannot be read: missing (an orphan: nothing to replay) or malformed.
    pub envelope_error: Option<String>,
    /// The dead score it was read with (a bulk operation acts on it only while it has it).
    score: f64,
    /// The id its home stores it under (a lane stores a generated id without `~<lane>.`).
    stored: String,
}

impl serde::Serialize for DeadJob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("id", &self.id)?;
        match self.lane {
            Some(lane) => m.serialize_entry("lane", &crate::lane_id::base36(lane))?,
            None => m.serialize_entry("shard", &self.shard)?,
        }
        m.serialize_entry("died_ms", &self.died_ms)?;
        m.serialize_entry("reason", &self.reason)?;
        m.serialize_entry("route", &self.route)?;
        m.serialize_entry("attempt", &self.attempt)?;
        m.serialize_entry("max_attempts", &self.max_attempts)?;
        m.serialize_entry("last_error", &self.last_error)?;
        m.serialize_entry("schedule", &self.schedule)?;
        m.serialize_entry("payload_size", &self.payload_size)?;
        m.serialize_entry("earlier_deaths", &self.earlier_deaths)?;
        m.serialize_entry("envelope_error", &self.envelope_error)?;
        m.end()
    }
}

/// Payload bytes `dead show` and the console's detail views read at most.
pub const PREVIEW_BYTES: usize = 2048;

/// Member bytes a dead raw member's listing entry carries at most.
pub const LIST_PREVIEW_BYTES: usize = 200;

/// Dead members a lookup by an id without its death time (the form before ids carried it)
/// walks at most.
pub const OLD_ID_SCAN: usize = 10_000;

/// A dead envelope job with everything `dead show` prints.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadJobDetail {
    pub job: DeadJob,
    pub headers: BTreeMap<String, String>,
    /// The payload's first [`PREVIEW_BYTES`] at most (empty when the envelope is missing or
    /// malformed); `job.payload_size` is its whole size.
    pub payload: Vec<u8>,
    /// Earlier deaths, oldest first (the current one is `job.died_ms` / `job.reason`).
    pub history: Vec<Death>,
}

impl DeadJobDetail {
    /// The JSON form (`dead show --json`, the console's `GET /api/dead/{id}`): the job's
    /// fields, headers, history, and the first `preview` bytes of the payload
    /// ([`payload_preview`]).
    pub fn to_json(&self, preview: usize) -> serde_json::Value {
        let mut v = serde_json::to_value(&self.job).expect("a dead job serializes");
        let total = self.job.payload_size.unwrap_or(self.payload.len() as u64);
        let p = payload_preview(&self.payload, preview, total);
        v["headers"] = serde_json::to_value(&self.headers).expect("headers serialize");
        v["payload_preview"] = p.text.into();
        v["payload_encoding"] = p.encoding.into();
        v["payload_truncated"] = p.truncated.into();
        v["history"] = serde_json::to_value(&self.history).expect("deaths serialize");
        v
    }
}

/// A dead member of a raw source, as far as a listing or a show reads it: never more of
/// the member than a preview.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadMember {
    /// The member's hash ([`member_hash`]).
    pub hash: String,
    pub died_ms: i64,
    pub reason: String,
    /// The member's size in bytes.
    pub size: u64,
    /// Its first bytes: [`LIST_PREVIEW_BYTES`] in a listing, [`PREVIEW_BYTES`] in a show.
    pub preview: Vec<u8>,
}

impl DeadMember {
    /// Its id, `<died ms>-<hash>`: what finds it without a scan (its death time and hash).
    pub fn id(&self) -> String {
        format!("{}-{}", self.died_ms, self.hash)
    }

    /// The message id it was published with, `<source>:<SHA-1 prefix>`; `None` for a member
    /// over 1 MiB, whose hash is not its SHA-1's ([`member_hash`]).
    pub fn message_id(&self, source: &str) -> Option<String> {
        (self.size <= HASH_WHOLE as u64).then(|| format!("{source}:{}", self.hash))
    }

    /// The listing's JSON form (`dead list --json`, `GET /api/dead`).
    pub fn to_json(&self, source: &str) -> serde_json::Value {
        self.detail_json(source, LIST_PREVIEW_BYTES)
    }

    /// The detail's JSON form (`dead show --source --json`, `GET /api/dead/{id}?source=`):
    /// the first `preview` bytes of the member.
    pub fn detail_json(&self, source: &str, preview: usize) -> serde_json::Value {
        let p = payload_preview(&self.preview, preview, self.size);
        serde_json::json!({
            "source": source,
            "id": self.id(),
            "message_id": self.message_id(source),
            "died_ms": self.died_ms,
            "reason": self.reason,
            "payload_size": self.size,
            "payload_preview": p.text,
            "payload_encoding": p.encoding,
            "payload_truncated": p.truncated,
        })
    }
}

/// The start of a payload as JSON carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadPreview {
    /// UTF-8 text when the bytes are (cut at a character boundary), else base64.
    pub text: String,
    /// `utf8` or `base64`, as `zdelay get` chooses it.
    pub encoding: String,
    /// Whether the payload is longer than what `text` holds.
    pub truncated: bool,
}

/// The first `max` bytes of a payload of `total` bytes whose first bytes are `start`: text
/// (fewer bytes, to end on a whole character) when they are UTF-8, else base64.
pub fn payload_preview(start: &[u8], max: usize, total: u64) -> PayloadPreview {
    let mut cut = start.len().min(max);
    if let Err(e) = std::str::from_utf8(&start[..cut])
        && e.error_len().is_none()
        && (cut as u64) < total
    {
        // Text whose last character was cut (not a whole payload ending mid-character).
        cut = e.valid_up_to();
    }
    let mut view = Envelope::new("-", start[..cut].to_vec()).to_json();
    let text = |v: Option<serde_json::Value>| match v {
        Some(serde_json::Value::String(s)) => s,
        _ => String::new(),
    };
    PayloadPreview {
        text: text(view.remove("payload")),
        encoding: text(view.remove("payload_encoding")),
        truncated: (cut as u64) < total,
    }
}

/// A raw member's message id tail: the first 16 hex digits of its SHA-1 (its message id is
/// `<source>:<this>`).
pub fn member_id(member: &[u8]) -> String {
    let mut hex = sha1_smol::Sha1::from(member).digest().to_string();
    hex.truncate(16);
    hex
}

/// Members up to this size are known by the SHA-1 of all of them (`walk_raw_dead.lua`'s
/// `HASH_WHOLE`).
const HASH_WHOLE: usize = 1 << 20;

/// Bytes of each end of a larger member that its hash covers (`walk_raw_dead.lua`'s `EDGE`).
const HASH_EDGE: usize = 64 << 10;

/// A dead raw member's hash, as `walk_raw_dead` computes it: [`member_id`] for a member of
/// at most 1 MiB; above, the first 16 hex digits of SHA-1 of `"<size>:"`, its first 64 KiB
/// and its last 64 KiB — so a huge member costs its copy, not a hash of all of it.
pub fn member_hash(member: &[u8]) -> String {
    if member.len() <= HASH_WHOLE {
        return member_id(member);
    }
    let mut sha = sha1_smol::Sha1::new();
    sha.update(format!("{}:", member.len()).as_bytes());
    sha.update(&member[..HASH_EDGE]);
    sha.update(&member[member.len() - HASH_EDGE..]);
    let mut hex = sha.digest().to_string();
    hex.truncate(16);
    hex
}

/// A raw member id as a user gives it: `<died ms>-<hash>` (what `dead list` prints), or the
/// hash alone (the older form, found by a bounded scan), optionally as `<source>:<id>`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MemberId {
    died_ms: Option<i64>,
    hash: String,
}

fn parse_member_id(source: &str, given: &str) -> Result<MemberId, ClientError> {
    let id = given
        .strip_prefix(source)
        .and_then(|rest| rest.strip_prefix(':'))
        .unwrap_or(given)
        .to_ascii_lowercase();
    let (died_ms, hash) = match id.split_once('-') {
        Some((ms, hash)) => (ms.parse::<i64>().ok().map(Some), hash),
        None => (Some(None), id.as_str()),
    };
    match died_ms {
        Some(died_ms) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Ok(MemberId {
                died_ms,
                hash: hash.to_owned(),
            })
        }
        _ => Err(ClientError::InvalidSelection(format!(
            "{given:?} is not a raw member id of {source}: expected <died ms>-<16 hex digits>, \
             as `dead list` prints it, optionally as {source}:<id>"
        ))),
    }
}

/// The answer when an id without its death time was not found within [`OLD_ID_SCAN`]
/// members.
fn old_id_not_found(source: &str, hashes: &[String]) -> ClientError {
    ClientError::InvalidSelection(format!(
        "no dead member of {source} with the id {} among its oldest {OLD_ID_SCAN}: an id \
         without its death time is looked for that far only; give it as `dead list` prints \
         it now, <died ms>-<id>, which is found directly",
        hashes.join(", ")
    ))
}

/// A dead job and its envelope as far as a peek read it (the payload: its first bytes),
/// stored where the peek's id says; `None` when it is not dead. Its home sets where.
fn dead_detail(peek: DeadPeek) -> Option<(DeadJob, Option<Result<Envelope, EnvelopeError>>)> {
    let score = peek.died?;
    let (envelope, payload_size) = read_envelope(peek.envelope);
    let job = describe(
        peek.id,
        score,
        peek.reason,
        &peek.history,
        envelope.as_ref(),
        payload_size,
    );
    Some((job, envelope))
}

fn describe(
    id: String,
    score: f64,
    reason: String,
    history: &str,
    envelope: Option<&Result<Envelope, EnvelopeError>>,
    payload_size: Option<u64>,
) -> DeadJob {
    let mut job = DeadJob {
        stored: id.clone(),
        id,
        shard: 0,
        lane: None,
        died_ms: score as i64,
        reason,
        route: None,
        attempt: 0,
        max_attempts: None,
        last_error: None,
        schedule: None,
        payload_size: None,
        earlier_deaths: parse_history(history).len(),
        envelope_error: None,
        score,
    };
    match envelope {
        None => job.envelope_error = Some("no envelope stored for this id".to_owned()),
        Some(Err(e)) => job.envelope_error = Some(e.to_string()),
        Some(Ok(env)) => {
            job.route = Some(env.dest.clone());
            job.attempt = env.meta.attempt;
            job.max_attempts = env.meta.max_attempts;
            job.last_error = env.meta.last_error.clone();
            job.schedule = env.meta.schedule.clone();
            job.payload_size = payload_size;
        }
    }
    job
}

/// The ids to act on, per home (by its number), each stored id with the dead score it was
/// selected with.
type Selected = BTreeMap<(u8, u32), Vec<(String, Option<f64>)>>;

/// Where dead jobs are kept, by number.
type Homes = BTreeMap<(u8, u32), Home>;

impl Operator {
    /// The homes of dead jobs: the shards of `layout`, or on storage layout 2 the route lanes
    /// as the registry names them now.
    async fn dead_homes(&self, layout: &Keys) -> Result<Homes, ClientError> {
        let homes = self.homes(layout).await?;
        Ok(homes.into_iter().map(|h| (h.key(), h)).collect())
    }

    /// The oldest dead jobs, at most `limit` per shard (per route lane on layout 2), oldest
    /// first.
    pub async fn dead_list(&self, limit: usize) -> Result<Vec<DeadJob>, ClientError> {
        self.dead_jobs(&DeadFilter::default(), limit).await
    }

    /// The oldest dead jobs the filter admits, at most `limit` per shard (per route lane on
    /// layout 2), oldest first.
    pub async fn dead_jobs(
        &self,
        filter: &DeadFilter,
        limit: usize,
    ) -> Result<Vec<DeadJob>, ClientError> {
        Ok(self
            .dead_jobs_bounded(filter, limit, usize::MAX)
            .await?
            .items)
    }

    /// Like [`Client::dead_jobs`], reading at most `scan` dead entries per shard or lane
    /// (oldest first, in the filter's age window): a filter on reason, route or schedule that
    /// matches little cannot make the call read a whole dead set. `complete` is false when a
    /// shard had more to read.
    pub async fn dead_jobs_bounded(
        &self,
        filter: &DeadFilter,
        limit: usize,
        scan: usize,
    ) -> Result<Bounded<DeadJob>, ClientError> {
        filter.check()?;
        self.fenced_by_layout("the dead letters", |layout| {
            self.dead_jobs_in(layout, filter, limit, scan)
        })
        .await
    }

    async fn dead_jobs_in(
        &self,
        layout: Keys,
        filter: &DeadFilter,
        limit: usize,
        scan: usize,
    ) -> Result<Bounded<DeadJob>, ClientError> {
        let homes = self.dead_homes(&layout).await?;
        let mut con = self.con.clone();
        let now_ms = con.now_ms().await?;
        let (min, max) = filter.score_range(now_ms);
        let page = filter.page_size(limit);
        let mut out = Bounded {
            items: Vec::new(),
            complete: true,
        };
        for home in homes.values().filter(|h| filter.may_be_in(h)) {
            let mut found = 0;
            let mut offset = 0;
            while found < limit {
                if offset >= scan {
                    out.complete = false;
                    break;
                }
                let count = page.min(scan - offset);
                let entries =
                    dead_page(&mut con, home.dead_key(), &min, &max, offset, count).await?;
                offset += entries.len();
                let ids: Vec<String> = entries.iter().map(|(m, _)| lossy(m)).collect();
                for peek in home.peek(&mut con, &ids, 0).await? {
                    if let Some(job) = home.job(peek)
                        && found < limit
                        && filter.matches(now_ms, &job)
                    {
                        out.items.push(job);
                        found += 1;
                    }
                }
                if entries.len() < count {
                    break;
                }
            }
        }
        out.items.sort_by(|a, b| {
            (a.died_ms, a.shard, a.lane, &a.id).cmp(&(b.died_ms, b.shard, b.lane, &b.id))
        });
        Ok(out)
    }

    /// Dead entries per shard (`ZCARD`), in shard order; on layout 2 per route lane, in lane
    /// order.
    pub async fn dead_counts(&self) -> Result<Vec<u64>, ClientError> {
        let homes = self.dead_homes(&self.keys()).await?;
        let mut pipe = redis::pipe();
        for home in homes.values() {
            pipe.zcard(home.dead_key());
        }
        Ok(pipe.query_async(&mut self.con.clone()).await?)
    }

    /// One dead job with its envelope's meta, history and the first [`PREVIEW_BYTES`] of
    /// its payload (never more: the payload is cut inside Redis); `None` when `id` is not
    /// dead.
    pub async fn dead_show(&self, id: &str) -> Result<Option<DeadJobDetail>, ClientError> {
        self.dead_show_at(None, id).await
    }

    /// [`Client::dead_show`] of the job `id` of destination `dest` (see
    /// [`Client::cancel_in`]), or by id alone when `dest` is `None`.
    pub async fn dead_show_at(
        &self,
        dest: Option<&str>,
        id: &str,
    ) -> Result<Option<DeadJobDetail>, ClientError> {
        self.fenced_by_layout("the dead letters", |layout| {
            self.dead_show_in(layout, dest, id)
        })
        .await
    }

    async fn dead_show_in(
        &self,
        layout: Keys,
        dest: Option<&str>,
        id: &str,
    ) -> Result<Option<DeadJobDetail>, ClientError> {
        let Some((home, stored)) = self.dead_home_of(&layout, dest, id).await? else {
            return Ok(None);
        };
        let mut con = self.con.clone();
        let Some(peek) = home.peek(&mut con, &[stored], PREVIEW_BYTES).await?.pop() else {
            return Ok(None);
        };
        let history = parse_history(&peek.history);
        let Some((job, envelope)) = home.detail(peek) else {
            return Ok(None);
        };
        let (headers, payload) = match envelope {
            Some(Ok(env)) => (env.meta.headers, env.payload),
            _ => (BTreeMap::new(), Vec::new()),
        };
        Ok(Some(DeadJobDetail {
            job,
            headers,
            payload,
            history,
        }))
    }

    /// Where the dead job `id` is kept and its stored id there: its shard on layout 1; on
    /// layout 2 the lane its generated id names, or the one lane or spread shard whose dead
    /// set holds a user-chosen id (`AmbiguousId` when several do). `None`: none holds it.
    async fn dead_home_of(
        &self,
        layout: &Keys,
        dest: Option<&str>,
        id: &str,
    ) -> Result<Option<(Home, String)>, ClientError> {
        let in_shard = || {
            let keys = layout.shard(layout.shard_of(id));
            Some((Home::Shard(keys), id.to_owned()))
        };
        Ok(
            match self
                .place_of(self.lane_book(), dest, id, Held::Dead)
                .await?
            {
                Found::Shard => in_shard(),
                Found::Lane(lane, stored) => Some((Home::Lane(lane), stored)),
                Found::Nowhere => None,
            },
        )
    }

    /// Makes dead jobs due now, resetting their attempt counts: the given ids, or, when
    /// `ids` is empty, every job that was dead when the call started.
    pub async fn dead_replay(&self, ids: &[String]) -> Result<Replayed, ClientError> {
        let selection = if ids.is_empty() {
            DeadSelection::Matching(DeadFilter::default())
        } else {
            DeadSelection::Ids(ids.to_vec())
        };
        self.dead_replay_selected(&selection, ReplayOptions::default(), |_| {})
            .await
    }

    /// Replays the selected dead jobs as `options` says, reporting progress. Then drops the
    /// history of jobs no longer stored.
    pub async fn dead_replay_selected(
        &self,
        selection: &DeadSelection,
        options: ReplayOptions,
        progress: impl FnMut(DeadProgress) + Send,
    ) -> Result<Replayed, ClientError> {
        let progress = Mutex::new(progress);
        self.fenced_by_layout("the dead letters", |layout| {
            self.dead_replay_in(layout, selection, options, &progress)
        })
        .await
    }

    async fn dead_replay_in(
        &self,
        layout: Keys,
        selection: &DeadSelection,
        options: ReplayOptions,
        progress: &Mutex<impl FnMut(DeadProgress) + Send>,
    ) -> Result<Replayed, ClientError> {
        let progress = |p| (progress.lock().expect("progress lock"))(p);
        let mut con = self.con.clone();
        let now_ms = con.now_ms().await?;
        let due = Due::At(due_ms(options.due, now_ms));
        let mut homes = self.dead_homes(&layout).await?;
        let (selected, unknown) = self
            .select_dead(&mut con, &layout, &mut homes, selection, now_ms, progress)
            .await?;
        let total = selected.values().map(|ids| ids.len() as u64).sum();
        let mut done = 0;
        let mut out = Replayed {
            skipped: unknown,
            ..Replayed::default()
        };
        let wake = layout.wake_channel();
        progress(DeadProgress::Acting { done, total });
        for (number, ids) in selected {
            let home = &homes[&number];
            for chunk in ids.chunks(DEAD_CHUNK) {
                let r = home
                    .replay(
                        &mut con,
                        &wake,
                        due,
                        !options.keep_attempts,
                        HISTORY_CAP,
                        chunk,
                    )
                    .await?;
                out.add(r);
                done += chunk.len() as u64;
                progress(DeadProgress::Acting { done, total });
            }
        }
        if selection.by_filter().is_some() {
            out.history_pruned = self.prune_histories(&mut con, &homes).await?;
        }
        Ok(out)
    }

    /// Deletes dead jobs: the given ids, or every job that was dead when the call started.
    pub async fn dead_purge(&self, ids: &[String]) -> Result<u64, ClientError> {
        let selection = if ids.is_empty() {
            DeadSelection::Matching(DeadFilter::default())
        } else {
            DeadSelection::Ids(ids.to_vec())
        };
        Ok(self.dead_purge_selected(&selection, |_| {}).await?.purged)
    }

    /// Deletes the selected dead jobs (envelope, reason, history), reporting progress. Then
    /// drops the history of jobs no longer stored.
    pub async fn dead_purge_selected(
        &self,
        selection: &DeadSelection,
        progress: impl FnMut(DeadProgress) + Send,
    ) -> Result<Purged, ClientError> {
        let progress = Mutex::new(progress);
        self.fenced_by_layout("the dead letters", |layout| {
            self.dead_purge_in(layout, selection, &progress)
        })
        .await
    }

    async fn dead_purge_in(
        &self,
        layout: Keys,
        selection: &DeadSelection,
        progress: &Mutex<impl FnMut(DeadProgress) + Send>,
    ) -> Result<Purged, ClientError> {
        let progress = |p| (progress.lock().expect("progress lock"))(p);
        let mut con = self.con.clone();
        let now_ms = con.now_ms().await?;
        let mut homes = self.dead_homes(&layout).await?;
        let (selected, unknown) = self
            .select_dead(&mut con, &layout, &mut homes, selection, now_ms, progress)
            .await?;
        let total = selected.values().map(|ids| ids.len() as u64).sum();
        let mut done = 0;
        let mut out = Purged {
            skipped: unknown,
            ..Purged::default()
        };
        progress(DeadProgress::Acting { done, total });
        for (number, ids) in selected {
            let home = &homes[&number];
            for chunk in ids.chunks(DEAD_CHUNK) {
                let (purged, skipped) = home.purge(&mut con, chunk).await?;
                out.purged += purged;
                out.skipped += skipped;
                done += chunk.len() as u64;
                progress(DeadProgress::Acting { done, total });
            }
        }
        if selection.by_filter().is_some() {
            out.history_pruned = self.prune_histories(&mut con, &homes).await?;
        }
        Ok(out)
    }

    /// The selected stored ids per home: given ids without a score, or what the filter admits
    /// now, each with the dead score it had; and how many given ids no lane holds (layout 2:
    /// skipped, as a script skips an id that is not dead).
    async fn select_dead(
        &self,
        con: &mut Conn,
        layout: &Keys,
        homes: &mut Homes,
        selection: &DeadSelection,
        now_ms: i64,
        progress: impl Fn(DeadProgress),
    ) -> Result<(Selected, u64), ClientError> {
        let mut out: Selected = BTreeMap::new();
        let Some((filter, most)) = selection.by_filter() else {
            let mut unknown = 0;
            if let DeadSelection::Ids(ids) = selection {
                // The scripts that act on them check each shard's layout marker (each lane's).
                for id in ids {
                    let Some((home, stored)) = self.dead_home_of(layout, None, id).await? else {
                        unknown += 1;
                        continue;
                    };
                    out.entry(home.key()).or_default().push((stored, None));
                    // A lane registered since the homes were read.
                    homes.entry(home.key()).or_insert(home);
                }
            }
            return Ok((out, unknown));
        };
        filter.check()?;
        // Read before any script runs: a namespace resharded away from this layout may hold
        // its dead jobs in shards the layout does not have.
        let (min, max) = filter.score_range(now_ms);
        let (mut scanned, mut selected) = (0u64, 0u64);
        'homes: for home in homes.values().filter(|h| filter.may_be_in(h)) {
            let mut offset = 0;
            loop {
                let entries = dead_page(con, home.dead_key(), &min, &max, offset, PAGE).await?;
                offset += entries.len();
                scanned += entries.len() as u64;
                let ids: Vec<String> = entries.iter().map(|(m, _)| lossy(m)).collect();
                let mut taken: Vec<(String, Option<f64>)> = if filter.reads_content() {
                    home.peek(con, &ids, 0)
                        .await?
                        .into_iter()
                        .filter_map(|peek| home.job(peek))
                        .filter(|job| filter.matches(now_ms, job))
                        .map(|job| (job.stored, Some(job.score)))
                        .collect()
                } else {
                    ids.into_iter()
                        .zip(entries.iter().map(|(_, score)| Some(*score)))
                        .collect()
                };
                taken.truncate(most.saturating_sub(selected as usize));
                selected += taken.len() as u64;
                if !taken.is_empty() {
                    out.entry(home.key()).or_default().extend(taken);
                }
                progress(DeadProgress::Selecting { scanned, selected });
                if selected as usize >= most {
                    break 'homes;
                }
                if entries.len() < PAGE {
                    break;
                }
            }
        }
        Ok((out, 0))
    }

    /// Drops the history of every id no longer stored, in every home; returns how many.
    async fn prune_histories(&self, con: &mut Conn, homes: &Homes) -> Result<u64, ClientError> {
        let mut pruned = 0;
        for home in homes.values() {
            let mut cursor = "0".to_owned();
            loop {
                let (next, fields): (String, Vec<Vec<u8>>) = redis::cmd("HSCAN")
                    .arg(home.history_key())
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(PAGE)
                    .query_async(con)
                    .await?;
                // HSCAN answers field, value, field, value…
                let ids: Vec<String> = fields.iter().step_by(2).map(|f| lossy(f)).collect();
                pruned += home.prune_history(con, &ids).await?;
                if next == "0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(pruned)
    }

    /// The oldest dead members of a raw source.
    pub async fn raw_dead_list(
        &self,
        source: &SourceConfig,
        limit: usize,
    ) -> Result<Vec<DeadMember>, ClientError> {
        self.raw_dead_members(source, &DeadFilter::default(), limit)
            .await
    }

    /// The oldest dead members of a raw source that the filter admits (age and reason:
    /// route and schedule are refused, raw members have no envelope), each with its first
    /// [`LIST_PREVIEW_BYTES`].
    pub async fn raw_dead_members(
        &self,
        source: &SourceConfig,
        filter: &DeadFilter,
        limit: usize,
    ) -> Result<Vec<DeadMember>, ClientError> {
        Ok(self
            .raw_dead_members_bounded(source, filter, limit, usize::MAX)
            .await?
            .items)
    }

    /// Like [`Client::raw_dead_members`], walking at most `scan` dead members of the
    /// source; `complete` is false when it had more to walk. Each call to Redis reads at
    /// most [`scripts::RAW_WALK_BUDGET`] of members (or one member, if larger) and answers
    /// [`LIST_PREVIEW_BYTES`] of each.
    pub async fn raw_dead_members_bounded(
        &self,
        source: &SourceConfig,
        filter: &DeadFilter,
        limit: usize,
        scan: usize,
    ) -> Result<Bounded<DeadMember>, ClientError> {
        check_raw_filter(filter)?;
        filter.check()?;
        let mut con = self.con.clone();
        let keys = source.keys();
        let now_ms = con.now_ms().await?;
        let (min, max) = filter.score_range(now_ms);
        let mut out = Bounded {
            items: Vec::new(),
            complete: true,
        };
        let (mut offset, mut walked) = (0, 0);
        while out.items.len() < limit {
            if walked >= scan {
                out.complete = false;
                break;
            }
            let range = RawDeadRange {
                min: &min,
                max: &max,
                offset,
                take: limit - out.items.len(),
                walk: RAW_WALK.min(scan - walked),
                reason: filter.reason.as_deref().unwrap_or(""),
                hashes: &[],
            };
            let mode = RawDeadWalk::List {
                preview: LIST_PREVIEW_BYTES,
            };
            let w = scripts::walk_raw_dead(&mut con, &keys, mode, &range).await?;
            walked += w.walked as usize;
            out.items.extend(w.listed.into_iter().map(dead_member));
            match w.next_offset {
                Some(next) => offset = next,
                None => break,
            }
        }
        Ok(out)
    }

    /// One dead member of a raw source by its id ([`DeadMember::id`], or `<source>:<id>`),
    /// with its first [`PREVIEW_BYTES`]; `None` when no dead member has it. The id's death
    /// time finds it directly; an id without one (the older form) is looked for among the
    /// oldest [`OLD_ID_SCAN`] members only (an error says so when it is not among them).
    pub async fn raw_dead_show(
        &self,
        source: &SourceConfig,
        id: &str,
    ) -> Result<Option<DeadMember>, ClientError> {
        let wanted = parse_member_id(&source.key, id)?;
        let mut con = self.con.clone();
        let mode = RawDeadWalk::List {
            preview: PREVIEW_BYTES,
        };
        let (mut listed, _) = raw_dead_by_ids(&mut con, source, &[wanted], mode).await?;
        Ok(listed.pop().map(dead_member))
    }

    /// Puts every member that was dead when the call started back into its source, due now.
    pub async fn raw_dead_replay(&self, source: &SourceConfig) -> Result<u64, ClientError> {
        let all = DeadSelection::Matching(DeadFilter::default());
        let r = self
            .raw_dead_replay_selected(source, &all, Due::In(Duration::ZERO), |_| {})
            .await?;
        Ok(r.replayed)
    }

    /// Puts the selected dead members back into their source, due at `due` (`Due::In` from
    /// Redis's clock when the call starts), reporting progress.
    pub async fn raw_dead_replay_selected(
        &self,
        source: &SourceConfig,
        selection: &DeadSelection,
        due: Due,
        progress: impl FnMut(DeadProgress) + Send,
    ) -> Result<Replayed, ClientError> {
        let mut con = self.con.clone();
        let now_ms = con.now_ms().await?;
        let due_ms = due_ms(due, now_ms);
        let score = match source.score_unit {
            ScoreUnit::Millis => due_ms.to_string(),
            ScoreUnit::Seconds => format!("{:.3}", due_ms as f64 / 1000.0),
        };
        let mode = RawDeadWalk::Replay { score: &score };
        let (taken, skipped) =
            raw_dead_act(&mut con, source, selection, mode, now_ms, progress).await?;
        Ok(Replayed {
            replayed: taken,
            skipped,
            due_ms: (taken > 0).then_some(due_ms),
            ..Replayed::default()
        })
    }

    /// Deletes every member of a raw source that was dead when the call started.
    pub async fn raw_dead_purge(&self, source: &SourceConfig) -> Result<u64, ClientError> {
        let all = DeadSelection::Matching(DeadFilter::default());
        Ok(self
            .raw_dead_purge_selected(source, &all, |_| {})
            .await?
            .purged)
    }

    /// Deletes the selected dead members of a raw source, reporting progress.
    pub async fn raw_dead_purge_selected(
        &self,
        source: &SourceConfig,
        selection: &DeadSelection,
        progress: impl FnMut(DeadProgress) + Send,
    ) -> Result<Purged, ClientError> {
        let mut con = self.con.clone();
        let now_ms = con.now_ms().await?;
        let (purged, skipped) = raw_dead_act(
            &mut con,
            source,
            selection,
            RawDeadWalk::Purge,
            now_ms,
            progress,
        )
        .await?;
        Ok(Purged {
            purged,
            skipped,
            history_pruned: 0,
        })
    }
}

/// A listed dead raw member.
fn dead_member(entry: scripts::RawDeadEntry) -> DeadMember {
    DeadMember {
        hash: entry.hash,
        died_ms: entry.score.floor() as i64,
        reason: entry.reason,
        size: entry.size,
        preview: entry.start,
    }
}

/// Replays or purges (`mode`) the selected dead members of a raw source: by filter, walking
/// the age window (at most the selection's count); by ids, each at its death time. Members
/// never leave Redis: the script finds and moves them. Returns (taken, ids not found).
async fn raw_dead_act(
    con: &mut Conn,
    source: &SourceConfig,
    selection: &DeadSelection,
    mode: RawDeadWalk<'_>,
    now_ms: i64,
    mut progress: impl FnMut(DeadProgress) + Send,
) -> Result<(u64, u64), ClientError> {
    let Some((filter, most)) = selection.by_filter() else {
        let DeadSelection::Ids(given) = selection else {
            return Ok((0, 0));
        };
        let ids = given
            .iter()
            .map(|id| parse_member_id(&source.key, id))
            .collect::<Result<Vec<_>, _>>()?;
        let (_, taken) = raw_dead_by_ids(con, source, &ids, mode).await?;
        return Ok((taken, (ids.len() as u64).saturating_sub(taken)));
    };
    check_raw_filter(filter)?;
    filter.check()?;
    let keys = source.keys();
    let (min, max) = filter.score_range(now_ms);
    let (mut offset, mut walked, mut taken) = (0, 0u64, 0u64);
    while (taken as usize) < most {
        let range = RawDeadRange {
            min: &min,
            max: &max,
            offset,
            take: DEAD_CHUNK.min(most - taken as usize),
            walk: RAW_WALK,
            reason: filter.reason.as_deref().unwrap_or(""),
            hashes: &[],
        };
        let w = scripts::walk_raw_dead(con, &keys, mode, &range).await?;
        walked += w.walked;
        taken += w.taken;
        progress(DeadProgress::Selecting {
            scanned: walked,
            selected: taken,
        });
        match w.next_offset {
            Some(next) => offset = next,
            None => break,
        }
    }
    Ok((taken, 0))
}

/// Walks a raw source's dead members for these ids in `mode`: an id with its death time
/// where it died (the members of that millisecond), the others among the oldest
/// [`OLD_ID_SCAN`] (an error when the walk stopped there with some not found). Returns what
/// was listed and how many were taken.
async fn raw_dead_by_ids(
    con: &mut Conn,
    source: &SourceConfig,
    ids: &[MemberId],
    mode: RawDeadWalk<'_>,
) -> Result<(Vec<scripts::RawDeadEntry>, u64), ClientError> {
    let keys = source.keys();
    let mut by_death: BTreeMap<Option<i64>, Vec<String>> = BTreeMap::new();
    for id in ids {
        by_death
            .entry(id.died_ms)
            .or_default()
            .push(id.hash.clone());
    }
    let (mut listed, mut taken) = (Vec::new(), 0);
    for (died_ms, hashes) in by_death {
        let (min, max, scan) = match died_ms {
            Some(ms) => (
                ms.to_string(),
                format!("({}", ms.saturating_add(1)),
                usize::MAX,
            ),
            None => ("-inf".to_owned(), "+inf".to_owned(), OLD_ID_SCAN),
        };
        let (mut offset, mut walked, mut found) = (0, 0, 0);
        while found < hashes.len() {
            if walked >= scan {
                return Err(old_id_not_found(&source.key, &hashes));
            }
            let range = RawDeadRange {
                min: &min,
                max: &max,
                offset,
                take: hashes.len() - found,
                walk: RAW_WALK.min(scan - walked),
                reason: "",
                hashes: &hashes,
            };
            let w = scripts::walk_raw_dead(con, &keys, mode, &range).await?;
            walked += w.walked as usize;
            found += w.taken as usize;
            listed.extend(w.listed);
            match w.next_offset {
                Some(next) => offset = next,
                None => break,
            }
        }
        taken += found as u64;
    }
    Ok((listed, taken))
}

/// `Due` as epoch ms, `Due::In` counted from `now_ms` (Redis's clock).
fn due_ms(due: Due, now_ms: i64) -> i64 {
    match due {
        Due::At(ms) => ms,
        Due::In(d) => now_ms + d.as_millis() as i64,
    }
}

/// Route and schedule read the envelope: raw members have none.
fn check_raw_filter(filter: &DeadFilter) -> Result<(), ClientError> {
    match filter.envelope_only().as_slice() {
        [] => Ok(()),
        names => Err(ClientError::InvalidSelection(format!(
            "{} does not apply to raw members: they have no envelope (a raw source delivers \
             to its one configured route); use --reason, --older-than or --newer-than",
            names.join(" and ")
        ))),
    }
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// One page of a dead ZSET in death order, scores in `[min, max]` (ZRANGEBYSCORE bounds).
async fn dead_page(
    con: &mut Conn,
    key: &str,
    min: &str,
    max: &str,
    offset: usize,
    count: usize,
) -> redis::RedisResult<Vec<(Vec<u8>, f64)>> {
    redis::cmd("ZRANGEBYSCORE")
        .arg(key)
        .arg(min)
        .arg(max)
        .arg("WITHSCORES")
        .arg("LIMIT")
        .arg(offset)
        .arg(count)
        .query_async(con)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::scripts::EnvelopeHead;

    fn job(died_ms: i64, reason: &str, route: Option<&str>, schedule: Option<&str>) -> DeadJob {
        DeadJob {
            id: "j".into(),
            shard: 0,
            died_ms,
            reason: reason.into(),
            route: route.map(str::to_owned),
            attempt: 0,
            max_attempts: None,
            last_error: None,
            schedule: schedule.map(str::to_owned),
            payload_size: None,
            earlier_deaths: 0,
            envelope_error: None,
            score: died_ms as f64,
            stored: "j".into(),
            lane: None,
        }
    }

    /// A dead job as a shard's peek describes it.
    fn dead_job(shard: u16, peek: DeadPeek) -> Option<DeadJob> {
        dead_detail(peek).map(|(job, _)| DeadJob { shard, ..job })
    }

    #[test]
    fn a_lane_job_is_shown_with_its_lane_and_public_id() {
        let mut j = job(5, "expired", Some("emails"), None);
        let shard_json = serde_json::to_value(&j).unwrap();
        assert_eq!(shard_json["shard"], 0);
        assert!(shard_json.get("lane").is_none());
        j.lane = Some(46);
        let lane_json = serde_json::to_value(&j).unwrap();
        assert_eq!(lane_json["lane"], "1a");
        assert!(lane_json.get("shard").is_none(), "{lane_json}");
        assert_eq!(lane_json["route"], "emails");
        assert_eq!(
            crate::client::lanes::public_id(46, "0PQ3aZr-x_9F"),
            "~1a.0PQ3aZr-x_9F"
        );
        assert_eq!(crate::client::lanes::public_id(46, "order-17"), "order-17");
    }

    const NOW: i64 = 1_000_000_000;
    const MIN: i64 = 60_000;

    #[test]
    fn the_empty_filter_takes_everything_dead_before_now() {
        let f = DeadFilter::default();
        assert!(f.is_empty());
        assert!(f.matches(NOW, &job(NOW - 1, "x", None, None)));
        assert!(
            !f.matches(NOW, &job(NOW, "x", None, None)),
            "not before now"
        );
        assert_eq!(f.score_range(NOW), ("-inf".into(), format!("({NOW}")));
    }

    #[test]
    fn reason_is_a_case_insensitive_substring() {
        let f = DeadFilter {
            reason: Some("wrongtype".into()),
            ..DeadFilter::default()
        };
        assert!(f.matches(
            NOW,
            &job(1, "rejected: WRONGTYPE q holds a string", None, None)
        ));
        assert!(!f.matches(NOW, &job(1, "unknown destination: q", None, None)));
    }

    #[test]
    fn route_and_schedule_match_exactly_and_need_the_field() {
        let f = DeadFilter {
            route: Some("emails".into()),
            ..DeadFilter::default()
        };
        assert!(f.matches(NOW, &job(1, "", Some("emails"), None)));
        assert!(!f.matches(NOW, &job(1, "", Some("emails-2"), None)));
        assert!(!f.matches(NOW, &job(1, "", None, None)), "no envelope");
        let f = DeadFilter {
            schedule: Some("nightly".into()),
            ..DeadFilter::default()
        };
        assert!(f.matches(NOW, &job(1, "", Some("q"), Some("nightly"))));
        assert!(!f.matches(NOW, &job(1, "", Some("q"), None)), "no schedule");
        assert!(!f.matches(NOW, &job(1, "", Some("q"), Some("nightly-2"))));
        assert_eq!(f.envelope_only(), ["--schedule"]);
        assert!(
            check_raw_filter(&f)
                .unwrap_err()
                .to_string()
                .contains("--schedule")
        );
    }

    #[test]
    fn ages_bound_a_window_and_its_score_range() {
        let f = DeadFilter {
            older_than: Some(Duration::from_secs(60)),
            newer_than: Some(Duration::from_secs(600)),
            ..DeadFilter::default()
        };
        assert!(f.check().is_ok());
        assert!(
            f.admits_age(NOW, NOW - MIN),
            "exactly 1 min old is older than 1 min"
        );
        assert!(!f.admits_age(NOW, NOW - MIN + 1));
        assert!(f.admits_age(NOW, NOW - 10 * MIN + 1));
        assert!(
            !f.admits_age(NOW, NOW - 10 * MIN),
            "10 min old is not newer than 10 min"
        );
        assert_eq!(
            f.score_range(NOW),
            (format!("({}", NOW - 10 * MIN), (NOW - MIN).to_string())
        );
        let empty = DeadFilter {
            older_than: Some(Duration::from_secs(600)),
            newer_than: Some(Duration::from_secs(60)),
            ..DeadFilter::default()
        };
        let e = empty.check().unwrap_err().to_string();
        assert!(e.contains("no time window"), "{e}");
        assert!(e.contains("10m") && e.contains("1m"), "{e}");
    }

    #[test]
    fn history_text_round_trips_and_is_capped() {
        let deaths: Vec<Death> = (1..=7)
            .map(|i| Death {
                died_ms: 1_700_000_000_000 + i,
                reason: format!("reason {i}: a b"),
            })
            .collect();
        let text = format_history(&deaths);
        assert_eq!(text.lines().count(), HISTORY_CAP);
        assert!(text.starts_with("1700000000003 reason 3: a b\n"), "{text}");
        assert_eq!(parse_history(&text), deaths[2..]);
        assert_eq!(parse_history(""), []);
    }

    #[test]
    fn history_reasons_lose_newlines_and_odd_lines_survive() {
        let text = format_history(&[Death {
            died_ms: 5,
            reason: "broker said:\nno".into(),
        }]);
        assert_eq!(text, "5 broker said: no");
        assert_eq!(
            parse_history("5\nnot a number here\n7 x"),
            [
                Death {
                    died_ms: 5,
                    reason: String::new()
                },
                Death {
                    died_ms: 0,
                    reason: "not a number here".into()
                },
                Death {
                    died_ms: 7,
                    reason: "x".into()
                },
            ]
        );
    }

    #[test]
    fn filters_from_text_treat_empty_as_unset_and_name_the_bad_field() {
        let f = DeadFilter::from_text(Some("q"), Some(" "), Some("10m"), None, Some("")).unwrap();
        assert_eq!(
            f,
            DeadFilter {
                route: Some("q".into()),
                older_than: Some(Duration::from_secs(600)),
                ..DeadFilter::default()
            }
        );
        assert!(
            DeadFilter::from_text(None, None, None, None, None)
                .unwrap()
                .is_empty()
        );
        let e = DeadFilter::from_text(None, None, None, Some("soon"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("newer_than") && e.contains("soon"), "{e}");
        let e = DeadFilter::from_text(None, None, Some("1h"), Some("1m"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no time window"), "{e}");
    }

    #[test]
    fn previews_cut_text_at_a_character_and_encode_binary() {
        let p = payload_preview(b"hello", 200, 5);
        assert_eq!(
            (p.text.as_str(), p.encoding.as_str(), p.truncated),
            ("hello", "utf8", false)
        );
        let long = format!("a{}", "é".repeat(150)); // byte 200 is inside an é
        let p = payload_preview(long.as_bytes(), 200, long.len() as u64);
        assert_eq!(p.text.len(), 199);
        assert!(p.truncated);
        // Only the start was read (Redis cut it inside a character): still text.
        let p = payload_preview(&long.as_bytes()[..100], 2048, long.len() as u64);
        assert_eq!((p.text.len(), p.encoding.as_str()), (99, "utf8"));
        assert!(p.truncated);
        let p = payload_preview(&[0xff, 0x00], 200, 2);
        assert_eq!((p.text.as_str(), p.encoding.as_str()), ("/wA=", "base64"));
        // A whole payload that ends inside a character is not text.
        let p = payload_preview(&[b'a', 0xe9], 200, 2);
        assert_eq!((p.text.as_str(), p.encoding.as_str()), ("Yek=", "base64"));
    }

    #[test]
    fn member_ids_carry_the_death_time_and_a_bounded_hash() {
        // sha1("abc") = a9993e364706816aba3e25717850c26c9cd0d89d
        assert_eq!(member_id(b"abc"), "a9993e364706816a");
        assert_eq!(member_hash(b"abc"), "a9993e364706816a");
        let member = DeadMember {
            hash: member_hash(b"abc"),
            died_ms: 1_700_000_000_123,
            reason: String::new(),
            size: 3,
            preview: b"abc".to_vec(),
        };
        assert_eq!(member.id(), "1700000000123-a9993e364706816a");
        assert_eq!(
            member.message_id("raw:a").as_deref(),
            Some("raw:a:a9993e364706816a")
        );
        // Over 1 MiB: the size and both ends, so a change in the middle is not seen.
        let mut big = vec![b'x'; (1 << 20) + 1];
        let hash = member_hash(&big);
        assert_ne!(hash, member_id(&big));
        big[1 << 19] = b'y';
        assert_eq!(member_hash(&big), hash);
        big.push(b'x');
        assert_ne!(member_hash(&big), hash);
        let wanted = MemberId {
            died_ms: Some(1_700_000_000_123),
            hash: "a9993e364706816a".into(),
        };
        assert_eq!(
            parse_member_id("raw:a", "raw:a:1700000000123-A9993E364706816A").unwrap(),
            wanted
        );
        assert_eq!(
            parse_member_id("raw:a", "1700000000123-a9993e364706816a").unwrap(),
            wanted
        );
        assert_eq!(
            parse_member_id("raw:a", "a9993e364706816a").unwrap(),
            MemberId {
                died_ms: None,
                hash: "a9993e364706816a".into()
            }
        );
        for bad in [
            "abc",
            "x-a9993e364706816a",
            "raw:b:a9993e364706816a",
            "1-abc",
        ] {
            assert!(parse_member_id("raw:a", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dead_jobs_are_described_from_their_frame_head() {
        let head = b"zd1:emails\n48\n{\"attempt\":3,\"last_error\":\"OOM\",\"schedule\":\"s1\"}";
        let peek = DeadPeek {
            id: "j1".into(),
            died: Some(12.0),
            reason: "gave up".into(),
            history: "1 a\n2 b".into(),
            envelope: EnvelopeHead::Frame {
                head: head.to_vec(),
                payload_size: 42,
                payload_start: Vec::new(),
            },
        };
        let job = dead_job(3, peek.clone()).expect("dead");
        assert_eq!(job.route.as_deref(), Some("emails"));
        assert_eq!(
            (
                job.attempt,
                job.last_error.as_deref(),
                job.schedule.as_deref()
            ),
            (3, Some("OOM"), Some("s1"))
        );
        assert_eq!((job.payload_size, job.earlier_deaths), (Some(42), 2));
        assert_eq!(job.envelope_error, None);
        let orphan = dead_job(
            3,
            DeadPeek {
                envelope: EnvelopeHead::Missing,
                ..peek.clone()
            },
        )
        .unwrap();
        assert_eq!(orphan.route, None);
        assert!(orphan.envelope_error.unwrap().contains("no envelope"));
        let big_json = DeadPeek {
            envelope: EnvelopeHead::Other {
                head: b"{\"dest\":".to_vec(),
                size: 100_000,
            },
            ..peek.clone()
        };
        let e = dead_job(3, big_json).unwrap().envelope_error.unwrap();
        assert!(e.contains("100000 bytes") && e.contains("65536"), "{e}");
        assert!(dead_job(3, DeadPeek { died: None, ..peek }).is_none());
    }
}
