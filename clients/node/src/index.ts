// zdelay producer client for Node: the producer protocol (docs/reference/protocol.md) on
// ioredis. Every call is one FCALL of the function library the zdelay daemons load.

import { randomBytes } from "crypto";
// Named imports: a default import of ioredis is its whole module to an ESM consumer's types
// (moduleResolution node16/nodenext), where `Redis` would not name the class.
import { Redis, Cluster } from "ioredis";

export const PROTOCOL = 2;
/** This client's release: a namespace whose schema names a newer `min_version` is refused. */
export const VERSION = "0.1.0";
/** Milliseconds a lookup by id waits for a job being moved (by `zdelay reshard` to its new spread
 * shard, or into its route's new lane) to leave where it was. */
const MOVE_WAIT_MS = 3000;
const SLOTS = 16384;

export class ZdelayError extends Error {
  /** Whether the same call may succeed later, unchanged. */
  retryable = false;
  constructor(message: string) {
    super(message);
    this.name = new.target.name;
  }
}
export class NoNamespace extends ZdelayError { retryable = true; }
/** The namespace was created without a test clock: its clock is Redis's. */
export class NoTestClock extends ZdelayError {}
export class ProtocolError extends ZdelayError {}
/** The namespace changed under the call (reshard, a lane moved): nothing was written. */
export class Fenced extends ZdelayError { retryable = true; }
/** `zdelay reshard` has not moved the job looked up by id to its new spread shard yet: nothing was
 * written; try again. */
export class Upgrading extends Fenced {}
/** The namespace needs a newer client (`min_version`, or an unknown storage layout): nothing was written. */
export class LayoutTooNew extends ProtocolError {}
/** The namespace is on storage layout 1 (also while `zdelay upgrade` runs), which this client does not
 * use: nothing was written. An operator runs `zdelay upgrade` with the older release's daemons and
 * producers still running; then this client can use it. */
export class LayoutTooOld extends ProtocolError {}
export class UnknownDestination extends ZdelayError {}
/** Storage layout 2: the destination has no route lane yet. A zdelay daemon whose config has the
 * route registers it when it starts, and so does a zdelay producer given that config (`zdelay
 * enqueue --config`, the Rust library with the config's routes); this client, which has no
 * config, cannot. Nothing was written; try again once one has (a destination no config names
 * stays refused). */
export class NoLane extends UnknownDestination { retryable = true; }
function noLane(dest: string, ns: Namespace): NoLane {
  const known = [...[...ns.lanes.keys()].sort(), ...[...ns.twoPhase].sort()].join(", ") || "none";
  return new NoLane(`destination ${JSON.stringify(dest)} has no route lane yet: on storage layout 2 a daemon whose config has the route registers it when it starts, and so does a producer given that config; nothing was written, try again once one has (registered: ${known})`);
}
export class JobExists extends ZdelayError {}
/** A daemon could not apply a schedule request: the message names why; nothing of it was written. */
export class ScheduleRefused extends ZdelayError {}
/** No daemon applied the schedule request in time; it stays, and is applied when one runs. */
export class NotApplied extends ZdelayError { retryable = true; }
export class InvalidJob extends ZdelayError {
  constructor(readonly field: string, why: string) {
    super(`${field}: ${why}`);
  }
}

const CRC: number[] = Array.from({ length: 256 }, (_, i) => {
  let c = i << 8;
  for (let k = 0; k < 8; k++) c = c & 0x8000 ? (c << 1) ^ 0x1021 : c << 1;
  return c & 0xffff;
});

/** CRC-16/XMODEM, the checksum Redis Cluster hashes keys with. */
export function crc16(data: Uint8Array): number {
  let c = 0;
  for (const b of data) c = ((c << 8) & 0xffff) ^ CRC[((c >> 8) ^ b) & 0xff];
  return c;
}

export function hashTag(key: Buffer): Buffer {
  const start = key.indexOf("{");
  if (start >= 0) {
    const end = key.indexOf("}", start + 1);
    if (end > start + 1) return key.subarray(start + 1, end);
  }
  return key;
}

/** The whole CRC-16 of the id's tag modulo the shard count (not the cluster slot). */
export function shardOf(id: string, shards: number): number {
  return crc16(hashTag(Buffer.from(id))) % shards;
}

const TAG_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz";
const tags = new Map<number, string>();

/** The shortest string over 0-9a-z in `slot`, the first in ASCII order among equals. */
export function slotTag(slot: number): string {
  const known = tags.get(slot);
  if (known !== undefined) return known;
  for (let n = 1; n <= 4; n++) {
    const digits = new Array<number>(n).fill(0);
    for (;;) {
      const tag = digits.map((d) => TAG_ALPHABET[d]).join("");
      const at = crc16(Buffer.from(tag)) % SLOTS;
      if (!tags.has(at)) tags.set(at, tag);
      if (at === slot) return tags.get(slot)!;
      let i = n - 1;
      while (i >= 0 && digits[i] === 35) digits[i--] = 0;
      if (i < 0) break;
      digits[i]++;
    }
  }
  throw new Error(`no tag for slot ${slot}`);
}

interface Lane { number: number; route: string; slot: number; push: string; list: string; }
const laneKeys = (ns: string, lane: Lane, ...kinds: string[]) =>
  kinds.map((k) => `${ns}:{${slotTag(lane.slot)}}:${k}:${lane.route}`);
const marker = (l: Lane) => `2 ${l.number.toString(36)} ${l.push} ${l.list}`;

