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
-- ARGV[2..] records: id, mask, 7 values, M, M members. mask has 7 characters, "1" where the
--   value is present (in reshard_take's order: due, envelope, inflight, dead, reason,
--   scheduled, ready member); the M members are added to ready (score 0).
-- Returns: the number of records written.
-- Re-run safety: yes (the same values overwrite themselves).
local marker = redis.call('GET', KEYS[9])
if marker ~= ARGV[1] then
  return redis.error_reply('ZDELAY_NOT_MIGRATING ' .. tostring(marker))
end
local function present(mask, k) return string.byte(mask, k) == 49 end -- "1"
local i, written = 2, 0
while i <= #ARGV do
  local id, mask, v = ARGV[i], ARGV[i + 1], i + 2
  if present(mask, 1) then redis.call('ZADD', KEYS[1], ARGV[v], id) end
  if present(mask, 2) then redis.call('HSET', KEYS[2], id, ARGV[v + 1]) end
  if present(mask, 3) then redis.call('ZADD', KEYS[3], ARGV[v + 2], id) end
  if present(mask, 4) then redis.call('ZADD', KEYS[4], ARGV[v + 3], id) end
  if present(mask, 5) then redis.call('HSET', KEYS[5], id, ARGV[v + 4]) end
  if present(mask, 6) then redis.call('HSET', KEYS[6], id, ARGV[v + 5]) end
  if present(mask, 7) then
    redis.call('HSET', KEYS[8], id, ARGV[v + 6])
    redis.call('ZADD', KEYS[7], 0, ARGV[v + 6])
  end
  local m = tonumber(ARGV[v + 7])
  for j = 1, m do redis.call('ZADD', KEYS[7], 0, ARGV[v + 7 + j]) end
  i = v + 8 + m
  written = written + 1
end
return written
