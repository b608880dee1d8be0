-- Included by upsert_schedule, delete_schedule and their lane variants: withdraw(job) takes
-- back an occurrence a firing wrote ahead of its time while it still waits as a job; true
-- when it was waiting. The includer names where a job waits (before its fence): withdraw_due
-- (the due set), withdraw_hashes (each hash with a field for it) and withdraw_set (the set
-- of large payloads, or nil).
local function withdraw(job)
  if redis.call('ZREM', withdraw_due, job) == 0 then return false end
  for _, hash in ipairs(withdraw_hashes) do redis.call('HDEL', hash, job) end
  if withdraw_set then redis.call('SREM', withdraw_set, job) end
  return true
end
