//! The HTTP enqueue (`POST /api/jobs`, `DELETE /api/jobs/{id}`, `POST
//! /api/jobs/{id}/reschedule`) on a real daemon: its own token, one job or JSON lines with one
//! answer per line, `Idempotency-Key`, errors that name what is wrong, a body limit, and the
//! jobs stored and delivered.

use crate::common::{Daemon, RedisServer, TestConfig, http_send, llen, wait_for};
use serde_json::Value;
use std::time::Duration;

const PRODUCERS: &str = "producers-secret-0123";
const OPERATORS: &str = "operators-secret-0123";

fn config(redis: &RedisServer, tokens: &str) -> TestConfig {
    TestConfig::new(
        &redis.url(),
        4,
        &format!(
            "{tokens}\n[[routes]]\nname = \"emails\"\nsink = \"local\"\ntarget = \"q:emails\"\n"
        ),
    )
}

/// (status, JSON body) of a request with `token` (if any) and a content type.
fn call(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    kind: &str,
    body: &[u8],
    extra: &[&str],
) -> (u16, Value) {
    let auth = token.map(|t| format!("Authorization: Bearer {t}"));
    let kind = format!("Content-Type: {kind}");
    let mut headers: Vec<&str> = vec![&kind];
    headers.extend(auth.as_deref());
    headers.extend(extra);
    let (status, text) = http_send(port, method, path, &headers, body).expect("an HTTP answer");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[test]
fn the_http_enqueue_takes_a_job_or_json_lines_behind_its_own_token() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        &format!("producer_token = \"{PRODUCERS}\"\ntoken = \"{OPERATORS}\""),
    );
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let json = "application/json";
    let post = |token: Option<&str>, body: &str, extra: &[&str]| {
        call(
            port,
            "POST",
            "/api/jobs",
            token,
            json,
            body.as_bytes(),
            extra,
        )
    };
    let job = r#"{"dest":"emails","payload":"hi","in":"1h","headers":{"tenant":"acme"}}"#;

    // Only the producers' token enqueues; the operators' does not, nor does none.
    assert_eq!(post(None, job, &[]).0, 403);
    let (status, body) = post(Some(OPERATORS), job, &[]);
    assert_eq!(status, 403, "{body}");
    let (status, body) = post(Some(PRODUCERS), job, &[]);
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["outcome"], "added");
    let id = body["id"].as_str().unwrap().to_owned();
    // ... and the producers' token performs no operator action.
    let (status, _) = call(
        port,
        "POST",
        &format!("/api/jobs/{id}/cancel"),
        Some(PRODUCERS),
        json,
        b"",
        &[],
    );
    assert_eq!(status, 403);

    // Idempotency-Key is the job's id: a retried request keeps the job it made.
    let (status, body) = post(Some(PRODUCERS), job, &["Idempotency-Key: order-7"]);
    assert_eq!(
        (status, body["id"].as_str()),
        (201, Some("order-7")),
        "{body}"
    );
    let (status, body) = post(Some(PRODUCERS), job, &["Idempotency-Key: order-7"]);
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("kept")),
        "{body}"
    );
    let (status, body) = post(Some(PRODUCERS), job, &["Idempotency-Key: order-7"]);
    assert_eq!(status, 200, "{body}");
    let (status, body) = call(
        port,
        "POST",
        "/api/jobs?on_conflict=error",
        Some(PRODUCERS),
        json,
        job.as_bytes(),
        &["Idempotency-Key: order-7"],
    );
    assert_eq!(status, 409, "{body}");

    // Stored byte for byte as the Rust library stores the same job.
    let at = crate::common::redis_now_ms(&mut redis.conn()) + 3_600_000;
    let same = format!(
        r#"{{"dest":"emails","payload":"same","at":{at},"id":"{{s}}:http","headers":{{"tenant":"acme","Traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}},"max_attempts":3,"max_lateness":"30s"}}"#
    );
    assert_eq!(post(Some(PRODUCERS), &same, &[]).0, 201);
    let rt = crate::common::runtime();
    let lib = rt
        .block_on(zdelay::Client::open(&redis.url()))
        .expect("library");
    let job = zdelay::NewJob::new("emails", "same")
        .id("{s}:lib")
        .at(at)
        .header("tenant", "acme")
        .header(
            "Traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .max_attempts(3)
        .max_lateness(Duration::from_secs(30));
    rt.block_on(lib.enqueue(job, zdelay::OnConflict::Replace))
        .expect("enqueue");
    let keys = zdelay::keys::Keys::new("zdelay", 4);
    let shard = keys.shard(keys.shard_of("{s}:http"));
    let stored = |id: &str| -> (Vec<u8>, f64, String) {
        redis::pipe()
            .hget(&shard.jobs, id)
            .zscore(&shard.due, id)
            .hget(&shard.max_lateness, id)
            .query(&mut redis.conn())
            .unwrap()
    };
    assert_eq!(stored("{s}:http"), stored("{s}:lib"));

    // Bad input: named, and nothing written.
    for (bad, says) in [
        (
            r#"{"dest":"emails","payload":"x","extra":1}"#,
            "unknown field `extra`",
        ),
        (r#"{"dest":"nowhere","payload":"x"}"#, "unknown destination"),
        (
            r#"{"dest":"emails","payload":"x","at":1795250000}"#,
            "looks like epoch seconds",
        ),
        (
            r#"{"dest":"emails","payload":"x","headers":{"n":1}}"#,
            "headers",
        ),
        ("not json", "expected"),
    ] {
        let (status, body) = post(Some(PRODUCERS), bad, &[]);
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains(says),
            "{bad}: {body}"
        );
    }

    // JSON lines: one answer per line, the bad one alone refused, the good ones delivered.
    let lines = "{\"dest\":\"emails\",\"payload\":\"a\"}\n{\"dest\":\"emails\"}\n\n{\"dest\":\"emails\",\"payload\":\"b\",\"id\":\"line-4\"}\n";
    let (status, body) = call(
        port,
        "POST",
        "/api/jobs",
        Some(PRODUCERS),
        "application/x-ndjson",
        lines.as_bytes(),
        &[],
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (body["enqueued"].as_u64(), body["failed"].as_u64()),
        (Some(2), Some(1)),
        "{body}"
    );
    let results = body["results"].as_array().unwrap();
    assert_eq!(results[1]["line"], 2);
    assert!(
        results[1]["error"].as_str().unwrap().contains("payload"),
        "{body}"
    );
    assert_eq!(
        (results[2]["line"].as_u64(), results[2]["id"].as_str()),
        (Some(4), Some("line-4"))
    );
    let mut con = redis.conn();
    wait_for("the two lines delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:emails") == 2
    });

    // Reschedule and cancel by id.
    let path = format!("/api/jobs/{id}/reschedule");
    let (status, body) = call(
        port,
        "POST",
        &path,
        Some(PRODUCERS),
        json,
        br#"{"in":"2h"}"#,
        &[],
    );
    assert_eq!(status, 200, "{body}");
    assert!(body["due_ms"].as_i64().unwrap() > 0);
    let (status, body) = call(
        port,
        "POST",
        "/api/jobs/nope/reschedule",
        Some(PRODUCERS),
        json,
        br#"{"in":"2h"}"#,
        &[],
    );
    assert_eq!(status, 404, "{body}");
    let (status, body) = call(
        port,
        "DELETE",
        &format!("/api/jobs/{id}"),
        Some(PRODUCERS),
        json,
        b"",
        &[],
    );
    assert_eq!(
        (status, body["cancelled"].as_bool()),
        (200, Some(true)),
        "{body}"
    );
    let (status, _) = call(
        port,
        "DELETE",
        &format!("/api/jobs/{id}"),
        Some(PRODUCERS),
        json,
        b"",
        &[],
    );
    assert_eq!(status, 404);

    // A body over the limit is refused before it is read whole.
    let huge = vec![b' '; 17 << 20];
    let (status, _) = call(port, "POST", "/api/jobs", Some(PRODUCERS), json, &huge, &[]);
    assert_eq!(status, 413);
}

