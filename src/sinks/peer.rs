//! What answers at a sink's address, for error messages a user can act on. When a sink cannot
//! talk to its broker, the client library's own error is often a parse failure or a bare
//! timeout; a short probe of the port says what is actually there: nothing, an HTTP server, a
//! TLS listener spoken to in plain text, or a broker of another kind.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;
use zdelay_core::config::SinkConfig;

/// The protocol a sink expects at its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Amqp,
    Nats,
    Kafka,
    Redis,
}

impl Protocol {
    fn described(self) -> &'static str {
        match self {
            Protocol::Amqp => "an AMQP 0-9-1 broker (RabbitMQ)",
            Protocol::Nats => "a NATS server",
            Protocol::Kafka => "a Kafka broker",
            Protocol::Redis => "a Redis server",
        }
    }
}

/// What a probe found at an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    Refused,
    /// No TCP connection within the probe's time.
    Unreachable,
    Http,
    /// A TLS listener (it answered plain text with a TLS alert).
    Tls,
    Speaks(Protocol),
    /// Connected, and it said nothing we recognise (a Kafka broker does that).
    Silent,
}

impl Peer {
    fn described(&self) -> &'static str {
        match self {
            Peer::Refused => "nothing listening (connection refused)",
            Peer::Unreachable => "no answer to a TCP connect",
            Peer::Http => "an HTTP server",
            Peer::Tls => "a TLS listener (use the TLS form of the URL, e.g. amqps:// or tls://)",
            Peer::Speaks(p) => p.described(),
            Peer::Silent => "a server that does not answer in any protocol zdelay knows",
        }
    }
}

/// The sink's addresses (`host:port`) and the protocol it expects there.
pub fn endpoints(config: &SinkConfig) -> (Protocol, Vec<String>) {
    match config {
        SinkConfig::Amqp(c) => (Protocol::Amqp, urls(c.url.expose(), 5672)),
        SinkConfig::Nats(c) => (Protocol::Nats, urls(c.url.expose(), 4222)),
        SinkConfig::Kafka(c) => (
            Protocol::Kafka,
            c.brokers
                .split(',')
                .map(str::trim)
                .filter(|b| !b.is_empty())
                .map(|b| with_port(b, 9092))
                .collect(),
        ),
        SinkConfig::Redis(c) => (
            Protocol::Redis,
            c.url
                .as_ref()
                .map(|u| urls(u.expose(), 6379))
                .unwrap_or_default(),
        ),
    }
}

/// `host:port` of each comma-separated URL (credentials and paths dropped).
pub fn urls(text: &str, default_port: u16) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|url| {
            let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
            let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
            let host = rest.split(['/', '?']).next().unwrap_or(rest);
            with_port(host, default_port)
        })
        .collect()
}

fn with_port(host: &str, default_port: u16) -> String {
    let has_port = host
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.ends_with(':') && p.parse::<u16>().is_ok());
    if has_port {
        host.to_owned()
    } else {
        format!("{host}:{default_port}")
    }
}

/// Probes `addr` (bounded to about 3 s): connects and listens a moment (a NATS server speaks
/// first), then says hello as a TLS client would (a TLS listener answers with a handshake
/// record or an alert; AMQP and Redis servers refuse it in their own words), and last asks
/// as an HTTP client would.
pub async fn identify(addr: &str) -> Peer {
    match probe(addr, &client_hello()).await {
        Ok(Peer::Silent) => {}
        Ok(peer) => return peer,
        Err(peer) => return peer,
    }
    probe(addr, b"GET / HTTP/1.0\r\n\r\n")
        .await
        .unwrap_or_else(|peer| peer)
}

/// One connection: listen 300 ms, then send `hello` and classify the answer. `Err` when
/// nothing accepted the connection.
async fn probe(addr: &str, hello: &[u8]) -> Result<Peer, Peer> {
    let mut stream = match timeout(Duration::from_secs(1), TcpStream::connect(addr)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return Err(Peer::Refused);
        }
        _ => return Err(Peer::Unreachable),
    };
    let mut buf = [0u8; 64];
    if let Ok(Ok(n)) = timeout(Duration::from_millis(300), stream.read(&mut buf)).await
        && n > 0
    {
        return Ok(classify(&buf[..n]));
    }
    if stream.write_all(hello).await.is_err() {
        return Ok(Peer::Silent);
    }
    Ok(
        match timeout(Duration::from_millis(700), stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => classify(&buf[..n]),
            _ => Peer::Silent,
        },
    )
}