interface Namespace {
  /** `shards`: the spread shards' count; a two-phase route's job is in spread shard `shardOf(id)`. */
  name: string; shards: number;
  lanes: Map<string, Lane>; twoPhase: Set<string>;
  /** Retired lanes (`#<lane>` → `<route> <slot> retired`): their route's list moved to another hash
   * slot, and a daemon relocates their jobs into the route's live lane (same stored ids). */
  retired: Map<number, { route: string; slot: number }>;
  /** `zdelay reshard` is moving the spread shards from this count to `shards`: two-phase jobs
   * not moved yet are in their old shards. */
  reshardingFrom?: number;
  /** Created with a test clock (`clock` = `test` in the schema): "now" is Redis's clock plus the
   * schema's `clock_ms`, which every call that reads the time adds. */
  testClock?: boolean;
}
/** Spread shard `shard`'s keys, in the middle slot of its share of the slot range. */
function shardKeys(ns: Namespace, shard: number, ...kinds: string[]): string[] {
  const tag = slotTag(Math.floor(((2 * shard + 1) * SLOTS) / (2 * ns.shards)));
  return kinds.map((k) => `${ns.name}:{${tag}}:s${shard}:${k}`);
}

type Command = (string | number | Buffer)[];
type Op<T> = Generator<Command[], T, unknown[]>;

/** A semantic version's precedence as comparable parts (a pre-release sorts before its release;
 * build metadata is ignored), or null for text that is no version. */
export function versionKey(text: string): (number | string)[][] | null {
  const [core, ...pre] = text.split("+", 1)[0].split("-");
  const parts = core.split(".");
  if (parts.length !== 3 || !parts.every((p) => /^[0-9]+$/.test(p))) return null;
  const tags = pre.length ? pre.join("-").split(".").map((t) => (/^[0-9]+$/.test(t) ? [0, Number(t), ""] : [1, 0, t])) : [];
  return [parts.map(Number), [pre.length ? 0 : 1], ...tags];
}

/** Negative, zero or positive as version `a` sorts before, with or after `b` (both versions). */
export function compareVersions(a: string, b: string): number {
  const [x, y] = [versionKey(a)!, versionKey(b)!];
  for (let i = 0; i < Math.max(x.length, y.length); i++) {
    if (x[i] === undefined || y[i] === undefined) return x[i] === undefined ? -1 : 1;
    for (let j = 0; j < x[i].length; j++) {
      if (x[i][j] !== y[i][j]) return x[i][j] < y[i][j] ? -1 : 1;
    }
  }
  return 0;
}

function tooNew(name: string | null, layout: number, minVersion: string | null): LayoutTooNew {
  const what = name ? `namespace ${name}` : "the namespace";
  return new LayoutTooNew(minVersion
    ? `${what} needs zdelay ${minVersion} or later (storage layout ${layout}; this is the zdelay Node client ${VERSION}): `
      + `upgrade the client to ${minVersion} or later`
    : `${what} is on storage layout ${layout}, which this client (${VERSION}) does not know (it knows 2): upgrade the client`);
}

function tooOld(name: string, upgrading: boolean): LayoutTooOld {
  return new LayoutTooOld(upgrading
    ? `namespace ${name} is on storage layout 1 and \`zdelay upgrade\` is moving it to layout 2: this client (${VERSION}) `
      + "uses it once the upgrade has finished; nothing was written"
    : `namespace ${name} is on storage layout 1, which this client (${VERSION}) does not use: nothing was written; `
      + "run `zdelay upgrade` (with the older release's daemons and producers still running), then use this client");
}

function* loadNamespace(name: string): Op<Namespace> {
  const [layout, shards, migrating, upgrading, minVersion, resharding, clock, protocol] = yield [
    ...["layout", "shards", "migrating", "upgrading", "min_version", "resharding", "clock"].map((f) => ["HGET", `${name}:schema`, f]),
    ["FCALL", `zd${PROTOCOL}_protocol`, 0],
  ];
  if (shards == null) {
    throw new NoNamespace(`namespace ${name} does not exist yet: a zdelay daemon creates it when it starts`);
  }
  // Before the library: a namespace this client cannot use says what to do about it, where no
  // daemon of this release has loaded the library yet. No layout field: as zdelay 0.1 created it.
  const layoutText = layout == null ? "1" : String(layout);
  if (!/^[0-9]+$/.test(layoutText)) {
    throw new ProtocolError(`${name}:schema field layout holds ${JSON.stringify(layoutText)}, not a layout number`);
  }
  const n = Number(layoutText);
  if (minVersion != null) {
    const needed = String(minVersion);
    if (!versionKey(needed)) throw new ProtocolError(`${name}:schema field min_version holds ${JSON.stringify(needed)}, not a version`);
    if (compareVersions(needed, VERSION) > 0) throw tooNew(name, n, needed);
  }
  if (n === 1) throw tooOld(name, upgrading != null);
  if (n !== 2) throw tooNew(name, n, null);
  if (protocol instanceof Error) {
    throw new ProtocolError(`the zdelay function library for protocol ${PROTOCOL} is not on this server `
      + `(${protocol.message}): a zdelay daemon of a release that speaks it loads it when it starts (Redis 7.0 or later, or Valkey 7.2)`);
  }
  const spoken = Number((protocol as unknown[])[0]);
  if (spoken !== PROTOCOL) throw new ProtocolError(`the server's zd${PROTOCOL}_protocol says ${spoken}; this client speaks ${PROTOCOL}`);
  if (migrating != null) throw new Fenced(`namespace ${name} is being resharded (${migrating}): try again`);
  const ns: Namespace = {
    name, shards: Number(String(shards)), lanes: new Map(), twoPhase: new Set(), retired: new Map(),
    reshardingFrom: resharding == null ? undefined : Number(String(resharding).split(" ")[0]),
    testClock: clock != null && String(clock) === "test",
  };
  const [registry] = yield [["HGETALL", `${name}:lanes`]];
  if (registry instanceof Error) throw registry; // e.g. NOPERM: Redis's own error, as for any other refused command
  const flat = (registry as Buffer[]).map(String);
  for (let i = 0; i < flat.length; i += 2) {
    const [key, value] = [flat[i], flat[i + 1]];
    if (key.startsWith("r:")) {
      const [num, , slot, push, ...list] = value.split(" ");
      ns.lanes.set(key.slice(2), { number: parseInt(num, 36), route: key.slice(2), slot: Number(slot), push, list: list.join(" ") });
    } else if (key.startsWith("t:")) ns.twoPhase.add(key.slice(2));
    else if (key.startsWith("#") && value.endsWith(" retired")) {
      const words = value.split(" ");
      const slot = Number(words[words.length - 2]);
      ns.retired.set(parseInt(key.slice(1), 36), { route: words.slice(0, -2).join(" "), slot });
    }
  }
  return ns;
}

