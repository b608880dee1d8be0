// A test namespace's clock ([testing] clock = true): a job enqueued 30 days ahead arrives
// moments after the clock is advanced 30 days, from this client; the clock only moves forward,
// and a namespace without one refuses to move.
import { test } from "node:test";
import assert from "node:assert/strict";
import Redis from "ioredis";
import * as zdelay from "../dist/esm/index.js";
import { startRedis, startDaemon, waitFor } from "./servers.mjs";

const DAY = 86_400_000;
const TESTING = '\n[poller]\nidle_poll_max = "60s"\n\n[testing]\nclock = true\n';

test("a job 30 days ahead arrives moments after advancing the clock 30 days", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`, { extra: TESTING });
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  try {
    const before = await client.clock();
    assert.equal(before.offsetMs, 0);
    const { id } = await client.enqueue({ dest: "emails", payload: "renewal reminder", delay: 30 * DAY });
    const view = await client.get(id);
    assert.equal(view.state, "scheduled");
    assert.ok(Math.abs(view.dueMs - (before.nowMs + 30 * DAY)) < 10_000, `${view.dueMs}`);

    const moved = await client.advanceClock(30 * DAY);
    assert.equal(moved.offsetMs, 30 * DAY);
    assert.ok(moved.nowMs >= before.nowMs + 30 * DAY);
    const started = Date.now();
    await waitFor("the job delivered", async () => (await redis.llen("q:emails")) === 1, 3000);
    console.log(`delivered ${Date.now() - started} ms after the advance`);
    assert.deepEqual(await redis.lrange("q:emails", 0, -1), ["renewal reminder"]);

    // A delay, and a reschedule's, now count from the moved clock.
    const later = await client.enqueue({ dest: "emails", payload: "tomorrow", delay: DAY });
    assert.ok(Math.abs((await client.get(later.id)).dueMs - ((await client.clock()).nowMs + DAY)) < 10_000);
    assert.equal((await client.get(later.id)).state, "scheduled");
    const due = await client.reschedule(later.id, { delay: 2 * DAY });
    assert.ok(Math.abs(due - ((await client.clock()).nowMs + 2 * DAY)) < 10_000, `${due}`);
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});

test("a clock moves forward only, and only on a namespace created with one", async () => {
  const server = await startRedis();
  const daemon = await startDaemon(`url = "${server.url}"`);
  const redis = new Redis(server.url);
  const client = new zdelay.Client(new Redis(server.url));
  try {
    await assert.rejects(client.clock(), (e) => e instanceof zdelay.NoTestClock);
    await assert.rejects(client.advanceClock(DAY), (e) => e instanceof zdelay.NoTestClock);
    assert.equal(await redis.hget("zdelay:schema", "clock_ms"), null, "nothing written");
    for (const bad of [-DAY, 0, 1.5, Number.NaN]) {
      await assert.rejects(client.advanceClock(bad), (e) => e instanceof zdelay.InvalidJob, `${bad}`);
    }
  } finally {
    redis.disconnect();
    client.redis.disconnect();
    await daemon.stop();
    await server.stop();
  }
});
