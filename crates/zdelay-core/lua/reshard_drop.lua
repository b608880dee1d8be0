-- reshard_drop: delete jobs from their old shard once reshard_put wrote them into their new
-- one: every trace of each id (due, envelope, lease, death, reason, scheduled due, ready entry,
-- max lateness, history of earlier deaths, and a schedule's definition, envelope, next
-- occurrence, mark and quarantine).
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] dead      ZSET  {zdelay:3}:dead
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons
-- KEYS[6] scheduled HASH  {zdelay:3}:scheduled
-- KEYS[7] ready     ZSET  {zdelay:3}:ready
-- KEYS[8] ready_ids HASH  {zdelay:3}:ready_ids
-- KEYS[9] max_lateness HASH {zdelay:3}:max_lateness
-- KEYS[10] schedules HASH {zdelay:3}:schedules
-- KEYS[11] sched_env HASH {zdelay:3}:sched_env
-- KEYS[12] sched_due ZSET {zdelay:3}:sched_due
-- KEYS[13] sched_fired ZSET {zdelay:3}:sched_fired
-- KEYS[14] sched_quarantine HASH {zdelay:3}:sched_quarantine
-- KEYS[15] history  HASH  {zdelay:3}:history
-- KEYS[16] shards   STRING {zdelay:3}:shards    layout marker
-- ARGV[1] the marker the running move set (an upgrade's "upgrading 2 <version>", a reshard's
--   new count); any other value refuses with ZDELAY_NOT_MIGRATING <marker>, deleting nothing
-- ARGV[2..] records (at most 1000): id, M, then M more members of ready to remove (its member
--   in ready_ids is removed in any case)
-- Returns: the number of entries deleted, over every key.
-- Re-run safety: yes; a second run finds nothing and returns 0.
local marker = redis.call('GET', KEYS[16])
if marker ~= ARGV[1] then
  return redis.error_reply('ZDELAY_NOT_MIGRATING ' .. tostring(marker))
end
local ids, members = {}, {}
local i = 2
while i <= #ARGV do
  local m = tonumber(ARGV[i + 1])
  ids[#ids + 1] = ARGV[i]
  for j = 1, m do members[#members + 1] = ARGV[i + 1 + j] end
  i = i + 2 + m
end
if #ids == 0 then return 0 end
-- One command per key for the whole batch.
local indexed = redis.call('HMGET', KEYS[8], unpack(ids))
for j = 1, #ids do
  if indexed[j] then members[#members + 1] = indexed[j] end
end
local removed = redis.call('ZREM', KEYS[1], unpack(ids)) + redis.call('HDEL', KEYS[2], unpack(ids))
  + redis.call('ZREM', KEYS[3], unpack(ids)) + redis.call('ZREM', KEYS[4], unpack(ids))
  + redis.call('HDEL', KEYS[5], unpack(ids)) + redis.call('HDEL', KEYS[6], unpack(ids))
  + redis.call('HDEL', KEYS[8], unpack(ids)) + redis.call('HDEL', KEYS[9], unpack(ids))
  + redis.call('HDEL', KEYS[10], unpack(ids)) + redis.call('HDEL', KEYS[11], unpack(ids))
  + redis.call('ZREM', KEYS[12], unpack(ids)) + redis.call('ZREM', KEYS[13], unpack(ids))
  + redis.call('HDEL', KEYS[14], unpack(ids)) + redis.call('HDEL', KEYS[15], unpack(ids))
if #members > 0 then removed = removed + redis.call('ZREM', KEYS[7], unpack(members)) end
return removed
