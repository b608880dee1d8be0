// Real servers for the tests: private redis-servers and a real `zdelay run` of this checkout
// (ZDELAY_BIN, else target/debug/zdelay), stopped by pid.
import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, writeFileSync, rmSync, openSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import Redis from "ioredis";

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
// counts as started (default /readyz).
export async function startDaemon(redisToml, { shards = 10, layout = 1, routes = ["emails"], targets = {}, env = {}, ready, extra = "" } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "zd-node-daemon-"));
  const admin = await freePort();
  const config = join(dir, "zdelay.toml");
  // layout null: none in the config, so the daemon follows the namespace (onto layout 2 when upgraded).
  const layoutLine = layout === null ? "" : `layout = ${layout}\n`;
  writeFileSync(config, `[redis]\n${redisToml}\nshards = ${shards}\n${layoutLine}\n[admin]\nlisten = "127.0.0.1:${admin}"\n\n`
    + routes.map((r) => `[[routes]]\nname = "${r}"\nsink = "local"\ntarget = "${targets[r] ?? `q:${r}`}"\n`).join("\n") + extra);
  const log = openSync(join(dir, "daemon.log"), "w");
  const proc = spawn(ZDELAY, ["run", "--config", config], { stdio: ["ignore", log, log], env: { ...process.env, ...env } });
  await waitFor("the daemon ready", async () => {
    if (proc.exitCode !== null) throw new Error(`zdelay run exited: see ${dir}/daemon.log`);
    if (ready) return ready();
    try { return (await fetch(`http://127.0.0.1:${admin}/readyz`)).ok; } catch { return false; }
  }, 30000);
  return {
    config,
    dir,
    cli: (...args) => execFileSync(ZDELAY, [...args, "--config", config]).toString().trim(),
    stop: () => stop(proc, dir),
  };
}
