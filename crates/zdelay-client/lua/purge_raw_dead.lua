-- purge_raw_dead: delete dead members of a raw source for good.
-- KEYS[1] dead          ZSET  delayed:emails:dead
-- KEYS[2] dead reasons  HASH  delayed:emails:dead:reasons
-- ARGV[1..] pairs: member, the dead score it was selected with ("" = whatever its score)
-- Returns: { purged, skipped } where skipped are members that are not dead, or died again
--   since they were selected
-- Re-run safety: yes.
local purged, skipped = 0, 0
for i = 1, #ARGV, 2 do
  local m, selected = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', KEYS[1], m)
  if score and (selected == '' or tonumber(score) == tonumber(selected)) then
    redis.call('ZREM', KEYS[1], m)
    redis.call('HDEL', KEYS[2], m)
    purged = purged + 1
  else
    skipped = skipped + 1
  end
end
return { purged, skipped }
