//! The lane registry of storage layout 2 (`<ns>:lanes`): reading it, and registering a local
//! route's lane with its marker; and reading one job of a lane.

use super::scripts::{self, LaneChange, Registering};
use super::{Conn, StoreError};
use crate::config::Push;
use crate::job::JobState;
use crate::keys::{self, Keys};
use crate::lane::{Lane, Registry, parse_entry};
use crate::lane_id::base36;
use crate::routes::LaneRoute;
use std::collections::BTreeMap;

/// Whether a lane script refused the call because the lane is not the one the caller read
/// from the registry (`ZDELAY_LANE_MOVED`, `_CHANGED`, `ZDELAY_NO_LANE`; nothing was
/// written): read the registry again.
pub fn is_lane_refusal(e: &redis::RedisError) -> bool {
    matches!(
        e.code(),
        Some("ZDELAY_LANE_MOVED" | "ZDELAY_LANE_CHANGED" | "ZDELAY_NO_LANE")
    )
}

/// Reads the lane registry. An entry zdelay would not write is an error naming it.
pub async fn read_registry(con: &mut Conn, keys: &Keys) -> Result<Registry, StoreError> {
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.lanes())
        .query_async(con)
        .await?;
    let mut registry = Registry::default();
    for (field, entry) in &fields {
        if let Some(route) = field.strip_prefix("t:") {
            registry.two_phase.insert(route.to_owned(), entry.clone());
            continue;
        }
        if let Some(sink) = field.strip_prefix("s:") {
            registry.sinks.insert(sink.to_owned());
            continue;
        }
        if let Some(number) = field.strip_prefix('#') {
            if let (Some(number), Some(retired)) = (
                crate::lane_id::parse_base36(number),
                crate::lane::parse_retired(entry),
            ) {
                registry.retired.insert(number, retired);
            }
            continue;
        }
        let Some(route) = field.strip_prefix("r:") else {
            continue;
        };
        let lane = parse_entry(keys, route, entry).ok_or_else(|| {
            StoreError::Schema(format!(
                "{} field {field} holds {entry:?}, not what zdelay writes",
                keys.lanes()
            ))
        })?;
        registry.by_route.insert(route.to_owned(), lane);
    }
    Ok(registry)
}

/// The unique windows set of every lane the registry ever gave out (`#<lane>` → `<route>
/// <slot> live|retired`): live lanes, retired ones, and those of routes no config names any
/// more, which no enqueue reaches to drop their ended windows. An entry zdelay would not
/// write is skipped.
pub async fn every_lanes_windows(con: &mut Conn, keys: &Keys) -> Result<Vec<String>, StoreError> {
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.lanes())
        .query_async(con)
        .await?;
    Ok(fields
        .iter()
        .filter(|(field, _)| field.starts_with('#'))
        .filter_map(|(_, entry)| {
            let mut words = entry.rsplitn(3, ' ');
            let _state = words.next()?;
            let slot = words.next()?.parse::<u16>().ok()?;
            let route = words.next()?;
            (slot < keys::SLOTS).then(|| {
                crate::keys::LaneKeys::new(keys.namespace(), keys::slot_tag(slot), route).windows
            })
        })
        .collect())
}

/// Why the local stream routes of `config` cannot run: the first whose key holds another type
/// than a stream (a list, a hash), which would send every job to dead as `wrong_type`; `None`
/// when every such key is a stream or absent. Reads only (`TYPE`).
pub async fn stream_key_conflict(
    con: &mut Conn,
    config: &crate::config::Config,
) -> Result<Option<String>, StoreError> {
    let plan = crate::routes::LaneRoutes::from_config(config);
    for route in plan.local.iter().filter(|r| r.push.is_stream()) {
        let kind: String = redis::cmd("TYPE").arg(&route.list).query_async(con).await?;
        if kind != "stream" && kind != "none" {
            return Ok(Some(format!(
                "route {} appends to the stream {} (push = \"xadd\"), but that key holds a \
                 {kind}: rename the route's target, or delete or rename the key",
                route.name, route.list
            )));
        }
    }
    Ok(None)
}

