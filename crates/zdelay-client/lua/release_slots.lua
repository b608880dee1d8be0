-- release_slots: an instance stopping gracefully leaves the registry and hands back every
-- poller slot it holds; the others plan them at their next heartbeat.
-- KEYS[1] instances HASH {zdelay}:instances         id -> "<registration expiry ms> <last heartbeat ms>"
-- KEYS[2] slots     HASH {zdelay}:slots             "<target>#<k>" -> instance id
-- KEYS[3] sources   HASH {zdelay}:instance_sources  id -> its raw sources' targets
-- ARGV[1] this instance's id
-- Returns: the number of slots released
-- Re-run safety: yes.
local me = ARGV[1]
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
return released