/** How far the namespace's test clock is ahead of Redis's, ms: 0 without one (no command). */
function* clockOffset(ns: Namespace): Op<number> {
  if (!ns.testClock) return 0;
  const [offset] = yield [["HGET", `${ns.name}:schema`, "clock_ms"]];
  if (offset instanceof Error) throw offset;
  return offset == null ? 0 : Number(String(offset));
}

/** A test namespace's clock: `now` is Redis's clock plus the offset the advances added. */
export interface ClockReading { nowMs: number; redisMs: number; offsetMs: number; }

function* clockOp(ns: Namespace): Op<ClockReading> {
  if (!ns.testClock) {
    throw new NoTestClock(`namespace ${ns.name} has no test clock: only a namespace created with [testing] clock = true has one`);
  }
  const [t, offset] = yield [["TIME"], ["HGET", `${ns.name}:schema`, "clock_ms"]];
  for (const reply of [t, offset]) if (reply instanceof Error) throw reply;
  const [sec, usec] = (t as Buffer[]).map((b) => Number(String(b)));
  const redisMs = sec * 1000 + Math.floor(usec / 1000);
  const offsetMs = offset == null ? 0 : Number(String(offset));
  return { nowMs: redisMs + offsetMs, redisMs, offsetMs };
}

/** Moves the test clock forward by `byMs` (1 or more) and wakes the daemons. The offset only grows
 * (HINCRBY), so concurrent advances add up. */
function* advanceClockOp(ns: Namespace, byMs: number): Op<ClockReading> {
  if (!Number.isSafeInteger(byMs) || byMs < 1) {
    throw new InvalidJob("byMs", `a test clock moves forward by whole milliseconds, 1 or more, got ${byMs}`);
  }
  if (!ns.testClock) yield* clockOp(ns); // refuses
  const [offset] = yield [["HINCRBY", `${ns.name}:schema`, "clock_ms", byMs]];
  if (offset instanceof Error) throw offset;
  const [published] = yield [["PUBLISH", `${ns.name}:wake`, `clock ${offset}`]];
  if (published instanceof Error) throw published;
  return yield* clockOp(ns);
}

const ULID = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";
const STORED = "-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz";
/** ULIDs (a two-phase route's jobs, in the spread shards) and 12-character stored ids (a route
 * lane's), increasing within a process. */
class Ids {
  private last = [0n, 0n];
  private stored = [0n, 0n];
  private random14 = BigInt(randomBytes(2).readUInt16BE() & 0x3fff);
  ulid(): string {
    let ms = BigInt(Date.now());
    let rnd = BigInt("0x" + randomBytes(10).toString("hex"));
    if (ms <= this.last[0]) [ms, rnd] = [this.last[0], this.last[1] + 1n];
    this.last = [ms, rnd];
    const n = (ms << 80n) | (rnd & ((1n << 80n) - 1n));
    return Array.from({ length: 26 }, (_, i) => ULID[Number((n >> BigInt(5 * (25 - i))) & 31n)]).join("");
  }
  storedId(): string {
    let ms = BigInt(Date.now() - 1_704_067_200_000);
    let counter = ms <= this.stored[0] ? this.stored[1] + 1n : 0n;
    if (ms < this.stored[0]) ms = this.stored[0];
    if (counter > 0xffffn) [ms, counter] = [ms + 1n, 0n];
    this.stored = [ms, counter];
    const n = (ms << 30n) | (this.random14 << 16n) | counter;
    return Array.from({ length: 12 }, (_, i) => STORED[Number((n >> BigInt(6 * (11 - i))) & 63n)]).join("");
  }
}

export interface Job {
  dest: string;
  payload: Buffer | string;
  /** A Date, or epoch milliseconds (rounded up: never due before it). */
  at?: Date | number;
  /** Milliseconds after Redis's clock. */
  delay?: number;
  id?: string;
  headers?: Record<string, string>;
  maxAttempts?: number;
  /** Milliseconds after the due time beyond which the job is not delivered. */
  maxLateness?: number;
  /** Milliseconds: due at a point of this window after its due time, derived from its id. */
  spread?: number;
  /** Milliseconds: once delivered or dead, an enqueue of its id within this is a "duplicate". */
  uniqueFor?: number;
}
export interface Enqueued { id: string; outcome: "added" | "replaced" | "kept" | "duplicate"; }
/** `{ debounce: ms }`: replace, but a waiting job is never made due later than its first
 * enqueue plus that many milliseconds. */
export type OnConflict = "replace" | "keep" | "error" | { debounce: number };

const wholeMs = (v: number, field: string) => {
  if (!Number.isInteger(v) || v < 0) throw new InvalidJob(field, `must be whole milliseconds >= 0, got ${v}`);
  return v;
};

/** Where in a spread window a job falls: FNV-1a (64 bits) of its id's bytes mod the window. */
export function spreadOffset(id: string, windowMs: number): number {
  let h = 0xcbf29ce484222325n;
  for (const b of Buffer.from(id)) h = ((h ^ BigInt(b)) * 0x100000001b3n) & 0xffffffffffffffffn;
  return windowMs ? Number(h % BigInt(windowMs)) : 0;
}

