-- move_due: take one batch of due jobs of a spread shard (two-phase routes: brokers, remote
-- Redis) and hand each to its sink: claimed at once for a publisher of the caller that has
-- room (the job leased to it, its envelope in the reply), or queued in the shard's ready set,
-- where that sink's publishers claim them (claim_jobs) at the sink's own pace. A sink that is
-- down or slow holds up nothing else: its jobs wait in its part of the ready set, untouched. A
-- job whose dest resolves to no sink goes to dead (local routes keep their jobs in route
-- lanes: move_lane). Expired leases are first returned to due.
-- KEYS[1] due       ZSET  {zdelay:3}:due        member = id, score = due ms
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs       id -> envelope ("zd1:" frame or JSON object;
--                                               a frame's meta JSON is not read on this path)
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight   member = id, score = lease deadline ms (and
--                                               its claim's fraction of a ms: include lease)
-- KEYS[4] dead      ZSET  {zdelay:3}:dead       member = id, score = ms it died
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons    id -> why it died
-- KEYS[6] scheduled HASH  {zdelay:3}:scheduled  id -> "<scheduled due ms> <token>": the due
--                                               kept once zdelay moved the job's score
-- KEYS[7] ready     ZSET  {zdelay:3}:ready      two-phase jobs waiting for their sink, all scores
--                                               0, member = "<sink>\n<due, 16 digits>\n<id>" (lex
--                                               order = sink, then due, then id)
-- KEYS[8] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[9] max_lateness HASH {zdelay:3}:max_lateness id -> ms after its due beyond which the job
--                                               goes to dead ("expired") instead of out
-- KEYS[10] sched_due ZSET {zdelay:3}:sched_due  schedule id -> its next occurrence (only its
--                                               head is read, for the reply)
-- KEYS[11] lease_seq STRING {zdelay:3}:lease_seq the shard's claim counter: the claims' tokens
-- KEYS[12] claims   HASH  {zdelay:3}:claims     token -> the claim's ids and scheduled dues
--                                               (include lease)
-- KEYS[13] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- KEYS[14] unique  HASH  {zdelay:3}:unique     id -> its unique_for window ms (enqueue_jobs)
-- KEYS[15] windows ZSET  {zdelay:3}:windows    "u:<id>" -> ms until which its id is a duplicate
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] batch size, at most 1000
-- ARGV[3] "now" in ms; "" = Redis TIME (tests pass an explicit value to drive time)
-- ARGV[4] largest payload in bytes (sizes the envelope reads; the publisher checks it)
-- ARGV[5] byte budget: envelope bytes one call takes at most (the walk below and the batch
--   together); a single envelope larger than the budget is still taken, alone. Reads may pass
--   it where envelopes turn from small to large (see read_envelopes)
-- ARGV[6] T, the number of two-phase routes; then T pairs: route name, part name (its sink's,
--   or its own flow part "<sink>:<route>")
-- then S, the number of parts of the ready set (jobs may also name a sink as
--   "<sink>/<target>"); then S names
-- then the walk: a sink name ("" = no walk) and where to resume (a member of ready, exclusive;
--   "" = the start of the sink's part). Up to a batch of that sink's part of ready is read and
--   each job is refiled by the route its dest resolves to now: left alone (the same sink), moved
--   to another sink's part (no attempt counted), or to dead ("route gone: ..." when nothing
--   resolves). It runs before the batch, for sinks that are not configured or are paused (whose
--   jobs no publisher claims, so none is handed over at publish).
-- then the lease of claimed jobs, ms; then, for each of the S parts in order, what the caller's
--   publishers of it take now (absent = "q"): "c" claims up to the given number of jobs and
--   bytes of envelopes (a single larger envelope alone), "w" waits for room: the batch is cut
--   before the part's first job that does not fit, unless a job after it is taken (then it is
--   queued instead, so a part without room holds up no other part; the batch is read in
--   chunks of 64 jobs, and not past a chunk of waiting jobs in a row, or past as many as the
--   largest depth a "w" gives, to look further), "q" queues in the ready set;
--   each followed by the jobs and the bytes ("c"), the depth and 0 ("w": 0 = 64), or 0 0 ("q")
-- Returns (the shape move_raw and move_lane share, with no list pushes and no lateness
-- buckets here: a two-phase job's lateness is its publish's): { taken, now_us, next_due (""
--   when the shard is empty), 0, 0, "",
--   dead per kind (6 integers: malformed, unknown_destination, wrong_type, oversize, missing,
--   expired; the walk's deaths included),
--   0 (the one lateness bucket),
--   leases expired and returned to due,
--   S, then jobs queued in the ready set for each part (S integers, in ARGV order; the walk's
--   refiled jobs included),
--   the next occurrence of the shard's schedules ("" when none),
--   the walk: jobs refiled to another sink, 0, to dead, and where it resumes ("" when the
--   sink's part has been walked to its end),
--   the earliest lease deadline in inflight ("" when nothing is in flight): the caller polls
--   again by then, so an expired lease needs no idle poll to be noticed,
--   the claims: { token ("" when nothing was claimed), lease deadline ms, the part (1-based)
--   whose lack of room cut the batch (0 when none did), S counts of jobs claimed per part, then
--   for each part in order its claimed jobs as triples: id, scheduled due ms (the first due it
--   was scheduled for: stable across retries, releases and lease expiry), envelope } }
-- taken = dead + queued + claimed of the batch; a full batch means "call again now", and so
-- does a next_due that is already due (a batch cut by the byte budget or by a part's room).
-- Re-run safety: yes; a second run finds the taken jobs gone and takes the next ones (the
-- first run's claims stay leased).

local shard_marker = KEYS[13]
-- @include shard_fence
local due_key, jobs_key, inflight_key, dead_key, reasons_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local scheduled_key, ready_key, ready_ids_key = KEYS[6], KEYS[7], KEYS[8]
local max_lateness_key, sched_due_key = KEYS[9], KEYS[10]
local batch = tonumber(ARGV[2])
local now_us
-- @include clock
now_us = clock_us(tonumber(ARGV[3]))
local now_ms = math.floor(now_us / 1000)
local unique_key, windows_key = KEYS[14], KEYS[15]
local claims_key = KEYS[12]
-- @include remember
-- @include lease
local max_payload = tonumber(ARGV[4])
local budget_left = tonumber(ARGV[5])
local budget_full = budget_left

local pos = 6
local remote_routes = {}  -- route name -> sink name
for _ = 1, tonumber(ARGV[pos]) do
  remote_routes[ARGV[pos + 1]] = ARGV[pos + 2]
  pos = pos + 2
end
pos = pos + 1
local remote_sinks = {}   -- sink name -> index in ARGV order
local sink_count = tonumber(ARGV[pos])
local queued, part_names = {}, {}
for s = 1, sink_count do
  pos = pos + 1
  remote_sinks[ARGV[pos]] = s
  part_names[s] = ARGV[pos]
  queued[s] = 0
end
pos = pos + 1
local walk_sink, walk_from = ARGV[pos], ARGV[pos + 1]
local lease_ms = tonumber(ARGV[pos + 2]) or 0
local mode, room_jobs, room_bytes = {}, {}, {}
for s = 1, sink_count do
  local at = pos + 3 * s
  mode[s] = ARGV[at] or 'q'
  room_jobs[s] = tonumber(ARGV[at + 1]) or 0
  room_bytes[s] = tonumber(ARGV[at + 2]) or 0
end

local DEAD_MALFORMED, DEAD_UNKNOWN, DEAD_WRONGTYPE, DEAD_OVERSIZE, DEAD_MISSING, DEAD_EXPIRED = 1, 2, 3, 4, 5, 6
local dead_counts = { 0, 0, 0, 0, 0, 0 }

local B64_INDEX = nil
-- Only JSON envelopes with payload_encoding "base64" reach this; zd1 frames carry raw bytes.
local function base64_decode(s)
  if not B64_INDEX then
    B64_INDEX = {}
    local alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
    for i = 1, 64 do B64_INDEX[string.byte(alphabet, i)] = i - 1 end
  end
  if #s % 4 ~= 0 then return nil end
  local out = {}
  for i = 1, #s, 4 do
    local a, b, c, d = string.byte(s, i, i + 3)
    local va, vb = B64_INDEX[a], B64_INDEX[b]
    if not va or not vb then return nil end
    local v = va * 262144 + vb * 4096
    out[#out + 1] = string.char(math.floor(v / 65536))
    if c ~= 61 then
      local vc = B64_INDEX[c]
      if not vc then return nil end
      v = v + vc * 64
      out[#out + 1] = string.char(math.floor(v / 256) % 256)
      if d ~= 61 then
        local vd = B64_INDEX[d]
        if not vd then return nil end
        out[#out + 1] = string.char((v + vd) % 256)
      end
    elseif d ~= 61 then
      return nil
    end
  end
  return table.concat(out)
end

-- Returns dest, or nil, nil, reason, kind (the payload is the publisher's to read; a JSON
-- envelope's is checked here, so an unreadable one dies before it is queued).
local function parse(v)
  if not v then return nil, nil, 'no envelope stored for this id', DEAD_MISSING end
  -- The meta length must be plain decimal digits and fit inside the record.
  local dest, digits = string.match(v, '^zd1:([^\n]*)\n(%d+)\n')
  if dest then
    local meta_at = 7 + #dest + #digits
    if meta_at + tonumber(digits) > #v + 1 then
      return nil, nil, 'malformed envelope: bad zd1 frame', DEAD_MALFORMED
    end
    return dest, meta_at + tonumber(digits), nil
  end
  if string.sub(v, 1, 4) == 'zd1:' then
    return nil, nil, 'malformed envelope: bad zd1 frame', DEAD_MALFORMED
  end
  if string.sub(v, 1, 1) ~= '{' then
    return nil, nil, 'malformed envelope: neither a zd1 frame nor a JSON object', DEAD_MALFORMED
  end
  local ok, env = pcall(cjson.decode, v)
  if not ok or type(env) ~= 'table' then return nil, nil, 'malformed envelope: invalid JSON', DEAD_MALFORMED end
  if env.v ~= nil and env.v ~= 1 then return nil, nil, 'malformed envelope: unsupported version', DEAD_MALFORMED end
  if type(env.dest) ~= 'string' then return nil, nil, 'malformed envelope: missing dest', DEAD_MALFORMED end
  if type(env.payload) ~= 'string' then return nil, nil, 'malformed envelope: missing payload', DEAD_MALFORMED end
  local enc = env.payload_encoding
  if enc == 'base64' then
    local raw = base64_decode(env.payload)
    if not raw then return nil, nil, 'malformed envelope: invalid base64 payload', DEAD_MALFORMED end
    return env.dest, raw, nil
  elseif enc == nil or enc == cjson.null or enc == 'utf8' then
    return env.dest, env.payload, nil
  end
  return nil, nil, 'malformed envelope: unknown payload_encoding', DEAD_MALFORMED
end

-- The two-phase sink a dest resolves to now (a route's, or the sink a "<sink>/<target>"
-- names), or nil.
local function resolve(dest)
  local sink = remote_routes[dest]
  if sink then return sink end
  local slash = string.find(dest, '/', 1, true)
  if slash and remote_sinks[string.sub(dest, 1, slash - 1)] then
    return string.sub(dest, 1, slash - 1)
  end
  return nil
end

-- The envelopes of ids[1..], read within budget_left: in chunks of as many ids as the rest
-- of the budget holds at max_payload each, and once every envelope the call read is small
-- (at most max_payload / SMALL_SHARE) at that size: with the defaults 64 ids a command
-- instead of 4 (an envelope's size is not known before it is read; HSTRLEN per id would cost
-- more than the read), so a chunk may read past the budget only where envelopes turn from
-- small to large. Once a large envelope was seen, one at a time: Redis hands a script a
-- multi-value reply by appending the values one after the other, copying what came before
-- each time. Returns them and how many ids they cover, a prefix of ids: at least one when
-- at_least_one (one envelope larger than the whole budget moves alone).
local LARGE = 65536
local SMALL_SHARE = 16
local small = max_payload / SMALL_SHARE
local largest_read = nil  -- the largest envelope this call read so far
local function read_envelopes(ids, at_least_one)
  local envelopes, n = {}, 0
  while n < #ids do
    local each = (largest_read and largest_read <= small) and small or max_payload
    local chunk = math.min(#ids - n, math.max(1, math.floor(budget_left / each)))
    if largest_read and largest_read >= LARGE then chunk = 1 end
    local part = redis.call('HMGET', jobs_key, unpack(ids, n + 1, n + chunk))
    for j = 1, chunk do
      local size = part[j] and #part[j] or 0
      if size > budget_left and (n > 0 or not at_least_one) then
        budget_left = 0
        return envelopes, n
      end
      n = n + 1
      envelopes[n] = part[j]
      budget_left = budget_left - size
      if not largest_read or size > largest_read then largest_read = size end
    end
    if budget_left <= 0 then break end
  end
  return envelopes, n
end

-- The walk (see the header): refile one sink's waiting jobs by their route now.
local refiled_sink, refiled_dead, walk_next = 0, 0, ''
if walk_sink ~= '' then
  local lo = walk_from ~= '' and ('(' .. walk_from) or ('[' .. walk_sink .. '\n')
  local members = redis.call('ZRANGEBYLEX', ready_key, lo, '(' .. walk_sink .. '\11', 'LIMIT', 0, batch)
  local ids, dues = {}, {}
  local prefix = #walk_sink + 2
  for i = 1, #members do
    local cut = string.find(members[i], '\n', prefix, true)
    dues[i] = string.sub(members[i], prefix, (cut or prefix) - 1)
    ids[i] = cut and string.sub(members[i], cut + 1) or ''
  end
  local envelopes, n = read_envelopes(ids, true)
  if n < #members or #members >= batch then walk_next = members[n] or '' end
  local gone, zready, hready, zdead, hdead = {}, {}, {}, {}, {}
  for i = 1, n do
    local dest, _, reason, kind = parse(envelopes[i])
    local sink = dest and resolve(dest)
    if sink ~= walk_sink then
      gone[#gone + 1] = members[i]
      local due = tonumber(dues[i]) or now_ms
      if sink then
        local member = sink .. '\n' .. string.format('%016d', due) .. '\n' .. ids[i]
        zready[#zready + 1] = 0
        zready[#zready + 1] = member
        hready[#hready + 1] = ids[i]
        hready[#hready + 1] = member
        queued[remote_sinks[sink]] = queued[remote_sinks[sink]] + 1
        refiled_sink = refiled_sink + 1
      else
        if dest then
          reason = 'route gone: ' .. dest .. ' resolves to no configured route or sink (it waited for sink ' .. walk_sink .. ')'
          kind = DEAD_UNKNOWN
        end
        zdead[#zdead + 1] = now_ms
        zdead[#zdead + 1] = ids[i]
        hdead[#hdead + 1] = ids[i]
        hdead[#hdead + 1] = reason
        dead_counts[kind] = dead_counts[kind] + 1
        refiled_dead = refiled_dead + 1
      end
    end
  end
  if #gone > 0 then redis.call('ZREM', ready_key, unpack(gone)) end
  local left = {}  -- ids whose ready entry goes (to dead); a refiled one gets a new one
  for j = 2, #zdead, 2 do left[#left + 1] = zdead[j] end
  if #left > 0 then redis.call('HDEL', ready_ids_key, unpack(left)) end
  if #zready > 0 then
    redis.call('ZADD', ready_key, unpack(zready))
    redis.call('HSET', ready_ids_key, unpack(hready))
  end
  if #zdead > 0 then
    local dead_ids = {}
    for j = 2, #zdead, 2 do dead_ids[#dead_ids + 1] = zdead[j] end
    redis.call('ZADD', dead_key, unpack(zdead))
    redis.call('HSET', reasons_key, unpack(hdead))
    redis.call('HDEL', scheduled_key, unpack(dead_ids))
    remember(dead_ids)
  end
end

-- Leases that ran out (a poller died or stalled mid-publish) make their jobs due again now.
-- Each keeps the due it was scheduled for (include lease).
local lapsed = redis.call('ZRANGEBYSCORE', inflight_key, '-inf', now_ms, 'WITHSCORES', 'LIMIT', 0, batch)
local expired = {}
if #lapsed > 0 then
  local scores, zargs, tokens = {}, {}, {}
  for i = 1, #lapsed / 2 do
    expired[i] = lapsed[2 * i - 1]
    scores[i] = lapsed[2 * i]
    tokens[score_token(scores[i])] = true
    zargs[#zargs + 1] = now_ms
    zargs[#zargs + 1] = expired[i]
  end
  keep_dues(expired, scores)
  redis.call('ZREM', inflight_key, unpack(expired))
  redis.call('ZADD', due_key, unpack(zargs))
  drop_finished_claims(tokens)
end

local ready_members, ready_ids = {}, {}  -- two-phase jobs queued for their sink
-- Due jobs are read in chunks, and no further once a chunk's worth of jobs in a row waits: a
-- part without room at the head costs a short read, not the whole batch's.
local CHUNK = 64
local lookahead = CHUNK
for s = 1, sink_count do
  if mode[s] == 'w' and room_jobs[s] > lookahead then lookahead = math.min(room_jobs[s], batch) end
end
local items = redis.call('ZRANGEBYSCORE', due_key, '-inf', now_ms, 'WITHSCORES', 'LIMIT', 0, math.min(batch, CHUNK))
local n = #items / 2
local next_due = ''
-- Jobs with a max lateness are checked one by one.
local bounded = n > 0 and redis.call('EXISTS', max_lateness_key) == 1
-- Numbers given to Redis as text once, not once per job.
local token, deadline, cut_by = '', string.format('%d', now_ms + lease_ms), 0
local claimed = {}  -- per part: the indexes of its claimed jobs in the batch
for s = 1, sink_count do claimed[s] = {} end
local envelopes, claim_ids, claim_dues = nil, {}, {}
if n > 0 then
  local ids = {}
  for i = 1, n do ids[i] = items[2 * i - 1] end
  local listed_all = n < math.min(batch, CHUNK)
  -- Each job's fate: 'd' dead (with why), 'q' queued, 'c' claimed, 'w' waits (its part has no
  -- room); the batch ends after the last job taken, and a waiting job before it is queued.
  local fate, part, why, kinds = {}, {}, {}, {}
  local used_bytes = {}
  for s = 1, sink_count do used_bytes[s] = 0 end
  local last_taken = 0
  local read = 0
  envelopes = {}
  while read - last_taken < lookahead do
    if read == n then
      if listed_all or n >= batch then break end
      local more = redis.call('ZRANGEBYSCORE', due_key, '-inf', now_ms, 'WITHSCORES', 'LIMIT', n, math.min(batch - n, CHUNK))
      for j = 1, #more do items[2 * n + j] = more[j] end
      local got = #more / 2
      for j = 1, got do ids[n + j] = more[2 * j - 1] end
      listed_all = got < math.min(batch - n, CHUNK)
      n = n + got
      if got == 0 then break end
    end
    -- The batch is the prefix of ids whose envelopes fit the budget (at least one, unless
    -- the walk spent it: the walk and the batch share one call's budget).
    local part_ids = { unpack(ids, read + 1, math.min(n, read + CHUNK)) }
    local got, k = read_envelopes(part_ids, read == 0 and budget_left == budget_full)
    local limits = (bounded and k > 0) and redis.call('HMGET', max_lateness_key, unpack(part_ids, 1, k)) or {}
    for j = 1, k do
      local i = read + j
      envelopes[i] = got[j]
      local dest, _, reason, kind = parse(got[j])
      local limit = limits[j] and tonumber(limits[j])
      if dest and limit then
        local late = now_ms - tonumber(items[2 * i])
        if late > limit then
          dest, reason, kind = nil, 'expired: ' .. late .. ' ms after its due time, max_lateness ' .. limit .. ' ms', DEAD_EXPIRED
        end
      end
      local sink = dest and resolve(dest)
      if sink then
        local s = remote_sinks[sink]
        part[i] = s
        local size = #got[j]
        local mine = claimed[s]
        local count = #mine
        if mode[s] == 'c' and count < room_jobs[s] and (count == 0 or used_bytes[s] + size <= room_bytes[s]) then
          fate[i] = 'c'
          mine[count + 1] = i
          used_bytes[s] = used_bytes[s] + size
        elseif mode[s] == 'c' or mode[s] == 'w' then
          fate[i] = 'w'
        else
          fate[i] = 'q'
        end
      else
        fate[i] = 'd'
        if dest then
          why[i], kinds[i] = 'unknown destination: ' .. dest, DEAD_UNKNOWN
        else
          why[i], kinds[i] = reason, kind
        end
      end
      if fate[i] ~= 'w' then last_taken = i end
    end
    read = read + k
    if k < #part_ids then break end
  end
  n = read
  if last_taken < n then cut_by = part[last_taken + 1] end
  n = last_taken
  local dead_ids, dead_reasons = {}, {}
  for i = 1, n do
    local id = items[2 * i - 1]
    if fate[i] == 'd' then
      dead_ids[#dead_ids + 1] = id
      dead_reasons[#dead_reasons + 1] = why[i]
      dead_counts[kinds[i]] = dead_counts[kinds[i]] + 1
    elseif fate[i] ~= 'c' then
      -- Lex order in ready: sink, then due (fixed width), then id.
      local member = part_names[part[i]] .. '\n' .. string.format('%016d', math.floor(tonumber(items[2 * i]))) .. '\n' .. id
      ready_members[#ready_members + 1] = member
      ready_ids[#ready_ids + 1] = id
      queued[part[i]] = queued[part[i]] + 1
    end
  end
  if #dead_ids > 0 then
    local zargs, hargs = {}, {}
    for j = 1, #dead_ids do
      zargs[#zargs + 1] = now_ms
      zargs[#zargs + 1] = dead_ids[j]
      hargs[#hargs + 1] = dead_ids[j]
      hargs[#hargs + 1] = dead_reasons[j]
    end
    redis.call('ZADD', dead_key, unpack(zargs))
    redis.call('HSET', reasons_key, unpack(hargs))
    remember(dead_ids)
  end
  if #ready_members > 0 then
    local zargs, hargs = {}, {}
    for j = 1, #ready_members do
      zargs[#zargs + 1] = 0
      zargs[#zargs + 1] = ready_members[j]
      hargs[#hargs + 1] = ready_ids[j]
      hargs[#hargs + 1] = ready_members[j]
    end
    redis.call('ZADD', ready_key, unpack(zargs))
    redis.call('HSET', ready_ids_key, unpack(hargs))
  end
  -- Claimed jobs are leased as claim_jobs leases them (include lease).
  for s = 1, sink_count do
    for _, i in ipairs(claimed[s]) do
      claim_ids[#claim_ids + 1] = items[2 * i - 1]
      -- A whole number of ms comes as its digits; anything else is written as one.
      local due = items[2 * i]
      if string.find(due, '.', 1, true) or string.find(due, 'e', 1, true) then
        due = string.format('%d', math.floor(tonumber(due)))
      end
      claim_dues[#claim_dues + 1] = due
    end
  end
  if #claim_ids > 0 then token = lease(claim_ids, claim_dues, deadline, KEYS[11]) end
  if bounded then
    -- The limit applies until the job leaves due (a two-phase job's is checked at publish).
    for _, done in ipairs({ dead_ids, ready_ids, claim_ids }) do
      if #done > 0 then redis.call('HDEL', max_lateness_key, unpack(done)) end
    end
  end
  if #dead_ids > 0 and redis.call('HLEN', scheduled_key) > 0 then
    -- A job released, retried or handed back earlier that dies here (config changed): its
    -- scheduled due is of no use any more.
    redis.call('HDEL', scheduled_key, unpack(dead_ids))
  end
  -- The first n ranks are exactly the ids read above (same script, scores <= now).
  if n > 0 then redis.call('ZREMRANGEBYRANK', due_key, 0, n - 1) end
end
local head = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
if head[2] then next_due = head[2] end

local out = { n, now_us, next_due, 0, 0, '' }
for k = 1, 6 do out[#out + 1] = dead_counts[k] end
out[#out + 1] = 0
out[#out + 1] = #expired
out[#out + 1] = sink_count
for s = 1, sink_count do out[#out + 1] = queued[s] end
local sched_head = redis.call('ZRANGE', sched_due_key, 0, 0, 'WITHSCORES')
out[#out + 1] = sched_head[2] or ''
out[#out + 1] = refiled_sink
out[#out + 1] = 0
out[#out + 1] = refiled_dead
out[#out + 1] = walk_next
local lease_head = redis.call('ZRANGE', inflight_key, 0, 0, 'WITHSCORES')
out[#out + 1] = lease_head[2] or ''
if not lease_head[2] and redis.call('EXISTS', claims_key) == 1 then
  -- Nothing in flight, so no claim's record is needed: one whose last job left some other
  -- way (an older release's lease expiry or settle) is dropped here.
  redis.call('DEL', claims_key)
end
local claims = { token, deadline, cut_by }
for s = 1, sink_count do claims[#claims + 1] = #claimed[s] end
local j = 0
for s = 1, sink_count do
  for _, i in ipairs(claimed[s]) do
    j = j + 1
    claims[#claims + 1] = claim_ids[j]
    claims[#claims + 1] = claim_dues[j]
    claims[#claims + 1] = envelopes[i]
  end
end
out[#out + 1] = claims
return out
