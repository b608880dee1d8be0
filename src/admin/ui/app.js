// zdelay console: renders the JSON of api/… (relative URLs: works under any prefix).
// Untrusted text (ids, reasons, payloads) is only ever set as textContent.
"use strict";

const TOKEN_KEY = "zdelay-admin-token";
const pages = {};
let refreshTimer = null;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs, ...children) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// Where a job is stored: its shard, or its route lane on storage layout 2.
function place(j) {
  return j.lane !== undefined ? ["lane", j.lane] : ["shard", j.shard];
}

function iso(ms) {
  return ms === null || ms === undefined ? "—" : new Date(ms).toISOString().replace(".000Z", "Z");
}

function span(ms) {
  const a = Math.abs(ms);
  if (a < 1000) return `${a} ms`;
  if (a < 120000) return `${(a / 1000).toFixed(1)} s`;
  if (a < 7200000) return `${Math.round(a / 60000)} min`;
  if (a < 172800000) return `${(a / 3600000).toFixed(1)} h`;
  return `${(a / 86400000).toFixed(1)} d`;
}

function when(ms, now) {
  if (ms === null || ms === undefined) return "—";
  const d = ms - now;
  return `${iso(ms)} (${d >= 0 ? "in " + span(d) : span(d) + " ago"})`;
}

function setStatus(text, kind) {
  const s = document.getElementById("status");
  s.textContent = text || "";
  s.className = kind || "";
}

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// Reads send the token when the tab has one: payloads and dead letters need it.
async function getJSON(path) {
  const t = token();
  const headers = t ? { Accept: "application/json", Authorization: "Bearer " + t } : { Accept: "application/json" };
  const r = await fetch(path, { headers });
  const body = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) throw new HttpError(r.status, body.error || `HTTP ${r.status}`);
  return body;
}

