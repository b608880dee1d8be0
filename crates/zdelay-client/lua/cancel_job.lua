-- cancel_job: cancel a pending job by id, O(log N): one due later, or due and waiting for its
-- two-phase sink in the ready set.
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] scheduled HASH  {zdelay:3}:scheduled
-- KEYS[5] ready     ZSET  {zdelay:3}:ready
-- KEYS[6] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[7] max_lateness HASH {zdelay:3}:max_lateness
-- ARGV[1] job id
-- Returns: 1 cancelled; 0 not pending (already delivered, dead, or never enqueued);
--   -1 in flight (claimed by a two-phase sink; it is being delivered)
-- Re-run safety: yes; a second run returns 0.
local id = ARGV[1]
local pending = redis.call('ZREM', KEYS[1], id) == 1
if not pending then
  local member = redis.call('HGET', KEYS[6], id)
  if member then
    redis.call('ZREM', KEYS[5], member)
    redis.call('HDEL', KEYS[6], id)
    pending = true
  end
end
if pending then
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[4], id)
  redis.call('HDEL', KEYS[7], id)
  return 1
end
if redis.call('ZSCORE', KEYS[3], id) then return -1 end
return 0
