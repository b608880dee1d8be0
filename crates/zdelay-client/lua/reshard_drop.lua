-- reshard_drop: delete jobs from their old shard once reshard_put wrote them into their new
-- one: every trace of each id (due, envelope, lease, death, reason, scheduled due, ready entry).
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
--   ZDELAY_NOT_MIGRATING <marker>, deleting nothing
-- ARGV[2..] records: id, M, then M more members of ready to remove (its member in ready_ids
--   is removed in any case)
-- Returns: the number of ids that had something to delete.
-- Re-run safety: yes; a second run finds nothing and returns 0.
local marker = redis.call('GET', KEYS[9])
if marker ~= ARGV[1] then
  return redis.error_reply('ZDELAY_NOT_MIGRATING ' .. tostring(marker))
end
local i, dropped = 2, 0
while i <= #ARGV do
  local id, m = ARGV[i], tonumber(ARGV[i + 1])
  local n = redis.call('ZREM', KEYS[1], id) + redis.call('HDEL', KEYS[2], id)
    + redis.call('ZREM', KEYS[3], id) + redis.call('ZREM', KEYS[4], id)
    + redis.call('HDEL', KEYS[5], id) + redis.call('HDEL', KEYS[6], id)
  local member = redis.call('HGET', KEYS[8], id)
  if member then
    n = n + redis.call('ZREM', KEYS[7], member) + redis.call('HDEL', KEYS[8], id)
  end
  for j = 1, m do n = n + redis.call('ZREM', KEYS[7], ARGV[i + 1 + j]) end
  if n > 0 then dropped = dropped + 1 end
  i = i + 2 + m
end
return dropped
