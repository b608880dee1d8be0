-- reschedule_job: move a pending job to a new due time, O(log N), waking the poller on a new
-- head. A job waiting for its two-phase sink in the ready set goes back to due.
-- KEYS[1] due        ZSET  {zdelay:3}:due
-- KEYS[2] scheduled  HASH  {zdelay:3}:scheduled  (a new schedule forgets the old one)
-- KEYS[3] ready      ZSET  {zdelay:3}:ready
-- KEYS[4] ready_ids  HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- ARGV[1] job id
-- ARGV[2] new due: epoch ms, or "+N" for N ms after Redis TIME
-- ARGV[3] wake channel (zdelay:wake); ARGV[4] shard number
-- Returns: the new due ms, or -1 when the job is not pending (delivered, dead, in flight, unknown)
-- Re-run safety: yes (absolute times); a relative time is measured again from the re-run.
local id = ARGV[1]
if not redis.call('ZSCORE', KEYS[1], id) then
  local member = redis.call('HGET', KEYS[4], id)
  if not member then return -1 end
  redis.call('ZREM', KEYS[3], member)
  redis.call('HDEL', KEYS[4], id)
end
local due
if string.sub(ARGV[2], 1, 1) == '+' then
  local t = redis.call('TIME')
  due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(string.sub(ARGV[2], 2))
else
  due = tonumber(ARGV[2])
end
redis.call('ZADD', KEYS[1], due, id)
redis.call('HDEL', KEYS[2], id)
local head = redis.call('ZRANGE', KEYS[1], 0, 0)
if head[1] == id then
  redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. string.format('%d', due))
end
return due
