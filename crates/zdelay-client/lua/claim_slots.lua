-- claim_slots: an instance's heartbeat: it registers (or stays registered), and takes or
-- renews its fair share of the poller slots, spread evenly over the live instances. Every
-- target (an envelope shard or a raw source) has per_shard slots, "<target>#<k>"; an instance
-- holds at most ceil(slots / live instances) of them and never two slots of one target, so
-- the two slots of a target land on two instances (with one instance the second stays free).
-- A slot whose holder stopped renewing (lease expired, or instance gone) is free.
-- KEYS[1] instances HASH  {zdelay}:instances  instance id -> "<registration expiry ms> <last heartbeat ms>"
-- KEYS[2] slots     HASH  {zdelay}:slots      "<target>#<k>" -> "<instance id> <lease expiry ms>"
-- ARGV[1] this instance's id; ARGV[2] registration lifetime ms; ARGV[3] slot lease ms
-- ARGV[4] slots per target (1 or 2); ARGV[5..] the targets, in a fixed order
-- Returns: { live instances, then the targets of the slots this instance holds now }
-- Re-run safety: yes; a second run renews what the first took.
local instances_key, slots_key = KEYS[1], KEYS[2]
local me, ttl, lease, per = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', instances_key, me, string.format('%d %d', now + ttl, now))
local live = {}
local live_count = 0
local registered = redis.call('HGETALL', instances_key)
for i = 1, #registered, 2 do
  local expiry = tonumber(string.match(registered[i + 1], '^(%d+)'))
  if expiry and expiry > now then
    live[registered[i]] = true
    live_count = live_count + 1
  else
    redis.call('HDEL', instances_key, registered[i])
  end
end

local slots, target_of = {}, {}
for i = 5, #ARGV do
  for k = 0, per - 1 do
    local slot = ARGV[i] .. '#' .. k
    slots[#slots + 1] = slot
    target_of[slot] = ARGV[i]
  end
end
local fair = math.ceil(#slots / live_count)

local holder = {}
local flat = redis.call('HGETALL', slots_key)
for i = 1, #flat, 2 do
  local id, expiry = string.match(flat[i + 1], '^(.*) (%d+)$')
  if id and tonumber(expiry) > now and live[id] then
    holder[flat[i]] = id
  elseif not target_of[flat[i]] then
    -- A slot of a target no longer configured, held by nobody: forget it.
    redis.call('HDEL', slots_key, flat[i])
  end
end

local mine, count = {}, {}
for _, slot in ipairs(slots) do
  if holder[slot] == me then
    mine[#mine + 1] = slot
    count[target_of[slot]] = (count[target_of[slot]] or 0) + 1
  end
end
-- More than the fair share (another instance joined): hand the extras back, first the
-- second slot of a target held twice here (one instance polling a target twice is one poller).
while #mine > fair do
  local drop = #mine
  for i = #mine, 1, -1 do
    if count[target_of[mine[i]]] > 1 then drop = i; break end
  end
  local slot = table.remove(mine, drop)
  count[target_of[slot]] = count[target_of[slot]] - 1
  redis.call('HDEL', slots_key, slot)
  holder[slot] = nil
end
-- Take free slots up to the fair share, never a second slot of a target polled here: that
-- slot waits for another instance, so the two slots of a target land on two instances.
for _, slot in ipairs(slots) do
  if #mine >= fair then break end
  if not holder[slot] and not count[target_of[slot]] then
    holder[slot] = me
    mine[#mine + 1] = slot
    count[target_of[slot]] = 1
  end
end
local out = { live_count }
local hargs = {}
for _, slot in ipairs(mine) do
  hargs[#hargs + 1] = slot
  hargs[#hargs + 1] = me .. ' ' .. string.format('%d', now + lease)
  out[#out + 1] = target_of[slot]
end
if #hargs > 0 then redis.call('HSET', slots_key, unpack(hargs)) end
return out
