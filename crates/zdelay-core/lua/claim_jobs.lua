-- claim_jobs: claim the oldest jobs waiting for one two-phase sink in a shard: each moves from
-- the ready set to inflight with a lease deadline, and its envelope is returned for the sink's
-- publisher to publish. Each call is one claim with a fencing token for settle_jobs, unique
-- among the shard's claims in flight, and one record of its jobs' scheduled dues (include
-- lease): the lease deadline alone is not unique (two claims in one millisecond with one
-- lease share it).
-- KEYS[1] jobs      HASH  {zdelay:3}:jobs       id -> envelope
-- KEYS[2] inflight  ZSET  {zdelay:3}:inflight   member = id, score = lease deadline ms (and
--                                               its claim's fraction of a ms)
-- KEYS[3] scheduled HASH  {zdelay:3}:scheduled  id -> "<scheduled due ms> <token>": the due
--                                               kept once zdelay moved the job's score
-- KEYS[4] ready     ZSET  {zdelay:3}:ready      member = "<sink>\n<due, 16 digits>\n<id>", score 0
-- KEYS[5] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[6] lease_seq STRING {zdelay:3}:lease_seq the shard's claim counter: the tokens
-- KEYS[7] claims    HASH  {zdelay:3}:claims     token -> the claim's ids and scheduled dues
--                                               (include lease)
-- KEYS[8] shards    STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] sink name; ARGV[3] batch size, at most 1000; ARGV[4] lease in ms
-- ARGV[5] byte budget: the claimed envelopes' bytes stop at it (sizes read with HSTRLEN before
--   anything is read); a single envelope larger than the budget is claimed alone
-- ARGV[6] "now" in ms; "" = Redis TIME (a namespace's test clock passes its time)
-- Returns: { now_us, lease deadline ms, token ("" when nothing was claimed), more (1 when the
--   budget cut the batch: more jobs wait), the earliest lease deadline in inflight after the call
--   ms ("" when nothing is in flight: the next time a job may come back for a sink without a
--   wake-up, once a mover finds its lease ran out), C, then C triples: id, scheduled due ms (the first due
--   it was scheduled for: stable across retries, releases and lease expiry), envelope ("" when
--   none is stored) }, in the ready set's order (due, then id).
-- Re-run safety: yes; a second run claims the next jobs (the first run's claims stay leased).

local shard_marker = KEYS[8]
-- @include shard_fence
local jobs_key, inflight_key, scheduled_key, ready_key, ready_ids_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local sink, batch, lease_ms, budget = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local claims_key = KEYS[7]
-- @include lease
-- @include clock
local now_us = clock_us(tonumber(ARGV[6]))
local deadline = math.floor(now_us / 1000) + lease_ms
-- Every member of this sink starts with "<sink>\n"; "\n" is byte 10, so "<sink>\11" is past them.
local function lease_head()
  local head = redis.call('ZRANGE', inflight_key, 0, 0, 'WITHSCORES')
  if #head == 0 then return '' end
  return head[2]
end
local members = redis.call('ZRANGEBYLEX', ready_key, '[' .. sink .. '\n', '(' .. sink .. '\11', 'LIMIT', 0, batch)
if #members == 0 then return { now_us, deadline, '', 0, lease_head(), 0 } end
local ids, dues = {}, {}
local prefix = #sink + 2
local n, used, more, largest = 0, 0, 0, 0
for i = 1, #members do
  local m = members[i]
  local cut = string.find(m, '\n', prefix, true)
  local id = string.sub(m, cut + 1)
  local size = redis.call('HSTRLEN', jobs_key, id)
  if n > 0 and used + size > budget then
    more = 1
    break
  end
  n, used = n + 1, used + size
  if size > largest then largest = size end
  dues[n] = string.sub(m, prefix, cut - 1)
  ids[n] = id
end
for i = #members, n + 1, -1 do members[i] = nil end
redis.call('ZREM', ready_key, unpack(members))
redis.call('HDEL', ready_ids_key, unpack(ids))
local due_now = {}
for i = 1, n do due_now[i] = string.format('%d', tonumber(dues[i])) end
local token = lease(ids, due_now, string.format('%d', deadline), KEYS[6])
local out = { now_us, deadline, token, more, lease_head(), n }
-- Large envelopes one at a time: a multi-value reply reaches a script by repeated appends.
local envelopes
if largest < 65536 then
  envelopes = redis.call('HMGET', jobs_key, unpack(ids))
else
  envelopes = {}
  for i = 1, n do envelopes[i] = redis.call('HGET', jobs_key, ids[i]) end
end
for i = 1, n do
  out[#out + 1] = ids[i]
  out[#out + 1] = due_now[i]
  out[#out + 1] = envelopes[i] or ''
end
return out
