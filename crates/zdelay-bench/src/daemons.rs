//! `--daemons N`: `zdelay run` processes, started for a measurement and stopped after it. The
//! binary is `--zdelay-bin`, else the `zdelay` beside this one (cargo builds both into one
//! directory), else `zdelay` on the `PATH` ([`zdelay_binary`]).
//!
//! Each gets the same generated config ([`daemon_config`]): the bench's Redis or cluster, the
//! scratch namespace and shard count, the bench's poller settings, the one route `bench`
//! onto the scratch list, and its own free admin port on 127.0.0.1. The environment's
//! `ZDELAY_*` variables are not passed on (an override such as `ZDELAY_REDIS__NAMESPACE`
//! would move a daemon off the scratch namespace); the Redis password, when the config has
//! one, is passed as `ZDELAY_REDIS__PASSWORD` instead of being written to the file. Their
//! logs go to files in a private directory, kept (and named) when something failed.
//!
//! Ready means: the registry (`{ns}:instances`) shows exactly N live instances and the bench
//! route's lane polled by as many of them as `poller.per_shard` asks, then one more heartbeat
//! so that every daemon has applied the last plan. Stopped means: SIGTERM to each pid, then its exit, within the
//! shutdown grace (SIGKILL after that, and whenever this struct is dropped with a daemon
//! still running).

use super::load::status;
use super::measure::process_cpu;
use anyhow::{Context, bail};
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use zdelay::stats::Instance;
use zdelay_core::config::Config;
use zdelay_core::keys::Keys;
use zdelay_core::store::{self, Conn};

/// The `zdelay run` config of every bench daemon, as TOML. `batch` is the bench's (the daemon
/// allows up to 1000); the first route is `route` onto `list`, on the local sink; `extra` is
/// appended as it is (more routes and raw sources, for `--mode idle`).
pub(super) fn daemon_config(
    config: &Config,
    batch: usize,
    route: &str,
    list: &str,
    admin: SocketAddr,
    extra: &str,
) -> String {
    // A JSON string is a valid TOML basic string (the same escapes).
    let q = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let d = |d: Duration| q(&humantime::format_duration(d).to_string());
    let (r, p) = (&config.redis, &config.poller);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "# written by zdelay-bench --daemons; deleted after the run\n"
    );
    let _ = writeln!(t, "[redis]");
    let _ = writeln!(t, "url = {}", q(&r.url));
    if !r.cluster_nodes.is_empty() {
        let nodes: Vec<String> = r.cluster_nodes.iter().map(|n| q(n)).collect();
        let _ = writeln!(t, "cluster_nodes = [{}]", nodes.join(", "));
    }
    let _ = writeln!(t, "namespace = {}", q(&r.namespace));
    let _ = writeln!(t, "shards = {}", r.shards);
    let _ = writeln!(t);
    let _ = writeln!(t, "[poller]");
    let _ = writeln!(t, "batch = {batch}");
    let _ = writeln!(t, "idle_poll = {}", d(p.idle_poll));
    let _ = writeln!(t, "idle_poll_max = {}", d(p.idle_poll_max));
    let _ = writeln!(t, "max_payload = {}", p.max_payload);
    let _ = writeln!(t, "lease = {}", d(p.lease));
    let _ = writeln!(t, "sink_concurrency = {}", p.sink_concurrency);
    let _ = writeln!(t, "per_shard = {}", p.per_shard);
    let _ = writeln!(t, "slot_lease = {}", d(p.slot_lease));
    let _ = writeln!(t, "shutdown_grace = {}", d(p.shutdown_grace));
    let _ = writeln!(t, "stats_interval = {}\n", d(p.stats_interval));
    let _ = writeln!(t, "[admin]");
    let _ = writeln!(t, "listen = {}\n", q(&admin.to_string()));
    let _ = writeln!(t, "[[routes]]");
    let _ = writeln!(t, "name = {}", q(route));
    let _ = writeln!(t, "sink = {}", q(zdelay_core::config::LOCAL_SINK));
    let _ = writeln!(t, "target = {}", q(list));
    t.push_str(extra);
    t
}

/// Whether the registry shows exactly `n` live instances and the bench route's lane (its
/// group) polled by `min(per_shard, n)` of them.
pub(super) fn lane_polled(instances: &[Instance], n: usize, per_shard: u8) -> bool {
    let want = (per_shard as usize).min(n);
    let polling = instances
        .iter()
        .filter(|i| i.sources.iter().any(|s| s.starts_with("lane")))
        .count();
    instances.len() == n && polling == want
}

/// A free TCP port on 127.0.0.1 (free when asked; the daemon binds it a moment later).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

pub(super) struct Daemons {
    children: Vec<Child>,
    /// Each daemon's admin address (`/metrics`).
    admins: Vec<SocketAddr>,
    dir: PathBuf,
    keys: Keys,
    per_shard: u8,
    heartbeat: Duration,
    grace: Duration,
    /// Something went wrong: keep the logs.
    keep_logs: bool,
}

