-- Included after their fences by delete_schedule and delete_schedule_lane: a schedule's keys
-- are the same in a shard and in a route lane, and so is what is done with them.

local id = ARGV[2]
if tonumber(redis.call('ZSCORE', KEYS[4], id)) ~= tonumber(ARGV[4]) then return -1 end
-- The occurrences a firing wrote ahead of their time (ARGV[5..]): taken back if they wait.
for k = 5, #ARGV do withdraw(ARGV[k]) end
-- Redis TIME: behind a test clock's time, so marks wait a little longer to be pruned.
local now = math.floor(clock_us() / 1000)
local old = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. (now - tonumber(ARGV[3])),
  'LIMIT', 0, 100)
if #old > 0 then redis.call('ZREM', KEYS[4], unpack(old)) end
redis.call('ZREM', KEYS[3], id)
redis.call('HDEL', KEYS[2], id)
redis.call('HDEL', KEYS[5], id)
redis.call('HDEL', KEYS[7], id)
return redis.call('HDEL', KEYS[1], id)