/// Gives the local route `route` (delivering to `list` with `push`) its lane, or confirms the
/// one it has, and writes the lane's marker. A route whose list moved to another hash slot
/// gets a new lane and its old one is retired: what that still holds waits there until
/// [`super::relocate::relocate`] moves it into the new lane.
pub async fn register(
    con: &mut Conn,
    keys: &Keys,
    route: &str,
    list: &str,
    push: Push,
) -> Result<(Lane, LaneChange), StoreError> {
    let slot = keys::slot_of(list);
    let old: Option<String> = redis::cmd("HGET")
        .arg(keys.lanes())
        .arg(format!("r:{route}"))
        .query_async(con)
        .await?;
    let old = match old {
        Some(entry) => Some(parse_entry(keys, route, &entry).ok_or_else(|| {
            StoreError::Schema(format!(
                "{} field r:{route} holds {entry:?}, not what zdelay writes",
                keys.lanes()
            ))
        })?),
        None => None,
    };
    // A list moved to another slot: a new lane. The old one is retired first, naming the
    // successor's number taken now; only then does the registry name the successor. A
    // producer with the old lane cached is refused from the retirement on and reads the
    // registry again; nothing more enters or leaves the old lane but by the relocation.
    let mut successor = None;
    if let Some(old) = &old
        && keys::slot_of(&old.list) != slot
    {
        // A relocation into the live lane that did not finish (no daemon with that config
        // ran it through) is finished first: the lane it empties may be the one this
        // registration makes live again, whose jobs the unfinished run had already put into
        // the live lane, where they may have been delivered since.
        let registry = read_registry(con, keys).await?;
        let pending: Vec<_> = registry.retired_of(route).collect();
        if super::relocate::unfinished(con, keys, &pending).await? {
            super::relocate::relocate(con, keys, old, &pending).await?;
        }
        let next: u32 = redis::cmd("HINCRBY")
            .arg(keys.lanes())
            .arg("next")
            .arg(1)
            .query_async(con)
            .await?;
        crate::failpoint::hold("lane_hold_before_retire").await;
        let number = base36(next);
        scripts::retire_lane(con, old, &number).await?;
        crate::failpoint::hold("lane_hold_after_retire").await;
        successor = Some(number);
    }
    let (number, change) = scripts::register_lane(
        con,
        &keys.lanes(),
        route,
        slot,
        push,
        list,
        successor.as_deref(),
        Registering::Daemon,
    )
    .await?;
    let number = crate::lane_id::parse_base36(&number).ok_or_else(|| {
        StoreError::Schema(format!("{} gave lane number {number:?}", keys.lanes()))
    })?;
    let lane = Lane::for_list(keys.namespace(), number, route, list, push);
    // Written on every registration, so a start that died after registering still ends
    // with the marker in place.
    let _: () = redis::cmd("SET")
        .arg(&lane.keys.marker)
        .arg(lane.marker())
        .query_async(con)
        .await?;
    Ok((lane, change))
}

/// Registers the two-phase routes (`t:<route>` → sink) and sinks (`s:<sink>`) of a daemon's
/// config, so producers know which destinations go to the spread shards. A route registered
/// as local with a lane is not changed here: [`register`] refuses that config.
pub async fn register_two_phase(
    con: &mut Conn,
    keys: &Keys,
    routes: &[(String, String)],
    sinks: &[String],
) -> Result<(), StoreError> {
    if routes.is_empty() && sinks.is_empty() {
        return Ok(());
    }
    scripts::register_two_phase(con, &keys.lanes(), routes, sinks, Registering::Daemon).await?;
    Ok(())
}

