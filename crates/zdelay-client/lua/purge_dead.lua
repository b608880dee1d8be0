-- purge_dead: delete dead envelope jobs for good (dead entry, reason and envelope).
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- ARGV[1..] ids
-- Returns: the number of jobs purged (ids that are not dead are skipped)
-- Re-run safety: yes.
local count = 0
for _, id in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[2], id) == 1 then
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[1], id)
    count = count + 1
  end
end
return count
