import { test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { createRequire } from "node:module";
import { join } from "node:path";
import Redis, { Cluster } from "ioredis";
import { execFileSync, spawn } from "node:child_process";
import * as zdelay from "../dist/esm/index.js";
import { ROOT, ZDELAY as zdelayBin, laneKeys, pinnedZdelay, spreadShardKeys, spreadShardKeysIn, startRedis, startDaemon, waitFor } from "./servers.mjs";

const VECTORS = JSON.parse(readFileSync(join(ROOT, "docs/reference/protocol-vectors.json"), "utf8"));
const TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

test("the shard rule and slot tags match the vectors; CommonJS loads too", () => {
  assert.equal(zdelay.crc16(Buffer.from("123456789")), VECTORS.crc16_xmodem_check.crc16);
  for (const c of VECTORS.shard_rule) assert.equal(zdelay.shardOf(c.id, c.shards), c.shard, JSON.stringify(c));
  for (const c of VECTORS.slot_tags.examples) assert.equal(zdelay.slotTag(c.slot), c.tag);
  for (const c of VECTORS.spread_offsets) assert.equal(zdelay.spreadOffset(c.id, c.window_ms), c.offset_ms, JSON.stringify(c));
  const kinds = { due: "due", jobs: "jobs", inflight: "inflight", dead: "dead", reasons: "reasons", scheduled: "scheduled",
    ready: "ready", ready_ids: "ready_ids", max_lateness: "max_lateness", marker: "shards", unique: "unique", windows: "windows" };
  for (const c of VECTORS.spread_shards) {
    assert.deepEqual(spreadShardKeysIn(c.namespace, c.shards, c.shard, ...Object.values(kinds)), Object.keys(kinds).map((k) => c.keys[k]));
  }
  const cjs = createRequire(import.meta.url)("../dist/cjs/index.js");
  assert.equal(cjs.shardOf("{user-42}:invoice", 10), 9);
});

test("jobs are stored as zdelay stores them, framed as the vectors say, and delivered", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`);
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  try {
    const atMs = Date.now() + 3_600_000;
    daemon.cli("enqueue", "--dest", "emails", "--id", "{u}:cli", "--at", String(atMs), "--payload", "hi there",
      "--header", "tenant=acme", "--header", `Traceparent=${TRACEPARENT}`, "--max-attempts", "3", "--max-lateness", "30s");
    const done = await client.enqueue({ dest: "emails", payload: "hi there", id: "{u}:node", at: atMs,
      headers: { tenant: "acme", Traceparent: TRACEPARENT }, maxAttempts: 3, maxLateness: 30_000 });
    assert.deepEqual(done, { id: "{u}:node", outcome: "added" });
    // Both in the route's lane, ids of your own stored as given: payload, meta, lateness, due alike.
    const [due, ...hashes] = await laneKeys(redis, "emails", "due", "jobs", "meta", "maxlate");
    for (const key of hashes) {
      const stored = await redis.hgetBuffer(key, "{u}:node");
      assert.ok(stored !== null, key);
      assert.deepEqual(stored, await redis.hgetBuffer(key, "{u}:cli"), key);
    }
    assert.equal(await redis.zscore(due, "{u}:node"), String(atMs));
    assert.equal(await redis.zscore(due, "{u}:cli"), String(atMs));
    const job = await client.get("{u}:node");
    assert.equal(job.state, "scheduled");
    assert.equal(job.dueMs, atMs);
    assert.equal(job.payload.toString(), "hi there");
    assert.deepEqual(job.headers, { tenant: "acme", traceparent: TRACEPARENT });
    assert.equal((await client.enqueue({ dest: "emails", payload: "x", id: "{u}:node" }, "keep")).outcome, "kept");
    await assert.rejects(client.enqueue({ dest: "emails", payload: "x", id: "{u}:node" }, "error"), zdelay.JobExists);
    daemon.cli("enqueue", "--dest", "emails", "--id", "s-cli", "--at", String(atMs), "--payload", "x", "--spread", "10s");
    await client.enqueue({ dest: "emails", payload: "x", id: "s-node", at: atMs, spread: 10_000 });
    for (const id of ["s-cli", "s-node"]) assert.equal((await client.get(id)).dueMs, atMs + zdelay.spreadOffset(id, 10_000));
    assert.ok((await client.reschedule("{u}:node", { delay: 7_200_000 })) > atMs);
    assert.equal(await client.cancel("{u}:node"), "cancelled");
    assert.equal(await client.cancel("{u}:node"), "not_pending");
    assert.equal(await client.get("{u}:node"), null);

    const results = await client.enqueueMany(Array.from({ length: 300 }, (_, i) => ({ dest: "emails", payload: `p${i}`, delay: i })));
    assert.ok(results.every((r) => !(r instanceof Error)));
    await waitFor("300 delivered", async () => (await redis.llen("q:emails")) === 300);
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("two-phase jobs are stored in their spread shard framed as the vectors say", async () => {
  // A route lane keeps payload and meta apart; the frame is what spread shards store, so every
  // destination of the vectors is a two-phase route here (a remote-Redis sink), or a <sink>/<target>.
  const server = await startRedis();
  const dests = [...new Set(VECTORS.envelopes.map((c) => c.dest).filter((d) => !d.includes("/")))];
  const extra = `[sinks.other]\nkind = "redis"\nurl = "${server.url}"\n\n`
    + dests.map((d) => `[[routes]]\nname = "${d}"\nsink = "other"\ntarget = "q:${d}"\n`).join("\n");
  const daemon = await startDaemon(`url = "${server.url}"`, { shards: 4, routes: [], extra });
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  try {
    for (const [i, c] of VECTORS.envelopes.entries()) {
      const id = `{v}:${i}`;
      await client.enqueue({ dest: c.dest, payload: Buffer.from(c.payload_base64, "base64"), id, delay: 3_600_000,
        headers: c.headers, maxAttempts: c.max_attempts ?? undefined, maxLateness: c.max_lateness_ms ?? undefined });
      const [jobs] = spreadShardKeys(4, zdelay.shardOf(id, 4), "jobs");
      const stored = await redis.hgetBuffer(jobs, id);
      assert.equal(stored?.toString("base64"), c.frame_base64, c.name);
    }
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("unique windows and debounce answer as the CLI does", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`);
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  const now = async () => { const [s, us] = await redis.time(); return Number(s) * 1000 + Math.floor(Number(us) / 1000); };
  try {
    assert.equal((await client.enqueue({ dest: "emails", payload: "once", id: "u1", uniqueFor: 300_000 })).outcome, "added");
    await waitFor("delivered", async () => (await redis.lrange("q:emails", 0, -1)).includes("once"));
    // Delivered within its window: a duplicate whatever the policy, and nothing written.
    assert.equal((await client.enqueue({ dest: "emails", payload: "again", id: "u1", uniqueFor: 300_000 })).outcome, "duplicate");
    assert.equal((await client.enqueue({ dest: "emails", payload: "again", id: "u1", uniqueFor: 300_000 }, "error")).outcome, "duplicate");
    assert.equal(await client.get("u1"), null);
    assert.equal(JSON.parse(daemon.cli("enqueue", "--dest", "emails", "--id", "u1", "--payload", "x", "--unique-for", "5m", "-o", "json")).duplicate, true);

    // Debounce: pushed later by each enqueue, never past the first enqueue plus max wait.
    const before = await now();
    await client.enqueue({ dest: "emails", payload: "v1", id: "d1", at: before + 30_000 }, { debounce: 60_000 });
    const after = await now();
    const again = await client.enqueue({ dest: "emails", payload: "v2", id: "d1", at: before + 600_000 }, { debounce: 60_000 });
    assert.equal(again.outcome, "replaced");
    const due = (await client.get("d1")).dueMs;
    assert.ok(due >= before + 60_000 && due <= after + 60_000, `${due}`);
    daemon.cli("enqueue", "--dest", "emails", "--id", "d1", "--payload", "v3", "--at", String(before + 40_000),
      "--on-conflict", "debounce", "--max-wait", "60s");
    assert.equal((await client.get("d1")).dueMs, before + 40_000);
    await assert.rejects(client.enqueue({ dest: "emails", payload: "x" }, "debounce"), (e) => e instanceof zdelay.InvalidJob && e.field === "onConflict");
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

// The producer's ACL rules from the security guide, with +fcall for the protocol.
function documentedProducerAcl() {
  const guide = readFileSync(join(ROOT, "docs/guides/security.md"), "utf8");
  const block = guide.split("ACL SETUSER producer")[1].split("```")[0];
  const rules = block.replaceAll("\\\n", " ").split(/\s+/).filter(Boolean);
  return [...rules.filter((r) => r !== "+script|load" && r !== "+evalsha"), "+fcall"];
}

test("a producer with the documented ACL cancels and needs the windows key for a window", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`);
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url.replace("redis://", "redis://producer:secret@")));
  try {
    await redis.call("ACL", "SETUSER", "producer", "reset", ...documentedProducerAcl());
    assert.equal((await client.enqueue({ dest: "emails", payload: "x", id: "acl-1", delay: 3_600_000 })).outcome, "added");
    // A cancel takes the unique key, which the documented ACL grants.
    assert.equal(await client.cancel("acl-1"), "cancelled");
    assert.equal(await client.get("acl-1"), null);
    // A call that uses a window needs the windows key the guide says to add; nothing is written.
    await assert.rejects(client.enqueue({ dest: "emails", payload: "x", id: "acl-2", delay: 3_600_000, uniqueFor: 3_600_000 }), /NOPERM/);
    assert.equal(await new zdelay.Client(redis).get("acl-2"), null);
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("a producer that may not read the lane registry gets Redis's refusal", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`);
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url.replace("redis://", "redis://no-registry:secret@")));
  try {
    await redis.call("ACL", "SETUSER", "no-registry", "on", ">secret", "~*", "&*", "+@all", "-hgetall");
    await assert.rejects(client.enqueue({ dest: "emails", payload: "x", id: "refused" }), /NOPERM.*hgetall/);
    assert.equal(await new zdelay.Client(redis).get("refused"), null);
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("schedules are set, paused, resumed and deleted through a daemon, planned as the CLI plans them", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`);
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  try {
    daemon.cli("schedule", "set", "by-cli", "--dest", "emails", "--cron", "0 9 * * 1-5", "--tz", "Europe/Paris",
      "--payload", "report", "--header", "tenant=acme", "--misfire", "skip", "--max-lateness", "30s", "--jitter", "2m");
    const state = await client.scheduleSet({ id: "by-node", dest: "emails", payload: "report", cron: "0 9 * * 1-5",
      tz: "Europe/Paris", headers: { tenant: "acme" }, misfire: "skip", maxLateness: 30_000, jitter: 120_000 });
    const read = (id) => {
      const v = JSON.parse(daemon.cli("schedule", "get", id, "-o", "json"));
      for (const k of ["id", "version", "created_ms", "updated_ms", "shard"]) delete v[k];
      return v;
    };
    const cli = read("by-cli");
    assert.deepEqual(state, { exists: true, paused: false, nextMs: cli.next_ms });
    assert.deepEqual(read("by-node"), cli);
    assert.equal(cli.jitter_ms, 120_000);

    await client.scheduleSet({ id: "tick", dest: "emails", payload: "tick", every: 200 });
    await waitFor("two occurrences", async () => (await redis.lrange("q:emails", 0, -1)).filter((p) => p === "tick").length >= 2);
    assert.deepEqual(await client.schedulePause("tick"), { exists: true, paused: true, nextMs: null });
    assert.ok((await client.scheduleResume("tick")).nextMs > 0);
    assert.equal((await client.scheduleDelete("tick")).exists, false);

    await assert.rejects(client.scheduleSet({ id: "bad", dest: "emails", cron: "61 * * * *" }),
      (e) => e instanceof zdelay.ScheduleRefused && /cron/.test(e.message));
    await assert.rejects(client.scheduleSet({ id: "bad", dest: "nowhere", every: 1000 }),
      (e) => e instanceof zdelay.ScheduleRefused && /unknown destination/.test(e.message));
    for (const [extra, field] of [[{}, "cron"], [{ every: 5, tz: "UTC" }, "tz"], [{ every: 0 }, "every"],
      [{ every: 5, misfire: "later" }, "misfire"], [{ every: 5, startAt: 1_700_000_000 }, "at"], [{ every: 5, headers: { n: 1 } }, "headers.n"]]) {
      await assert.rejects(client.scheduleSet({ id: "bad", dest: "emails", ...extra }),
        (e) => e instanceof zdelay.InvalidJob && e.field === field, JSON.stringify(extra));
    }
    assert.equal(await redis.hlen("{zdelay}:sched_requests"), 0);
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("a schedule with a calendar is planned as the CLI plans it", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`);
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  const dir = mkdtempSync(join(tmpdir(), "zdelay-cal-"));
  try {
    writeFileSync(join(dir, "holidays.txt"), "2030-12-25\n2031-01-01\n");
    daemon.cli("calendar", "set", "hol", "--dates", join(dir, "holidays.txt"));
    daemon.cli("schedule", "set", "cal-cli", "--dest", "emails", "--cron", "0 9 * * *", "--tz", "Europe/Paris",
      "--payload", "r", "--calendar", "hol", "--shift", "next");
    const state = await client.scheduleSet({ id: "cal-node", dest: "emails", payload: "r", cron: "0 9 * * *",
      tz: "Europe/Paris", calendar: "hol", shift: "next" });
    const read = (id) => {
      const v = JSON.parse(daemon.cli("schedule", "get", id, "-o", "json"));
      for (const k of ["id", "version", "created_ms", "updated_ms", "shard"]) delete v[k];
      return v;
    };
    const cli = read("cal-cli");
    assert.equal(state.nextMs, cli.next_ms);
    assert.deepEqual(read("cal-node"), cli);
    assert.match(JSON.stringify(cli), /hol/);
    await assert.rejects(client.scheduleSet({ id: "cal-bad", dest: "emails", cron: "0 9 * * *", calendar: "nope" }),
      (e) => e instanceof zdelay.ScheduleRefused && /no calendar named/.test(e.message));
    for (const [extra, field] of [[{ calendar: "no spaces" }, "calendar"], [{ calendar: "hol", shift: "later" }, "shift"],
      [{ shift: "next" }, "shift"]]) {
      await assert.rejects(client.scheduleSet({ id: "cal-bad", dest: "emails", cron: "0 9 * * *", ...extra }),
        (e) => e instanceof zdelay.InvalidJob && e.field === field, JSON.stringify(extra));
    }
    await assert.rejects(client.scheduleSet({ id: "cal-bad", dest: "emails", every: 60_000, calendar: "hol", shift: "previous" }),
      (e) => e instanceof zdelay.InvalidJob && /need cron/.test(e.message));
    assert.doesNotMatch(daemon.cli("schedule", "list"), /cal-bad/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("bad input is refused by name and writes nothing; no namespace before a daemon", async () => {
  const server = await startRedis();
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url), { maxPayload: 100 });
  try {
    await assert.rejects(client.enqueue({ dest: "emails", payload: "x" }), (e) => e instanceof zdelay.NoNamespace && e.retryable);
    assert.equal(await redis.dbsize(), 0);
    const daemon = await startDaemon(`url = "${server.url}"`);
    // The keys a job could be written to: the daemon's own bookkeeping ({zdelay}:…, written
    // on its own schedule) is left out.
    const jobKeys = async () => (await redis.keys("*")).filter((k) => !k.startsWith("{zdelay}:")).sort();
    try {
      const before = await jobKeys();
      const cases = [
        [{ headers: { n: 1 } }, "headers.n"], [{ at: 1_700_000_000 }, "at"], [{ at: 1, delay: 1 }, "at"],
        [{ id: "~mine" }, "id"], [{ maxAttempts: 0 }, "maxAttempts"], [{ maxLateness: -5 }, "maxLateness"],
        [{ payload: "x".repeat(101) }, "payload"], [{ dest: "a\nb" }, "dest"],
      ];
      for (const [extra, field] of cases) {
        await assert.rejects(client.enqueue({ dest: "emails", payload: "x", ...extra }),
          (e) => e instanceof zdelay.InvalidJob && e.field === field, JSON.stringify(extra));
      }
      assert.deepEqual(await jobKeys(), before);
    } finally {
      await daemon.stop();
    }
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await server.stop();
  }
});

test("a server without the library, or speaking another protocol or layout, is refused by name", async () => {
  const server = await startRedis();
  const redis = new Redis(server.url);
  const client = () => new zdelay.Client(new Redis(server.url));
  const refused = async (pattern) => {
    const c = client();
    await assert.rejects(c.enqueue({ dest: "emails", payload: "x" }), (e) => e instanceof zdelay.ProtocolError && pattern.test(e.message));
    c.redis.disconnect();
  };
  try {
    await redis.hset("zdelay:schema", { shards: 4, layout: 2 });
    await refused(/function library for protocol 2 is not on this server/);
    // Protocol 1's library, as a release before protocol 2 loads it: not this client's.
    await redis.call("FUNCTION", "LOAD", readFileSync(join(ROOT, "tests/it/fixtures/library_zdelay_p1_de46fba.lua"), "utf8"));
    await refused(/function library for protocol 2 is not on this server/);
    const newer = "#!lua name=zdelay_p2\nredis.register_function('zd2_protocol', function() return {3, '9.0.0'} end)";
    await redis.call("FUNCTION", "LOAD", newer);
    await refused(/says 3; this client speaks 2/);
    await redis.call("FUNCTION", "LOAD", "REPLACE", newer.replace("{3,", "{2,"));
    for (const [layout, error, pattern] of [[3, zdelay.LayoutTooNew, /storage layout 3/], [1, zdelay.LayoutTooOld, /`zdelay upgrade`/],
      ["two", zdelay.ProtocolError, /field layout holds "two"/]]) {
      await redis.hset("zdelay:schema", "layout", layout);
      const c = client();
      await assert.rejects(c.enqueue({ dest: "emails", payload: "x" }), (e) => e instanceof error && !e.retryable && pattern.test(e.message));
      c.redis.disconnect();
    }
    assert.deepEqual(await redis.keys("*"), ["zdelay:schema"]);
  } finally {
    redis.disconnect();
    await server.stop();
  }
});

test("on a cluster on layout 2, jobs go to their route's lane and are delivered", async () => {
  const nodes = [];
  for (let i = 0; i < 3; i++) nodes.push(await startRedis(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]));
  try {
    execFileSync("redis-cli", ["--cluster", "create", ...nodes.map((n) => `127.0.0.1:${n.port}`), "--cluster-replicas", "0", "--cluster-yes"], { stdio: "ignore" });
    await waitFor("cluster_state:ok", async () => {
      for (const n of nodes) {
        const r = new Redis(n.port);
        const info = await r.cluster("INFO");
        r.disconnect();
        if (!String(info).includes("cluster_state:ok")) return false;
      }
      return true;
    });
    const seeds = nodes.map((n) => `"${n.url}"`).join(", ");
    const daemon = await startDaemon(`cluster_nodes = [${seeds}]`, { shards: 4 });
    const cluster = new Cluster(nodes.map((n) => ({ host: "127.0.0.1", port: n.port })));
    const client = new zdelay.Client(cluster);
    try {
      const later = await client.enqueue({ dest: "emails", payload: "later", delay: 3_600_000 });
      assert.match(later.id, /^~/);
      assert.equal((await client.get(later.id)).state, "scheduled");
      await client.enqueue({ dest: "emails", payload: "mine", id: "mine", delay: 3_600_000, headers: { k: "v" } });
      assert.deepEqual((await client.get("mine", "emails")).headers, { k: "v" });
      // Without its destination, an id of your own is looked for in every lane.
      assert.equal((await client.get("mine")).dest, "emails");
      assert.equal(await client.get("nobody"), null);
      await assert.rejects(client.enqueue({ dest: "nowhere", payload: "x" }), zdelay.UnknownDestination);
      assert.equal(await client.cancel(later.id), "cancelled");
      await client.enqueue({ dest: "emails", payload: "now" });
      await waitFor("delivered from the lane", async () => (await cluster.lrange("q:emails", 0, -1)).join() === "now");
      assert.ok((await client.scheduleSet({ id: "s", dest: "emails", payload: "tick", every: 200 })).exists);
      await waitFor("an occurrence from the lane", async () => (await cluster.lrange("q:emails", 0, -1)).includes("tick"));
      assert.equal((await client.scheduleDelete("s")).exists, false);
    } finally {
      cluster.disconnect();
      await daemon.stop();
    }
  } finally {
    for (const n of nodes) await n.stop();
  }
});

