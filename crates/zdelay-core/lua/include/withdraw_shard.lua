-- Included by upsert_schedule and delete_schedule: withdraw(job) takes back an occurrence a
-- firing wrote ahead of its time while it still waits in the shard (KEYS[JOB_KEYS] due,
-- KEYS[JOB_KEYS + 1] jobs, KEYS[JOB_KEYS + 2] max_lateness); true when it was waiting.
local withdraw_due = KEYS[JOB_KEYS]
local function withdraw(job)
  if redis.call('ZREM', withdraw_due, job) == 0 then return false end
  redis.call('HDEL', KEYS[JOB_KEYS + 1], job)
  redis.call('HDEL', KEYS[JOB_KEYS + 2], job)
  return true
end
