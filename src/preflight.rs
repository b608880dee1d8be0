//! `zdelay check-config --connect`: checks, before a daemon starts, what it will need — the
//! Redis login and the ACL rights it uses, the namespace's layout, and every sink's broker and
//! each route's destination object (Kafka topic, AMQP exchange or queue, JetStream stream
//! and its duplicate window). Each check says what to create or change when it fails.
//!
//! Nothing here writes: rights are tried with commands that change nothing (a `ZREM` of a
//! member no one stores, an `EVALSHA` of a script that does not exist), objects are looked up
//! with passive declares and metadata reads. The sinks' own connection code is used, so a
//! check fails the way the daemon would.

use crate::sinks::{self, amqp::AmqpSink, kafka::KafkaSink, nats::NatsSink};
use serde::Serialize;
use std::time::Duration;
use zdelay_core::config::{Config, SinkConfig, redact_known};
use zdelay_core::keys::Keys;
use zdelay_core::routes::Routes;
use zdelay_core::store::{self, Conn};

/// One check's verdict.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Check {
    /// What was checked: `redis`, `redis rights`, `namespace`, `sink <name>`,
    /// `route <name>`.
    pub check: String,
    pub ok: bool,
    /// What was found, in words (secrets scrubbed).
    pub detail: String,
    /// What to create or change, when it failed and zdelay knows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

impl Check {
    fn pass(check: impl Into<String>, detail: impl AsRef<str>) -> Self {
        Check {
            check: check.into(),
            ok: true,
            detail: redact_known(detail.as_ref()).into_owned(),
            hint: None,
        }
    }

    fn fail(check: impl Into<String>, detail: impl AsRef<str>, hint: Option<String>) -> Self {
        Check {
            check: check.into(),
            ok: false,
            detail: redact_known(detail.as_ref()).into_owned(),
            hint: hint.map(|h| redact_known(&h).into_owned()),
        }
    }
}

/// Every check, Redis first, then each sink and its routes.
pub async fn run(config: &Config) -> Vec<Check> {
    let mut checks = redis_checks(config).await;
    let sinks = futures::future::join_all(
        config
            .sinks
            .iter()
            .map(|(name, sink)| sink_checks(config, name, sink)),
    )
    .await;
    checks.extend(sinks.into_iter().flatten());
    checks
}

/// A member no one stores: `ZREM`/`LREM`/`HDEL` of it change nothing.
const NOBODY: &str = "\u{0}zdelay check-config";

async fn redis_checks(config: &Config) -> Vec<Check> {
    let mut con = match Conn::connect(&config.redis).await {
        Ok(con) => con,
        Err(e) => return vec![Check::fail("redis", e.to_string(), None)],
    };
    let mut checks = vec![match store::probe_server(&mut con).await {
        Ok(server) if server.supported => {
            Check::pass("redis", format!("connected, {}", server.name))
        }
        Ok(server) => {
            let hint = Some(store::OLD_REDIS_HINT.to_owned());
            return vec![Check::fail("redis", server.too_old(), hint)];
        }
        Err(e) => return vec![Check::fail("redis", e.to_string(), None)],
    }];
    let keys = Keys::new(&config.redis.namespace, config.redis.shards);
    checks.push(rights(config, &keys, &mut con).await);
    checks.push(namespace(config, &keys, &mut con).await);
    let streams = Routes::from_config(config)
        .local()
        .iter()
        .any(|r| r.push.is_stream());
    if streams {
        checks.push(
            match store::lanes::stream_key_conflict(&mut con, config).await {
                Ok(None) => {
                    Check::pass("streams", "every stream route's key is a stream or absent")
                }
                Ok(Some(why)) => Check::fail("streams", why, None),
                Err(e) => Check::fail("streams", e.to_string(), None),
            },
        );
    }
    checks
}