// This build's `zdelay upgrade --yes` on `config`, held right after it fenced every layout-1 shard
// (nothing moved yet) until release().
async function heldUpgrade(config, dir) {
  const gate = join(dir, "upgrade-gate");
  const proc = spawn(zdelayBin, ["upgrade", "--yes", "--config", config], {
    env: { ...process.env, ZDELAY_FAILPOINT: `upgrade_after_fence=${gate}`, ZDELAY_LOG: "warn" },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let stderr = "";
  proc.stderr.on("data", (d) => (stderr += d));
  const exited = new Promise((res) => proc.once("exit", (code) => res(code)));
  await waitFor("the upgrade fenced layout 1", async () => existsSync(`${gate}.reached`) || proc.exitCode !== null);
  assert.equal(proc.exitCode, null, stderr);
  return {
    release: () => writeFileSync(gate, "go"),
    finish: async () => {
      writeFileSync(gate, "go");
      assert.equal(await exited, 0, stderr);
    },
  };
}

// Every key but the daemons' own bookkeeping, with its value: what a producer's call could have written.
async function stored(redis) {
  const out = {};
  for (const key of (await redis.keys("*")).sort()) {
    // The daemons' own state (their registrations, stats, poller-slot plan), which they
    // rewrite or let lapse on their own schedule: not what a client call writes.
    if (/instances|stats|activity|heartbeat|poller|sched_lock|\}:plan$|\}:slots$/.test(key)) continue;
    const type = await redis.type(key);
    out[key] = type === "hash" ? await redis.hgetall(key)
      : type === "zset" ? await redis.zrange(key, 0, -1, "WITHSCORES")
      : type === "string" ? await redis.get(key)
      : type === "list" ? await redis.lrange(key, 0, -1)
      : type === "set" ? (await redis.smembers(key)).sort() : type;
  }
  return out;
}

