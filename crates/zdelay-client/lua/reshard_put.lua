-- reshard_put: write jobs, as reshard_take read them from their old shard, into the shard they
-- belong to under the new shard count. Overwrites: writing the same job twice is writing it once.
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] dead      ZSET  {zdelay:3}:dead
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons
-- KEYS[6] scheduled HASH  {zdelay:3}:scheduled
-- KEYS[7] ready     ZSET  {zdelay:3}:ready
-- KEYS[8] ready_ids HASH  {zdelay:3}:ready_ids
-- KEYS[9] shards    STRING {zdelay:3}:shards    layout marker
-- ARGV[1] the marker this reshard set ("migrating <from> <to>"); any other value refuses with
--   ZDELAY_NOT_MIGRATING <marker>, writing nothing
-- ARGV[2..] records (at most 1000): id, mask, 7 values, M, M members. mask has 7 characters, "1" where the
--   value is present (in reshard_take's order: due, envelope, inflight, dead, reason,
--   scheduled, ready member); the M members are added to ready (score 0).
-- Returns: the number of records written.
-- Re-run safety: yes (the same values overwrite themselves).
local marker = redis.call('GET', KEYS[9])
if marker ~= ARGV[1] then
  return redis.error_reply('ZDELAY_NOT_MIGRATING ' .. tostring(marker))
end
local function present(mask, k) return string.byte(mask, k) == 49 end -- "1"
-- Gathered per key, then one command per key for the whole batch.
local due, jobs, inflight, dead, reasons, scheduled, ready, ready_ids = {}, {}, {}, {}, {}, {}, {}, {}
local function pair(t, a, b) t[#t + 1] = a; t[#t + 1] = b end
local i, written = 2, 0
while i <= #ARGV do
  local id, mask, v = ARGV[i], ARGV[i + 1], i + 2
  if present(mask, 1) then pair(due, ARGV[v], id) end
  if present(mask, 2) then pair(jobs, id, ARGV[v + 1]) end
  if present(mask, 3) then pair(inflight, ARGV[v + 2], id) end
  if present(mask, 4) then pair(dead, ARGV[v + 3], id) end
  if present(mask, 5) then pair(reasons, id, ARGV[v + 4]) end
  if present(mask, 6) then pair(scheduled, id, ARGV[v + 5]) end
  if present(mask, 7) then
    pair(ready_ids, id, ARGV[v + 6])
    pair(ready, 0, ARGV[v + 6])
  end
  local m = tonumber(ARGV[v + 7])
  for j = 1, m do pair(ready, 0, ARGV[v + 7 + j]) end
  i = v + 8 + m
  written = written + 1
end
if #due > 0 then redis.call('ZADD', KEYS[1], unpack(due)) end
if #jobs > 0 then redis.call('HSET', KEYS[2], unpack(jobs)) end
if #inflight > 0 then redis.call('ZADD', KEYS[3], unpack(inflight)) end
if #dead > 0 then redis.call('ZADD', KEYS[4], unpack(dead)) end
if #reasons > 0 then redis.call('HSET', KEYS[5], unpack(reasons)) end
if #scheduled > 0 then redis.call('HSET', KEYS[6], unpack(scheduled)) end
if #ready > 0 then redis.call('ZADD', KEYS[7], unpack(ready)) end
if #ready_ids > 0 then redis.call('HSET', KEYS[8], unpack(ready_ids)) end
return written
