-- Included after their fences by due_schedules and due_schedules_lane: a schedule's keys
-- are the same in a shard and in a route lane, and so is what is done with them.

local now = math.floor(clock_us(tonumber(ARGV[2])) / 1000)
-- Due, or within the firing's lead (ARGV[4] ms): those are written ahead of their time.
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now + tonumber(ARGV[4]), 'WITHSCORES',
  'LIMIT', 0, tonumber(ARGV[3]))
local out = { now }
-- Their definitions in one read (a call per schedule would cost more than the reading).
local ids = {}
for i = 1, #due, 2 do ids[#ids + 1] = due[i] end
local records = #ids > 0 and redis.call('HMGET', KEYS[1], unpack(ids)) or {}
for k, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = due[2 * k]
  out[#out + 1] = records[k] or ''
end
return out