/// Tries each kind of command the daemon sends, on each kind of key it uses; a refusal by
/// the ACL (`NOPERM`) fails the check, any other answer (`NOSCRIPT`, `WRONGTYPE`) shows
/// the right is there.
async fn rights(config: &Config, keys: &Keys, con: &mut Conn) -> Check {
    let due = keys.due(0);
    let registry = keys.instances();
    let channel = format!("{}:check-config", keys.namespace());
    let mut tries: Vec<(String, redis::Cmd)> = vec![
        ("TIME".into(), redis::cmd("TIME")),
        ("INFO".into(), {
            let mut c = redis::cmd("INFO");
            c.arg("server");
            c
        }),
        (format!("EVALSHA on {due}"), {
            let mut c = redis::cmd("EVALSHA");
            c.arg("0".repeat(40)).arg(1).arg(&due);
            c
        }),
        (format!("ZCARD {due}"), {
            let mut c = redis::cmd("ZCARD");
            c.arg(&due);
            c
        }),
        (format!("ZREM {due}"), {
            let mut c = redis::cmd("ZREM");
            c.arg(&due).arg(NOBODY);
            c
        }),
        (format!("HDEL {registry}"), {
            let mut c = redis::cmd("HDEL");
            c.arg(&registry).arg(NOBODY);
            c
        }),
        (format!("PUBLISH {channel}"), {
            let mut c = redis::cmd("PUBLISH");
            c.arg(&channel).arg("");
            c
        }),
    ];
    for route in Routes::from_config(config).local() {
        let key = &route.list;
        if tries
            .iter()
            .any(|(what, _)| what.contains(&format!(" {key} (a route's")))
        {
            continue;
        }
        if route.push.is_stream() {
            // An entry id no one appends (zdelay's and clients' entries have real times).
            let mut c = redis::cmd("XDEL");
            c.arg(key).arg("0-1");
            tries.push((format!("XDEL {key} (a route's stream)"), c));
        } else {
            let mut c = redis::cmd("LREM");
            c.arg(key).arg(0).arg(NOBODY);
            tries.push((format!("LREM {key} (a route's list)"), c));
        }
    }
    for source in &config.sources {
        for key in [source.key.clone(), source.keys().dead] {
            let mut c = redis::cmd("ZREM");
            c.arg(&key).arg(NOBODY);
            tries.push((format!("ZREM {key} (raw source)"), c));
        }
    }
    let mut refused = Vec::new();
    for (what, cmd) in &tries {
        if let Err(e) = cmd.query_async::<redis::Value>(con).await
            && (e.code() == Some("NOPERM") || e.to_string().contains("no permissions"))
        {
            refused.push(what.clone());
        }
    }
    if refused.is_empty() {
        return Check::pass(
            "redis rights",
            format!(
                "{} commands tried on the namespace's keys, routes' lists and raw sources: \
                 all allowed",
                tries.len()
            ),
        );
    }
    Check::fail(
        "redis rights",
        format!("refused by the server's ACL: {}", refused.join(", ")),
        Some(acl_hint(config)),
    )
}

/// The ACL rule the daemon's user needs (README, "ACL"), with this config's names.
fn acl_hint(config: &Config) -> String {
    let ns = &config.redis.namespace;
    let mut patterns = vec![
        format!("~{ns}:*"),
        format!("~{{{ns}:*"),
        format!("~{{{ns}}}:*"),
    ];
    let routes = Routes::from_config(config);
    let extra = routes.lists().iter().cloned().chain(
        config
            .sources
            .iter()
            .flat_map(|s| [s.key.clone(), s.keys().dead]),
    );
    for key in extra {
        let pattern = format!("~{key}");
        if !patterns.contains(&pattern) {
            patterns.push(pattern);
        }
    }
    format!(
        "ACL SETUSER <user> {} &{ns}:* +@read +@write +@scripting +@pubsub +@connection \
         -@dangerous +info +time{}",
        patterns.join(" "),
        if config.redis.cluster_nodes.is_empty() {
            ""
        } else {
            " +cluster|slots"
        }
    )
}

