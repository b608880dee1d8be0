//! Test harness: real servers and the real binary, each owned by a guard that stops it on
//! drop (also when the test panics), and condition waits with deadlines instead of sleeps.

#![allow(dead_code)]

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port (bound then released; the OS does not hand it out again at once).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
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

/// A private `redis-server` on a free port, stopped on drop.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Extra `redis-server` arguments, e.g. `["--notify-keyspace-events", "Kz"]`.
    pub fn start_with(extra: &[&str]) -> Self {
        let mut server = RedisServer {
            port: free_port(),
            dir: tempfile::tempdir().expect("a temp dir"),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--logfile", "redis.log"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (apt-get install redis-server)");
        self.child = Some(child);
        let url = self.url();
        wait_for(
            "redis-server to answer PING",
            Duration::from_secs(10),
            || {
                redis::Client::open(url.as_str())
                    .and_then(|c| c.get_connection())
                    .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                    .is_ok()
            },
        );
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

    /// Runs a CLI command with this config and returns its output.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(zdelay_bin())
            .arg("--config")
            .arg(&self.path)
            .args(args)
            .env("ZDELAY_LOG", "warn")
            .output()
            .expect("zdelay runs")
    }
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
        let dir = tempfile::tempdir().expect("a temp dir");
        let log = dir.path().join("zdelay.log");
        let child = Command::new(zdelay_bin())
            .arg("--config")
            .arg(&config.path)
            .arg("run")
            .env("ZDELAY_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("daemon log file"))
            .spawn()
            .expect("zdelay run starts");
        Daemon {
            child: Some(child),
            log,
            admin_port: config.admin_port,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("daemon running").id() as i32
    }

    /// HTTP GET on the admin port: (status, body), or None when nothing answers.
    pub fn admin_get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.admin_port, path)
    }

    pub fn wait_ready(&self) {
        wait_for("zdelay /readyz = 200", Duration::from_secs(20), || {
            matches!(self.admin_get("/readyz"), Some((200, _)))
        });
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
                "daemon did not exit within {timeout:?}"
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

/// Reads a whole list.
pub fn lrange(con: &mut redis::Connection, key: &str) -> Vec<Vec<u8>> {
    redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(con)
        .expect("LRANGE")
}

pub fn llen(con: &mut redis::Connection, key: &str) -> usize {
    redis::cmd("LLEN").arg(key).query(con).expect("LLEN")
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