#[test]
fn without_a_producer_token_the_http_enqueue_is_off() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{OPERATORS}\""));
    let _daemon = Daemon::start(&config);
    let body = br#"{"dest":"emails","payload":"x"}"#;
    for token in [None, Some(OPERATORS)] {
        let (status, answer) = call(
            config.admin_port,
            "POST",
            "/api/jobs",
            token,
            "application/json",
            body,
            &[],
        );
        assert_eq!(status, 403);
        assert!(
            answer["error"]
                .as_str()
                .unwrap()
                .contains("admin.producer_token"),
            "{answer}"
        );
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*jobs*")
        .query(&mut redis.conn())
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[test]
fn with_the_console_off_the_http_enqueue_is_served_alone() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        &format!("producer_token = \"{PRODUCERS}\"\ntoken = \"{OPERATORS}\"\nconsole = false"),
    );
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let (status, answer) = call(
        port,
        "POST",
        "/api/jobs",
        Some(PRODUCERS),
        "application/json",
        br#"{"dest":"emails","payload":"x","id":"console-off"}"#,
        &[],
    );
    assert_eq!(status, 201, "{answer}");
    let mut con = redis.conn();
    wait_for("the job delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:emails") == 1
    });
    for path in ["/", "/api/stats", "/api/dead"] {
        let (status, answer) = call(port, "GET", path, Some(OPERATORS), "text/plain", b"", &[]);
        assert_eq!(status, 404, "{path}: {answer}");
    }
}
