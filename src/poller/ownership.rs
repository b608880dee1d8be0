//! Shard ownership: which targets (envelope shards and raw sources) this instance polls.
//!
//! Ownership is published as a `watch` of target sets; the supervisor starts a poller for
//! every target that enters the set and stops the poller of every target that leaves it.
//!
//! Daemons share the targets through poller slots in Redis ([`Leases`]): each target has
//! `poller.per_shard` slots; every daemon registers with a heartbeat five times per
//! `poller.slot_lease`, and each heartbeat plans who polls what for every live daemon (the
//! same deterministic plan whoever runs it, see `claim_slots.lua`): at most ⌈slots / live
//! daemons⌉ each, the two slots of a target on two daemons, a slot left where it is while
//! that stays fair. A daemon that dies lapses after one lease and the next heartbeat of any
//! other plans its slots away; one that joins gets its share at its first heartbeat; one that
//! stops hands them back at once. A daemon that cannot renew for a whole lease stops polling:
//! it no longer knows what it owns. Two pollers on one target are safe anyway (every script
//! is atomic and two-phase settles are fenced), so a slot that briefly has two pollers costs
//! nothing but work.
//!
//! An instance id is stable across restarts (`poller.instance_id`, by default the pod name on
//! Kubernetes), and each process registers with a nonce of its own: a daemon restarted after
//! `kill -9` takes its previous life's registration, and with it its slots, at its first
//! heartbeat, instead of waiting a lease for it to lapse. A second live process with the same
//! id is found out by the first one's next heartbeat, which takes the registration back; the
//! newcomer then refuses to run ([`InstanceIdInUse`]). The rules are `claim_slots.lua`'s.

use super::context::TargetId;
use crate::metrics::{self, OWNED_SHARDS};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use zdelay_core::config::valid_instance_id;
use zdelay_core::keys::Keys;
use zdelay_core::store::scripts::{PolledTargets, Registrant, Registration, Standing};
use zdelay_core::store::{Conn, scripts};

/// The set of targets this instance polls.
pub type Owned = BTreeSet<TargetId>;

/// The sending side: whoever decides ownership updates it.
pub struct Ownership {
    tx: watch::Sender<Owned>,
}

impl Ownership {
    /// Owns `targets` from the start (a single instance owns every target).
    pub fn new(targets: Owned) -> Self {
        let ownership = Ownership {
            tx: watch::Sender::new(Owned::new()),
        };
        ownership.set(targets);
        ownership
    }

    /// Replaces the owned set; pollers follow.
    pub fn set(&self, targets: Owned) {
        let shards = targets
            .iter()
            .filter(|t| matches!(t, TargetId::Shard(_)))
            .count();
        ::metrics::gauge!(OWNED_SHARDS).set(shards as f64);
        self.tx.send_if_modified(|owned| {
            let changed = *owned != targets;
            *owned = targets;
            changed
        });
    }

    pub fn subscribe(&self) -> watch::Receiver<Owned> {
        self.tx.subscribe()
    }
}

/// A target's name in the slots HASH.
pub fn slot_name(target: &TargetId) -> String {
    match target {
        TargetId::Shard(s) => format!("shard:{s}"),
        TargetId::Source(key) => format!("source:{key}"),
        TargetId::Lane(number) => format!("lane:{}", zdelay_core::lane_id::base36(*number)),
    }
}

/// The target a slot name (`<target>` or `<target>#<k>`) stands for.
pub fn target_of(name: &str) -> Option<TargetId> {
    let name = name.rsplit_once('#').map_or(name, |(target, _)| target);
    if let Some(shard) = name.strip_prefix("shard:") {
        return shard.parse().ok().map(TargetId::Shard);
    }
    if let Some(lane) = name.strip_prefix("lane:") {
        return zdelay_core::lane_id::parse_base36(lane).map(TargetId::Lane);
    }
    name.strip_prefix("source:")
        .map(|key| TargetId::Source(key.to_owned()))
}

/// Route lanes are dealt in groups, not one slot each: lane `n` is in group `n % LANE_GROUPS`,
/// so the heartbeat's plan (`claim_slots`, one Lua call a second per daemon) costs the same
/// for 1,000 routes as for 64, and a group's holder polls every lane in it.
pub const LANE_GROUPS: u32 = 64;

/// This daemon's lanes by group. A group's slot name carries its members
/// (`lanes:<group>:<hash of its lane numbers>`), so daemons whose configs differ (a rolling
/// change) register different names for a group they hold different lanes of: each name is
/// dealt among the daemons that have exactly those lanes, and no lane is left unpolled.
#[derive(Debug, Default)]
pub struct LaneGroups {
    by_name: BTreeMap<String, Vec<TargetId>>,
}

