-- move_raw: move one batch of due members of a raw source ZSET onto its route's Redis list, as-is.
-- Producers just ZADD <key> <due> <payload>; the member is the payload, the score the due time.
-- KEYS[1] source        ZSET  delayed:emails            member = payload, score = due (ms or s)
-- KEYS[2] list          LIST  queue:emails              the route's list (or its -delayed lane)
-- KEYS[3] dead          ZSET  delayed:emails:dead       member = payload, score = ms it died
-- KEYS[4] dead reasons  HASH  delayed:emails:dead:reasons  member -> why it died
-- ARGV[1] batch size, at most 1000
-- ARGV[2] "now" in ms; "" = Redis TIME
-- ARGV[3] score unit: "ms" or "s"
-- ARGV[4] largest payload in bytes
-- ARGV[5] "LPUSH" | "RPUSH"
-- ARGV[6] byte budget: member bytes one call moves at most (members are read in chunks of as
--   many as the rest of the budget holds at the largest payload each, or, once every member
--   read is at most 1/16 of it, at that size: a chunk may then read up to 16 times the rest
--   of the budget); a single member larger than the budget is still taken, alone
-- ARGV[7] B, the number of lateness bucket bounds; then B bounds in ms, ascending
-- Scores implausible for the unit go to dead instead of being delivered at the wrong time:
-- in an "ms" source a score in [1e9, 1e11) is a seconds timestamp (2001..5138 read as seconds);
-- in an "s" source a score >= 1e11 is a millisecond timestamp. Scores below 1e9 in "ms"
-- sources (such as 0) mean "due now".
-- Returns: { taken, now_us, next_due ("" when empty; in the source's unit; already due when the
--   budget cut the batch), max_lateness_ms,
--   kept (left due because the push failed), first push error ("" if none),
--   moved, dead per kind (6 integers: implausible_score, wrong_type, oversize, 0, 0, 0),
--   jobs per lateness bucket (B + 1 integers) }
-- Re-run safety: yes.
local src, list, dead_key, reasons_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local batch = tonumber(ARGV[1])
local now_us
-- @include clock
now_us = clock_us(tonumber(ARGV[2]))
local now_ms = math.floor(now_us / 1000)
local unit_ms = ARGV[3] == 'ms'
local max_payload = tonumber(ARGV[4])
local cmd = ARGV[5]
local budget_left = tonumber(ARGV[6])
local bound_count = tonumber(ARGV[7])
local bounds, buckets = {}, {}
for b = 1, bound_count do bounds[b] = tonumber(ARGV[7 + b]) end
for b = 1, bound_count + 1 do buckets[b] = 0 end
local max_lateness = 0
local DEAD_IMPLAUSIBLE, DEAD_WRONGTYPE, DEAD_OVERSIZE = 1, 2, 3
local dead_counts = { 0, 0, 0, 0, 0, 0 }
local zdead, hdead = {}, {}
local function to_dead(member, reason, kind)
  zdead[#zdead + 1] = now_ms
  zdead[#zdead + 1] = member
  hdead[#hdead + 1] = member
  hdead[#hdead + 1] = reason
  dead_counts[kind] = dead_counts[kind] + 1
end

-- Members read within budget_left (at least one), in chunks of as many as the rest of the
-- budget holds at max_payload each (large members one at a time: a multi-value reply reaches
-- a script by repeated appends). Once every member read is small (at most max_payload /
-- SMALL_SHARE), chunks hold as many as the budget holds at that size: with the defaults, 64
-- members a command instead of 4, so a chunk may read past the budget only where a source
-- turns from small members to large ones. With `ranks`, the first `ranks` ranks (members
-- known due), read by rank, O(log N + chunk); otherwise up to `batch` members scored in
-- [min, max].
local SMALL_SHARE = 16
local small = max_payload / SMALL_SHARE
-- Returns the chunks as read (lists of members, in rank order; kept apart so that nothing is
-- copied per member), how many members they hold, and the largest one's size.
local function read_members(min, max, ranks)
  local chunks, n, largest = {}, 0, 0
  local want = ranks or batch
  while n < want do
    local each = max_payload
    if n > 0 and largest <= small then each = small end
    local chunk = math.min(want - n, math.max(1, math.floor(budget_left / each)))
    if largest >= 65536 then chunk = 1 end
    local part
    if ranks then
      part = redis.call('ZRANGE', src, n, n + chunk - 1)
    else
      part = redis.call('ZRANGEBYSCORE', src, min, max, 'LIMIT', n, chunk)
    end
    local got = #part
    if got == 0 then break end
    local bytes, part_largest = 0, 0
    for j = 1, got do
      local size = #part[j]
      bytes = bytes + size
      if size > part_largest then part_largest = size end
    end
    if bytes <= budget_left then
      -- The common case: the chunk is within the budget, taken as it came.
      chunks[#chunks + 1] = part
      n = n + got
      budget_left = budget_left - bytes
      if part_largest > largest then largest = part_largest end
    else
      -- The budget ends inside this chunk: members up to it.
      local taken = {}
      for j = 1, got do
        local size = #part[j]
        if size > budget_left and (n > 0 or j > 1) then break end
        taken[j] = part[j]
        budget_left = budget_left - size
        if size > largest then largest = size end
      end
      if #taken > 0 then
        chunks[#chunks + 1] = taken
        n = n + #taken
      end
      budget_left = 0
    end
    if got < chunk or budget_left <= 0 then break end
  end
  return chunks, n, largest
end

-- The members of `chunks` in one list (the paths that look at members one by one).
local function flatten(chunks)
  if #chunks == 1 then return chunks[1] end
  local all = {}
  for c = 1, #chunks do
    local part = chunks[c]
    for j = 1, #part do all[#all + 1] = part[j] end
  end
  return all
end

local implausible
if unit_ms then
  implausible = flatten(read_members('1e9', '(1e11'))
else
  implausible = flatten(read_members('1e11', '+inf'))
end
for i = 1, #implausible do
  to_dead(implausible[i], unit_ms and 'score looks like seconds in a millisecond source'
    or 'score looks like milliseconds in a seconds source', DEAD_IMPLAUSIBLE)
end
if #implausible > 0 then redis.call('ZREM', src, unpack(implausible)) end

-- Moved members' lateness per bucket, counted without reading every score: the batch is the n
-- lowest scores, so its members later than bound L are those scored below now - L, which
-- ZCOUNT(-inf, (now - L)) counts in O(log N). Only bounds between the batch's least and
-- greatest lateness need a ZCOUNT. Call before the batch leaves the ZSET.
local function late_of(score)
  local late = now_ms - (unit_ms and score or math.floor(score * 1000))
  if late < 0 then late = 0 end
  return late
end
local function count_buckets(first, last, k)
  local late_max = late_of(tonumber(redis.call('ZSCORE', src, first)))
  local late_min = late_of(tonumber(redis.call('ZSCORE', src, last)))
  max_lateness = late_max
  local above_prev = k -- members later than bounds[b - 1]
  for b = 1, bound_count do
    local bound, above = bounds[b], 0
    if bound < late_min then
      above = k
    elseif bound < late_max then
      local cut = unit_ms and string.format('%d', now_ms - bound) or string.format('%.3f', (now_ms - bound) / 1000)
      above = redis.call('ZCOUNT', src, '-inf', '(' .. cut)
      if above > k then above = k end
    end
    buckets[b] = above_prev - above
    above_prev = above
  end
  buckets[bound_count + 1] = above_prev
end

local max_score = unit_ms and now_ms or (now_ms / 1000)
local chunks, n, largest = {}, 0, 0
-- The implausible ones gone, the members due now are the lowest ranks (unless the budget or the
-- batch stopped their removal short: then this call moves nothing more).
if budget_left > 0 and #implausible < batch then
  local due = redis.call('ZCOUNT', src, '-inf', string.format('%.3f', max_score))
  if due > 0 then chunks, n, largest = read_members(nil, nil, math.min(batch, due)) end
end
local moved, kept, kept_error = 0, 0, ''
if n > 0 then
  local list_type = redis.call('TYPE', list)['ok']
  local list_ok = list_type == 'list' or list_type == 'none'
  -- INVARIANT: push before removing, all inside this script.
  if list_ok and largest <= max_payload then
    -- Fast path: the list is usable and no member is oversize, so each chunk is pushed as
    -- read (in rank order, which one push of them all would give too).
    local last = chunks[#chunks]
    count_buckets(chunks[1][1], last[#last], n)
    for c = 1, #chunks do
      local res = redis.pcall(cmd, list, unpack(chunks[c]))
      if type(res) == 'table' and res.err then
        kept, kept_error = n - moved, list .. ': ' .. res.err
        break
      end
      moved = moved + #chunks[c]
    end
    -- The push failed: the members it did not take stay due.
    n = moved
    if moved > 0 then redis.call('ZREMRANGEBYRANK', src, 0, moved - 1) end
  else
    local items, payloads = flatten(chunks), {}
    for i = 1, n do
      local member = items[i]
      if not list_ok then
        to_dead(member, 'WRONGTYPE: ' .. list .. ' holds a ' .. list_type .. ', not a list', DEAD_WRONGTYPE)
      elseif #member > max_payload then
        to_dead(member, 'payload of ' .. #member .. ' bytes exceeds max_payload ' .. max_payload, DEAD_OVERSIZE)
      else
        payloads[#payloads + 1] = member
        local score = tonumber(redis.call('ZSCORE', src, member))
        local late = now_ms - (unit_ms and score or math.floor(score * 1000))
        if late < 0 then late = 0 end
        if late > max_lateness then max_lateness = late end
        local b = 1
        while b <= bound_count and late > bounds[b] do b = b + 1 end
        buckets[b] = buckets[b] + 1
      end
    end
    if #payloads > 0 then
      local res = redis.pcall(cmd, list, unpack(payloads))
      if type(res) == 'table' and res.err then
        kept, kept_error = #payloads, list .. ': ' .. res.err
      else
        moved = #payloads
      end
    end
    if kept > 0 then
      -- The push failed: only the dead members leave; the rest stay due.
      n = n - kept
    else
      redis.call('ZREMRANGEBYRANK', src, 0, n - 1)
    end
  end
end
if #zdead > 0 then
  redis.call('ZADD', dead_key, unpack(zdead))
  redis.call('HSET', reasons_key, unpack(hdead))
  if kept > 0 then
    local members = {}
    for j = 2, #zdead, 2 do members[#members + 1] = zdead[j] end
    redis.call('ZREM', src, unpack(members))
  end
end
local head = redis.call('ZRANGE', src, 0, 0, 'WITHSCORES')
local next_due = head[2] or ''

local out = { n + #implausible, now_us, next_due, max_lateness, kept, kept_error, moved }
for k = 1, 6 do out[#out + 1] = dead_counts[k] end
for b = 1, bound_count + 1 do out[#out + 1] = buckets[b] end
return out
