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

/// The keys of route `emails`' lane, where its jobs and unique windows are kept.
fn lane_keys() -> zdelay::keys::LaneKeys {
    crate::common::lane_keys("emails", "q:emails")
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
    // Remembered a day after delivery by default (its unique window, while it waits).
    let lane = lane_keys();
    let window: Option<u64> = redis::cmd("HGET")
        .arg(&lane.unique)
        .arg("order-7")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(window, Some(24 * 3_600_000));
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
    let stored = |id: &str| -> (Vec<u8>, f64, String, String) {
        redis::pipe()
            .hget(&lane.jobs, id)
            .zscore(&lane.due, id)
            .hget(&lane.maxlate, id)
            .hget(&lane.meta, id)
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

/// Sends `head` (request line and headers, without the blank line), then `body` in pieces of
/// `piece` bytes every `pause`, and reads the answer to its end (the server closing the
/// connection) or `wait`: (the answer, how long it took from the first byte sent). Errors
/// writing are ignored: a server may answer and close before the body is sent.
fn raw_request(
    port: u16,
    head: &str,
    body: &[u8],
    piece: usize,
    pause: Duration,
    wait: Duration,
) -> (std::io::Result<String>, Duration) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.set_read_timeout(Some(wait)).unwrap();
    let started = std::time::Instant::now();
    stream
        .write_all(format!("{head}\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .expect("send the head");
    let mut writer = stream.try_clone().unwrap();
    let pieces: Vec<Vec<u8>> = body.chunks(piece.max(1)).map(<[u8]>::to_vec).collect();
    let sender = std::thread::spawn(move || {
        for p in pieces {
            if writer.write_all(&p).is_err() {
                return;
            }
            std::thread::sleep(pause);
        }
    });
    let mut answer = Vec::new();
    let read = stream.read_to_end(&mut answer);
    let took = started.elapsed();
    // Stop the sender (its next write fails) before joining it.
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let _ = sender.join();
    (
        read.map(|_| String::from_utf8_lossy(&answer).into_owned()),
        took,
    )
}

/// The peak resident set of a process, in kB (`VmHWM` of /proc/<pid>/status).
fn peak_rss_kb(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmHWM line")
}

#[test]
fn the_producer_token_is_checked_before_the_body_is_read() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        &format!("producer_token = \"{PRODUCERS}\"\ntoken = \"{OPERATORS}\""),
    );
    let daemon = Daemon::start(&config);
    let port = config.admin_port;
    let full = 16 << 20;

    // A body announced at the limit and never sent: answered from the headers alone.
    for auth in ["", "\r\nAuthorization: Bearer wrong-token-0123456789"] {
        let head = format!(
            "POST /api/jobs HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {full}{auth}"
        );
        let (answer, _) = raw_request(port, &head, b"", 1, Duration::ZERO, Duration::from_secs(5));
        let answer = answer.expect("an answer without the body being sent");
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    }

    // Bodies at the limit sent at once by callers without the token: none is kept.
    let before = peak_rss_kb(daemon.pid());
    let body = vec![b' '; full];
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                let head = format!(
                    "POST /api/jobs HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {full}"
                );
                let (answer, _) = raw_request(
                    port,
                    &head,
                    &body,
                    1 << 20,
                    Duration::ZERO,
                    Duration::from_secs(20),
                );
                let answer = answer.expect("an answer");
                assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
            });
        }
    });
    let grown_mb = peak_rss_kb(daemon.pid()).saturating_sub(before) / 1024;
    // 8 bodies read would be 128 MiB; what a connection's buffers hold stays far below.
    assert!(
        grown_mb < 32,
        "the daemon's peak memory grew {grown_mb} MiB"
    );
}