/// A minimal TLS 1.2 ClientHello: enough for any TLS server to answer with a handshake
/// record or an alert.
fn client_hello() -> Vec<u8> {
    let mut body = vec![0x03, 0x03]; // client version TLS 1.2
    body.extend([0u8; 32]); // random
    body.push(0); // no session id
    body.extend([0x00, 0x08, 0xc0, 0x2f, 0xc0, 0x30, 0x00, 0x9c, 0x00, 0x2f]); // suites
    body.extend([0x01, 0x00]); // compression: null
    let extensions: &[u8] = &[
        0x00, 0x0a, 0x00, 0x04, 0x00, 0x02, 0x00, 0x17, // supported groups: secp256r1
        0x00, 0x0b, 0x00, 0x02, 0x01, 0x00, // EC point formats: uncompressed
        0x00, 0x0d, 0x00, 0x08, 0x00, 0x06, 0x04, 0x01, 0x04, 0x03, 0x08, 0x04, // sig algs
    ];
    body.extend((extensions.len() as u16).to_be_bytes());
    body.extend(extensions);
    let mut handshake = vec![0x01, 0x00];
    handshake.extend((body.len() as u16).to_be_bytes());
    handshake.extend(body);
    let mut record = vec![0x16, 0x03, 0x01];
    record.extend((handshake.len() as u16).to_be_bytes());
    record.extend(handshake);
    record
}

fn classify(first: &[u8]) -> Peer {
    match first {
        [b'H', b'T', b'T', b'P', b'/', ..] => Peer::Http,
        [0x15 | 0x16, 0x03, ..] => Peer::Tls,
        [b'I', b'N', b'F', b'O', ..] => Peer::Speaks(Protocol::Nats),
        [b'A', b'M', b'Q', b'P', ..] => Peer::Speaks(Protocol::Amqp),
        [b'-' | b'+' | b'$' | b':', ..] => Peer::Speaks(Protocol::Redis),
        _ => Peer::Silent,
    }
}

