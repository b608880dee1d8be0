-- move_lane: push one batch of a route lane's due jobs onto the route's list (or append them to
-- its stream) and remove them, in one script (exactly once; the lane is in the list's hash
-- slot, so on a cluster too). The route is known from the keys: no job is parsed, no route
-- table is passed.
-- KEYS[1] due       ZSET   zdelay:{emj}:due:<route>       member = stored id, score = due ms
-- KEYS[2] jobs      HASH   zdelay:{emj}:jobs:<route>      stored id -> payload (raw bytes)
-- KEYS[3] meta      HASH   zdelay:{emj}:meta:<route>      stored id -> meta JSON (only jobs with meta)
-- KEYS[4] maxlate   HASH   zdelay:{emj}:maxlate:<route>   stored id -> max lateness ms
-- KEYS[5] large     SET    zdelay:{emj}:large:<route>     stored ids whose payload is over 4096 bytes
-- KEYS[6] dead      ZSET   zdelay:{emj}:dead:<route>      member = stored id, score = ms it died
-- KEYS[7] reasons   HASH   zdelay:{emj}:reasons:<route>   stored id -> why it died
-- KEYS[8] sched_due ZSET   zdelay:{emj}:sched_due:<route> schedule id -> its next occurrence (only
--                                                         its head is read, for the reply)
-- KEYS[9] list      LIST   the route's list (its target, or target .. delayed_suffix); a
--                          STREAM when the push is XADD
-- KEYS[10] flow     HASH   zdelay:{emj}:flow:<route>      the route's flow control: "tokens" and
--                                                         "at" (the rate's bucket, refilled at
--                                                         ms "at"), "held_since" (ms the route
--                                                         has been held since, by its rate or
--                                                         its list's bound; absent: flowing) and
--                                                         "held_by" ("rate" or "max_length")
-- KEYS[11] marker   STRING zdelay:{emj}:lane:<route>      "2 <lane> <LPUSH|RPUSH|XADD> <list key>"
-- KEYS[12] unique   HASH   zdelay:{emj}:unique:<route>    stored id -> its unique_for window ms
-- KEYS[13] windows  ZSET   zdelay:{emj}:windows:<route>   "u:<stored id>" -> ms until which it
--                                                         is a duplicate (enqueue_lane)
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] batch size, at most 1000
-- ARGV[3] "now" in ms; "" = Redis TIME (tests pass an explicit value to drive time)
-- ARGV[4] largest payload in bytes; a larger one goes to dead
-- ARGV[5] byte budget: payload bytes one call reads at most; a single larger payload still
--   moves, alone
-- ARGV[6] "LPUSH" | "RPUSH" | "XADD" (as the marker says)
-- ARGV[7] B, the number of lateness bucket bounds; then B bounds in ms, ascending
-- ARGV[8 + B] the route's rate in jobs per second ("" = none), ARGV[9 + B] its burst (jobs
--   the bucket holds), ARGV[10 + B] the list's bound ("" = none: max_length), ARGV[11 + B] how
--   long a held route waits before it looks at its list again, ms
-- ARGV[12 + B] the header that names a job's key ("" = no per-key rate), ARGV[13 + B] the
--   rate per key in jobs per second, ARGV[14 + B] the burst per key
-- ARGV[15 + B] XADD only: the stream's length bound after the call ("" = none: trim_max_len),
--   ARGV[16 + B] the age in ms past which entries are trimmed ("" = none: trim_max_age)
-- XADD: each job is one stream entry ("*" id), its fields in this order: "payload" (the
--   payload, raw bytes), "zdelay-id" ("<job id>:<due ms>": the generated id in its public
--   form "~<lane>.<stored id>", or the user's id), then "traceparent" and "tracestate" when
--   its headers have them, then "h:<name>" for each other header, names in byte order. After
--   the appends, the stream is trimmed once: XTRIM MAXLEN ~ and XTRIM MINID ~ (now - age),
--   each removing at most 10000 entries a call (Redis's default LIMIT for "~").
-- Per key: each key has a bucket of its own (field "k:<key>" of the flow hash: "<tokens>
--   <refilled at ms> <when it next has a whole token, ms>"); a job without the header, or
--   without meta, has the key "". A job whose key has no whole token is put later instead of
--   moved, at its turn, and its token is taken then (the bucket goes below zero): scored at
--   its turn plus half a millisecond, which marks it granted, so it moves then. That wait
--   counts as deferral too. A job whose meta is not JSON (its key unreadable) goes to dead.
-- Flow control: at most the bucket's whole tokens are moved (the bucket refills at the rate,
-- up to max(burst, 1 + 10 ms of the rate), on Redis's clock, shared by every daemon, and never
-- for a clock that stepped back), and never more than the list has room for below its bound.
-- Jobs over either wait in due, in order; none is dropped. The route is held from the call
-- one of them cut with due work left until a call leaves none due; while held, the wait
-- counts as deferral, not lateness: lateness (the buckets, the max lateness, and expiry by a
-- job's max lateness) is measured up to the moment the route became held. A list key that is
-- not a list is not a bound's reason to hold: the push sends the jobs to dead (wrong_type).
-- For XADD the bound reads the stream's XLEN, and a key that is not a stream is the same.
-- Returns move_due's reply shape for one route and no two-phase sink: { taken, now_us,
--   next_due ("" when the lane is empty), max_lateness_ms, kept (jobs left due because their
--   push failed, e.g. OOM), first push error ("" if none), moved,
--   dead per kind (6 integers: malformed (a per-key meta not JSON), unknown_destination
--   always 0, wrong_type,
--   oversize, missing, expired),
--   jobs per lateness bucket (B + 1 integers; the last is over the largest bound),
--   0 (leases), 0 (sinks), the next occurrence of the lane's schedules ("" when none),
--   0, 0, 0, "" (no walk), "" (no lease),
--   jobs moved that were deferred, their deferral in ms summed, held (0 flowing, 1 by the
--   rate, 2 by the list's bound) }
-- When the rate or the bound cut the call, next_due is when the route may move again (the
-- bucket has its next tenth of a second of tokens, at least one, with room left for a late
-- wake-up; or the next look at the list), so a held route never makes its mover spin.
-- taken = moved + dead; a full batch means "call again now", and so does a next_due that is
-- already due (a batch cut by the byte budget).
-- Re-run safety: yes; a second run finds the taken jobs gone and takes the next ones.

local lane_marker = KEYS[11]
-- @include lane_fence
local due_key, jobs_key, meta_key, maxlate_key, large_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local dead_key, reasons_key, sched_due_key, list_key = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local flow_key = KEYS[10]
local now_us
-- @include clock
now_us = clock_us(tonumber(ARGV[3]))
local now_ms = math.floor(now_us / 1000)
local unique_key, windows_key = KEYS[12], KEYS[13]
-- @include remember
local max_payload = tonumber(ARGV[4])
local budget_left = tonumber(ARGV[5])
local push = ARGV[6]
local stream = push == 'XADD'
local bound_count = tonumber(ARGV[7])
-- Bound b as a number, converted when first needed (a call compares a few of them).
local bound_values = {}
local function bound(b)
  local v = bound_values[b]
  if not v then
    v = tonumber(ARGV[7 + b])
    bound_values[b] = v
  end
  return v
end
local buckets = {}
for b = 1, bound_count + 1 do buckets[b] = 0 end

-- Flow control: how many jobs this call may move.
-- @include flow_bucket
local flow_at = 8 + bound_count
local rate, burst = tonumber(ARGV[flow_at]), tonumber(ARGV[flow_at + 1])
local max_length, hold_recheck = tonumber(ARGV[flow_at + 2]), tonumber(ARGV[flow_at + 3])
local batch = tonumber(ARGV[2])
local allowed = batch
-- cut_by: what cut this call's batch (0 nothing, 1 the rate, 2 the list's bound).
local tokens, capacity, bucket_at, held_since, cut_by, was_held_by = nil, nil, nil, nil, 0, nil
if rate or max_length then
  local state = redis.call('HMGET', flow_key, 'tokens', 'at', 'held_since', 'held_by')
  held_since, was_held_by = tonumber(state[3]), state[4]
  if rate then
    capacity = bucket_capacity(rate, burst)
    local whole
    tokens, bucket_at, whole = bucket_refill(rate, capacity, tonumber(state[1]), tonumber(state[2]), now_ms)
    if whole < allowed then
      allowed = whole
      cut_by = 1
    end
  end
  if max_length then
    -- A key that is not a list has no length to keep below the bound: the push finds it
    -- and sends the jobs to dead, saying why, instead of every call failing here.
    local len
    if stream then len = redis.pcall('XLEN', list_key) else len = redis.pcall('LLEN', list_key) end
    if type(len) == 'number' then
      local room = max_length - len
      if room < allowed then
        allowed = math.max(0, room)
        cut_by = 2
      end
    end
  end
end
-- Lateness is measured up to the moment the route became held; the rest is deferral.
local late_now = now_ms
if held_since and held_since < now_ms then late_now = held_since end
local deferred, deferral_ms = 0, 0

local DEAD_WRONGTYPE, DEAD_OVERSIZE, DEAD_MISSING, DEAD_EXPIRED = 3, 4, 5, 6
local dead_counts = { 0, 0, 0, 0, 0, 0 }
local moved, max_lateness, kept, kept_error = 0, 0, 0, ''

local key_header = ARGV[flow_at + 4]
local per_key = key_header and key_header ~= ''
local ids, scores = {}, {}
if allowed > 0 and per_key then
  local read = redis.call('ZRANGEBYSCORE', due_key, '-inf', now_ms, 'WITHSCORES', 'LIMIT', '0', allowed)
  for k = 1, #read / 2 do
    ids[k] = read[2 * k - 1]
    scores[k] = read[2 * k]
  end
elseif allowed > 0 then
  ids = redis.call('ZRANGEBYSCORE', due_key, '-inf', now_ms, 'LIMIT', '0', allowed)
end
local n = #ids

-- Per-key rates: a job whose key has no whole token is put later, at its turn, scored half a
-- millisecond past it: the half marks it granted, so at its turn it moves without asking for
-- a token again. Its token is taken when the turn is given (the bucket goes below zero, and
-- the next turn is when it has paid that back and has a whole token again), so a key's
-- turns and its immediate moves together stay within its bucket: at most burst + rate * T in
-- any T. A key with jobs waiting their turn has less than one token, so its new jobs queue
-- behind them, in due order, while other keys' jobs flow. A job whose meta cannot be read
-- for its key goes to dead, saying why.
local per_key_dead = 0
if per_key and n > 0 then
  local key_rate, key_burst = tonumber(ARGV[flow_at + 5]), tonumber(ARGV[flow_at + 6])
-- @include key_bucket
  local metas = redis.call('HMGET', meta_key, unpack(ids))
  -- A job's key: found as text in the compact JSON producers write ('"<header>":"<value>"',
  -- no backslash in the meta), else by decoding it. false: the meta is not JSON.
  local needle = '"' .. key_header .. '":"'
  local function key_of(meta)
    if not meta then return '' end
    if not string.find(meta, '\\', 1, true) then
      local _, e = string.find(meta, needle, 1, true)
      local close = e and string.find(meta, '"', e + 1, true)
      if close then return string.sub(meta, e + 1, close - 1) end
    end
    local ok, m = pcall(cjson.decode, meta)
    if not ok then return false end
    if type(m) == 'table' and type(m.headers) == 'table' then
      local v = m.headers[key_header]
      if type(v) == 'string' then return v end
    end
    return ''
  end
  -- Every key of the batch, then their buckets in one read. A burst of one key's jobs carry
  -- the same meta one after another: a job whose meta is its predecessor's has its key.
  -- A granted turn's score ends in ".5": it waited for its turn and goes now.
  local key_at, order, seen = {}, {}, {}
  local last_meta, last_key = nil, nil
  local byte = string.byte
  for i = 1, n do
    if byte(scores[i], -2) ~= 46 then
      local meta = metas[i]
      local key = last_key
      if meta ~= last_meta then
        key = key_of(meta)
        last_meta, last_key = meta, key
      end
      key_at[i] = key
      if key and not seen[key] then
        seen[key] = true
        order[#order + 1] = key
      end
    end
  end
  local buckets_of = key_buckets(flow_key, order)
  local kept_ids, later, kept_n, later_n, dead_ids = {}, {}, 0, 0, {}
  for i = 1, n do
    local key = key_at[i]
    if key == false then
      dead_ids[#dead_ids + 1] = ids[i]
    else
      local turn = key and key_take(buckets_of[key])
      if not turn then
        kept_n = kept_n + 1
        kept_ids[kept_n] = ids[i]
      else
        later[later_n + 1] = turn + 0.5
        later[later_n + 2] = ids[i]
        later_n = later_n + 2
        deferred = deferred + 1
        deferral_ms = deferral_ms + turn - now_ms
      end
    end
  end
  for k = 1, later_n, 1000 do
    redis.call('ZADD', due_key, 'XX', unpack(later, k, math.min(later_n, k + 999)))
  end
  key_buckets_write(flow_key, buckets_of, order)
  if #dead_ids > 0 then
    -- A replay with its meta mended moves it.
-- @include lane_kill
    kill_waiting(dead_ids, 'meta is not valid JSON, so its ' .. key_header
      .. ' header (the key of its route\'s key_rate) cannot be read')
    per_key_dead = #dead_ids
    dead_counts[1] = per_key_dead
  end
  ids = kept_ids
  n = #ids
end

-- The payloads of ids[1..] within the byte budget. While the lane's `large` set is empty
-- (producers list there every payload over SMALL bytes) and max_payload is at least SMALL,
-- no payload can be over the budget's share or over max_payload: one HMGET of as many ids as
-- the budget holds at SMALL each, with no per-job check (a missing payload makes the push
-- fail, and the general path sorts it out). Otherwise in chunks of as many ids as the rest
-- of the budget holds at max_payload each, so a payload is never read only to be left; once
-- one over LARGE was seen, one at a time (Redis copies what came before each value of a
-- multi-value reply). Returns them, how many ids they cover (at least one), and whether
-- every one is known to be present and within max_payload (nil: not checked).
local SMALL, LARGE = 4096, 65536

-- Whether the large set holds any id, once asked (nil until then): asked once per call.
local any_large = nil
local function large_listed()
  if any_large == nil then any_large = redis.call('EXISTS', large_key) == 1 end
  return any_large
end
local function read_payloads()
  if max_payload >= SMALL and not large_listed() then
    local count = math.min(n, math.max(1, math.floor(budget_left / SMALL)))
    return redis.call('HMGET', jobs_key, unpack(ids, 1, count)), count, nil
  end
  local payloads, count, largest, clean = nil, 0, 0, true
  while count < n do
    local chunk = math.min(n - count, math.max(1, math.floor(budget_left / max_payload)))
    if largest >= LARGE then chunk = 1 end
    local part = redis.call('HMGET', jobs_key, unpack(ids, count + 1, count + chunk))
    if count == 0 then payloads = part end
    for j = 1, chunk do
      local p = part[j]
      local size = 0
      if p then
        size = #p
        if size > max_payload then clean = false end
      else
        clean = false
      end
      if size > budget_left and count > 0 then return payloads, count, clean end
      count = count + 1
      if count > j then payloads[count] = p end
      budget_left = budget_left - size
      if size > largest then largest = size end
    end
    if budget_left <= 0 then break end
  end
  return payloads, count, clean
end

-- HDEL of ids[1..count], 32 at a time: Redis reuses its argument objects for the first 32
-- arguments of a command called from Lua and allocates the others, so small deletes cost
-- less than one large one.
local function hdel_ids(key, list, count)
  for i = 1, count, 32 do redis.call('HDEL', key, unpack(list, i, math.min(count, i + 31))) end
end

-- Lateness buckets of the batch (the n lowest scores, still in due: ranks 0 to n - 1) without
-- reading every score: the jobs later than bound L are those scored below now - L, counted
-- by ZCOUNT, for the bounds between the batch's least and greatest lateness. Returns the
-- score of rank n, the lane's head once the batch is gone ('' when none).
local function count_buckets()
  local tail = redis.call('ZRANGE', due_key, n - 1, n, 'WITHSCORES')
  local late_min = now_ms - tonumber(tail[2])
  local late_max = late_min
  if n > 1 then late_max = now_ms - tonumber(redis.call('ZSCORE', due_key, ids[1])) end
  if late_max > max_lateness then max_lateness = late_max end
  -- Bucket k holds lateness in (bound k - 1, bound k]; the last one is over every bound.
  local function bucket_of(late)
    local lo, hi = 1, bound_count + 1
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if late <= bound(mid) then hi = mid else lo = mid + 1 end
    end
    return lo
  end
  local first, last = bucket_of(late_min), bucket_of(late_max)
  -- above: jobs later than the bound below the bucket being counted.
  local above_prev = n
  for b = first, last - 1 do
    local above = redis.call('ZCOUNT', due_key, '-inf', '(' .. string.format('%d', now_ms - bound(b)))
    if above > n then above = n end
    buckets[b] = buckets[b] + above_prev - above
    above_prev = above
  end
  buckets[last] = buckets[last] + above_prev
  return tail[4] or ''
end

-- Stream entries: the public form of a stored id (generated: 12 characters of the stored id
-- alphabet, shown as "~<lane>.<stored id>"; a user's id as stored).
local id_prefix = '~' .. (string.match(ARGV[1], '^2 (%w+) ') or '') .. '.'
local meta_present = nil
local find = string.find
local function public_id(id)
  if #id == 12 and not find(id, '[^-0-9A-Z_a-z]') then return id_prefix .. id end
  return id
end
-- "<id>:<due ms>"; a score put later by a key's rate ends in ".5": its whole milliseconds.
local function zdelay_id(id, score)
  if find(score, '.', 1, true) then score = string.format('%d', math.floor(tonumber(score))) end
  return public_id(id) .. ':' .. score
end
-- The entry's fields after payload and zdelay-id: trace context first, then the other
-- headers as "h:<name>", in byte order. A meta that is not JSON, or has no headers, adds none.
local function header_fields(meta, args)
  if not meta then return end
  local ok, m = pcall(cjson.decode, meta)
  if not ok or type(m) ~= 'table' or type(m.headers) ~= 'table' then return end
  local h = m.headers
  for _, name in ipairs({ 'traceparent', 'tracestate' }) do
    if type(h[name]) == 'string' then
      args[#args + 1] = name
      args[#args + 1] = h[name]
    end
  end
  local names = {}
  for name, value in pairs(h) do
    if type(value) == 'string' and name ~= 'traceparent' and name ~= 'tracestate' then
      names[#names + 1] = name
    end
  end
  table.sort(names)
  for _, name in ipairs(names) do
    args[#args + 1] = 'h:' .. name
    args[#args + 1] = h[name]
  end
end
-- Pushes the jobs id_list[from..to], whose payloads are payload_list[from + shift ..
-- to + shift]: one LPUSH/RPUSH, or one XADD per job. Returns how many went (a failed
-- LPUSH/RPUSH changes nothing: 0) and the error that stopped it (nil: none). The jobs must
-- still be in due (XADD reads their scores).
local function push_jobs(id_list, payload_list, from, to, shift)
  if not stream then
    local res = redis.pcall(push, list_key, unpack(payload_list, from + shift, to + shift))
    if type(res) == 'table' and res.err then return 0, res.err end
    return to - from + 1, nil
  end
  local scores = redis.call('ZMSCORE', due_key, unpack(id_list, from, to))
  if meta_present == nil then meta_present = redis.call('EXISTS', meta_key) == 1 end
  local metas = {}
  if meta_present then metas = redis.call('HMGET', meta_key, unpack(id_list, from, to)) end
  for k = from, to do
    local i = k - from + 1
    local meta, res = metas[i], nil
    local zid = zdelay_id(id_list[k], scores[i])
    if meta then
      local args = { list_key, '*', 'payload', payload_list[k + shift], 'zdelay-id', zid }
      header_fields(meta, args)
      res = redis.pcall('XADD', unpack(args))
    else
      res = redis.pcall('XADD', list_key, '*', 'payload', payload_list[k + shift], 'zdelay-id', zid)
    end
    if type(res) == 'table' and res.err then return i - 1, res.err end
  end
  return to - from + 1, nil
end

local payloads
local done = false
-- The reply's next_due when the fast path knows it.
local next_due = nil
-- Jobs the chunked path below moved (they are gone from due when the paths after it run).
local pushed = 0
-- The common case (no payload listed as large, no max lateness in the lane, the route not
-- held): read, push and delete CHUNK jobs a command. Redis reuses the argument objects of the
-- first 32 arguments of a command called from Lua and allocates the others, so chunks of 30
-- ids cost 5-10 % less per job than one HMGET and one HDEL of the whole batch. A chunk
-- whose push fails (a missing payload, not a list, out of memory) changes nothing: the chunks
-- before it are moved, and it and the rest go on to the paths below, which sort them out.
local CHUNK = 30
if n > 0 and max_payload >= SMALL and not held_since and not large_listed()
    and redis.call('EXISTS', maxlate_key) == 0 then
  local count = math.min(n, math.max(1, math.floor(budget_left / SMALL)))
  for i = #ids, count + 1, -1 do ids[i] = nil end
  n = count
  for i = 1, n, CHUNK do
    local j = math.min(n, i + CHUNK - 1)
    local part = redis.call('HMGET', jobs_key, unpack(ids, i, j))
    local went, err = push_jobs(ids, part, i, j, 1 - i)
    if went > 0 then
      redis.call('HDEL', jobs_key, unpack(ids, i, i + went - 1))
      pushed = i + went - 1
    end
    if err then break end
  end
  if pushed > 0 then
    local rest = {}
    for i = pushed + 1, n do
      rest[#rest + 1] = ids[i]
      ids[i] = nil
    end
    n = pushed
    moved = pushed
    next_due = count_buckets()
    remember(ids)
    if redis.call('EXISTS', meta_key) == 1 then hdel_ids(meta_key, ids, n) end
    -- The first n ranks are exactly the ids read above (same script, scores <= now).
    redis.call('ZREMRANGEBYRANK', due_key, '0', n - 1)
    ids, n = rest, #rest
    if n > 0 then next_due = nil end
  end
  -- What is left (a failed push) goes to the paths below.
  budget_left = budget_left - pushed * SMALL
end
if n > 0 then
  local clean
  payloads, n, clean = read_payloads()
  for i = #ids, n + 1, -1 do ids[i] = nil end
  -- Fast path: no payload known to be missing or over max_payload, no max lateness in the lane.
  if clean ~= false and not held_since and redis.call('EXISTS', maxlate_key) == 0 then
    -- A failed push (a missing payload, not a list, out of memory) changed nothing: the
    -- general path sorts it out. XADDs that stopped part way moved the jobs before the
    -- failed one; the rest stay due for the next call.
    local went = push_jobs(ids, payloads, 1, n, 0)
    if went > 0 then
      for i = n, went + 1, -1 do ids[i] = nil end
      n = went
      moved = moved + n
      next_due = count_buckets()
      hdel_ids(jobs_key, ids, n)
      remember(ids)
      if redis.call('EXISTS', meta_key) == 1 then hdel_ids(meta_key, ids, n) end
      if large_listed() then redis.call('SREM', large_key, unpack(ids)) end
      -- The first n ranks are exactly the ids read above (same script, scores <= now).
      redis.call('ZREMRANGEBYRANK', due_key, '0', n - 1)
      done = true
    end
  end
end

if n > 0 and not done then
  -- What the chunked path counted stays counted if this push fails.
  local before = { buckets = {}, max_lateness = max_lateness, deferred = deferred, deferral_ms = deferral_ms }
  for k = 1, #buckets do before.buckets[k] = buckets[k] end
  local items = redis.call('ZRANGEBYSCORE', due_key, '-inf', now_ms, 'WITHSCORES', 'LIMIT', 0, n)
  local limits = redis.call('HMGET', maxlate_key, unpack(ids))
  local out_ids, out_payloads, dead_ids, dead_reasons = {}, {}, {}, {}
  local function to_dead(id, reason, kind)
    dead_ids[#dead_ids + 1] = id
    dead_reasons[#dead_reasons + 1] = reason
    dead_counts[kind] = dead_counts[kind] + 1
  end
  local bounds = {}
  for k = 1, bound_count do bounds[k] = bound(k) end
  local b = bound_count + 1
  for i = 1, n do
    local id, p = ids[i], payloads[i]
    local due_ms = tonumber(items[2 * i])
    local late = math.max(0, late_now - due_ms)
    local limit = limits[i] and tonumber(limits[i])
    if not p then
      to_dead(id, 'no payload stored for this id', DEAD_MISSING)
    elseif #p > max_payload then
      to_dead(id, 'payload of ' .. #p .. ' bytes exceeds max_payload ' .. max_payload, DEAD_OVERSIZE)
    elseif limit and late > limit then
      to_dead(id, 'expired: ' .. late .. ' ms after its due time, max_lateness ' .. limit .. ' ms', DEAD_EXPIRED)
    else
      out_ids[#out_ids + 1] = id
      out_payloads[#out_payloads + 1] = p
      if held_since then
        deferred = deferred + 1
        deferral_ms = deferral_ms + now_ms - math.max(due_ms, held_since)
      end
      if late > max_lateness then max_lateness = late end
      -- Scores ascend, so the bucket is found by walking from the previous job's.
      while b > 1 and late <= bounds[b - 1] do b = b - 1 end
      while b <= bound_count and late > bounds[b] do b = b + 1 end
      buckets[b] = buckets[b] + 1
    end
  end
  -- INVARIANT: push before removing, all inside this script; a failed push leaves its jobs due.
  if #out_ids > 0 then
    local went, err = push_jobs(out_ids, out_payloads, 1, #out_ids, 0)
    if err and went > 0 then
      -- XADDs that stopped part way: the jobs before the failed one moved, the rest stay due.
      kept = #out_ids - went
      kept_error = list_key .. ': ' .. err
      for j = #out_ids, went + 1, -1 do out_ids[j] = nil end
      moved = moved + went
    elseif err then
      if string.sub(err, 1, 9) == 'WRONGTYPE' then
        local t = redis.call('TYPE', list_key)['ok']
        local wanted = stream and 'a stream' or 'a list'
        for j = 1, #out_ids do
          to_dead(out_ids[j], 'WRONGTYPE: ' .. list_key .. ' holds a ' .. t .. ', not ' .. wanted, DEAD_WRONGTYPE)
        end
      else
        kept = #out_ids
        kept_error = list_key .. ': ' .. err
      end
      buckets = before.buckets
      max_lateness, deferred, deferral_ms = before.max_lateness, before.deferred, before.deferral_ms
      out_ids = {}
    else
      moved = moved + #out_ids
    end
  end
  if #dead_ids > 0 then
    -- A dead job keeps its payload and meta, for replay.
    local zargs, hargs = {}, {}
    for j = 1, #dead_ids do
      zargs[#zargs + 1] = now_ms
      zargs[#zargs + 1] = dead_ids[j]
      hargs[#hargs + 1] = dead_ids[j]
      hargs[#hargs + 1] = dead_reasons[j]
    end
    redis.call('ZADD', dead_key, unpack(zargs))
    redis.call('HSET', reasons_key, unpack(hargs))
  end
  if #out_ids > 0 then
    hdel_ids(jobs_key, out_ids, #out_ids)
    if redis.call('EXISTS', meta_key) == 1 then hdel_ids(meta_key, out_ids, #out_ids) end
  end
  -- The limit applies until the job leaves due, and so does the large set (a dead job's
  -- payload is never read by the move; a replay lists it again).
  for _, gone in ipairs({ out_ids, dead_ids }) do
    remember(gone)
    if #gone > 0 then
      redis.call('HDEL', maxlate_key, unpack(gone))
      if large_listed() then redis.call('SREM', large_key, unpack(gone)) end
    end
  end
  if kept > 0 then
    for _, gone in ipairs({ out_ids, dead_ids }) do
      if #gone > 0 then redis.call('ZREM', due_key, unpack(gone)) end
    end
    n = #out_ids + #dead_ids
  else
    redis.call('ZREMRANGEBYRANK', due_key, 0, n - 1)
  end
end

if not next_due then next_due = redis.call('ZRANGE', due_key, '0', '0', 'WITHSCORES')[2] or '' end
-- A stream route's trimming, once a call that appended (XTRIM with "~" removes whole nodes,
-- at most 10000 entries a call).
if stream and moved > 0 then
  local trim_max_len, trim_max_age = ARGV[flow_at + 7], ARGV[flow_at + 8]
  if trim_max_len and trim_max_len ~= '' then
    redis.call('XTRIM', list_key, 'MAXLEN', '~', trim_max_len)
  end
  if trim_max_age and trim_max_age ~= '' then
    -- On Redis's own clock, not a test clock's: the entries' ids are its milliseconds.
    local min_id = math.floor(clock_us() / 1000) - tonumber(trim_max_age)
    if min_id > 0 then redis.call('XTRIM', list_key, 'MINID', '~', string.format('%d', min_id)) end
  end
end
local held_by = 0
if rate or max_length then
  -- Held: due work is left and the rate or the bound cut this call, or the route was held
  -- already. A hold lasts until the route has caught up (nothing due is left): a call the
  -- limits did not cut (its tokens covered a whole batch, or the list had room) goes on from
  -- the same hold, so the backlog's wait stays deferral and the hold does not flap.
  local due_left = next_due ~= '' and tonumber(next_due) <= now_ms
  if due_left and cut_by > 0 then
    held_by = cut_by
  elseif due_left and held_since then
    held_by = was_held_by == 'max_length' and 2 or 1
  end
  local held = held_by > 0
  local writes = {}
  if rate then
    tokens = tokens - moved
    -- %.17g: read back exactly (tostring keeps 14 digits).
    writes = { 'tokens', string.format('%.17g', tokens), 'at', bucket_at }
  end
  if held and not held_since then
    writes[#writes + 1] = 'held_since'
    writes[#writes + 1] = now_ms
  end
  local by = held and (held_by == 1 and 'rate' or 'max_length')
  if by and by ~= was_held_by then
    writes[#writes + 1] = 'held_by'
    writes[#writes + 1] = by
  end
  if #writes > 0 then redis.call('HSET', flow_key, unpack(writes)) end
  if held_since and not held then redis.call('HDEL', flow_key, 'held_since', 'held_by') end
  if cut_by > 0 and held then
    -- When the route may move again: once the bucket has `want` tokens (a tenth of a
    -- second's worth, at most a batch, and room left in the bucket for a late wake-up; at
    -- least one job), or at the next look at the list.
    local wake = now_ms + hold_recheck
    if cut_by == 1 then wake = bucket_wake(rate, capacity, tokens, bucket_at, batch) end
    next_due = tostring(wake)
  end
end
local out = { pushed + n + per_key_dead, now_us, next_due, max_lateness, kept, kept_error, moved }
for k = 1, 6 do out[#out + 1] = dead_counts[k] end
for k = 1, bound_count + 1 do out[#out + 1] = buckets[k] end
local sched_head = redis.call('ZRANGE', sched_due_key, '0', '0', 'WITHSCORES')
out[#out + 1] = 0
out[#out + 1] = 0
out[#out + 1] = sched_head[2] or ''
out[#out + 1] = 0
out[#out + 1] = 0
out[#out + 1] = 0
out[#out + 1] = ''
out[#out + 1] = ''
out[#out + 1] = deferred
out[#out + 1] = deferral_ms
out[#out + 1] = held_by
return out
