-- release_slots: an instance stopping gracefully hands back every poller slot it holds and
-- leaves the registry, so the others take its slots at their next heartbeat.
-- KEYS[1] instances HASH  {zdelay}:instances
-- KEYS[2] slots     HASH  {zdelay}:slots      "<target>#<k>" -> "<instance id> <lease expiry ms>"
-- ARGV[1] this instance's id
-- Returns: the number of slots released
-- Re-run safety: yes.
local me = ARGV[1]
local released = 0
local flat = redis.call('HGETALL', KEYS[2])
for i = 1, #flat, 2 do
  local id = string.match(flat[i + 1], '^(.*) %d+$')
  if id == me then
    redis.call('HDEL', KEYS[2], flat[i])
    released = released + 1
  end
end
redis.call('HDEL', KEYS[1], me)
return released