function spreadDue(due: string, id: string, job: Job): string {
  if (job.spread === undefined) return due;
  const offset = spreadOffset(id, wholeMs(job.spread, "spread"));
  return due.startsWith("+") ? `+${Number(due.slice(1)) + offset}` : String(Number(due) + offset);
}

export function dueArg(at?: Date | number, delay?: number): string {
  if (at !== undefined && delay !== undefined) throw new InvalidJob("at", "give at or delay, not both");
  if (at === undefined) return `+${wholeMs(delay ?? 0, "delay")}`;
  const ms = at instanceof Date ? Math.ceil(at.getTime()) : at;
  if (!Number.isInteger(ms) || ms < 0) throw new InvalidJob("at", `must be a Date or epoch milliseconds, got ${String(at)}`);
  if (ms >= 1e9 && ms < 1e11) throw new InvalidJob("at", `${ms} looks like epoch seconds; at takes epoch milliseconds`);
  return String(ms);
}

function meta(job: Job): Record<string, unknown> {
  const m: Record<string, unknown> = {};
  if (job.headers && Object.keys(job.headers).length) {
    const h: Record<string, string> = {};
    for (const [k, v] of Object.entries(job.headers)) {
      if (typeof v !== "string") throw new InvalidJob(`headers.${k}`, `values must be strings, got ${typeof v}`);
      h[k] = v;
    }
    for (const name of ["traceparent", "tracestate"]) {
      for (const k of Object.keys(h)) {
        if (k !== name && k.toLowerCase() === name) {
          if (!(name in h)) h[name] = h[k];
          delete h[k];
        }
      }
    }
    const byBytes = (a: string, b: string) => Buffer.compare(Buffer.from(a), Buffer.from(b));
    m.headers = Object.fromEntries(Object.keys(h).sort(byBytes).map((k) => [k, h[k]]));
  }
  if (job.maxAttempts !== undefined) {
    if (!Number.isInteger(job.maxAttempts) || job.maxAttempts < 1) {
      throw new InvalidJob("maxAttempts", `must be a whole number >= 1, got ${job.maxAttempts}`);
    }
    m.max_attempts = job.maxAttempts;
  }
  return m;
}

function payloadOf(job: Job, maxPayload?: number): Buffer {
  const dest = Buffer.from(typeof job.dest === "string" ? job.dest : "");
  if (!dest.length || dest.length > 512 || dest.includes("\n")) {
    throw new InvalidJob("dest", `must be a non-empty string of at most 512 bytes without newlines: ${JSON.stringify(job.dest)}`);
  }
  const payload = typeof job.payload === "string" ? Buffer.from(job.payload) : job.payload;
  if (!Buffer.isBuffer(payload)) throw new InvalidJob("payload", "must be a Buffer or a string");
  if (maxPayload !== undefined && payload.length > maxPayload) {
    throw new InvalidJob("payload", `${payload.length} bytes exceeds maxPayload ${maxPayload}`);
  }
  if (job.id !== undefined) {
    const n = Buffer.byteLength(job.id);
    if (typeof job.id !== "string" || n === 0 || n > 256) throw new InvalidJob("id", "must be a non-empty string of at most 256 bytes");
    if (job.id.startsWith("~")) throw new InvalidJob("id", "ids starting with ~ are reserved for the ids zdelay generates");
  }
  return payload;
}

const json = (m: Record<string, unknown>) => (Object.keys(m).length ? Buffer.from(JSON.stringify(m)) : Buffer.alloc(0));
const OUTCOMES: Record<number, Enqueued["outcome"]> = { 1: "added", 2: "replaced", 0: "kept", 3: "duplicate" };

function* enqueueOp(ns: Namespace, jobs: Job[], onConflict: OnConflict, ids: Ids, maxPayload?: number): Op<(Enqueued | Error)[]> {
  let base: string;
  if (typeof onConflict === "object" && onConflict !== null) base = `debounce ${wholeMs(onConflict.debounce, "onConflict.debounce")}`;
  else if (["replace", "keep", "error"].includes(onConflict)) base = onConflict;
  else throw new InvalidJob("onConflict", `must be replace, keep, error or { debounce: ms }: ${onConflict}`);
  const results: (Enqueued | Error)[] = new Array(jobs.length);
  const groups = new Map<string, { head: Command; nkeys: number; items: [number, string, Command][] }>();
  const wake = `${ns.name}:wake`;
  // On a test clock, the time the call reads (a delay, debounce, unique windows) is its.
  const clockSuffix = ns.testClock ? ` clock ${yield* clockOffset(ns)}` : "";
  jobs.forEach((job, i) => {
    try {
      const payload = payloadOf(job, maxPayload);
      const m = meta(job);
      const due = dueArg(job.at, job.delay);
      const late = job.maxLateness === undefined ? "" : String(wholeMs(job.maxLateness, "maxLateness"));
      let policy = job.uniqueFor === undefined ? base : `${base} unique ${wholeMs(job.uniqueFor, "uniqueFor")}`;
      // The unique-window keys only for calls that use them: a producer whose ACL predates
      // them still enqueues.
      const windows = policy === onConflict ? [] : ["unique", "windows"];
      policy += clockSuffix;
      const lane = ns.lanes.get(job.dest);
      if (!lane && !ns.twoPhase.has(job.dest) && !job.dest.includes("/")) throw noLane(job.dest, ns);
      let head: Command, item: Command, id: string, nkeys: number;
      if (lane) {
        const stored = job.id ?? ids.storedId();
        id = job.id ?? `~${lane.number.toString(36)}.${stored}`;
        nkeys = 8 + windows.length;
        head = ["zd2_enqueue_lane", ...laneKeys(ns.name, lane, "due", "jobs", "meta", "maxlate", "large", "dead", "reasons", "lane", ...windows),
          marker(lane), policy, wake, `l${lane.number.toString(36)}`];
        item = [stored, spreadDue(due, stored, job), payload, json(m), late];
      } else {
        id = job.id ?? ids.ulid();
        const shard = shardOf(id, ns.shards);
        if (late !== "") m.max_lateness_ms = Number(late);
        const mj = json(m);
        const frame = Buffer.concat([Buffer.from(`zd1:${job.dest}\n${mj.length}\n`), mj, payload]);
        nkeys = 10 + windows.length;
        head = ["zd2_enqueue", ...shardKeys(ns, shard, "due", "jobs", "inflight", "dead", "reasons", "scheduled", "ready", "ready_ids", "max_lateness", "shards", ...windows),
          ns.shards, policy, wake, shard];
        item = [id, spreadDue(due, id, job), frame, late];
      }
      const key = head.join("\u0000");
      if (!groups.has(key)) groups.set(key, { head, nkeys, items: [] });
      groups.get(key)!.items.push([i, id, item]);
    } catch (e) {
      if (!(e instanceof ZdelayError)) throw e;
      results[i] = e;
    }
  });
  const calls: Command[] = [];
  const members: [number, string, Command][][] = [];
  for (const { head, nkeys, items } of groups.values()) {
    for (let s = 0; s < items.length; s += 500) {
      const chunk = items.slice(s, s + 500);
      calls.push(["FCALL", head[0], nkeys, ...head.slice(1), ...chunk.flatMap(([, , item]) => item)]);
      members.push(chunk);
    }
  }
  const replies = yield calls;
  replies.forEach((reply, c) => members[c].forEach(([i, id], n) => {
    // Registered, but its marker not written yet: as good as no lane (nothing written).
    if (reply instanceof Error && reply.message.startsWith("ZDELAY_NO_LANE")) results[i] = noLane(jobs[i].dest, ns);
    else if (reply instanceof Error) results[i] = reply;
    else {
      const code = Number((reply as unknown[])[n]);
      results[i] = code === -1 ? new JobExists(`job ${id} exists (onConflict 'error')`) : { id, outcome: OUTCOMES[code] };
    }
  }));
  return results;
}

