-- register_two_phase: register two-phase routes (their jobs wait in the spread shards, filed by
-- sink) and two-phase sinks in the namespace's lane registry (storage layout 2), so producers
-- know which destinations go to the spread shards.
-- KEYS[1] registry HASH zdelay:lanes  "t:<route>" -> "<sink>", "s:<sink>" -> "",
--                                      "r:<route>" -> a local route's lane (read only)
-- ARGV[1] "" for a daemon, which writes every entry as its config says; "missing" for a
--   producer, which registers only what the registry lacks and changes nothing: a route
--   registered otherwise (another sink, or as a local route with a lane) is answered with
--   nothing written
-- ARGV[2] the number of routes n; ARGV[3 .. 2 + 2n] route, sink pairs; the rest: sink names
-- Returns: { } when registered (or registered so already), or with "missing" the first route
--   registered otherwise: { route, the registered entry: "sink <sink>" or "<lane> local …" }
-- Re-run safety: yes; a second run finds its own entries.

local registry, missing = KEYS[1], ARGV[1] == 'missing'
local n = tonumber(ARGV[2])
if missing then
  for i = 3, 2 + 2 * n, 2 do
    local route, sink = ARGV[i], ARGV[i + 1]
    local lane = redis.call('HGET', registry, 'r:' .. route)
    if lane then return { route, lane } end
    local registered = redis.call('HGET', registry, 't:' .. route)
    if registered and registered ~= sink then return { route, 'sink ' .. registered } end
  end
end
for i = 3, 2 + 2 * n, 2 do
  redis.call('HSET', registry, 't:' .. ARGV[i], ARGV[i + 1])
end
for i = 3 + 2 * n, #ARGV do
  redis.call('HSET', registry, 's:' .. ARGV[i], '')
end
return {}