/// The namespace's stored layout against `redis.shards`.
async fn namespace(config: &Config, keys: &Keys, con: &mut Conn) -> Check {
    let ns = keys.namespace();
    let schema = match store::read_schema(con, keys).await {
        Ok(schema) => schema,
        Err(e) => return Check::fail("namespace", e.to_string(), None),
    };
    let configured = config.redis.shards;
    let Some(shards) = schema.shards else {
        return Check::pass(
            "namespace",
            format!(
                "{ns} does not exist yet: the first daemon creates it with {configured} spread \
                 shards"
            ),
        );
    };
    if let Err(e) =
        store::check_layout_field(keys, schema.layout.as_deref(), schema.upgrading.is_some())
    {
        return Check::fail(
            "namespace",
            e.to_string(),
            Some(
                "run zdelay upgrade with the older release's daemons still running, then this \
                 release (docs: Upgrading from storage layout 1)"
                    .to_owned(),
            ),
        );
    }
    // What `zdelay run` would refuse: a test clock setting the namespace does not share.
    if let Err(e) = store::clock::check_wanted(keys, config.testing.clock, schema.clock.as_deref())
    {
        return Check::fail(
            "namespace",
            e.to_string(),
            Some(
                "a test clock is set when a namespace is created: point the tests at a new \
                 redis.namespace (docs: Testing with a test clock)"
                    .to_owned(),
            ),
        );
    }
    if shards == configured {
        Check::pass(
            "namespace",
            format!("{ns} has {shards} shards, as configured"),
        )
    } else {
        // Processes use the namespace's count (a reshard changes it online).
        Check::pass(
            "namespace",
            format!(
                "{ns} has {shards} spread shards (redis.shards says {configured}: daemons and \
                 producers use the namespace's count)"
            ),
        )
    }
}

/// The routes that deliver through sink `name`: (route name, target).
fn routes_of<'a>(config: &'a Config, name: &str) -> Vec<(&'a str, &'a str)> {
    config
        .routes
        .iter()
        .filter(|r| r.sink == name)
        .map(|r| (r.name.as_str(), r.target.as_str()))
        .collect()
}

/// How long JetStream must remember a message id: a redelivery comes at most a lease plus
/// the longest retry backoff after the first publish.
pub fn needed_duplicate_window(config: &Config) -> Duration {
    config.poller.lease + config.poller.retry_cap
}

async fn sink_checks(config: &Config, name: &str, sink: &SinkConfig) -> Vec<Check> {
    let label = format!("sink {name}");
    let allow_note = |allow: &[String]| {
        if allow.is_empty() {
            String::new()
        } else {
            format!(
                "; targets admitted by allow ({}) are named by producers: not checked",
                allow.join(", ")
            )
        }
    };
    let routes = routes_of(config, name);
    match sink {
        SinkConfig::Redis(_) => match sinks::build(name, config) {
            // The scheduling Redis: its lists are among the rights checked above.
            Ok(None) => vec![Check::pass(
                label,
                "lists on the scheduling Redis (see the redis checks)",
            )],
            Ok(Some(sink)) => vec![match sink.check().await.into_result() {
                Ok(()) => Check::pass(label, "redis reachable"),
                Err(why) => Check::fail(label, why, None),
            }],
            Err(e) => vec![Check::fail(label, e.to_string(), None)],
        },
        SinkConfig::Kafka(c) => {
            let kafka = match KafkaSink::with_deadline(name, c, config.poller.publish_deadline()) {
                Ok(kafka) => kafka,
                Err(e) => return vec![Check::fail(label, e.to_string(), None)],
            };
            if let Err(why) = kafka.check().await {
                return vec![Check::fail(label, why, None)];
            }
            let mut checks = vec![Check::pass(
                label,
                format!("kafka brokers answer{}", allow_note(&c.allow)),
            )];
            for (route, topic) in routes {
                checks.push(match kafka.topic_exists(topic).await {
                    Ok(true) => {
                        Check::pass(format!("route {route}"), format!("topic {topic} exists"))
                    }
                    Ok(false) => Check::fail(
                        format!("route {route}"),
                        format!("topic {topic} does not exist: its jobs would wait (held)"),
                        Some(format!(
                            "kafka-topics.sh --bootstrap-server {} --create --topic {topic} \
                             --partitions <N> --replication-factor <R>",
                            c.brokers
                        )),
                    ),
                    Err(why) => Check::fail(format!("route {route}"), why, None),
                });
            }
            checks
        }
        SinkConfig::Amqp(c) => {
            let amqp = match AmqpSink::new(name, c) {
                Ok(amqp) => amqp,
                Err(e) => return vec![Check::fail(label, e.to_string(), None)],
            };
            if let Err(why) = amqp.health().await.into_result() {
                return vec![Check::fail(label, why, None)];
            }
            let mut checks = vec![Check::pass(
                label,
                format!("amqp broker answers{}", allow_note(&c.allow)),
            )];
            for (route, target) in routes {
                checks.push(amqp_route(&amqp, route, target).await);
            }
            checks
        }
        SinkConfig::Nats(c) => {
            let nats = match NatsSink::new(name, c) {
                Ok(nats) => nats,
                Err(e) => return vec![Check::fail(label, e.to_string(), None)],
            };
            if let Err(why) = nats.check().await {
                return vec![Check::fail(label, why, None)];
            }
            let mode = if c.jetstream {
                "JetStream"
            } else {
                "core NATS"
            };
            let mut checks = vec![Check::pass(
                label,
                format!("nats server answers ({mode}){}", allow_note(&c.allow)),
            )];
            if c.jetstream {
                let needed = needed_duplicate_window(config);
                for (route, subject) in routes {
                    checks.push(nats_route(&nats, route, subject, needed).await);
                }
            }
            checks
        }
    }
}