const NOWHERE: [undefined, null] = [undefined, null];

/** Where an id lives: [its lane, stored id], [undefined, id] for a spread shard, or NOWHERE. An id
 * of your own without `dest` is looked for in every lane and in its spread shard (one HEXISTS
 * each); held in more than one place, it needs `dest`. */
function* place(ns: Namespace, id: string, dest?: string): Op<[Lane | undefined, string | null]> {
  if (id.startsWith("~")) {
    const [num, stored] = id.slice(1).split(".", 2);
    if (!stored || stored.length !== 12) throw new InvalidJob("id", `${id} is not a generated id (~<lane>.<12 characters>)`);
    const number = parseInt(num, 36);
    // A retired lane's jobs are relocated into its route's live lane.
    const lane = [...ns.lanes.values()].find((l) => l.number === number) ?? ns.lanes.get(ns.retired.get(number)?.route ?? "");
    if (!lane) throw new Fenced(`lane ${num} is not in ${ns.name}:lanes`);
    return [lane, stored];
  }
  if (dest === undefined) {
    const lanes = [...ns.lanes.values()];
    const shard = shardKeys(ns, shardOf(id, ns.shards), "jobs")[0];
    const held = yield [...lanes.map((l) => ["HEXISTS", laneKeys(ns.name, l, "jobs")[0], id]), ["HEXISTS", shard, id]];
    for (const reply of held) if (reply instanceof Error) throw reply;
    const places: [Lane | undefined, string][] = lanes.flatMap((l, i) => (Number(held[i]) ? [[l, id] as [Lane, string]] : []));
    if (Number(held[lanes.length])) places.push([undefined, id]);
    if (places.length > 1) {
      const names = places.map(([l]) => (l ? l.route : "a two-phase destination")).join(", ");
      throw new InvalidJob("dest", `job id ${JSON.stringify(id)} is stored for ${names}: on storage layout 2 an id of your own is unique per route; give dest`);
    }
    return places[0] ?? NOWHERE;
  }
  return [ns.lanes.get(dest), id];
}

/** Whether a retired lane (its route's list moved to another hash slot) still holds `id`: the
 * relocation writes a job into the route's live lane before it deletes it from the retired one,
 * and nothing else changes a retired lane, so once it is gone there the live lane has it (or it
 * was delivered). The lane a generated id names; for an id of your own, every one. */
function* stillRelocating(ns: Namespace, id: string): Op<boolean> {
  const live = new Set([...ns.lanes.values()].map((l) => `${l.slot} ${l.route}`));
  const places: [{ route: string; slot: number }, string][] = [];
  if (id.startsWith("~")) {
    const [num, stored] = id.slice(1).split(".", 2);
    const retired = stored ? ns.retired.get(parseInt(num, 36)) : undefined;
    if (retired && !live.has(`${retired.slot} ${retired.route}`)) places.push([retired, stored]);
  } else {
    const seen = new Set<string>();
    for (const r of ns.retired.values()) {
      const name = `${r.slot} ${r.route}`;
      if (!live.has(name) && !seen.has(name)) {
        seen.add(name);
        places.push([r, id]);
      }
    }
  }
  if (!places.length) return false;
  const held = yield places.map(([r, stored]) => ["HEXISTS", `${ns.name}:{${slotTag(r.slot)}}:jobs:${r.route}`, stored]);
  for (const reply of held) if (reply instanceof Error) throw reply;
  return held.some((h: unknown) => Number(h) === 1);
}

/** While `zdelay reshard` moves a layout-2 namespace's spread shards: whether the old spread shard
 * of `id` still holds it. The reshard writes a job into its new shard before it deletes it from
 * the old one, so once it is gone there, the new shard has it. A generated id (`~…`) names a lane,
 * never a spread shard. Notes when the reshard finished. */
