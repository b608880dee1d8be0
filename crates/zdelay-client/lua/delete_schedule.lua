-- delete_schedule: remove a recurring schedule and its pending occurrence. Occurrences already
-- turned into jobs (due now, or handed to a sink) are left to complete.
-- KEYS[1] schedules HASH  {zdelay:3}:schedules
-- KEYS[2] sched_env HASH  {zdelay:3}:sched_env
-- KEYS[3] sched_due ZSET  {zdelay:3}:sched_due
-- ARGV[1] schedule id
-- Returns: 1 deleted, 0 no such schedule.
-- Re-run safety: yes; a second run returns 0.
local id = ARGV[1]
redis.call('ZREM', KEYS[3], id)
redis.call('HDEL', KEYS[2], id)
return redis.call('HDEL', KEYS[1], id)
