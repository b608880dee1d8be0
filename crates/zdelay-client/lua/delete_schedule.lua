-- delete_schedule: remove a recurring schedule and its pending occurrence. Occurrences already
-- turned into jobs (due now, or handed to a sink) are left to complete.
-- KEYS[1] schedules HASH  {zdelay:3}:schedules
-- KEYS[2] sched_env HASH  {zdelay:3}:sched_env
-- KEYS[3] sched_due ZSET  {zdelay:3}:sched_due
-- KEYS[4] shards    STRING {zdelay:3}:shards layout marker: the shard count once resharded, or
--                                           "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs
-- ARGV[2] schedule id
-- Returns: 1 deleted, 0 no such schedule.
-- Re-run safety: yes; a second run returns 0.
-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[4])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local id = ARGV[2]
redis.call('ZREM', KEYS[3], id)
redis.call('HDEL', KEYS[2], id)
return redis.call('HDEL', KEYS[1], id)