/// When `addr` holds something other than `expected`: what, in a sentence naming both.
pub async fn explain(addr: &str, expected: Protocol) -> Option<String> {
    let peer = identify(addr).await;
    let fine = match (&peer, expected) {
        (Peer::Speaks(p), _) => *p == expected,
        // A Kafka broker answers nothing we can recognise without speaking Kafka.
        (Peer::Silent, Protocol::Kafka) => true,
        _ => false,
    };
    (!fine).then(|| {
        format!(
            "expected {} at {addr}, found {}",
            expected.described(),
            peer.described()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_bytes_name_the_server() {
        assert_eq!(classify(b"HTTP/1.0 200 OK"), Peer::Http);
        assert_eq!(classify(&[0x15, 0x03, 0x03, 0x00, 0x02]), Peer::Tls);
        assert_eq!(
            classify(b"INFO {\"server_id\""),
            Peer::Speaks(Protocol::Nats)
        );
        assert_eq!(
            classify(b"AMQP\x00\x00\x09\x01"),
            Peer::Speaks(Protocol::Amqp)
        );
        assert_eq!(classify(b"-ERR unknown"), Peer::Speaks(Protocol::Redis));
        assert_eq!(classify(b"\x00\x00"), Peer::Silent);
    }

    #[test]
    fn addresses_come_from_urls_without_credentials() {
        assert_eq!(
            urls("amqp://u:p@rabbit.svc:5673/%2f", 5672),
            ["rabbit.svc:5673"]
        );
        assert_eq!(
            urls("nats://a:4222, nats://tok@b", 4222),
            ["a:4222", "b:4222"]
        );
        assert_eq!(urls("redis://:pw@127.0.0.1/0", 6379), ["127.0.0.1:6379"]);
        assert_eq!(with_port("k1", 9092), "k1:9092");
        assert_eq!(with_port("[::1]:9093", 9092), "[::1]:9093");
    }
}

/// The version an AMQP 0-9-1 server announces in its `Connection.Start` (server properties,
/// `version`), read by sending the protocol header and parsing the first frame. `None` when
/// the server cannot be reached or says nothing parseable (bounded to about 2 s).
pub async fn amqp_server_version(addr: &str) -> Option<String> {
    let mut stream = timeout(Duration::from_secs(1), TcpStream::connect(addr))
        .await
        .ok()?
        .ok()?;
    stream.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
    let mut frame = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        // type, channel, size, then the payload and the frame end byte
        while frame.len() < 7 || frame.len() < 8 + frame_size(&frame) {
            let n = stream.read(&mut buf).await.ok()?;
            if n == 0 || frame.len() > 64 * 1024 {
                return None;
            }
            frame.extend_from_slice(&buf[..n]);
        }
        Some(())
    };
    timeout(Duration::from_secs(1), read).await.ok()??;
    connection_start_version(&frame)
}

fn frame_size(frame: &[u8]) -> usize {
    u32::from_be_bytes([frame[3], frame[4], frame[5], frame[6]]) as usize
}

/// `version` from a `Connection.Start` method frame.
fn connection_start_version(frame: &[u8]) -> Option<String> {
    // frame: type 1 (method), channel 0, size; payload: class 10, method 10, major, minor,
    // server-properties (a field table: u32 length, then entries).
    if frame.first() != Some(&1) || frame.get(7..11)? != [0, 10, 0, 10] {
        return None;
    }
    let table_len = u32::from_be_bytes(frame.get(13..17)?.try_into().ok()?) as usize;
    let mut table = frame.get(17..17 + table_len)?;
    while !table.is_empty() {
        let name_len = *table.first()? as usize;
        let name = table.get(1..1 + name_len)?;
        let kind = *table.get(1 + name_len)?;
        let rest = table.get(2 + name_len..)?;
        let (value, after): (Option<&[u8]>, &[u8]) = match kind {
            b'S' | b'F' | b'A' | b'x' => {
                let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
                (Some(rest.get(4..4 + len)?), rest.get(4 + len..)?)
            }
            b't' | b'b' | b'B' => (None, rest.get(1..)?),
            b'u' | b's' => (None, rest.get(2..)?),
            b'I' | b'i' | b'f' => (None, rest.get(4..)?),
            b'l' | b'd' | b'T' => (None, rest.get(8..)?),
            _ => return None,
        };
        if name == b"version" && kind == b'S' {
            return String::from_utf8(value?.to_vec()).ok();
        }
        table = after;
    }
    None
}

/// Whether a dotted version (`3.10.8`, `7.0.15`) is at least `floor` (`(3, 10)`).
pub fn at_least(version: &str, floor: (u32, u32)) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    (major, minor) >= floor
}

#[cfg(test)]
mod version_tests {
    use super::*;

    #[test]
    fn versions_compare_by_major_and_minor() {
        assert!(at_least("3.10.8", (3, 10)));
        assert!(at_least("3.12.0", (3, 10)));
        assert!(at_least("4.0.1", (3, 10)));
        assert!(!at_least("3.9.29", (3, 10)));
        assert!(at_least("7.0.15", (7, 0)));
        assert!(!at_least("6.2.14", (7, 0)));
    }

    #[test]
    fn connection_start_yields_the_version() {
        // A Connection.Start as RabbitMQ sends it, cut to two properties.
        let mut table = Vec::new();
        for (name, value) in [("product", "RabbitMQ"), ("version", "3.10.8")] {
            table.push(name.len() as u8);
            table.extend(name.as_bytes());
            table.push(b'S');
            table.extend((value.len() as u32).to_be_bytes());
            table.extend(value.as_bytes());
        }
        let mut payload = vec![0, 10, 0, 10, 0, 9];
        payload.extend((table.len() as u32).to_be_bytes());
        payload.extend(&table);
        let mut frame = vec![1, 0, 0];
        frame.extend((payload.len() as u32).to_be_bytes());
        frame.extend(&payload);
        frame.push(0xce);
        assert_eq!(connection_start_version(&frame).as_deref(), Some("3.10.8"));
        assert_eq!(connection_start_version(b"HTTP/1.0 400"), None);
    }
}