impl LaneGroups {
    pub fn of(targets: &[TargetId]) -> Self {
        let mut groups: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for target in targets {
            if let TargetId::Lane(n) = target {
                groups.entry(n % LANE_GROUPS).or_default().push(*n);
            }
        }
        let by_name = groups
            .into_iter()
            .map(|(group, mut lanes)| {
                lanes.sort_unstable();
                let members: Vec<String> = lanes.iter().map(|n| n.to_string()).collect();
                // 64 bits of SHA-1: two different member sets never share a name in practice.
                let mut hash = sha1_smol::Sha1::from(members.join(","))
                    .digest()
                    .to_string();
                hash.truncate(16);
                (
                    format!("lanes:{group}:{hash}"),
                    lanes.into_iter().map(TargetId::Lane).collect(),
                )
            })
            .collect();
        LaneGroups { by_name }
    }

    /// The groups' slot names.
    pub fn names(&self) -> impl Iterator<Item = String> + '_ {
        self.by_name.keys().cloned()
    }

    /// The targets a claimed slot name stands for: a group's lanes, or the one target.
    pub fn targets_of(&self, name: &str) -> Vec<TargetId> {
        let base = name.rsplit_once('#').map_or(name, |(target, _)| target);
        match self.by_name.get(base) {
            Some(lanes) => lanes.clone(),
            None => target_of(name).into_iter().collect(),
        }
    }
}

/// Another live process renews the registration of this daemon's instance id.
#[derive(Debug, thiserror::Error)]
#[error(
    "poller.instance_id {0} is in use by another running daemon on this namespace (it keeps \
     renewing that registration): give each daemon its own id, or leave poller.instance_id \
     unset"
)]
pub struct InstanceIdInUse(pub String);

/// How soon a heartbeat that failed is tried again.
const RETRY_AFTER_ERROR: Duration = Duration::from_millis(200);

/// This instance's poller-slot leases.
pub struct Leases {
    pub con: Conn,
    pub keys: Keys,
    /// This daemon's id in the registry.
    pub instance: String,
    /// This process's own: tells a restart (or a duplicate) from the process itself.
    pub nonce: String,
    pub per_target: u8,
    pub lease: Duration,
    /// The shards every daemon polls: the namespace's count (layout 2's spread shards).
    pub shards: u16,
    /// The raw sources and route lanes of this daemon's config (shards are the same for
    /// every daemon); the lanes are dealt by [`LaneGroups`].
    pub sources: Vec<TargetId>,
}