impl Daemons {
    /// Starts `n` daemons of the `zdelay` binary `exe` on `config` (the bench's, already on the
    /// scratch namespace with its route onto `list`).
    pub(super) fn spawn(
        exe: &Path,
        n: u16,
        config: &Config,
        batch: usize,
        route: &str,
        list: &str,
    ) -> anyhow::Result<Daemons> {
        Self::spawn_with(exe, n, config, batch, route, list, "", &[])
    }

    /// [`Daemons::spawn`] with `extra` appended to their config (see [`daemon_config`]), and
    /// `secrets` (settings that never go into a file, as `ZDELAY_…` variables) in their
    /// environment.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn_with(
        exe: &Path,
        n: u16,
        config: &Config,
        batch: usize,
        route: &str,
        list: &str,
        extra: &str,
        secrets: &[(String, String)],
    ) -> anyhow::Result<Daemons> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let dir = std::env::temp_dir().join(format!("zdelay-bench-{}-{stamp}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut daemons = Daemons {
            children: Vec::new(),
            admins: Vec::new(),
            dir,
            keys: Keys::new(&config.redis.namespace, config.redis.shards),
            per_shard: config.poller.per_shard,
            heartbeat: config.poller.slot_lease / 5,
            grace: config.poller.shutdown_grace,
            keep_logs: false,
        };
        for i in 0..n {
            let admin = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let path = daemons.dir.join(format!("daemon-{i}.toml"));
            std::fs::write(
                &path,
                daemon_config(config, batch, route, list, admin, extra),
            )?;
            daemons.admins.push(admin);
            let log = std::fs::File::create(daemons.log_path(i as usize))?;
            let mut cmd = Command::new(exe);
            for (key, _) in std::env::vars_os() {
                if key.to_string_lossy().starts_with("ZDELAY_") {
                    cmd.env_remove(&key);
                }
            }
            if let Some(password) = &config.redis.password {
                cmd.env("ZDELAY_REDIS__PASSWORD", password.expose());
            }
            cmd.envs(secrets.iter().map(|(k, v)| (k, v)));
            let child = cmd
                .arg("--config")
                .arg(&path)
                .arg("run")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| {
                    format!(
                        "starting {} run (build the daemon with `cargo build --release --bin \
                         zdelay`, or name it with --zdelay-bin)",
                        exe.display()
                    )
                })?;
            daemons.children.push(child);
        }
        let pids: Vec<String> = daemons.pids().iter().map(u32::to_string).collect();
        status(&format!(
            "started {n} daemons ({} run, pids {}), logs in {}",
            exe.display(),
            pids.join(" "),
            daemons.dir.display()
        ));
        Ok(daemons)
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir.join(format!("daemon-{i}.log"))
    }

    pub(super) fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    pub(super) fn admins(&self) -> &[SocketAddr] {
        &self.admins
    }

    pub(super) fn count(&self) -> usize {
        self.children.len()
    }

    /// CPU seconds used so far by all the daemons together.
    pub(super) fn cpu(&self) -> f64 {
        self.pids().into_iter().filter_map(process_cpu).sum()
    }

    /// Fails (with the end of its log) when a daemon has exited.
    pub(super) fn check_running(&mut self) -> anyhow::Result<()> {
        for i in 0..self.children.len() {
            if let Some(exit) = self.children[i].try_wait()? {
                self.keep_logs = true;
                bail!(
                    "daemon {i} (pid {}) exited ({exit}); its log ends:\n{}",
                    self.children[i].id(),
                    tail(&self.log_path(i), 15)
                );
            }
        }
        Ok(())
    }

    /// Waits until every daemon is registered and the bench route's lane is polled (see the
    /// module doc); returns how long that took.
    pub(super) async fn wait_ready(
        &mut self,
        con: &mut Conn,
        timeout: Duration,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let n = self.children.len();
        loop {
            self.check_running()?;
            let now = store::server_time_ms(con).await?;
            let last = zdelay::stats::instances(con, &self.keys, now).await?;
            if lane_polled(&last, n, self.per_shard) {
                break;
            }
            if started.elapsed() > timeout {
                self.keep_logs = true;
                let seen: Vec<String> = last
                    .iter()
                    .map(|i| {
                        format!(
                            "{} polls {} shards and {:?}",
                            i.id,
                            i.shards.len(),
                            i.sources
                        )
                    })
                    .collect();
                bail!(
                    "the {n} daemons were not all polling after {timeout:?}: registry shows [{}]; \
                     logs in {}",
                    seen.join(", "),
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The plan is written by whichever heartbeat ran last; each daemon applies it at its
        // own next heartbeat.
        tokio::time::sleep(self.heartbeat + Duration::from_millis(200)).await;
        self.check_running()?;
        status(&format!(
            "{n} live instances, the route's lane polled by {}, after {:.1} s",
            (self.per_shard as usize).min(n),
            started.elapsed().as_secs_f64()
        ));
        Ok(started.elapsed())
    }

    /// SIGTERM to every daemon, then waits for each to exit (SIGKILL after the grace period).
    /// Returns the exit codes (`None`: killed).
    pub(super) async fn stop(mut self) -> Vec<Option<i32>> {
        for pid in self.pids() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let deadline = Instant::now() + self.grace + Duration::from_secs(5);
        let mut codes = vec![None; self.children.len()];
        for (i, child) in self.children.iter_mut().enumerate() {
            loop {
                match child.try_wait() {
                    Ok(Some(exit)) => {
                        codes[i] = exit.code();
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
        if codes.iter().any(|c| *c != Some(0)) {
            self.keep_logs = true;
            status(&format!(
                "daemons exited with {codes:?} (0 expected); logs kept in {}",
                self.dir.display()
            ));
        }
        codes
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        for child in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if self.keep_logs {
            eprintln!("bench: daemon logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Daemons {
    /// Keeps the logs (a measurement failed).
    pub(super) fn keep_logs(&mut self) {
        self.keep_logs = true;
    }
}

/// The last `lines` lines of a file.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The `zdelay` binary the daemons run: `given` (`--zdelay-bin`), else the `zdelay` in this
/// binary's directory, else the one on the `PATH`.
pub(super) fn zdelay_binary(given: Option<&Path>) -> PathBuf {
    if let Some(path) = given {
        return path.to_path_buf();
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| {
            Some(
                exe.parent()?
                    .join(format!("zdelay{}", std::env::consts::EXE_SUFFIX)),
            )
        })
        .filter(|path| path.is_file());
    beside.unwrap_or_else(|| PathBuf::from("zdelay"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemon_config_is_a_valid_config_on_the_scratch_namespace() {
        let mut config = Config::default();
        config.redis.namespace = "zdelay-bench".into();
        config.redis.shards = 8;
        config.poller.idle_poll = Duration::from_millis(50);
        config.poller.idle_poll_max = Duration::from_secs(3);
        config.poller.per_shard = 2;
        config.poller.slot_lease = Duration::from_millis(1500);
        let admin = SocketAddr::from(([127, 0, 0, 1], 40123));
        let text = daemon_config(&config, 500, "bench", "zdelay-bench:\"out\"", admin, "");
        let parsed = zdelay_core::config::from_toml(&text).expect(&text);
        assert_eq!(parsed.redis.url, config.redis.url);
        assert!(parsed.redis.cluster_nodes.is_empty());
        assert_eq!(parsed.redis.namespace, "zdelay-bench");
        assert_eq!(parsed.redis.shards, 8);
        assert_eq!(parsed.poller.batch, 500);
        assert_eq!(parsed.poller.idle_poll, Duration::from_millis(50));
        assert_eq!(parsed.poller.idle_poll_max, Duration::from_secs(3));
        assert_eq!(parsed.poller.per_shard, 2);
        assert_eq!(parsed.poller.slot_lease, Duration::from_millis(1500));
        assert_eq!(parsed.poller.shutdown_grace, config.poller.shutdown_grace);
        assert_eq!(parsed.admin.listen, admin);
        assert_eq!(parsed.routes.len(), 1, "only the bench route: {text}");
        assert_eq!(parsed.routes[0].name, "bench");
        assert_eq!(parsed.routes[0].sink, "local");
        assert_eq!(parsed.routes[0].target, "zdelay-bench:\"out\"");
        assert!(parsed.sources.is_empty());
        assert!(!text.contains("password"));

        config.redis.cluster_nodes = vec!["redis://127.0.0.1:7000".into(), "redis://h:7001".into()];
        let text = daemon_config(&config, 1000, "bench", "zdelay-bench:out", admin, "");
        let parsed = zdelay_core::config::from_toml(&text).expect(&text);
        assert_eq!(parsed.redis.cluster_nodes, config.redis.cluster_nodes);
    }

    fn instance(id: &str, sources: &[&str]) -> Instance {
        Instance {
            id: id.into(),
            shards: vec![0, 1],
            sources: sources.iter().map(|s| s.to_string()).collect(),
            last_seen_ms: 0,
            version: None,
        }
    }

    #[test]
    fn ready_needs_every_instance_and_the_lane_polled() {
        let two = [instance("a", &["lane0"]), instance("b", &[])];
        assert!(lane_polled(&two, 2, 1));
        assert!(!lane_polled(&two, 3, 1), "a third instance is missing");
        assert!(
            !lane_polled(&[instance("a", &[]), instance("b", &[])], 2, 1),
            "the lane unpolled"
        );
        // Two pollers per lane: on two instances, or on the one there is.
        assert!(!lane_polled(&two, 2, 2));
        let both = [instance("a", &["lane0"]), instance("b", &["lane0"])];
        assert!(lane_polled(&both, 2, 2));
        assert!(lane_polled(&[instance("a", &["lane0"])], 1, 2));
    }
}
