-- purge_raw_dead: delete dead members of a raw source for good.
-- KEYS[1] dead          ZSET  delayed:emails:dead
-- KEYS[2] dead reasons  HASH  delayed:emails:dead:reasons
-- ARGV[1..] members
-- Returns: the number of members purged (members that are not dead are skipped)
-- Re-run safety: yes.
local count = 0
for _, m in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], m) == 1 then
    redis.call('HDEL', KEYS[2], m)
    count = count + 1
  end
end
return count