// Every call of `client` refused naming `zdelay upgrade`, not retryable, nothing written.
async function refusedOnLayout1(client, redis, upgrading) {
  const before = await stored(redis);
  for (const call of [
    () => client.enqueue({ dest: "emails", payload: "x", id: "new", delay: 3_600_000 }),
    () => client.enqueue({ dest: "mirror", payload: "x", delay: 3_600_000 }),
    () => client.get("keep"), () => client.cancel("cancel", "emails"), () => client.reschedule("reschedule", { delay: 7_200_000 }),
    () => client.scheduleSet({ id: "s", dest: "emails", payload: "x", every: 3_600_000 }),
  ]) {
    await assert.rejects(call(), (e) => e instanceof zdelay.LayoutTooOld && e instanceof zdelay.ProtocolError && !e.retryable
      && /storage layout 1/.test(e.message) && e.message.includes("`zdelay upgrade`") && !e.message.includes("\n")
      && /is moving it to layout 2/.test(e.message) === upgrading);
  }
  assert.deepEqual(await stored(redis), before, "nothing written");
}

test("a layout-1 namespace is refused until zdelay upgrade moved it; then its jobs are found", async () => {
  const server = await startRedis();
  // Served by the older release: its daemon on layout 1, with a local route and a two-phase one (to
  // a Redis sink), and its CLI's jobs; its library is protocol 1's only.
  const extra = `[sinks.other]\nkind = "redis"\nurl = "${server.url}"\n\n[[routes]]\nname = "mirror"\nsink = "other"\ntarget = "q:mirror"\n`;
  const old = await startDaemon(`url = "${server.url}"`, { shards: 4, layout: 1, extra, binary: pinnedZdelay() });
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  let upgrade, current;
  try {
    assert.equal(await redis.hget("zdelay:schema", "layout"), "1");
    for (const id of ["keep", "cancel", "reschedule"]) old.cli("enqueue", "--dest", "emails", "--id", id, "--in", "1h", "--payload", id);
    old.cli("enqueue", "--dest", "mirror", "--id", "far", "--in", "1h", "--payload", "far");
    await refusedOnLayout1(client, redis, false);

    // This build's upgrade, held after its fence: still layout 1 (upgrading), still refused.
    const config = join(old.dir, "current.toml");
    writeFileSync(config, readFileSync(old.config, "utf8").replace("layout = 1\n", ""));
    upgrade = await heldUpgrade(config, old.dir);
    assert.equal(await redis.hget("zdelay:schema", "upgrading"), "2");
    await refusedOnLayout1(client, redis, true);
    await upgrade.finish();
    assert.equal(await redis.hget("zdelay:schema", "layout"), "2");

    // Moved, with the older daemon still running: only this release's daemons load the library of
    // protocol 2, so the client says that until one runs.
    await assert.rejects(client.get("keep"), (e) => e instanceof zdelay.ProtocolError && /library for protocol 2 is not on this server/.test(e.message));
    current = await startDaemon(`url = "${server.url}"`, { shards: 4, extra });
    await old.stop();
    assert.equal((await redis.call("FUNCTION", "LIST", "LIBRARYNAME", "zdelay_p1")).length, 1);
    // The jobs of layout 1, found by id where the upgrade moved them (local: the route's lane;
    // two-phase: its spread shard).
    const keep = await client.get("keep");
    assert.deepEqual([keep.state, keep.dest, keep.payload.toString()], ["scheduled", "emails", "keep"]);
    assert.equal((await client.get("far")).dest, "mirror");
    assert.equal(await client.cancel("cancel", "emails"), "cancelled");
    assert.equal(await client.get("cancel"), null);
    assert.notEqual(await client.reschedule("reschedule", { delay: 0 }), null);
    assert.equal((await client.enqueue({ dest: "emails", payload: "now" })).outcome, "added");
    await waitFor("delivered by this build", async () => (await redis.lrange("q:emails", 0, -1)).sort().join() === "now,reschedule");
  } finally {
    upgrade?.release();
    client.redis.disconnect();
    redis.disconnect();
    await old.stop();
    await current?.stop();
    await server.stop();
  }
});

