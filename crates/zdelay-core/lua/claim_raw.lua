-- claim_raw: claim due members of a raw source for its two-phase sink, the way the classic
-- recipes lease by score: each claimed member's score is bumped to the lease deadline inside
-- the source itself, so it is not due again until the lease runs out (then it is claimed
-- again: at least once). The source stays one key; what zdelay remembers about a member in
-- flight (its original due, attempts, the score zdelay set) lives in a HASH beside it.
-- Members whose score is implausible for the unit, or larger than max payload, go to dead.
-- KEYS[1] source        ZSET  delayed:events                 member = payload, score = due (ms or s)
-- KEYS[2] dead          ZSET  delayed:events:dead            member = payload, score = ms it died
-- KEYS[3] dead reasons  HASH  delayed:events:dead:reasons    member -> why it died
-- KEYS[4] claims        HASH  delayed:events:claims          sha1(member) -> "<original due ms>
--                                                            <attempts> <score zdelay set>"
-- ARGV[1] batch size; ARGV[2] score unit "ms" | "s"; ARGV[3] lease in ms; ARGV[4] max payload bytes
-- ARGV[5] byte budget of the claimed members; ARGV[6] "now" in ms, "" = Redis TIME (a namespace's
--   test clock passes its time)
-- Scores implausible for the unit: see move_raw (ms sources: [1e9, 1e11); s sources: >= 1e11).
-- Returns: { now_us, lease deadline (as stored: ms, or s with 3 decimals), dead implausible,
--   dead oversize, more, the source's lowest score after the call in ms ("" when it is empty: the
--   next time a member becomes due or a lease runs out, unless a producer writes an earlier one),
--   C, then C quadruples: member, original due ms, attempts before this one,
--   sha1 hex of the member }
-- Re-run safety: yes; a second run finds the claimed members not due and claims the next.
local src, dead_key, reasons_key, claims_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local batch, unit_ms = tonumber(ARGV[1]), ARGV[2] == 'ms'
local lease_ms, max_payload, budget_left = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
-- @include clock
local now_us = clock_us(tonumber(ARGV[6]))
local now_ms = math.floor(now_us / 1000)
local function in_unit(ms)
  if unit_ms then return string.format('%d', ms) end
  return string.format('%.3f', ms / 1000)
end
local function to_ms(score)
  if unit_ms then return math.floor(score) end
  return math.floor(score * 1000)
end

