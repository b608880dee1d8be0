-- Included after their fences by due_schedules and due_schedules_lane: a schedule's keys
-- are the same in a shard and in a route lane, and so is what is done with them.

local now = math.floor(clock_us(tonumber(ARGV[2])) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
local out = { now }
for i = 1, #due, 2 do
  out[#out + 1] = due[i]
  out[#out + 1] = due[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[1], due[i]) or ''
end
return out
