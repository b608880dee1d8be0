-- Included by upsert_schedule_lane and delete_schedule_lane: withdraw(job) takes back an
-- occurrence a firing wrote ahead of its time while it still waits in the lane
-- (KEYS[JOB_KEYS..JOB_KEYS + 4]: due, jobs, meta, maxlate, large); true when it was waiting.
local withdraw_due = KEYS[JOB_KEYS]
local function withdraw(job)
  if redis.call('ZREM', withdraw_due, job) == 0 then return false end
  redis.call('HDEL', KEYS[JOB_KEYS + 1], job)
  redis.call('HDEL', KEYS[JOB_KEYS + 2], job)
  redis.call('HDEL', KEYS[JOB_KEYS + 3], job)
  redis.call('SREM', KEYS[JOB_KEYS + 4], job)
  return true
end