-- Members with their scores (a flat list of pairs), read within budget_left (at least one),
-- in chunks of as many as the rest of the budget holds at max payload each (large members one
-- at a time: a multi-value reply reaches a script by repeated appends); and whether the budget
-- cut them short. With `ranks`, the first `ranks` ranks (members known due), read by rank,
-- O(log N + chunk); otherwise up to `batch` members scored in [min, max].
local function read_members(min, max, ranks)
  local items, count, largest = {}, 0, 0
  local want = ranks or batch
  while count < want do
    local chunk = math.min(want - count, math.max(1, math.floor(budget_left / max_payload)))
    if largest >= 65536 then chunk = 1 end
    local part
    if ranks then
      part = redis.call('ZRANGE', src, count, count + chunk - 1, 'WITHSCORES')
    else
      part = redis.call('ZRANGEBYSCORE', src, min, max, 'WITHSCORES', 'LIMIT', count, chunk)
    end
    for j = 1, #part, 2 do
      if count > 0 and #part[j] > budget_left then
        budget_left = 0
        return items, true
      end
      items[#items + 1] = part[j]
      items[#items + 1] = part[j + 1]
      count = count + 1
      budget_left = budget_left - #part[j]
      if #part[j] > largest then largest = #part[j] end
    end
    if #part < 2 * chunk then break end
    if budget_left <= 0 then return items, count < want end
  end
  return items, false
end

local dead_implausible, dead_oversize = 0, 0
local zdead, hdead = {}, {}
local function to_dead(member, reason)
  zdead[#zdead + 1] = now_ms
  zdead[#zdead + 1] = member
  hdead[#hdead + 1] = member
  hdead[#hdead + 1] = reason
end
local implausible, more = {}, false
do
  local scored
  if unit_ms then
    scored, more = read_members('1e9', '(1e11')
  else
    scored, more = read_members('1e11', '+inf')
  end
  for j = 1, #scored, 2 do implausible[#implausible + 1] = scored[j] end
end
for i = 1, #implausible do
  to_dead(implausible[i], unit_ms and 'score looks like seconds in a millisecond source'
    or 'score looks like milliseconds in a seconds source')
  dead_implausible = dead_implausible + 1
end
if #implausible > 0 then redis.call('ZREM', src, unpack(implausible)) end

-- The implausible ones gone, the members due now are the lowest ranks (unless the budget or the
-- batch stopped their removal short: then this call claims nothing more).
local items = {}
if #implausible >= batch then more = true end
if budget_left > 0 and not more then
  local due = redis.call('ZCOUNT', src, '-inf', in_unit(now_ms))
  if due > 0 then items, more = read_members(nil, nil, math.min(batch, due)) end
end
local out = { now_us, in_unit(now_ms + lease_ms), 0, 0, more and 1 or 0, '', 0 }
local function head_ms()
  local head = redis.call('ZRANGE', src, 0, 0, 'WITHSCORES')
  if #head == 0 then return '' end
  return string.format('%d', to_ms(tonumber(head[2])))
end
local claimed, shas, scores = {}, {}, {}
for i = 1, #items, 2 do
  local member, score = items[i], items[i + 1]
  if #member > max_payload then
    to_dead(member, 'payload of ' .. #member .. ' bytes exceeds max_payload ' .. max_payload)
    dead_oversize = dead_oversize + 1
    redis.call('ZREM', src, member)
  else
    claimed[#claimed + 1] = member
    shas[#shas + 1] = redis.sha1hex(member)
    scores[#scores + 1] = score
  end
end
if #zdead > 0 then
  redis.call('ZADD', dead_key, unpack(zdead))
  redis.call('HSET', reasons_key, unpack(hdead))
end
out[3], out[4] = dead_implausible, dead_oversize
local n = #claimed
out[7] = n
if n == 0 then
  out[6] = head_ms()
  return out
end
local known = redis.call('HMGET', claims_key, unpack(shas))
-- The deadline: past every claimed member's last lease, so no member gets a deadline twice.
local deadline_ms = now_ms + lease_ms
local records = {}
for i = 1, n do
  if known[i] then
    local d, a, s, last = string.match(known[i], '^(%-?%d+) (%d+) (%S+) ?(%S*)$')
    records[i] = { d = d, a = a, s = s }
    last = tonumber(last)
    if last and last >= deadline_ms then deadline_ms = last + 1 end
  end
end
local deadline = in_unit(deadline_ms)
out[2] = deadline
local zargs, hargs = {}, {}
for i = 1, n do
  -- A member still carries the score zdelay last gave it: its lease ran out, or a retry or
  -- release is due; keep its original due and attempts. Any other score: a producer
  -- (re)scheduled it, so this is a new occurrence.
  local due, attempts = to_ms(tonumber(scores[i])), 0
  local r = records[i]
  if r and r.d and tonumber(r.s) == tonumber(scores[i]) then
    due, attempts = tonumber(r.d), tonumber(r.a)
  end
  zargs[#zargs + 1] = deadline
  zargs[#zargs + 1] = claimed[i]
  hargs[#hargs + 1] = shas[i]
  hargs[#hargs + 1] = string.format('%d', due) .. ' ' .. attempts .. ' ' .. deadline .. ' ' .. deadline_ms
  out[#out + 1] = claimed[i]
  out[#out + 1] = string.format('%d', due)
  out[#out + 1] = attempts
  out[#out + 1] = shas[i]
end
redis.call('ZADD', src, 'XX', unpack(zargs))
redis.call('HSET', claims_key, unpack(hargs))
out[6] = head_ms()
return out
