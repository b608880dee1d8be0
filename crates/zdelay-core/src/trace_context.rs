//! W3C trace context carried in envelope headers: `traceparent` and `tracestate`.
//!
//! zdelay does not rewrite a creation context (the OpenTelemetry messaging conventions):
//! the two headers travel with the job and are delivered as given. This module owns the
//! two rules both sides share:
//! - on the way in, their names are matched case-insensitively and stored lowercase
//!   ([`normalize_header_names`]); every other header is kept as given;
//! - a `traceparent` is validated against the W3C format ([`TraceParent::parse`]) before
//!   the daemon uses it as the parent of its delay-hop span. A malformed one is not an
//!   error: it is still delivered as given, only not used (the daemon counts it).
//!
//! Pure functions; no OpenTelemetry dependency (producers stay light).

use std::collections::BTreeMap;

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// Stores `traceparent` and `tracestate` under their lowercase names, whatever case the
/// producer wrote (`Traceparent`, `TRACESTATE`). When both spellings are given, the
/// lowercase one wins and the others are dropped: two creation contexts cannot both hold.
pub fn normalize_header_names(headers: &mut BTreeMap<String, String>) {
    for name in [TRACEPARENT, TRACESTATE] {
        let other_spellings: Vec<String> = headers
            .keys()
            .filter(|k| k.as_str() != name && k.eq_ignore_ascii_case(name))
            .cloned()
            .collect();
        for key in other_spellings {
            if let Some(value) = headers.remove(&key) {
                headers.entry(name.to_owned()).or_insert(value);
            }
        }
    }
}

/// The header named `name` (lowercase), matched case-insensitively: envelopes written by
/// other producers may not be normalized.
pub fn header<'a>(headers: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .or_else(|| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        })
        .map(String::as_str)
}

/// A valid W3C `traceparent`: `<version>-<trace id>-<parent id>-<flags>`, lowercase hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceParent {
    /// Parses per W3C Trace Context level 1: version `00` is exactly 55 characters; a
    /// higher version (not `ff`) may append `-…` fields, which are ignored; ids must not be
    /// all zeros. `None` for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        let b = value.as_bytes();
        if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let version = hex_bytes::<1>(&b[0..2])?[0];
        match version {
            0xff => return None,
            0x00 if b.len() != 55 => return None,
            _ if b.len() > 55 && b[55] != b'-' => return None,
            _ => {}
        }
        let trace_id = hex_bytes::<16>(&b[3..35])?;
        let span_id = hex_bytes::<8>(&b[36..52])?;
        let flags = hex_bytes::<1>(&b[53..55])?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// The `sampled` flag (bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// What a job's headers say about its creation context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// No `traceparent` header.
    None,
    /// A valid one.
    Valid(TraceParent),
    /// A `traceparent` that is not W3C: delivered as given, not used, counted.
    Malformed,
}

/// The creation context in `headers`.
pub fn origin(headers: &BTreeMap<String, String>) -> Origin {
    match header(headers, TRACEPARENT) {
        None => Origin::None,
        Some(value) => TraceParent::parse(value).map_or(Origin::Malformed, Origin::Valid),
    }
}

/// Lowercase hex only (W3C forbids uppercase).
fn hex_bytes<const N: usize>(hex: &[u8]) -> Option<[u8; N]> {
    if hex.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn valid_traceparent_is_read() {
        let tp = TraceParent::parse(VALID).expect("valid");
        assert_eq!(tp.trace_id[0], 0x4b);
        assert_eq!(tp.trace_id[15], 0x36);
        assert_eq!(tp.span_id, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert!(tp.sampled());
        let unsampled = TraceParent::parse(&VALID.replace("-01", "-00")).expect("valid");
        assert!(!unsampled.sampled());
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        let cases = [
            "",
            "garbage",
            // zero ids
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // uppercase hex
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            // version ff, and version 00 with a suffix
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            // wrong lengths and separators
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            // a future version must separate its extra fields with '-'
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ];
        for case in cases {
            assert_eq!(TraceParent::parse(case), None, "{case:?}");
        }
    }

    #[test]
    fn a_future_version_is_read_by_its_first_fields() {
        let tp = TraceParent::parse(
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-adds",
        )
        .expect("future version accepted");
        assert_eq!(tp, TraceParent::parse(VALID).unwrap());
    }

    #[test]
    fn trace_header_names_are_stored_lowercase_others_as_given() {
        let mut headers = BTreeMap::from([
            ("TraceParent".to_owned(), VALID.to_owned()),
            ("TRACESTATE".to_owned(), "congo=t61rcWkgMzE".to_owned()),
            ("X-Custom".to_owned(), "Kept".to_owned()),
        ]);
        normalize_header_names(&mut headers);
        assert_eq!(
            headers,
            BTreeMap::from([
                ("traceparent".to_owned(), VALID.to_owned()),
                ("tracestate".to_owned(), "congo=t61rcWkgMzE".to_owned()),
                ("X-Custom".to_owned(), "Kept".to_owned()),
            ])
        );
    }

    #[test]
    fn the_lowercase_spelling_wins_over_others() {
        let mut headers = BTreeMap::from([
            ("traceparent".to_owned(), VALID.to_owned()),
            ("Traceparent".to_owned(), "other".to_owned()),
        ]);
        normalize_header_names(&mut headers);
        assert_eq!(
            headers,
            BTreeMap::from([("traceparent".to_owned(), VALID.to_owned())])
        );
    }

    #[test]
    fn origin_reads_any_case_and_tells_malformed_from_absent() {
        let with = |k: &str, v: &str| BTreeMap::from([(k.to_owned(), v.to_owned())]);
        assert_eq!(origin(&BTreeMap::new()), Origin::None);
        assert_eq!(origin(&with("x", VALID)), Origin::None);
        assert!(matches!(
            origin(&with("TRACEPARENT", VALID)),
            Origin::Valid(_)
        ));
        assert_eq!(origin(&with("traceparent", "00-bad")), Origin::Malformed);
    }
}
