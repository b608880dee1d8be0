-- upsert_schedule: create or update a recurring schedule, compare-and-set on its version and
-- its high-water mark, and set its pending occurrence. The caller planned the pending
-- occurrence from the definition and the mark it read; if either changed since (another
-- update, a firing, a delete), nothing is written and it reads again. So no occurrence at or
-- before the mark (one a firing already decided) ever becomes pending again.
-- KEYS[1] schedules HASH  {zdelay:3}:schedules  id -> "<version>\n<definition JSON>"
-- KEYS[2] sched_env HASH  {zdelay:3}:sched_env  id -> the envelope every occurrence carries
-- KEYS[3] sched_due ZSET  {zdelay:3}:sched_due  id -> its pending occurrence, ms (absent when
--                                               paused, ended or quarantined)
-- KEYS[4] sched_fired ZSET {zdelay:3}:sched_fired id -> its high-water mark, ms: every
--                                               occurrence at or before it was decided
-- KEYS[5] sched_quarantine HASH {zdelay:3}:sched_quarantine id -> "<ms> <reason>" (cleared)
-- KEYS[6] shards    STRING {zdelay:3}:shards layout marker: the shard count once resharded, or
--                                           "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs,
--   or ZDELAY_LAYOUT <layout> <min version> once a newer storage layout owns the shard (marker
--   "layout <layout> <min version>", or "upgrading …" while it moves in)
-- ARGV[2] schedule id; ARGV[3] expected version (0 = none: no schedule, or a definition
--   without a readable version); ARGV[4] the mark read ("" = none)
-- ARGV[5] definition JSON; ARGV[6] envelope ("" = keep the stored one)
-- ARGV[7] the pending occurrence: "keep" (the timing did not change: left as it is), "same"
--   (like keep, and only the update time changed: if the stored envelope is ARGV[6] too,
--   nothing is written and the version stays, so a firing fenced on it goes on), "pause"
--   (none while paused), "none" (the definition has no next occurrence) or the next
--   occurrence ms, which must be after the mark. With "none" or a time, a pending occurrence
--   already due (at or before Redis TIME) stays: the mover plans it with the new definition,
--   whose misfire policy decides what is delivered.
-- ARGV[8] now ms, as the caller read it: a new schedule's mark (nothing at or before its
--   creation fires)
-- ARGV[9] wake channel; ARGV[10] shard number, sent in the wake message
-- Returns: { version (the new one; the same when "same" wrote nothing), pending occurrence ms
--   ("" = none) } or { -1, current version } when
--   the version or the mark is not what was read (read again).
-- Re-run safety: a re-run with the same expected version finds it stale and changes nothing.
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
-- @include upsert_schedule_body