test("lookups by id during a reshard of the spread shards find two-phase jobs it has not moved yet", async () => {
  const [server, remote] = [await startRedis(), await startRedis()];
  const extra = `\n[sinks.other]\nkind = "redis"\nurl = "${remote.url}"\n\n[[routes]]\nname = "mirror"\nsink = "other"\ntarget = "q:mirror"\n`;
  const daemon = await startDaemon(`url = "${server.url}"`, { shards: 4, extra });
  const client = new zdelay.Client(new Redis(server.url));
  const gate = join(daemon.dir, "reshard-gate");
  let proc;
  try {
    for (const id of ["keep", "cancel", "reschedule"]) await client.enqueue({ dest: "mirror", payload: id, id, delay: 3_600_000 });
    proc = spawn(zdelayBin, ["reshard", "--to", "8", "--yes", "--config", daemon.config], {
      env: { ...process.env, ZDELAY_FAILPOINT: `reshard_after_fence=${gate}`, ZDELAY_LOG: "warn" },
      stdio: ["ignore", "ignore", "pipe"],
    });
    let stderr = "";
    proc.stderr.on("data", (d) => (stderr += d));
    const exited = new Promise((res) => proc.once("exit", (code) => res(code)));
    await waitFor("the reshard fenced the old shards", async () => existsSync(`${gate}.reached`) || proc.exitCode !== null);
    assert.equal(proc.exitCode, null, stderr);
    // New work follows the new count at once.
    assert.equal((await client.enqueue({ dest: "mirror", payload: "new", delay: 3_600_000 })).outcome, "added");
    // Not moved yet and nothing moves: a retryable refusal, never "not pending".
    await assert.rejects(client.cancel("cancel", "mirror"), (e) => e instanceof zdelay.Upgrading && e.retryable && /resharded/.test(e.message));
    setTimeout(() => writeFileSync(gate, "go"), 300);
    assert.equal(await client.cancel("cancel", "mirror"), "cancelled");
    assert.equal((await client.get("keep")).state, "scheduled");
    assert.ok((await client.reschedule("reschedule", { delay: 7_200_000 })) > Date.now());
    assert.equal(await exited, 0, stderr);
    assert.equal(await client.get("cancel", "mirror"), null);
    assert.equal((await client.get("keep", "mirror")).payload.toString(), "keep");
  } finally {
    writeFileSync(gate, "go");
    client.redis.disconnect();
    await daemon.stop();
    await remote.stop();
    await server.stop();
  }
});