impl Leases {
    /// The instance id: `configured` (`poller.instance_id`), else the pod name on
    /// Kubernetes, else the host name and a ULID (new at every start, so several daemons on
    /// one host need no config).
    pub fn instance_id(configured: Option<&str>) -> String {
        configured
            .map(str::to_owned)
            .or_else(|| pod_name(|name| std::env::var(name).ok()))
            .unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_owned())
                    .unwrap_or_else(|_| "zdelay".to_owned());
                format!("{host}-{}", ulid::Ulid::generate())
            })
    }

    /// A nonce for this process's registration.
    pub fn nonce() -> String {
        ulid::Ulid::generate().to_string()
    }

    /// Renews the leases until `shutdown`, publishing what is owned into `ownership`; then
    /// hands every slot back. Ends early, owning nothing, when another live process holds
    /// this instance id.
    pub async fn run(
        mut self,
        ownership: Ownership,
        shutdown: CancellationToken,
    ) -> Result<(), InstanceIdInUse> {
        let groups = LaneGroups::of(&self.sources);
        let sources: Vec<String> = self
            .sources
            .iter()
            .filter(|t| !matches!(t, TargetId::Lane(_)))
            .map(slot_name)
            .chain(groups.names())
            .collect();
        let every = self.lease / 5;
        let mut last_ok: Option<Instant> = None;
        let mut instances = 0;
        while !shutdown.is_cancelled() {
            let mut next = every;
            let standing = match last_ok {
                None => Standing::New,
                Some(at) if at.elapsed() < self.lease => Standing::Held,
                Some(_) => Standing::Lost,
            };
            let heartbeat = scripts::claim_slots(
                &mut self.con,
                &self.keys,
                Registrant {
                    instance: &self.instance,
                    nonce: &self.nonce,
                },
                standing,
                self.lease.as_millis() as u64,
                self.per_target,
                PolledTargets {
                    shards: self.shards,
                    named: &sources,
                },
            )
            .await;
            match heartbeat {
                Ok(claim) if claim.registration == Registration::InUse => {
                    ownership.set(Owned::new());
                    let in_use = InstanceIdInUse(self.instance.clone());
                    tracing::error!(instance = %self.instance, "{in_use}; stopping");
                    return Err(in_use);
                }
                Ok(claim) => {
                    last_ok = Some(Instant::now());
                    metrics::recovered("redis", "poller slots");
                    match claim.registration {
                        Registration::TookOver => tracing::warn!(
                            instance = %self.instance,
                            "took over this instance id's registration and poller slots from a \
                             process that did not hand them back (a previous run); if that \
                             process is still running, it keeps the id and this one stops"
                        ),
                        Registration::TookBack => tracing::warn!(
                            instance = %self.instance,
                            "another process started with this instance id and took its \
                             registration: taken back, that process stops"
                        ),
                        Registration::Renewed | Registration::InUse => {}
                    }
                    if claim.live_instances != instances {
                        instances = claim.live_instances;
                        tracing::info!(
                            instances,
                            owned = claim.targets.len(),
                            "poller slots rebalanced"
                        );
                    }
                    ownership.set(
                        claim
                            .targets
                            .iter()
                            .flat_map(|name| groups.targets_of(name))
                            .collect(),
                    );
                }
                Err(e) => {
                    // Soon again: once Redis answers, slots whose lease ran out meanwhile
                    // are taken back (and their shards polled) at once, not a heartbeat later.
                    next = every.min(RETRY_AFTER_ERROR);
                    metrics::error_event("redis", "poller slots", &e);
                    if last_ok.is_none_or(|at| at.elapsed() >= self.lease) {
                        // Our leases ran out: others may hold these slots now.
                        ownership.set(Owned::new());
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                _ = shutdown.cancelled() => {}
            }
        }
        ownership.set(Owned::new());
        Ok(())
    }

    /// Hands back every slot at once (after the pollers stopped), bounded to 2 s; leaves
    /// the registration alone when another process holds it.
    pub async fn release(con: &mut Conn, keys: &Keys, instance: &str, nonce: &str) {
        let released = tokio::time::timeout(
            Duration::from_secs(2),
            scripts::release_slots(con, keys, Registrant { instance, nonce }),
        )
        .await;
        match released {
            Ok(Ok(Some(n))) => tracing::info!(slots = n, "poller slots handed back"),
            Ok(Ok(None)) => tracing::info!(
                "this instance id's registration belongs to another process: left to it"
            ),
            Ok(Err(e)) => metrics::error_event("redis", "poller slots", &e),
            Err(_) => tracing::warn!("could not hand the poller slots back in time; they lapse"),
        }
    }
}

/// On Kubernetes (`KUBERNETES_SERVICE_HOST` set), the pod's name: `POD_NAME` when set,
/// else `HOSTNAME` (the pod name unless the pod sets another host name). Stable across
/// restarts of the container in its pod, unique among running pods.
fn pod_name(env: impl Fn(&str) -> Option<String>) -> Option<String> {
    env("KUBERNETES_SERVICE_HOST")?;
    ["POD_NAME", "HOSTNAME"]
        .into_iter()
        .filter_map(&env)
        .find(|name| valid_instance_id(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_dealt_in_groups_named_by_their_members() {
        let lanes: Vec<TargetId> = (0..1000).map(TargetId::Lane).collect();
        let groups = LaneGroups::of(&lanes);
        let names: Vec<String> = groups.names().collect();
        assert_eq!(names.len(), LANE_GROUPS as usize);
        let all: usize = names
            .iter()
            .map(|n| groups.targets_of(&format!("{n}#1")).len())
            .sum();
        assert_eq!(all, 1000, "every lane in one group");
        assert_eq!(groups.targets_of("shard:3"), [TargetId::Shard(3)]);
        // A daemon without lane 64 names group 0 differently: each gets dealt apart.
        let fewer = LaneGroups::of(&lanes[..64]);
        assert!(fewer.names().all(|n| n.starts_with("lanes:")));
        assert_ne!(
            fewer.names().next(),
            groups.names().next(),
            "group 0 holds 0 and 64 here, 0 alone there"
        );
        assert!(
            LaneGroups::of(&[TargetId::Shard(1)])
                .names()
                .next()
                .is_none()
        );
    }

    #[test]
    fn slot_names_round_trip() {
        for target in [
            TargetId::Shard(7),
            TargetId::Source("{raw}:events:a".to_owned()),
            TargetId::Lane(56),
        ] {
            assert_eq!(target_of(&slot_name(&target)), Some(target));
        }
        assert_eq!(target_of("nonsense"), None);
    }

    #[test]
    fn the_default_instance_id_is_the_pod_name_on_kubernetes_only() {
        fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
            move |name| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        }
        let k8s = ("KUBERNETES_SERVICE_HOST", "10.0.0.1");
        assert_eq!(pod_name(env(&[("HOSTNAME", "web-1")])), None);
        assert_eq!(
            pod_name(env(&[k8s, ("HOSTNAME", "zdelay-7d9f-x2q4")])).as_deref(),
            Some("zdelay-7d9f-x2q4")
        );
        assert_eq!(
            pod_name(env(&[
                k8s,
                ("HOSTNAME", "node-a"),
                ("POD_NAME", "zdelay-0")
            ]))
            .as_deref(),
            Some("zdelay-0")
        );
        // Not a valid id: the random default instead.
        assert_eq!(pod_name(env(&[k8s, ("HOSTNAME", "a b")])), None);
        assert_eq!(Leases::instance_id(Some("worker-1")), "worker-1");
    }
}
