//! The console's pages: one static bundle (`ui/index.html`, `app.js`, `app.css`) compiled
//! into the binary. The page renders what `/api/…` answers, so it shows exactly what
//! scripts and the CLI see. Every URL it uses is relative, so it works under
//! `admin.ui_prefix` and behind a proxy that adds a prefix of its own; nothing is loaded
//! from elsewhere (the Content-Security-Policy says so too).

use axum::Router;
use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");

/// Scripts and styles from this origin only, no framing (clickjacking), no form posts.
const POLICY: &str = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; \
                      form-action 'none'; base-uri 'none'";

fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, HeaderValue::from_static(kind)),
            (CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY)),
            (CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                HeaderName::from_static("x-content-type-options"),
                HeaderValue::from_static("nosniff"),
            ),
        ],
        body,
    )
        .into_response()
}

/// The pages under `prefix` (empty or `/something`): `<prefix>/` and its assets.
pub fn routes<S: Clone + Send + Sync + 'static>(prefix: &str) -> Router<S> {
    let mut router = Router::new()
        .route(
            &format!("{prefix}/"),
            get(|| async { asset(INDEX, "text/html; charset=utf-8") }),
        )
        .route(
            &format!("{prefix}/app.js"),
            get(|| async { asset(SCRIPT, "text/javascript; charset=utf-8") }),
        )
        .route(
            &format!("{prefix}/app.css"),
            get(|| async { asset(STYLE, "text/css; charset=utf-8") }),
        );
    if !prefix.is_empty() {
        // Relative URLs need the trailing slash.
        let to = format!("{prefix}/");
        router = router.route(prefix, get(move || async move { Redirect::permanent(&to) }));
    }
    router
}