test("on layout 2 an id of your own is looked for in every lane; held by two routes it needs dest", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`, { shards: 4, routes: ["emails", "sms"] });
  const client = new zdelay.Client(new Redis(server.url));
  try {
    await client.enqueue({ dest: "sms", payload: "text", id: "one", delay: 3_600_000 });
    assert.equal((await client.get("one")).dest, "sms");
    assert.ok((await client.reschedule("one", { delay: 7_200_000 })) > Date.now());
    for (const dest of ["emails", "sms"]) await client.enqueue({ dest, payload: dest, id: "two", delay: 3_600_000 });
    await assert.rejects(client.cancel("two"), (e) => e instanceof zdelay.InvalidJob && e.field === "dest" && /emails, sms/.test(e.message));
    assert.equal(await client.cancel("two", "sms"), "cancelled");
    assert.equal((await client.get("two")).dest, "emails");
    assert.equal(await client.cancel("none"), "not_pending");
    assert.equal(await client.get("none"), null);
  } finally {
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("on layout 2 a route without a lane is retryable and writes nothing", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`, { shards: 4 });
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  try {
    const lanesBefore = await redis.hgetall("zdelay:lanes");
    const keysBefore = new Set(await redis.keys("zdelay:{*"));
    for (const dest of ["sms", "nowhere"]) {
      await assert.rejects(client.enqueue({ dest, payload: "x" }), (e) => e instanceof zdelay.NoLane
        && e instanceof zdelay.UnknownDestination && e.retryable
        && e.message.includes(`destination "${dest}" has no route lane yet`)
        && e.message.includes("a producer given that config") && e.message.includes("nothing was written"));
    }
    const [refused, done] = await client.enqueueMany([{ dest: "sms", payload: "x" }, { dest: "emails", payload: "y", delay: 3_600_000 }]);
    assert.ok(refused instanceof zdelay.NoLane && done.outcome === "added");
    assert.deepEqual(await redis.hgetall("zdelay:lanes"), lanesBefore);
    assert.deepEqual((await redis.keys("zdelay:{*")).filter((k) => !keysBefore.has(k) && !k.endsWith(":emails")), []);
    // A producer given a config with the route registers its lane; the same call then goes in.
    const config = join(daemon.dir, "sms.toml");
    writeFileSync(config, `[redis]\nurl = "${server.url}"\nshards = 4\n\n[[routes]]\nname = "sms"\nsink = "local"\ntarget = "q:sms"\n`);
    execFileSync(zdelayBin, ["enqueue", "--config", config, "--dest", "sms", "--in", "1h", "--payload", "z"]);
    assert.equal((await client.enqueue({ dest: "sms", payload: "x" })).outcome, "added");
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("a namespace that needs a newer client is refused with nothing written", async () => {
  const server = await startRedis();
  // Beside the local route, a two-phase one: its jobs are in spread shards, whose markers a newer
  // storage layout sets to refuse this one's calls.
  const extra = `[sinks.other]\nkind = "redis"\nurl = "${server.url}"\n\n[[routes]]\nname = "mirror"\nsink = "other"\ntarget = "q:mirror"\n`;
  const daemon = await startDaemon(`url = "${server.url}"`, { shards: 4, extra });
  const redis = new Redis(server.url);
  const client = () => new zdelay.Client(new Redis(server.url));
  const c = client();
  try {
    const [jobs] = await laneKeys(redis, "emails", "jobs");
    await redis.hset("zdelay:schema", "min_version", "99.0.0");
    await assert.rejects(c.enqueue({ dest: "emails", payload: "x", id: "too-old" }),
      (e) => e instanceof zdelay.LayoutTooNew && !e.retryable && /99\.0\.0/.test(e.message));
    assert.equal(await redis.hexists(jobs, "too-old"), 0);
    // This client's own version, or an older one, is fine; so is a pre-release of it.
    for (const version of [zdelay.VERSION, "0.0.9", "0.1.0-rc.1"]) {
      await redis.hset("zdelay:schema", "min_version", version);
      const ok = client();
      for (const dest of ["emails", "mirror"]) {
        assert.equal((await ok.enqueue({ dest, payload: "x", id: `ok-${version}`, delay: 3_600_000 })).outcome, "added");
      }
      ok.redis.disconnect();
    }
    await redis.hset("zdelay:schema", "min_version", "not a version");
    const bad = client();
    await assert.rejects(bad.get("x"), (e) => e instanceof zdelay.ProtocolError && /min_version/.test(e.message));
    bad.redis.disconnect();
    // A spread shard fenced by a newer zdelay refuses a client that read the namespace before.
    await redis.hdel("zdelay:schema", "min_version");
    assert.equal((await c.get("ok-0.0.9", "mirror")).state, "scheduled");
    for (let s = 0; s < 4; s++) await redis.set(spreadShardKeys(4, s, "shards")[0], "layout 3 99.0.0");
    await assert.rejects(c.cancel("ok-0.0.9", "mirror"), (e) => e instanceof zdelay.LayoutTooNew && /99\.0\.0/.test(e.message));
    assert.equal((await c.get("ok-0.0.9", "emails")).state, "scheduled", "a lane is not a spread shard");
  } finally {
    c.redis.disconnect();
    redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("versions are ordered as semantic versions; the client's is the package's", () => {
  const order = ["0.1.0-alpha", "0.1.0-alpha.1", "0.1.0-alpha.beta", "0.1.0-beta.2", "0.1.0-beta.11", "0.1.0-rc.1",
    "0.1.0", "0.1.1", "0.2.0", "1.0.0+build.5"];
  for (let i = 1; i < order.length; i++) assert.ok(zdelay.compareVersions(order[i - 1], order[i]) < 0, `${order[i - 1]} < ${order[i]}`);
  assert.equal(zdelay.compareVersions("1.0.0+a", "1.0.0+b"), 0);
  for (const bad of ["", "1.0", "v1.0.0", "1.0.x", "not a version"]) assert.equal(zdelay.versionKey(bad), null, bad);
  const pkg = JSON.parse(readFileSync(join(ROOT, "clients/node/package.json"), "utf8"));
  assert.equal(zdelay.VERSION, pkg.version);
});

test("lookups by id follow a lane whose route's list moved to another slot", async () => {
  // The daemon started with the new list retires the old lane and relocates its jobs (held here
  // after its first put, so they are in both lanes); a client that read the registry before finds
  // and cancels them by id meanwhile.
  const server = await startRedis();
  let daemon = await startDaemon(`url = "${server.url}"`, { shards: 4 });
  const client = new zdelay.Client(new Redis(server.url));
  const gate = join(daemon.dir, "..", `relocate-gate-${process.pid}`);
  try {
    const generated = (await client.enqueue({ dest: "emails", payload: "generated", delay: 3_600_000 })).id;
    await client.enqueue({ dest: "emails", payload: "gone", id: "gone", delay: 3_600_000 });
    assert.ok(generated.startsWith("~"));
    await daemon.stop();
    daemon = await startDaemon(`url = "${server.url}"`, {
      shards: 4, targets: { emails: "q:elsewhere" },
      env: { ZDELAY_FAILPOINT: `relocate_after_put=${gate}` }, ready: async () => existsSync(`${gate}.reached`),
    });
    // Still in the old lane (not forgotten there yet): a retryable refusal, never "not found".
    await assert.rejects(client.get(generated), (e) => e instanceof zdelay.Fenced && e.retryable && /new lane/.test(e.message));
    setTimeout(() => writeFileSync(gate, "go"), 300);
    assert.equal((await client.get(generated)).payload.toString(), "generated");
    assert.equal(await client.cancel("gone"), "cancelled");
    assert.equal(await client.get("gone"), null);
  } finally {
    writeFileSync(gate, "go");
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
    rmSync(gate, { force: true });
    rmSync(`${gate}.reached`, { force: true });
  }
});