function* stillInOldShard(ns: Namespace, id: string): Op<boolean> {
  if (ns.reshardingFrom === undefined || id.startsWith("~")) return false;
  const old: Namespace = { ...ns, shards: ns.reshardingFrom as number };
  const jobs = shardKeys(old, shardOf(id, old.shards), "jobs")[0];
  const [resharding, held] = yield [["HGET", `${ns.name}:schema`, "resharding"], ["HEXISTS", jobs, id]];
  if (resharding instanceof Error) throw resharding;
  if (held instanceof Error) throw held;
  if (resharding == null) {
    ns.reshardingFrom = undefined;
    return false;
  }
  return Number(held) === 1;
}

const FENCES = ["ZDELAY_RESHARDED", "ZDELAY_MIGRATING", "ZDELAY_LAYOUT", "ZDELAY_LANE_MOVED", "ZDELAY_LANE_CHANGED"];
const isFence = (r: unknown) => r instanceof Error && FENCES.some((f) => r.message.startsWith(f));
function ok(reply: unknown): any {
  if (reply instanceof Error) {
    const [code, layout, version] = reply.message.split(" ");
    if (code === "ZDELAY_LAYOUT" && version !== undefined && (Number(layout) > 2 || !versionKey(version) || compareVersions(version, VERSION) > 0)) {
      throw tooNew(null, Number(layout), version);
    }
    if (isFence(reply)) throw new Fenced(reply.message);
    if (reply.message.startsWith("ZDELAY_NO_LANE")) {
      throw new NoLane(`this route's lane has no marker yet (${reply.message}): a daemon or a producer given the route's config registers it; nothing was written, try again`);
    }
    throw reply;
  }
  return reply;
}

function* cancelOp(ns: Namespace, id: string, dest?: string): Op<"cancelled" | "not_pending" | "in_flight"> {
  const [lane, stored] = yield* place(ns, id, dest);
  if (stored === null) return "not_pending";
  // With the job's unique-window key (the functions require it): its window entry goes too.
  const [code] = lane
    ? yield [["FCALL", "zd2_cancel_lane", 7, ...laneKeys(ns.name, lane, "due", "jobs", "meta", "maxlate", "large", "lane", "unique"), marker(lane), stored]]
    : yield [["FCALL", "zd2_cancel", 9, ...shardKeys(ns, shardOf(id, ns.shards), "due", "jobs", "inflight", "scheduled", "ready", "ready_ids", "max_lateness", "shards", "unique"), ns.shards, id]];
  return ({ 1: "cancelled", 0: "not_pending", [-1]: "in_flight" } as const)[Number(ok(code)) as 1 | 0 | -1];
}

function* rescheduleOp(ns: Namespace, id: string, due: string, dest?: string): Op<number | null> {
  const [lane, stored] = yield* place(ns, id, dest);
  if (stored === null) return null;
  // "+N" counts from Redis's clock in the function: a test clock's offset is added here.
  if (due.startsWith("+")) due = `+${Number(due.slice(1)) + (yield* clockOffset(ns))}`;
  const wake = `${ns.name}:wake`;
  const shard = shardOf(id, ns.shards);
  const [ms] = lane
    ? yield [["FCALL", "zd2_reschedule_lane", 2, ...laneKeys(ns.name, lane, "due", "lane"), marker(lane), stored, due, wake, `l${lane.number.toString(36)}`]]
    : yield [["FCALL", "zd2_reschedule", 5, ...shardKeys(ns, shard, "due", "scheduled", "ready", "ready_ids", "shards"), ns.shards, id, due, wake, shard]];
  const v = ok(ms);
  return v == null || Number(v) === -1 ? null : Number(v);
}

export interface JobView {
  id: string; state: "scheduled" | "due" | "in_flight" | "dead" | "orphan"; dest: string | null;
  payload: Buffer | null; dueMs: number | null; headers: Record<string, string>;
  maxAttempts: number | null; maxLatenessMs: number | null; reason: string | null;
}

function* getOp(ns: Namespace, id: string, dest?: string): Op<JobView | null> {
  const [lane, stored] = yield* place(ns, id, dest);
  if (stored === null) return null;
  let due, ready = null, inflight = null, dead, payload: Buffer | null, reason, late, m: any = {}, jobDest: string | null;
  let t: Buffer[];
  if (lane) {
    const [r] = yield [["FCALL", "zd2_get_lane", 7, ...laneKeys(ns.name, lane, "due", "jobs", "meta", "maxlate", "dead", "reasons", "lane"), marker(lane), stored]];
    let mj;
    [t, due, payload, mj, late, dead, reason] = [ok(r).slice(0, 2), ...ok(r).slice(2)];
    m = mj ? JSON.parse(String(mj)) : {};
    jobDest = lane.route;
  } else {
    const keys = shardKeys(ns, shardOf(id, ns.shards), "due", "jobs", "inflight", "dead", "reasons", "ready_ids", "shards");
    const [r] = yield [["FCALL", "zd2_get", 7, ...keys, ns.shards, id]];
    [t, due, ready, inflight, dead, payload, reason] = [ok(r).slice(0, 2), ...ok(r).slice(2)];
    jobDest = null;
    if (payload && payload.subarray(0, 4).toString() === "zd1:") {
      const nl = payload.indexOf("\n"), nl2 = payload.indexOf("\n", nl + 1);
      const len = Number(payload.subarray(nl + 1, nl2).toString());
      jobDest = payload.subarray(4, nl).toString();
      m = len ? JSON.parse(payload.subarray(nl2 + 1, nl2 + 1 + len).toString()) : {};
      payload = payload.subarray(nl2 + 1 + len);
    }
    late = m.max_lateness_ms ?? null;
  }
  const now = Number(String(t[0])) * 1000 + Number(String(t[1])) / 1000 + (yield* clockOffset(ns));
  let state: JobView["state"], score: unknown;
  if (due != null) [state, score] = [Number(String(due)) > now ? "scheduled" : "due", due];
  else if (ready != null) [state, score] = ["due", String(ready).split("\n")[1]];
  else if (inflight != null) [state, score] = ["in_flight", inflight];
  else if (dead != null) [state, score] = ["dead", dead];
  else if (payload != null) [state, score] = ["orphan", null];
  else return null;
  return {
    id, state, dest: jobDest, payload, dueMs: score == null ? null : Math.trunc(Number(String(score))),
    headers: m.headers ?? {}, maxAttempts: m.max_attempts ?? null,
    maxLatenessMs: late == null ? null : Number(String(late)), reason: reason == null ? null : String(reason),
  };
}

