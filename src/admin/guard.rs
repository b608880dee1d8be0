//! Who may act through the console: every `POST /api/…` passes [`check`] before it runs.
//!
//! - No `admin.token` configured: the console is read-only, every action is refused.
//! - `Authorization: Bearer <admin.token>` must match (compared in constant time). Browsers
//!   never attach such a header on their own, so a cross-site page cannot borrow an
//!   operator's session; the checks below refuse cross-site requests besides.
//! - CSRF: a request a browser marks as cross-site (`Sec-Fetch-Site: cross-site` or
//!   `same-site`), or whose `Origin` is not this host, is refused; so are HTML form bodies
//!   (`application/x-www-form-urlencoded`, `multipart/form-data`, `text/plain`), the only
//!   kinds a cross-site form can send without a preflight.
//!
//! Every refusal is answered 403 and none says what the token is.

use axum::http::HeaderMap;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN};
use zdelay_client::config::Secret;

/// Why an action was refused (the 403 body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    ReadOnly,
    NoToken,
    WrongToken,
    CrossSite(String),
    FormBody(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::ReadOnly => {
                f.write_str("the console is read-only: admin.token is not configured")
            }
            Refused::NoToken => f.write_str("actions need Authorization: Bearer <admin.token>"),
            Refused::WrongToken => f.write_str("wrong token"),
            Refused::CrossSite(why) => write!(f, "cross-site request refused: {why}"),
            Refused::FormBody(kind) => write!(f, "form bodies are refused ({kind})"),
        }
    }
}

/// Checks an action's request against the configured token and the CSRF rules.
pub fn check(headers: &HeaderMap, token: Option<&Secret>) -> Result<(), Refused> {
    let Some(token) = token else {
        return Err(Refused::ReadOnly);
    };
    let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = header("sec-fetch-site")
        && !matches!(site, "same-origin" | "none")
    {
        return Err(Refused::CrossSite(format!("Sec-Fetch-Site: {site}")));
    }
    if let Some(origin) = header(ORIGIN.as_str()) {
        let host = header(HOST.as_str()).unwrap_or("");
        let origin_host = origin.split_once("://").map_or("", |(_, rest)| rest);
        if origin_host != host {
            return Err(Refused::CrossSite(format!(
                "Origin {origin} is not this host ({host})"
            )));
        }
    }
    if let Some(kind) = header(CONTENT_TYPE.as_str()) {
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
    let given = header(AUTHORIZATION.as_str())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(Refused::NoToken)?;
    if !same(given.as_bytes(), token.expose().as_bytes()) {
        return Err(Refused::WrongToken);
    }
    Ok(())
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

    fn check_with(pairs: &[(&'static str, &str)]) -> Result<(), Refused> {
        check(&headers(pairs), Some(&Secret::from(TOKEN)))
    }

    #[test]
    fn the_token_is_required_and_compared() {
        let bearer = format!("Bearer {TOKEN}");
        assert_eq!(
            check(&headers(&[("authorization", &bearer)]), None),
            Err(Refused::ReadOnly)
        );
        assert_eq!(check_with(&[]), Err(Refused::NoToken));
        assert_eq!(
            check_with(&[("authorization", "Bearer 0123456789abcdeX")]),
            Err(Refused::WrongToken)
        );
        assert_eq!(
            check_with(&[("authorization", "Basic abc")]),
            Err(Refused::NoToken)
        );
        assert_eq!(check_with(&[("authorization", &bearer)]), Ok(()));
        // A script (curl) sends neither Origin nor Sec-Fetch-Site.
        assert_eq!(
            check_with(&[
                ("authorization", &bearer),
                ("host", "127.0.0.1:9464"),
                ("origin", "http://127.0.0.1:9464"),
                ("sec-fetch-site", "same-origin"),
                ("content-type", "application/json"),
            ]),
            Ok(())
        );
    }

    #[test]
    fn cross_site_and_form_requests_are_refused_even_with_the_token() {
        let bearer = format!("Bearer {TOKEN}");
        let refused = |pairs: &[(&'static str, &str)]| {
            let mut all = vec![("authorization", bearer.as_str()), ("host", "h:1")];
            all.extend_from_slice(pairs);
            check_with(&all)
        };
        assert!(matches!(
            refused(&[("sec-fetch-site", "cross-site")]),
            Err(Refused::CrossSite(_))
        ));
        assert!(matches!(
            refused(&[("sec-fetch-site", "same-site")]),
            Err(Refused::CrossSite(_))
        ));
        assert!(matches!(
            refused(&[("origin", "http://evil.example")]),
            Err(Refused::CrossSite(_))
        ));
        assert!(matches!(
            refused(&[("origin", "null")]),
            Err(Refused::CrossSite(_))
        ));
        for kind in [
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "Text/Plain;charset=utf-8",
        ] {
            assert!(
                matches!(
                    refused(&[("content-type", kind)]),
                    Err(Refused::FormBody(_))
                ),
                "{kind}"
            );
        }
        assert_eq!(refused(&[("origin", "http://h:1")]), Ok(()));
    }

    #[test]
    fn refusals_never_show_the_token() {
        for r in [
            Refused::ReadOnly,
            Refused::NoToken,
            Refused::WrongToken,
            Refused::CrossSite("x".into()),
            Refused::FormBody("text/plain".into()),
        ] {
            assert!(!r.to_string().contains(TOKEN));
        }
    }
}
