-- purge_raw_dead: delete dead members of a raw source for good.
-- KEYS[1] dead          ZSET  delayed:emails:dead
-- KEYS[2] dead reasons  HASH  delayed:emails:dead:reasons
-- ARGV[1..] members; none = the oldest 1000
-- Returns: the number of members purged
-- Re-run safety: yes.
local members = ARGV
if #members == 0 then members = redis.call('ZRANGE', KEYS[1], 0, 999) end
local count = 0
for _, m in ipairs(members) do
  if redis.call('ZREM', KEYS[1], m) == 1 then
    redis.call('HDEL', KEYS[2], m)
    count = count + 1
  end
end
return count
