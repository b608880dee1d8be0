//! TLS for tests: a throw-away CA made with `openssl` in a temp dir (server and client
//! certificates it signs, and a second CA that signs nothing zdelay trusts), and a
//! `redis-server` listening on TLS only.

use super::{free_port, redis_server_bin, wait_for};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Certificates: `ca.pem` signs `server.pem` (for 127.0.0.1 and localhost) and
/// `client.pem`; `other-ca.pem` signs `other-server.pem`.
pub struct TestCa {
    dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let d = dir.path();
        // Extensions make v3 certificates (webpki refuses v1).
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName = IP:127.0.0.1, DNS:localhost\n",
        )
        .expect("server.ext");
        std::fs::write(d.join("client.ext"), "extendedKeyUsage = clientAuth\n")
            .expect("client.ext");
        for ca in ["ca", "other-ca"] {
            openssl(
                d,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN=zdelay test {ca}"),
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.pem"),
                ],
            );
        }
        for (name, ca, ext) in [
            ("server", "ca", true),
            ("client", "ca", false),
            ("other-server", "other-ca", true),
        ] {
            openssl(
                d,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-subj",
                    &format!("/CN={name}"),
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.csr"),
                ],
            );
            let mut sign = vec!["x509", "-req", "-days", "2", "-in"];
            let csr = format!("{name}.csr");
            let ca_pem = format!("{ca}.pem");
            let ca_key = format!("{ca}.key");
            let out = format!("{name}.pem");
            sign.extend([
                csr.as_str(),
                "-CA",
                &ca_pem,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-out",
                &out,
            ]);
            sign.extend(["-extfile", if ext { "server.ext" } else { "client.ext" }]);
            openssl(d, &sign);
        }
        TestCa { dir }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// `[redis.tls]` TOML trusting this CA; with the client pair when `client` is set.
    pub fn redis_tls_toml(&self, client: bool) -> String {
        let mut toml = format!("[redis.tls]\nca_file = {:?}\n", self.path("ca.pem"));
        if client {
            toml.push_str(&format!(
                "cert_file = {:?}\nkey_file = {:?}\n",
                self.path("client.pem"),
                self.path("client.key")
            ));
        }
        toml
    }

    /// `redis-cli` arguments to talk TLS to a server of this CA (with the client pair).
    pub fn cli_args(&self) -> Vec<String> {
        [
            ("--cacert", "ca.pem"),
            ("--cert", "client.pem"),
            ("--key", "client.key"),
        ]
        .iter()
        .flat_map(|(flag, file)| [flag.to_string(), self.path(file).display().to_string()])
        .chain(["--tls".to_owned()])
        .collect()
    }

    /// `redis-server` arguments serving `cert` (`server` or `other-server`), trusting this
    /// CA's clients.
    pub fn server_args(&self, cert: &str) -> Vec<String> {
        vec![
            "--tls-cert-file".into(),
            self.path(&format!("{cert}.pem")).display().to_string(),
            "--tls-key-file".into(),
            self.path(&format!("{cert}.key")).display().to_string(),
            "--tls-ca-cert-file".into(),
            self.path("ca.pem").display().to_string(),
        ]
    }
}

/// A `redis-server` on TLS only (`--port 0`), stopped on drop.
pub struct TlsRedis {
    pub port: u16,
    _dir: tempfile::TempDir,
    child: Child,
}

impl TlsRedis {
    /// Serves `cert` (see [`TestCa::server_args`]); `extra`: e.g. `--tls-auth-clients yes`.
    pub fn start(ca: &TestCa, cert: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let port = free_port();
        let bin = redis_server_bin();
        let child = Command::new(&bin)
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(["--logfile", "redis.log"])
            .args(ca.server_args(cert))
            .args(["--tls-auth-clients", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{bin} runs: {e}"));
        let server = TlsRedis {
            port,
            _dir: dir,
            child,
        };
        let mut cli = ca.cli_args();
        if cert != "server" {
            cli.push("--insecure".into());
        }
        wait_for(
            "redis-server to answer PING on TLS",
            Duration::from_secs(10),
            || {
                server
                    .cli(&cli, &["PING"])
                    .is_some_and(|out| out.contains("PONG"))
            },
        );
        server
    }

    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// `redis-cli` over TLS (client pair presented); stdout when it succeeds.
    pub fn cli(&self, tls: &[String], args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(tls)
            .args(args)
            .output()
            .ok()?;
        (out.status.success() && !String::from_utf8_lossy(&out.stdout).starts_with("ERR"))
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
