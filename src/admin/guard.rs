//! Who may read and act through the console. Every console request passes [`Policy::site`]
//! (a layer on the console's routes); every `/api/…` handler asks [`Policy::check`] for the
//! [`Access`] it needs before it reads or acts.
//!
//! - **Public reads** (counts, forecast, schedule timing): open while `admin.public_reads`
//!   (the default), else they need the token.
//! - **Payload reads** (a job, the dead letters: payloads, headers, reasons): need the token
//!   when `admin.token` is set. Without one they are served only on a loopback
//!   `admin.listen` — only processes on the host reach it (and the `Host` check below keeps
//!   browsers' pages elsewhere out); a listener on the network without a token serves none.
//! - **Actions** (`POST`): need the token; without one the console is read-only. HTML form
//!   bodies (`application/x-www-form-urlencoded`, `multipart/form-data`, `text/plain`, the
//!   only kinds a cross-site form sends without a preflight) are refused.
//! - **Site** (every console request): the `Host` must be an IP address, `localhost` or one of
//!   `admin.allowed_hosts` — a page on a DNS name its author points at 127.0.0.1 (DNS
//!   rebinding) names that name. API requests a browser marks as cross-site
//!   (`Sec-Fetch-Site: cross-site` or `same-site`), or whose `Origin` is not this host, are
//!   refused too; pages are not (a link from elsewhere may open the console).
//!
//! The token travels as `Authorization: Bearer <admin.token>`, compared in constant time.
//! Browsers never attach that header on their own, so a cross-site page cannot borrow an
//! operator's session. Every refusal is answered 403 and none says what the token is.

use axum::http::HeaderMap;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN};
use std::net::IpAddr;
use zdelay_core::config::{AdminConfig, Secret};

/// What a console request wants to do, which decides what it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Counts, forecast, schedule timing.
    PublicRead,
    /// Payloads, headers, dead letters.
    PayloadRead,
    /// A `POST` that changes something.
    Action,
    /// A producer's call (the HTTP enqueue): needs `admin.producer_token`, which grants
    /// nothing else, as the operator's token does not grant this.
    Produce,
}

/// Why a request was refused (the 403 body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    ReadOnly,
    NoProducers,
    PayloadsNeedToken,
    NoToken,
    WrongToken,
    CrossSite(String),
    ForeignHost(String),
    FormBody(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::ReadOnly => {
                f.write_str("the console is read-only: admin.token is not configured")
            }
            Refused::NoProducers => {
                f.write_str("the HTTP enqueue is off: admin.producer_token is not configured")
            }
            Refused::PayloadsNeedToken => f.write_str(
                "payloads and dead letters are not served on a non-loopback admin.listen \
                 without admin.token",
            ),
            Refused::NoToken => f.write_str(
                "this needs Authorization: Bearer <admin.token> (the HTTP enqueue: \
                 <admin.producer_token>)",
            ),
            Refused::WrongToken => f.write_str("wrong token"),
            Refused::CrossSite(why) => write!(f, "cross-site request refused: {why}"),
            Refused::ForeignHost(host) => write!(
                f,
                "Host {host} is not this console's: add its name to admin.allowed_hosts"
            ),
            Refused::FormBody(kind) => write!(f, "form bodies are refused ({kind})"),
        }
    }
}

/// The console's access rules, from `[admin]`.
#[derive(Clone)]
pub struct Policy {
    token: Option<Secret>,
    producer_token: Option<Secret>,
    public_reads: bool,
    /// `admin.listen` is a loopback address: only this host reaches it.
    loopback: bool,
    allowed_hosts: Vec<String>,
}

impl Policy {
    pub fn new(admin: &AdminConfig) -> Self {
        Policy {
            token: admin.token.clone(),
            producer_token: admin.producer_token.clone(),
            public_reads: admin.public_reads,
            loopback: admin.listen.ip().is_loopback(),
            allowed_hosts: admin.allowed_hosts.clone(),
        }
    }

    pub fn actions_enabled(&self) -> bool {
        self.token.is_some()
    }

