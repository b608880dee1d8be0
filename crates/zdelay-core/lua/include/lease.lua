-- Included by the scripts that claim two-phase jobs (`-- @include lease`): claim_jobs and
-- move_due. lease(ids, dues, deadline, seq_key) leases ids[1..] to one claim: takes the next
-- token of the shard's counter seq_key, puts each id in inflight until deadline (text, ms),
-- and records "<scheduled due> <token>" in scheduled. dues[i] is the job's due now (decimal
-- ms); a due recorded by an earlier claim replaces it, in dues too, so the idempotency key
-- <id>:<due> is the same on every redelivery. Returns the token. Needs the locals
-- inflight_key and scheduled_key.

local function lease(ids, dues, deadline, seq_key)
  local token = string.format('%d', redis.call('INCR', seq_key))
  local known = redis.call('HMGET', scheduled_key, unpack(ids))
  local zargs, hargs = {}, {}
  for i = 1, #ids do
    zargs[#zargs + 1] = deadline
    zargs[#zargs + 1] = ids[i]
    local due = known[i] and string.match(known[i], '^(%-?%d+)')
    if due then dues[i] = due end
    hargs[#hargs + 1] = ids[i]
    hargs[#hargs + 1] = dues[i] .. ' ' .. token
  end
  redis.call('ZADD', inflight_key, unpack(zargs))
  redis.call('HSET', scheduled_key, unpack(hargs))
  return token
end
