-- due_schedules: the shard's schedules whose next occurrence is due, with their definitions,
-- read in one consistent step (read only: fire_schedules decides, fenced).
-- KEYS[1] schedules HASH  {zdelay:3}:schedules  id -> "<version>\n<definition JSON>"
-- KEYS[2] sched_due ZSET  {zdelay:3}:sched_due  id -> its next occurrence, ms
-- KEYS[3] shards    STRING {zdelay:3}:shards layout marker: the shard count once resharded, or
--                                           "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs,
--   or ZDELAY_LAYOUT <layout> <min version> once a newer storage layout owns the shard (marker
--   "layout <layout> <min version>", or "upgrading …" while it moves in)
-- ARGV[2] "now" in ms ("" = Redis TIME); ARGV[3] at most this many
-- Returns: { now ms, then per schedule: id, occurrence ms, "<version>\n<definition>" ("" if
--   the definition is missing) }
-- Re-run safety: yes (reads only).
-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[3])
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
-- @include due_schedules_body
