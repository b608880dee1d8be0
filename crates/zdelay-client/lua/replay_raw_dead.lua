-- replay_raw_dead: put dead members of a raw source back into the source ZSET.
-- KEYS[1] source        ZSET  delayed:emails
-- KEYS[2] dead          ZSET  delayed:emails:dead
-- KEYS[3] dead reasons  HASH  delayed:emails:dead:reasons
-- ARGV[1] score to give them (in the source's unit)
-- ARGV[2..] pairs: member, the dead score it was selected with ("" = whatever its score)
-- Returns: { replayed, skipped } where skipped are members that are not dead, or died again
--   since they were selected
-- Re-run safety: yes.
local replayed, skipped = 0, 0
for i = 2, #ARGV, 2 do
  local m, selected = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', KEYS[2], m)
  if score and (selected == '' or tonumber(score) == tonumber(selected)) then
    redis.call('ZREM', KEYS[2], m)
    redis.call('HDEL', KEYS[3], m)
    redis.call('ZADD', KEYS[1], ARGV[1], m)
    replayed = replayed + 1
  else
    skipped = skipped + 1
  end
end
return { replayed, skipped }
