-- unlock: releases a lock taken with SET NX PX, only by its holder (a lock that expired and
-- was taken by another is left to it).
-- KEYS[1] the lock STRING
-- ARGV[1] the holder's token
-- Returns: 1 released, 0 not held by this token.
-- Re-run safety: yes.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
