-- purge_dead: delete dead envelope jobs for good: dead entry, reason, envelope and history.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- KEYS[4] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- KEYS[5] shards   STRING {zdelay:3}:shards     layout marker: the shard count once resharded, or
--                                                "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs,
--   or ZDELAY_LAYOUT <layout> <min version> once a newer storage layout owns the shard (marker
--   "layout <layout> <min version>", or "upgrading …" while it moves in)
-- ARGV[2..] pairs: id, the dead score it was selected with ("" = purge it whatever its score)
-- Returns: { purged, skipped } where skipped are ids that are not dead, or died again since
--   they were selected (their score moved)
-- Re-run safety: yes; a purged id is no longer dead, so a second run skips it.

-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[5])
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
