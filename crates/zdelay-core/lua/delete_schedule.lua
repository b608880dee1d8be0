-- delete_schedule: remove a recurring schedule, its pending occurrence and any quarantine.
-- Occurrences already turned into jobs (due now, or handed to a sink) are left to complete.
-- Its high-water mark stays (a tombstone) until it is older than the retention: a schedule
-- created again with this id plans after it, and a write that read the schedule before the
-- delete finds the mark changed or the version gone, so nothing the deleted schedule fired is
-- fired again. Marks older than the retention (of any schedule) are pruned here, at most 100
-- per call.
-- KEYS[1] schedules HASH  {zdelay:3}:schedules
-- KEYS[2] sched_env HASH  {zdelay:3}:sched_env
-- KEYS[3] sched_due ZSET  {zdelay:3}:sched_due
-- KEYS[4] sched_fired ZSET {zdelay:3}:sched_fired id -> high-water mark ms
-- KEYS[5] sched_quarantine HASH {zdelay:3}:sched_quarantine
-- KEYS[6] shards    STRING {zdelay:3}:shards layout marker: the shard count once resharded, or
--                                           "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs,
--   or ZDELAY_LAYOUT <layout> <min version> once a newer storage layout owns the shard (marker
--   "layout <layout> <min version>", or "upgrading …" while it moves in)
-- ARGV[2] schedule id; ARGV[3] mark retention ms
-- Returns: 1 deleted, 0 no such schedule.
-- Re-run safety: yes; a second run returns 0.
-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[6])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  local newer = string.match(layout, '^layout (.+)') or string.match(layout, '^upgrading (.+)')
  if newer then
    return redis.error_reply('ZDELAY_LAYOUT ' .. newer)
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
-- @include delete_schedule_body
