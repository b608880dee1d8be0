//! The producer test vectors (`docs/reference/protocol-vectors.json`), written by an
//! implementation of the rules apart from this crate: this crate's keys, shards and frames
//! must match them byte for byte, as every client's must.

use super::{NewJob, envelope_of};
use crate::envelope::Envelope;
use crate::job::Due;
use crate::keys::{Keys, LaneKeys, slot_of, slot_tag, spread_slot};
use base64::Engine;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

const VECTORS: &str = include_str!("../../../../docs/reference/protocol-vectors.json");

fn vectors() -> Value {
    serde_json::from_str(VECTORS).expect("protocol-vectors.json is JSON")
}

fn text<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

fn number(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

fn bytes(v: &Value, field: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(text(v, field))
        .expect("base64")
}

#[test]
fn the_shard_rule_is_the_crc16_of_the_tag_modulo_the_shard_count() {
    let v = vectors();
    let rule = v["shard_rule"].as_array().expect("shard_rule");
    assert!(rule.len() >= 20, "{} cases", rule.len());
    for case in rule {
        let id = text(case, "id");
        let shards = number(case, "shards") as u16;
        let keys = Keys::new("zdelay", shards);
        assert_eq!(
            u64::from(keys.shard_of(id)),
            number(case, "shard"),
            "{case}"
        );
        // The id's Redis Cluster slot (CLUSTER KEYSLOT), from the same CRC of the same tag.
        assert_eq!(
            u64::from(slot_of(id)),
            number(case, "cluster_keyslot"),
            "{case}"
        );
    }
    // Some vector must tell the shard rule from "the key slot modulo the shard count".
    assert!(
        rule.iter()
            .any(|c| { number(c, "cluster_keyslot") % number(c, "shards") != number(c, "shard") })
    );
}

#[test]
fn slot_tags_lanes_and_spread_shards_are_named_as_the_vectors_say() {
    let v = vectors();
    for case in v["slot_tags"]["examples"].as_array().expect("slot tags") {
        assert_eq!(slot_tag(number(case, "slot") as u16), text(case, "tag"));
    }
    for case in v["lanes"].as_array().expect("lanes") {
        let slot = slot_of(text(case, "list"));
        assert_eq!(u64::from(slot), number(case, "slot"), "{case}");
        assert_eq!(slot_tag(slot), text(case, "tag"));
        let lane = LaneKeys::new(text(case, "namespace"), slot_tag(slot), text(case, "route"));
        let want = &case["keys"];
        for (name, got) in [
            ("due", &lane.due),
            ("jobs", &lane.jobs),
            ("meta", &lane.meta),
            ("maxlate", &lane.maxlate),
            ("large", &lane.large),
            ("dead", &lane.dead),
            ("reasons", &lane.reasons),
            ("marker", &lane.marker),
        ] {
            assert_eq!(got, text(want, name), "{name} of {case}");
        }
        assert_eq!(
            Keys::new(text(case, "namespace"), 16).lanes(),
            text(case, "registry")
        );
    }
    let spread = v["spread_shards"].as_array().expect("spread shards");
    assert!(spread.len() >= 5, "{} cases", spread.len());
    for case in spread {
        let (shards, shard) = (number(case, "shards") as u16, number(case, "shard") as u16);
        assert_eq!(u64::from(spread_slot(shard, shards)), number(case, "slot"));
        assert_eq!(slot_tag(spread_slot(shard, shards)), text(case, "tag"));
        let keys = Keys::new(text(case, "namespace"), shards);
        let sk = keys.shard(shard);
        let want = &case["keys"];
        for (name, got) in [
            ("due", &sk.due),
            ("jobs", &sk.jobs),
            ("inflight", &sk.inflight),
            ("dead", &sk.dead),
            ("reasons", &sk.reasons),
            ("scheduled", &sk.scheduled),
            ("ready", &sk.ready),
            ("ready_ids", &sk.ready_ids),
            ("max_lateness", &sk.max_lateness),
            ("marker", &sk.layout),
            ("unique", &sk.unique),
            ("windows", &sk.windows),
        ] {
            assert_eq!(got, text(want, name), "{name} of {case}");
        }
        assert_eq!(keys.schema(), text(case, "schema"));
        assert_eq!(keys.wake_channel(), text(case, "wake_channel"));
    }
}

#[test]
fn jobs_are_framed_as_the_vectors_say_and_read_back() {
    let v = vectors();
    let cases = v["envelopes"].as_array().expect("envelopes");
    assert!(cases.len() >= 5);
    for case in cases {
        let headers: BTreeMap<String, String> =
            serde_json::from_value(case["headers"].clone()).expect("headers of strings");
        let job = NewJob {
            id: None,
            dest: text(case, "dest").to_owned(),
            payload: bytes(case, "payload_base64"),
            due: Due::In(Duration::ZERO),
            headers,
            max_attempts: case["max_attempts"].as_u64().map(|n| n as u32),
            max_lateness: case["max_lateness_ms"].as_u64().map(Duration::from_millis),
            spread: None,
            unique_for: None,
        };
        let frame = bytes(case, "frame_base64");
        let encoded = envelope_of(job.clone()).encode().expect("encode");
        assert_eq!(
            String::from_utf8_lossy(&encoded),
            String::from_utf8_lossy(&frame),
            "{}",
            text(case, "name")
        );
        assert_eq!(encoded, frame, "{}", text(case, "name"));
        // And out: the frame reads back as the job it came from.
        let back = Envelope::decode(&frame).expect("decode");
        assert_eq!((back.dest, back.payload), (job.dest, job.payload));
        assert_eq!(back.meta.max_attempts, job.max_attempts);
        assert_eq!(
            back.meta.max_lateness_ms,
            job.max_lateness.map(|d| d.as_millis() as u64)
        );
    }
}

#[test]
fn a_spread_job_falls_where_the_vectors_say() {
    let v = vectors();
    let cases = v["spread_offsets"].as_array().expect("spread_offsets");
    assert!(cases.len() >= 5);
    for case in cases {
        let window = case["window_ms"].as_u64().expect("window_ms");
        let offset = super::spread_offset_ms(text(case, "id"), window);
        assert_eq!(Some(offset), case["offset_ms"].as_u64(), "{case}");
    }
}
