#!/usr/bin/env python3
# Usage: python3 scripts/protocol-vectors.py docs/reference/protocol-vectors.json
"""Writes docs/reference/protocol-vectors.json from an implementation of the rules independent
of the Rust code (CRC-16/XMODEM, hash tags, slot tags, the zd1 frame); the Rust tests check
their code against the file."""
import base64, hashlib, json, sys

def crc16(data: bytes) -> int:
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc

def tag(key: bytes) -> bytes:
    s = key.find(b'{')
    if s >= 0:
        e = key.find(b'}', s + 1)
        if e > s + 1:
            return key[s + 1:e]
    return key

ALPHA = b"0123456789abcdefghijklmnopqrstuvwxyz"
def slot_tags():
    tags = [None] * 16384
    missing = 16384
    length = 1
    while missing:
        digits = [0] * length
        while True:
            cand = bytes(ALPHA[d] for d in digits)
            slot = crc16(cand) % 16384
            if tags[slot] is None:
                tags[slot] = cand.decode()
                missing -= 1
                if not missing:
                    return tags
            i = length - 1
            while i >= 0 and digits[i] + 1 >= len(ALPHA):
                i -= 1
            if i < 0:
                break
            digits[i] += 1
            for j in range(i + 1, length):
                digits[j] = 0
        length += 1
    return tags

TAGS = slot_tags()
table_sha = hashlib.sha256("".join(t + "\n" for t in TAGS).encode()).hexdigest()

shard_cases = [
    ("01KAKZ3M0V9Q8D3W6M1E5T2X7N", [16, 10, 3, 1, 256]),
    ("{user-42}:reminder", [16, 10, 7]),
    ("{user-42}:invoice", [16, 10]),
    ("order-1001", [16, 12, 5]),
    ("{}:empty-tag", [16, 10]),
    ("{a}{b}", [16, 6]),
    ("}{x}", [16]),
    ("no{close", [16]),
    ("{{nested}}", [16, 10]),
    ("résumé-ünïcødé-😀", [16, 10]),
    ("{日本}:注文", [16, 6]),
    ("123456789", [16, 10]),
]
shards = []
for id_, counts in shard_cases:
    t = tag(id_.encode())
    c = crc16(t)
    for n in counts:
        shards.append({"id": id_, "tag": t.decode(), "crc16": c, "shards": n,
                       "shard": c % n, "cluster_keyslot": c % 16384})

def lane(ns, list_key, route):
    slot = crc16(tag(list_key.encode())) % 16384
    t = TAGS[slot]
    k = lambda kind: "%s:{%s}:%s:%s" % (ns, t, kind, route)
    return {"namespace": ns, "list": list_key, "route": route, "slot": slot, "tag": t,
            "keys": {"due": k("due"), "jobs": k("jobs"), "meta": k("meta"),
                     "maxlate": k("maxlate"), "large": k("large"), "dead": k("dead"),
                     "reasons": k("reasons"), "marker": k("lane")},
            "registry": "%s:lanes" % ns}

# Spread shard s of n: the two-phase routes' jobs, in the middle slot of the shard's share.
def spread(ns, n, s):
    slot = (2 * s + 1) * 16384 // (2 * n)
    t = TAGS[slot]
    k = lambda kind: "%s:{%s}:s%d:%s" % (ns, t, s, kind)
    return {"namespace": ns, "shards": n, "shard": s, "slot": slot, "tag": t,
            "keys": {"due": k("due"), "jobs": k("jobs"), "inflight": k("inflight"), "dead": k("dead"),
                     "reasons": k("reasons"), "scheduled": k("scheduled"), "ready": k("ready"),
                     "ready_ids": k("ready_ids"), "max_lateness": k("max_lateness"),
                     "marker": k("shards"), "unique": k("unique"), "windows": k("windows")},
            "schema": "%s:schema" % ns, "wake_channel": "%s:wake" % ns}

def frame(dest, payload, meta):
    m = b"" if not meta else json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()
    return b"zd1:" + dest.encode() + b"\n" + str(len(m)).encode() + b"\n" + m + payload

def normalized(headers):
    out = {}
    for k, v in headers.items():
        low = k.lower()
        if low in ("traceparent", "tracestate") and k != low:
            continue
        out[k] = v
    for k, v in headers.items():
        low = k.lower()
        if low in ("traceparent", "tracestate") and k != low:
            out.setdefault(low, v)
    return dict(sorted(out.items(), key=lambda kv: kv[0].encode()))

env_cases = [
    ("plain", "emails", b"hi there", {}, None, None),
    ("one header", "emails", b"hi there", {"trace": "7f3a"}, None, None),
    ("headers sorted by byte, trace context names lowercased, attempts, lateness", "orders",
     b'{"order":1001}', {"tenant": "acme", "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "Z-Last": "z", "a-first": "a"}, 5, 30000),
    ("binary payload, Unicode and escapes in a header value", "kafka/orders",
     bytes([0, 255, 10, 13]) + "é".encode(), {"note": "café ☕ \"q\" \\ \n tab\t"}, None, None),
    ("max lateness only", "emails-delayed", b"", {}, None, 250),
]
envelopes = []
for name, dest, payload, headers, attempts, lateness in env_cases:
    meta = {}
    h = normalized(headers)
    if h:
        meta["headers"] = h
    if attempts is not None:
        meta["max_attempts"] = attempts
    if lateness is not None:
        meta["max_lateness_ms"] = lateness
    f = frame(dest, payload, meta)
    envelopes.append({"name": name, "dest": dest,
                      "payload_base64": base64.b64encode(payload).decode(),
                      "headers": headers, "max_attempts": attempts, "max_lateness_ms": lateness,
                      "frame_base64": base64.b64encode(f).decode()})

def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h

# A job spread over a window is due at its due time plus FNV-1a-64(id) mod the window (ms).
spread_offsets = [{"id": i, "window_ms": w, "offset_ms": fnv1a64(i.encode()) % w}
                  for i, w in [("", 1000), ("a", 1000), ("order-1001", 300000), ("order-1002", 300000),
                               ("{user-42}:invoice", 60000), ("ünïcødé", 7), ("01JD4S8Q2ZKX7V3M5N6P8R9T0W", 86400000),
                               ("Xy0_-AbC1234", 3600000)]]

doc = {
    "about": "Test vectors for zdelay producers: the shard rule, key names, the zd1 frame and "
             "where a spread job falls in its window. "
             "Read by zdelay's own tests; a client in another language checks its code against "
             "them. Byte strings are base64; text is UTF-8.",
    "crc16_xmodem_check": {"input": "123456789", "crc16": crc16(b"123456789")},
    "shard_rule": shards,
    "slot_tags": {"table_sha256": table_sha,
                  "examples": [{"slot": s, "tag": TAGS[s]} for s in (0, 1, 2, 512, 8192, 15872, 16383)]},
    "lanes": [lane("zdelay", "queue:emails", "emails"), lane("zdelay", "{user}:queue", "user-q"),
              lane("orders", "jobs:ünïcødé", "uni")],
    "spread_shards": [spread("zdelay", 16, 0), spread("zdelay", 16, 15), spread("zdelay", 10, 3),
                      spread("orders", 16, 11), spread("orders", 1, 0)],
    "envelopes": envelopes,
    "spread_offsets": spread_offsets,
}
json.dump(doc, open(sys.argv[1], "w"), ensure_ascii=False, indent=1)
open(sys.argv[1], "a").write("\n")
