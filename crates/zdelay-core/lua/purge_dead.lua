-- purge_dead: delete dead envelope jobs for good: dead entry, reason, envelope and history.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- KEYS[4] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- KEYS[5] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2..] pairs: id, the dead score it was selected with ("" = purge it whatever its score)
-- Returns: { purged, skipped } where skipped are ids that are not dead, or died again since
--   they were selected (their score moved)
-- Re-run safety: yes; a purged id is no longer dead, so a second run skips it.

local shard_marker = KEYS[5]
-- @include shard_fence
local jobs_key, dead_key, reasons_key, history_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local purged, skipped = 0, 0
for i = 2, #ARGV, 2 do
  local id, selected = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', dead_key, id)
  if score and (selected == '' or tonumber(score) == tonumber(selected)) then
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
