-- release_slots: an instance stopping gracefully leaves the registry and hands back every
-- poller slot it holds; the others plan them at their next heartbeat. Only the process that
-- holds the registration does: one that refused to run because another live process holds
-- its instance id leaves that process's registration and slots alone.
-- KEYS[1] instances HASH {zdelay}:instances         id -> "<registration expiry ms> <last heartbeat ms> <nonce> <nonce it was taken from, or ->"
-- KEYS[2] slots     HASH {zdelay}:slots             "<target>#<k>" -> instance id
-- KEYS[3] sources   HASH {zdelay}:instance_sources  id -> its raw sources' targets
-- KEYS[4] plan      HASH {zdelay}:plan              claim_slots' last plan (deleted: the others
--                                                    make a new one without this instance)
-- ARGV[1] this instance's id; ARGV[2] this process's nonce
-- Returns: the number of slots released, or -1 when another process holds the registration
-- Re-run safety: yes.
local me, nonce = ARGV[1], ARGV[2]
local current = redis.call('HGET', KEYS[1], me)
if current and string.match(current, '^%d+ %d+ ?(%S*)') ~= nonce then
  return -1
end
local released = 0
local flat = redis.call('HGETALL', KEYS[2])
for i = 1, #flat, 2 do
  if flat[i + 1] == me then
    redis.call('HDEL', KEYS[2], flat[i])
    released = released + 1
  end
end
redis.call('HDEL', KEYS[1], me)
redis.call('HDEL', KEYS[3], me)
redis.call('DEL', KEYS[4])
return released
