-- Included by the scripts that claim two-phase jobs or settle them (`-- @include lease`):
-- claim_jobs, move_due, settle_jobs. Needs the locals inflight_key, scheduled_key, claims_key.
--
-- A claim is one record, not one per job: its jobs go into inflight, scored with the lease
-- deadline plus a fraction of a millisecond that names the claim (the claim counter mod 1024,
-- in 1024ths: exact in a double), and one field of claims, keyed "<deadline>:<n>" (the
-- claim's token), holds the claimed ids and the due each was scheduled for, packed once. A
-- settle presents the token: a job is the settle's while its inflight score is the token's.
-- A job's own scheduled record exists only once zdelay moved its score (retry, release,
-- hand-over, lease expiry): it keeps the first due of its idempotency key <id>:<due>.

-- The inflight score of a token, as a number (nil for a token of another shape).
local function token_score(token)
  local deadline, n = string.match(token, '^(%-?%d+):(%d+)$')
  if not deadline then return nil end
  return tonumber(deadline) + tonumber(n) / 1024
end

-- The token of an inflight score read back from Redis.
local function score_token(score)
  local s = tonumber(score)
  local deadline = math.floor(s)
  return string.format('%d:%d', deadline, math.floor((s - deadline) * 1024 + 0.5))
end

-- lease(ids, dues, deadline, seq_key) leases ids[1..] to one new claim until deadline (text,
-- ms). dues[i] is the job's due now (decimal ms); a due its own scheduled record keeps
-- replaces it, in dues too. Returns the claim's token.
local function lease(ids, dues, deadline, seq_key)
  local token, n
  repeat
    n = redis.call('INCR', seq_key) % 1024
    token = deadline .. ':' .. n
  until redis.call('HEXISTS', claims_key, token) == 0
  -- n / 1024 has at most 10 decimals: written out, it is the exact score.
  local score = deadline .. string.sub(string.format('%.10f', n / 1024), 2)
  if redis.call('HLEN', scheduled_key) > 0 then
    local known = redis.call('HMGET', scheduled_key, unpack(ids))
    local rewrite = {}
    for i = 1, #ids do
      local due = known[i] and string.match(known[i], '^(%-?%d+)')
      if due then
        dues[i] = due
        -- The token of the claim that holds it now: a settle of an older claim, by a daemon
        -- that still fences by this record, is refused.
        rewrite[#rewrite + 1] = ids[i]
        rewrite[#rewrite + 1] = due .. ' ' .. token
      end
    end
    if #rewrite > 0 then redis.call('HSET', scheduled_key, unpack(rewrite)) end
  end
  local zargs = {}
  for i = 1, #ids do
    zargs[#zargs + 1] = score
    zargs[#zargs + 1] = ids[i]
  end
  redis.call('ZADD', inflight_key, unpack(zargs))
  redis.call('HSET', claims_key, token, cmsgpack.pack(ids, dues))
  return token
end

-- The scheduled due of each of ids (all of one claim, token) that has no record of its own,
-- from the claim's record: id -> due.
local function claimed_dues(token)
  local packed = redis.call('HGET', claims_key, token)
  local found = {}
  if not packed then return found end
  local ok, ids, dues = pcall(cmsgpack.unpack, packed)
  if not ok or type(ids) ~= 'table' or type(dues) ~= 'table' then return found end
  for i = 1, #ids do found[ids[i]] = dues[i] end
  return found
end

-- Keeps the scheduled due of ids[i] (scores[i]: its inflight score, so its claim) in its own
-- record before its lease ends some other way than an ack: where none exists, from its claim's.
local function keep_dues(ids, scores)
  local known = redis.call('HLEN', scheduled_key) > 0 and redis.call('HMGET', scheduled_key, unpack(ids)) or {}
  local by_claim, hargs = {}, {}
  for i = 1, #ids do
    if not known[i] then
      local token = score_token(scores[i])
      local dues = by_claim[token]
      if not dues then
        dues = claimed_dues(token)
        by_claim[token] = dues
      end
      if dues[ids[i]] then
        hargs[#hargs + 1] = ids[i]
        hargs[#hargs + 1] = dues[ids[i]] .. ' ' .. token
      end
    end
  end
  if #hargs > 0 then redis.call('HSET', scheduled_key, unpack(hargs)) end
end

-- Drops the records of the claims of tokens (a set) that hold no job in flight any more.
local function drop_finished_claims(tokens)
  local gone = {}
  for token in pairs(tokens) do
    local score = token_score(token)
    if score and redis.call('ZCOUNT', inflight_key, score, score) == 0 then gone[#gone + 1] = token end
  end
  if #gone > 0 then redis.call('HDEL', claims_key, unpack(gone)) end
end
