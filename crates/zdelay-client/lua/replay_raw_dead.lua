-- replay_raw_dead: put dead members of a raw source back into the source ZSET.
-- KEYS[1] source        ZSET  delayed:emails
-- KEYS[2] dead          ZSET  delayed:emails:dead
-- KEYS[3] dead reasons  HASH  delayed:emails:dead:reasons
-- ARGV[1] score to give them (in the source's unit); ARGV[2..] members
-- Returns: the number of members replayed (members that are not dead are skipped)
-- Re-run safety: yes.
local count = 0
for i = 2, #ARGV do
  local m = ARGV[i]
  if redis.call('ZREM', KEYS[2], m) == 1 then
    redis.call('HDEL', KEYS[3], m)
    redis.call('ZADD', KEYS[1], ARGV[1], m)
    count = count + 1
  end
end
return count