/// A producer's registration of one destination of its config that the registry lacks
/// (`register_lane.lua` and `register_two_phase.lua`, the daemons' scripts, which give a route
/// one lane number however many register it at once). It never changes a registration:
/// `Some(entry)` when the destination is registered otherwise (another list or push side, a
/// two-phase route registered as local or the other way round), and nothing was written. A
/// new lane's marker is written only where none is (`SET NX`): a daemon that registered the
/// lane meanwhile wrote it already, and may have changed it since.
pub async fn register_missing(
    con: &mut Conn,
    keys: &Keys,
    route: LaneRoute<'_>,
) -> Result<Option<String>, StoreError> {
    let registry = keys.lanes();
    let (routes, sinks) = match route {
        LaneRoute::Local(local) => {
            let slot = keys::slot_of(&local.list);
            let (number, change) = scripts::register_lane(
                con,
                &registry,
                &local.name,
                slot,
                local.push,
                &local.list,
                None,
                Registering::Missing,
            )
            .await?;
            match change {
                LaneChange::New | LaneChange::Same => {}
                LaneChange::Differs { registered } => return Ok(Some(registered)),
                other => {
                    return Err(StoreError::Schema(format!(
                        "{registry} answered {other:?} to a registration of a missing route"
                    )));
                }
            }
            let number = crate::lane_id::parse_base36(&number).ok_or_else(|| {
                StoreError::Schema(format!("{registry} gave lane number {number:?}"))
            })?;
            let lane = Lane::for_list(
                keys.namespace(),
                number,
                &local.name,
                &local.list,
                local.push,
            );
            let _: Option<String> = redis::cmd("SET")
                .arg(&lane.keys.marker)
                .arg(lane.marker())
                .arg("NX")
                .query_async(con)
                .await?;
            return Ok(None);
        }
        LaneRoute::TwoPhase { route, sink } => (
            vec![(route.to_owned(), sink.to_owned())],
            vec![sink.to_owned()],
        ),
        LaneRoute::Sink(sink) => (Vec::new(), vec![sink.to_owned()]),
    };
    Ok(
        scripts::register_two_phase(con, &registry, &routes, &sinks, Registering::Missing)
            .await?
            .map(|(_, registered)| registered),
    )
}

/// One job of a route lane as read by [`get`].
#[derive(Debug, Clone, PartialEq)]
pub struct LaneJob {
    /// `Scheduled` or `Due` while waiting, `Dead`, or `Orphan` when only its payload is
    /// stored (in neither `due` nor `dead`: an inconsistency an operator should look at).
    pub state: JobState,
    /// Its due ms while waiting, the ms it died when dead; `None` for an orphan.
    pub score: Option<f64>,
    /// Raw bytes (a dead job keeps its payload); empty when none is stored. Read with a
    /// preview ([`get_preview`]): its first bytes only, cut inside Redis.
    pub payload: Vec<u8>,
    /// The whole payload's size in bytes.
    pub payload_size: u64,
    /// Meta JSON, for a job whose meta is not all defaults.
    pub meta: Option<String>,
    /// Not delivered later than this after its due (it dies `expired`).
    pub max_lateness_ms: Option<u64>,
    /// Why it died.
    pub reason: Option<String>,
    /// The lane's marker as read with the job (`None`: no marker): see [`get`].
    pub marker: Option<String>,
}

/// What [`lookup`] read: the lane's marker, and the job when the lane stores it.
#[derive(Debug, Clone, PartialEq)]
pub struct LaneLookup {
    pub marker: Option<String>,
    pub job: Option<LaneJob>,
}

/// Reads the job `id` of `lane` in one pipeline (every key is in the lane's hash slot, so on
/// a cluster too); `None` when the lane does not store it (delivered, cancelled, purged or
/// never enqueued). Scheduled or due is decided on Redis's clock.
///
/// Not fenced: the marker read with the job comes back in [`LaneJob::marker`], and the
/// caller checks it is `lane.marker()` (a retired lane's marker names its successor, where
/// the job may be now). [`lookup`] returns the marker when the job is not found, too.
pub async fn get(con: &mut Conn, lane: &Lane, id: &str) -> Result<Option<LaneJob>, StoreError> {
    Ok(read(con, lane, id, None).await?.job)
}