    /// How payload reads are served: `token` (with the token), `open` (without a token, on
    /// a loopback listener) or `off`.
    pub fn payload_reads(&self) -> &'static str {
        match (&self.token, self.loopback) {
            (Some(_), _) => "token",
            (None, true) => "open",
            (None, false) => "off",
        }
    }

    /// Whether the request may do `access`.
    pub fn check(&self, headers: &HeaderMap, access: Access) -> Result<(), Refused> {
        let token = match (access, &self.token, &self.producer_token) {
            (Access::Produce, _, None) => return Err(Refused::NoProducers),
            (Access::Produce, _, Some(producers)) => producers,
            (Access::PublicRead, _, _) if self.public_reads => return Ok(()),
            (Access::PayloadRead, None, _) if self.loopback => return Ok(()),
            (Access::PayloadRead, None, _) => return Err(Refused::PayloadsNeedToken),
            (_, None, _) => return Err(Refused::ReadOnly),
            (_, Some(token), _) => token,
        };
        if matches!(access, Access::Action | Access::Produce)
            && let Some(kind) = header(headers, CONTENT_TYPE.as_str())
        {
            let mime = kind
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            if matches!(
                mime.as_str(),
                "application/x-www-form-urlencoded" | "multipart/form-data" | "text/plain"
            ) {
                return Err(Refused::FormBody(mime));
            }
        }
        let given = header(headers, AUTHORIZATION.as_str())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or(Refused::NoToken)?;
        if !same(given.as_bytes(), token.expose().as_bytes()) {
            return Err(Refused::WrongToken);
        }
        Ok(())
    }

    /// Whether a request may reach the console at all: its `Host`, and for the API (`api`)
    /// whether a browser sent it from another site.
    pub fn site(&self, headers: &HeaderMap, api: bool) -> Result<(), Refused> {
        // A request without Host is no browser's (HTTP/1.0 from a script).
        let host = header(headers, HOST.as_str());
        if let Some(host) = host
            && !self.host_allowed(host)
        {
            return Err(Refused::ForeignHost(host.to_owned()));
        }
        if !api {
            return Ok(());
        }
        if let Some(site) = header(headers, "sec-fetch-site")
            && !matches!(site, "same-origin" | "none")
        {
            return Err(Refused::CrossSite(format!("Sec-Fetch-Site: {site}")));
        }
        if let Some(origin) = header(headers, ORIGIN.as_str()) {
            let host = host.unwrap_or("");
            let origin_host = origin.split_once("://").map_or("", |(_, rest)| rest);
            if origin_host != host {
                return Err(Refused::CrossSite(format!(
                    "Origin {origin} is not this host ({host})"
                )));
            }
        }
        Ok(())
    }

    /// An IP address, `localhost`, or a configured name; the port does not matter.
    fn host_allowed(&self, host: &str) -> bool {
        let name = match host.strip_prefix('[') {
            // [v6]:port
            Some(rest) => rest.split_once(']').map_or(rest, |(addr, _)| addr),
            None => host.rsplit_once(':').map_or(host, |(name, _)| name),
        };
        name.parse::<IpAddr>().is_ok()
            || name.eq_ignore_ascii_case("localhost")
            || self
                .allowed_hosts
                .iter()
                .any(|allowed| allowed.eq_ignore_ascii_case(name))
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Equality whose time does not depend on where the inputs differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef";

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    fn policy(token: Option<&str>, listen: &str) -> Policy {
        Policy::new(&AdminConfig {
            token: token.map(Secret::from),
            listen: listen.parse().unwrap(),
            allowed_hosts: vec!["zdelay.example.com".into()],
            ..AdminConfig::default()
        })
    }

    fn check_with(pairs: &[(&'static str, &str)], access: Access) -> Result<(), Refused> {
        policy(Some(TOKEN), "127.0.0.1:9464").check(&headers(pairs), access)
    }

    #[test]
    fn the_token_is_required_and_compared() {
        let bearer = format!("Bearer {TOKEN}");
        let read_only = policy(None, "127.0.0.1:9464");
        assert_eq!(
            read_only.check(&headers(&[("authorization", &bearer)]), Access::Action),
            Err(Refused::ReadOnly)
        );
        for access in [Access::Action, Access::PayloadRead] {
            assert_eq!(check_with(&[], access), Err(Refused::NoToken));
            assert_eq!(
                check_with(&[("authorization", "Bearer 0123456789abcdeX")], access),
                Err(Refused::WrongToken)
            );
            assert_eq!(
                check_with(&[("authorization", "Basic abc")], access),
                Err(Refused::NoToken)
            );
            assert_eq!(check_with(&[("authorization", &bearer)], access), Ok(()));
        }
        assert_eq!(check_with(&[], Access::PublicRead), Ok(()));
        assert_eq!(
            check_with(
                &[
                    ("authorization", &bearer),
                    ("content-type", "application/json")
                ],
                Access::Action
            ),
            Ok(())
        );
    }

    #[test]
    fn public_reads_can_be_closed() {
        let closed = Policy::new(&AdminConfig {
            token: Some(Secret::from(TOKEN)),
            public_reads: false,
            ..AdminConfig::default()
        });
        assert_eq!(
            closed.check(&HeaderMap::new(), Access::PublicRead),
            Err(Refused::NoToken)
        );
        let bearer = format!("Bearer {TOKEN}");
        assert_eq!(
            closed.check(&headers(&[("authorization", &bearer)]), Access::PublicRead),
            Ok(())
        );
    }

    #[test]
    fn payloads_without_a_token_only_on_loopback() {
        let none = HeaderMap::new();
        let local = policy(None, "127.0.0.1:9464");
        assert_eq!(local.check(&none, Access::PayloadRead), Ok(()));
        assert_eq!(local.payload_reads(), "open");
        let v6 = policy(None, "[::1]:9464");
        assert_eq!(v6.check(&none, Access::PayloadRead), Ok(()));
        let exposed = policy(None, "0.0.0.0:9464");
        assert_eq!(
            exposed.check(&none, Access::PayloadRead),
            Err(Refused::PayloadsNeedToken)
        );
        assert_eq!(exposed.payload_reads(), "off");
        assert_eq!(exposed.check(&none, Access::PublicRead), Ok(()));
        assert_eq!(policy(Some(TOKEN), "0.0.0.0:9464").payload_reads(), "token");
    }

    #[test]
    fn form_bodies_are_refused_for_actions_even_with_the_token() {
        let bearer = format!("Bearer {TOKEN}");
        for kind in [
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "Text/Plain;charset=utf-8",
        ] {
            assert!(
                matches!(
                    check_with(
                        &[("authorization", &bearer), ("content-type", kind)],
                        Access::Action
                    ),
                    Err(Refused::FormBody(_))
                ),
                "{kind}"
            );
        }
    }

    #[test]
    fn foreign_hosts_and_cross_site_requests_are_refused() {
        let p = policy(Some(TOKEN), "127.0.0.1:9464");
        let site = |pairs: &[(&'static str, &str)], api| p.site(&headers(pairs), api);
        for host in [
            "127.0.0.1:9464",
            "127.0.0.1",
            "[::1]:9464",
            "10.1.2.3:80",
            "localhost:9464",
            "LOCALHOST",
            "zdelay.example.com",
            "ZDelay.Example.com:443",
        ] {
            assert_eq!(site(&[("host", host)], true), Ok(()), "{host}");
        }
        for host in ["evil.example:9464", "localhost.evil.example", "example.com"] {
            assert!(
                matches!(site(&[("host", host)], false), Err(Refused::ForeignHost(_))),
                "{host}"
            );
        }
        assert_eq!(site(&[], true), Ok(()), "no Host: not a browser");
        // A script (curl) sends neither Origin nor Sec-Fetch-Site; a page of its own origin
        // may send both.
        assert_eq!(
            site(
                &[
                    ("host", "127.0.0.1:9464"),
                    ("origin", "http://127.0.0.1:9464"),
                    ("sec-fetch-site", "same-origin"),
                ],
                true
            ),
            Ok(())
        );
        for pairs in [
            [("host", "h:1"), ("sec-fetch-site", "cross-site")],
            [("host", "h:1"), ("sec-fetch-site", "same-site")],
            [("host", "127.0.0.1:1"), ("origin", "http://evil.example")],
            [("host", "127.0.0.1:1"), ("origin", "null")],
        ] {
            let mut p = policy(Some(TOKEN), "127.0.0.1:9464");
            p.allowed_hosts.push("h".into());
            assert!(
                matches!(p.site(&headers(&pairs), true), Err(Refused::CrossSite(_))),
                "{pairs:?}"
            );
            assert_eq!(p.site(&headers(&pairs), false), Ok(()), "pages: {pairs:?}");
        }
    }

    #[test]
    fn refusals_never_show_the_token() {
        for r in [
            Refused::ReadOnly,
            Refused::PayloadsNeedToken,
            Refused::NoToken,
            Refused::WrongToken,
            Refused::CrossSite("x".into()),
            Refused::ForeignHost("x".into()),
            Refused::FormBody("text/plain".into()),
        ] {
            assert!(!r.to_string().contains(TOKEN));
        }
    }
}
