// Real servers for the tests: private redis-servers and a real `zdelay run` of this checkout
// (ZDELAY_BIN, else target/debug/zdelay), stopped by pid.
import { spawn, execFileSync } from "node:child_process";
import { linkSync, mkdtempSync, renameSync, statSync, writeFileSync, rmSync, openSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import Redis from "ioredis";
import { slotTag } from "../dist/esm/index.js";

export const ROOT = resolve(import.meta.dirname ?? new URL(".", import.meta.url).pathname, "../../..");
export const ZDELAY = process.env.ZDELAY_BIN ?? join(ROOT, "target/debug/zdelay");
const REDIS_SERVER = process.env.ZDELAY_TEST_REDIS_SERVER ?? "redis-server";

export async function waitFor(what, cond, timeoutMs = 15000) {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

// A free loopback port below the kernel's ephemeral range (32768 and up), where any outgoing
// connection may take a port between this choice and the server's bind.
export async function freePort() {
  for (;;) {
    const port = 10000 + Math.floor(Math.random() * 22768);
    if (await isFree(port)) return port;
  }
}

async function isFree(port) {
  return new Promise((res) => {
    const s = createServer().once("error", () => res(false)).listen(port, "127.0.0.1", () => s.close(() => res(true)));
  });
}

export async function startRedis(extra = []) {
  let port = await freePort();
  if (extra.includes("--cluster-enabled")) {
    // The cluster bus listens on port + 10000: both must be free.
    do port = 20000 + Math.floor(Math.random() * 10000); while (!(await isFree(port)) || !(await isFree(port + 10000)));
  }
  const dir = mkdtempSync(join(tmpdir(), "zd-node-"));
  const proc = spawn(REDIS_SERVER, ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir, ...extra], { stdio: "ignore" });
  const probe = new Redis({ port, lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
  probe.on("error", () => {}); // refused until the server listens: expected, polled below
  await waitFor("redis-server", async () => {
    try {
      if (probe.status !== "ready") await probe.connect();
      return (await probe.ping()) === "PONG";
    } catch {
      probe.disconnect();
      return false;
    }
  });
  probe.disconnect();
  return { port, url: `redis://127.0.0.1:${port}`, stop: () => stop(proc, dir) };
}

function stop(proc, dir) {
  return new Promise((res) => {
    if (proc.exitCode !== null) return res();
    proc.once("exit", () => { if (dir) rmSync(dir, { recursive: true, force: true }); res(); });
    proc.kill("SIGTERM");
  });
}

// targets: a route's list other than q:<route>; env: added to the daemon's environment; ready: what
// counts as started (default /readyz); layout null (no setting) is what users get; `layout: 1` only
// for the older zdelay (`binary`: see pinnedZdelay).
export async function startDaemon(redisToml, { shards = 10, layout = null, routes = ["emails"], targets = {}, env = {}, ready, extra = "", binary = ZDELAY } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "zd-node-daemon-"));
  const admin = await freePort();
  const config = join(dir, "zdelay.toml");
  const layoutLine = layout === null ? "" : `layout = ${layout}\n`;
  writeFileSync(config, `[redis]\n${redisToml}\nshards = ${shards}\n${layoutLine}\n[admin]\nlisten = "127.0.0.1:${admin}"\n\n`
    + routes.map((r) => `[[routes]]\nname = "${r}"\nsink = "local"\ntarget = "${targets[r] ?? `q:${r}`}"\n`).join("\n") + extra);
  const log = openSync(join(dir, "daemon.log"), "w");
  const proc = spawn(binary, ["run", "--config", config], { stdio: ["ignore", log, log], env: { ...process.env, ...env } });
  await waitFor("the daemon ready", async () => {
    if (proc.exitCode !== null) throw new Error(`zdelay run exited: see ${dir}/daemon.log`);
    if (ready) return ready();
    try { return (await fetch(`http://127.0.0.1:${admin}/readyz`)).ok; } catch { return false; }
  }, 30000);
  return {
    config,
    dir,
    cli: (...args) => execFileSync(binary, [...args, "--config", config]).toString().trim(),
    stop: () => stop(proc, dir),
  };
}

let pinned;
// The older zdelay release, the last that serves storage layout 1 (what `zdelay upgrade` moves
// from; this build neither creates nor serves it): its binary's path, built once from the
// repository's history by scripts/pinned-zdelay.sh and cached under target/pinned.
export function pinnedZdelay() {
  if (pinned === undefined) {
    // Its first build leaves the older binary at target/debug/zdelay too (cargo links a new file
    // there): a second link to this build's keeps it, to put back.
    const ours = `${ZDELAY}.before-pinned`;
    rmSync(ours, { force: true });
    linkSync(ZDELAY, ours);
    try {
      pinned = execFileSync("bash", [join(ROOT, "scripts/pinned-zdelay.sh")], { stdio: ["ignore", "pipe", "inherit"] })
        .toString().trim().split("\n").pop();
    } finally {
      if (statSync(ZDELAY).ino !== statSync(ours).ino) renameSync(ours, ZDELAY);
      rmSync(ours, { force: true });
    }
  }
  return pinned;
}

// The keys of a route's lane (storage layout 2) in namespace zdelay, from its registry entry
// (`r:<route>` = `<lane> local <slot> <push> <list>`): `zdelay:{<slot's tag>}:<kind>:<route>`.
export async function laneKeys(redis, route, ...kinds) {
  const entry = await redis.hget("zdelay:lanes", `r:${route}`);
  if (entry === null) throw new Error(`no lane registered for ${route}`);
  const tag = slotTag(Number(entry.split(" ")[2]));
  return kinds.map((kind) => `zdelay:{${tag}}:${kind}:${route}`);
}

// The keys of spread shard `shard` of `shards` in namespace zdelay: `zdelay:{<tag>}:s<shard>:<kind>`,
// the tag of the slot in the middle of the shard's share of the slots.
export function spreadShardKeys(shards, shard, ...kinds) {
  return spreadShardKeysIn("zdelay", shards, shard, ...kinds);
}

export function spreadShardKeysIn(namespace, shards, shard, ...kinds) {
  const tag = slotTag(Math.floor(((2 * shard + 1) * 16384) / (2 * shards)));
  return kinds.map((kind) => `${namespace}:{${tag}}:s${shard}:${kind}`);
}