/// [`get`] with at most the first `preview` bytes of the payload, cut inside Redis
/// (`peek_dead_lane`), so a large payload is never sent whole.
pub async fn get_preview(
    con: &mut Conn,
    lane: &Lane,
    id: &str,
    preview: usize,
) -> Result<Option<LaneJob>, StoreError> {
    Ok(read(con, lane, id, Some(preview)).await?.job)
}

/// [`get`], with the marker also when the job is not found (a caller following a retired
/// lane needs it then).
pub async fn lookup(con: &mut Conn, lane: &Lane, id: &str) -> Result<LaneLookup, StoreError> {
    read(con, lane, id, None).await
}

/// [`lookup`], reading the payload whole or (`preview`) its first bytes.
pub async fn read(
    con: &mut Conn,
    lane: &Lane,
    id: &str,
    preview: Option<usize>,
) -> Result<LaneLookup, StoreError> {
    type Reply = (
        (i64, i64),
        Option<f64>,
        Option<Vec<u8>>,
        u64,
        bool,
        Option<String>,
        Option<String>,
        Option<f64>,
        Option<String>,
        Option<String>,
    );
    let k = &lane.keys;
    let mut pipe = redis::pipe();
    pipe.cmd("TIME").zscore(&k.due, id);
    // The payload, or its size and whether it is stored (HSTRLEN cannot tell an empty one).
    match preview {
        None => pipe.hget(&k.jobs, id).cmd("HSTRLEN").arg(&k.jobs).arg(id),
        Some(_) => pipe.cmd("ECHO").arg("").cmd("HSTRLEN").arg(&k.jobs).arg(id),
    };
    pipe.hexists(&k.jobs, id)
        .hget(&k.meta, id)
        .hget(&k.maxlate, id)
        .zscore(&k.dead, id)
        .hget(&k.reasons, id)
        .get(&k.marker);
    let (
        (secs, micros),
        due,
        payload,
        payload_size,
        stored,
        meta,
        max_lateness,
        dead,
        reason,
        mut marker,
    ): Reply = pipe.query_async(con).await?;
    let payload = match (preview, stored) {
        (None, _) => payload,
        (Some(_), false) => None,
        (Some(0), true) => Some(Vec::new()),
        (Some(n), true) => {
            match super::scripts::peek_dead_lane(con, lane, &[id.to_owned()], n).await {
                Ok(mut peeked) => Some(
                    peeked
                        .pop()
                        .and_then(|peek| match peek.envelope {
                            super::scripts::EnvelopeHead::Frame { payload_start, .. } => {
                                Some(payload_start)
                            }
                            _ => None,
                        })
                        .unwrap_or_default(),
                ),
                // The lane changed since its marker was read: the caller reads it again.
                Err(e) if is_lane_refusal(&e) => {
                    marker = None;
                    Some(Vec::new())
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let max_lateness_ms = match max_lateness {
        Some(text) => Some(text.parse::<u64>().map_err(|_| {
            StoreError::Schema(format!(
                "{} field {id} holds {text:?}, not a max lateness in ms",
                k.maxlate
            ))
        })?),
        None => None,
    };
    // In the namespace's time: a test clock's offset added (no I/O without one).
    let offset_ms = con.clock_offset_ms().await? as f64;
    let now_ms = (secs * 1_000_000 + micros) as f64 / 1000.0 + offset_ms;
    let (state, score) = match (due, dead) {
        (Some(s), _) if s > now_ms => (JobState::Scheduled, Some(s)),
        (Some(s), _) => (JobState::Due, Some(s)),
        (None, Some(s)) => (JobState::Dead, Some(s)),
        (None, None) if stored => (JobState::Orphan, None),
        (None, None) => return Ok(LaneLookup { marker, job: None }),
    };
    let job = LaneJob {
        state,
        score,
        payload: payload.unwrap_or_default(),
        payload_size,
        meta,
        max_lateness_ms,
        reason,
        marker: marker.clone(),
    };
    Ok(LaneLookup {
        marker,
        job: Some(job),
    })
}