#[test]
fn enqueue_requests_are_bounded_in_number_and_in_time() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        &format!(
            "producer_token = \"{PRODUCERS}\"\nenqueue_concurrency = 1\nenqueue_body_timeout = \"2s\""
        ),
    );
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let job = br#"{"dest":"emails","payload":"slow","in":"1h"}"#;
    let head = format!(
        "POST /api/jobs HTTP/1.1\r\nContent-Type: application/json\r\nAuthorization: Bearer {PRODUCERS}\r\nContent-Length: {}",
        job.len() + 1000
    );

    // A client trickling its body holds the only permit: another request is told to retry.
    std::thread::scope(|s| {
        let trickle = || {
            s.spawn(|| {
                raw_request(
                    port,
                    &head,
                    &[b' '; 1000],
                    1,
                    Duration::from_millis(100),
                    Duration::from_secs(30),
                )
            })
        };
        let mut slow = trickle();
        let mut refused = String::new();
        let probe = format!(
            "POST /api/jobs HTTP/1.1\r\nConnection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer {PRODUCERS}\r\nContent-Length: {}",
            job.len()
        );
        wait_for(
            "a request refused while the slow one is served",
            Duration::from_secs(10),
            || {
                let (answer, _) = raw_request(
                    port,
                    &probe,
                    job,
                    job.len(),
                    Duration::ZERO,
                    Duration::from_secs(5),
                );
                refused = answer.unwrap_or_else(|e| e.to_string());
                // A probe served before the slow request was admitted may have made that one the
                // refused request: start it again.
                if !refused.starts_with("HTTP/1.1 503") && slow.is_finished() {
                    slow = trickle();
                }
                refused.starts_with("HTTP/1.1 503")
            },
        );
        let lower = refused.to_ascii_lowercase();
        assert!(lower.contains("\r\nretry-after: 1\r\n"), "{refused}");
        assert!(refused.contains("admin.enqueue_concurrency"), "{refused}");

        // ... until its time to send the body ends: 408, and the connection closed (the
        // read ends before the client has sent everything or its own wait ends).
        let (answer, took) = slow.join().unwrap();
        let answer = answer.expect("the slow request answered and its connection closed");
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
        assert!(answer.contains("admin.enqueue_body_timeout"), "{answer}");
        assert!(took < Duration::from_secs(20), "answered after {took:?}");
    });

    // The permit is back: the next request is served.
    let (status, body) = call(
        port,
        "POST",
        "/api/jobs",
        Some(PRODUCERS),
        "application/json",
        job,
        &[],
    );
    assert_eq!(status, 201, "{body}");
}

#[test]
fn an_idempotency_key_is_remembered_for_its_window_after_delivery() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        &format!("producer_token = \"{PRODUCERS}\"\nidempotency_window = \"3s\""),
    );
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let post = |body: &str, key: &str| {
        let key = format!("Idempotency-Key: {key}");
        call(
            port,
            "POST",
            "/api/jobs",
            Some(PRODUCERS),
            "application/json",
            body.as_bytes(),
            &[&key],
        )
    };
    let mut con = redis.conn();
    let now = |con: &mut redis::Connection| crate::common::redis_now_ms(con);

    // Delivered at once, then sent again: found, nothing made.
    let job = r#"{"dest":"emails","payload":"pay order 9"}"#;
    let (status, body) = post(job, "order-9");
    assert_eq!(
        (status, body["outcome"].as_str()),
        (201, Some("added")),
        "{body}"
    );
    wait_for("the job delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:emails") == 1
    });
    let (status, body) = post(job, "order-9");
    assert_eq!(
        (status, body["id"].as_str(), body["outcome"].as_str()),
        (200, Some("order-9"), Some("duplicate")),
        "{body}"
    );
    // Remembered where every unique window is, for the configured window.
    let ends: f64 = redis::cmd("ZSCORE")
        .arg(&lane_keys().windows)
        .arg("u:order-9")
        .query(&mut con)
        .expect("the key remembered in the lane's windows");
    let left = ends as i64 - now(&mut con);
    assert!((0..=3_000).contains(&left), "window ends in {left} ms");
    // Nothing to wait for: a second job would be delivered within a few idle polls.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        llen(&mut con, "q:emails"),
        1,
        "a retry delivered a second job"
    );

    // Another job under a key in use: refused, the first left as it was.
    let waiting = r#"{"dest":"emails","payload":"first","in":"1h"}"#;
    assert_eq!(post(waiting, "order-10").0, 201);
    let (status, body) = post(waiting, "order-10");
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("kept")),
        "{body}"
    );
    let (status, body) = post(
        r#"{"dest":"emails","payload":"second","in":"1h"}"#,
        "order-10",
    );
    assert_eq!(status, 422, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("order-10"),
        "{body}"
    );
    let rt = crate::common::runtime();
    let lib = rt
        .block_on(zdelay::Client::open(&redis.url()))
        .expect("library");
    let stored = rt
        .block_on(lib.get("order-10"))
        .unwrap()
        .expect("still waiting");
    assert_eq!(stored.envelope.unwrap().payload, b"first");

    // After the window the key is free: the same request makes a new job.
    wait_for("the window over", Duration::from_secs(15), || {
        let (status, body) = post(job, "order-9");
        assert!(matches!(status, 200 | 201), "{body}");
        status == 201
    });
    wait_for("the new job delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:emails") == 2
    });
}