export interface Schedule {
  id: string;
  dest: string;
  payload?: Buffer | string;
  /** A cron expression (5 fields, or 6 with seconds first) in `tz` (IANA, default UTC)… */
  cron?: string;
  tz?: string;
  /** …or an interval in milliseconds. */
  every?: number;
  headers?: Record<string, string>;
  misfire?: "coalesce" | "skip" | "catch_up";
  maxCatchUp?: number;
  startAt?: Date | number;
  endAt?: Date | number;
  maxLateness?: number;
  maxAttempts?: number;
  /** Milliseconds: each occurrence is due at a point of this window after it, from its id. */
  jitter?: number;
  /** A calendar's name (`zdelay calendar set`): no occurrence on its days… */
  calendar?: string;
  /** …or moved to the next or previous business day at the same local time (cron only). */
  shift?: "skip" | "next" | "previous";
}
/** A schedule after its requests were applied. */
export interface ScheduleState { exists: boolean; paused: boolean | null; nextMs: number | null; }

/** The JSON form a daemon applies (a line of `zdelay schedule set --batch`). */
export function scheduleJson(s: Schedule): string {
  const id = Buffer.from(typeof s.id === "string" ? s.id : "");
  if (!id.length || id.length > 512 || id.includes("\n")) throw new InvalidJob("id", "must be a non-empty string of at most 512 bytes without newlines");
  const job = { dest: s.dest, payload: s.payload ?? "", headers: s.headers, maxAttempts: s.maxAttempts };
  const payload = payloadOf(job);
  const m = meta(job);
  if ((s.cron === undefined) === (s.every === undefined)) throw new InvalidJob("cron", "give cron or every, not both");
  if (s.tz !== undefined && s.cron === undefined) throw new InvalidJob("tz", "applies to cron only");
  if (s.misfire !== undefined && !["coalesce", "skip", "catch_up"].includes(s.misfire)) {
    throw new InvalidJob("misfire", `must be one of coalesce, skip, catch_up: ${s.misfire}`);
  }
  if (s.every !== undefined && wholeMs(s.every, "every") === 0) throw new InvalidJob("every", "must be at least 1 ms");
  if (s.calendar !== undefined && !(typeof s.calendar === "string" && /^[A-Za-z0-9._-]{1,64}$/.test(s.calendar))) {
    throw new InvalidJob("calendar", `must be 1 to 64 letters, digits, '-', '_' or '.': ${s.calendar}`);
  }
  if (s.shift !== undefined) {
    if (!["skip", "next", "previous"].includes(s.shift)) throw new InvalidJob("shift", `must be one of skip, next, previous: ${s.shift}`);
    if (s.calendar === undefined) throw new InvalidJob("shift", "needs a calendar");
    if (s.shift !== "skip" && s.cron === undefined) {
      throw new InvalidJob("shift", "next and previous move an occurrence to another day at the same local time: they need cron");
    }
  }
  const utf8 = payload.toString("utf8");
  const exact = Buffer.from(utf8).equals(payload);
  const out: Record<string, unknown> = {
    id: s.id, dest: s.dest, cron: s.cron, tz: s.tz, every: s.every === undefined ? undefined : `${s.every}ms`,
    payload: exact ? utf8 : payload.toString("base64"), payload_encoding: exact ? undefined : "base64",
    headers: m.headers, misfire: s.misfire, max_catch_up: s.maxCatchUp, max_attempts: m.max_attempts,
    start_at: s.startAt === undefined ? undefined : Number(dueArg(s.startAt)),
    end_at: s.endAt === undefined ? undefined : Number(dueArg(s.endAt)),
    max_lateness: s.maxLateness === undefined ? undefined : `${wholeMs(s.maxLateness, "maxLateness")}ms`,
    jitter: s.jitter === undefined ? undefined : `${wholeMs(s.jitter, "jitter")}ms`,
    calendar: s.calendar, shift: s.shift,
  };
  return JSON.stringify(out);
}

function* scheduleRequestOp(ns: Namespace, id: string, op: string, spec?: string): Op<number> {
  const keys = [`{${ns.name}}:sched_requests`, `{${ns.name}}:sched_results`];
  const [seq] = yield [["FCALL", "zd2_schedule", 2, ...keys, id, op, ...(spec === undefined ? [] : [spec])]];
  return Number(ok(seq));
}

function* scheduleOutcomeOp(ns: Namespace, id: string, seq: number): Op<ScheduleState | null> {
  const [text] = yield [["HGET", `{${ns.name}}:sched_results`, id]];
  const o = text == null ? {} : JSON.parse(String(text));
  if ((o.seq ?? -1) < seq) return null;
  if (!o.ok) throw new ScheduleRefused(`schedule ${id}: ${o.error}`);
  return { exists: o.exists, paused: o.paused ?? null, nextMs: o.next_ms ?? null };
}

export interface ClientOptions { namespace?: string; maxPayload?: number; }

/** A producer on an ioredis `Redis` or `Cluster`. */
export class Client {
  readonly namespace: string;
  private ns?: Namespace;
  private ids = new Ids();
  constructor(readonly redis: Redis | Cluster, private options: ClientOptions = {}) {
    this.namespace = options.namespace ?? "zdelay";
  }

