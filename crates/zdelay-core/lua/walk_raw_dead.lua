-- walk_raw_dead: list, replay or purge the dead members of a raw source whose dead score is in a
-- window, walking the dead ZSET by rank one member at a time, within a byte budget per call, so
-- no call reads (or answers) more than the budget plus one member. A member is known by its
-- hash: the first 16 hex digits of SHA-1(member) for a member of at most 1 MiB (the tail of its
-- message id), of SHA-1("<size>:" .. its first 64 KiB .. its last 64 KiB) above, so a huge
-- member costs its copy, not a hash of all of it.
-- KEYS[1] source        ZSET  delayed:emails         (replay puts members back here)
-- KEYS[2] dead          ZSET  delayed:emails:dead    member -> ms it died
-- KEYS[3] dead reasons  HASH  delayed:emails:dead:reasons
-- ARGV[1] mode: "list", "replay" or "purge"
-- ARGV[2] window min, ARGV[3] window max: dead scores as ZRANGEBYSCORE takes them ("(" for
--   exclusive, -inf, +inf)
-- ARGV[4] offset: members at the start of the window to pass over (left by earlier calls)
-- ARGV[5] at most this many members taken (listed, replayed or purged)
-- ARGV[6] at most this many members walked
-- ARGV[7] byte budget: no member is read once the members read add up to it (one always is)
-- ARGV[8] reason filter: only members whose reason contains it (ASCII case ignored); "" = any
-- ARGV[9] wanted hashes, separated by spaces; "" = any
-- ARGV[10] list: preview bytes per member; replay: the score members get in the source
-- Returns: { walked, taken, next offset (-1 once the window's end was reached), then, in list
--   mode, per member taken: dead score, hash, size, first ARGV[10] bytes, reason (its first
--   4096 bytes) }
-- Re-run safety: yes; list reads only, and replay and purge take a member only while it is
-- dead with a score in the window, so a second run skips what the first took.
local source_key, dead_key, reasons_key = KEYS[1], KEYS[2], KEYS[3]
local mode, min, max = ARGV[1], ARGV[2], ARGV[3]
local offset, count, walk_max, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local reason_part = string.lower(ARGV[8])
local extra = ARGV[10]
local HASH_WHOLE = 1048576
local EDGE = 65536
local REASON_MAX = 4096

local wanted = nil
if ARGV[9] ~= '' then
  wanted = {}
  for h in string.gmatch(ARGV[9], '%S+') do wanted[h] = true end
end

-- Ranks: the window holds ranks [first, last).
local first = 0
if min ~= '-inf' then
  if string.sub(min, 1, 1) == '(' then
    first = redis.call('ZCOUNT', dead_key, '-inf', string.sub(min, 2))
  else
    first = redis.call('ZCOUNT', dead_key, '-inf', '(' .. min)
  end
end
local last = redis.call('ZCOUNT', dead_key, '-inf', max)

local function hash(m)
  if #m <= HASH_WHOLE then
    return string.sub(redis.sha1hex(m), 1, 16)
  end
  return string.sub(redis.sha1hex(#m .. ':' .. string.sub(m, 1, EDGE) .. string.sub(m, -EDGE)), 1, 16)
end

local out = {}
local rank = first + offset
local walked, taken, spent = 0, 0, 0
while rank < last and walked < walk_max and taken < count and (walked == 0 or spent < budget) do
  local entry = redis.call('ZRANGE', dead_key, rank, rank, 'WITHSCORES')
  local m, score = entry[1], entry[2]
  walked = walked + 1
  spent = spent + #m
  local h = nil
  if wanted or mode == 'list' then h = hash(m) end
  local reason = nil
  if reason_part ~= '' or mode == 'list' then
    reason = redis.call('HGET', reasons_key, m) or ''
  end
  local take = (not wanted or wanted[h])
    and (reason_part == '' or string.find(string.lower(reason), reason_part, 1, true) ~= nil)
  if take then
    taken = taken + 1
  end
  if take and mode ~= 'list' then
    redis.call('ZREM', dead_key, m)
    redis.call('HDEL', reasons_key, m)
    if mode == 'replay' then
      redis.call('ZADD', source_key, extra, m)
    end
    -- The members after it moved up one rank.
    last = last - 1
  else
    if take then
      out[#out + 1] = score
      out[#out + 1] = h
      out[#out + 1] = #m
      out[#out + 1] = string.sub(m, 1, tonumber(extra))
      out[#out + 1] = string.sub(reason, 1, REASON_MAX)
    end
    rank = rank + 1
  end
end
local next_offset = -1
if rank < last then next_offset = rank - first end
local reply = { walked, taken, next_offset }
for i = 1, #out do reply[#reply + 1] = out[i] end
return reply
