-- purge_dead: delete dead envelope jobs for good (dead entry, reason and envelope).
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- ARGV[1..] ids; none = the oldest 1000 dead jobs of the shard
-- Returns: the number of jobs purged
-- Re-run safety: yes.
local ids = ARGV
if #ids == 0 then ids = redis.call('ZRANGE', KEYS[2], 0, 999) end
local count = 0
for _, id in ipairs(ids) do
  if redis.call('ZREM', KEYS[2], id) == 1 then
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[1], id)
    count = count + 1
  end
end
return count