  private async execute(commands: Command[]): Promise<unknown[]> {
    const run = (c: Command) => (this.redis as Redis).callBuffer(String(c[0]), ...c.slice(1)) as Promise<unknown>;
    if (this.redis instanceof Cluster) {
      return Promise.all(commands.map((c) => run(c).catch((e: unknown) => e)));
    }
    const pipe = this.redis.pipeline();
    for (const c of commands) (pipe as any).callBuffer(String(c[0]), ...c.slice(1));
    return ((await pipe.exec()) ?? []).map(([err, value]) => err ?? value);
  }

  private async drive<T>(op: Op<T>): Promise<T> {
    let step = op.next(undefined as unknown as unknown[]);
    while (!step.done) step = op.next(await this.execute(step.value));
    return step.value;
  }

  private async namespaceOf(again = false): Promise<Namespace> {
    if (!this.ns || again) this.ns = await this.drive(loadNamespace(this.namespace));
    return this.ns;
  }

  /** `make` on the namespace; once more after reading it again when a fence refused the call.
   * With `id` (a lookup by id), first waits while `zdelay reshard` has not moved that job to its
   * new spread shard, or a daemon not into its route's new lane. */
  private async run<T>(make: (ns: Namespace) => Op<T>, id?: string): Promise<T> {
    try {
      return await this.drive(make(await this.moved(await this.namespaceOf(), id)));
    } catch (e) {
      if (!(e instanceof Fenced) || e instanceof Upgrading) throw e;
      return this.drive(make(await this.moved(await this.namespaceOf(true), id)));
    }
  }

  private async moved(ns: Namespace, id?: string): Promise<Namespace> {
    const deadline = Date.now() + MOVE_WAIT_MS;
    while (id !== undefined && (await this.drive(stillInOldShard(ns, id)))) {
      if (Date.now() > deadline) {
        throw new Upgrading(`namespace ${ns.name} is being resharded (${ns.reshardingFrom} to ${ns.shards} spread shards) `
          + `and job ${id} is not moved yet: nothing was written; try again`);
      }
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    while (id !== undefined && (await this.drive(stillRelocating(ns, id)))) {
      if (Date.now() > deadline) {
        throw new Fenced(`job ${id} is being moved to its route's new lane (the route's list moved to another hash slot; `
          + "a daemon with the new config moves it when it starts): nothing was written; try again");
      }
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    return ns;
  }

  /** One result per job, in order: `Enqueued`, or the error of that job alone. */
  async enqueueMany(jobs: Job[], onConflict: OnConflict = "replace"): Promise<(Enqueued | Error)[]> {
    const results = await this.run((ns) => enqueueOp(ns, jobs, onConflict, this.ids, this.options.maxPayload));
    // Refused by a fence, or no lane in the registry as last read (one may be registered now).
    const again = results.flatMap((r, i) => (isFence(r) || r instanceof NoLane ? [i] : []));
    if (again.length) {
      const ns = await this.namespaceOf(true);
      const retried = await this.drive(enqueueOp(ns, again.map((i) => jobs[i]), onConflict, this.ids, this.options.maxPayload));
      again.forEach((i, n) => (results[i] = retried[n]));
    }
    return results;
  }

  async enqueue(job: Job, onConflict: OnConflict = "replace"): Promise<Enqueued> {
    const [result] = await this.enqueueMany([job], onConflict);
    if (result instanceof Error) throw result;
    return result;
  }

  /** "cancelled", "not_pending" (delivered, dead, unknown) or "in_flight". */
  cancel(id: string, dest?: string) {
    return this.run((ns) => cancelOp(ns, id, dest), id);
  }

  /** The new due time in epoch ms, or null when the job is not pending. */
  reschedule(id: string, when: { at?: Date | number; delay?: number; dest?: string }) {
    const due = dueArg(when.at, when.delay);
    return this.run((ns) => rescheduleOp(ns, id, due, when.dest), id);
  }

  get(id: string, dest?: string) {
    return this.run((ns) => getOp(ns, id, dest), id);
  }

  /** A test namespace's clock ([testing] clock = true). Throws `NoTestClock` on a namespace
   * created without one. */
  clock(): Promise<ClockReading> {
    return this.run((ns) => clockOp(ns));
  }

  /** Moves a test namespace's clock forward by `byMs` (1 or more) and wakes the daemons: what
   * falls due in the time skipped is delivered at once. Resolves the new clock. Throws
   * `NoTestClock` on a namespace created without one. */
  advanceClock(byMs: number): Promise<ClockReading> {
    return this.run((ns) => advanceClockOp(ns, byMs));
  }

  /**
   * Creates or updates a recurring schedule. A daemon plans it: waits up to `waitMs` for the
   * outcome, throwing `ScheduleRefused` (why) or `NotApplied`; waitMs 0 resolves null at once.
   */
  async scheduleSet(schedule: Schedule, waitMs = 5000) {
    return this.schedule(schedule.id, "set", scheduleJson(schedule), waitMs);
  }
  schedulePause(id: string, waitMs = 5000) { return this.schedule(id, "pause", undefined, waitMs); }
  scheduleResume(id: string, waitMs = 5000) { return this.schedule(id, "resume", undefined, waitMs); }
  scheduleDelete(id: string, waitMs = 5000) { return this.schedule(id, "delete", undefined, waitMs); }

  private async schedule(id: string, op: string, spec: string | undefined, waitMs: number): Promise<ScheduleState | null> {
    const seq = await this.run((ns) => scheduleRequestOp(ns, id, op, spec));
    const deadline = Date.now() + waitMs;
    while (waitMs > 0) {
      const state = await this.run((ns) => scheduleOutcomeOp(ns, id, seq));
      if (state) return state;
      if (Date.now() > deadline) {
        throw new NotApplied(`no zdelay daemon applied the request for schedule ${id} within ${waitMs} ms; it stays, and is applied when a daemon runs`);
      }
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    return null;
  }
}
