//! `zdelay reshard` ([`reshard`]), online.
//!
//! The shard count is the spread shards' (two-phase jobs, their dead letters,
//! schedules, unique windows and debounce deadlines); route lanes live by their list's slot
//! and are not resharded. A spread shard's slot depends on the count, so every job moves, and
//! the move runs online, with the online mover `zdelay upgrade` uses ([`crate::upgrade::Mover`]):
//!
//! 1. Checks: `--to` in range, no other reshard unfinished, the new shards empty, and no shard
//!    number whose keys are the same under both counts (it could not be copied before it is
//!    deleted). Daemons of older builds are named in a warning: they cannot follow.
//! 2. Fence: the schema gets `resharding = "<from> <to>"`; the new shards' markers say `to`;
//!    the schema says `shards = to` (new work goes there); then the old shards' markers say
//!    `to`. A call made with the old count is refused there (`ZDELAY_RESHARDED <to>`) before it
//!    writes anything, except a settle (token-fenced), so jobs claimed before the fence settle
//!    in place. Producers re-read the schema and send the call again; daemons restart their
//!    pollers on the new count.
//! 3. Move: unique windows and debounce deadlines first (kept when the new shard has newer
//!    ones), then rounds of each old shard's earliest due batch, then — once no lease a
//!    daemon holds there is live — everything else, and the windows again. Each batch is put
//!    into its new shard in transit mode (written once, a job a producer wrote there meanwhile
//!    kept) before it is deleted from the old one.
//! 4. Finish: each old shard is checked empty (its marker stays, fencing stale processes); the
//!    schema loses `resharding`, the new shards their `transit_in` sets.
//!
//! Running it again after a crash anywhere resumes. Nothing here prints: progress goes to a
//! callback.

use crate::keys::Keys;
use crate::reshard::{
    self, Daemon, IdPages, MAX_BATCH, Options, Outcome, Plan, Progress, Report, ReshardError,
};
use crate::store::{self, Conn, Layout, StoreError};
use std::collections::HashSet;
use std::time::Instant;