async fn amqp_route(amqp: &AmqpSink, route: &str, target: &str) -> Check {
    let check = format!("route {route}");
    let (exchange, key) = target.split_once('/').unwrap_or(("", target));
    match amqp.missing_object(target).await {
        Ok(None) if exchange.is_empty() => Check::pass(check, format!("queue {key} exists")),
        Ok(None) => Check::pass(
            check,
            format!(
                "exchange {exchange} exists (whether it routes key {key} to a queue is known \
                 only when publishing: an unroutable job is held)"
            ),
        ),
        Ok(Some(why)) if exchange.is_empty() => Check::fail(
            check,
            format!("queue {key} does not exist ({why}): its jobs would wait (held)"),
            Some(format!(
                "rabbitmqadmin declare queue name={key} durable=true"
            )),
        ),
        Ok(Some(why)) => Check::fail(
            check,
            format!("exchange {exchange} does not exist ({why}): its jobs would wait (held)"),
            Some(format!(
                "rabbitmqadmin declare exchange name={exchange} type=direct durable=true, then \
                 bind a queue: rabbitmqadmin declare binding source={exchange} \
                 destination=<queue> routing_key={key}"
            )),
        ),
        Err(why) => Check::fail(check, why, None),
    }
}

async fn nats_route(nats: &NatsSink, route: &str, subject: &str, needed: Duration) -> Check {
    let check = format!("route {route}");
    let needed_text = humantime::format_duration(needed)
        .to_string()
        .replace(' ', "");
    match nats.stream_for(subject).await {
        Ok(Some((stream, window))) if window >= needed => Check::pass(
            check,
            format!(
                "stream {stream} stores {subject}; duplicate window {} (at least {needed_text})",
                humantime::format_duration(window)
                    .to_string()
                    .replace(' ', "")
            ),
        ),
        Ok(Some((stream, window))) => Check::fail(
            check,
            format!(
                "stream {stream} stores {subject}, but its duplicate window, {}, is shorter \
                 than poller.lease + poller.retry_cap ({needed_text}): a redelivery after it \
                 reaches consumers twice",
                humantime::format_duration(window)
                    .to_string()
                    .replace(' ', "")
            ),
            Some(format!(
                "nats stream edit {stream} --dupe-window {needed_text}"
            )),
        ),
        Ok(None) => Check::fail(
            check,
            format!("no JetStream stream stores {subject}: its jobs would wait (held)"),
            Some(format!(
                "nats stream add <NAME> --subjects '{subject}' --dupe-window {needed_text} \
                 --defaults"
            )),
        ),
        Err(why) => Check::fail(check, why, None),
    }
}