// A read the server refused (403): what to do about it, instead of an error.
function refusedRead(e, what) {
  if (!(e instanceof HttpError) || e.status !== 403) throw e;
  return el("p", { id: "needs-token", class: "muted",
    text: `${what} show payloads and headers: ${e.message}.` + (token() ? "" : " Enter the admin token above to read them.") });
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

// Actions: POST without a body, the token in the Authorization header.
async function act(path, label) {
  const t = token();
  const headers = t ? { Authorization: "Bearer " + t } : {};
  try {
    const r = await fetch(path, { method: "POST", headers });
    const body = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
    if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
    setStatus(`${label}: done ${JSON.stringify(body)}`, "ok");
    await show(false);
    return body;
  } catch (e) {
    setStatus(`${label}: ${e.message}`, "error");
    return null;
  }
}

function actionButton(text, path, label, attrs) {
  return el("button", Object.assign({ type: "button", text, disabled: !token(), onclick: () => act(path, label) }, attrs || {}));
}

function enc(id) {
  return encodeURIComponent(id);
}

function table(head, rows, attrs) {
  return el("table", attrs || {},
    el("thead", {}, el("tr", {}, head.map(h => el("th", { class: h.n ? "n" : null, text: h.t || h })))),
    el("tbody", {}, rows));
}

function num(v, attrs) {
  return el("td", Object.assign({ class: "n" }, attrs || {}), v === null || v === undefined ? "—" : String(v));
}

// ---------------------------------------------------------------------------------------
pages.overview = async function () {
  const s = await getJSON("api/stats");
  const now = s.now_ms;
  const t = s.total;
  const lat = s.recent.lateness;
  const rate = s.recent.delivery_rate_per_s;
  const out = [];
  out.push(el("div", { class: "cards" },
    el("div", { class: "card" }, "due now", el("b", { id: "total-due", text: t.due_now })),
    el("div", { class: "card" }, "scheduled", el("b", { id: "total-scheduled", text: t.scheduled })),
    el("div", { class: "card" }, "in flight", el("b", { id: "total-inflight", text: t.inflight })),
    el("div", { class: "card" }, "dead", el("b", { id: "total-dead", text: t.dead })),
    el("div", { class: "card" }, `lateness p50 / p99 (last ${lat.window_minutes} min)`,
      el("b", { id: "lateness", text: lat.p50_ms === null ? "—" : `≤${lat.p50_ms} / ≤${lat.p99_ms}${lat.over ? "+" : ""} ms` })),
    el("div", { class: "card" }, "delivered / s (last hour)",
      el("b", { id: "rate", text: rate === null ? "—" : rate.toFixed(1) }))));

  out.push(el("h2", { text: "Instances and the shards they poll" }));
  out.push(s.instances.length === 0 ? el("p", { class: "muted", text: "No daemon registered." }) :
    table(["instance", "version", "shards", "raw sources", "last heartbeat"], s.instances.map(i =>
      el("tr", { "data-instance": i.id },
        el("td", { text: i.id }),
        el("td", { text: i.version ?? "—" }),
        el("td", { text: i.shards.join(", ") || "—" }),
        el("td", { text: i.sources.join(", ") || "—" }),
        el("td", { text: when(i.last_seen_ms, now) })))));

  out.push(el("h2", { text: "Backlog" }));
  // On storage layout 2 a local route's jobs wait in its route lane: one row each.
  const lanes = (s.lanes || []).map(b => ({ ...b, name: "route lane " + b.name }));
  const rows = s.shards.concat(lanes, s.sources).map(b => el("tr", { "data-backlog": b.name },
    el("td", { text: b.name }), num(b.due_now), num(b.scheduled), num(b.inflight), num(b.dead), num(b.oldest_due_age_ms)));
  rows.push(el("tr", { class: "total", "data-backlog": "total" },
    el("td", { text: "total" }), num(t.due_now), num(t.scheduled), num(t.inflight), num(t.dead), num(t.oldest_due_age_ms)));
  out.push(table(["", { t: "due now", n: 1 }, { t: "scheduled", n: 1 }, { t: "in flight", n: 1 }, { t: "dead", n: 1 }, { t: "oldest due ms", n: 1 }], rows, { id: "backlog" }));

  out.push(el("h2", { text: "Sinks" }));
  const waiting = Object.fromEntries(s.waiting.map(w => [w.sink, w]));
  // Jobs found waiting for a sink no daemon reports on (not configured any more, or not yet
  // checked) get a row too: nothing waiting in Redis stays out of sight.
  const unchecked = s.waiting.filter(w => w.jobs > 0 && !s.sinks.some(k => k.name === w.sink)).map(w =>
    el("tr", { "data-sink": w.sink },
      el("td", { text: w.sink }), el("td", { text: "—" }),
      el("td", { class: "down", text: w.configured ? "not checked yet" : "not configured" }),
      num(w.jobs), num(w.oldest_age_ms), el("td", { text: "—" })));
  out.push(s.sinks.length === 0 && unchecked.length === 0 ? el("p", { class: "muted", text: "Local routes only (delivered inside Redis): no broker sink to check." }) :
    table(["sink", "kind", "health", { t: "waiting", n: 1 }, { t: "oldest waiting ms", n: 1 }, "checked"], s.sinks.map(k =>
      el("tr", { "data-sink": k.name },
        el("td", { text: k.name }), el("td", { text: k.kind }),
        el("td", {},
          el("span", { class: k.up ? "up" : "down", text: k.up ? "up" : `down: ${k.error || ""}` }),
          // A target whose destination object is missing: its jobs wait, no attempt burned.
          Object.entries(k.held || {}).map(([target, why]) =>
            el("div", { class: "held", "data-held": target, text: `held ${target}: ${why}` }))),
        num((waiting[k.name] || {}).jobs || 0), num((waiting[k.name] || {}).oldest_age_ms || 0),
        el("td", { text: when(k.at, now) }))).concat(unchecked)));

  if ((s.flow || []).length > 0) {
    // Routes with a rate or a bound on their list: held means due work waits for it.
    out.push(el("h2", { text: "Flow control" }));
    out.push(table(["route", "rate", "per key", "max length", "now"], s.flow.map(f =>
      el("tr", { "data-flow": f.route },
        el("td", { text: f.route }),
        el("td", { text: f.rate ?? "—" }),
        el("td", { text: f.key_rate ? `${f.key_rate} per ${f.key_header}` : "—" }),
        num(f.max_length ?? "—"),
        el("td", { class: f.held_since_ms === null ? "up" : "down",
          text: f.held_since_ms === null ? "flowing" : `held for ${span(Math.max(0, now - f.held_since_ms))}` }))), { id: "flow" }));
  }

  out.push(el("h2", { text: "Delivered per minute (last 15 minutes, every daemon)" }));
  out.push(minuteChart(s.recent.minutes.slice(-15)));
  return out;
};

function minuteChart(minutes) {
  const W = 600, H = 120, max = Math.max(1, ...minutes.map(m => m.delivered));
  const bw = W / minutes.length;
  const g = svg("svg", { width: W, height: H + 18, role: "img", id: "throughput" });
  minutes.forEach((m, i) => {
    const h = Math.round((m.delivered / max) * H);
    const r = svg("rect", { class: "bar", x: i * bw + 1, y: H - h, width: bw - 2, height: h });
    r.append(svg("title", {}, `${iso(m.start_ms)}: ${m.delivered}`));
    g.append(r);
  });
  g.append(svg("text", { x: 0, y: H + 14 }, `max ${max}/min`));
  return g;
}

// ---------------------------------------------------------------------------------------
let forecastArgs = { next: "10m", step: "1m" };
pages.forecast = async function () {
  const f = await getJSON(`api/forecast?next=${enc(forecastArgs.next)}&step=${enc(forecastArgs.step)}`);
  const out = [];
  const next = el("input", { id: "fc-next", value: forecastArgs.next, size: 6 });
  const step = el("input", { id: "fc-step", value: forecastArgs.step, size: 6 });
  out.push(el("div", { class: "filters" },
    el("label", {}, "next", next), el("label", {}, "step", step),
    el("button", { type: "button", text: "Show", onclick: () => { forecastArgs = { next: next.value, step: step.value }; show(false); } })));
  out.push(el("div", { class: "cards" },
    el("div", { class: "card" }, "overdue now", el("b", { id: "forecast-overdue", text: f.overdue })),
    el("div", { class: "card" }, "drained per step (last hour's rate)", el("b", { id: "forecast-drain", text: f.drain_per_step ?? "—" })),
    el("div", { class: "card" }, "spikes", el("b", { id: "forecast-spikes", class: f.steps.some(s => s.spike) ? "spike" : null, text: f.steps.filter(s => s.spike).length }))));
  out.push(forecastChart(f));
  const limited = Object.entries(f.route_limits || {});
  if (limited.length > 0) {
    // A limited route drains at its own rate, whatever the namespace's recent pace.
    out.push(el("h2", { text: "Rate-limited routes" }));
    out.push(table(["route", { t: "rate / s", n: 1 }, { t: "per step", n: 1 }, "overdue clears in", "steps over its rate"],
      limited.map(([name, l]) => el("tr", { "data-limit": name },
        el("td", { text: name }), num(l.rate_per_s), num(l.drain_per_step),
        el("td", { text: span(l.overdue_clears_in_ms) }),
        el("td", { text: l.over_rate_steps.map(i => `+${span(i * f.step_ms)}`).join(", ") || "none" }))), { id: "route-limits" }));
  }
  const shards = Object.keys(f.overdue_by_shard);
  const sources = Object.keys(f.overdue_by_source);
  const routes = Object.keys(f.overdue_by_route || {});
  out.push(el("h2", { text: "Per step" }));
  out.push(table(["step start", { t: "jobs", n: 1 }, { t: "schedules", n: 1 }, ""].concat(shards.map(s => ({ t: "shard " + s, n: 1 }))).concat(routes.map(r => ({ t: "route " + r, n: 1 }))).concat(sources.map(s => ({ t: s, n: 1 }))),
    f.steps.map((s, i) => el("tr", { "data-step": i, class: s.spike ? "spike" : null },
      el("td", { text: `+${span(i * f.step_ms)}  ${iso(s.start_ms)}` }), num(s.count, { "data-count": s.count }), num(s.schedules),
      el("td", { text: s.spike ? "SPIKE" : "" }),
      shards.map(k => num(s.by_shard[k])), routes.map(k => num(s.by_route[k])), sources.map(k => num(s.by_source[k])))), { id: "forecast-steps" }));
  return out;
}

function forecastChart(f) {
  const W = 900, H = 180, steps = f.steps;
  const max = Math.max(1, f.drain_per_step || 0, ...steps.map(s => s.count));
  const bw = W / Math.max(1, steps.length);
  const g = svg("svg", { width: W, height: H + 20, role: "img", id: "forecast-chart" });
  steps.forEach((s, i) => {
    const h = Math.round((s.count / max) * H);
    const r = svg("rect", { class: s.spike ? "bar spike" : "bar", x: i * bw + 1, y: H - h, width: Math.max(1, bw - 2), height: h });
    r.append(svg("title", {}, `+${span(i * f.step_ms)}: ${s.count}${s.spike ? " (spike)" : ""}`));
    g.append(r);
  });
  if (f.drain_per_step !== null) {
    const y = H - Math.round((f.drain_per_step / max) * H);
    g.append(svg("line", { class: "limit", x1: 0, x2: W, y1: y, y2: y }));
    g.append(svg("text", { x: 4, y: Math.max(12, y - 4) }, `drained per step: ${f.drain_per_step}`));
  }
  g.append(svg("text", { x: 0, y: H + 16 }, `${steps.length} steps of ${span(f.step_ms)}; max ${max}`));
  return g;
}

// ---------------------------------------------------------------------------------------
let idleFrom = "";
let schedulesAfter = "";
pages.schedules = async function () {
  const query = new URLSearchParams(Object.entries({ after: schedulesAfter, idle_from: idleFrom }).filter(([, v]) => v)).toString();
  const s = await getJSON("api/schedules" + (query ? "?" + query : ""));
  const now = s.now_ms;
  if (s.total === 0) return [el("p", { class: "muted", text: "No recurring schedules." })];
  const rec = d => d.recurrence.cron ? `cron ${d.recurrence.cron.expr} (${d.recurrence.cron.tz})` : `every ${span(d.recurrence.every.interval_ms)}`;
  const misfire = m => typeof m === "string" ? m : Object.keys(m).map(k => `${k} ${JSON.stringify(m[k])}`).join(" ");
  // The calendar and the coming days it skips (or moves an occurrence off), each with why.
  const calendar = x => !x.calendar ? el("td", { class: "muted", text: "—" }) : el("td", { "data-calendar": x.calendar.name },
    el("div", { text: `${x.calendar.name} (${x.calendar.shift}, ${x.calendar.dates} dates)` }),
    ...(x.calendar_skips || []).map(k => el("div", { class: "muted", "data-skip": k.ms,
      text: `${k.at}: ${k.moved_to ? "moved to " + k.moved_to : "skipped"}: ${k.reason}` })));
  const rows = list => list.map(x =>
    el("tr", { "data-schedule": x.id },
      el("td", { text: x.id }), el("td", { text: x.dest }), el("td", { text: rec(x) }),
      el("td", { text: misfire(x.misfire) }), calendar(x),
      el("td", { class: x.paused ? "down" : (x.next_ms === null ? "muted" : "up"), text: x.paused ? "paused" : (x.next_ms === null ? "ended" : "active") }),
      el("td", { text: when(x.next_ms, now) }), el("td", { text: when(x.previous_ms, now) }),
      el("td", { text: x.health.last_fired_ms === null ? "never" : `${when(x.health.last_fired_ms, now)}, ${span(x.health.last_lateness_ms)} late` }),
      el("td", { class: x.health.missed + x.health.expired > 0 ? "down" : "", "data-health": [x.health.fired, x.health.missed, x.health.expired, x.health.skipped_by_calendar].join(" "),
        title: "occurrences fired / missed (passed over by the misfire policy) / expired / skipped by calendar",
        text: `${x.health.fired} / ${x.health.missed} / ${x.health.expired} / ${x.health.skipped_by_calendar}` }),
      el("td", {},
        x.paused ? actionButton("Resume", `api/schedules/${enc(x.id)}/resume`, `resume ${x.id}`, { "data-action": "resume" })
          : actionButton("Pause", `api/schedules/${enc(x.id)}/pause`, `pause ${x.id}`, { "data-action": "pause" }),
        " ",
        actionButton("Run now", `api/schedules/${enc(x.id)}/run`, `run ${x.id}`, { "data-action": "run" }))));
  const head = ["id", "destination", "repeats", "misfire", "calendar (coming skips)", "state", "next", "last (on the grid)", "last fired", "fired / missed / expired / skipped", ""];
  const out = [el("p", { class: "muted", id: "schedules-total", "data-total": s.total, "data-pending": s.pending,
    text: `${s.total} schedules, ${s.pending} with a pending occurrence; ${schedulesAfter ? "after the last page" : "the next"} ${s.schedules.length} to fire:` })];
  out.push(table(head, rows(s.schedules), { id: "schedules-next" }));
  out.push(el("p", {},
    s.next ? el("button", { type: "button", id: "schedules-more", text: "Next page", onclick: () => { schedulesAfter = s.next; show(false); } }) : "",
    " ", schedulesAfter ? el("button", { type: "button", text: "From the soonest", onclick: () => { schedulesAfter = ""; show(false); } }) : ""));
  out.push(el("h2", { text: "Paused or ended" }));
  out.push(el("p", { class: "muted", text: idleFrom ? `Scanning from ${idleFrom}.` : "Scanned from the start." },
    " ", s.idle_next ? el("button", { type: "button", id: "idle-more", text: "Scan further", onclick: () => { idleFrom = s.idle_next; show(false); } })
      : (idleFrom ? el("button", { type: "button", text: "Scan from the start", onclick: () => { idleFrom = ""; show(false); } }) : "Every schedule scanned.")));
  out.push(s.idle.length === 0 ? el("p", { class: "muted", text: "None found in this scan." }) : table(head, rows(s.idle), { id: "schedules-idle" }));
  return out;
};

// ---------------------------------------------------------------------------------------
const FILTERS = [["route", "route (destination)"], ["reason", "reason contains"], ["older_than", "died over (10m) ago"],
  ["newer_than", "died within (1h)"], ["schedule", "schedule id"]];
let deadFilter = { route: "", reason: "", older_than: "", newer_than: "", schedule: "", source: "" };
function deadQuery(extra) {
  return new URLSearchParams(Object.entries(Object.assign({}, deadFilter, extra || {})).filter(([, v]) => v)).toString();
}
function attempts(j) {
  return `${j.attempt}${j.max_attempts ? "/" + j.max_attempts : ""}`;
}

pages.dead = async function (arg) {
  if (arg) return deadDetail(arg, null);
  const q = deadQuery();
  let d;
  try {
    d = await getJSON("api/dead" + (q ? "?" + q : ""));
  } catch (e) {
    return [refusedRead(e, "Dead letters")];
  }
  const inputs = {};
  const field = ([name, hint]) => el("label", {}, hint, inputs[name] = el("input", { id: "dead-" + name, value: deadFilter[name], size: 12 }));
  inputs.source = el("select", { id: "dead-source" }, el("option", { value: "", text: "envelope jobs (+ every source)" }),
    d.sources.map(k => el("option", { value: k, text: k, selected: k === deadFilter.source })));
  const apply = () => { for (const k in inputs) deadFilter[k] = inputs[k].value.trim(); show(false); };
  const filtered = Object.values(deadFilter).some(v => v);
  const bulk = action => {
    const what = filtered ? "every dead job matching the filters" : "EVERY dead job";
    if (!confirm(`${action} ${what}?`)) return;
    act("api/dead?" + deadQuery({ action, all: filtered ? "" : "true" }), `${action} matching`);
  };
  const out = [el("div", { class: "filters" }, FILTERS.map(field), el("label", {}, "raw source", inputs.source),
    el("button", { type: "button", id: "dead-filter", text: "Filter", onclick: apply }),
    el("button", { type: "button", id: "dead-replay-all", "data-action": "replay-all", text: "Replay matching", disabled: !token(), onclick: () => bulk("replay") }),
    el("button", { type: "button", id: "dead-purge-all", "data-action": "purge-all", text: "Purge matching", disabled: !token(), onclick: () => bulk("purge") }))];
  out.push(el("p", { class: "muted", id: "dead-total", "data-total": d.total,
    text: `${d.total} dead jobs in all; showing the oldest ${d.jobs.length} jobs and ${d.raw.length} raw members that match (at most ${d.limit} each)` +
      (d.complete ? "" : `; stopped after reading ${d.scan_limit} per shard: narrow the ages to see further`) +
      (d.raw_not_listed ? `; raw members not listed: ${d.raw_not_listed}` : "") }));
  if (!deadFilter.source) {
    out.push(d.jobs.length === 0 ? el("p", { id: "dead-none", text: "No dead job matches." }) :
      table(["id", "route", "attempts", "reason", "died", "earlier deaths", ""], d.jobs.map(j =>
        el("tr", { "data-dead": j.id, "data-route": j.route ?? "" },
          el("td", {}, el("a", { href: "#dead/" + enc(j.id), text: j.id })),
          el("td", { text: j.route ?? "—" }), num(attempts(j)), el("td", { text: j.reason }), el("td", { text: when(j.died_ms, d.now_ms) }),
          num(j.earlier_deaths || ""),
          el("td", {},
            actionButton("Replay", `api/dead/${enc(j.id)}/replay`, `replay ${j.id}`, { "data-action": "replay" }), " ",
            el("button", { type: "button", text: "Purge", "data-action": "purge", disabled: !token(), onclick: () => {
              if (confirm(`Delete dead job ${j.id} for good?`)) act(`api/dead/${enc(j.id)}/purge`, `purge ${j.id}`);
            } })))), { id: "dead-jobs" }));
  }
  if (d.raw.length) {
    out.push(el("h2", { text: "Dead raw-source members" }));
    out.push(table(["source", "id", "member", "reason", "died", ""], d.raw.map(m => {
      const src = `?source=${enc(m.source)}`;
      return el("tr", { "data-raw": m.id, "data-source": m.source },
        el("td", { text: m.source }),
        el("td", {}, el("a", { href: `#dead-member/${enc(m.source)}/${m.id}`, text: m.id })),
        el("td", { text: m.payload_preview + (m.payload_truncated ? " …" : "") }), el("td", { text: m.reason }), el("td", { text: when(m.died_ms, d.now_ms) }),
        el("td", {},
          actionButton("Replay", `api/dead/${m.id}/replay${src}`, `replay ${m.source}:${m.id}`, { "data-action": "replay" }), " ",
          el("button", { type: "button", text: "Purge", "data-action": "purge", disabled: !token(), onclick: () => {
            if (confirm(`Delete dead member ${m.source}:${m.id} for good?`)) act(`api/dead/${m.id}/purge${src}`, `purge ${m.source}:${m.id}`);
          } })));
    }), { id: "dead-raw" }));
  }
  return out;
};

// #dead-member/<source>/<id>: one dead raw member (ids are hex: the last segment).
pages["dead-member"] = async function (arg) {
  const cut = (arg || "").lastIndexOf("/");
  return deadDetail(arg.slice(cut + 1), arg.slice(0, cut));
};

async function deadDetail(id, source) {
  const src = source ? `?source=${enc(source)}` : "";
  const out = [el("p", {}, el("a", { href: "#dead", text: "← dead letters" }))];
  let j;
  try {
    j = await getJSON(`api/dead/${enc(id)}${src}`);
  } catch (e) {
    if (e instanceof HttpError && e.status === 403) return out.concat(refusedRead(e, "Dead letters"));
    return out.concat(el("p", { id: "dead-missing", text: e.message }));
  }
  const rows = [["id", source ? `${j.id} (message id ${j.message_id})` : j.id]];
  if (source) rows.push(["source", source]);
  else rows.push(["route", j.route ?? "—"], place(j));
  rows.push(["died", iso(j.died_ms)], ["reason", j.reason]);
  if (!source) {
    if (j.envelope_error) rows.push(["envelope", j.envelope_error]);
    rows.push(["attempts", attempts(j)], ["last error", j.last_error ?? "—"]);
    if (j.schedule) rows.push(["schedule", j.schedule]);
    if (j.headers && Object.keys(j.headers).length) rows.push(["headers", JSON.stringify(j.headers)]);
  }
  out.push(el("dl", { id: "dead-detail" }, rows.map(([k, v]) => [el("dt", { text: k }), el("dd", { "data-field": k, text: v ?? "—" })])));
  if (!source) {
    out.push(el("h2", { text: `Earlier deaths (${j.history.length}), oldest first` }));
    out.push(j.history.length === 0 ? el("p", { class: "muted", id: "dead-history-none", text: "None: it died once." }) :
      el("ul", { id: "dead-history" }, j.history.map(h => el("li", { "data-death": h.died_ms, text: `${iso(h.died_ms)}  ${h.reason}` }))));
  }
  out.push(el("h2", { text: `Payload (${j.payload_size ?? 0} bytes, ${j.payload_encoding || "?"}${j.payload_truncated ? ", preview truncated" : ""})` }));
  out.push(el("pre", { id: "dead-payload", text: j.payload_preview ?? "" }));
  const delay = el("input", { id: "replay-in", size: 6, placeholder: "now" });
  const keep = el("input", { id: "replay-keep", type: "checkbox" });
  const replay = () => {
    const q = new URLSearchParams(source ? { source } : {});
    if (delay.value.trim()) q.set("in", delay.value.trim());
    if (keep.checked) q.set("keep_attempts", "true");
    act(`api/dead/${enc(id)}/replay?${q}`, `replay ${id}`).then(r => { if (r) location.hash = "#dead"; });
  };
  out.push(el("div", { class: "filters" },
    el("label", {}, "replay in (e.g. 10m)", delay),
    source ? null : el("label", {}, "keep attempts", keep),
    el("button", { type: "button", text: "Replay", "data-action": "replay", disabled: !token(), onclick: replay }),
    el("button", { type: "button", text: "Purge", "data-action": "purge", disabled: !token(), onclick: () => {
      if (confirm(`Delete ${id} for good?`)) act(`api/dead/${enc(id)}/purge${src}`, `purge ${id}`).then(r => { if (r) location.hash = "#dead"; });
    } })));
  return out;
}

// ---------------------------------------------------------------------------------------
pages.job = async function (arg) {
  const input = el("input", { id: "job-id-input", value: arg || "", size: 40, placeholder: "job id" });
  const go = () => { location.hash = "#job/" + enc(input.value.trim()); };
  input.addEventListener("keydown", e => { if (e.key === "Enter") go(); });
  const out = [el("div", { class: "filters" }, el("label", {}, "job id", input), el("button", { type: "button", text: "Show", onclick: go }))];
  if (!arg) return out;
  let j;
  try {
    j = await getJSON("api/jobs/" + enc(arg));
  } catch (e) {
    if (e instanceof HttpError && e.status === 403) return out.concat(refusedRead(e, "Jobs"));
    return out.concat(el("p", { id: "job-missing", text: e.message }));
  }
  const rows = [["id", j.id], ["state", j.state], ["destination", j.dest], place(j)];
  if (j.due !== undefined) rows.push(["due", iso(j.due)]);
  if (j.died !== undefined) rows.push(["died", iso(j.died)]);
  if (j.lease_deadline !== undefined) rows.push(["lease deadline", iso(j.lease_deadline)]);
  rows.push(["attempts", `${j.attempt ?? 0}${j.max_attempts ? " of " + j.max_attempts : ""}`]);
  if (j.last_error) rows.push(["last error", j.last_error]);
  if (j.reason) rows.push(["dead because", j.reason]);
  if (j.waiting_for_sink) rows.push(["waiting for sink", j.waiting_for_sink]);
  if (j.schedule) rows.push(["schedule", j.schedule]);
  if (j.headers && Object.keys(j.headers).length) rows.push(["headers", JSON.stringify(j.headers)]);
  out.push(el("dl", { id: "job" }, rows.map(([k, v]) => [el("dt", { text: k }), el("dd", { "data-field": k, text: v ?? "—" })])));
  out.push(el("h2", { text: `Payload (${j.payload_bytes} bytes, ${j.payload_encoding || "?"}${j.payload_truncated ? ", preview truncated" : ""})` }));
  out.push(el("pre", { id: "job-payload", text: j.payload ?? j.raw ?? "" }));
  const acts = [];
  if (j.state === "scheduled" || j.state === "due") acts.push(actionButton("Cancel", `api/jobs/${enc(j.id)}/cancel`, `cancel ${j.id}`, { "data-action": "cancel" }));
  if (j.state === "dead") {
    acts.push(actionButton("Replay", `api/dead/${enc(j.id)}/replay`, `replay ${j.id}`, { "data-action": "replay" }));
  }
  if (acts.length) out.push(el("p", {}, acts));
  return out;
};

// ---------------------------------------------------------------------------------------
function route() {
  const [name, ...rest] = location.hash.replace(/^#/, "").split("/");
  const page = pages[name] ? name : "overview";
  return { page, arg: rest.length ? decodeURIComponent(rest.join("/")) : null };
}

async function show(clearStatus) {
  const { page, arg } = route();
  const section = page === "dead-member" ? "dead" : page;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === section);
  if (clearStatus) setStatus("");
  try {
    const content = await pages[page](arg);
    const main = document.getElementById("page");
    main.replaceChildren(...content);
    main.dataset.page = page;
    main.dataset.loadedAt = String(Date.now());
  } catch (e) {
    setStatus(`${page}: ${e.message}`, "error");
  }
  clearTimeout(refreshTimer);
  if (page === "overview" || page === "forecast") refreshTimer = setTimeout(() => show(false), 5000);
}

function showAuth() {
  const has = !!token();
  document.getElementById("auth-state").textContent = has ? "unlocked: payloads and actions" : "locked";
  document.getElementById("token").hidden = has;
  document.getElementById("unlock").hidden = has;
  document.getElementById("lock").hidden = !has;
}

async function unlock() {
  const input = document.getElementById("token");
  const t = input.value.trim();
  if (!t) return;
  const r = await fetch("api/auth", { method: "POST", headers: { Authorization: "Bearer " + t } });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) {
    setStatus(`token refused: ${body.error || r.status}`, "error");
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, t);
  input.value = "";
  setStatus("unlocked for this tab: payloads and actions", "ok");
  showAuth();
  show(false);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("unlock").addEventListener("click", unlock);
  document.getElementById("token").addEventListener("keydown", e => { if (e.key === "Enter") unlock(); });
  document.getElementById("lock").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showAuth();
    show(true);
  });
  window.addEventListener("hashchange", () => show(true));
  showAuth();
  show(true);
});
