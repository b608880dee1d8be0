-- cancel_job: cancel a pending job by id, O(log N).
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] scheduled HASH  {zdelay:3}:scheduled
-- ARGV[1] job id
-- Returns: 1 cancelled; 0 not pending (already delivered, dead, or never enqueued);
--   -1 in flight (claimed by a two-phase sink; it is being delivered)
-- Re-run safety: yes; a second run returns 0.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  return 1
end
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then return -1 end
return 0
