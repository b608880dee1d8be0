-- purge_dead: delete dead envelope jobs for good (dead entry, reason and envelope).
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- KEYS[4] shards    STRING {zdelay:3}:shards     layout marker: the shard count once resharded, or
--                                                "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs
-- ARGV[2..] ids
-- Returns: the number of jobs purged (ids that are not dead are skipped)
-- Re-run safety: yes.

-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[4])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local count = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', KEYS[2], id) == 1 then
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[1], id)
    count = count + 1
  end
end
return count