#[test]
fn a_batch_reports_each_line_and_a_retry_under_its_key_duplicates_none() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("producer_token = \"{PRODUCERS}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let send = |lines: &str| {
        call(
            port,
            "POST",
            "/api/jobs",
            Some(PRODUCERS),
            "application/x-ndjson",
            lines.as_bytes(),
            &["Idempotency-Key: import-5"],
        )
    };
    let lines = |fixed: bool| {
        let (second, fourth) = if fixed {
            (
                r#"{"dest":"emails","payload":"b"}"#,
                r#"{"dest":"emails","payload":"d"}"#,
            )
        } else {
            (
                r#"{"dest":"emails"}"#,
                r#"{"dest":"nowhere","payload":"d"}"#,
            )
        };
        format!(
            "{{\"dest\":\"emails\",\"payload\":\"a\"}}\n{second}\n{{\"dest\":\"emails\",\"payload\":\"c\",\"id\":\"own-3\"}}\n{fourth}\n"
        )
    };
    let summary = |body: &serde_json::Value| -> Vec<(u64, String, u64, String)> {
        body["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["line"].as_u64().unwrap(),
                    r["id"].as_str().unwrap_or("").to_owned(),
                    r["status"].as_u64().unwrap(),
                    r["outcome"]
                        .as_str()
                        .or(r["error"].as_str().map(|_| "error"))
                        .unwrap()
                        .to_owned(),
                )
            })
            .collect()
    };
    let row = |line: u64, id: &str, status: u64, what: &str| {
        (line, id.to_owned(), status, what.to_owned())
    };

    // Each line answered: made, or refused with why; a line without an id gets one from the key.
    let (status, body) = send(&lines(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        summary(&body),
        [
            row(1, "import-5:1", 201, "added"),
            row(2, "import-5:2", 400, "error"),
            row(3, "own-3", 201, "added"),
            row(4, "import-5:4", 400, "error"),
        ],
        "{body}"
    );
    assert!(
        body["results"][1]["error"]
            .as_str()
            .unwrap()
            .contains("payload"),
        "{body}"
    );
    assert!(
        body["results"][3]["error"]
            .as_str()
            .unwrap()
            .contains("unknown destination"),
        "{body}"
    );
    assert_eq!(
        (body["enqueued"].as_u64(), body["failed"].as_u64()),
        (Some(2), Some(2))
    );
    let mut con = redis.conn();
    wait_for("two lines delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:emails") == 2
    });

    // The whole batch sent again with its failed lines mended: only those are made.
    let (status, body) = send(&lines(true));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        summary(&body),
        [
            row(1, "import-5:1", 200, "duplicate"),
            row(2, "import-5:2", 201, "added"),
            row(3, "own-3", 200, "duplicate"),
            row(4, "import-5:4", 201, "added"),
        ],
        "{body}"
    );
    wait_for("four lines delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:emails") == 4
    });
    let (_, body) = send(&lines(true));
    assert_eq!(
        body["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["outcome"] == "duplicate")
            .count(),
        4,
        "{body}"
    );
    // As above: more jobs would be delivered within a few idle polls.
    std::thread::sleep(Duration::from_millis(300));
    let mut delivered = crate::common::lrange(&mut con, "q:emails");
    delivered.sort();
    assert_eq!(
        delivered,
        [b"a".to_vec(), b"b".to_vec(), b"c".to_vec(), b"d".to_vec()]
    );
}
