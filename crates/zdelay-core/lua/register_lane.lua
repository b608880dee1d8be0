-- register_lane: give a local route its lane in the namespace's lane registry (storage layout 2),
-- or confirm the one it has. Lane numbers are given out once and never reused.
-- KEYS[1] registry HASH zdelay:lanes  "r:<route>" -> "<lane> local <slot> <LPUSH|RPUSH|XADD> <list key>",
--                                      "#<lane>" -> "<route> <slot> live|retired",
--                                      "next" -> the last lane number given out
-- ARGV[1] route name; ARGV[2] the slot of its list; ARGV[3] "LPUSH" | "RPUSH" | "XADD"; ARGV[4] the list (or stream) key
-- ARGV[5] optional: the successor's number (base 36) when the list moved to another slot, taken
--   from "next" by the caller before it retired the old lane (retire_lane) naming it
-- ARGV[6] optional: "missing" for a producer, which registers a route the registry lacks and
--   never changes one: a route registered otherwise (another list or push, or as two-phase,
--   "t:<route>") is answered "differs" with nothing written
-- Returns: { lane number (base 36), what happened: "new" (first registration), "same" (nothing
--   changed), "updated" (same slot, another list key or push: the caller rewrites the marker),
--   "moved" (another slot: a new lane; the old one is retired), the old lane's number ("" unless
--   moved) }, or with "missing": { lane number or "", "differs", the registered entry (for a
--   two-phase route: "sink <sink>") }
-- Re-run safety: yes; a second run finds its own registration ("same").

local registry = KEYS[1]
local route, slot, push, list = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local function base36(n)
  local digits = '0123456789abcdefghijklmnopqrstuvwxyz'
  local out = ''
  repeat
    local d = n % 36
    out = string.sub(digits, d + 1, d + 1) .. out
    n = math.floor(n / 36)
  until n == 0
  return out
end

local entry_of = function(lane) return lane .. ' local ' .. slot .. ' ' .. push .. ' ' .. list end
local old = redis.call('HGET', registry, 'r:' .. route)
if ARGV[6] == 'missing' then
  local sink = redis.call('HGET', registry, 't:' .. route)
  if sink then return { '', 'differs', 'sink ' .. sink } end
  if old then
    local lane = string.match(old, '^(%w+) ') or ''
    if old == entry_of(lane) then return { lane, 'same', '' } end
    return { lane, 'differs', old }
  end
end
if old then
  local lane, old_slot = string.match(old, '^(%w+) local (%d+) ')
  if lane and old_slot == slot then
    local entry = entry_of(lane)
    if entry == old then return { lane, 'same', '' } end
    redis.call('HSET', registry, 'r:' .. route, entry)
    return { lane, 'updated', '' }
  end
  local new = ARGV[5]
  if not new or new == '' then new = base36(redis.call('HINCRBY', registry, 'next', 1)) end
  redis.call('HSET', registry, 'r:' .. route, entry_of(new), '#' .. new, route .. ' ' .. slot .. ' live')
  if lane then
    redis.call('HSET', registry, '#' .. lane, route .. ' ' .. old_slot .. ' retired')
  end
  return { new, 'moved', lane or '' }
end
local new = base36(redis.call('HINCRBY', registry, 'next', 1))
redis.call('HSET', registry, 'r:' .. route, entry_of(new), '#' .. new, route .. ' ' .. slot .. ' live')
return { new, 'new', '' }
