-- purge_dead: delete dead envelope jobs for good: dead entry, reason, envelope and history.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- KEYS[4] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- ARGV[1..] pairs: id, the dead score it was selected with ("" = purge it whatever its score)
-- Returns: { purged, skipped } where skipped are ids that are not dead, or died again since
--   they were selected (their score moved)
-- Re-run safety: yes; a purged id is no longer dead, so a second run skips it.
local jobs_key, dead_key, reasons_key, history_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local purged, skipped = 0, 0
for i = 1, #ARGV, 2 do
  local id, fence = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', dead_key, id)
  if score and (fence == '' or tonumber(score) == tonumber(fence)) then
    redis.call('ZREM', dead_key, id)
    redis.call('HDEL', reasons_key, id)
    redis.call('HDEL', jobs_key, id)
    redis.call('HDEL', history_key, id)
    purged = purged + 1
  else
    skipped = skipped + 1
  end
end
return { purged, skipped }
