-- delete_schedule_lane: delete_schedule for a schedule kept in a route lane (storage layout 2):
-- remove it, its pending occurrence and any quarantine; its high-water mark stays (a
-- tombstone) until it is older than the retention. Its body is delete_schedule's (a test keeps
-- them the same); only the fence is the lane's.
-- KEYS[1] schedules HASH   zdelay:{emj}:sched:<route>
-- KEYS[2] sched_env HASH   zdelay:{emj}:sched_env:<route>
-- KEYS[3] sched_due ZSET   zdelay:{emj}:sched_due:<route>
-- KEYS[4] sched_fired ZSET zdelay:{emj}:sched_fired:<route> id -> high-water mark ms
-- KEYS[5] sched_quarantine HASH zdelay:{emj}:sched_quarantine:<route>
-- KEYS[6] marker    STRING zdelay:{emj}:lane:<route>       "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] schedule id; ARGV[3] mark retention ms
-- Returns: 1 deleted, 0 no such schedule.
-- Re-run safety: yes; a second run returns 0.
local lane_marker = KEYS[6]
-- @include lane_fence
local id = ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local old = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. (now - tonumber(ARGV[3])),
  'LIMIT', 0, 100)
if #old > 0 then redis.call('ZREM', KEYS[4], unpack(old)) end
redis.call('ZREM', KEYS[3], id)
redis.call('HDEL', KEYS[2], id)
redis.call('HDEL', KEYS[5], id)
return redis.call('HDEL', KEYS[1], id)