/// Reshards `namespace` to `opts.to` shards, or with `opts.dry_run` says what it would do. A
/// layout-1 namespace is refused: `zdelay upgrade` first.
pub async fn reshard(
    con: &Conn,
    namespace: &str,
    opts: &Options,
    progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<Outcome, ReshardError> {
    let started = Instant::now();
    let mut con = con.clone();
    let to = opts.to;
    if to == 0 || to > crate::config::MAX_SHARDS {
        return Err(ReshardError::OutOfRange(to.into()));
    }
    let schema = store::read_schema(&mut con, &Keys::new(namespace, 1)).await?;
    let probe = Keys::new(namespace, 1);
    let Some(shards) = schema.shards else {
        return Err(ReshardError::NoSchema(namespace.to_owned()));
    };
    store::check_layout_field(&probe, schema.layout.as_deref(), schema.upgrading.is_some())?;
    reshard_spread(&con, namespace, &schema, shards, opts, progress, started).await
}

/// `zdelay reshard` on layout 2: the spread shards (two-phase jobs) get another count while
/// producers and daemons run (see "Layout 2" in the module's documentation). Every spread
/// shard's slot depends on the count, so every job moves: the old shards are fenced and moved
/// into the new ones by the online mover `zdelay upgrade` uses.
async fn reshard_spread(
    con: &Conn,
    namespace: &str,
    schema: &store::Schema,
    shards: u16,
    opts: &Options,
    progress: &(dyn Fn(Progress) + Send + Sync),
    started: Instant,
) -> Result<Outcome, ReshardError> {
    let mut con = con.clone();
    let to = opts.to;
    let (from, resumed) = match reshard::run_of(namespace, shards, to, schema.resharding)? {
        Ok(run) => run,
        Err(done) => return Ok(done),
    };
    let old = Keys::new(namespace, from);
    let new = Keys::new(namespace, to);
    // A job is written into its new shard before it is deleted from its old one, so the two
    // must be different keys.
    if let Some(shard) = reshard::shared_shard(&old, &new) {
        return Err(ReshardError::SameKeys {
            from,
            to,
            shard,
            slot: crate::keys::spread_slot(shard, to),
        });
    }
    let daemons = reshard::live_daemons(&mut con, &old).await?;
    if !resumed {
        for shard in 0..to {
            let keys = reshard::held_keys(&con, &new, shard).await?;
            if !keys.is_empty() {
                return Err(ReshardError::StrayData {
                    namespace: namespace.to_owned(),
                    shards: from,
                    shard,
                    keys,
                });
            }
        }
    }
    let before = reshard::count(&con, &old, 0..from).await?;
    if opts.dry_run {
        let mut to_move = 0;
        for shard in 0..from {
            let keys = old.shard(shard);
            let mut pages = IdPages::new(&keys);
            let mut ids: HashSet<Vec<u8>> = HashSet::new();
            while let Some((page, _)) = pages.next(&mut con).await? {
                ids.extend(page);
            }
            to_move += ids.len() as u64;
        }
        return Ok(Outcome::DryRun(Plan {
            namespace: namespace.to_owned(),
            from,
            to,
            resume: resumed,
            counts: before,
            to_move,
            daemons,
            online: true,
        }));
    }
    progress(Progress::Start { from, to, resumed });
    let outdated: Vec<&Daemon> = daemons
        .iter()
        .filter(|d| !crate::upgrade::follows(d))
        .collect();
    if !outdated.is_empty() {
        let names: Vec<&str> = outdated.iter().map(|d| d.id.as_str()).collect();
        progress(Progress::Warning(format!(
            "daemons of builds older than this one cannot follow the new shard count and stop \
             at the fence (their jobs stay in Redis and move): {}; start them again with this \
             build",
            names.join(", ")
        )));
    }
    let probe = old.schema();
    if !resumed {
        let set: bool = redis::cmd("HSETNX")
            .arg(&probe)
            .arg("resharding")
            .arg(format!("{from} {to}"))
            .query_async(&mut con)
            .await?;
        if !set {
            return Err(ReshardError::MarkerChanged(
                "another reshard started meanwhile".into(),
            ));
        }
    }
    // The new shards take the new count's calls; then new work goes there; then the old
    // shards refuse every call made with the old count except a settle, so a producer or a
    // daemon meets the fence at its next call and follows (a refused call wrote nothing).
    let marker = Layout::Shards(to).marker();
    reshard::set_markers(&con, &new, to, &marker).await?;
    let _: () = redis::cmd("HSET")
        .arg(&probe)
        .arg("shards")
        .arg(to)
        .query_async(&mut con)
        .await?;
    reshard::set_markers(&con, &old, from, &marker).await?;
    // An idle daemon polling an old shard meets the fence now, not at its next idle poll.
    let mut wake = redis::pipe();
    for shard in 0..from {
        wake.publish(old.wake_channel(), format!("{shard} 0"))
            .ignore();
    }
    wake.query_async::<()>(&mut con).await?;
    progress(Progress::Fenced { counts: before });
    crate::failpoint::hold("reshard_after_fence").await;

    let adapt = |p: crate::upgrade::Progress| match p {
        crate::upgrade::Progress::Moved { total } => progress(Progress::Moved { total }),
        crate::upgrade::Progress::Settling {
            shard,
            jobs,
            lease_left_ms,
        } => progress(Progress::Warning(format!(
            "old shard {shard}: {jobs} jobs in flight; waiting for their daemons to settle \
             them (the last lease ends in {:.1} s)",
            lease_left_ms as f64 / 1000.0
        ))),
        crate::upgrade::Progress::ShardDone { shard } => {
            progress(Progress::ShardDone { shard, moved: 0 })
        }
        _ => {}
    };
    let registry = crate::lane::Registry::default();
    let mover = crate::upgrade::Mover {
        con: &con,
        legacy: &old,
        spread: &new,
        registry: &registry,
        batch: opts.batch.clamp(1, MAX_BATCH),
        progress: &adapt,
        moved: std::sync::atomic::AtomicU64::new(0),
        tally: Default::default(),
        channel: old.wake_channel(),
        fence: marker.clone(),
        retired: marker,
        carry_windows: true,
    };
    mover.run(opts.concurrency).await.map_err(|e| match e {
        crate::upgrade::UpgradeError::Store(s) => ReshardError::Store(s),
        crate::upgrade::UpgradeError::MarkerChanged(m) => ReshardError::MarkerChanged(m),
        crate::upgrade::UpgradeError::NotEmpty { shard, keys } => {
            ReshardError::RetiredNotEmpty { to, shard, keys }
        }
        other => ReshardError::Store(StoreError::Schema(other.to_string())),
    })?;
    let tally = mover.tally.into_inner().expect("tally lock");
    progress(Progress::Finishing);
    let after = reshard::count(&con, &new, 0..to).await?;
    let _: () = redis::cmd("HDEL")
        .arg(&probe)
        .arg("resharding")
        .query_async(&mut con)
        .await?;
    crate::upgrade::delete_transit_sets(&con, &new, &registry)
        .await
        .map_err(|e| ReshardError::Store(StoreError::Schema(e.to_string())))?;
    Ok(Outcome::Done(Report {
        namespace: namespace.to_owned(),
        from,
        to,
        resumed,
        before,
        after,
        moved: tally.to_spread_shards,
        superseded: tally.superseded,
        put_before: tally.put_before,
        online: true,
        elapsed_ms: started.elapsed().as_millis() as u64,
    }))
}
